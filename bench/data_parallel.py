"""Prefix-cache hit rate and throughput of data-parallel replicas: `pagoda serve --data-parallel-size D`.

The workload: S system prompts (each ~10 KV blocks) x T user turns, sent turn by turn (every system prompt's
turn t before any turn t+1) with a few requests in flight. Each replica gets a KV cache of --blocks-per-replica
blocks (the single replica gets D times as many: the same memory in all), a little more than half the
system prompts fit in one replica's cache: routing by prefix keeps each system prompt's blocks on one replica;
round-robin or random routing makes every replica cycle through all of them, evicting what it will need next.

    python -m pagoda.bench.data_parallel --model models/smollm2-135m-instruct       # CPU hit rates

`--streams` measures served throughput and TTFT instead: D=1 vs D=2 (--sizes) of one server with
`--concurrency` streamed requests in flight, shared system prompts x user turns, real text through
`--tokenizer`; every size gets the same KV memory in all (--kv-cache-memory-total, split over the replicas,
so D replicas on one GPU each take 1/D of it). One table at the end. On one H200:

    python -m pagoda.bench.data_parallel --streams --model qwen3-0.6b --load-format dummy \\
        --tokenizer models/smollm2-135m-instruct --sizes 1,2 --concurrency 256 --num-system 32 \\
        --num-turns 32 --system-words 400 --max-tokens 128 --kv-cache-memory-total 80GiB
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

from pagoda.launcher import free_ports

WORDS = ("river stone light cloud answer garden number paper window yellow market engine quiet summer table "
         "letter orange simple travel winter silver forest coffee bridge pocket animal doctor planet music "
         "careful ocean little friend button circle moment thunder").split()


def system_prompt(index: int, num_words: int = 120) -> str:
    """A distinct system prompt (its first words differ, so its first KV blocks do)."""
    rng = random.Random(index)
    return f"System {index}: you are assistant number {index}. " + " ".join(rng.choice(WORDS)
                                                                          for _ in range(num_words)) + "\n"


def workload(num_system: int, num_turns: int, system_words: int = 120) -> list[str]:
    """Turn by turn (turn t of every system prompt before turn t+1 of any), the system prompts shuffled within
    a turn (a fixed order would let round-robin partition them by parity)."""
    prompts = []
    for t in range(num_turns):
        order = list(range(num_system))
        random.Random(t).shuffle(order)
        prompts += [f"{system_prompt(s, system_words)}User turn {t}: tell me about "
                    f"{WORDS[(s * 7 + t) % len(WORDS)]}.\nAnswer:" for s in order]
    return prompts


@dataclass
class Server:
    process: subprocess.Popen[str]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metric_sums(self) -> dict[str, float]:
        """Each series summed over its labels (replicas)."""
        sums: dict[str, float] = {}
        for line in self.get("/metrics")[1].splitlines():
            match = re.fullmatch(r"([a-z_]+)(?:\{[^}]*\})? ([-0-9.e+]+)", line)
            if match:
                sums[match.group(1)] = sums.get(match.group(1), 0.0) + float(match.group(2))
        return sums

    def metric_by_replica(self, name: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in self.get("/metrics")[1].splitlines():
            match = re.fullmatch(rf'{name}\{{replica="(\d+)"\}} ([-0-9.e+]+)', line)
            if match:
                out[match.group(1)] = float(match.group(2))
        return out

    def complete(self, prompt: str, max_tokens: int, timeout: float = 120.0) -> tuple[int, dict]:
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
        request = urllib.request.Request(self.url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")


@contextlib.contextmanager
def serving(model: str, *extra: str, startup_timeout: float = 300.0,
            env: dict[str, str] | None = None) -> Iterator[Server]:
    """`pagoda serve` in a child process until the block ends (SIGTERM, then wait); `env`: its environment."""
    port = free_ports(1)[0]
    process = subprocess.Popen(
        [sys.executable, "-m", "pagoda.cli", "serve", "--model", model, "--port", str(port),
         "--served-model-name", "m", *extra], stdout=subprocess.PIPE, text=True, env=env)
    server = Server(process, port)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # one line once every process is healthy
        if "serving" not in line:
            raise RuntimeError(f"the server did not start: {line!r}")
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_for_replicas(server: Server, timeout: float = 120.0) -> None:
    """Until /health is 200 and names no replica as down (every replica serving), and every replica has a
    tokenizer registered (so the tokenizers can route to it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = server.get("/health")
        if status == 200 and "replicas_down" not in body:
            metrics = server.get("/metrics")[1]
            replicas = set(re.findall(r'^pagoda_kv_blocks_total\{replica="(\d+)"\}', metrics, re.M))
            served = set(re.findall(r'^pagoda_tokenizer_requests_total\{[^}]*\breplica="(\d+)"', metrics, re.M))
            if replicas <= served:
                return
        time.sleep(0.1)  # polling an HTTP endpoint: nothing to wait on instead
    raise TimeoutError(f"replicas not all up after {timeout} s: {server.get('/health')}")


@dataclass
class Figures:
    hit_rate: float  # prefix-cache hit tokens / query tokens over the workload
    seconds: float
    num_requests: int
    failures: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds


def run_workload(server: Server, prompts: list[str], concurrency: int, max_tokens: int) -> Figures:
    before = server.metric_sums()
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        statuses = list(pool.map(lambda p: server.complete(p, max_tokens)[0], prompts))
    seconds = time.monotonic() - started
    after = server.metric_sums()  # scheduler stats are at most 0.25 s old: wait for them to count the last
    deadline = time.monotonic() + 5.0
    while after.get("pagoda_prompt_tokens_total", 0) == before.get("pagoda_prompt_tokens_total", 0) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
        after = server.metric_sums()
    time.sleep(0.6)  # two more stats periods: the last requests' prefill counted
    after = server.metric_sums()
    hits = after["pagoda_prefix_cache_hit_tokens_total"] - before.get("pagoda_prefix_cache_hit_tokens_total", 0)
    queries = after["pagoda_prefix_cache_query_tokens_total"] - before.get(
        "pagoda_prefix_cache_query_tokens_total", 0)
    return Figures(hits / max(queries, 1.0), seconds, len(prompts), sum(s != 200 for s in statuses))


def parse_bytes_text(text: str) -> int:
    from pagoda.shared.config import parse_bytes

    return parse_bytes(text)


def run_streams(args: argparse.Namespace) -> int:
    """D=1 vs D=2 (...) served with streaming at a fixed concurrency: throughput, TTFT, ITL, prefix hits."""
    import asyncio

    from pagoda.bench.serve import run_level

    prompts = workload(args.num_system, args.num_turns, args.system_words)
    warm = [f"Warm-up {i}: " + system_prompt(10_000 + i, 40) for i in range(args.warmup)]
    total = parse_bytes_text(args.kv_cache_memory_total) if args.kv_cache_memory_total else 0
    print(f"{len(prompts)} streamed requests ({args.num_system} system prompts of {args.system_words} words x "
          f"{args.num_turns} turns), concurrency {args.concurrency}, max_tokens {args.max_tokens}, ignore_eos",
          flush=True)
    rows = []
    for size in [int(d) for d in args.sizes.split(",")]:
        extra = ["--data-parallel-size", str(size), "--routing", args.routing, *args.serve_args.split()]
        if args.load_format:
            extra += ["--load-format", args.load_format]
        if args.tokenizer:
            extra += ["--tokenizer", args.tokenizer]
        if total:
            extra += ["--kv-cache-memory", str(total // size)]  # bytes; replicas on one GPU split it
        with serving(args.model, *extra, startup_timeout=args.startup_timeout) as server:
            wait_for_replicas(server, args.startup_timeout)
            if warm:  # Triton/JIT and allocator warm-up outside the timed run, on prompts the run never sends
                asyncio.run(run_level(server.url, "m", warm, 8, min(len(warm), 16), None, {}, 0))
            before = server.metric_sums()
            result = asyncio.run(run_level(server.url, "m", prompts, args.max_tokens, args.concurrency, None, {}, 0))
            hit_rate = _hit_rate(server, before)
        rows.append((size, result, hit_rate))
        print(f"D={size}: {result['output_tok_per_s']:.0f} out tok/s, TTFT p99 {result['ttft_p99_ms']:.0f} ms, "
              f"failed {result['num_failed']} {result['errors']}", flush=True)
    print(streams_table(rows), flush=True)
    return 0 if all(r["num_failed"] == 0 for _, r, _ in rows) else 1


def _hit_rate(server: Server, before: dict[str, float]) -> float:
    time.sleep(0.6)  # two stats periods (0.25 s): the last requests' prefill is counted
    after = server.metric_sums()
    hits = after.get("pagoda_prefix_cache_hit_tokens_total", 0) - before.get("pagoda_prefix_cache_hit_tokens_total", 0)
    queries = after.get("pagoda_prefix_cache_query_tokens_total", 0) - before.get(
        "pagoda_prefix_cache_query_tokens_total", 0)
    return hits / max(queries, 1.0)


def streams_table(rows: list[tuple[int, dict, float]]) -> str:
    lines = ["| D | requests | failed | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
             "| prefix hit rate |", "|---|---|---|---|---|---|---|---|---|---|"]
    for size, r, hit_rate in rows:
        lines.append(f"| {size} | {r['num_requests']} | {r['num_failed']} | {r['requests_per_s']:.2f} | "
                     f"{r['output_tok_per_s']:.0f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                     f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {hit_rate:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--num-system", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=32)
    parser.add_argument("--system-words", type=int, default=120, help="words per system prompt")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--blocks-per-replica", type=int, default=72, help="0: the default KV cache size")
    parser.add_argument("--configs", default="1:prefix,2:prefix,2:round_robin,2:random")
    streams = parser.add_argument_group("--streams: throughput and TTFT of D replicas (streamed requests)")
    streams.add_argument("--streams", action="store_true")
    streams.add_argument("--sizes", default="1,2", help="data-parallel sizes to compare")
    streams.add_argument("--routing", default="prefix")
    streams.add_argument("--load-format", default=None, help="dummy: --model is a shape name (qwen3-0.6b)")
    streams.add_argument("--tokenizer", default=None, help="a tokenizer folder, so the streams carry text")
    streams.add_argument("--kv-cache-memory-total", default=None,
                         help="KV cache bytes per server (e.g. 80GiB), split evenly over its replicas")
    streams.add_argument("--warmup", type=int, default=32, help="untimed requests before the run")
    streams.add_argument("--serve-args", default="", help="more `pagoda serve` flags, space-separated")
    streams.add_argument("--startup-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.streams:
        return run_streams(args)
    prompts = workload(args.num_system, args.num_turns, args.system_words)
    print(f"{len(prompts)} requests ({args.num_system} system prompts x {args.num_turns} turns), "
          f"concurrency {args.concurrency}, max_tokens {args.max_tokens}", flush=True)
    for config in args.configs.split(","):
        size, routing = config.split(":")
        extra = ["--data-parallel-size", size, "--routing", routing, "--max-model-len", "1024"]
        if args.blocks_per_replica:
            extra += ["--num-kv-blocks", str(args.blocks_per_replica * (2 if size == "1" else 1))]
        with serving(args.model, *extra) as server:
            wait_for_replicas(server)
            figures = run_workload(server, prompts, args.concurrency, args.max_tokens)
        print(f"D={size} {routing:12s} hit rate {figures.hit_rate:.3f}  {figures.requests_per_s:.2f} req/s "
              f"({figures.seconds:.1f} s)  failures {figures.failures}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
