"""Tests for the batched sampler: greedy, seeded reproducibility, truncation, penalties, bans, logprobs."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
import torch

from pagoda.services.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties,
    mix32_,
    mul32_,
    row_keys,
    sample,
    uniform_noise,
)


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
        prompt_token_ids=pad(prompts, vocab_size), output_token_ids=pad(outputs, vocab_size),
    )
    expected = torch.tensor([
        reference_penalties(logits[b].tolist(), prompts[b], outputs[b],
                            presence[b], frequency[b], repetition[b])
        for b in range(num_rows)
    ])  # [B, V]
    penalised = apply_penalties(logits, metadata)  # [B, V]
    torch.testing.assert_close(penalised, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(penalised[0], logits[0])
    assert torch.equal(sample(logits, metadata).token_ids, expected.argmax(dim=-1))


def test_frequency_penalty_alone_without_prompt_ids() -> None:
    logits = torch.zeros(2, 6)  # [B, V]
    metadata = make_metadata(
        2, temperature=0.0, frequency_penalty=torch.tensor([0.5, 0.0]),
        output_token_ids=torch.tensor([[1, 1, 6], [2, 6, 6]]),
    )
    expected = torch.tensor([[0.0, -1.0, 0, 0, 0, 0], [0.0] * 6])  # [B, V]
    assert torch.equal(apply_penalties(logits, metadata), expected)


# ---------------------------------------------------------------------------------------------
# 5. bans and logprobs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_banned_tokens_never_sampled(temperature: float) -> None:
    torch.manual_seed(4)
    num_rows, vocab_size = 4000, 12
    logits = torch.randn(num_rows, vocab_size)  # [B, V]
    logits[:, 5] = 20.0  # the argmax everywhere, and banned everywhere
    half = num_rows // 2
    banned = torch.tensor([[5, 3, vocab_size]] * half + [[5, vocab_size, vocab_size]] * half)  # [B, 3]
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
    ids = torch.tensor([[2, vocab_size]] * half + [[vocab_size, vocab_size]] * half)  # [B, 2]
    values = torch.tensor([[torch.log(torch.tensor(3.0)).item(), 99.0]] * half + [[99.0, 99.0]] * half)
    metadata = make_metadata(num_rows, temperature=1.0, logit_bias_ids=ids, logit_bias_values=values)
    token_ids = sample(logits, metadata).token_ids  # [B]
    biased = torch.tensor([1 / 6, 1 / 6, 3 / 6, 1 / 6])
    assert total_variation(empirical(token_ids[:half], vocab_size), biased) < 0.02
    assert total_variation(empirical(token_ids[half:], vocab_size), torch.full((vocab_size,), 0.25)) < 0.02
    greedy_logits = torch.randn(3, vocab_size)  # [3, V]
    top = greedy_logits.argmax(dim=-1)  # [3]
    ids = torch.stack([top, torch.full_like(top, vocab_size)], dim=1)  # [3, 2]: push each row's argmax away
    greedy = make_metadata(3, temperature=0.0, logit_bias_ids=ids, logit_bias_values=torch.full((3, 2), -100.0))
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
        output_token_ids=torch.randint(0, vocab_size, (num_rows, 8)),
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


def test_logprobs_zero_and_none() -> None:
    logits = torch.randn(3, 20)  # [B, V]
    out = sample(logits, make_metadata(3, max_num_logprobs=0))
    assert out.top_token_ids.shape == (3, 0) and out.top_logprobs.shape == (3, 0)
    assert out.logprobs.shape == (3,)
    out = sample(logits, make_metadata(3))
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None
