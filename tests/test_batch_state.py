"""The worker's BatchState: rows found once per steady batch (rows_for), and a launched step's rows checked against
the sequences that own them now (holds) only when some row changed hands since."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda.services.worker.batch_state import BatchState
from pagoda.shared.messages import NewRequest, SamplingParams, StepPlan


def _new(seq_id: int) -> NewRequest:
    return NewRequest(seq_id=seq_id, token_ids=[1, 2, 3], num_prompt_tokens=3, block_ids=[seq_id],
                      num_computed_tokens=0, sampling=SamplingParams(), seed=0)


def _plan(step_id: int, seq_ids: list[int], new: tuple[int, ...] = (), finished: tuple[int, ...] = ()) -> StepPlan:
    return StepPlan(step_id=step_id, seq_ids=seq_ids, num_scheduled_tokens=[1] * len(seq_ids),
                    new_requests=[_new(s) for s in new], finished_seq_ids=list(finished))


def test_rows_for_reuses_a_steady_batch_and_follows_every_change() -> None:
    state = BatchState(max_num_seqs=4, max_model_len=64, block_size=16, eos_token_ids=(0,))
    state.apply(_plan(1, [10, 11, 12], new=(10, 11, 12)))
    rows = state.rows_for([10, 11, 12])
    assert rows.tolist() == [state.row_of[s] for s in (10, 11, 12)]
    assert state.rows_for([10, 11, 12]) is rows  # the same batch again: no lookups
    with pytest.raises(ValueError):
        rows[0] = 3  # shared between steps: read-only
    assert state.rows_for([12, 10]).tolist() == [state.row_of[12], state.row_of[10]]  # another order
    version = state.version
    state.apply(_plan(2, [10, 12], finished=(11,)))
    assert state.version > version
    state.apply(_plan(3, [10, 13], new=(13,)))  # 13 takes 11's row
    assert state.row_of[13] == rows[1]
    assert state.rows_for([10, 13]).tolist() == [state.row_of[10], state.row_of[13]]
    state.release(10)
    with pytest.raises(KeyError):
        state.rows_for([10, 13])


def test_holds_checks_owners_only_after_a_change() -> None:
    state = BatchState(max_num_seqs=4, max_model_len=64, block_size=16, eos_token_ids=(0,))
    state.apply(_plan(1, [1, 2, 3], new=(1, 2, 3)))
    rows, version = state.rows_for([1, 2, 3]), state.version
    assert state.holds([1, 2, 3], rows, version).tolist() == [True, True, True]
    state.release(2)
    state.apply(_plan(2, [4], new=(4,)))  # 4 reuses 2's row: a late token of 2 must not land in it
    assert state.row_of[4] == rows[1]
    assert state.holds([1, 2, 3], rows, version).tolist() == [True, False, True]
    state.release(99)  # unknown: nothing changes
    assert state.holds([1, 4, 3], rows, state.version).dtype == np.bool_
