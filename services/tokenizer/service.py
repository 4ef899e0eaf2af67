"""The tokenizer process: prompts become token ids for the scheduler, token ids become text for the apis."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from pagoda.services.grammar.compiler import (
    LazyGrammarChecker,
    constrain_after_reasoning,
    ending_ids,
    fast_forward_tokens,
)
from pagoda.services.protocol.reasoning import PROMPT_CLOSED, prompt_reasoning, thinking_budget
from pagoda.services.tokenizer.bad_words import with_bad_words_token_ids
from pagoda.services.tokenizer.directory import Peers
from pagoda.services.tokenizer.generation_config import sampling_defaults, with_default_max_tokens
from pagoda.services.tokenizer.offload import OFFLOAD_MIN_CHARS, OFFLOAD_MIN_TOKENS, Offloader
from pagoda.services.tokenizer.output import Outputs, RequestState
from pagoda.services.tokenizer.prompts import (
    Prompt,
    check_prompt,
    context_limit,
    detokenize_job,
    echo_text,
    generate_prompt,
    prompt_chars,
    tokenize_result,
    tokenizer_info,
)
from pagoda.services.tokenizer.replicas import Replica
from pagoda.services.tokenizer.text_stream import tokens_before_stop
from pagoda.services.tokenizer.tokenizer import Tokenizer, load_tokenizer
from pagoda.shared.config import EngineConfig, ServerConfig
from pagoda.shared.errors import InvalidRequestError, PagodaError, ServerOverloadedError
from pagoda.shared.heap import settle_heap
from pagoda.shared.messages import (
    AbortRequest,
    Accepted,
    Ack,
    AddRequest,
    ApiToTokenizer,
    DetokenizeRequest,
    DetokenizeResult,
    Directory,
    GenerateRequest,
    Heartbeat,
    ModelInfo,
    PromptRendered,
    RequestFailed,
    SamplingParams,
    SchedulerToTokenizer,
    Sequenced,
    StopSequence,
    TokenDeltas,
    TokenizeRequest,
    TokenizerHello,
    TokenizerInfoRequest,
    TokenizerInfoResult,
    TokenizerToApi,
    TokenizerToScheduler,
    resolve_vocabulary,
)
from pagoda.shared.service_main import run_service
from pagoda.shared.transport import Codec, ack_frame, drain, seal, send_nowait, single_frame, unseal

log = logging.getLogger(__name__)

MAX_POLL_S = 0.1  # timers (heartbeats, liveness, shutdown) are looked at least this often
LINK_POLL_S = 0.02  # ... and this often while a stream has something unacknowledged (an ack owed, a resend due)
MAX_DRAIN = 512  # messages taken from one socket before the other sockets get a turn
CLOSE_LINGER_MS = 500  # the last answers (503s on shutdown) get this long to leave
SCHEDULER_UNAVAILABLE = "the scheduler is not available; try again later"
API_HELLO_EVERY = 4  # heartbeats to the apis per hello (registration) sent in their place


def request_failed(request_id: str, error: PagodaError) -> RequestFailed:
    return RequestFailed(request_id, error.http_status, error.message, error.error_type, error.param, error.code)


def _renders_off_the_loop(request: GenerateRequest | TokenizeRequest) -> bool:
    """A large prompt, or a request's own chat template (--trust-request-chat-template): a template's loops cost
    what they will whatever the body's size (two nested range() calls in 90 bytes render for minutes), and on the
    loop they silenced the heartbeats until the api and the scheduler dropped this tokenizer with all it held."""
    return bool(request.chat_template) or prompt_chars(request.prompt_text, request.messages, request.tools,
                                                       request.documents) >= OFFLOAD_MIN_CHARS


@dataclass(slots=True)
class Waiting:
    """A request that needs ModelInfo, which the scheduler has not sent (yet, or again)."""

    api: int
    message: GenerateRequest | TokenizeRequest
    received_at: float  # time.monotonic()


class TokenizerService:
    """One tokenizer process: a DEALER per api and one to the scheduler, served by one poll loop."""

    def __init__(self, server_config: ServerConfig, tokenizer: Tokenizer | None,
                 context: zmq.Context | None = None, block_size: int = 16, fast_forward: bool = True,
                 sampling_defaults: dict[str, float | int] | None = None) -> None:
        # A random part: a restarted container has the same host name and often the same pid, and its
        # peers must not mistake it for the process that owned the requests they still wait on.
        self.tokenizer_id = server_config.tokenizer_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._tokenizer = tokenizer
        self._interval = server_config.heartbeat_interval
        self._timeout = server_config.heartbeat_timeout
        self._max_waiting = server_config.max_inflight_requests
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._peers = Peers(self._context, server_config, self.tokenizer_id.encode(), block_size,
                            self._on_api_frame, self._on_scheduler_frame)
        self._apis = self._peers.apis  # api key -> its socket
        self._replicas = self._peers.replicas
        self._api_in: Codec[ApiToTokenizer] = Codec(ApiToTokenizer)
        self._api_out: Codec[TokenizerToApi] = Codec(TokenizerToApi)
        self._scheduler_in: Codec[SchedulerToTokenizer] = Codec(SchedulerToTokenizer)
        self._scheduler_out: Codec[TokenizerToScheduler] = Codec(TokenizerToScheduler)
        self._offload = Offloader()  # large prompts tokenize on a thread: heartbeats keep going meanwhile
        self._peers.poller.register(self._offload.fd, zmq.POLLIN)
        self._outputs = Outputs(tokenizer, server_config.stream_interval)
        self._requests: dict[str, RequestState] = self._outputs.requests
        self._waiting: deque[Waiting] = deque()
        self._api_heard_at: dict[int, float] = {}  # api key -> time.monotonic() of its latest frame
        self._model_info: ModelInfo | None = None
        self._next_heartbeat = 0.0
        self._num_beats = 0
        self._grammars = LazyGrammarChecker(tokenizer)  # builds llguidance's tokenizer now, before registration
        self._reasoning_parser = server_config.reasoning_parser
        # where a chat prompt's turns end: a <think> before one of them opens no think block (prompt_reasoning)
        self._turn_markers = tuple(tokenizer.hf.all_special_tokens) if tokenizer is not None else ()
        self._fast_forward = fast_forward  # a grammar's forced start joins the prefill (compiler.fast_forward_tokens)
        self._max_logprobs = server_config.max_logprobs
        self._sampling_defaults = sampling_defaults or {}  # the model's generation config (generation_config.py)
        self._stopping = False
        log.info("tokenizer %s: apis %s, schedulers %s, %s", self.tokenizer_id,
                 list(self._peers.api_address.values()), [r.address for r in self._replicas.replicas],
                 f"tokenizer {tokenizer.path}" if tokenizer is not None else "no tokenizer (token ids only)")

    # ---------------------------------------------------------------- loop

    def run(self) -> None:
        settle_heap(f"tokenizer {self.tokenizer_id}")
        hello = self._hello()
        for api in self._apis:
            self._send_api(api, hello)
        for replica in self._replicas.replicas:
            _send(replica.sock, self._scheduler_out.encode(self._hello(replica.link.stream)))
        self._next_heartbeat = time.monotonic() + self._interval
        try:
            while not self._stopping:
                self._poll_once()
                self._tick(time.monotonic())
        finally:
            self._shutdown()

    def _hello(self, stream: int = 0) -> TokenizerHello:
        """Registration; it carries the tokenizer's EOS id (the worker loads no tokenizer to learn it), the model's
        sampling defaults (an api has no model folder to read them from) and, to a scheduler, the stream its
        requests travel in (a new one: a fresh registration)."""
        eos = self._tokenizer.eos_token_id if self._tokenizer is not None else None
        return TokenizerHello(self.tokenizer_id, os.getpid(), [eos] if eos is not None else [], stream,
                              self._sampling_defaults)

    def stop(self) -> None:
        """Ask the loop to end (from a signal handler): it does within MAX_POLL_S."""
        self._stopping = True

    def _poll_once(self) -> None:
        links = [r.link for r in self._replicas.replicas] + list(self._peers.api_links.values())
        pending = any(link.sends.entries or link.ack_owed_since is not None for link in links)
        timeout_s = min(LINK_POLL_S if pending else MAX_POLL_S, max(0.0, self._next_heartbeat - time.monotonic()))
        for sock, _ in self._peers.poller.poll(timeout_s * 1000):
            if sock == self._offload.fd:
                self._offload.drain()
                continue
            handle = self._peers.handlers[sock]
            drain(sock, lambda frames, handle=handle: _single(frames, handle), MAX_DRAIN)

    def _tick(self, now: float) -> None:
        self._tend_links(now)
        self._check_apis(now)
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
                         num_inflight=len(self._requests) + len(self._waiting) + len(self._offload.owners))
        # Every API_HELLO_EVERY-th beat is a hello: an api registers tokenizers only on their hello, and one
        # that restarted (or dropped this process as silent) takes it back on the next.
        self._num_beats += 1
        hello = self._num_beats % API_HELLO_EVERY == 0
        data = self._api_out.encode(self._hello() if hello else beat)
        for sock in self._apis.values():
            _send(sock, data)
        # Until ModelInfo comes, hello again: a scheduler that restarted, or was not listening yet,
        # only registers a tokenizer on its hello (it answers each with ModelInfo, so repeats are harmless).
        beat_data = self._scheduler_out.encode(beat)
        for replica in self._replicas.replicas:
            _send(replica.sock, beat_data if replica.model_info is not None
                  else self._scheduler_out.encode(self._hello(replica.link.stream)))
        self._replicas.prune(self._requests)

    def _shutdown(self) -> None:
        self._fail_all(ServerOverloadedError("the server is shutting down"))
        self._offload.close()
        self._peers.close(CLOSE_LINGER_MS)
        if self._own_context:
            self._context.term()
        log.info("tokenizer %s stopped", self.tokenizer_id)

    # ---------------------------------------------------------------- api -> tokenizer

    def _on_api_frame(self, api: int, frame: Any) -> None:
        message = self._api_in.decode(frame)
        self._api_heard_at[api] = time.monotonic()
        if isinstance(message, Sequenced | Ack):
            link = self._peers.api_links.get(api)
            if link is None:
                return
            stream = link.peer_stream
            messages = unseal(self._api_in, link, message, time.monotonic())
            if stream and link.peer_stream != stream:
                # An api's stream to this process begins when it registers this process: a new one at the same
                # address is a new api process (the old one was killed, and its clients went with it) or one that
                # dropped this process and failed what it had sent here. Either way it waits for none of them.
                self._lose_api(api, "a new stream began from its address (it restarted, or registered this "
                                    "tokenizer afresh)")
            for inner in messages:
                self._dispatch_api(api, inner)
        elif message is not None:
            self._dispatch_api(api, message)

    def _check_apis(self, now: float) -> None:
        """An api that has acknowledged nothing we sent, and sent nothing, for the heartbeat timeout is gone (killed
        and not replaced yet, or stopped): its requests would otherwise run on to their max_tokens."""
        for api, link in self._peers.api_links.items():
            silent_s = now - self._api_heard_at.get(api, now)
            if link.sends.unanswered_s(now) > self._timeout and silent_s > self._timeout and self._owns_work(api):
                self._lose_api(api, f"it acknowledged nothing for {silent_s:.1f} s")

    def _owns_work(self, api: int) -> bool:
        return (any(state.api == api for state in self._requests.values())
                or any(w.api == api for w in self._waiting) or api in self._offload.owners.values())

    def _lose_api(self, api: int, reason: str) -> None:
        """Abort every request of an api that is gone at the scheduler (freeing its blocks) and here; each one fails
        at that api too, in case it was only slow (a new process at its address ignores ids it does not know)."""
        error = ServerOverloadedError(f"the api process that sent this request seemed gone: {reason}")
        cancelled = [request_id for request_id, owner in self._offload.owners.items() if owner == api]
        for request_id in cancelled:
            self._offload.cancel(request_id)
        waiting = [w.message.request_id for w in self._waiting if w.api == api]
        self._waiting = deque(w for w in self._waiting if w.api != api)
        running = [request_id for request_id, state in self._requests.items() if state.api == api]
        for request_id in running:
            self._drop(request_id, abort=True)
        if cancelled or waiting or running:
            log.warning("api %s: %s; aborting its %d request(s)", self._peers.api_address.get(api, api), reason,
                        len(cancelled) + len(waiting) + len(running))
        for request_id in cancelled + waiting + running:
            self._fail(api, request_id, error)

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
                self._on_abort(api, message.request_id)
            elif isinstance(message, DetokenizeRequest):
                self._on_detokenize(api, message)
            elif isinstance(message, TokenizerInfoRequest):
                self._send_api(api, TokenizerInfoResult(message.request_id, tokenizer_info(self._tokenizer)))
            elif isinstance(message, Heartbeat):
                pass  # an api opening its stream to this process (_on_api_frame saw that it began)
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
        if request_id in self._requests or request_id in self._offload.owners:
            self._fail(api, request_id, InvalidRequestError(f"request id {request_id!r} is already in flight"))
            return
        constraint = request.params.structured_outputs
        compile_first = constraint is not None and self._grammars.compiles_slowly(constraint)

        def job() -> Prompt:
            prompt = generate_prompt(self._tokenizer, request, info)
            if compile_first:  # on the thread with the prompt: _admit then finds it compiled
                assert constraint is not None
                self._grammars.prepare(constraint)
            return prompt

        large = _renders_off_the_loop(request)
        self._offload.run(request_id, api, job, large or compile_first,
                          lambda prompt: self._admit(api, request, prompt),
                          lambda exc: self._fail(api, request_id, exc), bounded=large)

    def _work(self, api: int, request_id: str, job: Callable[[], Any], large: bool,
              finish: Callable[[Any], None]) -> None:
        """finish(job()) now, or on a thread for a large input; an error fails the request."""
        self._offload.run(request_id, api, job, large, finish, lambda exc: self._fail(api, request_id, exc))

    def _admit(self, api: int, request: GenerateRequest, prompt: Prompt) -> None:
        """A tokenized prompt that fits goes to the scheduler; the api hears Accepted."""
        request_id, params = request.request_id, request.params
        info = self._model_info
        if info is None:  # the scheduler went away while a thread tokenized
            raise ServerOverloadedError(SCHEDULER_UNAVAILABLE)
        params = with_default_max_tokens(params, self._sampling_defaults, len(prompt.token_ids),
                                         context_limit(info.max_model_len, info.max_num_tokens))
        check_prompt(prompt.token_ids, params, info, prompt.param)
        rendered = params  # the params as the client could send them (the rest below are the engine's own forms)
        params = with_bad_words_token_ids(params, self._tokenizer)
        # logprobs -1, allowed_token_ids, bad words' ids; chat asks the count as top_logprobs
        params = resolve_vocabulary(params, info.vocab_size, self._max_logprobs,
                                    "top_logprobs" if request.messages is not None else "logprobs")
        # where the chat template left the think block: the reasoning parser starts there, and so does a grammar
        reasoning = (prompt_reasoning(prompt.text or "", self._turn_markers) if request.messages is not None
                     and self._reasoning_parser is not None else "")
        if params.bounds_thinking:
            params = self._with_thinking(request, params, prompt, reasoning)
        forced: list[int] = []
        if params.structured_outputs is not None:
            if request.messages is not None and self._reasoning_parser is not None:
                params = constrain_after_reasoning(params, prompt_closed=reasoning == PROMPT_CLOSED)
            constraint = params.structured_outputs
            assert constraint is not None
            # Compiled here (cached), never on the worker's step loop; 400 if the library rejects it, or if an
            # allow-list leaves nothing it starts with (not checked where the grammar starts after reasoning).
            grammar_start = self._grammars.check(constraint, None if constraint.reasoning_end
                                                 else params.allowed_token_ids)
            if self._fast_forward:
                forced = fast_forward_tokens(grammar_start, params, len(prompt.token_ids), info.max_model_len,
                                             info.max_num_tokens, ending_ids(params, self._eos_ids(info)),
                                             info.vocab_size)
                forced = forced[:tokens_before_stop(self._tokenizer, prompt.token_ids, params, forced)]
        if request.render_only:  # vLLM's render routes: every check passed, nothing runs
            if rendered.max_tokens is None:  # up to the context, as a number (vLLM's get_max_tokens)
                room = context_limit(info.max_model_len, info.max_num_tokens) - len(prompt.token_ids)
                rendered = msgspec.structs.replace(rendered, max_tokens=room)
            self._send_api(api, PromptRendered(request_id, prompt.token_ids, rendered))
            return
        # raises (503) when none is live
        replica = self._replicas.route(request_id, prompt.token_ids, request.cache_salt, request.prompt_cache_key)
        echo = echo_text(self._tokenizer, prompt) if request.return_prompt_text else None
        renderer = self._outputs.add(api, request, params, prompt.token_ids, echo, forced, reasoning).renderer
        self._to_replica(replica, AddRequest(
            request_id, prompt.token_ids, params, request.priority, request.arrival_time, request.tenant,
            request.tenant_weight, request.tenant_priority, forced, request.cache_salt))
        self._send_api(api, Accepted(request_id, len(prompt.token_ids), echo,
                                     prompt.token_ids if request.return_token_ids else [],
                                     renderer.opening() if renderer is not None else b"", reasoning))

    def _with_thinking(self, request: GenerateRequest, params: SamplingParams, prompt: Prompt,
                       reasoning: str) -> SamplingParams:
        """vLLM's thinking_token_budget as the worker enforces it (SamplingParams.thinking), from where the chat
        prompt left the think block; a 400 where no block is read (the api refuses it first)."""
        tokenizer, parser = self._tokenizer, self._reasoning_parser
        if request.messages is None or parser is None or tokenizer is None:
            raise InvalidRequestError("thinking_token_budget bounds the think block of a chat answer that the "
                                      "server reads with --reasoning-parser", param="thinking_token_budget")
        assert params.thinking_token_budget is not None
        budget = thinking_budget(params.thinking_token_budget, parser, reasoning, prompt.text or "",
                                 lambda text: tokenizer.encode(text, add_special_tokens=False))
        return msgspec.structs.replace(params, thinking=budget)

    def _eos_ids(self, info: ModelInfo) -> set[int]:
        """The model's EOS ids and the tokenizer's."""
        eos_ids = set(info.eos_token_ids)
        if self._tokenizer is not None and self._tokenizer.eos_token_id is not None:
            eos_ids.add(self._tokenizer.eos_token_id)
        return eos_ids

    def _on_abort(self, api: int, request_id: str) -> None:
        """An api's abort of one of its own requests (a peer acts only on what it owns: another api's abort of an id
        it did not send is dropped with a warning)."""
        owner = self._owner(request_id)
        if owner is not None and owner != api:
            log.warning("dropped api %d's abort of %s, a request of api %d", api, request_id, owner)
            return
        if self._offload.cancel(request_id):
            return  # still tokenizing: its result will be dropped
        if request_id in self._requests:
            self._drop(request_id, abort=True)
        elif self._waiting:
            self._waiting = deque(w for w in self._waiting if w.message.request_id != request_id)
        # Otherwise it already finished or failed here; its last deltas crossed the abort.

    def _owner(self, request_id: str) -> int | None:
        """The api that sent a request in flight here (tokenizing, waiting for ModelInfo or running); None if none."""
        state = self._requests.get(request_id)
        if state is not None:
            return state.api
        if request_id in self._offload.owners:
            return self._offload.owners[request_id]
        return next((w.api for w in self._waiting if w.message.request_id == request_id), None)

    def _on_tokenize(self, api: int, request: TokenizeRequest, info: ModelInfo) -> None:
        self._work(api, request.request_id, lambda: tokenize_result(self._tokenizer, request, info.max_model_len),
                   _renders_off_the_loop(request), lambda result: self._send_api(api, result))

    def _on_detokenize(self, api: int, request: DetokenizeRequest) -> None:
        info = self._model_info
        try:
            decode = detokenize_job(self._tokenizer, request, info.vocab_size if info is not None else None)
        except InvalidRequestError as exc:
            self._fail(api, request.request_id, exc)
            return
        self._work(api, request.request_id, decode, len(request.token_ids) >= OFFLOAD_MIN_TOKENS,
                   lambda text: self._send_api(api, DetokenizeResult(request.request_id, text)))

    # ---------------------------------------------------------------- scheduler -> tokenizer

    def _on_scheduler_frame(self, frame: Any, replica: int = 0) -> None:
        message = self._scheduler_in.decode(frame)
        if message is None:
            return
        self._heard_from_scheduler(message, replica)
        if isinstance(message, Sequenced | Ack):
            link = self._replicas.replicas[replica].link
            for inner in unseal(self._scheduler_in, link, message, time.monotonic()):
                self._on_scheduler_message(inner, replica)
        else:
            self._on_scheduler_message(message, replica)

    def _on_scheduler_message(self, message: SchedulerToTokenizer, replica: int) -> None:
        if isinstance(message, TokenDeltas):
            self._on_token_deltas(message)
        elif isinstance(message, ModelInfo):
            self._on_model_info(message, replica)
        elif isinstance(message, RequestFailed):
            self._send_held(message.request_id)
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
            _send(replica.sock, self._scheduler_out.encode(self._hello(replica.link.stream)))
        replica.heard_at = time.monotonic()

    # ---------------------------------------------------------------- discovery (shared/discovery.py)

    def _on_directory(self, directory: Directory, index: int) -> None:
        """The registry's live apis and replicas: hello to the new ones; an api no longer listed is gone, and its
        clients with it (its requests are aborted); a replica that moved is lost at its old address."""
        changes = self._peers.apply(directory, index)
        for replica, address in changes.moved:
            self._lose_scheduler(f"it moved to {address}", replica.index)
            self._peers.retire(replica)
        for replica in changes.new_replicas:
            _send(replica.sock, self._scheduler_out.encode(self._hello(replica.link.stream)))
        for api in changes.new_apis:
            self._send_api(api, self._hello())
        for api, address in changes.gone_apis:
            self._api_heard_at.pop(api, None)
            self._lose_api(api, f"the registry no longer lists {address}")

    def _on_model_info(self, info: ModelInfo, index: int = 0) -> None:
        replica = self._replicas.replicas[index]
        if info != replica.model_info:
            log.info("registered with scheduler %d: %s", index, info)
            if info.max_num_tokens < info.max_model_len:  # vLLM refuses to start so; here requests are bounded
                log.warning("scheduler %d's KV cache holds %d tokens of one sequence, less than --max-model-len %d: "
                            "a prompt plus max_tokens past %d is refused (raise --kv-cache-memory / --num-kv-blocks "
                            "or lower --max-model-len)", index, info.max_num_tokens, info.max_model_len,
                            info.max_num_tokens)
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
        replica.link.restart()  # what it was sent is given up with the requests; the next hello names the new stream
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
            self._send_held(request_id)
            state = self._requests.pop(request_id)
            self._fail(state.api, request_id, ServerOverloadedError(reason))
            self._to_replica(replica, AbortRequest(request_id))  # it may only be slow

    def _on_token_deltas(self, message: TokenDeltas) -> None:
        """One step's columns in, one TextDeltas and/or RenderedRows per api out."""
        batch = self._outputs.on_token_deltas(message)
        for stop in batch.stops:
            self._send_scheduler(stop)
        for api, request_id in batch.failed:
            self._drop(request_id, abort=True)
            self._fail(api, request_id, PagodaError("internal error in the tokenizer"))
        for api, messages in batch.to_apis.items():
            for out in messages:
                self._send_api(api, out)

    # ---------------------------------------------------------------- sending

    def _send_held(self, request_id: str) -> None:
        """A request about to fail: the output its completions hold back (a stream interval) goes to its api first,
        as without an interval it would have gone already."""
        for api, messages in self._outputs.flush(request_id).to_apis.items():
            for out in messages:
                self._send_api(api, out)

    def _drop(self, request_id: str, abort: bool) -> None:
        if self._requests.pop(request_id, None) is not None and abort:
            self._send_scheduler(AbortRequest(request_id))

    def _fail_all(self, error: PagodaError) -> None:
        """Every request here gets `error`; the scheduler is told to drop them (it may only be slow)."""
        for request_id, api in list(self._offload.owners.items()):
            self._offload.cancel(request_id)
            self._fail(api, request_id, error)
        for waiting in self._waiting:
            self._fail(waiting.api, waiting.message.request_id, error)
        self._waiting.clear()
        for request_id, state in self._requests.items():
            self._send_held(request_id)
            self._fail(state.api, request_id, error)
            self._send_scheduler(AbortRequest(request_id))
        self._requests.clear()

    def _fail(self, api: int, request_id: str, error: PagodaError) -> None:
        self._send_api(api, request_failed(request_id, error))

    def _send_api(self, api: int, message: Any) -> None:
        """Answers and outputs travel in the api's sequenced stream (resent until acknowledged, applied once);
        hellos and heartbeats, repeated anyway, plain."""
        sock = self._apis.get(api)
        if sock is None:  # the api is gone (the registry forgot it), and its clients with it
            return
        if isinstance(message, TokenizerHello | Heartbeat):
            _send(sock, self._api_out.encode(message))
        else:
            _send(sock, seal(self._api_out, self._peers.api_links[api], message, time.monotonic()))

    def _send_scheduler(self, message: AbortRequest | StopSequence) -> None:
        """A request's abort or stop goes to the replica that owns it (none: it failed before it reached one)."""
        owner = self._replicas.owner_of(message.request_id)
        if owner is not None:
            self._to_replica(owner, message)

    def _to_replica(self, replica: Replica, message: AddRequest | AbortRequest | StopSequence) -> None:
        """In the replica's sequenced stream: sent again until acknowledged, applied there once, in order."""
        _send(replica.sock, seal(self._scheduler_out, replica.link, message, time.monotonic()))

    def _tend_links(self, now: float) -> None:
        """Each scheduler's stream: what it has not acknowledged in time goes again; an ack we owe it and no
        request carried goes alone (at most one per ACK_DELAY_S: acks are batched, never one per step)."""
        for replica in self._replicas.replicas:
            for entry in replica.link.due(now):
                log.warning("resending message %d to scheduler %d (send %d)", entry.seq, replica.index,
                            entry.num_sends)
                _send(replica.sock, entry.data)
            if replica.link.ack_due(now):
                _send(replica.sock, ack_frame(self._scheduler_out, replica.link))
        for api, link in self._peers.api_links.items():
            for entry in link.due(now):
                log.warning("resending message %d to api %s (send %d)", entry.seq, self._peers.api_address[api],
                            entry.num_sends)
                _send(self._apis[api], entry.data)
            if link.ack_due(now):
                _send(self._apis[api], ack_frame(self._api_out, link))


def _send(sock: zmq.Socket, data: bytes) -> None:
    # Never block the loop: with no high-water mark a DEALER queues while its peer is away.
    if sock.closed:  # a moved replica's old socket (Peers.retire): nothing listens there any more
        return
    if not send_nowait(sock, data):
        log.warning("dropped an outgoing message of %d bytes: the socket cannot take it", len(data))


def _single(frames: list[Any], handle: Callable[[Any], None]) -> None:
    frame = single_frame(frames)
    if frame is not None:
        handle(frame)


def run_tokenizer(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT; in-flight requests then get a 503."""
    # llguidance's tokenizer is built in the constructor (LazyGrammarChecker), before registration: the build holds
    # the GIL for seconds on a loaded host (3.4 s seen), and a tokenizer registered meanwhile would miss its
    # heartbeats and be dropped with its first requests.
    defaults = sampling_defaults(engine_config.model, engine_config.generation_config,  # a bad file: stop here
                                 engine_config.generation_overrides())
    run_service(server_config, lambda: TokenizerService(server_config, load_tokenizer(engine_config),
                                                        block_size=engine_config.block_size,
                                                        fast_forward=engine_config.grammar_fast_forward,
                                                        sampling_defaults=defaults))
