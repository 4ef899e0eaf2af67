"""The sampler as of commit c011cff (before per-row state and fused kernels), frozen: bench/sampler_bench.py's
"old" column in bench/RESULTS.md. Full-row fp32 passes and one ascending sort for top-k/top-p, as vLLM's.

Only its algorithm is kept here. The seeded noise (kernels/reference.py's counter hash, the draw contract every
path shares, which is why old and new draw the same tokens) and the output type are today's, imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.kernels.reference import gumbel_noise
from pagoda.services.worker.sampler import SamplerOutput


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling settings for the B rows sampled this step (all tensors on the logits' device)."""

    temperature: torch.Tensor  # [B] float32; 0 means greedy for that row
    seeds: torch.Tensor  # [B] int64, the request's seed, in [0, 2^63)
    offsets: torch.Tensor  # [B] int64, index of the sampled token within the request's output
    top_k: torch.Tensor | None = None  # [B] int64, 0 or -1 = off; None when no row uses top-k
    top_p: torch.Tensor | None = None  # [B] float32, 1.0 = off; None when no row uses it
    min_p: torch.Tensor | None = None  # [B] float32, 0.0 = off; None when no row uses it
    presence_penalty: torch.Tensor | None = None  # [B] float32; None when no row has any penalty
    frequency_penalty: torch.Tensor | None = None  # [B] float32
    repetition_penalty: torch.Tensor | None = None  # [B] float32
    prompt_token_ids: torch.Tensor | None = None  # [B, P] int64 padded with vocab_size
    output_token_ids: torch.Tensor | None = None  # [B, O] int64 padded with vocab_size
    logit_bias_ids: torch.Tensor | None = None  # [B, K] int64 padded with vocab_size; None when no row biases
    logit_bias_values: torch.Tensor | None = None  # [B, K] float32
    banned_token_ids: torch.Tensor | None = None  # [B, K] int64 padded with vocab_size
    max_num_logprobs: int | None = None  # None: no logprobs; k >= 0: sampled logprob plus top k
    all_greedy: bool = False  # every row greedy: skip the random path entirely


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
    """Pick one token per row of `logits` [B, V]; no host sync, no loop over rows."""
    raw_logits = logits.float()  # [B, V]
    logits = apply_penalties(raw_logits, metadata)  # [B, V]; every step is out of place: raw stays intact
    logits = apply_logit_bias(logits, metadata.logit_bias_ids, metadata.logit_bias_values)  # [B, V]
    logits = apply_banned_tokens(logits, metadata.banned_token_ids)  # [B, V]
    token_ids = logits.argmax(dim=-1)  # [B] int64
    if not metadata.all_greedy:
        token_ids = torch.where(is_greedy_row(metadata), token_ids, sample_random(logits, metadata))  # [B]
    return gather_logprobs(raw_logits, token_ids, metadata.max_num_logprobs)


def is_greedy_row(metadata: SamplingMetadata) -> torch.Tensor:
    """Rows whose answer is the argmax: temperature 0, or top_k == 1 (ties then break like argmax)."""
    greedy = metadata.temperature == 0.0  # [B] bool
    if metadata.top_k is not None:
        greedy = greedy | (metadata.top_k == 1)  # [B] bool
    return greedy


# ---------------------------------------------------------------------------------------------
# penalties and bans: on the model's logits, before temperature (OpenAI / vLLM order)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition over prompt+output tokens, then frequency and presence over output tokens."""
    if (metadata.presence_penalty is None and metadata.frequency_penalty is None
            and metadata.repetition_penalty is None):
        return logits
    num_rows, vocab_size = logits.shape
    output_counts = token_counts(metadata.output_token_ids, num_rows, vocab_size, logits.device)  # [B, V]
    output_seen = output_counts > 0  # [B, V] bool
    if metadata.repetition_penalty is not None:
        prompt_seen = token_mask(metadata.prompt_token_ids, num_rows, vocab_size, logits.device)  # [B, V]
        seen = output_seen | prompt_seen  # [B, V] bool
        penalty = metadata.repetition_penalty.unsqueeze(1)  # [B, 1]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)  # [B, V]
        logits = torch.where(seen, penalised, logits)  # [B, V]
    if metadata.frequency_penalty is not None:
        logits = logits - metadata.frequency_penalty.unsqueeze(1) * output_counts  # [B, V]
    if metadata.presence_penalty is not None:
        logits = logits - metadata.presence_penalty.unsqueeze(1) * output_seen  # [B, V]
    return logits


def token_counts(token_ids: torch.Tensor | None, num_rows: int, vocab_size: int,
                 device: torch.device) -> torch.Tensor:
    """How often each vocab id occurs per row; padding (= vocab_size) lands in a dropped extra column."""
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=device)  # [B, V+1]
    if token_ids is not None:
        ones = torch.ones(token_ids.shape, dtype=torch.float32, device=device)  # [B, O]
        counts.scatter_add_(1, token_ids, ones)
    return counts[:, :vocab_size]  # [B, V]


def token_mask(token_ids: torch.Tensor | None, num_rows: int, vocab_size: int,
               device: torch.device) -> torch.Tensor:
    """True where a vocab id occurs in the row's padded id list."""
    mask = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=device)  # [B, V+1]
    if token_ids is not None:
        mask.scatter_(1, token_ids, True)
    return mask[:, :vocab_size]  # [B, V]


def apply_logit_bias(logits: torch.Tensor, ids: torch.Tensor | None,
                     values: torch.Tensor | None) -> torch.Tensor:
    """Add each row's bias to its chosen ids; padding ids (= vocab_size) land in a dropped extra column."""
    if ids is None or values is None:
        return logits
    num_rows, vocab_size = logits.shape
    bias = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=logits.device)  # [B, V+1]
    bias.scatter_add_(1, ids, values.to(logits.dtype))
    return logits + bias[:, :vocab_size]  # [B, V]


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: torch.Tensor | None) -> torch.Tensor:
    """-inf on ids a row must not emit yet (EOS and stop ids under min_tokens)."""
    if banned_token_ids is None:
        return logits
    num_rows, vocab_size = logits.shape
    banned = token_mask(banned_token_ids, num_rows, vocab_size, logits.device)  # [B, V] bool
    return logits.masked_fill(banned, float("-inf"))  # [B, V]


# ---------------------------------------------------------------------------------------------
# the random path: temperature, truncation, then Gumbel-max with hashed noise


def sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Token ids [B] drawn from softmax(logits / T) after top-k, top-p and min-p truncation."""
    # Greedy rows get T=1 here only to stay finite; their result is replaced by the argmax.
    temperature = torch.where(metadata.temperature == 0.0, 1.0, metadata.temperature)  # [B]
    logits = logits / temperature.unsqueeze(1)  # [B, V]
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)  # [B, V]
    logits = apply_min_p(logits, metadata.min_p)  # [B, V]
    noise = gumbel_noise(metadata.seeds, metadata.offsets, logits.shape[1])  # [B, V]
    return noise.add_(logits).argmax(dim=-1)  # [B] int64


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf what top-k / top-p drop; one ascending sort serves both (vLLM's scheme)."""
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # [B, V] ascending, [B, V] int64
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab_size, top_k).clamp(1, vocab_size)  # [B] int64
        kth_largest = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))  # [B, 1]
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        # Drop a token when it and everything below it hold <= 1 - p of the mass: what stays is the
        # smallest top set with mass >= p. The largest token always stays.
        cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
        drop = cum_probs <= (1.0 - top_p).unsqueeze(1)  # [B, V] bool
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)  # [B, V]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Drop tokens with prob < min_p * max_prob, compared in log space (no softmax needed)."""
    if min_p is None:
        return logits
    max_logit = logits.amax(dim=-1, keepdim=True)  # [B, 1]
    threshold = max_logit + torch.log(min_p).unsqueeze(1)  # [B, 1]; log(0) = -inf keeps everything
    return logits.masked_fill(logits < threshold, float("-inf"))  # [B, V]


# ---------------------------------------------------------------------------------------------


def gather_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                    max_num_logprobs: int | None) -> SamplerOutput:
    """Logprobs of the raw model distribution (vLLM's default), not of the penalised one."""
    if max_num_logprobs is None:
        return SamplerOutput(token_ids, None, None, None)
    logprobs = torch.log_softmax(raw_logits, dim=-1)  # [B, V]
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [B]
    top_logprobs, top_token_ids = logprobs.topk(max_num_logprobs, dim=-1)  # [B, k], [B, k] int64
    return SamplerOutput(token_ids, sampled, top_token_ids, top_logprobs)
