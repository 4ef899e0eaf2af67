"""Structured outputs against independent oracles: what pagoda's grammars allow, and what the engine and the server
emit under them at temperature 1.0, checked by the `jsonschema` package (and pydantic for its own models),
Python's `re.fullmatch`, and plain membership for choices; schema features llguidance cannot enforce are a 400 that
names them.

Two samplers explore each grammar: a random walk over its masks (a uniform pick among the tokens it allows, leaning
to one-byte tokens and to ending where it may: thousands of paths a second, no model), and SmolLM2 itself (the
offline LLM and the HTTP server). A walk or completion that ends with `stop` must validate; one cut by its token
budget must say `length`."""

from __future__ import annotations

import concurrent.futures
import datetime
import enum
import json
import random
import re
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import llguidance
import numpy as np
import pytest

from pagoda.services.grammar.compiler import GrammarChecker, grammar_text
from pagoda.services.protocol.tools import parse_required, required_schema
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.config import SLOW_COMPILE_MIN_BYTES
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import StructuredOutputs
from tests.harness import HTTP, SERVED, Server

jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
openai = pytest.importorskip("openai")

# --------------------------------------------------------------------------------------------
# the corpus: schemas people send, pydantic's among them


def text(max_chars: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_chars}


class Color(enum.StrEnum):
    RED = "red"
    GREEN = "green"


class Address(pydantic.BaseModel):
    street: Annotated[str, pydantic.StringConstraints(max_length=6)]
    zip: Annotated[str, pydantic.StringConstraints(pattern=r"^\d{5}$")]


class Person(pydantic.BaseModel):
    """$defs and $ref, an enum class, exclusive bounds, Optional with a default, Literal, a date, a tuple."""

    name: Annotated[str, pydantic.StringConstraints(min_length=1, max_length=6)]
    age: Annotated[int, pydantic.Field(gt=0, lt=130)]
    nickname: Annotated[str, pydantic.StringConstraints(max_length=4)] | None = None
    color: Color
    address: Address
    tags: Annotated[list[Annotated[str, pydantic.StringConstraints(max_length=4)]],
                    pydantic.Field(min_length=1, max_length=2)]
    kind: Literal["a", "b"]
    born: datetime.date
    pair: tuple[int, bool]


class Tree(pydantic.BaseModel):
    """Recursive: the root is a $ref into $defs."""

    value: Annotated[int, pydantic.Field(ge=0, le=9)]
    children: Annotated[list[Tree], pydantic.Field(max_length=2)] = []


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: Annotated[int, pydantic.Field(ge=1, le=9)]


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    good: bool


class Owner(pydantic.BaseModel):
    """A discriminated union: pydantic writes oneOf with a discriminator (disjoint by the const kind)."""

    pet: Annotated[Cat | Dog, pydantic.Field(discriminator="kind")]
    id: uuid.UUID


PYDANTIC_MODELS: dict[str, type[pydantic.BaseModel]] = {"Person": Person, "Tree": Tree, "Owner": Owner}

DRAFT7 = "http://json-schema.org/draft-07/schema#"
SCHEMAS: dict[str, dict[str, Any]] = {
    "empty": {},
    "object": {"type": "object"},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "name": text(5)},
                 "required": ["id"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    "array_bounds": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                     "minItems": 2, "maxItems": 4},
    "enum_const": {"type": "object", "properties": {"mode": {"enum": ["fast", "slow", 3, None]},
                                                    "v": {"const": "v1"}},
                   "required": ["mode", "v"], "additionalProperties": False},
    "any_of": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                          "additionalProperties": False},
                         {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}]},
    "one_of_disjoint": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "string", "maxLength": 3}]},
    "defs_ref": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                  "required": ["x", "y"], "additionalProperties": False}},
                 "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
                 "required": ["a"], "additionalProperties": False},
    "definitions_draft7": {"$schema": DRAFT7, "definitions": {"n": {"type": "integer", "minimum": 3, "maximum": 4}},
                           "type": "array", "items": [{"$ref": "#/definitions/n"}, {"type": "string", "maxLength": 2}],
                           "additionalItems": False},
    "optional_fields": {"type": "object", "properties": {"a": text(3), "b": {"type": "integer"}, "c": {"type": "null"}},
                        "additionalProperties": False},
    "strings": {"type": "object", "properties": {
        "short": {"type": "string", "minLength": 2, "maxLength": 4},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{2}$"},
        "free_pattern": {"type": "string", "pattern": "[0-9]", "maxLength": 4},
        "greek": {"type": "string", "pattern": "^[α-ω]{1,3}$"}},
        "required": ["short", "code", "free_pattern", "greek"], "additionalProperties": False},
    "formats": {"type": "object", "properties": {
        "d": {"type": "string", "format": "date"}, "t": {"type": "string", "format": "time"},
        "u": {"type": "string", "format": "uuid"}, "ip": {"type": "string", "format": "ipv4"},
        "e": {"type": "string", "format": "email", "maxLength": 12}},
        "required": ["d", "t", "u", "ip", "e"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "excl": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
        "neg": {"type": "number", "minimum": -2.5, "exclusiveMaximum": -1},
        "half": {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 3},
        "third": {"type": "integer", "multipleOf": 3, "minimum": -10, "maximum": 10},
        "frac_bounds": {"type": "integer", "minimum": 1.5, "maximum": 3.5}},
        "required": ["excl", "neg", "half", "third", "frac_bounds"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"a": {"type": ["string", "null"], "maxLength": 3},
                                                  "b": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
                                                  "c": {"type": ["array", "null"], "items": {"type": "integer"},
                                                        "maxItems": 2}},
                 "required": ["a", "b", "c"], "additionalProperties": False},
    "additional_schema": {"type": "object", "additionalProperties": {"type": "boolean"}, "maxProperties": 2},
    "pattern_properties": {"type": "object", "patternProperties": {"^x_[a-z]$": {"type": "integer"}},
                           "additionalProperties": False},
    "prefix_items": {"type": "array", "prefixItems": [{"type": "integer"}, {"enum": ["a", "b"]}], "items": False},
    "all_of": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 5}},
                          "required": ["a"]}, {"properties": {"a": {"maximum": 7}}}]},
    "escapes": {"enum": ["", " ", 'a"b', "\\", "\u00e9", "\n", "\U0001f600"]},
    **{name: model.model_json_schema() for name, model in PYDANTIC_MODELS.items()},
}

# What llguidance cannot enforce: each is refused with a message that names it, never served unconstrained.
UNSUPPORTED: list[tuple[dict[str, Any], str]] = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"$schema": DRAFT7, "type": "object", "dependencies": {"a": ["b"]}}, "dependencies"),
    ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, "propertyNames"),
    ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),  # overlapping: anyOf would not do
    ({"type": "string", "format": "color-hex"}, "color-hex"),
    ({"$ref": "https://example.com/schema.json"}, "https://example.com/schema.json"),
]


# --------------------------------------------------------------------------------------------
# the random walk


class Walker:
    """Random paths through a grammar's masks: at each step a token the mask allows, uniformly, often among the
    one-byte tokens and sometimes among the closing ones (so that strings, numbers and objects end), and the end
    wherever EOS is allowed, half the time."""

    def __init__(self, ll: llguidance.LLTokenizer, vocab_size: int) -> None:
        self.ll = ll
        self.vocab_size = vocab_size
        self.eos = ll.eos_token
        pieces = [ll.decode_bytes([t]) for t in range(vocab_size)]
        self.one_byte = np.array([len(piece) == 1 for piece in pieces])  # [V] bool
        self.closing = np.array([piece in (b'"', b"}", b"]") for piece in pieces])  # [V] bool

    def walk(self, grammar: str, seed: int, max_tokens: int) -> tuple[str, str]:
        """(text, "stop" | "length") of one path."""
        matcher = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        rng = random.Random(seed)
        ids: list[int] = []
        for _ in range(max_tokens):
            words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.unpackbits(words, bitorder="little")[:self.vocab_size].astype(bool)  # [V]
            assert allowed.any(), f"the grammar allows nothing after {self.ll.decode_bytes(ids)!r}"
            if allowed[self.eos] and rng.random() < 0.5:
                return self.ll.decode_bytes(ids).decode(), "stop"
            closing, short = np.flatnonzero(allowed & self.closing), np.flatnonzero(allowed & self.one_byte)
            draw = rng.random()
            pool = (closing if len(closing) and draw < 0.25 else short if len(short) and draw < 0.8
                    else np.flatnonzero(allowed))
            token_id = int(pool[rng.randrange(len(pool))])
            if token_id == self.eos:
                return self.ll.decode_bytes(ids).decode(), "stop"
            assert matcher.consume_token(token_id), matcher.get_error()
            ids.append(token_id)
        return self.ll.decode_bytes(ids).decode(errors="replace"), "length"


@pytest.fixture(scope="module")
def walker(ll: llguidance.LLTokenizer, tokenizer: Tokenizer) -> Walker:
    return Walker(ll, tokenizer.vocab_size)


def validator(schema: dict[str, Any]) -> Any:
    """The schema's own draft (by $schema; 2020-12 without one), formats asserted."""
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def schema_errors(schema: dict[str, Any], text: str) -> list[str]:
    """What the oracles find wrong with a finished answer: JSON, the schema, and pydantic for its own models."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return [f"not JSON: {exc}"]
    errors = [e.message for e in validator(schema).iter_errors(value)]
    model = next((m for m in PYDANTIC_MODELS.values() if m.model_json_schema() == schema), None)
    if model is not None and not errors:
        try:
            model.model_validate_json(text)
        except pydantic.ValidationError as exc:
            errors.append(str(exc))
    return errors


# --------------------------------------------------------------------------------------------
# grammars against the oracles (no model)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_walk_of_a_schema_validates(walker: Walker, name: str) -> None:
    schema = SCHEMAS[name]
    grammar = grammar_text(StructuredOutputs(json=schema))
    finished = 0
    for seed in range(6):
        answer, reason = walker.walk(grammar, seed, max_tokens=150)
        if reason == "stop":
            finished += 1
            assert schema_errors(schema, answer) == [], answer
    assert finished, "no walk finished: the test says nothing about this schema"


REGEXES = ["^[a-z]{2,4}$", "abc$", "(?i)ab", "\\d{3}-\\d{4}", "[A-Z][a-z]{0,5}", "(yes|no|maybe)",
           "[\\w.+-]{1,8}@[a-z]{1,5}\\.com", "\\s?x", "[^a-z]{2}", "(\\d{1,2}:){2}\\d{2}", "\u00e9{2}|\U0001f600",
           "[\u4e00-\u9fff]{1,3}", "(ab){1,3}c?", "(a|ab)(c|bcd)", "\\$\\d+", "[$^]", "\\\\", "[\\]]", "[a\\-z]",
           "a{0}b", "x|", "[^\\n]{1,3}"]


@pytest.mark.parametrize("regex", REGEXES)
def test_every_walk_of_a_regex_fullmatches(walker: Walker, regex: str) -> None:
    grammar = grammar_text(StructuredOutputs(regex=regex))
    for seed in range(6):
        answer, reason = walker.walk(grammar, seed, max_tokens=40)
        assert reason == "stop" and re.fullmatch(regex, answer), (answer, reason)


CHOICES = [["a", "ab", "abc"], [" a", "a ", "a"], ["\U0001f600", "\u00e9", 'a"b', "tab\t", "back\\slash", "new\nline"],
           ["\u65e5\u672c", "\u65e5\u672c\u8a9e"], ["{{", "}}", "|", "/a/", "'q'"], ["  ", "\n", "x"]]


@pytest.mark.parametrize("choices", CHOICES)
def test_every_walk_of_a_choice_is_one_of_them(walker: Walker, choices: list[str]) -> None:
    grammar = grammar_text(StructuredOutputs(choice=choices))
    seen = set()
    for seed in range(16):
        answer, reason = walker.walk(grammar, seed, max_tokens=20)
        assert reason == "stop" and answer in choices, (answer, reason)
        seen.add(answer)
    assert len(seen) > 1  # the walk reaches more than one (a prefix does not hide the longer ones)


# (grammar, what it allows as a Python regex): Lark and GBNF, told apart by the first rule (a Lark grammar that held
# "::=" in a literal or a comment was taken for GBNF and refused)
GRAMMARS = [('start: "x ::= y"', "x ::= y"),
            ('// not a rule ::= here\nstart: "ok" | "no"', "ok|no"),
            ('start: item+\nitem: /[0-9]/ | "-"', "[0-9-]+"),
            ('root ::= color ("," color)*\ncolor ::= "red" | "blue"', "(red|blue)(,(red|blue))*"),
            ('# a comment\nroot ::= [a-c]+ "::="', "[a-c]+::="),
            # llama.cpp's \u and \U escapes (gbnf_to_lark wrote \u41 and \U1F600, which llguidance refuses)
            (r'root ::= [\u0041-\u0043]{1,3} "\u00e9" "\u0022"', '[A-C]{1,3}\u00e9"'),
            (r'root ::= "x" [\U0001F600-\U0001F64F]? [\u0000-\u0020]', "x[\U0001F600-\U0001F64F]?[\x00-\x20]"),
            (r'root ::= "\\u0041" [\u005D]', r"\\u0041\]")]


@pytest.mark.parametrize(("grammar", "oracle"), GRAMMARS)
def test_every_walk_of_a_grammar_matches_it(walker: Walker, ll: llguidance.LLTokenizer, grammar: str,
                                            oracle: str) -> None:
    constraint = StructuredOutputs(grammar=grammar)
    GrammarChecker(ll).check(constraint)
    lark = grammar_text(constraint)
    finished = 0
    for seed in range(6):
        answer, reason = walker.walk(lark, seed, max_tokens=30)
        finished += reason == "stop"
        assert reason == "length" or re.fullmatch(oracle, answer), (answer, reason)
    assert finished


@pytest.mark.parametrize(("schema", "feature"), UNSUPPORTED)
def test_unsupported_schema_features_are_refused_by_name(ll: llguidance.LLTokenizer, schema: dict[str, Any],
                                                        feature: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        GrammarChecker(ll).check(StructuredOutputs(json=schema))
    assert feature in raised.value.message


# Numeric bounds past 2**53: llguidance rounds them through a float and saturates them to 64-bit integers, so its
# answers broke them (a minimum of 1e29 allowed only 9223372036854775807), and a range at the bottom of the 64-bit
# integers crashed the compiling process (the tokenizer's: one request stopped the whole server). Refused by name.
OUT_OF_RANGE = [
    ({"type": "integer", "minimum": 1e29, "maximum": 1e30}, "minimum at /minimum"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 9223372036854775790,
                                             "maximum": 9223372036854775800}}}, "minimum at /properties/n/minimum"),
    ({"type": "number", "minimum": -9223372036854775800, "maximum": -9223372036854775790}, "minimum at /minimum"),
    ({"type": "integer", "minimum": -1e19, "maximum": -9223372036854775800}, "minimum at /minimum"),  # the crash
]


@pytest.mark.parametrize(("schema", "named"), OUT_OF_RANGE)
@pytest.mark.parametrize("kind", ["json", "grammar"])
def test_bounds_past_2_53_are_refused_by_name(ll: llguidance.LLTokenizer, schema: dict[str, Any], named: str,
                                              kind: str) -> None:
    constraint = (StructuredOutputs(json=schema) if kind == "json" else
                  StructuredOutputs(grammar="start: %json " + json.dumps(schema)))  # a Lark grammar embeds schemas
    with pytest.raises(InvalidRequestError) as raised:
        GrammarChecker(ll).check(constraint)
    assert named in raised.value.message and "2**53" in raised.value.message


@pytest.mark.parametrize("schema", [{"type": "integer", "minimum": -2**53, "maximum": 2**53},
                                    {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
                                    {"type": "integer", "maximum": 2**64 - 1},
                                    {"type": "integer", "exclusiveMaximum": 2**63}])
def test_bounds_within_range_or_past_the_top_are_served(walker: Walker, schema: dict[str, Any]) -> None:
    """At most 2**53 in magnitude, or an upper bound at or past the 64-bit top (int64's and uint64's maximum,
    which code generators write): every walk validates."""
    grammar = grammar_text(StructuredOutputs(json=schema))
    for seed in range(4):
        answer, reason = walker.walk(grammar, seed, max_tokens=40)
        assert reason == "length" or schema_errors(schema, answer) == [], answer


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


class Point(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # additionalProperties false: short answers
    x: Annotated[int, pydantic.Field(ge=0, le=9)]


class Plot(pydantic.BaseModel):
    """Its $defs holds a Point that is not tool "move"'s Point: the same name, another schema."""

    model_config = pydantic.ConfigDict(extra="forbid")

    points: Annotated[list[Point], pydantic.Field(min_length=1, max_length=2)]


class Move(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    to: Annotated[str, pydantic.StringConstraints(pattern="^[a-h][1-8]$")]
    via: Point | None = None


# tool_choice "required" nests each tool's parameters in an array schema: their "#/$defs/..." refs pointed at its
# root, which has none (every pydantic model with a nested model was a 400), and two tools' $defs may share a name
TOOLS = [tool("plot", Plot.model_json_schema()), tool("move", {**Move.model_json_schema(), "$defs": {
    "Point": {"type": "object", "properties": {"x": {"type": "string", "maxLength": 2}}, "required": ["x"],
              "additionalProperties": False}}}),
         tool("tree", Tree.model_json_schema())]


@pytest.mark.parametrize("tools", [TOOLS[:1], TOOLS], ids=["one", "three"])
def test_required_tool_calls_with_refs_validate_against_their_tools(walker: Walker, ll: llguidance.LLTokenizer,
                                                                    tools: list[dict[str, Any]]) -> None:
    constraint = StructuredOutputs(json=required_schema(tools, parallel=True))
    GrammarChecker(ll).check(constraint)
    grammar = grammar_text(constraint)
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    finished = 0
    for seed in range(8):
        answer, reason = walker.walk(grammar, seed, max_tokens=200)
        if reason != "stop":
            continue
        finished += 1
        calls = parse_required(answer)
        assert calls and len(calls) == len(json.loads(answer)), answer
        for call in calls:
            assert schema_errors(parameters[call.name], call.arguments) == [], (call.name, call.arguments)
    assert finished


# --------------------------------------------------------------------------------------------
# the model: the offline LLM and the server, at temperature 1.0

# Schemas whose every answer is short (bounded strings, numbers, arrays, no free properties): a completion that
# ends inside max_tokens says `stop`, one cut says `length`; neither outcome is assumed, each is checked.
BOUNDED = ["nested", "array_bounds", "enum_const", "defs_ref", "numbers", "nullable", "prefix_items", "escapes",
           "one_of_disjoint"]
MAX_TOKENS = 32


def prefix_ok(ll: llguidance.LLTokenizer, tokenizer: Tokenizer, constraint: StructuredOutputs, ids: list[int]) -> bool:
    """The tokens are a path the grammar allows (finished or not)."""
    return llguidance.LLMatcher(ll, grammar_text(constraint), log_level=0).consume_tokens(ids)


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> Any:
    from pagoda import LLM

    return LLM(str(smollm2_dir), max_model_len=256)


def test_offline_llm_answers_validate(llm: Any, ll: llguidance.LLTokenizer, tokenizer: Tokenizer) -> None:
    """One batch of schemas, regexes and choices through LLM.generate (some with n=2): every `stop` answer passes
    its oracle, every `length` one is a cut path of its grammar."""
    from pagoda import SamplingParams

    jobs: list[tuple[StructuredOutputs, Any]] = [(StructuredOutputs(json=SCHEMAS[name]), SCHEMAS[name])
                                                 for name in BOUNDED]
    jobs += [(StructuredOutputs(regex=regex), regex) for regex in ("\\d{3}-\\d{4}", "\u00e9{2}|x")]
    jobs += [(StructuredOutputs(choice=choices), choices) for choices in CHOICES[1:3]]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, n=1 + i % 3 // 2, structured_outputs=c)
              for i, (c, _) in enumerate(jobs)]
    outputs = llm.generate([f"Answer {i} in the format asked." for i in range(len(jobs))], params)
    num_stopped = 0
    for (constraint, oracle), output in zip(jobs, outputs, strict=True):
        for completion in output.outputs:
            answer, reason = completion.text, completion.finish_reason
            if reason == "length":
                assert len(completion.token_ids) == MAX_TOKENS
                assert prefix_ok(ll, tokenizer, constraint, list(completion.token_ids)), answer
                continue
            assert reason == "stop", reason
            num_stopped += 1
            if constraint.json is not None:
                assert schema_errors(oracle, answer) == [], answer
            elif constraint.regex is not None:
                assert re.fullmatch(oracle, answer), (oracle, answer)
            else:
                assert answer in oracle
    assert num_stopped >= len(jobs) // 2


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    return smollm2_server  # conftest's one default SmolLM2 server (SHARED_SERVER_MODULES)


def post(server: Server, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(status, body) of a request, or of a stream put back together: each choice's text (or its tool calls'
    arguments, by call) joined, and its finish_reason."""
    url = server.url + path
    if not body.get("stream"):
        response = HTTP.post(url, json=body, timeout=300)
        return response.status_code, response.json()
    choices: dict[int, dict[str, Any]] = {}
    with HTTP.stream("POST", url, json=body, timeout=300) as stream:
        if stream.status_code != 200:
            stream.read()
            return stream.status_code, stream.json()
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                joined = choices.setdefault(choice["index"], {"text": "", "tool_calls": {}, "finish_reason": None})
                delta = choice.get("delta", choice)
                joined["text"] += delta.get("text") or delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    into = joined["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                    into["name"] += call.get("function", {}).get("name") or ""
                    into["arguments"] += call.get("function", {}).get("arguments") or ""
                joined["finish_reason"] = choice.get("finish_reason") or joined["finish_reason"]
    return 200, {"choices": [choices[i] for i in sorted(choices)]}


def answers(status: int, body: dict[str, Any]) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice of a 200 answer, streamed or not."""
    assert status == 200, body
    return [(c.get("message", {}).get("content") if "message" in c else c["text"], c["finish_reason"])
            for c in body["choices"]]


CHAT = "/v1/chat/completions"


def chat_body(extra: dict[str, Any], seed: int, stream: bool, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"model": SERVED, "messages": [{"role": "user", "content": f"Answer {seed} in the format asked."}],
            "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "stream": stream, **extra}


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}


def test_server_answers_validate_streamed_or_not(server: Server) -> None:
    """Chat (response_format, guided_json) and completions (guided_regex, guided_choice), streamed and not, all at
    once: every `stop` answer passes its oracle, every `length` one does not parse as a finished answer."""
    jobs: list[tuple[str, dict[str, Any], Any]] = []
    for i, name in enumerate(["nested", "defs_ref", "Tree", "nullable"]):
        jobs.append((CHAT, chat_body(response_format(SCHEMAS[name]), i, stream=i % 2 == 0), SCHEMAS[name]))
        jobs.append((CHAT, chat_body({"guided_json": SCHEMAS[name]}, i, stream=i % 2 == 1), SCHEMAS[name]))
    for i, (key, oracle) in enumerate([("guided_regex", "[A-Z][a-z]{0,5}"), ("guided_regex", "(\\d{1,2}:){2}\\d{2}"),
                                       ("guided_choice", CHOICES[0]), ("guided_choice", CHOICES[2])]):
        body = {"model": SERVED, "prompt": "Pick:", "max_tokens": 24, "temperature": 1.0, "seed": i, "n": 2,
                "stream": i % 2 == 0, key: oracle}
        jobs.append(("/v1/completions", body, oracle))
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: post(server, job[0], job[1]), jobs))
    for (_, _, oracle), result in zip(jobs, results, strict=True):
        for answer, reason in answers(*result):
            if isinstance(oracle, dict):
                errors = schema_errors(oracle, answer)
                assert (errors == []) == (reason == "stop"), (answer, reason, errors)
            elif isinstance(oracle, str):
                assert reason == "stop" and re.fullmatch(oracle, answer), (oracle, answer, reason)
            else:
                assert reason == "stop" and answer in oracle, (answer, reason)


def test_an_answer_cut_mid_object_says_length(server: Server) -> None:
    """max_tokens ends the answer inside its object: finish_reason `length` (vLLM's), whose text does not parse,
    streamed or not, chat or completions; the openai client's parse() then refuses it (LengthFinishReasonError)."""
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 40}}, "required": ["story"]}
    bodies = [(CHAT, chat_body(response_format(schema), 1, stream=stream, max_tokens=8)) for stream in (False, True)]
    bodies += [("/v1/completions", {"model": SERVED, "prompt": "A story:", "max_tokens": 8, "guided_json": schema,
                                    "stream": stream}) for stream in (False, True)]
    client = server.client(timeout=300)
    with concurrent.futures.ThreadPoolExecutor(len(bodies) + 1) as pool:  # all at once: the engine batches them
        parsed = pool.submit(client.chat.completions.parse, model=SERVED,
                             messages=[{"role": "user", "content": "A story."}], response_format=Story, max_tokens=8)
        results = list(pool.map(lambda job: post(server, job[0], job[1]), bodies))
        with pytest.raises(openai.LengthFinishReasonError):
            parsed.result()
    for result in results:
        (answer, reason), = answers(*result)
        assert reason == "length" and answer.startswith('{"story": "'), (answer, reason)
        with pytest.raises(json.JSONDecodeError):
            json.loads(answer)


class Story(pydantic.BaseModel):
    story: Annotated[str, pydantic.StringConstraints(min_length=40)]


def test_required_tool_calls_from_pydantic_models_are_served(server: Server) -> None:
    """tool_choice required over tools whose parameters hold $defs (a 400 before, see the walk test above), streamed
    or not: each call's arguments validate against its own tool's parameters."""
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda stream: post(server, CHAT, chat_body(
            {"tools": TOOLS[:2], "tool_choice": "required", "parallel_tool_calls": False}, 3, stream=stream,
            max_tokens=32)), (False, True)))
    for stream, (status, body) in zip((False, True), results, strict=True):
        assert status == 200, body
        choice = body["choices"][0]
        calls = (list(choice["tool_calls"].values()) if stream else
                 [c["function"] for c in choice["message"].get("tool_calls") or []])
        assert choice["finish_reason"] in ("tool_calls", "length"), choice
        if choice["finish_reason"] == "tool_calls":
            assert len(calls) == 1  # parallel_tool_calls false
            for call in calls:
                assert schema_errors(parameters[call["name"]], call["arguments"]) == [], call


@pytest.mark.parametrize(("extra", "param", "feature"), [
    (response_format(UNSUPPORTED[0][0]), "response_format", "uniqueItems"),
    ({"guided_json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "guided_json", "oneOf"),
    ({"structured_outputs": {"json": {"type": "string", "format": "color-hex"}}}, "structured_outputs", "color-hex"),
    ({"tools": [tool("f", {"type": "object", "not": {"required": ["a"]}})], "tool_choice": "required"}, "tools",
     '["not"]'),
    ({"guided_regex": "\\bword"}, "guided_regex", "lookaround"),
    ({"guided_json": OUT_OF_RANGE[0][0]}, "guided_json", "2**53"),
])
def test_unsupported_features_are_a_400_naming_them(server: Server, extra: dict[str, Any], param: str,
                                                    feature: str) -> None:
    status, body = post(server, CHAT, chat_body(extra, 0, stream=False, max_tokens=4))
    assert status == 400 and body["error"]["param"] == param and feature in body["error"]["message"], body


def test_a_large_constraint_is_answered_through_the_grammar_gate(server: Server) -> None:
    """A schema past SLOW_COMPILE_MIN_BYTES waits out of the batch until the worker has compiled it (the scheduler's
    GrammarGate; before, every row of the batch waited for the compile): requests beside it and the constrained
    ones (the first held, the second after its matcher is built) all answer, the constrained ones valid."""
    description = " ".join(f"Say yes when clause {i} holds, no otherwise." for i in range(120))
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"],
                                                          "description": description}},
              "required": ["answer"], "additionalProperties": False}
    assert len(json.dumps(schema)) >= SLOW_COMPILE_MIN_BYTES  # by its description: the answer itself is short
    jobs = [(CHAT, chat_body(response_format(schema), seed, stream=seed == 1, max_tokens=48)) for seed in (0, 1)]
    jobs += [(CHAT, chat_body({}, seed, stream=False, max_tokens=8)) for seed in (2, 3)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: post(server, *job), jobs))
    for (status, body), constrained in zip(results, [True, True, False, False], strict=True):
        for text, finish_reason in answers(status, body):
            if constrained:
                assert finish_reason == "stop" and schema_errors(schema, text) == [], text
