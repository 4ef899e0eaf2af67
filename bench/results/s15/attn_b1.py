"""Paged attention decode at small batch, llama3-8b heads (32 q / 8 kv / 128), bf16 cache, block 16:
graph-timed per launch shape (splits, tile, warps) incl. the split reduce; outputs checked against splits=1."""
import sys
import torch
from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.kernels.paged_attention import AttentionConfig, paged_attention, pick_config

torch.manual_seed(0)
H, KV, D, BS = 32, 8, 128, 16
COPIES = 8
for B in [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,4").split(",")]:
    for ctx in [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "512,1024,2048").split(",")]:
        seq = ctx + 1
        nblk = -(-seq // BS)
        caches = []
        for _ in range(COPIES):
            k = torch.randn(B * nblk + 4, BS, KV, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            caches.append((k, v))
        bt = torch.randperm(B * nblk, device="cuda", dtype=torch.int32).view(B, nblk)
        sl = torch.full((B,), seq, device="cuda", dtype=torch.int32)
        qsl = torch.arange(B + 1, device="cuda", dtype=torch.int32)
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty_like(q) for _ in range(COPIES)]
        ref = paged_attention(q, *caches[0], bt, sl, qsl, 1, seq, D ** -0.5, config=AttentionConfig(num_splits=1))
        default = pick_config(B, B, KV, H // KV, 1, 8192)
        rows = []
        for splits in (1, 2, 4, 8, 16, 32, 64):
            for tile in (32, 64):
                for warps in (2, 4):
                    cfg = AttentionConfig(num_splits=splits, decode_tile_n=tile, decode_num_warps=warps, heads_fast=True)
                    got = paged_attention(q, *caches[0], bt, sl, qsl, 1, seq, D ** -0.5, config=cfg)
                    err = (got.float() - ref.float()).abs().max().item()
                    calls = [lambda c=c, o=o, cfg=cfg: paged_attention(q, *c, bt, sl, qsl, 1, seq, D ** -0.5, out=o, config=cfg)
                             for c, o in zip(caches, outs)]
                    us = graph_time_ms(calls, reps=15) * 1e3
                    rows.append((us, splits, tile, warps, err))
        rows.sort()
        dcfg = (default.num_splits, default.decode_tile_n, default.decode_num_warps)
        dus = [r[0] for r in rows if (r[1], r[2], r[3]) == dcfg]
        print(f"B={B} ctx={ctx}: default (graph max 8192) splits/tile/warps {dcfg} {dus[0] if dus else float('nan'):.2f} us; best:", flush=True)
        for us, s, t, w, err in rows[:6]:
            print(f"   {us:6.2f} us  splits {s:2d} tile {t} warps {w}  max err {err:.1e}", flush=True)
