"""The tokenizer renders a response's bytes exactly as the api renders the same deltas (streams and bodies)."""

from __future__ import annotations

import itertools
import re
from typing import Any

import msgspec
import pytest

from pagoda.services.protocol.render import (
    CHAT,
    COMPLETION,
    Choice,
    PromptRenderer,
    PromptView,
    renderer_for,
    usage_dict,
)
from pagoda.shared.messages import FinishReason, PositionLogprobs, RenderSpec, TextDelta, TokenLogprob

CALL_ID = re.compile(rb"call_[0-9a-f]{24}")  # tool call ids are random: compared as one placeholder

TEXTS = {
    "plain": ["Hello", ",", " wor", "ld", "!"],
    "tools": ["Sure. ", "<tool", "_call>", '{"name": "get", ', '"arguments": {"city": "Oslo"}}', "</tool_call>"],
    "reasoning": ["<think>", "let me ", "think", "</think>", "The answer", " is 4."],
}


def _logprob(token: str, k: int) -> PositionLogprobs:
    top = [TokenLogprob(f"alt{j}", j, -1.0 - j, list(f"alt{j}".encode())) for j in range(2)]
    return PositionLogprobs(TokenLogprob(token, 100 + k, -0.5 - k / 10, list(token.encode())), top)


def steps_of(request_ids: list[str], n: int, pieces: list[str], logprobs: bool, echo_scores: bool,
             token_ids: bool, reasons: list[int]) -> list[list[TextDelta]]:
    """One batch per step: every completion of every prompt gains a piece; the last one finishes it."""
    steps = []
    for k, piece in enumerate(pieces):
        batch = []
        for request_id, index in itertools.product(request_ids, range(n)):
            last = k == len(pieces) - 1
            text = piece if index == 0 else piece.upper()
            scores = [_logprob(f"p{j}", j) for j in range(2)] if echo_scores and k == 0 and index == 0 else []
            batch.append(TextDelta(request_id, index, text, 1, reasons[index] if last else -1,
                                   [_logprob(text, k)] if logprobs else [], 3, None, scores,
                                   [200 + k] if token_ids else []))
        steps.append(batch)
    return steps


def api_side(spec: RenderSpec, n: int, prompt_texts: list[str], prompt_ids: list[list[int]],
             steps: list[list[TextDelta]]) -> tuple[bytes, PromptView]:
    """What the api renders from text: opening, then one chunks() call per step (streaming)."""
    request_index = {f"r{p}": p for p in range(len(prompt_texts))}
    view = PromptView(n, [Choice(i) for i in range(len(prompt_texts) * n)], dict(enumerate(prompt_texts)),
                      dict(enumerate(prompt_ids)), {p: [] for p in range(len(prompt_texts))})
    renderer = renderer_for(spec)
    out = [renderer.opening(view)] if spec.stream else []
    for batch in steps:
        applied = []
        for delta in batch:
            p = request_index[delta.request_id]
            choice = view.choices[p * n + delta.index]
            choice.apply(delta)
            view.prompt_logprobs[p].extend(delta.prompt_logprobs)
            applied.append((choice, delta))
        if spec.stream:
            out.append(renderer.chunks(applied))
    return b"".join(out), view


def tokenizer_side(spec: RenderSpec, n: int, prompt_texts: list[str], prompt_ids: list[list[int]],
                   steps: list[list[TextDelta]]) -> tuple[bytes, dict[int, bytes]]:
    """What the tokenizers render: each prompt's opening, then each delta's bytes (a choice's JSON when not
    streaming)."""
    renderers = {f"r{p}": PromptRenderer(msgspec.structs.replace(spec, first_choice=p * n), n, text, ids)
                 for p, (text, ids) in enumerate(zip(prompt_texts, prompt_ids, strict=True))}
    out = [r.opening() for r in renderers.values()]
    choices: dict[int, bytes] = {}
    for batch in steps:
        for delta in batch:
            data = renderers[delta.request_id].render(delta)
            if not spec.stream and data:
                choices[int(delta.request_id[1:]) * n + delta.index] = data
            elif spec.stream:
                out.append(data)
    return b"".join(out), choices


CASES = [
    # route, texts, n, prompts, stream, logprobs, echo, return_token_ids, tool_mode, reasoning
    (COMPLETION, "plain", 1, 1, True, False, False, False, "none", None),
    (COMPLETION, "plain", 2, 2, True, True, False, False, "none", None),
    (COMPLETION, "plain", 2, 2, True, True, True, True, "none", None),
    (COMPLETION, "plain", 2, 2, False, True, True, True, "none", None),
    (COMPLETION, "plain", 1, 3, False, False, False, False, "none", None),
    (CHAT, "plain", 1, 1, True, False, False, False, "none", None),
    (CHAT, "plain", 3, 1, True, True, False, True, "none", None),
    (CHAT, "plain", 2, 1, False, True, False, True, "none", None),
    (CHAT, "tools", 2, 1, True, False, False, False, "auto", None),
    (CHAT, "tools", 1, 1, False, True, False, False, "auto", None),
    (CHAT, "plain", 1, 1, True, True, False, False, "named", None),
    (CHAT, "reasoning", 2, 1, True, True, False, False, "none", "qwen3"),
    (CHAT, "reasoning", 1, 1, False, False, False, True, "none", "qwen3"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("include_usage", [False, True])
def test_tokenizer_renders_the_bytes_the_api_would(case: tuple[Any, ...], include_usage: bool) -> None:
    route, texts, n, num_prompts, stream, logprobs, echo, token_ids, tool_mode, reasoning = case
    spec = RenderSpec(route, "resp-1", "m", 1700000000, stream, want_logprobs=logprobs, include_usage=include_usage,
                      echo=echo, return_token_ids=token_ids, tool_mode=tool_mode,
                      tool_name="get" if tool_mode == "named" else "", reasoning_parser=reasoning)
    prompt_texts = [f"prompt {p}" if echo else "" for p in range(num_prompts)]
    prompt_ids = [[10 + p, 11, 12] for p in range(num_prompts)]
    reasons = [FinishReason.STOP, FinishReason.LENGTH, FinishReason.STOP][:n]
    steps = steps_of([f"r{p}" for p in range(num_prompts)], n, TEXTS[texts], logprobs, echo and logprobs,
                     token_ids, reasons)

    expected, view = api_side(spec, n, prompt_texts, prompt_ids, steps)
    rendered, choices = tokenizer_side(spec, n, prompt_texts, prompt_ids, steps)
    if stream:
        assert rendered and CALL_ID.sub(b"call_X", rendered) == CALL_ID.sub(b"call_X", expected)
        return
    assert sorted(choices) == list(range(num_prompts * n))  # each choice rendered once, when it ended
    usage = usage_dict(3 * num_prompts, len(TEXTS[texts]) * n * num_prompts, 3)
    want = msgspec.json.encode(renderer_for(spec).body(view, usage))
    for choice in view.choices:
        choice.rendered = choices[choice.index]
    got = msgspec.json.encode(renderer_for(spec).body(view, usage))
    assert msgspec.json.decode(CALL_ID.sub(b"call_X", got)) == msgspec.json.decode(CALL_ID.sub(b"call_X", want))


def test_abnormal_ends_render_nothing() -> None:
    """An aborted or failed completion is answered with an error by the api: the tokenizer renders no bytes."""
    for stream in (True, False):
        renderer = PromptRenderer(RenderSpec(CHAT, "r", "m", 0, stream), 1, "", [1])
        assert bool(renderer.render(TextDelta("r", 0, "hi", 1))) == stream
        assert renderer.render(TextDelta("r", 0, "", 0, FinishReason.ABORT)) == b""
        assert renderer.render(TextDelta("r", 0, "", 0, FinishReason.ERROR)) == b""


@pytest.mark.parametrize("stream", [True, False])
def test_hidden_reasoning_renders_the_same_on_both_sides_without_it(stream: bool) -> None:
    """include_reasoning false under a reasoning parser (RenderSpec.include_reasoning): the tokenizer's bytes are the
    api's, with no reasoning and, as vLLM's, no logprobs or token ids of the choice (the prompt's ids stay)."""
    spec = RenderSpec(CHAT, "resp-1", "m", 1700000000, stream, want_logprobs=True, include_usage=True,
                      return_token_ids=True, reasoning_parser="qwen3", include_reasoning=False)
    steps = steps_of(["r0"], 2, TEXTS["reasoning"], True, False, True, [FinishReason.STOP, FinishReason.LENGTH])
    expected, view = api_side(spec, 2, [""], [[10, 11, 12]], steps)
    rendered, choices = tokenizer_side(spec, 2, [""], [[10, 11, 12]], steps)
    if stream:
        assert rendered == expected
        chunks = [msgspec.json.decode(line[6:]) for line in rendered.split(b"\n\n") if line.startswith(b"data: ")]
        deltas = [c["choices"][0] for c in chunks if c["choices"] and "role" not in c["choices"][0]["delta"]]
        assert "".join(d["delta"].get("content") or "" for d in deltas if d["index"] == 0) == "The answer is 4."
        # the role chunk too: its `token_ids: []` read, joined, as a choice of no tokens where the body has none
        assert all("token_ids" not in c["choices"][0] for c in chunks if c["choices"]), chunks[0]
        assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == [[10, 11, 12]] * 2
    else:
        for choice in view.choices:
            choice.rendered = choices[choice.index]
        body = msgspec.json.decode(msgspec.json.encode(renderer_for(spec).body(view, usage_dict(3, 12, 0))))
        deltas = body["choices"]
        # the second completion's `<THINK>` is no marker: all content
        assert [d["message"] for d in deltas] == [{"role": "assistant", "content": "The answer is 4."},
                                                  {"role": "assistant", "content": "".join(TEXTS["reasoning"]).upper()}]
        assert body["prompt_token_ids"] == [10, 11, 12]
    assert b"reasoning" not in rendered + b"".join(choices.values())
    assert all(d["logprobs"] is None and "token_ids" not in d for d in deltas), deltas


@pytest.mark.parametrize("stream", [True, False])
def test_text_offsets_of_tokens_that_split_characters_point_into_the_text(tokenizer: Any, stream: bool) -> None:
    """Legacy completions' text_offset is where a token starts in the text: a token holding part of a multi-byte
    character starts where that character does. Offsets summed the lengths of the tokens' own strings, one U+FFFD
    for each such token, so they ran past the characters they meant (SmolLM2 spells "日本の首都は東京です。" in 19
    tokens: the offset of す read 18 where the text has it at 9; echoing the prompt "日本の", its token の read 3,
    the prompt's length, where the completion starts, for 2)."""
    prompt, answer = "日本の", "首都は東京です。 Tokyo 🗼!"
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(answer, add_special_tokens=False)

    def position(token_id: int, logprob: float | None = -0.5) -> PositionLogprobs:
        token = TokenLogprob(tokenizer.decode([token_id], False), token_id, logprob,
                             list(tokenizer.token_bytes(token_id)))
        return PositionLogprobs(token, [])

    def starts(ids: list[int], base: int) -> list[int]:  # where each token's first byte lands in the text
        return [base + len(tokenizer.decode(ids[:i]).removesuffix("\ufffd")) for i in range(len(ids))]

    spec = RenderSpec(COMPLETION, "cmpl-1", "m", 1700000000, stream, want_logprobs=True, include_usage=False,
                      echo=not stream)
    steps, shown = [], ""
    for k, token_id in enumerate(answer_ids):
        text = tokenizer.decode(answer_ids[:k + 1]).removesuffix("\ufffd")[len(shown):]
        shown += text
        last = k == len(answer_ids) - 1
        scores = [position(prompt_ids[0], None), *map(position, prompt_ids[1:])] if k == 0 else []
        steps.append([TextDelta("r0", 0, text, 1, FinishReason.LENGTH if last else -1, [position(token_id)], 0,
                                None, scores, [])])
    assert shown == answer
    rendered, view = api_side(spec, 1, [prompt], [prompt_ids], steps)
    if stream:
        chunks = [msgspec.json.decode(line[6:]) for line in rendered.split(b"\n\n") if line.startswith(b"data: ")]
        offsets = [o for c in chunks for choice in c["choices"] if choice["logprobs"]
                   for o in choice["logprobs"]["text_offset"]]
        assert offsets == starts(answer_ids, 0)
    else:
        body = msgspec.json.decode(msgspec.json.encode(renderer_for(spec).body(view, usage_dict(3, 12, 0))))
        choice = body["choices"][0]
        assert choice["text"] == prompt + answer
        assert choice["logprobs"]["text_offset"] == starts(prompt_ids, 0) + starts(answer_ids, len(prompt))
