"""Greedy parity of pagoda and transformers on the same dummy weights (bf16 on GPU, or fp32 on CPU).

Prompts come in groups of equal length so the transformers side needs no padding; each prompt runs alone
on both sides. The reference is transformers with sdpa attention. Reports, for pagoda, the share of
prompts whose first N greedy tokens agree with it, and the last-position logits difference on the
prompts. `--variants` adds other systems measured against the same reference, to show how much agreement
a different but correct computation gets on these weights:
  pagoda-torch-ops  pagoda with its PyTorch reference ops instead of the Triton kernels (no CUDA graphs)
  hf-cudnn          transformers again, with SDPA held to its cuDNN kernel instead of flash
  hf-eager          transformers again, with its eager (matmul + softmax) attention
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from collections.abc import Iterator
from typing import Any

import torch

from pagoda.bench.hf_peer import load_hf_model
from pagoda.bench.workload import Workload

VARIANTS = ("pagoda-torch-ops", "hf-cudnn", "hf-eager")


def parity_prompts(vocab_size: int, num_prompts: int, new_tokens: int, seed: int) -> list[list[int]]:
    lengths = (24, 57, 100, 180)
    groups = [Workload(num_prompts // len(lengths), n, new_tokens, 0.0, seed + n).prompts(vocab_size)
              for n in lengths]
    return [p for group in groups for p in group]


@contextlib.contextmanager
def torch_reference_ops() -> Iterator[None]:
    """Models built inside use pagoda's PyTorch reference ops whatever the device."""
    from pagoda.services.worker import models as model_module

    original = model_module.ops_for
    model_module.ops_for = lambda device: model_module.reference_ops()
    try:
        yield
    finally:
        model_module.ops_for = original


def run_pagoda(shape: str, prompts: list[list[int]], new_tokens: int, dtype: str, device: str, seed: int,
               torch_ops: bool) -> tuple[list[list[int]], list[torch.Tensor], float]:
    """Greedy tokens and the prefill (last prompt position) logits of each prompt, one prompt at a time."""
    from pagoda import LLM, SamplingParams

    with torch_reference_ops() if torch_ops else contextlib.nullcontext():
        llm = LLM(shape, load_format="dummy", dtype=dtype, device=device, seed=seed, max_model_len=1024,
                  gpu_memory_utilization=0.5, enforce_eager=torch_ops)
    captured: list[torch.Tensor] = []
    runner = llm.engine.runner
    sampler = runner.sampler
    runner.sampler = lambda logits, meta: (captured.append(logits.float().cpu()), sampler(logits, meta))[1]  # type: ignore[assignment]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    tokens, prefill_logits = [], []
    for prompt in prompts:
        captured.clear()
        [out] = llm.generate([prompt], params)
        tokens.append(out.outputs[0].token_ids)
        prefill_logits.append(captured[0][0])
    elapsed = time.perf_counter() - start
    del llm, runner
    _free(device)
    return tokens, prefill_logits, elapsed


def run_hf(shape: str, prompts: list[list[int]], new_tokens: int, dtype: str, device: str, seed: int,
           attn_implementation: str = "sdpa",
           sdpa_backend: Any = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    hf = load_hf_model(shape, "dummy", getattr(torch, dtype), torch.device(device), seed,
                       attn_implementation=attn_implementation)
    backend = contextlib.nullcontext()
    if sdpa_backend is not None:
        from torch.nn.attention import sdpa_kernel

        backend = sdpa_kernel([sdpa_backend])
    tokens, prefill_logits = [], []
    with torch.inference_mode(), backend:
        # One prompt at a time, like pagoda: the same matrix shapes give cuBLAS the same algorithms.
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)  # [1, L]
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, pad_token_id=0)
            tokens.append(out[0, ids.shape[1]:].tolist())
            prefill_logits.append(hf(ids).logits[0, -1].float().cpu())
    del hf
    _free(device)
    return tokens, prefill_logits


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def agreement(ours: list[list[int]], our_logits: list[torch.Tensor], theirs: list[list[int]],
              their_logits: list[torch.Tensor], new_tokens: int) -> dict[str, float]:
    same = [a == b for a, b in zip(ours, theirs, strict=True)]
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), new_tokens)
                  for a, b in zip(ours, theirs, strict=True)]
    diffs = torch.stack([(a - b).abs().max() for a, b in zip(our_logits, their_logits, strict=True)])
    scale = torch.stack([b.abs().max() for b in their_logits])
    top1 = sum(int(a.argmax() == b.argmax()) for a, b in zip(our_logits, their_logits, strict=True))
    return {"identical_fraction": sum(same) / len(same), "mean_first_divergence": sum(first_diff) / len(first_diff),
            "prefill_logits_max_abs_diff": float(diffs.max()), "prefill_logits_max_abs": float(scale.max()),
            "prefill_top1_agree": top1 / len(ours)}


def top_gaps(logits: list[torch.Tensor]) -> dict[str, float]:
    """How close the reference's two best prefill logits are: the scale a numerical difference must reach
    to flip a greedy token."""
    gaps = torch.stack([lg.topk(2).values[0] - lg.topk(2).values[1] for lg in logits])
    return {"top2_gap_median": float(gaps.median()), "top2_gap_below_0.05": float((gaps < 0.05).float().mean())}


def run(shape: str, num_prompts: int, new_tokens: int, dtype: str, device: str, seed: int,
        variants: list[str]) -> dict[str, Any]:
    from pagoda.shared.shapes import resolve_arch

    prompts = parity_prompts(resolve_arch(shape, "dummy").vocab_size, num_prompts, new_tokens, seed)
    ours, our_logits, pagoda_s = run_pagoda(shape, prompts, new_tokens, dtype, device, seed, torch_ops=False)
    extra: dict[str, tuple[list[list[int]], list[torch.Tensor]]] = {}
    if "pagoda-torch-ops" in variants:
        tokens, logits, _ = run_pagoda(shape, prompts, new_tokens, dtype, device, seed, torch_ops=True)
        extra["pagoda-torch-ops"] = (tokens, logits)
    theirs, their_logits = run_hf(shape, prompts, new_tokens, dtype, device, seed)
    for name in ("hf-cudnn", "hf-eager"):
        if name not in variants:
            continue
        try:
            if name == "hf-cudnn":
                from torch.nn.attention import SDPBackend

                extra[name] = run_hf(shape, prompts, new_tokens, dtype, device, seed,
                                     sdpa_backend=SDPBackend.CUDNN_ATTENTION)
            else:
                extra[name] = run_hf(shape, prompts, new_tokens, dtype, device, seed, attn_implementation="eager")
        except RuntimeError as exc:  # a backend this build or shape lacks: say so, keep the other figures
            print(f"variant {name} failed: {str(exc).splitlines()[0]}", flush=True)
            _free(device)
    result: dict[str, Any] = {"shape": shape, "dtype": dtype, "device": device, "num_prompts": len(prompts),
                              "new_tokens": new_tokens, "pagoda_s": pagoda_s,
                              **agreement(ours, our_logits, theirs, their_logits, new_tokens),
                              **top_gaps(their_logits)}
    result["variants"] = {name: agreement(tokens, logits, theirs, their_logits, new_tokens)
                          for name, (tokens, logits) in extra.items()}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default="", help=f"comma-separated, from {', '.join(VARIANTS)}")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    result = run(args.shape, args.num_prompts, args.new_tokens, args.dtype, args.device, args.seed, variants)
    print("PARITY " + json.dumps(result), flush=True)
    return 0 if result["identical_fraction"] >= 0.9 else 1


if __name__ == "__main__":
    raise SystemExit(main())
