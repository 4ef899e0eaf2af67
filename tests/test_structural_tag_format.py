"""xgrammar's structural tag, `{"type": "structural_tag", "format": {...}}`: the shape checks (a 400 naming the part,
under each field that can carry it), the formats refused, and the grammar of every format served against SmolLM2's
tokenizer (what the tag allows passes, what it does not is refused). The server's test is in test_structural_tag.py."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import msgspec
import pytest

from pagoda.services.grammar.compiler import grammar_text
from pagoda.services.protocol.schemas import CompletionBody, structured_outputs
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import MAX_FORMAT_DEPTH, StructuredOutputs

TAG = "structured_outputs.structural_tag"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}
DIGITS = {"type": "regex", "pattern": r"\d+"}


def _constraint(fmt: Any, **top: Any) -> StructuredOutputs:
    return StructuredOutputs(structural_tag=json.dumps({"type": "structural_tag", "format": fmt, **top})).validate()


def _tag(begin: str, content: dict[str, Any], end: str | list[str]) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _weather(end: str = "</function>") -> dict[str, Any]:
    return _tag("<function=get_weather>", {"type": "json_schema", "json_schema": CITY}, end)


@pytest.mark.parametrize(("fmt", "param", "needle"), [
    ({"type": "token", "token": 5}, ".format.type", "token-level"),
    ({"type": "token_triggered_tags", "trigger_tokens": [1], "tags": []}, ".format.type", "token-level"),
    ({"type": "qwen_xml_parameter", "json_schema": {}}, ".format.type", "JSON style"),
    ({"type": "nope"}, ".format.type", "unknown format type"),
    ({"value": "a"}, ".format", "needs a type"),
    ({"type": "const_string"}, ".format", "needs value"),
    ({"type": "const_string", "value": "a", "weight": 1}, ".format", "not weight"),
    ({"type": "sequence", "elements": []}, ".format.elements", "1 to"),
    ({"type": "triggered_tags", "triggers": ["<f"], "tags": [_tag("<f>", DIGITS, ""), _tag("<f>", {
        "type": "regex", "pattern": ""}, "")]}, ".format.tags[1].content.pattern", "non-empty"),
    ({"type": "triggered_tags", "triggers": ["<f", "<"], "tags": [_tag("<f>", DIGITS, "")]},
     ".format.tags[0].begin", "exactly one"),
    ({"type": "triggered_tags", "triggers": ["<f"], "tags": [{"type": "or", "elements": [DIGITS]}]},
     ".format.tags[0].type", "tag format"),
    (_tag("<a>", {"type": "json_schema", "json_schema": CITY, "style": "qwen_xml"}, "</a>"),
     ".format.content.style", "json"),
    ({"type": "json_schema", "json_schema": CITY, "any_order": True}, ".format.any_order", "not supported"),
    ({"type": "json_schema", "json_schema": False}, ".format.json_schema", "schema object"),
    ({"type": "any_text", "max_tokens": 9}, ".format.max_tokens", "not supported"),
    (_tag("<a>", DIGITS, {"type": "token", "token": "<|im_end|>"}), ".format.end", "token-level"),
    ({"type": "repeat", "min": 3, "max": 2, "content": DIGITS}, ".format.max", "[min,"),
    ({"type": "dispatch", "rules": [["<a>"]]}, ".format.rules[0]", "[pattern"),
    ({"type": "tags_with_separator", "tags": [_weather()], "separator": 1}, ".format.separator", "string"),
])
def test_a_malformed_format_is_refused_naming_the_part(fmt: Any, param: str, needle: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        _constraint(fmt)
    assert (caught.value.param, needle in caught.value.message) == (TAG + param, True), caught.value.message


def test_the_format_form_bounds_its_depth_and_fields() -> None:
    deep: dict[str, Any] = DIGITS
    for _ in range(MAX_FORMAT_DEPTH):
        deep = {"type": "optional", "content": deep}
    with pytest.raises(InvalidRequestError, match="nest at most"):
        _constraint(deep)
    with pytest.raises(InvalidRequestError, match="format form takes type and format") as caught:
        _constraint(DIGITS, triggers=["x"])
    assert caught.value.param == TAG


@pytest.mark.parametrize(("field", "param"), [
    ("response_format", "response_format.format.tags[0].content.type"),
    ("structured_outputs", TAG + ".format.tags[0].content.type"),
    ("structural_tag", "structural_tag.format.tags[0].content.type")])
def test_each_field_names_the_part_under_itself(field: str, param: str) -> None:
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f"], "tags": [
        _tag("<f>", {"type": "any_tokens"}, "</f>")]}}
    value = {"response_format": tag, "structured_outputs": {"structural_tag": json.dumps(tag)},
             "structural_tag": json.dumps(tag)}[field]
    body = msgspec.convert({"model": "m", "prompt": "p", field: value}, CompletionBody)
    with pytest.raises(InvalidRequestError) as caught:
        structured_outputs(body)
    assert caught.value.param == param and "token-level" in caught.value.message


def test_the_offline_guided_decoding_params_take_the_format_form() -> None:
    from pagoda.params import GuidedDecodingParams

    text = json.dumps({"type": "structural_tag", "format": _weather()})
    constraint = GuidedDecodingParams(structural_tag=text).structured_outputs()
    assert constraint == StructuredOutputs(structural_tag=text) and constraint.validate()


def test_a_structural_tag_text_nested_thousands_deep_is_refused() -> None:
    """The text form is decoded apart from the body (whose depth check sees a string): msgspec raised RecursionError
    past ~1000 levels, a 500."""
    deep = '{"type": "optional", "content": ' * 20_000 + '{"type": "const_string", "value": "x"}' + "}" * 20_000
    for text in (f'{{"type": "structural_tag", "format": {deep}}}', "[" * 20_000 + "]" * 20_000):
        with pytest.raises(InvalidRequestError) as caught:
            StructuredOutputs(structural_tag=text).validate()
        assert caught.value.param == TAG and "deep" in caught.value.message, caught.value.message


@pytest.mark.parametrize(("fmt", "where"), [
    ({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "json_schema", "json_schema": CITY}]},
     "format.elements[0]"),  # nothing ends the text
    ({"type": "sequence", "elements": [{"type": "any_text"}, {"type": "const_string", "value": "."}]},
     "format.elements[0]"),  # it may hold "." itself: the first "." would not end it (xgrammar's text may)
    (_tag("<a>", {"type": "any_text"}, ["", "</a>"]), "format.content"),  # an empty end
    ({"type": "star", "content": _tag("<a>", {"type": "sequence", "elements": [
        {"type": "any_text"}, DIGITS]}, "</a>")}, "format.content.content.elements[0]"),
])
def test_free_text_with_nothing_to_end_it_is_refused(ll: llguidance.LLTokenizer, fmt: dict[str, Any],
                                                     where: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        grammar_text(_constraint(fmt), ll)
    assert f"structural_tag's {where}:" in caught.value.message, caught.value.message


def _accepts(ll: llguidance.LLTokenizer, grammar: str, token_ids: list[int]) -> bool:
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    return matcher.consume_tokens(token_ids) and not matcher.is_error() and matcher.is_accepting()


THINK = _tag("<think>", {"type": "any_text"}, "</think>")
TRIGGERED = {"type": "triggered_tags", "triggers": ["<function="], "tags": [
    _weather(), {"begin": "<function=n>", "content": DIGITS, "end": ["</function>", "</n>"]}], "excludes": ["BAD"]}
# format -> (texts it allows, texts it refuses)
CASES: dict[str, tuple[dict[str, Any], list[str], list[str]]] = {
    "const_string": ({"type": "const_string", "value": "Answer: 42"}, ["Answer: 42"], ["Answer: 43", "Answer:"]),
    "json_schema": ({"type": "json_schema", "json_schema": CITY}, ['{"city": "Oslo"}'],
                    ['{"city":"Oslo"}', '{"town": "Oslo"}', '{"city": "Oslo", "x": 1}']),
    "json_schema compact": ({"type": "json_schema", "json_schema": CITY, "max_whitespace_cnt": 0},
                            ['{"city":"Oslo"}'], ['{"city": "Oslo"}']),
    "json_schema true": ({"type": "json_schema", "json_schema": True}, ["[1, 2]", '"x"'], ["[1,"]),
    "grammar gbnf": ({"type": "grammar", "grammar": 'root ::= ("yes" | "no") "!"'}, ["yes!", "no!"], ["maybe!"]),
    "grammar gbnf unicode escapes": ({"type": "grammar", "grammar": r'root ::= [\u0041-\u0043]+ "\u00e9"'},
                                     ["AB\u00e9"], ["AD\u00e9", "AB"]),
    "grammar lark": ({"type": "sequence", "elements": [{"type": "grammar", "grammar": 'start: "a"+'},
                                                      {"type": "const_string", "value": "."}]}, ["aaa."], ["ab."]),
    "regex": ({"type": "regex", "pattern": r"[A-Z]{3}-\d{2}"}, ["ABC-12"], ["AB-12", "ABC-1x"]),
    "any_text": ({"type": "any_text", "excludes": ["<f"]}, ["", "anything\nat all"], ["a <f b"]),
    "sequence": ({"type": "sequence", "elements": [THINK, {"type": "const_string", "value": "A: "}, DIGITS]},
                 ["<think>why</think>A: 7", "<think></think>A: 7"], ["<think>why</think>A: x", "A: 7",
                                                                      "<think>a</think>b</think>A: 7"]),
    "sequence folding text": ({"type": "sequence", "elements": [{"type": "any_text", "excludes": ["END"]},
                                                               {"type": "const_string", "value": "END"}, DIGITS]},
                              ["free textEND12", "END1"], ["aEND", "aENDbEND1"]),
    "or": ({"type": "or", "elements": [{"type": "const_string", "value": "yes"}, DIGITS]}, ["yes", "12"], ["no"]),
    "optional": ({"type": "sequence", "elements": [{"type": "optional", "content": {
        "type": "const_string", "value": "+"}}, DIGITS]}, ["+1", "1"], ["++1"]),
    "plus": ({"type": "plus", "content": {"type": "const_string", "value": "ab"}}, ["ab", "abab"], ["", "aba"]),
    "star": ({"type": "star", "content": {"type": "const_string", "value": "ab"}}, ["", "abab"], ["a"]),
    "repeat": ({"type": "repeat", "min": 2, "max": 3, "content": {"type": "const_string", "value": "x;"}},
               ["x;x;", "x;x;x;"], ["x;", "x;x;x;x;"]),
    "repeat unbounded": ({"type": "repeat", "min": 1, "max": -1, "content": {"type": "const_string", "value": "x"}},
                         ["x", "xxxxx"], [""]),
    "tag": (_tag("<r>", DIGITS, ["</r>", "</answer>"]), ["<r>12</r>", "<r>3</answer>"], ["<r>12", "<r>a</r>"]),
    "tag of text": (THINK, ["<think>a\nb</think>"], ["<think>a</think>b</think>", "<think>a"]),
    "triggered_tags": (TRIGGERED, ["", "just text", 'I check <function=get_weather>{"city": "Oslo"}</function> ok'
                                   '<function=n>5</n>'],
                       ['<function=get_time>{}</function>', '<function=n>x</n>', 'a BAD b', "<function=n>5"]),
    "triggered_tags at_least_one": (TRIGGERED | {"at_least_one": True}, ['<function=n>5</n> then <function=n>6</n>'],
                                    ["", "text <function=n>5</n>"]),
    "triggered_tags stop_after_first": (TRIGGERED | {"stop_after_first": True}, ["text", "text <function=n>5</n>"],
                                        ["<function=n>5</n> more", "<function=n>5</n><function=n>6</n>"]),
    "triggered_tags exactly one": (TRIGGERED | {"at_least_one": True, "stop_after_first": True},
                                   ["<function=n>5</n>"], ["", "a<function=n>5</n>", "<function=n>5</n>b"]),
    "triggered_tags after thinking": ({"type": "sequence", "elements": [THINK, TRIGGERED]},
                                      ["<think>plan</think>text<function=n>1</n>"], ["text<function=n>1</n>"]),
    "triggered_tags in a tag": (_tag("<a>", {"type": "triggered_tags", "triggers": ["<f"], "tags": [
        _tag("<f>", DIGITS, "</f>")]}, "</a>"), ["<a>x <f>1</f> y</a>", "<a></a>"],
                                ["<a>x</a>y</a>", "<a><f>x</f></a>"]),
    "tags_with_separator": ({"type": "tags_with_separator", "tags": [_weather()], "separator": ", "},
                            ["", '<function=get_weather>{"city": "a"}</function>, <function=get_weather>'
                                 '{"city": "b"}</function>'],
                            ['<function=get_weather>{"city": "a"}</function>,<function=get_weather>'
                             '{"city": "b"}</function>', 'x<function=get_weather>{"city": "a"}</function>']),
    "tags_with_separator at_least_one stop_after_first": (
        {"type": "tags_with_separator", "tags": [_weather()], "separator": ",", "at_least_one": True,
         "stop_after_first": True}, ['<function=get_weather>{"city": "a"}</function>'],
        ["", '<function=get_weather>{"city": "a"}</function>,<function=get_weather>{"city": "a"}</function>']),
    "dispatch": ({"type": "dispatch", "rules": [["n=", DIGITS], ["b=", {"type": "const_string", "value": "yes;"}]]},
                 ["a n=12 and b=yes; then n=3", "plain"], ["n=x", "b=no"]),
    "dispatch once": ({"type": "dispatch", "rules": [["n=", DIGITS]], "loop": False}, ["a n=12", "plain"],
                      ["a n=12 then", "n=x"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_format_allows_what_it_says_and_no_more(ll: llguidance.LLTokenizer, tokenizer: Tokenizer,
                                                     case: str) -> None:
    fmt, allowed, refused = CASES[case]
    grammar = grammar_text(_constraint(fmt), ll)
    for text in allowed:
        assert _accepts(ll, grammar, tokenizer.encode(text, add_special_tokens=False)), (case, text)
    for text in refused:
        assert not _accepts(ll, grammar, tokenizer.encode(text, add_special_tokens=False)), (case, text)


def test_a_special_token_in_a_string_is_that_token(ll: llguidance.LLTokenizer, tokenizer: Tokenizer) -> None:
    """<|im_start|> (a special token of SmolLM2's) written in a begin, trigger or end is that token, as the legacy
    form's triggers are."""
    [im_start] = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    [im_end] = tokenizer.encode("<|im_end|>", add_special_tokens=False)

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    fmt = {"type": "triggered_tags", "triggers": ["<|im_start|>"], "tags": [
        _tag("<|im_start|>n=", DIGITS, "<|im_end|>")]}
    grammar = grammar_text(_constraint(fmt), ll)
    assert _accepts(ll, grammar, ids("a ") + [im_start] + ids("n=42") + [im_end] + ids(" b"))
    assert not _accepts(ll, grammar, ids("a ") + [im_start] + ids("n=x") + [im_end])
    thinking = grammar_text(_constraint(_tag("<|im_start|>", {"type": "any_text"}, "<|im_end|>")), ll)
    assert _accepts(ll, thinking, [im_start] + ids("free text") + [im_end])
    assert not _accepts(ll, thinking, [im_start] + ids("free text"))


def test_nested_tags_written_twice_keep_the_grammar_linear(ll: llguidance.LLTokenizer, tokenizer: Tokenizer) -> None:
    """triggered_tags with at_least_one writes each tag twice (whole first, then after its trigger): nested to the
    depth bound, its content is one rule each time, not a copy (15 levels were 2^14 copies of the innermost: 3.3 MB
    of grammar, seconds to build in the tokenizer and again in the worker, from a 2 KB body)."""
    def nested(levels: int) -> dict[str, Any]:
        inner: dict[str, Any] = {"type": "const_string", "value": "x"}
        for _ in range(levels):
            inner = {"type": "triggered_tags", "triggers": ["<a"], "at_least_one": True,
                     "tags": [_tag("<a>", inner, "</a>")]}
        return inner

    levels = (MAX_FORMAT_DEPTH - 1) // 2  # each level is two format objects deep
    one, deepest = grammar_text(_constraint(nested(1)), ll), grammar_text(_constraint(nested(levels)), ll)
    assert len(deepest) < 2 * levels * len(one), len(deepest)
    assert _accepts(ll, deepest, tokenizer.encode("<a>" * levels + "x" + "</a>" * levels, add_special_tokens=False))
    assert not _accepts(ll, deepest, tokenizer.encode("<a>" * levels + "y" + "</a>" * levels,
                                                      add_special_tokens=False))
