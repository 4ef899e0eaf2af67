"""Twenty-seventh session probe (prepared for the next device time): the engine's prefill-carrying steps kernel by
kernel, as the engine runs them. In the deepseek-v2-lite reference workload, step 5 took 180-188 ms of GPU time
(the step timer's events) where the same step replayed alone took 157.3 ms of kernels (bench/results/s27/
mixed_steps.py --reference-steps, call 8); steps 4 and 6 differ by ~4 and ~8-15 ms. This runs the reference's
prompts with 16 new tokens each (its prefill-carrying steps are planned the same: no sequence finishes before
they end) under torch.profiler, each ModelRunner._launch inside a record_function range, and attributes every GPU
activity to its step through the launch's correlation id. Per step: the runner's host time, kernel time, the GPU
span from its first to its last activity and the idle time inside it, against the step timer; then the largest
kernel differences of step 5 (--diff) against step 4.

    python3 bench/results/s27/engine_steps.py [--model deepseek-v2-lite] [--num-prompts 256] [--steps 12]
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
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def step_of_runtime_calls(events: list[dict[str, Any]]) -> dict[int, int]:
    """correlation id -> step index, for every runtime call made inside a step's range."""
    ranges = sorted((e["ts"], e["ts"] + e["dur"], int(e["name"][len(STEP):])) for e in events
                    if e.get("cat") == "user_annotation" and e.get("name", "").startswith(STEP))
    calls = sorted((e["ts"], e["args"]["correlation"]) for e in events
                   if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}))
    out, i = {}, 0
    for ts, corr in calls:
        while i < len(ranges) and ranges[i][1] < ts:
            i += 1
        if i < len(ranges) and ranges[i][0] <= ts <= ranges[i][1]:
            out[corr] = ranges[i][2]
    return out


def per_step(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    steps_of = step_of_runtime_calls(events)
    host = {int(e["name"][len(STEP):]): e["dur"] for e in events
            if e.get("cat") == "user_annotation" and e.get("name", "").startswith(STEP)}
    gpu: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in GPU_CATS and "dur" in e:
            step = steps_of.get(e.get("args", {}).get("correlation"))
            if step is not None:
                gpu[step].append(e)
    out = {}
    for step, acts in sorted(gpu.items()):
        acts.sort(key=lambda e: e["ts"])
        busy = sum(e["dur"] for e in acts)
        span = acts[-1]["ts"] + acts[-1]["dur"] - acts[0]["ts"]
        kernels: dict[str, float] = collections.defaultdict(float)
        for e in acts:
            kernels[e["name"][:70]] += e["dur"]
        out[step] = {"host_ms": host.get(step, 0) / 1e3, "busy_ms": busy / 1e3, "span_ms": span / 1e3,
                     "activities": len(acts), "kernels": kernels}
    return out


def main() -> None:
    from pagoda import LLM, SamplingParams
    from pagoda.services.worker.model_runner import StepTimer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v2-lite")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=12, help="print the first this many steps")
    parser.add_argument("--diff", type=int, nargs=2, default=(4, 5), help="kernel differences of step B minus A")
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy")
    runner = llm.engine.runner
    workload = replace(preset("reference"), num_prompts=args.num_prompts, input_len=args.input_len,
                       output_len=args.output_len)
    warm = replace(workload, seed=workload.seed + 1, num_prompts=4).prompts(runner.arch.vocab_size)
    llm.generate(warm, [SamplingParams(max_tokens=4, ignore_eos=True)] * len(warm))
    prompts = workload.prompts(runner.arch.vocab_size)
    params = [SamplingParams(max_tokens=args.output_len, ignore_eos=True)] * len(prompts)

    launch = runner._launch
    count = [0]

    def traced_launch(sent: Any) -> bool:  # noqa: ANN401 - the runner's StepPlan
        with torch.profiler.record_function(f"{STEP}{count[0]}"):
            count[0] += 1
            return launch(sent)

    runner._launch = traced_launch
    on_gpu = runner.device.type == "cuda"
    timer = runner.step_timer = StepTimer() if on_gpu else None
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts, params)
        if on_gpu:
            torch.cuda.synchronize()
    runner._launch, runner.step_timer = launch, None
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    with open(path) as trace:
        steps = per_step(json.load(trace)["traceEvents"])
    timed = [start.elapsed_time(end) for _, start, end in timer.steps] if timer is not None else []
    print(f"{count[0]} steps launched; {len(steps)} with GPU activity")
    print(f"{'step':>4} {'host ms':>8} {'busy ms':>8} {'span ms':>8} {'idle ms':>8} {'timer ms':>9} {'acts':>6}")
    for step, row in list(steps.items())[:args.steps]:
        timer_ms = f"{timed[step]:9.2f}" if step < len(timed) else f"{'':>9}"
        print(f"{step:>4} {row['host_ms']:8.2f} {row['busy_ms']:8.2f} {row['span_ms']:8.2f} "
              f"{row['span_ms'] - row['busy_ms']:8.2f} {timer_ms} {row['activities']:>6}")
    a, b = args.diff
    if a in steps and b in steps:
        ka, kb = steps[a]["kernels"], steps[b]["kernels"]
        diffs = sorted(((kb.get(k, 0) - ka.get(k, 0), k) for k in set(ka) | set(kb)), reverse=True)
        print(f"-- step {b} minus step {a}, largest (us):")
        for us, name in diffs[:16]:
            print(f"   {us:9.1f}  {name}")


if __name__ == "__main__":
    main()
