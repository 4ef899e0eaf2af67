"""DeepSeek-V2 / V2-Lite / V3 (and models built on them): multi-head latent attention over a paged latent cache, and
DeepSeekMoE.

Attention (MLA). A token's K and V for every head come from one latent: kv_a_proj_with_mqa gives [c_kv ‖ k_pe]
(kv_lora_rank + qk_rope_head_dim values); c_kv, RMS-normalised, and k_pe, rotated, are the token's cache entry in
each layer (KvLayout: one tensor of one "head" of R + P values). kv_b_proj [heads * (Dn + Dv), R] holds per head
W_UK [Dn, R] (k_nope = W_UK c_kv) and W_UV [Dv, R] (v = W_UV c_kv). Decode and short chunks absorb them: q_abs =
[q_nope W_UK ‖ q_pe] attends over the entries themselves (kernels/mla.py), and W_UV maps the latent mix back to
per-head values. Chunks long enough that expanding is cheaper (kernels/mla.ExpandPolicy) expand the cached latents
to per-head K/V instead. Queries come from q_proj (V2-Lite) or q_a_proj -> RMSNorm -> q_b_proj (q_lora_rank).
Checkpoints store each head's rope dims as interleaved pairs (rope_interleave); the prepare kernel reads them so.
YaRN's mscale_all_dim multiplies the softmax scale by mscale^2; its attention factor is in the rope table.

DeepSeekMoE. Layers from first_k_dense_replace on are sparse: shared experts (an ungated SiLU MLP of
n_shared_experts * moe_intermediate_size) plus routed experts on the fused MoE kernel, chosen by softmax scores
(V2: greedy or group-limited) or sigmoid scores plus e_score_correction_bias over groups (V3), their weights
renormalised where norm_topk_prob says so and scaled by routed_scaling_factor (kernels/moe.route_grouped_topk).
The shared MLP joins the routed experts in the fused call as n_shared_experts more experts of weight 1.

Tensor parallel: heads split (q_proj / q_b_proj and kv_b_proj rows, o_proj columns), q_a / kv_a and the latent
cache replicated on every rank; MLP and experts split along their intermediate dimension; one all-reduce after
attention and one after the MLP.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from pagoda.kernels import reference as ref
from pagoda.kernels.mla import (
    ExpandPolicy,
    chunk_rows,
    expand_max_rows,
    expand_min_query_len,
    read_rows,
    to_device_async,
    write_rows,
)
from pagoda.kernels.moe import exact_low_precision, route_grouped_topk, router_logits
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
    make_linear,
    make_param,
    moe_experts,
    quantized_linear,
    uses_head_gemv,
)
from pagoda.services.worker.models.llama import dense_mlp_placements, scale_rows
from pagoda.services.worker.models.moe import shared_expert_placements
from pagoda.services.worker.models.rope import RopeSpec, yarn_factor, yarn_mscale
from pagoda.shared.shapes import MlaArch, ModelArch, MoeArch

# MLA's q_a_layernorm and kv_a_layernorm (the latent norms) take RMSNorm's default eps in transformers and in
# DeepSeek's own modeling code, whatever rms_norm_eps says (that one is the layer and final norms')
LATENT_NORM_EPS = 1e-6


def softmax_scale(arch: ModelArch) -> float:
    """1 / sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under a scaled rope that sets mscale_all_dim
    (YaRN in DeepSeek's configs), as DeepSeek and transformers compute it."""
    assert arch.mla is not None
    scale = arch.mla.qk_head_dim ** -0.5
    spec = RopeSpec.of(arch)
    mscale_all_dim = spec.scaling.get("mscale_all_dim")
    if spec.rope_type != "default" and mscale_all_dim:
        factor = yarn_factor(spec) if spec.rope_type == "yarn" else float(spec.scaling["factor"])
        scale *= yarn_mscale(factor, float(mscale_all_dim)) ** 2
    return scale


def _linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, fp8: Fp8Weights | None,
            ops: Ops) -> torch.Tensor:
    return quantized_linear(x, weight, weight_scale, fp8, None, ops)


SubBatch = tuple[AttentionMetadata, tuple[int, int] | None, torch.Tensor | None]
# the last step's sub-batch, built once and read by every layer: (its metadata, its sequences) -> the sub-batch
_LAST_SUB_BATCH: list[tuple[AttentionMetadata, list[int], SubBatch]] = []


def _step_sub_batch(meta: AttentionMetadata, seqs: list[int], device: torch.device) -> SubBatch:
    """_sub_batch, once a step: every layer of the step passes the same metadata object and sequences."""
    if _LAST_SUB_BATCH and _LAST_SUB_BATCH[0][0] is meta and _LAST_SUB_BATCH[0][1] == seqs:
        return _LAST_SUB_BATCH[0][2]
    built = _sub_batch(meta, seqs, device)
    _LAST_SUB_BATCH[:] = [(meta, seqs, built)]
    return built


def _sub_batch(meta: AttentionMetadata, seqs: list[int], device: torch.device) -> SubBatch:
    """The step's sequences `seqs` (host indices, increasing) as a batch of their own for the absorbed path: their
    metadata (cache slots already written: slot_mapping is not read), and their rows of the step as (first, end)
    when they are one run, else as an index tensor [T_a] int64. Built from host lists, copied without a sync."""
    query_lens = [meta.query_lens_host[b] for b in seqs]
    seq_lens = [meta.seq_lens_host[b] for b in seqs]
    span, rows = chunk_rows(np.cumsum([0, *meta.query_lens_host]), meta.query_lens_host, seqs, device)
    index = to_device_async(np.asarray(seqs, dtype=np.int64), device)  # [B_a]
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping, block_tables=meta.block_tables.index_select(0, index),
        seq_lens=meta.seq_lens.index_select(0, index),
        query_start_loc=to_device_async(np.cumsum([0, *query_lens], dtype=np.int32), device),
        seq_lens_host=seq_lens, query_lens_host=query_lens, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens))
    return sub, span, rows

class MlaAttention(nn.Module):
    """Multi-head latent attention of one layer on one tensor-parallel rank."""

    def __init__(self, arch: ModelArch, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
                 fp8: Fp8Weights | None) -> None:
        super().__init__()
        mla = arch.mla
        assert mla is not None
        self.arch, self.mla, self.tp, self.fp8 = arch, mla, tp, fp8
        self.num_heads = arch.num_heads // tp.size
        h, heads = arch.hidden_size, self.num_heads
        self.q_lora = mla.q_lora_rank or 0
        # [q_lora + R + P, H]: q_a_proj's rows, then kv_a_proj_with_mqa's (one GEMM on the same input); both
        # replicated. Without q_lora only kv_a, and q_proj [heads * (Dn + P), H] split by heads.
        self.q_a_norm = make_param((self.q_lora,), dtype, device) if self.q_lora else None
        q_rows = heads * mla.qk_head_dim
        # Without q_lora both read h: unquantized, kv_a's rows and q_proj's live in one weight (one GEMM, one
        # launch fewer a layer; fp8 block scales would straddle the 576-row seam)
        self.aq_weight = make_param((mla.entry_dim + q_rows, h), dtype, device) if not self.q_lora and not fp8 else None
        if self.aq_weight is not None:
            self.a_weight, self.a_weight_scale = self.aq_weight[:mla.entry_dim], None  # views of it
            self.q_weight, self.q_weight_scale = self.aq_weight[mla.entry_dim:], None
        else:
            self.a_weight, self.a_weight_scale = make_linear(self.q_lora + mla.entry_dim, h, dtype, device, fp8)
            self.q_weight, self.q_weight_scale = make_linear(q_rows, self.q_lora or h, dtype, device,
                                                             fp8)  # q_b_proj or q_proj, this rank's heads
        self.kv_a_norm = make_param((mla.kv_lora_rank,), dtype, device)  # [R]
        # [heads * (Dn + Dv), R]: W_UK and W_UV of this rank's heads, in the model dtype (batched matmuls)
        self.kv_b = make_param((heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank), dtype, device)
        self.o_weight, self.o_weight_scale = make_linear(h, heads * mla.v_head_dim, dtype, device, fp8)
        self.scale = softmax_scale(arch)
        itemsize = torch.finfo(dtype).bits // 8
        self.expand = ExpandPolicy(min_query_len=expand_min_query_len(heads),
                                   max_seq_len=expand_max_rows(heads, mla.qk_head_dim, mla.v_head_dim, itemsize))

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [heads, Dn, R] and [heads, Dv, R] of kv_b."""
        mla = self.mla
        per_head = self.kv_b.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return per_head[:, :mla.qk_nope_head_dim], per_head[:, mla.qk_nope_head_dim:]

    def _project(self, h: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] -> q [T, heads, Dn + P] and kv_a [T, R + P] (the latent before its norm, k_pe before rope)."""
        if self.aq_weight is not None:
            aq = _linear(h, self.aq_weight, None, None, ops)  # [T, R + P + heads * (Dn + P)]
            entry = self.mla.entry_dim
            return aq[:, entry:].view(-1, self.num_heads, self.mla.qk_head_dim), aq[:, :entry]
        a = _linear(h, self.a_weight, self.a_weight_scale, self.fp8, ops)  # [T, q_lora + R + P]
        if self.q_a_norm is not None:
            q_low = ops.rms_norm(a[:, :self.q_lora], self.q_a_norm, LATENT_NORM_EPS)  # [T, q_lora]
            q = _linear(q_low, self.q_weight, self.q_weight_scale, self.fp8, ops)
        else:
            q = _linear(h, self.q_weight, self.q_weight_scale, self.fp8, ops)  # [T, heads * (Dn + P)]
        return q.view(-1, self.num_heads, self.mla.qk_head_dim), a[:, self.q_lora:]

    def _calibrate(self, kv_a: torch.Tensor, rope_cache: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                   kv_scale: torch.Tensor) -> None:
        """An fp8 cache's scale from this step's entries (2 x amax / 448 of [normed c_kv ‖ rotated k_pe])."""
        lat = self.mla.kv_lora_rank
        kv_c = ref.rms_norm(kv_a[:, :lat], self.kv_a_norm, LATENT_NORM_EPS)  # [T, R]
        cos, sin = rope_cache[0][positions], rope_cache[1][positions]  # [T, P]
        rotate = ref.apply_rope_interleaved if self.mla.rope_interleave else ref.apply_rope
        k_pe = rotate(kv_a[:, None, lat:], cos, sin)  # [T, 1, P]
        amax = torch.maximum(kv_c.abs().amax(), k_pe.abs().amax()).float()
        kv_scale.copy_((amax.clamp(min=ref.FP8_MIN_AMAX) * 2.0 / ref.FP8_MAX).reshape(1))

    def forward(self, h: torch.Tensor, positions: torch.Tensor, rope_cache: tuple[torch.Tensor, torch.Tensor],
                cache: torch.Tensor, meta: AttentionMetadata, ops: Ops, kv_scale: torch.Tensor | None,
                calibrate: bool) -> Hidden:
        """h [T, H] (normed) -> this rank's o_proj output [T, H] (before the all-reduce; on one device a weight-only
        o_proj's split-K partials, for the residual norm to sum). cache [N, bs, R + P]."""
        mla = self.mla
        q, kv_a = self._project(h, ops)  # [T, heads, Dn + P], [T, R + P]
        if calibrate and kv_scale is not None:
            self._calibrate(kv_a, rope_cache, positions, kv_scale)
        ops.mla_prepare(q, kv_a, self.kv_a_norm, LATENT_NORM_EPS, rope_cache[0], rope_cache[1], positions,
                        cache, meta.slot_mapping, kv_scale, mla.rope_interleave)  # q_pe rotated; entries cached
        expanded: list[int] = []
        if meta.max_query_len >= self.expand.min_query_len:  # never in decode steps (no host lists read there)
            expanded = self.expand.expanded_chunks(meta.query_lens_host, meta.seq_lens_host)
        num_tokens = q.shape[0]
        if not expanded:  # every row absorbed (decode steps, CUDA graphs: no host list is read)
            attn = self._absorbed(q, cache, meta, ops, kv_scale)  # [T, heads, Dv]
        else:
            chunked = set(expanded)
            absorbed = [b for b, query_len in enumerate(meta.query_lens_host) if query_len and b not in chunked]
            covered = sum(meta.query_lens_host) == num_tokens  # else padding rows past the last chunk: zero
            attn = (q.new_empty if covered else q.new_zeros)((num_tokens, self.num_heads, mla.v_head_dim))
            if absorbed:  # decode rows and short chunks beside expanded ones: only their rows
                sub_meta, span, rows = _step_sub_batch(meta, absorbed, q.device)
                q_sub = read_rows(q, span, rows)  # [T_a, heads, Dn + P]
                write_rows(attn, span, rows, self._absorbed(q_sub, cache, sub_meta, ops, kv_scale))  # [T_a, heads, Dv]
        if expanded:
            ops.mla_expand(q, cache, meta, expanded, self.kv_b, mla.qk_nope_head_dim, mla.v_head_dim, self.scale,
                           attn, kv_scale, self.expand.max_seq_len)
        attn = attn.view(num_tokens, -1)  # [T, heads * Dv]
        o = deferred_linear(attn, self.o_weight, self.o_weight_scale, self.fp8, ops) if self.tp.size == 1 else None
        return o if o is not None else _linear(attn, self.o_weight, self.o_weight_scale, self.fp8, ops)  # [T, H]

    def _absorbed(self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, ops: Ops,
                  kv_scale: torch.Tensor | None) -> torch.Tensor:
        """Absorbed attention of every row of q [T, heads, Dn + P] (rope applied) -> [T, heads, Dv]: W_UK folded
        into the query, the latent kernel, W_UV applied to its output."""
        mla = self.mla
        w_uk, w_uv = self._w_uk_uv()
        num_tokens = q.shape[0]
        per_head_gemv = uses_head_gemv(ops, num_tokens)
        q_nope = q[..., :mla.qk_nope_head_dim].transpose(0, 1)  # [heads, T, Dn]
        q_lat = ops.head_gemv(q_nope, w_uk) if per_head_gemv else torch.bmm(q_nope, w_uk)  # [heads, T, R]
        # the absorbed query [q_lat ‖ q_pe] read as two tensors in place: no concatenated copy
        out_lat = ops.mla_attend(q_lat.transpose(0, 1), cache, meta, self.scale, mla.kv_lora_rank, kv_scale,
                                 q_rope=q[..., mla.qk_nope_head_dim:])  # [T, heads, R]
        attn = q.new_empty((num_tokens, self.num_heads, mla.v_head_dim))  # [T, heads, Dv]
        # written through its [heads, T, Dv] view (a strided cuBLAS output): no transposing copy
        (ops.head_gemv if per_head_gemv else torch.bmm)(out_lat.transpose(0, 1), w_uv.transpose(1, 2),
                                                        out=attn.transpose(0, 1))
        return attn

    def placements(self, prefix: str, rank: int) -> Iterator[Placement]:
        """`prefix` = "model.layers.{i}.self_attn."."""
        mla, arch, heads = self.mla, self.arch, self.num_heads
        h, q_rows, lat = arch.hidden_size, heads * mla.qk_head_dim, mla.kv_lora_rank
        if self.q_a_norm is not None:
            yield Placement(prefix + "q_a_proj.weight", (self.q_lora, h), self.a_weight[:self.q_lora], None,
                            scale_target=scale_rows(self.a_weight_scale, slice(0, self.q_lora)))
            yield Placement(prefix + "q_a_layernorm.weight", (self.q_lora,), self.q_a_norm, None)
            yield Placement(prefix + "q_b_proj.weight", (arch.num_heads * mla.qk_head_dim, self.q_lora),
                            self.q_weight, 0, rank * q_rows, q_rows, self.q_weight_scale)
        else:
            yield Placement(prefix + "q_proj.weight", (arch.num_heads * mla.qk_head_dim, h), self.q_weight, 0,
                            rank * q_rows, q_rows, self.q_weight_scale)
        yield Placement(prefix + "kv_a_proj_with_mqa.weight", (mla.entry_dim, h), self.a_weight[self.q_lora:], None,
                        scale_target=scale_rows(self.a_weight_scale, slice(self.q_lora, None)))
        yield Placement(prefix + "kv_a_layernorm.weight", (lat,), self.kv_a_norm, None)
        kv_rows = heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        yield Placement(prefix + "kv_b_proj.weight", (arch.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), lat),
                        self.kv_b, 0, rank * kv_rows, kv_rows)
        o_cols = heads * mla.v_head_dim
        yield Placement(prefix + "o_proj.weight", (h, arch.num_heads * mla.v_head_dim), self.o_weight, 1,
                        rank * o_cols, o_cols, self.o_weight_scale)


class DenseMlp(nn.Module):
    """SiLU-gated MLP (the dense layers, and DeepSeek's shared experts): this rank's columns of it."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
                 fp8: Fp8Weights | None) -> None:
        super().__init__()
        self.hidden, self.intermediate, self.fp8 = hidden, intermediate, fp8
        local = intermediate // tp.size
        self.gate_up, self.gate_up_scale = make_linear(2 * local, hidden, dtype, device, fp8)  # [2I, H]
        self.down, self.down_scale = make_linear(hidden, local, dtype, device, fp8)  # [H, I]

    def forward(self, h: torch.Tensor, ops: Ops) -> torch.Tensor:
        """h [T, H] -> this rank's partial output [T, H]."""
        gate_up = _linear(h, self.gate_up, self.gate_up_scale, self.fp8, ops)  # [T, 2I]
        return _linear(ops.silu_and_mul(gate_up), self.down, self.down_scale, self.fp8, ops)

    def placements(self, prefix: str, rank: int) -> Iterator[Placement]:
        return dense_mlp_placements(prefix, self.hidden, self.intermediate, rank, self.gate_up, self.gate_up_scale,
                                    self.down, self.down_scale)


class DeepseekMoe(nn.Module):
    """Shared experts plus routed experts behind a DeepSeek router, in one fused-kernel call.

    The shared MLP (n_shared_experts * I wide) runs as n_shared more experts of width I that every token picks with
    weight 1: expert E + s holds rows [s I, (s + 1) I) of shared_experts.gate_proj / up_proj and those columns of
    down_proj (an MLP splits along its intermediate dimension into a sum of narrower ones). One fused call reads
    them at the routed experts' bandwidth, instead of three more GEMVs and an add. Where an FP8 checkpoint's
    128-column scale blocks would be cut by that split (I, or this rank's I / tp, not a multiple of the block and
    n_shared > 1) the shared MLP stays a separate dense MLP."""

    def __init__(self, arch: ModelArch, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
                 fp8: Fp8Weights | None) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None
        self.arch, self.moe, self.tp, self.fp8 = arch, moe, tp, fp8
        h = arch.hidden_size
        local = moe.expert_intermediate_size // tp.size
        # [E, H] fp32 (transformers keeps DeepSeek's gate in fp32 and routes in fp32)
        self.router = make_param((moe.num_experts, h), torch.float32, device)
        self.dtype = dtype
        self.router_low: torch.Tensor | None = None  # [E, H] in dtype once loaded, if exact (weights_loaded)
        self.correction_bias = (make_param((moe.num_experts,), torch.float32, device)  # [E]
                                if moe.topk_method == "noaux_tc" else None)
        self.num_shared = fused_shared_experts(moe, local, fp8)
        num_experts = moe.num_experts + self.num_shared
        # [E + S, 2I, H] (gate rows, then up rows) and [E + S, H, I] on this rank, the shared experts last; e4m3 +
        # scales [E + S, rows, groups] in FP8
        self.w_gate_up, self.w_gate_up_scale = make_linear(2 * local, h, dtype, device, fp8, num_experts)
        self.w_down, self.w_down_scale = make_linear(h, local, dtype, device, fp8, num_experts)
        self.shared = (DenseMlp(h, moe.shared_expert_intermediate_size, tp, dtype, device, fp8)
                       if moe.shared_expert_intermediate_size and not self.num_shared else None)

    def forward(self, h: torch.Tensor, ops: Ops) -> Hidden:
        """h [T, H] (normed) -> this rank's partial output [T, H] (or its top-k terms, base.moe_experts)."""
        moe = self.moe
        logits = router_logits(h, self.router, self.router_low)  # [T, E] fp32
        weights, ids = route_grouped_topk(logits, moe.top_k, moe.scoring_func, moe.topk_method,
                                          moe.num_groups, moe.topk_groups, self.correction_bias, moe.renormalize,
                                          moe.routed_scaling_factor, self.num_shared)  # [T, k + S] each
        group = self.fp8.group_size if self.fp8 is not None else None
        args = (h, self.w_gate_up, self.w_down, weights, ids, self.w_gate_up_scale, self.w_down_scale, group)
        if self.shared is not None:
            return ops.moe_experts(*args) + self.shared(h, ops)  # [T, H]
        return moe_experts(ops, self.tp.size, self.fp8, *args)  # [T, H] or its terms

    def weights_loaded(self) -> None:
        """The router in the model dtype when its values are exactly that (kernels/moe.router_logits); CUDA only,
        where the tensor-core GEMM with fp32 output exists."""
        self.router_low = exact_low_precision(self.router, self.dtype) if self.router.is_cuda else None

    def placements(self, prefix: str, rank: int) -> Iterator[Placement]:
        """`prefix` = "model.layers.{i}.mlp."; per-expert keys (fused [E, ...] expert tensors are cut into these
        names by the safetensors source), then the shared experts' slices of `shared_experts.*`."""
        moe, h = self.moe, self.arch.hidden_size
        yield Placement(prefix + "gate.weight", (moe.num_experts, h), self.router, None)
        if self.correction_bias is not None:
            yield Placement(prefix + "gate.e_score_correction_bias", (moe.num_experts,), self.correction_bias, None)
        for e in range(moe.num_experts):
            yield from dense_mlp_placements(f"{prefix}experts.{e}.", h, moe.expert_intermediate_size, rank,
                                            self.w_gate_up[e], _expert(self.w_gate_up_scale, e), self.w_down[e],
                                            _expert(self.w_down_scale, e))
        if self.shared is not None:
            yield from self.shared.placements(prefix + "shared_experts.", rank)
        for s in range(self.num_shared):
            yield from self._shared_placements(prefix + "shared_experts.", s, rank)

    def _shared_placements(self, prefix: str, s: int, rank: int) -> Iterator[Placement]:
        """Shared expert s = rows [s I, (s + 1) I) of gate_proj / up_proj [S I, H] and those columns of down_proj."""
        e = self.moe.num_experts + s
        yield from shared_expert_placements(prefix, self.arch.hidden_size, self.moe.shared_expert_intermediate_size,
                                            s * self.moe.expert_intermediate_size, rank, self.w_gate_up[e],
                                            _expert(self.w_gate_up_scale, e), self.w_down[e],
                                            _expert(self.w_down_scale, e))


def fused_shared_experts(moe: MoeArch, local: int, fp8: Fp8Weights | None) -> int:
    """How many I-wide experts the shared MLP joins the routed ones as (0: it stays a separate MLP). local: this
    rank's part of I."""
    shared, inter = moe.shared_expert_intermediate_size, moe.expert_intermediate_size
    if not shared or shared % inter or moe.shared_expert_gated:
        return 0
    num_shared = shared // inter
    group = fp8.group_size if fp8 is not None else None
    if num_shared > 1 and group is not None and local % group:  # a split would cut a checkpoint's scale block
        return 0
    return num_shared


def _expert(scale: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if scale is None else scale[e]


class DeepseekLayer(nn.Module):
    """input norm -> MLA -> post-attention norm -> dense MLP or DeepSeekMoE, with the fused residual adds."""

    def __init__(self, arch: ModelArch, index: int, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
                 fp8: Fp8Weights | None) -> None:
        super().__init__()
        assert arch.moe is not None
        self.arch, self.tp = arch, tp
        h = arch.hidden_size
        self.input_norm = make_param((h,), dtype, device)  # [H]
        self.post_attn_norm = make_param((h,), dtype, device)  # [H]
        self.attn = MlaAttention(arch, tp, dtype, device, fp8)
        # mlp: the sparse block (None on dense layers, as the other families have it: the runner's expert warm-up
        # looks for it); dense_mlp: the dense layers' MLP
        sparse = index in arch.moe.sparse_layers
        self.mlp = DeepseekMoe(arch, tp, dtype, device, fp8) if sparse else None
        self.dense_mlp = None if sparse else DenseMlp(h, arch.intermediate_size, tp, dtype, device, fp8)
        # The fp8 latent cache's per-tensor scale (k_scale; v_scale only so the shared loader finds it): from the
        # checkpoint, calibrated, or 1. A tensor, so CUDA graphs captured before a calibration read the new value.
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32, device=device))  # [1]
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32, device=device))  # [1]
        self.calibrate_kv = False

    def forward(self, x: Hidden, residual: torch.Tensor | None, positions: torch.Tensor,
                rope_cache: tuple[torch.Tensor, torch.Tensor], kv_cache: tuple[torch.Tensor, ...],
                meta: AttentionMetadata, ops: Ops) -> tuple[Hidden, torch.Tensor]:
        eps = self.arch.rms_norm_eps
        cache = kv_cache[0][:, :, 0]  # [N, bs, 1, R + P] -> [N, bs, R + P]
        fp8_cache = cache.dtype == torch.float8_e4m3fn
        h, residual = add_norm(x, residual, self.input_norm, eps, ops)  # [T, H] each
        o = self.attn(h, positions, rope_cache, cache, meta, ops, self.k_scale if fp8_cache else None,
                      self.calibrate_kv and fp8_cache)  # [T, H]
        self.calibrate_kv = False
        h, residual = add_norm(all_reduce_hidden(self.tp, o), residual, self.post_attn_norm, eps, ops)
        mlp = self.mlp if self.mlp is not None else self.dense_mlp
        assert mlp is not None
        out = mlp(h, ops)  # [T, H], or the MoE's top-k terms (only on one device, where the all-reduce is identity)
        return all_reduce_hidden(self.tp, out), residual

    def placements(self, prefix: str, rank: int) -> Iterator[Placement]:
        """This layer's Hugging Face tensors (`prefix` = "model.layers.{i}.") and where this rank's slices go."""
        h = self.arch.hidden_size
        yield Placement(prefix + "input_layernorm.weight", (h,), self.input_norm, None)
        yield Placement(prefix + "post_attention_layernorm.weight", (h,), self.post_attn_norm, None)
        yield from self.attn.placements(prefix + "self_attn.", rank)
        mlp = self.mlp if self.mlp is not None else self.dense_mlp
        assert mlp is not None
        yield from mlp.placements(prefix + "mlp.", rank)


def make_layer(arch: ModelArch, index: int, tp: TensorParallel, dtype: torch.dtype, device: torch.device,
               fp8: Fp8Weights | None) -> DeepseekLayer:
    return DeepseekLayer(arch, index, tp, dtype, device, fp8)


def kv_layout(arch: ModelArch, tp_size: int) -> KvLayout:
    """One latent entry [c_kv ‖ k_pe] per token and layer, the same on every rank."""
    mla: MlaArch | None = arch.mla
    assert mla is not None
    del tp_size
    return KvLayout(num_tensors=1, num_heads=1, head_dim=mla.entry_dim)
