"""Twenty-sixth session probe: deepseek-v2-lite's MLA decode launch (16 heads, bf16 latent cache) at the reference
workload's contexts (512-768 cached tokens), the default pick against split-KV and tile variants.

    python3 bench/results/s26/mla_splits.py

The H200 sweep that chose the default (bench/mla_bench.py --sweep, 2026-12-02) ran at 1k keys and tried split-KV
only with the transposed (keys_m) shape at B=256.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagoda.bench.mla_bench import Dims, _print_decode, decode_row
from pagoda.kernels.mla import pick_mla_config

VARIANTS = {
    "default": {},
    "splits2": dict(num_splits=2),
    "splits2 s3": dict(num_splits=2, decode_num_stages=3),
    "splits4": dict(num_splits=4),
    "w8": dict(decode_num_warps=8),
    "n64 w8": dict(decode_tile_n=64, decode_num_warps=8),
    "s3": dict(decode_num_stages=3),
}


def main() -> None:
    for batch, context in ((256, 640), (256, 1024), (128, 640), (64, 640)):
        base = pick_mla_config(batch, 16, 1, context)
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
