"""How many completions one /v1/completions request may ask for (--max-completions-per-request): a list of many
short prompts times a large n would otherwise tie the engine up for minutes and grow every process's memory from
one request (5,000 one-token prompts x n=16 had not finished in 300 s on the 2-core CPU, 2026-12-05). Past the
bound the request is a 400 naming `prompt`, before any per-prompt work."""

from __future__ import annotations

import json

import pytest

from pagoda.services.protocol.schemas import CompletionBody, completion_requests, decode_body
from pagoda.shared.config import ServerConfig
from pagoda.shared.errors import ConfigError, InvalidRequestError


def _body(**fields: object) -> CompletionBody:
    return decode_body(json.dumps({"model": "m", "max_tokens": 1, **fields}).encode(), CompletionBody)


def test_prompts_times_n_bounded() -> None:
    body = _body(prompt=[[1]] * 64, n=4)
    assert len(completion_requests(body, "cmpl-x", 0.0, max_completions=256)) == 64  # exactly at the bound
    with pytest.raises(InvalidRequestError, match="65 prompts x 4 completions") as refused:
        completion_requests(_body(prompt=[[1]] * 65, n=4), "cmpl-x", 0.0, max_completions=256)
    assert refused.value.param == "prompt"
    assert len(completion_requests(_body(prompt=["a"] * 300), "cmpl-x", 0.0)) == 300  # no bound given


def test_best_of_counts_as_the_completions_of_a_prompt() -> None:
    body = _body(prompt=["a", "b"], n=1, best_of=3, use_beam_search=True, temperature=0)
    with pytest.raises(InvalidRequestError, match="2 prompts x 3 completions"):
        completion_requests(body, "cmpl-x", 0.0, max_completions=5)
    assert len(completion_requests(body, "cmpl-x", 0.0, max_completions=6)) == 2


def test_the_bound_is_a_positive_setting() -> None:
    assert ServerConfig().max_completions_per_request == 4096
    with pytest.raises(ConfigError, match="max_completions_per_request"):
        ServerConfig(max_completions_per_request=0)
