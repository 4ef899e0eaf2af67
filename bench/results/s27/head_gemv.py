# ruff: noqa: B023 - every lambda runs inside graph_time_ms, in its loop iteration
"""Twenty-seventh session probe: MLA's absorbed per-head projections at one row (deepseek-v2-lite: 16 heads,
W_UK [128 -> 512] into the query, W_UV [512 -> 128] out of the latent), torch.bmm against kernels/gemv.head_gemv
and its launch variants, each launch on another copy of the weights (no L2 hits), 32 launches a graph.

    python3 bench/results/s27/head_gemv.py
"""

from __future__ import annotations

import torch
import triton

from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.kernels import gemv

HEADS, NOPE, LAT, V = 16, 128, 512, 128
COPIES = 32


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_n: int, block_k: int, warps: int) -> None:
    heads, rows, k = x.shape
    n = w.shape[2]
    gemv._head_gemv_kernel[(heads, triton.cdiv(n, block_n))](
        x, w, out, rows, k, n, *x.stride(), *w.stride(), *out.stride(), BLOCK_T=triton.next_power_of_2(rows),
        BLOCK_N=block_n, BLOCK_K=block_k, USE_PDL=False, num_warps=warps)


def main() -> None:
    dev = torch.device("cuda")
    w_uk = [(torch.randn(HEADS, NOPE, LAT, device=dev) * 0.05).bfloat16() for _ in range(COPIES)]  # [h, Dn, R]
    w_uv = [(torch.randn(HEADS, V, LAT, device=dev) * 0.05).bfloat16() for _ in range(COPIES)]  # [h, Dv, R]
    for rows in (1,):
        q = torch.randn(HEADS, rows, NOPE, device=dev).bfloat16()  # [h, T, Dn]
        lat = torch.randn(HEADS, rows, LAT, device=dev).bfloat16()  # [h, T, R]
        cases = {"uk": (q, w_uk, lambda w: w), "uv": (lat, w_uv, lambda w: w.transpose(1, 2))}
        for name, (x, ws, view) in cases.items():
            want = torch.bmm(x, view(ws[0])).float()
            n = view(ws[0]).shape[2]
            out = torch.empty(HEADS, rows, n, dtype=x.dtype, device=dev)
            res = {"bmm": 1000 * graph_time_ms([lambda w=w: torch.bmm(x, view(w), out=out) for w in ws], reps=10),
                   "head_gemv": 1000 * graph_time_ms([lambda w=w: gemv.head_gemv(x, view(w), out=out) for w in ws],
                                                     reps=10)}
            for block_n in (8, 16, 32, 64):
                for block_k in (64, 128, 256, 512):
                    for warps in (2, 4):
                        if block_n * block_k > 16384:
                            continue
                        label = f"n{block_n} k{block_k} w{warps}"
                        launch(x, view(ws[0]), out, block_n, block_k, warps)
                        err = (out.float() - want).abs().max().item()
                        assert err < 2e-2 * want.abs().max().item() + 1e-3, (label, err)
                        res[label] = 1000 * graph_time_ms(
                            [lambda w=w, b=(block_n, block_k, warps): launch(x, view(w), out, *b) for w in ws],
                            reps=10)
            best = sorted(res.items(), key=lambda kv: kv[1])[:5]
            print(f"T={rows} {name}: bmm {res['bmm']:.2f} us, head_gemv {res['head_gemv']:.2f} us; best "
                  + ", ".join(f"{k} {v:.2f}" for k, v in best), flush=True)


if __name__ == "__main__":
    main()
