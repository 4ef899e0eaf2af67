"""A streamed token's chunk rendered from its choice's cached envelope (Renderer._text_chunk) is byte for byte the
chunk the general path renders from dicts, on both routes, with and without usage, for any text, id or model name;
a delta that carries more than text (an end, logprobs, token ids, per-chunk usage) takes the general path."""

from __future__ import annotations

import itertools

import pytest

from pagoda.services.protocol.render import ChatRenderer, Choice, CompletionRenderer, Renderer, renderer_for
from pagoda.shared.messages import PositionLogprobs, RenderSpec, TextDelta, TokenLogprob

TEXTS = ["a", " hello", "é", "\x00", '"quoted"', "\\", "\n\t\r", "😀", "</script>", "\u2028\u2029", "x" * 500,
         "\x7f\x1f", "\ud7ff", "\"\\u0000\""]
NAMES = ["m", "\x00", 'q"m\\', "Qwen/Qwen3-0.6B"]


def general(renderer: Renderer, choice: Choice, delta: TextDelta) -> bytes:
    """What chunks() rendered for one delta before the cached envelope (the dict path)."""
    return renderer._chunk([renderer._with_ids(renderer._delta_choice(choice, delta), delta.token_ids)], choice)


@pytest.mark.parametrize("route", [0, 1])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_text_chunk_is_the_general_paths_bytes(route: int, include_usage: bool) -> None:
    for response_id, model in itertools.product(["cmpl-1", "\x00"], NAMES):
        renderer = renderer_for(RenderSpec(route, response_id, model, 1700000000, True, include_usage=include_usage))
        assert renderer._plain_text
        for index, text in itertools.product([0, 1, 17], TEXTS):
            delta = TextDelta(response_id, index, text, 1)
            fast = renderer.chunks([(Choice(index), delta)])
            assert fast == general(renderer, Choice(index), delta)
            assert index in renderer._text_parts  # the cached envelope made it


@pytest.mark.parametrize("spec_fields", [{"want_logprobs": True}, {"return_token_ids": True},
                                         {"continuous_usage": True, "include_usage": True}])
def test_other_renderers_take_the_general_path(spec_fields: dict[str, bool]) -> None:
    for route in (0, 1):
        renderer = renderer_for(RenderSpec(route, "cmpl-1", "m", 1, True, **spec_fields))
        assert not renderer._plain_text
        choice = Choice(0, num_prompt_tokens=3, num_tokens=2)
        delta = TextDelta("cmpl-1", 0, "hi", 1, token_ids=[5] if spec_fields.get("return_token_ids") else [])
        assert renderer.chunks([(choice, delta)]) == general(renderer, choice, delta)
        assert renderer._text_parts == {}


def test_ends_logprobs_token_ids_and_empty_text_take_the_general_path() -> None:
    logprob = PositionLogprobs(TokenLogprob("hi", 5, -0.5, [104, 105]), [])
    for renderer in (CompletionRenderer("c", "m", 1, want_logprobs=False, include_usage=True, echo=False),
                     ChatRenderer("c", "m", 1, want_logprobs=False, include_usage=False)):
        for delta in (TextDelta("c", 0, "hi", 1, finish_reason=1, stop_reason="x"),
                      TextDelta("c", 0, "hi", 1, logprobs=[logprob]), TextDelta("c", 0, "hi", 1, token_ids=[5]),
                      TextDelta("c", 0, "", 1, finish_reason=0)):
            assert renderer.chunks([(Choice(0), delta)]) == general(renderer, Choice(0), delta)
        assert renderer.chunks([(Choice(0), TextDelta("c", 0, "", 1))]) == b""  # nothing to say: no chunk
        assert renderer._text_parts == {}
