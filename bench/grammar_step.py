"""Host cost of constrained decoding per step, no model: what a step of K grammar rows asks of the CPU.

Runs K matchers of bench/structured.py's schema (an array of >= 200 strings of >= 16 characters) with a real
tokenizer (SmolLM2's; masks 49,152 ids wide: the dummy qwen3-0.6b shape fits its vocabulary to it),
feeding each row a random token its mask allows (what greedy on dummy weights draws), and times per step:

    raw_consume   llguidance's consume_token_par (or consume_token per row with 1 thread) alone
    raw_fill      fill_next_token_bitmask_par (or fill_next_token_bitmask per row) alone, into one buffer
    accept        GrammarRows.accept: the worker's call, Python bookkeeping included
    bitmask       GrammarRows.bitmask: the worker's call (row lookup, fill, flags, index)
    overhead      accept + bitmask - raw_consume - raw_fill: the Python around llguidance
    on_thread     advance_and_fill (accept + bitmask) on the runner's mask thread while this thread runs
                  --main-python-ms of pure Python (the engine applying a result and planning the next step):
                  from submit to done; the GIL the two share shows here (sys.getswitchinterval() matters)
    waited        how long that thread then blocks for the masks: what a step's masks add to the step loop
                  (before the mask thread, the loop ran accept + bitmask itself: their sum was its cost)

for K in --rows and the executor's thread counts in --threads. Then the grammar process (services/worker/
grammar_process.py), the worker's view per step (its masks checked equal to the in-process rows' every step):

    proc_rtt      submit (this step's tokens + the rows) -> masks ready in shared memory, this thread idle
    proc_work     of which the process's accept + fill (it consumes row by row; fills on its pool if the CPU has)
    proc_wire     proc_rtt - proc_work: encode, the pipe both ways, the mirror's bookkeeping
    proc_ready    with --main-python-ms of Python on this thread after submit: submit -> masks ready (compare
                  on_thread: the in-process mask thread under the same Python)
    proc_waited   how long this thread then blocks for them (compare waited)

    python -m pagoda.bench.grammar_step                      # K = 64, 256; 1 and 2 threads (and more if the CPU has)
    python -m pagoda.bench.grammar_step --rows 256 --threads 12 --steps 100

--engine adds the step loop's view: the offline engine (async scheduling) on this CPU with a tiny dummy model of
the qwen3-0.6b shape's vocabulary (so the forward costs little), every row constrained, masks per step:
fill (accept + fill, wherever it ran) and waited (what the step loop blocked on them), with the mask thread,
with the grammar process, and with the masks filled inline in the step loop (the worker before the thread).

--constraint structural_tag runs every row under a structural tag instead (free text in which "<tool_call>" goes on
as JSON of the same schema, then "</tool_call>": a tool-calling tag): the rows then draw free text, the masks
being free text's with the trigger watched.

JSON goes to $OUT/grammar_step.json when OUT is set (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llguidance
import llguidance.torch
import numpy as np
import torch

from pagoda.bench.report import write_json
from pagoda.bench.structured import LONG_SCHEMA
from pagoda.services.grammar.compiler import load_ll_tokenizer
from pagoda.services.worker import grammar as grammar_module
from pagoda.services.worker.grammar import GrammarRows
from pagoda.services.worker.grammar_process import MaskProcess, TokenizerSpec
from pagoda.services.worker.model_runner import MASK_SWITCH_INTERVAL_S
from pagoda.shared.config import DEFAULT_MODEL_DIR
from pagoda.shared.hf_tokenizer import load_hf_tokenizer
from pagoda.shared.messages import NewRequest, SamplingParams, StructuredOutputs

VOCAB_SIZE = 49152  # the qwen3-0.6b shape fitted to SmolLM2's tokenizer (bench/structured.py's GPU run)
PARTS = ("raw_consume", "raw_fill", "accept", "bitmask", "overhead", "on_thread", "waited")
PROCESS_PARTS = ("proc_rtt", "proc_work", "proc_wire", "proc_ready", "proc_waited")


def pick_tokens(mask: torch.Tensor, rng: np.random.Generator, real_vocab: int) -> list[int]:
    """One allowed token per row of `mask` [K, W] int32: random ids tried until one's bit is set."""
    words = mask.numpy().view(np.uint32)  # [K, W]
    picked = []
    for row in words:
        for _ in range(64):
            token = int(rng.integers(0, real_vocab))
            if (row[token >> 5] >> (token & 31)) & 1:
                break
        else:  # a narrow mask (a comma, a quote): take one of its allowed ids
            bits = np.unpackbits(row.view(np.uint8), bitorder="little")
            token = int(rng.choice(np.flatnonzero(bits)))
        picked.append(token)
    return picked


# a tool-calling structural tag over the same schema (--constraint structural_tag)
TOOL_TAG = {"structures": [{"begin": "<tool_call>", "schema": LONG_SCHEMA, "end": "</tool_call>"}],
            "triggers": ["<tool_call>"]}
CONSTRAINTS = {"json": StructuredOutputs(json=LONG_SCHEMA),
               "structural_tag": StructuredOutputs(structural_tag=json.dumps(TOOL_TAG))}
constraint = CONSTRAINTS["json"]  # every row's (main sets it from --constraint)


def new_request(seq_id: int) -> NewRequest:
    params = SamplingParams(max_tokens=4096, structured_outputs=constraint)
    return NewRequest(seq_id=seq_id, token_ids=[1, 2, 3], num_prompt_tokens=3, block_ids=[], num_computed_tokens=0,
                      sampling=params, seed=0)


def python_work(seconds: float) -> None:
    """Pure-Python work holding the GIL for `seconds` (dict and list churn, as a scheduler update does)."""
    stop = time.perf_counter() + seconds
    table: dict[int, list[int]] = {}
    while time.perf_counter() < stop:
        for i in range(200):
            table[i] = [i, i + 1]


def timed_fill(rows: GrammarRows, token_ids: list[int], seq_ids: list[int]) -> tuple[Any, float]:
    """The runner's mask job, and when it ended."""
    masks = rows.advance_and_fill([(seq_ids, token_ids)], seq_ids)
    assert masks is not None
    return masks, time.perf_counter()


def run_case(tokenizer: llguidance.LLTokenizer, real_vocab: int, num_rows: int, threads: int, steps: int,
             seed: int, main_python_s: float) -> dict[str, Any]:
    """`steps` steps of `num_rows` rows; per-part times per step (ms, median and p90)."""
    grammar_module.available_cpus = lambda: max(threads, grammar_module.PARALLEL_MIN_CPUS)  # type: ignore
    rows = GrammarRows(lambda: tokenizer, VOCAB_SIZE)
    rows._executor = llguidance.LLExecutor(num_threads=threads)
    parallel = threads > 1
    seq_ids = list(range(num_rows))
    for seq_id in seq_ids:
        rows.add(new_request(seq_id))
    rng = np.random.default_rng(seed)
    spare = llguidance.torch.allocate_token_bitmask(num_rows, VOCAB_SIZE)  # [K, W]: raw_fill's own buffer
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="masks")
    masks = rows.bitmask(seq_ids)  # compiles (once) and fills step 0's masks
    assert masks is not None
    for _ in range(steps):
        token_ids = pick_tokens(masks[1], rng, real_vocab)
        matchers = [rows._seqs[seq_id].matcher for seq_id in seq_ids]
        copies = [m.deep_copy() for m in matchers]  # raw calls run on copies: the timed worker calls see fresh state
        started = time.perf_counter()
        if parallel:
            llguidance.torch.consume_token_par(rows._executor, list(zip(copies, token_ids, strict=True)))
        else:
            for matcher, token_id in zip(copies, token_ids, strict=True):
                matcher.consume_token(token_id)
        times["raw_consume"].append(time.perf_counter() - started)
        started = time.perf_counter()
        if parallel:
            llguidance.torch.fill_next_token_bitmask_par(rows._executor, [(m, k) for k, m in enumerate(copies)],
                                                         spare)
        else:
            for k, matcher in enumerate(copies):
                llguidance.torch.fill_next_token_bitmask(matcher, spare, k)
        times["raw_fill"].append(time.perf_counter() - started)
        grammar_module.PARALLEL_ROWS = 2 if parallel else 1 << 30
        started = time.perf_counter()
        rows.accept(seq_ids, token_ids)
        times["accept"].append(time.perf_counter() - started)
        started = time.perf_counter()
        masks = rows.bitmask(seq_ids)
        times["bitmask"].append(time.perf_counter() - started)
        assert masks is not None and torch.equal(masks[1], spare), "the worker's masks differ from llguidance's"
        times["overhead"].append(times["accept"][-1] + times["bitmask"][-1] - times["raw_consume"][-1]
                                 - times["raw_fill"][-1])
        token_ids = pick_tokens(masks[1], rng, real_vocab)
        grammar_module.PARALLEL_ROWS = 2  # on the thread, always llguidance's pool (one GIL-free call each)
        started = time.perf_counter()
        job = pool.submit(timed_fill, rows, token_ids, seq_ids)
        python_work(main_python_s)
        waited = time.perf_counter()
        masks, ended = job.result()
        times["waited"].append(time.perf_counter() - waited)
        times["on_thread"].append(ended - started)
    stopped = sum(rows._seqs[s].matcher.is_stopped() for s in seq_ids)
    return {"rows": num_rows, "threads": threads, "steps": steps, "rows_stopped": stopped,
            **{part: {"median_ms": statistics.median(v) * 1e3, "p90_ms": float(np.percentile(v, 90)) * 1e3}
               for part, v in times.items()}}


def process_case(tokenizer_dir: str, tokenizer: llguidance.LLTokenizer, real_vocab: int, num_rows: int,
                 steps: int, seed: int, main_python_s: float) -> dict[str, Any]:
    """`steps` steps of `num_rows` rows through the grammar process, its masks checked against in-process rows;
    even steps with this thread idle, odd ones with main_python_s of Python after the submit. The reference rows
    run serially: a pool of llguidance's here spins on the CPUs after each call and delays the process (the worker
    has no pool of its own with the process: only the process has one)."""
    reference = GrammarRows(lambda: tokenizer, VOCAB_SIZE)
    reference._parallel = lambda num_rows: False  # type: ignore[method-assign]
    rows = MaskProcess(TokenizerSpec(tokenizer_dir, VOCAB_SIZE, ()), max_rows=num_rows)
    seq_ids = list(range(num_rows))
    try:
        for target in (reference, rows):
            for seq_id in seq_ids:
                target.add(new_request(seq_id))
        rng = np.random.default_rng(seed)
        expected = reference.bitmask(seq_ids)
        got = rows.bitmask(seq_ids)  # the process starts and compiles (once)
        assert expected is not None and got is not None and torch.equal(got[1], expected[1])
        times: dict[str, list[float]] = {part: [] for part in PROCESS_PARTS}
        for step in range(2 * steps):
            token_ids = pick_tokens(expected[1], rng, real_vocab)
            reference.accept(seq_ids, token_ids)
            expected = reference.bitmask(seq_ids)
            started = time.perf_counter()
            job = rows.submit([(seq_ids, token_ids)], seq_ids)
            if step % 2:
                python_work(main_python_s)
                waited = time.perf_counter()
                got = job.result()
                times["proc_waited"].append(time.perf_counter() - waited)
                assert job.reply is not None
                times["proc_ready"].append(job.reply.ended_at - started)
            else:
                got = job.result()
                assert job.reply is not None
                times["proc_rtt"].append(time.perf_counter() - started)
                times["proc_work"].append(job.reply.fill_s)
                times["proc_wire"].append(times["proc_rtt"][-1] - job.reply.fill_s)
            assert expected is not None and got is not None and torch.equal(got[1], expected[1]), \
                "the grammar process's masks differ from the in-process rows'"
    finally:
        rows.close()
        reference.close()
    return {"rows": num_rows, "steps": steps,
            **{part: {"median_ms": statistics.median(v) * 1e3, "p90_ms": float(np.percentile(v, 90)) * 1e3}
               for part, v in times.items()}}


def engine_case(tokenizer_dir: str, num_rows: int, num_tokens: int, mode: str) -> dict[str, Any]:
    """The offline engine's mask times per step for num_rows constrained rows of num_tokens tokens; mode: inline
    (in the step loop), thread (the runner's mask thread) or process (the grammar process)."""
    import dataclasses

    from pagoda.llm import LLM
    from pagoda.services.worker.model_runner import MaskTimes, ModelRunner
    from pagoda.shared import shapes

    shapes.SHAPES.setdefault("tiny-wide-vocab", dataclasses.replace(shapes.SHAPES["tiny"], vocab_size=151936))
    resume = ModelRunner.resume
    inline = mode == "inline"
    if inline:  # nothing starts the mask job: the next launch fills the masks in the step loop
        ModelRunner.resume = lambda self: None  # type: ignore[method-assign]
    try:
        llm = LLM("tiny-wide-vocab", load_format="dummy", tokenizer=tokenizer_dir, max_num_seqs=num_rows,
                  max_model_len=num_tokens + 64, async_scheduling=True, grammar_process=mode == "process")
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.encode(f"Write a JSON list #{i}") for i in range(num_rows)]
        params = SamplingParams(max_tokens=num_tokens, temperature=0.0, structured_outputs=constraint)
        llm.generate(prompts[:2], [params, params])  # warm-up: the matcher compiles
        llm.engine.runner.mask_times = MaskTimes()
        started = time.perf_counter()
        llm.generate(prompts, [params] * num_rows)
        elapsed = time.perf_counter() - started
        times = llm.engine.runner.mask_times.per_step_ms()
        llm.engine.runner.grammars.close()
        return {"rows": num_rows, "mode": mode, "elapsed_s": elapsed, **times}
    finally:
        ModelRunner.resume = resume  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="executor threads (default: 1, 2 and this process's CPUs)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--main-python-ms", type=float, default=2.0,
                        help="Python the main thread runs while the mask job runs (on_thread)")
    parser.add_argument("--switch-interval-ms", type=float, default=MASK_SWITCH_INTERVAL_S * 1e3,
                        help="sys.setswitchinterval (ms; default: what the runner sets once its mask thread starts)")
    parser.add_argument("--engine", action="store_true", help="also the offline engine's mask times (see above)")
    parser.add_argument("--engine-tokens", type=int, default=48)
    parser.add_argument("--no-process", action="store_true", help="skip the grammar process's round trip")
    parser.add_argument("--constraint", choices=sorted(CONSTRAINTS), default="json",
                        help="every row's constraint (see above)")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    global constraint
    constraint = CONSTRAINTS[args.constraint]
    cpus = grammar_module.available_cpus()
    threads = args.threads or sorted({1, 2, cpus})
    tokenizer = load_ll_tokenizer(args.tokenizer, VOCAB_SIZE, [])
    real_vocab = len(load_hf_tokenizer(args.tokenizer))  # the ids the tokenizer really has (49,152 for SmolLM2)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    results = [run_case(tokenizer, real_vocab, k, t, args.steps, args.seed, args.main_python_ms / 1e3)
               for k in args.rows for t in threads]
    print(f"affinity {len(os.sched_getaffinity(0))} CPUs, cgroup quota {grammar_module.cgroup_cpu_quota()} CPUs, "
          f"os.cpu_count {os.cpu_count()}: the worker sizes its pool from {cpus}")
    print(f"grammar host cost per step, ms (median / p90), {cpus} CPUs, vocab width {VOCAB_SIZE}; on_thread with "
          f"{args.main_python_ms} ms of Python beside it, GIL switch interval {sys.getswitchinterval() * 1e3} ms")
    print(f"{'rows':>5} {'thr':>4} " + " ".join(f"{part:>15}" for part in PARTS) + "  inline")
    for r in results:
        inline = r["accept"]["median_ms"] + r["bitmask"]["median_ms"]  # the step loop's cost without the thread
        print(f"{r['rows']:>5} {r['threads']:>4} "
              + " ".join(f"{r[p]['median_ms']:7.2f}/{r[p]['p90_ms']:<7.2f}" for p in PARTS) + f" {inline:7.2f}")
    process = [] if args.no_process else [
        process_case(args.tokenizer, tokenizer, real_vocab, k, args.steps, args.seed, args.main_python_ms / 1e3)
        for k in args.rows]
    if process:
        print(f"grammar process, the worker's view per step, ms (median / p90); proc_ready / proc_waited with "
              f"{args.main_python_ms} ms of Python on this thread (compare on_thread / waited above)")
        print(f"{'rows':>5} " + " ".join(f"{part:>15}" for part in PROCESS_PARTS))
        for r in process:
            print(f"{r['rows']:>5} " + " ".join(f"{r[p]['median_ms']:7.2f}/{r[p]['p90_ms']:<7.2f}"
                                               for p in PROCESS_PARTS))
    engine = []
    if args.engine:
        engine = [engine_case(args.tokenizer, k, args.engine_tokens, mode)
                  for k in args.rows for mode in ("inline", "thread", "process")]
        print("offline engine, every row constrained, ms per step: fill (accept + fill) / latency (submit -> ready) "
              "/ waited (the step loop)")
        for e in engine:
            print(f"{e['rows']:>5} {e['mode']:>8}  fill {e['fill_ms']:6.2f}  latency {e.get('latency_ms', 0.0):6.2f}  "
                  f"waited {e['waited_ms']:6.2f}  ({e['steps']} steps, {e['elapsed_s']:.2f} s)")
    if args.out:
        write_json(Path(args.out, "grammar_step.json"),
                   {"constraint": args.constraint, "cpus": cpus, "affinity": len(os.sched_getaffinity(0)),
                    "cgroup_quota": grammar_module.cgroup_cpu_quota(), "cpu_count": os.cpu_count(),
                    "main_python_ms": args.main_python_ms, "switch_interval_s": sys.getswitchinterval(),
                    "results": results, "process": process, "engine": engine})


if __name__ == "__main__":
    main()
