"""Context-length limits on every route, against vLLM: a prompt (plus max_tokens) past the context, or past a KV cache
smaller than the context, is a 400 in vLLM's words (clients match "This model's maximum context length is"; the
Messages API in Anthropic's); a request exactly at the limit runs and ends with finish_reason "length"; an unset
max_tokens (chat, or completions' null) fills what the context leaves; many long requests over the KV cache's size
are preempted and each answers as it does alone; nothing is left holding KV blocks."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagoda.services.api.anthropic import anthropic_context_error
from pagoda.services.api.errors import UpstreamError
from pagoda.services.api.handlers import _name_max_completion_tokens
from pagoda.services.protocol import anthropic as anthropic_protocol
from pagoda.services.protocol import responses as responses_protocol
from pagoda.services.protocol.schemas import ChatBody, CompletionBody, completion_params, decode_body
from pagoda.services.tokenizer.prompts import check_prompt, prompt_room
from pagoda.shared.config import parse_token_count
from pagoda.shared.errors import ConfigError, ContextLengthError, InvalidRequestError
from pagoda.shared.messages import ModelInfo, RequestFailed, SamplingParams
from tests.harness import SERVED, Server, http_client, running_server, wait_until
from tests.test_scheduler import FakeWorker, assert_all_free, make_request, make_scheduler, run_until_done

VLLM_WORDS = "This model's maximum context length is "
CONTEXT = ModelInfo(max_model_len=512, vocab_size=49152, max_num_tokens=23296, eos_token_ids=[2])
SMALL_CACHE = ModelInfo(max_model_len=512, vocab_size=49152, max_num_tokens=128, eos_token_ids=[2])


def refusal(token_ids: list[int], info: ModelInfo, **params: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as refused:
        check_prompt(token_ids, SamplingParams(**params), info, "prompt")
    return refused.value


# --------------------------------------------------------------------------------------------
# the tokenizer's checks, the offline engine's, and the words of each route


def test_the_context_refusals_read_as_vllms() -> None:
    check_prompt([5] * 511, SamplingParams(max_tokens=1), CONTEXT, "prompt")  # exactly the context
    check_prompt([5] * 511, SamplingParams(max_tokens=None), CONTEXT, "prompt")
    too_long = refusal([5] * 512, CONTEXT, max_tokens=None)
    assert (type(too_long), too_long.param, too_long.code) == (ContextLengthError, "prompt", "context_length_exceeded")
    assert too_long.message.startswith(VLLM_WORDS + "512 tokens. However, your request has 512 input tokens")
    over = refusal([5] * 511, CONTEXT, max_tokens=2)
    assert (over.param, over.code) == ("max_tokens", "context_length_exceeded")
    assert over.message == ("max_tokens is too large: 2. This model's maximum context length is 512 tokens and your "
                            "request has 511 input tokens (2 > 512 - 511).")


def test_a_kv_cache_smaller_than_the_context_bounds_prompt_and_max_tokens() -> None:
    """128 tokens of cache under a 512-token context: 100 + 29 could never finish (it was cut at 28 with
    finish_reason "length"); truncate_prompt_tokens -1 keeps room for max_tokens in the cache too."""
    check_prompt([5] * 100, SamplingParams(max_tokens=28), SMALL_CACHE, "prompt")
    over = refusal([5] * 100, SMALL_CACHE, max_tokens=29)
    assert over.param == "max_tokens" and "KV cache holds at most 128 tokens" in over.message
    assert "(29 > 128 - 100)" in over.message and VLLM_WORDS + "512 tokens" in over.message
    assert refusal([5] * 128, SMALL_CACHE).param == "prompt"
    assert prompt_room(512, 128, 4) == 124 and prompt_room(512, 23296, 4) == 508 and prompt_room(512, 128, None) == 127


def test_min_tokens_past_what_an_unset_max_tokens_leaves_is_refused() -> None:
    """vLLM fills an unset max_tokens with the room left and refuses min_tokens > max_tokens; pagoda took it and
    stopped at the context short of min_tokens."""
    check_prompt([5] * 500, SamplingParams(max_tokens=None, min_tokens=12), CONTEXT, "prompt")
    refused = refusal([5] * 500, CONTEXT, max_tokens=None, min_tokens=13)
    assert refused.param == "min_tokens" and "12 tokens" in refused.message
    assert refusal([5] * 100, SMALL_CACHE, max_tokens=None, min_tokens=29).param == "min_tokens"


def test_the_offline_engines_scheduler_refuses_as_the_tokenizer() -> None:
    sched = make_scheduler(num_blocks=8, block_size=16, max_model_len=512)  # 128 tokens of cache
    for args, error, param in ((dict(prompt=100, max_tokens=29), ContextLengthError, "max_tokens"),
                               (dict(prompt=128, max_tokens=None), ContextLengthError, "prompt"),
                               (dict(prompt=100, max_tokens=None, min_tokens=29), InvalidRequestError, "min_tokens")):
        with pytest.raises(error) as refused:
            sched.validate(make_request("bad", **args))  # type: ignore[arg-type]
        assert refused.value.param == param, refused.value
        assert ("min_tokens must not exceed max_tokens" if param == "min_tokens" else VLLM_WORDS) in \
            refused.value.message
    good = make_request("good", 100, max_tokens=28)  # exactly the cache
    sched.validate(good)
    sched.add_request(good)
    run_until_done(sched, FakeWorker(16))
    assert good.sequences[0].num_output_tokens == 28
    assert_all_free(sched)


def test_a_beam_search_is_sized_by_what_one_sequence_can_hold() -> None:
    """An unset max_tokens runs each beam to the context or the cache, whichever is smaller: the refusal of a group
    that cannot fit names that length (128 here), not the 512-token context no beam can reach."""
    sched = make_scheduler(num_blocks=8, block_size=16, max_model_len=512)
    with pytest.raises(ContextLengthError) as refused:
        sched.validate(make_request("beam", 20, max_tokens=None, use_beam_search=True, n=2, best_of=2))
    assert refused.value.param == "best_of" and "over 128 tokens needs up to 16 KV blocks" in refused.value.message
    sched.validate(make_request("beam", 20, max_tokens=40, use_beam_search=True, n=2, best_of=2))  # 2 x 4 blocks


def wire(error: ContextLengthError) -> UpstreamError:
    """The error as the api gets it from the tokenizer (RequestFailed carries message, param and code)."""
    return UpstreamError.from_failed(RequestFailed("r", error.http_status, error.message, error.error_type,
                                                   error.param, error.code))


def test_each_route_names_its_own_fields() -> None:
    too_long = ContextLengthError.prompt_too_long(730, "messages", 512, 23296)
    over = ContextLengthError.max_tokens_too_large(500, 13, 512, 23296)
    # Messages: Anthropic's words, no field in front (clients of Anthropic's API match them)
    for error, message in ((too_long, "prompt is too long: 730 tokens > 511 maximum"),
                           (over, "input length and `max_tokens` exceed context limit: 500 + 13 > 512, decrease "
                                  "input length or `max_tokens` and try again")):
        renamed = anthropic_context_error(anthropic_protocol.rename_error(wire(error)))
        assert (renamed.message, renamed.param, renamed.code, renamed.http_status) == (
            message, None, "context_length_exceeded", 400)
    other = InvalidRequestError("stop strings must not be empty", param="stop")
    assert anthropic_context_error(other) is other
    # Responses: max_output_tokens, input
    assert responses_protocol.rename_error(wire(over)).message.startswith("max_output_tokens is too large: 13.")
    assert "(input)" in responses_protocol.rename_error(wire(too_long)).message
    # chat: max_completion_tokens when the body sent it
    hi = [{"role": "user", "content": "hi"}]
    for fields, param in (({"max_completion_tokens": 13}, "max_completion_tokens"), ({"max_tokens": 13}, "max_tokens")):
        body = decode_body(json.dumps({"model": "m", "messages": hi, **fields}).encode(), ChatBody)
        error = wire(ContextLengthError.max_tokens_too_large(500, 13, 512, 23296))
        _name_max_completion_tokens(error, body)
        assert error.param == param and error.message.startswith(f"{param} is too large: 13.")


def test_completions_max_tokens_null_is_unset_as_vllms() -> None:
    def max_tokens(**fields: object) -> int | None:
        body = decode_body(json.dumps({"model": "m", "prompt": "hi", **fields}).encode(), CompletionBody)
        return completion_params(body).max_tokens

    assert (max_tokens(), max_tokens(max_tokens=None), max_tokens(max_tokens=5)) == (16, None, 5)


def test_only_max_model_len_hints_at_vllms_auto() -> None:
    for param, hinted in (("max_model_len", True), ("max_num_batched_tokens", False)):
        with pytest.raises(ConfigError) as refused:
            parse_token_count("-1", param)
        assert ("vLLM's auto" in refused.value.message) is hinted and refused.value.param == param


# --------------------------------------------------------------------------------------------
# served: a 120-token context over a 128-token KV cache, prefills in chunks of 32 tokens

MAX_MODEL_LEN = 120
NUM_KV_BLOCKS = 8  # of 16 tokens: one request fits, two long ones do not (preemption)


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[Server]:
    with running_server(smollm2_dir, "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(NUM_KV_BLOCKS),
                        "--max-num-batched-tokens", "32") as served:
        yield served


def post(server: Server, path: str, **body: Any) -> tuple[int, dict[str, Any]]:
    reply = http_client().post(server.url + path, json={"model": SERVED, **body}, timeout=120)
    return reply.status_code, reply.json()


def ids(n: int, first: int = 300) -> list[int]:
    return [first + i for i in range(n)]


def test_completions_at_and_past_the_context(server: Server) -> None:
    status, body = post(server, "/v1/completions", prompt=ids(110), max_tokens=10, ignore_eos=True, temperature=0)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] | {"prompt_tokens_details": None} == {"prompt_tokens": 110, "completion_tokens": 10,
                                                                "total_tokens": 120, "prompt_tokens_details": None}
    status, body = post(server, "/v1/completions", prompt=ids(110), max_tokens=None, ignore_eos=True, temperature=0)
    assert status == 200 and body["usage"]["completion_tokens"] == 10  # null: what the context leaves
    for prompt, max_tokens, param in ((ids(110), 11, "max_tokens"), (ids(120), 1, "prompt"),
                                      (" a" * 120, 1, "prompt"),  # as text: 120 tokens
                                      ([ids(10), ids(130)], 2, "prompt")):  # one of a batch: the whole request
        status, body = post(server, "/v1/completions", prompt=prompt, max_tokens=max_tokens)
        assert status == 400, body
        error = body["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param,
                                                                  "context_length_exceeded")
        assert error["message"].startswith(VLLM_WORDS + "120 tokens") or "(11 > 120 - 110)" in error["message"]


def test_chat_responses_and_messages_at_the_context(server: Server) -> None:
    messages = [{"role": "user", "content": " a" * 60}]
    status, counted = post(server, "/tokenize", messages=messages)
    num_prompt_tokens = counted["count"]
    room = MAX_MODEL_LEN - num_prompt_tokens
    status, body = post(server, "/v1/chat/completions", messages=messages, ignore_eos=True, temperature=0)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == MAX_MODEL_LEN  # unset max_tokens: fills the context
    status, body = post(server, "/v1/chat/completions", messages=messages, max_completion_tokens=room + 1)
    assert (status, body["error"]["param"]) == (400, "max_completion_tokens")
    status, body = post(server, "/v1/chat/completions", messages=messages, min_tokens=room + 1)
    assert (status, body["error"]["param"]) == (400, "min_tokens")
    status, body = post(server, "/v1/responses", input=messages, max_output_tokens=room + 1)
    assert (status, body["error"]["param"]) == (400, "max_output_tokens")
    status, body = post(server, "/v1/messages", messages=messages, max_tokens=room + 1)
    assert status == 400 and body["error"]["message"].startswith(
        f"input length and `max_tokens` exceed context limit: {num_prompt_tokens} + {room + 1} > {MAX_MODEL_LEN}")
    long_messages = [{"role": "user", "content": " a" * 200}]
    status, body = post(server, "/v1/messages", messages=long_messages, max_tokens=1)
    assert status == 400 and body["error"]["message"].startswith("prompt is too long: ")
    status, body = post(server, "/v1/messages/count_tokens", messages=long_messages)  # counts, as /tokenize
    assert status == 200 and body["input_tokens"] > MAX_MODEL_LEN


def test_a_stream_ends_at_the_context(server: Server) -> None:
    body = {"model": SERVED, "prompt": ids(110), "max_tokens": 10, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with http_client().stream("POST", server.url + "/v1/completions", json=body, timeout=120) as reply:
        events = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"]["total_tokens"] == MAX_MODEL_LEN


def test_long_requests_over_the_kv_cache_answer_as_alone(server: Server) -> None:
    """Three completions of one 40-token prompt (n=3, temperature 0) growing to 70 tokens each outgrow the
    128-token cache together (2 shared prompt blocks + 3 x 3 of their own > 8), so one is preempted whatever the
    timing; three prompts of 70-90 tokens (chunked by 32) sent at once overflow it too. Every completion answers
    as it does alone, and every block is free after."""

    def complete(prompt: list[int], max_tokens: int, n: int = 1) -> list[str]:
        status, body = post(server, "/v1/completions", prompt=prompt, max_tokens=max_tokens, n=n, temperature=0,
                            ignore_eos=True)
        assert status == 200, body
        return [choice["text"] for choice in body["choices"]]

    preempted_before = server.metrics()["pagoda_num_preemptions_total"]
    # 30 tokens reach a 5th block as 40 did (past 64 tokens: from 26 on), in 10 fewer steps of each run
    assert complete(ids(40), 30, n=3) == complete(ids(40), 30) * 3
    wait_until(lambda: server.metrics()["pagoda_num_preemptions_total"] > preempted_before, timeout=60,
               what="a preemption counted", interval=0.2)
    prompts = [ids(70 + 10 * i, first=1000 + 997 * i) for i in range(3)]
    alone = [complete(prompt, 8) for prompt in prompts]
    together: list[list[str] | None] = [None] * len(prompts)

    def run(i: int) -> None:
        together[i] = complete(prompts[i], 8)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone
    # a client that hangs up during its prefill leaves no request and no block behind
    request = json.dumps({"model": SERVED, "prompt": ids(110), "max_tokens": 5, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(request), request))
        assert client.recv(12) == b"HTTP/1.1 200"  # the stream has begun: the request is the scheduler's
    wait_until(lambda: (metrics := server.metrics())["pagoda_num_requests_running"] == 0
               and metrics["pagoda_num_requests_waiting"] == 0
               and metrics["pagoda_kv_blocks_free"] == metrics["pagoda_kv_blocks_total"] == NUM_KV_BLOCKS,
               timeout=60, what="every request over and every KV block free", interval=0.2)
