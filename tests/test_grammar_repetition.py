"""Counted repetitions and literals too long for llguidance to force (services/grammar/repetition.py) are a 400 at
submission naming them; they compiled and then failed the sequence mid-answer (a 500) once it reached them."""

from __future__ import annotations

import llguidance
import pytest

from pagoda.services.grammar.compiler import GrammarChecker, grammar_text
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import StructuredOutputs


@pytest.mark.parametrize(("constraint", "named"), [
    (StructuredOutputs(regex="a{1000000}"), "({1000000}) requires 1000000 characters"),
    (StructuredOutputs(regex="(x|y)a{100000}"), "({100000}) requires 100000 characters"),
    (StructuredOutputs(regex="(x|y)(a{100}b){1000}"), "({1000}) requires 101000 characters"),  # nested: the product
    (StructuredOutputs(regex=r"\p{L}{20000}"), "({20000})"),  # Rust syntax Python cannot parse: by its counts
    (StructuredOutputs(json={"type": "object", "properties": {"p": {"type": "string", "pattern": "^a{1000000}$"}}}),
     "pattern at /properties/p/pattern: a counted repetition ({1000000})"),
    (StructuredOutputs(json={"type": "object", "patternProperties": {"^x{20000}$": {}}}),
     "pattern at /patternProperties/^x{20000}$"),
    (StructuredOutputs(json={"enum": ["a" * 200000, "b"]}), "enum at /enum/0: a literal of 200002 characters"),
    (StructuredOutputs(json={"const": "a" * 200000}), "const at /const: a literal"),
    (StructuredOutputs(choice=["a" * 200000, "b"]), "a literal of 200000 characters"),
    (StructuredOutputs(grammar="start: /a{1000000}/"), "({1000000}) requires 1000000 characters"),
    (StructuredOutputs(grammar='start: "a"{200000}'), "({200000}) requires 200000 items"),
    (StructuredOutputs(grammar='start: "a"~200000'), "(~200000)"),
    (StructuredOutputs(grammar='root ::= "a"{200000}'), "requires 200000 items"),  # GBNF
    (StructuredOutputs(grammar='start: x\nx: %json {"type": "string", "pattern": "a{50000}"}'), "pattern at /pattern"),
])
def test_too_long_repetitions_are_refused_by_name(ll: llguidance.LLTokenizer, constraint: StructuredOutputs,
                                                  named: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        GrammarChecker(ll).check(constraint)
    assert named in info.value.message and "at most 10000" in info.value.message
    assert info.value.param == "structured_outputs"


@pytest.mark.parametrize("constraint", [
    StructuredOutputs(regex="[ab]{0,1000000}"),  # only a lower bound is forced
    StructuredOutputs(regex="a{10000}"),
    StructuredOutputs(regex=r"\d{3}-\d{4}"),
    StructuredOutputs(json={"type": "string", "maxLength": 1000000}),
    StructuredOutputs(grammar='start: "a{200000}" "b"{3}'),  # a count inside a string literal is text
    StructuredOutputs(grammar='start: "a"{0,1000000} // "b"{200000}'),
])
def test_repetitions_within_the_limit_are_served(ll: llguidance.LLTokenizer, constraint: StructuredOutputs) -> None:
    forced = GrammarChecker(ll).check(constraint)
    matcher = llguidance.LLMatcher(ll, grammar_text(constraint), log_level=0)
    assert matcher.consume_tokens(forced), matcher.get_error()
    for _ in range(8):  # a few steps past the forced start: no lexer or parser limit reached
        mask = matcher.compute_bitmask()
        if matcher.is_stopped():
            break
        token_id = next(i for i in range(ll.vocab_size) if mask[i // 8] >> (i % 8) & 1)
        assert matcher.consume_token(token_id), matcher.get_error()
    assert not matcher.is_error(), matcher.get_error()
