"""vLLM's StructuredOutputsParams options (disable_any_whitespace, disable_additional_properties, whitespace_pattern,
disable_fallback): taken by the offline class (StructuredOutputsParams(json=..., disable_any_whitespace=True) was a
TypeError), by the older GuidedDecodingParams (which refused two of them) and by the served structured_outputs
object (which refused them all as unknown keys); the grammars they make, checked with llguidance's matcher over
SmolLM2's tokenizer; one offline generation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import pytest

from pagoda import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from pagoda.services.grammar.compiler import grammar_text
from pagoda.services.protocol.schemas import CompletionBody, completion_params, decode_body
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}},
          "required": ["a", "b"]}
SPACED, COMPACT, LOOSE = '{"a": 1, "b": [1, 2]}', '{"a":1,"b":[1,2]}', '{ "a" : 1 , "b" : [ 1 , 2 ] }'


def accepts(ll: Any, tokenizer: Any, constraint: StructuredOutputs, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll, grammar_text(constraint.validate(), ll))
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_the_offline_class_takes_every_field_of_vllms() -> None:
    fields = dict(disable_any_whitespace=True, disable_additional_properties=True, disable_fallback=True)
    made = StructuredOutputsParams(json=SCHEMA, **fields)
    assert (made.disable_any_whitespace, made.disable_additional_properties, made.disable_fallback) == (True,) * 3
    assert StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?").whitespace_pattern == " ?"
    for kind in (dict(regex="a"), dict(choice=["a"]), dict(grammar='start: "a"'), dict(json_object=True),
                 dict(structural_tag=json.dumps({"structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
                                                 "triggers": ["<f>"]}))):
        assert SamplingParams(structured_outputs=StructuredOutputsParams(**kind, **fields)).structured_outputs


def test_disable_any_whitespace_writes_compact_json(ll: Any, tokenizer: Any) -> None:
    """As vLLM's guidance backend with disable_any_whitespace; without it pagoda writes json.dumps' form."""
    plain, compact = StructuredOutputs(json=SCHEMA), StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    assert [accepts(ll, tokenizer, plain, t) for t in (SPACED, COMPACT, LOOSE)] == [True, False, False]
    assert [accepts(ll, tokenizer, compact, t) for t in (SPACED, COMPACT, LOOSE)] == [False, True, False]
    any_object = StructuredOutputs(json_object=True, disable_any_whitespace=True)
    assert accepts(ll, tokenizer, any_object, '{"k":[1,{"j":2}]}')
    assert not accepts(ll, tokenizer, any_object, '{"k": 1}')


def test_whitespace_pattern_is_the_whitespace_between_tokens(ll: Any, tokenizer: Any) -> None:
    spaced = StructuredOutputs(json=SCHEMA, whitespace_pattern="[ ]?")
    assert [accepts(ll, tokenizer, spaced, t) for t in (SPACED, COMPACT, LOOSE)] == [True, True, True]
    assert not accepts(ll, tokenizer, spaced, '{"a":\n1,"b":[1,2]}')
    assert not accepts(ll, tokenizer, spaced, '{"a":  1,"b":[1,2]}')


def test_disable_additional_properties_closes_open_objects(ll: Any, tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "o": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
    extra, nested_extra = '{"a": 1, "z": 2}', '{"a": 1, "o": {"x": 1, "y": 2}}'
    open_ = StructuredOutputs(json=schema)
    closed = StructuredOutputs(json=schema, disable_additional_properties=True)
    assert accepts(ll, tokenizer, open_, extra) and accepts(ll, tokenizer, open_, nested_extra)
    assert not accepts(ll, tokenizer, closed, extra) and not accepts(ll, tokenizer, closed, nested_extra)
    assert accepts(ll, tokenizer, closed, '{"a": 1, "o": {"x": 1}}')
    kept = {**schema, "additionalProperties": {"type": "integer"}}  # a schema's own additionalProperties stands
    assert accepts(ll, tokenizer, StructuredOutputs(json=kept, disable_additional_properties=True), extra)


def test_a_structural_tags_schemas_follow_the_options(ll: Any, tokenizer: Any) -> None:
    tag = json.dumps({"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]})
    compact = StructuredOutputs(structural_tag=tag, disable_any_whitespace=True)
    assert accepts(ll, tokenizer, compact, f"Hi <f>{COMPACT}</f>")
    assert not accepts(ll, tokenizer, compact, f"Hi <f>{SPACED}</f>")


def test_whitespace_pattern_with_disable_any_whitespace_is_refused_naming_it() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        StructuredOutputs(json=SCHEMA, whitespace_pattern=" ", disable_any_whitespace=True).validate()
    assert caught.value.param == "structured_outputs.whitespace_pattern"
    for bad in (dict(whitespace_pattern=""), dict(disable_any_whitespace="yes")):
        with pytest.raises(InvalidRequestError) as caught:
            StructuredOutputs(json=SCHEMA, **bad).validate()
        assert caught.value.param == f"structured_outputs.{next(iter(bad))}"


def test_guided_decoding_params_pass_the_options_on() -> None:
    """It refused whitespace_pattern and disable_additional_properties; its backend option disable-any-whitespace
    is disable_any_whitespace."""
    given = [GuidedDecodingParams(json=SCHEMA, whitespace_pattern=" ?", disable_additional_properties=True),
             GuidedDecodingParams(json=SCHEMA, backend="guidance:disable-any-whitespace")]
    made = [SamplingParams(guided_decoding=g).structured_outputs for g in given]
    assert made == [StructuredOutputs(json=SCHEMA, whitespace_pattern=" ?", disable_additional_properties=True),
                    StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)]


def served(body: dict[str, Any]) -> StructuredOutputs | None:
    return completion_params(decode_body(json.dumps({"model": "m", "prompt": "x", **body}).encode(),
                                         CompletionBody)).structured_outputs


def test_the_served_object_takes_the_options_as_the_offline_class() -> None:
    options = {"disable_any_whitespace": True, "disable_additional_properties": True, "disable_fallback": True}
    assert served({"structured_outputs": {"json": SCHEMA, **options}}) == StructuredOutputs(json=SCHEMA, **options)
    assert served({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar:disable-any-whitespace"}) \
        == StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    for body, param in [({"json": SCHEMA, "whitespace_pattern": " ", "disable_any_whitespace": True},
                         "structured_outputs.whitespace_pattern"),
                        ({"json": SCHEMA, "disable_fallback": "no"}, "structured_outputs"),
                        ({"json": SCHEMA, "backend": "xgrammar"}, "structured_outputs")]:
        with pytest.raises(InvalidRequestError) as caught:
            served({"structured_outputs": body})
        assert caught.value.param == param, caught.value.message


@pytest.mark.slow
def test_offline_json_is_compact_with_disable_any_whitespace(smollm2_dir: Path) -> None:
    from pagoda import LLM

    llm = LLM(str(smollm2_dir), max_model_len=256)
    texts = [llm.generate(["A JSON object:"], SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=(
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=compact))))[0].outputs[0].text
        for compact in (False, True)]
    assert [json.loads(text) for text in texts] and " " not in texts[1] and ", " in texts[0], texts
