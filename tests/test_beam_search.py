"""Beam search: the pure bookkeeping (plain lists), the scheduler's forks and copy-on-write (plain objects), and
the engine against transformers' generate(num_beams=W, do_sample=False) on tiny random models and SmolLM2."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from pagoda.services.protocol.schemas import ChatBody, chat_request, decode_body
from pagoda.services.scheduler.beam import BeamSearch, assign_slots
from pagoda.services.scheduler.block_manager import hash_block, salted_root
from pagoda.services.scheduler.scheduler import Request, Scheduler
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import BeamCandidates, FinishReason, SamplingParams, StepPlan, StepResult

EOS = 2

# ---------------------------------------------------------------------------------------------
# the bookkeeping, pure


def search(width: int = 2, **kwargs) -> BeamSearch:
    fields = dict(width=width, num_return=width, length_penalty=1.0, early_stopping=False, max_new_tokens=10,
                  stop_ids=frozenset({EOS}))
    fields.update(kwargs)
    return BeamSearch(**fields)


def test_assign_slots_keeps_each_parents_first_child_in_place() -> None:
    slots = assign_slots([2, 2, 0, 3], num_slots=4)
    assert slots[0] == 2 and slots[2] == 0 and slots[3] == 3  # first children stay: no copy, no table change
    assert slots[1] == 1  # the second child of 2 takes the slot of beam 1, which has none
    assert sorted(slots) == [0, 1, 2, 3]
    assert assign_slots([0, 0, 0], num_slots=3) == [0, 1, 2]  # the first step: every beam forks slot 0


def test_stop_ranked_beyond_width_is_dropped_and_running_beams_skip_stops() -> None:
    beam = search(width=2)
    step = beam.step([7, EOS, 9, EOS], [0, 0, 0, 0], [-1.0, -1.5, -2.0, -2.5], [[]])
    assert [h.token_ids for h in beam.hypotheses] == [[EOS]]  # rank 1 < width; the EOS at rank 3 is not kept
    assert beam.hypotheses[0].score == pytest.approx(-1.5 / 1)
    assert [(parent, token) for parent, token, _ in step.beams] == [(0, 7), (0, 9)]  # stops never run on
    assert not step.done


def test_early_stopping_true_stops_once_width_hypotheses_are_kept() -> None:
    for early_stopping, done in ((True, True), (False, False)):
        beam = search(width=2, early_stopping=early_stopping)
        step = beam.step([EOS, 5, EOS, 6], [0, 0, 0, 0], [-1.4, -1.5, -1.6, -1.7], [[]])
        assert [h.score for h in beam.hypotheses] == [-1.4] and not step.done
        step = beam.step([EOS, 7, 8, 9], [0, 0, 1, 1], [-1.8, -1.9, -2.0, -2.1], [[5], [6]])
        assert [h.score for h in beam.hypotheses] == [-0.9, -1.4]
        # width hypotheses: True ends here; False goes on, as beam 7 (-1.9 / 2) can still beat -1.4
        assert step.done is done


def test_no_improvement_possible_ends_the_search_with_length_penalty_semantics() -> None:
    """early_stopping False: a running beam scored at the current length; "never" with a positive length
    penalty: at max length, which can keep the search open where False ends it."""
    results = {}
    for early_stopping in (False, "never"):
        beam = search(width=1, early_stopping=early_stopping, length_penalty=2.0, max_new_tokens=100)
        step = beam.step([EOS, 5], [0, 0], [-1.0, -1.2], [[]])
        results[early_stopping] = step.done
        assert beam.hypotheses[0].score == pytest.approx(-1.0)
    assert results == {False: True, "never": False}  # -1.2 / 1**2 < -1.0, but -1.2 / 100**2 > -1.0


def test_max_length_finishes_the_top_width_candidates() -> None:
    beam = search(width=2, max_new_tokens=1)
    step = beam.step([4, 5, 6, 7], [0, 0, 0, 0], [-1.0, -2.0, -3.0, -4.0], [[]])
    assert step.done and [h.token_ids for h in beam.best()] == [[4], [5]]
    assert not any(h.stopped for h in beam.hypotheses)


# ---------------------------------------------------------------------------------------------
# the scheduler: forks share full blocks, copy the partial one


def make_scheduler(num_blocks: int = 32) -> Scheduler:
    return Scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=64, vocab_size=100, eos_token_ids=[EOS])


def beam_request(width: int, prompt: list[int], max_tokens: int = 6, cache_salt: str = "") -> Request:
    params = SamplingParams(use_beam_search=True, best_of=width, n=width, max_tokens=max_tokens, temperature=0.0)
    return Request(request_id="r", prompt_token_ids=prompt, sampling=params.validate(), cache_salt=cache_salt)


def answer(plan: StepPlan, tokens: list[int], parents: list[int], scores: list[float]) -> StepResult:
    """The worker's result for the plan's one group; an on_device group's slots continue as the worker would
    (the width best candidates that are not stop ids, placed by assign_slots)."""
    (group,) = plan.beam_groups
    slot_parents = []
    if group.on_device:
        width = len(group.seq_ids)
        chosen = [parent for parent, token in zip(parents, tokens, strict=True)
                  if token not in group.stop_token_ids][:width]
        slot_parents = list(range(width))
        for slot, parent in zip(assign_slots(chosen, width), chosen, strict=True):
            slot_parents[slot] = parent
    return StepResult(step_id=plan.step_id, seq_ids=[], sampled_token_ids=[],
                      beam_candidates=[BeamCandidates(group.seq_ids[0], tokens, parents, scores, slot_parents)])


def test_beams_fork_by_reference_and_copy_only_the_last_partial_block() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(beam_request(3, [10, 11, 12, 13, 14, 15]))  # one full block of 4 and 2 tokens
    plan = scheduler.schedule()
    assert [g.seq_ids for g in plan.beam_groups] == [[0]]  # slot 0 alone at first
    first = scheduler.update(plan, answer(plan, [20, 21, 22, 23, 24, 25], [0] * 6, [-1, -2, -3, -4, -5, -6]))
    assert first == []  # nothing is said before the search ends
    request = scheduler.requests["r"]
    tables = [seq.table.block_ids for seq in request.sequences]
    assert tables[1][0] == tables[2][0] == tables[0][0]  # the full prompt block is shared ...
    assert scheduler.blocks._ref_counts[tables[0][0]] == 3
    assert len({t[1] for t in tables}) == 3  # ... and each beam has its own copy of the partial one
    plan = scheduler.schedule()
    assert plan.block_copies == [tables[0][1], tables[1][1], tables[0][1], tables[2][1]]
    assert [(f.seq_id, f.parent_seq_id, f.token_id) for f in plan.beam_forks] == [(0, 0, 20), (1, 0, 21), (2, 0, 22)]
    assert plan.beam_groups[0].seq_ids == [0, 1, 2] and plan.beam_groups[0].scores == [-1, -2, -3]
    assert plan.beam_groups[0].on_device and plan.beam_groups[0].stop_token_ids == [EOS]
    assert sorted(plan.seq_ids) == [0, 1, 2] and plan.num_scheduled_tokens == [1, 1, 1]
    scheduler.blocks.check_integrity([seq.table for seq in request.sequences])
    # from here the worker continues the beams: beam 1 has no child, its slot takes beam 0's second child; it
    # holds beam 0's full blocks and keeps its own last one (the worker copied beam 0's into it)
    own = [table[1] for table in tables]
    scheduler.update(plan, answer(plan, [30, 31, 32, 33, 34, 35], [0, 2, 0, 1, 1, 1], [-2, -3, -4, -5, -6, -7]))
    assert [seq.token_ids[6:] for seq in request.sequences] == [[20, 30], [20, 32], [22, 31]]
    assert [seq.table.block_ids for seq in request.sequences] == [[tables[0][0], b] for b in own]
    assert scheduler.blocks.num_free_blocks == 32 - 4  # one shared block, one own block a beam
    plan = scheduler.schedule()
    assert plan.beam_forks == [] and plan.block_copies == []  # nothing for the worker: it did it already
    assert plan.beam_groups[0].scores == [-2, -4, -3]  # slot order
    scheduler.blocks.check_integrity([seq.table for seq in request.sequences])


def plans_until_the_group_samples(scheduler: Scheduler) -> list[StepPlan]:
    """Schedule (answering each plan with nothing sampled) until a plan samples a beam group again: the plans that
    recompute a preempted group, the last one sampling it; at most four."""
    plans = []
    for _ in range(4):
        plan = scheduler.schedule()
        plans.append(plan)
        if plan.beam_groups:
            break
        scheduler.update(plan, StepResult(step_id=plan.step_id, seq_ids=[], sampled_token_ids=[]))
    return plans


@pytest.mark.parametrize(("tokens", "parents", "scores"), [
    ([20, 21, 22], [0, 0], [-1.0, -2.0, -3.0]),  # a token without a parent
    ([20], [3, 0], [float("-inf"), -1.0]),  # padding-like, one token short
    ([], [], []),  # no candidate at all
])
def test_a_first_steps_malformed_candidates_end_the_request_only(tokens: list[int], parents: list[int],
                                                                 scores: list[float]) -> None:
    """Lists of unequal length or none at all (a worker bug): the request ends with an error, where BeamSearch.step's
    assert (or an index past the padding filter's end) would end the scheduler process and every request in it."""
    scheduler = make_scheduler()
    scheduler.add_request(beam_request(2, [10, 11, 12, 13, 14]))
    plan = scheduler.schedule()
    request = scheduler.requests["r"]
    updates = scheduler.update(plan, answer(plan, tokens, parents, scores))
    assert [update.finish_reason for update in updates] == [FinishReason.ERROR] * 2
    assert all(seq.is_finished for seq in request.sequences) and "r" not in scheduler.requests


def test_preempted_beam_group_waits_whole_and_recomputes_each_beam() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(beam_request(2, [10, 11, 12, 13, 14]))
    plan = scheduler.schedule()
    scheduler.update(plan, answer(plan, [20, 21, 22, 23], [0] * 4, [-1, -2, -3, -4]))
    request = scheduler.requests["r"]
    scheduler._preempt(request.sequences[1])
    assert all(seq.status == 0 and not seq.table.block_ids for seq in request.sequences)  # both wait, no blocks
    plans = plans_until_the_group_samples(scheduler)
    assert plans[-1].beam_groups and plans[-1].beam_groups[0].seq_ids == [0, 1]  # they sample together again
    assert all(not p.beam_groups or len(p.beam_groups[0].seq_ids) == 2 for p in plans)
    recomputed = [new.token_ids for p in plans for new in p.new_requests]
    assert recomputed == [[10, 11, 12, 13, 14, 20], [10, 11, 12, 13, 14, 21]]


def test_a_salted_beam_group_caches_and_recomputes_under_its_salt() -> None:
    """cache_salt with beam search: the beams' shared prompt block is hashed under the salt, and the group that a
    preemption sends back finds it there (and an unsalted lookup of the same tokens does not)."""
    scheduler = make_scheduler()
    request = beam_request(2, [10, 11, 12, 13, 14], cache_salt="s")
    scheduler.add_request(request)
    plan = scheduler.schedule()
    scheduler.update(plan, answer(plan, [20, 21, 22, 23], [0] * 4, [-1, -2, -3, -4]))
    salted = hash_block(salted_root("s"), (10, 11, 12, 13))
    assert [seq.table.block_hashes for seq in request.sequences] == [[salted], [salted]]
    assert scheduler.blocks.lookup_prefix([10, 11, 12, 13, 14], 1) == ([], [])
    scheduler._preempt(request.sequences[1])
    plans = plans_until_the_group_samples(scheduler)
    assert plans[-1].beam_groups and plans[-1].beam_groups[0].seq_ids == [0, 1]
    assert [new.num_computed_tokens for p in plans for new in p.new_requests] == [4, 4]


@pytest.mark.parametrize(("logprob_fields", "named"), [
    ({"logprobs": True}, "logprobs"),  # chat's logprobs alone: the field the body set
    ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
])
def test_a_chat_beam_search_with_logprobs_names_the_field_set(logprob_fields: dict[str, object], named: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "n": 2,
            "best_of": 2, **logprob_fields}
    with pytest.raises(InvalidRequestError) as error:
        chat_request(decode_body(json.dumps(body).encode(), ChatBody), "r", 0.0)
    assert error.value.param == named and "beam search" in error.value.message


def test_beam_search_parameters_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(best_of=3).validate()  # best_of > n needs beam search
    with pytest.raises(InvalidRequestError, match="n must not exceed"):
        SamplingParams(use_beam_search=True, best_of=2, n=3).validate()
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(use_beam_search=True, best_of=2, top_p=0.5).validate()
    assert error.value.param == "top_p"
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(length_penalty=0.5).validate()
    assert error.value.param == "length_penalty"
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(use_beam_search=True, early_stopping="sometimes").validate()
    assert error.value.param == "early_stopping"
    scheduler = make_scheduler(num_blocks=8)
    with pytest.raises(InvalidRequestError) as error:  # 4 beams of up to 17 tokens: 20 blocks of 4, not 8
        scheduler.add_request(beam_request(4, [1] * 11))
    assert error.value.param == "best_of"


@pytest.mark.parametrize("best_of", [None, 9])
def test_a_width_the_server_cannot_run_names_the_field_that_set_it(best_of: int | None) -> None:
    """The width is best_of, else n (vLLM's clients send n alone): a search too wide for a step or for the KV cache
    named best_of to a client that had not sent it."""
    named = "best_of" if best_of is not None else "n"
    scheduler = make_scheduler(num_blocks=8)  # max_num_seqs 8
    too_wide = SamplingParams(use_beam_search=True, best_of=best_of, n=9, max_tokens=2, temperature=0.0).validate()
    with pytest.raises(InvalidRequestError) as error:
        scheduler.add_request(Request(request_id="wide", prompt_token_ids=[1, 2], sampling=too_wide))
    assert error.value.param == named and "width 9" in error.value.message
    too_long = SamplingParams(use_beam_search=True, best_of=best_of and 4, n=4, max_tokens=6,
                              temperature=0.0).validate()  # 4 beams of up to 17 tokens: 20 blocks of 4, not 8
    with pytest.raises(InvalidRequestError) as error:
        scheduler.add_request(Request(request_id="long", prompt_token_ids=[1] * 11, sampling=too_long))
    assert error.value.param == named and "KV blocks" in error.value.message


# ---------------------------------------------------------------------------------------------
# the engine against transformers


def tiny_llama(folder: Path, seed: int) -> tuple[Path, int]:
    """A tiny random Llama with sharp logits (no near-ties between beams) whose EOS is a token its beams
    often meet, so that hypotheses end by EOS as well as by length."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=EOS,
                         bos_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
        counts: Counter[int] = Counter()
        for prompt in prompts_for(seed):
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=0,
                                 eos_token_id=None)
            counts.update(out[0, len(prompt) + 2:].tolist())
    eos = counts.most_common(1)[0][0]
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    model.save_pretrained(folder)
    return folder, eos


def prompts_for(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(3, 256, (length,), generator=generator).tolist() for length in (5, 17, 30, 9, 40, 3)]


def hf_beams(folder: Path, prompts: list[list[int]], eos: int, width: int, n: int, max_new: int,
             length_penalty: float, early_stopping: bool | str) -> list[tuple[list[list[int]], list[float]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    answers = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=width,
                                 num_return_sequences=n, max_new_tokens=max_new, length_penalty=length_penalty,
                                 early_stopping=early_stopping, pad_token_id=0, eos_token_id=eos,
                                 return_dict_in_generate=True, output_scores=True)
            sequences = []
            for row in out.sequences.tolist():
                generated = row[len(prompt):]
                sequences.append(generated[:generated.index(eos) + 1] if eos in generated else generated)
            answers.append((sequences, out.sequences_scores.tolist()))
    return answers


def check_against_hf(llm, prompts: list[list[int]], expected, width: int, n: int, max_new: int,  # noqa: ANN001
                     length_penalty: float, early_stopping: bool | str) -> list:
    outputs = llm.generate(prompts, SamplingParams(use_beam_search=True, best_of=width, n=n, max_tokens=max_new,
                                                   length_penalty=length_penalty, early_stopping=early_stopping,
                                                   temperature=0.0))
    for output, (sequences, scores) in zip(outputs, expected, strict=True):
        assert [c.token_ids for c in output.outputs] == sequences
        assert [c.score for c in output.outputs] == pytest.approx(scores, rel=1e-4, abs=1e-5)
    return outputs


CASES = [(4, 4, 1.0, False), (4, 2, 0.5, True), (3, 3, 2.0, "never"), (4, 4, -0.5, False)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    return tiny_llama(tmp_path_factory.mktemp("tiny_beam"), seed=0)


@pytest.mark.parametrize("width,n,length_penalty,early_stopping", CASES)
def test_beam_search_matches_transformers_tiny(tiny: tuple[Path, int], width: int, n: int, length_penalty: float,
                                               early_stopping: bool | str) -> None:
    from pagoda import LLM

    folder, eos = tiny
    prompts = prompts_for(0)
    expected = hf_beams(folder, prompts, eos, width, n, 12, length_penalty, early_stopping)
    llm = LLM(str(folder), num_kv_blocks=64)
    outputs = check_against_hf(llm, prompts, expected, width, n, 12, length_penalty, early_stopping)
    reasons = {c.finish_reason for o in outputs for c in o.outputs}
    assert reasons <= {"stop", "length"} and "length" in reasons
    llm.engine.scheduler.blocks.check_integrity([])


def test_beam_search_matches_transformers_under_preemption_and_async(tiny: tuple[Path, int]) -> None:
    """17 blocks of 16 tokens hold one beam group (4 beams of up to 52 tokens) but not all six: groups are
    preempted in the middle of their search and recomputed; with async scheduling (two plans in flight) too."""
    from pagoda import LLM

    folder, eos = tiny
    prompts = prompts_for(0)
    expected = hf_beams(folder, prompts, eos, 4, 4, 12, 1.0, True)
    assert any(len(s) < 12 for sequences, _ in expected for s in sequences)  # some hypotheses end by EOS
    for async_scheduling in (False, True):
        llm = LLM(str(folder), num_kv_blocks=17, async_scheduling=async_scheduling)
        scheduler = llm.engine.scheduler
        in_flight: list[int] = []  # each preempted beam search's pending steps (async: one planned ahead)
        preempt = scheduler._preempt

        def recording_preempt(seq, preempt=preempt, in_flight=in_flight) -> None:  # noqa: ANN001
            if seq.request.beam is not None and seq.request.beam.num_generated:
                in_flight.append(seq.num_pending)
            preempt(seq)

        scheduler._preempt = recording_preempt
        check_against_hf(llm, prompts, expected, 4, 4, 12, 1.0, True)
        assert scheduler.stats.num_preemptions > 0
        assert max(in_flight, default=0) == (1 if async_scheduling else 0)  # async: preempted with a step running
        scheduler.blocks.check_integrity([])


def test_llm_beam_search_on_smollm2(smollm2_dir: Path) -> None:
    """LLM.beam_search (vLLM's offline API) gives transformers' beams and scores on the real model, short."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagoda import LLM, BeamSearchParams

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt = tokenizer.encode("The three primary colours are")
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=3,
                             num_return_sequences=3, max_new_tokens=8, return_dict_in_generate=True,
                             output_scores=True, pad_token_id=tokenizer.eos_token_id)
    for async_scheduling in (False, True):  # True: each beam step planned while the previous one runs
        llm = LLM(str(smollm2_dir), async_scheduling=async_scheduling)
        (result,) = llm.beam_search([{"prompt": "The three primary colours are"}],
                                    BeamSearchParams(beam_width=3, max_tokens=8))
        assert [s.tokens for s in result.sequences] == out.sequences.tolist()
        assert [s.score for s in result.sequences] == pytest.approx(out.sequences_scores.tolist(), rel=1e-4)
        assert result.sequences[0].text == tokenizer.decode(out.sequences[0])  # vLLM's: prompt and beam, decoded
