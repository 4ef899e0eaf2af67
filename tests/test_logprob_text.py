"""Logprob entries' strings for tokens that hold part of a UTF-8 character, as vLLM shows them (its LogprobsProcessor
_verify_tokens / _correct_decoded_token): "" for a leading piece, the whole character on the token that completes it,
in every entry of a position (sampled or prompt token, and alternatives), streamed or not; `bytes` stay the token's
own. The rule (logprob_text), the tokenizer process's Outputs (TokenDeltas in, TextDeltas out, as a stream's frames
or one frame), the offline API's decoded_token, and the served JSON against the shared SmolLM2 server."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from pagoda.services.tokenizer.logprob_text import shown_token_text
from pagoda.services.tokenizer.output import Outputs
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.messages import (
    FinishReason,
    GenerateRequest,
    PositionLogprobs,
    PromptScores,
    SamplingParams,
    TextDelta,
    TextDeltas,
    TokenDeltas,
)
from tests.harness import HTTP, SERVED, Server

# SmolLM2 spells these with tokens that end inside a character: 日 is b"\xe6\x97" + b"\xa5", 首 three one-byte
# tokens, 都 b"\xe9" + b"\x83\xbd" (alone: two U+FFFDs), 🗼 b" \xf0\x9f" + b"\x97" + b"\xbc" (a space in the first)
ANSWER = "日本の首都は東京です。 Tokyo 🗼!"
SHOWN = ["", "日", "本", "の", "", "", "首", "", "都", "", "は", "", "東", "", "京", "", "で", "す", "。",
         " Tokyo", "", "", " 🗼", "!"]
API = 0
_ids = itertools.count()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def answer_ids(tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    assert len(ids) == len(SHOWN)
    return ids


def own(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def test_leading_pieces_show_empty_and_the_completing_token_the_character(tokenizer: Tokenizer,
                                                                         answer_ids: list[int]) -> None:
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    shown = [shown_token_text(t, own(tokenizer, t), answer_ids[:k], decode, lambda i: own(tokenizer, i))
             for k, t in enumerate(answer_ids)]
    assert shown == SHOWN and "".join(shown) == ANSWER
    assert sum(own(tokenizer, t).endswith("\ufffd") for t in answer_ids) == 18, "the pieces' own strings"
    # without the tokens before it, a piece that completes a character has nothing to complete: ""
    assert shown_token_text(answer_ids[1], own(tokenizer, answer_ids[1]), [], decode, lambda i: own(tokenizer, i)) \
        == ""


# ------------------------------------------------------------------ the tokenizer process (Outputs)


def add(outputs: Outputs, params: SamplingParams, prompt: list[int]) -> str:
    request_id = f"r{next(_ids)}"
    params = params.validate()
    outputs.add(API, GenerateRequest(request_id, params, prompt_token_ids=prompt), params, prompt, None)
    return request_id


def frame(request_id: str, ids: list[int], end: int, tops: list[list[int]],
          scores: PromptScores | None = None) -> TokenDeltas:
    """One scheduler step with these tokens of completion 0, each with logprobs and its alternatives."""
    rows = list(range(len(ids)))
    return TokenDeltas([request_id] * len(ids), [0] * len(ids), ids,
                       [end if r == len(ids) - 1 else -1 for r in rows], [0] * len(ids), rows, [-0.5] * len(ids),
                       tops, [[-0.5 - j for j in range(len(top))] for top in tops],
                       [scores] if scores is not None else [], [0] if scores is not None else [])


def deltas_of(outputs: Outputs, message: TokenDeltas) -> list[TextDelta]:
    batch = outputs.on_token_deltas(message)
    assert not batch.failed
    return [d for m in batch.to_apis.get(API, []) if isinstance(m, TextDeltas) for d in m.deltas]


def positions(tokenizer: Tokenizer, answer_ids: list[int], per_frame: int) -> list[PositionLogprobs]:
    """The answer's logprob entries, its tokens sent `per_frame` a step; the alternatives at each position are the
    token itself and 本 / b"\\xa6" / b"\\xe9" (a whole character, a completing piece, a leading one)."""
    outputs = Outputs(tokenizer)
    request_id = add(outputs, SamplingParams(max_tokens=None, logprobs=4), [1, 2, 3])
    alternatives = [*tokenizer.encode("本", add_special_tokens=False), 116, 180]
    sent: list[TextDelta] = []
    for start in range(0, len(answer_ids), per_frame):
        ids = answer_ids[start:start + per_frame]
        last = start + per_frame >= len(answer_ids)
        sent += deltas_of(outputs, frame(request_id, ids, FinishReason.LENGTH if last else -1,
                                         [[t, *alternatives] for t in ids]))
    assert "".join(d.text for d in sent) == ANSWER
    return [p for d in sent for p in d.logprobs]


def test_sampled_and_alternative_entries_are_shown_after_the_tokens_before(tokenizer: Tokenizer,
                                                                          answer_ids: list[int]) -> None:
    streamed = positions(tokenizer, answer_ids, 1)
    assert [p.sampled.token for p in streamed] == SHOWN
    assert [p.top[0].token for p in streamed] == SHOWN  # the sampled token listed again: the same string
    # each alternative decoded after the sampled tokens before its position: b"\xa6" after 日's first piece is 旦
    # (b"\xe6\x97\xa6"), after a whole character nothing it completes (""); a leading piece is "" everywhere
    assert streamed[1].top[2].token == "旦" and streamed[3].top[2].token == ""
    assert {p.top[1].token for p in streamed} == {"本"} and {p.top[3].token for p in streamed} == {""}
    # bytes stay the token's own: joined, the answer's UTF-8
    assert b"".join(bytes(p.sampled.bytes) for p in streamed) == ANSWER.encode()
    # a character split across a stream's frames shows as when its tokens come in one frame
    for per_frame in (2, 3, len(answer_ids)):
        assert positions(tokenizer, answer_ids, per_frame) == streamed


def test_prompt_logprobs_show_pieces_after_the_scored_prompt_tokens(tokenizer: Tokenizer,
                                                                   answer_ids: list[int]) -> None:
    """vLLM's context for a prompt position is its prompt_logprobs' earlier entries: the first prompt token has none
    (null), so the second, which completes the 日 the first began, shows "" there; the first itself (echo's entry,
    no logprob) is its own decode, U+FFFD, as vLLM's completions decode a position without logprobs."""
    prompt = answer_ids
    outputs = Outputs(tokenizer)
    request_id = add(outputs, SamplingParams(max_tokens=1, prompt_logprobs=1), prompt)
    scored = prompt[1:]
    half = len(scored) // 2
    sent = []
    for first, ids in ((1, scored[:half]), (1 + half, scored[half:])):  # two prefill chunks
        scores = PromptScores(0, first, ids, [-1.0] * len(ids), [[t] for t in ids], [[-1.0]] * len(ids), [1] * len(ids))
        sent += deltas_of(outputs, TokenDeltas([request_id], [0], [-1], [-1], [0], [], [], [], [], [scores], [0]))
    sent += deltas_of(outputs, TokenDeltas([request_id], [0], [5], [FinishReason.LENGTH], [0], [], [], [], []))
    entries = [p for d in sent for p in d.prompt_logprobs]
    assert [p.sampled.token for p in entries] == ["\ufffd", "", *SHOWN[2:]]
    assert [p.top[0].token for p in entries[1:]] == ["", *SHOWN[2:]]


# ------------------------------------------------------------------ the offline API


@pytest.mark.slow
def test_offline_decoded_tokens_show_pieces_as_vllm(smollm2_dir: Path) -> None:
    from pagoda import LLM
    from pagoda import StructuredOutputsParams

    llm = LLM(str(smollm2_dir), max_model_len=256)
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    # the grammar leaves one answer: the model samples its tokens (each scored), no choice of its own
    params = SamplingParams(temperature=0.0, max_tokens=len(ids) + 2, logprobs=1, prompt_logprobs=1,
                            structured_outputs=StructuredOutputsParams(choice=[ANSWER, "x"]))
    [output] = llm.generate([{"prompt_token_ids": ids}], params)
    prompt_shown = [next(iter(entry.values())).decoded_token for entry in output.prompt_logprobs[1:]]
    assert prompt_shown == ["", *SHOWN[2:]]
    completion = output.outputs[0]
    assert completion.text == ANSWER
    context: list[int] = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs or [], strict=False):
        assert entry[token_id].decoded_token == shown_token_text(
            token_id, tokenizer.decode([token_id]), context[-4:],
            lambda t: tokenizer.decode(t), lambda t: tokenizer.decode([t]))
        context.append(token_id)
    shown = [entry[t].decoded_token for t, entry in zip(completion.token_ids, completion.logprobs or [],
                                                         strict=False)]
    assert "".join(shown).removesuffix(tokenizer.eos_token) == ANSWER and "" in shown  # the grammar's EOS ends it


# ------------------------------------------------------------------ served


@pytest.mark.slow
def test_served_logprob_strings_show_pieces_as_vllm(smollm2_server: Server, tokenizer: Tokenizer,
                                                    answer_ids: list[int]) -> None:
    """Completions (tokens, top_logprobs' keys), chat (token; bytes stay raw) and prompt_logprobs' decoded_token
    over HTTP; a stream shows what the whole body does."""
    [x] = tokenizer.encode("x", add_special_tokens=False)  # the other choice, which the model would take in chat
    guide = {"structured_outputs": {"choice": [ANSWER, "x"]}, "temperature": 0, "max_tokens": len(answer_ids) + 2,
             "logit_bias": {str(x): -100}}
    base = smollm2_server.url + "/v1"
    completion = {"model": SERVED, "prompt": answer_ids, "logprobs": 2, **guide}
    chat = {"model": SERVED, "messages": [{"role": "user", "content": "Say it"}], "logprobs": True, "top_logprobs": 2,
            **guide}
    whole = _post(base + "/completions", {**completion, "prompt_logprobs": 1}, stream=False)
    whole_chat = _post(base + "/chat/completions", chat, stream=False)
    for tokens in (whole["tokens"], whole_chat["tokens"]):  # the grammar's EOS ends each, with its entry
        assert "".join(tokens).removesuffix(tokenizer.eos_token) == ANSWER, tokens
        assert "" in tokens and not any("\ufffd" in t for t in tokens), tokens
    assert not any("\ufffd" in key for top in whole["top_logprobs"] for key in top), whole["top_logprobs"]
    assert b"".join(bytes(b) for b in whole_chat["bytes"]).removesuffix(tokenizer.eos_token.encode()) \
        == ANSWER.encode()
    assert [entry[str(t)]["decoded_token"] for t, entry in zip(answer_ids[1:], whole["prompt_logprobs"][1:],
                                                                strict=True)] == ["", *SHOWN[2:]]
    streamed = _post(base + "/completions", completion, stream=True)  # the strings (logprobs may differ in the last
    assert streamed["tokens"] == whole["tokens"]                          # digits: another batch shape)
    assert [list(top) for top in streamed["top_logprobs"]] == [list(top) for top in whole["top_logprobs"]]
    streamed_chat = _post(base + "/chat/completions", chat, stream=True)
    assert (streamed_chat["tokens"], streamed_chat["bytes"]) == (whole_chat["tokens"], whole_chat["bytes"])


def _post(url: str, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The first choice's logprob strings, joined over a stream's chunks."""
    got: dict[str, Any] = {"tokens": [], "top_logprobs": [], "bytes": [], "prompt_logprobs": None}
    if not stream:
        response = HTTP.post(url, json=body, timeout=120)
        assert response.status_code == 200, response.text
        choices = [response.json()["choices"][0]]
        got["prompt_logprobs"] = choices[0].get("prompt_logprobs")
    else:
        with HTTP.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
            assert response.status_code == 200, response.read()
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        choices = [c for line in lines for c in json.loads(line)["choices"]]
    for choice in choices:
        logprobs = choice.get("logprobs")
        if not logprobs:
            continue
        if "content" in logprobs:
            got["tokens"] += [e["token"] for e in logprobs["content"] or []]
            got["bytes"] += [e["bytes"] for e in logprobs["content"] or []]
        else:
            got["tokens"] += logprobs["tokens"]
            got["top_logprobs"] += logprobs["top_logprobs"]
    return got
