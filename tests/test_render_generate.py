"""vLLM's token-in / token-out API: /v1/chat/completions/render and /v1/completions/render turn an inference body
into the request /inference/v1/generate takes (token ids, the sampling params as pagoda runs them), and generate
answers with token ids. The body mapping and the response shape in process; the round trip (render, then generate,
gives the inference route's greedy tokens), streaming and the refusals over HTTP on the shared SmolLM2 server."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from pagoda.services.protocol.generate import (
    GenerateBody,
    GenerateRenderer,
    completion_body,
    generate_error,
    sampling_params_json,
)
from pagoda.services.protocol.render import Choice
from pagoda.services.protocol.schemas import completion_params, decode_body
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import (
    FinishReason,
    PositionLogprobs,
    SamplingParams,
    StructuredOutputs,
    TextDelta,
    TokenLogprob,
)
from tests.harness import HTTP, SERVED, Server, send_all

CHAT = [{"role": "user", "content": "Name three colours."}]


def generate_body(**fields: Any) -> GenerateBody:
    return decode_body(json.dumps({"token_ids": [1, 2, 3], "sampling_params": {}, **fields}).encode(), GenerateBody)


def refusal(**fields: Any) -> InvalidRequestError:
    """The refusal of a generate body, by its decoding or by its mapping to a completions body."""
    with pytest.raises(InvalidRequestError) as caught:
        completion_body(generate_body(**{"token_ids": [1, 2], **fields}))
    return caught.value


# ------------------------------------------------------------------ in process


@pytest.mark.parametrize("params", [
    SamplingParams(n=2, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.25,
                   repetition_penalty=1.1, seed=7, max_tokens=9, min_tokens=1, stop=["\n"], stop_token_ids=[2],
                   ignore_eos=True, logprobs=2, prompt_logprobs=1, skip_special_tokens=False,
                   include_stop_str_in_output=True, logit_bias={42: 1.5}, allowed_token_ids=[5, 6, 7],
                   bad_words=["no"], logprob_token_ids=[5, 6], stream_interval=2),
    SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=StructuredOutputs(regex="[a-z]+")),
])
def test_rendered_sampling_params_come_back_as_the_same_params(params: SamplingParams) -> None:
    """What render writes of a request's params, taken by generate, is the params the engine runs (the round trip's
    other half, for the fields a body can set)."""
    body = completion_body(generate_body(sampling_params=sampling_params_json(params)))
    assert body.prompt == [1, 2, 3] and body.return_token_ids
    assert completion_params(body) == params
    # unset: what the context leaves (vLLM's generate), not completions' 16
    assert completion_params(completion_body(generate_body())).max_tokens is None


@pytest.mark.parametrize(("fields", "param", "needle"), [
    ({"sampling_params": {"output_kind": 1}}, "sampling_params.output_kind", "follows `stream`"),
    ({"sampling_params": {"thinking_token_budget": 8}}, "sampling_params.thinking_token_budget", "chat prompt"),
    ({"sampling_params": {"nonsense": 1}}, "sampling_params.nonsense", "Unrecognized"),
    ({"sampling_params": {"detokenize": False}}, "sampling_params.detokenize", "must be true"),
    ({"sampling_params": {"temperature": "hot"}}, "sampling_params.temperature", "'sampling_params.temperature'"),
    ({"features": {"mm_hashes": {}}}, "features", "multimodal"),
    ({"kv_transfer_params": {"x": 1}}, "kv_transfer_params", "KV transfer"),
    ({"token_ids": []}, "token_ids", ""),
])
def test_generate_refuses_naming_the_field(fields: dict[str, Any], param: str, needle: str) -> None:
    error = refusal(**fields)
    assert error.param == param and needle in error.message, (error.param, error.message)


def test_a_range_refusal_names_the_sampling_field() -> None:
    body = completion_body(generate_body(sampling_params={"top_p": 7.0}))
    with pytest.raises(InvalidRequestError) as caught:
        completion_params(body)
    assert generate_error(caught.value).param == "sampling_params.top_p"
    prompt_error = InvalidRequestError("token id 99999 is past the vocabulary", param="prompt[0]")
    assert generate_error(prompt_error).param == "token_ids[0]"


def test_the_response_is_vllms_generate_response() -> None:
    renderer = GenerateRenderer("generate-tokens-x", SERVED, 0, want_logprobs=True, include_usage=True,
                                continuous_usage=True)
    choice = Choice(0, num_prompt_tokens=3)
    lp = PositionLogprobs(TokenLogprob("a", 7, -0.5, [97]), [TokenLogprob("a", 7, -0.5, [97])])
    delta = TextDelta("r", 0, "a", 1, FinishReason.LENGTH, logprobs=[lp], token_ids=[7])
    choice.apply(delta)
    chunk = json.loads(renderer.chunks([(choice, delta)]).removeprefix(b"data: "))
    assert chunk["request_id"] == "generate-tokens-x" and chunk["usage"]["completion_tokens"] == 1
    assert chunk["choices"] == [{"index": 0, "finish_reason": "length", "token_ids": [7], "logprobs": {"content": [
        {"token": "token_id:7", "logprob": -0.5, "bytes": list(b"token_id:7"),
         "top_logprobs": [{"token": "token_id:7", "logprob": -0.5, "bytes": list(b"token_id:7")}]}]}}]

    class View:
        choices = [choice]
        prompt_logprobs: list[list[PositionLogprobs]] = [[]]

    body = renderer.body(View(), {"prompt_tokens": 3})  # type: ignore[arg-type]
    assert body["choices"][0]["token_ids"] == [7] and body["choices"][0]["finish_reason"] == "length"
    assert body["prompt_logprobs"] is None and body["kv_transfer_params"] is None
    assert renderer.closing({"x": 1}).endswith(b"data: [DONE]\n\n")


# ------------------------------------------------------------------ over HTTP (the shared SmolLM2 server)


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    return smollm2_server


def post(server: Server, path: str, body: dict[str, Any]) -> Any:
    response = HTTP.post(server.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text[:500]
    return response.json()


@pytest.mark.slow
def test_render_then_generate_gives_the_inference_routes_tokens(server: Server) -> None:
    """Greedy: the chat route's tokens and a render + generate of the same body's are one; so for completions, one
    rendered request per prompt. The three inference requests and the two renders go at once."""
    chat = {"model": SERVED, "messages": CHAT, "max_tokens": 5, "temperature": 0}
    completion = {"model": SERVED, "prompt": ["The sky is", "One, two,"], "max_tokens": 4, "temperature": 0}
    url = server.url
    answers = send_all([("POST", url + "/v1/chat/completions", {**chat, "return_token_ids": True}),
                        ("POST", url + "/v1/completions", {**completion, "return_token_ids": True}),
                        ("POST", url + "/v1/chat/completions/render", chat),
                        ("POST", url + "/v1/completions/render", completion),
                        ("POST", url + "/tokenize", {"messages": CHAT})])
    assert all(a.status_code == 200 for a in answers), [a.text[:300] for a in answers]
    chat_out, completion_out, chat_rendered, completion_rendered, tokenized = (a.json() for a in answers)
    assert chat_rendered["token_ids"] == tokenized["tokens"]
    assert chat_rendered["sampling_params"]["max_tokens"] == 5 and chat_rendered["sampling_params"]["temperature"] == 0
    assert chat_rendered["model"] == SERVED and chat_rendered["request_id"].startswith("chatcmpl-")
    assert len(completion_rendered) == 2
    generated = send_all([("POST", url + "/inference/v1/generate", r) for r in [chat_rendered, *completion_rendered]])
    assert all(g.status_code == 200 for g in generated), [g.text[:300] for g in generated]
    chat_gen, *completion_gens = (g.json() for g in generated)
    assert chat_gen["choices"][0]["token_ids"] == chat_out["choices"][0]["token_ids"]
    assert chat_gen["choices"][0]["finish_reason"] == chat_out["choices"][0]["finish_reason"]
    assert chat_gen["usage"]["prompt_tokens"] == chat_out["usage"]["prompt_tokens"]
    assert [g["choices"][0]["token_ids"] for g in completion_gens] == \
        [c["token_ids"] for c in completion_out["choices"]]


@pytest.mark.slow
def test_generate_streams_and_scores(server: Server) -> None:
    """Token ids with logprobs named by id, the same tokens streamed (with the usage chunk asked for) as not."""
    body = {"model": SERVED, "token_ids": [1, 504, 3458, 314], "sampling_params": {"max_tokens": 4, "temperature": 0,
                                                                                  "logprobs": 1}}
    url = server.url + "/inference/v1/generate"
    with HTTP.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                     timeout=120) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    whole = post(server, "/inference/v1/generate", body)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    streamed = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
    choice = whole["choices"][0]
    assert streamed == choice["token_ids"] and len(streamed) == 4
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert [p["token"] for p in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert choice["finish_reason"] == "length" and whole["usage"]["prompt_tokens"] == 4


@pytest.mark.slow
def test_refusals_are_the_inference_routes(server: Server) -> None:
    """Render answers the 400s the inference route would (the same param); generate names its own fields."""
    url = server.url
    long_chat = {"model": SERVED, "messages": CHAT, "max_tokens": 10**6}
    cases = [("/v1/chat/completions", long_chat, "max_tokens"), ("/v1/chat/completions/render", long_chat,
                                                                 "max_tokens"),
             ("/v1/completions/render", {"model": SERVED, "prompt": "x", "temperature": -1}, "temperature"),
             ("/v1/chat/completions/render", {"model": SERVED, "messages": CHAT, "use_beam_search": True},
              "use_beam_search"),
             ("/v1/completions/render", {"model": SERVED, "prompt": "x", "echo": True}, "echo"),
             ("/v1/chat/completions/render", {"model": SERVED, "messages": CHAT, "include_reasoning": False},
              "include_reasoning"),
             ("/inference/v1/generate", {"token_ids": [1, 10**9], "sampling_params": {"max_tokens": 1}},
              "token_ids"),
             ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 10**6}},
              "sampling_params.max_tokens"),
             ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"output_kind": 2}},
              "sampling_params.output_kind")]
    answers = send_all([("POST", url + path, body) for path, body, _ in cases])
    for (path, _, param), answer in zip(cases, answers, strict=True):
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, (path, answer.text[:300])
    assert msgspec.json.decode(answers[0].content)["error"]["message"] == \
        msgspec.json.decode(answers[1].content)["error"]["message"]
