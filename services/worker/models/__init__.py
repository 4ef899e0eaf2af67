"""Model families behind one small interface, and the causal LM that stacks a family's layers.

A family is a module with `make_layer(arch, index, tp, dtype, device, fp8)` (one decoder layer, which yields its
own weight placements) and `kv_layout(arch, tp_size)` (what a token leaves in a layer's cache). Adding an
architecture: a file here, its entry in FAMILIES, its shapes in shared/shapes.py and its parity test.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import gemv, pdl
from pagoda.services.worker.models import deepseek, glm4_moe, llama, moe
from pagoda.services.worker.models.base import (
    AttentionMetadata,
    Fp8Weights,
    Hidden,
    KvLayout,
    Ops,
    Placement,
    SingleDevice,
    TensorParallel,
    add_norm,
    ops_for,
    reference_ops,
    triton_ops,
)
from pagoda.services.worker.models.rope import RopeSpec, rope_table
from pagoda.shared.shapes import ModelArch

__all__ = ["AttentionMetadata", "CausalLM", "Fp8Weights", "KvLayout", "Ops", "Placement", "SingleDevice",
           "TensorParallel", "ops_for", "reference_ops", "triton_ops", "FAMILIES", "family_of"]


FAMILIES: dict[str, ModuleType] = {
    "llama": llama, "mistral": llama, "qwen2": llama, "qwen3": llama,
    "qwen2_moe": moe, "qwen3_moe": moe, "mixtral": moe,
    "deepseek_v2": deepseek, "deepseek_v3": deepseek, "glm4_moe": glm4_moe,
}


def family_of(arch: ModelArch) -> ModuleType:
    family = FAMILIES.get(arch.model_type)
    assert family is not None, f"no model family for {arch.model_type!r} (shapes.py accepted it)"
    return family


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and the LM head of one tensor-parallel rank."""

    def __init__(self, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                 tp: TensorParallel | None = None, max_positions: int | None = None, ops: Ops | None = None,
                 fp8: Fp8Weights | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.ops = ops or ops_for(device)
        self.tp = tp or SingleDevice()
        self.dtype = dtype
        self.fp8 = fp8  # None: linear weights in dtype; else e4m3 (embeddings, norms and the LM head stay in dtype)
        self.vocab_per_rank = -(-arch.vocab_size // self.tp.size)
        self.vocab_start = self.tp.rank * self.vocab_per_rank
        h = arch.hidden_size
        # [V / tp, H]: this rank's vocabulary rows (the last rank's tail past vocab_size stays zero)
        self.embed = nn.Parameter(torch.zeros(self.vocab_per_rank, h, dtype=dtype, device=device),
                                  requires_grad=False)
        self.family = family_of(arch)
        self.layers = nn.ModuleList(self.family.make_layer(arch, index, self.tp, dtype, device, fp8)
                                    for index in range(arch.num_layers))
        self.final_norm = nn.Parameter(torch.empty(h, dtype=dtype, device=device), requires_grad=False)
        self.lm_head = self.embed if arch.tie_word_embeddings else nn.Parameter(
            torch.zeros(self.vocab_per_rank, h, dtype=dtype, device=device), requires_grad=False)
        # [P, rotary dim] each
        self.rope_cache = rope_table(RopeSpec.of(arch), max_positions or arch.context_limit, dtype, device)

    def kv_layout(self) -> KvLayout:
        return self.family.kv_layout(self.arch, self.tp.size)

    def placements(self) -> Iterator[Placement]:
        """Every Hugging Face tensor this rank needs and where its slice goes."""
        arch = self.arch
        h = arch.hidden_size
        vocab_rows = min(self.vocab_per_rank, arch.vocab_size - self.vocab_start)
        yield Placement("model.embed_tokens.weight", (arch.vocab_size, h), self.embed[:vocab_rows], 0,
                        self.vocab_start, vocab_rows)
        if not arch.tie_word_embeddings:
            yield Placement("lm_head.weight", (arch.vocab_size, h), self.lm_head[:vocab_rows], 0,
                            self.vocab_start, vocab_rows)
        yield Placement("model.norm.weight", (h,), self.final_norm, None)
        for index, layer in enumerate(self.layers):
            yield from layer.placements(f"model.layers.{index}.", self.tp.rank)

    def weights_loaded(self) -> None:
        """Once the checkpoint's values are in (weights.fill): each layer module builds what it derives from them."""
        for module in self.modules():
            hook = getattr(module, "weights_loaded", None)
            if module is not self and callable(hook):
                hook()

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed)  # [T, H]
        local = input_ids - self.vocab_start  # [T]
        mine = (local >= 0) & (local < self.vocab_per_rank)
        rows = F.embedding(local.clamp(0, self.vocab_per_rank - 1), self.embed)  # [T, H]
        return self.tp.all_reduce(rows * mine[:, None].to(rows.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, H]."""
        x: Hidden = self.embed_tokens(input_ids)  # [T, H]
        residual: torch.Tensor | None = None
        with pdl.scope(self.pdl_mode(input_ids.shape[0])):
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, positions, self.rope_cache, kv_cache, meta, self.ops)
            x, _ = add_norm(x, residual, self.final_norm, self.arch.rms_norm_eps, self.ops)
        return x

    def pdl_mode(self, num_tokens: int) -> int:
        """How a step of num_tokens launches its Triton kernels (kernels/pdl.py), as measured fastest on an H200:
        single-token steps of models whose decode chain is mostly Triton kernels (FP8 weight-only linears, MoE
        GEMVs, MLA) trigger their dependents first; FP8 steps of 2-8 tokens trigger at exit; everything else,
        bf16 dense models above all (cuBLAS between the kernels), launches without PDL."""
        if pdl.forced():
            return pdl.FIRST
        if num_tokens == 1 and (self.fp8 is not None or self.arch.moe is not None or self.arch.mla is not None
                                or (gemv.enabled() and self.ops.dense_gemv is not None)):
            return pdl.FIRST
        if self.fp8 is not None and 2 <= num_tokens <= 8:
            return pdl.AT_EXIT
        return 0

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab_size] logits in the model dtype (gathered across ranks). The sampler upcasts
        where it needs fp32; an all-greedy batch takes the argmax of these directly."""
        logits = F.linear(hidden, self.lm_head)  # [N, V / tp]
        logits = self.tp.all_gather_last_dim(logits)  # [N, V rounded up to tp]
        return logits[:, :self.arch.vocab_size]
