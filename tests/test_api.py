"""The api process against a fake tokenizer and fake scheduler stats: OpenAI shapes, errors, liveness, shutdown."""

from __future__ import annotations

import gzip
import itertools
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from pagoda.services.protocol.schemas import MAX_TURNS
from pagoda.shared.delivery import Link
from pagoda.shared.messages import (
    AbortRequest,
    Accepted,
    Ack,
    ApiToTokenizer,
    DetokenizeRequest,
    DetokenizeResult,
    FinishReason,
    GenerateRequest,
    Heartbeat,
    PositionLogprobs,
    RequestFailed,
    SchedulerStats,
    Sequenced,
    TextDelta,
    TextDeltas,
    TokenizeRequest,
    TokenizeResult,
    TokenizerHello,
    TokenizerToApi,
    TokenLogprob,
)
from pagoda.shared.transport import Codec, ack_frame, unseal
from tests.harness import HTTP, die_with_parent, free_port, wait_until

API_KEY = "test-key"
MODEL = "smollm2-135m-instruct"
MODEL_PATH = f"/models/{MODEL}"  # never read: the api only derives the served name from it
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
NUM_FAKE_TOKENS = 8  # a fake completion without a smaller max_tokens stops ("stop") after this many
SLOW_TOKEN_S = 0.02  # prompts containing "slow" get one token per this many seconds
HEARTBEAT_S = 0.1
MAX_MODEL_LEN = 2048
FAKE_STATS = SchedulerStats(
    time=0.0, num_running=3, num_waiting=2, kv_blocks_free=90, kv_blocks_total=100, kv_cache_usage=0.1,
    prefix_hit_tokens_total=40, prefix_query_tokens_total=100, num_preemptions_total=1, num_swapped_total=1,
    prompt_tokens_total=1234,
    generation_tokens_total=567, num_steps_total=10, worker_ready=True, worker_alive=True,
    tokenizer_ids=["fake-tok", "fake-tok-2"], tokenizer_requests_total=[7, 0], max_model_len=MAX_MODEL_LEN)


# --------------------------------------------------------------------------------------------
# fakes: a tokenizer process and the scheduler's stats feed


@dataclass
class FakeStream:
    request_id: str
    n: int
    tag: str  # token k of completion i reads f"{tag}{i}.{k} "
    num_tokens: int
    finish_reason: int
    interval_s: float
    num_logprobs: int | None
    next_at: float
    num_sent: int = 0


def fake_token(tag: str, index: int, k: int) -> str:
    return f"{tag}{index}.{k} "


def fake_text(tag: str, index: int, num_tokens: int) -> str:
    return "".join(fake_token(tag, index, k) for k in range(num_tokens))


class FakeTokenizer:
    """A DEALER that behaves like a tokenizer process; prompts with "slow", "hang" or "reject" change its pace, and
    one with the word "held" waits for release(its request id)."""

    def __init__(self, endpoint: str, identity: bytes = b"fake-tok",
                 sampling_defaults: dict[str, float | int] | None = None) -> None:
        self.endpoint = endpoint
        self.identity = identity
        self.sampling_defaults = sampling_defaults or {}  # announced in its hellos, as the model's generation config
        self.requests: dict[str, GenerateRequest] = {}
        self.aborted: set[str] = set()
        self.api_streams: list[int] = []  # the api's sequenced streams to it, in the order they began
        self.alive = threading.Event()  # cleared: silent like a hung process (no heartbeats, no replies)
        self.alive.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-tokenizer", daemon=True)
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()

    def release(self, request_id: str) -> None:
        """A "held" request starts its tokens (at its next turn of the loop)."""
        self._released.put(request_id)

    def start(self) -> FakeTokenizer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        out: Codec[TokenizerToApi] = Codec(TokenizerToApi)
        inbound: Codec[ApiToTokenizer] = Codec(ApiToTokenizer)
        sock.send(out.encode(self._hello()))
        streams: dict[str, FakeStream] = {}
        link: Link[ApiToTokenizer] = Link(resend_s=0.5)
        next_heartbeat = 0.0
        beats = itertools.count(1)
        while not self._stop.is_set():
            if not self.alive.is_set():
                self._stop.wait(0.02)
                continue
            now = time.monotonic()
            if now >= next_heartbeat:
                beat = (self._hello() if next(beats) % 4 == 0
                        else Heartbeat(self.identity.decode(), len(streams)))  # a hello every 4 beats, as the real one
                sock.send(out.encode(beat))
                next_heartbeat = now + HEARTBEAT_S
            due = min([s.next_at for s in streams.values()] + [next_heartbeat])
            if sock.poll(max(0, min(50, int((due - now) * 1000)))):
                while sock.poll(0):
                    message = inbound.decode(sock.recv())
                    if isinstance(message, Sequenced | Ack):  # the api's stream: applied once, in order, acked
                        messages = unseal(inbound, link, message, time.monotonic())
                        sock.send(ack_frame(out, link))
                        if link.peer_stream not in self.api_streams:
                            self.api_streams.append(link.peer_stream)
                    else:
                        messages = [message]
                    for reply in (r for m in messages for r in self._handle(m, streams)):
                        sock.send(out.encode(reply))
            while not self._released.empty():
                held = streams.get(self._released.get())
                if held is not None:
                    held.next_at = time.monotonic()
            batch = self._due_deltas(streams, time.monotonic())
            if batch:
                sock.send(out.encode(TextDeltas(batch)))
        sock.close()
        context.term()

    def _hello(self) -> TokenizerHello:
        return TokenizerHello(self.identity.decode(), os.getpid(), sampling_defaults=self.sampling_defaults)

    def _handle(self, message: ApiToTokenizer | None, streams: dict[str, FakeStream]) -> list[Any]:
        if isinstance(message, AbortRequest):
            self.aborted.add(message.request_id)
            streams.pop(message.request_id, None)
            return []
        if isinstance(message, TokenizeRequest):
            text = message.prompt_text or " ".join(m.content for m in message.messages or [])
            return [TokenizeResult(message.request_id, list(range(len(text.split()))), MAX_MODEL_LEN)]
        if isinstance(message, DetokenizeRequest):
            return [DetokenizeResult(message.request_id, " ".join(f"<{t}>" for t in message.token_ids))]
        if not isinstance(message, GenerateRequest):
            return []
        self.requests[message.request_id] = message
        return self._start(message, streams)

    def _start(self, request: GenerateRequest, streams: dict[str, FakeStream]) -> list[Any]:
        if request.messages:
            text = request.messages[-1].content
            num_prompt_tokens = sum(len(m.content.split()) for m in request.messages)
        elif request.prompt_text is not None:
            text, num_prompt_tokens = request.prompt_text, len(request.prompt_text.split())
        else:
            ids = request.prompt_token_ids or []
            text, num_prompt_tokens = " ".join(map(str, ids)), len(ids)
        if "reject" in text:
            return [RequestFailed(request.request_id, 400, "the prompt is too long", param="prompt",
                                  code="context_length_exceeded")]
        params = request.params
        slow = "slow" in text
        limit = 500 if slow else NUM_FAKE_TOKENS
        num_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)
        reason = FinishReason.LENGTH if num_tokens == params.max_tokens else FinishReason.STOP
        start = math.inf if "hang" in text or "held" in text.split() else time.monotonic()
        tag = text.split()[0] if request.prompt_token_ids is None else "ids"
        streams[request.request_id] = FakeStream(request.request_id, params.n, tag, num_tokens, reason,
                                                 SLOW_TOKEN_S if slow else 0.0, params.logprobs, start)
        prompt_text = text if request.return_prompt_text else None
        accepted = Accepted(request.request_id, num_prompt_tokens, prompt_text)
        if "overload" in text:  # forwarded, then refused by the scheduler (--max-waiting-requests): 503 after Accepted
            del streams[request.request_id]
            return [accepted, RequestFailed(request.request_id, 503, "the server is overloaded (1 requests waiting); "
                                            "try again later", "server_error")]
        return [accepted]

    def _due_deltas(self, streams: dict[str, FakeStream], now: float) -> list[TextDelta]:
        """One more token for every completion of every due stream, in one batch as a tokenizer sends."""
        batch = []
        for stream in list(streams.values()):
            if stream.next_at > now:
                continue
            k = stream.num_sent
            last = k + 1 == stream.num_tokens
            for i in range(stream.n):
                token = fake_token(stream.tag, i, k)
                logprobs = [] if stream.num_logprobs is None else [_fake_logprobs(token, k, stream.num_logprobs)]
                batch.append(TextDelta(stream.request_id, i, token, 1, stream.finish_reason if last else -1,
                                       logprobs, num_cached_tokens=2))
            stream.num_sent += 1
            stream.next_at = now + stream.interval_s
            if last:
                del streams[stream.request_id]
        return batch


def _fake_logprobs(token: str, k: int, num_top: int) -> PositionLogprobs:
    top = [TokenLogprob(f"alt{j}", j, -1.0 - j, list(f"alt{j}".encode())) for j in range(num_top)]
    return PositionLogprobs(TokenLogprob(token, 100 + k, -0.25, list(token.encode())), top)


class FakeStats:
    """The scheduler's stats PUB socket; `fresh` cleared: it stops publishing."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.fresh = threading.Event()
        self.fresh.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-stats", daemon=True)

    def start(self) -> FakeStats:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        context = zmq.Context()
        sock = context.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        codec: Codec[SchedulerStats] = Codec(SchedulerStats)
        while not self._stop.wait(0.1):
            if self.fresh.is_set():
                sock.send(codec.encode(msgspec.structs.replace(FAKE_STATS, time=time.time())))
        sock.close()
        context.term()


# --------------------------------------------------------------------------------------------
# the api process under test


@dataclass
class Stack:
    tmp: Path
    port: int
    proc: subprocess.Popen[bytes]
    tokenizer: FakeTokenizer
    stats: FakeStats

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_endpoint(self) -> str:
        return f"ipc://{self.tmp}/api0.sock"

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, timeout=10.0, max_retries=0)

    def post(self, path: str, body: Any = None, *, content: bytes | None = None,
             headers: dict[str, str] | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {API_KEY}"} if headers is None else headers
        if content is not None:
            return HTTP.post(self.url + path, content=content, headers=headers, timeout=10.0)
        return HTTP.post(self.url + path, json=body, headers=headers, timeout=10.0)

    def health(self) -> httpx.Response | None:
        try:
            return HTTP.get(self.url + "/health", timeout=2.0)
        except httpx.TransportError:
            return None

    def healthy(self) -> bool:
        response = self.health()
        return response is not None and response.status_code == 200

    def log(self) -> str:
        return (self.tmp / "api.log").read_text(errors="replace")


def start_stack(*extra_args: str, env: dict[str, str] | None = None,
                sampling_defaults: dict[str, float | int] | None = None) -> Stack:
    tmp = Path(tempfile.mkdtemp(prefix="pgapi"))  # short: ipc paths are limited to ~100 bytes
    port = free_port()
    stats = FakeStats(f"ipc://{tmp}/stats.sock").start()
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    child_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    child_env.update(env or {})
    with open(tmp / "api.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagoda.services.api", "--model", MODEL_PATH, "--runtime-dir", str(tmp),
             "--api-endpoints", f"ipc://{tmp}/api0.sock", "--stats-endpoint", f"ipc://{tmp}/stats.sock",
             "--port", str(port), "--api-key", API_KEY, "--heartbeat-interval", str(HEARTBEAT_S),
             "--heartbeat-timeout", "1.0", *extra_args], stdout=log, stderr=subprocess.STDOUT, env=child_env,
            preexec_fn=die_with_parent)
    # ZeroMQ connects before the api binds and delivers the hello once it does.
    tokenizer = FakeTokenizer(f"ipc://{tmp}/api0.sock", sampling_defaults=sampling_defaults).start()
    stack = Stack(tmp, port, proc, tokenizer, stats)
    try:
        wait_until(lambda: stack.healthy() or proc.poll() is not None, 20.0, "the api to become healthy")
        assert proc.poll() is None, stack.log()
    except BaseException:
        stop_stack(stack)
        raise
    return stack


def stop_stack(stack: Stack) -> None:
    if stack.proc.poll() is None:
        stack.proc.send_signal(signal.SIGTERM)
        try:
            stack.proc.wait(10)
        except subprocess.TimeoutExpired:
            stack.proc.kill()
            stack.proc.wait(5)
    stack.tokenizer.stop()
    stack.stats.stop()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    stack = start_stack()
    yield stack
    stop_stack(stack)
    print(stack.log())  # shown by pytest only when something failed


def _sse_lines(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line:
            yield line


# --------------------------------------------------------------------------------------------
# the process itself


def test_api_process_never_loads_torch(stack: Stack) -> None:
    maps = Path(f"/proc/{stack.proc.pid}/maps")
    if maps.exists():
        assert "libtorch" not in maps.read_text()
    code = ("import sys, pagoda.services.api.__main__, pagoda.services.api.server, pagoda.services.api.app; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_models_and_auth(stack: Stack) -> None:
    models = stack.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = httpx.get(stack.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert card["object"] == "list"
    model_card = card["data"][0]
    permission = model_card.pop("permission")
    assert model_card | {"created": 0, "root": "x"} == {
        "id": MODEL, "object": "model", "created": 0, "owned_by": "pagoda", "root": "x", "parent": None,
        "max_model_len": MAX_MODEL_LEN}
    assert model_card["root"]  # the model as the engine was given it (vLLM's card: clients read it)
    assert [p["object"] for p in permission] == ["model_permission"] and permission[0]["allow_sampling"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}, {"Authorization": f"Bearer {API_KEY}x"}):
        response = httpx.get(stack.url + "/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    for scheme in ("bearer", "BEARER", "Bearer "):  # the scheme in any case (RFC 9110), as for a tenant's key
        assert httpx.get(stack.url + "/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}).status_code == 200
    assert stack.post("/tokenize", {"prompt": "a"}, headers={}).status_code == 401
    # vLLM's token-in / token-out routes take the key as the generation routes do
    generate = {"token_ids": [1], "sampling_params": {}}
    assert stack.post("/inference/v1/generate", generate, headers={}).status_code == 401
    assert stack.post("/v1/completions/render", {"prompt": "a"}, headers={}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(stack.url + "/health").status_code == 200  # open without a key
    assert httpx.get(stack.url + "/metrics").status_code == 200


# --------------------------------------------------------------------------------------------
# chat


def test_chat_non_streaming(stack: Stack) -> None:
    response = stack.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        max_tokens=3, n=2)
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert response.model == MODEL
    assert [c.index for c in response.choices] == [0, 1]
    for choice in response.choices:
        assert choice.message.role == "assistant"
        assert choice.message.content == fake_text("hello", choice.index, 3)
        assert choice.finish_reason == "length"
        assert choice.logprobs is None
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (4, 6, 10)
    assert usage.prompt_tokens_details.cached_tokens == 2
    sent = stack.tokenizer.requests[response.id]
    assert [m.role for m in sent.messages] == ["system", "user"] and sent.add_generation_prompt


@pytest.mark.parametrize(("extra", "skip_sent"), [
    ({"tools": TOOLS}, False),  # auto under the hermes parser (this model's name): markers may be special tokens
    ({"tools": TOOLS, "tool_choice": "none"}, True),
    ({"tools": TOOLS, "skip_special_tokens": True}, True),  # the client's choice stands
    ({}, True)])
def test_auto_tool_calls_keep_special_tokens_unless_the_client_says(stack: Stack, extra: dict[str, Any],
                                                                    skip_sent: bool) -> None:
    """As vLLM's hermes and mistral parsers: an auto tool request's text keeps special tokens (Mistral's
    [TOOL_CALLS] is one), so its calls can be read."""
    body = {"model": MODEL_PATH, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    response = stack.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    assert stack.tokenizer.requests[response.json()["id"]].params.skip_special_tokens is skip_sent


def test_chat_defaults_content_parts_and_logprobs(stack: Stack) -> None:
    response = stack.openai().chat.completions.create(
        model=MODEL_PATH, messages=[{"role": "developer", "content": "rules"},
                                    {"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                 {"type": "text", "text": "you"}]}],
        logprobs=True, top_logprobs=2, temperature=0.0, seed=7, stop=["zzz"], logit_bias={"42": -100, "7": 2.5},
        extra_body={"top_k": 5})
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == fake_text("hi", 0, NUM_FAKE_TOKENS)
    content = choice.logprobs.content
    assert len(content) == NUM_FAKE_TOKENS
    assert content[0].token == fake_token("hi", 0, 0) and content[0].logprob == -0.25
    assert content[0].bytes == list(content[0].token.encode())
    assert [t.token for t in content[0].top_logprobs] == ["alt0", "alt1"]
    sent = stack.tokenizer.requests[response.id]
    # the developer turn as sent: the tokenizer gives it to the template as vLLM does (developer_as_system)
    assert sent.messages[0].role == "developer" and sent.messages[1].content == "hi\nyou"
    params = sent.params
    assert (params.max_tokens, params.logprobs, params.temperature, params.seed, params.stop, params.top_k) == \
        (None, 2, 0.0, 7, ["zzz"], 5)
    assert params.logit_bias == {42: -100.0, 7: 2.5}


def test_chat_streaming(stack: Stack) -> None:
    stream = stack.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream me"}], max_tokens=3, n=2, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    seen_role: set[int] = set()
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            if choice.index not in seen_role:
                assert choice.delta.role == "assistant" and choice.delta.content == ""  # first chunk: the role
                seen_role.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert texts == {i: fake_text("stream", i, 3) for i in (0, 1)}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == 2


def test_chat_streaming_raw_ends_with_done(stack: Stack) -> None:
    body = {"messages": [{"role": "user", "content": "raw"}], "stream": True, "max_tokens": 2}
    with httpx.stream("POST", stack.url + "/v1/chat/completions", json=body, timeout=10.0,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = list(_sse_lines(response))
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    first = msgspec.json.decode(lines[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in first  # only with include_usage


# --------------------------------------------------------------------------------------------
# completions


def test_completions_several_prompts(stack: Stack) -> None:
    response = stack.openai().completions.create(model=MODEL, prompt=["alpha beta", "gamma"], n=2, max_tokens=2)
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    expected = [fake_text("alpha", 0, 2), fake_text("alpha", 1, 2), fake_text("gamma", 0, 2), fake_text("gamma", 1, 2)]
    assert [c.text for c in response.choices] == expected
    assert {c.finish_reason for c in response.choices} == {"length"}
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (3, 8)
    assert {f"{response.id}-0", f"{response.id}-1"} <= set(stack.tokenizer.requests)


def test_completions_token_prompts_and_default_max_tokens(stack: Stack) -> None:
    response = stack.openai().completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]])
    assert [c.text for c in response.choices] == [fake_text("ids", 0, NUM_FAKE_TOKENS)] * 2
    assert response.usage.prompt_tokens == 5
    single = stack.openai().completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=20)
    assert len(single.choices) == 1 and single.choices[0].finish_reason == "stop"
    assert stack.tokenizer.requests[single.id].prompt_token_ids == [7, 8, 9]
    assert stack.tokenizer.requests[single.id].params.max_tokens == 20
    assert stack.tokenizer.requests[response.id + "-0"].params.max_tokens == 16  # OpenAI's default


def test_completions_streaming_echo(stack: Stack) -> None:
    stream = stack.openai().completions.create(model=MODEL, prompt=["alpha beta", "gamma"], n=2, max_tokens=2,
                                               echo=True, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    texts = {i: "" for i in range(4)}
    finish = {}
    for chunk in chunks[:-1]:
        assert chunk.object == "text_completion"
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts[1] == "alpha beta" + fake_text("alpha", 1, 2)
    assert texts[2] == "gamma" + fake_text("gamma", 0, 2)
    assert finish == {i: "length" for i in range(4)}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 3 + 8


def test_completions_logprobs(stack: Stack) -> None:
    response = stack.openai().completions.create(model=MODEL, prompt="lp", max_tokens=3, logprobs=2)
    logprobs = response.choices[0].logprobs
    tokens = [fake_token("lp", 0, k) for k in range(3)]
    assert logprobs.tokens == tokens and logprobs.token_logprobs == [-0.25] * 3
    assert logprobs.top_logprobs[0] == {"alt0": -1.0, "alt1": -2.0, tokens[0]: -0.25}
    assert logprobs.text_offset == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
    stream = stack.openai().completions.create(model=MODEL, prompt="lp", max_tokens=3, logprobs=1, stream=True)
    offsets = [o for chunk in stream for c in chunk.choices if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == logprobs.text_offset


# --------------------------------------------------------------------------------------------
# errors


BAD_REQUESTS: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "frobnicate": True}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"fifty": -100}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"7": "up"}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "best_of": 2, "stream": True}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": True, "best_of": 2, "top_p": 0.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "length_penalty": 0.5}, 400, "length_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True,
                              "best_of": 2, "n": 3}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),  # past --max-logprobs (vLLM's 20)
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, 400, "suffix"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "please reject this"}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "retrieval"}]}, 400, "tools[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
     400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"-1": 1}},
     400, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "response_format.type"),
    # json_schema's name, strict and description are typed (a wrong type was taken and echoed)
    *[(route, {**body, **wrap({"name": "a", "schema": {}, key: value})}, 400, f"{param}.{key}")
      for route, body, param, wrap in (
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "response_format.json_schema",
           lambda spec: {"response_format": {"type": "json_schema", "json_schema": spec}}),
          ("/v1/responses", {"input": "x"}, "text.format",
           lambda spec: {"text": {"format": {"type": "json_schema", **spec}}}))
      for key, value in (("name", []), ("name", ""), ("strict", "yes"), ("description", 5))],
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "store": True}, 400, "store"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": "2"}, 400, "n"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "extra": 1}]},
     400, "messages[0].extra"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    # integers the wire (int64) or the worker's rows cannot hold: a 400 naming the field, never a 500
    *[("/v1/completions", {"prompt": "x", name: value}, 400, name)
      for name in ("seed", "priority", "max_tokens", "top_k", "min_tokens", "n")
      for value in (2**63, 2**64, -(2**64), 10**30)],
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [2**64]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"9" * 30: 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": [1, 2**64]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2**63]]}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"k": 2**64}}, 400, "chat_template_kwargs"),
    ("/detokenize", {"tokens": [2**64]}, 400, "tokens"),
    # vLLM's cache_salt: a non-empty string (null is none), bounded here
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/completions", {"prompt": "x", "cache_salt": "s" * 1025}, 400, "cache_salt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "cache_salt": "é" * 513},
     400, "cache_salt"),  # 1026 bytes in UTF-8
    ("/v1/completions", {"prompt": "x", "cache_salt": 7}, 400, "cache_salt"),
    # OpenAI's prompt_cache_key: a non-empty string (null is none), bounded here, on the three generation routes
    ("/v1/completions", {"prompt": "x", "prompt_cache_key": ""}, 400, "prompt_cache_key"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_cache_key": ""},
     400, "prompt_cache_key"),
    ("/v1/responses", {"input": "x", "prompt_cache_key": ""}, 400, "prompt_cache_key"),
    ("/v1/completions", {"prompt": "x", "prompt_cache_key": "k" * 1025}, 400, "prompt_cache_key"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_cache_key": "é" * 513},
     400, "prompt_cache_key"),  # 1026 bytes in UTF-8
    ("/v1/responses", {"input": "x", "prompt_cache_key": "k" * 1025}, 400, "prompt_cache_key"),
    ("/v1/completions", {"prompt": "x", "prompt_cache_key": 7}, 400, "prompt_cache_key"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_cache_key": ["k"]},
     400, "prompt_cache_key"),
    ("/v1/responses", {"input": "x", "prompt_cache_key": {"k": 1}}, 400, "prompt_cache_key"),
    # vLLM's truncate_prompt_tokens: k >= 1 or -1; truncation_side: left or right
    *[("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": value}, 400, "truncate_prompt_tokens")
      for value in (0, -2, True, 2**63, "8")],
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": 0},
     400, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 4, "truncation_side": "middle"},
     400, "truncation_side"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "truncation_side": "both"},
     400, "truncation_side"),
    # turns and tool calls of one conversation: at most MAX_TURNS each (16,384)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * (MAX_TURNS + 1)}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}] * (MAX_TURNS // 2 + 1)}] * 2},
     400, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * (MAX_TURNS + 1)}, 400, "messages"),
    ("/v1/responses", {"input": [{"role": "user", "content": "x"}] * (MAX_TURNS + 1)}, 400, "input"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_requests(stack: Stack, path: str, body: dict[str, Any], status: int, param: str | None) -> None:
    response = stack.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_prompt_cache_key_reaches_the_tokenizer_on_every_generation_route(stack: Stack) -> None:
    """OpenAI's prompt_cache_key rides to the tokenizer, whose data-parallel routing keys on it: on completions (every
    prompt of the request), chat and the Responses API (echoed there too); null or absent is none."""
    client = stack.openai()
    completion = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=1,
                                           extra_body={"prompt_cache_key": "conversation-1"})
    assert [stack.tokenizer.requests[f"{completion.id}-{i}"].prompt_cache_key for i in (0, 1)] == \
        ["conversation-1"] * 2
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          prompt_cache_key="conversation-2")
    assert stack.tokenizer.requests[chat.id].prompt_cache_key == "conversation-2"
    response = client.responses.create(model=MODEL, input="hi", max_output_tokens=1, prompt_cache_key="user-3")
    assert response.prompt_cache_key == "user-3"
    assert stack.tokenizer.requests[response.id].prompt_cache_key == "user-3"
    for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
                       ("/v1/responses", {"input": "x", "max_output_tokens": 1})):
        for extra in ({}, {"prompt_cache_key": None}):
            answer = stack.post(path, {"model": MODEL, **body, **extra})
            assert answer.status_code == 200, answer.text
            assert stack.tokenizer.requests[answer.json()["id"]].prompt_cache_key == ""


def test_malformed_bodies_and_routes(stack: Stack) -> None:
    for content in (b"{bad json", b"[1, 2]", b"", b"\xff\xfe"):
        response = stack.post("/v1/completions", content=content)
        assert response.status_code == 400, content
        assert response.json()["error"]["type"] == "invalid_request_error"
    unknown_model = stack.post("/v1/chat/completions", {"model": "nope", "messages": []}).json()["error"]
    assert unknown_model["code"] == "model_not_found"
    missing = httpx.get(stack.url + "/v1/nothing", headers={"Authorization": f"Bearer {API_KEY}"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong_method = httpx.get(stack.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"})
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    with pytest.raises(openai.BadRequestError) as info:
        stack.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=2)
    assert info.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        stack.openai().completions.create(model="other", prompt="x")


def test_hostile_bodies_and_headers(stack: Stack) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for depth in (129, 2000, 100_000):  # the decoder recurses per level: refused before decoding
        content = b'{"prompt": "x", "metadata": ' + b"[" * depth + b"]" * depth + b"}"
        response = stack.post("/v1/completions", content=content, headers=auth | {"Content-Type": "application/json"})
        assert response.status_code == 400 and "deep" in response.json()["error"]["message"], response.text
    nested_ok = {"prompt": "x", "max_tokens": 1, "user": "[[[[" * 100}  # brackets inside strings do not count
    assert stack.post("/v1/completions", nested_ok).status_code == 200
    form = stack.post("/v1/completions", content=b'{"prompt": "x"}',
                      headers=auth | {"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415 and form.json()["error"]["code"] == "unsupported_media_type"
    big = stack.post("/v1/completions", {"prompt": "x" * ((4 << 20) + 1)})
    assert big.status_code == 400 and big.json()["error"]["param"] == "prompt"
    # a non-UTF-8 byte in Authorization, a second header that does not match: 401, never a 500
    raw = [(b"Authorization", b"Bearer \xff\xfe"), (b"Content-Type", b"application/json")]
    assert httpx.post(stack.url + "/v1/completions", content=b'{"prompt": "x"}', headers=raw).status_code == 401
    twice = [(b"Authorization", f"Bearer {API_KEY}".encode()), (b"Authorization", b"Bearer wrong")]
    assert httpx.get(stack.url + "/v1/models", headers=twice).status_code == 401
    same = [(b"Authorization", f"Bearer {API_KEY}".encode())] * 2
    assert httpx.get(stack.url + "/v1/models", headers=same).status_code == 200
    assert stack.healthy()


def test_a_body_its_content_encoding_cannot_decode_is_a_400(stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    tracebacks = stack.log().count("Traceback")
    gzipped = gzip.compress(b'{"prompt": "x", "max_tokens": 1}')
    assert stack.post("/v1/completions", content=gzipped, headers=headers | {"Content-Encoding": "gzip"}) \
        .status_code == 200
    for encoding, path in (("gzip", "/v1/completions"), ("deflate", "/tokenize")):
        response = stack.post(path, content=b'{"prompt": "x"}', headers=headers | {"Content-Encoding": encoding})
        assert response.status_code == 400, response.text
        assert f"content-encoding: {encoding}" in response.json()["error"]["message"]
    # the connection cannot be read past that body: it closes after the answer, rather than leave the next
    # request on it unanswered
    body = b'{"prompt": "x"}'
    with socket.create_connection(("127.0.0.1", stack.port), timeout=10.0) as conn:
        conn.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body + b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        received = b"".join(iter(lambda: conn.recv(65536), b""))  # to the end: the server closed it
    assert received.startswith(b"HTTP/1.1 400") and received.count(b"HTTP/1.1") == 1, received
    assert stack.log().count("Traceback") == tracebacks  # nor one from aiohttp draining the body afterwards


def _first_answer(port: int, head: bytes) -> bytes:
    """What the server sends first to a request of which only `head` (its line and headers) was sent: a status
    line and headers, and the body its Content-Length gives (the connection stays open)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10.0) as conn:
        received = b""
        conn.sendall(head)
        while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < _content_length(received):
            chunk = conn.recv(65536)
            if not chunk:
                break
            received += chunk
        return received


def _content_length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            return int(value)
    return 0


def test_a_body_declared_past_the_limit_is_a_413_before_any_of_it_is_sent(stack: Stack) -> None:
    """A Content-Length past 32 MiB is refused as it arrives: neither '100 Continue' to a client that asks before
    sending it (curl does, for large bodies), nor a wait for a body it would refuse after reading 32 MiB of it."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {(32 << 20) + 1}\r\n").encode()
    for expect in (b"Expect: 100-continue\r\n", b""):
        answer = _first_answer(stack.port, head + expect + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 413 "), answer
        error = msgspec.json.decode(answer.partition(b"\r\n\r\n")[2])["error"]  # JSON, as any error
        assert error["type"] == "invalid_request_error" and "Request Entity Too Large" in error["message"], error
    within = head.replace(str((32 << 20) + 1).encode(), b"15") + b"Expect: 100-continue\r\n\r\n"
    assert _first_answer(stack.port, within).startswith(b"HTTP/1.1 100 Continue")  # one it takes: go ahead
    assert stack.healthy()


def test_an_x_request_id_not_utf8_is_a_400_naming_it(stack: Stack) -> None:
    """The header's bytes that are not UTF-8 reach the handler as surrogates, which the wire to the tokenizer cannot
    carry: the 400 said 'the request holds a value out of range: 'utf-8' codec can't encode ...' naming nothing."""
    headers = [(b"Authorization", f"Bearer {API_KEY}".encode()), (b"Content-Type", b"application/json"),
               (b"X-Request-Id", b"trace-\xff\xfe")]
    for path, body in (("/v1/completions", b'{"prompt": "x", "max_tokens": 1}'),
                       ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}')):
        response = HTTP.post(stack.url + path, content=body, headers=headers, timeout=10.0)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "X-Request-Id" and "UTF-8" in error["message"], error
    utf8 = [*headers[:2], (b"X-Request-Id", "trace-é".encode())]
    answer = HTTP.post(stack.url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}', headers=utf8,
                       timeout=10.0)
    assert answer.status_code == 200 and answer.json()["id"] == "cmpl-trace-é", answer.text


def test_a_request_line_or_header_too_long_is_a_400_logged_without_a_traceback(stack: Stack) -> None:
    """aiohttp refuses a line past 8190 bytes before any handler; it logged that with a traceback at ERROR."""
    tracebacks = stack.log().count("Traceback")
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert HTTP.get(stack.url + "/v1/models/" + "x" * 9000, headers=auth, timeout=10.0).status_code == 400
    assert HTTP.get(stack.url + "/v1/models", headers=auth | {"X-Big": "x" * 9000}, timeout=10.0).status_code == 400
    assert stack.log().count("Traceback") == tracebacks
    assert stack.log().count("WARNING Error handling request from 127.0.0.1: 400 Got more than 8190 bytes") == 2
    assert stack.healthy()


def test_retrieve_model(stack: Stack) -> None:
    model = stack.openai().models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        stack.openai().models.retrieve("other-model")


def test_tokenize_and_detokenize(stack: Stack) -> None:
    assert stack.post("/tokenize", {"model": MODEL, "prompt": "a b c"}).json() == \
        {"tokens": [0, 1, 2], "count": 3, "max_model_len": MAX_MODEL_LEN, "token_strs": None}
    chat = stack.post("/tokenize", {"messages": [{"role": "user", "content": "one two"}]}).json()
    assert chat["count"] == 2
    assert stack.post("/detokenize", {"tokens": [1, 2]}).json() == {"prompt": "<1> <2>"}


# --------------------------------------------------------------------------------------------
# health, metrics, robustness


def test_metrics(stack: Stack) -> None:
    stack.openai().completions.create(model=MODEL, prompt="metric me", max_tokens=4)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(stack.url + "/metrics").text)}
    values = {s.name: s.value for f in families.values() for s in f.samples if not s.labels}
    assert values["pagoda_num_requests_running"] == 3 and values["pagoda_num_requests_waiting"] == 2
    assert values["pagoda_kv_cache_usage_ratio"] == pytest.approx(0.1)
    assert values["pagoda_kv_blocks_free"] == 90 and values["pagoda_kv_blocks_total"] == 100
    assert values["pagoda_prefix_cache_hit_tokens_total"] == 40
    assert values["pagoda_prefix_cache_query_tokens_total"] == 100
    assert values["pagoda_num_preemptions_total"] == 1 and values["pagoda_num_swapped_preemptions_total"] == 1
    assert values["pagoda_prompt_tokens_total"] == 1234 and values["pagoda_generation_tokens_total"] == 567
    for name in ("pagoda_time_to_first_token_seconds", "pagoda_inter_token_latency_seconds",
                 "pagoda_e2e_request_latency_seconds"):
        assert families[name].type == "histogram"
        assert values[f"{name}_count"] >= 1
    routes = {(s.labels["route"], s.labels["status"]) for s in families["pagoda_http_requests"].samples
              if s.name == "pagoda_http_requests_total"}
    assert ("/v1/completions", "200") in routes


def test_health_follows_the_stats_feed(stack: Stack) -> None:
    assert stack.health().json() == {"status": "ok"}
    stack.stats.fresh.clear()
    try:
        wait_until(lambda: stack.health().status_code == 503, 5.0, "health to notice stale stats")
        assert any("stats" in p for p in stack.health().json()["problems"])
    finally:
        stack.stats.fresh.set()
    wait_until(stack.healthy, 5.0, "health to recover")


def test_garbage_frames_are_dropped(stack: Stack) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"garbage")
    sock.connect(stack.api_endpoint)
    try:
        sock.send(b"\xff\x00garbage")
        sock.send_multipart([b"two", b"frames"])
        sock.send(msgspec.msgpack.encode(["hello", 1]))  # a known tag with the wrong fields
        wait_until(lambda: stack.log().count("dropped a malformed frame") >= 2, 5.0, "the api to drop the frames")
        wait_until(lambda: "dropped a routed message of 3 frames" in stack.log(), 5.0, "the 3-frame message")
    finally:
        sock.close()
        context.term()
    assert stack.proc.poll() is None
    response = stack.openai().completions.create(model=MODEL, prompt="still here", max_tokens=2)
    assert response.choices[0].text == fake_text("still", 0, 2)
    assert stack.tokenizer.requests[response.id]  # served by the real tokenizer, not the garbage sender


def test_client_disconnect_aborts(stack: Stack) -> None:
    body = {"prompt": "slow story", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=10.0,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        first = next(line for line in _sse_lines(response) if '"text"' in line)
    request_id = msgspec.json.decode(first[6:])["id"]
    wait_until(lambda: request_id in stack.tokenizer.aborted, 5.0, "an AbortRequest after a stream hang-up")

    # A non-streaming client that gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.url + "/v1/completions", json={"prompt": "slow wait", "max_tokens": 400}, timeout=0.5,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    request_id = next(r for r, g in stack.tokenizer.requests.items() if g.prompt_text == "slow wait")
    wait_until(lambda: request_id in stack.tokenizer.aborted, 5.0, "an AbortRequest after a hang-up")


def test_requests_spread_over_tokenizers(stack: Stack) -> None:
    second = FakeTokenizer(stack.api_endpoint, identity=b"fake-tok-2").start()
    client = stack.openai()
    try:
        wait_until(lambda: client.completions.create(model=MODEL, prompt="probe", max_tokens=1).id in second.requests,
                   5.0, "the second tokenizer to get a request")
        ids = [client.completions.create(model=MODEL, prompt="spread", max_tokens=1).id for _ in range(4)]
        assert sum(i in second.requests for i in ids) == 2  # two idle tokenizers take turns
        # The least loaded one gets new work: the other holds a hung request.
        with httpx.stream("POST", stack.url + "/v1/completions", json={"prompt": "hang on", "stream": True},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10.0) as response:
            assert response.status_code == 200  # the headers come once a tokenizer accepted it
            on_second = any(g.prompt_text == "hang on" for g in second.requests.values())
            idle = stack.tokenizer if on_second else second
            ids = [client.completions.create(model=MODEL, prompt="spread", max_tokens=1).id for _ in range(3)]
            assert all(i in idle.requests for i in ids)
    finally:
        second.stop()
    wait_until(lambda: "tokenizer b'fake-tok-2' dropped" in stack.log(), 5.0, "the api to drop the second one")
    for _ in range(3):
        assert client.completions.create(model=MODEL, prompt="after", max_tokens=1).id in stack.tokenizer.requests


def test_the_api_opens_its_stream_to_a_tokenizer_it_registers(stack: Stack) -> None:
    """On registering a tokenizer the api opens its sequenced stream to it at once, before any request: a tokenizer
    still running requests of a killed api process at this address learns from the new stream that their clients
    are gone (it aborts them) without waiting for this process to send it a request."""
    second = FakeTokenizer(stack.api_endpoint, identity=b"fake-tok-opened").start()
    try:
        wait_until(lambda: "tokenizer b'fake-tok-opened' (pid" in stack.log(), 5.0, "the api to register it")
        wait_until(lambda: len(second.api_streams) == 1, 5.0, "the api's stream to it to begin")
        assert not second.requests
    finally:
        second.stop()
    wait_until(lambda: "tokenizer b'fake-tok-opened' dropped" in stack.log(), 5.0, "the api to drop it")


def test_a_tokenizer_the_scheduler_does_not_list_is_not_ready(stack: Stack) -> None:
    """A tokenizer that told the api hello but is not registered with the scheduler (not connected yet, or holding
    a restarted scheduler's ModelInfo) would hold a request until it registers, or fail it: requests go to one the
    scheduler lists, and with none of those live /health says not ready."""
    stray = FakeTokenizer(stack.api_endpoint, identity=b"fake-tok-stray").start()
    client = stack.openai()
    try:
        wait_until(lambda: "tokenizer b'fake-tok-stray' (pid" in stack.log(), 5.0, "the api to register the stray one")
        ids = [client.completions.create(model=MODEL, prompt="listed only", max_tokens=1).id for _ in range(4)]
        assert all(i in stack.tokenizer.requests for i in ids) and not stray.requests
        assert stack.health().json() == {"status": "ok"}
        stack.tokenizer.alive.clear()  # the listed one falls silent: only the stray one is left
        try:
            wait_until(lambda: "tokenizer b'fake-tok' dropped" in stack.log(), 5.0, "the api to drop the listed one")
            health = stack.health()
            assert health is not None and health.status_code == 503
            assert health.json()["problems"] == ["no live tokenizer process is registered with the scheduler"]
        finally:
            stack.tokenizer.alive.set()
        wait_until(stack.healthy, 5.0, "the listed tokenizer to be taken back")
    finally:
        stray.stop()
    wait_until(lambda: "tokenizer b'fake-tok-stray' dropped" in stack.log(), 5.0, "the api to drop the stray one")


def test_tokenizer_death_fails_its_requests(stack: Stack) -> None:
    results: dict[str, Any] = {}

    def plain() -> None:
        results["plain"] = stack.post("/v1/completions", {"prompt": "hang plain"})

    def streamed() -> None:
        body = {"prompt": "hang streamed", "stream": True}
        with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=10.0,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            results["stream"] = list(_sse_lines(response))

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for thread in threads:
        thread.start()
    hung = lambda: [r for r, g in stack.tokenizer.requests.items() if g.prompt_text in ("hang plain", "hang streamed")]
    wait_until(lambda: len(hung()) == 2, 5.0, "both requests to reach the tokenizer")
    stack.tokenizer.alive.clear()  # from now on it says nothing, like a hung process
    try:
        for thread in threads:
            thread.join(10)
        assert results["plain"].status_code == 503
        assert results["plain"].json()["error"]["type"] == "server_error"
        lines = results["stream"]
        assert lines[-1] == "data: [DONE]" and "error" in msgspec.json.decode(lines[-2][6:])
        health = stack.health()
        assert health.status_code == 503 and "no live tokenizer process" in health.json()["problems"]
        assert stack.post("/v1/completions", {"prompt": "x"}).status_code == 503
    finally:
        stack.tokenizer.alive.set()
    wait_until(stack.healthy, 5.0, "the tokenizer to be taken back")
    # The api asked it to abort what it had lost, in case it was only slow.
    wait_until(lambda: set(hung()) <= stack.tokenizer.aborted, 5.0, "aborts of the lost requests")


def test_sigterm_drains_then_fails_what_is_left() -> None:
    metrics_dir = tempfile.mkdtemp(prefix="pgprom")
    stack = start_stack("--shutdown-grace", "1.5", "--max-inflight-requests", "2",
                        env={"PROMETHEUS_MULTIPROC_DIR": metrics_dir})
    try:
        lines: dict[str, list[str]] = {"short": [], "long": []}
        started = {name: threading.Event() for name in lines}

        def read(name: str, max_tokens: int) -> None:
            body = {"prompt": f"slow {name}", "max_tokens": max_tokens, "stream": True}
            with httpx.stream("POST", stack.url + "/v1/completions", json=body, timeout=10.0,
                              headers={"Authorization": f"Bearer {API_KEY}"}) as response:
                for line in _sse_lines(response):
                    lines[name].append(line)
                    started[name].set()

        threads = [threading.Thread(target=read, args=("short", 10)), threading.Thread(target=read, args=("long", 500))]
        for thread in threads:
            thread.start()
        for event in started.values():
            assert event.wait(5.0)
        assert stack.post("/v1/completions", {"prompt": "third"}).status_code == 503  # at most 2 in flight
        metrics = httpx.get(stack.url + "/metrics").text  # multiprocess mode: files plus the live snapshot
        assert "pagoda_kv_blocks_total 100.0" in metrics and "pagoda_time_to_first_token_seconds_count" in metrics

        began = time.monotonic()
        stack.proc.send_signal(signal.SIGTERM)
        assert stack.proc.wait(8.0) == 0
        assert time.monotonic() - began < 6.0
        for thread in threads:
            thread.join(5.0)
        short, long = lines["short"], lines["long"]
        assert short[-1] == long[-1] == "data: [DONE]"
        # The short stream finished inside the grace period; the long one was cut with an error event.
        assert "".join(msgspec.json.decode(x[6:])["choices"][0]["text"] for x in short[:-1]) == \
            fake_text("slow", 0, 10)
        assert msgspec.json.decode(long[-2][6:])["error"]["message"] == "the server is shutting down"
        long_id = msgspec.json.decode(long[0][6:])["id"]
        wait_until(lambda: long_id in stack.tokenizer.aborted, 5.0, "the abort of the cut stream")
    finally:
        stop_stack(stack)
        print(stack.log())


def test_unhandled_handler_error_is_a_json_500() -> None:
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from pagoda.services.api.app import error_middleware
    from pagoda.services.api.metrics import ApiMetrics

    async def broken(request: web.Request) -> web.Response:
        raise RuntimeError("a bug")

    async def call() -> tuple[int, Any]:
        app = web.Application(middlewares=[error_middleware(ApiMetrics(lambda: None))])
        app.router.add_get("/broken", broken)
        async with TestClient(TestServer(app)) as client:
            response = await client.get("/broken")
            return response.status, await response.json()

    status, body = asyncio.run(call())
    assert status == 500 and body["error"]["type"] == "server_error"


def test_request_timeout_aborts_and_answers_408() -> None:
    stack = start_stack("--request-timeout", "1", "--max-inflight-requests", "2")
    try:
        started = time.monotonic()
        response = stack.post("/v1/completions", {"prompt": "hang plain"})
        assert response.status_code == 408 and response.json()["error"]["code"] == "request_timeout"
        assert time.monotonic() - started < 5
        [request_id] = [rid for rid, g in stack.tokenizer.requests.items() if g.prompt_text == "hang plain"]
        wait_until(lambda: request_id in stack.tokenizer.aborted, 5.0, "an AbortRequest at the deadline")
        with httpx.stream("POST", stack.url + "/v1/completions", json={"prompt": "hang streamed", "stream": True},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10) as streamed:
            assert streamed.status_code == 200  # the status line went before the deadline: an error event ends it
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert "request_timeout" in events[-2] and events[-1] == "data: [DONE]"
        # past --max-inflight-requests: 503 with Retry-After
        threads = [threading.Thread(target=stack.post, args=("/v1/completions", {"prompt": f"hang {i}"}))
                   for i in range(2)]
        for thread in threads:
            thread.start()
        wait_until(lambda: sum(g.prompt_text.startswith("hang ") for g in stack.tokenizer.requests.values()
                               if g.prompt_text) >= 4, 5.0, "two requests in flight")
        overloaded = stack.post("/v1/completions", {"prompt": "one more"})
        assert overloaded.status_code == 503 and overloaded.headers["Retry-After"] == "1"
        for thread in threads:
            thread.join(10)
    finally:
        stop_stack(stack)


# --------------------------------------------------------------------------------------------
# the model's generation config (vLLM's --generation-config auto): defaults for what a request leaves unset

GENERATION_DEFAULTS: dict[str, float | int] = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                                               "repetition_penalty": 1.05, "max_tokens": 64}


@pytest.fixture(scope="module")
def defaults_stack() -> Iterator[Stack]:
    """An api whose tokenizer announces the model's generation-config sampling defaults."""
    stack = start_stack(sampling_defaults=GENERATION_DEFAULTS)
    yield stack
    stop_stack(stack)
    print(stack.log())


def _sent_params(stack: Stack, route: str, body: dict[str, Any]) -> Any:
    response = stack.post(route, {"model": MODEL_PATH, **body})
    assert response.status_code == 200, response.text
    return stack.tokenizer.requests[response.json()["id"]].params


def test_generation_config_fills_only_what_a_request_leaves_unset(defaults_stack: Stack) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    params = _sent_params(defaults_stack, "/v1/chat/completions", chat)
    # max_tokens stays unset: the tokenizer applies the default, capped by the context the prompt leaves
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty,
            params.max_tokens) == (0.7, 0.8, 20, 0.05, 1.05, None)
    # a value the client sends wins, also one equal to pagoda's own default
    explicit = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    params = _sent_params(defaults_stack, "/v1/chat/completions", {**chat, **explicit, "max_completion_tokens": 5})
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty,
            params.max_tokens) == (1.0, 1.0, 0, 0.0, 1.0, 5)
    params = _sent_params(defaults_stack, "/v1/chat/completions", {**chat, "temperature": 0.0, "max_tokens": 3})
    assert (params.temperature, params.top_p, params.max_tokens) == (0.0, 0.8, 3)
    # completions: the same sampling defaults; an omitted max_tokens is the API's own 16, as vLLM's
    params = _sent_params(defaults_stack, "/v1/completions", {"prompt": "hi", "top_k": 0})
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.max_tokens) == \
        (0.7, 0.8, 0, 1.05, 16)


def test_generation_config_gives_beam_search_only_its_temperature(defaults_stack: Stack) -> None:
    """vLLM's beam search takes the default temperature only: top_p / top_k / penalties would reshape the beams
    (and pagoda refuses them with beam search), so a model's sampling defaults must not make beam search fail."""
    params = _sent_params(defaults_stack, "/v1/completions",
                          {"prompt": "hi", "use_beam_search": True, "n": 2, "max_tokens": 4})
    assert params.use_beam_search and (params.temperature, params.top_p, params.top_k, params.min_p,
                                       params.repetition_penalty) == (0.7, 1.0, 0, 0.0, 1.0)


def test_without_a_generation_config_the_apis_own_defaults_hold(stack: Stack) -> None:
    params = _sent_params(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, 0, None)
