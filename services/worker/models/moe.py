"""Mixture-of-experts families: Qwen3-MoE, Qwen2-MoE (with its sigmoid-gated shared expert) and Mixtral.

Their attention is the Llama family's; the MLP of a sparse layer is a router (softmax top-k, renormalised where the
config says so) and the experts, run by one fused kernel (kernels/moe.py) on CUDA and by the plain reference on CPU.
Qwen2-MoE's shared expert, when its width is a multiple of the experts', runs in the same call as that many more
experts, weighted by sigmoid of its gate (a row appended to the router's GEMM).
Tensor parallel: every rank holds every expert's slice of the intermediate dimension; one all-reduce per layer.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels.moe import route_softmax_topk
from pagoda.services.worker.models.base import (
    Fp8Weights,
    Hidden,
    KvLayout,
    Ops,
    Placement,
    TensorParallel,
    add_norm,
    all_reduce_hidden,
    make_linear,
    make_param,
    moe_experts,
)
from pagoda.services.worker.models.llama import DecoderLayer, dense_mlp_placements, scale_rows
from pagoda.services.worker.models.llama import kv_layout as llama_kv_layout
from pagoda.shared.shapes import ModelArch, MoeArch

# Checkpoint names of the sparse block and its experts' three projections.
EXPERT_NAMES = {"mixtral": ("block_sparse_moe.", ("w1", "w3", "w2"))}
DEFAULT_EXPERT_NAMES = ("mlp.", ("gate_proj", "up_proj", "down_proj"))


class SparseMoe(nn.Module):
    """Router + routed experts (+ a gated shared expert): the MLP half of a sparse layer."""

    def __init__(self, arch: ModelArch, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
                 fp8: Fp8Weights | None) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None
        self.arch, self.moe, self.tp, self.fp8 = arch, moe, tp, fp8
        h = arch.hidden_size
        local = moe.expert_intermediate_size // tp.size
        self.num_shared = fused_gated_shared_experts(moe, fp8)  # the shared expert as experts E.. (0: apart)
        # [E (+ 1), H]: replicated, model dtype; the fused shared expert's gate as its last row
        self.router = make_param((moe.num_experts + (1 if self.num_shared else 0), h), dtype, device)
        # [E + S, 2I, H] (gate rows, then up rows) and [E + S, H, I] on this rank; e4m3 + scales [E, rows, groups]
        # in FP8
        num_experts = moe.num_experts + self.num_shared
        self.w_gate_up, self.w_gate_up_scale = make_linear(2 * local, h, dtype, device, fp8, num_experts)
        self.w_down, self.w_down_scale = make_linear(h, local, dtype, device, fp8, num_experts)
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        if moe.shared_expert_intermediate_size and not self.num_shared:  # one always-on expert x sigmoid(gate(x))
            shared = moe.shared_expert_intermediate_size // tp.size
            self.shared_gate_up = make_param((2 * shared, h), dtype, device)  # [2S, H]
            self.shared_down = make_param((h, shared), dtype, device)  # [H, S]
            self.shared_gate = make_param((1, h), dtype, device)  # [1, H]

    def forward(self, x: Hidden, residual: torch.Tensor, norm: torch.Tensor,
                ops: Ops) -> tuple[Hidden, torch.Tensor]:
        """x: o's output, or its split-K partials (one device), summed by the residual norm."""
        h, residual = add_norm(x, residual, norm, self.arch.rms_norm_eps, ops)  # [T, H] each
        router_logits = F.linear(h, self.router)  # [T, E (+ 1: the shared expert's gate)]
        weights, ids = route_softmax_topk(router_logits, self.moe.top_k, self.moe.renormalize,
                                          self.num_shared)  # [T, k + S] each
        group = self.fp8.group_size if self.fp8 is not None else None
        args = (h, self.w_gate_up, self.w_down, weights, ids, self.w_gate_up_scale, self.w_down_scale, group)
        if self.shared_gate_up is not None and self.shared_down is not None and self.shared_gate is not None:
            shared = F.linear(ops.silu_and_mul(F.linear(h, self.shared_gate_up)), self.shared_down)  # [T, H]
            out = ops.moe_experts(*args) + torch.sigmoid(F.linear(h, self.shared_gate)) * shared
            return self.tp.all_reduce(out), residual
        out = moe_experts(ops, self.tp.size, self.fp8, *args)  # [T, H], or its top-k terms (one device only)
        return all_reduce_hidden(self.tp, out), residual

    def placements(self, prefix: str, rank: int) -> Iterator[Placement]:
        """Per-expert checkpoint keys (`mlp.experts.{e}.gate_proj.weight`, Mixtral's
        `block_sparse_moe.experts.{e}.w1.weight`); fused [E, ...] expert tensors are split into these names by the
        safetensors source."""
        block, (gate, up, down) = EXPERT_NAMES.get(self.arch.model_type, DEFAULT_EXPERT_NAMES)
        h, full, num_experts = self.arch.hidden_size, self.moe.expert_intermediate_size, self.moe.num_experts
        yield Placement(prefix + block + "gate.weight", (num_experts, h), self.router[:num_experts], None)
        for e in range(self.moe.num_experts):
            yield from dense_mlp_placements(f"{prefix}{block}experts.{e}.", h, full, rank, self.w_gate_up[e],
                                            _expert(self.w_gate_up_scale, e), self.w_down[e],
                                            _expert(self.w_down_scale, e), names=(gate, up, down))
        if self.shared_gate_up is not None and self.shared_down is not None and self.shared_gate is not None:
            yield from dense_mlp_placements(prefix + block + "shared_expert.", h,
                                            self.moe.shared_expert_intermediate_size, rank, self.shared_gate_up,
                                            None, self.shared_down, None)
            yield Placement(prefix + block + "shared_expert_gate.weight", (1, h), self.shared_gate, None)
        if self.num_shared:
            yield Placement(prefix + block + "shared_expert_gate.weight", (1, h), self.router[num_experts:], None)
        for s in range(self.num_shared):
            e = num_experts + s
            yield from shared_expert_placements(prefix + block + "shared_expert.", h,
                                                self.moe.shared_expert_intermediate_size, full * s, rank,
                                                self.w_gate_up[e], _expert(self.w_gate_up_scale, e), self.w_down[e],
                                                _expert(self.w_down_scale, e))


def _expert(scale: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if scale is None else scale[e]


def fused_gated_shared_experts(moe: MoeArch, fp8: Fp8Weights | None) -> int:
    """How many I-wide experts Qwen2-MoE's gated shared expert joins the routed ones as (0: it stays a separate MLP):
    its width over I where that divides; apart under FP8, where it stays in the model dtype as it always has."""
    shared, inter = moe.shared_expert_intermediate_size, moe.expert_intermediate_size
    if not shared or not moe.shared_expert_gated or shared % inter or fp8 is not None:
        return 0
    return shared // inter


def shared_expert_placements(prefix: str, hidden: int, full_inter: int, first: int, rank: int,
                             gate_up: torch.Tensor, gate_up_scale: torch.Tensor | None, down: torch.Tensor,
                             down_scale: torch.Tensor | None) -> Iterator[Placement]:
    """One I-wide piece of a shared MLP (`prefix` gate_proj / up_proj [full_inter, H], down_proj [H, full_inter]) as
    a fused expert: its rows [first, first + I) and those columns of down_proj; this rank holds its I / tp of them
    (local = down's columns), as it does of every routed expert."""
    local = down.shape[1]
    start = first + rank * local
    yield Placement(prefix + "gate_proj.weight", (full_inter, hidden), gate_up[:local], 0, start, local,
                    scale_rows(gate_up_scale, slice(0, local)))
    yield Placement(prefix + "up_proj.weight", (full_inter, hidden), gate_up[local:], 0, start, local,
                    scale_rows(gate_up_scale, slice(local, None)))
    yield Placement(prefix + "down_proj.weight", (hidden, full_inter), down, 1, start, local, down_scale)


def is_sparse_layer(moe: MoeArch, index: int) -> bool:
    return index in moe.sparse_layers


def make_layer(arch: ModelArch, index: int, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
               fp8: Fp8Weights | None) -> DecoderLayer:
    """A Llama-family attention with the sparse block where the config makes this layer sparse, else dense."""
    assert arch.moe is not None
    if not is_sparse_layer(arch.moe, index):
        return DecoderLayer(arch, tp, dtype, device, fp8)
    return DecoderLayer(arch, tp, dtype, device, fp8, mlp=SparseMoe(arch, tp, dtype, device, fp8))


def kv_layout(arch: ModelArch, tp_size: int) -> KvLayout:
    return llama_kv_layout(arch, tp_size)
