# ruff: noqa: B023 - each step() runs in its own loop iteration
"""Twenty-seventh session probe: deepseek-v2-lite's prefill-carrying steps. In the reference workload (call 1) the
first such step (32 fresh prompts x 512) took 149.9 ms of GPU and the next seven 163-188 ms: each carries decode rows
and, under the 16,384-token budget, a prompt split across two steps (a chunk against cached context). Kernel time of
each kind of step, and by kernel for the difference.

    python3 bench/results/s27/mixed_steps.py
"""

from __future__ import annotations

import sys

import torch

from pagoda.bench.decode_profile import kernel_breakdown, make_batch
from pagoda.services.worker.models import CausalLM
from pagoda.services.worker.weights import load_model
from pagoda.shared.shapes import SHAPES

STEPS = {  # name: [(query_len, seq_len)] rows
    "pure 32x512": [(512, 512)] * 32,
    "64 decode + 31x512 + split 448": [(1, 530)] * 64 + [(512, 512)] * 31 + [(448, 448)],
    "96 decode + ctx chunk 64 + 31x512 + split 352": [(1, 560)] * 96 + [(64, 512)] + [(512, 512)] * 31
    + [(352, 352)],
    "224 decode + 31x512 + split 288": [(1, 700)] * 224 + [(512, 512)] * 31 + [(288, 288)],
    "no decode, ctx chunk 64 + 31x512 + split 448": [(64, 512)] + [(512, 512)] * 31 + [(448, 448)],
}
# the reference workload's prefill-carrying steps 5 and 6 as bench/sched_sim.py's scheduler plans them (decode rows
# first, then the chunks in their order): 188 / 171 ms in call 1, 180 / 167 in call 7, against ~159-164 for the rest
REFERENCE_STEPS = {
    "ref step 4": [(1, 516)] * 127 + [(190, 512)] + [(512, 512)] * 31 + [(195, 195)],
    "ref step 5": [(1, 517)] * 159 + [(317, 512)] + [(512, 512)] * 31 + [(36, 36)],
    "ref step 6": [(1, 518)] * 191 + [(476, 512)] + [(512, 512)] * 30 + [(357, 357)],
}
if "--reference-steps" in sys.argv:
    STEPS = {"pure 32x512": STEPS["pure 32x512"], **REFERENCE_STEPS}


def main() -> None:
    arch = SHAPES["deepseek-v2-lite"]
    dev = torch.device("cuda")
    model = CausalLM(arch, torch.bfloat16, dev, max_positions=4096)
    load_model(model, None, "dummy", seed=0)
    breakdowns = {}
    with torch.inference_mode():
        for name, rows in STEPS.items():
            meta, pos, nblocks = make_batch([q for q, _ in rows], [s for _, s in rows], dev)
            caches = [(torch.zeros(nblocks, 16, 1, arch.mla.entry_dim, device=dev, dtype=torch.bfloat16),)
                      for _ in range(arch.num_layers)]
            ids = torch.randint(0, arch.vocab_size, (pos.numel(),), device=dev)

            def step() -> torch.Tensor:
                h = model(ids, pos, caches, meta)
                return model.compute_logits(h[meta.query_start_loc[1:] - 1]).argmax(-1)

            for _ in range(2):
                step()
            breakdown = {k: (us, n) for k, us, n in kernel_breakdown(step, steps=2)}
            breakdowns[name] = breakdown
            total = sum(us for us, _ in breakdown.values())
            print(f"{name}: {pos.numel()} tokens, {total / 1e3:.2f} ms of kernels, "
                  f"{sum(n for _, n in breakdown.values())} launches", flush=True)
    base = breakdowns["pure 32x512"]
    for name, breakdown in list(breakdowns.items())[1:]:
        diffs = sorted(((breakdown.get(k, (0, 0))[0] - base.get(k, (0, 0))[0], k)
                        for k in set(breakdown) | set(base)), reverse=True)
        print(f"-- {name} minus pure, largest:")
        for us, k in diffs[:14]:
            print(f"   {us:9.1f} us  x{breakdown.get(k, (0, 0))[1]:<4d} {k}")


if __name__ == "__main__":
    main()
