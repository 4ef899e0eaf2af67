"""Tool-call and reasoning output as vLLM's users expect it, on the parsers and builders alone (no server): what the
models write, cut anywhere, gives the same answer streamed and whole, on chat, Messages and Responses."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from pagoda.services.protocol.anthropic import BlockBuilder
from pagoda.services.protocol.chat_output import ChatOutputSpec, ChoiceStream, whole_message
from pagoda.shared.messages import FinishReason


def _blocks(spec: ChatOutputSpec, pieces: list[str]) -> list[dict[str, Any]]:
    """The Messages content blocks of a completion written as these pieces."""
    builder = BlockBuilder(spec)
    for piece in pieces:
        builder.push(piece)
    builder.finish(FinishReason.STOP, None)
    return [block.json() for block in builder.blocks]


@pytest.mark.parametrize("pieces", [["   "], [" \n", "\n"], ["  ", "", "\t"]])
def test_messages_whitespace_answer_is_shown_once(pieces: list[str]) -> None:
    """An answer of whitespace alone is its text block, as written (the held space was added twice)."""
    for spec in (ChatOutputSpec("auto", "hermes"), ChatOutputSpec("auto", "llama3_json"), ChatOutputSpec()):
        assert _blocks(spec, pieces) == [{"type": "text", "text": "".join(pieces)}]
    thought = _blocks(ChatOutputSpec(reasoning_parser="qwen3"), ["<think>x</think>", *pieces])
    assert thought[1:] == [{"type": "text", "text": "".join(pieces)}]


MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")  # what Mistral's chat templates accept back (else they raise)


@pytest.mark.parametrize(("spec", "text"), [
    (ChatOutputSpec("auto", "mistral"), '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", '
                                        '"arguments": {}}]'),
    (ChatOutputSpec("auto", "mistral"), '[TOOL_CALLS]f[ARGS]{"a": 1}'),
    (ChatOutputSpec("required", "mistral"), '[{"name": "f", "parameters": {"a": 1}}]'),
    (ChatOutputSpec("named", "mistral", "f"), '{"a": 1}'),
])
def test_mistral_call_ids_are_nine_alphanumerics(spec: ChatOutputSpec, text: str) -> None:
    """Mistral's templates raise "Tool call IDs should be alphanumeric strings with length 9!" on the next turn
    otherwise: vLLM's mistral parser gives such ids (MistralToolCall), whole and streamed; other parsers keep call_."""
    message, _ = whole_message(spec, text)
    stream = ChoiceStream(spec)
    deltas = [d for ch in text for d in stream.push(ch)] + stream.finish()[0]
    streamed = [c["id"] for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    ids = [c["id"] for c in message["tool_calls"]] + streamed
    assert ids and all(MISTRAL_ID.fullmatch(i) for i in ids), ids
    hermes, _ = whole_message(ChatOutputSpec("named", "hermes", "f"), text)
    assert hermes["tool_calls"][0]["id"].startswith("call_")


def test_messages_tool_use_ids_under_the_mistral_parser_are_nine_alphanumerics() -> None:
    """The Messages API's tool_use ids come back as the chat template's call ids next turn: under the mistral parser
    they take Mistral's form (its templates refuse others); Anthropic's toolu_ form elsewhere."""
    mistral = _blocks(ChatOutputSpec("auto", "mistral"), ['[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]'])
    assert [b["type"] for b in mistral] == ["tool_use"] and MISTRAL_ID.fullmatch(mistral[0]["id"]), mistral
    hermes = _blocks(ChatOutputSpec("auto", "hermes"), ['<tool_call>{"name": "f", "arguments": {}}</tool_call>'])
    assert hermes[0]["id"].startswith("toolu_"), hermes


def test_hermes_argument_that_holds_the_closing_tag() -> None:
    """A call's object is read as JSON, not cut at the first `</tool_call>`: an argument may hold that text (a coding
    agent writing a parser, a template); the answer was all content before. Streamed too."""
    code = 'print("<tool_call>{}</tool_call>")\n'
    text = ("Writing it.\n<tool_call>\n" + json.dumps({"name": "write_file", "arguments": {"text": code}})
            + "\n</tool_call>\n<tool_call>\n{\"name\": \"run\", \"arguments\": {}}\n</tool_call>")
    spec = ChatOutputSpec("auto", "hermes")
    message, calls_tools = whole_message(spec, text)
    assert calls_tools and message["content"] == "Writing it."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("write_file", {"text": code}), ("run", {})]
    stream = ChoiceStream(spec)
    deltas = [d for i in range(0, len(text), 3) for d in stream.push(text[i:i + 3])] + stream.finish()[0]
    assert "".join(d.get("content", "") for d in deltas) == "Writing it."
    assert [c["function"].get("arguments") for d in deltas for c in d.get("tool_calls", []) if "id" not in c] == [
        c["function"]["arguments"] for c in message["tool_calls"]]
    # still content: text after an object inside the tag, an unclosed object, a tag with no object
    for broken in ('<tool_call>{"name": "f", "arguments": {}} and more</tool_call>',
                   '<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"',
                   'a <tool_call> b</tool_call>'):
        assert whole_message(spec, broken) == ({"role": "assistant", "content": broken}, False)


FRAGMENTS = ['<tool_call>', '</tool_call>', '{', '}', '[', ']', '"name"', ': ', '"f"', ', ', '"arguments"',
             '"parameters"', '{}', '"x"', '1', 'null', '\\', '"', '\n', ' ', 'text', '<think>', '</think>',
             '[TOOL_CALLS]', '[ARGS]', '<|python_tag|>', ';', 'é', '🎉', '<', '<tool', '</think', '<th', '[TOOL']
SPECS = [ChatOutputSpec(mode, parser, "f" if mode == "named" else "", reasoning, max_calls)
         for mode in ("auto", "required", "named", "none") for parser in ("hermes", "mistral", "llama3_json")
         for reasoning in (None, "qwen3", "deepseek_r1") for max_calls in (0, 1)]


def _client_view(deltas: list[dict[str, Any]]) -> tuple[str, str, list[tuple[str, str]]]:
    """(content, reasoning, [(name, arguments)]) as a client joins the deltas."""
    content, reasoning, calls = "", "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning") or ""
        for call in delta.get("tool_calls", []):
            name, arguments = calls.get(call["index"], ("", ""))
            calls[call["index"]] = (call["function"].get("name") or name,
                                    arguments + (call["function"].get("arguments") or ""))
    return content, reasoning, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("seed", range(4))
def test_any_text_cut_anywhere_streams_to_the_whole_answer(seed: int) -> None:
    """Seeded random texts of markers, JSON pieces and multi-byte characters, for every parser, mode and reasoning
    parser, cut at random places: no exception, and the joined deltas are the whole message."""
    rng = random.Random(seed)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 24)))
        spec = rng.choice(SPECS)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        message, calls_tools = whole_message(spec, text)
        stream = ChoiceStream(spec)
        deltas = [d for piece in pieces for d in stream.push(piece)]
        more, streamed_calls = stream.finish()
        content, reasoning, calls = _client_view(deltas + more)
        assert streamed_calls == calls_tools, (spec, pieces)
        assert content == (message["content"] or ""), (spec, pieces)
        assert reasoning == (message.get("reasoning") or ""), (spec, pieces)
        assert calls == [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]


ARGS = {"q": 'say "hi" \\ C:\\dir', "u": "日本語 🎉", "n": {"deep": [1, {"z": None}]}}
# (parser, what the model writes, content, [(name, arguments)]) as vLLM's parsers of the same name read them
REAL = [
    ("hermes", "I'll check.\n\n<tool_call>\n" + json.dumps({"name": "a", "arguments": ARGS}, ensure_ascii=False)
     + '\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>', "I'll check.",
     [("a", ARGS), ("b", {})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\nWaiting for the result.', None,
     [("a", {"x": 1})]),  # text after the calls is dropped, as vLLM's hermes drops it
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}', None, [("a", {"x": 1})]),  # cut before the close
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1', '<tool_call>\n{"name": "a", "arguments": {"x": 1',
     []),  # cut inside the object: content
    ("hermes", "<tool_call>\n{'name': 'a', 'arguments': {}}\n</tool_call>",
     "<tool_call>\n{'name': 'a', 'arguments': {}}\n</tool_call>", []),  # not JSON: content
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": ' + json.dumps(ARGS, ensure_ascii=False) + "}", None,
     [("a", ARGS)]),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", {"x": 1}), ("b", {})]),
    ("mistral", "[TOOL_CALLS] [" + json.dumps({"name": "a", "arguments": ARGS}, ensure_ascii=False) + "]", None,
     [("a", ARGS)]),
    ("mistral", 'Sure. [TOOL_CALLS]a[ARGS]{"x": "é"}[TOOL_CALLS]b[ARGS]{}', "Sure.", [("a", {"x": "é"}), ("b", {})]),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), REAL)
def test_what_models_write_parses_whole_and_streamed(parser: str, text: str, content: str | None,
                                                     calls: list[tuple[str, Any]]) -> None:
    spec = ChatOutputSpec("auto", parser)
    message, calls_tools = whole_message(spec, text)
    assert message["content"] == content and calls_tools == bool(calls)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls", [])] == calls
    for size in (1, 2, 5):
        stream = ChoiceStream(spec)
        deltas = [d for i in range(0, len(text), size) for d in stream.push(text[i:i + size])]
        more, streamed_calls = stream.finish()
        got_content, _, got_calls = _client_view(deltas + more)
        assert streamed_calls == calls_tools and got_content == (content or "")
        assert [(name, json.loads(arguments)) for name, arguments in got_calls] == calls
