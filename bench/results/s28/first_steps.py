"""Twenty-eighth session probe: the first timed run of the deepseek-v2-lite reference spends ~47 ms more in its last
prefill-carrying step than later runs (call 6: 68.2 ms against ~21 ms of GPU time; no Triton compile logged). This
runs the reference's prompts (16 new tokens: the same 9 prefill-carrying steps) twice under torch.profiler, after
the bench's own 4-prompt warm-up, each step inside a record_function range, and prints for the chosen steps of
each run: the host time, the GPU busy time (runtime and driver launches), and the longest host-side runtime /
driver calls and CPU ops inside the step (cudaMalloc, module loads, synchronizations).

    python3 bench/results/s28/first_steps.py [--steps 8]

(After call 10 it also lists the runtime / driver calls inside the step's longest host op; not run since.)
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
from dataclasses import replace
from typing import Any

import torch

from pagoda.bench.workload import preset

STEP = "pagoda_step_"


def report(events: list[dict[str, Any]], steps: list[int], label: str) -> None:
    ranges = {int(e["name"][len(STEP):]): (e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("cat") == "user_annotation" and e.get("name", "").startswith(STEP)}
    corr_step = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            for step, (lo, hi) in ranges.items():
                if lo <= e["ts"] <= hi:
                    corr_step[e["args"]["correlation"]] = step
                    break
    busy: dict[int, float] = collections.defaultdict(float)
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            step = corr_step.get(e.get("args", {}).get("correlation"))
            if step is not None:
                busy[step] += e["dur"] / 1e3
    for step in steps:
        if step not in ranges:
            continue
        lo, hi = ranges[step]
        print(f"[{label}] step {step}: host {1e-3 * (hi - lo):.2f} ms, GPU busy {busy[step]:.2f} ms")
        calls: dict[str, list[float]] = collections.defaultdict(list)
        for e in events:
            if e.get("cat") in ("cuda_runtime", "cuda_driver", "cpu_op") and "dur" in e and lo <= e["ts"] <= hi:
                calls[f"{e['cat']}:{e['name'][:60]}"].append(e["dur"] / 1e3)
        top = sorted(calls.items(), key=lambda kv: -max(kv[1]))[:14]
        for name, durs in top:
            print(f"    max {max(durs):8.3f} ms  total {sum(durs):8.3f}  x{len(durs):<5} {name}")
        ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e and lo <= e["ts"] <= hi]
        if ops:  # what the longest op spent its host time on: the runtime / driver calls inside it
            worst = max(ops, key=lambda e: e["dur"])
            inside = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e
                             and worst["ts"] <= e["ts"] <= worst["ts"] + worst["dur"]), key=lambda e: -e["dur"])
            print(f"    longest op {worst['name'][:50]} {worst['dur'] / 1e3:.3f} ms; calls inside it:")
            for e in inside[:8]:
                print(f"      {e['dur'] / 1e3:8.3f} ms  {e['cat']}:{e['name'][:60]}")


def main() -> None:
    from pagoda import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[8])
    args = parser.parse_args()
    llm = LLM("deepseek-v2-lite", load_format="dummy")
    runner = llm.engine.runner
    launch = runner._launch
    count = [0]

    def traced_launch(sent: Any) -> bool:  # noqa: ANN401
        with torch.profiler.record_function(f"{STEP}{count[0]}"):
            count[0] += 1
            return launch(sent)

    for run in range(2):
        workload = replace(preset("reference"), output_len=16, seed=7919 * run)
        warm = replace(workload, seed=workload.seed + 1, num_prompts=4).prompts(runner.arch.vocab_size)
        llm.generate(warm, [SamplingParams(max_tokens=4, ignore_eos=True)] * len(warm))
        prompts = workload.prompts(runner.arch.vocab_size)
        count[0] = 0
        runner._launch = traced_launch
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            llm.generate(prompts, [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts))
            torch.cuda.synchronize()
        runner._launch = launch
        path = tempfile.mktemp(suffix=".json")
        prof.export_chrome_trace(path)
        with open(path) as trace:
            report(json.load(trace)["traceEvents"], args.steps, f"run {run + 1}")


if __name__ == "__main__":
    main()
