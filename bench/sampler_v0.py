"""The sampler as of commit c011cff (before per-row state and fused kernels): bench/sampler_bench.py's baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9  # odd: spreads consecutive vocab ids over the whole 32-bit range
ROW_KEY_SALT = 0x5BD1E995
UNIFORM_SCALE = 2.0**-24  # 24-bit odd numerators give u in (0, 1), exact in float32


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


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32 logprob of the sampled token
    top_token_ids: torch.Tensor | None  # [B, k] int64
    top_logprobs: torch.Tensor | None  # [B, k] float32


class Sampler:
    """Stateless callable wrapper so the worker can hold a sampler object like a model module."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return sample(logits, metadata)


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
# counter-based noise: a pure function of (seed, offset, vocab id), so a seeded request draws the
# same token whatever else shares its batch, and no torch.Generator per row is needed.
# Values are 32-bit words held in int64; every product stays < 2^49 and every shift sees x >= 0.
# The [B, V] work runs in place (trailing underscore): fresh [B, V] temporaries cost ~3x on CPU.


def mul32_(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x = x * constant mod 2^32 in place, for x in [0, 2^32), split in 16-bit halves: no int64 overflow."""
    low = x * (constant & 0xFFFF)  # same shape as x, < 2^48
    return x.mul_(constant >> 16).bitwise_and_(0xFFFF).bitwise_left_shift_(16).add_(low).bitwise_and_(MASK32)


def mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons) in place: a bijective 32-bit finaliser with near-ideal avalanche."""
    x ^= x >> 16
    mul32_(x, 0x7FEB352D)
    x ^= x >> 15
    mul32_(x, 0x846CA68B)
    x ^= x >> 16
    return x


def row_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row [B] absorbing all 63 seed bits and the offset, word by word."""
    key = mix32_((offsets >> 32) ^ ROW_KEY_SALT)  # [B]
    key = mix32_(key ^ (offsets & MASK32))  # [B]
    key = mix32_(key ^ (seeds >> 32))  # [B]
    return mix32_(key ^ (seeds & MASK32))  # [B]


def uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u [B, V] float32 strictly inside (0, 1), a hash of (seed, offset, vocab id)."""
    vocab_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [V]
    vocab_words = mul32_(vocab_ids, GOLDEN32)  # [V]
    # The golden-ratio spread makes two rows' XOR-keyed inputs almost never coincide inside [0, V).
    bits = mix32_(row_keys(seeds, offsets).unsqueeze(1) ^ vocab_words.unsqueeze(0))  # [B, V] in [0, 2^32)
    numerators = bits.bitwise_right_shift_(8).bitwise_or_(1)  # [B, V] odd in [1, 2^24): exact in float32
    return numerators.float().mul_(UNIFORM_SCALE)  # [B, V], never 0 or 1


def gumbel_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, V]: argmax(logits + noise) samples from softmax(logits)."""
    return uniform_noise(seeds, offsets, vocab_size).log_().neg_().log_().neg_()  # [B, V] = -log(-log u)


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
