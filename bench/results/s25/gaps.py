"""Where the wall time of qwen3-0.6b's reference run goes, bf16 against fp8 KV: every step's device time and the
device's idle gaps between steps (CUDA events), for RUNS timed runs in one process (fresh prompt seeds each)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from pagoda import LLM, SamplingParams
from pagoda.bench.workload import Workload
from pagoda.services.worker.model_runner import StepTimer


def timed_run(llm: LLM, workload: Workload) -> dict:
    runner = llm.engine.runner
    prompts = workload.prompts(runner.arch.vocab_size)
    params = [SamplingParams(max_tokens=workload.output_len, ignore_eos=True) for _ in prompts]
    warm = replace(workload, seed=workload.seed + 100, num_prompts=4).prompts(runner.arch.vocab_size)
    llm.generate(warm, [SamplingParams(max_tokens=4, ignore_eos=True) for _ in warm])
    timer = runner.step_timer = StepTimer()
    torch.cuda.synchronize()
    first = torch.cuda.Event(enable_timing=True)
    first.record()
    start = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    runner.step_timer = None
    steps = timer.steps
    lead = first.elapsed_time(steps[0][1])
    gaps = [(i, steps[i - 1][0], steps[i][0], steps[i - 1][2].elapsed_time(steps[i][1])) for i in range(1, len(steps))]
    times = [(d, s.elapsed_time(e)) for d, s, e in steps]
    decode = sum(t for d, t in times if d) / 1e3
    mixed = sum(t for d, t in times if not d) / 1e3
    big = sorted(gaps, key=lambda g: -g[3])[:8]
    return {"elapsed_s": round(elapsed, 4), "tok_per_s": round(len(prompts) * workload.output_len / elapsed),
            "steps": len(steps), "lead_ms": round(lead, 2), "decode_s": round(decode, 4), "mixed_s": round(mixed, 4),
            "gap_sum_ms": round(sum(g[3] for g in gaps), 2),
            "gap_decode_decode_ms": round(sum(g[3] for g in gaps if g[1] and g[2]), 2),
            "gap_other_ms": round(sum(g[3] for g in gaps if not (g[1] and g[2])), 2),
            "biggest_gaps": [(i, int(a), int(b), round(g, 2)) for i, a, b, g in big],
            "first_steps": [(int(d), round(t, 2)) for d, t in times[:14]],
            "last_steps": [(int(d), round(t, 2)) for d, t in times[-3:]]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv", default="auto")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default="qwen3-0.6b")
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", kv_cache_dtype=args.kv)
    for run in range(args.runs):
        workload = Workload(num_prompts=256, input_len=512, output_len=256, input_len_jitter=0.0, seed=run + 1)
        print(json.dumps({"kv": args.kv, "run": run, **timed_run(llm, workload)}), flush=True)


if __name__ == "__main__":
    main()
