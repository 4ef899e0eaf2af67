"""SamplingState.metadata: a step that samples the same rows as the last one reuses its settings on the device; what
moves every step (offsets, min_tokens bans) and what admission changes are always the rows' own."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pagoda.services.worker.sampler import SamplingMetadata
from pagoda.services.worker.sampling_state import SamplingState
from pagoda.shared.messages import NewRequest, SamplingParams

VOCAB = 64


def _new(seq_id: int, params: SamplingParams, num_output: int = 0) -> NewRequest:
    return NewRequest(seq_id=seq_id, token_ids=list(range(3 + num_output)), num_prompt_tokens=3, block_ids=[],
                      num_computed_tokens=0, sampling=params, seed=seq_id, eos_token_ids=[0])


def _fields(metadata: SamplingMetadata) -> dict[str, object]:
    """Every field, tensors as lists (None stays None)."""
    return {f.name: (v.tolist() if isinstance(v := getattr(metadata, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(metadata)}


def _fresh(state: SamplingState, rows: np.ndarray) -> dict[str, object]:
    state._settings = None  # what a step without a reusable last step gathers
    return _fields(state.metadata(rows))


def test_reused_settings_equal_gathered_ones_step_after_step() -> None:
    state = SamplingState(6, VOCAB, torch.device("cpu"), eos_token_ids=[0])
    params = [SamplingParams(temperature=0.7, top_p=0.9, min_tokens=2),
              SamplingParams(temperature=1.0, top_k=5, logit_bias={3: 2.0}, logprobs=2),
              SamplingParams(temperature=0.0, presence_penalty=0.5, repetition_penalty=1.2),
              SamplingParams(temperature=0.9, min_p=0.1, min_tokens=4, stop_token_ids=[7])]
    state.admit([(row, _new(row, p)) for row, p in enumerate(params)])
    rows = np.array([0, 1, 2, 3])
    for _ in range(5):  # the bans of rows 0 and 3 end after 2 and 4 tokens: offsets and bans move every step
        reused = _fields(state.metadata(rows))
        assert state._settings is not None  # the next step may reuse these
        assert reused == _fresh(state, rows)
        state.record(rows, torch.tensor([5, 6, 7, 8]))
    assert reused["banned_token_ids"] is None and reused["offsets"] == [4, 4, 4, 4]
    # another set of rows, or a row taken by a new request, never sees the last step's settings
    assert _fields(state.metadata(rows[1:])) == _fresh(state, rows[1:])
    state.metadata(rows)
    state.admit([(1, _new(9, SamplingParams(temperature=0.0), num_output=1))])
    after = _fields(state.metadata(rows))
    assert after == _fresh(state, rows)
    assert after["temperature"][1] == 0.0 and after["offsets"][1] == 1
