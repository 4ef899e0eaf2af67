"""The sampler's Triton path (interpreted on CPU, small blocks and groups so short rows span many of them):
top-p without top-k by rejection rounds against the sort-based rule, and chi-square frequency tests of the
kernel path's draws for top-p, top-k + top-p with ties at the threshold, min-p and penalties."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda.kernels import reference
from pagoda.services.worker.sampler import SamplingMetadata, sample
from tests.test_sampler import count_tables, random_settings, reference_penalties, sorted_rule_keep, tied_logits

kernels = pytest.importorskip("pagoda.kernels.sampling")

# groups of 4 ids, splits of 32 ids for the exactness tests: a 200-id row spans 50 groups and 7 draw splits
SMALL = (("PROCESS_BLOCK", 32), ("ARGMAX_BLOCK", 16), ("ARGMAX_SPLIT", 32), ("TOP_P_BLOCK", 16),
         ("TOP_P_PIVOT_BLOCK", 16), ("TOP_K_GROUP", 4))
# the frequency tests: one block and one split a row (the interpreter's cost is per operation, not per id)
ONE_BLOCK = (("PROCESS_BLOCK", 64), ("ARGMAX_BLOCK", 64), ("ARGMAX_SPLIT", 64), ("TOP_P_BLOCK", 64),
             ("TOP_P_PIVOT_BLOCK", 64), ("TOP_K_GROUP", 4), ("NUCLEUS_ROUNDS", 1), ("TOP_P_PIVOTS", 128))


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def shrink(monkeypatch: pytest.MonkeyPatch, sizes: tuple[tuple[str, int], ...]) -> None:
    if not torch.cuda.is_available():
        for name, value in sizes:
            monkeypatch.setattr(kernels, name, value)


def on(meta: SamplingMetadata, dev: torch.device) -> SamplingMetadata:
    return SamplingMetadata(**{f: (getattr(meta, f).to(dev) if isinstance(getattr(meta, f), torch.Tensor)
                                   else getattr(meta, f)) for f in SamplingMetadata.__slots__})


# ---------------------------------------------------------------------------------------------
# top-p without top-k: exact against the sort-based rule, ties included


@pytest.mark.parametrize("rounds,dtype", [(0, torch.float32), (1, torch.bfloat16), (4, torch.float32)])
def test_top_p_rejection_draw_matches_cpu_path(rounds: int, dtype: torch.dtype,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows with top-p and no top-k (alone, with min-p, with a penalty) beside greedy, top-k + top-p and min-p
    rows draw the CPU path's tokens (its sort-based thresholds) on tie-heavy logits. rounds 0: every top-p row
    takes the exact per-row search; 1: the rejection round decides some, the search the others; 4: the default."""
    shrink(monkeypatch, SMALL)
    monkeypatch.setattr(kernels, "NUCLEUS_ROUNDS", rounds)
    num_rows, vocab_size = 16, 200 if not torch.cuda.is_available() else 5001
    logits = tied_logits(num_rows, vocab_size, seed=rounds).to(dtype)  # [B, V]: exact in bf16 too
    settings = random_settings(num_rows, vocab_size, seed=rounds)
    kind = torch.arange(num_rows) % 4  # 0: top-p, 1: top-p + min-p, 2: top-k + top-p, 3: greedy or min-p
    top_k = torch.where(kind == 2, settings["top_k"] % 9 + 1, 0)  # [B]
    top_p = torch.where(kind < 3, torch.rand(num_rows, generator=torch.Generator().manual_seed(rounds)) * 0.8
                        + 0.05, 1.0)  # [B] small top-p values: many first draws are rejected
    min_p = torch.where((kind == 1) | (kind == 3), settings["min_p"] + 0.01, 0.0)  # [B]
    temperature = settings["temperature"]
    temperature[3::8] = 0.0  # greedy rows
    gen = torch.Generator().manual_seed(5)
    outputs = torch.randint(0, vocab_size, (num_rows, 5), generator=gen).tolist()
    cpu = SamplingMetadata(temperature=temperature, seeds=torch.arange(num_rows) * 7919 + 1,
                           offsets=torch.arange(num_rows) + 11, top_k=top_k, top_p=top_p, min_p=min_p,
                           max_top_k=int(top_k.max()), presence_penalty=torch.where(kind == 0, 0.5, 0.0),
                           **count_tables(outputs, None, vocab_size))
    expected = sample(logits, cpu, use_kernels=False).token_ids  # [B]
    got = sample(logits.to(device()), on(cpu, device()), use_kernels=True).token_ids.cpu()  # [B]
    assert torch.equal(got, expected)
    nucleus = (top_p < 1) & (top_k == 0) & (temperature > 0)  # [B]
    processed = reference.process_logits(logits, cpu.output_counts, None, cpu.presence_penalty, None, None)
    free = reference.gumbel_argmax(processed, temperature, None, cpu.seeds, cpu.offsets, None)  # [B] no top-p
    assert (free != expected)[nucleus].any()  # some first draw fell outside its nucleus: the rounds had work


def test_top_p_threshold_whole_row_matches_sorted_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """top_p_threshold's per-row search over a whole row (truncation_thresholds(use_triton=True) uses it for top-p
    rows without top-k) keeps exactly the sort-based rule's tokens."""
    from pagoda.services.worker.sampler import truncation_thresholds

    shrink(monkeypatch, SMALL)
    num_rows, vocab_size = 8, 90
    logits = tied_logits(num_rows, vocab_size, seed=9).to(device())  # [B, V]
    settings = {k: v.to(device()) for k, v in random_settings(num_rows, vocab_size, seed=9).items()}
    settings["top_k"][::2] = 0
    meta = SamplingMetadata(temperature=settings["temperature"], seeds=torch.zeros_like(settings["top_k"]),
                            offsets=torch.zeros_like(settings["top_k"]), top_k=settings["top_k"],
                            top_p=settings["top_p"], min_p=settings["min_p"])
    got = truncation_thresholds(logits, meta, use_triton=True)  # [B]
    want = reference.truncation_thresholds(logits, **settings)  # [B]
    assert torch.equal(logits >= got[:, None], logits >= want[:, None])


def test_state_sends_the_nucleus_rows() -> None:
    """SamplingState.metadata flags exactly the rows with top_p < 1, no top-k and a temperature."""
    import numpy as np

    from pagoda.services.worker.sampling_state import SamplingState
    from pagoda.shared.messages import NewRequest, SamplingParams

    kinds = [SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(temperature=0.0, top_p=0.5),
             SamplingParams(temperature=0.7, top_p=0.9, top_k=20), SamplingParams(temperature=0.7, min_p=0.1),
             SamplingParams(temperature=1.0, top_p=0.3, min_p=0.1)]
    state = SamplingState(len(kinds), 32, torch.device("cpu"), eos_token_ids=[0])
    state.admit([(row, NewRequest(seq_id=row, token_ids=[1, 2], num_prompt_tokens=2, block_ids=[],
                                  num_computed_tokens=0, sampling=params, seed=row))
                 for row, params in enumerate(kinds)])
    meta = state.metadata(np.arange(len(kinds)))
    assert meta.nucleus is not None and meta.nucleus.tolist() == [1, 0, 0, 0, 1]
    assert state.metadata(np.array([2, 3])).nucleus is None


# ---------------------------------------------------------------------------------------------
# chi-square frequency tests on the kernel path


NUM_DRAWS = 240  # the interpreter runs one program at a time; the draws are deterministic (seeded noise)
VOCAB = 48  # 12 groups of 4 ids


def chi_square_limit(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile for one-sided p = 0.001 (z = 3.09), Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def check_frequencies(token_ids: torch.Tensor, target: torch.Tensor) -> None:
    """No draw outside target's support, and a chi-square test of the counts against it (categories with an
    expected count below 5 merged into one)."""
    assert (target[token_ids] > 0).all(), "an excluded token was sampled"
    counts = torch.bincount(token_ids, minlength=target.numel()).double()  # [V]
    expected = target.double() * token_ids.numel()  # [V]
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big & (target > 0)].sum().reshape(1)])
    wanted = torch.cat([expected[big], expected[~big & (target > 0)].sum().reshape(1)])
    keep = wanted > 0
    observed, wanted = observed[keep], wanted[keep]
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    assert statistic < chi_square_limit(len(wanted) - 1), f"chi-square {statistic:.1f} over {len(wanted)} bins"


def spread_row(seed: int) -> torch.Tensor:
    """[VOCAB] logits: twelve likely ids in distinct groups over a flat floor."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(VOCAB, generator=gen) * 0.3 - 3.0  # [V]
    ids = torch.randperm(VOCAB, generator=gen)[:12]
    row[ids] = torch.linspace(2.0, -0.5, 12)
    return row


def kernel_draws(row: torch.Tensor, **fields) -> torch.Tensor:
    """NUM_DRAWS draws of one logits row [V] through sample()'s kernel path (distinct offsets, one seed)."""
    n = NUM_DRAWS
    meta = SamplingMetadata(temperature=torch.full((n,), fields.pop("temperature", 1.0)),
                            seeds=torch.full((n,), 4242), offsets=torch.arange(n), **fields)
    logits = row.expand(n, -1).contiguous().to(device())  # [N, V]
    return sample(logits, on(meta, device()), use_kernels=True).token_ids.cpu()  # [N]


def target_of(row: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0,
              min_p: float = 0.0) -> torch.Tensor:
    keep = torch.tensor(sorted_rule_keep(row, temperature, top_k, top_p, min_p))  # [V]
    probs = torch.softmax(torch.tensor(row, dtype=torch.float64) / temperature, dim=0)  # [V]
    kept = torch.where(keep, probs, 0.0)
    return kept / kept.sum()


def test_chi_square_top_p_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    shrink(monkeypatch, ONE_BLOCK)
    row = spread_row(1)
    target = target_of(row.tolist(), 0.8, top_p=0.8)
    assert 3 <= int((target > 0).sum()) < 12  # the cut is real
    check_frequencies(kernel_draws(row, temperature=0.8, top_p=torch.full((NUM_DRAWS,), 0.8)), target)


def test_chi_square_top_k_top_p_with_ties_at_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Five ids in five groups tie at the k-th largest logit (k = 4): all are kept, then top-p cuts the mass."""
    shrink(monkeypatch, ONE_BLOCK)
    row = torch.full((VOCAB,), -4.0)  # [V]
    row[[5, 17]] = torch.tensor([1.5, 1.0])
    row[[2, 13, 22, 30, 45]] = 0.5  # the tie: ranks 3..7
    row[[9, 40]] = torch.tensor([0.2, 0.1])
    target = target_of(row.tolist(), 1.0, top_k=4, top_p=0.9)
    assert (target[[2, 13, 22, 30, 45]] > 0).all() and target[9] == 0  # every tie kept, nothing below
    check_frequencies(kernel_draws(row, top_k=torch.full((NUM_DRAWS,), 4), top_p=torch.full((NUM_DRAWS,), 0.9),
                                   max_top_k=4, top_p_without_top_k=False), target)


def test_chi_square_min_p(monkeypatch: pytest.MonkeyPatch) -> None:
    shrink(monkeypatch, ONE_BLOCK)
    row = spread_row(2)
    target = target_of(row.tolist(), 1.2, min_p=0.2)
    assert 3 <= int((target > 0).sum()) < 12
    check_frequencies(kernel_draws(row, temperature=1.2, min_p=torch.full((NUM_DRAWS,), 0.2)), target)


def test_chi_square_penalties_with_top_p(monkeypatch: pytest.MonkeyPatch) -> None:
    """Presence, frequency and repetition penalties from one row's state tables, then top-p without top-k."""
    shrink(monkeypatch, ONE_BLOCK)
    row = spread_row(3) + 1.0  # some positive, some negative logits
    prompt, output = [int(row.argmax()), 3, 4], [int(row.argmax()), int(row.argsort()[-2]), 7, 7]
    penalised = reference_penalties(row.tolist(), prompt, output, 0.4, 0.3, 1.3)
    target = target_of(penalised, 0.9, top_p=0.85)
    assert 3 <= int((target > 0).sum()) < 12
    n = NUM_DRAWS
    tables = count_tables([output], [prompt], VOCAB)
    token_ids = kernel_draws(row, temperature=0.9, top_p=torch.full((n,), 0.85),
                             presence_penalty=torch.full((n,), 0.4), frequency_penalty=torch.full((n,), 0.3),
                             repetition_penalty=torch.full((n,), 1.3), output_counts=tables["output_counts"],
                             prompt_mask=tables["prompt_mask"], state_rows=torch.zeros(n, dtype=torch.int64))
    check_frequencies(token_ids, target)


def test_chi_square_check_has_teeth(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same draws judged at another temperature's distribution fail the check."""
    shrink(monkeypatch, ONE_BLOCK)
    row = spread_row(2)
    token_ids = kernel_draws(row, temperature=1.2, min_p=torch.full((NUM_DRAWS,), 0.2))
    with pytest.raises(AssertionError, match="chi-square"):
        check_frequencies(token_ids, target_of(row.tolist(), 0.6, min_p=0.2 ** (1.2 / 0.6)))


# ---------------------------------------------------------------------------------------------
# min-p before top-p (vLLM V1's order) on every kernel path


def min_p_first_row() -> tuple[torch.Tensor, list[int]]:
    """[VOCAB] logits (T = 1): probabilities 0.4, 0.3, 0.2, 0.05, 0.05 at five ids in distinct groups, the rest
    ~0; and those five ids. min_p 0.3 keeps the first three (0.9 of the mass); top_p 0.75 over them keeps two
    (0.7 >= 0.675), where top-p before min-p (vLLM V0's order) would keep three (0.7 < 0.75)."""
    ids = [37, 6, 21, 14, 45]
    row = torch.full((VOCAB,), -30.0)  # [V]
    row[ids] = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05]).log()
    return row, ids


@pytest.mark.parametrize("top_k", [0, 4, 13], ids=["rejection", "gathered-groups", "past-the-groups"])
def test_min_p_cuts_before_top_p_on_the_kernel_path(top_k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The draws of every path (top-p without top-k by rejection, top-k within the gathered groups, top-k past
    them) take exactly the two ids vLLM V1's order keeps, and the thresholds keep the same."""
    from pagoda.services.worker.sampler import truncation_thresholds

    shrink(monkeypatch, ONE_BLOCK)
    row, ids = min_p_first_row()
    n = NUM_DRAWS
    fields: dict = dict(top_p=torch.full((n,), 0.75), min_p=torch.full((n,), 0.3))
    if top_k:
        fields.update(top_k=torch.full((n,), top_k), max_top_k=top_k, top_p_without_top_k=False)
    assert set(kernel_draws(row, **fields).tolist()) == set(ids[:2])
    meta = SamplingMetadata(temperature=torch.ones(1), seeds=torch.zeros(1, dtype=torch.int64),
                            offsets=torch.zeros(1, dtype=torch.int64), top_k=torch.tensor([top_k]),
                            top_p=torch.tensor([0.75]), min_p=torch.tensor([0.3]))
    logits = row.unsqueeze(0)  # [1, V]
    for use_triton in (True, False):
        threshold = truncation_thresholds(logits.to(device()), on(meta, device()), use_triton=use_triton).cpu()
        assert (logits[0] >= threshold[0]).nonzero().squeeze(1).tolist() == sorted(ids[:2]), use_triton
