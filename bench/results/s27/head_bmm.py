# ruff: noqa: B023 - every lambda runs inside graph_time_ms, in its loop iteration
"""Twenty-seventh session probe: MLA's absorbed per-head projections at decode batches (deepseek-v2-lite: 16 heads,
W_UK [128 -> 512] into the query, W_UV [512 -> 128] out of the latent) with the strided operands the model passes,
torch.bmm (cuBLAS: 9.7 / 4.6 us at B=256 in the eager profile, for ~7 MB each) against a Triton tensor-core
kernel per (head, row tile, column tile), each launch on another copy of the weights, 16 launches a graph.

    python3 bench/results/s27/head_bmm.py          (GPU: timings)
    TRITON_INTERPRET=1 python3 bench/results/s27/head_bmm.py --check   (CPU: values only)
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

HEADS, NOPE, ROPE, LAT, V = 16, 128, 64, 512, 128
COPIES = 16


@triton.jit
def _head_mm_kernel(x_ptr, w_ptr, out_ptr, T, K, N, stride_xh, stride_xt, stride_xk, stride_wh, stride_wk,
                    stride_wn, stride_oh, stride_ot, stride_on,
                    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    head = tl.program_id(0).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    t_mask = offs_t < T
    n_mask = offs_n < N
    x_ptrs = x_ptr + head * stride_xh + offs_t[:, None] * stride_xt + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + head * stride_wh + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        x = tl.load(x_ptrs, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    tl.store(out_ptr + head * stride_oh + offs_t[:, None] * stride_ot + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & n_mask[None, :])


def head_mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bt: int, bn: int, bk: int, warps: int,
            stages: int) -> None:
    heads, rows, k = x.shape
    n = w.shape[2]
    _head_mm_kernel[(heads, triton.cdiv(rows, bt), triton.cdiv(n, bn))](
        x, w, out, rows, k, n, *x.stride(), *w.stride(), *out.stride(), BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages)


def operands(rows: int, device: str, dtype: torch.dtype, copies: int):  # noqa: ANN201
    """As models/deepseek.py passes them: q_nope a [heads, T, Dn] view of q [T, heads, Dn + P]; W_UK / W_UV views of
    kv_b [heads, Dn + Dv, R]; out_lat a [heads, T, R] view of [T, heads, R]; attn written through a view."""
    q = torch.randn(rows, HEADS, NOPE + ROPE, device=device).to(dtype)
    q_nope = q[..., :NOPE].transpose(0, 1)  # [h, T, Dn]
    kv_bs = [(torch.randn(HEADS, NOPE + V, LAT, device=device) * 0.05).to(dtype) for _ in range(copies)]
    w_uks = [kv_b[:, :NOPE] for kv_b in kv_bs]  # [h, Dn, R]
    w_uvs = [kv_b[:, NOPE:].transpose(1, 2) for kv_b in kv_bs]  # [h, R, Dv]
    out_lat = torch.randn(rows, HEADS, LAT, device=device).to(dtype).transpose(0, 1)  # [h, T, R]
    q_lat = torch.empty(HEADS, rows, LAT, device=device, dtype=dtype)  # [h, T, R]
    attn = torch.empty(rows, HEADS, V, device=device, dtype=dtype)  # [T, h, Dv]
    return {"uk": (q_nope, w_uks, q_lat), "uv": (out_lat, w_uvs, attn.transpose(0, 1))}


TILES = [(bt, bn, bk, w, s) for bt in (32, 64) for bn in (64, 128, 256) for bk in (64, 128)
         for w, s in ((4, 2), (4, 3))]


def check() -> None:
    sys.path.insert(0, "tests")
    import conftest  # the interpreter's scalar loop-bound fix (numpy >= 2.4)

    conftest._fix_interpreter_scalar_index()
    for rows in (5, 40):
        for name, (x, ws, out) in operands(rows, "cpu", torch.float32, 1).items():
            for bt, bn, bk, w, s in ((16, 32, 32, 4, 2), (32, 64, 64, 4, 2)):
                head_mm(x, ws[0], out, bt, bn, bk, w, s)
                torch.testing.assert_close(out, torch.bmm(x, ws[0]), atol=1e-3, rtol=1e-3)
            print(f"check T={rows} {name}: ok", flush=True)


def main() -> None:
    from pagoda.bench.cuda_timing import graph_time_ms

    for rows in (64, 256):
        for name, (x, ws, out) in operands(rows, "cuda", torch.bfloat16, COPIES).items():
            want = torch.bmm(x, ws[0]).float()
            res = {"bmm": 1000 * graph_time_ms([lambda w=w: torch.bmm(x, w, out=out) for w in ws], reps=10)}
            for tile in TILES:
                try:
                    head_mm(x, ws[0], out, *tile)
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit: skip
                    print(f"skip {tile}: {type(exc).__name__}")
                    continue
                err = (out.float() - want).abs().max().item()
                assert err <= 2e-2 * want.abs().max().item(), (tile, err)
                res[str(tile)] = 1000 * graph_time_ms([lambda w=w: head_mm(x, w, out, *tile) for w in ws], reps=10)
            best = sorted(res.items(), key=lambda kv: kv[1])[:4]
            print(f"T={rows} {name}: bmm {res['bmm']:.2f} us; best " + ", ".join(f"{k} {v:.2f}" for k, v in best),
                  flush=True)


if __name__ == "__main__":
    check() if "--check" in sys.argv else main()
