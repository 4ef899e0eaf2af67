"""CPU time per streamed token of each pagoda process (api, tokenizer, scheduler, worker, grammar process) under N
concurrent streaming clients, on any machine (a tiny model on the CPU by default).

    python -m pagoda.bench.stream_cpu --concurrency 64 --num-prompts 256 --output-len 128 --rounds 3

The server is `pagoda serve` (OMP_NUM_THREADS=1, as the tests' harness); by default the model is a 2-layer Llama of
hidden size 64 over SmolLM2's vocabulary (tests/harness.py's tiny_llama_over_smollm2_vocab) with SmolLM2's
tokenizer, so the worker is cheap and the api and tokenizer carry a real share of the load. Each round sends
`num-prompts` token-id prompts (openai sampling: T 0.7, top_p 0.95, or --greedy; EOS ignored; stream with usage) to
/v1/completions, at most `concurrency` at once, with prompts no earlier round sent; the client only counts
`data:` lines (no JSON parse), so it takes little of the machine's CPU. Per round and process: CPU seconds
(utime + stime from /proc/<pid>/stat, all threads, children summed per role) and microseconds per output token
(ROLE:sys: the stime part, the kernel's: socket writes and reads, wake-ups).
Also the grammar process's CPU from the server's start to its health and over each round (--grammar-process).

--stream-interval N sends vLLM's stream_interval with every request (a chunk every N new tokens after the first);
`--serve-args "--stream-interval N"` sets the server's floor instead, the same for these requests:

    python -m pagoda.bench.stream_cpu --concurrency 64 --num-prompts 256 --output-len 128 --rounds 3 --stream-interval 4

--profile ROLE (api, tokenizer, scheduler, worker) runs that service under cProfile (a sitecustomize on PYTHONPATH)
and writes its stats to --profile-out when the process exits; print them with `python -m pstats FILE`.

On a 2-core machine the figures are noisy (the client, four services and the OS share two cores): compare medians
of several rounds, and A/B only on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from pagoda.bench.data_parallel import serving

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"
TICKS_PER_S = os.sysconf("SC_CLK_TCK")
ROLE = re.compile(r"pagoda\.services\.([a-z_.]+)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder or shape (default: the tiny Llama, built)")
    parser.add_argument("--serve-args", default="", help="more `pagoda serve` flags, space-separated")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=256, help="per round")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--greedy", action="store_true", help="temperature 0 (a cheaper worker step on a CPU)")
    parser.add_argument("--chat", action="store_true", help="/v1/chat/completions instead of /v1/completions")
    parser.add_argument("--stream-interval", type=int, default=None,
                        help="the requests' stream_interval: new tokens a chunk carries after the first (default: the "
                             "server's, 1 unless --serve-args sets --stream-interval)")
    parser.add_argument("--profile", default="", help="run this service under cProfile (api, tokenizer, ...)")
    parser.add_argument("--profile-out", default="/tmp/stream_cpu.prof")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    return parser.parse_args(argv)


def tiny_model(folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        sys.path.insert(0, str(REPO / "tests"))
        from harness import tiny_llama_over_smollm2_vocab

        folder.mkdir(parents=True, exist_ok=True)
        tiny_llama_over_smollm2_vocab(folder, SMOLLM2)
    return folder


def descendants(root: int) -> list[int]:
    """Every live process under `root` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds (utime + stime, all threads) of each pagoda process under `root`, summed per role."""
    seconds: dict[str, float] = {}
    for pid in descendants(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        match = ROLE.search(cmdline)
        role = match.group(1) if match else ("launcher" if pid == root else "other")
        seconds[role] = seconds.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / TICKS_PER_S
        seconds[role + ":sys"] = seconds.get(role + ":sys", 0.0) + int(fields[12]) / TICKS_PER_S
    return seconds


def self_cpu() -> float:
    times = os.times()
    return times.user + times.system


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    """Stream one request; its completion tokens (from the usage chunk)."""
    tokens = 0
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for line in response.content:
            if line.startswith(b'data: {"id"') and b'"usage":{' in line and b'"choices":[]' in line:
                tokens = int(re.search(rb'"completion_tokens":(\d+)', line).group(1))  # type: ignore[union-attr]
    return tokens


async def run_round(port: int, args: argparse.Namespace, offset: int) -> tuple[int, float]:
    """Send one round; (output tokens, seconds)."""
    rng = random.Random(offset)
    limit = asyncio.Semaphore(args.concurrency)
    path = "/v1/chat/completions" if args.chat else "/v1/completions"
    url = f"http://127.0.0.1:{port}{path}"
    sampling = {"temperature": 0.0} if args.greedy else {"temperature": 0.7, "top_p": 0.95}
    common = {"model": "m", "max_tokens": args.output_len, "ignore_eos": True, **sampling,
              "stream": True, "stream_options": {"include_usage": True}}
    if args.stream_interval is not None:
        common["stream_interval"] = args.stream_interval

    def body(i: int) -> dict[str, Any]:
        ids = [rng.randrange(100, 49000) for _ in range(args.input_len)]
        if args.chat:
            return {**common, "messages": [{"role": "user", "content": f"request {offset + i}: {ids}"}]}
        return {**common, "prompt": ids}

    bodies = [body(i) for i in range(args.num_prompts)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def limited(b: dict[str, Any]) -> int:
            async with limit:
                return await one(session, url, b)

        start = time.perf_counter()
        counts = await asyncio.gather(*(limited(b) for b in bodies))
        return sum(counts), time.perf_counter() - start


def server_env(args: argparse.Namespace, hook_dir: Path) -> dict[str, str]:
    """One intra-op thread a process; with --profile, the hook that profiles the named service."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args.profile:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook_dir), env.get("PYTHONPATH", "")]))
        env["PAGODA_BENCH_PROFILE"] = args.profile
        env["PAGODA_BENCH_PROFILE_OUT"] = args.profile_out
    return env


SITECUSTOMIZE = '''\
"""stream_cpu's profile hook: the service named by PAGODA_BENCH_PROFILE runs under cProfile until it exits."""
import atexit, cProfile, os, signal, sys
_role = os.environ.get("PAGODA_BENCH_PROFILE")
_argv = " ".join(getattr(sys, "orig_argv", sys.argv))
if _role and ("pagoda.services." + _role + " ") in (_argv + " "):
    import time
    _profile = cProfile.Profile(time.thread_time)  # CPU time: wall time counts waits for the 2 cores as work
    def _dump(*_):
        _profile.disable()
        _profile.dump_stats(os.environ["PAGODA_BENCH_PROFILE_OUT"])
    atexit.register(_dump)
    signal.signal(signal.SIGUSR2, _dump)
    _profile.enable()
'''


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or str(tiny_model(Path(tempfile.gettempdir()) / "pagoda-stream-cpu-tiny"))
    hook_dir = Path(tempfile.mkdtemp(prefix="stream_cpu_hook"))
    (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    tokenizer = [] if args.model else ["--tokenizer", str(SMOLLM2)]
    started = time.monotonic()
    with serving(model, "--max-model-len", "1024", *tokenizer, *args.serve_args.split(),
                 startup_timeout=args.startup_timeout, env=server_env(args, hook_dir)) as server:
        pid, port = server.process.pid, server.port
        at_health = cpu_by_role(pid)
        print(f"healthy after {time.monotonic() - started:.1f} s; CPU s so far: "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(at_health.items()) if ":" not in k))
        rows: list[dict[str, float]] = []
        offset = 0
        for r in range(args.rounds + 1):  # round 0 is a warm-up: not in the medians
            before, client_before = cpu_by_role(pid), self_cpu()
            tokens, seconds = asyncio.run(run_round(port, args, offset))
            after, client_after = cpu_by_role(pid), self_cpu()
            offset += args.num_prompts
            per_token = {role: 1e6 * (after[role] - before.get(role, 0.0)) / max(tokens, 1) for role in after}
            per_token["client"] = 1e6 * (client_after - client_before) / max(tokens, 1)
            label = "warm-up" if r == 0 else f"round {r}"
            print(f"{label}: {tokens} tokens in {seconds:.1f} s ({tokens / seconds:.0f} tok/s); us/token: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per_token.items())), flush=True)
            if "worker.grammar_process" in after:
                print(f"  grammar process CPU this round: "
                      f"{after['worker.grammar_process'] - before.get('worker.grammar_process', 0.0):.2f} s")
            if r > 0:
                rows.append(per_token)
        if rows:
            print("median us/token: " + ", ".join(
                f"{k} {statistics.median(row.get(k, 0.0) for row in rows):.1f}" for k in sorted(rows[0])))
    if args.profile:
        print(f"profile of {args.profile}: {args.profile_out} (python -m pstats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
