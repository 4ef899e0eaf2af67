"""The benchmark subcommands, for `pagoda bench ...` (pagoda/cli.py) and `python -m pagoda.bench ...`."""

from __future__ import annotations

import argparse


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
