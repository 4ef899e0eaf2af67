"""Forced runs longer than llguidance can walk (services/grammar/repetition.py) are a 400 at submission naming them:
they compiled and then failed the sequence mid-answer (a 500) once it reached them. Runs it does walk, and text that
is the model's choice however long, are served. Cases measured with llguidance 1.9.1 and SmolLM2's tokenizer."""

from __future__ import annotations

import llguidance
import numpy as np
import pytest

from pagoda.services.grammar.compiler import GrammarChecker, grammar_text
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import StructuredOutputs

CHOICE = 'start: ("x"|"y") '  # a Lark choice first: the run after it is not walked at submission


@pytest.mark.parametrize(("constraint", "named"), [
    (StructuredOutputs(regex="a{1000000}"), "forced start cannot be walked"),  # at the start: walked, and fails
    (StructuredOutputs(regex="(x|y)a{100000}"), "a run of 100000 characters"),
    (StructuredOutputs(regex="(x|y)(a{100}b){1000}"), "a run of 101000 characters"),  # nested: the product
    (StructuredOutputs(json={"type": "object", "properties": {"p": {"type": "string", "pattern": "^a{100000}$"}}}),
     "pattern at /properties/p/pattern: a regex forces a run of 100000"),
    (StructuredOutputs(json={"type": "object", "patternProperties": {"^x{50000}$": {}}}),
     "pattern at /patternProperties/^x{50000}$"),
    (StructuredOutputs(json={"enum": ["a" * 200000, "b"]}), "enum at /enum/0: a literal of 200002 bytes"),
    (StructuredOutputs(choice=["a" * 200000, "b"]), "a literal of 200000 bytes"),
    (StructuredOutputs(grammar='start: "a"{100000}'), "forced start cannot be walked"),
    (StructuredOutputs(grammar='root ::= "a"{100000}'), "forced start cannot be walked"),  # GBNF
    (StructuredOutputs(grammar='start: ("a"{100} "b"){1000}'), "forced start cannot be walked"),
    (StructuredOutputs(grammar='start: x{200}\nx: y{200}\ny: "a"'), "forced start cannot be walked"),
    (StructuredOutputs(grammar=CHOICE + '("a"{100} "b"){1000}'), "'start' forces a run of 101000 lexemes"),
    (StructuredOutputs(grammar=CHOICE + 'x{200}\nx: y{200}\ny: "a"'), "forces a run of 40000 lexemes"),
    (StructuredOutputs(grammar=CHOICE + '"a"~40000'), "forces a run of 40000 lexemes"),
    (StructuredOutputs(json={"type": "array", "items": {"const": 1}, "minItems": 20000}), "minItems (20000)"),
    (StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "array", "items": {"enum": ["z"]},
                                                                    "minItems": 20000}}}), "minItems (20000)"),
    (StructuredOutputs(json={"type": "string", "minLength": 100000, "pattern": "^a*$"}), "minLength (100000)"),
    (StructuredOutputs(grammar='start: "x" x\nx: %json {"type": "string", "pattern": "a{50000}"}'),
     "pattern at /pattern"),
    (StructuredOutputs(grammar='start: "x" x\nx: %json {"const": "' + "a" * 50000 + '"}'), "const at /const"),
])
def test_too_long_runs_are_refused_by_name(ll: llguidance.LLTokenizer, constraint: StructuredOutputs,
                                           named: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        GrammarChecker(ll).check(constraint)
    assert named in info.value.message, info.value.message
    assert info.value.param == "structured_outputs"


def walk(ll: llguidance.LLTokenizer, constraint: StructuredOutputs, forced: list[int], num_steps: int) -> None:
    """The forced start and `num_steps` steps past it, taking the lowest allowed id (a one-byte token where the
    grammar forces text: the most lexer and parser work a step can cause)."""
    matcher = llguidance.LLMatcher(ll, grammar_text(constraint), log_level=0)
    assert matcher.consume_tokens(forced), matcher.get_error()
    for _ in range(num_steps):
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if matcher.is_stopped():
            break
        assert matcher.consume_token(int(np.flatnonzero(bits[:ll.vocab_size])[0])), matcher.get_error()
    assert not matcher.is_error(), matcher.get_error()


@pytest.mark.parametrize("constraint", [
    StructuredOutputs(regex="[ab]{0,1000000}"),  # only a lower bound is forced
    StructuredOutputs(regex="[a-z]{20000}"),  # a class is the model's choice, however long
    StructuredOutputs(regex="[0-9a-f]{16384}"),
    StructuredOutputs(json={"type": "string", "pattern": "^[a-z]{20000}$"}),
    StructuredOutputs(json={"type": "string", "minLength": 50000, "pattern": "^[a-z]*$"}),
    StructuredOutputs(regex="a{20000}"),  # forced at the start: walked at submission
    StructuredOutputs(regex="a{100000}"),
    StructuredOutputs(regex="(x|y)a{40000}"),
    StructuredOutputs(regex=r"\d{3}-\d{4}"),
    StructuredOutputs(json={"type": "string", "maxLength": 1000000}),
    StructuredOutputs(json={"const": "a" * 200000}),  # the whole answer forced at the start
    StructuredOutputs(json={"enum": ["a" * 30000, "b"]}),
    StructuredOutputs(json={"const": "漢" * 1700}),  # decoded text counts, not json.dumps's \uXXXX
    StructuredOutputs(choice=["😀" * 900, "b"]),
    StructuredOutputs(json={"type": "array", "items": {"const": 1}, "minItems": 10000}),
    StructuredOutputs(json={"type": "array", "items": {"type": "integer"}, "minItems": 20000}),
    StructuredOutputs(grammar=CHOICE + '"a"{30000}'),
    StructuredOutputs(grammar=CHOICE + '("a"{100} "b"){290}'),
    StructuredOutputs(grammar='start: "a{200000}" "b"{3}'),  # a count inside a string literal is text
    StructuredOutputs(grammar='start: "a"{0,1000000} // "b"{200000}'),
    StructuredOutputs(grammar='start: x\nx: %json {"type": "string", "description": "' + "d" * 12000 + '"}'),
])
def test_runs_llguidance_walks_are_served(ll: llguidance.LLTokenizer, constraint: StructuredOutputs) -> None:
    walk(ll, constraint, GrammarChecker(ll).check(constraint), num_steps=8)


def properties(count: int) -> StructuredOutputs:
    return StructuredOutputs(json={"type": "object", "properties": {f"p_{i}_{'x' * 20}": {"type": "integer"}
                                                                     for i in range(count)}})


def test_an_object_past_the_parsers_row_limit_is_refused_at_submission(ll: llguidance.LLTokenizer) -> None:
    """600 optional properties compile, but the first property token passes llguidance's row limit (2407 items, max
    2000): the row failed mid-answer once sampling reached it (a 500); a 400 at submission now. 400 are served."""
    with pytest.raises(InvalidRequestError) as info:
        GrammarChecker(ll).check(properties(600))
    assert "limit of the grammar engine" in info.value.message and "max is 2000" in info.value.message
    walk(ll, properties(400), GrammarChecker(ll).check(properties(400)), num_steps=8)


def test_a_long_chain_of_lark_rules_is_checked_without_recursing_per_rule(ll: llguidance.LLTokenizer) -> None:
    """The run check walked a grammar's rules by recursion, one Python frame group per rule: a chain of 1,000 rules
    that each name the next (which llguidance compiles) was a 400 'maximum recursion depth exceeded'. It is served,
    and a chain that forces too long a run is still refused by name."""
    num_rules = 3000
    chain = "\n".join(f'r{i}: "x" r{i + 1} | "y"' for i in range(num_rules))
    GrammarChecker(ll).check(StructuredOutputs(grammar=f'start: r0\n{chain}\nr{num_rules}: "done"'))
    xs = " ".join(['"x"'] * 11)
    forced = "\n".join(f"r{i}: {xs} r{i + 1}" for i in range(num_rules))  # 33,000 forced lexemes
    with pytest.raises(InvalidRequestError) as info:
        GrammarChecker(ll).check(StructuredOutputs(grammar=f'start: ("a"|"b") r0\n{forced}\nr{num_rules}: "done"'))
    assert "forces a run of" in info.value.message
