"""GPU debugging of kernels/fp8_decode_gluon.py piece by piece (twenty-fourth session): the paged cp.async copy into
the ring, the QK^T fp8 wgmma, the PV fp16 wgmma, each against torch, then the whole kernel and a dump of its first
tile's dots. Ran against 1f42b48-00f8ae7 (the kernel's DEBUG=1 dump and separate K/V rings have since been removed,
so it no longer runs as is); what it found is in bench/RESULTS.md."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                               warpgroup_mma_wait)

from pagoda.kernels.fp8_decode_gluon import _issue_tile

NW = 4


@gluon.jit
def copy_kernel(cache_ptr, table_ptr, out_ptr, stride_b, stride_s, stride_h, kv_head, key_limit, tile,
                BLOCK_SIZE: gl.constexpr, TILE_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    TPW_D: gl.constexpr = HEAD_DIM // 16
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPW_D, TPW_D], [4, 1], [1, 0])
    lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    ring = gl.allocate_shared_memory(gl.float8e4nv, [2, TILE_N, HEAD_DIM], lay)
    ring2 = gl.allocate_shared_memory(gl.float8e4nv, [2, TILE_N, HEAD_DIM], lay)
    _issue_tile(ring.index(1), ring2.index(1), cache_ptr, cache_ptr, table_ptr, tile, key_limit, kv_head,
                stride_b, stride_s, stride_h, stride_b, stride_s, stride_h, BLOCK_SIZE, TILE_N, HEAD_DIM, copy_layout)
    async_copy.wait_group(0)
    gl.thread_barrier()
    x = ring.index(1).load(copy_layout)
    r = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, copy_layout))
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, copy_layout))
    gl.store(out_ptr + gl.expand_dims(r, 1) * HEAD_DIM + gl.expand_dims(c, 0), x)


@gluon.jit
def qk_kernel(k_ptr, q_ptr, s_ptr, TILE_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 32])
    lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    r = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, copy_layout))
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, copy_layout))
    k = gl.load(k_ptr + gl.expand_dims(r, 1) * HEAD_DIM + gl.expand_dims(c, 0))
    rq = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, copy_layout))
    q = gl.load(q_ptr + gl.expand_dims(rq, 1) * HEAD_DIM + gl.expand_dims(c, 0))
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [TILE_N, HEAD_DIM], lay, k)
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_M, HEAD_DIM], lay, q)
    fence_async_shared()
    gl.thread_barrier()
    s = warpgroup_mma(k_smem, q_smem.permute((1, 0)), gl.zeros([TILE_N, BLOCK_M], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s, ))
    rs = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, s_layout))
    cs = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    gl.store(s_ptr + gl.expand_dims(rs, 1) * BLOCK_M + gl.expand_dims(cs, 0), s)


@gluon.jit
def pv_kernel(v_ptr, p_ptr, o_ptr, TILE_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    p_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    v_lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_M * 2, 128), element_bitwidth=16, rank=2)
    r = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, copy_layout))
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, copy_layout))
    v = gl.load(v_ptr + gl.expand_dims(r, 1) * HEAD_DIM + gl.expand_dims(c, 0))
    rp = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, p_layout))
    cp = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, p_layout))
    p = gl.load(p_ptr + gl.expand_dims(rp, 1) * BLOCK_M + gl.expand_dims(cp, 0))
    v_smem = gl.allocate_shared_memory(gl.float16, [TILE_N, HEAD_DIM], v_lay, v)
    p_smem = gl.allocate_shared_memory(gl.float16, [TILE_N, BLOCK_M], p_lay, p)
    fence_async_shared()
    gl.thread_barrier()
    o = warpgroup_mma(v_smem.permute((1, 0)), p_smem, gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, o_layout),
                      use_acc=False, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o, ))
    ro = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, o_layout))
    co = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_ptr + gl.expand_dims(ro, 1) * BLOCK_M + gl.expand_dims(co, 0), o)


@gluon.jit
def pstore_kernel(v_ptr, p_ptr, o_ptr, VIA_BLOCKED: gl.constexpr, TILE_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                  BLOCK_M: gl.constexpr):
    """pv_kernel with p loaded straight into the QK accumulator's layout and stored to shared memory from there
    (stmatrix), or through a blocked layout first."""
    copy_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    p_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    v_lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_lay: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(BLOCK_M * 2, 128), element_bitwidth=16, rank=2)
    r = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, copy_layout))
    c = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, copy_layout))
    v = gl.load(v_ptr + gl.expand_dims(r, 1) * HEAD_DIM + gl.expand_dims(c, 0))
    rp = gl.arange(0, TILE_N, layout=gl.SliceLayout(1, s_layout))
    cp = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    p = gl.load(p_ptr + gl.expand_dims(rp, 1) * BLOCK_M + gl.expand_dims(cp, 0))
    v_smem = gl.allocate_shared_memory(gl.float16, [TILE_N, HEAD_DIM], v_lay, v)
    p_smem = gl.allocate_shared_memory(gl.float16, [TILE_N, BLOCK_M], p_lay)
    if VIA_BLOCKED:
        p_smem.store(gl.convert_layout(p, p_layout))
    else:
        p_smem.store(p)
    fence_async_shared()
    gl.thread_barrier()
    o = warpgroup_mma(v_smem.permute((1, 0)), p_smem, gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, o_layout),
                      use_acc=False, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o, ))
    ro = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, o_layout))
    co = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, o_layout))
    gl.store(o_ptr + gl.expand_dims(ro, 1) * BLOCK_M + gl.expand_dims(co, 0), o)


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    D, T, M = 128, 64, 16
    # copy
    cache = torch.randint(0, 120, (40, 16, 2, D), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    table = torch.randperm(40, device=dev).int()
    out = torch.zeros(T, D, dtype=torch.uint8, device=dev)
    for tile, limit in ((1, 200), (2, 140)):
        out.zero_()
        copy_kernel[(1, )](cache, table, out.view(torch.float8_e4m3fn), *cache.stride()[:3], 1, limit, tile,
                           BLOCK_SIZE=16, TILE_N=T, HEAD_DIM=D, num_warps=NW)
        keys = torch.arange(tile * T, tile * T + T, device=dev)
        ok = keys < limit
        blocks = table[(keys // 16).clamp(max=39)].long()
        want = cache.view(torch.uint8)[blocks, keys % 16, 1] * ok[:, None]
        print("copy tile", tile, "limit", limit, "equal", torch.equal(out, want),
              "mismatched rows", (out != want).any(1).sum().item())
    # qk
    k = (torch.randn(T, D, device=dev) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    q = (torch.randn(M, D, device=dev) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.zeros(T, M, device=dev)
    qk_kernel[(1, )](k, q, s, TILE_N=T, HEAD_DIM=D, BLOCK_M=M, num_warps=NW)
    want = k.float() @ q.float().T
    print("qk rel err", ((s - want).abs().max() / want.abs().max()).item())
    # pv
    v = torch.randn(T, D, device=dev).half()
    p = torch.rand(T, M, device=dev).half()
    o = torch.zeros(D, M, device=dev)
    pv_kernel[(1, )](v, p, o, TILE_N=T, HEAD_DIM=D, BLOCK_M=M, num_warps=NW)
    want = v.float().T @ p.float()
    print("pv rel err", ((o - want).abs().max() / want.abs().max()).item())
    for via in (False, True):
        o.zero_()
        pstore_kernel[(1, )](v, p, o, VIA_BLOCKED=via, TILE_N=T, HEAD_DIM=D, BLOCK_M=M, num_warps=NW)
        print("p stored from the mma layout", "via blocked" if via else "directly (stmatrix)", "rel err",
              ((o - want).abs().max() / want.abs().max()).item())

    # the whole kernel on tiny cases: one key (out = v_0 exactly), one tile, two tiles
    import sys
    sys.path.insert(0, "/tmp/tests-path")
    from tests.test_kv_fp8 import SCALE, _fp8_case, _run
    from pagoda.kernels import reference as ref
    from pagoda.kernels.paged_attention import AttentionConfig
    cfg = AttentionConfig(fp8_convert="qk_fp8x2", decode_keys_on_m=True, decode_lazy_sum=True, decode_pipelined=True)
    tri = AttentionConfig(fp8_convert="qk_fp8x2", decode_keys_on_m=True, decode_lazy_sum=True)
    import os
    for lens in ([] if os.environ.get("DUMP_ONLY") else ([1], [2], [64], [65], [128], [200])):
        case = _fp8_case([1] * len(lens), lens, torch.bfloat16, num_heads=8, num_kv_heads=2, head_dim=128, seed=3,
                         gaussian=True)
        exp = ref.paged_attention(case["q"].float(), case["k_cache"], case["v_cache"], case["block_tables"],
                                  case["seq_lens"], case["query_lens"], SCALE, k_scale=case["k_scale"],
                                  v_scale=case["v_scale"])
        g, t = _run(case, cfg), _run(case, tri)
        same_q = {**case, "q": case["q"][:, :1].expand_as(case["q"]).contiguous()}
        exp_same = ref.paged_attention(same_q["q"].float(), case["k_cache"], case["v_cache"], case["block_tables"],
                                       case["seq_lens"], case["query_lens"], SCALE, k_scale=case["k_scale"],
                                       v_scale=case["v_scale"])
        print("lens", lens, "every head's q the same: gluon err",
              ((_run(same_q, cfg) - exp_same).abs().max() / exp_same.abs().max()).item())
        print("lens", lens, "gluon err", ((g - exp).abs().max() / exp.abs().max()).item(), "triton err",
              ((t - exp).abs().max() / exp.abs().max()).item())
        if lens == [1]:
            print(" head errs", (g - exp).abs().amax(-1))

    # the first tile's raw dots of program (kv head 0, sequence 0) against torch
    from pagoda.kernels import fp8_decode_gluon as fg
    case = _fp8_case([1], [64], torch.bfloat16, num_heads=8, num_kv_heads=2, head_dim=128, seed=3, gaussian=True)
    q = case["q"].to(dev)
    kc, vc = case["k_cache"].to(dev), case["v_cache"].to(dev)
    table, lens_t, qsl = case["block_tables"].to(dev), torch.tensor([64], dtype=torch.int32, device=dev), case["qsl"].to(dev)
    dbg = torch.zeros(4096, device=dev)
    out = torch.zeros_like(q)
    ks, vs = case["k_scale"].to(dev), case["v_scale"].to(dev)
    fg.fp8_decode_kernel[(1, 1, 1)](out, q, kc, vc, table, lens_t, qsl, dbg, dbg, dbg, ks, vs, 0.5, 1, 1,
                                     q.stride(0), q.stride(1), out.stride(0), out.stride(1), *kc.stride()[:3],
                                     *vc.stride()[:3], table.stride(0), NUM_HEADS=8, GROUP=4, HEAD_DIM=128,
                                     BLOCK_SIZE=16, BLOCK_M=16, TILE_N=64, NUM_SPLITS=1, STAGES=2, USE_PDL=0,
                                     DEBUG=1, num_warps=4)
    torch.cuda.synchronize()
    s_hi = dbg[:1024].view(64, 16)
    s_lo = dbg[1024:2048].view(64, 16)
    sc = dbg[2048:2080].view(2, 16)
    q0 = q[0, :4].float()  # kv head 0's group
    amax = q0.abs().amax(1)
    hi = (q0 * (448.0 / amax)[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    res = q0 - hi.float() * (amax / 448.0)[:, None]
    amax_lo = res.abs().amax(1)
    lo = (res * (448.0 / amax_lo)[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    keys = torch.arange(64, device=dev)
    k_rows = kc[table[0, keys // 16].long(), keys % 16, 0].float()  # [64, D]
    want_hi = k_rows @ hi.float().T  # [64, 4]
    want_lo = k_rows @ lo.float().T
    print("raw hi dots rel err", ((s_hi[:, :4] - want_hi).abs().max() / want_hi.abs().max()).item())
    print("raw lo dots rel err", ((s_lo[:, :4] - want_lo).abs().max() / want_lo.abs().max()).item())
    print("scales hi", sc[0, :4].tolist(), "want", (amax / 448.0 * 0.5 * case["k_scale"].item()).tolist())
    print("scales lo", sc[1, :4].tolist(), "want", (amax_lo / 448.0 * 0.5 * case["k_scale"].item()).tolist())
    print("dots hi [:3,:4]", s_hi[:3, :4].tolist(), "want", want_hi[:3].tolist())


if __name__ == "__main__":
    main()
