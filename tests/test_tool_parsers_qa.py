"""Tool-call and reasoning output as vLLM's users expect it, on the parsers and builders alone (no server): what the
models write, cut anywhere, gives the same answer streamed and whole, on chat, Messages and Responses."""

from __future__ import annotations

import json
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
