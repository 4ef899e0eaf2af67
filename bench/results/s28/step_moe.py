"""Twenty-eighth session probe: why the reference's step 5 runs its grouped GEMMs ~12 ms slower than step 4
(call 1: engine_steps.py, cutlass sm90 kernel +12.2 ms, flash_fwd +1.1 ms). Runs the reference's prompts (16 new
tokens) twice on deepseek-v2-lite: (1) under torch.profiler, attributing every GPU activity (runtime AND driver
launches, so Triton kernels count) to its step, printing per step the kernel time by family and, for steps A and B,
every grouped-GEMM instance's duration in launch order; (2) with _fused_experts_gmm wrapped to record each call's
per-expert pair counts and token count on the device, printing per step the max / mean rows an expert and the
imbalance of the routed experts.

    python3 bench/results/s28/step_moe.py [--steps 9] [--diff 4 5]
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
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def gpu_by_step(events: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    ranges = sorted((e["ts"], e["ts"] + e["dur"], int(e["name"][len(STEP):])) for e in events
                    if e.get("cat") == "user_annotation" and e.get("name", "").startswith(STEP))
    calls = sorted((e["ts"], e["args"]["correlation"]) for e in events
                   if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {}))
    step_of, i = {}, 0
    for ts, corr in calls:
        while i < len(ranges) and ranges[i][1] < ts:
            i += 1
        if i < len(ranges) and ranges[i][0] <= ts <= ranges[i][1]:
            step_of[corr] = ranges[i][2]
    out: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in GPU_CATS and "dur" in e:
            step = step_of.get(e.get("args", {}).get("correlation"))
            if step is not None:
                out[step].append(e)
    for acts in out.values():
        acts.sort(key=lambda e: e["ts"])
    return out


def family(name: str) -> str:
    for key, label in (("cutlass", "grouped_mm"), ("flash_fwd", "flash"), ("nvjet", "cublas"), ("gemm", "cublas"),
                       ("_mla", "mla_triton"), ("moe", "moe_triton"), ("gather_sorted", "moe_triton"),
                       ("combine", "moe_triton"), ("align", "moe_triton")):
        if key in name:
            return label
    return "other"


def main() -> None:
    from pagoda import LLM, SamplingParams
    from pagoda.kernels import moe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v2-lite")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--diff", type=int, nargs=2, default=(4, 5))
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy")
    runner = llm.engine.runner
    workload = replace(preset("reference"), output_len=16)
    warm = replace(workload, seed=workload.seed + 1, num_prompts=4).prompts(runner.arch.vocab_size)
    llm.generate(warm, [SamplingParams(max_tokens=4, ignore_eos=True)] * len(warm))
    prompts = workload.prompts(runner.arch.vocab_size)
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts)

    launch = runner._launch
    count = [0]

    def traced_launch(sent: Any) -> bool:  # noqa: ANN401
        with torch.profiler.record_function(f"{STEP}{count[0]}"):
            count[0] += 1
            return launch(sent)

    runner._launch = traced_launch
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    with open(path) as trace:
        steps = gpu_by_step(json.load(trace)["traceEvents"])
    fams = ("grouped_mm", "flash", "cublas", "mla_triton", "moe_triton", "other")
    print("step  busy ms " + " ".join(f"{f:>10}" for f in fams))
    for step in sorted(steps)[:args.steps]:
        by = collections.defaultdict(float)
        for e in steps[step]:
            by[family(e["name"])] += e["dur"] / 1e3
        print(f"{step:>4} {sum(by.values()):8.2f} " + " ".join(f"{by[f]:10.2f}" for f in fams))
    for step in args.diff:
        gmm = [round(e["dur"]) for e in steps.get(step, []) if "cutlass" in e["name"]]
        print(f"step {step} grouped_mm us ({len(gmm)}): {gmm}")
    a, b = args.diff
    ka, kb = collections.defaultdict(float), collections.defaultdict(float)
    for e in steps.get(a, []):
        ka[e["name"][:80]] += e["dur"]
    for e in steps.get(b, []):
        kb[e["name"][:80]] += e["dur"]
    print(f"-- step {b} minus step {a}, largest (us):")
    for us, name in sorted(((kb[k] - ka[k], k) for k in set(ka) | set(kb)), reverse=True)[:12]:
        print(f"   {us:9.1f}  {name}")

    # (2) the routing each grouped-GEMM call saw
    runner._launch = launch
    gmm = moe._fused_experts_gmm
    counts: list[torch.Tensor] = []

    def recorded(x, w_gate_up, w_down, weights, topk_ids):  # noqa: ANN001, ANN202
        counts.append(torch.bincount(topk_ids.view(-1).long(), minlength=w_gate_up.shape[0]))
        return gmm(x, w_gate_up, w_down, weights, topk_ids)

    moe._fused_experts_gmm = recorded
    try:
        llm.generate(prompts, params)
    finally:
        moe._fused_experts_gmm = gmm
    layers = len(runner.arch.moe.sparse_layers)
    stacked = torch.stack(counts).float().cpu()  # [calls, E]
    print(f"{len(counts)} grouped-GEMM calls, {layers} a step assumed")
    for step in range(len(counts) // layers):
        block = stacked[step * layers:(step + 1) * layers]  # [layers, E]
        routed = block[:, :-2] if block.shape[1] == 66 else block
        print(f"step {step}: pairs {int(block[0].sum())}  routed max {routed.max(1).values.mean():.0f} "
              f"mean {routed.mean():.0f} (max/mean {(routed.max(1).values / routed.mean(1)).mean():.2f}; "
              f"worst layer {(routed.max(1).values / routed.mean(1)).max():.2f}) min {routed.min(1).values.mean():.0f}")


if __name__ == "__main__":
    main()
