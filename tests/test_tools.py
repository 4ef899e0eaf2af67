"""Tool calling and reasoning: parsers on plain strings, streamed deltas against whole answers, and the server
through the openai client (tool_choice required / named, a tool round trip, streamed tool calls)."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest

from pagoda.services.protocol.chat_output import ChatOutputSpec, ChoiceStream, whole_message
from pagoda.services.protocol.reasoning import ReasoningStream, split_reasoning
from pagoda.services.protocol.tools import (
    default_tool_parser,
    hermes_messages,
    parse_required,
    parse_tool_calls,
    required_schema,
)
from tests.harness import SERVED, Server

# --------------------------------------------------------------------------------------------
# parsers


def test_hermes_parser() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls("hermes", text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {})]
    assert parse_tool_calls("hermes", "no tools here") == ("no tools here", [])
    assert parse_tool_calls("hermes", "<tool_call>{broken") == ("<tool_call>{broken", [])
    _, unclosed = parse_tool_calls("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert [c.name for c in unclosed] == ["f"]


def test_llama3_json_parser() -> None:
    content, calls = parse_tool_calls("llama3_json", '{"name": "f", "parameters": {"a": 1}}; '
                                                     '{"name": "g", "parameters": {"b": "x"}}')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1}),
                                                                                    ("g", {"b": "x"})]
    _, tagged = parse_tool_calls("llama3_json", '<|python_tag|>{"name": "f", "arguments": "{\\"a\\": 2}"}')
    assert json.loads(tagged[0].arguments) == {"a": 2}
    assert parse_tool_calls("llama3_json", "The answer is 4.") == ("The answer is 4.", [])
    assert parse_tool_calls("llama3_json", '{"not": "a call"}')[1] == []


def test_mistral_parser() -> None:
    content, calls = parse_tool_calls("mistral", 'ok [TOOL_CALLS] [{"name": "f", "arguments": {"q": "z"}}]')
    assert content == "ok" and calls[0].name == "f" and json.loads(calls[0].arguments) == {"q": "z"}
    _, newer = parse_tool_calls("mistral", '[TOOL_CALLS]f[ARGS]{"q": 1}[TOOL_CALLS]g[ARGS]{}')
    assert [(c.name, json.loads(c.arguments)) for c in newer] == [("f", {"q": 1}), ("g", {})]


def test_required_output_and_schema() -> None:
    tools = [_tool("f", {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}),
             _tool("g", {})]
    schema = required_schema(tools, parallel=False)
    jsonschema.validate([{"name": "f", "parameters": {"x": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"x": "1"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "g", "parameters": {}}, {"name": "g", "parameters": {}}], schema)
    calls = parse_required('[{"name": "f", "parameters": {"x": 3}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 3})]


@pytest.mark.parametrize(("parameters", "arguments"), [
    ({"type": "string"}, '"{\\"a\\": 1}"'), ({"type": "array"}, "[1, 2]"), ({"type": "integer"}, "7"),
    ({"type": "number"}, "1e400"),  # past a double's range: JSON all the same, as the model wrote it
])
def test_required_calls_of_a_tool_whose_parameters_are_no_object(parameters: dict[str, Any], arguments: str) -> None:
    """A tool whose parameters name another JSON type (vLLM takes them, as a named tool_choice here does: its
    arguments are that value): the grammar held `required`'s "parameters" to it, so the call is that value, as the
    named call's is. The array came back as the message's content, finish_reason stop, no call (a string that held
    JSON was read as the object inside it)."""
    spec = ChatOutputSpec("required")
    text = f'[{{"name": "f", "parameters": {arguments}}}, {{"name": "g", "parameters": {{}}}}]'
    message, calls_tools = whole_message(spec, text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("f", arguments), ("g", "{}")]
    assert message["content"] is None and calls_tools
    assert [(c.name, c.arguments) for c in parse_required(text[:-10])] == [("f", arguments), ("g", "")]
    named, _ = whole_message(ChatOutputSpec("named", tool_name="f"), arguments)
    assert named["tool_calls"][0]["function"]["arguments"] == arguments


def test_default_parser_by_family() -> None:
    assert default_tool_parser(["Meta-Llama-3.1-8B-Instruct"]) == "llama3_json"
    assert default_tool_parser(["Mistral-7B-Instruct-v0.3"]) == "mistral"
    assert default_tool_parser(["Qwen3-0.6B"]) == "hermes"
    assert default_tool_parser(["smollm2-135m-instruct"]) == "hermes"


def test_hermes_prompt_for_templates_without_tools() -> None:
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c": "P"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    out = hermes_messages(messages, [_tool("w", {})])
    assert out[0]["role"] == "system" and '"name": "w"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert "<tool_call>" in out[2]["content"] and '"c": "P"' in out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_reasoning_split_whole_and_streamed(parser: str) -> None:
    text = ("<think>" if parser == "qwen3" else "") + "Hmm, 2+2.\nIt is 4.</think>\n\nThe answer is 4."
    reasoning, content = split_reasoning(parser, text)
    assert reasoning == "Hmm, 2+2.\nIt is 4." and content == "The answer is 4."
    for size in (1, 2, 3, 7):
        stream = ReasoningStream(parser)
        parts = [stream.push(text[i:i + size]) for i in range(0, len(text), size)] + [stream.close()]
        assert "".join(r for r, _ in parts) == reasoning
        assert "".join(c for _, c in parts) == content
    assert split_reasoning("qwen3", "Plain answer.") == (None, "Plain answer.")


def _reassemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """A client's view: content and reasoning concatenated, tool calls merged by index."""
    content, reasoning, calls = "", "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            if "id" in call:
                assert re.fullmatch(r"call_[0-9a-f]{24}|[A-Za-z0-9]{9}", call["id"]) and call["type"] == "function"
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"].get("arguments", "")
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)]}


@pytest.mark.parametrize(("spec", "text"), [
    (ChatOutputSpec("auto", "hermes"), 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>'),
    (ChatOutputSpec("auto", "hermes"), "Just text, a < b."),
    (ChatOutputSpec("auto", "llama3_json"), '{"name": "f", "parameters": {"a": 1}}'),
    (ChatOutputSpec("auto", "mistral"), '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]'),
    (ChatOutputSpec("required"), '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'),
    (ChatOutputSpec("named", tool_name="f"), '{"a": 1, "b": "x"}'),
    (ChatOutputSpec("auto", "hermes", reasoning_parser="qwen3"),
     '<think>I should call f.</think>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'),
])
def test_streamed_deltas_reassemble_into_the_whole_message(spec: ChatOutputSpec, text: str) -> None:
    message, calls_tools = whole_message(spec, text)
    for size in (1, 4, 1000):
        stream = ChoiceStream(spec)
        deltas = [d for i in range(0, len(text), size) for d in stream.push(text[i:i + size])]
        more, streamed_calls = stream.finish()
        got = _reassemble(deltas + more)
        assert streamed_calls == calls_tools
        assert got["content"].strip() == (message["content"] or "").strip()
        assert got["reasoning"] == (message.get("reasoning_content") or "")
        whole_calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                       for c in message.get("tool_calls", [])]
        assert got["calls"] == whole_calls


@pytest.mark.parametrize(("text", "finished"), [
    ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', True),
    (' [{"name": "f", "parameters": {"a": 80E680792574}}]\n', True),  # a number past a double's range is JSON
    ('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "param', False),  # a stop string cut the array
    ('[{"name": "f", "parameters": {"a": [1]', False),  # ends at a `]`, not the array's
    ('[{"name": "f", "parameters": {"a": 1}}', False),
])
def test_a_required_array_cut_short_holds_calls_but_is_no_finished_answer(text: str, finished: bool) -> None:
    """finish_reason "tool_calls" says the answer is its calls; a `required` array a stop string ended before its
    `]` still shows the calls written so far, and the choice keeps finish_reason "stop", as max_tokens keeps
    "length"."""
    spec = ChatOutputSpec("required")
    message, calls_tools = whole_message(spec, text)
    assert message["tool_calls"] and message["tool_calls"][0]["function"]["name"] == "f"
    assert calls_tools is finished
    stream = ChoiceStream(spec)
    deltas = stream.push(text)
    more, streamed_calls = stream.finish()
    assert streamed_calls is finished
    assert _reassemble(deltas + more)["calls"][0]["name"] == "f"


@pytest.mark.parametrize(("spec", "text", "finished"), [
    (ChatOutputSpec("named", tool_name="f"), '{"a": 1, "b": "x"}', True),
    (ChatOutputSpec("named", tool_name="f"), ' {"a": 80E680792574}\n', True),  # a number past a double's range
    (ChatOutputSpec("named", tool_name="f"), '{"city"', False),  # stop: [":"] cut the arguments
    (ChatOutputSpec("named", tool_name="f"), '{"a": {"b": 1}', False),  # ends at a `}`, not the object's
    (ChatOutputSpec("named", tool_name="f"), "", False),  # a stop string before the first token
    (ChatOutputSpec("named", tool_name="f"), '"a string"', True),  # a tool whose parameters are {"type": "string"}
    (ChatOutputSpec("named", tool_name="f"), '"a str', False),
    # the reasoning never closed (EOS or a stop string inside the think block): no arguments were written
    (ChatOutputSpec("named", tool_name="f", reasoning_parser="deepseek_r1"), "all of it is reasoning", False),
    (ChatOutputSpec("named", tool_name="f", reasoning_parser="qwen3"), '<think>a</think>\n{"a": 1}', True),
])
def test_a_named_call_cut_short_is_no_finished_answer(spec: ChatOutputSpec, text: str, finished: bool) -> None:
    """As for `required`: arguments that a stop string ended before their object closed (or before they began)
    are still the message's call, but the choice keeps finish_reason "stop" (it said "tool_calls", and an agent
    loop ran json.loads on `{"city"`); Messages' stop_reason is then stop_sequence, not tool_use."""
    message, calls_tools = whole_message(spec, text)
    assert message["tool_calls"][0]["function"]["name"] == "f"
    assert calls_tools is finished
    stream = ChoiceStream(spec)
    deltas = [d for ch in text for d in stream.push(ch)]
    more, streamed_calls = stream.finish()
    assert streamed_calls is finished
    assert _reassemble(deltas + more)["calls"][0]["name"] == "f"


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                             "parameters": parameters}}


# --------------------------------------------------------------------------------------------
# the whole server

# Bounded by construction: strings of at most 16 ASCII letters (at most 16 tokens), so a call is at most ~70
# bytes of JSON and every constrained answer ends inside max_tokens=120. tool_choice "required" sends
# parallel_tool_calls=False where the test needs the answer to end: an array of calls has no other bound.
NAME = {"type": "string", "pattern": "^[A-Za-z /_]{1,16}$"}
WEATHER = _tool("get_weather", {"type": "object", "properties": {
    "city": NAME, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False})
TIME = _tool("get_time", {"type": "object", "properties": {"timezone": NAME},
                          "required": ["timezone"], "additionalProperties": False})
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    return smollm2_server  # conftest's one default SmolLM2 server, shared with tests/test_server.py


def _check_calls(calls: list[Any], allowed: dict[str, dict[str, Any]]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        schema = allowed[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.slow
def test_tool_choice_required_and_named_give_valid_calls(server: Server) -> None:
    client = server.client(timeout=600)
    tools = {"get_weather": WEATHER, "get_time": TIME}
    required = client.chat.completions.create(model=SERVED, messages=ASK, tools=[WEATHER, TIME],
                                              tool_choice="required", parallel_tool_calls=False, max_tokens=120)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls or [], tools)
    named = client.chat.completions.create(model=SERVED, messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = named.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_time"]
    _check_calls(calls, tools)


@pytest.mark.slow
def test_round_trip_with_a_tool_message(server: Server) -> None:
    client = server.client(timeout=600)
    first = client.chat.completions.create(model=SERVED, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120)
    call = (first.choices[0].message.tool_calls or [])[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                          "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    answer = client.chat.completions.create(model=SERVED, messages=messages, tools=[WEATHER], max_tokens=40,
                                            temperature=0.0, extra_body={"min_tokens": 1})
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage is not None and first.usage is not None and answer.usage.completion_tokens >= 1
    # the call and the tool's result were rendered into the prompt (what the model says about them is its own)
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_reassemble_into_the_answer(server: Server, tool_choice: Any) -> None:
    client = server.client(timeout=600)
    kwargs = {"model": SERVED, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": tool_choice,
              "parallel_tool_calls": False, "max_tokens": 120, "temperature": 0.0}
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    with client.chat.completions.create(stream=True, **kwargs) as stream:
        for chunk in stream:
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                    if call.function and call.function.name:
                        entry["name"] = call.function.name
                    entry["arguments"] += (call.function.arguments or "") if call.function else ""
                finish = choice.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                 for c in whole.message.tool_calls or []]


@pytest.mark.slow
def test_tool_requests_that_are_refused(server: Server) -> None:
    import httpx
    for extra, param in [({"tool_choice": "required"}, "tool_choice"),
                         ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                          "tool_choice"),
                         ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
                         ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice")]:
        body = {"model": SERVED, "messages": ASK, "max_tokens": 5, **extra}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.slow
def test_tool_choice_none_keeps_the_tools_in_the_prompt(server: Server) -> None:
    """tool_choice "none" offers the tools to the model without letting it call them: they stay in the prompt, as
    vLLM's default and OpenAI's (the prompt left them out, so /tokenize with the same tools counted more tokens
    than the answer's usage, and a tool loop's none step missed its cached prefix). Nothing is parsed as a call."""
    client = server.client(timeout=600)
    none = client.chat.completions.create(model=SERVED, messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=1)
    bare = client.chat.completions.create(model=SERVED, messages=ASK, max_tokens=1)
    counted = httpx.post(f"{server.url}/tokenize", json={"model": SERVED, "messages": ASK, "tools": [WEATHER]},
                         timeout=600).json()
    assert none.usage.prompt_tokens == counted["count"] > bare.usage.prompt_tokens
    assert not none.choices[0].message.tool_calls
