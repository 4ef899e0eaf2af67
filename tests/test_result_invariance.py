"""A request's result does not depend on what else runs: its tokens, logprobs and finish reason alone in a roomy
engine (the oracle) equal those it gets batched with others, with its prompt found in the prefix cache, chunked
at a small token budget, preempted and recomputed, swapped out to host slots and back, with a step in flight at
each preemption (async scheduling), and through the padded decode batches of the CUDA-graph path.

fp32 on the CPU: a different batch shape may only move a logit by rounding noise, so a difference is allowed
only where the oracle's two likeliest tokens are within NEAR_TIE of each other (the rest of that completion is
then not compared); anything else is a bug (wrong positions, stale blocks, a seed's stream or a penalty's counts
restarted, a grammar matcher out of step)."""

from __future__ import annotations

import bisect
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.outputs import RequestOutput
from pagoda.params import GuidedDecodingParams
from pagoda.services.worker.cuda_graphs import DecodeGraphs
from pagoda.services.worker.models import AttentionMetadata
from tests.harness import tiny_llama_over_smollm2_vocab

NEAR_TIE = 1e-4  # top-1 minus top-2 logprob under which rounding noise may flip a choice
LOGPROB_TOL = 1e-4
SETTINGS = dict(max_model_len=256, block_size=4, dtype="float32", seed=0)
SWAP_64_KIB = 64 / (1 << 20)  # GiB: 64 KiB of host slots, fewer than the preempted sequences want

# ------------------------------------------------------------------------------------------------------------
# the requests: every per-request state the worker and scheduler keep, in one batch


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 500) for _ in range(20)]  # five blocks: odd requests share them
    prompts = [(shared if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randint(3, 22))]
               for i in range(8)]
    sp = SamplingParams
    params = [
        sp(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3),
        sp(temperature=0.9, seed=11, top_p=0.9, max_tokens=24, ignore_eos=True, logprobs=2),
        sp(temperature=0.7, seed=12, presence_penalty=1.2, frequency_penalty=0.5, repetition_penalty=1.2,
           min_tokens=10, logit_bias={7: 3.0}, stop_token_ids=[5, 9, 77], max_tokens=24, logprobs=2),
        sp(temperature=1.0, seed=13, n=3, top_k=40, max_tokens=20, ignore_eos=True, logprobs=2),
        sp(use_beam_search=True, n=2, best_of=3, max_tokens=12, ignore_eos=True, temperature=0.0),
        sp(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=2),
        sp(temperature=0.8, seed=14, min_p=0.05, n=2, frequency_penalty=1.0, max_tokens=20, ignore_eos=True,
           logprobs=2),
        sp(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1, allowed_token_ids=list(range(100, 300))),
    ]
    return prompts, params


PROMPTS, PARAMS = _requests()


def _alone(model: str | Path, prompts: list[list[int]], params: list[SamplingParams],
           **settings: object) -> list[RequestOutput]:
    """Each request by itself in an engine with room for all, nothing cached from the one before."""
    llm = _roomy(model, **settings)
    return [llm.generate([prompt], sampling)[0] for prompt, sampling in zip(prompts, params, strict=True)]


def _roomy(model: str | Path, **settings: object) -> LLM:
    return LLM(str(model), **{**SETTINGS, **settings, "enable_prefix_caching": False})


@pytest.fixture(scope="module")
def alone() -> list[RequestOutput]:
    return _alone("tiny", PROMPTS, PARAMS)


# ------------------------------------------------------------------------------------------------------------
# comparison


def _logprob(entry: dict, token_id: int) -> float:
    value = entry[token_id]
    return float(getattr(value, "logprob", value))


def _top_gap(entry: dict) -> float:
    values = sorted((_logprob(entry, token_id) for token_id in entry), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def assert_same_results(want: list[RequestOutput], got: list[RequestOutput]) -> None:
    """Every completion of every request as the oracle's: tokens (up to a near-tie flip), finish reason, logprobs
    and their top tokens, cumulative logprob (beam scores too) and prompt logprobs."""
    assert len(want) == len(got)
    for index, (a, b) in enumerate(zip(want, got, strict=True)):
        assert len(a.outputs) == len(b.outputs), f"request {index}: {len(b.outputs)} completions"
        for x, y in zip(a.outputs, b.outputs, strict=True):
            where = f"request {index} completion {x.index}"
            if x.token_ids != y.token_ids:
                at = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids, strict=False)) if s != t),
                          min(len(x.token_ids), len(y.token_ids)))
                gap = _top_gap(x.logprobs[at]) if x.logprobs and at < len(x.logprobs) else float("inf")
                assert gap < NEAR_TIE, (f"{where}: token {at} differs ({x.token_ids[at:at + 4]} alone, "
                                        f"{y.token_ids[at:at + 4]} here) where the top two are {gap:.4f} apart")
                continue  # a near-tie flipped: the rest follows another path
            assert y.finish_reason == x.finish_reason, where
            if x.logprobs is not None:
                assert y.logprobs is not None and len(y.logprobs) == len(x.logprobs), where
                for step, (ex, ey) in enumerate(zip(x.logprobs, y.logprobs, strict=True)):
                    assert ey.keys() == ex.keys(), f"{where}: top tokens differ at {step}"
                    for token_id in ex:
                        assert _logprob(ey, token_id) == pytest.approx(_logprob(ex, token_id), abs=LOGPROB_TOL), \
                            f"{where}: logprob of {token_id} at {step}"
            if x.cumulative_logprob is not None:
                assert y.cumulative_logprob == pytest.approx(x.cumulative_logprob, abs=1e-3), where
        if a.prompt_logprobs is not None:
            assert b.prompt_logprobs is not None and len(b.prompt_logprobs) == len(a.prompt_logprobs)
            for ex, ey in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
                assert ey.keys() == ex.keys()
                for token_id in ex:
                    assert _logprob(ey, token_id) == pytest.approx(_logprob(ex, token_id), abs=LOGPROB_TOL)


# ------------------------------------------------------------------------------------------------------------
# the engine under pressure

CROWDED = {
    # everything at once with room to spare; the second run finds prompts and outputs in the prefix cache
    "batched": dict(settings={}, preempted=False, swapped=False),
    # 40 blocks of 4 tokens against ~70 wanted: recompute, serially and with a step in flight
    "recompute": dict(settings=dict(num_kv_blocks=40), preempted=True, swapped=False),
    "recompute_async": dict(settings=dict(num_kv_blocks=40, async_scheduling=True), preempted=True, swapped=False),
    # host slots for some preempted sequences: they swap out and back, the rest recompute
    "swap_async": dict(settings=dict(num_kv_blocks=40, swap_space=SWAP_64_KIB, async_scheduling=True),
                       preempted=True, swapped=True),
    # 5 tokens a step: every prompt chunked, chunks preempted part way
    "chunked": dict(settings=dict(max_num_batched_tokens=5, num_kv_blocks=36), preempted=True, swapped=False),
    # three sequences a step: requests queue behind one another and n > 1 siblings wait holding forked blocks
    "few_seats": dict(settings=dict(max_num_seqs=3, async_scheduling=True), preempted=False, swapped=False),
}


@pytest.mark.parametrize("name", list(CROWDED))
def test_each_request_gets_its_alone_result_whatever_runs_beside_it(alone: list[RequestOutput], name: str) -> None:
    case = CROWDED[name]
    llm = LLM("tiny", **{**SETTINGS, **case["settings"]})
    assert_same_results(alone, llm.generate(PROMPTS, PARAMS))
    stats = llm.engine.scheduler.stats
    assert (stats.num_preemptions > 0) == case["preempted"], stats
    assert (stats.num_swapped > 0) == case["swapped"], stats
    # again, in reverse order: now prompts hit the blocks the first run cached (prompt and generated tokens)
    hits_before = stats.prefix_hit_tokens
    again = llm.generate(PROMPTS[::-1], PARAMS[::-1])[::-1]
    assert stats.prefix_hit_tokens > hits_before
    assert_same_results(alone, again)
    blocks = llm.engine.scheduler.blocks
    blocks.check_integrity()
    assert blocks.num_free_blocks == blocks.num_blocks


def test_a_continuation_reads_the_blocks_its_first_turn_decoded() -> None:
    """A second turn (prompt + the first turn's output + more) hits blocks that decode steps filled and hashed, and
    after a preemption by swap their copies: it equals a run that computes it all from scratch."""
    rng = random.Random(11)
    first = [rng.randrange(3, 500) for _ in range(13)]
    greedy = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.9, seed=4, max_tokens=23, ignore_eos=True, logprobs=2, presence_penalty=0.4)
    llm = LLM("tiny", **SETTINGS, num_kv_blocks=20, swap_space=SWAP_64_KIB)
    turn = llm.generate([first, first], [greedy, seeded])
    prompts = [first + turn[0].outputs[0].token_ids + [rng.randrange(3, 500) for _ in range(5)],
               first + turn[1].outputs[0].token_ids[:-1]]
    hits_before = llm.engine.scheduler.stats.prefix_hit_tokens
    got = llm.generate(prompts, [greedy, seeded])
    stats = llm.engine.scheduler.stats
    assert stats.prefix_hit_tokens - hits_before >= 2 * 32, "the decoded blocks were found in the cache"
    assert stats.num_swapped > 0, stats
    assert_same_results(_alone("tiny", prompts, [greedy, seeded]), got)


# ------------------------------------------------------------------------------------------------------------
# the padded decode batches of the CUDA-graph path, run eagerly on the CPU


class EagerDecodeGraphs(DecodeGraphs):
    """DecodeGraphs whose replay runs the captured computation eagerly: the same static buffers, the batch padded
    to a captured size with rows of slot -1 and length 0, the same block-table patch for beams the device chose.
    The CPU's attention reads the lengths from host lists (the CUDA kernels read seq_lens): they are given."""

    def capture(self) -> None:
        self.num_replays = 0

    def replay(self, input_ids: torch.Tensor, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
               block_tables: np.ndarray, patch=None) -> torch.Tensor:  # noqa: ANN001
        self.num_replays += 1
        batch = len(positions)
        size = self.sizes[bisect.bisect_left(self.sizes, batch)]
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(torch.from_numpy(positions))
        self.slots[:batch].copy_(torch.from_numpy(slots))
        self.seq_lens[:batch].copy_(torch.from_numpy(seq_lens.astype(np.int32)))
        self.block_tables[:batch, :block_tables.shape[1]].copy_(torch.from_numpy(block_tables))
        if patch is not None:
            patch(self.block_tables[:batch, :block_tables.shape[1]])
        self.slots[batch:size].fill_(-1)
        self.seq_lens[batch:size].zero_()
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size], block_tables=self.block_tables[:size], seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start[:size + 1], seq_lens_host=self.seq_lens[:size].tolist(),
            query_lens_host=[1] * size, max_query_len=1, max_seq_len=self.max_model_len)
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)  # [size, H]
        return self.model.compute_logits(hidden)[:batch]  # [B, V]


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_padded_decode_batches_give_the_alone_result(model: str) -> None:
    """Decode steps through the graph path's padded batches (13 seats: sizes 1, 2, 4, 8, 13), with preemption and
    a step in flight: the padding rows neither write the cache nor change a real row."""
    prompts, params = PROMPTS[:5], PARAMS[:5]  # greedy, seeded, penalised, n = 3, beams
    want = _alone(model, prompts, params)
    llm = LLM(model, **SETTINGS, max_num_seqs=13, num_kv_blocks=30, async_scheduling=True)
    runner = llm.engine.runner
    graphs = EagerDecodeGraphs(runner.model, runner.kv_caches, 13, runner.state.block_table.shape[1],
                               runner.max_model_len, runner.staging)
    graphs.capture()
    runner.graphs = graphs
    assert_same_results(want, llm.generate(prompts, params))
    assert graphs.num_replays > 10 and llm.engine.scheduler.stats.num_preemptions > 0


# ------------------------------------------------------------------------------------------------------------
# constrained rows and stop strings: a tiny random model with SmolLM2's tokenizer


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A 2-layer Llama of hidden size 64 over SmolLM2's vocabulary (random weights, its tokenizer files)."""
    return tiny_llama_over_smollm2_vocab(tmp_path_factory.mktemp("tiny-smollm2-vocab"), smollm2_dir)


def test_constrained_and_stopped_rows_keep_their_state_through_preemption(tokenizer_model: Path) -> None:
    """Grammar rows (JSON schema, regex, choice; their forced starts in the prefill) and stop strings, batched
    with n > 1 and penalised rows and preempted (recompute and swap, a step in flight): each matcher is rebuilt
    from the tokens its sequence carries, each seed's stream goes on where it was."""
    rng = random.Random(3)
    shared = [rng.randrange(100, 40000) for _ in range(12)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(100, 40000) for _ in range(rng.randint(4, 16))]
               for i in range(5)]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    sp, guided = SamplingParams, GuidedDecodingParams
    roomy = _roomy(tokenizer_model, max_model_len=512)
    # stop strings that end the completions part way: the text of a late token of each, unstopped
    diverse = dict(temperature=1.0, seed=6, n=2, max_tokens=24, ignore_eos=True, frequency_penalty=2.0,
                   repetition_penalty=3.0, logprobs=2)
    unstopped = roomy.generate([prompts[2]], sp(**diverse))[0].outputs
    decode = roomy.get_tokenizer().decode
    stops = [text for c in unstopped if (text := decode(c.token_ids[14:15]).strip())]
    assert stops
    params = [
        sp(temperature=0.0, max_tokens=24, logprobs=2, guided_decoding=guided(json=schema)),
        sp(temperature=0.8, seed=5, max_tokens=24, logprobs=2, guided_decoding=guided(regex=r"\(\d{3}\) \d{3}-\d{4}")),
        sp(**diverse, stop=stops, include_stop_str_in_output=True),
        sp(temperature=1.0, seed=8, max_tokens=24, logprobs=2, presence_penalty=0.5,
           guided_decoding=guided(json=schema)),
        sp(temperature=0.9, seed=7, max_tokens=24, logprobs=2,
           guided_decoding=guided(choice=["fifty-one", "51", "a much longer answer than that"])),
    ]
    want = [roomy.generate([prompt], sampling)[0] for prompt, sampling in zip(prompts, params, strict=True)]
    assert {c.finish_reason for c in want[2].outputs} == {"stop"}, "the stop strings end both completions"
    for swaps, settings in ((False, dict(num_kv_blocks=20, async_scheduling=True)),
                            (True, dict(num_kv_blocks=20, swap_space=SWAP_64_KIB / 4, max_num_batched_tokens=6))):
        llm = LLM(str(tokenizer_model), **SETTINGS | dict(max_model_len=512), **settings)
        got = llm.generate(prompts, params)
        assert_same_results(want, got)
        for a, b in zip(want, got, strict=True):
            assert [c.text for c in b.outputs] == [c.text for c in a.outputs]
        stats = llm.engine.scheduler.stats
        assert stats.num_preemptions > 0 and (stats.num_swapped > 0) == swaps, stats
