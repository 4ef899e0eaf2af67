"""vLLM's SamplingParams rules for values at the edges, where they are made (the api's body decoding, the offline
SamplingParams): a temperature in (0, 0.01) is raised to 0.01 with vLLM's warning (sampling_params.py
__post_init__, _MAX_TEMP); no engine or server is started."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from pagoda.params import SamplingParams as OfflineParams
from pagoda.services.protocol.schemas import ChatBody, CompletionBody, chat_request, completion_params, decode_body
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import SamplingParams

WARNING = ("temperature {} is less than 0.01, which may cause numerical errors nan or inf in tensors. We have maxed it "
           "out to 0.01.")


def served(body: dict[str, Any], defaults: dict[str, float | int] | None = None) -> SamplingParams:
    return completion_params(decode_body(json.dumps({"model": "m", "prompt": "x", **body}).encode(), CompletionBody),
                             defaults=defaults)


def served_chat(body: dict[str, Any]) -> SamplingParams:
    chat = decode_body(json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], **body}).encode(),
                       ChatBody)
    return chat_request(chat, "r", 0.0).params


@pytest.mark.parametrize("temperature", [1e-6, 0.001, 0.0099])
def test_a_temperature_below_a_hundredth_is_raised_to_it_with_vllms_warning(temperature: float,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """vLLM samples such a temperature at 0.01 (1e-6 too, which pagoda read as greedy: below its 1e-5) and logs why."""
    with caplog.at_level(logging.WARNING):
        params = [served({"temperature": temperature}), served_chat({"temperature": temperature}),
                  served({}, defaults={"temperature": temperature}),  # a generation config's default too
                  OfflineParams(temperature=temperature)]
    assert [p.temperature for p in params] == [0.01] * 4 and not any(p.is_greedy for p in params)
    assert [r.getMessage() for r in caplog.records] == [WARNING.format(temperature)] * 4


@pytest.mark.parametrize("temperature", [0.0, 0.01, 0.7])
def test_zero_and_a_hundredth_or_more_stand(temperature: float, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        params = [served({"temperature": temperature}), OfflineParams(temperature=temperature)]
    assert [p.temperature for p in params] == [temperature] * 2 and not caplog.records


def test_an_offline_temperature_set_later_is_raised_when_used(caplog: pytest.LogCaptureFixture) -> None:
    params = OfflineParams()
    params.temperature = 0.005  # vLLM's examples set fields after making one
    with caplog.at_level(logging.WARNING):
        assert params.wire().temperature == 0.01
    assert [r.getMessage() for r in caplog.records] == [WARNING.format(0.005)]


def test_a_beam_search_temperature_below_a_hundredth_is_raised(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's beam search samples through a SamplingParams of its temperature, which raises it the same way."""
    from pagoda.llm import BeamSearchParams

    with caplog.at_level(logging.WARNING):
        assert BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.001).sampling_params().temperature == 0.01
        assert BeamSearchParams(beam_width=2, max_tokens=4).sampling_params().temperature == 0.0
    assert [r.getMessage() for r in caplog.records] == [WARNING.format(0.001)]


# ------------------------------------------------------------------ logit_bias


def test_a_body_bias_past_a_hundred_is_clamped_to_it() -> None:
    """OpenAI documents biases from -100 to 100; vLLM's server clamps one past them (SamplingParams.from_optional)
    where pagoda answered 400."""
    bias = {"7": 101, "8": -1e9, "9": 2.5, "10": -100}
    expected = {7: 100.0, 8: -100.0, 9: 2.5, 10: -100.0}
    assert served({"logit_bias": bias}).logit_bias == expected
    assert served_chat({"logit_bias": bias}).logit_bias == expected


@pytest.mark.parametrize("value", ["up", True, None, [1], {"a": 1}])
def test_a_body_bias_that_is_not_a_number_is_a_400_naming_logit_bias(value: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        served({"logit_bias": {"7": value}})
    assert caught.value.param == "logit_bias"


def test_an_offline_bias_is_taken_as_given() -> None:
    """vLLM's offline SamplingParams takes any bias and adds it as given (only its server clamps); one past float32's
    range (inf in the worker's float32 add) or not finite is refused naming logit_bias."""
    assert OfflineParams(logit_bias={7: 500.0, 8: -250}).logit_bias == {7: 500.0, 8: -250}
    for bad in (1e39, float("inf"), float("nan"), "up"):
        with pytest.raises(InvalidRequestError) as caught:
            OfflineParams(logit_bias={7: bad})
        assert caught.value.param == "logit_bias"
