"""The worker's CPU fast paths give what the paths they shortcut give: the Gumbel draw over kept ids only
(kernels/reference.py) against the dense [B, V] draw."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import reference


def dense_gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, threshold: torch.Tensor | None,
                        seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The draw as the reference wrote it before the kept-ids path: noise over the whole [B, V]."""
    temperature = torch.where(temperature == 0.0, 1.0, temperature)  # [B]
    scaled = logits / temperature.unsqueeze(1)  # [B, V]
    if threshold is not None:
        scaled.masked_fill_(logits < threshold.unsqueeze(1), float("-inf"))
    return reference.gumbel_noise(seeds, offsets, logits.shape[1]).add_(scaled).argmax(dim=-1)  # [B]


def batch(num_rows: int, vocab_size: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab_size + 1, dtype=torch.float32)  # Zipf-like rows: a narrow nucleus
    logits = -1.2 * ranks.log()[torch.randperm(vocab_size, generator=generator)].repeat(num_rows, 1)
    logits += 0.3 * torch.randn(num_rows, vocab_size, generator=generator)  # [B, V]
    seeds = torch.randint(0, 2**63 - 1, (num_rows,), generator=generator)  # [B]
    offsets = torch.randint(0, 4096, (num_rows,), generator=generator)  # [B]
    return logits, seeds, offsets


@pytest.mark.parametrize("num_rows", [1, 3, 8])
@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_kept_ids_draw_matches_dense_draw(num_rows: int, top_p: float) -> None:
    vocab_size = 4096
    for seed in range(6):
        logits, seeds, offsets = batch(num_rows, vocab_size, seed)
        temperature = torch.tensor([0.7, 1.0, 0.3, 0.8, 0.7, 0.9, 0.5, 0.6][:num_rows])  # [B]
        threshold = reference.truncation_thresholds(logits, temperature, None, torch.full((num_rows,), top_p),
                                                    None)  # [B]
        assert int((logits >= threshold.unsqueeze(1)).sum()) < 0.25 * logits.numel(), "the kept-ids path runs"
        for step in range(4):  # later offsets: other noise
            drawn = reference.gumbel_argmax(logits, temperature, threshold, seeds, offsets + step, None)
            assert torch.equal(drawn, dense_gumbel_argmax(logits, temperature, threshold, seeds, offsets + step))


def test_kept_ids_draw_keeps_ties_and_edges() -> None:
    """Ties resolve to the smallest id as argmax's do; greedy rows, rows keeping everything (threshold -inf),
    -inf logits and NaN scores give the dense draw's ids."""
    vocab_size = 512
    logits, seeds, offsets = batch(4, vocab_size, 7)
    logits[0, 10:20] = 5.0  # a tie among the kept ids
    logits[1] = 0.0  # a flat row: everything kept at its threshold
    logits[2, :200] = float("-inf")
    temperature = torch.tensor([0.7, 1.0, 0.0, 0.8])  # [B]; row 2 greedy
    greedy = torch.tensor([False, False, True, False])
    top_p = torch.tensor([0.9, 0.9, 0.9, 0.9])
    threshold = reference.truncation_thresholds(logits, temperature, None, top_p, None)  # [B]
    narrow = threshold.clone()
    narrow[1] = 0.5  # above every logit of row 1 would keep nothing: never from these logits, but must not crash
    for thresholds in (threshold, torch.full((4,), float("-inf")), narrow):
        expected = dense_gumbel_argmax(logits, temperature, thresholds, seeds, offsets)
        expected = torch.where(greedy, logits.argmax(dim=-1), expected)
        assert torch.equal(reference.gumbel_argmax(logits, temperature, thresholds, seeds, offsets, greedy), expected)
    with_nan = logits.clone()
    with_nan[3, 5] = float("nan")
    expected = torch.where(greedy, with_nan.argmax(dim=-1),
                           dense_gumbel_argmax(with_nan, temperature, threshold, seeds, offsets))
    assert torch.equal(reference.gumbel_argmax(with_nan, temperature, threshold, seeds, offsets, greedy), expected)


def test_noise_at_points_is_the_dense_noise() -> None:
    seeds = torch.tensor([0, 1, 2**62 + 12345])  # [B]
    offsets = torch.tensor([0, 77, 2**33 + 5])  # [B]
    dense = reference.gumbel_noise(seeds, offsets, 1000)  # [B, V]
    rows = torch.tensor([0, 0, 1, 2, 2])
    ids = torch.tensor([0, 999, 500, 3, 998])
    points = reference.gumbel_noise_at(reference.row_keys(seeds, offsets)[rows], ids)  # [N]
    assert torch.equal(points, dense[rows, ids])


def test_served_cpu_worker_leaves_a_cpu_to_the_other_processes() -> None:
    from pagoda.services.worker.device import served_cpu_threads

    assert served_cpu_threads(2, 1, {}) == 1
    assert served_cpu_threads(1, 1, {}) == 1
    assert served_cpu_threads(16, 1, {}) == 15
    assert served_cpu_threads(16, 2, {}) == 7  # two tensor-parallel ranks share the host
    assert served_cpu_threads(16, 1, {"OMP_NUM_THREADS": "4"}) is None  # the operator's (or launcher's) choice
