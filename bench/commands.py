"""The benchmark subcommands, for `pagoda bench ...` (pagoda/cli.py) and `python -m pagoda.bench ...`, and the
entry point of a benchmark module written like one."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_commands(parser: argparse.ArgumentParser) -> None:
    """One subcommand per benchmark; each sets `bench_main`, the function that runs it with the parsed args."""
    from pagoda.bench import ipc, scheduler_step, serve, throughput

    commands = parser.add_subparsers(dest="bench_command", required=True)
    for name, module, help_text in (("throughput", throughput, "offline throughput vs the HF peers"),
                                    ("serve", serve, "online serving against a running server"),
                                    ("scheduler", scheduler_step, "pure-Python cost of a scheduler step"),
                                    ("ipc", ipc, "scheduler<->worker round trip over ZeroMQ")):
        sub = commands.add_parser(name, help=help_text)
        module.add_arguments(sub)
        sub.set_defaults(bench_main=module.main)


def run_script(doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
               main: Callable[[argparse.Namespace], int]) -> int:
    """`python -m pagoda.bench.<module>` for a module written as a subcommand (add_arguments + main(args))."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return main(parser.parse_args())
