"""The `pagoda` command: prepare-model, chat (offline demo), serve, bench."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pagoda.bench.commands import add_commands
from pagoda.shared.config import (
    add_engine_args,
    add_server_args,
    add_vllm_serve_args,
    apply_vllm_serve_args,
    check_log_level,
    engine_config_from_args,
    server_config_from_args,
)

log = logging.getLogger("pagoda.serve")


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
    from pagoda.services.api.tenants import read_keys_file
    from pagoda.shared.errors import ConfigError

    try:  # a bad flag or PAGODA_* value is the operator's error: said as the launcher says its own, no traceback
        notes = apply_vllm_serve_args(args)  # vLLM's flags: mapped onto pagoda's settings, or refused
        engine_config, server_config = engine_config_from_args(args), server_config_from_args(args)
        server_config.check_metrics_access()
        if server_config.api_keys_file:  # a missing or broken keys file: one line now, not an api's traceback later
            read_keys_file(server_config.api_keys_file)
    except ConfigError as exc:
        print(f"pagoda: error: {exc.message}", file=sys.stderr)
        return 2
    for note in notes:
        log.info("%s", note)
    return serve(engine_config, server_config)


def _cmd_keys(args: argparse.Namespace) -> int:
    """API keys and tenants in a keys file (--api-keys-file): add prints a new key once; only its hash is kept."""
    from pathlib import Path

    from pagoda.services.api import tenants
    from pagoda.shared.errors import ConfigError

    path = Path(args.file)
    try:
        if args.keys_command == "add":
            limits = {name: getattr(args, name) for name in tenants.TENANT_FIELDS if getattr(args, name) is not None}
            if "models" in limits:
                limits["models"] = [m.strip() for m in limits["models"].split(",") if m.strip()]
            key_id, key = tenants.add_key(path, args.tenant, limits)
            print(f"tenant {args.tenant}: key {key_id} added to {path}; the key (shown only now):", file=sys.stderr)
            print(key)
        elif args.keys_command == "revoke":
            if not tenants.revoke_key(path, args.key_id):
                print(f"no key {args.key_id} in {path}", file=sys.stderr)
                return 1
        else:
            data = tenants.load_document(path)
            for name, spec in sorted(data["tenants"].items()):
                ids = [tenants.entry_id(k) for k in data["keys"] if k["tenant"] == name]
                print(f"{name}: {spec} keys {ids}")
    except (ConfigError, ValueError, OSError) as exc:
        print(f"pagoda keys: error: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 2
    return 0


def _cmd_cluster_keys(args: argparse.Namespace) -> int:
    """A CURVE key pair for --cluster-key-dir (compose secret, Kubernetes Secret)."""
    from pagoda.shared.transport import ClusterKeys

    path = ClusterKeys.generate(args.dir)
    print(f"wrote {path} (the pair; keep it secret) and its public half beside it", file=sys.stderr)
    return 0


def _add_keys_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    keys = commands.add_parser("keys", help="API keys and tenant quotas for --api-keys-file")
    keys_commands = keys.add_subparsers(dest="keys_command", required=True)
    add = keys_commands.add_parser("add", help="make a key for a tenant (created or its limits updated); "
                                               "prints the key once")
    add.add_argument("file")
    add.add_argument("--tenant", required=True)
    add.add_argument("--models", default=None, help="comma-separated served model names ('*': any)")
    add.add_argument("--max-concurrent", dest="max_concurrent", type=int, default=None, help="0: no limit")
    add.add_argument("--requests-per-minute", dest="requests_per_minute", type=int, default=None)
    add.add_argument("--tokens-per-minute", dest="tokens_per_minute", type=int, default=None,
                     help="prompt + completion tokens, charged as they come (a beam search: its beams)")
    add.add_argument("--priority", type=int, default=None, help="tier: lower tiers are scheduled first")
    add.add_argument("--weight", type=float, default=None, help="share of the running slots within a tier")
    revoke = keys_commands.add_parser("revoke", help="remove a key by its id (or its sha256)")
    revoke.add_argument("file")
    revoke.add_argument("key_id")
    listing = keys_commands.add_parser("list", help="tenants, their limits and key ids")
    listing.add_argument("file")
    keys.set_defaults(func=_cmd_keys)


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
    add_vllm_serve_args(server)
    server.set_defaults(func=_cmd_serve)

    _add_keys_parser(commands)
    cluster = commands.add_parser("cluster-keys", help="make the CURVE key pair for --cluster-key-dir")
    cluster.add_argument("dir")
    cluster.set_defaults(func=_cmd_cluster_keys)

    bench = commands.add_parser("bench", help="benchmarks")
    add_commands(bench)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from pagoda.shared.errors import ConfigError

    try:  # a PAGODA_* value that is not its field's type fails while the flags' defaults are built
        parser = build_parser()
    except ConfigError as exc:
        print(f"pagoda: error: {exc.message}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        level = check_log_level(args.log_level)
    except ConfigError as exc:
        print(f"pagoda: error: {exc.message}", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
