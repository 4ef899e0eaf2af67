"""A served model on this CPU against plain transformers `generate`, on what users send: chat, T 0.7 + top_p 0.95
(no top_k), streamed, one stream and several at once.

    python -m pagoda.bench.cpu_serving --trees /tmp/perf-base,. --reps 3 --concurrency 1,8 --max-tokens 128

Per repetition, in turn: for each tree, `pagoda serve` of that tree (as `make run` starts it: no OMP_NUM_THREADS,
torch's default threads) takes `--requests-per-stream` chat requests per stream at each concurrency (EOS ignored,
so every answer is max-tokens long), then stops; then transformers' `generate` (sdpa, the same torch threads)
decodes the same chats' template-rendered ids at batch 1 and at batch = concurrency (left-padded, do_sample,
top_k=0, min_new_tokens), with no server alive. Output tok/s = output tokens / wall time of the level; TTFT and
the gap between streamed chunks per request; CPU seconds per 1k output tokens of each pagoda process (/proc). A
tree other than the installed one is served through a shim folder on PYTHONPATH (the editable install maps
`pagoda.*` onto this checkout). The machine is shared: interleaved repetitions, medians and spreads, the load
average with every row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from pagoda.bench.data_parallel import serving
from pagoda.bench.stream_cpu import cpu_by_role

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"
TOPICS = ("the sea", "a paged KV cache", "bread", "the moon", "trains", "chess", "rain", "a lighthouse", "bees",
          "volcanoes", "libraries", "winter", "coffee", "bridges", "owls", "maps", "glass", "rivers", "clocks",
          "gardens", "kites", "salt", "deserts", "violins", "tides", "copper", "ferns", "lanterns", "wolves", "ink")
ASKS = ("Write a short poem about {}.", "Explain {} to a child.", "Give me three facts about {}.",
        "Tell a story about {}.")


def chats(count: int, offset: int) -> list[list[dict[str, str]]]:
    """`count` one-turn chats, none repeated within a run (offset)."""
    out = []
    for i in range(offset, offset + count):
        ask = ASKS[i % len(ASKS)].format(TOPICS[(i // len(ASKS)) % len(TOPICS)])
        out.append([{"role": "user", "content": f"{ask} (#{i})"}])
    return out


def split_variant(variant: str) -> tuple[Path, dict[str, str]]:
    """"TREE[+NAME=VALUE...]": a checkout and the environment variables its server gets beyond `make run`'s."""
    tree, *assignments = variant.split("+")
    return Path(tree), dict(a.split("=", 1) for a in assignments)


def tree_env(tree: Path, shim_root: Path) -> tuple[dict[str, str], Path]:
    """The environment and working folder that import `pagoda` from `tree`: this checkout as installed; else a
    shim folder whose pagoda/ links the tree's files and its services/kernels/shared/bench folders (the
    package-dir mapping), first on sys.path (`python -m` puts the working folder there before PYTHONPATH)."""
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        env.pop(name, None)  # as `make run` in a plain shell
    if tree.resolve() == REPO:
        return env, REPO
    shim = shim_root / tree.resolve().name / "pagoda"
    if not shim.exists():
        shim.mkdir(parents=True)
        for entry in (tree / "pagoda").iterdir():
            (shim / entry.name).symlink_to(entry.resolve())
        for name, folder in (("services", "services"), ("kernels", "kernels"), ("shared", "shared"),
                             ("bench", "bench")):
            (shim / name).symlink_to((tree / folder).resolve())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim.parent), env.get("PYTHONPATH", "")]))
    return env, shim.parent


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    first, last, gaps, tokens = 0.0, 0.0, [], 0
    async with session.post(url, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for raw in response.content:
            if not raw.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(raw[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                if first == 0.0:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    return {"ttft_s": first - start, "gaps_s": gaps, "tokens": tokens}


async def serve_level(port: int, conversations: list[list[dict[str, str]]], concurrency: int,
                      max_tokens: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    common = {"model": "m", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.7, "top_p": 0.95,
              "stream": True, "stream_options": {"include_usage": True}}
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def limited(messages: list[dict[str, str]]) -> dict[str, Any]:
            async with limit:
                return await _one(session, url, {**common, "messages": messages})

        start = time.perf_counter()
        records = await asyncio.gather(*(limited(m) for m in conversations))
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in records)
    gaps = [g for r in records for g in r["gaps_s"]]
    return {"out_tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "ttft_p50_ms": 1e3 * statistics.median(r["ttft_s"] for r in records),
            "gap_p50_ms": 1e3 * statistics.median(gaps) if gaps else 0.0}


def run_server(variant: str, args: argparse.Namespace, shim_root: Path, offset: int) -> dict[str, Any]:
    tree, extra_env = split_variant(variant)
    env, folder = tree_env(tree, shim_root)
    here = Path.cwd()
    os.chdir(folder)  # the server's processes start here
    try:
        return _serve_levels(args, {**env, **extra_env}, offset)
    finally:
        os.chdir(here)


def _serve_levels(args: argparse.Namespace, env: dict[str, str], offset: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    with serving(str(args.model), *args.serve_args.split(), env=env, startup_timeout=args.startup_timeout) as server:
        asyncio.run(serve_level(server.port, chats(2, 10_000 + offset), 2, 16))  # warm-up: not counted
        for concurrency in args.concurrency:
            conversations = chats(concurrency * args.requests_per_stream, offset)
            offset += len(conversations)
            before = cpu_by_role(server.process.pid)
            row = asyncio.run(serve_level(server.port, conversations, concurrency, args.max_tokens))
            after = cpu_by_role(server.process.pid)
            row["cpu_ms_per_1k_tok"] = {role: round(1e6 * (after[role] - before.get(role, 0.0)) / row["tokens"], 1)
                                        for role in after if ":" not in role}
            row["load1"] = os.getloadavg()[0]
            rows[str(concurrency)] = row
    return rows


def run_hf(args: argparse.Namespace, offset: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows: dict[str, Any] = {}

    def generate(batch: list[list[dict[str, str]]], max_tokens: int) -> int:
        ids = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in batch]
        ids = [i["input_ids"] if isinstance(i, dict) or hasattr(i, "keys") else i for i in ids]
        width = max(len(i) for i in ids)
        input_ids = torch.tensor([[pad] * (width - len(i)) + list(i) for i in ids])  # [B, L]
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])  # [B, L]
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=mask, do_sample=True, temperature=0.7, top_p=0.95,
                                 top_k=0, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad)
        return (out.shape[1] - width) * len(batch)

    generate(chats(2, 10_000 + offset), 16)  # warm-up
    for concurrency in args.concurrency:
        conversations = chats(concurrency * args.requests_per_stream, offset)
        offset += len(conversations)
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(conversations), concurrency):
            tokens += generate(conversations[i:i + concurrency], args.max_tokens)
        wall = time.perf_counter() - start
        rows[str(concurrency)] = {"out_tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
                                  "load1": os.getloadavg()[0]}
    return rows


def run_hf_isolated(args: argparse.Namespace, offset: int) -> dict[str, Any]:
    """transformers in a child process (its torch threads and memory go with it)."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "pagoda.bench.cpu_serving", "--hf-child", str(offset),
                          "--model", str(args.model), "--max-tokens", str(args.max_tokens),
                          "--requests-per-stream", str(args.requests_per_stream),
                          "--concurrency", ",".join(map(str, args.concurrency))],
                         capture_output=True, text=True, check=True, env=tree_env(REPO, Path())[0], cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(results: list[dict[str, Any]], concurrency: list[int]) -> None:
    names = sorted({name for r in results for name in r["runs"]})
    for c in concurrency:
        for name in names:
            values = [r["runs"][name][str(c)]["out_tok_s"] for r in results if name in r["runs"]]
            extra = ""
            served = [r["runs"][name][str(c)] for r in results if name in r["runs"]]
            if "gap_p50_ms" in served[0]:
                extra = (f"; gap p50 {statistics.median(s['gap_p50_ms'] for s in served):.1f} ms, TTFT p50 "
                         f"{statistics.median(s['ttft_p50_ms'] for s in served):.0f} ms")
            print(f"c={c} {name}: median {statistics.median(values):.1f} out tok/s "
                  f"(min {min(values):.1f}, max {max(values):.1f}, n={len(values)}){extra}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=SMOLLM2)
    parser.add_argument("--trees", default=str(REPO), help="comma-separated checkouts to serve from, in turn; "
                        "TREE+NAME=VALUE adds an environment variable to that server's (e.g. .+OMP_NUM_THREADS=1)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--serve-args", default="", help="more `pagoda serve` flags, space-separated")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=None, help="write every row as JSON")
    parser.add_argument("--hf-child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.hf_child is not None:
        print(json.dumps(run_hf(args, args.hf_child)))
        return 0
    trees = args.trees.split(",")
    shim_root = Path(tempfile.mkdtemp(prefix="cpu_serving_shim"))
    results = []
    for rep in range(args.reps):
        offset = 1000 * rep
        runs: dict[str, Any] = {}
        for tree in trees:
            runs[f"pagoda@{tree}"] = run_server(tree, args, shim_root, offset)
            print(f"rep {rep} pagoda@{tree}: {json.dumps(runs[f'pagoda@{tree}'])}", flush=True)
        if not args.no_hf:
            runs["transformers"] = run_hf_isolated(args, offset)
            print(f"rep {rep} transformers: {json.dumps(runs['transformers'])}", flush=True)
        results.append({"rep": rep, "start_load1": os.getloadavg()[0], "runs": runs})
    summarize(results, args.concurrency)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
