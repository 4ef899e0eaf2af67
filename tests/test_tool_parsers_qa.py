"""Tool-call and reasoning output as vLLM's users expect it, on the parsers and builders alone (no server): what the
models write, cut anywhere, gives the same answer streamed and whole, on chat, Messages and Responses."""

from __future__ import annotations

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
