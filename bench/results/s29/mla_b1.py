"""Twenty-ninth session probe (prepared on the CPU, for the next device time): deepseek-v2-lite's MLA decode launch
at batch 1-4, where it is latency-bound. In the twenty-seventh session's batch-1 profile
(bench/results/s27/v2lite_profile_b1.json, 1024 cached tokens) `_mla_kernel` took 9.9 us and its split reduce 2.5
us a layer, for 1.2 MB of latent cache (0.3 us of HBM time): ~12 us of a ~82 us layer. The default at batch 1 is 32
splits of one 32-key tile each (pick_mla_config), and the s26 note on _MAX_SPLITS has 16 / 32 / 64 splits at 12.1 /
11.2 / 19.5 us (1k keys). This times the launch shapes around it, each graph-timed with its reduce, checked against
the reference first.

    python3 bench/results/s29/mla_b1.py
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagoda.bench.mla_bench import Dims, _print_decode, decode_row
from pagoda.kernels.mla import pick_mla_config

VARIANTS = {
    "default": {},
    "splits8": dict(num_splits=8),
    "splits16": dict(num_splits=16),
    "splits64": dict(num_splits=64),
    "n16 splits32": dict(decode_tile_n=16),
    "n16 splits64": dict(decode_tile_n=16, num_splits=64),
    "n64 splits16": dict(decode_tile_n=64, num_splits=16),
    "s1": dict(decode_num_stages=1),
    "s2": dict(decode_num_stages=2),
    "w8": dict(decode_num_warps=8),
    "keys on N": dict(decode_keys_m=False),
    "eager sums": dict(decode_lazy_sum=False),
}


def main() -> None:
    for batch, context in ((1, 512), (1, 1024), (1, 2048), (4, 1024)):
        base = pick_mla_config(batch, 16, 1, 8192)  # what a CUDA graph captures for an 8k max_model_len
        for label, change in VARIANTS.items():
            config = replace(base, **change)
            try:
                row = decode_row(Dims(16), batch, context, torch.bfloat16, "cuda", 10, config)
            except Exception as exc:  # noqa: BLE001 - a shape that does not compile: say so, go on
                print(f"B={batch} ctx={context} {label}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            _print_decode(row, f"B={batch} ctx={context} {label}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
