"""Twenty-seventh session probe: deepseek-v2-lite's MoE GEMVs at one token (6 routed + 2 shared experts, the
experts fused as E = 66), gate_up (SiLU fused) and down (the pairs summed) timed apart over a wider tile set than
bench/moe_tune.py's, each launch with other experts (16 routings cycled in one graph, so no launch finds its
weights in L2), against cuBLAS reading the same bytes as one matrix.

    python3 bench/results/s27/moe_b1.py
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.kernels import moe

E, H, INTER, TOP_K = 66, 2048, 1408, 8
ROUTINGS = 16


def routings(device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(ROUTINGS):
        ids = torch.cat((torch.randperm(64, device=device)[:6], torch.tensor([64, 65], device=device)))
        weights = torch.rand(1, TOP_K, device=device)
        out.append((ids.view(1, TOP_K).int(), weights))
    return out


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w_gate_up = (torch.randn(E, 2 * INTER, H, device=dev) * 0.02).bfloat16()  # [E, 2I, H]
    w_down = (torch.randn(E, H, INTER, device=dev) * 0.02).bfloat16()  # [E, H, I]
    x = torch.randn(1, H, device=dev).bfloat16()
    act = torch.randn(TOP_K, INTER, device=dev).bfloat16()
    routes = routings(dev)
    gate_bytes = TOP_K * 2 * INTER * H * 2
    down_bytes = TOP_K * H * INTER * 2

    def time_tile(which: str, tile: moe.GemvConfig) -> float:
        if which == "gate_up":
            out = torch.empty(TOP_K, INTER, dtype=x.dtype, device=dev)
            calls = [lambda ids=ids: moe._moe_gemv(x, w_gate_up, None, H, ids, out, TOP_K, True, None, tile)
                     for ids, _ in routes]
        else:
            out = torch.empty(1, H, dtype=x.dtype, device=dev)
            calls = [lambda ids=ids, w=w: moe._moe_gemv(act, w_down, None, INTER, ids, out, 1, False, w.view(-1), tile)
                     for ids, w in routes]
        return 1000 * graph_time_ms(calls, reps=10)

    # the same bytes as one cuBLAS GEMV, rotating copies
    for name, rows, k in (("gate_up", TOP_K * 2 * INTER, H), ("down", TOP_K * H, INTER)):
        ws = [(torch.randn(rows, k, device=dev) * 0.02).bfloat16() for _ in range(4)]
        xi = torch.randn(1, k, device=dev).bfloat16()
        us = 1000 * graph_time_ms([lambda w=w, xi=xi: F.linear(xi, w) for w in ws] * 4, reps=10)
        print(f"cublas {name:8s} {rows}x{k}: {us:7.2f} us  {rows * k * 2 / us / 1e6:5.2f} TB/s", flush=True)
        del ws

    up_tile, down_tile = moe.pick_tiles(1, TOP_K, E, INTER, H, torch.bfloat16, dev)
    up_us, down_us = time_tile("gate_up", up_tile), time_tile("down", down_tile)
    print(f"tuned gate_up {up_us:7.2f} us {gate_bytes / up_us / 1e6:5.2f} TB/s  {up_tile}")
    print(f"tuned down    {down_us:7.2f} us {down_bytes / down_us / 1e6:5.2f} TB/s  {down_tile}", flush=True)
    sweeps = {
        "gate_up": [moe.GemvConfig(bn, bk, w, s) for bn, bk, w, s in itertools.product(
            (4, 8, 16, 32), (128, 256, 512, 1024), (4,), (2, 3, 4)) if bn * bk <= 16384 and bn * bk >= 1024],
        "down": [moe.GemvConfig(bn, bk, w, s, pao) for bn, bk, w, s, pao in itertools.product(
            (2, 4, 8, 16), (64, 128, 256, 512), (4,), (3, 4), (True, False))
            if bn * bk * (8 if pao else 1) <= 32768 and bn * bk * (8 if pao else 1) >= 1024],
    }
    for which, tiles in sweeps.items():
        nbytes = gate_bytes if which == "gate_up" else down_bytes
        rows = []
        for tile in tiles:
            try:
                us = time_tile(which, tile)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile: skip it
                print(f"skip {which} {tile}: {type(exc).__name__}", flush=True)
                continue
            rows.append((us, tile))
        rows.sort(key=lambda r: r[0])
        print(f"== {which}: {len(rows)} tiles, best 12 ({nbytes / 1e6:.1f} MB)")
        for us, tile in rows[:12]:
            print(f"  {us:7.2f} us {nbytes / us / 1e6:5.2f} TB/s  {tile}", flush=True)


if __name__ == "__main__":
    main()
