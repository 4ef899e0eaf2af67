"""Anthropic's Messages API (POST /v1/messages): the body turned into a chat request and the answer built from the
text (unit), checked against the anthropic SDK's own types and stream accumulator; the api process against the fake
tokenizer (x-api-key, tenants, limits, Anthropic's error shape); SmolLM2 through the shared server, against the
chat route it is built on, with the anthropic SDK as the client."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pydantic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent

from pagoda.services.protocol.anthropic import (
    ERROR_PREFIX,
    NO_OP_VALUES,
    REFUSED_FIELDS,
    BlockBuilder,
    MessagesBody,
    MessagesRenderer,
    decode_count_tokens_body,
    decode_messages_body,
    error_from_body,
    rename_error,
    to_chat,
)
from pagoda.services.protocol.chat_output import ChatOutputSpec
from pagoda.services.protocol.schemas import MAX_TURNS, chat_output_spec, chat_request
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import ChatMessage, FinishReason, TextDelta, ToolCallMessage
from tests.harness import HTTP, SERVED, Server, send_all, wait_until

EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}
USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 3}}


def chat_of(body: dict[str, Any]) -> tuple[Any, Any]:
    """(the GenerateRequest, the ChatForm) a Messages body becomes; chat's refusals renamed as the route renames
    them (to_chat's name the Messages fields already)."""
    form = to_chat(decode_messages_body(json.dumps({"model": SERVED, "max_tokens": 16, **body}).encode()))
    try:
        return chat_request(form.chat, "msg_test", 0.0, 20), form
    except InvalidRequestError as exc:
        raise rename_error(exc) from None


def refusal(body: dict[str, Any]) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as failure:
        chat_of(body)
    return failure.value


# --------------------------------------------------------------------------------------------
# the request: Messages -> chat


def test_turns_become_the_chat_conversation() -> None:
    request, form = chat_of({"system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]})
    assert request.messages == [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    assert request.add_generation_prompt and not request.continue_final_message and form.constraint is None
    request, _ = chat_of({"system": [{"type": "text", "text": "Be brief."},
                                     {"type": "text", "text": "Use metric units.", "cache_control": {
                                         "type": "ephemeral"}}],
                          "tools": [WEATHER], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Oslo?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": ""},
            {"type": "text", "text": "Let me look.", "citations": None},
            # as the SDK writes an answer's block back (model_dump()): its null fields too
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}, "caller": None,
             "toolset_name": None},
            {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "5 C"},
            {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
             "content": [{"type": "text", "text": "no station"}]},
            {"type": "text", "text": "Thanks"}]},
        {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]}]})
    assert request.messages == [
        ChatMessage("system", "Be brief.\nUse metric units."), ChatMessage("user", "Weather in\nOslo?"),
        ChatMessage("assistant", "Let me look.", tool_calls=[
            ToolCallMessage("t1", "get_weather", '{"city": "Oslo"}'),
            ToolCallMessage("t2", "get_weather", '{"city": "Rome"}')], reasoning="hm"),
        ChatMessage("tool", "5 C", "get_weather", tool_call_id="t1"),
        ChatMessage("tool", ERROR_PREFIX + "no station", "get_weather", tool_call_id="t2"),
        ChatMessage("user", "Thanks"), ChatMessage("system", "Answer in French.")]
    assert request.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"], "description": WEATHER["description"]}}]


def test_a_last_assistant_turn_is_a_prefill_the_answer_continues() -> None:
    request, _ = chat_of({"messages": [{"role": "user", "content": "Pick A or B"},
                                       {"role": "assistant", "content": "The answer is ("}]})
    assert request.continue_final_message and not request.add_generation_prompt
    assert request.messages[-1] == ChatMessage("assistant", "The answer is (")


def test_extended_thinking_is_the_templates_switch_and_chats_thinking_budget() -> None:
    """Anthropic's thinking: "enabled" with budget_tokens is chat's thinking_token_budget and enable_thinking true
    (Qwen3's template switch); "adaptive" enable_thinking true and no budget; "disabled" enable_thinking false, which
    output_config.effort does not turn back on; absent leaves the template its default."""
    request, form = chat_of({"messages": HI, "max_tokens": 4096,
                             "thinking": {"type": "enabled", "budget_tokens": 2048}})
    assert (form.chat.thinking_token_budget, request.params.thinking_token_budget) == (2048, 2048)
    assert request.params.bounds_thinking and request.chat_template_kwargs == {"enable_thinking": True}
    request, form = chat_of({"messages": HI, "thinking": {"type": "disabled"}})
    assert request.chat_template_kwargs == {"enable_thinking": False} and not request.params.bounds_thinking
    request, form = chat_of({"messages": HI})
    assert request.chat_template_kwargs == {} and not request.params.bounds_thinking
    # adaptive (Claude Code's default) thinks as the model will, at output_config.effort: chat's reasoning_effort
    request, form = chat_of({"messages": HI, "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"}})
    assert request.chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "high"}
    assert not request.params.bounds_thinking
    request, form = chat_of({"messages": HI, "thinking": {"type": "disabled"}, "output_config": {"effort": "low"}})
    assert request.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    # count_tokens has no max_tokens to stay below: any budget from 1024 up renders as generation would
    count = to_chat(decode_count_tokens_body(json.dumps({"model": SERVED, "messages": HI, "thinking": {
        "type": "enabled", "budget_tokens": 100_000}}).encode()).as_messages(), count_only=True)
    assert count.chat.chat_template_kwargs == {"enable_thinking": True}


def test_sampling_tools_and_formats_map_to_chat() -> None:
    request, form = chat_of({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7, "temperature": 0.5,
                             "top_p": 0.9, "top_k": 5, "stop_sequences": ["\n\n"], "metadata": {"user_id": "u1"},
                             "service_tier": "standard_only", "thinking": {"type": "disabled"},
                             "cache_control": {"type": "ephemeral", "ttl": "1h"}})
    params = request.params
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.stop) == (7, 0.5, 0.9, 5,
                                                                                                ["\n\n"])
    assert form.chat.user == "u1"
    hi = [{"role": "user", "content": "Hi"}]
    request, form = chat_of({"messages": hi, "tools": [WEATHER], "tool_choice": {"type": "any"}})
    assert request.params.structured_outputs is not None and form.constraint == "tool_choice"
    assert form.chat.tool_choice == "required"
    _, form = chat_of({"messages": hi, "tools": [{**WEATHER, "strict": True}],
                       "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}})
    assert form.chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert form.chat.parallel_tool_calls is False
    # none: the tools stay in the prompt (Anthropic prices their system prompt for auto and none alike), unless
    # --exclude-tools-when-tool-choice-none; nothing constrains or parses a call
    request, form = chat_of({"messages": hi, "tools": [WEATHER], "tool_choice": {"type": "none"}})
    assert [tool["function"]["name"] for tool in request.tools] == ["get_weather"]
    assert request.params.structured_outputs is None and form.chat.tool_choice == "none"
    request = chat_request(form.chat, "msg_test", 0.0, 20, exclude_tools_when_none=True)
    assert request.tools == []
    request, form = chat_of({"messages": hi, "tool_choice": {"type": "auto"}})  # auto without tools: nothing to call
    assert request.tools == [] and form.chat.tool_choice is None
    request, form = chat_of({"messages": hi, "output_config": {"format": {"type": "json_schema", "schema": {
        "type": "object"}}}})
    assert request.params.structured_outputs.json == {"type": "object"}
    assert form.constraint == "output_config.format"


def test_count_tokens_takes_the_prompt_fields_only() -> None:
    body = decode_count_tokens_body(json.dumps({"model": SERVED, "messages": [{"role": "user", "content": "Hi"}],
                                                "system": "s", "tools": [WEATHER]}).encode())
    chat = to_chat(body.as_messages()).chat
    assert [m.role for m in chat.messages] == ["system", "user"] and chat.tools
    with pytest.raises(InvalidRequestError) as failure:
        decode_count_tokens_body(json.dumps({"model": SERVED, "messages": [], "max_tokens": 3}).encode())
    assert failure.value.param == "max_tokens"


HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body, param, needle", [
    ({"messages": HI, "container": "c1"}, "container", "containers"),
    ({"messages": HI, "mcp_servers": [{"type": "url"}]}, "mcp_servers", "MCP"),
    ({"messages": HI, "context_management": {"edits": []}}, "context_management", "context editing"),
    ({"messages": HI, "inference_geo": "us"}, "inference_geo", "region"),
    ({"messages": HI, "service_tier": "priority"}, "service_tier", "one service tier"),
    ({"messages": HI, "speed": "fast"}, "speed", "one speed"),
    ({"messages": HI, "thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.budget_tokens",
     "below max_tokens (16)"),
    ({"messages": HI, "max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 512}},
     "thinking.budget_tokens", "at least 1024"),
    ({"messages": HI, "max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": True}},
     "thinking.budget_tokens", "an integer"),
    ({"messages": HI, "thinking": {"type": "enabled"}}, "thinking.budget_tokens", "an integer"),
    ({"messages": HI, "thinking": {"type": "auto"}}, "thinking.type", '"enabled", "adaptive" or "disabled"'),
    ({"messages": HI, "thinking": {"type": "adaptive", "budget_tokens": 2048}}, "thinking.budget_tokens",
     "Unrecognized"),
    ({"messages": HI, "thinking": {"type": "disabled", "budget_tokens": 2048}}, "thinking.budget_tokens",
     "Unrecognized"),
    ({"messages": HI, "metadata": {"user_id": "u", "team": "x"}}, "metadata.team", "Unrecognized"),
    ({"messages": HI, "output_config": {"effort": "extreme"}}, "output_config.effort", "must be one of"),
    ({"messages": HI, "output_config": {"format": {"type": "grammar"}}}, "output_config.format.type", "json_schema"),
    ({"messages": HI, "cache_control": {"type": "persistent"}}, "cache_control", "ephemeral"),
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "user, assistant or system"),
    ({"messages": [*HI, {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[1].content[0].type", "expected a text block"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name", "Unrecognized"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type",
     "text models"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type", "text models"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"ttl": "5m"}}]}]},
     "messages[0].content[0].cache_control", "ephemeral"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id", "no tool_use"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": "next"}]},
     "messages", "no tool_result"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": "{}"}]}]}, "messages[1].content[0].input", "object"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "x"}]}]}, "messages[1].content[0].type", "redacted_thinking"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}, "caller": {"type": "code_execution"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]},
     "messages[1].content[0].caller", "programmatic"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}]}]},
     "messages[1].content[0].type", "server tools"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type", "a user turn holds"),
    ({"messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type",
     "server tool"),
    ({"messages": HI, "tools": [{"name": "f"}]}, "tools[0].input_schema", "JSON schema"),
    ({"messages": HI, "tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading", "Unrecognized"),
    ({"messages": HI, "tools": [{**WEATHER, "strict": True}]}, "tools[0].strict", "constrained"),
    ({"messages": HI, "tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"messages": HI, "tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
    ({"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name",
     "no tool named"),
    ({"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "required"}}, "tool_choice.type",
     "auto, any, tool or none"),
    ({"messages": [*HI, {"role": "assistant", "content": [
        {"type": "tool_use", "id": f"t{i}", "name": "f", "input": {}} for i in range(MAX_TURNS + 1)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}"} for i in range(MAX_TURNS + 1)]}]},
     "messages", "at most 16384 tool calls"),
    ({"messages": HI, "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"messages": HI, "temperature": -1}, "temperature", "temperature"),
    ({"messages": HI, "stop_sequences": [""]}, "stop_sequences", "stop"),
])
def test_what_is_refused_names_the_messages_field(body: dict[str, Any], param: str, needle: str) -> None:
    error = refusal(body)
    assert error.param == param and needle in error.message, (error.param, error.message)


@pytest.mark.parametrize("max_tokens", [0, -1, 2**31])
def test_max_tokens_out_of_range_speaks_of_messages_alone(max_tokens: int) -> None:
    """The Messages API has no prompt scoring: its refusal does not offer completions' max_tokens 0 cases."""
    error = refusal({"messages": HI, "max_tokens": max_tokens})
    assert error.param == "max_tokens" and "[1, 2147483647]" in error.message
    assert "echo" not in error.message and "prompt_logprobs" not in error.message


def test_unknown_and_missing_fields_are_400s_naming_them() -> None:
    for body, param in (({"model": SERVED, "max_tokens": 1, "messages": HI, "bogus": 1}, "bogus"),
                        ({"model": SERVED, "messages": HI}, "max_tokens"),
                        ({"max_tokens": 1, "messages": HI}, "model"),
                        ({"model": SERVED, "max_tokens": 1, "messages": HI * (MAX_TURNS + 1)}, "messages")):
        with pytest.raises(InvalidRequestError) as failure:
            decode_messages_body(json.dumps(body).encode())
        assert failure.value.param == param
    # null stands for "not given", also where a value is refused
    chat_of({"messages": HI, **{field: None for field in REFUSED_FIELDS}})
    for field, (values, _) in NO_OP_VALUES.items():
        for value in values:
            chat_of({"messages": HI, field: value})


def test_errors_take_anthropics_shape() -> None:
    renamed = rename_error(InvalidRequestError("stop strings must not be empty (stop)", param="stop"))
    assert (renamed.param, renamed.message) == ("stop_sequences", "stop_sequences strings must not be empty "
                                                                  "(stop_sequences)")
    assert rename_error(InvalidRequestError("too long", param="messages[3].content")).param == "messages"
    too_long = rename_error(InvalidRequestError("the prompt (messages) has 9 tokens; this model accepts at most 8 "
                                                "prompt tokens (truncate_prompt_tokens: -1 keeps what fits)",
                                                param="messages"))
    assert too_long.message == "the prompt (messages) has 9 tokens; this model accepts at most 8 prompt tokens"
    assert error_from_body(InvalidRequestError("too long", param="messages").to_dict()) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "messages: too long"}}
    timeout = {"error": {"message": "late", "type": "invalid_request_error", "param": None, "code": "request_timeout"}}
    assert error_from_body(timeout)["error"]["type"] == "timeout_error"
    assert error_from_body({"error": {"message": "x", "type": "server_error"}})["error"]["type"] == "api_error"


# --------------------------------------------------------------------------------------------
# the answer: events and the Message


def render(pieces: list[str], reason: int = FinishReason.STOP, *, body: dict[str, Any] | None = None,
           reasoning: str | None = None, stream: bool = True, stop: str | None = None,
           ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the events, the Message) of a completion whose deltas are `pieces`, one token each."""
    request, form = chat_of(body or {"messages": HI})
    spec = chat_output_spec(form.chat, "hermes", reasoning)
    renderer = MessagesRenderer("msg_test", SERVED, 1, spec, stream=stream)

    class View:
        choices = [type("C", (), {"num_prompt_tokens": 7})()]

    data = renderer.opening(View())  # type: ignore[arg-type]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        data += renderer.chunks([(None, TextDelta("msg_test", 0, piece, 1, reason if last else -1,
                                                  stop_reason=stop if last else None))])  # type: ignore[list-item]
    if not stream:
        assert data == b""
        return [], renderer.body(None, USAGE)  # type: ignore[arg-type]
    data += renderer.closing(USAGE)
    events = []
    for block in data.decode().split("\n\n")[:-1]:
        event_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
        EVENTS.validate_python(event)  # the anthropic SDK's own event types
        events.append(event)
    return events, renderer.body(None, USAGE)  # type: ignore[arg-type]


def check_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Anthropic's order: message_start, each block's start / deltas / stop, message_delta, message_stop. Returns
    the Message the SDK's own accumulator builds from the events."""
    assert events[0]["type"] == "message_start" and events[0]["message"]["content"] == []
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    index = 0
    types = []
    for event in events[1:-2]:
        types.append(event["type"])
        assert event["index"] == index
        if event["type"] == "content_block_stop":
            index += 1
    assert re.fullmatch(r"(content_block_start (content_block_delta )*content_block_stop )*",
                        "".join(t + " " for t in types)), types
    snapshot, buffers = None, {}
    for event in events:
        snapshot = accumulate_event(event=EVENTS.validate_python(event), current_snapshot=snapshot,
                                    json_bufs=buffers)
    assert snapshot is not None
    return snapshot.model_dump(exclude_none=True)


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """Its JSON without the null fields the SDK drops and with its tool ids replaced."""
    return json.loads(re.sub(r'"toolu_[0-9a-f]+"', '"ID"', json.dumps(Message.model_validate(message).model_dump(
        exclude_none=True))))


def test_a_plain_answer_streams_the_text_the_message_holds() -> None:
    events, message = render(["Hel", "lo", " there"])
    Message.model_validate(message)
    assert message["content"] == [{"type": "text", "text": "Hello there"}]
    assert (message["id"], message["type"], message["role"], message["model"]) == ("msg_test", "message",
                                                                                   "assistant", SERVED)
    assert (message["stop_reason"], message["stop_sequence"]) == ("end_turn", None)
    assert message["usage"] == {"input_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 3,
                                "output_tokens": 5, "service_tier": "standard"}
    assert events[0]["message"]["usage"]["input_tokens"] == 7  # the prompt, before the cache's hits are known
    assert _plain(check_stream(events)) == _plain(message)
    assert [e["delta"]["text"] for e in events if e["type"] == "content_block_delta"] == ["Hel", "lo", " there"]
    assert _plain(render(["Hel", "lo", " there"], stream=False)[1]) == _plain(message)


def test_a_whitespace_run_is_held_in_pieces() -> None:
    """A model looping on newlines (no tools, so chat's stream passes each one on): the whitespace waits as the
    tokens came, joined once (`held_space += text` copied all of it on every token: 256k newlines, 2.2 s of the
    api's event loop), and the message is the same, text after it or none."""
    n = 64_000
    for tail in (["Yes."], []):
        builder = BlockBuilder(ChatOutputSpec())
        assert [e for _ in range(n) for e in builder.push(" \n")] == [] and len(builder.held_space) == n
        for piece in tail:
            builder.push(piece)
        builder.finish(FinishReason.STOP, None)
        assert [block.json() for block in builder.blocks] == [{"type": "text", "text": " \n" * n + "".join(tail)}]
    events, message = render(["\n", "", "\n"])
    assert message["content"] == [{"type": "text", "text": "\n\n"}] and _plain(check_stream(events)) == _plain(message)


def test_stop_reasons() -> None:
    assert render(["One", " two"], FinishReason.LENGTH)[1]["stop_reason"] == "max_tokens"
    _, stopped = render(["One", " two"], stop="\n\n")
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "\n\n")
    # tool_choice any (`required`): a stop sequence that cut the calls' array is what ended the answer
    body = {"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "any"}}
    _, cut = render(['[{"name": "get_weather", "parameters": {"city": "Os'], body=body, stop="lo")
    assert [b["type"] for b in cut["content"]] == ["tool_use"]
    assert (cut["stop_reason"], cut["stop_sequence"]) == ("stop_sequence", "lo")
    _, whole = render(['[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'], body=body)
    assert [b["type"] for b in whole["content"]] == ["tool_use"] and whole["stop_reason"] == "tool_use"
    # a named tool alike: a stop sequence that cut its input is what ended the answer, a whole input is a tool_use
    named = {**body, "tool_choice": {"type": "tool", "name": "get_weather"}}
    _, cut = render(['{"city"'], body=named, stop=":")
    assert [b["type"] for b in cut["content"]] == ["tool_use"] and cut["content"][0]["input"] == {}
    assert (cut["stop_reason"], cut["stop_sequence"]) == ("stop_sequence", ":")
    assert render(['{"city": "Oslo"}'], body=named)[1]["stop_reason"] == "tool_use"
    # the think block never closed (the model ended inside it): no input was written, the turn ended, as chat's stop
    _, unwritten = render(["The user asks", " about Oslo."], body=named, reasoning="deepseek_r1")
    assert [b["type"] for b in unwritten["content"]] == ["thinking", "tool_use"]
    assert unwritten["stop_reason"] == "end_turn"
    # a whole call, then a stop sequence (auto): the answer is the call, which an agent loop runs on tool_use
    auto = {"messages": HI, "tools": [WEATHER]}
    _, called = render(['<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'],
                       body=auto, stop="\n\n")
    assert [b["type"] for b in called["content"]] == ["tool_use"] and called["stop_reason"] == "tool_use"
    events, empty = render([""])
    assert empty["content"] == [] and empty["stop_reason"] == "end_turn"
    assert [e["type"] for e in events] == ["message_start", "message_delta", "message_stop"]


def test_tool_calls_and_reasoning_become_blocks() -> None:
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER]}
    pieces = ["<think>", "The user", " asks.", "</think>", "Let me", " check.", "\n", "<tool_call>",
              '{"name": "get_weather", "arguments": {"city": "Oslo"}}', "</tool_call>",
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>']
    events, message = render(pieces, body=body, reasoning="qwen3")
    Message.model_validate(message)
    thinking, text, *calls = message["content"]
    assert thinking == {"type": "thinking", "thinking": "The user asks.", "signature": ""}
    assert text == {"type": "text", "text": "Let me check."}  # the whitespace before a call is no text
    assert [(c["type"], c["name"], c["input"]) for c in calls] == [("tool_use", "get_weather", {"city": "Oslo"}),
                                                                    ("tool_use", "get_weather", {"city": "Rome"})]
    assert all(c["id"].startswith("toolu_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert message["stop_reason"] == "tool_use"
    assert _plain(check_stream(events)) == _plain(message)
    assert _plain(render(pieces, body=body, reasoning="qwen3", stream=False)[1]) == _plain(message)
    # whitespace before a call is no text block; disable_parallel_tool_use keeps the first call
    _, alone = render(["\n", pieces[-1], pieces[-1]], body={**body, "tool_choice": {
        "type": "auto", "disable_parallel_tool_use": True}})
    assert [block["type"] for block in alone["content"]] == ["tool_use"]


def test_a_named_tool_streams_its_input_json() -> None:
    body = {"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    events, message = render(['{"city"', ': "Oslo"}'], body=body)
    [call] = message["content"]
    assert call["name"] == "get_weather" and call["input"] == {"city": "Oslo"}
    assert [e["delta"] for e in events if e["type"] == "content_block_delta"] == [
        {"type": "input_json_delta", "partial_json": '{"city"'},
        {"type": "input_json_delta", "partial_json": ': "Oslo"}'}]
    assert events[1]["content_block"]["input"] == {}
    assert _plain(check_stream(events)) == _plain(message)
    # cut off by max_tokens: arguments that are no JSON object leave the input empty
    _, cut = render(['{"city"', ': "Os'], FinishReason.LENGTH, body=body)
    assert cut["content"][0]["input"] == {} and cut["stop_reason"] == "max_tokens"


def test_a_named_input_nested_past_the_recursion_limit_is_left_empty() -> None:
    """A schema that lets arrays nest (a recursive $ref) and max_tokens cutting the model's `[[[[...`: Python's
    json gives up (RecursionError) before it sees the text is cut short. The input is {} as for any arguments that
    are no JSON object (it was a 500, the message lost); the stream's input_json_delta carries the text."""
    body = {"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    pieces = ['{"city": ', *["[" * 100] * 30]
    events, message = render(pieces, FinishReason.LENGTH, body=body)
    assert message["content"][0]["input"] == {} and message["stop_reason"] == "max_tokens"
    assert "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta") == "".join(
        pieces)
    closed = '{"city": ' + "[" * 3000 + "]" * 3000 + "}"  # whole, and as deep: no object Python reads either
    assert render([closed], body=body)[1]["content"][0]["input"] == {}


def test_an_error_after_the_first_event_is_an_error_event() -> None:
    renderer = MessagesRenderer("msg_test", SERVED, 1, chat_output_spec(chat_of({"messages": HI})[1].chat,
                                                                        "hermes", None), stream=True)
    data = renderer.stream_error(InvalidRequestError("too long", param="max_tokens").to_dict())
    assert data.startswith(b"event: error\ndata: ")
    event = json.loads(data.decode().split("data: ", 1)[1])
    assert event == {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: too long"}}


# --------------------------------------------------------------------------------------------
# the api process against the fake tokenizer: keys, tenants, limits, the error shape


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, str], Path]]:
    from pagoda.services.api.tenants import add_key
    from tests.test_api import start_stack, stop_stack

    folder = tmp_path_factory.mktemp("messages")
    keys_path, usage_path = folder / "keys.json", folder / "usage.jsonl"
    keys = {"one": add_key(keys_path, "one", {"requests_per_minute": 1, "weight": 2.0})[1],
            "other": add_key(keys_path, "other", {"models": ["some-other-model"]})[1]}
    stack = start_stack("--api-keys-file", str(keys_path), "--usage-log", str(usage_path),
                        "--max-prompt-bytes", "200", "--request-timeout", "2", "--max-inflight-requests", "1")
    yield stack, keys, usage_path
    stop_stack(stack)
    print(stack.log())


def _post(stack: Any, headers: dict[str, str], body: dict[str, Any], path: str = "/v1/messages") -> httpx.Response:
    return stack.post(path, {"model": SERVED, "max_tokens": 3, **body}, headers={**headers,
                                                                                "anthropic-version": "2023-06-01"})


def _error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


@pytest.mark.slow
def test_keys_tenants_and_limits_apply_as_for_chat(stack: tuple[Any, dict[str, str], Path]) -> None:
    from tests.test_api import API_KEY, fake_text

    api, keys, usage_path = stack
    hello = {"messages": [{"role": "user", "content": "hello there"}]}
    assert "x-api-key" in _error(_post(api, {}, hello), 401, "authentication_error")
    _error(_post(api, {"x-api-key": "pgk-unknown"}, hello), 401, "authentication_error")
    # two keys that differ: refused, as two Authorization headers that differ are
    _error(_post(api, {"x-api-key": keys["one"], "Authorization": f"Bearer {API_KEY}"}, hello), 401,
           "authentication_error")
    _error(_post(api, {"x-api-key": keys["other"]}, hello), 404, "not_found_error")  # not its model
    response = _post(api, {"x-api-key": keys["one"]}, hello)
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["id"].startswith("msg_") and message["stop_reason"] == "max_tokens"
    assert message["content"] == [{"type": "text", "text": fake_text("hello", 0, 3)}]
    forwarded = api.tokenizer.requests[message["id"]]
    assert forwarded.render is None  # the api renders the Message from the tokenizer's text
    assert (forwarded.tenant, forwarded.tenant_weight) == ("one", 2.0)
    refused = _post(api, {"x-api-key": keys["one"]}, {"messages": [{"role": "user", "content": "hello again"}]})
    _error(refused, 429, "rate_limit_error")
    assert int(refused.headers["Retry-After"]) >= 1
    record = next(json.loads(line) for line in usage_path.read_text().splitlines()
                  if json.loads(line)["request_id"] == message["id"])
    assert (record["tenant"], record["status"], record["completion_tokens"]) == ("one", 200, 3)
    operator = {"Authorization": f"Bearer {API_KEY}"}
    # --max-prompt-bytes counts the system prompt, the turns and the tool definitions
    long = _post(api, operator, {"system": "s" * 150, "messages": [{"role": "user", "content": "x" * 60}]})
    assert "--max-prompt-bytes" in _error(long, 400, "invalid_request_error")
    tools = _post(api, operator, {"tools": [{**WEATHER, "description": "d" * 200}], **hello})
    assert _error(tools, 400, "invalid_request_error").startswith("messages: ")
    assert "thinking" in _error(_post(api, operator, {**hello, "thinking": {"type": "enabled"}}), 400,
                                "invalid_request_error")
    _error(_post(api, operator, {**hello, "model": "claude-sonnet-4-5"}), 404, "not_found_error")
    # a tokenizer's refusal, and aiohttp's own errors, take the same shape; other routes keep OpenAI's
    _error(_post(api, operator, {"messages": [{"role": "user", "content": "reject this"}]}), 400,
           "invalid_request_error")
    _error(HTTP.get(api.url + "/v1/messages", headers=operator), 405, "invalid_request_error")
    assert "not valid JSON" in _error(HTTP.post(api.url + "/v1/messages", content=b"{bad json", headers=operator),
                                      400, "invalid_request_error")
    _error(HTTP.post(api.url + "/v1/messages", content=b"model=x", headers={
        **operator, "Content-Type": "application/x-www-form-urlencoded"}), 415, "invalid_request_error")
    _error(HTTP.post(api.url + "/v1/messages", content=b" " * (33 << 20), headers=operator), 413,
           "request_too_large")
    _error(HTTP.post(api.url + "/v1/messages/batches", json={}, headers=operator), 404, "not_found_error")
    assert api.post("/v1/chat/completions", {"messages": []}).json()["error"]["param"] == "messages"
    counted = _post(api, {"x-api-key": API_KEY}, {"messages": [{"role": "user", "content": "one two three"}],
                                                  "max_tokens": None}, path="/v1/messages/count_tokens")
    assert counted.status_code == 400  # count_tokens takes no max_tokens
    counted = api.post("/v1/messages/count_tokens", {"model": SERVED, "system": "s",
                                                     "messages": [{"role": "user", "content": "one two three"}]},
                       headers={"x-api-key": API_KEY})
    assert counted.status_code == 200 and counted.json() == {"input_tokens": 4}  # the fake counts words


@pytest.mark.slow
def test_a_timeout_ends_a_stream_with_an_error_event_and_inflight_requests_are_bounded(
        stack: tuple[Any, dict[str, str], Path]) -> None:
    from tests.test_api import API_KEY

    api = stack[0]
    with httpx.stream("POST", api.url + "/v1/messages", headers={"x-api-key": API_KEY}, timeout=10, json={
            "model": SERVED, "max_tokens": 5, "stream": True,
            "messages": [{"role": "user", "content": "hang streamed"}]}) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["message_start", "error"]
    assert events[-1]["error"]["type"] == "timeout_error"
    # past --max-inflight-requests (1): 503, Anthropic's overloaded_error, with Retry-After
    hanging = threading.Thread(target=lambda: answers.append(_post(api, {"x-api-key": API_KEY}, {
        "messages": [{"role": "user", "content": "hang plain"}]})))
    answers: list[httpx.Response] = []
    hanging.start()
    wait_until(lambda: any(g.messages and g.messages[-1].content == "hang plain"
                           for g in api.tokenizer.requests.values()), 5.0, "a request in flight")
    overloaded = _post(api, {"x-api-key": API_KEY}, {"messages": [{"role": "user", "content": "one more"}]})
    _error(overloaded, 503, "overloaded_error")
    assert overloaded.headers["Retry-After"] == "1"
    hanging.join(10)
    _error(answers[0], 408, "timeout_error")  # --request-timeout 2


# --------------------------------------------------------------------------------------------
# SmolLM2 through the shared server, with the anthropic SDK


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    return smollm2_server


# The anthropic SDK (2.x) no longer has sampling arguments; the API takes them, as older SDKs send them
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=120, max_retries=0)


def chat(server: Server, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return server.client(timeout=120).chat.completions.create(model=SERVED, messages=messages, temperature=0,
                                                               **extra)  # type: ignore[call-overload]


@pytest.mark.slow
def test_an_answer_is_chats_answer_to_the_same_conversation(server: Server, client: anthropic.Anthropic) -> None:
    turns = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
             {"role": "user", "content": "Another one?"}]
    message = client.messages.create(model=SERVED, max_tokens=8, extra_body=GREEDY, system="You answer in one word.",
                                     messages=turns)  # type: ignore[arg-type]
    expected = chat(server, [{"role": "system", "content": "You answer in one word."}, *turns], max_tokens=8)
    assert message.content[0].text == expected.choices[0].message.content
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == expected.usage.prompt_tokens
    assert usage.output_tokens == expected.usage.completion_tokens
    assert message.stop_reason == ("max_tokens" if expected.choices[0].finish_reason == "length" else "end_turn")
    counted = client.messages.count_tokens(model=SERVED, system="You answer in one word.",
                                           messages=turns)  # type: ignore[arg-type]
    assert counted.input_tokens == expected.usage.prompt_tokens
    # a prefill: the answer continues the last assistant turn, as chat's continue_final_message
    prefill = [turns[0], {"role": "assistant", "content": "My favourite colour is"}]
    continued = client.messages.create(model=SERVED, max_tokens=4, extra_body=GREEDY,
                                       messages=prefill)  # type: ignore[arg-type]
    expected = chat(server, prefill, max_tokens=4,
                    extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert continued.content[0].text == expected.choices[0].message.content


@pytest.mark.slow
def test_a_streamed_answer_is_the_answer(client: anthropic.Anthropic) -> None:
    body: dict[str, Any] = {"model": SERVED, "max_tokens": 8, "extra_body": GREEDY,
                            "messages": [{"role": "user", "content": "Write one short sentence about the sea."}]}
    whole = client.messages.create(**body)
    with client.messages.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_message()  # the SDK's own accumulator over the events
    texts = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    assert "".join(texts) == final.content[0].text == whole.content[0].text
    # message_start splits the prompt as the end does; the prompt's blocks are cached by the first request
    assert events[0].type == "message_start"
    start, end = events[0].message.usage, final.usage
    assert start.input_tokens + start.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert (start.input_tokens, start.cache_read_input_tokens) == (end.input_tokens, end.cache_read_input_tokens)
    assert start.cache_read_input_tokens > 0
    assert final.stop_reason == whole.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    # a stop sequence from the middle of the greedy answer ends it there, not shown
    stop = " " + whole.content[0].text.split()[2]
    stopped = client.messages.create(**{**body, "stop_sequences": [stop]})
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == whole.content[0].text[:whole.content[0].text.index(stop)]


@pytest.mark.slow
def test_a_tool_round_trip(server: Server, client: anthropic.Anthropic) -> None:
    question = {"role": "user", "content": "What is the weather in Paris?"}

    def streamed_call() -> tuple[list[Any], Message]:
        with client.messages.stream(model=SERVED, max_tokens=30, extra_body=GREEDY, messages=[question],  # type: ignore
                                    tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}) as stream:
            return list(stream), stream.get_final_message()

    with ThreadPoolExecutor(2) as pool:  # the first call and the stream at once (independent): the engine batches them
        streaming = pool.submit(streamed_call)
        first = client.messages.create(model=SERVED, max_tokens=40, extra_body=GREEDY, messages=[question],  # type: ignore
                                       tools=[WEATHER], tool_choice={"type": "any"})  # type: ignore[list-item]
        events, final = streaming.result()
    [call] = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and first.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    with ThreadPoolExecutor(2) as pool:  # the answer to the result and chat's at once (both need only `call`)
        answering = pool.submit(lambda: client.messages.create(
            model=SERVED, max_tokens=6, extra_body=GREEDY, tools=[WEATHER],  # type: ignore[list-item]
            messages=[question, {"role": "assistant", "content": [call.model_dump()]},  # sent back whole
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                    "content": "Sunny, 21 C"}]}]))  # type: ignore[list-item]
        expected = chat(server, [question, {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": "Sunny, 21 C"}],
            tools=tools, max_tokens=6)
        second = answering.result()
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == expected.usage.prompt_tokens
    assert "".join(b.text for b in second.content if b.type == "text") == (expected.choices[0].message.content or "")
    [streamed] = final.content
    jsonschema.validate(streamed.input, WEATHER["input_schema"])
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == streamed.input


@pytest.mark.slow
def test_refusals_over_http_are_anthropic_errors(server: Server, client: anthropic.Anthropic) -> None:
    url = server.url + "/v1/messages"
    for body, needle in (({"messages": HI, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
                         # a budget needs --reasoning-parser, which this server has not: named as the Messages field
                         ({"messages": HI, "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}},
                          "thinking.budget_tokens: thinking.budget_tokens needs a reasoning model"),
                         ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                          "messages[0].content[0].type"),
                         # past the context: Anthropic's words, which its clients match
                         ({"messages": HI, "max_tokens": 5000}, "input length and `max_tokens` exceed context limit: "),
                         ({"messages": [{"role": "user", "content": "hello " * 1100}]}, "prompt is too long: ")):
        response = HTTP.post(url, json={"model": SERVED, "max_tokens": 4, **body}, timeout=120)
        assert response.status_code == 400, response.text
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith(needle), error
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=HI)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as failure:
        client.messages.create(model=SERVED, max_tokens=4, messages=HI, extra_body={"mcp_servers": [{  # type: ignore
            "type": "url", "url": "https://example.invalid", "name": "x"}]})
    assert "mcp_servers" in str(failure.value)


# --------------------------------------------------------------------------------------------
# docs/vllm-compat.md's Messages table against the server


def _table() -> list[list[str]]:
    from tests.test_vllm_compat import doc_rows

    return doc_rows("The Anthropic Messages API")


@pytest.mark.slow
def test_the_messages_table_matches_the_server(server: Server) -> None:
    rows = _table()
    bodies = [{"model": SERVED, "max_tokens": 1, "messages": HI, **json.loads(example)} for _, _, example, _ in rows]
    # sent 8 at a time (the engine batches them): the same requests as one after the other
    responses = send_all([("POST", server.url + "/v1/messages", body) for body in bodies])
    for (field, status, _example, _notes), body, response in zip(rows, bodies, responses, strict=True):
        where = f"{field}: {response.text[:300]}"
        if status in ("supported", "mapped"):
            assert response.status_code == 200, where
            if body.get("stream"):
                for line in response.text.splitlines():
                    if line.startswith("data: "):
                        EVENTS.validate_python(json.loads(line[6:]))
            else:
                Message.model_validate(response.json())
        else:
            assert status == "refused" and response.status_code == 400, where
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error", where
            assert error["message"].startswith(f"{field}: ") and REFUSED_FIELDS[field] in error["message"], where
    assert len(rows) > 20


def test_the_messages_table_covers_every_field() -> None:
    rows = {row[0]: row[1] for row in _table()}
    assert set(rows) == set(MessagesBody.__struct_fields__), "Messages fields and docs/vllm-compat.md's rows differ"
    assert all(rows[field] == "refused" for field in REFUSED_FIELDS)
    assert all(rows[field] == "mapped" for field in NO_OP_VALUES)
