"""llama3-8b FP8 linear layers at decode/prefill row counts: cuBLASLt row-wise vs the Triton FP8 GEMM's tiles, and
the fused activation-quant kernels. Times: CUDA graph of (L2 flush + op) minus the flush alone."""
import torch
from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.kernels import fp8
dev = torch.device("cuda")
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
flush_ms = min(graph_time_ms(lambda: flush.zero_(), reps=20) for _ in range(3))
def t_us(fn):
    return (min(graph_time_ms(lambda: (flush.zero_(), fn()), reps=20) for _ in range(2)) - flush_ms) * 1e3
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CANDS = [(64, 64, 4, 4), (64, 128, 4, 4), (64, 128, 4, 5), (64, 128, 8, 4), (64, 256, 8, 3), (128, 64, 4, 4),
         (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3)]
for m in (64, 128, 256, 512):
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device=dev) * 0.05).to(torch.float8_e4m3fn)
        ws = torch.rand(n, 1, device=dev) + 0.5
        a = (torch.randn(m, k, device=dev) * 0.05).to(torch.float8_e4m3fn)
        s_a = torch.rand(m, 1, device=dev) + 0.5
        ref = fp8.scaled_mm_rowwise(a, s_a, w, ws, torch.bfloat16).float()
        cub = t_us(lambda: fp8.scaled_mm_rowwise(a, s_a, w, ws, torch.bfloat16))
        row = []
        for cand in CANDS:
            try:
                out = fp8.fp8_gemm(a, s_a, w, ws, None, torch.bfloat16, block=cand).float()
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                us = t_us(lambda: fp8.fp8_gemm(a, s_a, w, ws, None, torch.bfloat16, block=cand))
                row.append((us, cand, err))
            except Exception as exc:
                row.append((1e9, cand, str(exc)[:40]))
        row.sort(key=lambda r: r[0])
        best = row[0]
        flops = 2 * m * n * k
        print(f"M={m} {name}: cuBLAS {cub:.1f} us ({flops / cub / 1e6:.0f} TF/s); triton best {best[0]:.1f} {best[1]} "
              f"err {best[2] if isinstance(best[2], str) else round(best[2], 5)}; next "
              + " ".join(f"{us:.1f}{c}" for us, c, _ in row[1:4]), flush=True)
print("-- silu_and_mul_quant (I = 14336)")
for m in (256, 4096, 16384):
    gu = torch.randn(m, 2 * 14336, device=dev, dtype=torch.bfloat16)
    gb = gu.numel() * 2 + m * 14336
    for label, kw in (("two-pass 2048 w8", {"tile": 2048, "num_warps": 8}), ("one-pass w8", {"num_warps": 8}),
                      ("one-pass w16", {"num_warps": 16}), ("one-pass w32", {"num_warps": 32})):
        us = t_us(lambda: fp8.silu_and_mul_quant_fp8(gu, **kw))
        print(f"M={m} {label}: {us:.1f} us ({gb / us / 1e6:.2f} TB/s)", flush=True)
    del gu
print("-- add_rms_norm_quant (D = 4096)")
for m in (256, 4096, 16384):
    x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    r = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    wn = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    gb = m * 4096 * 7
    for warps in (4, 8, 16):
        us = t_us(lambda: fp8.add_rms_norm_quant_fp8(x, r, wn, 1e-5, num_warps=warps))
        print(f"M={m} warps {warps}: {us:.1f} us ({gb / us / 1e6:.2f} TB/s)", flush=True)
