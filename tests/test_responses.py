"""OpenAI's Responses API (POST /v1/responses): the body turned into a chat request and the answer built from the
text (unit), checked against the openai SDK's own types; the api process against the fake tokenizer (auth, tenants,
aborts, timeouts); SmolLM2 through the shared server, against the chat route it is built on; and the Responses table
of docs/vllm-compat.md row by row."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from pagoda.services.protocol.chat_output import ChatOutputSpec
from pagoda.services.protocol.responses import (
    NO_OP_VALUES,
    REFUSED_FIELDS,
    OutputBuilder,
    OutputItem,
    ResponsesBody,
    ResponsesRenderer,
    decode_responses_body,
    rename_error,
    to_chat,
)
from pagoda.services.protocol.schemas import MAX_TURNS, chat_output_spec, chat_request
from pagoda.services.protocol.vllm import RESPONSES_NOT_STORED, UNSUPPORTED_FIELDS
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import ChatMessage, FinishReason, PositionLogprobs, TextDelta, TokenLogprob
from tests.harness import HTTP, SERVED, Server, send_all, wait_until

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 3}}


def chat_of(body: dict[str, Any]) -> tuple[Any, Any]:
    """(the GenerateRequest, the ChatForm) a Responses body becomes."""
    form = to_chat(decode_responses_body(json.dumps(body).encode()))
    return chat_request(form.chat, "resp_test", 0.0, 20), form


def refusal(body: dict[str, Any]) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as failure:
        try:
            chat_of(body)
        except InvalidRequestError as exc:
            raise rename_error(exc) from None
    return failure.value


# --------------------------------------------------------------------------------------------
# the request: Responses -> chat


def test_input_is_optional_beside_instructions() -> None:
    """OpenAI's input is optional (client.responses.input_tokens.count(instructions=...) counts the instructions);
    with neither there is nothing to answer, since nothing is stored."""
    request, _ = chat_of({"instructions": "Say hi."})
    assert request.messages == [ChatMessage("system", "Say hi.")]
    error = refusal({"model": "m"})
    assert error.param == "input" and "instructions" in error.message
    assert refusal({"input": []}).param == "input"


def test_input_items_become_the_chat_conversation() -> None:
    request, _ = chat_of({"input": "Hi", "instructions": "Be brief."})
    assert request.messages == [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    request, _ = chat_of({"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Use metric units."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in"},
                                                        {"type": "input_text", "text": "Oslo and Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "id": "fc_2", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}',
         "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "5 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "20 C"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No more."}]},
        {"role": "user", "content": "Thanks"}], "tools": [WEATHER]})
    roles = [(m.role, m.content, m.name, m.tool_call_id) for m in request.messages]
    # the developer turn reaches the template as chat's do (merged into the system turn where the template does
    # not name the role: conversation.developer_as_system)
    assert roles == [("system", "Be brief.", None, None), ("developer", "Use metric units.", None, None),
                     ("user", "Weather in\nOslo and Rome?", None, None), ("assistant", "Let me look.", None, None),
                     ("tool", "5 C", "get_weather", "c1"), ("tool", "20 C", "get_weather", "c2"),
                     ("assistant", "No more.", None, None), ("user", "Thanks", None, None)]
    # both calls join the assistant turn that wrote the text before them (parallel calls of one turn)
    assert [(c.id, c.name, json.loads(c.arguments)) for c in request.messages[3].tool_calls] == [
        ("c1", "get_weather", {"city": "Oslo"}), ("c2", "get_weather", {"city": "Rome"})]
    request, _ = chat_of({"input": [{"role": "user", "content": "Hi"},
                                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                    {"type": "function_call_output", "call_id": "c", "output": "ok"}]})
    assert [(m.role, m.content, len(m.tool_calls)) for m in request.messages] == [
        ("user", "Hi", 0), ("assistant", "", 1), ("tool", "ok", 0)]


def test_tools_choice_format_and_sampling_map_to_chat() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request, form = chat_of({"input": "Hi", "tools": [{**WEATHER, "strict": True}], "max_output_tokens": 9,
                             "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
                             "temperature": 0.5, "top_p": 0.9, "seed": 3, "top_k": 4, "stop": ["\n"],
                             "include": ["message.output_text.logprobs"], "top_logprobs": 2, "priority": 2,
                             "metadata": {"k": "v"}, "prompt_cache_key": "user-1"})
    assert request.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER["parameters"],
        "strict": True}}]
    params = request.params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed, params.top_k, params.stop,
            params.logprobs, request.priority) == (9, 0.5, 0.9, 3, 4, ["\n"], 2, 2)
    assert params.structured_outputs is not None and params.structured_outputs.json == WEATHER["parameters"]
    assert form.constraint == "tools"
    spec = chat_output_spec(form.chat, "hermes", None)
    assert (spec.tool_mode, spec.tool_name, spec.max_calls) == ("named", "get_weather", 1)
    assert form.settings["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert form.settings["tools"] == [{**WEATHER, "strict": True}] and form.settings["metadata"] == {"k": "v"}
    assert request.prompt_cache_key == form.settings["prompt_cache_key"] == "user-1"  # routed as chat's, and echoed
    request, form = chat_of({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "a",
                                                                 "schema": schema, "strict": True}}})
    assert request.params.structured_outputs.json == schema and form.constraint == "text.format"
    assert form.settings["text"] == {"format": {"type": "json_schema", "name": "a", "schema": schema,
                                                "strict": True}}
    request, form = chat_of({"input": "Hi", "text": {"format": {"type": "json_object"}}})
    assert request.params.structured_outputs.json_object
    request, form = chat_of({"input": "Hi", "text": {"format": {"type": "text"}}, "store": True,
                             "background": False, "service_tier": "auto", "truncation": "disabled",
                             "reasoning": {"effort": None, "summary": None}})
    assert request.params.structured_outputs is None and form.constraint is None
    assert request.params.logprobs is None and request.params.max_tokens is None  # up to the context, as chat
    assert form.settings["tool_choice"] == "auto" and form.settings["parallel_tool_calls"] is True


def test_reasoning_effort_is_chats() -> None:
    """reasoning.effort is chat's reasoning_effort (vLLM's Responses passes it to the template): the template's
    reasoning_effort and enable_thinking (chat_template_kwargs' own enable_thinking wins), echoed in the response's
    reasoning; null keys are taken (the SDK's dump of a Reasoning), and change nothing."""
    request, form = chat_of({"input": "Hi", "reasoning": {"effort": "low", "summary": None}})
    assert request.chat_template_kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    assert form.settings["reasoning"] == {"effort": "low", "summary": None}
    request, _ = chat_of({"input": "Hi", "reasoning": {"effort": "none"}, "chat_template_kwargs": {"x": 1}})
    assert request.chat_template_kwargs == {"x": 1, "reasoning_effort": "none", "enable_thinking": False}
    request, _ = chat_of({"input": "Hi", "reasoning": {"effort": "high"},
                          "chat_template_kwargs": {"enable_thinking": False}})
    assert request.chat_template_kwargs == {"reasoning_effort": "high", "enable_thinking": False}
    request, form = chat_of({"input": "Hi", "reasoning": {"effort": None, "generate_summary": None}})
    assert request.chat_template_kwargs == {} and form.settings["reasoning"] == {"effort": None, "summary": None}


def test_a_long_run_of_parallel_calls_joins_one_assistant_turn_in_order() -> None:
    """8,191 parallel calls and their outputs (as many as MAX_TURNS input items allow): one assistant turn holding
    them in order, then their outputs. Each call copied the turn's list of calls before (quadratic: about 2.5
    minutes of the api's event loop for a 32 MiB body); this pins the behaviour, not the speed."""
    num_calls = (MAX_TURNS - 1) // 2
    calls = [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": ""} for i in range(num_calls)]
    outputs = [{"type": "function_call_output", "call_id": f"c{i}", "output": ""} for i in range(num_calls)]
    request, _ = chat_of({"input": [{"role": "user", "content": "q"}, *calls, *outputs]})
    assistant = request.messages[1]
    assert assistant.role == "assistant" and len(request.messages) == 2 + num_calls
    assert [call.id for call in assistant.tool_calls] == [f"c{i}" for i in range(num_calls)]


def test_calls_the_sdk_serializes_are_taken_back() -> None:
    """A function_call item as the openai SDK writes it to JSON (model_dump(by_alias=True): async, caller and
    namespace null) and an output with the function's name: taken (they were 400s 'Unrecognized argument')."""
    call = {"arguments": '{"city": "Paris"}', "call_id": "call_1", "name": "get_weather", "type": "function_call",
            "id": "fc_1", "async": None, "caller": None, "namespace": None, "status": "completed"}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "sunny", "caller": None,
              "name": "get_weather", "namespace": None}
    request, _ = chat_of({"input": [{"role": "user", "content": "Weather?"}, call, output]})
    assert request.messages[-1].role == "tool" and request.messages[-1].content == "sunny"
    for field in ("async", "caller", "namespace"):
        error = refusal({"input": [{"role": "user", "content": "Weather?"}, {**call, field: "x"}, output]})
        assert error.param == f"input[1].{field}" and "not supported" in error.message, error.message


def test_tool_choice_auto_without_tools_is_the_default() -> None:
    """OpenAI's default tool_choice, echoed in every response, is taken when sent back without tools (chat's
    refusal of 'auto' without tools named a value the response itself reports)."""
    for extra in ({}, {"tools": []}):
        request, form = chat_of({"input": "Hi", "tool_choice": "auto", **extra})
        assert not request.tools and form.constraint is None
        assert form.settings["tool_choice"] == "auto" and form.settings["tools"] == []
    request, _ = chat_of({"input": "Hi", "tool_choice": "auto", "tools": [WEATHER]})
    assert request.tools is not None and len(request.tools) == 1  # with tools, chat's auto


@pytest.mark.parametrize("body, param, needle", [
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation"),
    ({"input": "Hi", "conversation": "conv_1"}, "conversation", "not stored"),
    ({"input": "Hi", "prompt": {"id": "p"}}, "prompt", "prompt templates"),
    ({"input": "Hi", "max_tool_calls": 2}, "max_tool_calls", "built-in tools"),
    ({"input": "Hi", "background": True}, "background", "store"),
    ({"input": "Hi", "truncation": "auto"}, "truncation", "not implemented"),
    ({"input": "Hi", "service_tier": "flex"}, "service_tier", "one service tier"),
    ({"input": "Hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "none, minimal, low, medium, high"),
    ({"input": "Hi", "reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary",
     "no reasoning summaries"),
    ({"input": "Hi", "reasoning": {"generate_summary": "concise"}}, "reasoning.generate_summary", "summaries"),
    ({"input": "Hi", "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation", "obfuscation"),
    ({"input": "Hi", "stream_options": {"include_obfuscation": False}}, "stream_options", "stream is true"),
    ({"input": "Hi", "include": ["file_search_call.results"]}, "include[0]", "built-in tool"),
    ({"input": "Hi", "top_logprobs": 2}, "top_logprobs", "message.output_text.logprobs"),
    ({"input": "Hi", "text": {"verbosity": "low"}}, "text.verbosity", "verbosity"),
    ({"input": "Hi", "text": {"format": {"type": "grammar"}}}, "text.format.type", "json_schema"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": "x"}}},
     "text.format.schema", "JSON object"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "built-in tool"),
    ({"input": "Hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].function",
     "Unrecognized"),
    ({"input": "Hi", "tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "no tool named"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice",
     "built-in tool"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": 1}]}]}, "input[0].summary[0]",
     "summary_text"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "role must be"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "text models"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}, "input[0].content[0]",
     "input_text part"),
    ({"input": [{"role": "user", "content": [{"type": [], "text": "x"}]}]}, "input[0].content[0].type",
     "content parts are"),
    ({"input": [{"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}]}, "input[0].content[0].type",
     "content parts are"),
    ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input[0].type", "built-in tools"),
    # fields sent back from an earlier answer, read nowhere: typed all the same (they were taken whatever they held)
    ({"input": [{"role": "user", "content": "q", "id": []}]}, "input[0].id", "string"),
    ({"input": [{"role": "user", "content": "q", "status": "done"}]}, "input[0].status", "status must be"),
    ({"input": [{"role": "user", "content": "q", "phase": 1}]}, "input[0].phase", "string"),
    ({"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "a", "annotations": "x"}]}]},
     "input[0].content[0].annotations", "array"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "status": {}},
                {"type": "function_call_output", "call_id": "c", "output": "r"}]}, "input[0].status", "status"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "r", "id": 5}]}, "input[1].id", "string"),
    ({"input": [{"role": "user", "content": "q"}, {"type": "reasoning", "summary": "x"}]}, "input[1].summary",
     "array"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "not stored"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id",
     "No tool call found"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, "input",
     "No tool output found"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}]}, "input[0].name",
     "non-empty"),
    ({"input": [{"role": "user", "content": "Hi", "name": "bob"}]}, "input[0].name", "Unrecognized"),
    # OpenAI's "Duplicate item found with id": a stored conversation listed by input_items pages by item id (an
    # `after` naming an id twice paged back to its first place: the SDK's auto-pagination looped forever)
    ({"input": [{"role": "user", "content": "a", "id": "msg_1"}, {"role": "assistant", "content": "b", "id": "msg_1"}]},
     "input[1].id", "Duplicate item found with id 'msg_1'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "id": "fc_1"},
                {"type": "function_call_output", "call_id": "c", "output": "r", "id": "fc_1"}]}, "input[1].id",
     "Duplicate item"),
    ({"input": "Hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be"),
    ({"input": "Hi", "temperature": -1}, "temperature", "temperature"),
    ({"input": "Hi", "prompt_cache_key": ""}, "prompt_cache_key", "non-empty"),
    ({"input": "Hi", "text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "only one of"),
])
def test_what_is_refused_names_the_responses_field(body: dict[str, Any], param: str, needle: str) -> None:
    error = refusal(body)
    assert error.param == param and needle in error.message, (error.param, error.message)
    # chat's words for its own fields never leak into a Responses refusal (max_output_tokens 0 named prompt_logprobs
    # and echo, which Responses does not have)
    assert "prompt_logprobs" not in error.message and "echo" not in error.message, error.message


def test_unknown_and_vllm_refused_fields_are_400s_naming_them() -> None:
    for field in ("bogus", "kv_transfer_params", "vllm_xargs"):
        with pytest.raises(InvalidRequestError) as failure:
            decode_responses_body(json.dumps({"input": "Hi", field: 1}).encode())
        assert failure.value.param == field and UNSUPPORTED_FIELDS.get(field, "Unrecognized") in failure.value.message
    # null stands for "not given", also where a value is refused
    chat_of({"input": "Hi", **{field: None for field in REFUSED_FIELDS}})
    for field, (values, _) in NO_OP_VALUES.items():
        for value in values:
            chat_of({"input": "Hi", field: value})


def test_tokenizer_refusals_name_the_responses_fields() -> None:
    too_long = rename_error(InvalidRequestError("the prompt (messages) has 2000 tokens", param="messages"))
    assert (too_long.param, too_long.message) == ("input", "the prompt (input) has 2000 tokens")
    budget = rename_error(InvalidRequestError("prompt plus max_tokens=9 exceed it", param="max_tokens"))
    assert (budget.param, budget.message) == ("max_output_tokens", "prompt plus max_output_tokens=9 exceed it")
    assert rename_error(InvalidRequestError("x", param="response_format.json_schema.schema")).param == \
        "text.format.schema"
    assert rename_error(InvalidRequestError("x", param="seed")).param == "seed"


# --------------------------------------------------------------------------------------------
# the answer: events and the response object


def _logprob(token: str) -> PositionLogprobs:
    return PositionLogprobs(TokenLogprob(token, 7, -0.25, list(token.encode())), [TokenLogprob("a", 8, -2.0, [97])])


def render(pieces: list[str], reason: int = FinishReason.STOP, *, body: dict[str, Any] | None = None,
           reasoning: str | None = None, stream: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the events, the final response) of a completion whose deltas are `pieces`, one token each."""
    request, form = chat_of(body or {"input": "Hi"})
    spec = chat_output_spec(form.chat, "hermes", reasoning)
    renderer = ResponsesRenderer("resp_test", SERVED, 1, form.settings, spec, stream=stream,
                                 want_logprobs=bool(form.chat.logprobs), temperature=request.params.temperature,
                                 top_p=request.params.top_p)
    data = renderer.opening(None)  # type: ignore[arg-type]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        data += renderer.chunks([(None, TextDelta("resp_test", 0, piece, 1, reason if last else -1,
                                                  [_logprob(piece)] if form.chat.logprobs else []))])
    if not stream:
        assert data == b""
        return [], renderer.body(None, USAGE)  # type: ignore[arg-type]
    data += renderer.closing(USAGE)
    events = []
    for block in data.decode().split("\n\n")[:-1]:
        event_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
        EVENTS.validate_python(event)  # the openai SDK's own event types, strictly
        events.append(event)
    return events, events[-1]["response"]


ITEM_EVENTS = {  # an item's events between its output_item.added and .done
    "message": re.compile(r"content_part\.added (output_text\.delta )*output_text\.done content_part\.done "),
    "reasoning": re.compile(r"content_part\.added (reasoning_text\.delta )*reasoning_text\.done content_part\.done "),
    "function_call": re.compile(r"(function_call_arguments\.delta )*function_call_arguments\.done "),
}


def check_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The Responses stream's order: created, in_progress, each item added / its parts / done, one terminal event;
    sequence numbers count from 0; each item's deltas join to its done text, and the terminal response holds the
    items as they were done. Returns that response."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]
    assert final["type"] == f"response.{final['response']['status']}"
    output = final["response"]["output"]
    rest = events[2:-1]
    for index, item in enumerate(output):
        added = rest.pop(0)
        assert added["type"] == "response.output_item.added" and added["output_index"] == index
        assert added["item"]["id"] == item["id"] and added["item"]["status"] == "in_progress"
        inner = []
        while rest[0]["type"] != "response.output_item.done":
            inner.append(rest.pop(0))
        assert all(e["item_id"] == item["id"] and e["output_index"] == index for e in inner)
        types = "".join(e["type"].removeprefix("response.") + " " for e in inner)
        assert ITEM_EVENTS[item["type"]].fullmatch(types), types
        joined = "".join(e["delta"] for e in inner if e["type"].endswith(".delta"))
        text = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert joined == text == inner[-2 if item["type"] != "function_call" else -1].get(
            "arguments" if item["type"] == "function_call" else "text")
        done = rest.pop(0)
        assert done["output_index"] == index and done["item"] == item
    assert rest == []
    return final["response"]


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Equal responses but for their random item ids and completion time."""
    def plain(response: dict[str, Any]) -> str:
        text = json.dumps({**response, "completed_at": None})
        return re.sub(r'"(rs|msg|fc|call)_[0-9a-f]+"', '"ID"', text)
    assert plain(a) == plain(b)


def test_a_plain_answer_streams_the_text_the_response_holds() -> None:
    events, response = render(["Hel", "lo", " there"])
    assert check_stream(events) == response
    Response.model_validate(response)  # the SDK's type, strictly
    assert response["status"] == "completed" and response["incomplete_details"] is None
    [message] = response["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": "Hello there", "annotations": [], "logprobs": []}]
    assert response["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 3,
                                                                             "cache_write_tokens": 0},
                                 "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                                 "total_tokens": 12}
    assert "output_text" not in response  # the SDK's convenience, not a field
    _same(response, render(["Hel", "lo", " there"], stream=False)[1])


def test_running_out_of_tokens_is_incomplete() -> None:
    events, response = render(["One", ",", " two"], FinishReason.LENGTH,
                              body={"input": "Count", "max_output_tokens": 3})
    assert check_stream(events) == response and events[-1]["type"] == "response.incomplete"
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete" and response["completed_at"] is None
    assert response["max_output_tokens"] == 3
    Response.model_validate(response)


def test_tool_calls_reasoning_and_logprobs_become_items() -> None:
    body = {"input": "Weather?", "tools": [WEATHER], "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    pieces = ["<think>", "The user", " asks.", "</think>", "Let me", " check.", "\n", "<tool_call>",
              '{"name": "get_weather", "arguments": {"city": "Oslo"}}', "</tool_call>",
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>']
    events, response = render(pieces, body=body, reasoning="qwen3")
    assert check_stream(events) == response
    Response.model_validate(response)
    reasoning, message, *calls = response["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "The user asks."}] and reasoning["summary"] == []
    assert message["content"][0]["text"] == "Let me check."  # the whitespace before a call is no content
    # the message's logprobs are its own tokens': not the reasoning's, nor the calls' (nor that whitespace's)
    assert [entry["token"] for entry in message["content"][0]["logprobs"]] == ["Let me", " check."]
    assert [(c["name"], json.loads(c["arguments"]), c["status"]) for c in calls] == [
        ("get_weather", {"city": "Oslo"}, "completed"), ("get_weather", {"city": "Rome"}, "completed")]
    assert all(c["call_id"].startswith("call_") and c["id"].startswith("fc_") for c in calls)
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 4  # the think block, markers too
    _same(response, render(pieces, body=body, reasoning="qwen3", stream=False)[1])
    # whitespace before a call is no message; parallel_tool_calls false keeps the first call
    _, alone = render(["\n", pieces[-1], pieces[-1]], body={"input": "Hi", "tools": [WEATHER],
                                                           "parallel_tool_calls": False})
    assert [item["type"] for item in alone["output"]] == ["function_call"] and not alone["parallel_tool_calls"]


def test_a_whitespace_run_is_held_in_pieces() -> None:
    """A model looping on newlines (no tools, so chat's stream passes each one on): the whitespace waits as the
    tokens came, joined once (`held_space += text` copied all of it on every token: 256k newlines, 2.4 s of the
    api's event loop), and the answer is the same message, streamed or not, text after it or none."""
    n = 64_000
    for tail in (["Yes."], []):
        builder = OutputBuilder(ChatOutputSpec(), want_logprobs=False)
        assert [e for _ in range(n) for e in builder.push(" \n", [], 1)] == [] and len(builder.held_space) == n
        events, response = render(["\n"] * 3 + tail + [""])
        assert check_stream(events) == response
        assert [item["content"][0]["text"] for item in response["output"]] == ["\n" * 3 + "".join(tail)]
        for piece in tail:
            builder.push(piece, [], 1)
        builder.finish(FinishReason.STOP)
        assert [item.text for item in builder.items] == [" \n" * n + "".join(tail)]


def test_closing_an_item_compares_no_items(monkeypatch: pytest.MonkeyPatch) -> None:
    """The item being closed is the last one: found by list.index, each call's close compared it with every item
    before it (OutputItem's field-by-field ==), quadratic in the calls: 8000 calls of a looping model held the api's
    event loop 11 s at the end of the answer (Messages' builder, which counts, 0.4 s)."""
    comparisons = []
    monkeypatch.setattr(OutputItem, "__eq__", lambda self, other: comparisons.append(1) or self is other)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    events, response = render(["Sure.", *[call] * 50], body={"input": "Weather?", "tools": [WEATHER]})
    assert [item["type"] for item in response["output"]] == ["message", *["function_call"] * 50]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == list(range(51))
    assert comparisons == []


def test_a_named_function_streams_its_arguments_and_an_empty_answer_is_a_message() -> None:
    body = {"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}
    events, response = render(['{"city"', ': "Oslo"}'], body=body)
    assert check_stream(events) == response
    [call] = response["output"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Oslo"}
    assert [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"] == [
        '{"city"', ': "Oslo"}']
    events, response = render([""])
    assert check_stream(events) == response
    assert response["output"][0]["content"][0]["text"] == ""


def test_an_error_after_the_first_event_is_an_error_event() -> None:
    request, form = chat_of({"input": "Hi"})
    renderer = ResponsesRenderer("resp_test", SERVED, 1, form.settings, ChatOutputSpec(), stream=True,
                                 want_logprobs=False, temperature=1.0, top_p=1.0)
    renderer.opening(None)  # type: ignore[arg-type]
    data = renderer.stream_error(InvalidRequestError("too long", param="messages").to_dict())
    event = json.loads(data.decode().split("data: ", 1)[1])
    assert event == {"type": "error", "code": None, "message": "too long", "param": "input", "sequence_number": 2}
    EVENTS.validate_python(event)


# --------------------------------------------------------------------------------------------
# the api process against the fake tokenizer: auth, tenants, aborts, timeouts


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, dict[str, str], Path]]:
    from pagoda.services.api.tenants import add_key
    from tests.test_api import start_stack, stop_stack

    folder = tmp_path_factory.mktemp("responses")
    keys_path, usage_path = folder / "keys.json", folder / "usage.jsonl"
    keys = {"one": add_key(keys_path, "one", {"requests_per_minute": 1, "weight": 2.0})[1],
            "other": add_key(keys_path, "other", {"models": ["some-other-model"]})[1]}
    stack = start_stack("--api-keys-file", str(keys_path), "--usage-log", str(usage_path), "--request-timeout", "2")
    yield stack, keys, usage_path
    stop_stack(stack)
    print(stack.log())


def _post(stack: Any, key: str, body: dict[str, Any]) -> httpx.Response:
    return stack.post("/v1/responses", body, headers={"Authorization": f"Bearer {key}"})


@pytest.mark.slow
def test_keys_tenants_and_the_usage_log_apply_as_for_chat(stack: tuple[Any, dict[str, str], Path]) -> None:
    from tests.test_api import API_KEY, fake_text

    api, keys, usage_path = stack
    assert _post(api, "pgk-unknown", {"input": "hello there"}).status_code == 401
    assert _post(api, keys["other"], {"input": "hello there"}).status_code == 404  # not its model
    response = _post(api, keys["one"], {"input": "hello there", "max_output_tokens": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("resp_") and body["status"] == "incomplete"
    assert body["output"][0]["content"][0]["text"] == fake_text("hello", 0, 3)
    forwarded = api.tokenizer.requests[body["id"]]
    assert forwarded.render is None  # the api renders the Responses answer from the tokenizer's text
    assert (forwarded.tenant, forwarded.tenant_weight) == ("one", 2.0)
    refused = _post(api, keys["one"], {"input": "hello again"})
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    record = next(json.loads(line) for line in usage_path.read_text().splitlines()
                  if json.loads(line)["request_id"] == body["id"])
    assert (record["tenant"], record["status"], record["completion_tokens"]) == ("one", 200, 3)
    missing = _post(api, API_KEY, {"input": "hello", "previous_response_id": "resp_x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "previous_response_id"
    stored = HTTP.get(api.url + "/v1/responses/resp_x", headers={"Authorization": f"Bearer {API_KEY}"})
    assert stored.status_code == 404 and RESPONSES_NOT_STORED in stored.json()["error"]["message"]
    background = _post(api, API_KEY, {"input": "hello", "background": True})  # its state would be read back
    assert background.status_code == 400 and background.json()["error"]["param"] == "background"
    assert "--responses-store" in background.json()["error"]["message"]


@pytest.mark.slow
def test_a_client_that_leaves_aborts_and_the_deadline_ends_a_stream_with_an_error_event(
        stack: tuple[Any, dict[str, str], Path]) -> None:
    from tests.test_api import API_KEY

    api = stack[0]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", api.url + "/v1/responses", json={"input": "slow story", "stream": True},
                      headers=headers, timeout=10) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if '"response.output_text.delta"' in line and line.startswith("data"))
    assert json.loads(first[6:])["delta"] == "slow0.0 "
    [request_id] = [rid for rid, g in api.tokenizer.requests.items()
                    if g.messages and g.messages[-1].content == "slow story"]
    wait_until(lambda: request_id in api.tokenizer.aborted, 5.0, "an AbortRequest after a stream hang-up")
    # --request-timeout 2: a request that never ends is a 408, and past its first event a stream ends with `error`
    timed_out = api.post("/v1/responses", {"input": "hang plain"})
    assert timed_out.status_code == 408 and timed_out.json()["error"]["code"] == "request_timeout"
    with httpx.stream("POST", api.url + "/v1/responses", json={"input": "hang streamed", "stream": True},
                      headers=headers, timeout=10) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1]["code"] == "request_timeout" and events[-1]["sequence_number"] == 2


# --------------------------------------------------------------------------------------------
# SmolLM2 through the shared server


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    return smollm2_server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client(timeout=120)


def post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return HTTP.post(server.url + "/v1/responses", json={"model": SERVED, **body}, timeout=120)


def stream_events(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    with HTTP.stream("POST", server.url + "/v1/responses", json={"model": SERVED, **body, "stream": True},
                     timeout=120) as response:
        assert response.status_code == 200, response.read()
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    for event in events:
        EVENTS.validate_python(event)
    return events


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.create(model=SERVED, messages=messages, temperature=0, **extra)  # type: ignore


@pytest.mark.slow
def test_an_answer_is_chats_answer_to_the_same_conversation(server: Server, client: openai.OpenAI) -> None:
    """instructions and a multi-turn input render the prompt chat renders for the same messages: the same prompt
    tokens and, greedy, the same text."""
    turns = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
             {"role": "user", "content": "Another one?"}]
    raw = post(server, {"instructions": "You answer in one word.", "max_output_tokens": 8, "temperature": 0,
                        "input": [turns[0], {"type": "message", "role": "assistant", "content": [
                            {"type": "output_text", "text": "Blue.", "annotations": []}]}, turns[2]]})
    assert raw.status_code == 200, raw.text
    response = Response.model_validate(raw.json())  # the SDK's type, strictly
    expected = chat(client, [{"role": "system", "content": "You answer in one word."}, *turns], max_tokens=8)
    assert response.output_text == expected.choices[0].message.content
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == expected.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.status == ("incomplete" if expected.choices[0].finish_reason == "length" else "completed")
    assert response.model == SERVED and response.object == "response" and response.temperature == 0
    plain = client.responses.create(model=SERVED, input="Name a colour.", max_output_tokens=4, temperature=0)
    assert plain.output_text == chat(client, turns[:1], max_tokens=4).choices[0].message.content


@pytest.mark.slow
def test_the_response_echoes_the_reasoning_effort(server: Server) -> None:
    raw = post(server, {"input": "Hi", "max_output_tokens": 1, "reasoning": {"effort": "minimal"}})
    assert raw.status_code == 200, raw.text
    assert Response.model_validate(raw.json()).reasoning.effort == "minimal"
    assert raw.json()["reasoning"] == {"effort": "minimal", "summary": None}


@pytest.mark.slow
def test_a_streamed_answer_joins_to_the_answer(server: Server, client: openai.OpenAI) -> None:
    body = {"input": "Write one short sentence about the sea.", "max_output_tokens": 8, "temperature": 0}
    events = stream_events(server, body)
    final = check_stream(events)
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 8
    whole = client.responses.create(model=SERVED, **body)
    assert whole.output_text == final["output"][0]["content"][0]["text"]
    with client.responses.stream(model=SERVED, input="Say hi.", max_output_tokens=6, temperature=0) as stream:
        events = list(stream)  # the SDK's own stream reader, checking each event against its state
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas and deltas == events[-1].response.output_text


@pytest.mark.slow
def test_json_schema_output_parses(server: Server, client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    response = client.responses.create(model=SERVED, input="A person", max_output_tokens=40, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                        "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "person"
    broken = post(server, {"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                                                        "schema": {"type": "objectx"}}}})
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "text.format"


@pytest.mark.slow
def test_a_tool_round_trip(server: Server, client: openai.OpenAI) -> None:
    """tool_choice required gives a function_call item whose arguments match the parameters; sent back with its
    output, the conversation is chat's with an assistant tool call and a tool message."""
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.responses.create(model=SERVED, input=[question], tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=40, temperature=0)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert first.tool_choice == "required" and first.tools[0].name == "get_weather"
    second = client.responses.create(
        model=SERVED, tools=[WEATHER], max_output_tokens=6, temperature=0,
        input=[question, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    expected = chat(client, [question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "name": call.name, "content": "Sunny, 21 C"}],
        tools=tools, max_tokens=6)
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    assert second.output_text == (expected.choices[0].message.content or "")
    events = stream_events(server, {"input": [question], "tools": [WEATHER], "max_output_tokens": 30,
                                    "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0})
    [streamed] = check_stream(events)["output"]
    jsonschema.validate(json.loads(streamed["arguments"]), WEATHER["parameters"])


@pytest.mark.slow
@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "Hi", "bogus": 1}, "bogus"),
    ({"input": "Hi", "max_output_tokens": 2000}, "max_output_tokens"),  # past the context the prompt leaves
    ({"input": "hello " * 1100}, "input"),  # a prompt past the context
])
def test_refusals_over_http_are_openai_errors(server: Server, body: dict[str, Any], param: str) -> None:
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


# --------------------------------------------------------------------------------------------
# docs/vllm-compat.md's Responses table against the server


def _table() -> list[list[str]]:
    from tests.test_vllm_compat import doc_rows

    return doc_rows("The Responses API")


@pytest.mark.slow
def test_the_responses_table_matches_the_server(server: Server) -> None:
    rows = _table()
    bodies = [{"model": SERVED, "input": "Hi", "max_output_tokens": 1, **json.loads(example)}
              for _, _, example, _ in rows]
    # sent 8 at a time (nothing is stored, the engine batches them): the same requests as one after the other
    responses = send_all([("POST", server.url + "/v1/responses", body) for body in bodies])
    for (field, status, _example, _notes), response in zip(rows, responses, strict=True):
        where = f"{field}: {response.text[:300]}"
        if status in ("supported", "mapped"):
            assert response.status_code == 200, where
        else:
            assert status == "refused" and response.status_code == 400, where
            error = response.json()["error"]
            assert error["param"] == field or error["param"].startswith(f"{field}."), where
            reason = REFUSED_FIELDS.get(field) or UNSUPPORTED_FIELDS.get(field) or NO_OP_VALUES.get(field, ("", ""))[1]
            assert reason in error["message"], where
    assert len(rows) > 40


def test_the_responses_table_covers_every_field() -> None:
    rows = {row[0]: row[1] for row in _table()}
    missing = set(ResponsesBody.__struct_fields__) - set(rows)
    assert not missing, f"Responses fields without a row in docs/vllm-compat.md: {sorted(missing)}"
    assert all(rows[field] == "refused" for field in REFUSED_FIELDS)
