"""One request's bad values stay its own: refused at validation, clamped or refused if they reach the worker
anyway, and a sampler failure on its row fails that request alone (found by bisection)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from pagoda import LLM
from pagoda.services.worker.isolation import FaultySampler, bisect_failures
from pagoda.services.worker.sampler import Sampler, SamplerOutput
from pagoda.services.worker.sampling_state import INT32_MAX, SamplingState, admission_error
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import MAX_INT32, NewRequest, SamplingParams, StepPlan

HUGE = [2**31, 2**63, 2**64 - 1, 2**70]


@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize("name", ["top_k", "min_tokens", "max_tokens"])
def test_validate_refuses_counts_past_int32(name: str, value: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{name: value, "max_tokens": None} if name != "max_tokens" else {name: value}).validate()
    assert info.value.param == name


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1, 2**64])
def test_validate_refuses_seeds_past_int64(value: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(seed=value).validate()
    assert info.value.param == "seed"


def test_validate_accepts_the_bounds() -> None:
    SamplingParams(top_k=MAX_INT32, max_tokens=MAX_INT32, min_tokens=MAX_INT32, seed=2**63 - 1,
                   stop_token_ids=[MAX_INT32], logit_bias={MAX_INT32: 1.0}).validate()
    SamplingParams(seed=-(2**63)).validate()


def test_worker_clamps_what_slipped_through() -> None:
    """A NewRequest that never met validate (an older peer, a bug) must not overflow the worker's rows."""
    state = SamplingState(4, 512, torch.device("cpu"), eos_token_ids=(2,))
    bad = SamplingParams(top_k=2**63, min_tokens=2**63, max_tokens=None)
    good = SamplingParams(top_k=5)
    # the wire carries them (uint64) and decodes them back unchanged
    bad = msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=SamplingParams)
    state.admit([(0, NewRequest(0, [1, 2, 3], 3, [0], 0, bad, seed=1)),
                 (1, NewRequest(1, [1, 2, 3], 3, [1], 0, good, seed=2))])
    assert state.top_k[0] == 0 and state.top_k[1] == 5  # a cut past the vocabulary is no cut
    assert state.min_tokens[0] == INT32_MAX  # never stops early, as asked, without overflowing the row


# ---------------------------------------------------------------- defence in depth: one row fails alone


def test_bisection_finds_every_guilty_row() -> None:
    guilty = {3, 11, 12}

    calls: list[list[int]] = []

    def sample_subset(index: np.ndarray) -> SamplerOutput:
        calls.append(index.tolist())
        if guilty & set(index.tolist()):
            raise ValueError(f"bad row in {index.tolist()}")
        ids = torch.from_numpy(index * 10)  # [K] a token that says which row drew it
        return SamplerOutput(ids, ids.float(), ids[:, None].repeat(1, 2), ids[:, None].float().repeat(1, 2))

    isolated = bisect_failures(sample_subset, 16)
    assert sorted(i for i, _ in isolated.guilty) == sorted(guilty)
    assert all("ValueError" in error for _, error in isolated.guilty)
    kept = [i for i in range(16) if i not in guilty]
    assert isolated.kept.tolist() == kept  # ascending, so the batch order of the survivors holds
    assert isolated.output is not None and isolated.output.token_ids.tolist() == [10 * i for i in kept]
    assert isolated.output.top_token_ids is not None and isolated.output.top_token_ids.shape == (len(kept), 2)
    assert len(calls) <= 2 * len(guilty) * 4 + 2  # about 2 k log2(B), never a row-by-row sweep of all 16


def test_bisection_when_every_row_fails() -> None:
    def failing(index: np.ndarray) -> SamplerOutput:
        raise RuntimeError("broken")

    isolated = bisect_failures(failing, 3)
    assert isolated.output is None and isolated.kept.tolist() == [] and len(isolated.guilty) == 3


def _new(seq_id: int, **changes: object) -> NewRequest:
    fields = {"seq_id": seq_id, "token_ids": [1, 2, 3], "num_prompt_tokens": 3, "block_ids": [0],
              "num_computed_tokens": 0, "sampling": SamplingParams(max_tokens=4), "seed": 1}
    sampling = changes.pop("sampling_changes", None)
    fields.update(changes)
    if sampling:
        fields["sampling"] = msgspec.structs.replace(fields["sampling"], **sampling)  # type: ignore[arg-type]
    return NewRequest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("changes", [
    {"token_ids": [1, 2, 512]}, {"token_ids": [-1, 2, 3]}, {"token_ids": list(range(1, 70))},
    {"num_prompt_tokens": 0}, {"num_computed_tokens": 4}, {"block_ids": [0, 99]}, {"block_ids": [0] * 9},
    {"seed": 2**64}, {"sampling_changes": {"temperature": float("nan")}}, {"sampling_changes": {"top_p": 0.0}},
    {"sampling_changes": {"min_p": 2.0}}, {"sampling_changes": {"repetition_penalty": 0.0}},
    {"sampling_changes": {"presence_penalty": float("inf")}}, {"sampling_changes": {"logprobs": 600}},
    {"sampling_changes": {"logit_bias": {512: 1.0}}}, {"sampling_changes": {"logit_bias": {5: float("nan")}}},
    {"sampling_changes": {"stop_token_ids": [2**40]}},
], ids=lambda c: ",".join(f"{k}" for k in (c.get("sampling_changes") or c)))
def test_admission_refuses_what_would_break_a_row(changes: dict[str, object]) -> None:
    limits = {"vocab_size": 512, "max_model_len": 64, "num_kv_blocks": 8, "max_blocks_per_row": 4}
    assert admission_error(_new(0), **limits) == ""
    assert admission_error(_new(0, **changes), **limits) != ""


FAULT_SEED = 4242


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_failing_row_fails_alone_in_the_runner(smollm2_dir: Path, device: str) -> None:
    """Through ModelRunner with the tiny model: a request the worker must refuse (400) and one whose sampling
    raises (500) drop out of their step; the third request's token is what it draws alone. On CUDA the
    bisection re-reads staged inputs and the CUDA-graph decode path runs after it."""
    llm = LLM("tiny", tokenizer=str(smollm2_dir), max_model_len=64, max_num_seqs=4, seed=0, device=device)
    runner = llm.engine.runner
    greedy = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)
    good = NewRequest(100, [5, 6, 7], 3, [0], 0, greedy, seed=1)
    plan = StepPlan(step_id=1000, seq_ids=[100, 101, 102], num_scheduled_tokens=[3, 3, 3],
                    new_requests=[good, NewRequest(101, [5, 6, 99999], 3, [1], 0, greedy, seed=2),
                                  NewRequest(102, [5, 6, 8], 3, [2], 0, greedy, seed=FAULT_SEED)])
    runner.sampler = FaultySampler(FAULT_SEED)
    result = runner.execute(plan)
    assert not result.error
    assert result.seq_ids == [100] and len(result.sampled_token_ids) == 1
    assert len(result.sampled_logprobs) == 1 and len(result.top_token_ids[0]) == 1
    assert {(f.seq_id, f.status) for f in result.failed} == {(101, 400), (102, 500)}
    assert "vocabulary" in next(f.message for f in result.failed if f.seq_id == 101)
    assert "injected" in next(f.message for f in result.failed if f.seq_id == 102)
    assert set(runner.state.row_of) == {100}  # the failed ones left the worker
    # the survivor goes on; a later plan that still names a failed request skips it
    decode = StepPlan(step_id=1001, seq_ids=[100, 102], num_scheduled_tokens=[1, 1])
    after = runner.execute(decode)
    assert after.seq_ids == [100] and not after.error
    # what the same request draws alone (another id, another block), with the plain sampler
    runner.sampler = Sampler()
    twin = msgspec.structs.replace(good, seq_id=200, block_ids=[3])
    first = runner.execute(StepPlan(step_id=1002, seq_ids=[200], num_scheduled_tokens=[3], new_requests=[twin]))
    second = runner.execute(StepPlan(step_id=1003, seq_ids=[200], num_scheduled_tokens=[1]))
    assert (first.sampled_token_ids, second.sampled_token_ids) == (result.sampled_token_ids, after.sampled_token_ids)
