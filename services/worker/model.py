"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) over a flattened token batch with paged KV.

Tensor parallel: q/k/v and gate/up are split by columns (heads, MLP units), o and down by rows, with
an all-reduce after each; embeddings and the LM head are split by vocabulary rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import reference as ref
from pagoda.shared.shapes import ModelArch


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the KV cache and what each query attends to; passed, never global."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: tokens in the cache after this step
    query_start_loc: torch.Tensor  # [B + 1] int32: sequence b's queries are rows [qsl[b], qsl[b+1])
    seq_lens_host: list[int]
    query_lens_host: list[int]
    max_query_len: int
    max_seq_len: int


class AttentionBackend(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor: ...


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend over the paged cache (PyTorch reference).
    k_scale, v_scale [1] fp32: the per-tensor scales of an fp8 cache (ignored by other caches)."""
    ref.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    return ref.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_host,
                               meta.query_lens_host, scale, fresh_kv=(k, v), k_scale=k_scale, v_scale=v_scale)


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The same with the Triton kernels (GPU): write K/V into their slots, then paged attention."""
    from pagoda.kernels.kv_cache import write_kv
    from pagoda.kernels.paged_attention import paged_attention

    write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                           meta.max_query_len, meta.max_seq_len, scale, k_scale=k_scale, v_scale=v_scale)


def triton_attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Paged attention over caches that already hold this step's K/V (written by prepare_qkv)."""
    from pagoda.kernels.paged_attention import paged_attention

    return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                           meta.max_query_len, meta.max_seq_len, scale, k_scale=k_scale, v_scale=v_scale)


@dataclass(frozen=True, slots=True)
class Ops:
    """The kernels one model instance uses: plain PyTorch on CPU, Triton on CUDA (same semantics)."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float],
                           tuple[torch.Tensor, torch.Tensor]]
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                   tuple[torch.Tensor, torch.Tensor]]  # (q, k, cos cache, sin cache, positions) -> q, k
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    attention: AttentionBackend
    # (x [..., K], e4m3 weight [N, K], fp32 scales [N, 1] or [N, K / g], group size g or None, bias) -> [..., N]
    fp8_linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int | None, torch.Tensor | None],
                         torch.Tensor] = ref.fp8_linear
    # Per-channel FP8: the activation quantization fused into the op before each GEMM, and the GEMM alone.
    # (x, residual, weight, eps) -> (e4m3 [T, D], scales [T, 1], summed residual [T, D])
    add_rms_norm_quant: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float],
                                 tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = ref.add_rms_norm_quant_fp8
    silu_and_mul_quant: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = ref.silu_and_mul_quant_fp8
    # (x_q, x_scale, weight, weight_scale, group_size, out dtype, bias) -> [M, N]
    fp8_matmul: Callable[..., torch.Tensor] = ref.fp8_matmul
    # One pass from the fused qkv rows to attention inputs (q/k norm, rope, K/V into the cache: q returned) and
    # attention over the cache alone; None: the separate ops above (rms_norm, rope, attention writing K/V).
    prepare_qkv: Callable[..., torch.Tensor] | None = None
    attend: Callable[..., torch.Tensor] | None = None


def _reference_rope(q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_cache[positions], sin_cache[positions]  # [T, D] each
    return ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)


def reference_ops() -> Ops:
    return Ops(rms_norm=ref.rms_norm, add_rms_norm=ref.add_rms_norm, rope=_reference_rope,
               silu_and_mul=ref.silu_and_mul, attention=reference_attention)


def triton_ops() -> Ops:
    from pagoda.kernels import activation, fp8, norm, qkv_prep, rope

    def fused_rope(q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.apply_rope(q, k, cos_cache, sin_cache, positions=positions, inplace=True)

    return Ops(rms_norm=norm.rms_norm, add_rms_norm=norm.add_rms_norm, rope=fused_rope,
               silu_and_mul=activation.silu_and_mul, attention=triton_attention, fp8_linear=fp8.fp8_linear,
               add_rms_norm_quant=fp8.add_rms_norm_quant_fp8, silu_and_mul_quant=fp8.silu_and_mul_quant_fp8,
               fp8_matmul=fp8.fp8_matmul, prepare_qkv=qkv_prep.prepare_qkv, attend=triton_attend)


def ops_for(device: torch.device) -> Ops:
    return triton_ops() if device.type == "cuda" else reference_ops()


class TensorParallel(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...
    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor: ...
    def agree_min(self, value: int, device: torch.device) -> int: ...


class SingleDevice:
    """tensor_parallel_size 1: the collectives are identities."""

    rank = 0
    size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def agree_min(self, value: int, device: torch.device) -> int:
        return value


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, with linear or llama3 scaling where configured."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif scaling.get("rope_type") == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


@dataclass(frozen=True, slots=True)
class Fp8Weights:
    """Every linear layer (fused qkv, o, fused gate_up, down) in FP8: e4m3 weights [N, K] with fp32 scales
    [N, 1] (one per output channel) or, with group_size g, [N, ceil(K / g)] (one per row and g columns: a
    checkpoint's g x g block scales repeated along the rows, so fused and sharded weights keep any row split).
    Activations are quantized per token (and per g columns with group_size) on the fly."""

    group_size: int | None = None


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
                 fp8: Fp8Weights | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.num_heads = arch.num_heads // tp.size
        self.num_kv_heads = arch.num_kv_heads // tp.size
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * arch.head_dim
        self.kv_size = self.num_kv_heads * arch.head_dim
        local_mlp = arch.intermediate_size // tp.size
        h = arch.hidden_size

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        def linear(rows: int, cols: int) -> tuple[nn.Parameter, nn.Parameter | None]:
            """A weight [rows, cols] in the model dtype, or in e4m3 with its fp32 scales."""
            if fp8 is None:
                return param(rows, cols), None
            groups = 1 if fp8.group_size is None else -(-cols // fp8.group_size)
            weight = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device)
            scales = torch.empty(rows, groups, dtype=torch.float32, device=device)  # [rows, 1 or groups]
            return (nn.Parameter(weight, requires_grad=False), nn.Parameter(scales, requires_grad=False))

        self.fp8 = fp8
        self.input_norm = param(h)  # [H]
        self.post_attn_norm = param(h)  # [H]
        self.qkv_weight, self.qkv_weight_scale = linear(self.q_size + 2 * self.kv_size, h)  # [Q + 2KV, H] local
        self.qkv_bias = param(self.q_size + 2 * self.kv_size) if arch.attention_bias else None
        self.q_norm = param(arch.head_dim) if arch.qk_norm else None  # [D]
        self.k_norm = param(arch.head_dim) if arch.qk_norm else None
        self.o_weight, self.o_weight_scale = linear(h, self.q_size)  # [H, Q] local columns
        self.gate_up_weight, self.gate_up_weight_scale = linear(2 * local_mlp, h)  # [2I, H]: gate rows, up rows
        self.down_weight, self.down_weight_scale = linear(h, local_mlp)  # [H, I]
        # Per-tensor scales of an fp8 KV cache (cached = k / k_scale): from the checkpoint, calibrated, or 1.
        # Tensors, not floats, so CUDA graphs captured before a calibration read the new values.
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32, device=device))  # [1]
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32, device=device))  # [1]
        self.calibrate_kv = False  # set for one step: k_scale, v_scale := 2 x amax / 448 of that step's K, V
        self.scale = arch.head_dim ** -0.5

    def linear(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
               bias: torch.Tensor | None, ops: Ops) -> torch.Tensor:
        if weight_scale is None:
            return F.linear(x, weight, bias)
        assert self.fp8 is not None
        return ops.fp8_linear(x, weight, weight_scale, self.fp8.group_size, bias)

    def _calibrate_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """KV scales from this step's K/V amax (with 2x headroom for later tokens): one step, then fixed."""
        from pagoda.kernels.reference import FP8_MAX, FP8_MIN_AMAX

        self.k_scale.copy_(k.abs().amax().float().clamp(min=FP8_MIN_AMAX) * 2.0 / FP8_MAX)
        self.v_scale.copy_(v.abs().amax().float().clamp(min=FP8_MIN_AMAX) * 2.0 / FP8_MAX)
        self.calibrate_kv = False

    def _norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor,
                     weight: torch.Tensor, weight_scale: torch.Tensor | None, bias: torch.Tensor | None,
                     ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """add_rms_norm then a linear layer: (out [T, N], new residual [T, H]). Per-channel FP8 quantizes the
        activations in the norm's pass (one kernel fewer per GEMM)."""
        eps = self.arch.rms_norm_eps
        if weight_scale is not None and self.fp8 is not None and self.fp8.group_size is None:
            h_q, h_scale, residual = ops.add_rms_norm_quant(x, residual, norm, eps)  # [T, H] e4m3, [T, 1]
            return ops.fp8_matmul(h_q, h_scale, weight, weight_scale, None, x.dtype, bias), residual
        h, residual = ops.add_rms_norm(x, residual, norm, eps)  # [T, H] each
        return self.linear(h, weight, weight_scale, bias, ops), residual

    def _mlp(self, gate_up: torch.Tensor, ops: Ops) -> torch.Tensor:
        """silu(gate) * up, then down [T, H] (per-channel FP8: quantized in the activation's pass)."""
        if self.down_weight_scale is not None and self.fp8 is not None and self.fp8.group_size is None:
            mlp_q, mlp_scale = ops.silu_and_mul_quant(gate_up)  # [T, I] e4m3, [T, 1]
            return ops.fp8_matmul(mlp_q, mlp_scale, self.down_weight, self.down_weight_scale, None, gate_up.dtype)
        mlp = ops.silu_and_mul(gate_up)  # [T, I]
        return self.linear(mlp, self.down_weight, self.down_weight_scale, None, ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope_cache: tuple[torch.Tensor, torch.Tensor], kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.arch.rms_norm_eps
        qkv, residual = self._norm_linear(x, residual, self.input_norm, self.qkv_weight, self.qkv_weight_scale,
                                          self.qkv_bias, ops)  # [T, Q + 2KV], [T, H]
        fp8_cache = kv_cache[0].dtype == torch.float8_e4m3fn
        if ops.prepare_qkv is not None and ops.attend is not None and not self.calibrate_kv:
            k_scale, v_scale = (self.k_scale, self.v_scale) if fp8_cache else (None, None)
            q = ops.prepare_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm, self.k_norm,
                                eps, rope_cache[0], rope_cache[1], positions, kv_cache[0], kv_cache[1],
                                meta.slot_mapping, k_scale, v_scale)  # [T, heads, D]; K/V now in the cache
            attn = ops.attend(q, kv_cache[0], kv_cache[1], meta, self.scale, k_scale, v_scale)  # [T, heads, D]
            return self._finish(attn, residual, ops)
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

    def _finish(self, attn: torch.Tensor, residual: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """o projection, residual add + norm, MLP: attn [T, heads, D] -> (layer output [T, H], residual [T, H])."""
        o = self.linear(attn.reshape(-1, self.q_size), self.o_weight, self.o_weight_scale, None, ops)  # [T, H]
        x = self.tp.all_reduce(o)
        gate_up, residual = self._norm_linear(x, residual, self.post_attn_norm, self.gate_up_weight,
                                              self.gate_up_weight_scale, None, ops)  # [T, 2I], [T, H]
        return self.tp.all_reduce(self._mlp(gate_up, ops)), residual


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
        self.layers = nn.ModuleList(DecoderLayer(arch, self.tp, dtype, device, fp8) for _ in range(arch.num_layers))
        self.final_norm = nn.Parameter(torch.empty(h, dtype=dtype, device=device), requires_grad=False)
        self.lm_head = self.embed if arch.tie_word_embeddings else nn.Parameter(
            torch.zeros(self.vocab_per_rank, h, dtype=dtype, device=device), requires_grad=False)
        positions = torch.arange(max_positions or arch.max_position_embeddings, device=device)  # [P]
        cos, sin = ref.rope_cos_sin(rope_inv_freq(arch).to(device), positions, dtype)  # [P, D] each
        self.rope_cache = (cos, sin)

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
        x = self.embed_tokens(input_ids)  # [T, H]
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rope_cache, kv_cache, meta, self.ops)
        x, _ = self.ops.add_rms_norm(x, residual, self.final_norm, self.arch.rms_norm_eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, vocab_size] logits in the model dtype (gathered across ranks). The sampler upcasts
        where it needs fp32; an all-greedy batch takes the argmax of these directly."""
        logits = F.linear(hidden, self.lm_head)  # [N, V / tp]
        logits = self.tp.all_gather_last_dim(logits)  # [N, V rounded up to tp]
        return logits[:, :self.arch.vocab_size]
