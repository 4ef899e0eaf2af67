"""Triton sampling kernels: the fused logits pass, the grammar bitmask, the top-p threshold and Gumbel-max.

Each reads the [B, V] logits once (the top-p search reads a row a few times from L2 when no top-k
bounds it) and none materialises a [B, V] noise tensor. References: kernels/reference.py
(process_logits, apply_token_bitmask, truncation_thresholds, gumbel_argmax).

Grammar bitmask layout (xgrammar / llguidance): `bitmask [B, ceil(V / 32)] int32`; bit j of word w set
means token 32 * w + j is allowed; `rows [B] bool` says which rows have a mask (None: every row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# kernels may only read constexpr globals; the values are reference.GOLDEN32 / ROW_KEY_SALT / UNIFORM_SCALE
GOLDEN32: tl.constexpr = tl.constexpr(0x9E3779B9)
ROW_KEY_SALT: tl.constexpr = tl.constexpr(0x5BD1E995)
UNIFORM_SCALE: tl.constexpr = tl.constexpr(2.0**-24)
NEG_INF_KEY: tl.constexpr = tl.constexpr(-2139095041)  # _float_key(-inf): keys below it are NaN bit patterns
PROCESS_BLOCK = 2048
ARGMAX_BLOCK = 1024
ARGMAX_SPLIT = 8192  # vocab ids per program of the Gumbel argmax: B * V / 8192 programs fill the GPU
TOP_P_BLOCK = 1024
TOP_P_PIVOT_BLOCK = 256  # ids per step of the whole-row pivot passes: [256, 16] running sums stay in registers
TOP_P_PIVOTS = 16  # thresholds tried per pass of the top-p search: 32 key bits in 8 passes
NUCLEUS_ROUNDS = 4  # rejection rounds of the top-p draw before the exact per-row fallback (see gumbel_argmax)
TOP_K_GROUP = 64  # ids per group: the row's k largest values lie in the k groups with the largest maxima
TOP_K_MAX = 256  # beyond this (or for short rows), torch.topk over the whole row


# ---------------------------------------------------------------------------------------------
# helpers


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (wraps mod 2^32): reference.mix32_."""
    x ^= x >> 16
    x *= tl.full((), 0x7FEB352D, tl.uint32)
    x ^= x >> 15
    x *= tl.full((), 0x846CA68B, tl.uint32)
    x ^= x >> 16
    return x


@triton.jit
def _row_key(seed, offset):
    """reference.row_keys for one row: seed and offset int64 scalars -> uint32."""
    key = _mix32((offset >> 32).to(tl.uint32) ^ tl.full((), ROW_KEY_SALT, tl.uint32))
    key = _mix32(key ^ (offset & 0xFFFFFFFF).to(tl.uint32))
    key = _mix32(key ^ (seed >> 32).to(tl.uint32))
    return _mix32(key ^ (seed & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _float_key(x):
    """fp32 -> int32 whose signed order is the float order (-0.0 and +0.0 share a key)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _key_float(key):
    """Inverse of _float_key for an int32 key."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] contiguous along V, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits dtype {logits.dtype} is not a float type")


def _check_rows(name: str, t: torch.Tensor | None, num_rows: int, dtype: torch.dtype, device: torch.device) -> None:
    if t is None:
        return
    if t.shape != (num_rows,) or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be [{num_rows}] {dtype} contiguous on {device}, got {tuple(t.shape)} "
                         f"{t.dtype} on {t.device}")


def _check_bitmask(bitmask: torch.Tensor, num_rows: int, vocab_size: int, device: torch.device) -> None:
    words = -(-vocab_size // 32)
    if (bitmask.dim() != 2 or bitmask.shape[0] != num_rows or bitmask.shape[1] < words
            or bitmask.dtype != torch.int32 or bitmask.device != device or bitmask.stride(1) != 1):
        raise ValueError(f"bitmask must be [{num_rows}, >= {words}] int32 on {device}, got "
                         f"{tuple(bitmask.shape)} {bitmask.dtype} on {bitmask.device}")


# ---------------------------------------------------------------------------------------------
# grammar bitmask, in place


@triton.jit(do_not_specialize=["vocab_size"])
def _bitmask_kernel(logits_ptr, stride_l, vocab_size, bitmask_ptr, stride_m, rows_ptr,
                    HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    apply = True
    if HAS_ROWS:
        apply = tl.load(rows_ptr + b) != 0
    if apply:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
        in_vocab = cols < vocab_size
        words = tl.load(bitmask_ptr + b * stride_m + cols // 32, mask=in_vocab, other=-1)  # [BLOCK] int32
        disallowed = ((words >> (cols % 32)) & 1) == 0
        tl.store(logits_ptr + b * stride_l + cols, float("-inf"), mask=in_vocab & disallowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """In place: -inf where the row's bitmask [B, ceil(V/32)] int32 clears a token's bit, for rows [B] bool
    (None: all). Returns logits [B, V]."""
    _check_logits(logits)
    num_rows, vocab_size = logits.shape
    _check_bitmask(bitmask, num_rows, vocab_size, logits.device)
    _check_rows("rows", rows, num_rows, torch.bool, logits.device)
    if num_rows == 0:
        return logits
    grid = (num_rows, triton.cdiv(vocab_size, PROCESS_BLOCK))
    _bitmask_kernel[grid](logits, logits.stride(0), vocab_size, bitmask, bitmask.stride(0),
                          rows if rows is not None else bitmask, HAS_ROWS=rows is not None, BLOCK=PROCESS_BLOCK)
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """reference.apply_token_bitmask: a new tensor like logits [B, V] with disallowed tokens at -inf."""
    return apply_token_bitmask_(logits.clone(), bitmask, rows)


# ---------------------------------------------------------------------------------------------
# the fused pass: penalties (gated per row) then the bitmask, raw logits in, fp32 out


@triton.jit(do_not_specialize=["vocab_size", "num_groups"])
def _process_kernel(logits_ptr, stride_l, out_ptr, vocab_size, state_rows_ptr, counts_ptr, stride_c,
                    prompt_ptr, stride_p, presence_ptr, frequency_ptr, repetition_ptr,
                    bitmask_ptr, stride_m, bitmask_rows_ptr, group_max_ptr, group_ties_ptr, num_groups,
                    PENALTIES: tl.constexpr, HAS_PROMPT: tl.constexpr, HAS_BITMASK: tl.constexpr,
                    WRITE_OUT: tl.constexpr, GROUP_STATS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Few constants on purpose: which penalties and which rows apply is read per row, so a handful of variants
    covers every batch (the worker compiles them at start-up; a compile while serving stalls a step)."""
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    in_vocab = cols < vocab_size
    x = tl.load(logits_ptr + b * stride_l + cols, mask=in_vocab, other=0.0).to(tl.float32)  # [BLOCK]
    if PENALTIES:
        presence = tl.load(presence_ptr + b)
        frequency = tl.load(frequency_ptr + b)
        repetition = tl.load(repetition_ptr + b)
        if (presence != 0.0) | (frequency != 0.0) | (repetition != 1.0):  # rows without penalties read nothing
            row = tl.load(state_rows_ptr + b)
            counts = tl.load(counts_ptr + row * stride_c + cols, mask=in_vocab, other=0).to(tl.float32)
            seen = counts > 0.0
            if repetition != 1.0:
                rep_seen = seen
                if HAS_PROMPT:
                    rep_seen = rep_seen | (tl.load(prompt_ptr + row * stride_p + cols, mask=in_vocab, other=0) != 0)
                x = tl.where(rep_seen, tl.where(x > 0, x / repetition, x * repetition), x)
            x = x - frequency * counts
            x = x - presence * seen.to(tl.float32)
    if HAS_BITMASK:
        if tl.load(bitmask_rows_ptr + b) != 0:
            words = tl.load(bitmask_ptr + b * stride_m + cols // 32, mask=in_vocab, other=-1)
            x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
    if WRITE_OUT:
        tl.store(out_ptr + b * vocab_size + cols, x, mask=in_vocab)
    if GROUP_STATS:  # per group of GROUP ids: the largest value and how many ids hold it
        grouped = tl.reshape(tl.where(in_vocab, x, float("-inf")), [BLOCK // GROUP, GROUP])  # [N, GROUP]
        largest = tl.max(grouped, axis=1)  # [N]
        valid = tl.reshape(in_vocab, [BLOCK // GROUP, GROUP])
        ties = tl.sum(((grouped == largest[:, None]) & valid).to(tl.int32), axis=1)  # [N]
        groups = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)  # [N]
        tl.store(group_max_ptr + b * num_groups + groups, largest, mask=groups < num_groups)
        tl.store(group_ties_ptr + b * num_groups + groups, ties, mask=groups < num_groups)


@dataclass(slots=True)
class GroupedLogits:
    """The sampler's view of one step's logits after the fused pass."""

    logits: torch.Tensor  # [B, V]: the processed fp32 logits, or the input itself when the pass changed nothing
    group_max: torch.Tensor | None  # [B, G] fp32: the largest logit of each group of TOP_K_GROUP ids
    group_ties: torch.Tensor | None  # [B, G] int32: how many ids of the group hold that largest logit


def _check_penalty_tables(num_rows: int, vocab_size: int, device: torch.device, state_rows: torch.Tensor | None,
                          output_counts: torch.Tensor | None, prompt_mask: torch.Tensor | None) -> None:
    if output_counts is None or state_rows is None:
        raise ValueError("penalties need output_counts and state_rows")
    if (output_counts.dim() != 2 or output_counts.shape[1] != vocab_size or output_counts.stride(1) != 1
            or output_counts.dtype not in (torch.int32, torch.float32) or output_counts.device != device):
        raise ValueError(f"output_counts must be [R, {vocab_size}] int32/fp32 on {device}, got "
                         f"{tuple(output_counts.shape)} {output_counts.dtype}")
    _check_rows("state_rows", state_rows, num_rows, torch.int64, device)
    if prompt_mask is not None and (prompt_mask.shape != output_counts.shape or prompt_mask.dtype != torch.bool
                                    or prompt_mask.stride(1) != 1 or prompt_mask.device != device):
        raise ValueError(f"prompt_mask must be {tuple(output_counts.shape)} bool, got {tuple(prompt_mask.shape)} "
                         f"{prompt_mask.dtype}")


def process_logits_grouped(logits: torch.Tensor, state_rows: torch.Tensor | None = None,
                           output_counts: torch.Tensor | None = None, prompt_mask: torch.Tensor | None = None,
                           presence: torch.Tensor | None = None, frequency: torch.Tensor | None = None,
                           repetition: torch.Tensor | None = None, bitmask: torch.Tensor | None = None,
                           bitmask_rows: torch.Tensor | None = None, *, write_out: bool = True,
                           group_stats: bool = False) -> GroupedLogits:
    """One read of logits [B, V] (any float dtype): penalties and the bitmask as reference.process_logits, with
    the per-row tables left in place (output_counts [R, V] int32/fp32 and prompt_mask [R, V] bool, read at row
    state_rows[b] for batch row b). write_out: write the processed fp32 logits (else `logits` comes back, which
    needs that nothing applies). group_stats: also each group's maximum and its tie count (TOP_K_GROUP ids a
    group), which top-k, top-p and the Gumbel draw use instead of rereading the whole row."""
    _check_logits(logits)
    num_rows, vocab_size = logits.shape
    device = logits.device
    penalised = presence is not None or frequency is not None or repetition is not None
    if penalised:
        _check_penalty_tables(num_rows, vocab_size, device, state_rows, output_counts, prompt_mask)
    for name, t in (("presence", presence), ("frequency", frequency), ("repetition", repetition)):
        _check_rows(name, t, num_rows, torch.float32, device)
    if bitmask is not None:
        _check_bitmask(bitmask, num_rows, vocab_size, device)
        _check_rows("bitmask_rows", bitmask_rows, num_rows, torch.bool, device)
    if not write_out and (penalised or bitmask is not None):
        raise ValueError("penalties and a bitmask need write_out")
    block, group = PROCESS_BLOCK, TOP_K_GROUP
    assert block % group == 0, "a program's block holds whole groups"
    out = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=device) if write_out else logits
    num_groups = triton.cdiv(vocab_size, group)
    group_max = group_ties = None
    if group_stats:
        group_max = torch.empty((num_rows, num_groups), dtype=torch.float32, device=device)  # [B, G]
        group_ties = torch.empty((num_rows, num_groups), dtype=torch.int32, device=device)  # [B, G]
    if num_rows == 0 or not (write_out or group_stats):
        return GroupedLogits(out, group_max, group_ties)
    dummy = out
    counts = output_counts if penalised and output_counts is not None else dummy
    has_prompt = penalised and prompt_mask is not None and repetition is not None
    prompt = prompt_mask.view(torch.uint8) if has_prompt and prompt_mask is not None else dummy
    if penalised:  # the kernel reads all three per row: the missing ones are neutral
        presence = presence if presence is not None else torch.zeros(num_rows, device=device)
        frequency = frequency if frequency is not None else torch.zeros(num_rows, device=device)
        repetition = repetition if repetition is not None else torch.ones(num_rows, device=device)
    if bitmask is not None and bitmask_rows is None:
        bitmask_rows = torch.ones(num_rows, dtype=torch.bool, device=device)  # [B] every row
    grid = (num_rows, triton.cdiv(vocab_size, block))
    _process_kernel[grid](
        logits, logits.stride(0), out, vocab_size, state_rows if state_rows is not None else dummy,
        counts, counts.stride(0), prompt, prompt.stride(0),
        presence if presence is not None else dummy, frequency if frequency is not None else dummy,
        repetition if repetition is not None else dummy,
        bitmask if bitmask is not None else dummy, bitmask.stride(0) if bitmask is not None else 0,
        bitmask_rows if bitmask_rows is not None else dummy,
        group_max if group_max is not None else dummy, group_ties if group_ties is not None else dummy, num_groups,
        PENALTIES=penalised, HAS_PROMPT=has_prompt, HAS_BITMASK=bitmask is not None, WRITE_OUT=write_out,
        GROUP_STATS=group_stats, GROUP=group, BLOCK=block)
    return GroupedLogits(out, group_max, group_ties)


def process_logits(logits: torch.Tensor, state_rows: torch.Tensor | None, output_counts: torch.Tensor | None,
                   prompt_mask: torch.Tensor | None, presence: torch.Tensor | None, frequency: torch.Tensor | None,
                   repetition: torch.Tensor | None, bitmask: torch.Tensor | None = None,
                   bitmask_rows: torch.Tensor | None = None) -> torch.Tensor:
    """reference.process_logits with the per-row tables left in place: output_counts [R, V] (int32 or fp32)
    and prompt_mask [R, V] bool are read at row state_rows[b] for batch row b. Returns new fp32 [B, V]."""
    return process_logits_grouped(logits, state_rows, output_counts, prompt_mask, presence, frequency, repetition,
                                  bitmask, bitmask_rows).logits


# ---------------------------------------------------------------------------------------------
# top-p threshold: the largest logit t whose {logit >= t} holds >= top_p of the mass, searched over
# the 32-bit float keys with NUM_PIVOTS thresholds per pass; over the top-k candidates when a row has them


@triton.jit
def _mass_at(src_ptr, num, pivots, row_max, temperature, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr,
             COUNT: tl.constexpr = False):
    """[NUM_PIVOTS] sum of exp((x - row_max) / T) (COUNT: of 1) over the x in src[:num] whose key >= each pivot.
    Sums per lane and reduces across lanes once at the end. Compares floats: a key's order is its float's (the
    two zeros share key 0, and -0.0 >= +0.0 holds), and one fp32 compare beats a key conversion and an int64
    compare per (id, pivot) pair, which made the whole-row passes compute-bound (H200: 0.44 ms a pass)."""
    pivot_values = _key_float(pivots.to(tl.int32))  # [NUM_PIVOTS] fp32
    mass = tl.zeros([BLOCK, NUM_PIVOTS], dtype=tl.float32)
    for start in range(0, num, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(src_ptr + cols, mask=cols < num, other=float("-inf")).to(tl.float32)  # [BLOCK]
        if COUNT:
            weight = tl.where(cols < num, 1.0, 0.0)  # [BLOCK]
        else:
            weight = tl.exp((x - row_max) / temperature)  # [BLOCK]; -inf -> 0
        hit = x[:, None] >= pivot_values[None, :]  # [BLOCK, NUM_PIVOTS]
        mass += tl.where(hit, weight[:, None], 0.0)
    return tl.sum(mass, axis=0)


@triton.jit
def _search(src_ptr, num, lo, hi, target, row_max, temperature, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr,
            COUNT: tl.constexpr = False):
    """Largest key in [lo, hi] with mass (COUNT: the number of ids) >= target, given mass(lo) >= target."""
    offsets = tl.arange(0, NUM_PIVOTS).to(tl.int64) + 1  # [NUM_PIVOTS]
    while lo < hi:
        step = (hi - lo + NUM_PIVOTS) // (NUM_PIVOTS + 1)
        pivots = tl.minimum(lo + offsets * step, hi)  # [NUM_PIVOTS] increasing
        ok = _mass_at(src_ptr, num, pivots, row_max, temperature, BLOCK, NUM_PIVOTS, COUNT) >= target
        lo = tl.maximum(lo, tl.max(tl.where(ok, pivots, lo), axis=0))
        hi = tl.minimum(hi, tl.min(tl.where(ok, hi, pivots - 1), axis=0))
    return lo


@triton.jit(do_not_specialize=["vocab_size", "num_cand"])
def _top_p_row_kernel(logits_ptr, stride_l, vocab_size, cand_ptr, stride_c, num_cand, use_cand_ptr,
                      temperature_ptr, top_p_ptr, lower_ptr, threshold_ptr, HAS_CAND: tl.constexpr,
                      FULL_ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """One program per row: one pass over the row for its max and the mass above `lower`, then the search over
    the row's K top-k candidates (every token above the k-th logit is one of them, so the masses above it are
    exact) or, for a row without them and FULL_ROWS, over the whole row. Other rows get `lower` back. Off the
    sampler's hot path: rows without top-k draw by rejection (_nucleus_*_kernel) and never need the threshold."""
    b = tl.program_id(0).to(tl.int64)
    lower = tl.load(lower_ptr + b)
    top_p = tl.load(top_p_ptr + b)
    threshold = lower
    use_cand = False
    if HAS_CAND:
        use_cand = tl.load(use_cand_ptr + b) != 0
    if (top_p < 1.0) & (use_cand | FULL_ROWS):
        temperature = tl.load(temperature_ptr + b)
        temperature = tl.where(temperature == 0.0, 1.0, temperature)
        row = logits_ptr + b * stride_l
        lane_max = tl.full([BLOCK], -1.0e30, tl.float32)
        lane_sum = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, vocab_size, BLOCK):  # online max and sum per lane
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
            x = tl.where(x >= lower, x, float("-inf"))
            new_max = tl.maximum(lane_max, x)
            lane_sum = lane_sum * tl.exp((lane_max - new_max) / temperature) + tl.exp((x - new_max) / temperature)
            lane_max = new_max
        row_max = tl.max(lane_max, axis=0)
        total = tl.sum(lane_sum * tl.exp((lane_max - row_max) / temperature), axis=0)
        lo, hi = _float_key(lower).to(tl.int64), _float_key(row_max).to(tl.int64)
        if use_cand:
            key = _search(cand_ptr + b * stride_c, num_cand, lo, hi, top_p * total, row_max, temperature, BLOCK,
                          NUM_PIVOTS)
        else:
            key = _search(row, vocab_size, lo, hi, top_p * total, row_max, temperature, BLOCK, NUM_PIVOTS)
        threshold = _key_float(key.to(tl.int32))
    tl.store(threshold_ptr + b, threshold)


@triton.jit(do_not_specialize=["num_gathered", "num_groups", "num_chosen"])
def _group_thresholds_kernel(gathered_ptr, num_gathered, group_max_ptr, group_ties_ptr, num_groups, chosen_ptr,
                             num_chosen, top_k_ptr, top_p_ptr, min_p_ptr, temperature_ptr, threshold_ptr,
                             whole_row_ptr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
                             BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """One program per row, from the chosen groups' logits gathered[b, :num_gathered]. m_K, the smallest chosen
    group maximum, bounds the k-th largest from below, and no id outside the chosen groups is above m_K. So: the
    k-th largest by a count search over [m_K, row max], min-p, then the top-p threshold by a mass search over the
    ids both keep, with the ids at the k-th largest outside the chosen groups added where min-p keeps them (there
    are some only when it equals m_K). whole_row[b]: the row needs its whole row for the draw (no top-k, or ids
    outside the chosen groups reach the threshold); a row without top-k gets min-p's threshold (or -inf): its
    top-p needs the caller's whole-row search."""
    b = tl.program_id(0).to(tl.int64)
    row = gathered_ptr + b * num_gathered
    temperature = tl.load(temperature_ptr + b)
    temperature = tl.where(temperature == 0.0, 1.0, temperature)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, num_gathered, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        lane_max = tl.maximum(lane_max, tl.load(row + cols, mask=cols < num_gathered, other=float("-inf")))
    row_max = tl.max(lane_max, axis=0)
    lane_min = tl.full([BLOCK], float("inf"), tl.float32)
    for start in range(0, num_chosen, BLOCK):
        slots = start + tl.arange(0, BLOCK)
        group = tl.load(chosen_ptr + b * num_chosen + slots, mask=slots < num_chosen, other=0)
        maxima = tl.load(group_max_ptr + b * num_groups + group, mask=slots < num_chosen, other=float("inf"))
        lane_min = tl.minimum(lane_min, maxima)
    smallest_chosen = tl.min(lane_min, axis=0)  # m_K
    top_k = tl.load(top_k_ptr + b)
    threshold = tl.full((), float("-inf"), tl.float32)
    whole_row = top_k <= 0
    if top_k > 0:  # at least k gathered ids are >= m_K (the chosen maxima): the count search's start
        kth_key = _search(row, num_gathered, _float_key(smallest_chosen).to(tl.int64),
                          _float_key(row_max).to(tl.int64), tl.minimum(top_k, num_chosen).to(tl.float32), row_max,
                          temperature, BLOCK, NUM_PIVOTS, COUNT=True)
        kth = _key_float(kth_key.to(tl.int32))
        threshold = kth
        outside = tl.zeros([BLOCK], dtype=tl.int32)  # ids at kth outside the chosen groups: in any group ...
        if kth == smallest_chosen:
            for start in range(0, num_groups, BLOCK):
                groups = start + tl.arange(0, BLOCK)
                maxima = tl.load(group_max_ptr + b * num_groups + groups, mask=groups < num_groups,
                                 other=float("-inf"))
                count = tl.load(group_ties_ptr + b * num_groups + groups, mask=groups < num_groups, other=0)
                outside += tl.where(maxima == kth, count, 0)
            for start in range(0, num_chosen, BLOCK):  # ... less those in the chosen (gathered) groups
                slots = start + tl.arange(0, BLOCK)
                group = tl.load(chosen_ptr + b * num_chosen + slots, mask=slots < num_chosen, other=0)
                maxima = tl.load(group_max_ptr + b * num_groups + group, mask=slots < num_chosen,
                                 other=float("-inf"))
                count = tl.load(group_ties_ptr + b * num_groups + group, mask=slots < num_chosen, other=0)
                outside -= tl.where(maxima == kth, count, 0)
        num_outside = tl.sum(outside, axis=0)
        lower_key = kth_key  # top-p runs over the ids top-k and min-p keep (vLLM V1's order)
        if HAS_MIN_P:
            min_p_threshold = row_max + temperature * tl.log(tl.load(min_p_ptr + b))
            if min_p_threshold > kth:  # every id at or above it lies in the gathered groups (it is > m_K)
                threshold = min_p_threshold
                lower_key = _float_key(min_p_threshold).to(tl.int64)
                num_outside = num_outside * 0
        if HAS_TOP_P:
            top_p = tl.load(top_p_ptr + b)
            if top_p < 1.0:
                lane_sum = tl.zeros([BLOCK], dtype=tl.float32)
                for start in range(0, num_gathered, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    x = tl.load(row + cols, mask=cols < num_gathered, other=float("-inf"))
                    lane_sum += tl.where(x >= threshold, tl.exp((x - row_max) / temperature), 0.0)
                total = tl.sum(lane_sum, axis=0) + num_outside.to(tl.float32) * tl.exp((kth - row_max) / temperature)
                key = _search(row, num_gathered, lower_key, _float_key(row_max).to(tl.int64), top_p * total,
                              row_max, temperature, BLOCK, NUM_PIVOTS)
                threshold = tl.maximum(threshold, _key_float(key.to(tl.int32)))
        whole_row = (threshold == kth) & (num_outside > 0)
    elif HAS_MIN_P:
        threshold = row_max + temperature * tl.log(tl.load(min_p_ptr + b))
    tl.store(threshold_ptr + b, threshold)
    tl.store(whole_row_ptr + b, whole_row.to(tl.int8))


@triton.jit(do_not_specialize=["num_gathered", "num_chosen"])
def _gathered_gumbel_kernel(gathered_ptr, num_gathered, chosen_ptr, num_chosen, temperature_ptr, threshold_ptr,
                            seeds_ptr, offsets_ptr, token_ptr, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """The Gumbel draw of one row over its gathered groups (every id reaching its threshold is there, the caller
    checked): the noise of each id as in _gumbel_argmax_kernel, ties to the smallest id as torch.argmax."""
    b = tl.program_id(0).to(tl.int64)
    row = gathered_ptr + b * num_gathered
    temperature = tl.load(temperature_ptr + b)
    temperature = tl.where(temperature == 0.0, 1.0, temperature)
    threshold = tl.load(threshold_ptr + b)
    key = _row_key(tl.load(seeds_ptr + b), tl.load(offsets_ptr + b))
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, num_gathered, BLOCK):
        slots = start + tl.arange(0, BLOCK)
        valid = slots < num_gathered
        x = tl.load(row + slots, mask=valid, other=float("-inf"))
        group = tl.load(chosen_ptr + b * num_chosen + slots // GROUP, mask=valid, other=0)
        ids = (group * GROUP + slots % GROUP).to(tl.int32)  # [BLOCK] vocabulary ids
        bits = _mix32(key ^ (ids.to(tl.uint32) * tl.full((), GOLDEN32, tl.uint32)))
        u = ((bits >> 8) | 1).to(tl.float32) * UNIFORM_SCALE
        score = tl.where(valid & (x >= threshold), x / temperature - tl.log(-tl.log(u)), float("-inf"))
        better = (score > best) | ((score == best) & (ids < best_index))
        best = tl.where(better, score, best)
        best_index = tl.where(better, ids, best_index)
    top = tl.max(best, axis=0)
    index = tl.min(tl.where(best == top, best_index, 2147483647), axis=0)
    tl.store(token_ptr + b, tl.where(index == 2147483647, 0, index).to(tl.int64))


def top_p_threshold(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, lower: torch.Tensor,
                    candidates: torch.Tensor | None = None, use_candidates: torch.Tensor | None = None,
                    search_full_rows: bool = True) -> torch.Tensor:
    """Per-row top-p threshold [B] fp32 on logits [B, V] (fp32, or bf16 / fp16 read as fp32), over the tokens with
    logit >= lower [B] (the top-k threshold, or -inf), with reference.truncation_thresholds' rule. candidates
    [B, K] fp32 hold each row's K largest logits (descending; torch.topk): rows flagged in use_candidates [B] bool
    search those, with the mass above `lower` summed over the whole row; the others search their whole row in one
    program each, unless search_full_rows is False. Rows with top_p >= 1 get `lower` back. The sampler uses it
    for top-k past TOP_K_MAX only (group_thresholds does smaller k; rows without top-k draw by rejection)."""
    _check_logits(logits)
    num_rows, vocab_size = logits.shape
    device = logits.device
    for name, t in (("temperature", temperature), ("top_p", top_p), ("lower", lower)):
        _check_rows(name, t, num_rows, torch.float32, device)
    has_cand = candidates is not None and use_candidates is not None
    if candidates is not None:
        if (candidates.dim() != 2 or candidates.shape[0] != num_rows or candidates.dtype != torch.float32
                or candidates.stride(1) != 1 or candidates.device != device):
            raise ValueError(f"candidates must be [{num_rows}, K] fp32, got {tuple(candidates.shape)} "
                             f"{candidates.dtype}")
        _check_rows("use_candidates", use_candidates, num_rows, torch.bool, device)
    if num_rows == 0 or not (has_cand or search_full_rows):
        return lower.clone()
    threshold = torch.empty(num_rows, dtype=torch.float32, device=device)  # [B]
    cand = candidates if candidates is not None and has_cand else lower
    _top_p_row_kernel[(num_rows,)](
        logits, logits.stride(0), vocab_size, cand, cand.stride(0) if has_cand else 0,
        cand.shape[1] if has_cand else 0, use_candidates if has_cand else lower, temperature, top_p, lower,
        threshold, HAS_CAND=has_cand, FULL_ROWS=search_full_rows, BLOCK=TOP_P_BLOCK, NUM_PIVOTS=TOP_P_PIVOTS,
        num_warps=8)
    return threshold


def group_thresholds(candidates: TopCandidates, group_max: torch.Tensor, group_ties: torch.Tensor,
                     top_k: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                     temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.truncation_thresholds [B] fp32 from top_candidates' gathered groups and the fused pass's group
    maxima and ties, for every row with top_k [B] > 0 (at most the candidates' k); a row without top-k gets its
    min-p threshold (or -inf) and, if it has top_p < 1, needs top_p_threshold over its whole row as well.
    Also whole_row [B] bool: the rows whose draw needs the whole row (no top-k, or ids outside the gathered
    groups at the threshold); gathered_gumbel_argmax draws the others."""
    gathered, groups = candidates.gathered, candidates.groups
    if gathered is None or groups is None:
        raise ValueError("group_thresholds needs top_candidates' gathered groups (k <= TOP_K_MAX)")
    num_rows, num_gathered = gathered.shape
    device = gathered.device
    if not gathered.is_contiguous() or gathered.dtype != torch.float32 or not groups.is_contiguous():
        raise ValueError("gathered must be contiguous fp32 and groups contiguous")
    if group_max.shape != group_ties.shape or group_max.shape[0] != num_rows or not group_max.is_contiguous() \
            or not group_ties.is_contiguous() or group_ties.dtype != torch.int32:
        raise ValueError(f"group_max / group_ties must be [{num_rows}, G] fp32 / int32, contiguous")
    _check_rows("top_k", top_k, num_rows, torch.int64, device)
    for name, t in (("top_p", top_p), ("min_p", min_p), ("temperature", temperature)):
        _check_rows(name, t, num_rows, torch.float32, device)
    threshold = torch.empty(num_rows, dtype=torch.float32, device=device)  # [B]
    whole_row = torch.empty(num_rows, dtype=torch.bool, device=device)  # [B]
    if num_rows == 0:
        return threshold, whole_row
    _group_thresholds_kernel[(num_rows,)](
        gathered, num_gathered, group_max, group_ties, group_max.shape[1], groups, groups.shape[1], top_k,
        top_p if top_p is not None else temperature, min_p if min_p is not None else temperature, temperature,
        threshold, whole_row.view(torch.int8), HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None,
        BLOCK=TOP_P_PIVOT_BLOCK, NUM_PIVOTS=TOP_P_PIVOTS, num_warps=4)
    return threshold, whole_row


def gathered_gumbel_argmax(candidates: TopCandidates, temperature: torch.Tensor, threshold: torch.Tensor,
                           seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """gumbel_argmax's token ids [B] int64 for rows whose every id at or above threshold [B] lies in
    top_candidates' gathered groups (group_thresholds' whole_row is False): reads k x 64 logits a row."""
    gathered, groups = candidates.gathered, candidates.groups
    if gathered is None or groups is None:
        raise ValueError("gathered_gumbel_argmax needs top_candidates' gathered groups")
    num_rows, num_gathered = gathered.shape
    device = gathered.device
    for name, t, dtype in (("temperature", temperature, torch.float32), ("threshold", threshold, torch.float32),
                           ("seeds", seeds, torch.int64), ("offsets", offsets, torch.int64)):
        _check_rows(name, t, num_rows, dtype, device)
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)  # [B]
    if num_rows:
        _gathered_gumbel_kernel[(num_rows,)](gathered, num_gathered, groups, groups.shape[1], temperature, threshold,
                                             seeds, offsets, token_ids, GROUP=TOP_K_GROUP, BLOCK=ARGMAX_BLOCK,
                                             num_warps=4)
    return token_ids


# ---------------------------------------------------------------------------------------------
# the batch's largest k logits per row (candidates for top-k / top-p / min-p thresholds)



@dataclass(slots=True)
class TopCandidates:
    values: torch.Tensor | None  # [B, k] fp32 descending: each row's k largest logits (torch.topk's values)
    gathered: torch.Tensor | None  # [B, k * TOP_K_GROUP] fp32: the logits of the k groups with the largest maxima
    groups: torch.Tensor | None  # [B, k] int64: those groups (-inf fills the partial last group's missing ids)


def top_candidates(logits: torch.Tensor, k: int, group_max: torch.Tensor | None = None,
                   with_values: bool = True) -> TopCandidates:
    """Each row's k largest logits of logits [B, V], k >= 1, ties included. The k groups (TOP_K_GROUP ids each)
    with the largest maxima hold them: a logit above the k-th largest lies in a group whose maximum is above it,
    fewer than k groups have such a maximum, so all of them are chosen; the other chosen groups each add a value
    at least the k-th largest. So the answer is a top-k over the k x 64 gathered values. The same holds for any
    k' <= k: every logit above a row's k'-th largest is gathered.
    group_max [B, G] (process_logits_grouped's) saves the pass that finds the maxima; with_values=False skips the
    final top-k (group_thresholds searches the gathered values itself). torch.topk over the whole row made four
    radix passes over [256, 151936] fp32 (~0.57 ms on an H200); k > TOP_K_MAX falls back to it."""
    _check_logits(logits)
    num_rows, vocab_size = logits.shape
    if not 1 <= k <= vocab_size:
        raise ValueError(f"k must be in 1..{vocab_size}, got {k}")
    group = TOP_K_GROUP
    num_groups = triton.cdiv(vocab_size, group)
    if k > TOP_K_MAX or num_groups < k or num_rows == 0:
        return TopCandidates(logits.topk(k, dim=-1).values.float(), None, None)  # [B, k]
    if group_max is None:
        num_full = vocab_size // group
        group_max = logits[:, :num_full * group].unflatten(1, (num_full, group)).amax(dim=2)  # [B, G_full]
        if num_full < num_groups:  # the partial last group
            group_max = torch.cat([group_max, logits[:, num_full * group:].amax(dim=1, keepdim=True)], dim=1)
    if group_max.shape != (num_rows, num_groups):
        raise ValueError(f"group_max must be [{num_rows}, {num_groups}], got {tuple(group_max.shape)}")
    groups = group_max.topk(k, dim=1, sorted=False).indices  # [B, k]: which k, not their order
    ids = (groups.unsqueeze(2) * group + torch.arange(group, device=logits.device)).flatten(1)  # [B, k * group]
    gathered = logits.gather(1, ids.clamp(max=vocab_size - 1)).float()  # [B, k * group]
    gathered.masked_fill_(ids >= vocab_size, float("-inf"))  # the partial group's missing ids
    return TopCandidates(gathered.topk(k, dim=1).values if with_values else None, gathered, groups)  # [B, k]


def row_top_values(logits: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk(logits, k).values for logits [B, V]: [B, k] descending (top_candidates' values)."""
    values = top_candidates(logits, k).values
    assert values is not None
    return values.to(logits.dtype)


# ---------------------------------------------------------------------------------------------
# Gumbel-max: noise from the (seed, offset, id) hash in registers, threshold mask, running argmax.
#
# Top-p without top-k draws by rejection, exactly under reference.truncation_thresholds' rule: a row keeps
# {x >= t*}, and id i is kept iff the mass of {x > x_i} is below top_p of the mass min-p keeps (the row's mass
# without min-p; ties at t* all kept).
# The draw over {x > lo} (lo = -inf at first) gives a candidate; kept, it is the draw over the kept set (same
# noise, and the kept set lies inside {x > lo}); rejected, t* > x_candidate, and the next round draws over
# {x > x_candidate}. A candidate is rejected with probability below (1 - top_p) / top_p; rows still undecided
# after NUCLEUS_ROUNDS (~(1 - top_p)^R of them) search t* exactly, one program each. No round reads a row that
# is decided or has no top-p, and rounds are one launch each with no host sync.


@triton.jit
def _gumbel_score(x, cols, key, temperature):
    """x / T + Gumbel noise of ids `cols` under the row's key: reference.gumbel_argmax's score."""
    bits = _mix32(key ^ (cols.to(tl.uint32) * tl.full((), GOLDEN32, tl.uint32)))
    u = ((bits >> 8) | 1).to(tl.float32) * UNIFORM_SCALE  # (0, 1), exact as in the reference
    return x / temperature - tl.log(-tl.log(u))


@triton.jit(do_not_specialize=["vocab_size", "num_splits"])
def _argmax_split_kernel(logits_ptr, stride_l, vocab_size, best_value_ptr, best_index_ptr, num_splits,
                         SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Per (row, split of SPLIT ids): the largest value and its first id, as torch.argmax ranks them (a NaN is
    larger than everything: the split's first NaN, stored as NaN; all -inf: the split's first id)."""
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row = logits_ptr + b * stride_l
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], 2147483647, tl.int32)
    nan_index = tl.full([BLOCK], 2147483647, tl.int32)
    first = split * SPLIT
    for start in range(first, first + SPLIT, BLOCK):
        cols = start + tl.arange(0, BLOCK)  # [BLOCK]
        x = tl.load(row + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        nan_index = tl.minimum(nan_index, tl.where(x != x, cols, 2147483647))
        better = x > best  # strict: a lane keeps its first maximum
        best = tl.where(better, x, best)
        best_index = tl.where(better, cols, best_index)
    top = tl.max(best, axis=0)
    index = tl.min(tl.where(best == top, best_index, 2147483647), axis=0)
    index = tl.where(index == 2147483647, first, index)
    first_nan = tl.min(nan_index, axis=0)
    has_nan = first_nan != 2147483647
    tl.store(best_value_ptr + b * num_splits + split, tl.where(has_nan, float("nan"), top))
    tl.store(best_index_ptr + b * num_splits + split, tl.where(has_nan, first_nan, index))


@triton.jit(do_not_specialize=["num_splits"])
def _argmax_finish_kernel(best_value_ptr, best_index_ptr, num_splits, out_ptr, SPLITS: tl.constexpr):
    """A row's id from its splits' bests: the first NaN, else the first split holding the maximum (splits ascend,
    so that is the smallest id among ties)."""
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, SPLITS)
    mask = offs < num_splits
    value = tl.load(best_value_ptr + b * num_splits + offs, mask=mask, other=float("-inf"))  # [SPLITS]
    index = tl.load(best_index_ptr + b * num_splits + offs, mask=mask, other=2147483647)  # [SPLITS]
    is_nan = value != value
    first_nan = tl.min(tl.where(is_nan, index, 2147483647), axis=0)
    top = tl.max(tl.where(is_nan, float("-inf"), value), axis=0)
    best = tl.min(tl.where((value == top) & mask, index, 2147483647), axis=0)
    tl.store(out_ptr + b, tl.where(first_nan != 2147483647, first_nan, best).to(tl.int64))


def greedy_argmax(logits: torch.Tensor, split: int = ARGMAX_SPLIT) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for logits [B, V] (first id of ties, NaN largest) in two launches: B * V / split
    programs each find their split's best, then one program a row picks among them. torch's reduction over one long
    row runs on few blocks (~36 us for one row of 128k ids on an H200), this on V / split SMs."""
    _check_logits(logits)
    if split < ARGMAX_BLOCK or split % ARGMAX_BLOCK:
        raise ValueError(f"split must be a positive multiple of {ARGMAX_BLOCK}, got {split}")
    num_rows, vocab_size = logits.shape
    if not 0 < vocab_size < 2**31:
        raise ValueError(f"vocab size {vocab_size} out of range")
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)  # [B]
    if num_rows == 0:
        return out
    num_splits = triton.cdiv(vocab_size, split)
    best_value = torch.empty((num_rows, num_splits), dtype=torch.float32, device=logits.device)  # [B, S]
    best_index = torch.empty((num_rows, num_splits), dtype=torch.int32, device=logits.device)  # [B, S]
    _argmax_split_kernel[(num_rows, num_splits)](logits, logits.stride(0), vocab_size, best_value, best_index,
                                                 num_splits, SPLIT=split, BLOCK=ARGMAX_BLOCK)
    _argmax_finish_kernel[(num_rows,)](best_value, best_index, num_splits, out,
                                       SPLITS=max(16, triton.next_power_of_2(num_splits)))
    return out


@triton.jit(do_not_specialize=["vocab_size"])
def _gumbel_argmax_kernel(logits_ptr, stride_l, vocab_size, temperature_ptr, threshold_ptr, seeds_ptr,
                          offsets_ptr, greedy_ptr, best_value_ptr, best_index_ptr, num_splits, rows_ptr,
                          nucleus_ptr, part_max_ptr, part_sum_ptr, bitmask_ptr, stride_m, bitmask_rows_ptr,
                          HAS_THRESHOLD: tl.constexpr, HAS_GREEDY: tl.constexpr, HAS_ROWS: tl.constexpr,
                          NUCLEUS: tl.constexpr, HAS_BITMASK: tl.constexpr, HAS_BITMASK_ROWS: tl.constexpr,
                          SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """Per (row, split): the best score and its id; for top-p rows (NUCLEUS) also the split's largest logit and
    its mass sum(exp((x - max) / T)) over the ids at or above the threshold (top-p's total: a top-p row's
    threshold here is its min-p's, or -inf). HAS_BITMASK: a grammar bitmask applies to the
    flagged rows on the fly (their disallowed ids read as -inf), so a masked row needs no written-out copy."""
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if HAS_ROWS:
        if tl.load(rows_ptr + b) == 0:  # drawn elsewhere (gathered_gumbel_argmax): no logits read; an empty split
            out = b * num_splits + split  # written all the same: the nucleus kernels read every row's round 0
            tl.store(best_value_ptr + out, tl.full((), float("-inf"), tl.float32))
            tl.store(best_index_ptr + out, (split * SPLIT).to(tl.int32))
            if NUCLEUS:
                tl.store(part_max_ptr + out, tl.full((), -1.0e30, tl.float32))
                tl.store(part_sum_ptr + out, tl.zeros((), dtype=tl.float32))
            return
    masked = False
    if HAS_BITMASK:
        masked = True
        if HAS_BITMASK_ROWS:
            masked = tl.load(bitmask_rows_ptr + b) != 0
    greedy = False
    if HAS_GREEDY:
        greedy = tl.load(greedy_ptr + b) != 0
    in_nucleus = False
    if NUCLEUS:
        in_nucleus = tl.load(nucleus_ptr + b) != 0
    temperature = tl.load(temperature_ptr + b)
    temperature = tl.where(temperature == 0.0, 1.0, temperature)
    threshold = float("-inf")
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + b)
    key = _row_key(tl.load(seeds_ptr + b), tl.load(offsets_ptr + b))
    row = logits_ptr + b * stride_l
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = tl.full([BLOCK], 2147483647, tl.int32)
    split_max = tl.full((), -1.0e30, tl.float32)
    split_sum = tl.zeros((), dtype=tl.float32)
    first = split * SPLIT
    for start in range(first, first + SPLIT, BLOCK):
        cols = start + tl.arange(0, BLOCK)  # [BLOCK]
        in_vocab = cols < vocab_size
        x = tl.load(row + cols, mask=in_vocab, other=float("-inf")).to(tl.float32)
        if masked:
            words = tl.load(bitmask_ptr + b * stride_m + cols // 32, mask=in_vocab, other=-1)  # [BLOCK] int32
            x = tl.where(((words >> (cols % 32)) & 1) != 0, x, float("-inf"))
        block_max = tl.max(x, axis=0)
        if greedy:
            score = x
        elif block_max >= threshold:
            score = tl.where(x >= threshold, _gumbel_score(x, cols, key, temperature), float("-inf"))
        else:  # every id of the block is truncated away (most blocks under top-k): no noise to draw
            score = tl.full([BLOCK], float("-inf"), tl.float32)
        if in_nucleus:  # one exp an id, rescaled once a block; over what min-p (the threshold) keeps
            kept = x
            if HAS_THRESHOLD:  # the row's maximum is kept (min-p's threshold is at or below it): same reference
                kept = tl.where(x >= threshold, x, float("-inf"))
            new_max = tl.maximum(split_max, block_max)
            split_sum = split_sum * tl.exp((split_max - new_max) / temperature) \
                + tl.sum(tl.exp((kept - new_max) / temperature), axis=0)
            split_max = new_max
        score = tl.where(in_vocab, score, float("-inf"))
        better = score > best  # strict: a lane keeps its first maximum
        best = tl.where(better, score, best)
        best_index = tl.where(better, cols, best_index)
    top = tl.max(best, axis=0)
    index = tl.min(tl.where(best == top, best_index, 2147483647), axis=0)
    index = tl.where(index == 2147483647, first, index)  # all -inf: the split's first id, like torch.argmax
    tl.store(best_value_ptr + b * num_splits + split, top)
    tl.store(best_index_ptr + b * num_splits + split, index)
    if NUCLEUS:
        tl.store(part_max_ptr + b * num_splits + split, split_max)
        tl.store(part_sum_ptr + b * num_splits + split, split_sum)


@triton.jit
def _nucleus_decide(b, prev, row, vocab_size, num_rows, num_splits, temperature, top_p, in_nucleus, part_max_ptr,
                    score_ptr, index_ptr, mass_ptr, active_ptr, cand_ptr, lo_ptr, row_max_ptr, target_ptr,
                    SPLITS: tl.constexpr):
    """A top-p row's state after round `prev`'s per-split results (round 0: the first draw and the split masses):
    (undecided, candidate id, its logit, lo, row max, mass target). Round prev >= 1 held the mass above the
    candidate of round prev - 1 and the draw above it: below the target, that candidate is the answer;
    otherwise the draw is the next candidate and the rejected one's logit the new lo."""
    splits = tl.arange(0, SPLITS)
    valid = splits < num_splits
    base = (prev * num_rows + b) * num_splits
    was_active = prev == 0
    if prev > 0:  # a row decided before round prev ran no programs in it: its slots there hold nothing written
        was_active = tl.load(active_ptr + (prev - 1) * num_rows + b) != 0
    live = valid & was_active
    scores = tl.load(score_ptr + base + splits, mask=live, other=float("-inf"))
    indices = tl.load(index_ptr + base + splits, mask=live, other=2147483647)
    top = tl.max(scores, axis=0)
    best = tl.min(tl.where(live & (scores == top), indices, 2147483647), axis=0)  # first split: smallest id
    masses = tl.load(mass_ptr + base + splits, mask=live, other=0.0)
    if prev == 0:
        maxima = tl.load(part_max_ptr + b * num_splits + splits, mask=valid, other=-1.0e30)
        row_max = tl.max(maxima, axis=0)
        total = tl.sum(masses * tl.exp((maxima - row_max) / temperature), axis=0)
        target = top_p * total
        active = in_nucleus & (top_p < 1.0) & (total > 0.0)
        cand = best
        lo = tl.full((), float("-inf"), tl.float32)
    else:
        slot = (prev - 1) * num_rows + b
        row_max = tl.load(row_max_ptr + b)
        target = tl.load(target_ptr + b)
        prev_cand = tl.load(cand_ptr + slot)
        active = was_active & (tl.sum(masses, axis=0) >= target)  # the candidate is below t*
        cand = tl.where(active, best, prev_cand)
        prev_value = tl.load(row + tl.minimum(tl.maximum(prev_cand, 0), vocab_size - 1)).to(tl.float32)
        lo = tl.where(active, prev_value, tl.load(lo_ptr + slot))
    cand = tl.minimum(tl.maximum(cand, 0), vocab_size - 1)  # a row drawn elsewhere holds no valid id here
    value = tl.load(row + cand).to(tl.float32)
    return active, cand, value, lo, row_max, target


@triton.jit(do_not_specialize=["vocab_size", "num_rows", "num_splits", "prev"])
def _nucleus_round_kernel(logits_ptr, stride_l, vocab_size, temperature_ptr, threshold_ptr, seeds_ptr, offsets_ptr,
                          top_p_ptr, nucleus_ptr, part_max_ptr, score_ptr, index_ptr, mass_ptr, active_ptr,
                          cand_ptr, lo_ptr, row_max_ptr, target_ptr, num_rows, num_splits, prev,
                          HAS_THRESHOLD: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                          SPLITS: tl.constexpr):
    """Round prev + 1, one program per (row, split): every program of a row decides round prev the same way
    (split 0 writes it down for the next round); an undecided row's programs then sum their split's mass above
    the candidate's logit and draw over the ids above it (the next candidate, should this one be rejected)."""
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    if tl.load(nucleus_ptr + b) == 0:
        return
    temperature = tl.load(temperature_ptr + b)  # top-p rows are never greedy: T > 0
    row = logits_ptr + b * stride_l
    active, cand, value, lo, row_max, target = _nucleus_decide(
        b, prev, row, vocab_size, num_rows, num_splits, temperature, tl.load(top_p_ptr + b), True, part_max_ptr,
        score_ptr, index_ptr, mass_ptr, active_ptr, cand_ptr, lo_ptr, row_max_ptr, target_ptr, SPLITS)
    if split == 0:
        slot = prev * num_rows + b
        tl.store(active_ptr + slot, active.to(tl.int8))
        tl.store(cand_ptr + slot, cand)
        tl.store(lo_ptr + slot, lo)
        if prev == 0:
            tl.store(row_max_ptr + b, row_max)
            tl.store(target_ptr + b, target)
    if active:
        threshold = float("-inf")
        if HAS_THRESHOLD:
            threshold = tl.load(threshold_ptr + b)
        key = _row_key(tl.load(seeds_ptr + b), tl.load(offsets_ptr + b))
        mass = tl.zeros([BLOCK], dtype=tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_index = tl.full([BLOCK], 2147483647, tl.int32)
        first = split * SPLIT
        for start in range(first, first + SPLIT, BLOCK):
            cols = start + tl.arange(0, BLOCK)  # [BLOCK]
            x = tl.load(row + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
            if tl.max(x, axis=0) > value:  # blocks wholly at or below the candidate add nothing
                above = x > value
                mass += tl.where(above, tl.exp((x - row_max) / temperature), 0.0)
                score = tl.where(above & (x >= threshold), _gumbel_score(x, cols, key, temperature), float("-inf"))
                better = score > best
                best = tl.where(better, score, best)
                best_index = tl.where(better, cols, best_index)
        top = tl.max(best, axis=0)
        index = tl.min(tl.where(best == top, best_index, 2147483647), axis=0)
        out = ((prev + 1) * num_rows + b) * num_splits + split
        tl.store(score_ptr + out, top)
        tl.store(index_ptr + out, tl.where(index == 2147483647, first, index))
        tl.store(mass_ptr + out, tl.sum(mass, axis=0))


@triton.jit(do_not_specialize=["vocab_size", "num_rows", "num_splits", "num_rounds"])
def _nucleus_final_kernel(logits_ptr, stride_l, vocab_size, temperature_ptr, threshold_ptr, seeds_ptr, offsets_ptr,
                          top_p_ptr, nucleus_ptr, part_max_ptr, score_ptr, index_ptr, mass_ptr, active_ptr,
                          cand_ptr, lo_ptr, row_max_ptr, target_ptr, token_ptr, num_rows, num_splits, num_rounds,
                          HAS_THRESHOLD: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                          DRAW_BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """One program per row: the token. Other rows: round 0's draw. Top-p rows: the last round decided; a row
    still undecided searches t* over (lo, row max] (every key there down to t* has mass >= the target) and
    draws over {x >= max(t*, threshold)}."""
    b = tl.program_id(0).to(tl.int64)
    in_nucleus = tl.load(nucleus_ptr + b) != 0
    temperature = tl.load(temperature_ptr + b)
    temperature = tl.where(temperature == 0.0, 1.0, temperature)
    row = logits_ptr + b * stride_l
    prev = tl.where(in_nucleus, num_rounds, 0)
    active, token, value, lo, row_max, target = _nucleus_decide(
        b, prev, row, vocab_size, num_rows, num_splits, temperature, tl.load(top_p_ptr + b), in_nucleus,
        part_max_ptr, score_ptr, index_ptr, mass_ptr, active_ptr, cand_ptr, lo_ptr, row_max_ptr, target_ptr,
        SPLITS)
    if active:
        lo_key = _float_key(lo).to(tl.int64)
        lo_key = tl.where(lo == float("-inf"), lo_key, lo_key + 1)
        t_key = _search(row, vocab_size, lo_key, _float_key(row_max).to(tl.int64), target, row_max, temperature,
                        BLOCK, NUM_PIVOTS)
        threshold = _key_float(t_key.to(tl.int32))
        if HAS_THRESHOLD:
            threshold = tl.maximum(threshold, tl.load(threshold_ptr + b))
        key = _row_key(tl.load(seeds_ptr + b), tl.load(offsets_ptr + b))
        best = tl.full([DRAW_BLOCK], float("-inf"), tl.float32)
        best_index = tl.full([DRAW_BLOCK], 2147483647, tl.int32)
        for start in range(0, vocab_size, DRAW_BLOCK):
            cols = start + tl.arange(0, DRAW_BLOCK)
            x = tl.load(row + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
            score = tl.where(x >= threshold, _gumbel_score(x, cols, key, temperature), float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            best_index = tl.where(better, cols, best_index)
        top = tl.max(best, axis=0)
        token = tl.min(tl.where(best == top, best_index, 2147483647), axis=0)
    tl.store(token_ptr + b, token.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, threshold: torch.Tensor | None,
                  seeds: torch.Tensor, offsets: torch.Tensor, greedy: torch.Tensor | None,
                  rows: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                  nucleus: torch.Tensor | None = None, bitmask: torch.Tensor | None = None,
                  bitmask_rows: torch.Tensor | None = None) -> torch.Tensor:
    """reference.gumbel_argmax in one read of logits [B, V]: token ids [B] int64. rows [B] bool: only those rows
    are drawn (the others' ids are left unspecified, for the caller to replace). nucleus [B] bool (or int64 0/1)
    with top_p [B] fp32: rows (drawn, never greedy, no top-k) whose kept set {x >= threshold} (min-p's, or the
    whole row) is also cut by top-p over that set, as reference.truncation_thresholds: drawn by rejection (see
    above).
    bitmask [B, >= V/32] int32 with bitmask_rows [B] bool (None: every row): the draw of
    reference.apply_token_bitmask(logits, bitmask, bitmask_rows), read in the same pass (not with nucleus rows,
    whose rejection rounds read the row again)."""
    _check_logits(logits)
    num_rows, vocab_size = logits.shape
    device = logits.device
    _check_rows("temperature", temperature, num_rows, torch.float32, device)
    _check_rows("threshold", threshold, num_rows, torch.float32, device)
    _check_rows("seeds", seeds, num_rows, torch.int64, device)
    _check_rows("offsets", offsets, num_rows, torch.int64, device)
    _check_rows("greedy", greedy, num_rows, torch.bool, device)
    if not 0 < vocab_size < 2**31:
        raise ValueError(f"vocab size {vocab_size} out of range")
    _check_rows("rows", rows, num_rows, torch.bool, device)
    _check_rows("top_p", top_p, num_rows, torch.float32, device)
    if nucleus is not None:  # bool, or int64 0/1 (the sampling state's packed upload)
        _check_rows("nucleus", nucleus, num_rows, nucleus.dtype if nucleus.dtype == torch.int64 else torch.bool,
                    device)
    if (top_p is None) != (nucleus is None):
        raise ValueError("top_p and nucleus come together")
    if bitmask is not None:
        if nucleus is not None:
            raise ValueError("a bitmask is not read by the top-p rejection rounds: apply it first")
        _check_bitmask(bitmask, num_rows, vocab_size, device)
        _check_rows("bitmask_rows", bitmask_rows, num_rows, torch.bool, device)
    elif bitmask_rows is not None:
        raise ValueError("bitmask_rows without a bitmask")
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    num_splits = triton.cdiv(vocab_size, ARGMAX_SPLIT)
    rounds = NUCLEUS_ROUNDS if nucleus is not None else 0
    best_value = torch.empty((rounds + 1, num_rows, num_splits), dtype=torch.float32, device=device)  # [R+1, B, S]
    best_index = torch.empty((rounds + 1, num_rows, num_splits), dtype=torch.int32, device=device)  # [R+1, B, S]
    mass = part_max = best_value
    if nucleus is not None:
        mass = torch.empty((rounds + 1, num_rows, num_splits), dtype=torch.float32, device=device)  # [R+1, B, S]
        part_max = torch.empty((num_rows, num_splits), dtype=torch.float32, device=device)  # [B, S]
    dummy = temperature
    _gumbel_argmax_kernel[(num_rows, num_splits)](
        logits, logits.stride(0), vocab_size, temperature, threshold if threshold is not None else dummy,
        seeds, offsets, greedy if greedy is not None else dummy, best_value, best_index, num_splits,
        rows if rows is not None else dummy, nucleus if nucleus is not None else dummy, part_max, mass,
        bitmask if bitmask is not None else best_index, bitmask.stride(0) if bitmask is not None else 0,
        bitmask_rows if bitmask_rows is not None else dummy,
        HAS_THRESHOLD=threshold is not None, HAS_GREEDY=greedy is not None, HAS_ROWS=rows is not None,
        NUCLEUS=nucleus is not None, HAS_BITMASK=bitmask is not None, HAS_BITMASK_ROWS=bitmask_rows is not None,
        SPLIT=ARGMAX_SPLIT, BLOCK=ARGMAX_BLOCK)
    if nucleus is None or top_p is None:
        # the first split holding the maximum has its smallest id (splits ascend): torch.argmax's tie rule
        winner = best_value[0].argmax(dim=1, keepdim=True)  # [B, 1]
        return best_index[0].gather(1, winner).squeeze(1).long()  # [B]
    slots = max(rounds, 1)
    active = torch.empty((slots, num_rows), dtype=torch.int8, device=device)  # [R, B]
    cand = torch.empty((slots, num_rows), dtype=torch.int32, device=device)  # [R, B]
    lo = torch.empty((slots, num_rows), dtype=torch.float32, device=device)  # [R, B]
    row_max = torch.empty(num_rows, dtype=torch.float32, device=device)  # [B]
    target = torch.empty(num_rows, dtype=torch.float32, device=device)  # [B]
    common = (logits, logits.stride(0), vocab_size, temperature, threshold if threshold is not None else dummy,
              seeds, offsets, top_p, nucleus, part_max, best_value, best_index, mass, active, cand, lo, row_max,
              target)
    splits = triton.next_power_of_2(num_splits)
    for prev in range(rounds):
        _nucleus_round_kernel[(num_rows, num_splits)](
            *common, num_rows, num_splits, prev, HAS_THRESHOLD=threshold is not None, SPLIT=ARGMAX_SPLIT,
            BLOCK=ARGMAX_BLOCK, SPLITS=splits)
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)  # [B]
    _nucleus_final_kernel[(num_rows,)](
        *common, token_ids, num_rows, num_splits, rounds, HAS_THRESHOLD=threshold is not None, SPLITS=splits,
        BLOCK=TOP_P_PIVOT_BLOCK, DRAW_BLOCK=ARGMAX_BLOCK, NUM_PIVOTS=TOP_P_PIVOTS, num_warps=8)
    return token_ids
