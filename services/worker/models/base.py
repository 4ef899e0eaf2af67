"""What every model family shares: attention metadata, the op set (PyTorch on CPU, Triton on CUDA), tensor
parallelism, FP8 weight layout, weight placements and the KV layout a family asks of the cache."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from pagoda.kernels import fp8_weight_only as w8a16
from pagoda.kernels import gemv, moe
from pagoda.kernels import reference as ref
from pagoda.shared.config import measurement_switch

# A layer's output: a tensor, or a split-K weight-only GEMM's fp32 partial sums that the next residual add + norm
# sums in its own pass (one launch fewer; kernels/fp8_weight_only.py).
Hidden = torch.Tensor | w8a16.DeferredSum


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


def reference_mla_attend(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                         kv_lora_rank: int, kv_scale: torch.Tensor | None = None,
                         q_rope: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA over the latent cache [N, bs, R + P] (PyTorch reference): q [T, heads, R + P] -> [T, heads, R].
    With q_rope [T, heads, P], q holds the first R values only."""
    if q_rope is not None:
        q = torch.cat((q, q_rope), dim=-1)  # [T, heads, R + P]
    return ref.mla_attention(q, cache, meta.block_tables, meta.seq_lens_host, meta.query_lens_host, scale,
                             kv_lora_rank, kv_scale)


def triton_mla_attend(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      kv_lora_rank: int, kv_scale: torch.Tensor | None = None,
                      q_rope: torch.Tensor | None = None) -> torch.Tensor:
    """The same with the Triton split-KV kernel; q and q_rope read in place."""
    from pagoda.kernels.mla import mla_attention

    return mla_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
                         meta.max_seq_len, scale, kv_lora_rank, kv_scale=kv_scale, q_rope=q_rope)


def reference_mla_expand(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, seqs: list[int],
                         w_kv_b: torch.Tensor, qk_nope_head_dim: int, v_head_dim: int, scale: float,
                         out: torch.Tensor, kv_scale: torch.Tensor | None = None, max_rows: int = 0) -> None:
    """The chunks of sequences `seqs` by expanded multi-head attention: q [T, heads, Dn + P] un-absorbed; their rows
    of out [T, heads, Dv] are written (PyTorch reference, one sequence at a time: max_rows does not apply)."""
    expanded = ref.mla_expanded_attention(q, cache, meta.block_tables, meta.seq_lens_host, meta.query_lens_host,
                                          w_kv_b, qk_nope_head_dim, v_head_dim, scale, kv_scale, seqs)
    starts = [0]
    for query_len in meta.query_lens_host:
        starts.append(starts[-1] + query_len)
    for b in seqs:
        out[starts[b]:starts[b + 1]] = expanded[starts[b]:starts[b + 1]]


def triton_mla_expand(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, seqs: list[int],
                      w_kv_b: torch.Tensor, qk_nope_head_dim: int, v_head_dim: int, scale: float,
                      out: torch.Tensor, kv_scale: torch.Tensor | None = None, max_rows: int = 0) -> None:
    """The same with gathered, expanded K/V and the paged kernel, in launches of at most max_rows latent rows
    (0: kernels/mla's default)."""
    from pagoda.kernels.mla import EXPAND_MAX_ROWS, mla_expanded_attention

    mla_expanded_attention(q, cache, meta.block_tables, meta.seq_lens_host, meta.query_lens_host, seqs, w_kv_b,
                           qk_nope_head_dim, v_head_dim, scale, out, kv_scale, max_rows or EXPAND_MAX_ROWS)


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
    # Weight-only FP8 (W8A16) for few tokens, no activation quantization: same arguments as fp8_linear; and
    # (rows, N, K, device) -> whether it serves that GEMM (else W8A8 above); kernels/fp8_weight_only.py
    fp8_weight_only: Callable[..., torch.Tensor] = ref.fp8_weight_only_linear
    prefers_weight_only: Callable[[int, int, int, torch.device], bool] = w8a16.prefers_weight_only
    # The same with a split-K output left as partial sums (fp8_weight_only_deferred), and the residual add + norm
    # that sums them: (parts [S, T, H], dtype, residual, weight, eps) -> (normed, summed). None: the GEMM's own sum.
    fp8_weight_only_deferred: Callable[..., Hidden] | None = None
    add_rms_norm_parts: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # The same norm quantizing for a per-channel W8A8 GEMM after it (a weight-only layer's partials feeding a W8A8
    # one): (parts, dtype, residual, weight, eps) -> (e4m3 [T, H], scales [T, 1], summed). None: the GEMM quantizes.
    add_rms_norm_parts_quant: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    # One pass from the fused qkv rows (or a split-K GEMM's DeferredSum of them) to attention inputs (q/k norm,
    # rope, K/V into the cache: q returned) and attention over the cache alone; None: the separate ops above
    # (rms_norm, rope, attention writing K/V).
    prepare_qkv: Callable[..., torch.Tensor] | None = None
    attend: Callable[..., torch.Tensor] | None = None
    # (x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], topk weights [T, k], topk ids [T, k], FP8 scales or None
    # x2, group size) -> [T, H]: the routed experts of a sparse layer
    moe_experts: Callable[..., torch.Tensor] = ref.moe_experts
    # The same with the top-k sum left to the next residual add + norm (add_rms_norm_parts) where the kernel path
    # has one of its own (moe.fused_experts defer_sum): -> [T, H] or DeferredSum [k, T, H]; None: summed
    moe_experts_deferred: Callable[..., Hidden] | None = None
    # Multi-head latent attention (models/deepseek.py): q's rope and the latent entries into the cache in one pass,
    # absorbed attention over the latent cache, and the expanded path for long chunks
    mla_prepare: Callable[..., None] = ref.mla_prepare
    mla_attend: Callable[..., torch.Tensor] = reference_mla_attend
    mla_expand: Callable[..., None] = reference_mla_expand
    # (x [..., K], bf16/fp16 weight [N, K], bias) -> [..., N]: a Triton GEMV for few rows under PAGODA_DENSE_GEMV=1
    # (kernels/gemv.py); None: torch's linear always
    dense_gemv: Callable[..., torch.Tensor] | None = None
    # (x [heads, T, K], w [heads, K, N], out) -> [heads, T, N]: MLA's per-head absorbed projections as one Triton
    # launch under the same switch (kernels/gemv.head_gemv); None: torch.bmm always
    head_gemv: Callable[..., torch.Tensor] | None = None


def _reference_rope(q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                    positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_cache[positions], sin_cache[positions]  # [T, D] each
    return ref.apply_rope(q, cos, sin), ref.apply_rope(k, cos, sin)


def reference_ops() -> Ops:
    return Ops(rms_norm=ref.rms_norm, add_rms_norm=ref.add_rms_norm, rope=_reference_rope,
               silu_and_mul=ref.silu_and_mul, attention=reference_attention)


def triton_ops() -> Ops:
    from pagoda.kernels import activation, fp8, mla, moe, norm, qkv_prep, rope

    def fused_rope(q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.apply_rope(q, k, cos_cache, sin_cache, positions=positions, inplace=True)

    return Ops(rms_norm=norm.rms_norm, add_rms_norm=norm.add_rms_norm, rope=fused_rope,
               silu_and_mul=activation.silu_and_mul, attention=triton_attention, fp8_linear=fp8.fp8_linear,
               add_rms_norm_quant=fp8.add_rms_norm_quant_fp8, silu_and_mul_quant=fp8.silu_and_mul_quant_fp8,
               fp8_matmul=fp8.fp8_matmul, fp8_weight_only=w8a16.fp8_weight_only_linear,
               fp8_weight_only_deferred=w8a16.fp8_weight_only_deferred, add_rms_norm_parts=norm.add_rms_norm_parts,
               add_rms_norm_parts_quant=fp8.add_rms_norm_parts_quant_fp8,
               prepare_qkv=qkv_prep.prepare_qkv, attend=triton_attend,
               moe_experts=moe.fused_experts, moe_experts_deferred=functools.partial(moe.fused_experts, defer_sum=True),
               mla_prepare=mla.mla_prepare, mla_attend=triton_mla_attend,
               mla_expand=triton_mla_expand, dense_gemv=gemv.dense_gemv, head_gemv=gemv.head_gemv)


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


@dataclass(frozen=True, slots=True)
class Fp8Weights:
    """Every linear layer (fused qkv, o, fused gate_up, down) in FP8: e4m3 weights [N, K] with fp32 scales
    [N, 1] (one per output channel) or, with group_size g, [N, ceil(K / g)] (one per row and g columns: a
    checkpoint's g x g block scales repeated along the rows, so fused and sharded weights keep any row split).
    Activations are quantized per token (and per g columns with group_size) on the fly."""

    group_size: int | None = None



@dataclass(frozen=True, slots=True)
class Placement:
    """One Hugging Face tensor this rank needs and where its slice goes."""

    hf_name: str
    full_shape: tuple[int, ...]
    target: torch.Tensor  # the parameter (or its row range) to fill
    shard_dim: int | None  # None: replicated on every rank
    shard_start: int = 0
    shard_len: int = 0
    scale_target: torch.Tensor | None = None  # an FP8 weight's scale rows [rows, 1 or K / g]
    # target row t takes row row_order[t] of the slice read (and of its scales): GLM's q/k heads, permuted so the
    # kernels' whole-head rope does a partial rope (rope.permute_rotary_dims). None: in order
    row_order: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What one token leaves in one layer's cache: `num_tensors` tensors (K and V: 2; one latent: 1) of
    [num_heads, head_dim] each on this rank. The block manager only counts blocks; this decides their bytes."""

    num_tensors: int
    num_heads: int
    head_dim: int

    def bytes_per_token(self, num_layers: int, dtype_bytes: int) -> int:
        return num_layers * self.num_tensors * self.num_heads * self.head_dim * dtype_bytes


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                     fp8: Fp8Weights | None, bias: torch.Tensor | None, ops: Ops) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N]: dense, weight-only FP8 for few tokens, else FP8 with the activations
    quantized per token (W8A8)."""
    if weight_scale is None:
        if ops.dense_gemv is not None and gemv.applies(x, weight):
            return ops.dense_gemv(x, weight, bias)
        return torch.nn.functional.linear(x, weight, bias)
    assert fp8 is not None
    if uses_weight_only(x, weight, ops):
        return ops.fp8_weight_only(x, weight, weight_scale, fp8.group_size, bias)
    return ops.fp8_linear(x, weight, weight_scale, fp8.group_size, bias)


def deferred_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                    fp8: Fp8Weights | None, ops: Ops, gated: bool = False) -> Hidden | None:
    """The weight-only FP8 linear of x [T, K] with its split-K output left as partials where it splits; None where
    this layer does not take that path (dense or W8A8 weights, ops without it, PAGODA_FUSE_SPLIT_K=0). Single
    device only: an all-reduce needs the sum. gated: x is [T, 2K] = [gate ‖ up], multiplied as silu(gate) * up in
    the same launch (fuse_silu_gemv)."""
    if (weight_scale is None or fp8 is None or ops.fp8_weight_only_deferred is None
            or ops.add_rms_norm_parts is None or measurement_switch("FUSE_SPLIT_K") == "0"):
        return None
    rows = x.numel() // x.shape[-1]
    if not ops.prefers_weight_only(rows, weight.shape[0], weight.shape[1], x.device):
        return None
    return ops.fp8_weight_only_deferred(x, weight, weight_scale, fp8.group_size, None, gated=gated)


def qkv_prep_sums_split_k() -> bool:
    """Whether qkv prep takes the qkv GEMV's split-K partials (deferred_linear) rather than the sum kernel's rows:
    one launch fewer a layer where the weight-only qkv GEMV splits K (the H200 table: 2-32 rows). Untimed as of
    2026-12-05. PAGODA_FUSE_SPLIT_K=norms (an A/B switch) leaves the partials to the norms only, 0 to nothing."""
    return measurement_switch("FUSE_SPLIT_K") not in ("0", "norms")


def moe_experts(ops: Ops, tp_size: int, fp8: Fp8Weights | None, *args: object) -> Hidden:
    """ops.moe_experts(*args), or on one device ops.moe_experts_deferred: the top-k sum left to the next residual
    add + norm, one launch fewer a sparse layer where the grouped GEMM runs (its [T, k, H] rows read once, by the
    norm). H200, 2026-12-03 (bench/step_ab.py, graph-timed decode steps, 640 cached tokens): deepseek-v2-lite
    9.743 -> 9.640 ms at B=64, 11.648 -> 11.540 at B=256; qwen3-30b-a3b 22.146 -> 21.900 at B=256. Not with
    per-channel FP8 weights: there the next norm quantizes its output for the W8A8 GEMM after it (add_rms_norm_quant,
    which takes no parts), and the sum would cost that fusion. PAGODA_FUSE_MOE_SUM=0 (the A/B switch) keeps the sum
    in the MoE layer."""
    if (tp_size == 1 and ops.moe_experts_deferred is not None and ops.add_rms_norm_parts is not None
            and (fp8 is None or fp8.group_size is not None) and measurement_switch("FUSE_MOE_SUM") != "0"):
        return ops.moe_experts_deferred(*args)
    return ops.moe_experts(*args)


def uses_head_gemv(ops: Ops, num_tokens: int) -> bool:
    """Whether MLA's absorbed per-head projections of a step of num_tokens rows take ops.head_gemv (the switch of
    the 16-bit GEMV, at most its rows) rather than torch.bmm. PAGODA_HEAD_GEMV=0 keeps them on torch.bmm under
    that switch (an A/B switch: the linears on the GEMV, the per-head projections not)."""
    return (ops.head_gemv is not None and gemv.enabled() and measurement_switch("HEAD_GEMV") != "0"
            and 1 <= num_tokens <= gemv.MAX_ROWS)


def fuse_silu_gemv(rows: int) -> bool:
    """Whether the down projection of a step of `rows` tokens, where it takes the weight-only FP8 path with its sum
    deferred, reads [gate ‖ up] and multiplies silu(gate) * up itself: one launch fewer a layer
    (kernels/fp8_weight_only.py GATED; same values). At one row only: H200, 2026-12-03 (bench/step_ab.py, llama3-8b
    FP8, graph-timed decode step, 512 cached tokens) 4.201 -> 4.049 ms at B=1, but 3.215 -> 5.249 at B=4 and
    3.272 -> 7.515 at B=8 (the gated tiles are untuned there); the B=1 pair on the one-row tiles' slow layout that
    a54432a undid (gated 325 SASS loop instructions against 261 now, 490 against 433 then). PAGODA_FUSE_SILU_GEMV
    (the A/B switch): 1 at every row count, 0 never."""
    switch = measurement_switch("FUSE_SILU_GEMV")
    return switch == "1" if switch else rows == 1


def all_reduce_hidden(tp: TensorParallel, x: Hidden) -> Hidden:
    """tp.all_reduce of a layer's output of either kind: a DeferredSum is only left on a single device, where the
    all-reduce is the identity."""
    return tp.all_reduce(x) if isinstance(x, torch.Tensor) else x


def add_norm(x: Hidden, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.add_rms_norm for a layer's output of either kind: (normed [T, H], summed residual [T, H])."""
    if isinstance(x, w8a16.DeferredSum):
        assert residual is not None and ops.add_rms_norm_parts is not None, "partials come with their consumer"
        return ops.add_rms_norm_parts(x.parts, x.dtype, residual, weight, eps)
    return ops.add_rms_norm(x, residual, weight, eps)


def uses_weight_only(x: torch.Tensor, weight: torch.Tensor, ops: Ops) -> bool:
    """Whether the FP8 GEMM of x [..., K] with weight [N, K] takes the weight-only path (by row count and shape;
    static per CUDA graph, since a graph's row count is)."""
    rows = x.numel() // x.shape[-1]
    return ops.prefers_weight_only(rows, weight.shape[0], weight.shape[1], x.device)


def make_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def make_linear(rows: int, cols: int, dtype: torch.dtype, device: torch.device, fp8: Fp8Weights | None,
                experts: int | None = None) -> tuple[nn.Parameter, nn.Parameter | None]:
    """A weight [rows, cols] (or [experts, rows, cols]) in the model dtype, or in e4m3 with its fp32 scales
    [(experts,) rows, 1 or ceil(cols / g)]."""
    lead = () if experts is None else (experts,)
    if fp8 is None:
        return make_param((*lead, rows, cols), dtype, device), None
    groups = 1 if fp8.group_size is None else -(-cols // fp8.group_size)
    if experts is not None and groups == 1 and moe.splits_experts(experts, rows, cols):
        # per-row FP8 experts the gmm path may split into groups: a spare expert of storage each (kernels/moe)
        weight = moe.with_spare_expert((experts, rows, cols), torch.float8_e4m3fn, device)
        scale = moe.with_spare_expert((experts, rows, 1), torch.float32, device)
        return nn.Parameter(weight, requires_grad=False), nn.Parameter(scale, requires_grad=False)
    weight = make_param((*lead, rows, cols), torch.float8_e4m3fn, device)
    return weight, make_param((*lead, rows, groups), torch.float32, device)
