"""Ad-hoc: pagoda's fused MoE (tuned tiles) vs torch._grouped_mm (CUTLASS) at prefill token counts."""
import json
import os
import sys

import torch
import torch.nn.functional as F

from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.kernels.moe import fused_experts

torch.manual_seed(0)
dev = "cuda"
SHAPES = {  # name: (E, top_k, I, H, always-picked experts at the end)
    "v2lite E=66": (66, 8, 1408, 2048, 2),
    "qwen3-30b E=128": (128, 8, 768, 2048, 0),
    "mixtral E=8": (8, 2, 14336, 4096, 0),
}
rows = []


def route(T, E, k, shared):
    routed = E - shared
    logits = torch.randn(T, routed, device=dev)
    w, ids = torch.topk(logits.softmax(-1), k - shared, dim=-1)
    if shared:
        ids = torch.cat([ids, torch.arange(routed, E, device=dev).expand(T, shared)], 1)
        w = torch.cat([w, torch.ones(T, shared, device=dev)], 1)
    return w.float().contiguous(), ids.int().contiguous()


def gmm_path(x, wgu, wd, w, ids, pad):
    T, k = ids.shape
    E = wgu.shape[0]
    inter = wd.shape[2]
    flat = ids.view(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    if pad:
        padded = (counts + 15) // 16 * 16
        offs = torch.cumsum(padded, 0).int()
        # destination of each sorted pair in the padded layout
        starts = torch.cumsum(padded, 0) - padded
        seg_starts = torch.cumsum(counts, 0) - counts
        sorted_e = flat[order].long()
        dest = starts[sorted_e] + (torch.arange(order.numel(), device=dev) - seg_starts[sorted_e])
        P = T * k + 16 * E
        a = torch.zeros(P, x.shape[1], dtype=x.dtype, device=dev)
        a[dest] = x[order // k]
    else:
        offs = torch.cumsum(counts, 0).int()
        a = x[order // k]
        dest = None
    h = torch._grouped_mm(a, wgu.transpose(1, 2), offs=offs)
    act = F.silu(h[:, :inter]) * h[:, inter:]
    o = torch._grouped_mm(act, wd.transpose(1, 2), offs=offs)
    if dest is not None:
        o = o[dest]
    o = o * w.view(-1)[order, None].to(o.dtype)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=dev)
    out.index_add_(0, order // k, o.float())
    return out.to(x.dtype)


for name, (E, k, inter, H, shared) in SHAPES.items():
    wgu = torch.randn(E, 2 * inter, H, device=dev, dtype=torch.bfloat16) * 0.02
    wd = torch.randn(E, H, inter, device=dev, dtype=torch.bfloat16) * 0.02
    for T in (1024, 4096, 8192, 16384):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        w, ids = route(T, E, k, shared)
        flops = 2 * T * k * 3 * inter * H
        ref = fused_experts(x, wgu, wd, w, ids).float()
        row = {"shape": name, "T": T, "gflop": flops / 1e9}
        try:
            ms = graph_time_ms(lambda: fused_experts(x, wgu, wd, w, ids), reps=5, replays=3)
            row["pagoda_ms"] = ms
            row["pagoda_tflops"] = flops / ms / 1e9
        except Exception as e:  # noqa: BLE001
            row["pagoda_err"] = repr(e)[:200]
        for pad in (False, True):
            key = "gmm_pad" if pad else "gmm"
            try:
                got = gmm_path(x, wgu, wd, w, ids, pad).float()
                row[key + "_relerr"] = ((got - ref).norm() / ref.norm()).item()
                ms = graph_time_ms(lambda: gmm_path(x, wgu, wd, w, ids, pad), reps=5, replays=3)
                row[key + "_ms"] = ms
                row[key + "_tflops"] = flops / ms / 1e9
            except Exception as e:  # noqa: BLE001
                row[key + "_err"] = repr(e)[:300]
        # the two GEMMs alone, sorted input given
        try:
            flat = ids.view(-1)
            order = torch.argsort(flat, stable=True)
            offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).int()
            a = x[order // k]
            act = torch.randn(a.shape[0], inter, device=dev, dtype=torch.bfloat16)

            def gemms():
                torch._grouped_mm(a, wgu.transpose(1, 2), offs=offs)
                torch._grouped_mm(act, wd.transpose(1, 2), offs=offs)
            ms = graph_time_ms(gemms, reps=5, replays=3)
            row["gemms_only_ms"] = ms
            row["gemms_only_tflops"] = flops / ms / 1e9
        except Exception as e:  # noqa: BLE001
            row["gemms_only_err"] = repr(e)[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    del wgu, wd
    torch.cuda.empty_cache()
out = os.environ.get("OUT", "/tmp")
json.dump(rows, open(os.path.join(out, "moe_gmm.json"), "w"), indent=1)
