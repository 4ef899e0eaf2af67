"""Llama-family decoder layer (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM): grouped-query attention over the paged
KV cache (q/k/v bias for Qwen2, q/k RMSNorm for Qwen3) and a SiLU-gated MLP. Mixture-of-experts families reuse the
attention half and swap the MLP for a sparse block (models/moe.py).

Tensor parallel: q/k/v and gate/up are split by columns (heads, MLP units), o and down by rows, with
an all-reduce after each.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from pagoda.kernels.fp8_weight_only import DeferredSum
from pagoda.services.worker.models.base import (
    AttentionMetadata,
    Fp8Weights,
    Hidden,
    KvLayout,
    Ops,
    Placement,
    TensorParallel,
    add_norm,
    all_reduce_hidden,
    deferred_linear,
    fuse_silu_gemv,
    make_linear,
    make_param,
    qkv_prep_sums_split_k,
    quantized_linear,
    uses_weight_only,
)
from pagoda.services.worker.models.rope import permute_rotary_dims
from pagoda.shared.shapes import ModelArch


class MlpBlock(Protocol):
    """The half of a layer after attention: (o's output, residual, post-attention norm) -> (out, residual); o's
    output may be its split-K partials (one device), for the block's residual norm to sum. A mixture-of-experts
    family supplies one (models/moe.py); None on a layer means the dense MLP below."""

    def __call__(self, x: Hidden, residual: torch.Tensor, norm: torch.Tensor,
                 ops: Ops) -> tuple[Hidden, torch.Tensor]: ...

    def placements(self, prefix: str, rank: int) -> Iterator[Placement]: ...


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
                 fp8: Fp8Weights | None = None, mlp: MlpBlock | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.num_heads = arch.num_heads // tp.size
        self.num_kv_heads = arch.num_kv_heads // tp.size
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * arch.head_dim
        self.kv_size = self.num_kv_heads * arch.head_dim
        h = arch.hidden_size
        self.fp8 = fp8
        self.input_norm = make_param((h,), dtype, device)  # [H]
        self.post_attn_norm = make_param((h,), dtype, device)  # [H]
        # [Q + 2KV, H] local rows
        self.qkv_weight, self.qkv_weight_scale = make_linear(self.q_size + 2 * self.kv_size, h, dtype, device, fp8)
        self.qkv_bias = make_param((self.q_size + 2 * self.kv_size,), dtype, device) if arch.attention_bias else None
        self.q_norm = make_param((arch.head_dim,), dtype, device) if arch.qk_norm else None  # [D]
        self.k_norm = make_param((arch.head_dim,), dtype, device) if arch.qk_norm else None
        self.o_weight, self.o_weight_scale = make_linear(h, self.q_size, dtype, device, fp8)  # [H, Q] local columns
        self.o_bias = make_param((h,), dtype, device) if arch.o_proj_bias else None  # [H], added once (rank 0)
        self.mlp = mlp  # a sparse block replaces the dense MLP's weights
        self.gate_up_weight = self.gate_up_weight_scale = self.down_weight = self.down_weight_scale = None
        if mlp is None:
            local_mlp = arch.intermediate_size // tp.size
            # [2I, H]: gate rows, up rows; [H, I]
            self.gate_up_weight, self.gate_up_weight_scale = make_linear(2 * local_mlp, h, dtype, device, fp8)
            self.down_weight, self.down_weight_scale = make_linear(h, local_mlp, dtype, device, fp8)
        # Per-tensor scales of an fp8 KV cache (cached = k / k_scale): from the checkpoint, calibrated, or 1.
        # Tensors, not floats, so CUDA graphs captured before a calibration read the new values.
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32, device=device))  # [1]
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32, device=device))  # [1]
        self.calibrate_kv = False  # set for one step: k_scale, v_scale := 2 x amax / 448 of that step's K, V
        self.scale = arch.head_dim ** -0.5

    def linear(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
               bias: torch.Tensor | None, ops: Ops) -> torch.Tensor:
        return quantized_linear(x, weight, weight_scale, self.fp8, bias, ops)

    def _fused_quant(self, x: Hidden, weight: torch.Tensor, weight_scale: torch.Tensor | None, ops: Ops) -> bool:
        """Per-channel W8A8: the op before the GEMM quantizes the activations in its own pass (for split-K partials,
        the norm that sums them, where ops has it)."""
        if isinstance(x, DeferredSum):
            if ops.add_rms_norm_parts_quant is None:
                return False
            x = x.parts[0]  # [T, H]: the rows
        return (weight_scale is not None and self.fp8 is not None and self.fp8.group_size is None
                and not uses_weight_only(x, weight, ops))

    def _calibrate_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """KV scales from this step's K/V amax (with 2x headroom for later tokens): one step, then fixed."""
        from pagoda.kernels.reference import FP8_MAX, FP8_MIN_AMAX

        self.k_scale.copy_(k.abs().amax().float().clamp(min=FP8_MIN_AMAX) * 2.0 / FP8_MAX)
        self.v_scale.copy_(v.abs().amax().float().clamp(min=FP8_MIN_AMAX) * 2.0 / FP8_MAX)
        self.calibrate_kv = False

    def _norm_linear(self, x: Hidden, residual: torch.Tensor | None, norm: torch.Tensor,
                     weight: torch.Tensor, weight_scale: torch.Tensor | None, bias: torch.Tensor | None,
                     ops: Ops, defer: bool = False) -> tuple[Hidden, torch.Tensor]:
        """add_rms_norm then a linear layer: (out [T, N], new residual [T, H]). Per-channel FP8 quantizes the
        activations in the norm's pass (one kernel fewer per GEMM); split-K partials of x are summed in it. defer:
        the caller's next op takes a weight-only layer's split-K partials (out may be a DeferredSum)."""
        eps = self.arch.rms_norm_eps
        if self._fused_quant(x, weight, weight_scale, ops):
            if isinstance(x, DeferredSum):
                assert residual is not None and ops.add_rms_norm_parts_quant is not None, "partials come with one"
                h_q, h_scale, residual = ops.add_rms_norm_parts_quant(x.parts, x.dtype, residual, norm, eps)
            else:
                h_q, h_scale, residual = ops.add_rms_norm_quant(x, residual, norm, eps)  # [T, H] e4m3, [T, 1]
            return ops.fp8_matmul(h_q, h_scale, weight, weight_scale, None, x.dtype, bias), residual
        h, residual = add_norm(x, residual, norm, eps, ops)  # [T, H] each
        if defer and bias is None:
            out = deferred_linear(h, weight, weight_scale, self.fp8, ops)
            if out is not None:
                return out, residual
        return self.linear(h, weight, weight_scale, bias, ops), residual

    def _mlp(self, gate_up: torch.Tensor, ops: Ops) -> Hidden:
        """silu(gate) * up, then down [T, H] (per-channel FP8: quantized in the activation's pass; weight-only
        FP8 on one device: the split-K sum left to the next norm)."""
        if self._fused_quant(gate_up, self.down_weight, self.down_weight_scale, ops):
            mlp_q, mlp_scale = ops.silu_and_mul_quant(gate_up)  # [T, I] e4m3, [T, 1]
            return ops.fp8_matmul(mlp_q, mlp_scale, self.down_weight, self.down_weight_scale, None, gate_up.dtype)
        if self.tp.size == 1 and fuse_silu_gemv(gate_up.numel() // gate_up.shape[-1]):
            assert self.down_weight is not None
            down = deferred_linear(gate_up, self.down_weight, self.down_weight_scale, self.fp8, ops, gated=True)
            if down is not None:
                return down
        mlp = ops.silu_and_mul(gate_up)  # [T, I]
        if self.tp.size == 1:
            assert self.down_weight is not None
            down = deferred_linear(mlp, self.down_weight, self.down_weight_scale, self.fp8, ops)
            if down is not None:
                return down
        return self.linear(mlp, self.down_weight, self.down_weight_scale, None, ops)

    def forward(self, x: Hidden, residual: torch.Tensor | None, positions: torch.Tensor,
                rope_cache: tuple[torch.Tensor, torch.Tensor], kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, ops: Ops) -> tuple[Hidden, torch.Tensor]:
        eps = self.arch.rms_norm_eps
        fused_prep = ops.prepare_qkv is not None and ops.attend is not None and not self.calibrate_kv
        qkv, residual = self._norm_linear(x, residual, self.input_norm, self.qkv_weight, self.qkv_weight_scale,
                                          self.qkv_bias, ops,
                                          defer=fused_prep and qkv_prep_sums_split_k())  # [T, Q + 2KV], [T, H]
        fp8_cache = kv_cache[0].dtype == torch.float8_e4m3fn
        if fused_prep:
            assert ops.prepare_qkv is not None and ops.attend is not None
            k_scale, v_scale = (self.k_scale, self.v_scale) if fp8_cache else (None, None)
            q = ops.prepare_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm, self.k_norm,
                                eps, rope_cache[0], rope_cache[1], positions, kv_cache[0], kv_cache[1],
                                meta.slot_mapping, k_scale, v_scale)  # [T, heads, D]; K/V now in the cache
            attn = ops.attend(q, kv_cache[0], kv_cache[1], meta, self.scale, k_scale, v_scale)  # [T, heads, D]
            return self._finish(attn, residual, ops)
        assert isinstance(qkv, torch.Tensor), "partials only for prepare_qkv"
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, heads, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, kv_heads, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = ops.rms_norm(q, self.q_norm, eps)
            k = ops.rms_norm(k, self.k_norm, eps)
        q, k = ops.rope(q, k, rope_cache[0], rope_cache[1], positions)
        if fp8_cache:
            if self.calibrate_kv:
                self._calibrate_kv(k, v)
            attn = ops.attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.k_scale,
                                 self.v_scale)  # [T, heads, D]
        else:
            attn = ops.attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, heads, D]
        return self._finish(attn, residual, ops)

    def _finish(self, attn: torch.Tensor, residual: torch.Tensor, ops: Ops) -> tuple[Hidden, torch.Tensor]:
        """o projection, residual add + norm, MLP: attn [T, heads, D] -> (layer output [T, H], residual [T, H])."""
        attn = attn.reshape(-1, self.q_size)  # [T, Q]
        deferrable = self.tp.size == 1 and self.o_bias is None  # split-K partials carry no bias
        x = deferred_linear(attn, self.o_weight, self.o_weight_scale, self.fp8, ops) if deferrable else None
        if x is None:
            bias = self.o_bias if self.tp.rank == 0 else None  # one rank's bias in the all-reduced sum
            x = self.tp.all_reduce(self.linear(attn, self.o_weight, self.o_weight_scale, bias, ops))  # [T, H]
        if self.mlp is not None:
            return self.mlp(x, residual, self.post_attn_norm, ops)
        gate_up, residual = self._norm_linear(x, residual, self.post_attn_norm, self.gate_up_weight,
                                              self.gate_up_weight_scale, None, ops)  # [T, 2I], [T, H]
        assert isinstance(gate_up, torch.Tensor), "not deferred"
        return all_reduce_hidden(self.tp, self._mlp(gate_up, ops)), residual


    def _rotary_order(self) -> torch.Tensor | None:
        """Slot -> checkpoint dim of every q/k head [D] where rope covers only part of it (arch.rotary_dim)."""
        if self.arch.rope_dim == self.head_dim:
            return None
        return permute_rotary_dims(self.head_dim, self.arch.rope_dim)

    def placements(self, prefix: str, rank: int) -> Iterator[Placement]:
        """This layer's Hugging Face tensors (`prefix` = "model.layers.{i}.") and where this rank's slices go."""
        arch, h = self.arch, self.arch.hidden_size
        q, kv = self.q_size, self.kv_size
        yield Placement(prefix + "input_layernorm.weight", (h,), self.input_norm, None)
        yield Placement(prefix + "post_attention_layernorm.weight", (h,), self.post_attn_norm, None)
        head_order = self._rotary_order()  # [D] or None: q and k heads permuted for a partial rope
        for name, rows, size, full in (("q_proj", slice(0, q), q, arch.q_size),
                                       ("k_proj", slice(q, q + kv), kv, arch.kv_size),
                                       ("v_proj", slice(q + kv, q + 2 * kv), kv, arch.kv_size)):
            attn = prefix + "self_attn." + name
            order = None
            if head_order is not None and name != "v_proj":  # each head of this rank's slice the same way
                order = (torch.arange(0, size, self.head_dim)[:, None] + head_order[None, :]).reshape(-1)  # [size]
            yield Placement(attn + ".weight", (full, h), self.qkv_weight[rows], 0, rank * size, size,
                            scale_rows(self.qkv_weight_scale, rows), order)
            if self.qkv_bias is not None:
                yield Placement(attn + ".bias", (full,), self.qkv_bias[rows], 0, rank * size, size, row_order=order)
        yield Placement(prefix + "self_attn.o_proj.weight", (h, arch.q_size), self.o_weight, 1, rank * q, q,
                        self.o_weight_scale)
        if self.o_bias is not None:
            yield Placement(prefix + "self_attn.o_proj.bias", (h,), self.o_bias, None)
        if self.q_norm is not None and self.k_norm is not None:
            yield Placement(prefix + "self_attn.q_norm.weight", (arch.head_dim,), self.q_norm, None,
                            row_order=head_order)
            yield Placement(prefix + "self_attn.k_norm.weight", (arch.head_dim,), self.k_norm, None,
                            row_order=head_order)
        if self.mlp is not None:
            yield from self.mlp.placements(prefix, rank)
            return
        assert self.gate_up_weight is not None and self.down_weight is not None
        yield from dense_mlp_placements(prefix + "mlp.", arch.hidden_size, arch.intermediate_size, rank,
                                        self.gate_up_weight, self.gate_up_weight_scale, self.down_weight,
                                        self.down_weight_scale)


def dense_mlp_placements(prefix: str, hidden: int, full_inter: int, rank: int, gate_up: torch.Tensor,
                         gate_up_scale: torch.Tensor | None, down: torch.Tensor, down_scale: torch.Tensor | None,
                         names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> Iterator[Placement]:
    """A SiLU-gated MLP's three tensors (`prefix` + gate/up/down names) into fused gate_up [2I, H] and down
    [H, I] (I: this rank's columns of `full_inter`)."""
    local = down.shape[1]
    gate, up, down_name = names
    yield Placement(prefix + gate + ".weight", (full_inter, hidden), gate_up[:local], 0, rank * local, local,
                    scale_rows(gate_up_scale, slice(0, local)))
    yield Placement(prefix + up + ".weight", (full_inter, hidden), gate_up[local:], 0, rank * local, local,
                    scale_rows(gate_up_scale, slice(local, None)))
    yield Placement(prefix + down_name + ".weight", (hidden, full_inter), down, 1, rank * local, local, down_scale)


def scale_rows(scale: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if scale is None else scale[rows]


def kv_layout(arch: ModelArch, tp_size: int) -> KvLayout:
    """K and V per kv head."""
    return KvLayout(num_tensors=2, num_heads=arch.num_kv_heads // tp_size, head_dim=arch.head_dim)


def make_layer(arch: ModelArch, index: int, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
               fp8: Fp8Weights | None) -> DecoderLayer:
    return DecoderLayer(arch, tp, dtype, device, fp8)
