"""Tests for the batched sampler: greedy, seeded reproducibility, truncation, penalties, bans, logprobs."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import msgspec
import numpy as np
import pytest
import torch

from pagoda.kernels import reference
from pagoda.kernels.reference import mix32_, mul32_, row_keys, uniform_noise
from pagoda.services.worker.sampler import Sampler, SamplingMetadata, process_logits, sample


def make_metadata(num_rows: int, temperature: float | torch.Tensor = 1.0, seed: int = 1234,
                  **fields) -> SamplingMetadata:
    """Same seed for every row, offsets 0..B-1; `fields` override any SamplingMetadata field."""
    temperature = torch.as_tensor(temperature, dtype=torch.float32).expand(num_rows)  # [B]
    base = dict(
        temperature=temperature,
        seeds=torch.full((num_rows,), seed, dtype=torch.int64),  # [B]
        offsets=torch.arange(num_rows, dtype=torch.int64),  # [B]
        all_greedy=bool((temperature == 0.0).all()),
    )
    base.update(fields)
    return SamplingMetadata(**base)


def empirical(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(token_ids, minlength=vocab_size).float() / token_ids.numel()  # [V]


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p - q).abs().sum().item()


# ---------------------------------------------------------------------------------------------
# 1. greedy


@pytest.mark.parametrize("num_rows,vocab_size", [(1, 7), (5, 100), (33, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_temperature_zero_is_argmax(num_rows: int, vocab_size: int, dtype: torch.dtype) -> None:
    torch.manual_seed(num_rows * vocab_size)
    logits = torch.randn(num_rows, vocab_size).to(dtype)  # [B, V]
    expected = logits.float().argmax(dim=-1)  # [B]
    for all_greedy in (True, False):  # the fast path and the mixed path must agree
        metadata = make_metadata(num_rows, temperature=0.0, all_greedy=all_greedy)
        assert torch.equal(sample(logits, metadata).token_ids, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_argmax_kernel_is_torch_argmax(dtype: torch.dtype) -> None:
    """The greedy path's split argmax (kernels/sampling.greedy_argmax, the GPU's all-greedy sampler): torch.argmax's
    id on random rows, ties inside and across splits (first id), a NaN (largest: its first id), -inf rows (id 0),
    a vocabulary that is not a multiple of the split; and through sample() with the kernels."""
    from pagoda.kernels.sampling import ARGMAX_BLOCK, greedy_argmax

    device = kernel_device()
    vocab_size = 3 * ARGMAX_BLOCK + 100  # four splits of ARGMAX_BLOCK ids, the last one short
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, vocab_size, generator=gen).to(dtype)  # [B, V]
    logits[1] = torch.randint(0, 3, (vocab_size,), generator=gen).to(dtype)  # ties everywhere: first 2
    logits[2, [50, ARGMAX_BLOCK + 5, 3 * ARGMAX_BLOCK + 7]] = 9.0  # equal maxima in three splits
    logits[3, [2 * ARGMAX_BLOCK + 1, 40]] = float("nan")  # NaN beats every number: the first NaN
    logits[3, 10] = float("inf")
    logits[4] = float("-inf")
    logits[5, -1] = 100.0  # the maximum in the short last split
    logits[6, :ARGMAX_BLOCK] = float("-inf")  # a whole split of -inf, the maximum elsewhere
    logits = logits.to(device)
    expected = logits.cpu().argmax(dim=-1)
    assert torch.equal(greedy_argmax(logits, split=ARGMAX_BLOCK).cpu(), expected)
    assert torch.equal(greedy_argmax(logits, split=2 * ARGMAX_BLOCK).cpu(), expected)
    assert torch.equal(greedy_argmax(logits[:, :-3]).cpu(), logits[:, :-3].cpu().argmax(dim=-1))  # strided rows
    assert greedy_argmax(logits[:0]).shape == (0,)
    metadata = make_metadata(7, temperature=0.0, all_greedy=True)
    metadata = dataclasses.replace(metadata, temperature=metadata.temperature.to(device),
                                   seeds=metadata.seeds.to(device), offsets=metadata.offsets.to(device))
    assert torch.equal(sample(logits, metadata, use_kernels=True).token_ids.cpu(), expected)
    with pytest.raises(ValueError, match="multiple"):
        greedy_argmax(logits, split=ARGMAX_BLOCK + 1)


def test_greedy_rows_inside_a_random_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 300)  # [B, V]
    temperature = torch.tensor([0.0, 1.0] * 8)  # [B]
    top_k = torch.tensor([0, 0, 0, 1] * 4)  # [B]; top_k == 1 is greedy too, whatever the temperature
    out = Sampler()(logits, make_metadata(16, temperature=temperature, top_k=top_k))
    greedy = (temperature == 0) | (top_k == 1)  # [B]
    assert torch.equal(out.token_ids[greedy], logits.argmax(dim=-1)[greedy])


def test_input_logits_are_not_modified() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 50)  # [B, V]
    before = logits.clone()  # [B, V]
    metadata = make_metadata(
        4, top_k=torch.full((4,), 5), top_p=torch.full((4,), 0.9), min_p=torch.full((4,), 0.1),
        repetition_penalty=torch.full((4,), 1.3), banned_token_ids=torch.tensor([[0, 1]] * 4),
        **count_tables([[1, 2]] * 4, [[3]] * 4, 50),
        logit_bias_ids=torch.tensor([[4]] * 4), logit_bias_values=torch.full((4, 1), 2.0),
    )
    sample(logits, metadata)
    assert torch.equal(logits, before)
    assert torch.equal(metadata.seeds, torch.full((4,), 1234))
    assert torch.equal(metadata.offsets, torch.arange(4))


# ---------------------------------------------------------------------------------------------
# 2. seeded reproducibility


def test_hash_matches_python_reference() -> None:
    def mix32_reference(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    rng = random.Random(0)
    edges = [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]
    words = edges + [rng.getrandbits(32) for _ in range(500)]
    x = torch.tensor(words, dtype=torch.int64)  # [N]
    assert mix32_(x.clone()).tolist() == [mix32_reference(w) for w in words]
    assert mul32_(x.clone(), 0xFFFFFFFF).tolist() == [(w * 0xFFFFFFFF) & 0xFFFFFFFF for w in words]


def test_uniform_noise_range_and_mean() -> None:
    seeds = torch.tensor([0, 1, 2**63 - 1, 2**62], dtype=torch.int64)  # [B]
    u = uniform_noise(seeds, torch.tensor([0, 5, 2**40, 7]), 5000)  # [B, V]
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01


def test_all_seed_bits_matter() -> None:
    base = 0x123456789ABCDEF
    seeds = torch.tensor([base] + [base ^ (1 << bit) for bit in range(63)], dtype=torch.int64)  # [64]
    keys = row_keys(seeds, torch.zeros(64, dtype=torch.int64))  # [64]
    assert len(set(keys.tolist())) == 64


def test_seeded_draw_independent_of_batch_companions() -> None:
    torch.manual_seed(2)
    vocab_size = 500
    row = torch.randn(vocab_size) * 0.5  # [V]: flat enough that the draw really depends on the noise
    seed, offset, temperature = 987654321987, 17, 0.9

    def draw_in_batch(num_rows: int, position: int) -> int:
        logits = torch.randn(num_rows, vocab_size)  # [B, V] random companions
        logits[position] = row
        seeds = torch.randint(0, 2**62, (num_rows,))  # [B]
        offsets = torch.randint(0, 1000, (num_rows,))  # [B]
        temperatures = torch.rand(num_rows) + 0.5  # [B]
        seeds[position], offsets[position], temperatures[position] = seed, offset, temperature
        metadata = SamplingMetadata(
            temperature=temperatures, seeds=seeds, offsets=offsets, top_k=torch.full((num_rows,), 400),
            top_p=torch.full((num_rows,), 0.97), min_p=torch.full((num_rows,), 0.02),
        )
        return sample(logits, metadata).token_ids[position].item()

    alone = draw_in_batch(1, 0)
    for num_rows, position in [(2, 1), (7, 0), (7, 3), (64, 63), (129, 50)]:
        assert draw_in_batch(num_rows, position) == alone


def test_offsets_vary_and_seeds_differ() -> None:
    vocab_size, num_draws = 100, 64
    logits = torch.zeros(num_draws, vocab_size)  # [B, V] uniform distribution

    def draws(seed: int) -> list[int]:
        return sample(logits, make_metadata(num_draws, seed=seed)).token_ids.tolist()

    first = draws(42)
    assert first == draws(42)
    assert len(set(first)) > 30  # 64 uniform draws over 100 ids hit ~47 distinct ids
    for other in (43, 42 + 2**40, 42 + 2**62):
        second = draws(other)
        assert sum(a == b for a, b in zip(first, second, strict=True)) < 8  # ~0.64 matches expected


# ---------------------------------------------------------------------------------------------
# 3. truncation: excluded tokens never appear; the rest follow the renormalised distribution

NUM_DRAWS = 20_000
PROBS = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.08, 0.06, 0.04, 0.03, 0.015, 0.005])  # [10]
PERMUTATION = torch.tensor([3, 7, 0, 9, 1, 5, 2, 8, 4, 6])  # [10]: the ranking is not the id order


def draw_many(logits_row: torch.Tensor, **fields) -> torch.Tensor:
    """NUM_DRAWS draws of one logits row via distinct offsets, as one batch [NUM_DRAWS]."""
    logits = logits_row.expand(NUM_DRAWS, -1)  # [N, V]
    return sample(logits, make_metadata(NUM_DRAWS, seed=7, **fields)).token_ids


def check_distribution(token_ids: torch.Tensor, target: torch.Tensor) -> None:
    """No draw outside target's support and TV < 0.05 (expected TV here is ~0.01)."""
    assert (target[token_ids] > 0).all(), "an excluded token was sampled"
    assert total_variation(empirical(token_ids, target.numel()), target) < 0.05


def renormalised(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, probs, 0.0)  # [V]
    return kept / kept.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_plain_temperature_distribution(temperature: float) -> None:
    probs = PROBS[PERMUTATION]  # [V]
    target = torch.softmax(probs.log() / temperature, dim=-1)  # [V]
    check_distribution(draw_many(probs.log(), temperature=temperature), target)


def test_top_k_distribution() -> None:
    probs = PROBS[PERMUTATION]  # [V]
    keep = probs >= PROBS[3]  # the 4 most likely
    check_distribution(draw_many(probs.log(), top_k=torch.full((NUM_DRAWS,), 4)), renormalised(probs, keep))


def test_top_p_distribution() -> None:
    probs = PROBS[PERMUTATION]  # [V]
    keep = probs >= PROBS[2]  # 0.30 + 0.20 = 0.50 < 0.6 <= 0.65: the smallest set with mass >= 0.6
    top_p = torch.full((NUM_DRAWS,), 0.6)  # [N]
    check_distribution(draw_many(probs.log(), top_p=top_p), renormalised(probs, keep))


def test_min_p_distribution() -> None:
    probs = PROBS[PERMUTATION]  # [V]
    keep = probs >= 0.25 * 0.30  # min_p 0.25 of the top prob 0.30: keeps 0.30 .. 0.08
    min_p = torch.full((NUM_DRAWS,), 0.25)  # [N]
    check_distribution(draw_many(probs.log(), min_p=min_p), renormalised(probs, keep))


def test_top_k_top_p_min_p_combined_with_temperature() -> None:
    probs = PROBS[PERMUTATION]  # [V]
    temperature = 2.0
    scaled = torch.softmax(probs.log() / temperature, dim=-1)  # [V] flatter
    keep = probs >= PROBS[5]  # top-k 6 first
    after_k = renormalised(scaled, keep)  # [V]
    sorted_probs = after_k.sort(descending=True).values  # [V]
    assert sorted_probs[:4].sum() < 0.8 < sorted_probs[:5].sum()  # so top-p 0.8 keeps the top 5
    keep = keep & (after_k >= sorted_probs[4])
    assert (after_k[keep] >= 0.3 * sorted_probs[0]).all()  # and min-p 0.3 removes none of them
    token_ids = draw_many(
        probs.log(), temperature=temperature, top_k=torch.full((NUM_DRAWS,), 6),
        top_p=torch.full((NUM_DRAWS,), 0.8), min_p=torch.full((NUM_DRAWS,), 0.3),
    )
    check_distribution(token_ids, renormalised(scaled, keep))


def test_per_row_settings_with_off_values() -> None:
    """top_k 0 / -1 and top_p 1.0 are off for their rows while other rows truncate."""
    probs = PROBS[PERMUTATION]  # [V]
    half = NUM_DRAWS // 2
    top_k = torch.tensor([2, 0] * half)  # [N]
    top_p = torch.tensor([1.0, 1.0] * half)  # [N]
    token_ids = draw_many(probs.log(), top_k=top_k, top_p=top_p)  # [N]
    check_distribution(token_ids[0::2], renormalised(probs, probs >= PROBS[1]))
    check_distribution(token_ids[1::2], probs)
    token_ids = draw_many(probs.log(), top_k=torch.tensor([-1, 3] * half))  # [N]
    check_distribution(token_ids[0::2], probs)
    check_distribution(token_ids[1::2], renormalised(probs, probs >= PROBS[2]))


# ---------------------------------------------------------------------------------------------
# 4. penalties against a per-row Python reference


def reference_penalties(logits: list[float], prompt: list[int], output: list[int], presence: float,
                        frequency: float, repetition: float) -> list[float]:
    logits = list(logits)
    for token in set(prompt) | set(output):
        logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
    for token, count in Counter(output).items():
        logits[token] -= frequency * count + presence
    return logits


def pad(rows: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max(1, max(len(row) for row in rows))
    return torch.tensor([row + [pad_id] * (width - len(row)) for row in rows], dtype=torch.int64)  # [B, W]


def count_tables(outputs: list[list[int]], prompts: list[list[int]] | None, vocab_size: int) -> dict:
    """SamplingMetadata fields for per-row output counts [B, V] and prompt presence [B, V] (row b at b)."""
    counts = torch.zeros(len(outputs), vocab_size, dtype=torch.int32)  # [B, V]
    for b, ids in enumerate(outputs):
        for token in ids:
            counts[b, token] += 1
    fields = dict(output_counts=counts, state_rows=torch.arange(len(outputs)))
    if prompts is not None:
        mask = torch.zeros(len(outputs), vocab_size, dtype=torch.bool)  # [B, V]
        for b, ids in enumerate(prompts):
            mask[b, ids] = True
        fields["prompt_mask"] = mask
    return fields


def test_penalties_match_reference() -> None:
    rng = random.Random(3)
    torch.manual_seed(3)
    num_rows, vocab_size = 9, 40
    logits = torch.randn(num_rows, vocab_size) * 3  # [B, V]
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randrange(0, 12))] for _ in range(num_rows)]
    outputs = [[rng.randrange(vocab_size) for _ in range(rng.randrange(0, 20))] for _ in range(num_rows)]
    presence = [rng.uniform(-2, 2) for _ in range(num_rows)]
    frequency = [rng.uniform(-2, 2) for _ in range(num_rows)]
    repetition = [rng.uniform(0.5, 2.0) for _ in range(num_rows)]
    presence[0], frequency[0], repetition[0] = 0.0, 0.0, 1.0  # a row with no penalty shares the batch
    metadata = make_metadata(
        num_rows, temperature=0.0,
        presence_penalty=torch.tensor(presence), frequency_penalty=torch.tensor(frequency),
        repetition_penalty=torch.tensor(repetition),
        **count_tables(outputs, prompts, vocab_size),
    )
    expected = torch.tensor([
        reference_penalties(logits[b].tolist(), prompts[b], outputs[b],
                            presence[b], frequency[b], repetition[b])
        for b in range(num_rows)
    ])  # [B, V]
    penalised = process_logits(logits, metadata, use_triton=False)  # [B, V]
    torch.testing.assert_close(penalised, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(penalised[0], logits[0])
    assert torch.equal(sample(logits, metadata).token_ids, expected.argmax(dim=-1))


def test_frequency_penalty_alone_without_prompt_ids() -> None:
    logits = torch.zeros(2, 6)  # [B, V]
    metadata = make_metadata(
        2, temperature=0.0, frequency_penalty=torch.tensor([0.5, 0.0]),
        **count_tables([[1, 1], [2]], None, 6),
    )
    expected = torch.tensor([[0.0, -1.0, 0, 0, 0, 0], [0.0] * 6])  # [B, V]
    assert torch.equal(process_logits(logits, metadata, use_triton=False), expected)


# ---------------------------------------------------------------------------------------------
# 5. bans and logprobs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_banned_tokens_never_sampled(temperature: float) -> None:
    torch.manual_seed(4)
    num_rows, vocab_size = 4000, 12
    logits = torch.randn(num_rows, vocab_size)  # [B, V]
    logits[:, 5] = 20.0  # the argmax everywhere, and banned everywhere
    half = num_rows // 2
    banned = torch.tensor([[5, 3, -1]] * half + [[5, -1, -1]] * half)  # [B, 3] padded with -1
    metadata = make_metadata(num_rows, temperature=temperature, banned_token_ids=banned)
    token_ids = sample(logits, metadata).token_ids  # [B]
    assert not (token_ids == 5).any()
    assert not (token_ids[:half] == 3).any()
    if temperature == 0.0:
        masked = logits.clone()  # [B, V]
        masked[:, 5] = float("-inf")
        assert torch.equal(token_ids[half:], masked[half:].argmax(dim=-1))
    else:
        assert (token_ids[half:] == 3).any()  # banned only in the first half


def test_logit_bias_shifts_the_distribution_per_row() -> None:
    """Row 0 biases token 2 by +ln 3 (so its probability triples against the rest); row 1 biases nothing
    (padding only); greedy rows follow the biased argmax."""
    num_rows, vocab_size = 20000, 4
    logits = torch.zeros(num_rows, vocab_size)  # [B, V]: uniform before the bias
    half = num_rows // 2
    ids = torch.tensor([[2, 0]] * half + [[0, 0]] * half)  # [B, 2] padded with id 0, value 0
    values = torch.tensor([[torch.log(torch.tensor(3.0)).item(), 0.0]] * half + [[0.0, 0.0]] * half)
    metadata = make_metadata(num_rows, temperature=1.0, logit_bias_ids=ids, logit_bias_values=values)
    token_ids = sample(logits, metadata).token_ids  # [B]
    biased = torch.tensor([1 / 6, 1 / 6, 3 / 6, 1 / 6])
    assert total_variation(empirical(token_ids[:half], vocab_size), biased) < 0.02
    assert total_variation(empirical(token_ids[half:], vocab_size), torch.full((vocab_size,), 0.25)) < 0.02
    greedy_logits = torch.randn(3, vocab_size)  # [3, V]
    top = greedy_logits.argmax(dim=-1)  # [3]
    ids = torch.stack([top, torch.zeros_like(top)], dim=1)  # [3, 2]: push each row's argmax away
    values = torch.tensor([[-100.0, 0.0]] * 3)  # [3, 2]
    greedy = make_metadata(3, temperature=0.0, logit_bias_ids=ids, logit_bias_values=values)
    expected = greedy_logits.scatter(1, top[:, None], -math.inf).argmax(dim=-1)  # [3]
    output = sample(greedy_logits, dataclasses.replace(greedy, max_num_logprobs=0))
    assert torch.equal(output.token_ids, expected)
    assert output.logprobs is not None  # logprobs stay those of the model's own distribution
    assert torch.allclose(output.logprobs, torch.log_softmax(greedy_logits, -1).gather(1, expected[:, None])[:, 0])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_of_raw_logits(temperature: float) -> None:
    torch.manual_seed(5)
    num_rows, vocab_size, num_top = 6, 64, 5
    logits = torch.randn(num_rows, vocab_size, dtype=torch.bfloat16)  # [B, V]
    metadata = make_metadata(
        num_rows, temperature=temperature, max_num_logprobs=num_top,
        repetition_penalty=torch.full((num_rows,), 1.5),
        **count_tables(torch.randint(0, vocab_size, (num_rows, 8)).tolist(), None, vocab_size),
        top_k=torch.full((num_rows,), 10),
    )
    out = sample(logits, metadata)
    expected = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    torch.testing.assert_close(out.logprobs, expected.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.dtype == torch.float32
    assert out.top_token_ids.shape == (num_rows, num_top) and out.top_token_ids.dtype == torch.int64
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    torch.testing.assert_close(out.top_logprobs, expected.gather(1, out.top_token_ids))
    torch.testing.assert_close(out.top_logprobs, expected.topk(num_top, dim=-1).values)
    for row in range(num_rows):  # the sampled token's rank: 1 + how many tokens the raw distribution puts above it
        chosen = expected[row, out.token_ids[row]].item()
        assert out.ranks[row].item() == sum(value >= chosen for value in expected[row].tolist())


def test_logprobs_zero_and_none() -> None:
    logits = torch.randn(3, 20)  # [B, V]
    out = sample(logits, make_metadata(3, max_num_logprobs=0))
    assert out.top_token_ids.shape == (3, 0) and out.top_logprobs.shape == (3, 0)
    assert out.logprobs.shape == (3,)
    out = sample(logits, make_metadata(3))
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None


# ---------------------------------------------------------------------------------------------
# 6. truncation thresholds against a per-row sort-based rule (ties included)


def sorted_rule_keep(row: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[bool]:
    """The rule of reference.truncation_thresholds, one row in float64 Python: keep logit >= threshold. vLLM V1's
    order: top-k and min-p, then top-p over what they keep."""
    values = sorted(row, reverse=True)
    temperature = temperature or 1.0
    threshold = -math.inf
    if top_k > 0:
        threshold = values[min(top_k, len(values)) - 1]
    if min_p > 0.0:
        threshold = max(threshold, values[0] + temperature * math.log(min_p))
    if top_p < 1.0:
        kept = [v for v in values if v >= threshold]
        weights = [math.exp((v - kept[0]) / temperature) for v in kept]
        total, mass = sum(weights), 0.0
        for v, w in zip(kept, weights, strict=True):
            mass += w
            if mass >= top_p * total:
                threshold = max(threshold, v)
                break
    return [v >= threshold for v in row]


def random_settings(num_rows: int, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    top_k = torch.randint(0, vocab_size + 3, (num_rows,), generator=gen)  # [B]: some over V
    top_k[::3] = 0
    top_p = torch.rand(num_rows, generator=gen) * 0.9 + 0.05  # [B]
    top_p[1::4] = 1.0
    min_p = torch.rand(num_rows, generator=gen) * 0.3  # [B]
    min_p[::2] = 0.0
    temperature = torch.rand(num_rows, generator=gen) * 1.5 + 0.2  # [B]
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def tied_logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_rows, vocab_size, generator=gen) * 8).round() / 4  # [B, V]: many ties


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_threshold_masks_match_sorted_rule(seed: int) -> None:
    num_rows, vocab_size = 24, 97
    logits = tied_logits(num_rows, vocab_size, seed)  # [B, V]
    settings = random_settings(num_rows, vocab_size, seed)
    threshold = reference.truncation_thresholds(logits, **settings)  # [B]
    for b in range(num_rows):
        expected = sorted_rule_keep(logits[b].tolist(), *(settings[k][b].item() for k in
                                                          ("temperature", "top_k", "top_p", "min_p")))
        assert (logits[b] >= threshold[b]).tolist() == expected, f"row {b}"


@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_top_k_candidate_thresholds_match_reference(seed: int) -> None:
    """The CPU path without a full sort (every top-p row has top-k) keeps exactly the reference's tokens."""
    from pagoda.services.worker.sampler import truncation_thresholds

    num_rows, vocab_size = 40, 300
    logits = tied_logits(num_rows, vocab_size, seed)  # [B, V]
    settings = random_settings(num_rows, vocab_size, seed)
    settings["top_k"] = settings["top_k"] % 40 + 1  # every row has top-k, some with ties beyond the k-th
    settings["top_k"][0] = 1
    meta = make_metadata(num_rows, **settings, top_p_without_top_k=False)
    got = truncation_thresholds(logits, meta, use_triton=False)  # [B]
    want = reference.truncation_thresholds(logits, **settings)  # [B]
    assert torch.equal(logits >= got[:, None], logits >= want[:, None])


@pytest.mark.parametrize("first_width", [4, 256])
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_nucleus_candidate_thresholds_match_reference(seed: int, first_width: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-p rows without top-k on the CPU path (candidates widened until the nucleus fits, no full sort) keep
    exactly the reference's tokens: flat rows whose nucleus is most of the row, peaked ones, ties, rows with
    top-k and min-p beside them. A first width of 4 widens 4 -> 32 -> 256 -> the whole row."""
    from pagoda.services.worker import sampler

    monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", first_width)
    num_rows, vocab_size = 40, 300
    logits = tied_logits(num_rows, vocab_size, seed)  # [B, V]
    logits[::5] *= 0.02  # [B/5, V]: nearly flat, the nucleus holds most of the row
    logits[1::5] *= 4.0  # peaked
    settings = random_settings(num_rows, vocab_size, seed)
    settings["top_k"][::2] = 0  # half the rows top-p over the whole row
    settings["top_p"][::5] = 0.999
    meta = make_metadata(num_rows, **settings, top_p_without_top_k=True)
    got = sampler.truncation_thresholds(logits, meta, use_triton=False)  # [B]
    want = reference.truncation_thresholds(logits, **settings)  # [B]
    assert torch.equal(logits >= got[:, None], logits >= want[:, None])


def test_cpu_nucleus_widens_only_the_sampled_rows_it_must(monkeypatch: pytest.MonkeyPatch) -> None:
    """A greedy row's top_p never widens the candidates (its draw is the argmax: its threshold is its maximum), and
    a sampled row whose nucleus is wide widens alone, not the whole batch (one such row made every row's topk
    run 256 -> 2048 -> 16384 -> 49152 wide, slower than the sort it replaced)."""
    from pagoda.services.worker import sampler

    monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", 4)
    widths: list[tuple[int, int]] = []  # (rows, k) of each topk
    topk = torch.Tensor.topk

    def spy(self: torch.Tensor, k: int, *args, **kwargs):
        widths.append((self.shape[0], k))
        return topk(self, k, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", spy)
    vocab_size = 300
    gen = torch.Generator().manual_seed(3)
    peaked = torch.randn(2, vocab_size, generator=gen) * 8  # [2, V]: nuclei of a few tokens
    flat = torch.randn(1, vocab_size, generator=gen) * 0.01  # [1, V]: the nucleus is most of the row
    logits = torch.cat([peaked, flat])  # [3, V]
    settings = dict(temperature=torch.tensor([0.7, 0.7, 0.0]), top_p=torch.full((3,), 0.9))
    meta = make_metadata(3, **settings, top_p_without_top_k=True)
    got = sampler.truncation_thresholds(logits, meta, use_triton=False)  # [3]
    assert widths == [(3, 4)]
    assert got[2] == logits[2].max()  # the greedy row keeps its maximum
    want = reference.truncation_thresholds(logits[:2], settings["temperature"][:2], None, settings["top_p"][:2], None)
    assert torch.equal(logits[:2] >= got[:2, None], logits[:2] >= want[:, None])

    widths.clear()
    settings["temperature"][2] = 1.5  # now sampled: it alone widens, 4 -> 32 -> the whole row
    meta = make_metadata(3, **settings, top_p_without_top_k=True)
    got = sampler.truncation_thresholds(logits, meta, use_triton=False)  # [3]
    assert widths[0] == (3, 4) and widths[1:] and all(rows == 1 for rows, _ in widths[1:])
    want = reference.truncation_thresholds(logits, settings["temperature"], None, settings["top_p"], None)
    assert torch.equal(logits >= got[:, None], logits >= want[:, None])


# ---------------------------------------------------------------------------------------------
# 7. distributions with penalties, bias and truncation together


def test_penalties_bias_and_truncation_distribution() -> None:
    """One row's state (prompt + output counts, all three penalties, a bias) drawn NUM_DRAWS times through
    the state table; frequencies match the probabilities computed by hand."""
    vocab_size = 10
    logits_row = PROBS[PERMUTATION].log() + 1.0  # [V]: some positive, some negative
    prompt, output = [3, 4], [7, 7, 0, 9]
    presence, frequency, repetition, temperature = 0.3, 0.2, 1.4, 0.9
    bias = {5: 1.5, 2: -0.7}
    expected_logits = reference_penalties(logits_row.tolist(), prompt, output, presence, frequency, repetition)
    for token, value in bias.items():
        expected_logits[token] += value
    expected_logits = torch.tensor(expected_logits)  # [V]
    keep = torch.tensor(sorted_rule_keep(expected_logits.tolist(), temperature, 6, 0.85, 0.05))  # [V]
    target = renormalised(torch.softmax(expected_logits / temperature, dim=-1), keep)  # [V]
    assert 2 <= int(keep.sum()) < 6  # the truncation really cuts
    tables = count_tables([output], [prompt], vocab_size)
    n = NUM_DRAWS
    metadata = make_metadata(
        n, temperature=temperature, seed=11, top_k=torch.full((n,), 6), top_p=torch.full((n,), 0.85),
        min_p=torch.full((n,), 0.05), presence_penalty=torch.full((n,), presence),
        frequency_penalty=torch.full((n,), frequency), repetition_penalty=torch.full((n,), repetition),
        output_counts=tables["output_counts"], prompt_mask=tables["prompt_mask"],
        state_rows=torch.zeros(n, dtype=torch.int64),
        logit_bias_ids=torch.tensor([list(bias)] * n), logit_bias_values=torch.tensor([list(bias.values())] * n),
    )
    check_distribution(sample(logits_row.expand(n, -1), metadata).token_ids, target)


def test_wrong_distribution_fails_the_check() -> None:
    """The distribution check has teeth: top-p 0.6 draws judged against the untruncated target fail."""
    probs = PROBS[PERMUTATION]  # [V]
    token_ids = draw_many(probs.log(), top_p=torch.full((NUM_DRAWS,), 0.6))
    with pytest.raises(AssertionError):
        check_distribution(token_ids, renormalised(probs, probs >= PROBS[3]))


# ---------------------------------------------------------------------------------------------
# 8. grammar bitmask


def random_bitmask(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    words = -(-vocab_size // 32)
    return torch.randint(-2**31, 2**31 - 1, (num_rows, words), dtype=torch.int32, generator=gen)  # [B, W]


def test_bitmask_reference_bits() -> None:
    bitmask = torch.tensor([[0b101, -1], [-2**31, 0]], dtype=torch.int32)  # [2, 2]
    allowed = reference.token_bitmask_allowed(bitmask, 40)  # [2, 40]
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, *range(32, 40)]
    assert allowed[1].nonzero().flatten().tolist() == [31]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bitmask_rows_never_sample_disallowed(temperature: float) -> None:
    num_rows, vocab_size = 64, 77
    torch.manual_seed(9)
    logits = torch.randn(num_rows, vocab_size) * 3  # [B, V]
    bitmask = random_bitmask(num_rows, vocab_size, 9)
    rows = torch.arange(num_rows) % 2 == 0  # [B]: odd rows have no grammar
    metadata = make_metadata(num_rows, temperature=temperature, token_bitmask=bitmask, bitmask_rows=rows,
                             top_k=torch.full((num_rows,), 5))
    token_ids = sample(logits, metadata).token_ids  # [B]
    allowed = reference.token_bitmask_allowed(bitmask, vocab_size)  # [B, V]
    picked = allowed.gather(1, token_ids[:, None]).squeeze(1)  # [B]
    assert picked[rows].all()
    if temperature == 0.0:
        masked = logits.masked_fill(~allowed & rows[:, None], float("-inf"))
        assert torch.equal(token_ids, masked.argmax(dim=-1))
        assert not picked[~rows].all()  # unmasked rows do pick disallowed ids (the mask is off for them)


# ---------------------------------------------------------------------------------------------
# 9. Triton kernels against the references (interpreter on CPU: tiny grids; the gpu copies are larger)

kernels = pytest.importorskip("pagoda.kernels.sampling")


def kernel_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_kernel_checks(num_rows: int, vocab_size: int, seed: int) -> None:
    device = kernel_device()
    logits = tied_logits(num_rows, vocab_size, seed).to(device)  # [B, V]
    bitmask = random_bitmask(num_rows, vocab_size, seed).to(device)
    bitmask[:, 0] |= 1  # token 0 allowed everywhere, so no row is all -inf
    rows = (torch.arange(num_rows) % 3 != 1).to(device)  # [B]
    assert torch.equal(kernels.apply_token_bitmask(logits, bitmask, rows),
                       reference.apply_token_bitmask(logits, bitmask, rows))
    assert torch.equal(kernels.apply_token_bitmask(logits, bitmask), reference.apply_token_bitmask(logits, bitmask))
    gen = torch.Generator().manual_seed(seed)
    table_rows = num_rows + 2
    counts = torch.randint(0, 3, (table_rows, vocab_size), generator=gen, dtype=torch.int32).to(device)
    prompt = (torch.rand(table_rows, vocab_size, generator=gen) < 0.2).to(device)
    state_rows = torch.randperm(table_rows, generator=gen)[:num_rows].to(device)  # [B]
    presence = (torch.rand(num_rows, generator=gen) - 0.5).to(device)
    frequency = (torch.rand(num_rows, generator=gen) - 0.5).to(device)
    repetition = (torch.rand(num_rows, generator=gen) + 0.5).to(device)
    presence[0], frequency[0], repetition[0] = 0.0, 0.0, 1.0  # a row that reads nothing
    processed = kernels.process_logits(logits, state_rows, counts, prompt, presence, frequency, repetition,
                                       bitmask, rows)
    expected = reference.process_logits(logits, counts[state_rows], prompt[state_rows], presence, frequency,
                                        repetition, bitmask, rows)
    torch.testing.assert_close(processed, expected, rtol=1e-6, atol=1e-6)
    only_frequency = kernels.process_logits(logits, state_rows, counts, None, None, frequency, None)
    torch.testing.assert_close(only_frequency, reference.process_logits(logits, counts[state_rows], None, None,
                                                                        frequency, None), rtol=1e-6, atol=1e-6)
    settings = {k: v.to(device) for k, v in random_settings(num_rows, vocab_size, seed).items()}
    temperature = settings["temperature"]
    temperature[-1] = 0.0  # a greedy row
    for top_k in (None, settings["top_k"]):
        meta = SamplingMetadata(temperature=temperature, seeds=torch.zeros(num_rows, dtype=torch.int64, device=device),
                                offsets=torch.zeros(num_rows, dtype=torch.int64, device=device), top_k=top_k,
                                top_p=settings["top_p"], min_p=settings["min_p"])
        from pagoda.services.worker.sampler import truncation_thresholds

        got = truncation_thresholds(expected, meta, use_triton=True)  # [B]
        want = reference.truncation_thresholds(expected, temperature, top_k, settings["top_p"], settings["min_p"])
        assert torch.equal(expected >= got[:, None], expected >= want[:, None])
    seeds = torch.randint(0, 2**62, (num_rows,), generator=gen).to(device)  # [B]
    offsets = torch.randint(0, 2**40, (num_rows,), generator=gen).to(device)  # [B]
    greedy = temperature == 0.0  # [B]
    threshold = reference.truncation_thresholds(expected, temperature, settings["top_k"], settings["top_p"], None)
    for thr in (None, threshold):
        got_ids = kernels.gumbel_argmax(expected, temperature, thr, seeds, offsets, greedy)
        want_ids = reference.gumbel_argmax(expected, temperature, thr, seeds, offsets, greedy)
        assert torch.equal(got_ids, want_ids)
    # the grammar bitmask read inside the draw: the same tokens as drawing over the masked copy
    for flagged in (rows, None):
        masked = reference.apply_token_bitmask(logits, bitmask, flagged)  # [B, V]
        got_ids = kernels.gumbel_argmax(logits, temperature, None, seeds, offsets, greedy, bitmask=bitmask,
                                        bitmask_rows=flagged)
        want_ids = reference.gumbel_argmax(masked, temperature, None, seeds, offsets, greedy)
        assert torch.equal(got_ids, want_ids)
        allowed = reference.token_bitmask_allowed(bitmask, vocab_size)  # [B, V]
        is_flagged = flagged if flagged is not None else torch.ones_like(greedy)
        assert allowed[torch.arange(num_rows, device=device), got_ids][is_flagged].all()


def test_kernel_constants_match_reference() -> None:
    assert (kernels.GOLDEN32, kernels.ROW_KEY_SALT, kernels.UNIFORM_SCALE) == (
        reference.GOLDEN32, reference.ROW_KEY_SALT, reference.UNIFORM_SCALE)


@pytest.mark.parametrize("small_blocks", [False, True])
def test_kernels_match_reference_interpreted(small_blocks: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """small_blocks: several vocab splits and tiles per row, so the cross-split reductions run too."""
    if torch.cuda.is_available():
        pytest.skip("the gpu test covers this")
    if small_blocks:
        for name, value in SMALL_BLOCKS:
            monkeypatch.setattr(kernels, name, value)
    run_kernel_checks(num_rows=3, vocab_size=70, seed=int(small_blocks))


SMALL_BLOCKS = (("PROCESS_BLOCK", 32), ("ARGMAX_BLOCK", 16), ("ARGMAX_SPLIT", 32), ("TOP_P_BLOCK", 16),
                ("TOP_P_PIVOT_BLOCK", 16), ("TOP_K_GROUP", 4))


@pytest.mark.parametrize("case,dtype", [("top_k_top_p_penalties", torch.bfloat16), ("top_p_min_p", torch.float32),
                                        ("bias_bans_top_k", torch.bfloat16), ("top_k_over_groups", torch.float32),
                                        ("bitmask_temperature", torch.bfloat16)])
def test_kernel_sample_path_matches_cpu_path(case: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """sample()'s Triton path (the fused pass with group maxima and tie counts, candidates from the groups, the
    top-p search over the gathered groups, the Gumbel draw skipping blocks below the threshold) draws the CPU
    path's tokens on tie-heavy logits in the model's dtype; groups of 4 ids and small blocks so a 70-id row
    spans many of each (the interpreter on CPU, the real kernels on a GPU)."""
    if not torch.cuda.is_available():
        for name, value in SMALL_BLOCKS:
            monkeypatch.setattr(kernels, name, value)
    device = kernel_device()
    num_rows, vocab_size = 12, 70 if not torch.cuda.is_available() else 3001
    gen = torch.Generator().manual_seed(len(case))
    logits = tied_logits(num_rows, vocab_size, seed=len(case)).to(dtype)  # [B, V]: exact in bf16 too
    settings = random_settings(num_rows, vocab_size, seed=len(case))
    if case != "top_k_over_groups":
        settings["top_k"] = settings["top_k"] % 11  # within the groups: the grouped candidates run
    fields: dict = dict(top_k=settings["top_k"], top_p=settings["top_p"], min_p=None, max_top_k=0,
                        top_p_without_top_k=bool(((settings["top_p"] < 1) & (settings["top_k"] <= 0)).any()))
    if case == "top_k_top_p_penalties":
        outputs = torch.randint(0, vocab_size, (num_rows, 9), generator=gen).tolist()
        fields.update(presence_penalty=torch.full((num_rows,), 0.5), frequency_penalty=torch.full((num_rows,), 0.25),
                      **count_tables(outputs, None, vocab_size))
    elif case == "top_p_min_p":
        fields.update(top_k=None, min_p=settings["min_p"], top_p_without_top_k=True)
    elif case == "bias_bans_top_k":
        fields.update(top_p=None, logit_bias_ids=torch.randint(0, vocab_size, (num_rows, 3), generator=gen),
                      logit_bias_values=torch.full((num_rows, 3), 2.0),
                      banned_token_ids=torch.where(torch.arange(num_rows)[:, None] % 2 == 0,
                                                   torch.tensor([[5, 9]]), -1))
    elif case == "bitmask_temperature":  # grammar rows beside free ones, no truncation: the draw reads the mask
        bitmask = random_bitmask(num_rows, vocab_size, seed=3)
        bitmask[:, 0] |= 1  # no row without an allowed id
        fields.update(top_k=None, top_p=None, top_p_without_top_k=False, token_bitmask=bitmask,
                      bitmask_rows=torch.arange(num_rows) % 4 != 1)
    temperature = settings["temperature"]
    temperature[-1] = 0.0  # a greedy row
    cpu = make_metadata(num_rows, temperature=temperature, seed=77, **fields)
    on_device = SamplingMetadata(**{f: (getattr(cpu, f).to(device) if isinstance(getattr(cpu, f), torch.Tensor)
                                        else getattr(cpu, f)) for f in SamplingMetadata.__slots__})
    expected = sample(logits, cpu, use_kernels=False).token_ids
    got = sample(logits.to(device), on_device, use_kernels=True).token_ids.cpu()
    assert torch.equal(got, expected)


def test_group_stats_and_group_thresholds_match_references(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused pass's group maxima and tie counts against plain PyTorch counts, and group_thresholds (k-th
    largest by count search, top-p with the ties outside the chosen groups, min-p) against the sort-based rule,
    on tie-heavy rows with a partial last group and ties at the k-th largest outside the chosen groups."""
    if not torch.cuda.is_available():
        for name, value in SMALL_BLOCKS:
            monkeypatch.setattr(kernels, name, value)
    device = kernel_device()
    group = kernels.TOP_K_GROUP
    num_rows, vocab_size = 6, 17 * group + 3
    logits = tied_logits(num_rows, vocab_size, seed=3).clamp(max=0.5)  # [B, V]
    logits[:, 0], logits[:, group] = 3.0, 2.0  # then ten groups whose maximum is 1.0: more than the k chosen
    logits[:, torch.arange(2, 12) * group + torch.arange(10) % group] = 1.0
    logits = logits.to(device)
    grouped = kernels.process_logits_grouped(logits, write_out=False, group_stats=True)
    padded = torch.nn.functional.pad(logits, (0, group - 3), value=float("-inf")).unflatten(1, (18, group))
    want_max = padded.amax(dim=2)  # [B, G]
    assert grouped.logits is logits and torch.equal(grouped.group_max, want_max)
    assert torch.equal(grouped.group_ties, (padded == want_max[:, :, None]).sum(dim=2).int())
    k = 6
    top = kernels.top_candidates(logits, k, grouped.group_max)
    assert top.values is not None and torch.equal(top.values, logits.topk(k, dim=-1).values)
    settings = random_settings(num_rows, vocab_size, seed=4)
    top_k = (torch.arange(num_rows) % k + 1).to(device)  # [B] 1..k
    top_k[2] = 0  # a row without top-k: min-p only here
    kth = logits.topk(k, dim=-1).values.gather(1, (top_k.clamp(min=1) - 1)[:, None]).squeeze(1)  # [B]
    chosen = torch.zeros_like(want_max, dtype=torch.bool).scatter_(1, top.groups, True)  # [B, G]
    outside = ((padded == kth[:, None, None]) & ~chosen[:, :, None]).sum(dim=(1, 2))  # [B]
    assert (outside[top_k > 0] > 0).any()  # the case the tie counts exist for
    temperature, top_p, min_p = (settings[name].to(device) for name in ("temperature", "top_p", "min_p"))
    top_p[2] = 1.0
    got, whole_row = kernels.group_thresholds(top, grouped.group_max, grouped.group_ties, top_k, top_p, min_p,
                                              temperature)
    want = reference.truncation_thresholds(logits, temperature, top_k, top_p, min_p)  # [B]
    kept = logits >= want[:, None]  # [B, V]
    assert torch.equal(logits >= got[:, None], kept)
    # whole_row: exactly the rows without top-k and those keeping an id outside the gathered groups
    outside_kept = (kept & ~chosen.repeat_interleave(group, dim=1)[:, :vocab_size]).any(dim=1)  # [B]
    assert torch.equal(whole_row, (top_k <= 0) | outside_kept)
    seeds = torch.arange(num_rows, dtype=torch.int64, device=device) * 7919  # [B]
    offsets = torch.arange(num_rows, dtype=torch.int64, device=device) + 3  # [B]
    drawn = kernels.gathered_gumbel_argmax(top, temperature, got, seeds, offsets)  # [B]
    expected = reference.gumbel_argmax(logits, temperature, got, seeds, offsets, None)  # [B]
    assert torch.equal(drawn[~whole_row], expected[~whole_row])


@pytest.mark.parametrize("k", [1, 7, 50, 64])
def test_row_top_values_matches_topk(k: int) -> None:
    """The grouped candidates (the k groups with the largest maxima, then their top k) equal torch.topk's
    values, ties included; 9001 ids leave a partial last group."""
    device = kernel_device()
    logits = tied_logits(3, 9001, seed=k).to(device)  # [B, V]: many ties
    logits[1, 4000:4200] = logits[1].max()  # a run of ties at the top, across group borders
    logits[2, -1] = logits[2].max() + 1  # the largest value in the partial last group
    assert torch.equal(kernels.row_top_values(logits, k), logits.topk(k, dim=-1).values)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows,vocab_size", [(7, 1000), (64, 32000), (33, 151936)])
def test_kernels_match_reference_gpu(num_rows: int, vocab_size: int) -> None:
    run_kernel_checks(num_rows, vocab_size, seed=num_rows)


@pytest.mark.gpu
def test_gpu_sample_matches_cpu_sample() -> None:
    """The same seeded batch gives the same tokens on the CUDA path and the CPU path."""
    num_rows, vocab_size = 96, 50000
    torch.manual_seed(13)
    logits = torch.randn(num_rows, vocab_size) * 2  # [B, V]
    settings = random_settings(num_rows, vocab_size, 13)
    settings["top_k"] = settings["top_k"] % 200
    cpu = make_metadata(num_rows, seed=5, **settings, presence_penalty=torch.full((num_rows,), 0.5),
                        frequency_penalty=torch.full((num_rows,), 0.2),
                        **count_tables(torch.randint(0, vocab_size, (num_rows, 30)).tolist(), None, vocab_size))
    gpu = SamplingMetadata(**{f: (getattr(cpu, f).cuda() if isinstance(getattr(cpu, f), torch.Tensor)
                                  else getattr(cpu, f)) for f in SamplingMetadata.__slots__})
    expected = sample(logits, cpu).token_ids
    got = sample(logits.cuda(), gpu).token_ids.cpu()
    assert (got == expected).float().mean().item() > 0.98  # float rounding may flip a rare near-tie


# ---------------------------------------------------------------------------------------------
# 10. the per-row state: admission, metadata, one scatter per step, row reuse, re-admission

from pagoda.services.worker.sampling_state import SamplingState  # noqa: E402
from pagoda.shared.messages import NewRequest, SamplingParams  # noqa: E402


def new_request(seq_id: int, tokens: list[int], num_prompt: int, seed: int = 0, **params) -> NewRequest:
    return NewRequest(seq_id=seq_id, token_ids=tokens, num_prompt_tokens=num_prompt, block_ids=[],
                      num_computed_tokens=0, sampling=SamplingParams(**params), seed=seed)


def test_state_counts_scatter_reuse_and_readmission() -> None:
    vocab_size = 16
    state = SamplingState(4, vocab_size, torch.device("cpu"), eos_token_ids=[15])
    state.admit([(0, new_request(1, [1, 2, 3], 3, seed=7)), (2, new_request(2, [4, 4, 5, 6], 2))])
    assert state.output_counts is None and state.prompt_mask is None  # nobody needs them yet
    state.admit([(1, new_request(3, [2, 2, 9, 9, 9], 3, presence_penalty=0.5, repetition_penalty=1.2))])
    assert state.output_counts is not None and state.prompt_mask is not None
    assert state.output_counts[1].tolist() == [0] * 9 + [2] + [0] * 6  # rebuilt from the carried output
    assert state.prompt_mask[1].nonzero().flatten().tolist() == [2, 9]
    rows = np.array([1, 0])
    meta = state.metadata(rows)
    assert meta.offsets.tolist() == [2, 0] and meta.seeds.tolist() == [0, 7]
    assert meta.presence_penalty.tolist() == [0.5, 0.0] and meta.frequency_penalty is None
    torch.testing.assert_close(meta.repetition_penalty, torch.tensor([1.2, 1.0]))
    assert meta.state_rows.tolist() == [1, 0] and meta.top_k is None and meta.logit_bias_ids is None
    state.record(rows, torch.tensor([9, 3]), meta.state_rows)
    assert state.output_counts[1, 9].item() == 3 and state.output_counts[0, 3].item() == 1
    assert state.metadata(rows).offsets.tolist() == [3, 1]
    # row 1 reused by a request with other settings: counts rebuilt, stale values gone
    state.admit([(1, new_request(4, [5, 5, 7], 2, frequency_penalty=1.0, top_k=3))])
    assert state.output_counts[1].nonzero().flatten().tolist() == [7]
    meta = state.metadata(np.array([1]))
    assert meta.offsets.tolist() == [1] and meta.top_k.tolist() == [3] and meta.max_top_k == 3
    assert meta.repetition_penalty is None and meta.presence_penalty is None
    assert meta.frequency_penalty.tolist() == [1.0]
    # top-p rows without top-k ask the sampler for the whole-row search; with top-k they do not
    state.admit([(2, new_request(5, [1], 1, top_p=0.9, top_k=5)), (3, new_request(6, [1], 1, top_p=0.9))])
    assert not state.metadata(np.array([2, 1])).top_p_without_top_k
    assert state.metadata(np.array([2, 3])).top_p_without_top_k


def test_state_bias_and_bans() -> None:
    vocab_size = 16
    state = SamplingState(3, vocab_size, torch.device("cpu"), eos_token_ids=[15])
    state.admit([(0, new_request(1, [1, 2], 2, logit_bias={3: 10.0, 4: -1.0})),
                 (1, msgspec.structs.replace(new_request(2, [1, 2], 2, min_tokens=2, stop_token_ids=[7]),
                                             eos_token_ids=[15])),  # the scheduler's EOS ids, with the plan
                 (2, new_request(3, [1, 2], 2))])
    rows = np.array([0, 1, 2])
    meta = state.metadata(rows)
    assert meta.logit_bias_ids.tolist() == [[3, 4], [0, 0], [0, 0]]
    assert meta.logit_bias_values.tolist() == [[10.0, -1.0], [0.0, 0.0], [0.0, 0.0]]
    assert meta.banned_token_ids.tolist() == [[-1, -1], [7, 15], [-1, -1]]
    logits = torch.zeros(3, vocab_size)  # [B, V]
    logits[:, 7] = logits[:, 15] = 5.0
    meta.temperature = torch.zeros(3)
    meta.all_greedy = True
    assert sample(logits, meta).token_ids.tolist() == [3, 0, 7]  # row 0 biased up, row 1 banned
    for _ in range(2):
        state.record(rows, torch.tensor([0, 0, 0]))
    assert state.metadata(rows).banned_token_ids is None  # min_tokens reached
    state.admit([(0, new_request(4, [1], 1))])  # a reused row sheds its old bias
    assert state.metadata(np.array([0])).logit_bias_ids is None
    assert state.bias_ids[0].tolist() == [0, 0]


# ---------------------------------------------------------------------------------------------
# 11. the worker end to end (dummy "tiny" shape): state survives companions and preemption


def test_engine_penalised_seeded_output_survives_companions_and_preemption() -> None:
    """A seeded, penalised request gives the same tokens alone and when crowded into preemption: the counts
    and prompt presence rebuilt at re-admission equal the ones the scatter kept."""
    from pagoda import LLM, SamplingParams

    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(temperature=0.8, seed=99, max_tokens=40, ignore_eos=True, presence_penalty=1.5,
                            frequency_penalty=0.7, repetition_penalty=1.3, top_k=30, min_tokens=5,
                            logit_bias={3: 2.0})
    alone = LLM("tiny", seed=3).generate([prompt], params)[0].outputs[0].token_ids
    crowded_llm = LLM("tiny", seed=3, num_kv_blocks=9)  # 3 x 4 blocks wanted
    others = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    outputs = crowded_llm.generate([[9, 10, 11] * 8, [12, 13] * 12, prompt],
                                   [others, others, params])  # the last arrived is the one preempted
    assert crowded_llm.engine.scheduler.stats.num_preemptions > 0
    assert outputs[2].outputs[0].token_ids == alone
