"""Online serving benchmark against a running server: fixed concurrency or Poisson arrivals, streamed.

Per request it records TTFT (first streamed token), inter-token gaps, end-to-end latency and the
token count (from usage); it prints percentiles and output tokens/s per load level, writes JSON,
and plots throughput and latency against load when matplotlib is present.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pagoda.bench.workload import Workload


@dataclass(slots=True)
class RequestRecord:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    gaps_s: list[float] = field(default_factory=list)  # between successive streamed chunks, per token
    error: str = ""


async def _one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int] | str,
               output_len: int, headers: dict[str, str]) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    record = RequestRecord(ok=False)
    last = start
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return record
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    if record.ttft_s == 0.0:
                        record.ttft_s = now - start
                    else:
                        record.gaps_s.append(now - last)
                    last = now
        record.e2e_s = time.perf_counter() - start
        record.ok = record.output_tokens > 0
    except (TimeoutError, aiohttp.ClientError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def run_level(url: str, model: str, prompts: list[Any], output_len: int, concurrency: int | None,
                    rate: float | None, headers: dict[str, str], seed: int) -> dict[str, Any]:
    """Send every prompt, at most `concurrency` at once, or arriving as a Poisson process at `rate`/s."""
    limit = asyncio.Semaphore(concurrency or len(prompts))
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def limited(prompt: Any) -> RequestRecord:
            async with limit:
                return await _one(session, url, model, prompt, output_len, headers)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))  # the arrival process itself, not synchronisation
        records = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return summarize(records, elapsed, concurrency, rate)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(records: list[RequestRecord], elapsed: float, concurrency: int | None,
              rate: float | None) -> dict[str, Any]:
    good = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in good)
    ttft = [r.ttft_s for r in good]
    itl = [gap for r in good for gap in r.gaps_s]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]
    e2e = [r.e2e_s for r in good]
    return {"concurrency": concurrency, "request_rate": rate, "num_requests": len(records),
            "num_failed": len(records) - len(good), "elapsed_s": elapsed, "requests_per_s": len(good) / elapsed,
            "output_tok_per_s": tokens / elapsed,
            **{f"ttft_p{q}_ms": 1e3 * _pct(ttft, q / 100) for q in (50, 90, 99)},
            **{f"itl_p{q}_ms": 1e3 * _pct(itl, q / 100) for q in (50, 90, 99)},
            **{f"tpot_p{q}_ms": 1e3 * _pct(tpot, q / 100) for q in (50, 99)},
            **{f"e2e_p{q}_s": _pct(e2e, q / 100) for q in (50, 99)},
            "errors": sorted({r.error for r in records if r.error})[:5]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the served model name")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated levels (ignored with --request-rate)")
    parser.add_argument("--request-rate", default=None, help="comma-separated Poisson arrival rates, requests/s")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=49152, help="random prompt ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON results (a PNG plot is written beside it)")


def main(args: argparse.Namespace) -> int:
    workload = Workload(args.num_prompts, args.input_len, args.output_len, 0.0, args.seed)
    prompts = workload.prompts(args.vocab_size)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    levels: list[tuple[int | None, float | None]]
    if args.request_rate:
        levels = [(None, float(r)) for r in args.request_rate.split(",")]
    else:
        levels = [(int(c), None) for c in args.concurrency.split(",")]
    results = []
    for concurrency, rate in levels:
        count = args.num_prompts if rate else max(args.num_prompts, concurrency or 1)
        result = asyncio.run(run_level(args.url, args.model, prompts[:count], args.output_len, concurrency, rate,
                                       headers, args.seed))
        results.append(result)
        _print_row(result)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "url": args.url, "model": args.model,
              "workload": asdict(workload), "levels": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        plot(report, Path(args.out).with_suffix(".png"))
    return 0 if all(r["num_failed"] == 0 for r in results) else 1


def _print_row(r: dict[str, Any]) -> None:
    load = f"c={r['concurrency']}" if r["concurrency"] else f"rate={r['request_rate']}/s"
    print(f"{load:<12} req/s {r['requests_per_s']:7.2f}  out tok/s {r['output_tok_per_s']:9.1f}  "
          f"TTFT p50/p99 {r['ttft_p50_ms']:8.1f}/{r['ttft_p99_ms']:8.1f} ms  "
          f"ITL p50/p99 {r['itl_p50_ms']:7.1f}/{r['itl_p99_ms']:7.1f} ms  failed {r['num_failed']}", flush=True)


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    levels = report["levels"]
    xs = [r["concurrency"] or r["request_rate"] for r in levels]
    label = "concurrency" if levels[0]["concurrency"] else "request rate (req/s)"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(xs, [r["output_tok_per_s"] for r in levels], marker="o")
    left.set(xlabel=label, ylabel="output tokens/s", title="throughput")
    for key, name in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("itl_p50_ms", "ITL p50"),
                      ("itl_p99_ms", "ITL p99")):
        right.plot(xs, [r[key] for r in levels], marker="o", label=name)
    right.set(xlabel=label, ylabel="ms", title="latency", yscale="log")
    right.legend()
    fig.suptitle(f"{report['model']} @ {report['url']} ({report['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
