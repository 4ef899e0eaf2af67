"""The MoE layer at prefill token counts, both paths of kernels/moe.py fused_experts: "triton" (pagoda's grouped
GEMM, tuned tiles) and "gmm" (torch._grouped_mm, CUTLASS, with its gather, SiLU-and-mul and combine). Per shape and
token count: device time from a CUDA graph, TFLOP/s, the two grouped GEMMs of the gmm path alone (what its other
steps add is the difference), the gmm path's error against the triton path, and the path moe_path picks. The
figures to set kernels/moe.py GMM_MIN_ROWS_PER_EXPERT (and GMM_BLOCK_M) by.

    python -m pagoda.bench.moe_prefill [--shapes deepseek-v2-lite,qwen3-30b-a3b,mixtral-8x7b]
                                       [--tokens 1024,2048,4096,8192,16384] [--out FILE]
    python -m pagoda.bench.moe_prefill --smoke    # a tiny shape on CPU (Triton interpreter): checks the script runs

Shared experts are fused as the model files fuse them (DeepSeek-V2-Lite: 64 + 2 experts, 6 + 2 per token).
JSON goes to --out, else to $OUT/moe_prefill.json when OUT is set.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from pagoda.bench.interpreter import use_interpreter
from pagoda.bench.report import write_report

SHAPE_NAMES = "deepseek-v2-lite,qwen3-30b-a3b,mixtral-8x7b"
TOKENS = "1024,2048,4096,8192,16384"
SMOKE_SHAPE, SMOKE_TOKENS = "tiny-deepseek-v3", "8,24"
PATHS = ("triton", "gmm")


def _layer(name: str, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(w_gate_up [E + S, 2I, H], w_down [E + S, H, I], routed experts E, shared experts S) of a shape."""
    from pagoda.services.worker.models.deepseek import fused_shared_experts
    from pagoda.services.worker.models.moe import fused_gated_shared_experts
    from pagoda.shared.shapes import SHAPES

    arch = SHAPES[name]
    assert arch.moe is not None, f"{name} is not a mixture-of-experts shape"
    spec, hidden = arch.moe, arch.hidden_size
    inter = spec.expert_intermediate_size
    num_shared = fused_shared_experts(spec, inter, None) or fused_gated_shared_experts(spec, None)
    num_experts = spec.num_experts + num_shared
    w_gate_up = (torch.randn(num_experts, 2 * inter, hidden, device=device) * 0.02).to(dtype)  # [E + S, 2I, H]
    w_down = (torch.randn(num_experts, hidden, inter, device=device) * 0.02).to(dtype)  # [E + S, H, I]
    return w_gate_up, w_down, spec.num_experts, num_shared


def _routing(num_tokens: int, num_routed: int, top_k: int, num_shared: int,
             device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing over the routed experts, then the shared ones (ids num_routed.., weight 1)."""
    from pagoda.kernels import moe

    weights, ids = moe.route_softmax_topk(torch.randn(num_tokens, num_routed, device=device), top_k, True)
    shared = torch.arange(num_routed, num_routed + num_shared, dtype=torch.int32, device=device)
    return (torch.cat((weights, weights.new_ones(num_tokens, num_shared)), 1),
            torch.cat((ids, shared.expand(num_tokens, num_shared)), 1))  # [T, k + S] each


def _time_ms(fn: Callable[[], object], device: str) -> float:
    """Device time from a CUDA graph; on CPU (--smoke) the wall time of one eager call after a first one."""
    if device == "cuda":
        from pagoda.bench.cuda_timing import graph_time_ms

        return graph_time_ms(fn, reps=5, replays=3)
    fn()
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


def _gemms_only(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                ids: torch.Tensor) -> Callable[[], object]:
    """The gmm path's two torch._grouped_mm calls alone, on rows already sorted by expert."""
    from pagoda.kernels import moe

    align = moe.align_pairs(ids, w_gate_up.shape[0], moe.GMM_BLOCK_M)
    offs = align.run_ends  # [E] int32
    rows, _ = moe.gather_sorted(x, align, ids.shape[1])  # [max_padded, H]
    act = torch.zeros(rows.shape[0], w_down.shape[2], dtype=x.dtype, device=x.device)  # [max_padded, I]

    def run() -> None:
        torch._grouped_mm(rows, w_gate_up.transpose(1, 2), offs=offs)
        torch._grouped_mm(act, w_down.transpose(1, 2), offs=offs)
    return run


def shape_rows(name: str, token_counts: list[int], dtype: torch.dtype, device: str) -> list[dict[str, Any]]:
    from pagoda.kernels import moe
    from pagoda.shared.shapes import SHAPES

    w_gate_up, w_down, num_routed, num_shared = _layer(name, dtype, device)
    num_experts, two_i, hidden = w_gate_up.shape
    top_k = SHAPES[name].moe.top_k + num_shared  # type: ignore[union-attr]
    rows = []
    for num_tokens in token_counts:
        x = torch.randn(num_tokens, hidden, device=device).to(dtype)  # [T, H]
        weights, ids = _routing(num_tokens, num_routed, top_k - num_shared, num_shared, device)
        flops = 2 * num_tokens * top_k * 3 * hidden * (two_i // 2)
        row: dict[str, Any] = {
            "shape": name, "tokens": num_tokens, "pairs": num_tokens * top_k, "gflop": round(flops / 1e9, 1),
            "default_path": moe.moe_path(x.device, dtype, dtype, num_tokens, top_k, num_experts, hidden, two_i // 2)}
        outs = {}
        for path in PATHS:
            call = partial(moe.fused_experts, x, w_gate_up, w_down, weights, ids, path=path)
            outs[path] = call().float()
            ms = _time_ms(call, device)
            row[f"{path}_ms"], row[f"{path}_tflops"] = round(ms, 4), round(flops / ms / 1e9, 1)
        gemms_ms = _time_ms(_gemms_only(x, w_gate_up, w_down, ids), device)
        row["gmm_gemms_only_ms"], row["gmm_gemms_only_tflops"] = round(gemms_ms, 4), round(flops / gemms_ms / 1e9, 1)
        row["speedup"] = round(row["triton_ms"] / row["gmm_ms"], 3)
        row["rel_err"] = ((outs["gmm"] - outs["triton"]).norm() / outs["triton"].norm()).item()
        print(f"{name:>18}{num_tokens:>7}{row['triton_ms']:>10.3f}{row['gmm_ms']:>10.3f}{gemms_ms:>10.3f}"
              f"{row['triton_tflops']:>9.0f}{row['gmm_tflops']:>9.0f}{row['speedup']:>8.2f}{row['rel_err']:>10.1e}"
              f"  {row['default_path']}", flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPE_NAMES)
    parser.add_argument("--tokens", default=TOKENS)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on CPU in fp32, to check the script")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not hasattr(torch, "_grouped_mm"):
        parser.error(f"torch {torch.__version__} has no torch._grouped_mm")
    if args.smoke:
        use_interpreter()
        device, dtype, shapes, tokens = "cpu", torch.float32, SMOKE_SHAPE, SMOKE_TOKENS
    elif torch.cuda.is_available():
        device, dtype, shapes, tokens = "cuda", torch.bfloat16, args.shapes, args.tokens
        print(torch.cuda.get_device_name(), flush=True)
    else:
        parser.error("needs a CUDA device (or --smoke)")
    torch.manual_seed(0)
    print(f"{'shape':>18}{'tokens':>7}{'triton ms':>10}{'gmm ms':>10}{'gemms ms':>10}{'TFLOP/s':>9}{'gmm':>9}"
          f"{'speedup':>8}{'rel err':>10}  default")
    rows: list[dict[str, Any]] = []
    for name in shapes.split(","):
        rows += shape_rows(name, [int(t) for t in tokens.split(",")], dtype, device)
        if device == "cuda":
            torch.cuda.empty_cache()
    write_report({"device": device, "dtype": str(dtype), "rows": rows}, args.out, "moe_prefill.json", indent=1,
                 announce=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
