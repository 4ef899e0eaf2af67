"""vLLM's logprob_token_ids: the listed ids' logprobs in place of a row's top k, on the worker's sampling path (CPU),
through the field's checks, and offline. Served over HTTP: tests/test_vllm_compat.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.services.worker.sampler import sample
from pagoda.services.worker.sampling_state import SamplingState, admission_error
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import MAX_LOGPROB_TOKEN_IDS, NewRequest, SamplingParams, resolve_vocabulary

VOCAB = 64


def _new(seq_id: int, params: SamplingParams) -> NewRequest:
    return NewRequest(seq_id=seq_id, token_ids=[1, 2, 3], num_prompt_tokens=3, block_ids=[], num_computed_tokens=0,
                      sampling=params, seed=seq_id, eos_token_ids=[0])


def _sampled_rows(params: list[SamplingParams], logits: torch.Tensor,
                  order: list[int] | None = None) -> tuple[list[list[int]], list[list[float]], list[float]]:
    """Admit one request per params (rows 0..n-1), sample the batch (rows in `order`), and cut each row's top list
    to its length as the worker's step result does."""
    state = SamplingState(8, VOCAB, torch.device("cpu"), eos_token_ids=[0])
    state.admit([(row, _new(row, p)) for row, p in enumerate(params)])
    rows = np.array(order if order is not None else range(len(params)), dtype=np.int64)
    out = sample(logits, state.metadata(rows), use_kernels=False)
    assert out.top_token_ids is not None and out.top_logprobs is not None and out.logprobs is not None
    wanted = state.num_logprobs[rows].tolist()
    ids = [r[:k] for r, k in zip(out.top_token_ids.tolist(), wanted, strict=True)]
    lps = [r[:k] for r, k in zip(out.top_logprobs.tolist(), wanted, strict=True)]
    return ids, lps, out.logprobs.tolist()


def test_listed_ids_take_the_place_of_the_top_k_row_by_row() -> None:
    """A batch mixing a row listing ids (fewer and more than its neighbours' k), rows with a top k, and a row
    without logprobs: each listed row gets exactly its ids' raw logprobs in its order, the others their top k."""
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 3
    params = [SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.0, logprobs=0, logprob_token_ids=[5, 63, 0, 17, 40]),
              SamplingParams(temperature=0.7, seed=3, logprobs=3, logprob_token_ids=[9]),
              SamplingParams(temperature=0.0, logprobs=6)]
    raw = torch.log_softmax(logits.float(), dim=-1)
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        ids, lps, sampled = _sampled_rows(params, logits[order], order)
        for b, row in enumerate(order):
            listed = params[row].logprob_token_ids
            want_ids = listed if listed else raw[row].topk(params[row].logprobs or 0).indices.tolist()
            assert ids[b] == want_ids
            assert lps[b] == pytest.approx(raw[row, want_ids].tolist(), abs=1e-5)
        assert len(sampled) == len(order)


def test_a_row_listing_ids_after_one_that_did_keeps_only_its_own() -> None:
    """Rows are reused: a request without ids admitted into a row that listed some gets its top k back."""
    state = SamplingState(2, VOCAB, torch.device("cpu"), eos_token_ids=[0])
    state.admit([(0, _new(0, SamplingParams(temperature=0.0, logprobs=0, logprob_token_ids=[7, 8, 9])))])
    state.admit([(0, _new(1, SamplingParams(temperature=0.0, logprobs=2)))])
    logits = torch.randn(1, VOCAB)
    out = sample(logits, state.metadata(np.array([0])), use_kernels=False)
    assert out.top_token_ids is not None
    assert out.top_token_ids[0, :2].tolist() == torch.log_softmax(logits, -1)[0].topk(2).indices.tolist()


@pytest.mark.parametrize("fields, needle", [
    ({"logprob_token_ids": [1, 2]}, "needs logprobs"),
    ({"logprobs": 0, "logprob_token_ids": [3, 3]}, "repeat"),
    ({"logprobs": 0, "logprob_token_ids": list(range(MAX_LOGPROB_TOKEN_IDS + 1))}, "at most"),
    ({"logprobs": 0, "logprob_token_ids": [-1]}, "token ids in"),
    ({"logprobs": 0, "logprob_token_ids": [True]}, "token ids in"),
    ({"logprobs": 0, "logprob_token_ids": [4], "max_tokens": 0, "prompt_logprobs": 0}, "max_tokens 0"),
])
def test_bad_lists_are_refused_naming_the_field(fields: dict, needle: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**fields).validate()
    assert caught.value.param == "logprob_token_ids" and needle in caught.value.message


def test_ids_outside_the_vocabulary_are_refused_where_it_is_known() -> None:
    params = SamplingParams(logprobs=0, logprob_token_ids=[3, VOCAB]).validate()
    with pytest.raises(InvalidRequestError) as caught:
        resolve_vocabulary(params, VOCAB, max_logprobs=20)
    assert caught.value.param == "logprob_token_ids"
    assert "outside the vocabulary" in admission_error(_new(0, params), VOCAB, 4096, 1024, 256)


@pytest.mark.gpu
def test_listed_ids_on_the_cuda_sampling_path() -> None:
    """The same mixed batch on CUDA (the Triton sampling kernels, a 128k vocabulary, 40 rows, some listing 1-128
    ids): each row's list is its ids with the raw logprobs of the CPU reference, the others' top k."""
    vocab, num_rows = 131072, 40
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(num_rows, vocab, generator=generator) * 4  # [B, V]
    params = []
    for row in range(num_rows):
        count = [0, 1, 5, 128][row % 4]
        ids = torch.randperm(vocab, generator=generator)[:count].tolist()
        params.append(SamplingParams(temperature=[0.0, 0.8][row % 2], top_p=0.9, seed=row, logprobs=row % 7,
                                     logprob_token_ids=ids))
    state = SamplingState(num_rows, vocab, torch.device("cuda"), eos_token_ids=[0])
    state.admit([(row, _new(row, p)) for row, p in enumerate(params)])
    out = sample(logits.cuda().to(torch.bfloat16), state.metadata(np.arange(num_rows)))
    assert out.top_token_ids is not None and out.top_logprobs is not None
    raw = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1)  # [B, V]
    for row, p in enumerate(params):
        length = p.top_list_length
        ids = out.top_token_ids[row, :length].tolist()
        want = p.logprob_token_ids or raw[row].topk(length).indices.tolist()
        if p.logprob_token_ids:
            assert ids == want
        else:  # a near-tie may order two top ids apart
            assert sorted(raw[row, ids].tolist()) == pytest.approx(sorted(raw[row, want].tolist()), abs=1e-3)
        assert out.top_logprobs[row, :length].tolist() == pytest.approx(raw[row, ids].tolist(), abs=1e-3)
