"""--max-prompt-bytes counts every string the chat template renders into the prompt: prompt texts, message
contents, the assistant turns' tool calls (names and arguments) and the tool definitions (as JSON). Before, tool
calls and definitions were not counted, so a request could bring megabytes of template input past the bound."""

from __future__ import annotations

import json

import msgspec

from pagoda.services.protocol.responses import decode_responses_body, to_chat
from pagoda.services.protocol.schemas import ChatBody, CompletionBody, TokenizeBody, decode_body, prompt_bytes

TOOL = {"type": "function", "function": {"name": "lookup", "description": "Looks a word up.",
                                         "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}


def _decode(kind: type, **fields: object) -> object:
    return decode_body(json.dumps({"model": "m", **fields}).encode(), kind)


def _tool_turns(arguments: str) -> list[dict[str, object]]:
    call = {"id": "call-1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
    return [{"role": "user", "content": "Look up 'é'."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call-1", "content": "found"}]


def test_prompt_texts_count_their_utf8_bytes() -> None:
    assert prompt_bytes(_decode(CompletionBody, prompt="héllo")) == 6
    assert prompt_bytes(_decode(CompletionBody, prompt=["ab", [1, 2, 3], "c"])) == 3  # token ids count 0


def test_tool_call_names_and_arguments_count() -> None:
    arguments = json.dumps({"word": "é" * 1000})
    body = _decode(ChatBody, messages=_tool_turns(arguments))
    contents = len("Look up 'é'.".encode()) + len(b"found")
    assert prompt_bytes(body) == contents + len(b"lookup") + len(arguments.encode())


def test_tool_definitions_count_as_json() -> None:
    messages = [{"role": "user", "content": "hi"}]
    tools = [TOOL, TOOL | {"function": TOOL["function"] | {"name": "other", "description": "d" * 5000}}]
    for kind in (ChatBody, TokenizeBody):
        with_tools = prompt_bytes(_decode(kind, messages=messages, tools=tools))
        assert with_tools == 2 + len(msgspec.json.encode(tools))
        assert with_tools > 5000 > prompt_bytes(_decode(kind, messages=messages))


def test_responses_input_counts_function_calls_and_tools() -> None:
    arguments = json.dumps({"word": "x" * 3000})
    request = {"model": "m", "input": [
        {"type": "message", "role": "user", "content": "Look it up."},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": arguments},
        {"type": "function_call_output", "call_id": "c1", "output": "found"}],
        "tools": [{"type": "function", "name": "lookup", "parameters": TOOL["function"]["parameters"]}]}
    chat = to_chat(decode_responses_body(json.dumps(request).encode())).chat
    assert prompt_bytes(chat) >= len(arguments) + len("Look it up.found")
    assert prompt_bytes(chat) - len(msgspec.json.encode(chat.tools)) == len("Look it up.lookupfound") + len(arguments)
