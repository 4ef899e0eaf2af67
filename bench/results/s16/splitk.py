"""The Triton FP8 GEMM with split-K (partials summed by a second kernel) against cuBLASLt, llama3-8b shapes; then
the fused quant kernels after the one-pass / hardware-cast change."""
import torch
from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.kernels import fp8
dev = torch.device("cuda")
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
flush_ms = min(graph_time_ms(lambda: flush.zero_(), reps=20) for _ in range(3))
def t_us(fn):
    return (min(graph_time_ms(lambda: (flush.zero_(), fn()), reps=20) for _ in range(2)) - flush_ms) * 1e3
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}
CANDS = [((64, 128, 4, 5), 2), ((64, 128, 4, 5), 4), ((128, 128, 8, 3), 2), ((128, 128, 8, 3), 4),
         ((64, 64, 4, 4), 2), ((128, 64, 4, 4), 2), ((128, 128, 8, 4), 2), ((64, 128, 4, 4), 3)]
for m in (64, 128, 256):
    for name, (n, k) in SHAPES.items():
        if name == "gate_up" and m < 256:
            continue
        w = (torch.randn(n, k, device=dev) * 0.05).to(torch.float8_e4m3fn)
        ws = torch.rand(n, 1, device=dev) + 0.5
        a = (torch.randn(m, k, device=dev) * 0.05).to(torch.float8_e4m3fn)
        s_a = torch.rand(m, 1, device=dev) + 0.5
        ref = fp8.scaled_mm_rowwise(a, s_a, w, ws, torch.bfloat16).float()
        cub = t_us(lambda: fp8.scaled_mm_rowwise(a, s_a, w, ws, torch.bfloat16))
        row = []
        for cand, split in CANDS:
            out = fp8.fp8_gemm(a, s_a, w, ws, None, torch.bfloat16, block=cand, split_k=split).float()
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            us = t_us(lambda: fp8.fp8_gemm(a, s_a, w, ws, None, torch.bfloat16, block=cand, split_k=split))
            row.append((us, cand, split, err))
        row.sort(key=lambda r: r[0])
        print(f"M={m} {name}: cuBLAS {cub:.1f} us; split-K best {row[0][0]:.1f} {row[0][1]} x{row[0][2]} "
              f"(err {row[0][3]:.4f}); next " + " ".join(f"{us:.1f}{c}x{s}" for us, c, s, _ in row[1:4]), flush=True)
print("-- silu_and_mul_quant (I = 14336), one pass + hardware cast")
for m in (256, 4096, 16384):
    gu = torch.randn(m, 2 * 14336, device=dev, dtype=torch.bfloat16)
    gb = gu.numel() * 2 + m * 14336
    for label, kw in (("default", {}), ("one-pass w8", {"num_warps": 8}), ("two-pass 2048 w8", {"tile": 2048, "num_warps": 8})):
        us = t_us(lambda: fp8.silu_and_mul_quant_fp8(gu, **kw))
        print(f"M={m} {label}: {us:.1f} us ({gb / us / 1e6:.2f} TB/s)", flush=True)
    del gu
print("-- add_rms_norm_quant (D = 4096), hardware cast")
for m in (256, 16384):
    x = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    r = torch.randn(m, 4096, device=dev, dtype=torch.bfloat16)
    wn = torch.randn(4096, device=dev, dtype=torch.bfloat16)
    gb = m * 4096 * 7
    for warps in (4, 8, 16):
        us = t_us(lambda: fp8.add_rms_norm_quant_fp8(x, r, wn, 1e-5, num_warps=warps))
        print(f"M={m} warps {warps}: {us:.1f} us ({gb / us / 1e6:.2f} TB/s)", flush=True)
