"""Tool-call and reasoning output as vLLM's users expect it, on the parsers and builders alone (no server): what the
models write, cut anywhere, gives the same answer streamed and whole, on chat, Messages and Responses."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda.services.protocol.anthropic import BlockBuilder
from pagoda.services.protocol.chat_output import ChatOutputSpec
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
