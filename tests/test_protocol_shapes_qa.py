"""The shapes of pagoda's answers against the official SDKs' own types: every field an SDK type knows has that type,
every required one is there, and no field is one the type does not know (vLLM's documented extensions aside), on
/v1/chat/completions, /v1/completions, /v1/responses and /v1/messages, streamed and not; the event-order invariants
the SDKs' stream helpers rely on; and those helpers run end to end against the shared SmolLM2 server. The first half
feeds the renderers deltas (no server); the second asks SmolLM2."""

from __future__ import annotations

import json
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
from tests.harness import SERVED, Server, http_client

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
        return [d for i, (r, m) in enumerate(zip(raw, model, strict=True)) for d in unknown_fields(r, m, f"{path}[{i}]")]
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


def sse_events(data: bytes) -> list[dict[str, Any]]:
    """The events of `event: NAME / data: JSON` SSE bytes, each event's name checked against its type."""
    events = []
    for block in data.decode().split("\n\n")[:-1]:
        event_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
        events.append(event)
    return events


def _logprob(token: str) -> PositionLogprobs:
    return PositionLogprobs(TokenLogprob(token, 7, -0.25, list(token.encode())), [TokenLogprob("a", 8, -2.0, [97])])


# --------------------------------------------------------------------------------------------
# the renderers, fed deltas

SETTINGS = {"instructions": None, "max_output_tokens": None, "metadata": {}, "parallel_tool_calls": True,
            "prompt_cache_key": None, "safety_identifier": None, "text": {"format": {"type": "text"}},
            "tool_choice": "auto", "tools": [], "top_logprobs": 1, "user": None}


def responses_stream(pieces: list[str], spec: ChatOutputSpec = ChatOutputSpec(), *, logprobs: bool = True,
                     reason: int = FinishReason.STOP) -> list[dict[str, Any]]:
    renderer = ResponsesRenderer("resp_test", SERVED, 1, SETTINGS, spec, stream=True, want_logprobs=logprobs,
                                 temperature=1.0, top_p=1.0)
    data = renderer.opening(None)  # type: ignore[arg-type]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        data += renderer.chunks([(None, TextDelta("resp_test", 0, piece, 1, reason if last else -1,  # type: ignore[list-item]
                                                  [_logprob(piece)] if logprobs else []))])
    return sse_events(data + renderer.closing(USAGE))


def test_responses_text_events_carry_logprobs_in_the_events_shape() -> None:
    """output_text.delta and .done carry OpenAI's ResponseLogProb ({token, logprob, top_logprobs: [{token,
    logprob}]}, no bytes); the message's output_text part carries bytes too (its own Logprob type). The events'
    logprobs used to be the part's, bytes and all: a field the events' type does not have."""
    events = responses_stream(["Hel", "lo", " world"])
    for event in events:
        check_shape(RESPONSE_EVENTS, event)
    deltas = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert deltas == done["logprobs"] == [
        {"token": t, "logprob": -0.25, "top_logprobs": [{"token": "a", "logprob": -2.0}]} for t in ("Hel", "lo", " world")]
    part = events[-1]["response"]["output"][0]["content"][0]
    assert [lp["bytes"] for lp in part["logprobs"]] == [list(t.encode()) for t in ("Hel", "lo", " world")]
    assert [{k: v for k, v in lp.items() if k != "bytes"} | {"top_logprobs": [{"token": "a", "logprob": -2.0}]}
            for lp in part["logprobs"]] == deltas


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
    import shutil

    import msgspec

    from pagoda.services.protocol.schemas import MessageBody, chat_messages
    from pagoda.services.tokenizer.prompts import tokenize_prompt
    from pagoda.services.tokenizer.tokenizer import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(ALTERNATING)
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [_call("call_1", "Paris"), _call("call_2", "Rome")]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rainy"}]},
                {"role": "assistant", "content": "Sunny in Paris, rainy in Rome."},
                {"role": "user", "content": "And Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [_call("call_3", "Oslo")]},
                {"role": "tool", "tool_call_id": "call_3", "content": "snow"}]
    prompt = tokenize_prompt(Tokenizer(tmp_path), prompt_text=None, prompt_token_ids=None,
                             messages=chat_messages([msgspec.convert(m, MessageBody) for m in messages]),
                             add_generation_prompt=True, continue_final_message=False, chat_template_kwargs=None,
                             tools=[WEATHER])
    assert prompt.text is not None
    turns = prompt.text.split("[INST] ")[1:]
    assert len(turns) == 4
    assert turns[1].startswith("<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>"
                               " [/INST] Sunny in Paris")
    assert turns[3] == "<tool_response>\nsnow\n</tool_response> [/INST]"
