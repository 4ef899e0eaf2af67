"""Preemption by swap across cache layouts: DeepSeek's one latent vector a token and layer, the MoE families' K/V per
head, the fp8 cache; with a cache small enough to preempt, greedy tokens and logprobs with swap space equal those
without it and those of a run with room for all, and the swaps really happened."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pagoda import LLM, SamplingParams
from tests.parity import random_prompts
from tests.test_deepseek import _v2, _v3
from tests.test_moe_models import _qwen3_moe

VOCAB = 256
BUILDERS: dict[str, Callable[[Path], Path]] = {"deepseek-v2": _v2, "deepseek-v3": _v3, "qwen3-moe": _qwen3_moe}
Completions = list[tuple[list[int], float]]


def _generate(llm: LLM, prompts: list[list[int]]) -> Completions:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    return [(list(out.outputs[0].token_ids), out.outputs[0].cumulative_logprob or 0.0)
            for out in llm.generate(prompts, params)]


def _assert_same(got: Completions, want: Completions) -> None:
    for (tokens, logprob), (want_tokens, want_logprob) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert logprob == pytest.approx(want_logprob, abs=1e-3)


@pytest.mark.parametrize(("family", "kv_cache_dtype", "async_scheduling"), [
    ("deepseek-v2", "auto", False), ("deepseek-v3", "fp8", True), ("qwen3-moe", "fp8", False)])
def test_swapped_preemption_gives_each_requests_own_outputs(tmp_path: Path, family: str, kv_cache_dtype: str,
                                                            async_scheduling: bool) -> None:
    """6 prompts of 23-61 tokens, 16 new each, in 14 blocks of 8 (~42 wanted): 6 preemptions, by swap with swap
    space; every block of a swapped sequence comes back by copy (no prefix caching)."""
    folder = BUILDERS[family](tmp_path)
    prompts = random_prompts([40, 55, 23, 61, 35, 47], VOCAB, seed=3)
    settings = dict(dtype="float32", block_size=8, kv_cache_dtype=kv_cache_dtype, async_scheduling=async_scheduling)
    unhurried = _generate(LLM(str(folder), **settings), prompts)  # room for all: what each gives alone
    runs = {}
    for swap_space in (0.0, 0.002):  # 2 MiB: hundreds of slots
        llm = LLM(str(folder), num_kv_blocks=14, enable_prefix_caching=False, swap_space=swap_space, **settings)
        runs[swap_space] = _generate(llm, prompts)
        scheduler = llm.engine.scheduler
        assert scheduler.stats.num_preemptions > 0
        assert (scheduler.stats.num_swapped > 0) == (swap_space > 0)
        scheduler.host.settle()
        assert scheduler.host.num_free_blocks == scheduler.host.num_blocks, "every host slot comes back"
    _assert_same(runs[0.002], runs[0.0])
    _assert_same(runs[0.002], unhurried)
