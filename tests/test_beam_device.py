"""Beam search continued on the device: the block-copy kernel against its reference, the vectorised choice of the
next beams against beam.py's, and the engine planning a beam step before the previous one's result (async
scheduling) with transformers' answers, through an abort in the middle."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagoda.kernels import reference as ref
from pagoda.kernels.block_copy import copy_blocks
from pagoda.services.scheduler.beam import BeamSearch, assign_slots
from pagoda.services.worker.sampler import beam_continue
from pagoda.shared.messages import SamplingParams
from tests.test_beam_search import check_against_hf, hf_beams, prompts_for, tiny_llama

# ---------------------------------------------------------------------------------------------
# the kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_copy_blocks_matches_reference(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn((3, 9, 4, 2, 8), generator=generator).to(dtype)  # [planes, blocks, block_size, heads, D]
    # 1 <- 0 and 5 <- 0 (one source, two destinations), 2 <- 7; 3 and 4 keep theirs (skipped)
    src = torch.tensor([0, 3, 0, 7, 4])
    dst = torch.tensor([1, 3, 5, 2, 4])
    expected = cache.clone()
    ref.copy_blocks(expected, src, dst)
    copy_blocks(cache, src, dst)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(expected[:, 5].float(), expected[:, 0].float()) and torch.equal(expected[:, 2], cache[:, 7])


def test_copy_blocks_rejects_bad_inputs() -> None:
    cache = torch.zeros((2, 4, 8))
    with pytest.raises(ValueError, match="src and dst"):
        copy_blocks(cache, torch.tensor([0, 1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="int32 or int64"):
        copy_blocks(cache, torch.tensor([0.0]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="contiguous"):
        copy_blocks(cache.transpose(0, 1), torch.tensor([0]), torch.tensor([1]))


# ---------------------------------------------------------------------------------------------
# the worker's choice of the next beams is the scheduler's


def test_beam_continue_chooses_as_beam_search_and_assign_slots() -> None:
    """Random groups of several widths, candidates best first with stop ids among them (and ties of score): by
    slot, the parent, token and score the scheduler's bookkeeping gives."""
    rng = random.Random(0)
    stops_of = [[2], [], [2, 5], [7]]
    for trial in range(40):
        widths = [rng.randint(1, 4) for _ in range(rng.randint(1, 5))]
        k = 2 * max(widths) + 3
        tokens, parents, scores, stops = [], [], [], []
        expected = []
        for width in widths:
            stop_ids = stops_of[rng.randrange(len(stops_of))]
            row_tokens = [rng.choice([2, 5, 7, 9, 11, 12, 13, 14]) if rng.random() < 0.3 else rng.randrange(15, 60)
                          for _ in range(k)]
            row_parents = [rng.randrange(width) for _ in range(k)]
            row_scores = sorted((round(-rng.uniform(0, 4), 1) for _ in range(k)), reverse=True)  # ties likely
            search = BeamSearch(width=width, num_return=width, length_penalty=1.0, early_stopping=False,
                                max_new_tokens=100, stop_ids=frozenset(stop_ids), num_generated=1,
                                scores=[0.0] * width)
            count = max(2, 1 + len(stop_ids)) * width
            decided = search.step(row_tokens[:count], row_parents[:count], row_scores[:count], [[]] * width)
            slots = assign_slots([p for p, _, _ in decided.beams], width)
            by_slot = [(0, 0, 0.0)] * width
            for beam, slot in zip(decided.beams, slots, strict=True):
                by_slot[slot] = beam
            expected.append(by_slot)
            tokens.append(row_tokens)
            parents.append(row_parents)
            scores.append(row_scores)
            stops.append(stop_ids + [-1] * (2 - len(stop_ids)))
        slot_parent, slot_token, slot_score = beam_continue(
            torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores, dtype=torch.float32), torch.tensor(stops),
            torch.tensor(widths), max(widths))
        for g, width in enumerate(widths):
            assert slot_parent[g, :width].tolist() == [p for p, _, _ in expected[g]], trial
            assert slot_token[g, :width].tolist() == [t for _, t, _ in expected[g]], trial
            assert slot_score[g, :width].tolist() == pytest.approx([s for _, _, s in expected[g]]), trial
            assert slot_parent[g, width:].tolist() == list(range(width, max(widths)))  # padding keeps itself


# ---------------------------------------------------------------------------------------------
# the engine: beams planned ahead of their result


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    return tiny_llama(tmp_path_factory.mktemp("tiny_beam_device"), seed=0)


def test_async_beam_steps_are_planned_before_the_previous_result(tiny: tuple[Path, int]) -> None:
    """With two plans in flight, a beam group's next step goes out while its previous one runs (the worker chose
    its beams), block tables and copies on the device; the answers are transformers'."""
    from pagoda import LLM

    folder, eos = tiny
    prompts = prompts_for(0)
    expected = hf_beams(folder, prompts, eos, 4, 3, 12, 1.0, False)
    llm = LLM(str(folder), num_kv_blocks=64, async_scheduling=True)
    scheduler = llm.engine.scheduler
    ahead: list[int] = []  # for each plan with beams the worker continues: plans in flight when it was made
    schedule = scheduler.schedule

    def counting_schedule():  # noqa: ANN202
        in_flight = scheduler.num_inflight
        plan = schedule()
        if any(group.on_device for group in plan.beam_groups):
            ahead.append(in_flight)
        return plan

    scheduler.schedule = counting_schedule
    check_against_hf(llm, prompts, expected, 4, 3, 12, 1.0, False)
    assert ahead and sum(1 for n in ahead if n >= 1) >= len(ahead) // 2  # most beam steps overlap the previous one
    scheduler.blocks.check_integrity([])


def test_beam_request_aborted_mid_flight_leaves_the_others_exact(tiny: tuple[Path, int]) -> None:
    """A beam search aborted while its planned-ahead step runs: its blocks come back, the other searches keep
    transformers' answers."""
    from pagoda import LLM

    folder, eos = tiny
    prompts = prompts_for(0)[:4]
    expected = hf_beams(folder, prompts, eos, 3, 3, 12, 1.0, False)
    llm = LLM(str(folder), num_kv_blocks=64, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(use_beam_search=True, best_of=3, n=3, max_tokens=12, temperature=0.0)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    victim = engine.add_request(prompts_for(1)[0], params)
    for _ in range(6):  # the victim's group is past its first step, a step of it in flight
        engine.step()
    request = engine.scheduler.requests[victim]
    assert request.beam is not None and request.beam.num_generated > 1
    assert engine.scheduler.num_inflight >= 1
    engine.abort_request(victim)
    while engine.has_unfinished_requests():
        engine.step()
    for request_id, (sequences, scores) in zip(ids, expected, strict=True):
        output = engine.get_output(request_id)
        assert [c.token_ids for c in output.outputs] == sequences
        assert [c.score for c in output.outputs] == pytest.approx(scores, rel=1e-4, abs=1e-5)
    assert {c.finish_reason for c in engine.get_output(victim).outputs} == {"abort"}
    engine.scheduler.blocks.check_integrity([])
    assert engine.scheduler.blocks.num_free_blocks == engine.scheduler.blocks.num_blocks
