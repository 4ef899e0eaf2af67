"""Tenant fairness under a flood: tenant A keeps `--flood` streams in flight while tenant B's `--b-streams`
streams send their requests one after another; B's time to first token with A flooding against B alone (one
server, keys file with two tenants of weight 1). Prints a table, writes JSON under $OUT.

    python -m pagoda.bench.tenants --model qwen3-0.6b --load-format dummy --flood 256 --b-streams 4   # one H200

The target (issue 23): B's TTFT p99 under the flood within 2x of B's TTFT p99 alone.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from pagoda.bench.commands import run_script
from pagoda.bench.data_parallel import Server, serving
from pagoda.bench.report import stamp, write_report
from pagoda.bench.serve import RequestRecord, _one
from pagoda.bench.workload import Workload

MAX_RATIO = 2.0


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _b_phase(session: aiohttp.ClientSession, url: str, key: str, prompts: list[list[int]],
                   args: argparse.Namespace) -> list[RequestRecord]:
    async def stream(i: int) -> list[RequestRecord]:
        mine = prompts[i::args.b_streams]
        return [await _one(session, url, "m", p, args.b_output_len, {"Authorization": f"Bearer {key}"},
                           {"temperature": 0.0}) for p in mine]

    return [r for records in await asyncio.gather(*(stream(i) for i in range(args.b_streams))) for r in records]


async def _flood_worker(session: aiohttp.ClientSession, url: str, key: str, prompts: list[list[int]],
                        args: argparse.Namespace, done: list[RequestRecord]) -> None:
    for prompt in prompts:  # one stream of A's: a request, then the next
        done.append(await _one(session, url, "m", prompt, args.a_output_len, {"Authorization": f"Bearer {key}"},
                               {"temperature": 0.0}))


async def _a_waiting(server: Server) -> float:
    metrics = await asyncio.to_thread(server.get, "/metrics")
    values = [float(line.split()[-1]) for line in metrics[1].splitlines()
              if line.startswith(('pagoda_tenant_sequences_waiting{tenant="a"}',
                                  'pagoda_tenant_sequences_running{tenant="a"}'))]
    return sum(values)


async def measure(server: Server, keys: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    b_count = args.b_streams * args.b_requests
    b_alone = Workload(num_prompts=b_count, input_len=args.input_len, seed=args.seed).prompts(args.vocab_size)
    b_flood = Workload(num_prompts=b_count, input_len=args.input_len, seed=args.seed).prompts(args.vocab_size, b_count)
    a_prompts = Workload(num_prompts=args.flood * args.a_rounds, input_len=args.input_len,
                         seed=args.seed + 1).prompts(args.vocab_size)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await _b_phase(session, server.url, keys["b"], b_alone[:args.b_streams], args)  # warm-up
        alone = await _b_phase(session, server.url, keys["b"], b_alone, args)
        a_done: list[RequestRecord] = []
        flood = [asyncio.create_task(_flood_worker(session, server.url, keys["a"], a_prompts[i::args.flood], args,
                                                   a_done)) for i in range(args.flood)]
        started = time.perf_counter()
        while await _a_waiting(server) < 0.9 * args.flood:
            await asyncio.sleep(0.2)  # polling the metrics until A's flood is in
            if time.perf_counter() - started > 600:
                raise TimeoutError("tenant A's flood never reached the scheduler")
        flood_started, a_before = time.perf_counter(), len(a_done)
        flooded = await _b_phase(session, server.url, keys["b"], b_flood, args)
        flood_s = time.perf_counter() - flood_started
        a_tokens = sum(r.output_tokens for r in a_done[a_before:])
        still = await _a_waiting(server)
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    failed = [r.error for r in alone + flooded if not r.ok]
    assert not failed, failed[:3]
    ttft_alone, ttft_flood = [r.ttft_s for r in alone], [r.ttft_s for r in flooded]
    return {"b_alone_ttft_p50_ms": 1e3 * _p(ttft_alone, 0.5), "b_alone_ttft_p99_ms": 1e3 * _p(ttft_alone, 0.99),
            "b_flood_ttft_p50_ms": 1e3 * _p(ttft_flood, 0.5), "b_flood_ttft_p99_ms": 1e3 * _p(ttft_flood, 0.99),
            "ratio_p99": _p(ttft_flood, 0.99) / _p(ttft_alone, 0.99),
            "b_alone_itl_mean_ms": 1e3 * statistics.mean(g for r in alone for g in r.gaps_s or [0.0]),
            "b_flood_itl_mean_ms": 1e3 * statistics.mean(g for r in flooded for g in r.gaps_s or [0.0]),
            "a_out_tok_per_s_during": a_tokens / flood_s, "a_in_flight_at_end": still,
            "b_alone_ttft_ms": [round(1e3 * t, 1) for t in ttft_alone],
            "b_flood_ttft_ms": [round(1e3 * t, 1) for t in ttft_flood]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--flood", type=int, default=256, help="tenant A's streams in flight")
    parser.add_argument("--a-rounds", type=int, default=8, help="requests each of A's streams has to send")
    parser.add_argument("--a-output-len", type=int, default=256)
    parser.add_argument("--b-streams", type=int, default=4)
    parser.add_argument("--b-requests", type=int, default=8, help="per B stream, one after another")
    parser.add_argument("--b-output-len", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="", help="more `pagoda serve` flags, one string")


def main(args: argparse.Namespace) -> int:
    from pagoda.services.api.tenants import add_key

    folder = Path(tempfile.mkdtemp(prefix="pagoda-tenants-"))
    keys = {name: add_key(folder / "keys.json", name, {})[1] for name in ("a", "b")}
    # --metrics-access open: the benchmark polls tenant A's queue on /metrics (beside a keys file it takes the
    # operator's key by default, and this server has none)
    with serving(args.model, "--load-format", args.load_format, "--api-keys-file", str(folder / "keys.json"),
                 "--metrics-access", "open", *args.server_args.split()) as server:
        figures = asyncio.run(measure(server, keys, args))
    for name in ("b_alone_ttft_p50_ms", "b_alone_ttft_p99_ms", "b_flood_ttft_p50_ms", "b_flood_ttft_p99_ms",
                 "b_alone_itl_mean_ms", "b_flood_itl_mean_ms", "a_out_tok_per_s_during", "a_in_flight_at_end"):
        print(f"{name:24} {figures[name]:10.1f}")
    ratio = figures["ratio_p99"]
    print(f"B's TTFT p99 flooded / alone: {ratio:.2f}x (target <= {MAX_RATIO:g}x) -> "
          f"{'PASS' if ratio <= MAX_RATIO else 'MISS'}")
    report = {"date": stamp(), "model": args.model, "flood": args.flood,
              "b_streams": args.b_streams, "server_args": args.server_args, **figures}
    write_report(report, None, "tenants.json")
    return 0


if __name__ == "__main__":
    sys.exit(run_script(__doc__, add_arguments, main))
