"""The whole server as users run it: `pagoda serve` with SmolLM2, real processes, the official openai client."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
import zmq

from pagoda import LLM, SamplingParams
from tests.harness import SERVED, Server, running_server, wait_until

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "1, 2, 3, 4,",
           "def fibonacci(n):", "The best way to learn a language is"]
CHAT = [{"role": "user", "content": "What is the boiling point of water?"}]


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    return smollm2_server  # conftest's one default SmolLM2 server, shared with tests/test_tools.py


@pytest.fixture(scope="module")
def offline(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), max_model_len=1024)


def _offline_text(llm: LLM, prompt: str | list[int], max_tokens: int) -> tuple[str, str, int, int]:
    """Greedy text, finish reason, prompt tokens and generated tokens of the in-process engine."""
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))
    completion = out.outputs[0]
    return completion.text, completion.finish_reason or "", len(out.prompt_token_ids), len(completion.token_ids)


# ------------------------------------------------------------------ 1. chat and completions


def test_completions_match_the_offline_engine(server: Server, offline: LLM) -> None:
    client = server.client()
    lengths = (8, 20, 12, 16, 4)
    # the offline engine's answers in one batch (20 steps, not 60), then the server's, sent at once (batched too)
    expected = offline.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths])
    with concurrent.futures.ThreadPoolExecutor(len(lengths)) as pool:
        responses = list(pool.map(lambda case: client.completions.create(
            model=SERVED, prompt=case[0], max_tokens=case[1], temperature=0), zip(PROMPTS, lengths, strict=True)))
    for out, response in zip(expected, responses, strict=True):
        completion = out.outputs[0]
        text, reason = completion.text, completion.finish_reason or ""
        num_prompt, num_generated = len(out.prompt_token_ids), len(completion.token_ids)
        choice = response.choices[0]
        assert response.object == "text_completion"
        assert choice.text == text and choice.finish_reason == reason
        assert response.usage.prompt_tokens == num_prompt
        assert response.usage.completion_tokens == num_generated
        assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_echo_with_logprobs_scores_the_prompt_like_the_offline_engine(server: Server, offline: LLM) -> None:
    """The legacy scoring call (lm-eval-harness's loglikelihood): echo + logprobs lists every prompt token,
    the first with no logprob, then the completion's; the numbers are the in-process engine's."""
    prompt = "The capital of France is Paris, and the capital of Italy is"
    [out] = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2, logprobs=2))
    assert out.prompt_logprobs is not None
    response = server.client().completions.create(model=SERVED, prompt=prompt, max_tokens=1, temperature=0,
                                                  echo=True, logprobs=2)
    choice = response.choices[0]
    num_prompt = len(out.prompt_token_ids)
    assert choice.text == prompt + out.outputs[0].text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == num_prompt + 1 and "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [entry[token] for entry, token in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:], strict=True)]
    assert logprobs.token_logprobs[1:num_prompt] == pytest.approx(expected, abs=1e-4)
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(num_prompt + 1)]
    assert response.usage.prompt_tokens == num_prompt and response.usage.completion_tokens == 1
    # max_tokens=0 (the older scoring call): the prompt and its scores, nothing generated.
    scored = server.client().completions.create(model=SERVED, prompt=prompt, max_tokens=0, temperature=0,
                                                echo=True, logprobs=2)
    assert scored.choices[0].text == prompt and scored.choices[0].finish_reason == "length"
    assert scored.choices[0].logprobs.token_logprobs == logprobs.token_logprobs[:num_prompt]
    assert scored.usage.completion_tokens == 0
    # A one-token prompt has nothing scored, yet is listed.
    single = server.client().completions.create(model=SERVED, prompt=[out.prompt_token_ids[0]], max_tokens=2,
                                                temperature=0, echo=True, logprobs=0).choices[0].logprobs
    assert len(single.tokens) == 3 and single.token_logprobs[0] is None and single.tokens[0] == logprobs.tokens[0]


def test_streamed_completion_concatenates_to_the_same_text(server: Server, offline: LLM) -> None:
    text, reason, num_prompt, _ = _offline_text(offline, PROMPTS[1], 40)
    stream = server.client().completions.create(model=SERVED, prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == num_prompt


def test_chat_streaming_and_not(server: Server, offline: LLM) -> None:
    [expected] = offline.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=12))
    client = server.client()
    response = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=12, temperature=0)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.outputs[0].text
    assert response.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.outputs[0].token_ids)

    chunks = list(client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == expected.outputs[0].finish_reason


def test_raw_stream_ends_with_done(server: Server) -> None:
    body = {"model": SERVED, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


# ------------------------------------------------------------------ 2. concurrency and batching


def _stream_text(client: openai.OpenAI, prompt: str, max_tokens: int) -> tuple[str, str | None]:
    chunks = list(client.completions.create(model=SERVED, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            stream=True))
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return "".join(c.choices[0].text for c in chunks if c.choices), reasons[-1] if reasons else None


def test_32_concurrent_streams_complete_and_batch(server: Server, offline: LLM) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(32)]
    lengths = [2 + (i * 7) % 15 for i in range(32)]  # 2..16 tokens: rows finish at different steps
    expected = offline.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths])
    client = server.client(timeout=600)
    peak_running = 0
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(_stream_text, client, p, n) for p, n in zip(prompts, lengths, strict=True)]
        while not all(f.done() for f in futures):
            peak_running = max(peak_running, server.metrics().get("pagoda_num_requests_running", 0))
            time.sleep(0.1)  # sampling a gauge while the load runs
        results = [f.result() for f in futures]
    for (text, reason), out in zip(results, expected, strict=True):
        assert text == out.outputs[0].text and reason == out.outputs[0].finish_reason
    assert peak_running > 1


# ------------------------------------------------------------------ 4. abort frees blocks


def test_disconnected_streams_are_aborted_and_free_their_blocks(server: Server) -> None:
    wait_until(lambda: server.metrics().get("pagoda_num_requests_running") == 0, 30, "the server to be idle")
    idle_free = server.metrics()["pagoda_kv_blocks_free"]

    def read_a_few_then_leave(i: int) -> int:
        body = {"model": SERVED, "prompt": f"Tell me a long story, part {i}.", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        seen = 0
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                seen += line.startswith("data: {")
                if seen >= 3:
                    break  # closing the stream mid-way is the disconnect
        return seen

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(n >= 3 for n in pool.map(read_a_few_then_leave, range(8)))
    left_at = time.monotonic()
    wait_until(lambda: server.metrics().get("pagoda_num_requests_running") == 0
               and server.metrics().get("pagoda_kv_blocks_free") == idle_free, 2.0, "aborted requests to free blocks")
    assert time.monotonic() - left_at <= 2.0


# ------------------------------------------------------------------ 5. process layout


def test_each_service_is_its_own_process_and_the_api_has_no_torch(server: Server) -> None:
    children = server.children()
    assert set(children) == {"api", "tokenizer", "scheduler", "worker"}
    pids = [pid for group in children.values() for pid in group]
    assert len(pids) == len(set(pids)) == 4
    [api_pid] = children["api"]
    assert "libtorch" not in Path(f"/proc/{api_pid}/maps").read_text()
    [worker_pid] = children["worker"]
    assert "libtorch" in Path(f"/proc/{worker_pid}/maps").read_text()


# ------------------------------------------------------------------ 6. bad input


@pytest.mark.parametrize(("body", "status", "param"), [
    (b"{not json", 400, None),
    ({"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ({"model": SERVED, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": SERVED, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ({"model": SERVED, "prompt": "hi", "temperature": [1]}, 400, "temperature"),
    ({"model": SERVED, "prompt": "word " * 1100}, 400, "prompt"),
    ({"model": SERVED, "prompt": "hi", "max_tokens": 2000}, 400, "max_tokens"),
])
def test_bad_requests_get_openai_errors(server: Server, body: object, status: int, param: str | None) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(server.url + "/v1/completions", timeout=30, **kwargs)  # type: ignore[arg-type]
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_garbage_frames_are_dropped(server: Server) -> None:
    context = zmq.Context()
    try:
        for name, kind in (("api0", zmq.DEALER), ("scheduler", zmq.DEALER), ("result", zmq.PUSH)):
            sock = context.socket(kind)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(f"ipc://{server.runtime_dir}/{name}.sock")
            sock.send_multipart([b"\xff\x00garbage", b"more"])
            sock.send(b"\xc1\xc1\xc1")
            sock.close()
    finally:
        context.term()
    response = server.client().completions.create(model=SERVED, prompt="Still alive?", max_tokens=4)
    assert response.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ------------------------------------------------------------------ 3. several tokenizers and apis


@pytest.mark.extended  # tests/test_compose_processes.py runs 2 apis + 2 tokenizers in the default run
def test_two_tokenizers_and_two_apis(smollm2_dir: Path, offline: LLM) -> None:
    with running_server(smollm2_dir, "--tokenizer-workers", "2", "--api-workers", "2") as server:
        children = server.children()
        assert len(children["tokenizer"]) == 2 and len(children["api"]) == 2
        client = server.client(timeout=300)
        prompts = [f"{PROMPTS[i % len(PROMPTS)]} [{i}]" for i in range(16)]
        expected = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda p: _stream_text(client, p, 12), prompts))
        for (text, _), out in zip(results, expected, strict=True):
            assert text == out.outputs[0].text
        chat = client.chat.completions.create(model=SERVED, messages=CHAT, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content
        per_tokenizer = {k: v for k, v in server.metrics().items() if k.startswith("pagoda_tokenizer_requests_total")}
        assert len(per_tokenizer) == 2 and all(v > 0 for v in per_tokenizer.values()), per_tokenizer


# ------------------------------------------------------------------ 7. SIGTERM under load


@pytest.mark.extended  # test_api.py (drain, then fail what is left) and tests/reliability cover SIGTERM
def test_sigterm_during_load_ends_cleanly(smollm2_dir: Path) -> None:
    with running_server(smollm2_dir) as server:
        client = server.client(timeout=60)
        pids = [pid for group in server.children().values() for pid in group]

        def one(i: int) -> str:
            try:
                text, reason = _stream_text(client, f"Count slowly to one hundred, take {i}:", 200)
                return f"done:{reason}"
            except (openai.APIError, httpx.HTTPError) as exc:
                return f"error:{type(exc).__name__}"

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(one, i) for i in range(6)]
            wait_until(lambda: server.metrics().get("pagoda_num_requests_running", 0) > 0, 60, "load to start")
            stopped_at = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            outcomes = [f.result(timeout=30) for f in futures]
        server.process.wait(timeout=15)
        assert time.monotonic() - stopped_at <= 12.0
        assert all(o.startswith(("done:", "error:")) for o in outcomes)
        assert not [pid for pid in pids if Path(f"/proc/{pid}").exists() and _alive(pid)]
        assert not server.runtime_dir.exists() or not any(server.runtime_dir.glob("*.sock"))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in state



# ------------------------------------------------------------------ token ids (vLLM's return_token_ids)


def test_return_token_ids_on_both_endpoints(server: Server, offline: LLM) -> None:
    tokenizer = offline.get_tokenizer()
    body = {"model": SERVED, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    out = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    [choice] = out["choices"]
    assert len(choice["token_ids"]) == out["usage"]["completion_tokens"]
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    assert choice["prompt_token_ids"] == tokenizer.encode(PROMPTS[0])
    # Streamed: every chunk's ids, joined, are the whole response's; the first chunk brings the prompt's.
    chunks = _sse_json(server, "/v1/completions", {**body, "stream": True})
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    chat = {"model": SERVED, "messages": CHAT, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    out = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    [choice] = out["choices"]
    assert len(out["prompt_token_ids"]) == out["usage"]["prompt_tokens"]
    assert tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]
    chunks = _sse_json(server, "/v1/chat/completions", {**chat, "stream": True})
    assert chunks[0]["prompt_token_ids"] == out["prompt_token_ids"]
    assert [t for c in chunks for t in c["choices"][0].get("token_ids", [])] == choice["token_ids"]


def test_beam_search_on_both_endpoints_matches_the_offline_engine(server: Server, offline: LLM) -> None:
    """use_beam_search (vLLM's field): the n best beams as choices, best first, as the in-process engine has them."""
    fields = {"max_tokens": 6, "use_beam_search": True, "best_of": 3, "n": 2, "length_penalty": 0.8}
    params = SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=6, length_penalty=0.8)
    [expected] = offline.generate([PROMPTS[0]], params)
    out = httpx.post(server.url + "/v1/completions", json={"model": SERVED, "prompt": PROMPTS[0], **fields},
                     timeout=60).json()
    assert [c["text"] for c in out["choices"]] == [c.text for c in expected.outputs]
    assert out["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in expected.outputs)
    [chat_expected] = offline.chat(CHAT, params)
    out = httpx.post(server.url + "/v1/chat/completions", json={"model": SERVED, "messages": CHAT, **fields},
                     timeout=60).json()
    assert [c["message"]["content"] for c in out["choices"]] == [c.text for c in chat_expected.outputs]


def _sse_json(server: Server, path: str, body: dict[str, object]) -> list[dict]:
    """The JSON chunks of a raw SSE stream, in order, up to [DONE]."""
    chunks = []
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_dummy_weights_without_tokenizer_stream_one_chunk_per_step() -> None:
    """No tokenizer: no text, yet every step's token goes out as a chunk with its token_ids."""
    with running_server(Path("tiny"), "--load-format", "dummy") as dummy:
        body = {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        whole = httpx.post(dummy.url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=60).json()
        [choice] = whole["choices"]
        assert choice["prompt_token_ids"] == [1, 2, 3] and len(choice["token_ids"]) == 6
        chunks = _sse_json(dummy, "/v1/completions", {**body, "stream": True})
        with_ids = [c["choices"][0]["token_ids"] for c in chunks if c["choices"][0].get("token_ids")]
        assert with_ids == [[t] for t in choice["token_ids"]]  # one chunk per step, one token each
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        asked = _sse_json(dummy, "/v1/completions", {**body, "stream": True, "return_token_ids": True})
        assert asked[0]["choices"][0]["prompt_token_ids"] == [1, 2, 3]
        assert [t for c in asked for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
