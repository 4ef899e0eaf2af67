"""Grammar bitmasks as the worker applies them (the sampler's fused pass: numpy unpacking on the CPU, the Triton
kernel on CUDA) against a plain Python reference on random masks. Imports only torch, numpy and pagoda's
sampler, so it runs on a machine without the server-test dependencies:
    python -m pytest tests/test_grammar_bitmask.py -m gpu
"""

from __future__ import annotations

import pytest
import torch

from pagoda.services.worker.sampler import SamplingMetadata, apply_token_bitmask_host, process_logits, sample


def plain_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[bool]) -> torch.Tensor:
    """Slow and obvious: a Python loop over rows and tokens; bit t % 32 of word t // 32 allows token t."""
    out = logits.clone()
    words = bitmask.tolist()
    for b, flagged in enumerate(rows):
        if not flagged:
            continue
        for t in range(logits.shape[1]):
            if not (words[b][t // 32] >> (t % 32)) & 1:
                out[b, t] = float("-inf")
    return out


def random_case(batch: int, vocab: int, seed: int, extra_words: int = 0,
                density: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """logits [B, V], bitmask [B, ceil(V/32) + extra_words] int32 with `density` of bits set, flags [B]."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen)  # [B, V]
    words = -(-vocab // 32) + extra_words
    bits = torch.rand(batch, words, 32, generator=gen) < density  # [B, W, 32]
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)  # [32]
    bitmask = ((bits.long() * weights).sum(-1) - ((bits[..., 31].long()) << 32)).to(torch.int32)  # [B, W]
    rows = (torch.rand(batch, generator=gen) < 0.6).tolist()
    rows[0] = True  # at least one constrained row
    return logits, bitmask, rows


def metadata(batch: int, bitmask: torch.Tensor, rows: list[bool] | None, device: str = "cpu") -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.zeros(batch, device=device),
                            seeds=torch.zeros(batch, dtype=torch.int64, device=device),
                            offsets=torch.zeros(batch, dtype=torch.int64, device=device), all_greedy=True,
                            token_bitmask=bitmask.to(device),
                            bitmask_rows=None if rows is None else torch.tensor(rows, device=device))


@pytest.mark.parametrize(("batch", "vocab", "seed", "extra_words", "density"), [
    (1, 32, 0, 0, 0.5), (5, 100, 1, 0, 0.5), (4, 1000, 2, 1, 0.9), (7, 65, 3, 0, 0.1), (3, 4099, 4, 2, 0.02)])
def test_cpu_bitmask_matches_the_plain_reference(batch: int, vocab: int, seed: int, extra_words: int,
                                                 density: float) -> None:
    logits, bitmask, rows = random_case(batch, vocab, seed, extra_words, density)
    expected = plain_reference(logits, bitmask, rows)
    got = process_logits(logits, metadata(batch, bitmask, rows), use_triton=False)
    assert torch.equal(got, expected)
    assert torch.equal(logits, random_case(batch, vocab, seed, extra_words, density)[0])  # input untouched
    every = process_logits(logits, metadata(batch, bitmask, None), use_triton=False)  # no flags: every row
    assert torch.equal(every, plain_reference(logits, bitmask, [True] * batch))
    assert torch.equal(apply_token_bitmask_host(logits.clone(), bitmask, torch.tensor(rows)), expected)


def test_greedy_sampling_picks_the_best_allowed_token() -> None:
    batch, vocab = 6, 300
    logits, bitmask, rows = random_case(batch, vocab, 5, density=0.3)
    token_ids = sample(logits, metadata(batch, bitmask, rows)).token_ids  # [B]
    assert torch.equal(token_ids, plain_reference(logits, bitmask, rows).argmax(dim=-1))
    assert not torch.equal(token_ids, plain_reference(logits, bitmask, [True] * batch).argmax(dim=-1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("batch", "vocab", "seed"), [(9, 2000, 6), (3, 151936, 7)])
def test_gpu_bitmask_matches_the_plain_reference(batch: int, vocab: int, seed: int) -> None:
    logits, bitmask, rows = random_case(batch, vocab, seed, density=0.7)
    got = process_logits(logits.cuda(), metadata(batch, bitmask, rows, "cuda"), use_triton=True).cpu()  # [B, V]
    assert torch.equal(got, process_logits(logits, metadata(batch, bitmask, rows), use_triton=False))
    # the plain loop over the first 2048 tokens and the last 1024 (all of them for the small vocabulary)
    head = min(vocab, 2048)
    assert torch.equal(got[:, :head], plain_reference(logits[:, :head], bitmask, rows))
    tail_start = (vocab - 1024) // 32 * 32  # on a word boundary
    tail = plain_reference(logits[:, tail_start:], bitmask[:, tail_start // 32:], rows)
    assert torch.equal(got[:, tail_start:], tail)
