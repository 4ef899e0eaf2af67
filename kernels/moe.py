"""Fused mixture-of-experts in Triton: route tokens to their top-k experts, sort the (token, slot) pairs by expert
into BLOCK_M-row tiles, then one grouped GEMM for gate+up with SiLU-and-mul in its epilogue and one for down with
the routing weight applied; the top-k sum closes the layer. Large bf16 batches on a GPU with CUTLASS grouped GEMMs
(prefill) take a second path instead, over torch._grouped_mm: the same sort, the token rows gathered into it, two
grouped GEMMs with SiLU-and-mul between them, and one kernel for the weighted top-k sum (moe_path decides).

Every buffer has a shape fixed by (tokens, top_k, experts, BLOCK_M), never by the routing, so a decode step
captures in a CUDA graph: tiles past the routed ones exit at once. Expert weights are in the model dtype, or e4m3
with fp32 scales per output row and K-group (weight-only FP8: converted in registers, no activation quantization).

    pairs p = t * top_k + j  (token t's j-th expert)
    sorted_pairs [max_padded]: pair ids grouped by expert, each expert's run padded to BLOCK_M with `num_pairs`
    tile_experts [max_tiles]: the expert of each BLOCK_M tile, -1 for tiles past the routed ones
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from pagoda.kernels import pdl
from pagoda.kernels.activation import silu_and_mul
from pagoda.kernels.fp8 import cast_e4m3, fast_accum, hw_cast, quantize_fp8_rows, silu_and_mul_quant_fp8
from pagoda.kernels.fp8_weight_only import DeferredSum, pow2_scale
from pagoda.shared.config import measurement_switch, triton_interpreted

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).with_name("moe_configs")


# ---------------------------------------------------------------- routing


def route_softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                       num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int32): softmax in fp32, the k largest
    (ties: the lower expert id first), renormalised to sum 1 where the config says so. num_shared > 0 (Qwen2-MoE's
    gated shared expert, split into num_shared experts E.. of the fused weights): router_logits [T, E + 1] end with
    the shared expert's gate logit, and each row gets those experts appended with weight sigmoid(gate): [T, k + S].
    One Triton kernel on CUDA (a decode step runs this per layer: five small kernels became one), the PyTorch
    reference elsewhere."""
    if router_logits.is_cuda:
        return route_softmax_topk_triton(router_logits, top_k, renormalize, num_shared)
    return route_softmax_topk_reference(router_logits, top_k, renormalize, num_shared)


def route_softmax_topk_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                                 num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = router_logits.shape[0], router_logits.shape[1] - (1 if num_shared else 0)
    probs = torch.softmax(router_logits[:, :num_experts].float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    if num_shared:
        gate = router_logits[:, num_experts:].float().sigmoid()  # [T, 1]
        shared_ids = torch.arange(num_experts, num_experts + num_shared, dtype=torch.int32, device=ids.device)
        weights = torch.cat((weights, gate.expand(num_tokens, num_shared)), dim=1)  # [T, k + S]
        ids = torch.cat((ids, shared_ids.expand(num_tokens, num_shared)), dim=1)  # [T, k + S]
    return weights, ids


def route_grouped_topk(router_logits: torch.Tensor, top_k: int, scoring_func: str, topk_method: str,
                       num_groups: int, topk_groups: int, correction_bias: torch.Tensor | None, renormalize: bool,
                       routed_scaling_factor: float, num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeekMoE routing, router_logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int32).
    Scores: softmax (V2) or sigmoid (V3) in fp32; experts are chosen by score + correction_bias [E] (V3's
    e_score_correction_bias; None: 0). "greedy": the k best of all experts; "group_limited_greedy" (V2) and
    "noaux_tc" (V3): only experts of the topk_groups best of num_groups equal groups, a group ranked by its best
    choice score (V2) or the sum of its two best (V3). The weights are the chosen experts' scores (never the bias),
    renormalised to sum 1 if asked, then times routed_scaling_factor. Semantics of reference.route_grouped_topk.
    num_shared > 0 appends the shared experts as always-chosen experts E .. E + num_shared - 1 of weight 1 (the
    fused expert weights hold them after the routed ones): weights and ids are then [T, k + num_shared].
    One Triton kernel on CUDA (about a dozen small PyTorch kernels otherwise, per sparse layer and step)."""
    args = (router_logits, top_k, scoring_func, topk_method, num_groups, topk_groups, correction_bias, renormalize,
            routed_scaling_factor, num_shared)
    if router_logits.is_cuda:
        return route_grouped_topk_triton(*args)
    return route_grouped_topk_torch(*args)


def route_grouped_topk_torch(router_logits: torch.Tensor, top_k: int, scoring_func: str, topk_method: str,
                             num_groups: int, topk_groups: int, correction_bias: torch.Tensor | None,
                             renormalize: bool, routed_scaling_factor: float,
                             num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """route_grouped_topk in batched PyTorch ops (the CPU path)."""
    num_tokens, num_experts = router_logits.shape
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring_func == "sigmoid" else logits.softmax(dim=-1)  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()  # [T, E]
    if topk_method != "greedy":
        grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)  # [T, G, E / G]
        if topk_method == "noaux_tc":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.amax(dim=-1)  # [T, G]
        groups = group_scores.topk(topk_groups, dim=-1).indices  # [T, topk_groups]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)  # [T, G]
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(num_tokens, num_experts)
    ids = choice.topk(top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)  # [T, k]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights, ids = weights * routed_scaling_factor, ids.to(torch.int32)
    if num_shared:
        shared_ids = torch.arange(num_experts, num_experts + num_shared, dtype=torch.int32, device=ids.device)
        ids = torch.cat((ids, shared_ids.expand(num_tokens, num_shared)), dim=1)  # [T, k + S]
        weights = torch.cat((weights, weights.new_ones(num_tokens, num_shared)), dim=1)  # [T, k + S]
    return weights, ids


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_lt,
                  TOP_K: tl.constexpr, K_P: tl.constexpr, EXPERTS_P: tl.constexpr, RENORMALIZE: tl.constexpr,
                  NUM_SHARED: tl.constexpr):
    """One token: softmax over its experts, then k rounds of argmax (lowest id among equals), masking each pick;
    then the NUM_SHARED shared experts (ids E.., weight sigmoid of the logit after the experts'). K_P >= k + S."""
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, EXPERTS_P)
    e_mask = offs_e < num_experts
    logits = tl.load(logits_ptr + token * stride_lt + offs_e, mask=e_mask, other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)  # [E_P]; padding 0
    remaining = tl.where(e_mask, probs, -1.0)
    offs_k = tl.arange(0, K_P)
    picked_w = tl.zeros([K_P], dtype=tl.float32)
    picked_id = tl.zeros([K_P], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        best_id = tl.min(tl.where(remaining == best, offs_e, EXPERTS_P), axis=0)
        picked_w = tl.where(offs_k == j, best, picked_w)
        picked_id = tl.where(offs_k == j, best_id, picked_id)
        remaining = tl.where(offs_e == best_id, -2.0, remaining)
    if RENORMALIZE:
        picked_w = picked_w / tl.sum(tl.where(offs_k < TOP_K, picked_w, 0.0), axis=0)
    if NUM_SHARED > 0:
        gate = tl.sigmoid(tl.load(logits_ptr + token * stride_lt + num_experts).to(tl.float32))
        picked_w = tl.where(offs_k < TOP_K, picked_w, gate)
        picked_id = tl.where(offs_k < TOP_K, picked_id, num_experts + offs_k - TOP_K)
    row: tl.constexpr = TOP_K + NUM_SHARED
    tl.store(weights_ptr + token * row + offs_k, picked_w, mask=offs_k < row)
    tl.store(ids_ptr + token * row + offs_k, picked_id, mask=offs_k < row)


def route_softmax_topk_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                              num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = router_logits.shape[0], router_logits.shape[1] - (1 if num_shared else 0)
    assert router_logits.stride(1) == 1 and 0 < top_k <= num_experts
    row = top_k + num_shared
    weights = torch.empty(num_tokens, row, dtype=torch.float32, device=router_logits.device)  # [T, k + S]
    ids = torch.empty(num_tokens, row, dtype=torch.int32, device=router_logits.device)  # [T, k + S]
    if num_tokens:
        _route_kernel[(num_tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0),
                                     TOP_K=top_k, K_P=triton.next_power_of_2(row),
                                     EXPERTS_P=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
                                     NUM_SHARED=num_shared, num_warps=1 if num_experts <= 64 else 4)
    return weights, ids


@triton.jit
def _grouped_route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_lt, scaling,
                          GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_P: tl.constexpr,
                          GROUP_SIZE_P: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr,
                          K_P: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
                          GROUP_TOP2: tl.constexpr, RENORMALIZE: tl.constexpr, NUM_SHARED: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """One token, its experts laid out [groups, group size]: scores, choice scores (+ bias), the topk_groups best
    groups (by best or best-two choice score), then k rounds of argmax over the allowed experts (lowest id among
    equals), each pick's weight its score; then the NUM_SHARED shared experts (ids E.., weight 1). K_P >= k + S."""
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, GROUPS_P)
    offs_j = tl.arange(0, GROUP_SIZE_P)
    valid = (offs_g < GROUPS)[:, None] & (offs_j < GROUP_SIZE)[None, :]  # [G_P, S_P]
    expert = offs_g[:, None] * GROUP_SIZE + offs_j[None, :]  # [G_P, S_P] expert ids
    logits = tl.load(logits_ptr + token * stride_lt + expert, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.where(valid, tl.sigmoid(logits), 0.0)
    else:
        exps = tl.where(valid, tl.exp(logits - tl.max(tl.max(logits, 1), 0)), 0.0)
        scores = exps / tl.sum(tl.sum(exps, 1), 0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if GROUPED:
        best = tl.max(choice, 1)  # [G_P]
        group_score = best
        if GROUP_TOP2:
            first = tl.min(tl.where(choice == best[:, None], offs_j[None, :], GROUP_SIZE_P), 1)  # [G_P]
            group_score = best + tl.max(tl.where(offs_j[None, :] == first[:, None], float("-inf"), choice), 1)
        group_score = tl.where(offs_g < GROUPS, group_score, float("-inf"))
        keep = tl.zeros([GROUPS_P], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUPS):
            top = tl.max(group_score, 0)
            pick = tl.min(tl.where(group_score == top, offs_g, GROUPS_P), 0)
            keep = tl.where(offs_g == pick, 1, keep)
            group_score = tl.where(offs_g == pick, float("-inf"), group_score)
        choice = tl.where(keep[:, None] == 1, choice, float("-inf"))
    offs_k = tl.arange(0, K_P)
    picked_w = tl.zeros([K_P], dtype=tl.float32)
    picked_id = tl.zeros([K_P], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        top = tl.max(tl.max(choice, 1), 0)
        pick = tl.min(tl.min(tl.where(choice == top, expert, GROUPS_P * GROUP_SIZE_P), 1), 0)
        weight = tl.sum(tl.sum(tl.where(expert == pick, scores, 0.0), 1), 0)
        picked_w = tl.where(offs_k == j, weight, picked_w)
        picked_id = tl.where(offs_k == j, pick, picked_id)
        choice = tl.where(expert == pick, float("-inf"), choice)
    k_mask = offs_k < TOP_K
    if RENORMALIZE:
        picked_w = picked_w / (tl.sum(tl.where(k_mask, picked_w, 0.0), 0) + 1e-20)
    picked_w = picked_w * scaling
    if NUM_SHARED > 0:  # the shared experts: always chosen, weight 1, after the routed ones
        picked_w = tl.where(k_mask, picked_w, 1.0)
        picked_id = tl.where(k_mask, picked_id, GROUPS * GROUP_SIZE + offs_k - TOP_K)
    row: tl.constexpr = TOP_K + NUM_SHARED
    tl.store(weights_ptr + token * row + offs_k, picked_w, mask=offs_k < row)
    tl.store(ids_ptr + token * row + offs_k, picked_id, mask=offs_k < row)


def route_grouped_topk_triton(router_logits: torch.Tensor, top_k: int, scoring_func: str, topk_method: str,
                              num_groups: int, topk_groups: int, correction_bias: torch.Tensor | None,
                              renormalize: bool, routed_scaling_factor: float,
                              num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """route_grouped_topk in one launch (a program per token)."""
    num_tokens, num_experts = router_logits.shape
    grouped = topk_method != "greedy"
    groups = num_groups if grouped else 1
    assert router_logits.stride(1) == 1 and num_experts % groups == 0 and 0 < top_k <= num_experts
    assert correction_bias is None or (correction_bias.shape == (num_experts,) and correction_bias.is_contiguous())
    group_size = num_experts // groups
    row = top_k + num_shared
    weights = torch.empty(num_tokens, row, dtype=torch.float32, device=router_logits.device)  # [T, k + S]
    ids = torch.empty(num_tokens, row, dtype=torch.int32, device=router_logits.device)  # [T, k + S]
    if num_tokens:
        pdl_options = pdl.launch_options(router_logits.device)
        _grouped_route_kernel[(num_tokens,)](
            router_logits, correction_bias if correction_bias is not None else router_logits, weights, ids,
            router_logits.stride(0), float(routed_scaling_factor), GROUPS=groups, GROUP_SIZE=group_size,
            GROUPS_P=triton.next_power_of_2(groups), GROUP_SIZE_P=triton.next_power_of_2(group_size),
            TOPK_GROUPS=topk_groups if grouped else 1, TOP_K=top_k, K_P=triton.next_power_of_2(row),
            SIGMOID=scoring_func == "sigmoid", HAS_BIAS=correction_bias is not None, GROUPED=grouped,
            GROUP_TOP2=topk_method == "noaux_tc" and group_size > 1, RENORMALIZE=renormalize,
            NUM_SHARED=num_shared, num_warps=1 if num_experts <= 64 else 4,
            **pdl_options)
    return weights, ids


# Up to this many tokens the fp32 router reads the activations directly (a GEMV per token and expert block); more,
# and the cuBLAS GEMM on an fp32 copy reads the router once for all of them.
ROUTER_GEMV_MAX_TOKENS = 16


def router_logits(h: torch.Tensor, router: torch.Tensor, router_low: torch.Tensor | None = None) -> torch.Tensor:
    """h [T, H] (model dtype) @ router [E, H].T in fp32 -> [T, E] fp32, as F.linear(h.float(), router) computes
    them (DeepSeek routes on fp32 logits). On CUDA at decode batches one Triton kernel reading h as it is, in
    place of a copy kernel and a cuBLAS GEMV; the products and sums are fp32 either way, their order differs.
    router_low: the same router in h's dtype where every value is exactly one (exact_low_precision): above the
    GEMV's batches one tensor-core GEMM with fp32 output, in place of an fp32 copy of h, a SIMT sgemm and a
    split-K reduce. A product of two bf16 (fp16) values is exact in fp32, so only the summation order differs."""
    if h.is_cuda and h.shape[0] <= ROUTER_GEMV_MAX_TOKENS:
        return router_logits_triton(h, router)
    if h.is_cuda and router_low is not None and router_low.dtype == h.dtype:
        assert router_low.shape == router.shape
        return torch.mm(h, router_low.t(), out_dtype=torch.float32)  # [T, E] fp32
    return torch.nn.functional.linear(h.float(), router)


def exact_low_precision(router: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """router [E, H] fp32 in dtype (bf16 / fp16) if that loses nothing (a checkpoint that ships its gate in bf16,
    as DeepSeek's do, or dummy weights drawn in the model dtype), else None: routing stays on the fp32 values."""
    if dtype not in (torch.bfloat16, torch.float16) or router.dtype != torch.float32:
        return None
    low = router.to(dtype)
    return low if torch.equal(low.float(), router) else None


@triton.jit
def _router_gemv_kernel(h_ptr, w_ptr, out_ptr, num_experts, hidden, stride_ht, stride_we, stride_ot,
                        BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    """One token's logits of BLOCK_E experts: fp32 products of h (converted exactly) and the fp32 router rows,
    summed over H in a fixed order (every expert's row the same way: equal rows give equal logits)."""
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    offs_h = tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_E, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h_mask = offs_h < hidden - h0
        x = tl.load(h_ptr + token * stride_ht + h0 + offs_h, mask=h_mask, other=0.0).to(tl.float32)  # [BH]
        w = tl.load(w_ptr + offs_e[:, None] * stride_we + (h0 + offs_h)[None, :],
                    mask=e_mask[:, None] & h_mask[None, :], other=0.0)  # [BE, BH]
        acc += w * x[None, :]
    tl.store(out_ptr + token * stride_ot + offs_e, tl.sum(acc, axis=1), mask=e_mask)


def router_logits_triton(h: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    num_tokens, hidden = h.shape
    num_experts = router.shape[0]
    assert router.shape == (num_experts, hidden) and router.dtype == torch.float32
    assert h.stride(1) == 1 and router.stride(1) == 1
    out = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=h.device)  # [T, E]
    # a program per expert up to 256 of them (V2-Lite: 64 of 8 KB each at one token; V3: 256 of 28 KB): at one token
    # the router's read spreads over as many SMs as it can
    block_e = max(1, triton.next_power_of_2(num_experts) // 256)
    block_h = min(1024, triton.next_power_of_2(hidden))
    if num_tokens:
        pdl_options = pdl.launch_options(h.device)
        _router_gemv_kernel[(num_tokens, triton.cdiv(num_experts, block_e))](
            h, router, out, num_experts, hidden, h.stride(0), router.stride(0), out.stride(0),
            BLOCK_E=block_e, BLOCK_H=block_h, num_warps=4, **pdl_options)
    return out


# ---------------------------------------------------------------- alignment


@triton.jit
def _tile_experts(tiles, tile_end, e_mask, total, BLOCK_M: tl.constexpr):
    """Each tile's expert: how many runs end at or before it (tile_end [E_P]: where expert e's tiles end); -1 past
    the last run (total rows)."""
    ended = (tiles[:, None] >= tile_end[None, :]) & e_mask[None, :]  # [TILES, E_P]
    expert = tl.sum(ended.to(tl.int32), axis=1)
    return tl.where(tiles * BLOCK_M < total, expert, -1)


@triton.jit
def _padded_counts(topk_ids_ptr, num_pairs, EXPERTS_P: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """The pairs per expert (a register histogram over CHUNK pairs at a time) and each count padded to BLOCK_M."""
    counts = tl.zeros([EXPERTS_P], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < num_pairs
        expert = tl.load(topk_ids_ptr + offs, mask=mask, other=0)
        counts += tl.histogram(expert, EXPERTS_P, mask=mask).to(tl.int32)  # [E_P]
    return counts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M


@triton.jit(do_not_specialize=["num_pairs", "max_padded", "max_tiles"])  # varies with the batch: no recompiles
def _align_kernel(topk_ids_ptr, sorted_pairs_ptr, tile_experts_ptr, num_padded_ptr, cursor_ptr, run_ends_ptr,
                  num_pairs, max_padded, max_tiles,
                  NUM_EXPERTS: tl.constexpr, EXPERTS_P: tl.constexpr, BLOCK_M: tl.constexpr,
                  CHUNK: tl.constexpr, TILE_CHUNK: tl.constexpr):
    """One program: count pairs per expert (a register histogram), pad each count to BLOCK_M, lay the experts'
    runs end to end, then place every pair in its expert's run (the order inside a run is free: the top-k sum
    does not depend on it). The placement's atomics are relaxed: only their uniqueness matters, and the
    acquire-release default fences every one of them (~26 us at 2,048 pairs on an H200 before this)."""
    offs_e = tl.arange(0, EXPERTS_P)
    e_mask = offs_e < NUM_EXPERTS
    for start in range(0, max_padded, CHUNK):  # padding rows point past the last pair
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + offs, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=offs < max_padded)
    counts, padded = _padded_counts(topk_ids_ptr, num_pairs, EXPERTS_P, BLOCK_M, CHUNK)  # [E_P] each
    run_end = tl.cumsum(padded, axis=0)  # [E_P]: where each expert's run ends
    run_start = run_end - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    tl.store(cursor_ptr + offs_e, run_start, mask=e_mask)
    tl.store(run_ends_ptr + offs_e, run_end, mask=e_mask)
    tile_end = run_end // BLOCK_M  # [E_P]: tiles [start, end) of expert e
    for start in range(0, max_tiles, TILE_CHUNK):
        tiles = start + tl.arange(0, TILE_CHUNK)  # [TC]
        tl.store(tile_experts_ptr + tiles, _tile_experts(tiles, tile_end, e_mask, total, BLOCK_M),
                 mask=tiles < max_tiles)
    tl.debug_barrier()  # the padding rows and the cursors are written before any pair is placed
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < num_pairs
        expert = tl.load(topk_ids_ptr + offs, mask=mask, other=0)
        slot = tl.atomic_add(cursor_ptr + expert, tl.full([CHUNK], 1, tl.int32), mask=mask, sem="relaxed")
        tl.store(sorted_pairs_ptr + slot, offs.to(tl.int32), mask=mask)


@triton.jit(do_not_specialize=["num_pairs", "max_padded", "max_tiles"])  # varies with the batch: no recompiles
def _align_by_expert_kernel(topk_ids_ptr, sorted_pairs_ptr, tile_experts_ptr, num_padded_ptr, run_ends_ptr,
                            num_pairs, max_padded, max_tiles,
                            NUM_EXPERTS: tl.constexpr, EXPERTS_P: tl.constexpr, BLOCK_M: tl.constexpr,
                            PAD_P: tl.constexpr, CHUNK: tl.constexpr, TILE_CHUNK: tl.constexpr):
    """A program per expert, no atomics: every program counts all pairs per expert (a register histogram; the ids
    are a few KB, read from L2), lays the padded runs end to end, then writes its own run: its pairs in pair order
    (a prefix sum of the matches ranks them), its padding rows and its tiles' expert. The last expert's program
    also writes num_padded and the sentinel rows and -1 tiles past it. The layout equals the stable sort's."""
    expert = tl.program_id(0)
    offs_e = tl.arange(0, EXPERTS_P)
    counts, padded = _padded_counts(topk_ids_ptr, num_pairs, EXPERTS_P, BLOCK_M, CHUNK)  # [E_P] each
    mine = offs_e == expert
    run_end = tl.sum(tl.where(mine, tl.cumsum(padded, axis=0), 0), axis=0)
    run_start = run_end - tl.sum(tl.where(mine, padded, 0), axis=0)
    count = tl.sum(tl.where(mine, counts, 0), axis=0)
    placed = run_start
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
        hit = (ids == expert).to(tl.int32)
        rank = tl.cumsum(hit, axis=0)  # [CHUNK] inclusive: the k-th match goes to row placed + k - 1
        tl.store(sorted_pairs_ptr + placed + rank - 1, offs.to(tl.int32), mask=hit > 0)
        placed += tl.sum(hit, axis=0)
    pad = run_start + count + tl.arange(0, PAD_P)  # a run is padded by at most BLOCK_M - 1 rows
    tl.store(sorted_pairs_ptr + pad, tl.full([PAD_P], 0, tl.int32) + num_pairs, mask=pad < run_end)
    for start in range(run_start // BLOCK_M, run_end // BLOCK_M, TILE_CHUNK):
        tiles = start + tl.arange(0, TILE_CHUNK)
        tl.store(tile_experts_ptr + tiles, tl.full([TILE_CHUNK], 0, tl.int32) + expert, mask=tiles < run_end // BLOCK_M)
    tl.store(run_ends_ptr + expert, run_end)
    if expert == NUM_EXPERTS - 1:  # run_end is the total here
        tl.store(num_padded_ptr, run_end)
        for start in range(run_end, max_padded, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            tl.store(sorted_pairs_ptr + offs, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=offs < max_padded)
        for start in range(run_end // BLOCK_M, max_tiles, TILE_CHUNK):
            tiles = start + tl.arange(0, TILE_CHUNK)
            tl.store(tile_experts_ptr + tiles, tl.full([TILE_CHUNK], -1, tl.int32), mask=tiles < max_tiles)


@dataclass(frozen=True, slots=True)
class Alignment:
    sorted_pairs: torch.Tensor  # [max_padded] int32
    tile_experts: torch.Tensor  # [max_tiles] int32
    num_padded: torch.Tensor  # [1] int32: rows of sorted_pairs in use (a multiple of block_m)
    block_m: int
    run_ends: torch.Tensor  # [E] int32: where each expert's run ends (the grouped GEMM's offs; [-1] = num_padded)


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted layout in the worst case: every expert's run padded by block_m - 1."""
    return num_pairs + num_experts * (block_m - 1)


# Above this many pairs the decode alignments (a program per expert, or one program with serial atomics below
# ALIGN_BY_EXPERT_MIN_EXPERTS experts) lose to one spread over the GPU: on CUDA the multi-program alignment
# (align_pairs_spread), elsewhere a torch sort.
ALIGN_SORT_MIN_PAIRS = 4096


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """topk_ids [T, k] int32 -> the pairs grouped by expert in block_m tiles (shapes fixed by T, k, E, block_m)."""
    assert topk_ids.dtype == torch.int32 and topk_ids.is_contiguous()
    if topk_ids.numel() > ALIGN_SORT_MIN_PAIRS:
        if topk_ids.is_cuda:
            return align_pairs_spread(topk_ids, num_experts, block_m)
        return align_pairs_sorted(topk_ids, num_experts, block_m)
    if num_experts >= ALIGN_BY_EXPERT_MIN_EXPERTS:
        return align_pairs_by_expert(topk_ids, num_experts, block_m)
    return align_pairs_triton(topk_ids, num_experts, block_m)


def align_pairs_sorted(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """The same layout from a stable sort and prefix sums (no host sync; the order inside a run is the pair order)."""
    flat = topk_ids.view(-1).long()  # [P]
    num_pairs = flat.numel()
    device = flat.device
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    max_tiles = -(-max_padded // block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = padded.cumsum(0)  # [E]
    order = torch.sort(flat, stable=True).indices  # [P]: pair ids grouped by expert
    experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[experts]  # place inside the run
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[(run_end - padded)[experts] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(max_tiles, device=device) * block_m  # [max_tiles]
    tile_experts = torch.searchsorted(run_end, tile_starts, right=True)
    tile_experts = torch.where(tile_starts < run_end[-1], tile_experts, -1).to(torch.int32)
    run_ends = run_end.to(torch.int32)
    return Alignment(sorted_pairs, tile_experts, run_ends[-1:], block_m, run_ends)


def _empty_alignment(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """The layout's tensors for a kernel to fill: [max_padded] rows, [max_tiles] tiles, num_padded, [E] run ends."""
    max_padded = max_padded_rows(topk_ids.numel(), num_experts, block_m)
    empty = partial(torch.empty, dtype=torch.int32, device=topk_ids.device)
    return Alignment(empty(max_padded), empty(-(-max_padded // block_m)), empty(1), block_m, empty(num_experts))


def align_pairs_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """The layout from one Triton program (few pairs: decode batches)."""
    num_pairs = topk_ids.numel()
    align = _empty_alignment(topk_ids, num_experts, block_m)
    cursors = torch.empty(num_experts, dtype=torch.int32, device=topk_ids.device)  # [E] scratch
    experts_p = triton.next_power_of_2(num_experts)
    # 16 warps: H200, 66 experts (deepseek-v2-lite), 32 launches in one graph (bench/results/s26/small_kernels.py):
    # 7.8 / 5.2 / 4.3 us at 256 / 128 / 64 tokens x 8 picks against 8.9 / 5.9 / 5.0 with 4 warps; CHUNK 1024 was
    # the best or level at every size
    _align_kernel[(1,)](topk_ids, align.sorted_pairs, align.tile_experts, align.num_padded, cursors, align.run_ends,
                        num_pairs, align.sorted_pairs.numel(), align.tile_experts.numel(),
                        NUM_EXPERTS=num_experts, EXPERTS_P=experts_p,
                        BLOCK_M=block_m, CHUNK=1024, TILE_CHUNK=max(16, 4096 // experts_p), num_warps=16)
    return align


def align_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """The layout from a program per expert (few pairs: decode batches), no atomics; equal to align_pairs_sorted."""
    num_pairs = topk_ids.numel()
    align = _empty_alignment(topk_ids, num_experts, block_m)
    small_pairs, warps, chunk = ALIGN_BY_EXPERT_SMALL
    if num_pairs > small_pairs:
        warps, chunk = ALIGN_BY_EXPERT_WARPS, ALIGN_BY_EXPERT_CHUNK
    _align_by_expert_kernel[(num_experts,)](
        topk_ids, align.sorted_pairs, align.tile_experts, align.num_padded, align.run_ends, num_pairs,
        align.sorted_pairs.numel(), align.tile_experts.numel(),
        NUM_EXPERTS=num_experts, EXPERTS_P=triton.next_power_of_2(num_experts), BLOCK_M=block_m,
        PAD_P=triton.next_power_of_2(block_m), CHUNK=chunk, TILE_CHUNK=16, num_warps=warps)
    return align


# The program-per-expert alignment's launch: chunks of 512 pairs with 4 warps up to 512 pairs, else 1024 with 8.
# H200, 32 launches in one graph (bench/results/s28/align_decode.py, call 4), us a call at 1 / 64 / 128 / 256 / 512
# tokens x 8 picks over 66 experts: 4 warps x 512 2.62 / 2.59 / 3.64 / 5.68 / 9.72; 8 x 1024 2.96 / 2.92 / 3.10 /
# 4.43 / 7.12; the one-program kernel 3.49 / 4.29 / 5.31 / 7.76 / 11.85. With 8 experts (mixtral) every program
# reads every pair for few pairs of its own and the one-program kernel wins (2.3 against 2.5-2.9): below
# ALIGN_BY_EXPERT_MIN_EXPERTS experts it stays.
ALIGN_BY_EXPERT_SMALL = (512, 4, 512)  # (up to this many pairs, warps, chunk)
ALIGN_BY_EXPERT_CHUNK, ALIGN_BY_EXPERT_WARPS = 1024, 8
ALIGN_BY_EXPERT_MIN_EXPERTS = 32


@triton.jit(do_not_specialize=["num_pairs"])  # varies with the batch: no recompiles
def _count_pairs_kernel(topk_ids_ptr, counts_ptr, num_pairs, EXPERTS_P: tl.constexpr, CHUNK: tl.constexpr):
    """One chunk of pairs: its histogram over the experts, added to the global counts (one vector atomic)."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < num_pairs
    expert = tl.load(topk_ids_ptr + offs, mask=mask, other=0)
    counts = tl.histogram(expert, EXPERTS_P, mask=mask).to(tl.int32)  # [E_P]
    tl.atomic_add(counts_ptr + tl.arange(0, EXPERTS_P), counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _lay_runs_kernel(counts_ptr, cursor_ptr, run_ends_ptr, num_padded_ptr, NUM_EXPERTS: tl.constexpr,
                     EXPERTS_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """One program: each expert's count padded to BLOCK_M and the runs laid end to end (each run's first row into
    the cursors the placement advances, its end into run_ends)."""
    offs_e = tl.arange(0, EXPERTS_P)
    e_mask = offs_e < NUM_EXPERTS
    counts = tl.load(counts_ptr + offs_e, mask=e_mask, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)  # [E_P]
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    tl.store(cursor_ptr + offs_e, run_end - padded, mask=e_mask)
    tl.store(run_ends_ptr + offs_e, run_end, mask=e_mask)


@triton.jit(do_not_specialize=["max_tiles"])
def _tile_experts_kernel(run_ends_ptr, num_padded_ptr, tile_experts_ptr, max_tiles, NUM_EXPERTS: tl.constexpr,
                         EXPERTS_P: tl.constexpr, BLOCK_M: tl.constexpr, TILES: tl.constexpr):
    """TILES tiles' experts: how many runs end at or before each tile's first row (-1 past the last run). A
    program per TILES tiles: at BLOCK_M 1 (the grouped-GEMM path) there is a tile per row."""
    offs_e = tl.arange(0, EXPERTS_P)
    e_mask = offs_e < NUM_EXPERTS
    run_end = tl.load(run_ends_ptr + offs_e, mask=e_mask, other=0)  # [E_P]
    total = tl.load(num_padded_ptr)
    tiles = tl.program_id(0) * TILES + tl.arange(0, TILES)  # [TILES]
    tl.store(tile_experts_ptr + tiles, _tile_experts(tiles, run_end // BLOCK_M, e_mask, total, BLOCK_M),
             mask=tiles < max_tiles)


@triton.jit(do_not_specialize=["num_pairs"])
def _place_pairs_kernel(topk_ids_ptr, cursor_ptr, sorted_pairs_ptr, num_pairs, CHUNK: tl.constexpr):
    """One chunk of pairs, each to the next free row of its expert's run (relaxed atomics: only the rows'
    uniqueness matters; the order inside a run is free, the top-k sum does not depend on it)."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < num_pairs
    expert = tl.load(topk_ids_ptr + offs, mask=mask, other=0)
    row = tl.atomic_add(cursor_ptr + expert, tl.full([CHUNK], 1, tl.int32), mask=mask, sem="relaxed")
    tl.store(sorted_pairs_ptr + row, offs.to(tl.int32), mask=mask)


# Pairs a program of the spread alignment counts or places
SPREAD_CHUNK = 1024


def align_pairs_spread(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """The layout over the whole GPU, for many pairs (prefill): a program per chunk of pairs counts them per expert,
    one program lays out the runs, a program per group of tiles finds their experts, a program per chunk places
    each pair. Padding rows are the sentinel filled first. No sort and no host sync (align_pairs_sorted is the same
    layout from torch ops)."""
    if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous int32, got {topk_ids.dtype} strides {topk_ids.stride()}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts and block_m must be >= 1, got {num_experts} and {block_m}")
    num_pairs = topk_ids.numel()
    max_padded = max_padded_rows(num_pairs, num_experts, block_m)
    max_tiles = -(-max_padded // block_m)
    device = topk_ids.device
    experts_p = triton.next_power_of_2(num_experts)
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)  # [max_padded]
    tile_experts = torch.empty(max_tiles, dtype=torch.int32, device=device)  # [max_tiles]
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    counts = torch.zeros(2, experts_p, dtype=torch.int32, device=device)  # [counts, cursors]
    run_ends = torch.empty(num_experts, dtype=torch.int32, device=device)  # [E]
    if num_pairs:
        chunks = (triton.cdiv(num_pairs, SPREAD_CHUNK),)
        _count_pairs_kernel[chunks](topk_ids, counts[0], num_pairs, EXPERTS_P=experts_p, CHUNK=SPREAD_CHUNK,
                                    num_warps=4)
    _lay_runs_kernel[(1,)](counts[0], counts[1], run_ends, num_padded, NUM_EXPERTS=num_experts, EXPERTS_P=experts_p,
                           BLOCK_M=block_m, num_warps=4)
    tiles = max(16, 4096 // experts_p)  # a [tiles, E_P] comparison a program
    _tile_experts_kernel[(triton.cdiv(max_tiles, tiles),)](run_ends, num_padded, tile_experts, max_tiles,
                                                          NUM_EXPERTS=num_experts, EXPERTS_P=experts_p,
                                                          BLOCK_M=block_m, TILES=tiles, num_warps=4)
    if num_pairs:
        _place_pairs_kernel[chunks](topk_ids, counts[1], sorted_pairs, num_pairs, CHUNK=SPREAD_CHUNK, num_warps=4)
    return Alignment(sorted_pairs, tile_experts, num_padded, block_m, run_ends)


# ---------------------------------------------------------------- grouped GEMM


@triton.jit
def _load_weight_tile(w_ptrs, scale_ptrs, k_left, offs_k, n_mask, k0, IS_FP8: tl.constexpr,
                      GROUP_K: tl.constexpr, stride_sg, compute_dtype: tl.constexpr, EVEN_K: tl.constexpr,
                      EVEN_N: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] weight tile in the activation dtype (e4m3 converted and scaled in registers)."""
    if EVEN_K and EVEN_N:
        w = tl.load(w_ptrs)
    else:
        mask = (offs_k[:, None] < k_left) & n_mask[None, :]
        w = tl.load(w_ptrs, mask=mask, other=0.0)
    if IS_FP8:
        scale = tl.load(scale_ptrs + (k0 // GROUP_K) * stride_sg, mask=n_mask, other=0.0)  # [BLOCK_N]
        w = (w.to(tl.float32) * scale[None, :]).to(compute_dtype)
    return w


@triton.jit
def _quantize_act_tile(a, HW_CAST: tl.constexpr, FP32_DOT: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] activation tile as e4m3 codes with one power-of-two scale a row (amax to at most 448:
    exact scaling, as the W8A16 kernel's act_fp8 tiles): (codes, or their fp32 values for FP32_DOT; scales [BM])."""
    af = a.to(tl.float32)
    scale, inverse = pow2_scale(tl.max(tl.abs(af), 1))  # [BM] each
    codes = cast_e4m3(af * inverse[:, None], HW_CAST)
    if FP32_DOT:
        codes = codes.to(tl.float32)
    return codes, scale


@triton.jit
def _act_fp8_step(acc, a_q, a_scale, w_ptrs, scale_ptrs, k_left, offs_k, n_mask, k0, GROUP_K: tl.constexpr,
                  stride_sg, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, FP32_DOT: tl.constexpr):
    """acc [BM, BN] += (a_q @ W tile) * row scales * the weight tile's scales: the e4m3 tile as loaded on fp8 tensor
    cores (its fp32 values under FP32_DOT: Triton's interpreter, fp32 models)."""
    if EVEN_K and EVEN_N:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & n_mask[None, :], other=0.0)
    if FP32_DOT:
        w = w.to(tl.float32)
    w_scale = tl.load(scale_ptrs + (k0 // GROUP_K) * stride_sg, mask=n_mask, other=0.0)  # [BN]
    return acc + tl.dot(a_q, w) * a_scale[:, None] * w_scale[None, :]


@triton.jit(do_not_specialize=["num_pairs"])  # the batch's pair count: one variant for every count
def _moe_gemm_kernel(
        a_ptr, w_ptr, scale_ptr, out_ptr, sorted_pairs_ptr, tile_experts_ptr, num_padded_ptr, topk_weights_ptr,
        N, K, num_pairs,
        stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
        stride_om, stride_on,
        A_ROWS_PER_PAIR: tl.constexpr,  # top_k when A is indexed by token (pair // top_k), 1 when by pair
        FUSE_SILU: tl.constexpr,  # W holds [gate; up] rows (N each): out = silu(x @ gate.T) * (x @ up.T)
        MUL_WEIGHT: tl.constexpr,  # scale each output row by its pair's routing weight
        IS_FP8: tl.constexpr, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        ACT_FP8: tl.constexpr = False, HW_CAST: tl.constexpr = True, FP32_DOT: tl.constexpr = False):
    """out[pair, n] = act(A[row(pair)] @ W[expert(pair)].T)[n] for the BLOCK_M pairs of one tile.
    ACT_FP8 (e4m3 weights): W8A8 for large batches, where converting the weight tiles bounds the weight-only form:
    each A tile is quantized per row where it is loaded (_quantize_act_tile: no kernel of its own) and multiplied
    with the e4m3 tile as loaded on fp8 tensor cores, both scales applied to that K step's product."""
    pid = tl.program_id(0)
    num_tiles_m = tl.num_programs(0) // tl.cdiv(N, BLOCK_N)
    num_tiles_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles share each column sweep (their expert's weights stay in L2)
    per_group = GROUP_M * num_tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(tile_experts_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)  # [BLOCK_M]
    m_mask = pairs < num_pairs
    rows = (pairs // A_ROWS_PER_PAIR).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_base = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk
    w_ptrs = w_base + offs_n[None, :] * stride_wn  # [BLOCK_K, BLOCK_N]: W[e, n, k] read transposed
    s_ptrs = scale_ptr + expert * stride_se + offs_n * stride_sn
    compute_dtype: tl.constexpr = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FUSE_SILU:
        up_ptrs = w_ptrs + N * stride_wn
        up_s_ptrs = s_ptrs + N * stride_sn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        if ACT_FP8:
            a_q, a_scale = _quantize_act_tile(a, HW_CAST, FP32_DOT)
            acc = _act_fp8_step(acc, a_q, a_scale, w_ptrs, s_ptrs, k_left, offs_k, n_mask, k0, GROUP_K, stride_sg,
                                EVEN_K, EVEN_N, FP32_DOT)
            if FUSE_SILU:
                acc_up = _act_fp8_step(acc_up, a_q, a_scale, up_ptrs, up_s_ptrs, k_left, offs_k, n_mask, k0,
                                       GROUP_K, stride_sg, EVEN_K, EVEN_N, FP32_DOT)
        else:
            w = _load_weight_tile(w_ptrs, s_ptrs, k_left, offs_k, n_mask, k0, IS_FP8, GROUP_K, stride_sg,
                                  compute_dtype, EVEN_K, EVEN_N)
            acc += tl.dot(a, w)
            if FUSE_SILU:
                up = _load_weight_tile(up_ptrs, up_s_ptrs, k_left, offs_k, n_mask, k0, IS_FP8, GROUP_K, stride_sg,
                                       compute_dtype, EVEN_K, EVEN_N)
                acc_up += tl.dot(a, up)
        if FUSE_SILU:
            up_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if FUSE_SILU:
        # the gate is rounded to the storage dtype before silu, as F.silu(gate) * up does on model-dtype tensors
        gate = acc.to(compute_dtype).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(compute_dtype).to(tl.float32) * acc_up.to(compute_dtype).to(
            tl.float32)
    if MUL_WEIGHT:
        weight = tl.load(topk_weights_ptr + pairs, mask=m_mask, other=0.0).to(tl.float32)
        acc = acc.to(compute_dtype).to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemv_pair(a_ptr, w_ptr, scale_ptr, topk_ids_ptr, pair, offs_n, n_mask, N, K,
               stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
               A_ROWS_PER_PAIR: tl.constexpr, FUSE_SILU: tl.constexpr, IS_FP8: tl.constexpr, GROUP_K: tl.constexpr,
               EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One pair's BLOCK_N outputs in fp32 (silu(gate) * up when FUSE_SILU), rounded as the GEMM kernel rounds."""
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    row = (pair // A_ROWS_PER_PAIR).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row * stride_am + offs_k * stride_ak
    w_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk  # [BN, BK]
    s_ptrs = scale_ptr + expert * stride_se + offs_n * stride_sn
    compute_dtype: tl.constexpr = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs).to(tl.float32)
            w_mask = n_mask[:, None]
        else:
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        if IS_FP8:
            w = (w * tl.load(s_ptrs + (k0 // GROUP_K) * stride_sg, mask=n_mask, other=0.0)[:, None]).to(
                compute_dtype).to(tl.float32)
        acc += tl.sum(w * a[None, :], axis=1)
        if FUSE_SILU:
            up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0).to(tl.float32)
            if IS_FP8:
                up = (up * tl.load(s_ptrs + N * stride_sn + (k0 // GROUP_K) * stride_sg, mask=n_mask,
                                   other=0.0)[:, None]).to(compute_dtype).to(tl.float32)
            acc_up += tl.sum(up * a[None, :], axis=1)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if FUSE_SILU:
        gate = acc.to(compute_dtype).to(tl.float32)
        acc = (gate / (1.0 + tl.exp(-gate))).to(compute_dtype).to(tl.float32) * acc_up.to(compute_dtype).to(
            tl.float32)
    return acc.to(compute_dtype).to(tl.float32)


@triton.jit
def _gemv_pairs_at_once(a_ptr, w_ptr, scale_ptr, topk_ids_ptr, topk_weights_ptr, slot, offs_n, n_mask, K,
                        stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
                        SUM_TOP_K: tl.constexpr, PAIRS_P: tl.constexpr, IS_FP8: tl.constexpr,
                        GROUP_K: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_j weight_j * out_j over a token's SUM_TOP_K pairs (A indexed by pair), every pair's K-step loaded in one
    [PAIRS_P, BLOCK_N, BLOCK_K] tile: one pipelined K loop instead of SUM_TOP_K loops one after another. Each
    pair's output is rounded as _gemv_pair rounds it before the weighted sum."""
    offs_p = tl.arange(0, PAIRS_P)
    p_mask = offs_p < SUM_TOP_K
    pairs = slot * SUM_TOP_K + offs_p  # [P]
    experts = tl.load(topk_ids_ptr + pairs, mask=p_mask, other=0).to(tl.int64)  # [P]
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + pairs.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak  # [P, BK]
    w_ptrs = (w_ptr + experts[:, None, None] * stride_we + offs_n[None, :, None] * stride_wn
              + offs_k[None, None, :] * stride_wk)  # [P, BN, BK]
    pn_mask = p_mask[:, None] & n_mask[None, :]  # [P, BN]
    s_ptrs = scale_ptr + experts[:, None] * stride_se + offs_n[None, :] * stride_sn  # [P, BN]
    compute_dtype: tl.constexpr = a_ptr.dtype.element_ty
    acc = tl.zeros((PAIRS_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=p_mask[:, None], other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=pn_mask[:, :, None], other=0.0).to(tl.float32)
        else:
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=p_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=pn_mask[:, :, None] & k_mask[None, None, :], other=0.0).to(tl.float32)
        if IS_FP8:
            w = (w * tl.load(s_ptrs + (k0 // GROUP_K) * stride_sg, mask=pn_mask, other=0.0)[:, :, None]).to(
                compute_dtype).to(tl.float32)
        acc += tl.sum(w * a[:, None, :], axis=2)  # [P, BN]
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    weights = tl.load(topk_weights_ptr + pairs, mask=p_mask, other=0.0).to(tl.float32)  # [P]
    return tl.sum(acc.to(compute_dtype).to(tl.float32) * weights[:, None], axis=0)  # [BN]


@triton.jit
def _moe_gemv_kernel(
        a_ptr, w_ptr, scale_ptr, out_ptr, topk_ids_ptr, topk_weights_ptr, N, K,
        stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
        stride_om, stride_on,
        A_ROWS_PER_PAIR: tl.constexpr, FUSE_SILU: tl.constexpr, SUM_TOP_K: tl.constexpr,
        IS_FP8: tl.constexpr, GROUP_K: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAIRS_AT_ONCE: tl.constexpr, PAIRS_P: tl.constexpr,
        USE_PDL: tl.constexpr):
    """Few pairs (decode at small batch), no alignment and no padded rows. SUM_TOP_K = 0: one program per
    (pair, BLOCK_N columns) writes that pair's row. SUM_TOP_K = k: one program per (token, BLOCK_N columns) runs
    the token's k pairs and writes sum_j weight_j * out_j (the layer's last step, no [T * k, H] buffer): one pair
    after another, or with PAIRS_AT_ONCE (A by pair, no SiLU) all k in each K-step (_gemv_pairs_at_once)."""
    pdl.launch_dependents(USE_PDL)
    pdl.wait(USE_PDL)
    slot = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if PAIRS_AT_ONCE:
        acc = _gemv_pairs_at_once(a_ptr, w_ptr, scale_ptr, topk_ids_ptr, topk_weights_ptr, slot, offs_n, n_mask, K,
                                  stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn,
                                  stride_sg, SUM_TOP_K, PAIRS_P, IS_FP8, GROUP_K, EVEN_K, BLOCK_N, BLOCK_K)
    elif SUM_TOP_K == 0:
        acc = _gemv_pair(a_ptr, w_ptr, scale_ptr, topk_ids_ptr, slot, offs_n, n_mask, N, K,
                         stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
                         A_ROWS_PER_PAIR, FUSE_SILU, IS_FP8, GROUP_K, EVEN_K, BLOCK_N, BLOCK_K)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in tl.static_range(SUM_TOP_K):
            pair = slot * SUM_TOP_K + j
            out = _gemv_pair(a_ptr, w_ptr, scale_ptr, topk_ids_ptr, pair, offs_n, n_mask, N, K,
                             stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sg,
                             A_ROWS_PER_PAIR, FUSE_SILU, IS_FP8, GROUP_K, EVEN_K, BLOCK_N, BLOCK_K)
            acc += out * tl.load(topk_weights_ptr + pair).to(tl.float32)
    tl.store(out_ptr + slot * stride_om + offs_n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    # the down GEMV (a token's pairs summed in one program): every pair's K-step in one tile (_gemv_pairs_at_once)
    pairs_at_once: bool = False


def _moe_gemv(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, group_k: int,
              topk_ids: torch.Tensor, out: torch.Tensor, rows_per_pair: int, fuse_silu: bool,
              topk_weights: torch.Tensor | None, tile: GemvConfig) -> None:
    """out [T * k, N] per pair, or with topk_weights out [T, N] = the weighted sum over each token's k pairs."""
    n = w.shape[1] // 2 if fuse_silu else w.shape[1]
    k = w.shape[2]
    is_fp8 = w.dtype == torch.float8_e4m3fn
    stride_s = w_scale.stride() if is_fp8 and w_scale is not None else (0, 0, 0)
    top_k = topk_ids.shape[1] if topk_weights is not None else 0
    if tile.pairs_at_once and (not top_k or fuse_silu or rows_per_pair != 1):
        raise ValueError("pairs_at_once is for the down GEMV: a token's pairs summed, A indexed by pair, no SiLU")
    grid = (topk_ids.shape[0] if top_k else topk_ids.numel(), triton.cdiv(n, tile.block_n))
    pdl_options = pdl.launch_options(a.device)
    _moe_gemv_kernel[grid](
        a, w, w_scale if is_fp8 else out, out, topk_ids, topk_weights if topk_weights is not None else out, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), *stride_s, out.stride(0), out.stride(1),
        A_ROWS_PER_PAIR=rows_per_pair, FUSE_SILU=fuse_silu, SUM_TOP_K=top_k, IS_FP8=is_fp8,
        GROUP_K=group_k, EVEN_K=k % tile.block_k == 0, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        PAIRS_AT_ONCE=tile.pairs_at_once, PAIRS_P=triton.next_power_of_2(max(top_k, 1)),
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_options)


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    # FP8 experts only: W8A8 (each activation tile quantized per row where it is loaded, fp8 tensor cores) instead
    # of weight-only; the FP8 tables (bench/moe_tune.py --weights fp8) choose it per bucket and GEMM by measurement
    act_fp8: bool = False


def smaller_tile(tile: TileConfig) -> TileConfig:
    """The next tile to try when a launch runs out of shared memory: one stage fewer (down to 2), then half the N
    block, then half the K block (a K block that divided a scale group still does)."""
    if tile.num_stages > 2:
        return replace(tile, num_stages=tile.num_stages - 1)
    if tile.block_n > 16:
        return replace(tile, block_n=tile.block_n // 2)
    if tile.block_k > 16:
        return replace(tile, block_k=tile.block_k // 2)
    raise ValueError(f"no smaller MoE GEMM tile than {tile}")


# (tile, operand dtypes, fused SiLU, device) -> the tile that launched in its place (launch_fitting)
_FITTED_TILES: dict[tuple[Any, ...], TileConfig] = {}


def launch_fitting(launch: Callable[[TileConfig], None], tile: TileConfig, key: tuple[Any, ...]) -> TileConfig:
    """launch(tile), or with smaller tiles while Triton finds that one needs more shared memory than the device has;
    the tile that launched is remembered for `key`, so later launches go straight to it. The tables and defaults are
    tuned for bf16 / fp8 operands; fp32 ones (tiny test models) have twice the bytes: 64 x 128 x 64 gate/up tiles
    in 4 stages asked 327,680 B of an H200's 232,448. Returns the tile used."""
    tile = _FITTED_TILES.get((tile, *key), tile)
    tried = tile
    while True:
        try:
            launch(tile)
        except OutOfResources as exc:
            smaller = smaller_tile(tile)
            log.info("MoE GEMM tile %s: %s; trying %s", tile, exc, smaller)
            tile = smaller
            continue
        if tile != tried:
            _FITTED_TILES[(tried, *key)] = tile
        return tile


# PAGODA_MOE_ACT_FP8=auto: FP8 experts take W8A8 (act_fp8) from this many expert rows (token-expert pairs) per
# expert on average: below it the weight-only grouped GEMM reads fewer bytes for the same work; above it converting
# each weight tile bounds it (H100, 2026-12-05, bench/moe_fp8_sweep.py, weight-only FP8 against bf16: 1.31-1.77x at
# 1-256 tokens, i.e. up to 31 rows per expert on deepseek-v2-lite, 0.98x at 124 rows and 0.66-0.72x at 8192 tokens).
ACT_FP8_MIN_ROWS_PER_EXPERT = 64


def moe_act_fp8(num_pairs: int, num_experts: int, tile: TileConfig) -> bool:
    """Whether FP8 experts run W8A8 for a grouped GEMM over num_pairs (token, expert) pairs with this tile: the
    tile's choice (an FP8 table's, measured by bench/moe_tune.py --weights fp8; weight-only in the bf16 tables and the
    default tiles), unless PAGODA_MOE_ACT_FP8 overrides it for an A/B: 0 never, 1 always, auto from
    ACT_FP8_MIN_ROWS_PER_EXPERT rows an expert; unset or "table": the tile's."""
    mode = measurement_switch("MOE_ACT_FP8")
    if mode == "auto":
        return num_pairs >= ACT_FP8_MIN_ROWS_PER_EXPERT * num_experts
    if mode in ("0", "1"):
        return mode == "1"
    return tile.act_fp8


def _moe_gemm(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, group_k: int | None,
              align: Alignment, out: torch.Tensor, num_pairs: int, rows_per_pair: int, fuse_silu: bool,
              topk_weights: torch.Tensor | None, tile: TileConfig, act_fp8: bool = False) -> None:
    n = w.shape[1] // 2 if fuse_silu else w.shape[1]
    k = w.shape[2]
    is_fp8 = w.dtype == torch.float8_e4m3fn
    assert is_fp8 or not act_fp8, "W8A8 experts need e4m3 weights"
    scale = w_scale if is_fp8 else out  # unused pointer when not fp8
    assert not is_fp8 or (w_scale is not None and group_k is not None)
    assert not is_fp8 or group_k is None or group_k >= k or group_k % tile.block_k == 0, "K-tile crosses a scale group"
    stride_s = w_scale.stride() if is_fp8 and w_scale is not None else (0, 0, 0)
    max_tiles = align.tile_experts.numel()

    def launch(tile: TileConfig) -> None:
        grid = (max_tiles * triton.cdiv(n, tile.block_n),)
        _moe_gemm_kernel[grid](
            a, w, scale, out, align.sorted_pairs, align.tile_experts, align.num_padded,
            topk_weights if topk_weights is not None else out,
            n, k, num_pairs,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), *stride_s,
            out.stride(0), out.stride(1),
            A_ROWS_PER_PAIR=rows_per_pair, FUSE_SILU=fuse_silu, MUL_WEIGHT=topk_weights is not None,
            IS_FP8=is_fp8, GROUP_K=group_k or k, EVEN_K=k % tile.block_k == 0, EVEN_N=n % tile.block_n == 0,
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
            ACT_FP8=act_fp8, HW_CAST=hw_cast(),
            FP32_DOT=a.dtype == torch.float32 or triton_interpreted(),
            num_warps=tile.num_warps, num_stages=tile.num_stages)

    # the row tiles (block_m) come from the alignment: only the stages and the N and K blocks may change
    launch_fitting(launch, tile, (a.dtype, w.dtype, fuse_silu, act_fp8, a.device))


# ---------------------------------------------------------------- tuned tiles


def _bucket(num_tokens: int) -> int:
    """Token counts share a tile configuration per power of two."""
    return 1 << max(0, math.ceil(math.log2(max(num_tokens, 1))))


Tiles = tuple[TileConfig, TileConfig] | tuple[GemvConfig, GemvConfig]


def default_tiles(num_tokens: int, top_k: int, num_experts: int, intermediate: int, hidden: int) -> Tiles:
    """Reasonable tiles for any shape: GEMVs for a few pairs spread over many experts, else the grouped GEMM."""
    if num_tokens * top_k <= 16 and 4 * num_tokens * top_k <= num_experts:
        return default_gemv(hidden), default_gemv(intermediate)
    tile = default_tile(num_tokens, top_k, num_experts)
    return tile, tile


def default_gemv(k: int) -> GemvConfig:
    """A GEMV tile by the length K of the rows it reduces, from the two tuned H200 tables at 1-2 tokens (moe_configs/:
    qwen3-30b-a3b E=128 I=768 H=2048, mixtral E=8 I=14336 H=4096): long rows want few rows per program and long
    K-steps with 2 stages. gate_up (K = 2048, 4096): block_n 8 / block_k 512 (qwen3, 1 token), 16 / 512 (mixtral, 1),
    4 / 1024 (both, 2 tokens); down at K = 14336: 4 / 1024, 2 stages (1 and 2 tokens); down at K = 768: 16 / 256,
    3 stages (1 token), 32 / 128, 4 stages (2 tokens). 4 warps in all of these."""
    if k >= 8192:
        return GemvConfig(block_n=4, block_k=1024, num_warps=4, num_stages=2)
    if k >= 2048:
        return GemvConfig(block_n=8, block_k=512, num_warps=4, num_stages=2)
    return GemvConfig(block_n=16, block_k=256, num_warps=4, num_stages=3)


def default_tile(num_tokens: int, top_k: int, num_experts: int) -> TileConfig:
    """A reasonable grouped-GEMM tile: small row tiles when experts see few tokens each."""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 4:
        return TileConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    if per_expert <= 32:
        return TileConfig(block_m=32, block_n=64, block_k=64, group_m=4, num_warps=4, num_stages=4)
    return TileConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)


def config_file_name(num_experts: int, intermediate: int, hidden: int, dtype: str, device_name: str) -> str:
    device = device_name.replace(" ", "_")
    return f"E={num_experts},I={intermediate},H={hidden},dtype={dtype},device={device},triton={triton.__version__}.json"


@lru_cache(maxsize=16)
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def tiles_from_json(entry: dict[str, Any]) -> Tiles:
    """A table entry: {"gate_up": tile, "down": tile}, or {"kind": "gemv", ...} for the GEMV path."""
    kind = GemvConfig if entry.get("kind") == "gemv" else TileConfig
    return kind(**entry["gate_up"]), kind(**entry["down"])  # type: ignore[return-value]


def tiles_to_json(tiles: Tiles) -> dict[str, Any]:
    """tiles_from_json's inverse; act_fp8 written only where set (the bf16 tables never have it)."""
    def fields(tile: TileConfig | GemvConfig) -> dict[str, Any]:
        return {name: value for name, value in asdict(tile).items() if name != "act_fp8" or value}
    entry: dict[str, Any] = {"gate_up": fields(tiles[0]), "down": fields(tiles[1])}
    if isinstance(tiles[0], GemvConfig):
        entry["kind"] = "gemv"
    return entry


@lru_cache(maxsize=64)
def _tuned_table(file_name: str) -> dict[int, Tiles] | None:
    path = CONFIG_DIR / file_name
    if not path.is_file():
        log.info("no tuned MoE tiles %s (bench/moe_tune.py writes them)", file_name)
        return None
    raw = json.loads(path.read_text())
    return {int(bucket): tiles_from_json(entry) for bucket, entry in raw.items()}


def pick_tiles(num_tokens: int, top_k: int, num_experts: int, intermediate: int, hidden: int,
               dtype: torch.dtype, device: torch.device, weight_dtype: torch.dtype | None = None) -> Tiles:
    """(gate_up tile, down tile) for this shape: FP8 experts (weight_dtype e4m3) the FP8 table's from its smallest
    bucket up, else the table of the activations' dtype at its nearest bucket, else the default tiles."""
    if device.type == "cuda":
        def table_of(dtype_name: str) -> dict[int, Tiles] | None:
            return _tuned_table(config_file_name(num_experts, intermediate, hidden, dtype_name,
                                                 _device_name(device.index)))
        fp8_table = table_of(FP8_TABLE_DTYPE) if weight_dtype == torch.float8_e4m3fn else None
        tiles = tiles_from_tables(num_tokens, fp8_table, table_of(str(dtype).removeprefix("torch.")))
        if tiles is not None:
            return tiles
    return default_tiles(num_tokens, top_k, num_experts, intermediate, hidden)


FP8_TABLE_DTYPE = "float8_e4m3fn"  # the dtype in FP8 experts' table names (tuned with bf16 activations)


def tiles_from_tables(num_tokens: int, fp8_table: dict[int, Tiles] | None,
                      table: dict[int, Tiles] | None) -> Tiles | None:
    """The FP8 table's nearest bucket from its smallest one up (a table tuned at 128-8192 tokens says nothing about
    one token: it would hand a decode step a large batch's grouped-GEMM tiles), else the other table's nearest
    bucket; None without either."""
    bucket = _bucket(num_tokens)
    if fp8_table and bucket >= min(fp8_table):
        return _nearest(fp8_table, bucket)
    return _nearest(table, bucket) if table else None


def _nearest(table: dict[int, Tiles], bucket: int) -> Tiles:
    return table[min(table, key=lambda b: abs(math.log2(b) - math.log2(bucket)))]


# ---------------------------------------------------------------- prefill over CUTLASS grouped GEMM

# From this many (token, expert) pairs per expert on average, a bf16 layer on a CUDA device with CUTLASS grouped
# GEMMs (sm90/sm100) runs its two GEMMs on torch._grouped_mm. Measured on one H200 (2026-12-02,
# python -m pagoda.bench.moe_prefill, bench/results/s10/call6/moe_prefill.json; gmm / Triton layer time): the gmm
# path wins from ~512 rows an expert and loses below ~256: deepseek-v2-lite (66 experts incl. 2 shared, 8 each)
# 0.86 / 1.06 / 0.99 / 1.02 / 1.03 at 1k / 2k / 4k / 8k / 16k tokens (~125 / 250 / 500 / 990 / 1990 rows an
# expert); qwen3-30b-a3b (128, 8) 1.07 / 0.79 / 0.95 / 1.09 / 1.09; mixtral-8x7b (8, 2) 0.92 / 1.07 / 1.16 / 1.19 /
# 1.23 (256 / 512 / 1k / 2k / 4k rows an expert). Decode never comes near: its CUDA graphs hold at most
# max_num_seqs tokens (256 by default); and the path has no host sync, so a graph that did capture it would still
# replay correctly.
GMM_MIN_ROWS_PER_EXPERT = 512
# Each expert's run of rows in the grouped-GEMM layout is padded to a multiple of this. 1: no padding rows at all.
# CUTLASS masks a group's ragged last tile itself, and a group's first row stays 16-byte aligned for any count
# (rows are H or I elements, multiples of 8), so padding would only add rows to compute; to be measured.
GMM_BLOCK_M = 1
MOE_PATHS = ("triton", "gmm")
CUTLASS_MAX_GROUPS = 1023  # torch's CUTLASS grouped GEMM: "Can't process more than 1024 groups"
# FP8 experts with per-row weight scales on the gmm path (torch._scaled_grouped_mm, W8A8 with per-row activation
# scales): each expert's run padded to this many rows (torchao pads its FP8 grouped GEMMs' groups to 16 rows).
GMM_FP8_BLOCK_M = 16
# FP8 experts with per-row scales take the gmm path from this many rows (token-expert pairs) an expert on average.
# bench/moe_fp8_sweep.py, 2026-12-06 (bench/results/s36/call2/): speedup over bf16 experts of per-row W8A8 on
# torch._scaled_grouped_mm / the Triton FP8 grouped GEMM (weight-only tiles), at tokens (rows an expert):
#   H200, deepseek-v2-lite (66 experts incl. 2 shared, 8 a token): 128 (15.5) 1.26 / 1.09, 256 1.27 / 1.13,
#     512 1.30 / 0.97, 1024 0.82 / 0.80, 2048 1.25 / 0.74, 8192 1.43 / 0.69;
#   H200, qwen3-30b-a3b (128 experts, 8 a token): 128 (8) 1.13 / 1.45, 256 (16) 1.14 / 1.17, 512 1.14 / 1.05,
#     1024 1.30 / 0.82, 8192 1.41 / 0.65 (and the whole decode step at B=256, 16 rows: 19.45 ms against 19.14);
#   H100: v2-lite 64 (7.8) 1.55 / 1.62, 128 1.60 / 1.41; qwen3 128 1.47 / 1.63, 256 1.51 / 1.39.
# Below ~8 rows the weight-only kernels read the same bytes without quantizing activations and win; at 16 rows the
# two are level on qwen3 and gmm wins on v2-lite.
FP8_GMM_MIN_ROWS_PER_EXPERT = 12


# torch._scaled_grouped_mm (rows 2D x experts 3D) picks its CUTLASS tiles from M = rows of A / groups: 64 x 128 x 128
# ping-pong tiles up to M = 128, else 128 x 256 x 64 cooperative ones (256 x 128 x 128 from M = 2048 with fast
# accumulation). deepseek-v2-lite's two expert GEMMs took 268 us at 768 tokens (M = 108), 485 at 1024 (M = 139) and
# 514 at 2048 (H100, 2026-12-06, bench/results/s37/call1.txt). Handing the op f times the groups
# (expert_group_views: each expert one real group and f - 1 empty ones) keeps M at most GMM_FP8_SMALL_TILE_M without
# a second launch. Whole layer, split / not (bench/results/s37/call2.txt H200, call3.txt H100):
#   deepseek-v2-lite (64 routed + 2 shared experts): 1024 tokens (M = 139) 317 / 535 us (H200), 361 / 547 (H100);
#     2048 (M = 263) 547 / 620, 570 / 639; 4096 (M = 511) 943 / 882; 8192 1815 / 1679;
#   qwen3-30b-a3b (128 experts): 2048 (M = 143) 431 / 427, 468 / 467; 3072 (M = 207) 590 / 521 (H100);
#     4096 (M = 286) 687 / 629.
# So the split is taken per shape, where it was measured to win: GMM_FP8_SPLIT_MAX_M holds, for (experts, I, H),
# the largest M it applies to (from above GMM_FP8_SMALL_TILE_M); other shapes keep torch's choice.
# PAGODA_MOE_FP8_GMM_SPLIT=0 turns it off (A/B runs).
GMM_FP8_SMALL_TILE_M = 128
GMM_FP8_SPLIT_MAX_M: dict[tuple[int, int, int], int] = {
    (66, 1408, 2048): 272,  # deepseek-v2-lite: between the last measured win (263) and the first loss (511)
}


def splits_experts(num_experts: int, rows: int, cols: int) -> bool:
    """Whether per-row FP8 expert weights [E, rows, cols] (gate_up [E, 2I, H] or down [E, H, I]) are of a shape the
    gmm path may split (GMM_FP8_SPLIT_MAX_M): only those need with_spare_expert's storage."""
    return (num_experts, rows // 2, cols) in GMM_FP8_SPLIT_MAX_M or (num_experts, cols, rows) in GMM_FP8_SPLIT_MAX_M


def with_spare_expert(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                      like: torch.Tensor | None = None) -> torch.Tensor:
    """An [E, ...] tensor over storage for E + 1 experts (a copy of `like` if given): expert_group_views' last
    groups reach past expert E - 1 into that room."""
    storage = torch.empty(shape[0] + 1, *shape[1:], dtype=dtype, device=device)
    experts = storage[:shape[0]]
    if like is not None:
        experts.copy_(like)
    return experts


def fp8_gmm_split_enabled() -> bool:
    return measurement_switch("MOE_FP8_GMM_SPLIT") != "0"


def expert_split(rows: int, weight: torch.Tensor, scale: torch.Tensor, max_m: int) -> int:
    """How many groups f per expert the FP8 gmm path hands torch._scaled_grouped_mm for `rows` rows of A (1: no
    split): where rows // E is above GMM_FP8_SMALL_TILE_M and at most max_m, the least power of two with
    rows // (E f) <= GMM_FP8_SMALL_TILE_M. weight [E, N, K] e4m3, scale [E, N, 1] fp32. A split needs room past the
    last expert for its empty groups' extents (with_spare_expert, which make_linear uses for the shapes
    splits_experts names), every group's pointer 16-byte aligned and at most CUTLASS_MAX_GROUPS groups."""
    num_experts, n, k = weight.shape
    if not GMM_FP8_SMALL_TILE_M < rows // num_experts <= max_m or not fp8_gmm_split_enabled():
        return 1
    split = 2
    while rows // (num_experts * split) > GMM_FP8_SMALL_TILE_M:
        split *= 2
    aligned = (n * k // split) % 16 == 0 and n % split == 0 and (n // split * 4) % 16 == 0
    contiguous = weight.is_contiguous() and scale.is_contiguous()
    room = (_room(weight, num_experts * n * k + (split - 1) * n * k // split)
            and _room(scale, num_experts * n + (split - 1) * n // split))
    fits = num_experts * split <= CUTLASS_MAX_GROUPS
    return split if aligned and contiguous and room and fits else 1


def _room(t: torch.Tensor, elements: int) -> bool:
    """t's storage holds `elements` elements from t's first one."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + elements) * t.element_size()


def expert_group_views(weight: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor,
                       split: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [E, N, K], scale [E, N, 1], offs [E] int32 -> [E f, N, K] and [E f, N] views and offs [E f]: group
    e f is expert e with its rows; groups e f + 1 .. e f + f - 1 are empty (their run ends where expert e's does)
    and point inside expert e's bytes (the last ones into the storage's spare room), never read."""
    num_experts, n, k = weight.shape
    if split == 1:
        return weight, scale.view(num_experts, n), offs
    views = torch.as_strided(weight, (num_experts * split, n, k), (n * k // split, k, 1), weight.storage_offset())
    scales = torch.as_strided(scale, (num_experts * split, n), (n // split, 1), scale.storage_offset())
    return views, scales, offs[:, None].expand(num_experts, split).reshape(-1)  # [E f, N, K], [E f, N], [E f]


def fp8_gmm_mode() -> str:
    """PAGODA_MOE_FP8_GMM, for A/B runs: 0 never, 1 at every batch size; unset or auto: from
    FP8_GMM_MIN_ROWS_PER_EXPERT."""
    return measurement_switch("MOE_FP8_GMM") or "auto"


@lru_cache(maxsize=16)
def scaled_grouped_mm_device(index: int | None) -> bool:
    """torch._scaled_grouped_mm runs CUTLASS's FP8 row-wise grouped GEMM on this CUDA device (sm90 only)."""
    return hasattr(torch, "_scaled_grouped_mm") and torch.cuda.get_device_capability(index) == (9, 0)


def per_row_scales(w: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """e4m3 expert weights [E, rows, K] with one scale per row ([E, rows, 1]): what the FP8 gmm path takes."""
    return (w.dtype == torch.float8_e4m3fn and scale is not None and scale.shape == (*w.shape[:2], 1)
            and scale.dtype == torch.float32 and scale.is_contiguous())


@lru_cache(maxsize=16)
def cutlass_grouped_mm_device(index: int | None) -> bool:
    """torch._grouped_mm runs CUTLASS on this CUDA device: sm90 or sm100, bf16. Elsewhere (or in fp16) torch falls
    back to a loop of GEMMs over offs copied to the host: a sync per call, no capture in a CUDA graph."""
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(index)[0] in (9, 10)


def moe_path(device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype, num_tokens: int, top_k: int,
             num_experts: int, hidden: int, inter: int, fp8_per_row: bool = False) -> str:
    """Which fused_experts path a call takes: "gmm" (torch._grouped_mm, CUTLASS) for large bf16 batches on a device
    that has it, and for FP8 experts with per-row scales (fp8_per_row) from FP8_GMM_MIN_ROWS_PER_EXPERT rows an expert
    where torch._scaled_grouped_mm has CUTLASS's FP8 kernel (PAGODA_MOE_FP8_GMM overrides); else "triton" (pagoda's
    grouped GEMM and GEMVs: block-scaled FP8, fp16, small batches, CPU)."""
    fp8 = weight_dtype == torch.float8_e4m3fn
    if device.type != "cuda" or dtype != torch.bfloat16 or weight_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return "triton"
    min_rows = GMM_MIN_ROWS_PER_EXPERT
    if fp8:
        mode = fp8_gmm_mode()
        if not fp8_per_row or mode == "0":
            return "triton"
        min_rows = 0 if mode == "1" else FP8_GMM_MIN_ROWS_PER_EXPERT
    if (num_tokens * top_k < min_rows * num_experts or num_experts > CUTLASS_MAX_GROUPS
            or hidden % (16 if fp8 else 8) or inter % (16 if fp8 else 8)):
        return "triton"  # strides of 16 bytes: TMA's rule
    if fp8:
        return "gmm" if scaled_grouped_mm_device(device.index) else "triton"
    return "gmm" if cutlass_grouped_mm_device(device.index) else "triton"


def expert_offsets(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> torch.Tensor:
    """topk_ids [T, k] -> offs [E] int32: where each expert's run of the block_m-padded layout ends (align_pairs'
    runs; offs[-1] = its num_padded): Alignment.run_ends from torch ops, their reference in tests."""
    flat = topk_ids.view(-1).long()  # [P]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # [E]
    return ((counts + block_m - 1) // block_m * block_m).cumsum(0).to(torch.int32)  # [E]


@triton.jit(do_not_specialize=["num_pairs"])
def _gather_sorted_kernel(x_ptr, sorted_pairs_ptr, num_padded_ptr, out_ptr, positions_ptr, x_scale_ptr, out_scale_ptr,
                          num_pairs, hidden, stride_xt, stride_or, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                          HAS_SCALE: tl.constexpr):
    """Row r of the expert-sorted layout: x[pair // k] for its pair, zeros for a padding row, nothing past
    num_padded (the grouped GEMM reads no row past offs[-1]). Column block 0 records positions[pair] = r and, with
    HAS_SCALE (x quantized per token row), out_scale[r] = x_scale[pair // k] (1 for a padding row)."""
    row = tl.program_id(0)
    if row >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_pairs_ptr + row)
    real = pair < num_pairs
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    token = (pair // TOP_K).to(tl.int64)
    vals = tl.load(x_ptr + token * stride_xt + cols, mask=mask & real, other=0)
    tl.store(out_ptr + row.to(tl.int64) * stride_or + cols, vals, mask=mask)
    if tl.program_id(1) == 0:
        tl.store(positions_ptr + pair, row, mask=real)
        if HAS_SCALE:
            tl.store(out_scale_ptr + row, tl.load(x_scale_ptr + token, mask=real, other=1.0))


def gather_sorted(x: torch.Tensor, align: Alignment, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (rows [max_padded, H]: x's row of each pair in align's expert-sorted order, padding rows zero,
    rows past num_padded unwritten; positions [T * k] int32: the row of each pair)."""
    num_tokens, hidden = x.shape
    num_pairs = num_tokens * top_k
    assert x.stride(1) == 1 and align.sorted_pairs.dtype == torch.int32
    max_padded = align.sorted_pairs.numel()
    rows = torch.empty(max_padded, hidden, dtype=x.dtype, device=x.device)  # [max_padded, H]
    positions = torch.empty(num_pairs, dtype=torch.int32, device=x.device)  # [T * k]
    _launch_gather(x, align, top_k, rows, positions, None)
    return rows, positions


def _launch_gather(x: torch.Tensor, align: Alignment, top_k: int, rows: torch.Tensor, positions: torch.Tensor,
                   scales: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """_gather_sorted_kernel over align's rows; scales: (x's per-token scales, the rows' scales to write)."""
    max_padded, hidden = rows.shape
    block = min(1024, triton.next_power_of_2(hidden))
    x_scale, row_scales = scales if scales is not None else (positions, positions)  # unused pointers without
    if max_padded:
        _gather_sorted_kernel[(max_padded, triton.cdiv(hidden, block))](
            x, align.sorted_pairs, align.num_padded, rows, positions, x_scale, row_scales, positions.numel(), hidden,
            x.stride(0), rows.stride(0), TOP_K=top_k, BLOCK_H=block, HAS_SCALE=scales is not None, num_warps=4)


def gather_sorted_fp8(x_q: torch.Tensor, x_scale: torch.Tensor, align: Alignment,
                      top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gather_sorted for e4m3 rows quantized per token: x_q [T, H] e4m3, x_scale [T, 1] fp32 -> (rows [max_padded, H]
    e4m3, row_scales [max_padded] fp32: each row's token scale, 1 for padding, unwritten past num_padded; positions
    [T * k] int32). One byte an element moved instead of two."""
    num_tokens, hidden = x_q.shape
    assert x_q.dtype == torch.float8_e4m3fn and x_q.stride(1) == 1
    assert x_scale.shape == (num_tokens, 1) and x_scale.dtype == torch.float32 and x_scale.is_contiguous()
    max_padded = align.sorted_pairs.numel()
    rows = torch.empty(max_padded, hidden, dtype=torch.uint8, device=x_q.device)  # [max_padded, H] e4m3 bits
    row_scales = torch.empty(max_padded, dtype=torch.float32, device=x_q.device)  # [max_padded]
    positions = torch.empty(num_tokens * top_k, dtype=torch.int32, device=x_q.device)  # [T * k]
    # moved as bytes (byte 0 is e4m3's +0 for the padding rows)
    _launch_gather(x_q.view(torch.uint8), align, top_k, rows, positions, (x_scale, row_scales))
    return rows.view(torch.float8_e4m3fn), row_scales, positions


@triton.jit
def _combine_kernel(o_ptr, positions_ptr, weights_ptr, out_ptr, hidden, stride_or, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum_j round(w[t, j] * o[position of pair (t, j)]): each product rounded to the model dtype as the
    Triton path's down GEMM stores it, the k of them summed in fp32 as its top-k sum does, rounded once."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(positions_ptr + token * TOP_K + j).to(tl.int64)
        weight = tl.load(weights_ptr + token * TOP_K + j)
        o = tl.load(o_ptr + row * stride_or + cols, mask=mask, other=0.0).to(tl.float32)
        acc += (o * weight).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, acc.to(dtype), mask=mask)


def combine_top_k(o: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """o [rows, H] (expert-sorted), positions [T * k] int32, weights [T * k] fp32 -> [T, H]: each token's weighted
    sum over its k rows, read through positions (one pass over o; no [T * k, H] buffer in pair order)."""
    num_pairs, hidden = positions.numel(), o.shape[1]
    assert num_pairs % top_k == 0 and weights.shape == (num_pairs,) and weights.dtype == torch.float32
    assert o.stride(1) == 1 and positions.dtype == torch.int32
    num_tokens = num_pairs // top_k
    out = torch.empty(num_tokens, hidden, dtype=o.dtype, device=o.device)  # [T, H]
    block = min(1024, triton.next_power_of_2(hidden))
    if num_tokens:
        _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
            o, positions, weights, out, hidden, o.stride(0), out.stride(0), TOP_K=top_k, BLOCK_H=block,
            num_warps=4)
    return out


def _fused_experts_gmm(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
    """The layer on torch._grouped_mm: pairs sorted by expert (align_pairs), their token rows gathered, the two
    GEMMs with offs = each expert's run end, SiLU-and-mul between them, the weighted top-k sum through the
    inverse of the sort. Every step stays on the device (the forward runs layer after layer without a sync)."""
    num_experts, top_k = w_gate_up.shape[0], topk_ids.shape[1]
    align = align_pairs(topk_ids, num_experts, GMM_BLOCK_M)
    offs = align.run_ends  # [E] int32
    rows, positions = gather_sorted(x, align, top_k)  # [max_padded, H], [T * k]
    gate_up = torch._grouped_mm(rows, w_gate_up.transpose(1, 2), offs=offs)  # [max_padded, 2I]
    act = silu_and_mul(gate_up)  # [max_padded, I]: the gate rounded to the model dtype before SiLU, as Triton's
    o = torch._grouped_mm(act, w_down.transpose(1, 2), offs=offs)  # [max_padded, H]
    return combine_top_k(o, positions, weights, top_k)  # [T, H]


def _fused_experts_gmm_fp8(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                           w_gate_up_scale: torch.Tensor, w_down_scale: torch.Tensor, weights: torch.Tensor,
                           topk_ids: torch.Tensor) -> torch.Tensor:
    """FP8 experts with per-row weight scales on torch._scaled_grouped_mm (CUTLASS's FP8 grouped GEMM with row-wise
    scales, Hopper): W8A8 with one scale per activation row. Each token row is quantized once (amax / 448) and
    gathered as bytes into the expert-sorted layout (runs padded to GMM_FP8_BLOCK_M rows); the gate_up GEMM's bf16
    output is quantized again per row by the SiLU-and-mul kernel; the weighted top-k sum as on the bf16 gmm path.
    Semantics: reference.moe_experts_w8a8_rows. Both GEMMs see each expert as `split` groups (expert_split) where that
    keeps torch's small tiles and was measured to win for this shape (GMM_FP8_SPLIT_MAX_M)."""
    num_experts = w_gate_up.shape[0]
    top_k = topk_ids.shape[1]
    align = align_pairs(topk_ids, num_experts, GMM_FP8_BLOCK_M)
    offs = align.run_ends  # [E] int32
    x_q, x_scale = quantize_fp8_rows(x)  # [T, H] e4m3, [T, 1]
    rows, row_scales, positions = gather_sorted_fp8(x_q, x_scale, align, top_k)  # [max_padded, H], [max_padded]
    accum = fast_accum()
    max_m = GMM_FP8_SPLIT_MAX_M.get((num_experts, w_down.shape[2], w_down.shape[1]), GMM_FP8_SMALL_TILE_M)
    split = expert_split(rows.shape[0], w_gate_up, w_gate_up_scale, max_m)
    if split != expert_split(rows.shape[0], w_down, w_down_scale, max_m):  # both or neither: they share offs_split
        split = 1
    w_up, s_up, offs_split = expert_group_views(w_gate_up, w_gate_up_scale, offs, split)  # [E f, 2I, H], [E f, 2I]
    gate_up = torch._scaled_grouped_mm(rows, w_up.transpose(1, 2), row_scales, s_up, offs=offs_split,
                                       out_dtype=x.dtype, use_fast_accum=accum)  # [max_padded, 2I]
    act, act_scale = silu_and_mul_quant_fp8(gate_up)  # [max_padded, I] e4m3, [max_padded, 1]
    w_d, s_d, _ = expert_group_views(w_down, w_down_scale, offs, split)  # [E f, H, I], [E f, H]
    o = torch._scaled_grouped_mm(act, w_d.transpose(1, 2), act_scale.view(-1), s_d, offs=offs_split,
                                 out_dtype=x.dtype, use_fast_accum=accum)  # [max_padded, H]
    return combine_top_k(o, positions, weights, top_k)  # [T, H]


# ---------------------------------------------------------------- the layer


def fused_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w_gate_up_scale: torch.Tensor | None = None,
                  w_down_scale: torch.Tensor | None = None, group_k: int | None = None,
                  tiles: Tiles | None = None, path: str | None = None,
                  defer_sum: bool = False) -> torch.Tensor | DeferredSum:
    """sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, j].

    x [T, H]; w_gate_up [E, 2I, H] (gate rows then up rows); w_down [E, H, I]; topk_weights [T, k] fp32;
    topk_ids [T, k] int32. FP8 weights: e4m3 with scales [E, rows, K / group_k] (group_k = K: per row).
    path: "triton" (pagoda's grouped GEMM or GEMVs, with `tiles`), "gmm" (torch._grouped_mm; FP8 experts with
    per-row scales: torch._scaled_grouped_mm, W8A8 with per-row activation scales), None: moe_path's
    choice, or "triton" when tiles are given. Returns [T, H] in x's dtype; with defer_sum, on the grouped-GEMM path
    (the one with a top-k sum of its own), the k weighted rows of each token as DeferredSum [k, T, H] for the
    next residual add + norm to sum."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    _check_experts(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale, w_down_scale, group_k)
    fp8_per_row = per_row_scales(w_gate_up, w_gate_up_scale) and per_row_scales(w_down, w_down_scale)
    if path is None:
        path = "triton" if tiles is not None else moe_path(x.device, x.dtype, w_gate_up.dtype, num_tokens, top_k,
                                                             num_experts, hidden, inter, fp8_per_row)
    _check_path(path, w_gate_up.dtype, fp8_per_row)
    if path == "gmm" and w_gate_up.dtype == torch.float8_e4m3fn:
        assert w_gate_up_scale is not None and w_down_scale is not None
        return _fused_experts_gmm_fp8(x, w_gate_up, w_down, w_gate_up_scale, w_down_scale,
                                      topk_weights.contiguous().view(-1), topk_ids.contiguous())
    if path == "gmm":
        return _fused_experts_gmm(x, w_gate_up, w_down, topk_weights.contiguous().view(-1), topk_ids.contiguous())
    if tiles is None:
        tiles = pick_tiles(num_tokens, top_k, num_experts, inter, hidden, x.dtype, x.device, w_gate_up.dtype)
    num_pairs = num_tokens * top_k
    topk_ids = topk_ids.contiguous()
    weights = topk_weights.contiguous().view(-1)  # [T * k]
    if isinstance(tiles[0], GemvConfig):
        return _fused_experts_gemv(x, w_gate_up, w_down, weights, topk_ids, w_gate_up_scale, w_down_scale,
                                   group_k, tiles)
    up_tile, down_tile = tiles
    fp8_block_k = group_k if w_gate_up.dtype == torch.float8_e4m3fn else None
    if fp8_block_k is not None:  # a K-tile must stay inside one scale group
        up_tile = _fit_block_k(up_tile, fp8_block_k, hidden)
        down_tile = _fit_block_k(down_tile, fp8_block_k, inter)
    align_up = align_pairs(topk_ids, num_experts, up_tile.block_m)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [T * k, I]
    is_fp8 = w_gate_up.dtype == torch.float8_e4m3fn
    _moe_gemm(x, w_gate_up, w_gate_up_scale, _group(group_k, hidden), align_up, act, num_pairs, top_k, True, None,
              up_tile, is_fp8 and moe_act_fp8(num_pairs, num_experts, up_tile))
    align_down = align_up if down_tile.block_m == up_tile.block_m else align_pairs(topk_ids, num_experts,
                                                                                    down_tile.block_m)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)  # [T * k, H]
    _moe_gemm(act, w_down, w_down_scale, _group(group_k, inter), align_down, out, num_pairs, 1, False, weights,
              down_tile, is_fp8 and moe_act_fp8(num_pairs, num_experts, down_tile))
    if defer_sum:
        return DeferredSum(out.view(num_tokens, top_k, hidden).transpose(0, 1), x.dtype)  # [k, T, H] view
    return out.view(num_tokens, top_k, hidden).sum(dim=1)  # [T, H]


def _check_path(path: str, weight_dtype: torch.dtype, fp8_per_row: bool) -> None:
    if path not in MOE_PATHS:
        raise ValueError(f"MoE path must be one of {MOE_PATHS}, got {path!r}")
    if path != "gmm":
        return
    if weight_dtype == torch.float8_e4m3fn:
        if not fp8_per_row:
            raise ValueError("the gmm MoE path takes FP8 experts with one fp32 scale per weight row ([E, rows, 1]); "
                             "block-scaled FP8 experts run on the triton path")
        if not hasattr(torch, "_scaled_grouped_mm"):
            raise ValueError(f"the gmm MoE path for FP8 experts needs torch._scaled_grouped_mm (torch "
                             f"{torch.__version__} has none)")
    elif not hasattr(torch, "_grouped_mm"):
        raise ValueError(f"the gmm MoE path needs torch._grouped_mm (torch {torch.__version__} has none)")


def _fused_experts_gemv(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                        topk_ids: torch.Tensor, w_gate_up_scale: torch.Tensor | None,
                        w_down_scale: torch.Tensor | None, group_k: int | None,
                        tiles: tuple[GemvConfig, GemvConfig]) -> torch.Tensor:
    """Few pairs: one GEMV per (pair, column block), no alignment."""
    (num_tokens, hidden), top_k = x.shape, topk_ids.shape[1]
    inter = w_down.shape[2]
    num_pairs = num_tokens * top_k
    up_tile, down_tile = tiles
    if w_gate_up.dtype == torch.float8_e4m3fn and group_k is not None:
        up_tile = _fit_gemv_block_k(up_tile, group_k, hidden)
        down_tile = _fit_gemv_block_k(down_tile, group_k, inter)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [T * k, I]
    _moe_gemv(x, w_gate_up, w_gate_up_scale, _group(group_k, hidden), topk_ids, act, top_k, True, None, up_tile)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)  # [T, H]: the top-k sum in the kernel
    _moe_gemv(act, w_down, w_down_scale, _group(group_k, inter), topk_ids, out, 1, False, weights, down_tile)
    return out


def _fit_gemv_block_k(tile: GemvConfig, group_k: int, k: int) -> GemvConfig:
    if group_k >= k:
        return tile
    block_k = min(tile.block_k, group_k)
    assert group_k % block_k == 0, f"FP8 scale group {group_k} is not a multiple of {block_k}"
    return replace(tile, block_k=block_k)


def _group(group_k: int | None, k: int) -> int:
    return k if group_k is None else group_k


def _fit_block_k(tile: TileConfig, group_k: int, k: int) -> TileConfig:
    if group_k >= k:
        return tile
    group = group_k
    block_k = tile.block_k
    while group % block_k and block_k > 16:
        block_k //= 2
    assert group % block_k == 0, f"FP8 scale group {group} is not a multiple of 16"
    return replace(tile, block_k=block_k)


def _check_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, w_gate_up_scale: torch.Tensor | None, w_down_scale: torch.Tensor | None,
                   group_k: int | None) -> None:
    num_experts, two_i, hidden = w_gate_up.shape
    assert x.dim() == 2 and x.shape[1] == hidden, (x.shape, w_gate_up.shape)
    assert w_down.shape == (num_experts, hidden, two_i // 2), (w_down.shape, w_gate_up.shape)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0]
    assert topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32
    assert x.stride(1) == 1 and w_gate_up.stride(2) == 1 and w_down.stride(2) == 1
    if w_gate_up.dtype == torch.float8_e4m3fn:
        assert w_down.dtype == torch.float8_e4m3fn and w_gate_up_scale is not None and w_down_scale is not None
        group_up, group_down = _group(group_k, hidden), _group(group_k, two_i // 2)
        assert w_gate_up_scale.shape == (num_experts, two_i, -(-hidden // group_up)), w_gate_up_scale.shape
        assert w_down_scale.shape == (num_experts, hidden, -(-(two_i // 2) // group_down)), w_down_scale.shape
    else:
        assert w_gate_up.dtype == w_down.dtype == x.dtype, (x.dtype, w_gate_up.dtype, w_down.dtype)
