"""Issue 26's GPU figures in one command: every decoding mode against greedy, one process per shape.

    python -m pagoda.bench.decoding --out $OUT                 # everything, ~6-8 minutes on one H200
    python -m pagoda.bench.decoding --only qwen3 schemas       # some parts
    python -m pagoda.bench.decoding --tokenizer .gpu/smollm2-tok   # SmolLM2's tokenizer files elsewhere

Parts, each in its own process (one model load, its workloads back to back, the prefix cache emptied between):
  qwen3       qwen3-0.6b, dummy bf16 weights, 256 x 512 -> 256: reference (greedy), openai (T 0.7 + top_p 0.95),
              mixed (a quarter each greedy, top_p, top_k + top_p, min_p)
  llama       llama3-8b: the same three; then beam search width 4 (beam4) and n=4 sampling (n4-128), both
              64 x 512 -> 128 with four completions a prompt
  structured  bench/structured.py on the qwen3-0.6b shape with SmolLM2's tokenizer, 256 rows x 256 tokens: a JSON
              schema on every row, and on a quarter of them, against unconstrained (4 rounds)
  schemas     a server (pagoda serve, qwen3-0.6b dummy, SmolLM2's tokenizer): 64 unconstrained streams alone, then
              the same with 100 distinct 50-field schemas sent meanwhile: the streams' inter-token p99
Prints one table (figure, target, met) and writes decoding.json (and the parts' raw output) under --out, or
$OUT when set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pagoda.bench.report import stamp, write_json

PARTS = ("qwen3", "llama", "structured", "schemas")
SHAPE_WORKLOADS = {"qwen3": ("qwen3-0.6b", ("reference", "openai", "mixed")),
                   "llama": ("llama3-8b", ("reference", "openai", "mixed", "n4-128", "beam4"))}
# SmolLM2's tokenizer: the model folder here (make model), its tokenizer files alone on the GPU machine
TOKENIZER_FOLDERS = ("models/smollm2-135m-instruct", ".gpu/smollm2-tok")
# --smoke (a CPU check of the mechanics, no figures): the tiny shape and a few requests of a few tokens
SMOKE = os.environ.get("PAGODA_DECODING_SMOKE") == "1"
NUM_STREAMS, NUM_SCHEMAS, STREAM_TOKENS, PROMPT_LEN = (4, 6, 12, 16) if SMOKE else (64, 100, 256, 512)


# ---------------------------------------------------------------------------------------------
# children


def run_shape(shape: str, workloads: tuple[str, ...]) -> dict[str, Any]:
    """One engine, each workload in turn (bench/throughput.py's measurement), prompts of another seed each."""
    from pagoda import LLM
    from pagoda.bench.throughput import measure_pagoda
    from pagoda.bench.workload import preset

    started = time.perf_counter()
    llm = LLM("tiny" if SMOKE else shape, load_format="dummy", seed=0)
    load_s = time.perf_counter() - started
    results: dict[str, Any] = {"shape": shape, "load_s": load_s}
    for index, name in enumerate(workloads):
        llm.engine.scheduler.blocks.reset_prefix_cache()
        workload = replace(preset(name, shape), seed=100 + index)
        if SMOKE:
            workload = replace(workload, num_prompts=4, input_len=16, output_len=4)
        results[name] = measure_pagoda(llm, workload)
        print(f"{shape} {name}: {results[name]['output_tok_per_s']:.0f} tok/s", file=sys.stderr, flush=True)
    return results


def default_tokenizer() -> str:
    """The first of TOKENIZER_FOLDERS present (the first when none is: the error then names the usual one)."""
    return next((folder for folder in TOKENIZER_FOLDERS if Path(folder).is_dir()), TOKENIZER_FOLDERS[0])


def served(tokenizer: str) -> list[str]:
    """The model a structured/schemas part serves: the dummy qwen3-0.6b shape; in --smoke the tokenizer's folder
    (SmolLM2's weights, on CPU)."""
    return ["--model", tokenizer] if SMOKE else ["--model", "qwen3-0.6b", "--load-format", "dummy"]


def run_structured(out_dir: Path, tokenizer: str) -> dict[str, Any]:
    path = out_dir / "structured.json"
    # 256 tokens a row, 4 rounds: runs of 128 tokens lasted 0.6-1.2 s on an H200 and swung 0.50-0.87 (2026-12-02)
    sizes = ["4", "8", "1"] if SMOKE else ["256", "256", "4"]
    argv = [sys.executable, "-m", "pagoda.bench.structured", *served(tokenizer), "--tokenizer", tokenizer,
            "--num-requests", sizes[0], "--max-tokens", sizes[1], "--prompt-len", "64", "--rounds", sizes[2],
            "--constrained-every", "1", "4", "--out", str(path)]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def fifty_field_schema(index: int) -> dict[str, Any]:
    from pagoda.bench.structured import fifty_field_schema as base

    schema = base()
    schema["properties"][f"id_{index}"] = {"type": "integer"}  # a distinct schema each: no cache hit
    schema["required"].append(f"id_{index}")
    return schema


async def _stream(session: Any, url: str, prompt: list[int]) -> list[float]:
    """One streamed completion: the gaps between its chunks (seconds)."""
    body = {"prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": True}
    times: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times[1:], times[2:], strict=False)]  # from the second token on


async def _schema_request(session: Any, url: str, index: int) -> bool:
    body = {"prompt": "Fill in the form as JSON:", "max_tokens": 48, "temperature": 0.0,
            "structured_outputs": {"json": fifty_field_schema(index)}}
    async with session.post(url + "/v1/completions", json=body) as response:
        await response.read()
        return response.status == 200


async def _streams_level(url: str, seed: int, with_schemas: bool) -> dict[str, Any]:
    import aiohttp

    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(NUM_STREAMS)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        streams = [asyncio.create_task(_stream(session, url, prompt)) for prompt in prompts]
        schemas: list[bool] = []
        if with_schemas:
            await asyncio.sleep(0.5 if SMOKE else 2.0)  # the streams decode: the schemas arrive in their midst
            schemas = await asyncio.gather(*(_schema_request(session, url, seed * 1000 + i)
                                             for i in range(NUM_SCHEMAS)))
        gaps = sorted(gap for result in await asyncio.gather(*streams) for gap in result)
    return {"itl_p50_ms": 1e3 * gaps[len(gaps) // 2], "itl_p99_ms": 1e3 * gaps[int(0.99 * len(gaps))],
            "itl_max_ms": 1e3 * gaps[-1], "schemas_ok": sum(schemas), "schemas_sent": len(schemas)}


def run_schemas(out_dir: Path, tokenizer: str) -> dict[str, Any]:
    port = 8000 + os.getpid() % 1000
    runtime = out_dir / "schemas_runtime"
    runtime.mkdir(parents=True, exist_ok=True)
    log = (out_dir / "schemas_server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "pagoda.cli", "serve", *served(tokenizer),
                               "--tokenizer", tokenizer, "--port", str(port),
                               "--runtime-dir", str(runtime), "--max-model-len", "2048"],
                              stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # the launcher prints one line once every process is healthy
        if "serving" not in line:
            raise RuntimeError(f"the server did not start: {line!r} (see schemas_server.log)")
        url = f"http://127.0.0.1:{port}"
        asyncio.run(_streams_level(url, 0, False))  # warm-up: CUDA graphs, the tokenizer's first grammar
        alone = asyncio.run(_streams_level(url, 1, False))
        with_schemas = asyncio.run(_streams_level(url, 2, True))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    return {"alone": alone, "with_schemas": with_schemas,
            "itl_p99_ratio": with_schemas["itl_p99_ms"] / alone["itl_p99_ms"]}


def child(part: str, out_dir: Path, tokenizer: str) -> dict[str, Any]:
    if part in SHAPE_WORKLOADS:
        return run_shape(*SHAPE_WORKLOADS[part])
    if not Path(tokenizer).is_dir():
        raise FileNotFoundError(f"no tokenizer folder {tokenizer!r}: pass --tokenizer (SmolLM2's tokenizer files)")
    if part == "structured":
        return run_structured(out_dir, tokenizer)
    return run_schemas(out_dir, tokenizer)


# ---------------------------------------------------------------------------------------------
# the parent: one process a part, then the table


def _run_part(part: str, out_dir: Path, timeout: float, tokenizer: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "pagoda.bench.decoding", "--child", part, "--out", str(out_dir),
            "--tokenizer", tokenizer]
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    (out_dir / f"{part}.log").write_text(proc.stderr[-200_000:])
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {**json.loads(line[len("RESULT "):]), "wall_s": time.perf_counter() - started}
    return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}


def rows(report: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(figure, value, target, met) for the table."""
    out: list[tuple[str, str, str, str]] = []
    for part in ("qwen3", "llama"):
        figures = report.get(part, {})
        greedy = figures.get("reference", {}).get("output_tok_per_s")
        for name in ("reference", "openai", "mixed"):
            tok = figures.get(name, {}).get("output_tok_per_s")
            if tok is None:
                continue
            if name == "reference":
                out.append((f"{part} greedy tok/s", f"{tok:,.0f}", "", ""))
            else:
                ratio = tok / greedy if greedy else float("nan")
                out.append((f"{part} {name} / greedy", f"{ratio:.3f} ({tok:,.0f})", ">= 0.95", _met(ratio >= 0.95)))
    llama = report.get("llama", {})
    if "beam4" in llama and "n4-128" in llama:
        ratio = llama["beam4"]["output_tok_per_s"] / llama["n4-128"]["output_tok_per_s"]
        out.append(("llama beam4 / n4 sampling", f"{ratio:.3f}", ">= 0.8", _met(ratio >= 0.8)))
    structured = report.get("structured", {})
    for mode, target in (("json_schema", 0.9), ("json_schema_1_in_4", 0.95)):
        ratio = structured.get(mode, {}).get("ratio", {}).get("median")
        if ratio is not None:
            out.append((f"structured {mode} / free", f"{ratio:.3f}", f">= {target}", _met(ratio >= target)))
    schemas = report.get("schemas", {})
    if "itl_p99_ratio" in schemas:
        ratio = schemas["itl_p99_ratio"]
        detail = f"{ratio:.2f} ({schemas['alone']['itl_p99_ms']:.1f} -> {schemas['with_schemas']['itl_p99_ms']:.1f} ms)"
        out.append(("64 streams ITL p99, 100 schemas", detail, "<= 1.5x", _met(ratio <= 1.5)))
    for part, figures in report.items():
        if isinstance(figures, dict) and "error" in figures:
            out.append((part, "failed", "", figures["error"][-120:]))
    return out


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results/decoding"))
    parser.add_argument("--timeout", type=float, default=300, help="seconds each part may run")
    parser.add_argument("--tokenizer", default=default_tokenizer(),
                        help="SmolLM2's tokenizer folder for the structured and schemas parts "
                             f"(default: the first present of {', '.join(TOKENIZER_FOLDERS)})")
    parser.add_argument("--smoke", action="store_true", help="a CPU check of the mechanics (tiny shape, no figures)")
    parser.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        os.environ["PAGODA_DECODING_SMOKE"] = "1"  # the children read it
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, out_dir, args.tokenizer)), flush=True)
        return 0
    report: dict[str, Any] = {"date": stamp()}
    for part in args.only:
        report[part] = _run_part(part, out_dir, args.timeout, args.tokenizer)
        write_json(out_dir / "decoding.json", report)  # what finished, if cut short
        print(f"{part}: done in {report[part].get('wall_s', 0):.0f} s", file=sys.stderr, flush=True)
    table = rows(report)
    widths = [max(len(row[i]) for row in table + [("figure", "value", "target", "")]) for i in range(4)]
    for row in [("figure", "value", "target", ""), *table]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    return 0 if all("error" not in v for v in report.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
