"""vLLM's stream_interval (per request) and --stream-interval (the server's): a streamed completion's first tokens go
out at once, then chunks of at least the interval's new tokens, and its end at once with what was held. The holding
logic through the tokenizer process's Outputs (no sockets: TokenDeltas in, TextDeltas or rendered bytes out), then
over HTTP against the shared SmolLM2 server (tests/test_vllm_serve_flags.py runs a server with --stream-interval)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pagoda.services.protocol.render import CHAT, COMPLETION
from pagoda.services.tokenizer.output import Outputs
from pagoda.services.tokenizer.pacing import Pacer
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import (
    FinishReason,
    GenerateRequest,
    PromptScores,
    RenderedRows,
    RenderSpec,
    SamplingParams,
    StopSequence,
    TextDelta,
    TextDeltas,
    TokenDeltas,
)
from tests.harness import HTTP, SERVED, Server

pytestmark = pytest.mark.slow

SENTENCE = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."
API = 0  # the one api the requests here come from

_ids = itertools.count()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def words(tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(SENTENCE, add_special_tokens=False)
    assert len(ids) >= 16
    return ids


def add(outputs: Outputs, params: SamplingParams, render: RenderSpec | None = None, return_token_ids: bool = False,
        forced: list[int] | None = None) -> str:
    request_id = f"r{next(_ids)}"
    prompt = [1, 2, 3]
    outputs.add(API, GenerateRequest(request_id, params.validate(), prompt_token_ids=prompt, render=render,
                                     return_token_ids=return_token_ids), params, prompt, None, forced)
    return request_id


def step(outputs: Outputs, rows: list[tuple[str, int, int, int]], logprobs: bool = False,
         scores: dict[int, PromptScores] | None = None) -> list[Any]:
    """One scheduler step: (request id, completion index, token id, finish reason) rows in; what goes to the api."""
    request_ids, indices, token_ids, reasons = (list(c) for c in zip(*rows, strict=True))
    lp_rows = [r for r, row in enumerate(rows) if row[2] >= 0] if logprobs else []
    scored = sorted(scores or {})
    batch = outputs.on_token_deltas(TokenDeltas(
        request_ids, indices, token_ids, reasons, [5] * len(rows), lp_rows, [-0.25] * len(lp_rows),
        [[] for _ in lp_rows], [[] for _ in lp_rows], [(scores or {})[r] for r in scored], scored))
    assert not batch.failed
    return batch.to_apis.get(API, [])


def deltas_of(messages: list[Any]) -> list[TextDelta]:
    return [d for m in messages if isinstance(m, TextDeltas) for d in m.deltas]


def stream(outputs: Outputs, request_id: str, ids: list[int], end: int, **kwargs: Any) -> list[list[TextDelta]]:
    """One token a step, the last with `end`; the deltas each step sent."""
    return [deltas_of(step(outputs, [(request_id, 0, t, end if k == len(ids) - 1 else -1)], **kwargs))
            for k, t in enumerate(ids)]


def joined(deltas: list[TextDelta]) -> tuple[str, int, list[int], int]:
    return ("".join(d.text for d in deltas), sum(d.num_new_tokens for d in deltas),
            [t for d in deltas for t in d.token_ids], sum(len(d.logprobs) for d in deltas))


# ------------------------------------------------------------------ the holding logic (Outputs, Pacer)


def test_the_first_token_goes_alone_then_chunks_of_the_interval_then_the_end(tokenizer: Tokenizer,
                                                                            words: list[int]) -> None:
    ids = words[:12]
    sent = {}
    for interval in (None, 4):
        outputs = Outputs(tokenizer)
        request_id = add(outputs, SamplingParams(max_tokens=12, logprobs=0, stream_interval=interval),
                         return_token_ids=True)
        sent[interval] = stream(outputs, request_id, ids, FinishReason.LENGTH, logprobs=True)
        assert not outputs.requests  # finished: nothing left held
    assert [len(s) for s in sent[None]] == [1] * 12
    # steps 1, 5, 9 and the end (12) send; the others hold
    assert [[d.num_new_tokens for d in s] for s in sent[4]] == [[1], [], [], [], [4], [], [], [], [4], [], [], [3]]
    flat = [d for s in sent[4] for d in s]
    assert [d.finish_reason for d in flat] == [-1, -1, -1, FinishReason.LENGTH]
    assert all(len(d.token_ids) == len(d.logprobs) == d.num_new_tokens and d.num_cached_tokens == 5 for d in flat)
    assert joined(flat) == joined([d for s in sent[None] for d in s]) == (tokenizer.decode(ids), 12, ids, 12)


@pytest.mark.parametrize("interval", [3, 100])
def test_a_stop_string_mid_interval_sends_what_is_held_with_the_end(tokenizer: Tokenizer, words: list[int],
                                                                   interval: int) -> None:
    results = []
    for stream_interval in (None, interval):
        outputs = Outputs(tokenizer)
        request_id = add(outputs, SamplingParams(max_tokens=None, stop=[" lazy"], stream_interval=stream_interval))
        sent: list[TextDelta] = []
        stops: list[StopSequence] = []
        for token_id in words:
            batch = outputs.on_token_deltas(TokenDeltas([request_id], [0], [token_id], [-1], [0], [], [], [], []))
            stops += batch.stops
            sent += deltas_of(batch.to_apis.get(API, []))
            if sent and sent[-1].finish_reason >= 0:
                break
        assert stops == [StopSequence(request_id, 0)]
        assert (sent[-1].finish_reason, sent[-1].stop_reason) == (FinishReason.STOP, " lazy")
        results.append(("".join(d.text for d in sent), sum(d.num_new_tokens for d in sent), len(sent)))
    (text, num_tokens, _), (paced_text, paced_tokens, num_chunks) = results
    assert (paced_text, paced_tokens) == (text, num_tokens) and text == "The quick brown fox jumps over the"
    assert num_chunks == (1 + (num_tokens - 1 + interval - 1) // interval if interval < num_tokens else 2)


def test_an_interval_past_max_tokens_sends_the_first_token_then_the_rest_at_the_end(tokenizer: Tokenizer,
                                                                                   words: list[int]) -> None:
    outputs = Outputs(tokenizer)
    request_id = add(outputs, SamplingParams(max_tokens=6, stream_interval=1000))
    sent = stream(outputs, request_id, words[:6], FinishReason.LENGTH)
    assert [[d.num_new_tokens for d in s] for s in sent] == [[1], [], [], [], [], [5]]
    assert "".join(d.text for s in sent for d in s) == tokenizer.decode(words[:6])


def test_a_hidden_eos_ends_the_held_chunk_and_counts(tokenizer: Tokenizer, words: list[int]) -> None:
    eos = tokenizer.eos_token_id
    assert eos is not None
    outputs = Outputs(tokenizer)
    request_id = add(outputs, SamplingParams(max_tokens=None, stream_interval=4), return_token_ids=True)
    sent = [d for s in stream(outputs, request_id, [*words[:3], eos], FinishReason.STOP) for d in s]
    assert [(d.num_new_tokens, d.finish_reason) for d in sent] == [(1, -1), (3, FinishReason.STOP)]
    assert [t for d in sent for t in d.token_ids] == [*words[:3], eos]  # the EOS is counted and listed (vLLM's)
    assert "".join(d.text for d in sent) == tokenizer.decode(words[:3]) and sent[-1].stop_reason is None


def test_completions_of_one_request_are_held_independently(tokenizer: Tokenizer, words: list[int]) -> None:
    outputs = Outputs(tokenizer)
    request_id = add(outputs, SamplingParams(n=2, max_tokens=None, stream_interval=3))
    counts: dict[int, list[int]] = {0: [], 1: []}
    texts: dict[int, str] = {0: "", 1: ""}
    for k in range(9):  # completion 1 starts a step late and ends at step 6; completion 0 ends at step 9
        rows = [(request_id, 0, words[k], FinishReason.LENGTH if k == 8 else -1)]
        if 1 <= k <= 6:
            rows.append((request_id, 1, words[10 + k], FinishReason.STOP if k == 6 else -1))
        for delta in deltas_of(step(outputs, rows)):
            counts[delta.index].append(delta.num_new_tokens)
            texts[delta.index] += delta.text
    assert counts == {0: [1, 3, 3, 2], 1: [1, 3, 2]}
    assert texts == {0: tokenizer.decode(words[:9]), 1: tokenizer.decode(words[11:16])}  # 1's stop token: hidden
    assert not outputs.requests


def test_the_server_interval_is_a_floor_a_request_may_raise(tokenizer: Tokenizer, words: list[int]) -> None:
    for server, asked, expected in [(3, 2, [1, 3, 3, 2]), (3, None, [1, 3, 3, 2]), (3, 5, [1, 5, 3]),
                                    (1, None, [1] * 9), (1, 1, [1] * 9), (2, 1, [1, 2, 2, 2, 2])]:
        outputs = Outputs(tokenizer, server)
        request_id = add(outputs, SamplingParams(max_tokens=9, stream_interval=asked))
        sent = [d for s in stream(outputs, request_id, words[:9], FinishReason.LENGTH) for d in s]
        assert [d.num_new_tokens for d in sent] == expected, (server, asked)
        assert (outputs.requests.get(request_id) is None) and sent[-1].finish_reason == FinishReason.LENGTH


def test_an_abnormal_end_follows_the_held_output_alone(tokenizer: Tokenizer, words: list[int]) -> None:
    """An abort or error shows no output of its own delta (the api answers it with an error): what was held goes
    first as a running delta, as without an interval it would have gone already."""
    for reason in (FinishReason.ABORT, FinishReason.ERROR):
        outputs = Outputs(tokenizer)
        request_id = add(outputs, SamplingParams(max_tokens=None, stream_interval=8))
        assert [d.num_new_tokens for s in stream(outputs, request_id, words[:3], -1) for d in s] == [1]
        sent = deltas_of(step(outputs, [(request_id, 0, -1, reason)]))
        assert [(d.text, d.num_new_tokens, d.finish_reason) for d in sent] == [
            (tokenizer.decode(words[1:3]), 2, -1), ("", 0, reason)]


@pytest.mark.parametrize("rendered", [False, True])
def test_a_request_that_fails_gets_what_was_held_once(tokenizer: Tokenizer, words: list[int], rendered: bool) -> None:
    outputs = Outputs(tokenizer)
    spec = RenderSpec(COMPLETION, "cmpl-1", "m", 7, True) if rendered else None
    request_id = add(outputs, SamplingParams(n=2, max_tokens=None, stream_interval=8), render=spec)
    for k in range(4):
        step(outputs, [(request_id, 0, words[k], -1), (request_id, 1, words[k + 4], -1)])
    flushed = outputs.flush(request_id).to_apis[API]
    if rendered:
        rows = flushed[0]
        assert isinstance(rows, RenderedRows) and (rows.indices, rows.num_new_tokens) == ([0, 1], [3, 3])
        texts = [json.loads(data[6:])["choices"][0]["text"] for data in rows.data]
    else:
        sent = deltas_of(flushed)
        assert [(d.index, d.num_new_tokens, d.finish_reason) for d in sent] == [(0, 3, -1), (1, 3, -1)]
        texts = [d.text for d in sent]
    assert texts == [tokenizer.decode(words[1:4]), tokenizer.decode(words[5:8])]
    assert outputs.flush(request_id).to_apis == {}  # once
    assert outputs.flush("not-here").to_apis == {}


def test_prompt_scores_and_a_forced_start_lead_the_first_delta(tokenizer: Tokenizer, words: list[int]) -> None:
    """A prompt chunk's scores (no token yet) wait for the completion's first token, which goes out at once with
    them and with the grammar's forced start before it, as vLLM sends prompt logprobs with the first output."""
    forced = tokenizer.encode('{"name": "', add_special_tokens=False)
    sent = {}
    for interval in (None, 4):
        outputs = Outputs(tokenizer)
        request_id = add(outputs, SamplingParams(max_tokens=None, prompt_logprobs=0, stream_interval=interval),
                         forced=forced, return_token_ids=True)
        scores = PromptScores(0, 1, [2, 3], [-1.0, -2.0], [[], []], [[], []])
        sent[interval] = [deltas_of(step(outputs, [(request_id, 0, -1, -1)], scores={0: scores})),
                          *stream(outputs, request_id, words[:3], -1)]
    assert [len(s) for s in sent[None]] == [1, 1, 1, 1]  # the scores alone, then a delta a token
    assert [len(s) for s in sent[4]] == [0, 1, 0, 0]  # the scores held until the first token, then it holds
    (first,) = sent[4][1]
    assert first.text == sent[None][1][0].text and first.text.startswith('{"name": "')
    assert first.token_ids == [*forced, words[0]] and first.num_new_tokens == len(forced) + 1
    assert [p.sampled.token_id for p in first.prompt_logprobs] == [1, 2, 3]  # the first prompt token, then scored
    assert first.prompt_logprobs == sent[None][0][0].prompt_logprobs


def test_the_pacer_alone() -> None:
    pacer = Pacer(2, 1)
    running = [TextDelta("r", 0, c, 1) for c in "abcde"]
    assert [[d.text for d in pacer.pace(d)] for d in running] == [["a"], [], ["bc"], [], ["de"]]
    assert pacer.pace(TextDelta("r", 0, "", 0, FinishReason.LENGTH)) == [TextDelta("r", 0, "", 0, 1)]
    with pytest.raises(AssertionError):
        Pacer(1, 1)  # an interval of 1 holds nothing: no pacer at all


def _sse(data: list[bytes]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for chunk in data for line in chunk.split(b"\n\n") if line.startswith(b"data: {")]


def _rendered(outputs: Outputs, request_id: str, ids: list[int], end: int) -> list[dict[str, Any]]:
    data = [row for s in range(len(ids))
            for m in step(outputs, [(request_id, 0, ids[s], end if s == len(ids) - 1 else -1)])
            if isinstance(m, RenderedRows) for row in m.data]
    return _sse(data)


def test_rendered_streams_count_usage_and_ids_per_chunk(tokenizer: Tokenizer, words: list[int]) -> None:
    spec = RenderSpec(COMPLETION, "cmpl-1", "m", 7, True, include_usage=True, return_token_ids=True,
                      continuous_usage=True)
    chunks = _rendered(outputs := Outputs(tokenizer), add(outputs, SamplingParams(max_tokens=12, stream_interval=4),
                                                          render=spec, return_token_ids=True),
                       words[:12], FinishReason.LENGTH)
    assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [1, 4, 4, 3]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 5, 9, 12]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(words[:12])


@pytest.mark.parametrize("text, spec_fields", [
    ('Sure, I will look the weather up for you. <tool_call>{"name": "get", "arguments": {"city": "Oslo"}}</tool_call>',
     {"tool_mode": "auto"}),
    ("<think>Let me think about it.</think>The answer is four.", {"reasoning_parser": "qwen3"}),
])
def test_tool_call_and_reasoning_parsers_read_the_same_text_in_fewer_pieces(
        tokenizer: Tokenizer, text: str, spec_fields: dict[str, Any]) -> None:
    assert tokenizer.eos_token_id is not None
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    spec = RenderSpec(CHAT, "chatcmpl-1", "m", 7, True, **spec_fields)
    messages = []
    for interval in (None, 3):
        outputs = Outputs(tokenizer)
        chunks = _rendered(outputs, add(outputs, SamplingParams(max_tokens=None, skip_special_tokens=False,
                                                                stream_interval=interval), render=spec),
                           ids, FinishReason.STOP)
        message: dict[str, Any] = {"content": "", "reasoning": "", "arguments": "", "names": []}
        for chunk in chunks:
            delta = chunk["choices"][0]["delta"]
            message["content"] += delta.get("content") or ""
            message["reasoning"] += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                message["names"] += [call["function"]["name"]] if call["function"].get("name") else []
                message["arguments"] += call["function"].get("arguments") or ""
        message["finish"] = chunks[-1]["choices"][0]["finish_reason"]
        messages.append((message, len(chunks)))
    (whole, num_chunks), (paced, num_paced) = messages
    assert paced == whole and num_paced < num_chunks
    if "tool_mode" in spec_fields:
        assert (whole["names"], json.loads(whole["arguments"]), whole["finish"]) == (["get"], {"city": "Oslo"},
                                                                                    "tool_calls")
    else:
        assert (whole["reasoning"], whole["content"], whole["finish"]) == ("Let me think about it.",
                                                                           "The answer is four.", "stop")


# ------------------------------------------------------------------ over HTTP (the shared SmolLM2 server)

@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    return smollm2_server


def sse_chunks(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with HTTP.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


ROUTES = {"completions": ("/v1/completions", {"prompt": "Once upon a time"}),
          "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story."}]})}


def _piece(route: str, choice: dict[str, Any]) -> str:
    return (choice.get("text") or "") if route == "completions" else (choice["delta"].get("content") or "")


def streamed(server: Server, route: str, **fields: Any) -> dict[str, Any]:
    """A greedy stream's chunks, per choice: text, token counts (token_ids), finish and stop reasons, usage."""
    path, prompt = ROUTES[route]
    body = {"model": SERVED, "temperature": 0, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **prompt, **fields}
    chunks = sse_chunks(server, path, body)
    out: dict[str, Any] = {"usage": chunks[-1]["usage"], "choices": {}}
    assert chunks[-1]["choices"] == []
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        mine = out["choices"].setdefault(choice["index"], {"text": "", "counts": [], "usage": [], "finish": None})
        mine["text"] += _piece(route, choice)
        if choice.get("token_ids"):  # chat's role chunk and finish chunk carry none
            mine["counts"].append(len(choice["token_ids"]))
            mine["usage"].append(chunk["usage"]["completion_tokens"])
        if choice["finish_reason"] is not None:
            mine["finish"], mine["stop_reason"] = choice["finish_reason"], choice.get("stop_reason")
    return out


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_streamed_completion_comes_in_chunks_of_the_interval(server: Server, route: str) -> None:
    fields = {"max_tokens": 12, "ignore_eos": True}
    whole, paced = streamed(server, route, **fields), streamed(server, route, stream_interval=4, **fields)
    assert whole["choices"][0]["counts"] == [1] * 12
    assert paced["choices"][0]["counts"] == [1, 4, 4, 3]
    assert paced["choices"][0]["usage"] == [1, 5, 9, 12]  # continuous usage counts the tokens up to each chunk
    assert paced["choices"][0]["text"] == whole["choices"][0]["text"] != ""
    assert paced["choices"][0]["finish"] == whole["choices"][0]["finish"] == "length"
    assert paced["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 12


def test_an_interval_past_max_tokens_and_n_completions(server: Server) -> None:
    past = streamed(server, "completions", max_tokens=5, ignore_eos=True, stream_interval=100)
    assert past["choices"][0]["counts"] == [1, 4] and past["choices"][0]["finish"] == "length"
    both = streamed(server, "chat", max_tokens=7, ignore_eos=True, n=2, stream_interval=3)
    assert sorted(both["choices"]) == [0, 1]
    for choice in both["choices"].values():
        assert choice["counts"] == [1, 3, 3] and choice["usage"] == [1, 4, 7] and choice["finish"] == "length"
    assert both["choices"][0]["text"] == both["choices"][1]["text"]  # greedy


def test_a_stop_string_mid_interval_ends_the_stream_with_what_was_held(server: Server) -> None:
    whole = streamed(server, "completions", max_tokens=16, ignore_eos=True)["choices"][0]["text"]
    words = whole.split()
    assert len(words) >= 6, whole
    stop = " " + words[4]  # a word inside the output (SmolLM2's 5th token here): it ends a chunk of 5 mid-way
    expected = whole[:whole.index(stop)]
    for interval in (None, 5):
        got = streamed(server, "completions", max_tokens=16, ignore_eos=True, stop=[stop], stream_interval=interval)
        choice = got["choices"][0]
        assert (choice["text"], choice["finish"], choice["stop_reason"]) == (expected, "stop", stop), interval
        assert choice["usage"][-1] == got["usage"]["completion_tokens"]
        if interval is not None:
            assert 1 < len(choice["counts"]) and choice["counts"][-1] < interval, choice["counts"]


@pytest.mark.parametrize("value", [True, 0, -1, 2.5, 2**31, "2", [2]])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_bad_stream_interval_is_a_400_naming_it(server: Server, route: str, value: Any) -> None:
    path, prompt = ROUTES[route]
    response = HTTP.post(server.url + path, timeout=60,
                         json={"model": SERVED, "max_tokens": 1, "stream": True, "stream_interval": value, **prompt})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stream_interval" and "Unrecognized" not in error["message"], error


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_null_is_the_servers_interval(server: Server, route: str) -> None:
    path, prompt = ROUTES[route]
    for value in (None, 1):
        response = HTTP.post(server.url + path, timeout=60,
                             json={"model": SERVED, "max_tokens": 2, "stream_interval": value, **prompt})
        assert response.status_code == 200, response.text


def test_the_field_is_checked_where_params_are_made() -> None:
    for value in (True, 0, -3, 1.5, 2**31):
        with pytest.raises(InvalidRequestError) as failure:
            SamplingParams(stream_interval=value).validate()  # type: ignore[arg-type]
        assert failure.value.param == "stream_interval"
    assert SamplingParams(stream_interval=2**31 - 1).validate().stream_interval == 2**31 - 1
    assert msgspec.json.decode(b'{"n": 2}', type=SamplingParams).stream_interval is None  # an older sender's
    from pagoda.params import SamplingParams as OfflineParams

    assert OfflineParams(stream_interval=4).wire().stream_interval == 4  # offline: taken, changes nothing
    with pytest.raises(InvalidRequestError):
        OfflineParams(stream_interval=0)
