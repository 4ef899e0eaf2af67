"""Twenty-seventh session probe: where a deepseek-v2-lite prefill step's GPU sits idle. The s13 profile put 150.9
ms of kernels in a 161.8 ms step (32 x 512 new tokens, five steps back to back): ~11 ms of idle GPU a step. Two
steps under torch.profiler (CPU + CUDA); from its trace: the largest gaps between GPU activities with the kernels
on each side, and the CUDA runtime calls that can block the host (synchronize, malloc / free, device-to-host
copies) with their time.

    python3 bench/results/s27/prefill_gaps.py [SEQS LEN]
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
import time

import torch

from pagoda.bench.decode_profile import make_batch
from pagoda.services.worker.models import CausalLM
from pagoda.services.worker.weights import load_model
from pagoda.shared.shapes import SHAPES

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
BLOCKING = ("Synchronize", "cudaMalloc", "cudaFree", "cudaMemcpy", "cudaHostAlloc", "cudaEventSynchronize",
            "cudaStreamWaitEvent", "cudaMemset")


def main() -> None:
    seqs, qlen = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (32, 512)
    arch = SHAPES["deepseek-v2-lite"]
    dev = torch.device("cuda")
    model = CausalLM(arch, torch.bfloat16, dev, max_positions=4096)
    load_model(model, None, "dummy", seed=0)
    with torch.inference_mode():
        meta, pos, nblocks = make_batch([qlen] * seqs, [qlen] * seqs, dev)
        caches = [(torch.zeros(nblocks, 16, 1, arch.mla.entry_dim, device=dev, dtype=torch.bfloat16),)
                  for _ in range(arch.num_layers)]
        ids = torch.randint(0, arch.vocab_size, (seqs * qlen,), device=dev)

        def step() -> torch.Tensor:
            h = model(ids, pos, caches, meta)
            return model.compute_logits(h[meta.query_start_loc[1:] - 1]).argmax(-1)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        for _ in range(3):  # host time to issue a step against its time to finish: equal when something syncs
            start = time.perf_counter()
            step()
            issued = time.perf_counter() - start
            torch.cuda.synchronize()
            print(f"step issued in {issued * 1e3:.2f} ms, done in {(time.perf_counter() - start) * 1e3:.2f} ms",
                  flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS and "dur" in e), key=lambda e: e["ts"])
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    busy = sum(e["dur"] for e in gpu)
    print(f"2 steps: GPU span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, idle {(span - busy) / 1e3:.2f} ms, "
          f"{len(gpu)} activities")
    gaps = []
    for before, after in zip(gpu, gpu[1:], strict=False):
        gap = after["ts"] - (before["ts"] + before["dur"])
        gaps.append((gap, before["name"][:60], after["name"][:60]))
    gaps.sort(reverse=True)
    small = sum(g for g, _, _ in gaps if g < 20)
    print(f"gaps: {sum(1 for g, _, _ in gaps if g >= 20)} of >= 20 us sum "
          f"{sum(g for g, _, _ in gaps if g >= 20) / 1e3:.2f} ms; the rest {small / 1e3:.2f} ms")
    for gap, before, after in gaps[:25]:
        print(f"  {gap:9.1f} us  after {before}  before {after}")
    runtime = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cuda_runtime" and any(b in e["name"] for b in BLOCKING):
            runtime[e["name"]][0] += 1
            runtime[e["name"]][1] += e.get("dur", 0)
    print("runtime calls that can block (count, ms):")
    for name, (count, dur) in sorted(runtime.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:40s} {count:6d} {dur / 1e3:9.3f}")
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and "Launch" in e["name"]]
    print(f"launch calls: {len(launches)}, host time in them {sum(e['dur'] for e in launches) / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
