"""Batched token sampling on the device: penalties, bias, bans, grammar bitmask, greedy, temperature,
top-k/p, min-p and seeded Gumbel-max, reading the [B, V] logits about once.

Order (vLLM's): logit bias on the raw logits, then penalties (repetition over prompt + output tokens,
then frequency and presence over output tokens), and bans (min_tokens, bad_words) and the grammar bitmask
(-inf, which no bias or penalty undoes, so where they run does not matter); then greedy rows take the argmax,
and the others draw from softmax(logits / T) after truncation. The bias and the additive penalties commute,
so the bias is added before the penalty pass only when a row of the batch has a repetition penalty (which
scales a biased logit: (l + b) / r, not l / r + b), else after it, as the bans are. Truncation is a per-row
threshold on the processed logits (kernels/reference.py `truncation_thresholds` states the rule, ties at the
threshold are kept); the draw is
argmax(logits / T + Gumbel noise) where the noise is a hash of (seed, output index, token id), so a
seeded row draws the same token whatever shares its batch, on CPU and GPU alike. Logprobs are those of
the raw model distribution.

On CUDA the work runs in kernels/sampling.py: one fused pass over the model-dtype logits (penalties, bitmask,
and each group of 64 ids' maximum and tie count), the batch's largest k from the groups with the largest
maxima, the top-p search over those (the mass of the gathered groups plus the ties outside them), and one
Gumbel-argmax kernel that reads only the blocks reaching a row's threshold. On CPU the PyTorch references of
kernels/reference.py run, except the truncation thresholds: from each row's largest logits (torch.topk, widened
until a top-p nucleus fits) instead of the reference's full sort.

Grammar hook (structured output): set `metadata.token_bitmask` [B, ceil(V/32)] int32 (bit j of word w set:
token 32 * w + j allowed, the xgrammar / llguidance layout) and, when only some rows have a grammar,
`metadata.bitmask_rows` [B] bool. Disallowed tokens become -inf for greedy and random rows alike, before
top-k/p thresholds; logprobs stay those of the raw distribution.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.kernels import reference

if TYPE_CHECKING:
    from pagoda.kernels.sampling import GroupedLogits, TopCandidates


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling settings for the B rows sampled this step (all tensors on the logits' device).
    An optional field is None when no row of the batch uses it."""

    temperature: torch.Tensor  # [B] float32; 0 means greedy for that row
    seeds: torch.Tensor  # [B] int64, the request's seed, in [0, 2^63)
    offsets: torch.Tensor  # [B] int64, index of the sampled token within the request's output
    top_k: torch.Tensor | None = None  # [B] int64, 0 or -1 = off
    top_p: torch.Tensor | None = None  # [B] float32, 1.0 = off
    min_p: torch.Tensor | None = None  # [B] float32, 0.0 = off
    presence_penalty: torch.Tensor | None = None  # [B] float32, 0 = off
    frequency_penalty: torch.Tensor | None = None  # [B] float32, 0 = off
    repetition_penalty: torch.Tensor | None = None  # [B] float32, 1 = off
    state_rows: torch.Tensor | None = None  # [B] int64: row b's row in output_counts / prompt_mask
    output_counts: torch.Tensor | None = None  # [R, V] int32: how often each id was generated (penalties)
    prompt_mask: torch.Tensor | None = None  # [R, V] bool: ids in the prompt (repetition penalty)
    logit_bias_ids: torch.Tensor | None = None  # [B, K] int64, padded with id 0 and value 0
    logit_bias_values: torch.Tensor | None = None  # [B, K] float32
    banned_token_ids: torch.Tensor | None = None  # [B, K] int64, padded with -1
    token_bitmask: torch.Tensor | None = None  # [B, ceil(V/32)] int32 grammar masks
    bitmask_rows: torch.Tensor | None = None  # [B] bool: rows whose token_bitmask applies (None: all)
    max_num_logprobs: int | None = None  # None: no logprobs; k >= 0: sampled logprob plus top k
    # logprob_token_ids: a row's listed ids take the place of its top k (-1: none there; its top k stay) [B, K] int64
    logprob_token_ids: torch.Tensor | None = None
    all_greedy: bool = False  # every row greedy: skip the random path entirely
    max_top_k: int = 0  # host copy of max(top_k) (0: read it from top_k, a device sync)
    top_p_without_top_k: bool = True  # host flag: some row has top_p < 1 and no top-k (False skips a search)
    nucleus: torch.Tensor | None = None  # [B] bool: rows with top_p < 1, no top-k, not greedy (None: derived)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32 logprob of the sampled token
    top_token_ids: torch.Tensor | None  # [B, k] int64
    top_logprobs: torch.Tensor | None  # [B, k] float32
    ranks: torch.Tensor | None = None  # [B] int64: the sampled token's rank in the raw distribution (1: likeliest)


class Sampler:
    """Stateless callable wrapper so the worker can hold a sampler object like a model module."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return sample(logits, metadata)


def sample(logits: torch.Tensor, metadata: SamplingMetadata, use_kernels: bool | None = None) -> SamplerOutput:
    """Pick one token per row of `logits` [B, V]; no host sync, no loop over rows. use_kernels: the Triton path
    (default: on CUDA; tests run it on CPU under the interpreter)."""
    if metadata.all_greedy and metadata.max_num_logprobs is None and not _modifies_logits(metadata):
        # argmax in the LM head's dtype: the upcast is monotonic, so the same id (first of ties), without
        # writing and reading an fp32 copy of [B, V] (~0.11 ms a step at B=256, V=152k on an H200); on the GPU
        # split over the vocabulary (torch's argmax of one 128k row took 36 us)
        if not (logits.is_cuda if use_kernels is None else use_kernels):
            return SamplerOutput(logits.argmax(dim=-1), None, None, None)
        from pagoda.kernels import sampling

        return SamplerOutput(sampling.greedy_argmax(logits), None, None, None)
    if logits.is_cuda if use_kernels is None else use_kernels:
        token_ids = _sample_on_device(logits, metadata)  # [B] int64
    else:
        raw_logits = logits.float()  # [B, V]; the same tensor when logits is fp32: never written
        processed = process_logits(raw_logits, metadata, use_triton=False)  # [B, V] fp32
        if metadata.all_greedy:
            token_ids = processed.argmax(dim=-1)  # [B] int64
        else:
            threshold = truncation_thresholds(processed, metadata, use_triton=False)  # [B] or None
            token_ids = reference.gumbel_argmax(processed, metadata.temperature, threshold, metadata.seeds,
                                                metadata.offsets, is_greedy_row(metadata))  # [B] int64
    return gather_logprobs(logits, token_ids, metadata.max_num_logprobs, metadata.logprob_token_ids)


def _sample_on_device(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The CUDA path, logits [B, V] in the model's dtype: one fused pass reads them (penalties and bitmask, each
    group's maximum for the top-k and min-p thresholds), top-k rows draw over the groups holding their largest
    logits, the others over their whole row, top-p rows without top-k by rejection rounds that read only the rows
    still undecided. Token ids [B] int64."""
    from pagoda.kernels import sampling

    m = metadata
    penalised = m.presence_penalty is not None or m.frequency_penalty is not None or m.repetition_penalty is not None
    bias_first = _bias_first(m)
    if bias_first:  # the repetition penalty scales the biased logits: an fp32 copy, biased, feeds the pass
        logits = _biased_copy(logits, m)  # [B, V] fp32
    # applied after the fused pass
    scattered = (m.logit_bias_ids is not None and not bias_first) or m.banned_token_ids is not None
    thresholds = not m.all_greedy and (m.top_k is not None or m.min_p is not None)  # top-p alone needs none
    nucleus_pass = not m.all_greedy and m.top_p is not None and m.top_p_without_top_k
    if m.token_bitmask is not None and not (penalised or scattered or thresholds or nucleus_pass):
        # greedy and temperature rows: the draw reads the bitmask itself, with no fp32 copy of the batch written
        # and read again (a quarter of the rows constrained must not make the others pay a pass)
        return sampling.gumbel_argmax(logits, m.temperature.float().contiguous(), None, m.seeds.contiguous(),
                                      m.offsets.contiguous(), is_greedy_row(m), bitmask=m.token_bitmask,
                                      bitmask_rows=m.bitmask_rows)  # [B] int64
    write_out = penalised or m.token_bitmask is not None or scattered
    grouped = sampling.GroupedLogits(logits, None, None)
    if write_out or thresholds:
        grouped = sampling.process_logits_grouped(
            logits, m.state_rows, m.output_counts if penalised else None,
            m.prompt_mask if m.repetition_penalty is not None else None, m.presence_penalty, m.frequency_penalty,
            m.repetition_penalty, m.token_bitmask, m.bitmask_rows, write_out=write_out,
            group_stats=thresholds and not scattered)
    processed = grouped.logits  # [B, V]: fp32 when written, else the model's logits
    if scattered:
        processed = _scatter_bias_and_bans(processed, m, not bias_first)  # [B, V] fp32, in place
        if thresholds:  # the group maxima must see the bias: one more read
            grouped = sampling.process_logits_grouped(processed, write_out=False, group_stats=True)
    if m.all_greedy:
        return processed.argmax(dim=-1)  # [B] int64
    greedy = is_greedy_row(m)  # [B]
    threshold, draw = _device_thresholds(processed, m, grouped) if thresholds else (None, None)  # [B] or None
    temperature, seeds, offsets = m.temperature.float().contiguous(), m.seeds.contiguous(), m.offsets.contiguous()
    top_p = nucleus = None
    if nucleus_pass:
        top_p, nucleus = m.top_p.float().contiguous(), nucleus_rows(m, greedy)  # [B], [B]
    if draw is None:
        return sampling.gumbel_argmax(processed, temperature, threshold, seeds, offsets, greedy, top_p=top_p,
                                      nucleus=nucleus)  # [B] int64
    assert threshold is not None
    candidates, whole_row = draw
    whole_row = whole_row | greedy  # [B]: these rows read their whole row; the others only their gathered groups
    full = sampling.gumbel_argmax(processed, temperature, threshold, seeds, offsets, greedy, rows=whole_row,
                                  top_p=top_p, nucleus=nucleus)  # [B]
    part = sampling.gathered_gumbel_argmax(candidates, temperature, threshold, seeds, offsets)  # [B]
    return torch.where(whole_row, full, part)  # [B] int64


def nucleus_rows(m: SamplingMetadata, greedy: torch.Tensor) -> torch.Tensor:
    """Rows [B] bool whose top-p cuts their whole row (top_p < 1, no top-k, not greedy): metadata.nucleus when
    the sampling state sent it, else computed here."""
    if m.nucleus is not None:
        return m.nucleus
    assert m.top_p is not None
    nucleus = (m.top_p < 1.0) & ~greedy  # [B]
    if m.top_k is not None:
        nucleus &= m.top_k <= 0
    return nucleus


def _modifies_logits(m: SamplingMetadata) -> bool:
    """Whether process_logits changes anything for this batch (penalties, bitmask, bias, bans)."""
    return (m.presence_penalty is not None or m.frequency_penalty is not None or m.repetition_penalty is not None
            or m.token_bitmask is not None or m.logit_bias_ids is not None or m.banned_token_ids is not None)


def is_greedy_row(metadata: SamplingMetadata) -> torch.Tensor:
    """Rows whose answer is the argmax: temperature 0, or top_k == 1 (ties then break like argmax)."""
    greedy = metadata.temperature == 0.0  # [B] bool
    if metadata.top_k is not None:
        greedy = greedy | (metadata.top_k == 1)  # [B] bool
    return greedy


# ---------------------------------------------------------------------------------------------
# penalties, bias, bans, bitmask: on the model's logits, before temperature


def process_logits(raw_logits: torch.Tensor, metadata: SamplingMetadata, use_triton: bool) -> torch.Tensor:
    """Processed fp32 logits [B, V]; raw_logits itself when nothing applies (never written in place)."""
    m = metadata
    penalised = m.presence_penalty is not None or m.frequency_penalty is not None or m.repetition_penalty is not None
    prompt_mask = m.prompt_mask if m.repetition_penalty is not None else None
    logits = raw_logits
    bias_first = _bias_first(m)
    if bias_first:  # the repetition penalty scales the biased logits (vLLM's order)
        logits = _biased_copy(raw_logits, m)  # [B, V] fp32
    if penalised or m.token_bitmask is not None:
        if use_triton:
            from pagoda.kernels import sampling

            logits = sampling.process_logits(logits, m.state_rows, m.output_counts, prompt_mask,
                                             m.presence_penalty, m.frequency_penalty, m.repetition_penalty,
                                             m.token_bitmask, m.bitmask_rows)  # [B, V] new
        else:
            counts = prompts = None
            if penalised:
                assert m.output_counts is not None and m.state_rows is not None, "penalties need output_counts"
                counts = m.output_counts.index_select(0, m.state_rows)  # [B, V]
                prompts = prompt_mask.index_select(0, m.state_rows) if prompt_mask is not None else None
            logits = reference.process_logits(logits, counts, prompts, m.presence_penalty, m.frequency_penalty,
                                              m.repetition_penalty)  # [B, V] new
            if m.token_bitmask is not None:
                logits = apply_token_bitmask_host(logits, m.token_bitmask, m.bitmask_rows)  # [B, V]
    if (m.logit_bias_ids is not None and not bias_first) or m.banned_token_ids is not None:
        logits = _scatter_bias_and_bans(logits.clone() if logits is raw_logits else logits, m, not bias_first)
    return logits


def _bias_first(m: SamplingMetadata) -> bool:
    """Whether the logit bias goes in before the penalty pass: only a repetition penalty tells the orders apart."""
    return m.logit_bias_ids is not None and m.repetition_penalty is not None


def _biased_copy(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    """A new fp32 copy of logits [B, V] (any float dtype; never written) with the logit bias added."""
    return _add_bias(logits.float() if logits.dtype != torch.float32 else logits.clone(), m)  # [B, V] fp32


def _add_bias(logits: torch.Tensor, m: SamplingMetadata) -> torch.Tensor:
    """The logit bias added into logits [B, V] fp32 (owned by the caller)."""
    if m.logit_bias_ids is not None and m.logit_bias_values is not None:
        # padding adds 0.0 to id 0: harmless, and order-independent under duplicate ids
        logits.scatter_add_(1, m.logit_bias_ids, m.logit_bias_values)
    return logits


def _scatter_bias_and_bans(logits: torch.Tensor, m: SamplingMetadata, bias: bool = True) -> torch.Tensor:
    """Logit bias (unless already added: bias False), then min_tokens and bad_words bans (-inf), written into
    logits [B, V] fp32 (owned by the caller)."""
    if bias:
        _add_bias(logits, m)
    if m.banned_token_ids is not None:
        banned = m.banned_token_ids >= 0  # [B, K]
        values = torch.where(banned, float("-inf"), float("inf"))  # [B, K]; amin with +inf changes nothing
        logits.scatter_reduce_(1, m.banned_token_ids.clamp(min=0), values, reduce="amin")
    return logits


def apply_token_bitmask_host(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """reference.apply_token_bitmask on the CPU, for logits [B, V] fp32 that the caller owns (written in place
    or replaced): numpy unpacks the bits of the flagged rows (bitmask [B, >= V/32] int32, rows [B] bool, None:
    all) and a select writes -inf: ~1 ms for 16 rows of SmolLM2's 49k vocabulary on a busy 2-core machine,
    where the reference's per-token shifts took 12-28 ms."""
    assert sys.byteorder == "little" and bitmask.dtype == torch.int32 and bitmask.shape[0] == logits.shape[0]
    vocab_size = logits.shape[1]
    index = None if rows is None or bool(rows.all()) else rows.nonzero().squeeze(1)  # [K] or None: every row
    words = bitmask if index is None else bitmask.index_select(0, index)  # [K, W]
    bits = np.unpackbits(words.contiguous().numpy().view(np.uint8), axis=-1, count=vocab_size,
                         bitorder="little")  # [K, V] uint8: bit j of byte b is token 8 * b + j
    allowed = torch.from_numpy(bits).bool()  # [K, V]
    if index is None:
        return torch.where(allowed, logits, float("-inf"))  # [B, V] new (a select: masked_fill_ branches per token)
    logits[index] = torch.where(allowed, logits.index_select(0, index), float("-inf"))  # [K, V]
    return logits


# ---------------------------------------------------------------------------------------------
# truncation thresholds and the draw


def truncation_thresholds(logits: torch.Tensor, metadata: SamplingMetadata, use_triton: bool) -> torch.Tensor | None:
    """Per-row threshold [B] fp32 (keep logit >= threshold), or None when no row truncates."""
    m = metadata
    if m.top_k is None and m.top_p is None and m.min_p is None:
        return None
    if use_triton:
        from pagoda.kernels import sampling

        grouped = sampling.process_logits_grouped(logits, write_out=False, group_stats=True)
        threshold = _device_thresholds(logits, m, grouped)[0]  # [B]: top-k (with its top-p) and min-p
        if m.top_p is None:
            return threshold
        # top-p without top-k: the sampler draws by rejection and never needs it; here one program a row searches
        # over what min-p keeps (the threshold of such a row)
        whole = (m.top_p < 1.0) & (m.top_k <= 0) if m.top_k is not None else m.top_p < 1.0  # [B]
        temperature = torch.where(m.temperature == 0.0, 1.0, m.temperature).float()  # [B]
        top_p = torch.where(whole, m.top_p, 1.0).float().contiguous()  # [B]
        return torch.maximum(threshold, sampling.top_p_threshold(logits, temperature, top_p, threshold))  # [B]
    top_k = m.top_k
    if top_k is not None:
        max_top_k = min(m.max_top_k or int(top_k.max()), logits.shape[1])
        if max_top_k <= 0:
            top_k = None
    if top_k is None and m.top_p is None and m.min_p is None:
        return None
    return _candidate_thresholds(logits, m, top_k, max_top_k if top_k is not None else 0)  # [B]: no full sort


def _device_thresholds(logits: torch.Tensor, m: SamplingMetadata, grouped: GroupedLogits
                       ) -> tuple[torch.Tensor, tuple[TopCandidates, torch.Tensor] | None]:
    """The top-k (with its top-p) and min-p thresholds on CUDA for logits [B, V] and their group maxima / ties
    (grouped); top-p without top-k is not in them (the draw's rejection rounds apply it). Threshold [B] fp32, and
    when the gathered groups were used, them with whole_row [B] bool (rows whose draw needs the whole row)."""
    from pagoda.kernels import sampling

    temperature = torch.where(m.temperature == 0.0, 1.0, m.temperature).float()  # [B] contiguous
    threshold = torch.full_like(temperature, float("-inf"))  # [B]
    top_k = m.top_k
    max_top_k = min(m.max_top_k or int(top_k.max()), logits.shape[1]) if top_k is not None else 0
    top_p = m.top_p.float().contiguous() if m.top_p is not None else None
    candidates = None
    if max_top_k > 0:
        assert top_k is not None
        grouped_path = grouped.group_max is not None and grouped.group_ties is not None
        candidates = sampling.top_candidates(logits, max_top_k, grouped.group_max, with_values=not grouped_path)
        if candidates.gathered is not None and grouped.group_max is not None and grouped.group_ties is not None:
            # one kernel: k-th largest, top-p over the gathered groups, min-p (rows with top-k)
            min_p = m.min_p.float().contiguous() if m.min_p is not None else None
            threshold, whole_row = sampling.group_thresholds(candidates, grouped.group_max, grouped.group_ties,
                                                             top_k, top_p, min_p, temperature)  # [B], [B]
            return threshold, (candidates, whole_row)
        assert candidates.values is not None  # past TOP_K_MAX: torch.topk's values over the whole row
        has_k = top_k > 0  # [B]
        kth = candidates.values.gather(1, (top_k.clamp(1, max_top_k) - 1).unsqueeze(1)).squeeze(1)  # [B]
        threshold = torch.where(has_k, kth, threshold)  # [B]
    if m.min_p is not None:
        if candidates is not None and candidates.values is not None:
            row_max = candidates.values[:, 0]  # [B]
        elif grouped.group_max is not None:
            row_max = grouped.group_max.amax(dim=1)  # [B]
        else:
            row_max = logits.amax(dim=-1).float()  # [B]
        threshold = torch.maximum(threshold, row_max + temperature * torch.log(m.min_p))  # [B]
    if candidates is not None and top_p is not None:  # top-k rows: top-p over what top-k and min-p keep
        assert candidates.values is not None
        threshold = sampling.top_p_threshold(logits, temperature, top_p, threshold, candidates.values, top_k > 0,
                                             search_full_rows=False)  # [B]
    return threshold, None


NUCLEUS_CANDIDATES = 256  # first candidate width for top-p rows without top-k; x8 for the rows whose nucleus is wider


def _candidate_thresholds(logits: torch.Tensor, metadata: SamplingMetadata, top_k: torch.Tensor | None,
                          max_top_k: int) -> torch.Tensor:
    """CPU thresholds [B] from the rows' largest logits instead of a full sort of [B, V] (a 49k-id row's sort
    is most of a CPU decode step's sampling). Candidates: the batch's largest k, or for sampled top-p rows without
    top-k NUCLEUS_CANDIDATES, widened x8 (then to the whole row, where topk is the sort) for only the rows whose
    nucleus is wider. Top-p runs over the candidates with the mass of the whole set top-k and min-p keep
    {logit >= max(k-th, min-p's threshold)} (ties beyond the candidates included), so the result is
    reference.truncation_thresholds' (up to fp32 rounding where top_p equals a prefix's mass), except for greedy
    rows (T = 0): their threshold is the row's maximum, since the draw takes their argmax whatever the threshold."""
    m = metadata
    vocab_size = logits.shape[1]
    greedy = m.temperature == 0.0  # [B]
    temperature = torch.where(greedy, 1.0, m.temperature).unsqueeze(1)  # [B, 1]
    has_k = top_k > 0 if top_k is not None else torch.zeros_like(greedy)  # [B]
    nucleus = (m.top_p < 1.0) & ~has_k & ~greedy if m.top_p is not None else None  # [B]: top-p over the whole row
    width = max_top_k
    if nucleus is not None and bool(nucleus.any()):
        width = max(width, min(NUCLEUS_CANDIDATES, vocab_size))
    candidates = logits.topk(max(width, 1), dim=-1).values  # [B, K] descending
    row_max = candidates[:, :1]  # [B, 1]
    threshold = torch.full_like(row_max, float("-inf"))  # [B, 1]
    if max_top_k > 0:
        assert top_k is not None
        kth = candidates.gather(1, (top_k.clamp(1, max_top_k) - 1).unsqueeze(1))  # [B, 1]
        threshold = torch.where(has_k.unsqueeze(1), kth, threshold)  # [B, 1]
    if m.min_p is not None:  # before top-p, whose mass counts only what top-k and min-p keep (vLLM V1's order)
        threshold = torch.maximum(threshold, row_max + temperature * torch.log(m.min_p).unsqueeze(1))
    if m.top_p is not None:
        top_p = m.top_p.unsqueeze(1)  # [B, 1]
        weights = ((logits - row_max) / temperature).exp_().masked_fill_(logits < threshold, 0.0)  # [B, V]
        total = weights.sum(dim=1, keepdim=True)  # [B, 1]
        pth, reached = _top_p_cut(candidates, threshold, row_max, temperature, top_p, total)  # [B, 1], [B]
        short = nucleus & ~reached if nucleus is not None else None  # [B]: the nucleus is wider than K
        while short is not None and width < vocab_size and bool(short.any()):
            width = width * 8 if width * 32 < vocab_size else vocab_size
            rows = short.nonzero().squeeze(1)  # [R]
            wider = logits[rows].topk(width, dim=-1).values  # [R, K'] descending
            pth[rows], reached_rows = _top_p_cut(wider, threshold[rows], row_max[rows], temperature[rows],
                                                 top_p[rows], total[rows])
            short[rows] = ~reached_rows
        threshold = torch.where(top_p < 1.0, torch.maximum(threshold, pth), threshold)  # [B, 1]
    threshold = torch.where(greedy.unsqueeze(1), row_max, threshold)  # [B, 1]
    return threshold.squeeze(1)  # [B]


def _top_p_cut(candidates: torch.Tensor, threshold: torch.Tensor, row_max: torch.Tensor, temperature: torch.Tensor,
               top_p: torch.Tensor, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p threshold [R, 1] of rows from their largest logits candidates [R, K] (descending), given their
    top-k threshold, max, temperature, top_p and the mass of their whole kept set (each [R, 1]): the first
    candidate whose cumulative mass reaches top_p * total, else the top-k threshold; and whether it was reached
    [R] bool."""
    kept = candidates.masked_fill(candidates < threshold, float("-inf"))  # [R, K]
    cum = ((kept - row_max) / temperature).exp().cumsum(dim=1)  # [R, K]
    reached = cum >= top_p * total  # [R, K]
    found = reached.any(dim=1)  # [R]
    index = reached.int().argmax(dim=1, keepdim=True)  # [R, 1] first True (0 when none)
    return torch.where(found.unsqueeze(1), kept.gather(1, index), threshold), found  # [R, 1], [R]


# ---------------------------------------------------------------------------------------------


def gather_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor, max_num_logprobs: int | None,
                    listed_ids: torch.Tensor | None = None) -> SamplerOutput:
    """Logprobs of the raw model distribution (vLLM's default), not of the penalised one. listed_ids [B, K] (K <=
    max_num_logprobs; -1 where a row lists nothing): vLLM's logprob_token_ids, in place of those rows' top k."""
    if max_num_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = torch.log_softmax(raw_logits, dim=-1, dtype=torch.float32)  # [B, V] fp32, from any float dtype
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [B]
    top_logprobs, top_token_ids = logprobs.topk(max_num_logprobs, dim=-1)  # [B, k], [B, k] int64
    if listed_ids is not None:
        width = listed_ids.shape[1]
        assert width <= max_num_logprobs, "a row's listed ids are counted in the batch's logprobs width"
        listed = listed_ids >= 0  # [B, K]
        picked = logprobs.gather(1, listed_ids.clamp(min=0))  # [B, K]
        top_logprobs[:, :width] = torch.where(listed, picked, top_logprobs[:, :width])
        top_token_ids[:, :width] = torch.where(listed, listed_ids, top_token_ids[:, :width])
    ranks = (logprobs >= sampled[:, None]).sum(dim=-1)  # [B]: 1 for the likeliest, as the prompt's ranks (vLLM's)
    return SamplerOutput(token_ids, sampled, top_token_ids, top_logprobs, ranks)


# ---------------------------------------------------------------------------------------------
# beam search: each group's best continuations over [beams x vocabulary], batched over groups


def beam_candidates(logits: torch.Tensor, scores: torch.Tensor, temperature: torch.Tensor, group: torch.Tensor,
                    slot: torch.Tensor, num_groups: int, max_beams: int,
                    k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V] of every beam of the step's beam searches, row b being beam slot[b] [B] of group group[b]
    [B] with cumulative logprob scores[b] [B] fp32: each group's k best continuations score + log_softmax(logits
    / T) (T 0 or 1: the plain log-probabilities), best first, as token ids, parent slots and new scores, each
    [G, k] (a group with fewer than k continuations pads with -inf scores). A row's own top k first, then the
    top k of each group's [beams x k]: a group's k best lie among its rows' k best. No host sync."""
    num_rows, vocab_size = logits.shape
    row_k = min(k, vocab_size)
    t = torch.where(temperature > 0.0, temperature, 1.0).unsqueeze(1)  # [B, 1]
    log_probs = torch.log_softmax(logits.float() / t, dim=-1) + scores.unsqueeze(1)  # [B, V] fp32
    top = log_probs.topk(row_k, dim=-1)  # [B, k] values and token ids, best first
    columns = slot.unsqueeze(1) * row_k + torch.arange(row_k, device=logits.device)  # [B, k]
    grid = torch.full((num_groups, max_beams * row_k), float("-inf"), device=logits.device)  # [G, W * k]
    grid_ids = torch.zeros((num_groups, max_beams * row_k), dtype=torch.int64, device=logits.device)  # [G, W * k]
    rows = group.unsqueeze(1).expand(num_rows, row_k)  # [B, k]
    grid[rows, columns] = top.values
    grid_ids[rows, columns] = top.indices
    best = grid.topk(min(k, max_beams * row_k), dim=1)  # [G, k]
    return grid_ids.gather(1, best.indices), best.indices // row_k, best.values


def beam_continue(token_ids: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, stop_ids: torch.Tensor,
                  widths: torch.Tensor, max_width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's next running beams from its candidates token_ids, parents, scores [G, k] (best first), on the
    device (beam.BeamSearch.step and beam.assign_slots, vectorised): the first widths[g] [G] candidates whose token
    is not one of the group's stop_ids [G, S] (-1 pads), each placed in a slot as assign_slots does (a parent's
    first child keeps the parent's slot; other children take the slots left, in order). Returns, by slot, the
    parent slot, token and cumulative logprob [G, max_width] each; slots >= widths[g] continue themselves."""
    num_groups = token_ids.shape[0]
    device = token_ids.device
    hits = (token_ids.unsqueeze(2) == stop_ids.unsqueeze(1)).any(dim=2)  # [G, k]
    order = torch.sort(hits.to(torch.int32), dim=1, stable=True).indices[:, :max_width]  # [G, W] non-stops first
    slot_ids = torch.arange(max_width, device=device).expand(num_groups, max_width)  # [G, W]
    valid = slot_ids < widths.unsqueeze(1)  # [G, W]
    parent = torch.where(valid, parents.gather(1, order), slot_ids)  # [G, W] each new beam's parent slot
    earlier = torch.ones(max_width, max_width, dtype=torch.bool, device=device).tril(-1)  # [j, i]: i < j
    first = ~((parent.unsqueeze(2) == parent.unsqueeze(1)) & earlier).any(dim=2)  # [G, W] its parent's first child
    taken = ((parent.unsqueeze(2) == slot_ids.unsqueeze(1)) & first.unsqueeze(2)).any(dim=1)  # [G, W] by slot
    free = torch.sort(taken.to(torch.int32), dim=1, stable=True).indices  # [G, W] free slots first, ascending
    later_rank = (torch.cumsum((~first).to(torch.int64), dim=1) - 1).clamp(min=0)  # [G, W]
    slot = torch.where(first, parent, free.gather(1, later_rank))  # [G, W] the slot of each new beam
    slot_parent = torch.empty_like(parent).scatter_(1, slot, parent)  # [G, W]
    slot_token = torch.zeros_like(parent).scatter_(1, slot, torch.where(valid, token_ids.gather(1, order), 0))
    slot_score = torch.zeros_like(scores[:, :max_width]).scatter_(
        1, slot, torch.where(valid, scores.gather(1, order), 0.0))  # [G, W]
    return slot_parent, slot_token, slot_score
