"""Tool-call parsers for the MoE / DeepSeek models people serve (vLLM's deepseek_v3, deepseek_v31 and qwen3_coder),
on the parsers and builders alone (no server): what the models write, whole and cut at every character, on chat,
Messages and Responses; Qwen3-Coder's arguments typed by the tools' schemas; DeepSeek's tool prompt; the names."""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import pytest

from pagoda.services.protocol.chat_output import ChatOutputSpec, ChoiceStream, whole_message
from pagoda.services.protocol.render import CHAT
from pagoda.services.protocol.schemas import ChatBody, chat_output_spec, decode_body
from pagoda.services.protocol.tools import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    deepseek_call_form,
    default_tool_parser,
    keeps_special_tokens,
    parse_required,
    parse_tool_calls,
    tool_conversation,
    tool_start_marker,
)
from pagoda.shared.config import ServerConfig, add_server_args, server_config_from_args
from pagoda.shared.errors import ConfigError
from pagoda.shared.messages import FinishReason, GenerateRequest, RenderSpec, SamplingParams
from tests.test_protocol_shapes_qa import responses_stream
from tests.test_render import steps_of, tokenizer_side
from tests.test_tool_parsers_qa import ARGS, FRAGMENTS, _blocks, _client_view

MODEL_PARSERS = ("deepseek_v3", "deepseek_v31", "qwen3_coder")


def test_the_markers_are_deepseeks_characters() -> None:
    """Full-width vertical bars (U+FF5C) and the SentencePiece space U+2581, as DeepSeek-V3's tokenizer and chat
    template spell them; ASCII lookalikes are another text."""
    assert DS_CALLS_BEGIN == "<\uff5ctool\u2581calls\u2581begin\uff5c>"
    for marker in (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP):
        assert marker[1] == marker[-2] == "\uff5c" and "|" not in marker and "_" not in marker
    ascii_text = '<|tool_calls_begin|><|tool_call_begin|>f<|tool_sep|>{}<|tool_call_end|><|tool_calls_end|>'
    assert parse_tool_calls("deepseek_v31", ascii_text) == (ascii_text, [])


# --------------------------------------------------------------------------------------------
# what the models write


def v3_call(name: str, arguments: Any) -> str:
    """One call as DeepSeek-V3's chat template writes it (V3, V3-0324, R1, R1-0528)."""
    return (f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{json.dumps(arguments, ensure_ascii=False)}\n```"
            f"{DS_CALL_END}")


def v31_call(name: str, arguments: Any) -> str:
    """One call as DeepSeek-V3.1's chat template writes it (V3.1, V3.1-Terminus, V3.2-Exp)."""
    return f"{DS_CALL_BEGIN}{name}{DS_SEP}{json.dumps(arguments, ensure_ascii=False)}{DS_CALL_END}"


def qwen_call(name: str, arguments: dict[str, Any]) -> str:
    """One call as Qwen3-Coder's chat template writes it: strings as they are, anything else as JSON."""
    params = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}"
                     "\n</parameter>\n" for key, value in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


NESTED = {"filter": {"and": [{"field": "a", "op": "=", "value": [1, 2.5, None, True]}, {"not": {"x": {}}}]}}
CODE = 'print("```json\\n{}")  # <｜tool▁call▁end｜> <｜tool▁calls▁end｜> </function>\n'
V3_ALL = "\n".join([v3_call("get_weather", {"city": "Paris"}), v3_call("a", ARGS), v3_call("n", NESTED)])
V31_ALL = "".join([v31_call("get_weather", {"city": "Paris"}), v31_call("a", ARGS), v31_call("n", NESTED)])
QWEN_TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    "a": {"type": "object", "properties": {"q": {"type": "string"}, "u": {"type": "string"}, "n": {"type": "object"}}},
    "write_file": {"type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}},
    "search": {"type": "object", "properties": {"filter": {"type": "object"}, "limit": {"type": "integer"},
                                                "exact": {"type": "boolean"}, "score": {"type": "number"}}},
}
QWEN_ALL = "\n".join([qwen_call("get_weather", {"city": "Paris", "days": 3}), qwen_call("a", ARGS),
                      qwen_call("search", {"filter": NESTED["filter"], "limit": 10, "exact": False, "score": 0.5})])

# (parser, what the model writes, content, [(name, arguments)])
REAL: list[tuple[str, str, str | None, list[tuple[str, Any]]]] = [
    ("deepseek_v3", f"{DS_CALLS_BEGIN}{v3_call('get_weather', {'city': 'Paris'})}{DS_CALLS_END}", None,
     [("get_weather", {"city": "Paris"})]),
    ("deepseek_v3", f"Let me look.\n\n{DS_CALLS_BEGIN}{V3_ALL}{DS_CALLS_END}", "Let me look.",
     [("get_weather", {"city": "Paris"}), ("a", ARGS), ("n", NESTED)]),
    ("deepseek_v3", f"{DS_CALLS_BEGIN}{v3_call('write', {'code': CODE})}{DS_CALLS_END}", None,
     [("write", {"code": CODE})]),  # arguments read as JSON: a fence or an end marker inside them is text
    ("deepseek_v3", f"{DS_CALLS_BEGIN}{v3_call('f', {})}", None, [("f", {})]),  # cut before the end marker
    ("deepseek_v3", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}f\n```json\n{{\"x\": 1}}", None,
     [("f", {"x": 1})]),  # cut after the arguments, before the fence closes
    ("deepseek_v31", f"{DS_CALLS_BEGIN}{v31_call('get_weather', {'city': 'Paris'})}{DS_CALLS_END}", None,
     [("get_weather", {"city": "Paris"})]),
    ("deepseek_v31", f"Checking both.{DS_CALLS_BEGIN}{V31_ALL}{DS_CALLS_END}", "Checking both.",
     [("get_weather", {"city": "Paris"}), ("a", ARGS), ("n", NESTED)]),
    ("deepseek_v31", f"{DS_CALLS_BEGIN}{v31_call('write', {'code': CODE})}{DS_CALLS_END}", None,
     [("write", {"code": CODE})]),
    # each parser reads the other version's form (a V3.1 served under a name without its version)
    ("deepseek_v3", f"{DS_CALLS_BEGIN}{v31_call('f', {'x': 1})}{DS_CALLS_END}", None, [("f", {"x": 1})]),
    ("deepseek_v31", f"{DS_CALLS_BEGIN}{v3_call('f', {'x': 1})}{DS_CALLS_END}", None, [("f", {"x": 1})]),
    ("qwen3_coder", qwen_call("get_weather", {"city": "Paris", "days": 3}), None,
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("qwen3_coder", "I'll search.\n\n" + QWEN_ALL, "I'll search.",
     [("get_weather", {"city": "Paris", "days": 3}), ("a", ARGS),
      ("search", {"filter": NESTED["filter"], "limit": 10, "exact": False, "score": 0.5})]),
    ("qwen3_coder", qwen_call("write_file", {"path": "a.py", "text": CODE + "\n\nline after blank\n"}), None,
     [("write_file", {"path": "a.py", "text": CODE + "\n\nline after blank\n"})]),  # one newline trimmed each side
    ("qwen3_coder", qwen_call("write_file", {"path": "x", "text": "</function></tool_call><parameter=y>"}), None,
     [("write_file", {"path": "x", "text": "</function></tool_call><parameter=y>"})]),  # a value ends at its tag
    ("qwen3_coder", qwen_call("get_weather", {"city": "Oslo"})[:-len("\n</tool_call>")], None,
     [("get_weather", {"city": "Oslo"})]),  # the last </tool_call> left open
    ("qwen3_coder", "<tool_call>\n<function=now>\n</function>\n</tool_call>", None, [("now", {})]),
]

# texts that hold a marker but no call that parses: all content, as for the other parsers
MALFORMED: list[tuple[str, str]] = [
    ("deepseek_v3", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_wea"),  # cut in the name
    ("deepseek_v3", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}f\n```json\n{{\"x\": "),  # cut in the JSON
    ("deepseek_v3", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}f\n{{\"x\": 1}}{DS_CALL_END}"),  # no fence
    ("deepseek_v3", f"{DS_CALLS_BEGIN}{v3_call('f', {})} and then {v3_call('g', {})}{DS_CALLS_END}"),
    ("deepseek_v3", f"{DS_CALLS_BEGIN}{DS_CALLS_END}"),  # no call
    ("deepseek_v3", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}f\n```json\n[1, 2]\n```{DS_CALL_END}"),
    ("deepseek_v31", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}f{DS_SEP}{{'x': 1}}{DS_CALL_END}"),  # not JSON
    ("deepseek_v31", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}f{DS_SEP}{{\"a\": NaN}}{DS_CALL_END}"),  # nor NaN, Infinity
    ("deepseek_v3", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}f\n```json\n{{\"a\": [-Infinity]}}\n```"),
    ("deepseek_v31", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}f{DS_SEP}{{\"a\": 1e400}}{DS_CALL_END}"),  # inf as a double
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": Infinity}}]'),
    ("llama3_json", '{"name": "f", "parameters": {"a": NaN}}'),
    ("deepseek_v31", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}{DS_SEP}{{}}{DS_CALL_END}"),  # no name
    ("deepseek_v31", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}f{DS_SEP}{{}} trailing{DS_CALL_END}"),
    ("deepseek_v31", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}f{{}}{DS_CALL_END}"),  # no separator
    ("deepseek_v31", f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}f{{}}{DS_CALL_END}{v31_call('g', {})}"),  # nor in this call
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=x>\n1\n"),  # cut in a value
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n"),  # cut before </function>
    ("qwen3_coder", "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"),  # Hermes JSON
    ("qwen3_coder", "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=>\n</function>\n</tool_call>"),  # no name
    ("qwen3_coder", "<tool_call>\n<function=f</function>\n</tool_call>"),  # no name's end
    ("qwen3_coder", "<tool_call>\n<function=f>\n</function> and more\n</tool_call>"),
]


def _calls_of(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]


def _spec(parser: str) -> ChatOutputSpec:
    return ChatOutputSpec("auto", parser, tool_parameters=QWEN_TOOLS if parser == "qwen3_coder" else {})


def _streamed(spec: ChatOutputSpec, pieces: list[str]) -> tuple[tuple[str, str, list[tuple[str, str]]], bool]:
    stream = ChoiceStream(spec)
    deltas = [d for piece in pieces for d in stream.push(piece)]
    more, calls_tools = stream.finish()
    return _client_view(deltas + more), calls_tools


@pytest.mark.parametrize(("parser", "text", "content", "calls"), REAL)
def test_what_the_models_write_parses(parser: str, text: str, content: str | None,
                                      calls: list[tuple[str, Any]]) -> None:
    message, calls_tools = whole_message(_spec(parser), text)
    assert message["content"] == content and calls_tools
    assert _calls_of(message) == calls
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_a_call_that_does_not_parse_is_content(parser: str, text: str) -> None:
    assert whole_message(_spec(parser), text) == ({"role": "assistant", "content": text}, False)
    (content, _, calls), calls_tools = _streamed(_spec(parser), list(text))
    assert (content, calls, calls_tools) == (text, [], False)


@pytest.mark.parametrize(("parser", "text"), [(p, t) for p, t, _, _ in REAL] + MALFORMED)
def test_cut_at_every_character_streams_to_the_whole_answer(parser: str, text: str) -> None:
    """One character a push, and every cut into two pieces: the joined deltas are the whole message (content sent
    before the calls, the calls at the end, a text whose call never parses all content)."""
    spec = _spec(parser)
    message, calls_tools = whole_message(spec, text)
    want = ((message["content"] or ""), "", [(c["function"]["name"], c["function"]["arguments"])
                                             for c in message.get("tool_calls", [])])
    for pieces in [list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]:
        assert _streamed(spec, pieces) == (want, calls_tools), pieces


def test_content_before_the_calls_is_sent_as_it_comes() -> None:
    """What precedes the start marker streams as content before the answer ends; only text that may begin a call is
    held (a prefix of the marker at the end of what came)."""
    for parser in MODEL_PARSERS:
        marker = tool_start_marker(parser)
        stream = ChoiceStream(_spec(parser))
        assert stream.push("Checking the weather") == [{"content": "Checking the weather"}]
        assert stream.push(" now. " + marker[:3]) == [{"content": " now."}]
        assert stream.push(marker[3:]) == []


MODEL_FRAGMENTS = [DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP, "function", "\n```json\n",
                   "\n```", "<｜tool", "▁", "<function=f>", "<function=", "</function>", "<parameter=x>",
                   "<parameter=limit>", "</parameter>", "<parameter", "</para", '{"x": 1}', "3", "true", "f"]


@pytest.mark.parametrize("seed", range(3))
def test_any_text_cut_anywhere_streams_to_the_whole_answer(seed: int) -> None:
    """Seeded random texts of these parsers' markers beside the other parsers' pieces, cut at random, under every
    mode and reasoning parser: no exception, and the joined deltas are the whole message."""
    rng = random.Random(seed)
    fragments = MODEL_FRAGMENTS * 3 + FRAGMENTS
    tools = {"f": {"type": "object", "properties": {"x": {"type": "integer"}, "limit": {"type": "integer"}}}}
    for _ in range(400):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 24)))
        spec = ChatOutputSpec(rng.choice(["auto", "auto", "required", "none"]), rng.choice(MODEL_PARSERS), "",
                              rng.choice([None, "qwen3", "deepseek_r1"]), rng.choice([0, 1]),
                              tool_parameters=rng.choice([{}, tools]))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        message, calls_tools = whole_message(spec, text)
        (content, reasoning, calls), streamed_calls = _streamed(spec, pieces)
        assert streamed_calls == calls_tools, (spec, pieces)
        assert content == (message["content"] or ""), (spec, pieces)
        assert reasoning == (message.get("reasoning") or ""), (spec, pieces)
        assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]


def test_r1_thinks_then_calls() -> None:
    """DeepSeek-R1-0528 under --reasoning-parser deepseek_r1: the think block is reasoning, the calls after it calls."""
    text = f"The user wants weather.</think>\n\nOne moment.{DS_CALLS_BEGIN}{v3_call('w', {'c': 'P'})}{DS_CALLS_END}"
    spec = ChatOutputSpec("auto", "deepseek_v3", reasoning_parser="deepseek_r1")
    message, _ = whole_message(spec, text)
    assert (message["reasoning"], message["content"], _calls_of(message)) == (
        "The user wants weather.", "One moment.", [("w", {"c": "P"})])
    assert _streamed(spec, list(text))[0][:2] == ("One moment.", "The user wants weather.")


# --------------------------------------------------------------------------------------------
# Qwen3-Coder's arguments, typed by the tool's parameter schema


def _typed(schema: dict[str, Any] | None, value: str, tool: str = "f") -> Any:
    tools = {} if schema is None else {"f": {"type": "object", "properties": {"v": schema}, "$defs": {
        "Point": {"type": "object", "properties": {"x": {"type": "number"}}},
        "Loop": {"anyOf": [{"$ref": "#/$defs/Loop"}, {"$ref": "#/$defs/Loop"}]}}}}
    _, calls = parse_tool_calls("qwen3_coder", qwen_call(tool, {"v": value}), tools)
    return json.loads(calls[0].arguments)["v"]


TYPED = [
    ({"type": "string"}, "42", "42"),
    ({"type": "string"}, '{"a": 1}', '{"a": 1}'),  # JSON-looking text of a string parameter stays text
    ({"type": "string"}, "null", "null"),
    ({"type": "string", "enum": ["true", "false"]}, "true", "true"),
    ({"type": "integer"}, "42", 42),
    ({"type": "integer"}, " -7 ", -7),
    ({"type": "integer"}, "3.0", 3),
    ({"type": "integer"}, "3.5", "3.5"),  # not an integer: the text, for the tool to judge
    ({"type": "integer"}, "a few", "a few"),
    ({"type": "integer"}, "null", None),  # how the template writes a None argument
    ({"type": "integer"}, "1" + "0" * 400, 10 ** 400),  # past a double's range: still the integer (no float())
    ({"type": "number"}, "-1" + "0" * 400, -10 ** 400),
    ({"type": "integer"}, "1" + "0" * 5000, "1" + "0" * 5000),  # past Python's int digit limit: the text
    ({"type": "object"}, '{"x": 1' + "0" * 5000 + "}", '{"x": 1' + "0" * 5000 + "}"),
    ({"type": "array"}, "[" * 5000 + "]" * 5000, "[" * 5000 + "]" * 5000),  # past the recursion limit: the text
    ({"anyOf": {"type": "integer"}}, "5", "5"),  # anyOf not a list: no type named
    ({"anyOf": [{"type": "integer"}], "oneOf": ({"type": "string"},)}, "5", 5),
    ({"type": "number"}, "2.5", 2.5),
    ({"type": "number"}, "1e3", 1000.0),
    ({"type": "number"}, "NaN", "NaN"),  # not JSON
    ({"type": "number"}, "-Infinity", "-Infinity"),
    ({"type": "number"}, "1e400", "1e400"),  # past a double's range: no JSON number, so the text
    ({"type": "array"}, "[NaN, 1]", "[NaN, 1]"),  # arguments are strict JSON: the text holding NaN stays text
    ({}, '{"x": Infinity}', '{"x": Infinity}'),
    ({"type": "boolean"}, "true", True),
    ({"type": "boolean"}, "False", False),
    ({"type": "boolean"}, "yes", "yes"),
    ({"type": "object"}, '{"a": [1, {"b": null}], "s": "x\\"y"}', {"a": [1, {"b": None}], "s": 'x"y'}),
    ({"type": "object"}, "{'a': 1}", "{'a': 1}"),  # Python, not JSON: the text
    ({"type": "object"}, "[1]", "[1]"),  # an array is no object
    ({"type": "array"}, '["a", 2]', ["a", 2]),
    ({"type": "array", "items": {"type": "integer"}}, "[1, 2, 3]", [1, 2, 3]),
    ({"type": "null"}, "null", None),
    ({"type": ["integer", "null"]}, "null", None),
    ({"type": ["integer", "null"]}, "5", 5),
    ({"type": ["string", "null"]}, "null", None),  # null allowed: null (as vLLM's), though a string could be "null"
    ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "null", None),
    ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "None", "None"),  # a string allowed: None may be the word
    ({"type": "integer"}, "None", None),  # Qwen3-Coder's template writes a None argument as None (none|string)
    ({"anyOf": [{"type": "object"}, {"type": "null"}]}, "None", None),
    ({"type": "boolean"}, " None\n", None),
    ({"enum": [None, "a"]}, "null", None),
    ({"type": ["string", "integer"]}, "5", 5),  # strings last: any text is one
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "12", 12),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "twelve", "twelve"),
    ({"anyOf": [{"type": "object"}, {"type": "null"}]}, "null", None),
    ({"anyOf": [{"type": "object"}, {"type": "null"}]}, '{"k": 1}', {"k": 1}),
    ({"oneOf": [{"type": "boolean"}, {"type": "array"}]}, "[true]", [True]),
    ({"$ref": "#/$defs/Point"}, '{"x": 1.5}', {"x": 1.5}),  # a pydantic model's field: its $ref followed
    ({"$ref": "#/$defs/Missing"}, '{"x": 1}', {"x": 1}),  # no type known: JSON object or array, else text
    ({"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}]}, '{"x": 2}', {"x": 2}),  # pydantic's Optional[Point]
    ({"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}]}, "null", None),
    ({"oneOf": [{"$ref": "#/$defs/Point"}, {"type": "integer"}]}, "3", 3),
    ({"allOf": [{"$ref": "#/$defs/Point"}]}, '{"x": 1}', {"x": 1}),
    ({"$ref": "#/$defs/Loop"}, "5", "5"),  # a cycle of $refs (doubling at each step): read 64 schemas, no type
    ({"$ref": "#/$defs/Loop"}, "[5]", [5]),
    ({"enum": [1, 2, 3]}, "2", 2),  # an enum or const without a type: its values' JSON types
    ({"enum": [1, 2, 3]}, "two", "two"),
    ({"const": True}, "true", True),
    ({"enum": [0.5, "auto"]}, "0.5", 0.5),
    ({"enum": [0.5, "auto"]}, "auto", "auto"),
    ({"enum": ["1", 2]}, "1", "1"),  # the text is one of its strings: that string
    ({"enum": ["1", 2]}, "2", 2),
    ({"const": {"k": 1}}, '{"k": 1}', {"k": 1}),
    ({}, '[1, 2]', [1, 2]),
    ({}, "42", "42"),
    ({"description": "anything"}, "plain words", "plain words"),
    (None, "42", "42"),  # no schema for the tool: text
]


@pytest.mark.parametrize(("schema", "value", "want"), TYPED)
def test_qwen3_coder_types_arguments_by_the_schema(schema: dict[str, Any] | None, value: str, want: Any) -> None:
    got = _typed(schema, value)
    assert got == want and type(got) is type(want)


# pydantic's model_json_schema() of: sub: Sub | None = None; subs: list[Sub] | None = None; level: Literal[1, 2, 3];
# mode: Literal["fast", "slow"] = "fast"; on: Literal[True] = True; note: str | None = None (Sub: x: int)
PYDANTIC_ARGS = json.loads(
    '{"$defs": {"Sub": {"properties": {"x": {"title": "X", "type": "integer"}}, "required": ["x"], "title": "Sub", '
    '"type": "object"}}, "properties": {"sub": {"anyOf": [{"$ref": "#/$defs/Sub"}, {"type": "null"}], "default": '
    'null}, "subs": {"anyOf": [{"items": {"$ref": "#/$defs/Sub"}, "type": "array"}, {"type": "null"}], "default": '
    'null, "title": "Subs"}, "level": {"enum": [1, 2, 3], "title": "Level", "type": "integer"}, "mode": {"default": '
    '"fast", "enum": ["fast", "slow"], "title": "Mode", "type": "string"}, "on": {"const": true, "default": true, '
    '"title": "On", "type": "boolean"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": null, '
    '"title": "Note"}}, "required": ["level"], "title": "Args", "type": "object"}')


@pytest.mark.parametrize("parser", ["qwen3_coder", "glm45"])
def test_pydantic_models_arguments_are_typed(parser: str) -> None:
    """A tool whose parameters are a pydantic model's schema: Optional[Sub] (a $ref inside anyOf) is the object, a
    list of them the list, Literal values their JSON types. GLM's template writes non-strings as JSON too."""
    written = {"sub": '{"x": 1}', "subs": '[{"x": 2}]', "level": "2", "mode": "slow", "on": "true", "note": "hi"}
    text = (qwen_call("f", written) if parser == "qwen3_coder" else "<tool_call>f\n" + "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in written.items()) + "</tool_call>")
    _, calls = parse_tool_calls(parser, text, {"f": PYDANTIC_ARGS})
    assert json.loads(calls[0].arguments) == {"sub": {"x": 1}, "subs": [{"x": 2}], "level": 2, "mode": "slow",
                                              "on": True, "note": "hi"}


def test_qwen3_coder_parameter_the_schema_lacks_is_text() -> None:
    """A parameter the function does not declare, or a function that was not offered: the text as written."""
    tools = {"f": {"type": "object", "properties": {"n": {"type": "integer"}}}}
    _, calls = parse_tool_calls("qwen3_coder", qwen_call("f", {"n": "1", "extra": "2"}) + qwen_call("g", {"n": "3"}),
                                tools)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"n": 1, "extra": "2"}), ("g", {"n": "3"})]
    _, untyped = parse_tool_calls("qwen3_coder", qwen_call("f", {"n": "1"}))  # no schemas given at all
    assert json.loads(untyped[0].arguments) == {"n": "1"}


def test_qwen3_coder_schemas_come_with_the_request() -> None:
    """The api puts the offered functions' schemas in the output spec for qwen3_coder's auto requests only, and the
    spec crosses to the tokenizer in the RenderSpec (msgspec, as on the wire): the rendered call is typed there."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": QWEN_TOOLS["search"]}},
             {"type": "function", "function": {"name": "g"}}]

    def spec_for(parser: str, choice: Any = "auto") -> ChatOutputSpec:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": choice}
        return chat_output_spec(decode_body(msgspec.json.encode(body), ChatBody), parser, None)

    assert spec_for("qwen3_coder").tool_parameters == {"f": QWEN_TOOLS["search"], "g": {}}
    assert spec_for("hermes").tool_parameters == {} and spec_for("deepseek_v3").tool_parameters == {}
    assert spec_for("qwen3_coder", "required").tool_parameters == {}

    output = spec_for("qwen3_coder")
    render = RenderSpec(CHAT, "chatcmpl-1", "m", 1, False, tool_mode=output.tool_mode, tool_parser=output.tool_parser,
                        tool_parameters=output.tool_parameters)
    request = GenerateRequest("r0", SamplingParams(), messages=[], render=render)
    render = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=GenerateRequest).render
    assert render is not None and render.tool_parameters == output.tool_parameters
    text = qwen_call("f", {"limit": 5, "exact": True, "filter": {"a": 1}})
    steps = steps_of(["r0"], 1, [text[:20], text[20:]], False, False, False, [FinishReason.STOP])
    _, choices = tokenizer_side(render, 1, [""], [[1, 2]], steps)
    message = msgspec.json.decode(choices[0])["message"]
    assert _calls_of(message) == [("f", {"limit": 5, "exact": True, "filter": {"a": 1}})]


# --------------------------------------------------------------------------------------------
# the Messages and Responses APIs read the same calls


@pytest.mark.parametrize("parser", MODEL_PARSERS)
def test_messages_and_responses_get_the_calls(parser: str) -> None:
    """tool_use blocks (Messages) and function_call items (Responses) for each parser, after the text before them."""
    text = "Checking.\n" + {"deepseek_v3": f"{DS_CALLS_BEGIN}{V3_ALL}{DS_CALLS_END}",
                            "deepseek_v31": f"{DS_CALLS_BEGIN}{V31_ALL}{DS_CALLS_END}",
                            "qwen3_coder": QWEN_ALL}[parser]
    spec = _spec(parser)
    want = _calls_of(whole_message(spec, text)[0])
    assert len(want) == 3
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    blocks = _blocks(spec, pieces)
    assert blocks[0] == {"type": "text", "text": "Checking."}
    assert [(b["type"], b["name"], b["input"]) for b in blocks[1:]] == [("tool_use", n, a) for n, a in want]
    assert all(b["id"].startswith("toolu_") for b in blocks[1:])
    events = responses_stream(pieces, spec, logprobs=False)
    output = events[-1]["response"]["output"]
    assert output[0]["type"] == "message" and output[0]["content"][0]["text"] == "Checking."
    assert [(o["type"], o["name"], json.loads(o["arguments"])) for o in output[1:]] == [
        ("function_call", n, a) for n, a in want]


# --------------------------------------------------------------------------------------------
# the prompt: DeepSeek's templates take no tool list

# DeepSeek-V3's and V3.1's templates as they write an assistant's calls (the rest of each is beside the point here)
V3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['tool_calls'] %}{% for tool in m['tool_calls'] %}"
               "{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + "
               "'```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
               "{% endfor %}{% endif %}{% endfor %}")
V31_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['tool_calls'] %}{% for tool in m['tool_calls'] %}"
                "{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + "
                "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}{% endfor %}{% endif %}{% endfor %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {
                                               "type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]


def test_deepseek_templates_get_deepseeks_tool_prompt() -> None:
    """The tool list joins the system prompt as DeepSeek-V3.1's model card writes it ("## Tools", a section per
    tool), asking for the call form the template itself writes; the tool turns stay the template's to write."""
    assert (deepseek_call_form(V3_TEMPLATE), deepseek_call_form(V31_TEMPLATE)) == ("deepseek_v3", "deepseek_v31")
    assert deepseek_call_form("{{ messages }} tool_calls") is None and deepseek_call_form(None) is None
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}]},
             {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    for template, call in ((V3_TEMPLATE, f"{DS_CALL_BEGIN}function{DS_SEP}tool_call_name\n```json\n"),
                           (V31_TEMPLATE, f"{DS_CALL_BEGIN}tool_call_name{DS_SEP}tool_call_arguments{DS_CALL_END}")):
        messages, tools = tool_conversation(template, turns, TOOLS)
        assert tools is None and messages[1:] == turns[1:]
        system = messages[0]["content"]
        assert system.startswith("Be brief.\n\n## Tools\nYou have access to the following tools:\n\n")
        assert "### get_weather\nDescription: Weather of a city\n\nParameters: " + json.dumps(
            TOOLS[0]["function"]["parameters"]) + "\n" in system
        assert "### now\nDescription: \n\nParameters: {}\n" in system
        assert f"IMPORTANT: ALWAYS adhere to this exact format for tool use:\n{DS_CALLS_BEGIN}{call}" in system
        assert "<tool_call>" not in system and "<tools>" not in system
        alone, _ = tool_conversation(template, turns[1:2], TOOLS)
        assert alone[0]["role"] == "system" and alone[0]["content"].startswith("## Tools\n")
        assert tool_conversation(template, turns[1:], None) == (turns[1:], None)  # tool turns, no list
    # any other template that writes calls but takes no list keeps the Hermes prompt
    other, _ = tool_conversation("{{ m.tool_calls }}", turns, TOOLS)
    assert "<tools>" in other[0]["content"]


# --------------------------------------------------------------------------------------------
# names, special tokens and the flag


@pytest.mark.parametrize(("name", "parser"), [
    ("deepseek-ai/DeepSeek-V3", "deepseek_v3"),
    ("deepseek-ai/DeepSeek-V3-0324", "deepseek_v3"),
    ("deepseek-ai/DeepSeek-R1", "deepseek_v3"),
    ("deepseek-ai/DeepSeek-R1-0528", "deepseek_v3"),
    ("deepseek-ai/DeepSeek-V2-Lite-Chat", "hermes"),  # no tool format: its template writes no calls
    ("deepseek-ai/DeepSeek-V2-Chat", "hermes"),
    ("deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct", "hermes"),
    ("deepseek-ai/DeepSeek-V2.5", "deepseek_v3"),  # V2.5's template writes V3's calls
    ("DeepSeek-R1-Distill-Llama-70B", "deepseek_v3"),  # R1's template on a Llama 3.3: DeepSeek's calls
    ("deepseek-ai/DeepSeek-V3.1", "deepseek_v31"),
    ("deepseek-ai/DeepSeek-V3.1-Terminus", "deepseek_v31"),
    ("deepseek-ai/DeepSeek-V3.2-Exp", "deepseek_v31"),
    ("deepseek-ai/DeepSeek-V3.2-Exp-Base", "deepseek_v31"),
    ("deepseek-ai/DeepSeek-V3.2", "hermes"),  # DSML calls, which no parser here reads: what unknown names get
    ("deepseek-ai/DeepSeek-V3.2-Speciale", "hermes"),
    ("models/deepseek_v3_2", "hermes"),
    ("tngtech/DeepSeek-R1T-Chimera", "deepseek_v3"),  # R1 and V3 merged: R1's template
    ("deepseek-ai/DeepSeek-V3-Base", "deepseek_v3"),
    ("unsloth/DeepSeek-V3.1-GGUF", "deepseek_v31"),
    ("deepseek-ai/deepseek-llm-7b-chat", "hermes"),
    ("deepseek-ai/deepseek-vl2", "hermes"),
    ("deepseek-ai/DeepSeek-Prover-V2-671B", "hermes"),
    ("huggyllama/llama-30b", "hermes"),  # LLaMA 1, no Llama 3
    ("models/deepseek-v31-fp8", "deepseek_v31"),
    ("models/deepseek_v3_1", "deepseek_v31"),
    ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3_coder"),
    ("Qwen/Qwen3-Coder-480B-A35B-Instruct-FP8", "qwen3_coder"),
    ("served/qwen3_coder", "qwen3_coder"),
    ("Qwen/Qwen3-30B-A3B", "hermes"),
    ("Qwen/Qwen2.5-Coder-7B-Instruct", "hermes"),
    ("NousResearch/Hermes-3-Llama-3.1-8B", "hermes"),
    ("meta-llama/Llama-3.1-8B-Instruct", "llama3_json"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mistral"),
])
def test_default_parser_by_the_models_name(name: str, parser: str) -> None:
    assert default_tool_parser([name, name.rsplit("/", 1)[-1].lower()]) == parser


@pytest.mark.parametrize(("names", "parser"), [
    (["/data/nvme-r1/deepseek-ai/DeepSeek-V2-Lite-Chat"], "hermes"),  # r1 in a directory says nothing
    (["/srv/v3-cluster/deepseek-llm-7b-chat"], "hermes"),
    (["/models/hermes-pool/Meta-Llama-3.1-8B-Instruct"], "llama3_json"),
    (["/mnt/qwen3-coder-runs/glm-4.5-air/"], "glm45"),  # a trailing slash
    (["/root/.cache/huggingface/hub/models--deepseek-ai--DeepSeek-V3.1/snapshots/9f2c1a0b"], "deepseek_v31"),
    (["/root/.cache/huggingface/hub/models--Qwen--Qwen3-Coder-30B-A3B-Instruct/snapshots/abc/"], "qwen3_coder"),
    (["/models/ckpt-7", "my-agent"], "hermes"),
    (["/models/ckpt-7", "deepseek-r1"], "deepseek_v3"),  # a served name that says what the model is
    (["/models/deepseek-v3.2", "deepseek-v3.1"], "deepseek_v31"),
])
def test_default_parser_reads_each_names_last_component(names: list[str], parser: str) -> None:
    assert default_tool_parser(names) == parser


def test_the_new_parsers_keep_special_tokens_under_auto() -> None:
    for parser in MODEL_PARSERS:
        assert keeps_special_tokens("auto", parser) and not keeps_special_tokens("required", parser)
    assert not keeps_special_tokens("auto", "llama3_json")


def test_the_flag_takes_vllms_names_and_refuses_others() -> None:
    import argparse

    for parser in MODEL_PARSERS:
        assert ServerConfig(tool_call_parser=parser).tool_call_parser == parser
    for refused in ("pythonic", "deepseek_v32", "qwen3_xml", "deepseekv3", "DeepSeek_V3"):
        with pytest.raises(ConfigError, match="deepseek_v3, deepseek_v31, qwen3_coder"):
            ServerConfig(tool_call_parser=refused)
    cli = argparse.ArgumentParser()
    add_server_args(cli)
    assert server_config_from_args(cli.parse_args(["--tool-call-parser", "qwen3_coder"])).tool_call_parser == (
        "qwen3_coder")
    assert "deepseek_v31" in cli.format_help()


# --------------------------------------------------------------------------------------------
# hostile model output and odd client schemas: content or text, never an error (a 500)


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [schema]}
    return schema


DEEP_SCHEMA = _nested(5000)
HOSTILE_JSON = ["1" + "0" * 5000, "1" + "0" * 400, "-1" + "0" * 400, "1" + "0" * 400 + ".0", "1e400", "-1e400",
                "NaN", "Infinity", "-Infinity", "[NaN, 1]", '{"x": Infinity}', "[" * 5000 + "]" * 5000,
                '{"a":' * 3000 + "1" + "}" * 3000, '{"a": 1' + "0" * 5000 + "}", '"\\ud800"', '{"a": "\\udfff"}',
                '"\\x"', "\x00", "{", '{"a": [1, 2}', ""]
HOSTILE_SCHEMAS: list[Any] = [
    {"type": "integer"}, {"type": "number"}, {"type": ["integer", "number", "boolean", "object", "array", "null"]},
    {"anyOf": {"type": "integer"}}, {"anyOf": [{"type": "integer"}], "oneOf": ({"type": "string"},)},
    {"anyOf": [1, None, "x", [], {"type": 5}]}, {"oneOf": "integer"}, DEEP_SCHEMA, {"enum": 3}, {"enum": [[], {}]},
    {"const": float("nan")}, {"$ref": "#/$defs/A"}, {"$ref": 5}, {"$ref": "#/properties/v/0"},
    {"$ref": "#"}, {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]}, {"type": 5}, True, None, [], "string",
]


def _hostile_texts(payload: str) -> dict[str, list[str]]:
    """Each parser's call forms around one hostile JSON value or raw text."""
    return {
        "hermes": [f'<tool_call>{{"name": "f", "arguments": {payload}}}</tool_call>', f"<tool_call>{payload}",
                   f'<tool_call>{{"name": {payload}, "arguments": {{}}}}</tool_call>'],
        "mistral": [f'[TOOL_CALLS][{{"name": "f", "arguments": {payload}}}]', f"[TOOL_CALLS]f[ARGS]{payload}"],
        "llama3_json": [f'{{"name": "f", "parameters": {payload}}}', f'{{"name": "f", "parameters": {{}}}};{payload}'],
        "deepseek_v3": [f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}f\n```json\n{payload}\n```{DS_CALL_END}",
                        f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}f{DS_SEP}{{\"a\": {payload}}}{DS_CALL_END}"],
        "deepseek_v31": [f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}f{DS_SEP}{payload}{DS_CALL_END}{DS_CALLS_END}",
                         f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}f{DS_SEP}{{\"a\": {payload}}}{DS_CALL_END}"],
        "qwen3_coder": [f"<tool_call>\n<function=f>\n<parameter=v>\n{payload}\n</parameter>\n</function>\n</tool_call>",
                        f"<tool_call>\n<function={payload}>\n</function>\n</tool_call>"],
        "glm45": [f"<tool_call>f\n<arg_key>v</arg_key>\n<arg_value>{payload}</arg_value>\n</tool_call>",
                  f"<tool_call>{payload}\n</tool_call>", f"<tool_call>f<arg_key>{payload}</arg_key></tool_call>"],
    }


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    text.encode()  # UTF-8 as it is sent: no lone surrogate
    return json.loads(text, parse_constant=refuse)


def test_hostile_output_never_raises() -> None:
    """Numbers past Python's int digit limit or a double's range, nesting past the recursion limit, NaN, lone
    surrogates, broken JSON, under every parser and every odd schema a client may send: each text reads as content
    or calls, whole and streamed, and every call's arguments are JSON text that can be sent."""
    from pagoda.services.protocol.tools import PARSERS_WITH_SCHEMAS, TOOL_CALL_PARSERS, parse_required

    checked = 0
    for payload in HOSTILE_JSON:
        forms = _hostile_texts(payload)
        forms["glm47"] = forms["glm45"]
        for parser in TOOL_CALL_PARSERS:
            for text in forms[parser]:
                for schema in HOSTILE_SCHEMAS if parser in PARSERS_WITH_SCHEMAS else HOSTILE_SCHEMAS[:1]:
                    parameters = {"f": {"type": "object", "properties": {"v": schema}, "$defs": {
                        "A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}}}
                    _, calls = parse_tool_calls(parser, text, parameters)
                    for call in calls:
                        assert isinstance(_strict_json(call.arguments), dict) and call.name.encode(), (parser, text)
                    checked += 1
                for parameters in ({"f": [1]}, {"f": {"properties": [1]}}, {"f": True}):
                    parse_tool_calls(parser, text, parameters)  # type: ignore[arg-type]
                spec = ChatOutputSpec("auto", parser, tool_parameters={"f": {"properties": {"v": DEEP_SCHEMA}}})
                message, _ = whole_message(spec, text)
                msgspec.json.encode(message)
                _streamed(spec, [text[:7], text[7:]])
        for required in (f'[{{"name": "f", "parameters": {payload}}}]', f'[{{"name": "f", "parameters": {payload}',
                         f'[{{"name": {payload}, "parameters": {{}}}}]', f'[{{"name": "\\x{payload}'):
            msgspec.json.encode([c.to_openai("c") for c in parse_required(required)])
    assert checked > 600
    for payload in ("1" + "0" * 5000, "[" * 5000 + "]" * 5000, '{"a":' * 3000 + "1" + "}" * 3000):
        for parser in ("hermes", "deepseek_v3", "deepseek_v31"):  # arguments that are no JSON we read: content
            text = _hostile_texts(payload)[parser][-1 if parser == "deepseek_v3" else 0]
            assert parse_tool_calls(parser, text) == (text, []), parser
    surrogate = parse_tool_calls("hermes", '<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>')
    assert surrogate[1][0].arguments == '{"a": "\\ud800"}'  # kept as JSON's escape, which UTF-8 can carry


# --------------------------------------------------------------------------------------------
# long answers stream in linear time


@pytest.mark.parametrize("parser", ["qwen3_coder", "hermes", "llama3_json"])
def test_a_long_call_or_whitespace_run_is_held_in_pieces(parser: str) -> None:
    """64k tokens inside a call, or a model looping on newlines: what is held is the tokens as they came, joined once
    at the end (`held += text` copied all of it on every token: a second of CPU for 64k), and the streamed answer is
    still the whole one."""
    n = 64_000
    head = {"qwen3_coder": "<tool_call>\n<function=write_file>\n<parameter=text>\n",
            "hermes": '<tool_call>{"name": "write_file", "arguments": {"text": "',
            "llama3_json": '{"name": "write_file", "parameters": {"text": "'}[parser]
    tail = {"qwen3_coder": "\n</parameter>\n</function>\n</tool_call>", "hermes": '"}}</tool_call>',
            "llama3_json": '"}}'}[parser]
    spec = _spec(parser)
    for pieces in ([head] + ["abc "] * n + [tail], ["Sure."] + ["\n"] * n + [" Done."], ["\n"] * n + [head, tail]):
        stream = ChoiceStream(spec)
        deltas = [d for piece in pieces[:-1] for d in stream.push(piece)]
        # the tokens held as they came, not one growing string (llama3_json after text: sent, nothing held)
        assert len(stream.held) >= n or pieces[0] == "\n" or stream.plain
        deltas += stream.push(pieces[-1])
        more, calls_tools = stream.finish()
        message, whole_calls = whole_message(spec, "".join(pieces))
        want = (message["content"] or "", "", [(c["function"]["name"], c["function"]["arguments"])
                                               for c in message.get("tool_calls", [])])
        assert (_client_view(deltas + more), calls_tools) == (want, whole_calls)


# --------------------------------------------------------------------------------------------
# GLM-4.5 / 4.7: the name after <tool_call> is a function's name, else the text is prose


@pytest.mark.parametrize("parser", ["glm45", "glm47"])
def test_glm_text_after_tool_call_that_is_no_name_is_content(parser: str) -> None:
    """`<tool_call>` then a function's name (letters, digits, `_-.:/`) and `<arg_key>`, `</tool_call>` or a newline
    at the end; prose mentioning the tag, or another model's format, is content (it was a call named "in the docs",
    or one whose name was JSON text)."""
    for text in ("See <tool_call> in the docs.", "Wrap it as <tool_call>get_weather now</tool_call>.",
                 '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
                 "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",  # Qwen3-Coder's XML
                 "<tool_call>get weather\n</tool_call>", "<tool_call>f()\n</tool_call>", "the <tool_call>tag",
                 "<tool_call>\nget_weather\n</tool_call>", "<tool_call></tool_call>"):
        assert parse_tool_calls(parser, text) == (text, []), text
        assert whole_message(ChatOutputSpec("auto", parser), text) == ({"role": "assistant", "content": text}, False)


@pytest.mark.parametrize("parser", ["glm45", "glm47"])
def test_glm_names_and_the_whitespace_after_them(parser: str) -> None:
    """4.5's newline, 4.7's nothing, the spaces some runtimes leave; names as MCP clients write them."""
    for text, name, arguments in [
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", "get_weather",
         {"city": "Paris"}),
        ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", "get_weather",
         {"city": "Paris"}),
        ("<tool_call>ls <arg_key>dirPath</arg_key> <arg_value>backend</arg_value> </tool_call>", "ls",
         {"dirPath": "backend"}),
        ("<tool_call>github.search:repos/list-1\n</tool_call>", "github.search:repos/list-1", {}),
        ("<tool_call>天气\n</tool_call>", "天气", {}),
        ("<tool_call>now\n", "now", {}),  # cut short after the name's line
    ]:
        content, calls = parse_tool_calls(parser, "Checking.\n" + text)
        assert content == "Checking." and [(c.name, json.loads(c.arguments)) for c in calls] == [(name, arguments)]


def test_required_calls_keep_numbers_past_a_doubles_range_verbatim() -> None:
    """`required` decodes under a grammar that admits any JSON number: `80E680792574` is JSON past a double's range,
    which the strict reader refuses. The whole array's calls all come back (the fuzz found the call holding it and
    every call after it lost), that call's arguments as the model wrote them; a cut-short array still ends in the
    call being written."""
    calls = [{"name": "tree", "parameters": {"value": 6}}, {"name": "move", "parameters": {"to": "c4"}}]
    big = '{"name": "tree", "parameters": {"value": 1, "w": 80E680792574}}'
    text = f"[{json.dumps(calls[0])}, {big}, {json.dumps(calls[1])}]"
    parsed = parse_required(text)
    assert [c.name for c in parsed] == ["tree", "tree", "move"]
    assert parsed[1].arguments == '{"value": 1, "w": 80E680792574}'
    assert [json.loads(c.arguments) for c in (parsed[0], parsed[2])] == [c["parameters"] for c in calls]
    cut = parse_required(text[:-12])
    assert [c.name for c in cut] == ["tree", "tree", "move"] and cut[1].arguments == parsed[1].arguments
