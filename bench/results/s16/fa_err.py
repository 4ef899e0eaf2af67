"""cuBLASLt FP8 row-wise GEMM with and without fast accumulation against the fp32 product of the same e4m3
operands (llama3-8b shapes, N(0, 1) activations, N(0, 0.02) weights)."""
import torch
from pagoda.kernels import fp8
from pagoda.kernels import reference as ref
dev = torch.device("cuda")
g = torch.Generator(device="cuda").manual_seed(0)
for name, (n, k) in {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}.items():
    for m in (256, 8192):
        x = torch.randn(m, k, device=dev, generator=g)
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        xq, xs = fp8.quantize_fp8_rows(x)
        wq, ws = fp8.quantize_fp8_rows(w)
        exact = (xq.float() * xs) @ (wq.float() * ws).t()
        res = []
        for fa in (False, True):
            out = fp8.scaled_mm_rowwise(xq, xs, wq, ws, torch.bfloat16, fast_accum=fa).float()
            cos = torch.nn.functional.cosine_similarity(out, exact, dim=1).min().item()
            rel = ((out - exact).norm() / exact.norm()).item()
            res.append(f"{'fast' if fa else 'exact'}: min row cosine {cos:.7f}, rel err {rel:.2e}")
        print(f"{name} M={m}: " + "; ".join(res), flush=True)
