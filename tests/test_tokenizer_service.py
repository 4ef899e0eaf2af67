"""The real tokenizer process, driven over ZeroMQ by a fake api and a fake scheduler (two ROUTER sockets)."""

from __future__ import annotations

import itertools
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from pagoda.services.tokenizer.offload import OFFLOAD_MIN_CHARS
from pagoda.services.tokenizer.prompts import (
    MAX_DETOKENIZED_BYTES,
    generate_prompt,
    max_prompt_len,
    prompt_chars,
    truncated_ids,
)
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.config import SLOW_COMPILE_MIN_BYTES
from pagoda.shared.delivery import Link
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import (
    AbortRequest,
    Accepted,
    Ack,
    AddRequest,
    ApiToTokenizer,
    ChatMessage,
    DetokenizeRequest,
    DetokenizeResult,
    FinishReason,
    GenerateRequest,
    Heartbeat,
    ModelInfo,
    RenderedRows,
    RenderSpec,
    RequestFailed,
    SamplingParams,
    SchedulerToTokenizer,
    Sequenced,
    StopSequence,
    StructuredOutputs,
    TextDelta,
    TextDeltas,
    TokenDeltas,
    TokenizeRequest,
    TokenizeResult,
    TokenizerHello,
    TokenizerToApi,
    TokenizerToScheduler,
    ToolCallMessage,
)
from pagoda.shared.transport import MAX_FRAME_BYTES, Codec, ack_frame, make_socket, seal, unseal
from tests.harness import die_with_parent

pytestmark = pytest.mark.slow

HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_TIMEOUT = 2.0
MAX_MODEL_LEN = 128
STARTUP_TIMEOUT = 120.0  # importing transformers and loading the tokenizer, on a slow or shared CI machine
REPLY_TIMEOUT = 5.0
UNICODE_TEXT = "Grüße, 世界! 🎉 family: 👨‍👩‍👧 ok"

_ids = itertools.count()


def new_id() -> str:
    return f"req-{next(_ids)}"


class Harness:
    """One tokenizer process; the test plays its api and its scheduler.

    While the test waits for a message, the fake scheduler sends heartbeats (when `scheduler_alive`) and
    answers every TokenizerHello with `model_info`, as the real one does.
    """

    def __init__(self, model_dir: Path, *extra_args: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pg", dir="/tmp"))  # ipc paths must stay short
        self.context = zmq.Context()
        api_endpoint, scheduler_endpoint = f"ipc://{self.dir}/api0.sock", f"ipc://{self.dir}/sched.sock"
        self.api = make_socket(self.context, zmq.ROUTER, api_endpoint, bind=True)
        self.scheduler = make_socket(self.context, zmq.ROUTER, scheduler_endpoint, bind=True)
        self.api_in, self.api_out = Codec(TokenizerToApi), Codec(ApiToTokenizer)
        self.scheduler_in, self.scheduler_out = Codec(TokenizerToScheduler), Codec(SchedulerToTokenizer)
        self.api_inbox: list[Any] = []
        self.scheduler_inbox: list[Any] = []
        self.identity: bytes | None = None  # the tokenizer's, once it spoke to the api
        self.scheduler_peer: bytes | None = None  # the same, once it spoke to the scheduler
        self.model_info: ModelInfo | None = None
        self.scheduler_alive = True
        self.scheduler_name = "sched-test"  # its heartbeats' sender
        self.last_scheduler_send = 0.0
        self.link: Link[Any] = Link(resend_s=1.0)  # the fake scheduler's end of the tokenizer's stream
        self.api_link: Link[Any] = Link(resend_s=1.0)  # the fake api's
        self.api_alive = True  # False: the fake api takes nothing in and acknowledges nothing (a process gone)
        self.log_path = self.dir / "tokenizer.log"
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pagoda.services.tokenizer", "--model", str(model_dir),
                 "--api-endpoints", api_endpoint, "--scheduler-endpoint", scheduler_endpoint,
                 "--heartbeat-interval", str(HEARTBEAT_INTERVAL), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
                 "--tokenizer-id", "tok-test", "--log-level", "info", *extra_args],
                stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.context.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    # ---------------------------------------------------------------- sending

    def send_api(self, message: msgspec.Struct) -> None:
        self.send_api_frames([self.api_out.encode(message)])

    def send_api_frames(self, frames: list[bytes]) -> None:
        assert self.identity is not None, "the tokenizer has not said hello yet"
        self.api.send_multipart([self.identity, *frames])

    def send_api_sealed(self, message: msgspec.Struct, link: Link[Any]) -> None:
        """As a real api sends: in its sequenced stream `link` (a new Link: a new api process)."""
        self.send_api_frames([seal(self.api_out, link, message, time.monotonic())])

    def send_scheduler(self, message: msgspec.Struct) -> None:
        self.send_scheduler_frames([self.scheduler_out.encode(message)])

    def send_scheduler_frames(self, frames: list[bytes]) -> None:
        assert self.scheduler_peer is not None, "the tokenizer has not said hello yet"
        self.scheduler.send_multipart([self.scheduler_peer, *frames])
        self.last_scheduler_send = time.monotonic()

    # ---------------------------------------------------------------- receiving

    @staticmethod
    def _ack(send: Callable[[], None]) -> None:
        """Send an ack as a real peer would: a tokenizer that already exited (its last frame was its
        last word, as after SIGTERM) is not there to take it, and that is not the test's failure."""
        try:
            send()
        except zmq.ZMQError as error:
            if error.errno != zmq.EHOSTUNREACH:
                raise

    def _pump(self, until: float) -> None:
        """Receive what arrives before `until` (returning at the first arrival) and play the scheduler."""
        poller = zmq.Poller()
        poller.register(self.api, zmq.POLLIN)
        poller.register(self.scheduler, zmq.POLLIN)
        while True:
            now = time.monotonic()
            if self.scheduler_alive and self.scheduler_peer is not None \
                    and now - self.last_scheduler_send >= HEARTBEAT_INTERVAL:
                self.send_scheduler(Heartbeat(self.scheduler_name))
            timeout_ms = max(0.0, min(until, now + HEARTBEAT_INTERVAL) - now) * 1000
            events = dict(poller.poll(timeout_ms))
            if self.api in events:
                identity, payload = self.api.recv_multipart()
                self.identity = identity
            if self.api in events and self.api_alive:
                message = self.api_in.decode(payload)
                if isinstance(message, Sequenced | Ack):  # the tokenizer's stream to the api: once, in order, acked
                    self.api_inbox += unseal(self.api_in, self.api_link, message, now)
                    self._ack(lambda: self.send_api_frames([ack_frame(self.api_out, self.api_link)]))
                else:
                    self.api_inbox.append(message)
            if self.scheduler in events:
                self.scheduler_peer, payload = self.scheduler.recv_multipart()
                message = self.scheduler_in.decode(payload)
                if isinstance(message, Sequenced | Ack):  # the tokenizer's sequenced stream: applied once, acked
                    self.scheduler_inbox += unseal(self.scheduler_in, self.link, message, now)
                    self._ack(lambda: self.send_scheduler_frames([ack_frame(self.scheduler_out, self.link)]))
                else:
                    self.scheduler_inbox.append(message)
                if isinstance(message, TokenizerHello) and self.scheduler_alive and self.model_info is not None:
                    self.send_scheduler(self.model_info)
            if events or time.monotonic() >= until:
                return

    def _expect(self, inbox: list[Any], match: Callable[[Any], bool], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            for i, message in enumerate(inbox):
                if match(message):
                    return inbox.pop(i)
            if time.monotonic() >= deadline:
                raise AssertionError(f"no {what} within {timeout} s; tokenizer log:\n{self.log_tail()}")
            self._pump(deadline)

    def expect_api(self, match: Callable[[Any], bool], timeout: float = REPLY_TIMEOUT, what: str = "message") -> Any:
        return self._expect(self.api_inbox, match, timeout, f"{what} at the api")

    def expect_scheduler(self, match: Callable[[Any], bool], timeout: float = REPLY_TIMEOUT,
                         what: str = "message") -> Any:
        return self._expect(self.scheduler_inbox, match, timeout, f"{what} at the scheduler")

    def expect_reply(self, request_id: str, kind: type, timeout: float = REPLY_TIMEOUT) -> Any:
        """The next answer to `request_id`, which must be of type `kind`."""
        reply = self.expect_api(lambda m: getattr(m, "request_id", None) == request_id, timeout,
                                f"answer to {request_id}")
        assert isinstance(reply, kind), reply
        return reply

    def expect_text(self, request_id: str) -> TextDelta:
        """The next TextDelta of `request_id` (its TextDeltas must hold nothing else: tests run one at a time)."""
        batch = self.expect_api(lambda m: isinstance(m, TextDeltas), what="TextDeltas")
        assert [d.request_id for d in batch.deltas] == [request_id], batch
        return batch.deltas[0]

    # ---------------------------------------------------------------- scenarios

    def start(self, info: ModelInfo | None) -> None:
        """Wait for both hellos and register the tokenizer (None: the scheduler is not ready to)."""
        self.model_info = info
        self.expect_api(lambda m: isinstance(m, TokenizerHello), STARTUP_TIMEOUT, "hello")
        self.expect_scheduler(lambda m: isinstance(m, TokenizerHello), STARTUP_TIMEOUT, "hello")

    def generate(self, params: SamplingParams | None = None, **prompt: Any) -> tuple[str, Accepted, AddRequest]:
        request_id = new_id()
        self.send_api(GenerateRequest(request_id, params or SamplingParams(max_tokens=None), **prompt))
        accepted = self.expect_reply(request_id, Accepted)
        added = self.expect_scheduler(lambda m: isinstance(m, AddRequest) and m.request_id == request_id)
        return request_id, accepted, added

    def feed(self, request_id: str, token_ids: list[int], finish_reason: int = -1, index: int = 0,
             **columns: Any) -> TextDelta:
        """Send tokens (one row each, as over several steps, in one frame); their TextDeltas merged in one."""
        self.send_scheduler(token_deltas([(request_id, index, token_ids, finish_reason)], **columns))
        batch = self.expect_api(lambda m: isinstance(m, TextDeltas), what="TextDeltas")
        assert {d.request_id for d in batch.deltas} == {request_id}, batch
        return merged(batch.deltas)


def token_deltas(completions: list[tuple[str, int, list[int], int]], logprobs: list[float] | None = None,
                 top_token_ids: list[list[int]] | None = None,
                 top_logprobs: list[list[float]] | None = None) -> TokenDeltas:
    """The scheduler's columns for (request id, index, token ids, finish reason) completions: one row per
    token (the finish reason on the last); logprob columns, when given, cover every row in order."""
    rows: list[tuple[str, int, int, int]] = []
    for request_id, index, ids, reason in completions:
        rows += [(request_id, index, t, reason if i == len(ids) - 1 else -1) for i, t in enumerate(ids)]
        if not ids:
            rows.append((request_id, index, -1, reason))
    request_ids, indices, tokens, reasons = (list(column) for column in zip(*rows, strict=True))
    lp_rows = list(range(len(rows))) if logprobs is not None else []
    no_top: list[list[Any]] = [[] for _ in lp_rows]
    return TokenDeltas(request_ids, indices, tokens, reasons, [0] * len(rows), lp_rows, logprobs or [],
                       top_token_ids or no_top, top_logprobs or no_top)


def merged(deltas: list[TextDelta]) -> TextDelta:
    """One TextDelta for a completion's consecutive deltas (what one multi-token step would have made)."""
    last = deltas[-1]
    return msgspec.structs.replace(last, text="".join(d.text for d in deltas),
                                   num_new_tokens=sum(d.num_new_tokens for d in deltas),
                                   logprobs=[p for d in deltas for p in d.logprobs],
                                   prompt_logprobs=[p for d in deltas for p in d.prompt_logprobs],
                                   token_ids=[t for d in deltas for t in d.token_ids])


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


def model_info(tokenizer: Tokenizer) -> ModelInfo:
    assert tokenizer.eos_token_id is not None
    return ModelInfo(max_model_len=MAX_MODEL_LEN, vocab_size=tokenizer.vocab_size, max_num_tokens=4096,
                     eos_token_ids=[tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path, tokenizer: Tokenizer) -> Iterator[Harness]:
    """One tokenizer process shared by the tests that leave it serving."""
    harness = Harness(smollm2_dir)
    try:
        harness.start(model_info(tokenizer))
        yield harness
    finally:
        harness.close()


@pytest.fixture()
def own_tok(smollm2_dir: Path, tokenizer: Tokenizer) -> Iterator[Harness]:
    """A tokenizer process for a test that makes it lose its scheduler or stop."""
    harness = Harness(smollm2_dir)
    try:
        harness.start(model_info(tokenizer))
        yield harness
    finally:
        harness.close()


# -------------------------------------------------------------------------------------------- tests


def test_heartbeats_reach_api_and_scheduler(tok: Harness) -> None:
    for expect in (tok.expect_api, tok.expect_scheduler):
        for _ in range(2):
            beat = expect(lambda m: isinstance(m, Heartbeat), 2 * HEARTBEAT_INTERVAL + 1.0, "Heartbeat")
            assert beat.sender == "tok-test"


def test_text_prompt_is_accepted_and_added(tok: Harness, tokenizer: Tokenizer) -> None:
    text = "The capital of France is"
    request_id, accepted, added = tok.generate(SamplingParams(max_tokens=8), prompt_text=text, priority=3,
                                               arrival_time=123.5, return_prompt_text=True)
    expected = tokenizer.encode(text)
    assert accepted.num_prompt_tokens == len(expected)
    assert accepted.prompt_text == text
    assert added.prompt_token_ids == expected
    assert added.params == SamplingParams(max_tokens=8)
    assert (added.priority, added.arrival_time) == (3, 123.5)
    tok.send_api(AbortRequest(request_id))


def test_token_id_prompt_echo_decodes_the_ids(tok: Harness, tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("echo me")
    request_id, accepted, added = tok.generate(prompt_token_ids=ids, return_prompt_text=True)
    assert (accepted.num_prompt_tokens, accepted.prompt_text, added.prompt_token_ids) == (len(ids), "echo me", ids)
    tok.send_api(AbortRequest(request_id))


def test_streamed_text_equals_the_whole_decode(tok: Harness, tokenizer: Tokenizer) -> None:
    request_id, _, _ = tok.generate(prompt_text="Say:")
    ids = tokenizer.encode(UNICODE_TEXT, add_special_tokens=False)
    deltas = [tok.feed(request_id, [t]) for t in ids[:-1]]
    deltas.append(tok.feed(request_id, ids[-1:], FinishReason.LENGTH))
    assert "".join(d.text for d in deltas) == tokenizer.decode(ids) == UNICODE_TEXT
    assert any(d.text == "" for d in deltas), "an emoji's bytes span tokens: some deltas must hold text back"
    assert all("\ufffd" not in d.text for d in deltas)
    assert [d.num_new_tokens for d in deltas] == [1] * len(ids)
    assert [d.finish_reason for d in deltas] == [-1] * (len(ids) - 1) + [FinishReason.LENGTH]
    # The request is gone: more tokens for it are ignored (the next TextDeltas is another request's).
    tok.send_scheduler(token_deltas([(request_id, 0, [42], -1)]))
    other_id, _, _ = tok.generate(prompt_text="x")
    assert tok.feed(other_id, [42], FinishReason.LENGTH).request_id == other_id


def test_stop_string_across_deltas_stops_the_sequence(tok: Harness, tokenizer: Tokenizer) -> None:
    params = SamplingParams(max_tokens=None, stop=["stop here"])
    request_id, _, _ = tok.generate(params, prompt_text="Count:")
    ids = tokenizer.encode("Count: 1 2 3 stop here and more", add_special_tokens=False)
    assert not any("stop here" in tokenizer.decode([t]) for t in ids), "the stop string must span tokens"
    deltas: list[TextDelta] = []
    for token_id in ids:
        deltas.append(tok.feed(request_id, [token_id]))
        if deltas[-1].finish_reason >= 0:
            break
    stop = tok.expect_scheduler(lambda m: isinstance(m, StopSequence), what="StopSequence")
    assert stop == StopSequence(request_id, 0)
    assert "".join(d.text for d in deltas) == "Count: 1 2 3 "
    assert deltas[-1].finish_reason == FinishReason.STOP
    assert deltas[-1].stop_reason == "stop here"
    assert all(d.finish_reason == -1 and d.stop_reason is None for d in deltas[:-1])
    # Tokens the scheduler sampled before it got the StopSequence are dropped.
    tok.send_scheduler(token_deltas([(request_id, 0, ids[-1:], FinishReason.STOP)]))
    other_id, _, _ = tok.generate(prompt_text="x")
    assert tok.feed(other_id, [42], FinishReason.LENGTH).request_id == other_id


def test_eos_as_last_token_adds_no_text(tok: Harness, tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_id
    assert eos is not None
    # skip_special_tokens=False: were the EOS pushed, "<|im_end|>" would show in the text.
    request_id, _, _ = tok.generate(SamplingParams(max_tokens=None, skip_special_tokens=False), prompt_text="Hi")
    ids = tokenizer.encode("Hello, 世界!", add_special_tokens=False)
    deltas = [tok.feed(request_id, [t]) for t in ids[:-1]]
    deltas.append(tok.feed(request_id, [ids[-1], eos], FinishReason.STOP))
    assert "".join(d.text for d in deltas) == "Hello, 世界!"
    assert deltas[-1].num_new_tokens == 2  # the EOS counts as generated
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == (FinishReason.STOP, None)


def test_include_stop_str_in_output_shows_the_stop_tokens_text(tok: Harness, tokenizer: Tokenizer) -> None:
    # vLLM's include_stop_str_in_output covers stop tokens too: the stop token's text is shown (the EOS's too,
    # "<|im_end|>" here with skip_special_tokens=False); it was dropped whatever the flag. Its id and logprob are
    # listed either way, as vLLM's (its detokenizer leaves only the text out), so token_ids, logprobs and usage
    # count the same tokens: they left it out without the flag while usage counted it.
    ids = tokenizer.encode("The capital is Paris", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    assert eos is not None
    for include, stop_ids, expected in [(False, [ids[-1]], "The capital is"), (True, [ids[-1]], "The capital is Paris"),
                                        (True, [eos], "The capital is Paris<|im_end|>")]:
        params = SamplingParams(max_tokens=None, stop_token_ids=stop_ids, include_stop_str_in_output=include,
                                skip_special_tokens=False, logprobs=0)
        request_id, _, _ = tok.generate(params, prompt_text="Hi", return_token_ids=True)
        sent = [*ids[:-1], stop_ids[0]] if stop_ids[0] == ids[-1] else [*ids, eos]
        delta = tok.feed(request_id, sent, FinishReason.STOP, logprobs=[-0.5] * len(sent))
        assert (delta.text, delta.finish_reason) == (expected, FinishReason.STOP)
        assert delta.token_ids == sent and [p.sampled.token_id for p in delta.logprobs] == sent
        assert delta.num_new_tokens == len(sent)  # the stop token counts as generated either way
        assert delta.stop_reason == (None if stop_ids[0] == eos else stop_ids[0])  # vLLM's: EOS is checked first


def test_stop_reason_names_the_stop_string_or_token(tok: Harness, tokenizer: Tokenizer) -> None:
    """vLLM's stop_reason: the stop string that matched, the stop_token_ids id sampled, the EOS id when EOS is
    ignored but listed; None for EOS, max_tokens, and until the completion ends."""
    ids = tokenizer.encode("The capital is Paris. Next", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    assert eos is not None
    cases = [(SamplingParams(max_tokens=None, stop=["Paris"]), ids, -1, "Paris"),
             (SamplingParams(max_tokens=None, stop_token_ids=[ids[2]]), ids[:3], FinishReason.STOP, ids[2]),
             (SamplingParams(max_tokens=None, stop_token_ids=[eos], ignore_eos=True), [*ids, eos], FinishReason.STOP,
              eos),
             (SamplingParams(max_tokens=None), [*ids, eos], FinishReason.STOP, None),
             (SamplingParams(max_tokens=len(ids)), ids, FinishReason.LENGTH, None)]
    for params, sent, reason, expected in cases:
        request_id, _, _ = tok.generate(params, prompt_text="Hi")
        if not isinstance(expected, str):  # a stop string ends the completion where it matches, here in ids[3]
            assert tok.feed(request_id, sent[:2]).stop_reason is None  # running
            sent = sent[2:]
        delta = tok.feed(request_id, sent, reason)
        assert delta.finish_reason == (FinishReason.STOP if isinstance(expected, str) else reason)
        assert delta.stop_reason == expected, params


def test_n_completions_finish_independently(tok: Harness, tokenizer: Tokenizer) -> None:
    request_id, _, _ = tok.generate(SamplingParams(n=2, max_tokens=None), prompt_text="Hi")
    a, b = tokenizer.encode(" one", add_special_tokens=False), tokenizer.encode(" two", add_special_tokens=False)
    tok.send_scheduler(token_deltas([(request_id, 0, a, FinishReason.LENGTH), (request_id, 1, b, -1)]))
    batch = tok.expect_api(lambda m: isinstance(m, TextDeltas))
    by_index = [merged([d for d in batch.deltas if d.index == i]) for i in (0, 1)]
    assert [(d.index, d.text, d.finish_reason) for d in by_index] == [(0, " one", 1), (1, " two", -1)]
    assert tok.feed(request_id, [tokenizer.eos_token_id], FinishReason.STOP, index=1).text == ""


def test_rendered_requests_get_sse_bytes_and_choice_json(tok: Harness, tokenizer: Tokenizer) -> None:
    """A request with a RenderSpec gets its opening in Accepted and RenderedRows: SSE chunks per step when
    streaming, one choice object at the end otherwise; the api only writes them."""
    spec = RenderSpec(1, "chatcmpl-1", "m", 7, True)
    request_id = new_id()
    tok.send_api(GenerateRequest(request_id, SamplingParams(n=2, max_tokens=None), prompt_text="Hi", render=spec))
    accepted = tok.expect_reply(request_id, Accepted)
    tok.expect_scheduler(lambda m: isinstance(m, AddRequest) and m.request_id == request_id)
    opening = [msgspec.json.decode(line[6:]) for line in accepted.opening.split(b"\n\n") if line]
    assert [c["choices"][0]["index"] for c in opening] == [0, 1]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in opening)
    ids = tokenizer.encode(" one two", add_special_tokens=False)
    tok.send_scheduler(token_deltas([(request_id, 0, ids, FinishReason.LENGTH), (request_id, 1, ids[:1], -1)]))
    rows = tok.expect_api(lambda m: isinstance(m, RenderedRows), what="RenderedRows")
    assert rows.request_ids == [request_id] * (len(ids) + 1)
    assert rows.finish_reasons[len(ids) - 1] == FinishReason.LENGTH and rows.num_new_tokens == [1] * (len(ids) + 1)
    chunks = [msgspec.json.decode(line[6:]) for data in rows.data for line in data.split(b"\n\n") if line]
    assert all(c["id"] == "chatcmpl-1" and c["object"] == "chat.completion.chunk" for c in chunks)
    text = {i: "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == i)
            for i in (0, 1)}
    assert text == {0: " one two", 1: " one"}
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["index"] == 0][-1] == "length"

    request_id = new_id()
    tok.send_api(GenerateRequest(request_id, SamplingParams(max_tokens=None), prompt_text="Hi",
                                 render=RenderSpec(0, "cmpl-2", "m", 7, False, first_choice=3)))
    assert tok.expect_reply(request_id, Accepted).opening == b""
    tok.send_scheduler(token_deltas([(request_id, 0, ids, FinishReason.STOP)]))
    rows = tok.expect_api(lambda m: isinstance(m, RenderedRows), what="RenderedRows")
    assert rows.data[:-1] == [b""] * (len(ids) - 1)  # not streamed: nothing until the choice ends
    choice = msgspec.json.decode(rows.data[-1])
    # a stop token's own text is not part of the output
    assert choice == {"index": 3, "text": tokenizer.decode(ids[:-1]), "logprobs": None, "finish_reason": "stop",
                      "stop_reason": None, "prompt_logprobs": None}  # vLLM's keys, null for EOS / when not asked


def test_logprobs_carry_token_strings(tok: Harness, tokenizer: Tokenizer) -> None:
    request_id, _, _ = tok.generate(SamplingParams(max_tokens=None, logprobs=2), prompt_text="Hi")
    first, second = tokenizer.encode(" héllo", add_special_tokens=False)[:2]
    delta = tok.feed(request_id, [first], logprobs=[-0.5], top_token_ids=[[first, second]],
                     top_logprobs=[[-0.5, -1.25]])
    [position] = delta.logprobs
    token = tokenizer.decode([first], skip_special_tokens=False)
    assert (position.sampled.token, position.sampled.token_id, position.sampled.logprob) == (token, first, -0.5)
    assert position.sampled.bytes == list(tokenizer.token_bytes(first))
    assert [(t.token_id, t.logprob, t.token) for t in position.top] == [
        (first, -0.5, token), (second, -1.25, tokenizer.decode([second], skip_special_tokens=False))]
    # Without logprobs asked, none are sent.
    plain_id, _, _ = tok.generate(prompt_text="Hi")
    assert tok.feed(plain_id, [first], FinishReason.LENGTH).logprobs == []
    tok.send_api(AbortRequest(request_id))


def test_logprob_tokens_join_to_the_text_then_the_eos(tok: Harness, tokenizer: Tokenizer) -> None:
    """The EOS that ends a completion is not in its text, but has its logprob entry, as vLLM's: one entry per
    token that usage counts."""
    request_id, _, _ = tok.generate(SamplingParams(max_tokens=None, logprobs=0), prompt_text="Hi")
    ids = tokenizer.encode(" fine", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    delta = tok.feed(request_id, [*ids, eos], FinishReason.STOP, logprobs=[-0.1] * (len(ids) + 1),
                     top_token_ids=[[]] * (len(ids) + 1), top_logprobs=[[]] * (len(ids) + 1))
    assert delta.text == " fine"
    assert "".join(p.sampled.token for p in delta.logprobs) == delta.text + tokenizer.decode([eos], False)
    assert delta.num_new_tokens == len(delta.logprobs) == len(ids) + 1


def test_tokenize_token_strs_and_continue_final_message(tok: Harness, tokenizer: Tokenizer) -> None:
    request_id = new_id()
    tok.send_api(TokenizeRequest(request_id, prompt_text="hello world", return_token_strs=True))
    result = tok.expect_reply(request_id, TokenizeResult)
    assert result.token_strs == tokenizer.hf.convert_ids_to_tokens(result.token_ids)
    messages = [ChatMessage("user", "Hi"), ChatMessage("assistant", "Once upon")]
    request_id = new_id()
    tok.send_api(TokenizeRequest(request_id, messages=messages, add_generation_prompt=False,
                                 continue_final_message=True))
    ids = tok.expect_reply(request_id, TokenizeResult).token_ids
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("Once upon")


def test_chat_messages_use_the_chat_template(tok: Harness, tokenizer: Tokenizer) -> None:
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there!", name="ann")]
    request_id, accepted, added = tok.generate(messages=messages)
    expected = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hi there!", "name": "ann"}])
    assert added.prompt_token_ids == expected
    assert accepted.num_prompt_tokens == len(expected)
    tok.send_api(AbortRequest(request_id))


# Command-R / Granite style retrieval documents and the reasoning switches, each rendered where given
RAG_TEMPLATE = """{%- for doc in documents or [] %}{{- 'Document ' ~ loop.index0 ~ ': ' ~ doc.title ~ '\\n' }}
{%- endfor %}
{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if reasoning_effort is defined %}{{- '<effort>' + reasoning_effort + '</effort>' }}{%- endif %}"""


def test_documents_and_template_variables_reach_the_template(smollm2_dir: Path, tmp_path: Path) -> None:
    """GenerateRequest.documents and TokenizeRequest.documents cross the wire to the template beside the chat
    template variables (the api's reasoning_effort among them): the prompt the scheduler gets and the count are the
    template's rendering with them. A request without them renders as before."""
    template = tmp_path / "rag.jinja"
    template.write_text(RAG_TEMPLATE)
    rag = Tokenizer(smollm2_dir, RAG_TEMPLATE)
    harness = Harness(smollm2_dir, "--chat-template", str(template))
    try:
        harness.start(model_info(rag))
        messages = [ChatMessage("user", "Weather?")]
        conversation = [{"role": "user", "content": "Weather?"}]
        documents = [{"title": "Oslo", "text": "rain"}, {"title": "Paris", "text": "sun"}]
        variables = {"reasoning_effort": "low", "enable_thinking": True}
        want = rag.render_chat(conversation, chat_template_kwargs=variables, documents=documents)
        assert want.startswith("Document 0: Oslo\nDocument 1: Paris\n") and want.endswith("<effort>low</effort>")
        request_id, _, added = harness.generate(messages=messages, documents=documents,
                                                chat_template_kwargs=variables)
        assert added.prompt_token_ids == rag.encode(want, add_special_tokens=False)
        harness.send_api(AbortRequest(request_id))
        count_id = new_id()
        harness.send_api(TokenizeRequest(count_id, messages=messages, documents=documents,
                                         chat_template_kwargs=variables))
        assert harness.expect_reply(count_id, TokenizeResult).token_ids == added.prompt_token_ids
        request_id, _, added = harness.generate(messages=messages)
        assert added.prompt_token_ids == rag.encode(rag.render_chat(conversation), add_special_tokens=False)
        harness.send_api(AbortRequest(request_id))
    finally:
        harness.close()


def test_documents_count_in_the_work_estimate() -> None:
    """Retrieval documents are rendered as turns are: their text counts in prompt_chars, which moves a large render
    off the loop."""
    messages = [ChatMessage("user", "Weather?")]
    documents = [{"title": f"doc {i}", "text": "x" * 1000} for i in range(40)]
    assert prompt_chars(None, messages, documents=documents) >= OFFLOAD_MIN_CHARS > prompt_chars(None, messages)


def test_truncated_ids_follow_vllms_rules() -> None:
    ids = list(range(10))

    def cut(limit: int | None, side: str | None = None, max_len: int = 100) -> list[int]:
        params = SamplingParams(truncate_prompt_tokens=limit, truncation_side=side).validate()
        return truncated_ids(ids, params, max_len)

    assert cut(None) == cut(10) == cut(11) == cut(-1) == ids  # off, or not longer than k
    assert cut(3) == cut(3, "left") == [7, 8, 9] and cut(3, "right") == [0, 1, 2]
    assert cut(-1, max_len=4) == [6, 7, 8, 9] and cut(-1, "right", max_len=4) == [0, 1, 2, 3]
    assert max_prompt_len(128, 4096) == 127 and max_prompt_len(128, 64) == 63  # the context, or the KV cache
    for limit, side, param in ((0, None, "truncate_prompt_tokens"), (-2, None, "truncate_prompt_tokens"),
                               (True, None, "truncate_prompt_tokens"), (2**63, None, "truncate_prompt_tokens"),
                               (4, "middle", "truncation_side")):
        with pytest.raises(InvalidRequestError) as caught:
            SamplingParams(truncate_prompt_tokens=limit, truncation_side=side).validate()
        assert caught.value.param == param


def test_truncate_prompt_tokens_keeps_the_last_or_first_tokens(tok: Harness, tokenizer: Tokenizer) -> None:
    """vLLM's truncate_prompt_tokens, after tokenization (chat: after the template): the scheduler gets the kept
    tokens, the api their count (usage) and, for echo, their text; a larger k changes nothing."""
    text = "The capital of France is Paris, and the capital of Spain is Madrid."
    ids = tokenizer.encode(text)
    for side, kept in ((None, ids[-5:]), ("left", ids[-5:]), ("right", ids[:5])):
        params = SamplingParams(max_tokens=4, truncate_prompt_tokens=5, truncation_side=side)
        request_id, accepted, added = tok.generate(params, prompt_text=text, return_prompt_text=True)
        assert added.prompt_token_ids == kept and accepted.num_prompt_tokens == 5, side
        assert accepted.prompt_text == tokenizer.decode(kept, skip_special_tokens=False)  # echo: the kept text
        tok.send_api(AbortRequest(request_id))
    request_id, accepted, added = tok.generate(SamplingParams(max_tokens=4, truncate_prompt_tokens=len(ids) + 1),
                                               prompt_text=text, return_prompt_text=True)
    assert (added.prompt_token_ids, accepted.prompt_text) == (ids, text)
    tok.send_api(AbortRequest(request_id))
    request_id, _, added = tok.generate(SamplingParams(max_tokens=4, truncate_prompt_tokens=3),
                                        prompt_token_ids=ids)
    assert added.prompt_token_ids == ids[-3:]
    tok.send_api(AbortRequest(request_id))
    messages = [ChatMessage("user", text)]
    request_id, accepted, added = tok.generate(SamplingParams(max_tokens=4, truncate_prompt_tokens=6),
                                               messages=messages)
    assert added.prompt_token_ids == tokenizer.apply_chat_template([{"role": "user", "content": text}])[-6:]
    tok.send_api(AbortRequest(request_id))


def test_truncate_prompt_tokens_minus_one_keeps_what_the_context_takes(tok: Harness, tokenizer: Tokenizer) -> None:
    """-1: a prompt longer than the context keeps its last max_model_len - 1 tokens (one is left to generate) without
    max_tokens, max_model_len - max_tokens with it (as vLLM's), before the prompt-too-long check; the default
    max_tokens then fills what the context leaves. A max_tokens the context cannot hold is still refused."""
    ids = tokenizer.encode(LONG_TEXT)
    assert len(ids) > MAX_MODEL_LEN
    request_id, accepted, added = tok.generate(SamplingParams(max_tokens=None, truncate_prompt_tokens=-1),
                                               prompt_text=LONG_TEXT)
    assert added.prompt_token_ids == ids[-(MAX_MODEL_LEN - 1):] and accepted.num_prompt_tokens == MAX_MODEL_LEN - 1
    tok.send_api(AbortRequest(request_id))
    request_id, accepted, added = tok.generate(SamplingParams(max_tokens=16, truncate_prompt_tokens=-1),
                                               prompt_text=LONG_TEXT)
    assert added.prompt_token_ids == ids[-(MAX_MODEL_LEN - 16):] and accepted.num_prompt_tokens == MAX_MODEL_LEN - 16
    tok.send_api(AbortRequest(request_id))
    request_id = new_id()
    tok.send_api(GenerateRequest(request_id, SamplingParams(max_tokens=MAX_MODEL_LEN, truncate_prompt_tokens=-1),
                                 prompt_text=LONG_TEXT))
    assert tok.expect_reply(request_id, RequestFailed).param == "max_tokens"



@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A word-level tokenizer whose encode puts a BOS before the text, as Llama's, Mistral's and DeepSeek's do."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{word: 3 + i for i, word in enumerate("a b c d e f g h".split())}}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Whitespace()
    rust.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder = tmp_path_factory.mktemp("bos_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=rust, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(folder))
    return Tokenizer(folder)


def test_truncation_keeps_the_bos_the_tokenizer_adds(bos_tokenizer: Tokenizer) -> None:
    """A text prompt is truncated as transformers' tokenizer truncates it (vLLM's way): the special tokens encode adds
    (a BOS) stay and the text's own tokens make up the rest of the k, on either side; -1 likewise. Token-id prompts and
    add_special_tokens=false prompts are cut as they are."""
    from transformers import AutoTokenizer

    text = "a b c d e f"
    info = ModelInfo(max_model_len=5, vocab_size=bos_tokenizer.vocab_size, max_num_tokens=4096, eos_token_ids=[1])
    for side, limit in (("left", 3), ("right", 3), ("left", -1), ("right", 1)):
        params = SamplingParams(max_tokens=1, truncate_prompt_tokens=limit, truncation_side=side)
        prompt = generate_prompt(bos_tokenizer, GenerateRequest("r", params, prompt_text=text), info)
        reference = AutoTokenizer.from_pretrained(bos_tokenizer.path, truncation_side=side)
        max_length = max_prompt_len(info.max_model_len, info.max_num_tokens) if limit == -1 else limit
        expected = reference.encode(text, truncation=True, max_length=max_length)
        assert prompt.token_ids == expected and expected[0] == 0, (side, limit)
        assert prompt.text == bos_tokenizer.decode(expected[1:], skip_special_tokens=False)  # echo: the text's own
    params = SamplingParams(max_tokens=1, truncate_prompt_tokens=3)
    ids = bos_tokenizer.encode(text)
    as_ids = GenerateRequest("r", params, prompt_token_ids=ids)
    assert generate_prompt(bos_tokenizer, as_ids, info).token_ids == ids[-3:]
    unframed = GenerateRequest("r", params, prompt_text=text, add_special_tokens=False)
    assert generate_prompt(bos_tokenizer, unframed, info).token_ids == bos_tokenizer.encode(text, False)[-3:]


LONG_TEXT = "hello " * MAX_MODEL_LEN


@pytest.mark.parametrize("prompt, params, param, code", [
    ({"prompt_token_ids": [5] * MAX_MODEL_LEN}, {}, "prompt", "context_length_exceeded"),
    ({"prompt_text": LONG_TEXT}, {}, "prompt", "context_length_exceeded"),
    ({"messages": [ChatMessage("user", LONG_TEXT)]}, {}, "messages", "context_length_exceeded"),
    ({"prompt_token_ids": [5] * 100}, {"max_tokens": 29}, "max_tokens", "context_length_exceeded"),
    ({"prompt_text": ""}, {}, "prompt", None),
    ({"prompt_token_ids": []}, {}, "prompt", None),
    ({"prompt_token_ids": [1, 49152]}, {}, "prompt", None),
    ({"prompt_token_ids": [-1]}, {}, "prompt", None),
    ({}, {}, "prompt", None),
    ({"prompt_text": "hi"}, {"stop_token_ids": [49152]}, "stop_token_ids", None),
    ({"messages": []}, {}, "messages", None),
    ({"messages": [ChatMessage("user", "hi")], "chat_template_kwargs": {"tokenize": True}}, {},
     "chat_template_kwargs", None),
    # -1 (the whole vocabulary) past --max-logprobs: named as the client sent it (chat: top_logprobs)
    ({"prompt_text": "hi"}, {"logprobs": -1}, "logprobs", None),
    ({"messages": [ChatMessage("user", "hi")]}, {"logprobs": -1}, "top_logprobs", None),
])
def test_bad_requests_fail_with_400(tok: Harness, tokenizer: Tokenizer, prompt: dict[str, Any],
                                    params: dict[str, Any], param: str, code: str | None) -> None:
    assert tokenizer.vocab_size == 49152
    request_id = new_id()
    tok.send_api(GenerateRequest(request_id, SamplingParams(**{"max_tokens": None, **params}), **prompt))
    failed = tok.expect_reply(request_id, RequestFailed)
    assert (failed.status, failed.error_type, failed.param, failed.code) == (
        400, "invalid_request_error", param, code), failed
    if code and param != "max_tokens":  # vLLM's words (clients match them), naming the field
        assert failed.message.startswith("This model's maximum context length is "), failed.message
        assert f" input tokens ({param}); " in failed.message, failed.message


def test_prompt_plus_max_tokens_at_the_limit_is_accepted(tok: Harness) -> None:
    request_id, accepted, _ = tok.generate(SamplingParams(max_tokens=28), prompt_token_ids=[5] * 100)
    assert accepted.num_prompt_tokens == 100
    tok.send_api(AbortRequest(request_id))


def test_abort_is_forwarded_and_later_tokens_ignored(tok: Harness) -> None:
    request_id, _, _ = tok.generate(prompt_text="abort me")
    tok.send_api(AbortRequest(request_id))
    tok.expect_scheduler(lambda m: m == AbortRequest(request_id), what="the forwarded AbortRequest")
    tok.send_scheduler(token_deltas([(request_id, 0, [42], -1)]))
    other_id, _, _ = tok.generate(prompt_text="x")
    assert tok.feed(other_id, [42], FinishReason.LENGTH).request_id == other_id


def test_scheduler_failure_is_forwarded(tok: Harness) -> None:
    request_id, _, _ = tok.generate(prompt_text="fail me")
    tok.send_scheduler(RequestFailed(request_id, 500, "worker error", "internal_error"))
    assert tok.expect_reply(request_id, RequestFailed) == RequestFailed(request_id, 500, "worker error",
                                                                        "internal_error")


def test_a_failure_follows_the_output_a_stream_interval_held(tok: Harness, tokenizer: Tokenizer) -> None:
    """stream_interval 8: after the first token the output is held; the scheduler's failure sends it first (the
    client sees the output up to the error, as without an interval), once."""
    request_id, _, _ = tok.generate(SamplingParams(max_tokens=None, stream_interval=8), prompt_text="Hi")

    def mine(message: Any) -> bool:
        return getattr(message, "request_id", None) == request_id \
            or (isinstance(message, TextDeltas) and message.deltas[0].request_id == request_id)

    ids = tokenizer.encode(" one two three", add_special_tokens=False)
    tok.send_scheduler(token_deltas([(request_id, 0, ids, -1)]))
    assert [d.num_new_tokens for d in tok.expect_api(mine, what="the first delta").deltas] == [1]
    tok.send_scheduler(RequestFailed(request_id, 500, "worker error", "internal_error"))
    held = tok.expect_api(mine, what="the held output")
    assert isinstance(held, TextDeltas), held  # before the failure
    assert [(d.request_id, d.text, d.num_new_tokens, d.finish_reason) for d in held.deltas] == [
        (request_id, tokenizer.decode(ids[1:]), len(ids) - 1, -1)]
    assert tok.expect_reply(request_id, RequestFailed).message == "worker error"
    tok.send_scheduler(RequestFailed(request_id, 500, "again", "internal_error"))  # gone: nothing more is sent
    other_id, _, _ = tok.generate(prompt_text="x")
    assert tok.feed(other_id, [42], FinishReason.LENGTH).request_id == other_id
    assert not any(map(mine, tok.api_inbox))


def test_tokenize_and_detokenize(tok: Harness, tokenizer: Tokenizer) -> None:
    request_id = new_id()
    tok.send_api(TokenizeRequest(request_id, prompt_text="hello world"))
    assert tok.expect_reply(request_id, TokenizeResult) == TokenizeResult(
        request_id, tokenizer.encode("hello world"), MAX_MODEL_LEN)
    chat_id = new_id()
    tok.send_api(TokenizeRequest(chat_id, messages=[ChatMessage("user", "hi")]))
    assert tok.expect_reply(chat_id, TokenizeResult).token_ids == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}])
    ids = tokenizer.encode(UNICODE_TEXT)
    request_id = new_id()
    tok.send_api(DetokenizeRequest(request_id, ids))
    assert tok.expect_reply(request_id, DetokenizeResult) == DetokenizeResult(request_id, UNICODE_TEXT)
    request_id = new_id()
    tok.send_api(DetokenizeRequest(request_id, [1, 10**9]))
    assert tok.expect_reply(request_id, RequestFailed).status == 400


def test_a_detokenize_whose_text_cannot_fit_a_frame_is_a_400(tok: Harness, tokenizer: Tokenizer) -> None:
    """Ids decode to up to 81 bytes each (SmolLM2's longest token): a 28 MiB /detokenize body of them made a text
    past the 64 MiB frame ZeroMQ takes, which the api's socket refused, the tokenizer sent again, forever, with
    every answer queued behind it ('no tokenizer process is available' from then on). The text is refused
    instead, naming tokens, and the stream goes on."""
    assert MAX_DETOKENIZED_BYTES + (1 << 20) < MAX_FRAME_BYTES  # room for the message around the text
    longest = max(range(tokenizer.vocab_size), key=lambda i: len(tokenizer.token_bytes(i)))
    ids = [longest] * (MAX_DETOKENIZED_BYTES // len(tokenizer.token_bytes(longest)) + 1)
    request_id = new_id()
    tok.send_api(DetokenizeRequest(request_id, ids))
    failed = tok.expect_reply(request_id, RequestFailed, timeout=60.0)
    assert failed.status == 400 and failed.param == "tokens" and "bytes" in failed.message, failed
    fits = ids[:len(ids) // 2]
    request_id = new_id()
    tok.send_api(DetokenizeRequest(request_id, fits))
    assert tok.expect_reply(request_id, DetokenizeResult, timeout=60.0).text == \
        tokenizer.decode(fits, skip_special_tokens=False)


def test_large_prompt_tokenizes_off_the_loop(tok: Harness, tokenizer: Tokenizer) -> None:
    """A prompt large enough to take a while is tokenized on a thread: a small request sent after it is
    answered first, and the large one is refused (it is far past the context) without a 500."""
    large_id, small_id = new_id(), new_id()
    tok.send_api(GenerateRequest(large_id, SamplingParams(max_tokens=1), prompt_text="lorem ipsum " * 200_000))
    tok.send_api(TokenizeRequest(small_id, prompt_text="hello"))
    first = tok.expect_api(lambda m: getattr(m, "request_id", None) in (large_id, small_id), what="an answer")
    assert first == TokenizeResult(small_id, tokenizer.encode("hello"), MAX_MODEL_LEN)
    failed = tok.expect_reply(large_id, RequestFailed, timeout=60.0)
    assert failed.status == 400 and failed.code == "context_length_exceeded"
    large_ids = list(range(100, 200)) * 400  # 40,000 ids: decoded on the thread too
    detok_id = new_id()
    tok.send_api(DetokenizeRequest(detok_id, large_ids))
    assert tok.expect_reply(detok_id, DetokenizeResult).text == tokenizer.decode(large_ids, skip_special_tokens=False)


def test_a_long_decode_lets_other_threads_run(tokenizer: Tokenizer) -> None:
    """The tokenizer decodes a long id list (/detokenize) on a thread so that its loop keeps sending heartbeats;
    the Rust decode held the GIL throughout (15M ids, a 28 MiB /detokenize body, held it 5 s: the api and the
    scheduler dropped the tokenizer as silent, with every request it held). With the switch interval out of reach
    the other thread can run only if the decode lets go of the GIL."""
    ran = threading.Event()
    go = threading.Event()
    other = threading.Thread(target=lambda: go.wait() and ran.set())
    other.start()  # now waiting on `go`: it needs the GIL to go on
    ids = list(range(100, 200)) * 400
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)  # this thread keeps the GIL unless a call lets it go
    try:
        go.set()
        text = tokenizer.decode(ids, skip_special_tokens=False)
        ran_during_decode = ran.is_set()
    finally:
        sys.setswitchinterval(interval)
        other.join()
    assert ran_during_decode
    assert text == tokenizer.backend.decode(ids, skip_special_tokens=False)  # the same text as decode's


def test_a_conversation_of_many_tool_calls_renders_off_the_loop(tok: Harness, tokenizer: Tokenizer) -> None:
    """Tool calls and empty turns count as the work they are (prompt_chars): 20,000 calls with no content (the QA
    helper's 200k stalled the loop past the heartbeat timeout, failing every request in flight) render on a thread,
    so a small request sent after them is answered first."""
    calls = [ToolCallMessage(f"call_{i}", "get_weather", '{"city": "Paris"}') for i in range(20_000)]
    messages = [ChatMessage("user", "Weather?"), ChatMessage("assistant", "", tool_calls=calls)]
    assert prompt_chars(None, messages) >= OFFLOAD_MIN_CHARS > prompt_chars(None, messages[:1]) + 20_000
    large_id, small_id = new_id(), new_id()
    tok.send_api(GenerateRequest(large_id, SamplingParams(max_tokens=1), messages=messages))
    tok.send_api(TokenizeRequest(small_id, prompt_text="hello"))
    first = tok.expect_api(lambda m: getattr(m, "request_id", None) in (large_id, small_id), what="an answer")
    assert first == TokenizeResult(small_id, tokenizer.encode("hello"), MAX_MODEL_LEN)
    assert tok.expect_reply(large_id, RequestFailed, timeout=60.0).code == "context_length_exceeded"


def test_a_requests_own_chat_template_renders_off_the_loop(tok: Harness, tokenizer: Tokenizer) -> None:
    """A request's own chat_template (--trust-request-chat-template) costs what its loops cost, whatever the body's
    size: on the loop, a 90-byte template of nested range() calls silenced the heartbeats until the api and the
    scheduler dropped the tokenizer (every request on it a 503). It renders on a thread, for generation and for a
    count alike: a small request sent after each is answered first, and each still gets its answer."""
    template = "{% for i in range(100000) %}{% for j in range(20) %}{% endfor %}{% endfor %}hello"
    messages = [ChatMessage("user", "hi")]
    slow_generate, slow_count = new_id(), new_id()
    tok.send_api(GenerateRequest(slow_generate, SamplingParams(max_tokens=1), messages=messages,
                                 chat_template=template))
    tok.send_api(TokenizeRequest(slow_count, messages=messages, chat_template=template))
    small_id = new_id()
    tok.send_api(TokenizeRequest(small_id, prompt_text="hello"))
    first = tok.expect_api(lambda m: getattr(m, "request_id", None) in (slow_generate, slow_count, small_id),
                           what="an answer")
    assert first == TokenizeResult(small_id, tokenizer.encode("hello"), MAX_MODEL_LEN)
    assert tok.expect_reply(slow_count, TokenizeResult, timeout=60.0).token_ids == tokenizer.encode("hello")
    assert tok.expect_reply(slow_generate, Accepted, timeout=60.0).num_prompt_tokens == len(tokenizer.encode("hello"))
    tok.send_api(AbortRequest(slow_generate))


def test_a_large_constraint_compiles_off_the_loop(tok: Harness, tokenizer: Tokenizer) -> None:
    """A large JSON schema takes llguidance seconds to compile (~8 s for 600 KB on the 2-core host): on the loop it
    silenced the process's heartbeats until the api and the scheduler dropped the tokenizer, failing every request
    it held. It compiles on a thread with the prompt (SLOW_COMPILE_MIN_BYTES): a small request sent after it is
    answered first, and the constrained one still reaches the scheduler with its constraint."""
    # 400 optional properties: under llguidance's row limit (from ~600 the first property token passes it: a 400)
    properties = {f"field_{i}_" + "x" * 60: {"type": ["integer", "string", "boolean"]} for i in range(400)}
    constraint = StructuredOutputs(json={"type": "object", "properties": properties})
    assert len(msgspec.json.encode(constraint)) >= SLOW_COMPILE_MIN_BYTES
    large_id, small_id = new_id(), new_id()
    tok.send_api(GenerateRequest(large_id, SamplingParams(max_tokens=1, structured_outputs=constraint),
                                 prompt_text="hi"))
    tok.send_api(TokenizeRequest(small_id, prompt_text="hello"))
    first = tok.expect_api(lambda m: getattr(m, "request_id", None) in (large_id, small_id), what="an answer")
    assert first == TokenizeResult(small_id, tokenizer.encode("hello"), MAX_MODEL_LEN)
    tok.expect_reply(large_id, Accepted, timeout=60.0)
    added = tok.expect_scheduler(lambda m: isinstance(m, AddRequest) and m.request_id == large_id)
    assert added.params.structured_outputs == constraint
    tok.send_api(AbortRequest(large_id))


def test_abort_while_a_thread_tokenizes(tok: Harness) -> None:
    request_id = new_id()
    tok.send_api(GenerateRequest(request_id, SamplingParams(max_tokens=1), prompt_text="lorem " * 100_000))
    tok.send_api(AbortRequest(request_id))
    probe = new_id()
    tok.send_api(TokenizeRequest(probe, prompt_text="after"))
    tok.expect_reply(probe, TokenizeResult)
    tok.send_api(TokenizeRequest(probe2 := new_id(), prompt_text="x" * 40_000))  # queued behind the aborted job
    tok.expect_reply(probe2, TokenizeResult, timeout=30.0)
    assert not [m for m in tok.api_inbox if getattr(m, "request_id", None) == request_id]


def test_garbage_frames_are_dropped(tok: Harness) -> None:
    tok.send_api_frames([b"\xc1 not msgpack"])
    tok.send_api_frames([b"two", b"frames"])
    tok.send_api_frames([msgspec.msgpack.encode(["gen", "no params"])])
    tok.send_scheduler_frames([b"\xff\xfe garbage"])
    tok.send_scheduler_frames([b"two", b"frames"])
    tok.send_scheduler_frames([msgspec.msgpack.encode(["tokens", [["x", "not an index", []]]])])
    request_id, _, _ = tok.generate(prompt_text="still serving")
    assert tok.feed(request_id, [42], FinishReason.LENGTH).finish_reason == FinishReason.LENGTH
    assert tok.proc.poll() is None


def test_silent_scheduler_fails_inflight_then_tokenizer_registers_again(own_tok: Harness) -> None:
    request_id, _, _ = own_tok.generate(prompt_text="wait for me")
    own_tok.scheduler_alive = False
    silent_since = own_tok.last_scheduler_send
    failed = own_tok.expect_reply(request_id, RequestFailed, timeout=HEARTBEAT_TIMEOUT + 2.0)
    assert time.monotonic() - silent_since < HEARTBEAT_TIMEOUT + 1.0
    assert (failed.status, failed.error_type) == (503, "server_error")
    # The scheduler may only be slow: it is told to drop the request.
    own_tok.expect_scheduler(lambda m: m == AbortRequest(request_id), what="an AbortRequest")
    # Back again: the tokenizer says hello, gets ModelInfo, and serves.
    own_tok.scheduler_inbox.clear()
    own_tok.scheduler_alive = True
    own_tok.expect_scheduler(lambda m: isinstance(m, TokenizerHello), what="a fresh hello")
    request_id, accepted, _ = own_tok.generate(prompt_text="again")
    assert accepted.num_prompt_tokens > 0


def test_a_restarted_apis_requests_are_aborted(own_tok: Harness) -> None:
    """An api process killed and replaced at its address: its clients went with it, so when the new process's
    stream begins, the old one's requests are aborted at the scheduler (they ran on to max_tokens, holding KV
    blocks), and the new process's request is served."""
    old_api = Link[Any](resend_s=1.0)
    orphan_id = new_id()
    own_tok.send_api_sealed(GenerateRequest(orphan_id, SamplingParams(max_tokens=None), prompt_text="orphan"),
                            old_api)
    own_tok.expect_reply(orphan_id, Accepted)
    own_tok.expect_scheduler(lambda m: isinstance(m, AddRequest) and m.request_id == orphan_id)
    own_tok.api_link = Link(resend_s=1.0)  # the new process's receiving end, fresh too
    request_id = new_id()
    own_tok.send_api_sealed(GenerateRequest(request_id, SamplingParams(max_tokens=None), prompt_text="new"),
                            Link(resend_s=1.0))
    own_tok.expect_scheduler(lambda m: m == AbortRequest(orphan_id), what="the orphan's AbortRequest")
    own_tok.expect_scheduler(lambda m: isinstance(m, AddRequest) and m.request_id == request_id)
    own_tok.expect_reply(request_id, Accepted)
    assert own_tok.feed(request_id, [42], FinishReason.LENGTH).request_id == request_id
    assert AbortRequest(request_id) not in own_tok.scheduler_inbox


def test_a_silent_apis_requests_are_aborted_and_failed(own_tok: Harness) -> None:
    """An api that acknowledges nothing for the heartbeat timeout (killed and not back yet, or stopped) is taken
    for gone: its requests are aborted at the scheduler; one that was only slow hears that they failed."""
    request_id, _, _ = own_tok.generate(prompt_text="orphan")
    own_tok.api_alive = False
    own_tok.send_scheduler(token_deltas([(request_id, 0, [42], -1)]))  # output the api never acknowledges
    own_tok.expect_scheduler(lambda m: m == AbortRequest(request_id), timeout=HEARTBEAT_TIMEOUT + REPLY_TIMEOUT,
                             what="the orphan's AbortRequest")
    own_tok.api_alive = True
    failed = own_tok.expect_reply(request_id, RequestFailed, timeout=HEARTBEAT_TIMEOUT + REPLY_TIMEOUT)
    assert (failed.status, failed.error_type) == (503, "server_error")
    own_tok.api_inbox.clear()  # the output it missed came before the failure, in order
    request_id, _, _ = own_tok.generate(prompt_text="served again")
    assert own_tok.feed(request_id, [42], FinishReason.LENGTH).request_id == request_id


def test_scheduler_restart_is_seen_in_its_heartbeats(tok: Harness) -> None:
    request_id, _, _ = tok.generate(prompt_text="in flight across a restart")
    tok.scheduler_inbox.clear()
    tok.scheduler_name = "sched-test-restarted"
    tok.send_scheduler(Heartbeat(tok.scheduler_name))
    failed = tok.expect_reply(request_id, RequestFailed)
    assert (failed.status, failed.error_type) == (503, "server_error")
    tok.expect_scheduler(lambda m: isinstance(m, TokenizerHello), what="a fresh hello")
    request_id, _, _ = tok.generate(prompt_text="after the restart")
    assert tok.feed(request_id, [42], FinishReason.LENGTH).text


def test_sigterm_fails_inflight_and_exits_zero(own_tok: Harness) -> None:
    request_id, _, _ = own_tok.generate(prompt_text="in flight")
    own_tok.proc.send_signal(signal.SIGTERM)
    signalled_at = time.monotonic()
    failed = own_tok.expect_reply(request_id, RequestFailed)
    assert (failed.status, failed.error_type) == (503, "server_error")
    assert own_tok.proc.wait(timeout=5.0) == 0, own_tok.log_tail()
    assert time.monotonic() - signalled_at < 3.0


def test_no_tokenizer_serves_token_ids_only() -> None:
    """A folder without tokenizer files (as a dummy shape): ids in, empty text out, text prompts refused."""
    model_dir = Path(tempfile.mkdtemp(prefix="pgm", dir="/tmp"))
    harness = Harness(model_dir)
    try:
        # A scheduler that does not answer the hello yet: requests wait, then get a 503 ...
        harness.start(None)
        late_id = new_id()
        harness.send_api(GenerateRequest(late_id, SamplingParams(), prompt_token_ids=[1]))
        failed = harness.expect_reply(late_id, RequestFailed, timeout=HEARTBEAT_TIMEOUT + 2.0)
        assert (failed.status, failed.error_type) == (503, "server_error")
        harness.expect_scheduler(lambda m: isinstance(m, TokenizerHello), what="a repeated hello")
        # ... or are served once it answers one of the hellos the tokenizer repeats until then.
        waiting_id = new_id()
        harness.send_api(TokenizeRequest(waiting_id, prompt_text="no tokenizer"))
        harness.model_info = ModelInfo(max_model_len=64, vocab_size=1000, max_num_tokens=64, eos_token_ids=[0])
        assert harness.expect_reply(waiting_id, RequestFailed).status == 400
        request_id, accepted, _ = harness.generate(SamplingParams(max_tokens=None, logprobs=0),
                                                   prompt_token_ids=[1, 2, 3])
        assert accepted.num_prompt_tokens == 3
        delta = harness.feed(request_id, [7], FinishReason.LENGTH, logprobs=[-0.1])
        assert (delta.text, delta.num_new_tokens, delta.logprobs[0].sampled.token) == ("", 1, "token_id:7")
        text_id = new_id()
        harness.send_api(GenerateRequest(text_id, SamplingParams(), prompt_text="hello"))
        assert harness.expect_reply(text_id, RequestFailed).status == 400
    finally:
        harness.close()
        shutil.rmtree(model_dir, ignore_errors=True)



def test_hello_carries_the_generation_configs_sampling_defaults(tmp_path: Path) -> None:
    """vLLM's --generation-config: "auto" (the default) takes the model folder's generation_config.json sampling
    fields, max_new_tokens as max_tokens; "vllm" none; a folder its own file. The tokenizer reads them (the api has
    no model folder) and announces them to the apis, which fill them into requests that leave them unset."""
    model_dir = tmp_path / "model"  # no tokenizer files: token ids only, a quick start
    model_dir.mkdir()
    (model_dir / "generation_config.json").write_text(msgspec.json.encode(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0, "repetition_penalty": 1.1,
         "max_new_tokens": 512, "do_sample": True, "eos_token_id": [1, 2], "length_penalty": None}).decode())
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.3}')
    expected = [((), {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0, "repetition_penalty": 1.1,
                      "max_tokens": 512}),
                (("--generation-config", "vllm"), {}),
                (("--generation-config", str(other)), {"temperature": 0.3}),
                # vLLM's --override-generation-config, over the file (null unsets a key)
                (("--override-generation-config", '{"temperature": 0.2, "top_k": null}'),
                 {"temperature": 0.2, "top_p": 0.95, "min_p": 0, "repetition_penalty": 1.1, "max_tokens": 512})]
    harnesses: list[Harness] = []
    try:
        for args, _ in expected:  # the four processes start at once (each its own sockets), then each is asked
            harnesses.append(Harness(model_dir, *args))
        for harness, (args, defaults) in zip(harnesses, expected, strict=True):
            hello = harness.expect_api(lambda m: isinstance(m, TokenizerHello), STARTUP_TIMEOUT, "hello")
            assert hello.sampling_defaults == defaults, args
    finally:
        for harness in harnesses:
            harness.close()


def test_the_default_max_tokens_is_capped_by_the_context_the_prompt_leaves() -> None:
    """A chat request without max_tokens gets the generation config's max_new_tokens, capped by the context after
    its prompt (vLLM's): a default never turns a prompt that fits into a refused one. A value the client sent is
    kept (and checked against the context as sent); min_tokens above the capped default is refused, naming it."""
    from pagoda.services.tokenizer.generation_config import with_default_max_tokens
    from pagoda.shared.errors import InvalidRequestError

    defaults: dict[str, float | int] = {"temperature": 0.6, "max_tokens": 512}
    unset = SamplingParams(max_tokens=None)
    assert with_default_max_tokens(unset, defaults, 100, 4096).max_tokens == 512
    assert with_default_max_tokens(unset, defaults, 4000, 4096).max_tokens == 96  # the room after the prompt
    assert with_default_max_tokens(SamplingParams(max_tokens=700), defaults, 100, 4096).max_tokens == 700
    assert with_default_max_tokens(unset, {"temperature": 0.6}, 100, 4096).max_tokens is None
    with pytest.raises(InvalidRequestError) as refused:
        with_default_max_tokens(SamplingParams(max_tokens=None, min_tokens=200), defaults, 4000, 4096)
    assert refused.value.param == "min_tokens"


def test_a_chat_request_without_max_tokens_reaches_the_scheduler_with_the_capped_default(tmp_path: Path) -> None:
    """Through the tokenizer process: the generation config's max_new_tokens (512) for a request that left
    max_tokens unset, capped at the room a 60-token context leaves after 3 prompt tokens."""
    model_dir = tmp_path / "model"  # no tokenizer files: token ids only, a quick start
    model_dir.mkdir()
    (model_dir / "generation_config.json").write_text('{"max_new_tokens": 512}')
    harness = Harness(model_dir)
    try:
        harness.start(ModelInfo(max_model_len=60, vocab_size=1000, max_num_tokens=64, eos_token_ids=[0]))
        _, _, added = harness.generate(SamplingParams(max_tokens=None), prompt_token_ids=[1, 2, 3])
        assert added.params.max_tokens == 57
        _, _, added = harness.generate(SamplingParams(max_tokens=5), prompt_token_ids=[1, 2, 3])
        assert added.params.max_tokens == 5
    finally:
        harness.close()


def test_a_generation_config_folder_without_the_file_stops_the_tokenizer(tmp_path: Path) -> None:
    harness = Harness(tmp_path, "--generation-config", str(tmp_path / "missing"))
    try:
        assert harness.proc.wait(timeout=STARTUP_TIMEOUT) == 2
        assert "(generation_config)" in harness.log_tail()
    finally:
        harness.close()
