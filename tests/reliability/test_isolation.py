"""One request's bad values stay its own: refused at validation, and clamped if they reach the worker anyway."""

from __future__ import annotations

import msgspec
import pytest
import torch

from pagoda.services.worker.sampling_state import INT32_MAX, SamplingState
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import MAX_INT32, NewRequest, SamplingParams

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
