"""FP8 on one GPU: (a) GEMM microbench bf16 vs fp8 per-channel (cuBLASLt and Triton) vs fp8 block-wise (Triton)
on llama3-8b shapes, (b) KV blocks with a bf16 vs an fp8 KV cache, (c) greedy-logit quality of FP8 vs bf16 on
dummy weights.

    python -m pagoda.bench.fp8_bench [--parts gemm,kv,quality] [--out bench/results/h200_fp8.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.cuda_timing import flushed_time_ms

# llama3-8b: (name, N, K) of each linear layer
LLAMA3_8B_GEMMS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
TOKEN_COUNTS = (1, 16, 256, 8192)


def _time_ms(fn: Any, iters: int = 50) -> float:
    """Median time of one call, L2 wiped before each (a 25 MB fp8 weight would otherwise stay in the H200's L2)."""
    return flushed_time_ms(fn, iters)


def _gemm_row(name: str, m: int, w: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, w_bq: torch.Tensor,
              w_bs: torch.Tensor) -> dict[str, Any]:
    """One GEMM shape: x [M, K] bf16 times every weight form; checks each FP8 path against the reference."""
    import torch.nn.functional as F

    from pagoda.kernels import fp8
    from pagoda.kernels import reference as ref

    n, k = w.shape
    x = torch.randn(m, k, device="cuda").bfloat16()  # [M, K]
    x_q, x_s = fp8.quantize_fp8_rows(x)
    x_gq, x_gs = fp8.quantize_fp8_rows(x, 128)
    timings = {
        "bf16": _time_ms(lambda: F.linear(x, w)),
        "fp8_quant_token": _time_ms(lambda: fp8.quantize_fp8_rows(x)),
        "fp8_rowwise_scaled_mm": _time_ms(lambda: fp8.scaled_mm_rowwise(x_q, x_s, w_q, w_s, torch.bfloat16)),
        "fp8_rowwise_scaled_mm_fast_accum": _time_ms(
            lambda: fp8.scaled_mm_rowwise(x_q, x_s, w_q, w_s, torch.bfloat16, fast_accum=True)),
        "fp8_rowwise_triton": _time_ms(lambda: fp8.fp8_gemm(x_q, x_s, w_q, w_s, None, torch.bfloat16)),
        "fp8_rowwise_linear": _time_ms(lambda: fp8.fp8_linear(x, w_q, w_s, None)),
        "fp8_block_triton": _time_ms(lambda: fp8.fp8_gemm(x_gq, x_gs, w_bq, w_bs, 128, torch.bfloat16)),
        "fp8_block_linear": _time_ms(lambda: fp8.fp8_linear(x, w_bq, w_bs, 128)),
    }
    flops, fp8_bytes = 2 * m * n * k, n * k + m * k
    row = {"gemm": name, "M": m, "N": n, "K": k, **{f"{key}_us": 1e3 * v for key, v in timings.items()},
           "bf16_TBps": 2 * fp8_bytes / timings["bf16"] / 1e9, "bf16_TFLOPs": flops / timings["bf16"] / 1e9,
           "fp8_rowwise_TBps": fp8_bytes / timings["fp8_rowwise_scaled_mm"] / 1e9,
           "fp8_rowwise_TFLOPs": flops / timings["fp8_rowwise_scaled_mm"] / 1e9,
           "speedup_linear_rowwise": timings["bf16"] / timings["fp8_rowwise_linear"],
           "speedup_linear_block": timings["bf16"] / timings["fp8_block_linear"]}
    checks = {"rowwise_linear": (fp8.fp8_linear(x, w_q, w_s, None), ref.fp8_linear(x.float(), w_q, w_s, None)),
              "rowwise_triton": (fp8.fp8_gemm(x_q, x_s, w_q, w_s, None, torch.bfloat16),
                                 ref.fp8_linear(x.float(), w_q, w_s, None)),
              "block_linear": (fp8.fp8_linear(x, w_bq, w_bs, 128), ref.fp8_linear(x.float(), w_bq, w_bs, 128))}
    for key, (out, expected) in checks.items():
        row[f"cosine_{key}"] = torch.nn.functional.cosine_similarity(out.float(), expected, dim=1).min().item()
    return row


def gemm_bench() -> list[dict[str, Any]]:
    from pagoda.kernels import reference as ref

    rows = []
    for name, n, k in LLAMA3_8B_GEMMS:
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()  # [N, K]
        w_q, w_s = ref.quantize_fp8_rows(w)  # per channel
        w_bq, w_blocks = ref.quantize_fp8_blocks(w, (128, 128))
        w_bs = w_blocks.repeat_interleave(128, dim=0)[:n].contiguous()  # [N, K / 128]: the model's layout
        for m in TOKEN_COUNTS:
            row = _gemm_row(name, m, w, w_q, w_s, w_bq, w_bs)
            rows.append(row)
            print(f"{name:8s} M={m:5d} bf16 {row['bf16_us']:8.1f} us | fp8 rowwise: quant "
                  f"{row['fp8_quant_token_us']:6.1f} + cuBLASLt {row['fp8_rowwise_scaled_mm_us']:8.1f} (fast accum "
                  f"{row['fp8_rowwise_scaled_mm_fast_accum_us']:8.1f}, triton "
                  f"{row['fp8_rowwise_triton_us']:8.1f}) = linear {row['fp8_rowwise_linear_us']:8.1f} us "
                  f"({row['speedup_linear_rowwise']:.2f}x) | block: triton {row['fp8_block_triton_us']:8.1f}, "
                  f"linear {row['fp8_block_linear_us']:8.1f} us ({row['speedup_linear_block']:.2f}x) | min cosine "
                  f"{min(v for key, v in row.items() if key.startswith('cosine_')):.5f}", flush=True)
        del w, w_q, w_s, w_bq, w_bs
        torch.cuda.empty_cache()
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
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": torch.cuda.get_device_name(),
                              "torch": torch.__version__}
    if "gemm" in parts:
        report["gemm"] = gemm_bench()
    if "kv" in parts:
        report["kv_blocks"] = kv_blocks(args.kv_model)
    if "quality" in parts:
        report["quality"] = quality(args.quality_model, args.num_prompts, args.prompt_len, args.max_tokens)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
