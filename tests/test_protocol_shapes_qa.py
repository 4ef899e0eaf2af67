"""The shapes of pagoda's answers against the official SDKs' own types: every field an SDK type knows has that type,
every required one is there, and no field is one the type does not know (vLLM's documented extensions aside), on
/v1/chat/completions, /v1/completions, /v1/responses and /v1/messages, streamed and not; the event-order invariants
the SDKs' stream helpers rely on; and those helpers run end to end against the shared SmolLM2 server. The first half
feeds the renderers deltas (no server); the second asks SmolLM2."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import openai
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from pagoda.services.protocol.chat_output import ChatOutputSpec
from pagoda.services.protocol.responses import ResponsesRenderer
from pagoda.shared.messages import FinishReason, PositionLogprobs, TextDelta, TokenLogprob
from tests.harness import SERVED, Server, http_client, named_events

RESPONSE_EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
MESSAGE_EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)
USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 3}}
# Fields the SDK types do not know that the server adds on purpose: vLLM's extensions of OpenAI's answers, and OpenAI's
# own `name` of function_call_arguments.done (in its API reference, not yet in the Python SDK's type)
EXTENSIONS = frozenset({"stop_reason", "token_ids", "prompt_token_ids", "prompt_logprobs", "reasoning",
                        "reasoning_content"})
DONE_EVENT_NAME = ("ResponseFunctionCallArgumentsDoneEvent", "name")


def unknown_fields(raw: Any, model: Any, path: str = "$") -> list[str]:
    """Where `raw` (decoded JSON) holds what `model` (the SDK's object validated from it) has no field for, lacks a
    required field, or holds a value of another JSON type than the model's; [] when the shapes agree."""
    if isinstance(model, pydantic.BaseModel):
        if not isinstance(raw, dict):
            return [f"{path}: {type(raw).__name__} for {type(model).__name__}"]
        fields = {(info.alias or name): (name, info) for name, info in type(model).model_fields.items()}
        out = []
        for key, value in raw.items():
            if key in fields:
                out += unknown_fields(value, getattr(model, fields[key][0]), f"{path}.{key}")
            elif key not in EXTENSIONS and (type(model).__name__, key) != DONE_EVENT_NAME:
                out.append(f"{path}.{key}: not a field of {type(model).__name__}")
        out += [f"{path}.{key}: missing" for key, (_, info) in fields.items() if info.is_required() and key not in raw]
        return out
    if isinstance(model, list):
        if not isinstance(raw, list) or len(raw) != len(model):
            return [f"{path}: {type(raw).__name__} for a list"]
        return [d for i, (r, m) in enumerate(zip(raw, model, strict=True))
                for d in unknown_fields(r, m, f"{path}[{i}]")]
    if isinstance(model, dict) and isinstance(raw, dict):
        return [d for key in raw if key in model for d in unknown_fields(raw[key], model[key], f"{path}.{key}")]
    if model is not None and raw is not None and type(raw) is not type(model) \
            and not (isinstance(model, float) and isinstance(raw, int)):
        return [f"{path}: {type(raw).__name__} for {type(model).__name__}"]
    return []


def check_shape(sdk_type: Any, raw: dict[str, Any]) -> Any:
    """`raw` validated strictly by the SDK's type (a class or a TypeAdapter), with no field the type does not know."""
    if isinstance(sdk_type, pydantic.TypeAdapter):
        model = sdk_type.validate_python(raw, strict=True)
    else:
        model = sdk_type.model_validate(raw, strict=True)
    assert unknown_fields(raw, model) == [], raw
    return model


def _logprob(token: str) -> PositionLogprobs:
    return PositionLogprobs(TokenLogprob(token, 7, -0.25, list(token.encode())), [TokenLogprob("a", 8, -2.0, [97])])


# --------------------------------------------------------------------------------------------
# the renderers, fed deltas

SETTINGS = {"instructions": None, "max_output_tokens": None, "metadata": {}, "parallel_tool_calls": True,
            "prompt_cache_key": None, "safety_identifier": None, "text": {"format": {"type": "text"}},
            "tool_choice": "auto", "tools": [], "top_logprobs": 1, "user": None,
            "reasoning": {"effort": None, "summary": None}}


PLAIN = ChatOutputSpec()


def responses_stream(pieces: list[str], spec: ChatOutputSpec = PLAIN, *, logprobs: bool = True,
                     reason: int = FinishReason.STOP) -> list[dict[str, Any]]:
    renderer = ResponsesRenderer("resp_test", SERVED, 1, SETTINGS, spec, stream=True, want_logprobs=logprobs,
                                 temperature=1.0, top_p=1.0)
    data = renderer.opening(None)  # type: ignore[arg-type]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        data += renderer.chunks([(None, TextDelta("resp_test", 0, piece, 1, reason if last else -1,  # type: ignore[list-item]
                                                  [_logprob(piece)] if logprobs else []))])
    return named_events(data + renderer.closing(USAGE))


def test_responses_text_events_carry_logprobs_in_the_events_shape() -> None:
    """output_text.delta and .done carry OpenAI's ResponseLogProb ({token, logprob, top_logprobs: [{token,
    logprob}]}, no bytes); the message's output_text part carries bytes too (its own Logprob type). The events'
    logprobs used to be the part's, bytes and all: a field the events' type does not have."""
    events = responses_stream(["Hel", "lo", " world"])
    for event in events:
        check_shape(RESPONSE_EVENTS, event)
    deltas = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    top = [{"token": "a", "logprob": -2.0}]
    assert deltas == done["logprobs"] == [{"token": t, "logprob": -0.25, "top_logprobs": top}
                                          for t in ("Hel", "lo", " world")]
    part = events[-1]["response"]["output"][0]["content"][0]
    assert [lp["bytes"] for lp in part["logprobs"]] == [list(t.encode()) for t in ("Hel", "lo", " world")]
    assert [{k: v for k, v in lp.items() if k != "bytes"} | {"top_logprobs": top} for lp in part["logprobs"]] == deltas


# --------------------------------------------------------------------------------------------
# the prompt of a tool round trip, for a template that takes no tools

# A template of Mistral-7B-Instruct-v0.2's kind: no tools; after a system message, user and assistant turns
# must alternate
ALTERNATING = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}
{%- else %}{%- set loop_messages = messages %}{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}
    {%- else %}{{- ' ' + message['content'] + eos_token }}{%- endif %}
{%- endfor %}
"""
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _call(call_id: str, city: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


def test_parallel_tool_results_are_one_user_turn_for_a_template_without_tools(tmp_path: Any,
                                                                                smollm2_dir: Any) -> None:
    """The Hermes prompt pagoda writes for a template that takes no tools puts the results of one turn's calls in
    one user turn (Qwen2.5's Hermes template groups consecutive tool messages so). Each result used to be a user
    turn of its own: a template that requires alternating turns refused a parallel call's round trip with a 400."""
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [_call("call_1", "Paris"), _call("call_2", "Rome")]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rainy"}]},
                {"role": "assistant", "content": "Sunny in Paris, rainy in Rome."},
                {"role": "user", "content": "And Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [_call("call_3", "Oslo")]},
                {"role": "tool", "tool_call_id": "call_3", "content": "snow"}]
    text = _rendered(tmp_path, smollm2_dir, messages)
    turns = text.split("[INST] ")[1:]
    assert len(turns) == 4
    assert turns[1].startswith("<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>"
                               " [/INST] Sunny in Paris")
    assert turns[3] == "<tool_response>\nsnow\n</tool_response> [/INST]"


def test_a_user_message_after_tool_results_joins_their_turn_for_a_template_without_tools(tmp_path: Any,
                                                                                         smollm2_dir: Any) -> None:
    """A user turn that holds tool results and text (Anthropic's tool_result blocks beside a text block, which
    Claude Code sends; chat's tool messages then a user message) is one user turn of the Hermes prompt. It was two
    user turns in a row: a template that requires alternating turns refused it with a 400."""
    text = _rendered(tmp_path, smollm2_dir, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "Paris")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}, {"type": "text", "text": "And Rome?"}]}])
    assert text.split("[INST] ")[2] == "<tool_response>\nsunny\n</tool_response>\nThanks.\nAnd Rome? [/INST]"


def _rendered(folder: Any, smollm2_dir: Any, messages: list[dict[str, Any]]) -> str:
    """The served prompt of `messages` (with the weather tool) under the ALTERNATING template."""
    import shutil

    import msgspec

    from pagoda.services.protocol.schemas import MessageBody, chat_messages
    from pagoda.services.tokenizer.prompts import tokenize_prompt
    from pagoda.services.tokenizer.tokenizer import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(ALTERNATING)
    prompt = tokenize_prompt(Tokenizer(folder), prompt_text=None, prompt_token_ids=None,
                             messages=chat_messages([msgspec.convert(m, MessageBody) for m in messages]),
                             add_generation_prompt=True, continue_final_message=False, chat_template_kwargs=None,
                             tools=[WEATHER])
    assert prompt.text is not None
    return prompt.text


# --------------------------------------------------------------------------------------------
# SmolLM2 through the shared server: every answer in its SDK type's shape, streamed and not

CHAT, COMPLETIONS, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"
HEADERS = {"anthropic-version": "2023-06-01"}
HI = [{"role": "user", "content": "Say hi"}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}},
        "required": ["city"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
FLAT_TOOL = {"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": CITY}
GREEDY = {"model": SERVED, "temperature": 0}
INCLUDE_USAGE = {"stream_options": {"include_usage": True}}
QUESTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (CHAT, {"messages": HI, "max_tokens": 6, "n": 2, "logprobs": True, "top_logprobs": 2, "seed": 3,
                    "model": SERVED, "temperature": 0.9}),
    "chat_stop": (CHAT, {**GREEDY, "messages": HI, "max_tokens": 12, "stop": ["welcome"]}),
    "chat_required": (CHAT, {**GREEDY, "messages": ASK, "max_tokens": 40, "tools": [TOOL], "tool_choice": "required"}),
    "chat_named": (CHAT, {**GREEDY, "messages": ASK, "max_tokens": 40, "tools": [TOOL],
                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    "chat_json": (CHAT, {**GREEDY, "messages": ASK, "max_tokens": 40, "response_format": {
        "type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}}),
    "completion": (COMPLETIONS, {**GREEDY, "prompt": ["Once upon", "Hi"], "max_tokens": 4, "n": 2, "logprobs": 2}),
    "completion_stop": (COMPLETIONS, {**GREEDY, "prompt": "1, 2, 3,", "max_tokens": 12, "stop": [" 6"]}),
    "responses": (RESPONSES, {**GREEDY, "input": "Say hi", "max_output_tokens": 6,
                              "include": ["message.output_text.logprobs"], "top_logprobs": 2}),
    "responses_required": (RESPONSES, {**GREEDY, "input": "Weather in Paris?", "max_output_tokens": 40,
                                       "tools": [FLAT_TOOL], "tool_choice": "required"}),
    "responses_json": (RESPONSES, {**GREEDY, "input": "Weather in Paris?", "max_output_tokens": 40, "text": {
        "format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}}),
    "messages": (MESSAGES, {**GREEDY, "messages": HI, "max_tokens": 12, "stop_sequences": ["welcome"]}),
    "messages_tool": (MESSAGES, {**GREEDY, "messages": ASK, "max_tokens": 40, "tools": [ANTHROPIC_TOOL],
                                 "tool_choice": {"type": "any"}}),
}


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    return smollm2_server


def _stream_events(data: bytes) -> list[dict[str, Any]]:
    """An SSE stream's events: `data:` only (chat, completions: [DONE] last, once) or `event:` + `data:`."""
    if data.startswith(b"event: "):
        return named_events(data)
    payloads = [block.removeprefix("data: ") for block in data.decode().split("\n\n")[:-1]]
    assert payloads.count("[DONE]") == 1 and payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


@pytest.fixture(scope="module")
def answers(server: Server) -> dict[str, tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Each question asked streamed (usage included where the route has the option) and not, all at once: name ->
    (the stream's events, the body)."""
    client = http_client()

    def ask(path: str, body: dict[str, Any], stream: bool) -> Any:
        extra = {"stream": True, **(INCLUDE_USAGE if path in (CHAT, COMPLETIONS) else {})} if stream else {}
        response = client.post(server.url + path, json={**body, **extra}, headers=HEADERS, timeout=300)
        assert response.status_code == 200, response.text
        if not stream:
            assert response.headers["content-type"].startswith("application/json")
            return response.json()
        assert response.headers["content-type"].startswith("text/event-stream")
        return _stream_events(response.content)

    with ThreadPoolExecutor(2 * len(QUESTIONS)) as pool:
        futures = {name: (pool.submit(ask, *question, True), pool.submit(ask, *question, False))
                   for name, question in QUESTIONS.items()}
        return {name: (streamed.result(), whole.result()) for name, (streamed, whole) in futures.items()}


def _check_envelope(objects: list[dict[str, Any]], prefix: str, obj: str) -> None:
    """One id (of the route's prefix), one integer `created`, the served model, the route's object name."""
    assert len({(o["id"], o["created"], o["model"], o["object"]) for o in objects}) == 1
    first = objects[0]
    assert first["id"].startswith(prefix) and type(first["created"]) is int and first["model"] == SERVED
    assert first["object"] == obj


@pytest.mark.parametrize("name", [n for n, (path, _) in QUESTIONS.items() if path == CHAT])
def test_chat_answers_are_the_sdks_types(answers: dict[str, Any], name: str) -> None:
    """The body a ChatCompletion, each chunk a ChatCompletionChunk (no unknown field); each choice's first chunk
    carries the role, its finish_reason comes once, on its last chunk, and the usage chunk (empty choices) is last."""
    chunks, body = answers[name]
    check_shape(ChatCompletion, body)
    for chunk in chunks:
        check_shape(ChatCompletionChunk, chunk)
    _check_envelope([body], "chatcmpl-", "chat.completion")
    _check_envelope(chunks, "chatcmpl-", "chat.completion.chunk")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {**body["usage"], "prompt_tokens_details": {
        "cached_tokens": chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]}}
    assert all(c["usage"] is None for c in chunks[:-1])
    per_choice: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks[:-1]:
        assert len(chunk["choices"]) == 1
        per_choice.setdefault(chunk["choices"][0]["index"], []).append(chunk["choices"][0])
    assert sorted(per_choice) == [c["index"] for c in body["choices"]]
    for index, choices in per_choice.items():
        assert choices[0]["delta"]["role"] == "assistant"
        assert all("role" not in c["delta"] for c in choices[1:])
        assert [c["finish_reason"] for c in choices][:-1] == [None] * (len(choices) - 1)
        assert choices[-1]["finish_reason"] == body["choices"][index]["finish_reason"]
    for call in (body["choices"][0]["message"].get("tool_calls") or []):
        assert call["id"].startswith("call_") and call["type"] == "function"


@pytest.mark.parametrize("name", [n for n, (path, _) in QUESTIONS.items() if path == COMPLETIONS])
def test_completion_answers_are_the_sdks_types(answers: dict[str, Any], name: str) -> None:
    """The body a Completion; each chunk one too, but for a running choice's finish_reason: OpenAI's streams send
    null there, which the SDK's type (it reads chunks unchecked) does not list."""
    chunks, body = answers[name]
    check_shape(Completion, body)
    for chunk in chunks:
        ended = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in chunk["choices"]]
        check_shape(Completion, {**chunk, "choices": ended})
    _check_envelope([body], "cmpl-", "text_completion")
    _check_envelope(chunks, "cmpl-", "text_completion")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == body["usage"]["total_tokens"]
    finished: set[int] = set()
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        assert choice["index"] not in finished, "nothing after a choice's finish_reason"
        if choice["finish_reason"] is not None:
            finished.add(choice["index"])
            assert choice["finish_reason"] == body["choices"][choice["index"]]["finish_reason"]
    assert finished == {c["index"] for c in body["choices"]}


def _without_volatile(response: dict[str, Any]) -> dict[str, Any]:
    """A response less what differs between two askings: ids, clock readings, prefix-cache hits."""
    out = {k: v for k, v in response.items() if k not in ("id", "created_at", "completed_at", "usage")}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in response["output"]]
    return out


@pytest.mark.parametrize("name", [n for n, (path, _) in QUESTIONS.items() if path == RESPONSES])
def test_responses_answers_are_the_sdks_types(answers: dict[str, Any], name: str) -> None:
    """The body a Response, each event a ResponseStreamEvent (no unknown field); sequence numbers count from 0;
    output_index, content_index and item_id agree with the item added; each item's deltas join to its .done and to
    the terminal response's item, and that response is the body."""
    events, body = answers[name]
    check_shape(Response, body)
    for event in events:
        check_shape(RESPONSE_EVENTS, event)
    assert body["id"].startswith("resp_") and type(body["created_at"]) is int
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[-1]["type"] == f"response.{final['status']}" and _without_volatile(final) == _without_volatile(body)
    items: dict[int, dict[str, Any]] = {}
    joined: dict[str, str] = {}
    for event in events[2:-1]:
        if event["type"] == "response.output_item.added":
            assert event["output_index"] == len(items)
            items[event["output_index"]] = event["item"]
            continue
        item = items[event["output_index"]]
        assert event.get("item_id", item["id"]) == item["id"] and event.get("content_index", 0) == 0
        if event["type"].endswith(".delta"):
            joined[item["id"]] = joined.get(item["id"], "") + event["delta"]
        elif event["type"] in ("response.output_text.done", "response.function_call_arguments.done"):
            assert joined.get(item["id"], "") == event.get("text", event.get("arguments"))
        elif event["type"] == "response.output_item.done":
            assert event["item"] == final["output"][event["output_index"]]
    for item in final["output"]:
        text = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert joined.get(item["id"], "") == text
        assert item["id"].startswith({"message": "msg_", "function_call": "fc_", "reasoning": "rs_"}[item["type"]])
        assert item["type"] != "function_call" or item["call_id"].startswith("call_")


@pytest.mark.parametrize("name", [n for n, (path, _) in QUESTIONS.items() if path == MESSAGES])
def test_messages_answers_are_the_sdks_types(answers: dict[str, Any], name: str) -> None:
    """The body a Message, each event a RawMessageStreamEvent (no unknown field), in Anthropic's order:
    message_start, each block's start, deltas and stop by index, message_delta with the stop reason and usage,
    message_stop; the blocks the events build are the body's."""
    events, body = answers[name]
    check_shape(Message, body)
    for event in events:
        check_shape(MESSAGE_EVENTS, event)
    assert body["id"].startswith("msg_") and events[0]["message"]["id"].startswith("msg_")
    assert [e["type"] for e in events[:1] + events[-2:]] == ["message_start", "message_delta", "message_stop"]
    blocks: list[dict[str, Any]] = []
    open_index = None
    for event in events[1:-2]:
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == len(blocks)
            open_index = event["index"]
            blocks.append({**event["content_block"], "partial_json": ""})
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index
            delta = event["delta"]
            key = {"text_delta": "text", "input_json_delta": "partial_json", "thinking_delta": "thinking"}[
                delta["type"]]
            blocks[-1][key] += delta[key]
        else:
            assert event["type"] == "content_block_stop" and event["index"] == open_index
            open_index = None
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["partial_json"])
            assert block["id"].startswith("toolu_")
        del block["partial_json"]
    assert [{k: v for k, v in b.items() if k != "id"} for b in blocks] == \
        [{k: v for k, v in b.items() if k != "id"} for b in body["content"]]
    delta = events[-2]
    assert (delta["delta"]["stop_reason"], delta["delta"]["stop_sequence"]) == (body["stop_reason"],
                                                                                body["stop_sequence"])
    assert delta["usage"]["output_tokens"] == body["usage"]["output_tokens"]


class City(pydantic.BaseModel):
    city: str = pydantic.Field(pattern="^[A-Z][a-z]{1,8}$")


def test_the_sdks_stream_helpers_agree_with_the_answers(server: Server) -> None:
    """openai's responses.stream / chat.completions.stream (parsed formats and tools) and anthropic's
    messages.stream run to their final objects without raising, and those are what the non-streamed calls return."""
    client = server.client(timeout=300)
    messages_client = anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=300, max_retries=0)
    ask = "Weather in Paris?"
    chat_ask: Any = [{"role": "user", "content": ask}]
    city_tool = openai.pydantic_function_tool(City, name="get_weather")
    greedy = {"temperature": 0}

    def responses_pair() -> tuple[Any, Any]:
        with client.responses.stream(model=SERVED, input=ask, text_format=City, max_output_tokens=40,
                                     **greedy) as stream:
            streamed = stream.get_final_response()
        return streamed, client.responses.parse(model=SERVED, input=ask, text_format=City, max_output_tokens=40,
                                                **greedy)

    def responses_tool_pair() -> tuple[Any, Any]:
        with client.responses.stream(model=SERVED, input=ask, tools=[FLAT_TOOL], tool_choice="required",
                                     max_output_tokens=40, **greedy) as stream:  # type: ignore[list-item]
            streamed = stream.get_final_response()
        return streamed, client.responses.create(model=SERVED, input=ask, tools=[FLAT_TOOL],  # type: ignore[list-item]
                                                 tool_choice="required", max_output_tokens=40, **greedy)

    def chat_pair() -> tuple[Any, Any]:
        with client.chat.completions.stream(model=SERVED, messages=chat_ask, response_format=City, max_tokens=40,
                                            **greedy) as stream:
            streamed = stream.get_final_completion()
        return streamed, client.chat.completions.parse(model=SERVED, messages=chat_ask, response_format=City,
                                                       max_tokens=40, **greedy)

    def chat_tool_pair() -> tuple[Any, Any]:
        with client.chat.completions.stream(model=SERVED, messages=chat_ask, tools=[city_tool], tool_choice="required",
                                            max_tokens=40, **greedy) as stream:
            streamed = stream.get_final_completion()
        return streamed, client.chat.completions.parse(model=SERVED, messages=chat_ask, tools=[city_tool],
                                                       tool_choice="required", max_tokens=40, **greedy)

    def messages_pair() -> tuple[Any, Any]:
        options: Any = {"model": SERVED, "max_tokens": 40, "messages": chat_ask, "tools": [ANTHROPIC_TOOL],
                        "tool_choice": {"type": "any"}, "extra_body": greedy}
        with messages_client.messages.stream(**options) as stream:
            streamed = stream.get_final_message()
        return streamed, messages_client.messages.create(**options)

    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(f) for f in (responses_pair, responses_tool_pair, chat_pair, chat_tool_pair,
                                            messages_pair)]
        (responses, parsed), (called, call), (chat, chat_parsed), (chat_called, chat_call), (message, created) = \
            [f.result() for f in futures]
    assert responses.status == parsed.status == "completed" and responses.output_parsed == parsed.output_parsed
    assert isinstance(responses.output_parsed, City)
    assert [(o.type, o.name, o.arguments, o.status) for o in called.output] == \
        [(o.type, o.name, o.arguments, o.status) for o in call.output]  # type: ignore[union-attr]
    assert called.output[0].type == "function_call"
    assert chat.choices[0].message.parsed == chat_parsed.choices[0].message.parsed
    assert isinstance(chat.choices[0].message.parsed, City)
    streamed_calls = chat_called.choices[0].message.tool_calls
    assert streamed_calls and [c.function.parsed_arguments for c in streamed_calls] == \
        [c.function.parsed_arguments for c in chat_call.choices[0].message.tool_calls]  # type: ignore[union-attr]
    assert isinstance(streamed_calls[0].function.parsed_arguments, City)
    assert [(b.type, b.name, b.input) for b in message.content] == \
        [(b.type, b.name, b.input) for b in created.content]  # type: ignore[union-attr]
    assert (message.stop_reason, message.usage.output_tokens) == (created.stop_reason, created.usage.output_tokens)
