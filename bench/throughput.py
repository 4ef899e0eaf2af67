"""Offline throughput: pagoda's engine against the Hugging Face peers, same model, weights and workload.

Every system runs in its own process, one after the other, so none inherits another's GPU memory;
this process only orchestrates and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

from pagoda.bench.report import stamp, unwritable, write_json
from pagoda.bench.roofline import Precision, batch1_floor_ms, checkpoint_quantization, roofline_seconds
from pagoda.bench.workload import (
    ENGINE_DEFAULTS,
    PRESETS,
    Workload,
    jitter_fraction,
    non_negative_int,
    positive_int,
    preset,
)
from pagoda.shared.config import DTYPE_ALIASES, KV_CACHE_DTYPES, QUANTIZATIONS


def _step_summary(timer: Any) -> dict[str, Any]:
    """Decode GPU busy fraction and per-step device times from CUDA events around each step (CUDA only).

    busy fraction = summed device time of decode steps / device time between consecutive decode steps' ends:
    what is missing is the GPU waiting for the host (the issue's target is >= 0.95).
    """
    if timer is None or not timer.steps:
        return {"decode_gpu_busy_fraction": None}
    fraction, num_decode = timer.decode_busy_fraction()
    decode = sorted(start.elapsed_time(end) for is_decode, start, end in timer.steps if is_decode)
    mixed = [start.elapsed_time(end) for is_decode, start, end in timer.steps if not is_decode]
    return {"decode_gpu_busy_fraction": round(fraction, 4), "decode_steps": num_decode,
            "decode_step_gpu_ms_p50": decode[len(decode) // 2] if decode else 0.0,
            "decode_steps_gpu_s": sum(decode) / 1e3, "mixed_steps": len(mixed), "mixed_steps_gpu_s": sum(mixed) / 1e3,
            "mixed_step_gpu_ms": [round(ms, 2) for ms in mixed]}


def single_request_latency(llm: Any, prompt: list[int], num_tokens: int) -> dict[str, float]:
    """Batch-1 decode: the median wall time of a decode step (one token) after a prompt's prefill."""
    from pagoda import SamplingParams

    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True))
    step_times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    decode = sorted(step_times[1:])  # the first step is the prefill
    return {"batch1_prompt_len": len(prompt), "batch1_decode_ms_p50": 1e3 * decode[len(decode) // 2],
            "batch1_prefill_ms": 1e3 * step_times[0]}


def run_pagoda(model: str, load_format: str, workload: Workload, engine_args: dict[str, Any],
               latency_prompt_len: int = 0, repeats: int = 1) -> dict[str, Any]:
    from pagoda import LLM

    load_start = time.perf_counter()
    llm = LLM(model, load_format=load_format, **engine_args)
    load_s = time.perf_counter() - load_start
    return measure_repeated(llm, workload, repeats, load_s, latency_prompt_len)


def measure_repeated(llm: Any, workload: Workload, repeats: int, load_s: float = 0.0,
                     latency_prompt_len: int = 0) -> dict[str, Any]:
    """`repeats` timed runs of the workload in one process, each on prompts of its own seed (none finds another's
    in the prefix cache): the median run's result (by output tok/s), with every run's throughput beside it. Runs of
    a few seconds move by several percent with the host's scheduling; the median of several is the figure to
    compare."""
    assert repeats >= 1
    runs = [measure_pagoda(llm, replace(workload, seed=workload.seed + 7919 * r), load_s,
                           latency_prompt_len if r == repeats - 1 else 0) for r in range(repeats)]
    if repeats == 1:
        return runs[0]
    rates = [r["output_tok_per_s"] for r in runs]
    median = sorted(runs, key=lambda r: r["output_tok_per_s"])[(repeats - 1) // 2]
    return {**median, **{k: v for k, v in runs[-1].items() if k.startswith("batch1_")},
            "repeats": repeats, "repeat_tok_per_s": [round(rate, 1) for rate in rates],
            "repeat_tok_per_s_mean": round(sum(rates) / repeats, 1),
            "repeat_steps": [{k: r[k] for k in REPEAT_STEP_KEYS if k in r} for r in runs]}


# Per-run step figures kept beside the median's (where one run of a call differs, e.g. the first, the steps say
# whether prefill-carrying or decode steps moved)
REPEAT_STEP_KEYS = ("elapsed_s", "decode_steps_gpu_s", "decode_step_gpu_ms_p50", "mixed_steps_gpu_s",
                    "mixed_step_gpu_ms", "num_steps")


def measure_pagoda(llm: Any, workload: Workload, load_s: float = 0.0, latency_prompt_len: int = 0) -> dict[str, Any]:
    """One workload on an engine already loaded (bench/decoding.py runs several in one process): a warm-up on
    fresh prompts of the same sampling kinds, then the timed run."""
    from pagoda import SamplingParams

    runner = llm.engine.runner
    prompts = workload.prompts(runner.arch.vocab_size)
    params = [SamplingParams(max_tokens=workload.output_len, ignore_eos=True, **workload.sampling_kwargs(i))
              for i in range(len(prompts))]
    # warm-up on the timed run's own sampling path: the first sampled mixed step of a process took 180 ms (H200,
    # qwen3-0.6b) against 34-42 ms for the next ones (one-time allocations or compiles; not pinned down)
    # Fresh short prompts (another seed): the timed prompts must not sit in the prefix cache (a one-prompt workload
    # was otherwise wholly cached by its own warm-up); four, so every kind of a mixed workload runs.
    warm = replace(workload, seed=workload.seed + 1, num_prompts=4, input_len=min(workload.input_len, 512),
                   shared_prefix_len=0).prompts(runner.arch.vocab_size)
    llm.generate(warm, [SamplingParams(max_tokens=4, ignore_eos=True, **workload.sampling_kwargs(i))
                        for i in range(len(warm))])
    before = replace(llm.engine.scheduler.stats)  # the counters are the engine's since start: report the run's
    timer = None
    if getattr(runner.device, "type", "cpu") == "cuda":
        from pagoda.services.worker.model_runner import StepTimer

        timer = runner.step_timer = StepTimer()
    _sync(runner.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    _sync(runner.device)
    elapsed = time.perf_counter() - start
    run = _stats_since(before, llm.engine.scheduler.stats)  # before the batch-1 timing's steps
    runner.step_timer = None
    token_lists = [c.token_ids for o in outputs for c in o.outputs]
    num_output = sum(len(t) for t in token_lists)
    latency = single_request_latency(llm, prompts[0][:latency_prompt_len], 64) if latency_prompt_len else {}
    return {"system": "pagoda", "elapsed_s": elapsed, "output_tokens": num_output,
            "prefix_hit_tokens": run["prefix_hit_tokens"], **latency,
            **_step_summary(timer), "max_inflight_plans": llm.engine.scheduler.max_inflight_plans,
            "output_tok_per_s": num_output / elapsed, "load_s": load_s,
            "num_steps": run["num_steps"],
            "num_preemptions": run["num_preemptions"], "num_kv_blocks": runner.num_blocks,
            "num_swapped": run["num_swapped"], "num_swap_blocks": runner.num_swap_blocks,
            "device": str(runner.device), "dtype": str(runner.dtype),
            "compiles_after_start_up": [[name, round(1e3 * seconds, 1)] for name, seconds in
                                        getattr(getattr(runner, "compile_watch", None), "compiles", [])],
            "first_outputs": [t[:32] for t in token_lists[:4]]}


def _stats_since(before: Any, now: Any) -> dict[str, int]:
    """The scheduler's counters (SchedulerStats) over the timed run alone: now less what they were before it."""
    names = ("prefix_hit_tokens", "num_steps", "num_preemptions", "num_swapped")
    return {name: getattr(now, name) - getattr(before, name) for name in names}


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """Run a single system in this process (the child side)."""
    workload = workload_from_args(args)
    if args.system == "pagoda":
        return run_pagoda(args.model, args.load_format, workload, engine_args(args), args.latency_prompt_len,
                          args.repeats)
    from pagoda.bench.hf_peer import run_peer
    from pagoda.services.worker.device import resolve_device
    from pagoda.shared.config import EngineConfig

    config = EngineConfig(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device)
    device = resolve_device(config)
    return run_peer(args.system, args.model, args.load_format, workload, config.resolved_dtype(device), device,
                    args.seed)


# Without --workload: the small CPU default (32 x ~100 -> 128, greedy).
CUSTOM_DEFAULTS = {"num_prompts": 32, "input_len": 100, "input_len_jitter": 0.1, "output_len": 128}


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The named preset (adjusted to the model), or the custom defaults; explicit size flags override either."""
    sizes = {name: getattr(args, name) for name in CUSTOM_DEFAULTS}
    if args.workload:
        return preset(args.workload, args.model, seed=args.seed, **sizes)
    return Workload(seed=args.seed, **{k: v if v is not None else CUSTOM_DEFAULTS[k] for k, v in sizes.items()})


_ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory", "enforce_eager",
                 "quantization", "kv_cache_dtype", "tokenizer")


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """pagoda's engine keyword arguments: the flags given, over the preset's engine defaults (ENGINE_DEFAULTS)."""
    result: dict[str, Any] = {"seed": args.seed, "dtype": args.dtype, "device": args.device}
    if args.no_async_scheduling:
        result["async_scheduling"] = False
    result.update(ENGINE_DEFAULTS.get(args.workload or "", {}))
    for name in _ENGINE_FLAGS:
        value = getattr(args, name)
        if value not in (None, False):
            result[name] = value
    if args.swap_space is not None:  # 0 is a value here (always recompute)
        result["swap_space"] = args.swap_space
    return result


def precision_from_args(args: argparse.Namespace) -> Precision:
    """The storage the floor counts: the model dtype, --quantization (or an FP8 checkpoint's own), the KV dtype."""
    quantization = args.quantization or checkpoint_quantization(args.model)
    dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)  # --dtype float is float32, as the engine reads it
    if dtype == "auto":  # the engine's choice: float32 on a CPU named, else bf16 (a device left auto: CUDA's)
        dtype = "float32" if args.device == "cpu" else "bfloat16"
    dtype_bytes = 4 if dtype == "float32" else 2
    return Precision(dtype_bytes, quantization, args.kv_cache_dtype or "auto")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="models/smollm2-135m-instruct", help="model folder or dummy shape")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--workload", default=None, choices=tuple(PRESETS),
                        help="a named workload (bench/workload.py); size flags below override its numbers")
    parser.add_argument("--num-prompts", type=positive_int, default=None)
    parser.add_argument("--input-len", type=positive_int, default=None)
    parser.add_argument("--input-len-jitter", type=jitter_fraction, default=None,
                        help="prompt lengths uniform in input-len * [1 - j, 1 + j], j in [0, 1]")
    parser.add_argument("--output-len", type=positive_int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default=None)
    parser.add_argument("--swap-space", type=float, default=None,
                        help="pagoda only: GiB of host memory for preempted sequences' blocks (default: the engine's; "
                             "0: recompute them)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help="pagoda only: fp8 weights")
    parser.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES, help="pagoda only: fp8 KV cache")
    parser.add_argument("--tokenizer", default=None,
                        help="pagoda only: a tokenizer folder for a dummy shape (its vocabulary, as `serve` has it)")
    parser.add_argument("--no-async-scheduling", action="store_true", help="serial steps (default: overlap on CUDA)")
    parser.add_argument("--peer", action="append", default=[], choices=("hf-static", "hf-compiled", "hf-cb"),
                        help="also run this Hugging Face peer (repeatable)")
    parser.add_argument("--skip-pagoda", action="store_true", help="run only the peers")
    parser.add_argument("--latency-prompt-len", type=non_negative_int, default=0,
                        help="also time batch-1 decode after a prompt of this many tokens")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="pagoda only: time the workload this many times in one process (fresh prompts each) and "
                             "report the median run")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each system may run")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    parser.add_argument("--system", default=None, help=argparse.SUPPRESS)  # child mode


def main(args: argparse.Namespace) -> int:
    if args.system:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0
    if args.out and (why := unwritable(args.out)):
        print(f"--out {args.out}: cannot write the report there ({why})", file=sys.stderr)
        return 2
    if why := plan_error(args):
        print(why, file=sys.stderr)
        return 2
    systems = ([] if args.skip_pagoda else ["pagoda"]) + args.peer
    workload = workload_from_args(args)
    if args.peer and (workload.n > 1 or workload.sampling != "greedy"):
        print(f"the Hugging Face peers run greedy n=1 workloads only, not {args.workload}", file=sys.stderr)
        return 2
    results: list[dict[str, Any]] = []
    report = {"date": stamp(), "model": args.model, "load_format": args.load_format,
              "workload_name": args.workload or "custom", "workload": workload.to_dict(),
              "engine_args": engine_args(args), "results": results, "roofline": _roofline(args)}
    for system in systems:
        results.append(_run_child(args, system))
        if args.out:  # after every system, so a run cut short still leaves what it measured
            write_json(args.out, report)
        print(f"{system}: " + json.dumps({k: v for k, v in results[-1].items() if k != "first_outputs"}),
              flush=True)
    _print_table(report)
    return 0 if all("error" not in r for r in results) else 1


def plan_error(args: argparse.Namespace) -> str | None:
    """Why the run cannot go as asked, found before any process starts (a child found it only as a traceback): a
    model that is no folder or dummy shape, a --max-model-len past its context, or a prompt of the workload that
    leaves no room for --output-len tokens."""
    from pagoda.shared.errors import PagodaError
    from pagoda.shared.shapes import resolve_arch, resolve_max_model_len

    try:
        arch = resolve_arch(args.model, "dummy" if args.load_format == "dummy" else "auto", args.tokenizer)
    except PagodaError as exc:
        return f"--model {args.model}: {exc}"
    try:
        context = resolve_max_model_len(arch, args.max_model_len)
    except PagodaError as exc:
        return f"--max-model-len {args.max_model_len}: {exc}"
    workload = workload_from_args(args)
    longest = max(len(prompt) for prompt in workload.prompts(arch.vocab_size))
    if longest + workload.output_len > context:
        return (f"--input-len / --output-len: the workload's longest prompt ({longest} tokens) and "
                f"{workload.output_len} output tokens exceed the {context}-token context of {args.model} "
                "(--max-model-len)")
    return None


_FORWARDED = ("model", "load_format", "workload", "num_prompts", "input_len", "input_len_jitter", "output_len", "seed",
              "dtype", "device", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory",
              "enforce_eager", "latency_prompt_len", "quantization", "kv_cache_dtype", "no_async_scheduling",
              "tokenizer", "repeats", "swap_space")


def _roofline(args: argparse.Namespace) -> dict[str, Any]:
    from pagoda.shared.shapes import resolve_arch

    try:
        arch = resolve_arch(args.model, "dummy" if args.load_format == "dummy" else "auto")
    except Exception:  # noqa: BLE001 - the floor is a courtesy; the run itself reports real errors
        return {}
    precision = precision_from_args(args)
    floor = roofline_seconds(arch, workload_from_args(args), precision)
    if args.latency_prompt_len:
        floor["batch1_floor_ms"] = batch1_floor_ms(arch, args.latency_prompt_len, precision)
    return floor


def child_argv(args: argparse.Namespace, system: str) -> list[str]:
    """The command that runs one system in its own process with this run's settings."""
    argv = [sys.executable, "-m", "pagoda.bench", "throughput", "--system", system]
    for key in _FORWARDED:
        value = getattr(args, key)
        if value is None or value is False:  # (0 and 0.0 are values: --swap-space 0)
            continue
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def _run_child(args: argparse.Namespace, system: str) -> dict[str, Any]:
    argv = child_argv(args, system)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=os.environ.copy(), timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:
        print(f"{system} timed out after {args.timeout} s", file=sys.stderr)
        return {"system": system, "error": f"timed out after {args.timeout} s: {str(exc.stderr or '')[-500:]}"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout)[-2000:]
    print(f"{system} failed (exit {proc.returncode}):\n{tail}", file=sys.stderr)
    return {"system": system, "error": tail}


def _print_table(report: dict[str, Any]) -> None:
    results = report["results"]
    floor = report.get("roofline") or {}
    base = next((r for r in results if r["system"] == "pagoda" and "error" not in r), None)
    print(f"\nmodel {report['model']}  workload {report['workload']}")
    print(f"{'system':<14}{'out tok/s':>12}{'elapsed s':>12}{'pagoda x':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['system']:<14}{'failed':>12}")
            continue
        ratio = base["output_tok_per_s"] / r["output_tok_per_s"] if base else float("nan")
        print(f"{r['system']:<14}{r['output_tok_per_s']:>12.1f}{r['elapsed_s']:>12.2f}{ratio:>10.2f}")
    if floor:
        print(f"roofline floor {floor['floor_s']:.2f} s ({floor['floor_out_tok_per_s']:.0f} out tok/s)"
              + (f"; pagoda at {floor['floor_s'] / base['elapsed_s']:.0%} of it" if base else "")
              + f" [{floor['precision']}]")
    if base and base.get("repeats"):
        print(f"pagoda: the median of {base['repeats']} runs; out tok/s {base['repeat_tok_per_s']}, mean "
              f"{base['repeat_tok_per_s_mean']:.1f}")
        for i, run in enumerate(base.get("repeat_steps", [])):
            if "mixed_steps_gpu_s" in run:
                print(f"  run {i + 1}: {run['elapsed_s']:.3f} s; GPU {run['mixed_steps_gpu_s']:.3f} s in "
                      f"prefill-carrying steps, {run['decode_steps_gpu_s']:.3f} s in decode steps "
                      f"(p50 {run['decode_step_gpu_ms_p50']:.2f} ms)")
    if base and base.get("decode_gpu_busy_fraction") is not None:
        print(f"decode GPU busy {base['decode_gpu_busy_fraction']:.1%} over {base['decode_steps']} decode steps "
              f"(max_inflight_plans {base['max_inflight_plans']}; target >= 95%)")
    if base and "batch1_decode_ms_p50" in base:
        line = (f"batch-1 decode after {base['batch1_prompt_len']} prompt tokens: "
                f"{base['batch1_decode_ms_p50']:.2f} ms/token")
        if floor.get("batch1_floor_ms"):
            ratio = base["batch1_decode_ms_p50"] / floor["batch1_floor_ms"]
            line += f" (floor {floor['batch1_floor_ms']:.2f} ms: {ratio:.2f}x)"
        print(line)
    if base and floor and base.get("mixed_steps_gpu_s") and report["workload"]["input_len"] >= 16384:
        _print_long_context(base, floor)


def _print_long_context(base: dict[str, Any], floor: dict[str, Any]) -> None:
    """Long prompts: prefill against the matmul-peak bound (attention FLOPs included), decode against the
    bandwidth floor at that context."""
    prefill_s = base["mixed_steps_gpu_s"]
    print(f"prefill {floor['prefill_tokens'] / prefill_s:,.0f} tok/s in {prefill_s:.2f} s of GPU time; matmul-peak "
          f"bound {floor['floor_prefill_s']:.2f} s: {floor['floor_prefill_s'] / prefill_s:.0%} of peak")
    print(f"decode {base['decode_step_gpu_ms_p50']:.2f} ms/step (p50 GPU); "
          f"floor {floor['floor_decode_step_ms']:.2f} ms at the workload's mean context: "
          f"{base['decode_step_gpu_ms_p50'] / floor['floor_decode_step_ms']:.2f}x")
