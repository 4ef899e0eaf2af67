"""The routes and the offline API treat the same request alike: an earlier answer's reasoning reaches the chat
template from chat's `reasoning`, Responses' reasoning items and Anthropic's thinking blocks; LLM.chat refuses the
answer fields the server refuses; a message's text parts cross the api -> tokenizer wire once; `service_tier` is
taken and refused alike on chat and Responses. Unit-level: no model runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pagoda.services.protocol.anthropic import decode_messages_body
from pagoda.services.protocol.anthropic import to_chat as messages_to_chat
from pagoda.services.protocol.responses import decode_responses_body, rename_error
from pagoda.services.protocol.responses import to_chat as responses_to_chat
from pagoda.services.protocol.schemas import ChatBody, chat_request, decode_body, prompt_bytes
from pagoda.services.tokenizer.prompts import chat_dicts, tokenize_prompt
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import GenerateRequest
from tests.test_chat_template_parity import CONTENT_PARTS, QWEN3, tokenizer_folder

WEATHER_CALL = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def chat(body: dict[str, Any]) -> GenerateRequest:
    return chat_request(decode_body(json.dumps(body).encode(), ChatBody), "chat_test", 0.0)


def via_responses(body: dict[str, Any]) -> GenerateRequest:
    form = responses_to_chat(decode_responses_body(json.dumps(body).encode()))
    try:
        return chat_request(form.chat, "resp_test", 0.0)
    except InvalidRequestError as exc:
        raise rename_error(exc) from None


def via_messages(body: dict[str, Any]) -> GenerateRequest:
    form = messages_to_chat(decode_messages_body(json.dumps({"model": "m", "max_tokens": 16, **body}).encode()))
    return chat_request(form.chat, "msg_test", 0.0)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(tokenizer_folder(tmp_path_factory.mktemp("qwen3"), QWEN3))


def prompt(tokenizer: Tokenizer, request: GenerateRequest) -> str:
    text = tokenize_prompt(tokenizer, prompt_text=None, prompt_token_ids=None, messages=request.messages,
                           tools=request.tools or None).text
    assert text is not None
    return text


# --------------------------------------------------------------------------------------------
# 1. an earlier answer's reasoning, on every route


CHAT_TOOL_LOOP = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "Let me look.", "reasoning": "I should look it up.", "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "5 C"}]}


def test_responses_reasoning_items_reach_the_template_as_chats_reasoning(qwen3: Tokenizer) -> None:
    """A reasoning item sent back (as pagoda's answers write it: reasoning, message, calls) is the reasoning of the
    assistant turn its message and calls make, as chat's `reasoning` is: the same messages, the same prompt."""
    want = chat(CHAT_TOOL_LOOP)
    items = [{"role": "user", "content": "Weather in Oslo?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "I should look it up."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "5 C"}]
    got = via_responses({"input": items, "tools": [{"type": "function", "name": "get_weather",
                                                    "parameters": {"type": "object"}}]})
    assert got.messages == want.messages
    assert "<think>\nI should look it up.\n</think>" in prompt(qwen3, got) == prompt(qwen3, want)
    # a summary only (OpenAI's answers carry no content): the summary is the reasoning
    items[1] = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "I should look it up."}]}
    assert via_responses({"input": items}).messages[1].reasoning == "I should look it up."
    # reasoning then a call, with no message between: one turn of empty content
    turn = via_responses({"input": [items[0], items[1], *items[3:]]}).messages[1]
    assert (turn.role, turn.content, turn.reasoning, len(turn.tool_calls)) == (
        "assistant", "", "I should look it up.", 1)


def test_anthropic_thinking_blocks_reach_the_template_as_chats_reasoning(qwen3: Tokenizer) -> None:
    want = chat(CHAT_TOOL_LOOP)
    got = via_messages({"tools": [{"name": "get_weather", "input_schema": {"type": "object"}}], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should look it up.", "signature": ""},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "5 C"}]}]})
    assert got.messages == want.messages
    assert "<think>\nI should look it up.\n</think>" in prompt(qwen3, got) == prompt(qwen3, want)


def test_reasoning_counts_toward_the_prompt_bytes() -> None:
    """The template renders it, so --max-prompt-bytes counts it as it counts the content."""
    body = decode_body(json.dumps(CHAT_TOOL_LOOP).encode(), ChatBody)
    without = decode_body(json.dumps({**CHAT_TOOL_LOOP, "messages": [
        {k: v for k, v in m.items() if k != "reasoning"} for m in CHAT_TOOL_LOOP["messages"]]}).encode(), ChatBody)
    assert prompt_bytes(body) - prompt_bytes(without) == len("I should look it up.")


# --------------------------------------------------------------------------------------------
# 2. LLM.chat refuses what the server refuses


ANSWER_VALUES = [("refusal", "I can't help with that."), ("annotations", [{"type": "url_citation"}]),
                 ("audio", {"id": "audio_1"}), ("function_call", {"name": "f", "arguments": "{}"})]


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> Any:
    from pagoda.llm import LLM

    return LLM("tiny", load_format="dummy", tokenizer=str(smollm2_dir), num_kv_blocks=16, max_model_len=256)


@pytest.mark.parametrize(("field", "value"), ANSWER_VALUES)
def test_llm_chat_refuses_the_answer_fields_the_server_refuses(llm: Any, field: str, value: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", field: value},
                {"role": "user", "content": "Bye"}]
    with pytest.raises(InvalidRequestError) as served:
        chat({"messages": messages})
    with pytest.raises(InvalidRequestError) as offline:
        llm.chat(messages)
    assert (offline.value.param, offline.value.message) == (served.value.param, served.value.message)
    assert offline.value.param == f"messages[1].{field}"


def test_llm_chat_takes_the_answer_fields_null(llm: Any) -> None:
    """As the openai SDK's model_dump() of an answer writes them (annotations also empty), on both paths."""
    dumped = {"role": "assistant", "content": "Hello", "refusal": None, "annotations": [], "audio": None,
              "function_call": None}
    messages = [{"role": "user", "content": "Hi"}, dumped, {"role": "user", "content": "Bye"}]
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
             {"role": "user", "content": "Bye"}]
    assert chat({"messages": messages}).messages == chat({"messages": plain}).messages
    tokenizer = llm.engine.tokenizer  # what LLM.chat renders with
    assert tokenizer.render_chat(messages) == tokenizer.render_chat(plain)


# --------------------------------------------------------------------------------------------
# 3. text parts cross the wire once


def test_text_parts_cross_the_wire_once_and_reach_the_template_as_parts(tmp_path: Path) -> None:
    parts = ["alpha part one", "beta\npart two", ""]
    request = chat({"messages": [{"role": "user", "content": [{"type": "text", "text": t} for t in parts]}]})
    wire = msgspec.msgpack.encode(request)  # what the api sends the tokenizer (shared/transport.py)
    assert wire.count(b"alpha part one") == 1 and wire.count(b"beta\npart two") == 1
    decoded = msgspec.msgpack.decode(wire, type=GenerateRequest)
    assert decoded.messages is not None and decoded.messages[0].content == "\n".join(parts)
    assert chat_dicts(decoded.messages)[0]["content"] == [{"type": "text", "text": t} for t in parts]
    # a string's content stays a string
    plain = chat({"messages": [{"role": "user", "content": "alpha part one"}]})
    assert plain.messages is not None and chat_dicts(plain.messages)[0]["content"] == "alpha part one"
    text = prompt(Tokenizer(tokenizer_folder(tmp_path, CONTENT_PARTS)), decoded)
    assert "[alpha part one][beta\npart two][]" in text


# --------------------------------------------------------------------------------------------
# 4. service_tier


@pytest.mark.parametrize("tier", ["auto", "default", None])
def test_service_tier_that_names_the_one_tier_is_taken_on_chat_and_responses(tier: str | None) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert chat({"messages": messages, "service_tier": tier}).messages == chat({"messages": messages}).messages
    assert via_responses({"input": messages, "service_tier": tier}).messages == chat({"messages": messages}).messages


@pytest.mark.parametrize("tier", ["flex", "scale", "priority"])
def test_service_tier_that_would_be_ignored_is_refused_alike(tier: str) -> None:
    with pytest.raises(InvalidRequestError) as on_chat:
        chat({"messages": [{"role": "user", "content": "Hi"}], "service_tier": tier})
    with pytest.raises(InvalidRequestError) as on_responses:
        via_responses({"input": "Hi", "service_tier": tier})
    assert on_chat.value.param == on_responses.value.param == "service_tier"
    assert on_chat.value.message == on_responses.value.message
    assert "one service tier" in on_chat.value.message
