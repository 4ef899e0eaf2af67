"""A streamed answer is the non-streamed answer: with the same deltas (or, on the server, temperature 0), the
stream's chunks or events add up to the body, on every endpoint, judged by the SDKs' own stream accumulators (openai's
ChatCompletionStreamState and ResponseStreamState, anthropic's accumulate_event) and by a plain reassembly.

The first half feeds the renderers the servers use the same text cut at seeded random places (markers split
anywhere), streamed and not: content, reasoning, tool calls of every parser, logprobs, finish and stop reasons,
n > 1. The second half asks one served SmolLM2 each question twice, streamed and not: completions (echo, logprobs,
stop strings, n, usage), chat (logprobs, n, stop, usage, forced tool calls, json_schema), Responses and Messages."""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pagoda.services.protocol.render import CHAT, PromptRenderer, renderer_for, usage_dict
from pagoda.shared.messages import FinishReason, PositionLogprobs, RenderSpec, TextDelta, TokenLogprob

# --------------------------------------------------------------------------------------------
# the renderers, fed the same deltas both ways

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2]}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
# (tool_mode, tool_parser, reasoning_parser, max_calls) -> texts a model may write
CHAT_CASES: list[tuple[tuple[str, str, str | None, int], str]] = [
    (("auto", "hermes", None, 0), "Sure.\n" + CALL),
    (("auto", "hermes", None, 0), "\n\n" + CALL + "\n" + CALL2),
    (("auto", "hermes", None, 0), "  Let me see. \n " + CALL),
    (("auto", "hermes", None, 1), CALL + CALL2),
    (("auto", "hermes", None, 0), "Text, then a broken call:\n<tool_call>{not json"),
    (("auto", "hermes", None, 0), "a < b and <tool but no call, ends with space \n"),
    (("auto", "hermes", None, 0), "cut off: " + CALL[:30]),
    (("auto", "mistral", None, 0), 'ok \n[TOOL_CALLS] [{"name": "f", "arguments": {"q": "z"}}]'),
    (("auto", "mistral", None, 0), '[TOOL_CALLS]f[ARGS]{"q": 1}[TOOL_CALLS]g[ARGS]{}'),
    (("auto", "llama3_json", None, 0), ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}'),
    (("auto", "llama3_json", None, 0), '<|python_tag|>{"name": "f", "arguments": "{\\"a\\": 2}"}'),
    (("auto", "llama3_json", None, 0), "{not a call} and text"),
    (("required", "hermes", None, 0), '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'),
    (("required", "hermes", None, 0), '[{"name": "f", "param'),
    (("named", "hermes", None, 0), '{"a": 1, "b": "x"}'),
    (("named", "hermes", "deepseek_r1", 0), "all of it is reasoning, the call never starts"),
    (("none", "hermes", "qwen3", 0), "<think>Two and two.\nFour.</think>\n\nThe answer is 4."),
    (("none", "hermes", "qwen3", 0), "No think block </think> here."),
    (("none", "hermes", "qwen3", 0), "<think>cut off inside the think bl"),
    (("none", "hermes", "deepseek_r1", 0), "reasoning first</think>then the answer"),
    (("auto", "hermes", "qwen3", 0), "<think>I should call it.</think>\nOn it.\n" + CALL),
    (("auto", "mistral", "deepseek_r1", 0), 'hm</think>[TOOL_CALLS] [{"name": "f", "arguments": {}}]'),
]


def _cuts(text: str, seed: int) -> list[str]:
    """The text as token pieces cut at seeded random places (several cuts per marker, on average)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, max(1, len(text) // 3))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _logprob(token: str, k: int) -> PositionLogprobs:
    top = [TokenLogprob(f"alt{j}", j, -2.0 - j - k / 7, list(f"alt{j}".encode())) for j in range(2)]
    return PositionLogprobs(TokenLogprob(token, 100 + k, -0.5 - k / 10, list(token.encode())), top)


def render_both(spec: RenderSpec, pieces: list[list[str]], reasons: list[int],
                stop_reasons: list[str | int | None]) -> tuple[bytes, dict[str, Any]]:
    """(the SSE bytes, the body) of one prompt whose n = len(pieces) choices write these pieces, one token each,
    rendered as the servers render them: the tokenizer's PromptRenderer, the api's closing and body."""
    n = len(pieces)
    out: dict[bool, Any] = {}
    for stream in (True, False):
        mode = msgspec.structs.replace(spec, stream=stream)
        renderer = PromptRenderer(mode, n, "", [1, 2, 3])
        data, choices = [renderer.opening()], {}
        for k in range(max(map(len, pieces))):  # one step: every running choice gains a token
            for index, choice_pieces in enumerate(pieces):
                if k >= len(choice_pieces):
                    continue
                last = k == len(choice_pieces) - 1
                piece = choice_pieces[k]
                delta = TextDelta("r", index, piece, 1, reasons[index] if last else -1,
                                  [_logprob(piece, k)] if spec.want_logprobs else [],
                                  stop_reason=stop_reasons[index] if last else None)
                rendered = renderer.render(delta)
                if stream:
                    data.append(rendered)
                elif rendered:
                    choices[index] = rendered
        api = renderer_for(mode)
        usage = usage_dict(3, sum(map(len, pieces)), 0)
        if stream:
            out[True] = b"".join(data) + api.closing(usage)
        else:
            view = renderer.view
            for choice in view.choices:
                choice.rendered = choices[choice.index]
            out[False] = json.loads(msgspec.json.encode(api.body(view, usage)))
    return out[True], out[False]


def sse_payloads(data: bytes) -> list[dict[str, Any]]:
    """The JSON of each `data:` event; [DONE] comes exactly once, last."""
    blocks = data.decode().split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("data: ") and "\n" not in b for b in blocks[:-1]), data[:300]
    payloads = [b.removeprefix("data: ") for b in blocks[:-1]]
    assert payloads.count("[DONE]") == 1 and payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def accumulate_chat(chunks: list[dict[str, Any]]) -> ChatCompletion:
    """The openai SDK's own reassembly of a chat stream (`client.chat.completions.stream`'s snapshot; its final
    completion would refuse a choice cut off by length)."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return ChatCompletion.model_validate(state.current_completion_snapshot.model_dump())


def check_chat_chunks(chunks: list[dict[str, Any]], n: int) -> dict[int, Any]:
    """Every chunk's envelope; each choice's role comes first and once, its finish_reason last and once; each tool
    call's first delta alone carries its id, type and name, every later one only argument text. Returns each
    choice's stop_reason."""
    stop_reasons: dict[int, Any] = {}
    assert len({(c["id"], c["created"], c["model"], c["object"]) for c in chunks}) == 1
    finished: set[int] = set()
    ids: dict[tuple[int, int], str] = {}
    roles: list[int] = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            index = choice["index"]
            assert 0 <= index < n and index not in finished, chunk
            delta = choice["delta"]
            if "role" in delta:
                roles.append(index)
            else:
                assert index in roles, "a choice's first chunk carries its role"
            if choice["finish_reason"] is not None:
                finished.add(index)
                stop_reasons[index] = choice["stop_reason"]  # vLLM's field, which the SDK's snapshot leaves out
                assert delta == {}, "the finish_reason comes on a chunk of its own, after the text"
            for call in delta.get("tool_calls", []):
                key = (index, call["index"])
                if "id" in call:
                    assert key not in ids and call["type"] == "function" and call["function"]["name"]
                    assert call["id"].startswith("call_") and call["function"]["arguments"] == ""
                    ids[key] = call["id"]
                else:
                    assert key in ids and set(call) == {"index", "function"} and set(call["function"]) == {
                        "arguments"}
    assert sorted(roles) == list(range(n)) and finished == set(range(n))
    assert len(set(ids.values())) == len(ids), "tool call ids are unique"
    return stop_reasons


def same_chat_answer(streamed: ChatCompletion, whole: ChatCompletion, *, want_logprobs: bool) -> None:
    """The SDK's reassembled stream and the body: the same choices, in order, field by field (tool call ids are
    random: each side's own, compared by shape)."""
    assert [c.index for c in streamed.choices] == [c.index for c in whole.choices] == list(range(len(whole.choices)))
    for got, want in zip(streamed.choices, whole.choices, strict=True):
        assert (got.message.content or "") == (want.message.content or ""), got.index
        extra_got, extra_want = got.message.model_extra or {}, want.message.model_extra or {}
        for name in ("reasoning", "reasoning_content"):
            assert (extra_got.get(name) or "") == (extra_want.get(name) or ""), name
        calls = [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []]
        assert calls == [(c.function.name, c.function.arguments) for c in want.message.tool_calls or []]
        assert got.finish_reason == want.finish_reason
        if want_logprobs:
            assert got.logprobs is not None and want.logprobs is not None
            assert [t.model_dump() for t in got.logprobs.content or []] == \
                [t.model_dump() for t in want.logprobs.content or []]
        else:
            assert got.logprobs is None and want.logprobs is None


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("mode", "text"), CHAT_CASES, ids=[f"{c[0][0]}-{c[0][1]}-{c[0][2]}-{i}"
                                                             for i, c in enumerate(CHAT_CASES)])
def test_chat_stream_reassembles_into_the_body(mode: tuple[str, str, str | None, int], text: str, seed: int) -> None:
    tool_mode, tool_parser, reasoning_parser, max_calls = mode
    spec = RenderSpec(CHAT, "chatcmpl-1", "m", 1700000000, True, want_logprobs=seed != 1, include_usage=True,
                      tool_mode=tool_mode, tool_parser=tool_parser, tool_name="f" if tool_mode == "named" else "",
                      reasoning_parser=reasoning_parser, max_calls=max_calls)
    # n = 2: the second choice writes the same text cut elsewhere and ends by length, the first by a stop string
    pieces = [_cuts(text, seed), _cuts(text, seed + 10)]
    data, body = render_both(spec, pieces, [FinishReason.STOP, FinishReason.LENGTH], ["\n\n", None])
    chunks = sse_payloads(data)
    stop_reasons = check_chat_chunks(chunks[:-1], 2)
    assert stop_reasons == {c["index"]: c["stop_reason"] for c in body["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    whole = ChatCompletion.model_validate(body)
    same_chat_answer(accumulate_chat(chunks), whole, want_logprobs=spec.want_logprobs)
