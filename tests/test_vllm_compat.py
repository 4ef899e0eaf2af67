"""vLLM's extensions over HTTP (issue 24), sent as vLLM's clients send them (the openai client's extra_body), against
the shared SmolLM2 server; and docs/vllm-compat.md's tables checked row by row against that server."""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagoda.services.protocol.schemas import (
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    chat_echo_text,
    chat_output_spec,
    chat_request,
    chat_response_role,
    completion_params,
    decode_body,
)
from pagoda.services.protocol.vllm import GUIDED_BACKENDS, UNSUPPORTED_FIELDS, UNSUPPORTED_ROUTES
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.hf_tokenizer import load_hf_tokenizer
from pagoda.shared.messages import SamplingParams, resolve_vocabulary
from tests.harness import HTTP, SERVED, Server, send_all

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parent.parent / "docs" / "vllm-compat.md"
VOCAB_SIZE = 49152  # SmolLM2's
CHAT = [{"role": "user", "content": "Name a colour."}]
SAYING = "Here is a common saying about apples. An apple a day, keeps"


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    return smollm2_server  # conftest's shared SmolLM2 server (with --max-logprobs -1)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client(timeout=120)


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return HTTP.post(server.url + path, json=body, timeout=120)


def sse_chunks(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with HTTP.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def token_ids(server: Server, text: str) -> list[int]:
    return post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]


# ------------------------------------------------------------------ guided_decoding_backend


def test_every_backend_name_pagoda_serves_maps_to_its_grammar_engine(server: Server, client: openai.OpenAI) -> None:
    for backend in (*GUIDED_BACKENDS, "xgrammar:disable-any-whitespace", "guidance:no-fallback"):
        raw = client.completions.with_raw_response.create(
            model=SERVED, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0.8, seed=1,
            extra_body={"guided_choice": ["yes", "no"], "guided_decoding_backend": backend})
        assert raw.parse().choices[0].text in ("yes", "no"), backend
        assert "guided_decoding_backend is deprecated" in raw.headers["Warning"]
        assert "guided_choice is deprecated" in raw.headers["Warning"]
    chat = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=5, extra_body={
        "guided_regex": "(red|blue)", "guided_decoding_backend": "lm-format-enforcer"})
    assert chat.choices[0].message.content in ("red", "blue")
    # the field alone, without a constraint, is accepted too (vLLM's clients send it by default)
    plain = client.completions.with_raw_response.create(model=SERVED, prompt="Hi", max_tokens=1,
                                                         extra_body={"guided_decoding_backend": "auto"})
    assert plain.headers["Warning"].count("deprecated") == 1


@pytest.mark.parametrize("extra, needle", [
    ({"guided_choice": ["a"], "guided_decoding_backend": "sglang"}, "the backends are auto, guidance"),
    ({"guided_json": {"type": "object"}, "guided_decoding_backend": "guidance:disable-additional-properties"},
     "disable-additional-properties are not supported"),
])
def test_other_backends_are_refused_naming_those_that_exist(client: openai.OpenAI, extra: dict, needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as failure:
        client.completions.create(model=SERVED, prompt="Hi", max_tokens=2, extra_body=extra)
    error = failure.value.body
    assert error["param"] == "guided_decoding_backend" and needle in error["message"]


def test_a_grammar_is_served_under_every_backend_name(client: openai.OpenAI) -> None:
    """As vLLM V0 (outlines took grammars, lm-format-enforcer fell back to outlines); V1's outlines and
    lm-format-enforcer refuse them, a limitation no client relies on."""
    for backend in GUIDED_BACKENDS:
        out = client.completions.create(model=SERVED, prompt="Say a or b:", max_tokens=4, extra_body={
            "guided_grammar": 'start: "a" | "b"', "guided_decoding_backend": backend})
        assert out.choices[0].text in ("a", "b")


# ------------------------------------------------------------------ prompt_logprobs


def _check_prompt_logprobs(scores: list[Any], prompt_ids: list[int], k: int) -> None:
    """vLLM's shape: null first, then {id: {logprob, rank, decoded_token}} with the prompt's token and the top k."""
    assert len(scores) == len(prompt_ids) and scores[0] is None
    for position, token_id in zip(scores[1:], prompt_ids[1:], strict=True):
        own = position[str(token_id)]
        assert own["logprob"] <= 0.0 and own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        others = [entry for key, entry in position.items() if key != str(token_id)]
        assert len(others) in (k - 1, k) if k > 0 else others == []
        # its rank is 1 + the tokens more likely than it, as far as the top k show them
        assert sum(entry["logprob"] > own["logprob"] for entry in others) == min(own["rank"] - 1, k)
        shown = [r for r in range(1, k + 1) if r != own["rank"]][:len(others)]
        assert sorted(entry["rank"] for entry in others) == shown


def test_completion_prompt_logprobs_match_echo_scores(server: Server, client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    out = client.completions.create(model=SERVED, prompt=prompt, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    scores = out.choices[0].model_extra["prompt_logprobs"]
    prompt_ids = token_ids(server, prompt)
    _check_prompt_logprobs(scores, prompt_ids, 2)
    # the same engine scoring serves echo + logprobs: the same numbers
    echo = client.completions.create(model=SERVED, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2)
    echoed = echo.choices[0].logprobs.token_logprobs[:len(prompt_ids)]
    assert echoed[0] is None
    for entry, token_id, logprob in zip(scores[1:], prompt_ids[1:], echoed[1:], strict=True):
        assert entry[str(token_id)]["logprob"] == pytest.approx(logprob, abs=1e-5)
    assert echo.choices[0].model_extra["prompt_logprobs"] is None  # only asked for through echo
    # prompt_logprobs=0: the prompt's own token only; max_tokens=0 scores the prompt alone
    alone = client.completions.create(model=SERVED, prompt=prompt, max_tokens=0, extra_body={"prompt_logprobs": 0})
    _check_prompt_logprobs(alone.choices[0].model_extra["prompt_logprobs"], prompt_ids, 0)
    assert alone.usage.completion_tokens == 0


def test_truncate_prompt_tokens_runs_and_reports_the_kept_prompt(server: Server, client: openai.OpenAI) -> None:
    """vLLM's truncate_prompt_tokens (and truncation_side): the last (or first) k prompt tokens run; usage counts
    them, return_token_ids lists them, echo shows their text and its logprobs score them (the echoed text is what
    the prompt's logprob tokens join to); the answer is that of the kept tokens sent alone."""
    prompt = "The capital of France is Paris, and the capital of Spain is"
    prompt_ids = token_ids(server, prompt)
    for side, kept in ((None, prompt_ids[-6:]), ("right", prompt_ids[:6])):
        extra = {"truncate_prompt_tokens": 6, **({"truncation_side": side} if side else {})}
        out = client.completions.create(model=SERVED, prompt=prompt, max_tokens=3, temperature=0,
                                        extra_body={**extra, "return_token_ids": True})
        alone = client.completions.create(model=SERVED, prompt=kept, max_tokens=3, temperature=0)
        assert out.usage.prompt_tokens == 6 and out.choices[0].model_extra["prompt_token_ids"] == kept, side
        assert out.choices[0].text == alone.choices[0].text
        echo = client.completions.create(model=SERVED, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                         logprobs=1, extra_body=extra)
        logprobs = echo.choices[0].logprobs
        assert "".join(logprobs.tokens) == echo.choices[0].text  # the echoed text is the kept tokens'
        assert len(logprobs.tokens) == 7 and logprobs.token_logprobs[0] is None
        assert not echo.choices[0].text.startswith(prompt)
    whole = client.completions.create(model=SERVED, prompt=prompt, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": len(prompt_ids) + 1})
    assert whole.usage.prompt_tokens == len(prompt_ids)
    chat = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4


def test_chat_prompt_logprobs_at_the_top_level_null_when_not_asked(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=2, n=2, temperature=0.7, seed=3,
                                         extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    scores = out.model_extra["prompt_logprobs"]
    _check_prompt_logprobs(scores, out.model_extra["prompt_token_ids"], 1)
    assert all("prompt_logprobs" not in choice.model_extra for choice in out.choices)
    plain = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=1)
    assert "prompt_logprobs" in plain.model_extra and plain.model_extra["prompt_logprobs"] is None
    assert client.completions.create(model=SERVED, prompt="Hi", max_tokens=1).choices[0].model_extra[
        "prompt_logprobs"] is None


def test_prompt_logprobs_of_the_whole_vocabulary(client: openai.OpenAI) -> None:
    out = client.completions.create(model=SERVED, prompt=[1, 9690, 198], max_tokens=1,
                                    extra_body={"prompt_logprobs": -1})
    scores = out.choices[0].model_extra["prompt_logprobs"]
    assert len(scores) == 3 and scores[0] is None
    for position in scores[1:]:
        assert len(position) == VOCAB_SIZE
        assert sorted(entry["rank"] for entry in position.values()) == list(range(1, VOCAB_SIZE + 1))
        assert sum(math.exp(entry["logprob"]) for entry in position.values()) == pytest.approx(1.0, abs=1e-3)


def test_prompt_logprobs_leave_the_prefix_cache_on_for_the_others(client: openai.OpenAI) -> None:
    """A scored prompt is computed whole (cached positions are never scored), yet it fills the cache for requests
    that do not ask, and those still hit it."""
    prompt = f"Request {uuid.uuid4().hex}: " + "a list of things that are green, such as grass and leaves. " * 4
    first = client.completions.create(model=SERVED, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 1})
    assert first.usage.prompt_tokens >= 48 and first.usage.prompt_tokens_details.cached_tokens == 0
    plain = client.completions.create(model=SERVED, prompt=prompt, max_tokens=1)
    assert plain.usage.prompt_tokens_details.cached_tokens >= 32  # the scored request's blocks
    again = client.completions.create(model=SERVED, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 1})
    assert again.usage.prompt_tokens_details.cached_tokens == 0  # recomputed, scored whole
    before, after = first.choices[0].model_extra["prompt_logprobs"], again.choices[0].model_extra["prompt_logprobs"]
    assert len(after) == first.usage.prompt_tokens
    for a, b in zip(before[1:], after[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(a[key]["logprob"] == pytest.approx(b[key]["logprob"], abs=1e-4) for key in a)


def test_cache_salt_shares_prefix_blocks_only_among_equal_salts(client: openai.OpenAI) -> None:
    """vLLM's cache_salt through the tokenizer to the scheduler: a prompt hits the prefix cache under the salt it was
    cached with, never under another salt nor unsalted; chat takes it too."""
    prompt = f"Request {uuid.uuid4().hex}: " + "a list of things that are green, such as grass and leaves. " * 4

    def cached_tokens(salt: str | None, messages: bool = False) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        if messages:
            reply = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=1, extra_body=extra)
        else:
            reply = client.completions.create(model=SERVED, prompt=prompt, max_tokens=1, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached_tokens("a") == 0
    assert cached_tokens("a") >= 32
    assert cached_tokens("b") == 0
    assert cached_tokens(None) == 0
    assert cached_tokens(None) >= 32  # the unsalted chain, as without salts
    assert cached_tokens("a", messages=True) == 0  # the chat template's prompt starts otherwise
    assert cached_tokens("a", messages=True) >= 32
    assert cached_tokens("b", messages=True) == 0


def test_prompt_logprobs_are_refused_when_streaming(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as failure:
        client.completions.create(model=SERVED, prompt="Hi", max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert failure.value.body["param"] == "prompt_logprobs"


# ------------------------------------------------------------------ continuous_usage_stats


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server: Server, route: str) -> None:
    body: dict[str, Any] = {"model": SERVED, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    body.update({"prompt": "Once upon a time"} if route == "completions" else {"messages": CHAT})
    chunks = sse_chunks(server, path, body)
    final = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and final["completion_tokens"] == 5
    counts = []
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == final["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        counts.append(usage["completion_tokens"])
    assert counts == sorted(counts) and counts[-2] == 5
    # continuous stats ride on include_usage, as vLLM's: without it no chunk has usage
    body["stream_options"] = {"include_usage": False, "continuous_usage_stats": True}
    assert all(chunk.get("usage") is None for chunk in sse_chunks(server, path, body))


# ------------------------------------------------------------------ return_tokens_as_token_ids, allowed_token_ids


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                                                      "return_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert all(re.fullmatch(r"token_id:\d+", alt.token) for alt in entry.top_logprobs)
    out = client.completions.create(model=SERVED, prompt="Hello", max_tokens=3, temperature=0, logprobs=1,
                                    extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    logprobs = out.choices[0].logprobs
    assert logprobs.tokens == [f"token_id:{t}" for t in out.choices[0].model_extra["token_ids"]]
    assert all(all(key.startswith("token_id:") for key in top) for top in logprobs.top_logprobs)
    plain = client.completions.create(model=SERVED, prompt="Hello", max_tokens=3, temperature=0, logprobs=1)
    assert plain.choices[0].text == out.choices[0].text
    assert logprobs.text_offset == plain.choices[0].logprobs.text_offset  # offsets still follow the text


def test_an_eos_ended_answer_lists_the_eos_in_token_ids_and_logprobs(server: Server) -> None:
    """vLLM's detokenizer leaves a stop token out of the text only: its id stays in token_ids and its logprob in
    logprobs (vLLM's own test decodes a chat's token_ids to its content + "<|im_end|>"), so token_ids, logprobs
    and usage's completion_tokens count the same tokens, on every route, streamed or not."""
    eos = 2  # SmolLM2's <|im_end|>
    body = {"model": SERVED, "messages": CHAT, "max_tokens": 64, "temperature": 0, "logprobs": True,
            "return_token_ids": True}
    chat = post(server, "/v1/chat/completions", body).json()
    choice = chat["choices"][0]
    assert choice["finish_reason"] == "stop" and "<|im_end|>" not in choice["message"]["content"]
    ids, entries = choice["token_ids"], choice["logprobs"]["content"]
    assert ids[-1] == eos and entries[-1]["token"] == "<|im_end|>"
    assert len(entries) == len(ids) == chat["usage"]["completion_tokens"]
    chunks = sse_chunks(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    assert [t for c in streamed for t in c.get("token_ids") or []] == ids
    assert len([e for c in streamed for e in (c["logprobs"] or {}).get("content", [])]) == len(ids)
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)

    prompt = chat["prompt_token_ids"]
    out = post(server, "/v1/completions", {"model": SERVED, "prompt": prompt, "max_tokens": 64, "temperature": 0,
                                           "logprobs": 0, "return_token_ids": True}).json()
    assert out["choices"][0]["token_ids"] == ids and out["choices"][0]["text"] == choice["message"]["content"]
    assert len(out["choices"][0]["logprobs"]["tokens"]) == len(ids) == out["usage"]["completion_tokens"]
    generated = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": 64, "temperature": 0, "logprobs": 0}}).json()
    assert generated["choices"][0]["token_ids"] == ids
    assert len(generated["choices"][0]["logprobs"]["content"]) == len(ids) == generated["usage"]["completion_tokens"]


def test_logprob_token_ids_list_those_ids_at_every_generated_position(server: Server) -> None:
    """vLLM's logprob_token_ids: each position's top list is the listed ids (in their order), with the logprobs
    the whole vocabulary's list gives them, on both routes; the sampled token's logprob as always."""
    listed = [token_ids(server, " apple")[0], 5, 100, token_ids(server, " day")[0]]
    extra = {"return_tokens_as_token_ids": True, "max_tokens": 3, "temperature": 0}
    names = [f"token_id:{t}" for t in listed]

    whole = post(server, "/v1/completions", {"model": SERVED, "prompt": SAYING, "logprobs": -1, **extra}).json()
    picked = post(server, "/v1/completions", {"model": SERVED, "prompt": SAYING, "logprobs": 1,
                                              "logprob_token_ids": listed, **extra}).json()
    want, got = whole["choices"][0]["logprobs"], picked["choices"][0]["logprobs"]
    assert got["tokens"] == want["tokens"] and got["token_logprobs"] == pytest.approx(want["token_logprobs"])
    for everything, top in zip(want["top_logprobs"], got["top_logprobs"], strict=True):
        shown = {name: lp for name, lp in top.items() if name in names}
        assert list(shown) == names, top  # completions' dict also holds the sampled token
        assert list(shown.values()) == pytest.approx([everything[name] for name in names], abs=1e-4)

    messages = [{"role": "user", "content": "Name a fruit."}]
    whole = post(server, "/v1/chat/completions", {"model": SERVED, "messages": messages, "logprobs": True,
                                                  "top_logprobs": -1, **extra}).json()
    picked = post(server, "/v1/chat/completions", {"model": SERVED, "messages": messages, "logprobs": True,
                                                   "logprob_token_ids": listed, **extra}).json()
    want, got = whole["choices"][0]["logprobs"]["content"], picked["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in got] == [e["token"] for e in want]
    for everything, entry in zip(want, got, strict=True):
        assert [alt["token"] for alt in entry["top_logprobs"]] == names
        by_name = {alt["token"]: alt["logprob"] for alt in everything["top_logprobs"]}
        assert [alt["logprob"] for alt in entry["top_logprobs"]] == pytest.approx(
            [by_name[name] for name in names], abs=1e-4)


@pytest.mark.parametrize("route, body, needle", [
    ("/v1/chat/completions", {"messages": CHAT, "logprob_token_ids": [5]}, "needs logprobs"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 0, "logprob_token_ids": [5, VOCAB_SIZE]},
     "outside the vocabulary"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 0, "logprob_token_ids": [5, 5]}, "repeat"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 0, "echo": True, "max_tokens": 0, "logprob_token_ids": [5]},
     "max_tokens 0"),
])
def test_bad_logprob_token_ids_are_refused(server: Server, route: str, body: dict[str, Any], needle: str) -> None:
    response = post(server, route, {"model": SERVED, **body})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "logprob_token_ids" and needle in error["message"], \
        response.text


@pytest.mark.parametrize("stream", [False, True])
def test_request_id_names_the_response_and_x_request_id_wins(server: Server, stream: bool) -> None:
    """vLLM's request_id: the response's id (every chunk's) is cmpl- / chatcmpl- + it, X-Request-Id's over the
    body's; two requests named alike both run."""
    def ids(route: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> set[str]:
        body = {"model": SERVED, "max_tokens": 2, **body}
        if not stream:
            response = HTTP.post(server.url + route, json=body, headers=headers, timeout=120)
            assert response.status_code == 200, response.text
            return {response.json()["id"]}
        with HTTP.stream("POST", server.url + route, json={**body, "stream": True}, headers=headers,
                         timeout=120) as response:
            assert response.status_code == 200, response.read()
            return {json.loads(line[6:])["id"] for line in response.iter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"}

    chat = {"messages": CHAT}
    assert ids("/v1/completions", {"prompt": "Hi", "request_id": "trace-7"}) == {"cmpl-trace-7"}
    assert ids("/v1/chat/completions", {**chat, "request_id": "trace-7"}) == {"chatcmpl-trace-7"}
    assert ids("/v1/chat/completions", {**chat, "request_id": "body"}, {"X-Request-Id": "head"}) == {"chatcmpl-head"}
    assert ids("/v1/completions", {"prompt": "Hi"}, {"X-Request-Id": "head"}) == {"cmpl-head"}
    [plain] = ids("/v1/completions", {"prompt": "Hi"})
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", plain)
    together = send_all([("POST", server.url + "/v1/completions",
                          {"model": SERVED, "prompt": f"Count to {i}", "max_tokens": 2, "request_id": "same"})
                         for i in range(4)])
    assert [r.status_code for r in together] == [200] * 4 and {r.json()["id"] for r in together} == {"cmpl-same"}


@pytest.mark.parametrize("body, headers, param", [({"request_id": ""}, None, "request_id"),
                                                  ({"request_id": "x" * 1025}, None, "request_id"),
                                                  ({"request_id": 7}, None, "request_id"),
                                                  ({}, {"X-Request-Id": ""}, "X-Request-Id")])
def test_bad_request_ids_are_refused(server: Server, body: dict[str, Any], headers: dict[str, str] | None,
                                     param: str) -> None:
    response = HTTP.post(server.url + "/v1/completions", json={"model": SERVED, "prompt": "Hi", **body},
                         headers=headers, timeout=120)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_allowed_token_ids_restrict_sampling_on_both_endpoints(server: Server, client: openai.OpenAI) -> None:
    allowed = sorted({*token_ids(server, " red"), *token_ids(server, " blue"), *token_ids(server, " green")})
    out = client.completions.create(model=SERVED, prompt="My favourite colours are", max_tokens=6, temperature=1.0,
                                    seed=11, extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    generated = out.choices[0].model_extra["token_ids"]
    assert len(generated) == 6 and set(generated) <= set(allowed)
    chat = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=4, temperature=0,
                                          extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert set(chat.choices[0].model_extra["token_ids"]) <= set(allowed)
    free = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=4, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert not set(free.choices[0].model_extra["token_ids"]) <= set(allowed)  # the restriction did something


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reason_names_what_stopped_each_choice(client: openai.OpenAI, stream: bool) -> None:
    """vLLM's stop_reason on both endpoints: the stop token id, the stop string, null for max_tokens; streamed, on
    the chunk that carries the finish_reason."""
    def reason(route: str, **extra: object) -> tuple[str | None, object]:
        body: dict[str, object] = {"model": SERVED, "max_tokens": 4, "temperature": 0, "stream": stream, **extra}
        if route == "completions":
            out = client.completions.create(prompt="The capital of France is", **body)  # type: ignore[call-overload]
        else:
            out = client.chat.completions.create(messages=[{"role": "user", "content": "The capital of France is"}],
                                                 **body)  # type: ignore[call-overload]
        last = [chunk.choices[0] for chunk in out if chunk.choices][-1] if stream else out.choices[0]
        return last.finish_reason, last.model_extra["stop_reason"]

    with ThreadPoolExecutor(4) as pool:  # those that need no earlier answer at once, then those that need one
        greedy_of = pool.submit(lambda: client.completions.create(
            model=SERVED, prompt="The capital of France is", max_tokens=4, temperature=0,
            extra_body={"return_token_ids": True}))
        chat_of = pool.submit(lambda: client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": "The capital of France is"}], max_tokens=4,
            temperature=0, extra_body={"return_token_ids": True}))
        plain = pool.submit(reason, "completions")
        one_token = pool.submit(reason, "chat", max_tokens=1)
        greedy, chat = greedy_of.result(), chat_of.result()
        ids = greedy.choices[0].model_extra["token_ids"]
        word = greedy.choices[0].text.split()[0]
        chat_ids = chat.choices[0].model_extra["token_ids"]
        by_id = pool.submit(reason, "completions", extra_body={"stop_token_ids": [ids[1]]})
        by_word = pool.submit(reason, "completions", stop=[word])
        chat_by_id = pool.submit(reason, "chat", extra_body={"stop_token_ids": [chat_ids[1]]})
        assert by_id.result() == ("stop", ids[1])
        assert by_word.result() == ("stop", word)
        assert plain.result() == ("length", None)
        assert chat.choices[0].finish_reason == "length", "four tokens of an answer, no EOS among them"
        assert chat_by_id.result() == ("stop", chat_ids[1])
        assert one_token.result() == ("length", None)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_repetition_detection_ends_a_loop_with_vllms_reasons(server: Server, route: str, stream: bool) -> None:
    """One allowed token makes the output loop on it: with repetition_detection (patterns of 1-2 tokens, 5 copies)
    it ends at its 5th token with vLLM's finish_reason "repetition" and stop_reason "repetition_detected", at
    min_tokens when that is later, and runs to max_tokens without it."""
    (dot,) = token_ids(server, ".")
    base: dict[str, Any] = {"model": SERVED, "max_tokens": 12, "temperature": 0, "allowed_token_ids": [dot]}
    base |= {"prompt": SAYING} if route == "/v1/completions" else {"messages": CHAT}

    def run(**extra: Any) -> tuple[str, object, int]:
        body = {**base, **extra}
        if not stream:
            out = post(server, route, body).json()
            return out["choices"][0]["finish_reason"], out["choices"][0]["stop_reason"], \
                out["usage"]["completion_tokens"]
        chunks = sse_chunks(server, route, {**body, "stream_options": {"include_usage": True}})
        last = [chunk["choices"][0] for chunk in chunks if chunk["choices"]][-1]
        return last["finish_reason"], last["stop_reason"], chunks[-1]["usage"]["completion_tokens"]

    watch = {"max_pattern_size": 2, "min_count": 5}
    cases = [({"repetition_detection": watch}, ("repetition", "repetition_detected", 5)),
             ({"repetition_detection": watch, "min_tokens": 7}, ("repetition", "repetition_detected", 7)),
             ({"repetition_detection": {**watch, "min_pattern_size": 2}}, ("repetition", "repetition_detected", 10)),
             ({}, ("length", None, 12)),
             ({"repetition_detection": {"max_pattern_size": 0}}, ("length", None, 12))]
    with ThreadPoolExecutor(len(cases)) as pool:  # at once: the engine batches them, each row detected alone
        results = list(pool.map(lambda case: run(**case[0]), cases))
    assert results == [expected for _, expected in cases]


@pytest.mark.parametrize("watch, param", [({"max_pattern_size": 3, "min_count": 1}, "repetition_detection.min_count"),
                                          ({"max_pattern_size": 3, "min_count": 2, "n": 2}, "repetition_detection"),
                                          ({"max_pattern_size": 5000, "min_count": 2},
                                           "repetition_detection.max_pattern_size")])
def test_bad_repetition_detection_is_refused(server: Server, watch: dict[str, int], param: str) -> None:
    response = post(server, "/v1/completions", {"model": SERVED, "prompt": "Hi", "repetition_detection": watch})
    assert response.status_code == 400 and response.json()["error"]["param"].startswith(param), response.text


@pytest.mark.parametrize("ids, needle", [([], "must not be empty"), ([5, VOCAB_SIZE], "outside the vocabulary")])
def test_bad_allowed_token_ids_are_refused(client: openai.OpenAI, ids: list[int], needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as failure:
        client.completions.create(model=SERVED, prompt="Hi", max_tokens=1, extra_body={"allowed_token_ids": ids})
    assert failure.value.body["param"] == "allowed_token_ids" and needle in failure.value.body["message"]


@pytest.mark.parametrize("extra, param", [({"allowed_token_ids": [2], "min_tokens": 3}, "min_tokens"),
                                          ({"allowed_token_ids": [4607, 787], "bad_words": ["no"]}, "bad_words")])
def test_allowed_token_ids_that_the_bans_empty_are_refused(client: openai.OpenAI, extra: dict[str, Any],
                                                           param: str) -> None:
    """EOS (SmolLM2's 2) banned until min_tokens, or a one-token bad word (both spellings of "no"), takes every
    allowed id: a 400 naming the field, not a completion of ids outside the list (the sampler's row was all -inf)."""
    with pytest.raises(openai.BadRequestError) as failure:
        client.completions.create(model=SERVED, prompt="Hi", max_tokens=4, temperature=0, extra_body=extra)
    assert failure.value.body["param"] == param and "no token is left" in failure.value.body["message"]


# ------------------------------------------------------------------ chat echo, top_logprobs -1


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_with_continue_final_message(server: Server, client: openai.OpenAI, stream: bool) -> None:
    messages = [{"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": SAYING}]
    body = {"max_tokens": 8, "temperature": 0, "continue_final_message": True, "add_generation_prompt": False}

    def echo() -> str:
        if stream:
            chunks = sse_chunks(server, "/v1/chat/completions", {"model": SERVED, "messages": messages, "echo": True,
                                                                  **body})
            return "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
        return client.chat.completions.create(model=SERVED, messages=messages,
                                              extra_body={**body, "echo": True}).choices[0].message.content

    with ThreadPoolExecutor(4) as pool:  # the four requests at once (none needs another's answer)
        plain_of = pool.submit(client.chat.completions.create, model=SERVED, messages=messages, extra_body=body)
        echoed_of = pool.submit(echo)
        # a user message last is not the reply's role: nothing to echo
        user_last_of = pool.submit(client.chat.completions.create, model=SERVED, messages=CHAT, max_tokens=3,
                                   temperature=0, extra_body={"echo": True})
        unechoed_of = pool.submit(client.chat.completions.create, model=SERVED, messages=CHAT, max_tokens=3,
                                  temperature=0)
        plain, echoed, user_last, unechoed = (f.result() for f in (plain_of, echoed_of, user_last_of, unechoed_of))
    continued = plain.choices[0].message.content
    assert SAYING not in continued
    assert echoed == SAYING + continued
    assert user_last.choices[0].message.content == unechoed.choices[0].message.content


@pytest.mark.parametrize(("messages", "extra", "role", "echoed"), [
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}],
     {"continue_final_message": True}, "assistant", "Once"),
    ([{"role": "user", "content": "Hi"}], {}, "assistant", ""),  # a generation prompt: the reply is the assistant's
    ([{"role": "user", "content": "Hi"}], {"add_generation_prompt": False}, "user", "Hi"),  # the user's, continued
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], {}, "assistant", "Hello")])
def test_chat_echo_follows_the_replys_role(messages: list[dict[str, Any]], extra: dict[str, Any], role: str,
                                           echoed: str) -> None:
    """As vLLM's (and docs/vllm-compat.md's echo row): the reply's role is --response-role's with a generation
    prompt, else the last message's; echo puts the last message first when it has that role."""
    body = decode_body(json.dumps({"messages": messages, "echo": True, **extra}).encode(), ChatBody)
    request = chat_request(body, "r", 0.0)
    assert chat_response_role(request, "assistant") == role
    assert chat_echo_text(body, request, role) == echoed


def test_top_logprobs_of_the_whole_vocabulary(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=1, temperature=0,
                                         extra_body={"logprobs": True, "top_logprobs": -1})
    [entry] = out.choices[0].logprobs.content
    assert len(entry.top_logprobs) == VOCAB_SIZE
    values = [alt.logprob for alt in entry.top_logprobs]
    assert values == sorted(values, reverse=True) and entry.logprob == pytest.approx(values[0])  # greedy: the top
    assert sum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-3)
    completion = client.completions.create(model=SERVED, prompt="Hi", max_tokens=1, logprobs=-1,
                                           extra_body={"return_tokens_as_token_ids": True})  # keyed by id: no clash
    assert len(completion.choices[0].logprobs.top_logprobs[0]) == VOCAB_SIZE


def test_whole_vocabulary_logprobs_past_max_logprobs_are_refused() -> None:
    """Under a finite --max-logprobs (vLLM's default 20), -1 is refused with vLLM's message once the vocabulary is
    known (the tokenizer resolves it); numbers past the bound are refused at the api (tests/test_api.py)."""
    params = SamplingParams(logprobs=-1).validate(20)
    with pytest.raises(InvalidRequestError, match="Requested sample logprobs of -1 .*max allowed: 20") as failure:
        resolve_vocabulary(params, VOCAB_SIZE, 20)
    assert failure.value.param == "logprobs"
    assert resolve_vocabulary(SamplingParams(prompt_logprobs=-1), VOCAB_SIZE, -1).prompt_logprobs == VOCAB_SIZE
    assert resolve_vocabulary(SamplingParams(logprobs=-1), VOCAB_SIZE, VOCAB_SIZE).logprobs == VOCAB_SIZE
    with pytest.raises(InvalidRequestError, match="Requested prompt logprobs of 21, which is greater than max"):
        SamplingParams(prompt_logprobs=21).validate(20)


# ------------------------------------------------------------------ /tokenize, routes


def test_tokenize_answers_token_strs_null_and_renders_tools(server: Server, client: openai.OpenAI) -> None:
    plain = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert "token_strs" in plain and plain["token_strs"] is None
    assert len(post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()[
        "token_strs"]) == plain["count"]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    without = post(server, "/tokenize", {"messages": CHAT}).json()
    with_tools = post(server, "/tokenize", {"messages": CHAT, "tools": tools}).json()
    assert with_tools["count"] > without["count"]
    # the prompt generation renders with those tools is the one /tokenize counted
    chat = client.chat.completions.create(model=SERVED, messages=CHAT, tools=tools, max_tokens=1)
    assert chat.usage.prompt_tokens == with_tools["count"]
    refused = post(server, "/tokenize", {"prompt": "x", "tools": tools})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


def test_vllm_service_routes(server: Server, smollm2_dir: Path) -> None:
    assert HTTP.get(server.url + "/version").json() == {"version": importlib.metadata.version("pagoda")}
    info = HTTP.get(server.url + "/tokenizer_info").json()
    assert info["tokenizer_class"] == type(load_hf_tokenizer(smollm2_dir)).__name__  # the class that was loaded
    assert info["eos_token"] == "<|im_end|>" and "chat_template" in info
    assert not any(key.endswith("_file") for key in info)
    for method in ("GET", "POST"):
        ping = HTTP.request(method, server.url + "/ping")
        assert ping.status_code == 200 and ping.json()["status"] == "ok"
    assert isinstance(HTTP.get(server.url + "/load").json()["server_load"], int)
    # /load counts a request while it is served
    body = {"model": SERVED, "prompt": "Count slowly:", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with HTTP.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()  # kept: a dropped iterator closes the response, and the server aborts
        first = next(lines)
        assert response.status_code == 200, first
        assert HTTP.get(server.url + "/load").json()["server_load"] >= 1


def test_invocations_route_by_body(server: Server) -> None:
    chat = post(server, "/invocations", {"messages": CHAT, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = post(server, "/invocations", {"prompt": "Hi", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    neither = post(server, "/invocations", {"input": "Hi"})
    assert neither.status_code == 400 and "Cannot find suitable handler" in neither.json()["error"]["message"]
    assert post(server, "/invocations", {"prompt": "Hi", "bogus": 1}).status_code == 400  # the route checks the rest


# ------------------------------------------------------------------ beam search


def test_use_beam_search_reaches_the_engine_or_is_refused_clearly(client: openai.OpenAI) -> None:
    """Until the engine has beam search (issue 26) use_beam_search is a 400 saying so; once SamplingParams carries
    it, the fields reach the engine: one beam is greedy decoding, and two beams give two different texts."""
    from pagoda.services.protocol.schemas import beam_search_available

    body = {"use_beam_search": True, "best_of": 1, "length_penalty": 1.0, "early_stopping": False}
    prompt = "The three primary colours are"
    if not beam_search_available():
        with pytest.raises(openai.BadRequestError) as failure:
            client.completions.create(model=SERVED, prompt=prompt, max_tokens=4, temperature=0, extra_body=body)
        assert failure.value.body["param"] == "use_beam_search"
        assert "beam search is not available yet" in failure.value.body["message"]
        return
    greedy = client.completions.create(model=SERVED, prompt=prompt, max_tokens=6, temperature=0)
    one_beam = client.completions.create(model=SERVED, prompt=prompt, max_tokens=6, temperature=0, extra_body=body)
    assert one_beam.choices[0].text == greedy.choices[0].text
    two = client.completions.create(model=SERVED, prompt=prompt, max_tokens=6, temperature=0, n=2,
                                    extra_body={**body, "best_of": 2})
    assert len(two.choices) == 2 and two.choices[0].text != two.choices[1].text


# ------------------------------------------------------------------ docs/vllm-compat.md against the server

BASES: dict[str, tuple[str, str, dict[str, Any]]] = {  # endpoint -> (method, path, minimal body)
    "completions": ("POST", "/v1/completions", {"model": SERVED, "prompt": "Hello", "max_tokens": 1}),
    "chat": ("POST", "/v1/chat/completions", {"model": SERVED, "messages": CHAT, "max_tokens": 1}),
    "tokenize": ("POST", "/tokenize", {"prompt": "Hello"}),
    "detokenize": ("POST", "/detokenize", {"tokens": [1, 2]}),
}
CHAT_TOKENIZE_FIELDS = {"messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                        "chat_template", "media_io_kwargs", "mm_processor_kwargs"}


def doc_rows(section: str) -> list[list[str]]:
    """The rows of the table under `## {section}`: cells stripped, backticks removed."""
    text = DOC.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    return [[cell.strip().strip("`") for cell in row.strip().strip("|").split("|")] for row in rows]


def _expected_ok(status: str) -> bool:
    if status == "supported with beam search":
        from pagoda.services.protocol.schemas import beam_search_available

        return beam_search_available()
    if status == "supported with --trust-request-chat-template":
        return False  # the module's server runs without the flag: refused with vLLM's words (test_vllm_serve_flags)
    assert status in ("supported", "mapped", "refused"), status
    return status != "refused"


def test_spaces_between_special_tokens_changes_nothing(client: openai.OpenAI) -> None:
    """vLLM's default (true) and false give the text of the fast decoder, which has no such switch: special tokens
    kept in an echoed prompt read the same either way."""
    texts = []
    for spaces in (True, False):
        completion = client.completions.create(
            model=client.models.list().data[0].id, prompt="<|im_start|>user<|im_end|><|im_start|>", max_tokens=1,
            temperature=0, echo=True,
            extra_body={"skip_special_tokens": False, "spaces_between_special_tokens": spaces})
        texts.append(completion.choices[0].text)
    assert texts[0] == texts[1] and texts[0].startswith("<|im_start|>user<|im_end|><|im_start|>"), texts


def test_the_field_table_matches_the_server(server: Server) -> None:
    cases = []  # (field, endpoint, status, method, path, body): one request each, independent of the others
    for field, endpoints, status, example, _notes in doc_rows("Request fields"):
        extra = json.loads(example)
        for endpoint in endpoints.split(", "):
            method, path, base = BASES[endpoint]
            if endpoint == "tokenize" and CHAT_TOKENIZE_FIELDS & set(extra):
                base = {"messages": CHAT}
            body = {**base, **extra}
            if body.get("stream"):
                body["max_tokens"] = 1
            cases.append((field, endpoint, status, method, path, body))
    # sent 8 at a time (the engine batches them): the same requests and checks as one after the other
    responses = send_all([(method, server.url + path, body) for _, _, _, method, path, body in cases])
    for (field, endpoint, status, _method, _path, _body), response in zip(cases, responses, strict=True):
        where = f"{field} on {endpoint}: {response.text[:300]}"
        if _expected_ok(status):
            assert response.status_code == 200, where
        else:
            assert response.status_code == 400, where
            error = response.json()["error"]
            assert error["param"] == field, where
            if field in UNSUPPORTED_FIELDS:
                assert UNSUPPORTED_FIELDS[field] in error["message"], where
    assert len(cases) > 100


def test_the_field_table_covers_every_field_pagoda_reads() -> None:
    documented: dict[str, set[str]] = {}
    statuses: dict[str, str] = {}
    for field, endpoints, status, _example, _notes in doc_rows("Request fields"):
        for endpoint in endpoints.split(", "):
            documented.setdefault(endpoint, set()).add(field)
        statuses[field] = status
    for endpoint, body in (("completions", CompletionBody), ("chat", ChatBody), ("tokenize", TokenizeBody),
                           ("detokenize", DetokenizeBody)):
        missing = set(body.__struct_fields__) - documented.get(endpoint, set())
        assert not missing, f"{endpoint} fields without a row in {DOC.name}: {sorted(missing)}"
    for field in UNSUPPORTED_FIELDS:
        assert statuses.get(field) == "refused", field


def test_the_route_table_matches_the_server(server: Server) -> None:
    rows = doc_rows("Routes")
    for route, method, status, example, _notes in rows:
        body = json.loads(example) if example else None
        if route in ("/v1/completions", "/invocations") and body is not None:
            body["model"] = SERVED
        response = HTTP.request(method, server.url + route, json=body, timeout=120)
        if status == "refused":
            assert response.status_code == 404, route
            assert UNSUPPORTED_ROUTES[route] in response.json()["error"]["message"], route
        else:
            assert status == "supported" and response.status_code == 200, f"{route}: {response.text[:300]}"
    assert {row[0] for row in rows if row[2] == "refused"} == set(UNSUPPORTED_ROUTES)


def test_seed_minus_one_is_vllms_no_seed() -> None:
    """vLLM reads seed=-1 as no seed (its SamplingParams turn it into None): a request with it is not reproducible,
    where pagoda once seeded it with -1, so that every such request drew the same tokens."""
    body = decode_body(b'{"prompt": "Hi", "seed": -1}', CompletionBody)
    assert completion_params(body).seed is None
    assert completion_params(decode_body(b'{"prompt": "Hi", "seed": 7}', CompletionBody)).seed == 7
    chat = decode_body(b'{"messages": [{"role": "user", "content": "Hi"}], "seed": -1}', ChatBody)
    assert chat_request(chat, "r", 0.0).params.seed is None


def _chat_refusal(fields: dict[str, Any]) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        chat_request(decode_body(json.dumps({"messages": CHAT, **fields}).encode(), ChatBody), "r", 0.0)
    return caught.value


@pytest.mark.parametrize("fields, param, needle", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "none, minimal, low, medium, high, xhigh, max"),
    ({"reasoning_effort": "LOW"}, "reasoning_effort", "must be one of"),
    ({"reasoning_effort": 2}, "reasoning_effort", "Expected `str | null`"),
    ({"include_reasoning": "false"}, "include_reasoning", "Expected `bool | null`"),
    ({"include_reasoning": 0}, "include_reasoning", "Expected `bool | null`"),
    ({"documents": {"title": "t", "text": "x"}}, "documents", "Expected `array | null`"),
    ({"documents": [{"title": "t", "year": 2024}]}, "documents[0]", "Expected `str`"),
    ({"documents": ["x"]}, "documents[0]", "Expected `object`"),
    ({"documents": [{"text": "x"}] * 16_385}, "documents", "length <= 16384"),
])
def test_reasoning_and_documents_fields_are_checked(fields: dict[str, Any], param: str, needle: str) -> None:
    """vLLM's reasoning_effort (its Literal), include_reasoning (a bool) and documents (objects of strings, at most as
    many as the turns of a conversation): anything else is a 400 naming the field."""
    error = _chat_refusal(fields)
    assert error.param == param and needle in error.message, error.message


def test_reasoning_and_documents_fields_are_taken() -> None:
    """Every effort vLLM takes, include_reasoning either way, documents: the request goes on, carrying them (the
    effort as the template variables, the documents as their own field); null is not set."""
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        body = decode_body(json.dumps({"messages": CHAT, "reasoning_effort": effort}).encode(), ChatBody)
        variables = chat_request(body, "r", 0.0).chat_template_kwargs
        assert variables == {"reasoning_effort": effort, "enable_thinking": effort != "none"}
    documents = [{"title": "t", "text": "x"}, {}]
    body = decode_body(json.dumps({"messages": CHAT, "documents": documents, "include_reasoning": False,
                                   "reasoning_effort": None}).encode(), ChatBody)
    request = chat_request(body, "r", 0.0)
    assert request.documents == documents and request.chat_template_kwargs == {}
    assert chat_output_spec(body, "hermes", "qwen3").include_reasoning is False
    assert chat_request(decode_body(json.dumps({"messages": CHAT}).encode(), ChatBody), "r", 0.0).documents is None


def test_thinking_token_budget_without_a_reasoning_parser_is_refused(server: Server) -> None:
    """vLLM refuses a budget without its reasoning config; this server has no --reasoning-parser, so no think block is
    read: a 400 naming the field and the flag. No budget (-1, null) changes nothing. With a parser:
    tests/test_reasoning_qa.py."""
    body = {"model": SERVED, "messages": CHAT, "max_tokens": 2, "temperature": 0}
    refused = post(server, "/v1/chat/completions", {**body, "thinking_token_budget": 10})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "thinking_token_budget"
    assert "--reasoning-parser" in error["message"], error
    plain = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    for budget in (-1, None):
        taken = post(server, "/v1/chat/completions", {**body, "thinking_token_budget": budget})
        assert taken.status_code == 200 and taken.json()["choices"][0]["message"] == plain
