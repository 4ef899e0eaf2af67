"""The tokenizer process: prompts become token ids for the scheduler, token ids become text for the apis."""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from pagoda.services.tokenizer.offload import OFFLOAD_MIN_CHARS, OFFLOAD_MIN_TOKENS, Offloader
from pagoda.services.tokenizer.output import advance
from pagoda.services.tokenizer.render import PromptRenderer
from pagoda.services.tokenizer.replicas import Replica, ReplicaSet
from pagoda.services.tokenizer.structured import LazyGrammarChecker, constrain_after_reasoning
from pagoda.services.tokenizer.text_stream import TextStream
from pagoda.services.tokenizer.tokenizer import Tokenizer, load_tokenizer
from pagoda.services.tokenizer.tools import tool_conversation
from pagoda.shared.config import EngineConfig, ServerConfig
from pagoda.shared.errors import (
    ConfigError,
    ContextLengthError,
    InvalidRequestError,
    PagodaError,
    ServerOverloadedError,
)
from pagoda.shared.messages import (
    AbortRequest,
    Accepted,
    AddRequest,
    ApiToTokenizer,
    ChatMessage,
    DetokenizeRequest,
    DetokenizeResult,
    Directory,
    FinishReason,
    GenerateRequest,
    Heartbeat,
    ModelInfo,
    PositionLogprobs,
    PromptScores,
    RenderedRows,
    ReplicaAddress,
    RequestFailed,
    SamplingParams,
    SchedulerToTokenizer,
    StopSequence,
    TextDelta,
    TextDeltas,
    TokenDeltas,
    TokenizeRequest,
    TokenizeResult,
    TokenizerHello,
    TokenizerToApi,
    TokenizerToScheduler,
    TokenLogprob,
)
from pagoda.shared.transport import Codec, load_cluster_keys, make_socket, single_frame

log = logging.getLogger(__name__)

MAX_POLL_S = 0.1  # timers (heartbeats, liveness, shutdown) are looked at least this often
MAX_DRAIN = 512  # messages taken from one socket before the other sockets get a turn
CLOSE_LINGER_MS = 500  # the last answers (503s on shutdown) get this long to leave
SCHEDULER_UNAVAILABLE = "the scheduler is not available; try again later"
API_HELLO_EVERY = 4  # heartbeats to the apis per hello (registration) sent in their place


def tokenizer_endpoints(config: ServerConfig) -> tuple[list[str], list[str]]:
    """The api addresses and every replica's scheduler address known at start. With a registry: the registry's
    scheduler only; the apis and the other replicas come in its Directory (shared/discovery.py)."""
    apis = config.api_endpoint_list()
    if config.registry_endpoint:
        return apis, [config.registry_endpoint]
    if not apis:
        raise ConfigError("no api endpoint to connect to", param="api_endpoints")
    return apis, config.replica_endpoint_list("scheduler")


def stats_endpoints(config: ServerConfig, num_replicas: int) -> list[str]:
    """Every replica's stats address, needed only to route by prefix across several replicas."""
    if config.registry_endpoint:
        return []  # from the registry's Directory
    return config.replica_endpoint_list("stats") if config.routing == "prefix" and num_replicas > 1 else []


# --------------------------------------------------------------------------------------------
# prompts: pure functions of a request, the tokenizer and the model's limits


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # the text the ids came from (None for token-id prompts)
    param: str  # the request field errors about this prompt name


def chat_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                                "arguments": c.arguments}}
                                   for c in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def tokenize_prompt(tokenizer: Tokenizer | None, *, prompt_text: str | None, prompt_token_ids: list[int] | None,
                    messages: list[ChatMessage] | None, add_special_tokens: bool = True,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> Prompt:
    """Token ids of whichever prompt field is set; InvalidRequestError names the field at fault."""
    if sum(field is not None for field in (prompt_text, prompt_token_ids, messages)) != 1:
        raise InvalidRequestError("exactly one of a prompt, prompt token ids or messages must be given",
                                  param="prompt")
    if prompt_token_ids is not None:
        return Prompt(list(prompt_token_ids), None, "prompt")
    param = "messages" if messages is not None else "prompt"
    if tokenizer is None:
        raise InvalidRequestError(f"this model has no tokenizer: send the prompt as token ids, not {param}",
                                  param=param)
    try:
        if messages is not None:
            # render_chat + encode is Tokenizer.apply_chat_template, keeping the text for echo.
            conversation, tools = tool_conversation(tokenizer.hf.chat_template, chat_dicts(messages), tools)
            text = tokenizer.render_chat(conversation, add_generation_prompt, tools=tools,
                                         continue_final_message=continue_final_message,
                                         chat_template_kwargs=chat_template_kwargs)
            return Prompt(tokenizer.encode(text, add_special_tokens=False), text, param)
        assert prompt_text is not None
        return Prompt(tokenizer.encode(prompt_text, add_special_tokens=add_special_tokens), prompt_text, param)
    except PagodaError:
        raise
    except Exception as exc:
        # A template or tokenizer that raises is the request's problem, never the process's.
        raise InvalidRequestError(f"cannot tokenize the {param}: {exc}", param=param) from exc


def check_prompt(token_ids: list[int], params: SamplingParams, info: ModelInfo, param: str) -> None:
    """Raise InvalidRequestError unless the scheduler can run this prompt with these params."""
    if not token_ids:
        raise InvalidRequestError(f"the {param} is empty", param=param)
    if min(token_ids) < 0 or max(token_ids) >= info.vocab_size:
        bad = next(t for t in token_ids if not 0 <= t < info.vocab_size)
        raise InvalidRequestError(f"token id {bad} is out of range [0, {info.vocab_size})", param=param)
    # At least one token must be generated, in the context and in the KV cache.
    max_prompt_len = min(info.max_model_len, info.max_num_tokens) - 1
    num_tokens = len(token_ids)
    if num_tokens > max_prompt_len:
        raise ContextLengthError(f"the {param} has {num_tokens} tokens; this model accepts at most "
                                 f"{max_prompt_len} prompt tokens", param=param)
    if params.max_tokens is not None and num_tokens + params.max_tokens > info.max_model_len:
        raise ContextLengthError(f"this model's maximum context length is {info.max_model_len} tokens, but "
                                 f"{num_tokens} prompt tokens plus max_tokens={params.max_tokens} exceed it",
                                 param="max_tokens")
    if any(t >= info.vocab_size for t in params.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids must be < {info.vocab_size}", param="stop_token_ids")
    if any(t >= info.vocab_size for t in params.logit_bias):
        raise InvalidRequestError(f"logit_bias token ids must be < {info.vocab_size}", param="logit_bias")


def _prompt_chars(prompt_text: str | None, messages: list[ChatMessage] | None) -> int:
    """Characters to tokenize: what decides whether the work moves off the loop."""
    return len(prompt_text or "") + sum(len(m.content) for m in messages or [])


def request_failed(request_id: str, error: PagodaError) -> RequestFailed:
    return RequestFailed(request_id, error.http_status, error.message, error.error_type, error.param, error.code)


# --------------------------------------------------------------------------------------------
# the process


@dataclass(slots=True)
class RequestState:
    api: int  # index of the owning api's socket
    params: SamplingParams
    streams: list[TextStream | None]  # one per completion; None once that completion finished
    num_unfinished: int
    first_prompt_token: int = -1  # prompt_logprobs: listed first (no logprob) with completion 0's first delta
    return_token_ids: bool = False  # deltas carry their token ids (asked for, or no tokenizer to make text)
    renderer: PromptRenderer | None = None  # the api asked for bytes (RenderedRows), not TextDeltas


@dataclass(slots=True)
class RowColumns:
    """RenderedRows being built for one api."""

    request_ids: list[str] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    finish_reasons: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)
    data: list[bytes] = field(default_factory=list)

    def add(self, delta: TextDelta, data: bytes) -> None:
        self.request_ids.append(delta.request_id)
        self.indices.append(delta.index)
        self.num_new_tokens.append(delta.num_new_tokens)
        self.finish_reasons.append(delta.finish_reason)
        self.num_cached_tokens.append(delta.num_cached_tokens)
        self.data.append(data)

    def message(self) -> RenderedRows:
        return RenderedRows(self.request_ids, self.indices, self.num_new_tokens, self.finish_reasons,
                            self.num_cached_tokens, self.data)


@dataclass(slots=True)
class Waiting:
    """A request that needs ModelInfo, which the scheduler has not sent (yet, or again)."""

    api: int
    message: GenerateRequest | TokenizeRequest
    received_at: float  # time.monotonic()


class TokenizerService:
    """One tokenizer process: a DEALER per api and one to the scheduler, served by one poll loop."""

    def __init__(self, server_config: ServerConfig, tokenizer: Tokenizer | None,
                 context: zmq.Context | None = None, block_size: int = 16) -> None:
        # A random part: a restarted container has the same host name and often the same pid, and its
        # peers must not mistake it for the process that owned the requests they still wait on.
        self.tokenizer_id = server_config.tokenizer_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._tokenizer = tokenizer
        self._interval = server_config.heartbeat_interval
        self._timeout = server_config.heartbeat_timeout
        self._max_waiting = server_config.max_inflight_requests
        api_endpoints, scheduler_endpoints = tokenizer_endpoints(server_config)
        self._own_context = context is None
        self._context = context or zmq.Context()
        identity = self.tokenizer_id.encode()
        # api key -> its socket; keys never reuse (apis from the registry come and go)
        self._apis = {index: make_socket(self._context, zmq.DEALER, endpoint, bind=False, identity=identity)
                      for index, endpoint in enumerate(api_endpoints)}
        self._api_address = dict(enumerate(api_endpoints))
        self._fixed_apis = frozenset(self._apis)  # given in the settings: never forgotten
        self._next_api = len(self._apis)
        self._replicas = ReplicaSet.connect(self._context, scheduler_endpoints,
                                            stats_endpoints(server_config, len(scheduler_endpoints)), identity,
                                            server_config.routing, block_size, self._timeout,
                                            discover=bool(server_config.registry_endpoint))
        self._api_in: Codec[ApiToTokenizer] = Codec(ApiToTokenizer)
        self._api_out: Codec[TokenizerToApi] = Codec(TokenizerToApi)
        self._scheduler_in: Codec[SchedulerToTokenizer] = Codec(SchedulerToTokenizer)
        self._scheduler_out: Codec[TokenizerToScheduler] = Codec(TokenizerToScheduler)
        self._poller = zmq.Poller()
        self._handlers: dict[zmq.Socket, Callable[[Any], None]] = {}
        for replica in self._replicas.replicas:
            self._handlers[replica.sock] = lambda frame, i=replica.index: self._on_scheduler_frame(frame, i)
            if replica.stats_sock is not None:
                self._handlers[replica.stats_sock] = lambda frame, i=replica.index: self._replicas.on_stats(i, frame)
        for index, sock in self._apis.items():
            self._handlers[sock] = lambda frame, index=index: self._on_api_frame(index, frame)
        for sock in self._handlers:
            self._poller.register(sock, zmq.POLLIN)
        self._offload = Offloader()  # large prompts tokenize on a thread: heartbeats keep going meanwhile
        self._tokenizing: dict[str, int] = {}  # request id -> owning api, while its work runs on a thread
        self._poller.register(self._offload.fd, zmq.POLLIN)

        self._requests: dict[str, RequestState] = {}
        self._waiting: deque[Waiting] = deque()
        self._model_info: ModelInfo | None = None
        self._next_heartbeat = 0.0
        self._num_beats = 0
        self._token_texts: dict[int, tuple[str, list[int]]] = {}  # token id -> (its string, its bytes)
        self._grammars = LazyGrammarChecker(tokenizer)  # builds llguidance's tokenizer now, before registration
        self._reasoning_parser = server_config.reasoning_parser
        self._stopping = False
        log.info("tokenizer %s: apis %s, schedulers %s, %s", self.tokenizer_id, api_endpoints, scheduler_endpoints,
                 f"tokenizer {tokenizer.path}" if tokenizer is not None else "no tokenizer (token ids only)")

    # ---------------------------------------------------------------- loop

    def run(self) -> None:
        hello = self._hello()
        for api in self._apis:
            self._send_api(api, hello)
        self._send_scheduler(hello)
        self._next_heartbeat = time.monotonic() + self._interval
        try:
            while not self._stopping:
                self._poll_once()
                self._tick(time.monotonic())
        finally:
            self._shutdown()

    def _hello(self) -> TokenizerHello:
        """Registration; it carries the tokenizer's EOS id: the worker loads no tokenizer to learn it."""
        eos = self._tokenizer.eos_token_id if self._tokenizer is not None else None
        return TokenizerHello(self.tokenizer_id, os.getpid(), [eos] if eos is not None else [])

    def stop(self) -> None:
        """Ask the loop to end (from a signal handler): it does within MAX_POLL_S."""
        self._stopping = True

    def _poll_once(self) -> None:
        timeout_s = min(MAX_POLL_S, max(0.0, self._next_heartbeat - time.monotonic()))
        for sock, _ in self._poller.poll(timeout_s * 1000):
            if sock == self._offload.fd:
                self._offload.drain()
                continue
            handle = self._handlers[sock]
            for _ in range(MAX_DRAIN):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                frame = single_frame(frames)
                if frame is not None:
                    handle(frame)

    def _tick(self, now: float) -> None:
        if now >= self._next_heartbeat:
            self._send_heartbeats()
            self._next_heartbeat = now + self._interval
        for replica in self._replicas.replicas:
            if replica.heard_at is not None and now - replica.heard_at > self._timeout:
                self._lose_scheduler(f"the scheduler has not answered for {self._timeout:g} s", replica.index)
        while self._waiting and now - self._waiting[0].received_at > self._timeout:
            waiting = self._waiting.popleft()
            self._fail(waiting.api, waiting.message.request_id,
                       ServerOverloadedError(SCHEDULER_UNAVAILABLE))

    def _send_heartbeats(self) -> None:
        beat = Heartbeat(self.tokenizer_id,
                         num_inflight=len(self._requests) + len(self._waiting) + len(self._tokenizing))
        # Every API_HELLO_EVERY-th beat is a hello: an api registers tokenizers only on their hello, and one
        # that restarted (or dropped this process as silent) takes it back on the next.
        self._num_beats += 1
        hello = self._num_beats % API_HELLO_EVERY == 0
        data = self._api_out.encode(self._hello() if hello else beat)
        for sock in self._apis.values():
            _send(sock, data)
        # Until ModelInfo comes, hello again: a scheduler that restarted, or was not listening yet,
        # only registers a tokenizer on its hello (it answers each with ModelInfo, so repeats are harmless).
        hello_data = self._scheduler_out.encode(self._hello())
        beat_data = self._scheduler_out.encode(beat)
        for replica in self._replicas.replicas:
            _send(replica.sock, beat_data if replica.model_info is not None else hello_data)
        self._replicas.prune(self._requests)

    def _shutdown(self) -> None:
        self._fail_all(ServerOverloadedError("the server is shutting down"))
        self._offload.close()
        for sock in self._handlers:
            sock.close(linger=CLOSE_LINGER_MS)  # the replicas' sockets are among them
        if self._own_context:
            self._context.term()
        log.info("tokenizer %s stopped", self.tokenizer_id)

    # ---------------------------------------------------------------- api -> tokenizer

    def _on_api_frame(self, api: int, frame: Any) -> None:
        message = self._api_in.decode(frame)
        if message is not None:
            self._dispatch_api(api, message)

    def _dispatch_api(self, api: int, message: ApiToTokenizer) -> None:
        try:
            if isinstance(message, GenerateRequest | TokenizeRequest):
                if self._model_info is None:
                    self._wait_for_model_info(api, message)
                elif isinstance(message, GenerateRequest):
                    self._on_generate(api, message, self._model_info)
                else:
                    self._on_tokenize(api, message, self._model_info)
            elif isinstance(message, AbortRequest):
                self._on_abort(message.request_id)
            elif isinstance(message, DetokenizeRequest):
                self._on_detokenize(api, message)
            else:
                log.warning("dropped an unexpected %s from api %d", type(message).__name__, api)
        except Exception:
            # A bug must cost one request, not the process.
            log.exception("failed on %s %s", type(message).__name__, message.request_id)
            self._drop(message.request_id, abort=True)
            self._fail(api, message.request_id, PagodaError("internal error in the tokenizer"))

    def _wait_for_model_info(self, api: int, message: GenerateRequest | TokenizeRequest) -> None:
        if len(self._waiting) >= self._max_waiting:
            self._fail(api, message.request_id, ServerOverloadedError(SCHEDULER_UNAVAILABLE))
            return
        self._waiting.append(Waiting(api, message, time.monotonic()))

    def _on_generate(self, api: int, request: GenerateRequest, info: ModelInfo) -> None:
        request_id = request.request_id
        if request_id in self._requests or request_id in self._tokenizing:
            self._fail(api, request_id, InvalidRequestError(f"request id {request_id!r} is already in flight"))
            return
        # The api validated the params (SamplingParams.validate, at the edge); what it cannot know, the prompt's
        # length against the context and token ids against the vocabulary, check_prompt checks below, and the
        # scheduler re-checks only the invariants it relies on.
        def tokenize() -> Prompt:
            return tokenize_prompt(
                self._tokenizer, prompt_text=request.prompt_text, prompt_token_ids=request.prompt_token_ids,
                messages=request.messages, add_special_tokens=request.add_special_tokens,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs, tools=request.tools or None)

        self._work(api, request_id, tokenize, _prompt_chars(request.prompt_text, request.messages),
                   lambda prompt: self._admit(api, request, prompt))

    def _work(self, api: int, request_id: str, job: Callable[[], Any], size: int,
              finish: Callable[[Any], None]) -> None:
        """finish(job()) now, or on a thread for a large input (the loop goes on; finish runs on it later).
        A PagodaError from either fails the request; any other error fails it as an internal one."""
        if size < OFFLOAD_MIN_CHARS:
            try:
                finish(job())
            except PagodaError as exc:
                self._fail(api, request_id, exc)
            return
        if self._offload.full():
            self._fail(api, request_id, ServerOverloadedError("too many large prompts are being tokenized"))
            return
        self._tokenizing[request_id] = api

        def done(value: Any, failed: bool) -> None:
            if self._tokenizing.pop(request_id, None) is None:
                return  # failed meanwhile (scheduler lost, shutdown)
            try:
                if failed:
                    raise value
                finish(value)
            except PagodaError as exc:
                self._fail(api, request_id, exc)
            except Exception:
                log.exception("failed on the large input of %s", request_id)
                self._fail(api, request_id, PagodaError("internal error in the tokenizer"))

        self._offload.submit(request_id, job, done)

    def _admit(self, api: int, request: GenerateRequest, prompt: Prompt) -> None:
        """A tokenized prompt that fits goes to the scheduler; the api hears Accepted."""
        request_id, params = request.request_id, request.params
        info = self._model_info
        if info is None:  # the scheduler went away while a thread tokenized
            raise ServerOverloadedError(SCHEDULER_UNAVAILABLE)
        check_prompt(prompt.token_ids, params, info, prompt.param)
        if params.structured_outputs is not None:
            params = self._check_structured(params, prompt, info, request.messages is not None)
        streams: list[TextStream | None] = [TextStream(self._tokenizer, prompt.token_ids, params)
                                            for _ in range(params.n)]
        first_token = prompt.token_ids[0] if params.prompt_logprobs is not None else -1
        replica = self._replicas.route(request_id, prompt.token_ids)  # raises (503) when none is live
        echo = self._prompt_text(prompt, params) if request.return_prompt_text else None
        renderer = (PromptRenderer(request.render, params.n, echo or "", prompt.token_ids)
                    if request.render is not None else None)
        self._requests[request_id] = RequestState(api, params, streams, params.n, first_token,
                                                  request.return_token_ids or self._tokenizer is None, renderer)
        _send(replica.sock, self._scheduler_out.encode(AddRequest(
            request_id, prompt.token_ids, params, request.priority, request.arrival_time, request.tenant,
            request.tenant_weight, request.tenant_priority)))
        self._send_api(api, Accepted(request_id, len(prompt.token_ids), echo,
                                     prompt.token_ids if request.return_token_ids else [],
                                     renderer.opening() if renderer is not None else b""))

    def _check_structured(self, params: SamplingParams, prompt: Prompt, info: ModelInfo,
                          is_chat: bool) -> SamplingParams:
        """Compile the grammar here (cached), never on the worker's step loop; 400 if the library rejects it."""
        assert params.structured_outputs is not None
        self._grammars.check(params.structured_outputs)
        if is_chat and self._reasoning_parser is not None:
            return constrain_after_reasoning(params, prompt.text or "")
        return params

    def _prompt_text(self, prompt: Prompt, params: SamplingParams) -> str | None:
        if prompt.text is not None or self._tokenizer is None:
            return prompt.text
        # Special tokens kept: echo's text must be what its prompt tokens (logprobs.tokens) join to.
        return self._tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    def _on_abort(self, request_id: str) -> None:
        if self._tokenizing.pop(request_id, None) is not None:
            self._offload.cancel(request_id)
        elif request_id in self._requests:
            self._drop(request_id, abort=True)
        elif self._waiting:
            self._waiting = deque(w for w in self._waiting if w.message.request_id != request_id)
        # Otherwise it already finished or failed here; its last deltas crossed the abort.

    def _on_tokenize(self, api: int, request: TokenizeRequest, info: ModelInfo) -> None:
        def tokenize() -> TokenizeResult:
            prompt = tokenize_prompt(self._tokenizer, prompt_text=request.prompt_text, prompt_token_ids=None,
                                     messages=request.messages, add_special_tokens=request.add_special_tokens,
                                     add_generation_prompt=request.add_generation_prompt,
                                     continue_final_message=request.continue_final_message)
            token_strs = ([self._token_str(t) for t in prompt.token_ids]
                          if request.return_token_strs and self._tokenizer is not None else [])
            return TokenizeResult(request.request_id, prompt.token_ids, info.max_model_len, token_strs)

        self._work(api, request.request_id, tokenize, _prompt_chars(request.prompt_text, request.messages),
                   lambda result: self._send_api(api, result))

    def _token_str(self, token_id: int) -> str:
        """The vocabulary entry of a token, as vLLM's return_token_strs lists it (byte-level pieces as is)."""
        assert self._tokenizer is not None
        piece = self._tokenizer.hf.convert_ids_to_tokens(token_id)
        return piece if isinstance(piece, str) else ""

    def _on_detokenize(self, api: int, request: DetokenizeRequest) -> None:
        if self._tokenizer is None:
            self._fail(api, request.request_id, InvalidRequestError("this model has no tokenizer", param="tokens"))
            return
        vocab_size = self._model_info.vocab_size if self._model_info is not None else self._tokenizer.vocab_size
        bad = next((t for t in request.token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            self._fail(api, request.request_id,
                       InvalidRequestError(f"token id {bad} is out of range [0, {vocab_size})", param="tokens"))
            return
        tokenizer = self._tokenizer

        def decode() -> str:
            try:
                return tokenizer.decode(request.token_ids, skip_special_tokens=False)
            except Exception as exc:
                raise InvalidRequestError(f"cannot decode: {exc}", param="tokens") from exc

        size = OFFLOAD_MIN_CHARS if len(request.token_ids) >= OFFLOAD_MIN_TOKENS else 0
        self._work(api, request.request_id, decode, size,
                   lambda text: self._send_api(api, DetokenizeResult(request.request_id, text)))

    # ---------------------------------------------------------------- scheduler -> tokenizer

    def _on_scheduler_frame(self, frame: Any, replica: int = 0) -> None:
        message = self._scheduler_in.decode(frame)
        if message is None:
            return
        self._heard_from_scheduler(message, replica)
        if isinstance(message, TokenDeltas):
            self._on_token_deltas(message)
        elif isinstance(message, ModelInfo):
            self._on_model_info(message, replica)
        elif isinstance(message, RequestFailed):
            state = self._requests.pop(message.request_id, None)
            if state is not None:
                self._send_api(state.api, message)
        elif isinstance(message, Directory):
            self._on_directory(message, replica)
        elif not isinstance(message, Heartbeat):
            log.warning("dropped an unexpected %s from the scheduler", type(message).__name__)

    def _heard_from_scheduler(self, message: SchedulerToTokenizer, index: int = 0) -> None:
        replica = self._replicas.replicas[index]
        if isinstance(message, Heartbeat):
            if replica.sender is not None and message.sender != replica.sender:
                self._lose_scheduler(f"the scheduler restarted ({replica.sender} -> {message.sender})", index)
            replica.sender = message.sender
        if replica.lost:
            log.info("scheduler %d is back: registering again", index)
            replica.lost = False
            _send(replica.sock, self._scheduler_out.encode(self._hello()))
        replica.heard_at = time.monotonic()

    # ---------------------------------------------------------------- discovery (shared/discovery.py)

    def _on_directory(self, directory: Directory, index: int) -> None:
        """The registry's live apis and replicas: connect to new ones; an api it no longer lists is gone."""
        registry = self._replicas.replicas[index]
        registry.replica_id = str(directory.registry_replica_id)
        for entry in directory.replicas:
            self._watch_replica(entry, registry)
        listed = set(directory.apis)
        for address in sorted(listed - set(self._api_address.values())):
            self._add_api(address)
        for api, address in list(self._api_address.items()):
            if address not in listed and api not in self._fixed_apis:
                self._remove_api(api)

    def _watch_replica(self, entry: ReplicaAddress, registry: Replica) -> None:
        replica_id = str(entry.replica_id)
        if replica_id == registry.replica_id:
            self._watch_stats(registry, entry.stats)
            return
        known = self._replicas.find(replica_id)
        if known is not None and known.address == entry.scheduler:
            return  # a restart at the same address: its new heartbeats' sender makes us register again
        if known is not None:  # it moved: whatever it held is lost, the old address is dropped
            self._lose_scheduler(f"it moved to {entry.scheduler}", known.index)
            known.replica_id = f"{replica_id}@{known.address}"  # out of routing's way; stays lost
        replica = self._replicas.add(replica_id, entry.scheduler, None)
        log.info("replica %s found at %s", replica_id, entry.scheduler)
        self._handlers[replica.sock] = lambda frame, i=replica.index: self._on_scheduler_frame(frame, i)
        self._poller.register(replica.sock, zmq.POLLIN)
        self._watch_stats(replica, entry.stats)
        _send(replica.sock, self._scheduler_out.encode(TokenizerHello(self.tokenizer_id, os.getpid())))

    def _watch_stats(self, replica: Replica, stats: str) -> None:
        if replica.stats_sock is not None or not self._replicas.use_stats:
            return
        self._replicas.watch_stats(replica, stats)
        self._handlers[replica.stats_sock] = lambda frame, i=replica.index: self._replicas.on_stats(i, frame)
        self._poller.register(replica.stats_sock, zmq.POLLIN)

    def _add_api(self, address: str) -> None:
        api, self._next_api = self._next_api, self._next_api + 1
        sock = make_socket(self._context, zmq.DEALER, address, bind=False, identity=self.tokenizer_id.encode())
        self._apis[api], self._api_address[api] = sock, address
        self._handlers[sock] = lambda frame, index=api: self._on_api_frame(index, frame)
        self._poller.register(sock, zmq.POLLIN)
        log.info("api %s found", address)
        self._send_api(api, TokenizerHello(self.tokenizer_id, os.getpid()))

    def _remove_api(self, api: int) -> None:
        """The registry forgot this api: its clients are gone with it, so its requests are aborted."""
        sock, address = self._apis.pop(api), self._api_address.pop(api)
        self._poller.unregister(sock)
        del self._handlers[sock]
        sock.close(linger=0)
        orphans = [request_id for request_id, state in self._requests.items() if state.api == api]
        log.warning("api %s is gone: aborting its %d request(s)", address, len(orphans))
        for request_id in orphans:
            self._drop(request_id, abort=True)

    def _on_model_info(self, info: ModelInfo, index: int = 0) -> None:
        replica = self._replicas.replicas[index]
        if info != replica.model_info:
            log.info("registered with scheduler %d: %s", index, info)
        replica.model_info = info
        self._model_info = info
        waiting, self._waiting = self._waiting, deque()
        for entry in waiting:
            self._dispatch_api(entry.api, entry.message)

    def _lose_scheduler(self, reason: str, index: int = 0) -> None:
        """Fail what is in flight on that replica; new requests go to the others, or wait for one to register
        this process again when none is left."""
        replica = self._replicas.replicas[index]
        replica.model_info, replica.heard_at, replica.lost = None, None, True
        if len(self._replicas.replicas) > 1:
            reason = f"replica {index}: {reason}"
        self._model_info = self._replicas.model_info()
        if self._model_info is None:
            log.warning("%s: failing %d in-flight requests", reason, len(self._requests))
            self._fail_all(ServerOverloadedError(reason))
            return
        owned = [rid for rid in self._replicas.owned_by(index) if rid in self._requests]
        log.warning("%s: failing its %d in-flight requests", reason, len(owned))
        for request_id in owned:
            state = self._requests.pop(request_id)
            self._fail(state.api, request_id, ServerOverloadedError(reason))
            _send(replica.sock, self._scheduler_out.encode(AbortRequest(request_id)))  # it may only be slow

    def _on_token_deltas(self, message: TokenDeltas) -> None:
        """One step's columns in, one TextDeltas per api out (a step carries up to max_num_seqs rows)."""
        if not message.columns_agree():
            log.error("dropped a TokenDeltas frame whose columns disagree (%d rows)", len(message))
            return
        outgoing: dict[int, list[TextDelta]] = {}  # requests that take text (TextDeltas), by api
        rendered: dict[int, RowColumns] = {}  # requests that take bytes (RenderedRows), by api
        requests = self._requests
        lp_at = {row: i for i, row in enumerate(message.logprob_rows)} if message.logprob_rows else None
        scores_at = {s.req_id: s for s in message.prompt_scores} if message.prompt_scores else None
        for row, (request_id, index, token_id, reason) in enumerate(zip(
                message.request_ids, message.indices, message.token_ids, message.finish_reasons, strict=True)):
            state = requests.get(request_id)
            if state is None:
                continue  # aborted or failed here: these tokens were already on their way
            try:
                text_delta = self._text_delta(state, request_id, index, token_id, reason,
                                              message.num_cached_tokens[row],
                                              self._row_logprobs(message, lp_at, row, token_id)
                                              if lp_at is not None else None,
                                              scores_at.get(row) if scores_at is not None else None)
                if text_delta is None:
                    continue
                renderer = state.renderer
                if renderer is not None:
                    data = renderer.render(text_delta)
                    columns = rendered.get(state.api)
                    if columns is None:
                        columns = rendered[state.api] = RowColumns()
                    columns.add(text_delta, data)
                    continue
            except Exception:
                log.exception("failed on the tokens of %s", request_id)
                self._drop(request_id, abort=True)
                self._fail(state.api, request_id, PagodaError("internal error in the tokenizer"))
                continue
            out = outgoing.get(state.api)
            if out is None:
                out = outgoing[state.api] = []
            out.append(text_delta)
        for api, columns in rendered.items():
            self._send_api(api, columns.message())
        for api, deltas in outgoing.items():
            self._send_api(api, TextDeltas(deltas))

    def _row_logprobs(self, message: TokenDeltas, lp_at: dict[int, int] | None, row: int,
                      token_id: int) -> PositionLogprobs | None:
        if lp_at is None or token_id < 0:
            return None
        i = lp_at.get(row)
        if i is None:
            return None
        top = [self._token_logprob(t, lp) for t, lp in zip(message.top_token_ids[i], message.top_logprobs[i],
                                                            strict=False)]
        return PositionLogprobs(self._token_logprob(token_id, message.logprobs[i]), top)

    def _text_delta(self, state: RequestState, request_id: str, index: int, token_id: int, reason: int,
                    num_cached_tokens: int, logprob: PositionLogprobs | None,
                    scores: PromptScores | None) -> TextDelta | None:
        """The text one completion gained; finishes it (and tells the scheduler) on a stop string."""
        if not 0 <= index < len(state.streams):
            log.warning("dropped tokens for completion %d of %s (n=%d)", index, request_id, len(state.streams))
            return None
        stream = state.streams[index]
        if stream is None:
            return None  # a stop string finished it here; tokens sampled before the scheduler knew are dropped
        prompt_logprobs = self._prompt_logprobs(state, index, scores)
        if token_id < 0 and reason < 0:
            return TextDelta(request_id, index, "", 0, prompt_logprobs=prompt_logprobs) if prompt_logprobs else None
        token_ids = [token_id] if token_id >= 0 else []
        step = advance(stream, token_id, reason)
        if step.stop_string:
            self._send_scheduler(StopSequence(request_id, index))
        if step.finish_reason >= 0:
            self._finish_completion(state, request_id, index)
        stop_token = reason == FinishReason.STOP and token_id >= 0
        logprobs = [logprob] if logprob is not None and state.params.logprobs is not None and not stop_token else []
        shown_ids = token_ids if state.return_token_ids and not stop_token else []
        return TextDelta(request_id, index, step.text, len(token_ids), step.finish_reason, logprobs,
                         num_cached_tokens, stream.stop_reason, prompt_logprobs, shown_ids)

    def _finish_completion(self, state: RequestState, request_id: str, index: int) -> None:
        state.streams[index] = None
        state.num_unfinished -= 1
        if state.num_unfinished == 0:
            del self._requests[request_id]

    def _prompt_logprobs(self, state: RequestState, index: int, scores: PromptScores | None) -> list[PositionLogprobs]:
        """Scored prompt tokens. The prompt's first token, which nothing scores, leads completion 0's first
        delta (scores come before or with a completion's first token; a 1-token prompt has none)."""
        lead = []
        if state.first_prompt_token >= 0 and index == 0:
            lead = [PositionLogprobs(self._token_logprob(state.first_prompt_token, None), [])]
            state.first_prompt_token = -1
        if scores is None:
            return lead
        return lead + [PositionLogprobs(self._token_logprob(token_id, logprob),
                                 [self._token_logprob(t, lp) for t, lp in zip(top_ids, top_lps, strict=False)])
                for token_id, logprob, top_ids, top_lps in zip(scores.token_ids, scores.logprobs,
                                                               scores.top_token_ids, scores.top_logprobs,
                                                               strict=False)]

    def _token_logprob(self, token_id: int, logprob: float | None) -> TokenLogprob:
        cached = self._token_texts.get(token_id)
        if cached is None:
            if self._tokenizer is not None:
                token = self._tokenizer.decode([token_id], skip_special_tokens=False)
                raw = self._tokenizer.token_bytes(token_id)
            else:
                token = f"token_id:{token_id}"
                raw = token.encode("utf-8")
            cached = self._token_texts[token_id] = (token, list(raw))
        return TokenLogprob(cached[0], token_id, logprob, cached[1])

    # ---------------------------------------------------------------- sending

    def _drop(self, request_id: str, abort: bool) -> None:
        if self._requests.pop(request_id, None) is not None and abort:
            self._send_scheduler(AbortRequest(request_id))

    def _fail_all(self, error: PagodaError) -> None:
        """Every request here gets `error`; the scheduler is told to drop them (it may only be slow)."""
        for request_id, api in self._tokenizing.items():
            self._offload.cancel(request_id)
            self._fail(api, request_id, error)
        self._tokenizing.clear()
        for waiting in self._waiting:
            self._fail(waiting.api, waiting.message.request_id, error)
        self._waiting.clear()
        for request_id, state in self._requests.items():
            self._fail(state.api, request_id, error)
            self._send_scheduler(AbortRequest(request_id))
        self._requests.clear()

    def _fail(self, api: int, request_id: str, error: PagodaError) -> None:
        self._send_api(api, request_failed(request_id, error))

    def _send_api(self, api: int, message: Any) -> None:
        sock = self._apis.get(api)
        if sock is not None:  # else the api is gone (the registry forgot it), and its clients with it
            _send(sock, self._api_out.encode(message))

    def _send_scheduler(self, message: Any) -> None:
        """A request's abort or stop goes to the replica that owns it; anything else to every replica."""
        data = self._scheduler_out.encode(message)
        request_id = getattr(message, "request_id", None)
        owner = self._replicas.owner_of(request_id) if request_id is not None else None
        if owner is not None:
            _send(owner.sock, data)
            return
        if request_id is not None:
            return  # never routed (failed before it reached a replica): nobody to tell
        for replica in self._replicas.replicas:
            _send(replica.sock, data)


def _send(sock: zmq.Socket, data: bytes) -> None:
    # Never block the loop: with no high-water mark a DEALER queues while its peer is away.
    try:
        sock.send(data, zmq.NOBLOCK)
    except zmq.Again:
        log.warning("dropped an outgoing message of %d bytes: the socket cannot take it", len(data))


def run_tokenizer(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT; in-flight requests then get a 503."""
    load_cluster_keys(server_config.cluster_key_dir)
    # llguidance's tokenizer is built in the constructor (LazyGrammarChecker), before registration: the build holds
    # the GIL for seconds on a loaded host (3.4 s seen), and a tokenizer registered meanwhile would miss its
    # heartbeats and be dropped with its first requests.
    service = TokenizerService(server_config, load_tokenizer(engine_config), block_size=engine_config.block_size)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: service.stop())
    try:
        service.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
