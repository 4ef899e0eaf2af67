"""FP8 on one GPU: (a) GEMM microbench bf16 vs fp8 per-channel (cuBLASLt and Triton) vs fp8 block-wise (Triton)
on llama3-8b shapes (or MoE expert shapes), (b) KV blocks with a bf16 vs an fp8 KV cache, (c) greedy-logit quality
of FP8 vs bf16 on dummy weights.

    python -m pagoda.bench.fp8_bench [--parts gemm,kv,quality] [--gemm-shapes llama3-8b,qwen3-30b-a3b:experts]
        [--gemm-m 1,2,4,...] [--out bench/results/h200_fp8.json]

The GEMM part times every path of gemm_variants() (bf16, cuBLASLt and Triton W8A8, block-wise, and the
weight-only W8A16 kernel where it exists) at issue 25's M buckets, each checked against its fp32 reference.
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.cuda_timing import flushed_time_ms
from pagoda.bench.report import stamp, write_json

# issue 25's M buckets: decode batches 1..32 (weight-only territory), mid batches, prefill chunks
TOKEN_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 8192)
DEFAULT_GEMM_SHAPES = "llama3-8b"  # also e.g. qwen3-30b-a3b:experts,mixtral-8x7b:experts


def gemm_shapes(spec: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of the FP8 linear layers of dummy shapes: "model" for a layer's dense linears and one routed
    expert's (a sparse layer's, for a mixture of experts), "model:experts" for the expert's only. Comma-separated;
    the shapes come from bench/roofline.fp8_linears, which mirrors the engine."""
    from pagoda.bench.roofline import fp8_linears
    from pagoda.shared.shapes import SHAPES

    shapes: list[tuple[str, int, int]] = []
    for item in spec.split(","):
        model, _, part = item.partition(":")
        if model not in SHAPES or part not in ("", "experts"):
            raise ValueError(f"unknown GEMM shape {item!r}: a dummy shape name ({', '.join(SHAPES)}), "
                             f"optionally with :experts")
        arch = SHAPES[model]
        dense, expert = fp8_linears(arch, arch.moe.sparse_layers[0] if arch.moe else 0)
        for name, n, k in (expert if part == "experts" else dense + expert):
            if (f"{model}.{name}", n, k) not in shapes:
                shapes.append((f"{model}.{name}", n, k))
    return shapes


@dataclass(frozen=True, slots=True)
class GemmOperands:
    """One (shape, M): the bf16 activation and weight, the weight in FP8 per channel and per 128 x 128 block (the
    model's [N, K / 128] scale layout), and the activation pre-quantized per token / per 128 columns."""

    x: torch.Tensor  # [M, K] bf16
    w: torch.Tensor  # [N, K] bf16
    w_q: torch.Tensor  # [N, K] e4m3
    w_s: torch.Tensor  # [N, 1] fp32
    w_bq: torch.Tensor  # [N, K] e4m3
    w_bs: torch.Tensor  # [N, K / 128] fp32
    x_q: torch.Tensor  # [M, K] e4m3
    x_s: torch.Tensor  # [M, 1] fp32
    x_gq: torch.Tensor  # [M, K] e4m3
    x_gs: torch.Tensor  # [M, K / 128] fp32


@dataclass(frozen=True, slots=True)
class GemmVariant:
    """A timed path: `make(operands)` returns the no-argument call that is timed (and checked, unless it returns
    no [M, N] output). `weights` names the weight form whose fp32 reference it is checked against: "bf16",
    "channel" or "block". `linear`: it takes the bf16 activation, so its time is what a linear layer costs (the
    rest start from pre-quantized activations). `max_rows`: skipped above this M (None: every M)."""

    make: Callable[[GemmOperands], Callable[[], torch.Tensor]]
    weights: str
    linear: bool
    max_rows: int | None = None


def gemm_variants() -> dict[str, GemmVariant]:
    """Every GEMM path the sweep times, by name. The hook for new kernels: add an entry here (kernels/fp8.py's
    weight-only W8A16 GEMV is picked up from pagoda.kernels.fp8_weight_only when that module exists)."""
    import torch.nn.functional as F

    from pagoda.kernels import fp8

    bf16 = torch.bfloat16
    variants = {
        "bf16": GemmVariant(lambda o: lambda: F.linear(o.x, o.w), "bf16", True),
        "fp8_quant_token": GemmVariant(lambda o: lambda: fp8.quantize_fp8_rows(o.x), "none", False),
        "fp8_rowwise_scaled_mm": GemmVariant(
            lambda o: lambda: fp8.scaled_mm_rowwise(o.x_q, o.x_s, o.w_q, o.w_s, bf16), "channel", False),
        "fp8_rowwise_scaled_mm_fast_accum": GemmVariant(
            lambda o: lambda: fp8.scaled_mm_rowwise(o.x_q, o.x_s, o.w_q, o.w_s, bf16, fast_accum=True), "channel",
            False),
        "fp8_rowwise_triton": GemmVariant(
            lambda o: lambda: fp8.fp8_gemm(o.x_q, o.x_s, o.w_q, o.w_s, None, bf16), "channel", False),
        "fp8_rowwise_linear": GemmVariant(lambda o: lambda: fp8.fp8_linear(o.x, o.w_q, o.w_s, None), "channel", True),
        # what a W8A8 layer costs in the model where the kernel before it writes the e4m3 activation (RMSNorm,
        # SiLU-and-mul): the GEMM alone, as the model dispatches it
        "fp8_rowwise_fused": GemmVariant(
            lambda o: lambda: fp8.fp8_matmul(o.x_q, o.x_s, o.w_q, o.w_s, None, bf16), "channel", True),
        "fp8_block_triton": GemmVariant(
            lambda o: lambda: fp8.fp8_gemm(o.x_gq, o.x_gs, o.w_bq, o.w_bs, 128, bf16), "block", False),
        "fp8_block_linear": GemmVariant(lambda o: lambda: fp8.fp8_linear(o.x, o.w_bq, o.w_bs, 128), "block", True),
    }
    try:
        from pagoda.kernels import fp8_weight_only as w8
    except ImportError:  # the W8A16 kernel is not on this branch
        return variants
    variants["fp8_w8a16"] = GemmVariant(lambda o: lambda: w8.fp8_weight_only_linear(o.x, o.w_q, o.w_s, None),
                                        "channel", True, getattr(w8, "MAX_ROWS", None))
    variants["fp8_w8a16_block"] = GemmVariant(
        lambda o: lambda: w8.fp8_weight_only_linear(o.x, o.w_bq, o.w_bs, 128), "block", True,
        getattr(w8, "MAX_ROWS", None))
    return variants


def _time_ms(fn: Any, iters: int = 50) -> float:
    """Median time of one call, L2 wiped before each (a 25 MB fp8 weight would otherwise stay in the H200's L2)."""
    return flushed_time_ms(fn, iters)


def _gemm_row(name: str, m: int, weights: dict[str, torch.Tensor],
              variants: dict[str, GemmVariant]) -> dict[str, Any]:
    """One GEMM shape at M rows: every variant timed, and checked (min row cosine) against the fp32 reference of
    the weight form it reads."""
    from pagoda.kernels import fp8
    from pagoda.kernels import reference as ref

    n, k = weights["w"].shape
    x = torch.randn(m, k, device="cuda").bfloat16()  # [M, K]
    ops = GemmOperands(x, **weights, **dict(zip(("x_q", "x_s"), fp8.quantize_fp8_rows(x), strict=True)),
                       **dict(zip(("x_gq", "x_gs"), fp8.quantize_fp8_rows(x, 128), strict=True)))
    expected = {"bf16": x.float() @ ops.w.float().t(), "channel": ref.fp8_linear(x.float(), ops.w_q, ops.w_s, None),
                "block": ref.fp8_linear(x.float(), ops.w_bq, ops.w_bs, 128)}
    row: dict[str, Any] = {"gemm": name, "M": m, "N": n, "K": k}
    for key, variant in variants.items():
        if variant.max_rows is not None and m > variant.max_rows:
            continue
        call = variant.make(ops)
        row[f"{key}_us"] = 1e3 * _time_ms(call)
        if variant.weights in expected:
            out = call().float()  # [M, N]
            row[f"cosine_{key}"] = torch.nn.functional.cosine_similarity(out, expected[variant.weights],
                                                                         dim=1).min().item()
    bf16_us = row["bf16_us"]
    fp8_linear_us = {key: row[f"{key}_us"] for key, v in variants.items() if v.linear and key != "bf16"
                     and f"{key}_us" in row and v.weights == "channel"}
    best = min(fp8_linear_us, key=fp8_linear_us.get)
    row.update({"bf16_TBps": (2 * n * k + 2 * m * k) / bf16_us / 1e6, "bf16_TFLOPs": 2 * m * n * k / bf16_us / 1e6,
                "best_fp8_linear": best, "best_fp8_linear_TBps": (n * k + 2 * m * k) / row[f"{best}_us"] / 1e6,
                "speedup_best_fp8_linear": bf16_us / row[f"{best}_us"],
                "speedup_linear_rowwise": bf16_us / row["fp8_rowwise_linear_us"],
                "speedup_linear_block": bf16_us / row["fp8_block_linear_us"]})
    return row


def gemm_bench(spec: str = DEFAULT_GEMM_SHAPES, token_counts: tuple[int, ...] = TOKEN_COUNTS) -> list[dict[str, Any]]:
    from pagoda.kernels import reference as ref

    variants = gemm_variants()
    rows = []
    for name, n, k in gemm_shapes(spec):
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()  # [N, K]
        w_q, w_s = ref.quantize_fp8_rows(w)  # per channel
        w_bq, w_blocks = ref.quantize_fp8_blocks(w, (128, 128))
        w_bs = w_blocks.repeat_interleave(128, dim=0)[:n].contiguous()  # [N, K / 128]: the model's layout
        weights = {"w": w, "w_q": w_q, "w_s": w_s, "w_bq": w_bq, "w_bs": w_bs}
        for m in token_counts:
            row = _gemm_row(name, m, weights, variants)
            rows.append(row)
            times = " ".join(f"{key[:-3]} {value:.1f}" for key, value in row.items() if key.endswith("_us"))
            print(f"{name:28s} M={m:5d} us: {times} | best fp8 linear {row['best_fp8_linear']} "
                  f"{row['speedup_best_fp8_linear']:.2f}x bf16, {row['best_fp8_linear_TBps']:.2f} TB/s | min cosine "
                  f"{min(v for key, v in row.items() if key.startswith('cosine_')):.5f}", flush=True)
        del w, w_q, w_s, w_bq, w_bs, weights
        torch.cuda.empty_cache()
    slower = [r for r in rows if r["speedup_best_fp8_linear"] < 1.0]
    print(f"best FP8 linear slower than bf16 in {len(slower)} of {len(rows)} (shape, M): "
          + ", ".join(f"{r['gemm']} M={r['M']} {r['speedup_best_fp8_linear']:.2f}x" for r in slower), flush=True)
    return rows


def _runner(model: str, **kwargs: Any) -> Any:
    from pagoda.services.worker.model_runner import ModelRunner
    from pagoda.shared.config import EngineConfig

    load_format = "auto" if Path(model, "config.json").is_file() else "dummy"  # a folder: its real weights
    return ModelRunner(EngineConfig(model=model, load_format=load_format, **kwargs))


def kv_blocks(model: str) -> list[dict[str, Any]]:
    """KV blocks the profile leaves (gpu_memory_utilization 0.9) and at a fixed 8 GiB, per weight / KV dtype."""
    rows = []
    for quantization, kv_dtype in ((None, "auto"), (None, "fp8"), ("fp8", "auto"), ("fp8", "fp8")):
        for budget in (None, 8 << 30):
            runner = _runner(model, quantization=quantization, kv_cache_dtype=kv_dtype, enforce_eager=True,
                             kv_cache_memory=budget)
            row = {"model": model, "quantization": quantization or "bf16", "kv_cache_dtype": kv_dtype,
                   "kv_cache_memory": budget or "profiled", "num_kv_blocks": runner.num_blocks,
                   "kv_bytes_per_block": runner.kv_bytes_per_block(),
                   "weights_GiB": torch.cuda.memory_allocated() / 2**30 - runner.kv_cache.numel()
                   * runner.kv_cache.element_size() / 2**30}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del runner
            gc.collect()
            torch.cuda.empty_cache()
    base = {r["kv_cache_memory"]: r["num_kv_blocks"] for r in rows if r["quantization"] == "bf16"
            and r["kv_cache_dtype"] == "auto"}
    for row in rows:
        row["blocks_vs_bf16"] = row["num_kv_blocks"] / base[row["kv_cache_memory"]]
    return rows


def greedy_steps(runner: Any, scheduler: Any, prompts: list[list[int]],
                 max_tokens: int) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Greedy tokens and the logits row [V] of each sampled step, per request (ids "0", "1", ...), with `scheduler`
    (a pagoda Scheduler sized for the runner) planning every step of `runner` (a ModelRunner)."""
    from pagoda.services.scheduler.scheduler import Request
    from pagoda.shared.messages import SamplingParams

    steps: list[torch.Tensor] = []
    sampler = runner.sampler
    runner.sampler = lambda logits, meta: (steps.append(logits.detach().float().cpu()), sampler(logits, meta))[1]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(request_id=str(i), prompt_token_ids=prompt, sampling=params, arrival_time=i))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logits: dict[str, list[torch.Tensor]] = {str(i): [] for i in range(len(prompts))}
    try:
        while scheduler.has_unfinished():
            plan = scheduler.schedule()
            result = runner.execute(plan)
            rows = dict(zip(result.seq_ids, steps[-1], strict=True)) if result.seq_ids else {}
            for update in scheduler.update(plan, result):
                tokens[update.seq.request.request_id].append(update.token_id)
                logits[update.seq.request.request_id].append(rows[update.seq.seq_id])
    finally:
        runner.sampler = sampler
    return tokens, logits


def _greedy(runner: Any, prompts: list[list[int]], max_tokens: int) -> tuple[dict, dict]:
    from pagoda.services.scheduler.scheduler import Scheduler

    scheduler = Scheduler(num_blocks=runner.num_blocks, block_size=runner.block_size, max_num_seqs=64,
                          max_num_batched_tokens=8192, max_model_len=runner.max_model_len,
                          vocab_size=runner.arch.vocab_size)
    return greedy_steps(runner, scheduler, prompts, max_tokens)


def quality(model: str, num_prompts: int, prompt_len: int, max_tokens: int) -> list[dict[str, Any]]:
    """Cosine similarity of each greedy step's logits to bf16's (while the greedy paths agree) and top-1
    agreement, for fp8 weights, fp8 KV and both; dummy weights (flat logits: top-1 is a hard test)."""
    generator = torch.Generator().manual_seed(0)
    base_runner = _runner(model, num_kv_blocks=4096, max_model_len=prompt_len + max_tokens + 16)
    vocab = base_runner.arch.vocab_size
    prompts = [torch.randint(10, vocab, (prompt_len,), generator=generator).tolist() for _ in range(num_prompts)]
    base = _greedy(base_runner, prompts, max_tokens)
    del base_runner
    torch.cuda.empty_cache()
    rows = []
    for quantization, kv_dtype in (("fp8", "auto"), (None, "fp8"), ("fp8", "fp8")):
        runner = _runner(model, num_kv_blocks=4096, max_model_len=prompt_len + max_tokens + 16,
                         quantization=quantization, kv_cache_dtype=kv_dtype)
        ours = _greedy(runner, prompts, max_tokens)
        cosines, agree, first_agree = [], [], []
        for request_id, base_tokens in base[0].items():
            first_agree.append(float(base[1][request_id][0].argmax() == ours[1][request_id][0].argmax()))
            for step, (a, b) in enumerate(zip(base[1][request_id], ours[1][request_id], strict=True)):
                if base_tokens[:step] != ours[0][request_id][:step]:
                    break
                cosines.append(torch.nn.functional.cosine_similarity(a, b, dim=0).item())
                agree.append(float(a.argmax() == b.argmax()))
        row = {"model": model, "quantization": quantization or "bf16", "kv_cache_dtype": kv_dtype,
               "num_prompts": num_prompts, "prompt_len": prompt_len, "compared_steps": len(cosines),
               "cosine_min": min(cosines), "cosine_mean": sum(cosines) / len(cosines),
               "top1_agreement": sum(agree) / len(agree),
               "top1_agreement_first_token": sum(first_agree) / len(first_agree),
               "greedy_sequences_identical": sum(base[0][r] == ours[0][r] for r in base[0]) / num_prompts}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del runner
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--parts", default="gemm,kv,quality")
    parser.add_argument("--gemm-shapes", default=DEFAULT_GEMM_SHAPES,
                        help="comma-separated dummy shapes, each optionally :experts (its routed expert's only)")
    parser.add_argument("--gemm-m", default=",".join(map(str, TOKEN_COUNTS)), help="comma-separated token counts")
    parser.add_argument("--kv-model", default="llama3-8b")
    parser.add_argument("--quality-model", default="qwen3-0.6b")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_bench needs a CUDA GPU (FP8 GEMMs: compute capability >= 8.9)")
    parts = set(args.parts.split(","))
    report: dict[str, Any] = {"date": stamp(), "device": torch.cuda.get_device_name(),
                              "torch": torch.__version__}
    if "gemm" in parts:
        report["gemm"] = gemm_bench(args.gemm_shapes, tuple(int(m) for m in args.gemm_m.split(",")))
    if "kv" in parts:
        report["kv_blocks"] = kv_blocks(args.kv_model)
    if "quality" in parts:
        report["quality"] = quality(args.quality_model, args.num_prompts, args.prompt_len, args.max_tokens)
    if args.out:
        write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
