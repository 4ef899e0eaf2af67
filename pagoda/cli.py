"""The `pagoda` command: prepare-model, chat (offline demo), serve, bench."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pagoda.bench.commands import add_commands
from pagoda.shared.config import add_engine_args, add_server_args, engine_config_from_args, server_config_from_args


def _cmd_prepare(args: argparse.Namespace) -> int:
    from pagoda import prepare

    argv = [args.name] + (["--models-dir", args.models_dir] if args.models_dir else [])
    return prepare.main(argv)


def _cmd_chat(args: argparse.Namespace) -> int:
    """Offline demo: one chat reply from the model, printed as it is generated."""
    from pagoda.engine import LLMEngine
    from pagoda.shared.messages import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    if engine.tokenizer is None:
        print("error: this model has no tokenizer, so no chat", file=sys.stderr)
        return 2
    messages = [{"role": "user", "content": args.message}]
    prompt = engine.tokenizer.apply_chat_template(messages)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    print(f"user: {args.message}\nassistant: ", end="", flush=True)
    engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            print(delta.text, end="", flush=True)
    print()
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from pagoda.launcher import serve

    return serve(engine_config_from_args(args), server_config_from_args(args))


def _cmd_bench(args: argparse.Namespace) -> int:
    return args.bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="pagoda: an LLM inference server")
    parser.add_argument("--log-level", default="WARNING")
    commands = parser.add_subparsers(dest="command", required=True)

    prep = commands.add_parser("prepare-model", help="download and convert a known model into models/")
    prep.add_argument("name", nargs="?", default="smollm2")
    prep.add_argument("--models-dir", default=None)
    prep.set_defaults(func=_cmd_prepare)

    chat = commands.add_parser("chat", help="offline demo: stream one chat reply")
    add_engine_args(chat)
    chat.add_argument("--message", default="Explain in three sentences what a paged KV cache is.")
    chat.add_argument("--max-tokens", type=int, default=200)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.set_defaults(func=_cmd_chat)

    server = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_args(server)
    add_server_args(server)
    server.set_defaults(func=_cmd_serve)

    bench = commands.add_parser("bench", help="benchmarks")
    add_commands(bench)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
