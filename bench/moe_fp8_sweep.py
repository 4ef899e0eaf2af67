"""FP8 experts against bf16 experts at every token count (issue 25 item 3's mixture-of-experts rows): one sparse
layer's routed (and fused shared) experts through `moe.fused_experts` as the model dispatches it, with the committed
tile tables, bf16 weights and `--quantization fp8`'s per-channel e4m3 weights, timed cold (each launch on its own copy
of the weights and its own routing where one launch would fit in L2, as bench/moe_tune.py tunes), and checked
against the reference.

    python -m pagoda.bench.moe_fp8_sweep [--shapes deepseek-v2-lite,qwen3-30b-a3b] [--tokens 1,2,...] [--out f.json]

Prints one row per (shape, tokens): both times, FP8's speedup, the HBM fraction each reaches on the expert bytes it
reads, FP8's error (from FP8_GMM_MIN_TOKENS tokens on sm90 also FP8 on the gmm path: per-row W8A8 on
torch._scaled_grouped_mm); then the (shape, tokens) where FP8 is slower than bf16.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.bench.moe_tune import HBM_BYTES_PER_S, _routing, copies_for, quantize_experts
from pagoda.bench.report import write_json
from pagoda.kernels import moe
from pagoda.kernels import reference as ref
from pagoda.services.worker.models.deepseek import fused_shared_experts
from pagoda.services.worker.models.moe import fused_gated_shared_experts
from pagoda.shared.shapes import SHAPES

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 8192)  # the FP8 sweep's M values (bench/fp8_tune.py SWEEP_M)
DEFAULT_SHAPES = "deepseek-v2-lite,qwen3-30b-a3b"


@dataclass(frozen=True, slots=True)
class Experts:
    """One sparse layer's expert weights in both forms: w_gate_up [E, 2I, H] and w_down [E, H, I] in bf16, the same
    in e4m3 with per-row fp32 scales [E, rows, 1] (shared experts fused in as experts E - S .. E - 1)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_q: torch.Tensor
    gate_up_s: torch.Tensor
    down_q: torch.Tensor
    down_s: torch.Tensor

    def args(self, fp8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if fp8:
            return self.gate_up_q, self.down_q, self.gate_up_s, self.down_s
        return self.gate_up, self.down, None, None


def make_experts(num_experts: int, hidden: int, inter: int, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16) -> Experts:
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, device=device) * 0.02).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, device=device) * 0.02).to(dtype)
    return Experts(gate_up, down, *map(_as_served, quantize_experts(gate_up)), *map(_as_served, quantize_experts(down)))


def _as_served(t: torch.Tensor) -> torch.Tensor:
    """t [E, ...] over storage for one more expert, as the model allocates per-row FP8 experts that may split."""
    return moe.with_spare_expert(t.shape, t.dtype, t.device, like=t)


def expert_bytes(touched: int, hidden: int, inter: int, fp8: bool) -> int:
    """Bytes of the experts a launch reads: 3 H x I weights each, one byte an element in e4m3 (scales aside)."""
    return touched * 3 * hidden * inter * (1 if fp8 else 2)


def _launch(x: torch.Tensor, experts: Experts, weights: torch.Tensor, ids: torch.Tensor,
            fp8: bool, path: str | None = None) -> Callable[[], torch.Tensor]:
    """The layer's experts on x as the model calls them (the dispatch and tiles moe.fused_experts picks), or on
    `path` ("gmm": for FP8 experts, per-row W8A8 on torch._scaled_grouped_mm)."""
    w_gate_up, w_down, gate_up_scale, down_scale = experts.args(fp8)
    return functools.partial(moe.fused_experts, x, w_gate_up, w_down, weights, ids, gate_up_scale, down_scale,
                             path=path)


# From this many tokens the sweep also times FP8 experts on the gmm path (PAGODA_MOE_FP8_GMM's candidate).
FP8_GMM_MIN_TOKENS = 256


def sweep_row(shape: str, num_tokens: int, copies: list[Experts], routings: list[tuple[torch.Tensor, torch.Tensor]],
              hidden: int, inter: int, timer: Callable[[list[Callable[[], object]]], float]) -> dict[str, Any]:
    """Both forms at one token count: ms a launch (timer over one launch per (weight copy, routing)), speedup, HBM
    fraction on the experts read, and FP8's relative error against the reference on the first copy."""
    x = torch.randn(num_tokens, hidden, device=copies[0].gate_up.device).to(copies[0].gate_up.dtype)  # [T, H]
    row: dict[str, Any] = {"shape": shape, "tokens": num_tokens}
    touched = int(routings[0][1].unique().numel())  # experts one launch reads (the routings are alike)
    for label, fp8 in (("bf16", False), ("fp8", True)):
        calls = [_launch(x, experts, weights, ids, fp8) for experts, (weights, ids) in zip(copies, routings,
                                                                                           strict=True)]
        ms = timer(calls)
        row[f"{label}_us"] = round(1e3 * ms, 2)
        row[f"{label}_hbm_fraction"] = expert_bytes(touched, hidden, inter, fp8) / (ms * 1e-3) / HBM_BYTES_PER_S
    weights, ids = routings[0]
    expected = ref.moe_experts(x.float(), copies[0].gate_up.float(), copies[0].down.float(), weights, ids)
    got = _launch(x, copies[0], weights, ids, True)().float()
    row["fp8_rel_err"] = round(((got - expected).norm() / expected.norm()).item(), 5)
    row["speedup_fp8"] = round(row["bf16_us"] / row["fp8_us"], 3)
    if num_tokens >= FP8_GMM_MIN_TOKENS and x.is_cuda and moe.scaled_grouped_mm_device(x.device.index):
        calls = [_launch(x, experts, weights, ids, True, "gmm") for experts, (weights, ids) in zip(copies, routings,
                                                                                                   strict=True)]
        row["fp8_gmm_us"] = round(1e3 * timer(calls), 2)
        got = _launch(x, copies[0], *routings[0], True, "gmm")().float()
        row["fp8_gmm_rel_err"] = round(((got - expected).norm() / expected.norm()).item(), 5)
        row["speedup_fp8_gmm"] = round(row["bf16_us"] / row["fp8_gmm_us"], 3)
    return row


def sweep_shape(shape: str, tokens: tuple[int, ...], device: torch.device,
                timer: Callable[[list[Callable[[], object]]], float],
                dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """Every token count of one shape (dtype: the unquantized form's, bf16 as served)."""
    arch = SHAPES[shape]
    spec = arch.moe
    assert spec is not None, f"{shape} is not a mixture-of-experts shape"
    num_shared = (fused_shared_experts(spec, spec.expert_intermediate_size, None)
                  or fused_gated_shared_experts(spec, None))
    hidden, inter = arch.hidden_size, spec.expert_intermediate_size
    num_experts, top_k = spec.num_experts + num_shared, spec.top_k + num_shared
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 50 << 20
    down_bytes = hidden * inter  # the fp8 form's: the colder of the two needs the more copies
    needed = max(copies_for(t, top_k, num_experts, down_bytes, l2_bytes) for t in tokens)
    copies = [make_experts(num_experts, hidden, inter, device, dtype) for _ in range(needed)]
    rows = []
    for num_tokens in tokens:
        count = copies_for(num_tokens, top_k, num_experts, down_bytes, l2_bytes)
        routings = [_routing(num_tokens, spec.num_experts, spec.top_k, num_shared, device) for _ in range(count)]
        rows.append(sweep_row(shape, num_tokens, copies[:count], routings, hidden, inter, timer))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    tokens = tuple(int(t) for t in args.tokens.split(","))
    rows = []
    for shape in args.shapes.split(","):
        rows += sweep_shape(shape, tokens, device, lambda calls: graph_time_ms(calls, reps=10))
        torch.cuda.empty_cache()
    slower = [row for row in rows if row["speedup_fp8"] < 1.0]
    print(f"FP8 experts slower than bf16 in {len(slower)} of {len(rows)} (shape, tokens): "
          + ", ".join(f"{row['shape']} T={row['tokens']} {row['speedup_fp8']:.2f}x" for row in slower))
    if args.out:
        write_json(args.out, {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                              "device": torch.cuda.get_device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
