"""What CURVE costs served throughput: `pagoda serve` with every ZeroMQ endpoint on tcp://127.0.0.1, once with
the cluster key pair (the launcher makes one: CURVE on every socket) and once plain (`--cluster-key-dir none`),
the same streamed load on each (fresh server per run, runs interleaved). Prints a table, writes JSON under $OUT.

    python -m pagoda.bench.curve --model qwen3-0.6b --load-format dummy --streams 256      # one H200

The target (issue 23): CURVE costs < 3% of served output tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagoda.bench.data_parallel import serving
from pagoda.bench.serve import run_level
from pagoda.bench.workload import Workload

MAX_COST = 0.03


def _ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _tcp_flags(runtime_dir: str) -> list[str]:
    scheduler, plan, result, stats, api = (f"tcp://127.0.0.1:{p}" for p in _ports(5))
    return ["--runtime-dir", runtime_dir, "--scheduler-endpoint", scheduler, "--plan-endpoint", plan,
            "--result-endpoint", result, "--stats-endpoint", stats, "--api-endpoints", api]


def one_run(args: argparse.Namespace, curve: bool, offset: int) -> dict[str, Any]:
    """A fresh server, a warm-up level, then the measured level (prompts no earlier level sent)."""
    runtime_dir = tempfile.mkdtemp(prefix="pagoda-curve-")
    flags = [*_tcp_flags(runtime_dir), "--load-format", args.load_format, *args.server_args.split()]
    if not curve:
        flags += ["--cluster-key-dir", "none"]
    workload = Workload(num_prompts=args.streams * args.rounds, input_len=args.input_len, output_len=args.output_len,
                        seed=args.seed)
    with serving(args.model, *flags) as server:
        keyed = os.path.exists(os.path.join(runtime_dir, "keys", "cluster.key_secret"))
        assert keyed == curve, f"the server ran {'with' if keyed else 'without'} CURVE, not as asked"
        warm = Workload(num_prompts=args.streams, input_len=args.input_len, output_len=16, seed=args.seed + 1)
        asyncio.run(run_level(server.url, "m", warm.prompts(args.vocab_size), 16, args.streams, None, {}, args.seed))
        prompts = workload.prompts(args.vocab_size, offset)
        level = asyncio.run(run_level(server.url, "m", prompts, args.output_len, args.streams, None, {}, args.seed))
    assert level["num_failed"] == 0, level["errors"]
    return {"curve": curve, **{k: level[k] for k in ("output_tok_per_s", "requests_per_s", "ttft_p50_ms",
                                                       "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "elapsed_s")}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--streams", type=int, default=256, help="requests in flight")
    parser.add_argument("--rounds", type=int, default=2, help="each run sends streams x rounds requests")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved")
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="", help="more `pagoda serve` flags, one string")


def main(args: argparse.Namespace) -> int:
    runs = []
    for repeat in range(args.repeats):
        for curve in (False, True) if repeat % 2 == 0 else (True, False):
            run = one_run(args, curve, offset=len(runs) * args.streams * args.rounds)
            runs.append(run)
            print(f"{'curve' if curve else 'plain':5}  {run['output_tok_per_s']:10.0f} out tok/s  "
                  f"TTFT p50 {run['ttft_p50_ms']:8.1f} ms  ITL p50 {run['itl_p50_ms']:6.2f} ms", flush=True)
    plain = statistics.median(r["output_tok_per_s"] for r in runs if not r["curve"])
    curve = statistics.median(r["output_tok_per_s"] for r in runs if r["curve"])
    cost = 1.0 - curve / plain
    print(f"\nmedian out tok/s: plain {plain:.0f}, CURVE {curve:.0f}: CURVE costs {100 * cost:.2f}% "
          f"(target < {100 * MAX_COST:g}%) -> {'PASS' if cost < MAX_COST else 'MISS'}")
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "model": args.model, "streams": args.streams,
              "input_len": args.input_len, "output_len": args.output_len, "runs": runs, "plain_tok_per_s": plain,
              "curve_tok_per_s": curve, "cost": cost, "target": MAX_COST}
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "curve.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
