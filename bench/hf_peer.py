"""The Hugging Face transformers peer on the same model, weights and workload as pagoda.

Modes: hf-static (`generate` on one left-padded batch), hf-compiled (the same with
cache_implementation="static", which transformers compiles), hf-cb (`generate_batch` continuous
batching). Each runs in its own process (see throughput.py): generate_batch's cache takes most free
GPU memory, and it fails inside torch.inference_mode().
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.workload import Workload
from pagoda.services.worker.weights import DummySource
from pagoda.shared.shapes import SHAPES, resolve_arch

PEERS = ("hf-static", "hf-compiled", "hf-cb")


def load_hf_model(model: str, load_format: str, dtype: torch.dtype, device: torch.device,
                  seed: int, attn_implementation: str = "sdpa") -> Any:
    """The transformers model; for a dummy shape, filled with exactly pagoda's dummy weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if load_format == "dummy" and model in SHAPES and not Path(model, "config.json").is_file():
        arch = resolve_arch(model, load_format)
        raw = arch.to_hf_config()
        config = AutoConfig.for_model(raw.pop("model_type"), **raw)
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
        source = DummySource(seed, device, dtype)
        with torch.no_grad():
            for name, param in hf.named_parameters():
                param.copy_(source(name, tuple(param.shape), None, 0, 0))
        if arch.tie_word_embeddings:
            hf.tie_weights()
        return hf.eval()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation=attn_implementation)
    return hf.to(device).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_generate(hf: Any, prompts: list[list[int]], output_len: int, device: torch.device,
                 static_cache: bool) -> tuple[float, list[list[int]]]:
    """One left-padded batch through generate(); EOS cannot end a row early (min_new_tokens)."""
    max_len = max(len(p) for p in prompts)
    pad = 0
    input_ids = torch.tensor([[pad] * (max_len - len(p)) + p for p in prompts], device=device)  # [B, L]
    attention_mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs: dict[str, Any] = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
                                  pad_token_id=pad, attention_mask=attention_mask)
    if static_cache:
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        if static_cache:  # the first call compiles; the issue counts only the second
            hf.generate(input_ids, **kwargs)
        _sync(device)
        start = time.perf_counter()
        out = hf.generate(input_ids, **kwargs)
        _sync(device)
    elapsed = time.perf_counter() - start
    return elapsed, out[:, max_len:].tolist()


def run_generate_batch(hf: Any, prompts: list[list[int]], output_len: int,
                       device: torch.device) -> tuple[float, list[list[int]]]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    hf.generate_batch(inputs=prompts[:2], generation_config=config, progress_bar=False)  # warm-up
    _sync(device)
    start = time.perf_counter()
    results = hf.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    _sync(device)
    elapsed = time.perf_counter() - start
    ordered = sorted(results.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
    return elapsed, [list(r.generated_tokens) for r in ordered]


def run_peer(mode: str, model: str, load_format: str, workload: Workload, dtype: str, device: str,
             seed: int) -> dict[str, Any]:
    assert mode in PEERS, mode
    torch_device = torch.device(device)
    torch_dtype = getattr(torch, dtype)
    attn = "paged|sdpa" if mode == "hf-cb" else "sdpa"
    load_start = time.perf_counter()
    hf = load_hf_model(model, load_format, torch_dtype, torch_device, seed, attn_implementation=attn)
    prompts = workload.prompts(hf.config.vocab_size)
    load_s = time.perf_counter() - load_start
    if mode == "hf-cb":
        elapsed, outputs = run_generate_batch(hf, prompts, workload.output_len, torch_device)
    else:
        elapsed, outputs = run_generate(hf, prompts, workload.output_len, torch_device, mode == "hf-compiled")
    num_output = sum(len(o) for o in outputs)
    return {"system": mode, "elapsed_s": elapsed, "output_tokens": num_output,
            "output_tok_per_s": num_output / elapsed, "load_s": load_s,
            "first_outputs": [o[:32] for o in outputs[:4]]}
