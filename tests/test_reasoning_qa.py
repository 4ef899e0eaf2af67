"""Reasoning models as vLLM's users expect them (`--reasoning-parser qwen3|deepseek_r1`): the think block becomes
`reasoning` and the rest `content`, whole and streamed, at every cut of what SmolLM2's tokenizer makes of it, and
where the chat template left the block decides where the output starts (vLLM's `prompt_is_reasoning_end`, and its
qwen3 parser for Qwen3-Thinking-2507 and Qwen3.5, whose templates open `<think>` in the prompt). One SmolLM2 server
with the qwen3 parser checks the routes; a prefilled assistant turn stands in for a template that opens or closes
the block."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pagoda.services.grammar.compiler import constrain_after_reasoning
from pagoda.services.protocol.chat_output import ChatOutputSpec, ChoiceStream, whole_message
from pagoda.services.protocol.reasoning import PROMPT_CLOSED, PROMPT_OPENED, prompt_reasoning
from pagoda.services.protocol.responses import OutputBuilder
from pagoda.shared.messages import FinishReason, PositionLogprobs, SamplingParams, StructuredOutputs, TokenLogprob
from tests.harness import SERVED, Server, http_client, running_server

PARSERS = ("qwen3", "deepseek_r1")
PROMPTS = ("", PROMPT_OPENED, PROMPT_CLOSED)


def _expected(parser: str, prompt: str, text: str) -> tuple[str | None, str]:
    """vLLM's split of a finished output, written apart from the parser: a prompt that closed the block makes all
    content; one that opened it (or deepseek_r1, whose template always does) starts inside, where a repeated opener
    is dropped; otherwise (qwen3) only an output that opens with `<think>` has reasoning. No `</think>`: the tokens
    ran out inside the block, all of it is reasoning. The newlines right after `</think>` are the template's."""
    if prompt == PROMPT_CLOSED:
        return None, text
    stripped = text.lstrip()
    if parser == "qwen3" and prompt != PROMPT_OPENED and not stripped.startswith("<think>"):
        return None, text
    rest = stripped[len("<think>"):] if stripped.startswith("<think>") else text
    reasoning, end, content = rest.partition("</think>")
    return reasoning, content.lstrip("\n") if end else ""


def _streamed(spec: ChatOutputSpec, pieces: list[str]) -> tuple[str | None, str]:
    """(reasoning or None, content) as a client joins the deltas of these pieces."""
    stream = ChoiceStream(spec)
    deltas = [d for piece in pieces for d in stream.push(piece)] + stream.finish()[0]
    reasoning = [d["reasoning"] for d in deltas if "reasoning" in d]
    assert reasoning == [d["reasoning_content"] for d in deltas if "reasoning" in d]
    assert all(r for r in reasoning), deltas  # no empty reasoning deltas
    return ("".join(reasoning) if reasoning else None), "".join(d.get("content") or "" for d in deltas)


def _token_pieces(tokenizer: Any, text: str) -> list[str]:
    """The text as the detokenizer streams it: one piece per token, a character cut across tokens held back."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, sent = [], ""
    for i in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:i])
        if not prefix.endswith("\ufffd"):
            pieces.append(prefix[len(sent):])
            sent = prefix
    assert sent == text
    return pieces


WORDS = ["<think>", "</think>", "<think>\n", "\n</think>\n\n", "<", "</", "think", ">", "\n", "\n\n", " ", "ok",
         "Hm, let me see.", "é", "日本", "<tool_call>", "answer 4", "</thi", "nk>"]


def test_prompt_reasoning_reads_where_the_template_left_the_block(tokenizer: Any) -> None:
    """Qwen3-Thinking-2507's and Qwen3.5's generation prompt and DeepSeek-R1's open the block; Qwen3's
    enable_thinking=False closes it; a prefilled assistant turn may do either."""
    assert prompt_reasoning("<|im_start|>assistant\n<think>\n") == PROMPT_OPENED
    assert prompt_reasoning("<｜Assistant｜><think>\n") == PROMPT_OPENED
    assert prompt_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n") == PROMPT_CLOSED
    # an earlier turn's block kept in the history neither opens nor closes this answer's
    markers = tokenizer.hf.all_special_tokens
    history = "<|im_start|>assistant\n<think>\nr\n</think>\n\ncall<|im_end|>\n<|im_start|>user\nok<|im_end|>\n"
    assert prompt_reasoning(history + "<|im_start|>assistant\n", markers) == ""
    assert prompt_reasoning(history + "<|im_start|>assistant\n<think>\n", markers) == PROMPT_OPENED
    chat = [{"role": "user", "content": "hi"}]
    told = tokenizer.render_chat([{"role": "system", "content": "Reason inside <think> tags."}, *chat])
    assert prompt_reasoning(told, markers) == "" and prompt_reasoning(told + "<think>\n", markers) == PROMPT_OPENED
    opened = tokenizer.render_chat([*chat, {"role": "assistant", "content": "<think>\n"}], False,
                                   continue_final_message=True)
    assert prompt_reasoning(opened, tokenizer.hf.all_special_tokens) == PROMPT_OPENED
    thinking = tokenizer.render_chat([*chat, {"role": "assistant", "content": "<think>\nSo far"}], False,
                                     continue_final_message=True)  # a prefill of thinking begun
    assert prompt_reasoning(thinking, tokenizer.hf.all_special_tokens) == PROMPT_OPENED
    closed = tokenizer.render_chat([*chat, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}], False,
                                   continue_final_message=True)
    assert prompt_reasoning(closed) == PROMPT_CLOSED


def test_prompt_reasoning_with_think_as_a_special_token_and_an_answer_prefill(tokenizer: Any) -> None:
    """A tokenizer listing <think> / </think> among its special tokens (a common fine-tuning recipe) never found the
    block opened (the <think> itself counted as a turn marker after it); a prefilled answer after an empty block
    (Qwen3's template renders every final assistant message so) was "neither", so the grammar waited for a
    </think> that never came and response_format was not applied."""
    markers = (*tokenizer.hf.all_special_tokens, "<think>", "</think>")
    assert prompt_reasoning("<|im_start|>assistant\n<think>\n", markers) == PROMPT_OPENED
    chat = [{"role": "user", "content": "hi"}]
    prefill = tokenizer.render_chat([*chat, {"role": "assistant", "content": "<think>\n\n</think>\n\n{"}], False,
                                    continue_final_message=True)
    assert prompt_reasoning(prefill, markers) == PROMPT_CLOSED
    # a block closed in an earlier turn, or a </think> a user message mentions, closes nothing of this answer
    told = tokenizer.render_chat([{"role": "user", "content": "What does </think> mean?"}])
    assert prompt_reasoning(told, markers) == ""
    params = SamplingParams(structured_outputs=StructuredOutputs(json_object=True))
    closed = constrain_after_reasoning(params, prompt_closed=prompt_reasoning(prefill, markers) == PROMPT_CLOSED)
    assert closed.structured_outputs.reasoning_end == ""  # the grammar starts where the parser says content does


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_split_matches_vllm_at_every_cut(tokenizer: Any, parser: str, prompt: str) -> None:
    """Seeded random outputs of markers, words, newlines and multi-byte characters: the whole message, the stream
    token by token and the stream cut once at every character give vLLM's split."""
    rng = random.Random(f"{parser}{prompt}")
    texts = ["", "\n", "<think>", "</think>", "plain answer", "<think>a</think>", "a</think>b"]
    texts += ["".join(rng.choice(WORDS) for _ in range(rng.randint(1, 7))) for _ in range(40)]
    spec = ChatOutputSpec(reasoning_parser=parser, prompt_reasoning=prompt)
    for text in texts:
        want = _expected(parser, prompt, text)
        message, calls = whole_message(spec, text)
        assert (message["reasoning"], message["content"]) == want, (text, message)
        assert message["reasoning_content"] == message["reasoning"] and not calls
        got = _streamed(spec, _token_pieces(tokenizer, text))
        assert got == (want[0] or None, want[1]), (text, got)
        for cut in range(len(text) + 1):
            got = _streamed(spec, [text[:cut], text[cut:]])
            assert got == (want[0] or None, want[1]), (text, cut, got)


def test_a_prompt_that_closed_the_block_makes_all_content_under_deepseek_r1() -> None:
    """A template that closes the block itself (DeepSeek-V3.1's or Qwen3's with thinking off) gets an answer, not
    reasoning: the grammar of response_format then applies from the first token (constrain_after_reasoning), and its
    JSON came back as `reasoning` with `content` "" before, as did every other answer under deepseek_r1."""
    spec = ChatOutputSpec(reasoning_parser="deepseek_r1", prompt_reasoning=prompt_reasoning("<think>\n\n</think>\n\n"))
    message, _ = whole_message(spec, '{"a": 1}')
    assert (message["content"], message["reasoning"]) == ('{"a": 1}', None)
    assert _streamed(spec, ['{"a"', ": 1}"]) == (None, '{"a": 1}')


def test_a_prompt_that_opened_the_block_starts_inside_it_under_qwen3() -> None:
    """Qwen3-Thinking-2507's and Qwen3.5's templates write `<think>` in the prompt: the model writes only `</think>`.
    Under the qwen3 parser the whole output (its `</think>` too) came back as content, with reasoning null."""
    spec = ChatOutputSpec(reasoning_parser="qwen3", prompt_reasoning=PROMPT_OPENED)
    message, _ = whole_message(spec, "Let me think.\n</think>\n\nIt is 4.")
    assert (message["reasoning"], message["content"]) == ("Let me think.\n", "It is 4.")


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("prompt", ("", PROMPT_OPENED))
def test_a_whitespace_run_at_the_start_is_held_in_pieces(parser: str, prompt: str) -> None:
    """A model looping on newlines before it decides (a `<think>` may still come, or the opener the prompt wrote
    repeated): the whitespace is held as the tokens came, joined once something else comes (`pending += text` and
    its lstrip() went over all of it on every token: 128k newlines, 11 s of the tokenizer's CPU), and the streamed
    answer is still the whole one, whatever comes after it."""
    n = 64_000
    spec = ChatOutputSpec(reasoning_parser=parser, prompt_reasoning=prompt)
    for tail in (["<think>", "Hm.</think>", "Yes."], ["Yes."], ["\t", "", " "], ["<th", "ink>x"]):
        pieces = ["\n"] * n + ["", " \n"] + tail
        stream = ChoiceStream(spec)
        deltas = [d for piece in pieces[:n + 2] for d in stream.push(piece)]
        assert deltas == [] and stream.reasoning is not None and len(stream.reasoning.space) == n + 2
        assert _streamed(spec, pieces) == _expected(parser, prompt, "".join(pieces))
        message, _ = whole_message(spec, "".join(pieces))
        assert (message["reasoning"], message["content"]) == _expected(parser, prompt, "".join(pieces))


def test_hermes_calls_inside_the_thinking_are_no_calls() -> None:
    """A `<tool_call>` the model writes while it thinks is reasoning; the call after `</think>` is the one made."""
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    text = f"<think>maybe {call.replace('1', '2')}</think>\n\n{call}"
    for prompt in ("", PROMPT_OPENED):
        spec = ChatOutputSpec("auto", "hermes", reasoning_parser="qwen3", prompt_reasoning=prompt)
        body = text if not prompt else text[len("<think>"):]
        message, calls = whole_message(spec, body)
        assert calls and [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"a": 1}']
        assert "tool_call" in message["reasoning"] and not message["content"]


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_include_reasoning_false_drops_the_reasoning_and_keeps_the_content(tokenizer: Any, parser: str,
                                                                          prompt: str) -> None:
    """vLLM's include_reasoning=false: what the parser separates as reasoning is not returned, whole (neither
    `reasoning` nor `reasoning_content`) or streamed (no reasoning delta, none empty either); the content is the
    one include_reasoning=true gives, at every cut."""
    rng = random.Random(f"hidden{parser}{prompt}")
    texts = ["", "<think>only thinking", "<think>a</think>\n\nb", "plain answer"]
    texts += ["".join(rng.choice(WORDS) for _ in range(rng.randint(1, 7))) for _ in range(20)]
    shown = ChatOutputSpec(reasoning_parser=parser, prompt_reasoning=prompt)
    hidden = ChatOutputSpec(reasoning_parser=parser, prompt_reasoning=prompt, include_reasoning=False)
    assert hidden.hides_reasoning and not shown.hides_reasoning
    for text in texts:
        message, _ = whole_message(hidden, text)
        assert message == {"role": "assistant", "content": whole_message(shown, text)[0]["content"]}, text
        for pieces in (_token_pieces(tokenizer, text), [text[:len(text) // 2], text[len(text) // 2:]]):
            stream = ChoiceStream(hidden)
            deltas = [d for piece in pieces for d in stream.push(piece)] + stream.finish()[0]
            assert all(set(d) == {"content"} and d["content"] for d in deltas), (text, deltas)
            assert "".join(d["content"] for d in deltas) == message["content"], text


# The routes, on one SmolLM2 server with the qwen3 parser


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[Server]:
    with running_server(smollm2_dir, "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                        "--enable-auto-tool-choice") as served:
        yield served


def _post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http_client().post(server.url + path, json={"model": SERVED, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _events(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http_client().stream("POST", server.url + path, json={"model": SERVED, "stream": True, **body},
                              timeout=60) as response:
        assert response.status_code == 200
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def _at_once(*calls: Callable[[], Any]) -> list[Any]:
    """The calls' results, the calls made at once (independent requests: the engine batches them)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def _prefilled(prefill: str, **body: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": prefill}],
            "continue_final_message": True, "add_generation_prompt": False, "temperature": 0, **body}


def test_chat_after_a_prompt_that_opened_the_block_is_reasoning(server: Server) -> None:
    """The prompt ends inside the think block, the tokens run out before `</think>`: everything is reasoning,
    streamed and not, finish_reason length (content was the model's thinking before)."""
    body = _prefilled("<think>\n", max_tokens=12)
    choice = _post(server, "/v1/chat/completions", body)["choices"][0]
    message = choice["message"]
    assert message["reasoning"] and message["reasoning"] == message["reasoning_content"]
    assert not message["content"] and choice["finish_reason"] == "length"
    chunks = _events(server, "/v1/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_messages_after_a_prompt_that_opened_the_block_is_a_thinking_block(server: Server) -> None:
    """The Messages API renders on the api side (the tokenizer says where the prompt left the block): a prefill
    that opens it gives a thinking block, streamed and not."""
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\n"}],
            "max_tokens": 8, "temperature": 0}
    content = _post(server, "/v1/messages", body)["content"]
    assert [block["type"] for block in content] == ["thinking"] and content[0]["thinking"]
    events = _events(server, "/v1/messages", body)
    thinking = "".join(e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta")
    assert thinking == content[0]["thinking"]


def test_json_after_a_prompt_that_closed_the_block_is_content(server: Server) -> None:
    """The template closed the block: the grammar applies from the first token and its JSON is the content."""
    body = _prefilled("<think>\n\n</think>\n\n", max_tokens=20, response_format={"type": "json_object"})
    message = _post(server, "/v1/chat/completions", body)["choices"][0]["message"]
    assert message["reasoning"] is None and isinstance(json.loads(message["content"]), dict)


def _position(token: str) -> PositionLogprobs:
    return PositionLogprobs(TokenLogprob(token, 0, -0.5, list(token.encode())), [])


@pytest.mark.parametrize("prompt", ["", PROMPT_OPENED])
def test_responses_count_and_show_the_tokens_of_an_opener_cut_across_tokens(tokenizer: Any, prompt: str) -> None:
    """SmolLM2 writes `<think>` as `<`, `think`, `>`: the tokens held while it may still be the opener are the
    think block's (reasoning_tokens counts them, the markers' too), not the message's. The `<` (and whitespace before
    it) was left out of reasoning_tokens and its logprob led the message's, whose text it is not part of."""
    text = "\n<think>\nLet me see.</think>\n\nIt is 4."
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = _token_pieces(tokenizer, text)
    assert len(pieces) == len(ids) and pieces[1] == "<"
    builder = OutputBuilder(ChatOutputSpec(reasoning_parser="qwen3", prompt_reasoning=prompt), want_logprobs=True)
    for piece in pieces:
        builder.push(piece, [_position(piece)], 1)
    builder.finish(FinishReason.STOP)
    reasoning, message = builder.items
    num_answer = len(tokenizer.encode("It is 4.", add_special_tokens=False))
    assert builder.num_reasoning_tokens == len(ids) - num_answer
    assert [lp.sampled.token for lp in message.logprobs] == pieces[-num_answer:]
    assert (reasoning.text, message.text) == ("\nLet me see.", "It is 4.")


def test_responses_show_the_logprobs_of_a_held_start_that_was_no_opener(tokenizer: Any) -> None:
    """Held as a possible `<think>` that turned out not to be: the tokens are the message's, logprobs included."""
    builder = OutputBuilder(ChatOutputSpec(reasoning_parser="qwen3"), want_logprobs=True)
    for piece in ["\n", "<", "b>", " hi"]:
        builder.push(piece, [_position(piece)], 1)
    builder.finish(FinishReason.STOP)
    [message] = builder.items
    assert message.text == "\n<b> hi" and [lp.sampled.token for lp in message.logprobs] == ["\n", "<", "b>", " hi"]
    assert builder.num_reasoning_tokens == 0


def test_json_after_a_prefill_of_thinking_begun_follows_the_think_block(server: Server) -> None:
    """An assistant prefill that began the thinking (`<think>\\nok`): the grammar waits for `</think>` (nudged here
    with logit_bias), and the parser too, so the JSON is the content; it was all content, `</think>` included."""
    nudge = {str(i): 12 for i in (9617, 17400, 46)}  # SmolLM2's `</`, `think`, `>`
    body = _prefilled("<think>\nok", max_tokens=30, logit_bias=nudge, response_format={"type": "json_object"})
    message = _post(server, "/v1/chat/completions", body)["choices"][0]["message"]
    assert message["reasoning"] is not None and "</think>" not in message["content"]
    assert isinstance(json.loads(message["content"]), dict)
    deltas = [c["choices"][0]["delta"] for c in _events(server, "/v1/chat/completions", body) if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]


def test_a_system_prompt_that_mentions_think_tags_opens_no_block(server: Server) -> None:
    """"Reason inside <think> tags" in the system prompt is no opener: an answer that opens no block is content."""
    messages = [{"role": "system", "content": "Reason inside <think> tags."}, {"role": "user", "content": "hi"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "logit_bias": {"44": -100}}  # no `<`
    message = _post(server, "/v1/chat/completions", body)["choices"][0]["message"]
    assert message["content"] and message["reasoning"] is None


def _lines(server: Server, body: dict[str, Any]) -> list[str]:
    """The SSE data lines of a streamed chat completion, [DONE] included."""
    with http_client().stream("POST", server.url + "/v1/chat/completions",
                              json={"model": SERVED, "stream": True, **body}, timeout=60) as response:
        assert response.status_code == 200
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_include_reasoning_false_returns_no_reasoning_whole_or_streamed(server: Server) -> None:
    """include_reasoning=false: an answer that was all reasoning comes back with no reasoning field and empty content,
    its tokens counted in usage; its logprobs null and its token ids absent (vLLM's: they would spell the reasoning
    out). Streamed, no delta carries reasoning, and the stream still ends: the finish chunk, the usage, [DONE]."""
    body = _prefilled("<think>\n", max_tokens=12, logprobs=True, return_token_ids=True)
    whole, answer, lines = _at_once(
        lambda: _post(server, "/v1/chat/completions", body),
        lambda: _post(server, "/v1/chat/completions", {**body, "include_reasoning": False}),
        lambda: _lines(server, {**body, "include_reasoning": False, "stream_options": {"include_usage": True}}))
    shown = whole["choices"][0]
    assert shown["message"]["reasoning"] and shown["logprobs"] and shown["token_ids"]
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ""}, choice
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None and "token_ids" not in choice
    assert answer["usage"]["completion_tokens"] == 12 and answer["prompt_token_ids"]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert deltas[0]["delta"]["role"] == "assistant" and deltas[-1]["finish_reason"] == "length"
    assert all("reasoning" not in d["delta"] and "reasoning_content" not in d["delta"] and d["logprobs"] is None
               and "token_ids" not in d for d in deltas[1:]), deltas
    assert "".join(d["delta"].get("content") or "" for d in deltas) == ""
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_include_reasoning_false_keeps_the_answer_after_the_thinking(server: Server) -> None:
    """Thinking, then `</think>` (nudged with logit_bias), then an answer: include_reasoning=false returns the same
    content as true, whole and streamed, without the reasoning."""
    nudge = {str(i): 12 for i in (9617, 17400, 46)}  # SmolLM2's `</`, `think`, `>`
    body = _prefilled("<think>\nok", max_tokens=20, logit_bias=nudge)
    shown, hidden, chunks = _at_once(
        lambda: _post(server, "/v1/chat/completions", body)["choices"][0]["message"],
        lambda: _post(server, "/v1/chat/completions", {**body, "include_reasoning": False})["choices"][0]["message"],
        lambda: _events(server, "/v1/chat/completions", {**body, "include_reasoning": False}))
    assert shown["reasoning"] is not None and shown["content"]
    assert hidden == {"role": "assistant", "content": shown["content"]}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any("reasoning" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == shown["content"]


# vLLM's thinking_token_budget (services/worker/thinking.py), on the same server


END_IDS = [9617, 17400, 46]  # SmolLM2's `</`, `think`, `>`: the tokenizer's spelling of `</think>`, which is forced


def _thinking(server: Server, body: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """(the choice's token ids, its message)."""
    choice = _post(server, "/v1/chat/completions", {**body, "return_token_ids": True})["choices"][0]
    return choice["token_ids"], choice["message"]


def _end_at(token_ids: list[int]) -> int:
    """Where the end marker's ids start in an output (its reasoning's length in tokens); -1: nowhere."""
    return next((i for i in range(len(token_ids)) if token_ids[i:i + len(END_IDS)] == END_IDS), -1)


@pytest.mark.parametrize("budget", [0, 2, 4])
def test_a_thinking_budget_closes_the_block_after_that_many_tokens(server: Server, tokenizer: Any,
                                                                   budget: int) -> None:
    """The prompt opened the block ("<think>\\n", whose newline counts against the budget as in vLLM): the output
    writes budget - 1 reasoning tokens (none for 0), then `</think>` is forced and the answer follows, where without
    a budget the same greedy request reasons on and never closes the block."""
    body = _prefilled("<think>\n", max_tokens=16)
    (free_ids, free), (token_ids, message) = _at_once(
        lambda: _thinking(server, body), lambda: _thinking(server, {**body, "thinking_token_budget": budget}))
    assert _end_at(free_ids) < 0 and not free["content"]
    assert len(tokenizer.encode(free["reasoning"], add_special_tokens=False)) > budget
    spent = len(tokenizer.encode("\n", add_special_tokens=False))
    assert _end_at(token_ids) == max(budget - spent, 0)
    assert token_ids[:_end_at(token_ids)] == free_ids[:_end_at(token_ids)]  # the model's own tokens until then
    assert message["content"] and message["reasoning"] == tokenizer.decode(token_ids[:_end_at(token_ids)])


def test_a_block_the_model_closes_within_the_budget_is_left_as_it_was(server: Server, tokenizer: Any) -> None:
    """`</think>` nudged with logit_bias, written after a few reasoning tokens: a budget that covers them (down to
    the last one before the marker) leaves the answer the same token for token; one below cuts the thinking there."""
    body = _prefilled("<think>\nok", max_tokens=20, logit_bias={str(i): 5 for i in END_IDS})
    spent = len(tokenizer.encode("\nok", add_special_tokens=False))  # the prompt's own tokens in the block
    # at once: those that need no answer first (the engine batches them), then the budget that needs `end`
    (free_ids, free), covering, (cut_ids, cut) = _at_once(
        lambda: _thinking(server, body), lambda: _thinking(server, {**body, "thinking_token_budget": 64}),
        lambda: _thinking(server, {**body, "thinking_token_budget": spent + 2}))
    end = _end_at(free_ids)
    assert end > 2 and free["content"], free
    assert covering == (free_ids, free), 64
    assert _thinking(server, {**body, "thinking_token_budget": spent + end}) == (free_ids, free), spent + end
    assert _end_at(cut_ids) == 2 and cut_ids[:2] == free_ids[:2] and cut["reasoning"] != free["reasoning"]


def test_a_thinking_budget_streams_as_it_answers_whole(server: Server) -> None:
    """The forced `</think>` splits the stream's deltas where it splits the whole answer."""
    body = _prefilled("<think>\n", max_tokens=12, thinking_token_budget=3)
    message = _post(server, "/v1/chat/completions", body)["choices"][0]["message"]
    deltas = [c["choices"][0]["delta"] for c in _events(server, "/v1/chat/completions", body) if c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"] != ""


def test_a_thinking_budget_with_response_format_starts_the_grammar_at_the_forced_end(server: Server) -> None:
    """Thinking that would not end by itself (without a budget the JSON never starts) is closed, and the grammar
    takes the answer from there."""
    body = _prefilled("<think>\n", max_tokens=24, response_format={"type": "json_object"})
    assert _post(server, "/v1/chat/completions", body)["choices"][0]["message"]["content"] == ""
    message = _post(server, "/v1/chat/completions", {**body, "thinking_token_budget": 2})["choices"][0]["message"]
    assert message["reasoning"] is not None and message["content"].startswith("{")


def test_bad_words_that_ban_the_forced_end_are_a_400(server: Server) -> None:
    """The end marker must come once the budget is spent: bad_words that ban its first token leave no token."""
    body = _prefilled("<think>\n", max_tokens=4, thinking_token_budget=0, bad_words=["</"])
    response = http_client().post(server.url + "/v1/chat/completions", json={"model": SERVED, **body}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "bad_words", response.text
    assert "thinking_token_budget" in response.json()["error"]["message"]


@pytest.mark.parametrize("value", [-2, 2**31, 2**70, 1.5, True, "3"])
def test_bad_thinking_budgets_are_refused_naming_the_field(server: Server, value: object) -> None:
    """vLLM's values are a non-negative integer, or -1 (or null) for none; past int32 is refused as other counts."""
    body = _prefilled("<think>\n", max_tokens=2, thinking_token_budget=value)
    response = http_client().post(server.url + "/v1/chat/completions", json={"model": SERVED, **body}, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "thinking_token_budget", response.text
    assert "[0, 2147483647]" in error["message"] or "Expected `int | null`" in error["message"], error


def test_no_thinking_budget_is_vllms_minus_one_or_null(server: Server) -> None:
    body = _prefilled("<think>\n", max_tokens=6)
    plain = _thinking(server, body)
    assert _thinking(server, {**body, "thinking_token_budget": -1}) == plain
    assert _thinking(server, {**body, "thinking_token_budget": None}) == plain


def test_a_thinking_budget_on_completions_is_refused(server: Server) -> None:
    """/v1/completions renders no chat template: no reasoning parser reads a think block there (no budget passes)."""
    def post(budget: int) -> Any:
        return http_client().post(server.url + "/v1/completions", timeout=60, json={
            "model": SERVED, "prompt": "<think>\n", "max_tokens": 2, "thinking_token_budget": budget})

    refused = post(3)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget"
    assert "/v1/completions" in refused.json()["error"]["message"]
    assert post(-1).status_code == 200
