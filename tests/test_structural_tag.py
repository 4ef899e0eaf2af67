"""vLLM's structural tags: free text in which each trigger goes on as a structure (begin, JSON of a schema, end).
The shape checks, the grammar against SmolLM2's tokenizer (text and special-token triggers), and the server's three
ways to ask (response_format, structured_outputs, the deprecated top-level field) on a tiny random model, and
xgrammar's format form there (its grammars are test_structural_tag_format.py's)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llguidance
import pytest

from pagoda.services.grammar.compiler import grammar_text
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import StructuredOutputs
from tests.harness import SERVED, Server, http_client, running_server, tiny_llama_over_smollm2_vocab

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
           "additionalProperties": False}
TOOLS_TAG = {"structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
                            {"begin": "<|im_start|>n=", "schema": {"type": "integer"}, "end": ";"}],
             "triggers": ["<function=", "<|im_start|>"]}


def _constraint(tag: dict[str, Any]) -> StructuredOutputs:
    return StructuredOutputs(structural_tag=json.dumps(tag)).validate()


@pytest.mark.parametrize(("tag", "param", "needle"), [
    ({"structures": [], "triggers": ["<f"]}, "structured_outputs.structural_tag.structures", "1 to"),
    ({"structures": [{"begin": "<f>", "schema": {}, "end": ""}], "triggers": []},
     "structured_outputs.structural_tag.triggers", "non-empty"),
    ({"structures": [{"begin": "<g>", "schema": {}, "end": ""}], "triggers": ["<f"]},
     "structured_outputs.structural_tag.structures[0].begin", "none of the triggers"),
    ({"structures": [{"begin": "<f>", "schema": "x", "end": ""}], "triggers": ["<f"]},
     "structured_outputs.structural_tag.structures[0]", "JSON schema object"),
    ({"structures": [{"begin": "<f>", "end": ""}], "triggers": ["<f"]},
     "structured_outputs.structural_tag.structures[0]", "JSON schema object"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "structured_outputs.structural_tag.format",
     "needs tags, triggers"),
    ({"structures": [{"begin": "<f>", "schema": {}, "end": ""}], "triggers": ["<f"], "at_least_one": True},
     "structured_outputs.structural_tag", "at_least_one"),
])
def test_a_malformed_structural_tag_is_refused_naming_the_part(tag: dict[str, Any], param: str, needle: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        _constraint(tag)
    assert caught.value.param == param and needle in caught.value.message
    with pytest.raises(InvalidRequestError, match="not JSON"):
        StructuredOutputs(structural_tag="{").validate()


def _accepts(ll: llguidance.LLTokenizer, grammar: str, token_ids: list[int]) -> bool:
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    return matcher.consume_tokens(token_ids) and not matcher.is_error() and matcher.is_accepting()


def test_the_grammar_holds_text_with_structures_where_triggers_appear(ll: llguidance.LLTokenizer,
                                                                      tokenizer: Tokenizer) -> None:
    """Free text; a text trigger anywhere goes on as its structure (JSON as every JSON constraint writes it); a
    special-token trigger is that token (its spelling in text is free text); no trigger: any text."""
    grammar = grammar_text(_constraint(TOOLS_TAG), ll)
    im_start = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    assert len(im_start) == 1

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    assert _accepts(ll, grammar, ids("plain text, no call"))
    assert _accepts(ll, grammar, ids('I check. <function=get_weather>{"city": "Oslo"}</function> Done.'))
    assert _accepts(ll, grammar, ids('<function=get_weather>{"city": "a"}</function><function=get_weather>'
                                     '{"city": "b"}</function>'))
    assert not _accepts(ll, grammar, ids('<function=get_time>{"city": "Oslo"}</function>'))  # no such structure
    assert not _accepts(ll, grammar, ids('<function=get_weather>{"town": "Oslo"}</function>'))  # off the schema
    assert not _accepts(ll, grammar, ids('<function=get_weather>{"city":"Oslo"}</function>'))  # free whitespace
    assert not _accepts(ll, grammar, ids('<function=get_weather>{"city": "Oslo"}'))  # unfinished
    assert _accepts(ll, grammar, ids("a ") + im_start + ids("n=42; b"))
    assert not _accepts(ll, grammar, ids("a ") + im_start + ids("n=x;"))
    # a trigger that is no special token of this tokenizer, though written as one, is text
    text_trigger = {"structures": [{"begin": "<tool>", "schema": {"type": "integer"}, "end": "</tool>"}],
                    "triggers": ["<tool>"]}
    grammar = grammar_text(_constraint(text_trigger), ll)
    assert _accepts(ll, grammar, ids("x <tool>7</tool> y")) and not _accepts(ll, grammar, ids("x <tool>y</tool>"))


# --------------------------------------------------------------------------------------------
# the server

# The random model is pushed to write the trigger "e" (logit_bias): free, it writes "eee..."; held, each "e" goes on
# as its structure, one digit, then "!", and the next "e" follows.
E_TAG = {"structures": [{"begin": "e", "schema": {"type": "integer", "minimum": 0, "maximum": 9}, "end": "!"}],
         "triggers": ["e"]}
E_RULE = re.compile(r"e(?!\d!)")
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Server]:
    model = tiny_llama_over_smollm2_vocab(tmp_path_factory.mktemp("tiny-structural-tag"), smollm2_dir)
    with running_server(model, "--max-model-len", "256", "--num-kv-blocks", "64",
                        "--served-model-name", SERVED) as running:
        yield running


def _complete(server: Server, **fields: Any) -> Any:
    body = {"model": SERVED, "prompt": "The weather here", "max_tokens": 24, "temperature": 1.0, **fields}
    return http_client().post(server.url + "/v1/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def favour_e(tokenizer: Tokenizer) -> dict[str, float]:
    [e_id] = tokenizer.encode("e", add_special_tokens=False)
    return {str(e_id): 100.0}


def _complete_text(text: str) -> str:
    """The output less an unfinished structure at its end (max_tokens may cut one)."""
    return re.sub(r"e\d?$", "", text)


@pytest.mark.parametrize("how", ["response_format", "structured_outputs", "structural_tag"])
def test_the_server_holds_each_trigger_to_its_structure(server: Server, favour_e: dict[str, float], how: str) -> None:
    fields = {"response_format": {"response_format": {"type": "structural_tag", **E_TAG}},
              "structured_outputs": {"structured_outputs": {"structural_tag": json.dumps(E_TAG)}},
              "structural_tag": {"structural_tag": json.dumps(E_TAG)}}[how]
    seen = 0
    for seed in range(2):
        response = _complete(server, seed=seed, logit_bias=favour_e, **fields)
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["text"]
        assert not E_RULE.search(_complete_text(text)), text
        seen += text.count("e")
        if how == "structural_tag":  # vLLM's deprecated field: named in the Warning header
            assert "structural_tag is deprecated" in response.headers["Warning"]
    unconstrained = _complete(server, logit_bias=favour_e).json()["choices"][0]["text"]
    assert seen and E_RULE.search(unconstrained), "the random model writes e followed by other text when free"


# xgrammar's format form of E_TAG
E_FORMAT = {"type": "triggered_tags", "triggers": ["e"], "tags": [{"type": "tag", "begin": "e", "content": {
    "type": "json_schema", "json_schema": E_TAG["structures"][0]["schema"]}, "end": "!"}]}


def test_the_server_holds_the_format_form(server: Server, favour_e: dict[str, float]) -> None:
    response = _complete(server, seed=0, logit_bias=favour_e,
                         response_format={"type": "structural_tag", "format": E_FORMAT})
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    assert "e" in text and not E_RULE.search(_complete_text(text)), text


def test_structural_tag_refusals_name_the_field(server: Server) -> None:
    bad = {"structures": [{"begin": "x", "schema": {}, "end": ""}], "triggers": ["e"]}
    refused = _complete(server, response_format={"type": "structural_tag", **bad})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"
    refused = _complete(server, response_format={"type": "structural_tag", "format": {"type": "token", "token": 1}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format.format.type"
    unended = {"type": "sequence", "elements": [{"type": "any_text"}, {"type": "const_string", "value": "."}]}
    refused = _complete(server, response_format={"type": "structural_tag", "format": unended})  # the compiler's
    assert refused.status_code == 400 and "format.elements[0]" in refused.json()["error"]["message"]
    refused = _complete(server, structured_outputs={"structural_tag": json.dumps(E_TAG)}, guided_regex="a")
    assert refused.status_code == 400
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = http_client().post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "tools": tools,
        "tool_choice": "required", "response_format": {"type": "structural_tag", **E_TAG}})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "tool_choice"


def test_the_offline_guided_decoding_params_take_a_structural_tag() -> None:
    """vLLM's GuidedDecodingParams(structural_tag=...) becomes the same constraint as the server's."""
    from pagoda.params import GuidedDecodingParams

    text = json.dumps(E_TAG)
    assert GuidedDecodingParams(structural_tag=text).structured_outputs() == StructuredOutputs(structural_tag=text)
