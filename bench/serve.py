"""Online serving benchmark against a running server: fixed concurrency or Poisson arrivals, streamed.

Per request it records TTFT (first streamed token), inter-token gaps, end-to-end latency and the
token count (from usage); it prints percentiles and output tokens/s per load level, writes JSON,
and plots throughput and latency against load when matplotlib is present.

`--console` keeps one browser console's traffic open during each level (its live stats stream, and the request
inspector's poll every CONSOLE_POLL_S), as a page left open on the server would; the level then reports the
stream's ticks per second. bench/console_overhead.py compares that with a server started with --no-console.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pagoda.bench.report import stamp, unwritable, write_json
from pagoda.bench.workload import PRESETS, Workload, positive_int, preset

CONSOLE_POLL_S = 2.0  # the request inspector's poll (services/api/console/static/inspector.js)


@dataclass(slots=True)
class RequestRecord:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0  # usage's completion_tokens: all `choices` completions together
    gaps_s: list[float] = field(default_factory=list)  # between successive streamed chunks of one completion
    error: str = ""
    choices: int = 1  # completions of the request (its n)

    @property
    def tokens_per_choice(self) -> float:
        return self.output_tokens / self.choices


async def _one(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int] | str,
               output_len: int, headers: dict[str, str], sampling: dict[str, Any]) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, **sampling,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    record = RequestRecord(ok=False, choices=int(sampling.get("n", 1)))
    last: dict[int, float] = {}  # per choice index: when its latest chunk came (n > 1 streams interleave them)
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return record
            async for raw in response.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = _stream_event(line[6:])
                now = time.perf_counter()
                if isinstance(chunk, str):  # an error event, or no chunk at all: the request failed so
                    record.error = chunk
                    return record
                if isinstance(chunk.get("usage"), dict):
                    record.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                for choice in chunk.get("choices") or ():
                    if record.ttft_s == 0.0:
                        record.ttft_s = now - start
                    index = choice.get("index", 0)
                    if index in last:
                        record.gaps_s.append(now - last[index])
                    last[index] = now
        record.e2e_s = time.perf_counter() - start
        record.ok = record.output_tokens > 0
        if not record.ok:
            record.error = "the stream ended without a usage chunk counting its tokens"
    except (TimeoutError, aiohttp.ClientError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def _stream_event(text: str) -> dict[str, Any] | str:
    """One streamed event's JSON object, or what the request failed with instead: the message of an error event
    (a server that fails a stream after its 200 sends its error body as the last event), or a line that is no
    chunk at all."""
    try:
        event = json.loads(text)
    except ValueError:
        return f"not a JSON event: {text[:200]}"
    if not isinstance(event, dict):
        return f"not a JSON object: {text[:200]}"
    if "error" in event:
        error = event["error"]
        return f"error event: {error.get('message') if isinstance(error, dict) else error}"[:300]
    return event


@dataclass(slots=True)
class ConsoleWatch:
    """What one open console received during a level."""

    tick_times: list[float] = field(default_factory=list)  # time.perf_counter() of each live tick
    polls: int = 0
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        times = self.tick_times
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        return {"ticks": len(times), "ticks_per_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1
                else 0.0, "max_gap_s": max(gaps, default=float("nan")), "polls": self.polls,
                "errors": self.errors[:5]}


async def _watch_console(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                         watch: ConsoleWatch) -> None:
    """The traffic of one console page: the live stream read to the end, the inspector polled, until cancelled."""

    async def stream() -> None:
        async with session.get(url + "/console/api/stream", headers=headers) as response:
            if response.status != 200:
                watch.errors.append(f"stream: HTTP {response.status}")
                return
            async for raw in response.content:
                if raw.startswith(b"event: tick"):
                    watch.tick_times.append(time.perf_counter())

    async def poll() -> None:
        while True:
            async with session.get(url + "/console/api/requests", headers=headers) as response:
                await response.read()
                watch.polls += 1
                if response.status != 200:
                    watch.errors.append(f"requests: HTTP {response.status}")
            await asyncio.sleep(CONSOLE_POLL_S)  # the page's poll interval, not a wait for something

    try:
        await asyncio.gather(stream(), poll())
    except aiohttp.ClientError as exc:
        watch.errors.append(f"{type(exc).__name__}: {exc}")


async def run_level(url: str, model: str, prompts: list[Any], output_len: int, concurrency: int | None,
                    rate: float | None, headers: dict[str, str], seed: int,
                    sampling: dict[str, Any] | list[dict[str, Any]] | None = None,
                    console: bool = False) -> dict[str, Any]:
    """Send every prompt, at most `concurrency` at once, or arriving as a Poisson process at `rate`/s; with
    `console`, one console page's traffic runs alongside. sampling: the body fields of every request, or a list
    with one entry per prompt."""
    per_prompt = sampling if isinstance(sampling, list) else [sampling or {"temperature": 0.0}] * len(prompts)
    limit = asyncio.Semaphore(concurrency or len(prompts))
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        watch = ConsoleWatch()
        watcher = asyncio.create_task(_watch_console(session, url, headers, watch)) if console else None

        async def limited(prompt: Any, fields: dict[str, Any]) -> RequestRecord:
            async with limit:
                return await _one(session, url, model, prompt, output_len, headers, fields)

        start = time.perf_counter()
        tasks = []
        for i, (prompt, fields) in enumerate(zip(prompts, per_prompt, strict=True)):
            if rate and i:  # the gap before each arrival after the first: none after the last, inside the window
                await asyncio.sleep(rng.expovariate(rate))  # the arrival process itself, not synchronisation
            tasks.append(asyncio.create_task(limited(prompt, fields)))
        records = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
    result = summarize(records, elapsed, concurrency, rate)
    if console:
        result["console"] = watch.summary()
    return result


def _pct(values: list[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) by linear interpolation between the two nearest ranks, as numpy's percentile
    (and so vLLM's benchmark_serving) computes it: the median of [10, 20] is 15, their p99 19.9."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def summarize(records: list[RequestRecord], elapsed: float, concurrency: int | None,
              rate: float | None) -> dict[str, Any]:
    good = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in good)
    ttft = [r.ttft_s for r in good]
    itl = [gap for r in good for gap in r.gaps_s]
    tpot = [(r.e2e_s - r.ttft_s) / (r.tokens_per_choice - 1) for r in good if r.tokens_per_choice > 1]
    e2e = [r.e2e_s for r in good]
    return {"concurrency": concurrency, "request_rate": rate, "num_requests": len(records),
            "num_failed": len(records) - len(good), "elapsed_s": elapsed, "requests_per_s": len(good) / elapsed,
            "output_tok_per_s": tokens / elapsed,
            **{f"ttft_p{q}_ms": 1e3 * _pct(ttft, q / 100) for q in (50, 90, 99)},
            **{f"itl_p{q}_ms": 1e3 * _pct(itl, q / 100) for q in (50, 90, 99)},
            **{f"tpot_p{q}_ms": 1e3 * _pct(tpot, q / 100) for q in (50, 99)},
            **{f"e2e_p{q}_s": _pct(e2e, q / 100) for q in (50, 99)},
            "errors": sorted({r.error for r in records if r.error})[:5]}


def positive_rate(text: str) -> float:
    """An argparse type: a finite number > 0 (requests/s, milliseconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0")
    return value


def comma_list(item: Any) -> Any:
    """An argparse type: comma-separated items of `item` ('' for none)."""
    def parse(text: str) -> list[Any]:
        return [item(part.strip()) for part in text.split(",") if part.strip()]
    parse.__name__ = f"list of {item.__name__}"
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the served model name")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=comma_list(positive_int), default=[1, 8, 32],
                        help="comma-separated levels ('' for none)")
    parser.add_argument("--request-rate", type=comma_list(positive_rate), default=[],
                        help="comma-separated Poisson arrival rates, requests/s (run after the concurrency levels)")
    parser.add_argument("--workload", default=None, choices=tuple(PRESETS),
                        help="prompt shape and sampling of a named workload; size flags override its numbers")
    parser.add_argument("--num-prompts", type=positive_int, default=None, help="per load level (default 64)")
    parser.add_argument("--input-len", type=positive_int, default=None, help="default 128")
    parser.add_argument("--output-len", type=positive_int, default=None, help="default 64")
    parser.add_argument("--rounds", type=positive_int, default=4,
                        help="a concurrency level c sends max(c, min(num_prompts, rounds * c)) prompts")
    parser.add_argument("--slo-ttft-ms", type=positive_rate, default=1000.0,
                        help="TTFT p99 bound for the best-rate line")
    parser.add_argument("--slo-itl-ms", type=positive_rate, default=50.0, help="ITL p99 bound for the best-rate line")
    parser.add_argument("--vocab-size", type=positive_int, default=49152,
                        help="random prompt ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON results (a PNG plot is written beside it)")
    parser.add_argument("--console", action="store_true",
                        help="keep one console page's traffic open during each level (its stats stream and polls)")


def _workload(args: argparse.Namespace) -> Workload:
    sizes = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len}
    if args.workload:
        return preset(args.workload, seed=args.seed, **sizes)
    defaults = {"num_prompts": 64, "input_len": 128, "output_len": 64}
    return Workload(seed=args.seed, **{k: v if v is not None else defaults[k] for k, v in sizes.items()})


def main(args: argparse.Namespace) -> int:
    if not args.concurrency and not args.request_rate:
        print("--concurrency / --request-rate: no load level to run (both are empty)", file=sys.stderr)
        return 2
    if args.out and (why := unwritable(args.out)):
        print(f"--out {args.out}: cannot write the report there ({why})", file=sys.stderr)
        return 2
    workload = _workload(args)
    if workload.sampling == "beam":
        print("beam search is not streamed: run the beam4 workload with bench/throughput.py", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    levels: list[tuple[int | None, float | None]] = [(c, None) for c in args.concurrency]
    levels += [(None, r) for r in args.request_rate]
    results = []
    offset = 0
    for concurrency, rate in levels:
        # a concurrency level sends at most `rounds` prompts per slot: batch-1 levels stay short
        count = workload.num_prompts if rate else max(concurrency or 1, min(workload.num_prompts,
                                                                              args.rounds * (concurrency or 1)))
        # fresh prompts per level: the prefix cache would otherwise skip the prefill of prompts sent before
        prompts = Workload(**{**workload.to_dict(), "num_prompts": count}).prompts(args.vocab_size, offset)
        offset += count
        result = asyncio.run(run_level(args.url, args.model, prompts, workload.output_len, concurrency, rate,
                                       headers, args.seed,
                                       [workload.sampling_kwargs(offset - count + i) for i in range(count)],
                                       args.console))
        results.append(result)
        _print_row(result)
    best = best_rate(results, args.slo_ttft_ms, args.slo_itl_ms)
    if any(r["request_rate"] for r in results):
        print(f"highest rate with TTFT p99 <= {args.slo_ttft_ms:g} ms and ITL p99 <= {args.slo_itl_ms:g} ms: "
              + (f"{best:g} req/s" if best else "none of those tried"), flush=True)
    report = {"date": stamp(), "url": args.url, "model": args.model,
              "workload_name": args.workload or "custom", "workload": asdict(workload), "levels": results,
              "slo": {"ttft_p99_ms": args.slo_ttft_ms, "itl_p99_ms": args.slo_itl_ms, "best_rate": best}}
    if args.out:
        write_json(args.out, report)
        for kind in ("concurrency", "request_rate"):
            levels_of_kind = [r for r in results if r[kind]]
            if levels_of_kind:
                plot({**report, "levels": levels_of_kind}, Path(args.out).with_suffix(f".{kind}.png"))
    return 0 if all(r["num_failed"] == 0 for r in results) else 1


def best_rate(levels: list[dict[str, Any]], ttft_ms: float, itl_ms: float) -> float | None:
    """The highest Poisson rate tried whose TTFT p99 and ITL p99 stay within the bounds, with no failures."""
    ok = [r["request_rate"] for r in levels if r["request_rate"] and r["num_failed"] == 0
          and r["ttft_p99_ms"] <= ttft_ms and (r["itl_p99_ms"] <= itl_ms or math.isnan(r["itl_p99_ms"]))]
    return max(ok) if ok else None


def _print_row(r: dict[str, Any]) -> None:
    load = f"c={r['concurrency']}" if r["concurrency"] else f"rate={r['request_rate']}/s"
    print(f"{load:<12} req/s {r['requests_per_s']:7.2f}  out tok/s {r['output_tok_per_s']:9.1f}  "
          f"TTFT p50/p99 {r['ttft_p50_ms']:8.1f}/{r['ttft_p99_ms']:8.1f} ms  "
          f"ITL p50/p99 {r['itl_p50_ms']:7.1f}/{r['itl_p99_ms']:7.1f} ms  failed {r['num_failed']}"
          + (f"  console {r['console']['ticks_per_s']:.2f} ticks/s, max gap {r['console']['max_gap_s']:.2f} s"
             if "console" in r else ""), flush=True)
    if r["num_failed"] and r["errors"]:  # the reason, which the JSON alone (--out) carried
        print(f"{'':<12} first error: {r['errors'][0]}", flush=True)


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
