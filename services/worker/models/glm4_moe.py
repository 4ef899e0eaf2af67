"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (transformers' Glm4MoeForCausalLM): Llama-family grouped-query attention (q/k/v
bias, optional q/k RMSNorm, rope over the first partial_rotary_factor of each head) in front of DeepSeek-V3's MoE.

Attention is models/llama.py's DecoderLayer. Its rope covers only the first rotary_dim dims of a head, in
rotate-half order; the kernels rotate whole heads, so the loader permutes every q/k head (weights, biases, norm
weights) to put the rotary pairs on the kernels' pairs and the rope table passes the other slots through
(rope.permute_rotary_dims): q . k, and so the attention, is unchanged, and the cache holds permuted K (every K of
the model the same way: prefix caching, swapping and preemption do not see it).

MLP: layers before first_k_dense_replace are dense; the others are DeepSeek-V3's sparse block (models/deepseek.py
DeepseekMoe: sigmoid scores, e_score_correction_bias, group-limited top-k, routed_scaling_factor, the shared experts
fused in as more experts), behind the Llama layer's residual norm. The checkpoints' MTP layers
(model.layers.{num_hidden_layers}.*, num_nextn_predict_layers) are not loaded.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pagoda.services.worker.models.base import (
    Fp8Weights,
    Hidden,
    KvLayout,
    Ops,
    Placement,
    TensorParallel,
    add_norm,
    all_reduce_hidden,
)
from pagoda.services.worker.models.deepseek import DeepseekMoe
from pagoda.services.worker.models.llama import DecoderLayer
from pagoda.services.worker.models.llama import kv_layout as llama_kv_layout
from pagoda.shared.shapes import ModelArch


class Glm4Moe(DeepseekMoe):
    """DeepSeek-V3's sparse block as a Llama layer's MLP block: the post-attention norm, then router and experts."""

    def forward(self, x: Hidden, residual: torch.Tensor, norm: torch.Tensor,  # type: ignore[override]
                ops: Ops) -> tuple[Hidden, torch.Tensor]:
        """x: o's output (or its split-K partials on one device, summed by the norm) -> (out [T, H], residual)."""
        h, residual = add_norm(x, residual, norm, self.arch.rms_norm_eps, ops)  # [T, H] each
        return all_reduce_hidden(self.tp, super().forward(h, ops)), residual

    def placements(self, prefix: str, rank: int) -> Iterator[Placement]:
        """`prefix` = "model.layers.{i}." (the Llama layer's): its mlp.gate, mlp.experts.{e}, mlp.shared_experts."""
        return super().placements(prefix + "mlp.", rank)


def make_layer(arch: ModelArch, index: int, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
               fp8: Fp8Weights | None) -> DecoderLayer:
    assert arch.moe is not None
    if index not in arch.moe.sparse_layers:
        return DecoderLayer(arch, tp, dtype, device, fp8)
    return DecoderLayer(arch, tp, dtype, device, fp8, mlp=Glm4Moe(arch, tp, dtype, device, fp8))


def kv_layout(arch: ModelArch, tp_size: int) -> KvLayout:
    return llama_kv_layout(arch, tp_size)
