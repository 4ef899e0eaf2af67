"""The scheduler process: requests in from tokenizers, one plan per step out to the workers, tokens back.

    tokenizers --AddRequest/AbortRequest/StopSequence--> [ROUTER]            [PUB] --StepPlan--> workers
    tokenizers <--ModelInfo/TokenDeltas/RequestFailed--- [ROUTER] scheduler [PULL] <--StepResult-- rank 0
                                                                             [PUB] --SchedulerStats--> apis
This file only moves messages; the policy is Scheduler (pure Python). Up to max_inflight_plans plans (2 with
async scheduling) are out at the worker at once; PlanPipeline keeps them in order and matches each result
to the oldest.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from pagoda.services.scheduler.grammar_gate import GrammarGate
from pagoda.services.scheduler.health import StepWatch
from pagoda.services.scheduler.phases import PhaseClock
from pagoda.services.scheduler.pipeline import PlanPipeline
from pagoda.services.scheduler.registry import RegistryHost
from pagoda.services.scheduler.scheduler import Request, Scheduler, SeqUpdate
from pagoda.services.scheduler.tracing import RequestTracer
from pagoda.shared.config import (
    MATCHER_CACHE_BYTES,
    MATCHER_CACHE_SIZE,
    SLOW_COMPILE_MIN_BYTES,
    EngineConfig,
    ServerConfig,
)
from pagoda.shared.delivery import Link, SendLog
from pagoda.shared.errors import InvalidRequestError, PagodaError
from pagoda.shared.heap import settle_heap
from pagoda.shared.lru import SizedLru
from pagoda.shared.messages import (
    MAX_INT32,
    AbortRequest,
    Ack,
    AddRequest,
    ApiJoin,
    FinishReason,
    GrammarCompiled,
    GrammarDef,
    Heartbeat,
    ModelInfo,
    NewRequest,
    PromptScores,
    ReplicaJoin,
    RequestFailed,
    SchedulerStats,
    SchedulerToApi,
    SchedulerToTokenizer,
    SchedulerToWorker,
    Sequenced,
    Shutdown,
    StepPlan,
    StepResult,
    StopSequence,
    StructuredOutputs,
    TokenDeltas,
    TokenizerHello,
    TokenizerToScheduler,
    WorkerReady,
    WorkerToScheduler,
)
from pagoda.shared.service_main import run_service
from pagoda.shared.transport import (
    MAX_FRAME_BYTES,
    Codec,
    ack_frame,
    drain,
    make_socket,
    seal,
    single_frame,
    split_routed,
    unseal,
)

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.25
MAX_TENANT_STATS = 1024  # tenants whose queue times are kept (the keys file's; more would be a forger's)
MAX_SWEPT_TOKENIZERS = 64  # identities remembered after a silence sweep (a restarted one comes with a new name)
MAX_TOKENIZER_EOS = 16  # EOS ids one tokenizer may register
# logprob entries (a token or one of its alternatives) one request may make a step carry: the api's message of a
# step holds ~30 bytes an entry (msgspec: the token's text, id, logprob, bytes and rank), so one request at the bound
# fills under half of the frame ZeroMQ takes (Scheduler._check_logprob_entries)
LOGPROB_ENTRY_BYTES = 30
MAX_LOGPROB_ENTRIES = MAX_FRAME_BYTES // (2 * LOGPROB_ENTRY_BYTES)
MAX_WORKER_GRAMMARS = 512  # constraints the workers keep by hash (each up to 1 MiB of text) ...
MAX_WORKER_GRAMMAR_BYTES = 64 << 20  # ... and their encoded sizes together (512 of 1 MiB would be 512 MiB a worker)
LINK_TICK_MS = 20  # while a tokenizer stream has something unacknowledged (either way), the loop looks this often
IDLE_NACK_S = 0.05  # a message out this long that an idle worker rank has not applied was lost (the worker acks
# IDLE_ACK_MS after its last step when no plan came; one still in flight then is only sent twice, harmlessly)
HUNG_EXIT_CODE = 3  # the scheduler exits with this when the worker hangs (the launcher then stops everything)


@dataclass(slots=True)
class Peer:
    last_seen: float
    link: Link[TokenizerToScheduler] = field(default_factory=lambda: Link(0.5))  # the sequenced streams both ways
    # (shared/delivery.py), kept over a sweep
    request_ids: set[str] = field(default_factory=set)
    num_requests: int = 0
    eos_token_ids: frozenset[int] = frozenset()  # from its hello: its requests stop on these too (not others')
    stream: int = 0  # the stream its latest hello named: a new one is a fresh registration


@dataclass(slots=True)
class _Columns:
    """One tokenizer's share of a step, gathered row by row (see TokenDeltas)."""

    request_ids: list[str] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reasons: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    prompt_scores: list[PromptScores] = field(default_factory=list)
    prompt_score_rows: list[int] = field(default_factory=list)


class SchedulerService:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        self.engine_config = engine_config
        self.config = server_config
        endpoint = server_config.endpoint
        self.context = zmq.Context()
        self.front = make_socket(self.context, zmq.ROUTER, endpoint("scheduler"), bind=True,
                                 role="scheduler_to_tokenizer")
        self.plans = make_socket(self.context, zmq.PUB, endpoint("plan"), bind=True, role="plan")
        self.results = make_socket(self.context, zmq.PULL, endpoint("result"), bind=True)
        self.stats_out = make_socket(self.context, zmq.PUB, endpoint("stats"), bind=True)
        self.from_tokenizers: Codec[TokenizerToScheduler] = Codec(TokenizerToScheduler)
        self.to_tokenizers: Codec[SchedulerToTokenizer] = Codec(SchedulerToTokenizer)
        self.to_workers: Codec[SchedulerToWorker] = Codec(SchedulerToWorker)
        self.from_workers: Codec[WorkerToScheduler] = Codec(WorkerToScheduler)
        self.stats_codec: Codec[SchedulerToApi] = Codec(SchedulerToApi)
        self.scheduler: Scheduler | None = None  # built once every worker rank is ready
        self.model_info: ModelInfo | None = None
        self.ready_ranks: set[int] = set()
        self.rank0_ready: WorkerReady | None = None
        self.tokenizers: dict[bytes, Peer] = {}
        self.swept: dict[bytes, Peer] = {}  # tokenizers dropped for silence after their hello (oldest first), kept
        # with their streams: one that was only late takes both up where they were
        self.owner: dict[str, bytes] = {}  # request id -> tokenizer identity
        self.pipeline: PlanPipeline | None = None  # plans out at the worker, oldest first (with the scheduler)
        self.inflight_since = 0.0  # when the oldest plan in flight went out (or its predecessor's result came)
        self.worker_last_seen = 0.0
        self.generation_tokens_total = 0
        self.tenant_queue: dict[str, list[float]] = {}  # tenant -> [requests admitted, seconds queued]
        self.num_unsent = 0  # messages to tokenizers dropped: the peer vanished or its queue reached the HWM
        self.sends = SendLog()  # plans and constraints to the workers not yet known done (shared/delivery.py)
        self.early_results: dict[int, StepResult] = {}  # results that came before an older plan's (by step id)
        self.rank_acked: dict[str, int] = {}  # each worker rank's last applied sequenced message
        # the constraints the workers hold, by hash (-> None): they drop what the scheduler evicts for them
        self.worker_grammars: SizedLru[str, None] = SizedLru(MAX_WORKER_GRAMMARS, MAX_WORKER_GRAMMAR_BYTES)
        # of those, the ones every worker rank said it built (GrammarCompiled), within half the workers' matcher
        # cache (every constraint a plan names counts: small ones fill the workers' cache too), so that one counted
        # as built is still there when its request is added; and which ranks answered for each, until all have
        self.compiled_grammars: SizedLru[str, None] = SizedLru(MATCHER_CACHE_SIZE // 2, MATCHER_CACHE_BYTES // 2)
        self.compiled_ranks: dict[str, set[int]] = {}
        self.grammar_gate = GrammarGate()  # requests waiting for the workers to compile their large constraint
        self.unsampled_constrained: set[int] = set()  # sequences whose grammar the worker may still be compiling
        self.grammar_codec = msgspec.msgpack.Encoder(order="deterministic")
        # the console's step split: wall time of steps with and without prompt tokens, and this loop's own time
        self.prefill_step_s = self.decode_step_s = self.host_s = 0.0
        self.tracer = RequestTracer() if server_config.console else None  # the request inspector's timelines
        self.phases = PhaseClock()  # vLLM's request phase and step token histograms
        self.running = True
        self.stalled = False
        self.instance_id = f"scheduler-{os.getpid()}-{time.time_ns()}"  # tokenizers spot a restart by it
        self._next_heartbeat = 0.0
        self._next_stats = 0.0
        self.watch = StepWatch(server_config.step_timeout, server_config.hang_floor)
        self.problem = ""  # why the worker counts as hung ("" while it makes progress)
        self.exit_code = 0
        self.registry = RegistryHost(self.context, server_config, self.instance_id)

    # ---------------------------------------------------------------- loop

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.results, zmq.POLLIN)
        log.info("scheduler up; waiting for %d worker rank(s)", self.engine_config.tensor_parallel_size)
        while self.running:
            busy = not self.stalled and self.pipeline is not None and self.pipeline.wants_plan()
            timeout_ms = 0 if busy else int(self.config.heartbeat_interval * 1000 / 2)
            if not busy and any(p.link.sends.entries or p.link.ack_owed_since is not None
                                for p in self.tokenizers.values()):
                timeout_ms = min(timeout_ms, LINK_TICK_MS)  # an ack owed, or a resend that may come due
            events = dict(poller.poll(timeout_ms))
            if events:
                self.stalled = False
            if self.front in events:
                drain(self.front, self._on_tokenizer_frames, copy=False)
            if self.results in events:
                drain(self.results, self._on_worker_frames, copy=False)
            self._maybe_step()
            if self.sends.entries:
                self._resend_due(time.monotonic())
            self._tend_links(time.monotonic())
            self._periodic()
        self._close()

    def _maybe_step(self) -> None:
        """Send plans while the pipeline has room: with async scheduling, step N+1's plan goes out while
        step N runs."""
        pipeline = self.pipeline
        while pipeline is not None and not self.stalled and pipeline.wants_plan():
            started = time.monotonic()
            plan = pipeline.schedule()
            if self.tracer is not None and (plan.new_requests or pipeline.scheduler.preemption_log):
                self._trace_plan(plan, pipeline.scheduler)
            if not plan.seq_ids and not plan.finished_seq_ids:
                self.stalled = True  # nothing runnable until a message (or a result) changes something
                self.host_s += time.monotonic() - started
                return
            if plan.new_requests:
                self._count_queue_time(plan)
            self.phases.on_plan(plan, pipeline.scheduler, started)
            self._send_plan(plan)
            sent = time.monotonic()
            self.host_s += sent - started
            if not plan.seq_ids:  # only forgotten ids to pass on: no result will come
                return
            if len(pipeline.inflight) == 1:
                self.inflight_since = sent

    def _trace_plan(self, plan: StepPlan, scheduler: Scheduler) -> None:
        assert self.tracer is not None and scheduler.preemption_log is not None
        now = time.time()
        self.tracer.on_preempted(scheduler.preemption_log, now)
        scheduler.preemption_log.clear()
        self.tracer.on_plan(plan, scheduler, now)

    def _send_plan(self, plan: StepPlan) -> None:
        """Number the plan in the workers' sequenced stream and keep it until it is known done (its result, or
        the workers' acknowledgement): a lost plan or result is sent again (_resend_due). Constraints go ahead of
        it once each (GrammarDef), the plan names them by hash."""
        now = time.monotonic()
        if plan.new_requests and any(new.sampling.structured_outputs is not None for new in plan.new_requests):
            self.unsampled_constrained.update(new.seq_id for new in plan.new_requests
                                              if new.sampling.structured_outputs is not None)
            plan = msgspec.structs.replace(plan, new_requests=[self._by_hash(new, now) for new in plan.new_requests])
        if self.unsampled_constrained and plan.finished_seq_ids:
            self.unsampled_constrained.difference_update(plan.finished_seq_ids)
        seq = self.sends.take_seq()
        data = self.to_workers.encode(msgspec.structs.replace(plan, seq=seq))
        resend_s = self.watch.resend_after(sum(plan.num_scheduled_tokens), self._compiling(plan))
        self.sends.record(seq, data, now, resend_s, tag=plan.step_id if plan.seq_ids else -1)
        self.plans.send(data, copy=False)

    def _by_hash(self, new: NewRequest, now: float) -> NewRequest:
        """The request with its constraint replaced by the constraint's hash; a GrammarDef goes first when the
        workers do not hold it (the scheduler keeps their cache's contents and evicts for them, LRU)."""
        constraint = new.sampling.structured_outputs
        if constraint is None:
            return new
        encoded = self.grammar_codec.encode(constraint)
        digest = hashlib.sha256(encoded).hexdigest()
        self._define(digest, constraint, len(encoded), now)
        if not self.compiled_grammars.touch(digest) and len(encoded) < SLOW_COMPILE_MIN_BYTES:
            self.compiled_grammars.put(digest, None, len(encoded))  # the worker compiles it now: it takes room there
        return msgspec.structs.replace(new, sampling=msgspec.structs.replace(new.sampling, structured_outputs=None),
                                       grammar_hash=digest)

    def _define(self, digest: str, constraint: StructuredOutputs, size: int, now: float) -> None:
        """Send the workers a GrammarDef unless they hold it (the scheduler evicts for them, LRU); they compile it
        as it comes and answer GrammarCompiled."""
        if self.worker_grammars.touch(digest):
            return
        evict = self.worker_grammars.put(digest, None, size)
        for gone in evict:
            self.compiled_grammars.discard(gone)
            self.compiled_ranks.pop(gone, None)
        seq = self.sends.take_seq()
        data = self.to_workers.encode(GrammarDef(seq, digest, constraint, evict))
        self.sends.record(seq, data, now, self.watch.resend_after())
        self.plans.send(data, copy=False)

    def _held_for_grammar(self, request: Request) -> bool:
        """Hold a request with a large constraint the workers have not built out of the queue (grammar_gate.py):
        its GrammarDef goes now, and GrammarCompiled admits it. False: it joins the queue now."""
        constraint = request.sampling.structured_outputs
        if constraint is None:
            return False
        assert self.scheduler is not None
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", param="request_id")
        encoded = self.grammar_codec.encode(constraint)
        if len(encoded) < SLOW_COMPILE_MIN_BYTES:
            return False
        digest = hashlib.sha256(encoded).hexdigest()
        if self.compiled_grammars.touch(digest) and self.worker_grammars.touch(digest):
            return False
        now = time.monotonic()
        self._define(digest, constraint, len(encoded), now)
        self.grammar_gate.hold(request, digest, now)
        return True

    def _on_grammar_compiled(self, message: GrammarCompiled) -> None:
        """Once every rank has built it (each compiles it; a step waits for the slowest), its requests go."""
        size = self.worker_grammars.size_of(message.hash)
        if size is None and not self.grammar_gate.waits_for(message.hash):
            return  # evicted, nobody waits: a late answer
        ranks = self.compiled_ranks.setdefault(message.hash, set())
        if 0 <= message.rank < self.engine_config.tensor_parallel_size:
            ranks.add(message.rank)
        if len(ranks) < self.engine_config.tensor_parallel_size:
            return
        del self.compiled_ranks[message.hash]
        if size is not None:
            self.compiled_grammars.put(message.hash, None, size)
        for request in self.grammar_gate.release(message.hash):
            self._admit_held(request)

    def _forget_partial_compiles(self) -> None:
        """The ranks that built a constraint nobody waits for and the workers no longer hold: some rank's
        GrammarCompiled was lost (or came after the eviction), so the entry would never be completed or evicted."""
        for digest in [d for d in self.compiled_ranks
                       if self.worker_grammars.size_of(d) is None and not self.grammar_gate.waits_for(d)]:
            del self.compiled_ranks[digest]

    def _admit_held(self, request: Request) -> None:
        """A held request joins the queue (as _on_add would have added it)."""
        assert self.scheduler is not None
        self.stalled = False  # something may be runnable now (a timeout admits without a socket event)
        try:
            self.scheduler.add_request(request)
        except PagodaError as exc:
            identity = self.owner.get(request.request_id)
            if identity is not None:
                self._fail(identity, request.request_id, exc.http_status, exc.message, exc.error_type, exc.param,
                           exc.code)
            self._forget(request.request_id)

    def _resend_due(self, now: float) -> None:
        """Sequenced messages the workers have not answered in time go again (a lost plan, or a lost result:
        the worker answers a repeated plan with its cached result)."""
        for entry in self.sends.due(now):
            log.warning("resending message %d to the workers (send %d; step %d)", entry.seq, entry.num_sends,
                        entry.tag)
            self.plans.send(entry.data, copy=False)

    def _count_queue_time(self, plan: StepPlan) -> None:
        """Per tenant: requests admitted for the first time in this plan and their time since arrival."""
        assert self.scheduler is not None
        now = time.time()  # arrival_time is the api's wall clock
        for new in plan.new_requests:
            seq = self.scheduler.get_sequence(new.seq_id)
            if seq is None or seq.index or seq.num_preemptions or not seq.request.tenant:
                continue
            entry = self.tenant_queue.get(seq.request.tenant)
            if entry is None:
                if len(self.tenant_queue) >= MAX_TENANT_STATS:
                    continue
                entry = self.tenant_queue[seq.request.tenant] = [0, 0.0]
            entry[0] += 1
            entry[1] += max(0.0, now - seq.request.arrival_time)

    def _periodic(self) -> None:
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.config.heartbeat_interval
            self._heartbeat_tokenizers()
            self._sweep_dead_tokenizers(now)
            self._registry_tick(now)
            self._check_progress(now)
            for request in self.grammar_gate.expired(now):
                log.warning("request %s: no worker said its constraint compiled in %.0f s; queued anyway",
                            request.request_id, self.grammar_gate.timeout_s)
                self._admit_held(request)
            self._forget_partial_compiles()
            if len(self.ready_ranks) < self.engine_config.tensor_parallel_size:
                # subscription probe; its sender tells a worker whether this is the scheduler it knows
                self.plans.send(self.to_workers.encode(Heartbeat(sender=self.instance_id)))
        if now >= self._next_stats:
            self._next_stats = now + STATS_INTERVAL_S
            self.stats_out.send(self.stats_codec.encode(self._stats(now)))

    # ---------------------------------------------------------------- tokenizers

    def _on_tokenizer_frames(self, frames: list[zmq.Frame]) -> None:
        routed = split_routed(frames)
        if routed is None:
            return
        identity, payload = routed
        message = self.from_tokenizers.decode(payload)
        if message is None:
            return
        if isinstance(message, ApiJoin | ReplicaJoin):
            self._on_join(identity, message)
            return
        peer = self._registered(identity, message)
        if peer is None:
            return
        now = time.monotonic()
        peer.last_seen = now
        if isinstance(message, Sequenced | Ack):
            for inner in unseal(self.from_tokenizers, peer.link, message, now):
                self._on_tokenizer_message(identity, peer, inner)
        else:
            self._on_tokenizer_message(identity, peer, message)

    def _registered(self, identity: bytes, message: TokenizerToScheduler) -> Peer | None:
        """The tokenizer this message comes from, registered now if it says hello (or comes back after a
        sweep); None: not a registered tokenizer (dropped; an AddRequest still gets its answer)."""
        peer = self.tokenizers.get(identity)
        if peer is None and identity in self.swept and isinstance(message, Heartbeat | Sequenced | Ack):
            # It said hello before and was only late (a busy host, a long call holding its GIL): back at once,
            # rather than after it notices our silence and fails what it holds; its streams go on.
            peer = self.tokenizers[identity] = self.swept.pop(identity)
            log.info("tokenizer %s is back", identity.decode(errors="replace"))
            if self.model_info is not None:
                self._send_tokenizer(identity, self.model_info)
        if peer is None and not isinstance(message, TokenizerHello):
            # Registration takes a hello: a stray peer's heartbeat must not make it a tokenizer. A request
            # from it still gets an answer (it re-registers once it misses our heartbeats).
            if isinstance(message, Sequenced | Ack | Heartbeat):
                # Registered with a scheduler that is not us (we restarted): our heartbeat's sender tells it so at
                # once; it fails what it held there and says hello. Idle, it would otherwise take our silence for
                # heartbeat_timeout, holding the old ModelInfo: its next request would be refused here.
                self._send_tokenizer(identity, Heartbeat(sender=self.instance_id))
            if isinstance(message, Sequenced):
                message = self.from_tokenizers.decode(message.body) or message
            log.warning("dropped a %s from unregistered peer %r", type(message).__name__, identity[:64])
            if isinstance(message, AddRequest):
                self._fail(identity, message.request_id, 503, "this tokenizer is not registered with the scheduler "
                           "(a new scheduler, or one that dropped it); try again", "server_error")
            return None
        if peer is None:
            peer = self.swept.pop(identity, None) or Peer(time.monotonic(), Link(self.config.resend_interval))
            self.tokenizers[identity] = peer
            log.info("tokenizer %s registered", identity.decode(errors="replace"))
            if self.model_info is not None:
                self._send_tokenizer(identity, self.model_info)
        return peer

    def _on_tokenizer_message(self, identity: bytes, peer: Peer, message: TokenizerToScheduler) -> None:
        if isinstance(message, AddRequest):
            self._on_add(identity, peer, message)
        elif isinstance(message, AbortRequest | StopSequence):
            if self.owner.get(message.request_id) != identity:  # only the tokenizer that owns a request ends it
                log.warning("dropped a %s for request %r from %r, which does not own it", type(message).__name__,
                            message.request_id[:64], identity[:64])
            elif isinstance(message, AbortRequest):
                self._abort(message.request_id)
            else:
                self._on_stop_sequence(message)
        elif isinstance(message, TokenizerHello):
            self._on_hello(identity, peer, message)

    def _on_hello(self, identity: bytes, peer: Peer, message: TokenizerHello) -> None:
        peer.eos_token_ids = frozenset(t for t in message.eos_token_ids[:MAX_TOKENIZER_EOS] if 0 <= t <= MAX_INT32)
        # A tokenizer names a new stream only when it holds no request here (it started, or gave us up and failed
        # them): whatever it owned is orphaned, and what we sent it and it never acknowledged is moot. A hello
        # naming the stream we know is a repeat (it asks for ModelInfo again; a delayed frame): nothing ends.
        if message.stream == 0 or message.stream != peer.stream:
            for request_id in list(peer.request_ids):
                self._abort(request_id)
            if peer.stream != message.stream:
                peer.link.restart()
            peer.stream = message.stream
        if self.model_info is not None:
            self._send_tokenizer(identity, self.model_info)  # a restarted tokenizer asks again

    def _on_add(self, identity: bytes, peer: Peer, message: AddRequest) -> None:
        if self.scheduler is None:
            self._fail(identity, message.request_id, 503, "the model is still loading", "server_error")
            return
        limit = self.config.max_waiting_requests
        # bounded queue (the api adds Retry-After to the 503): requests still waiting, as /metrics counts them
        if limit and self.scheduler.num_waiting_requests + len(self.grammar_gate) >= limit:
            self._fail(identity, message.request_id, 503, f"the server is overloaded ({limit} requests waiting); "
                       "try again later", "server_error")
            return
        request = Request(request_id=message.request_id, prompt_token_ids=message.prompt_token_ids,
                          sampling=message.params, arrival_time=message.arrival_time, priority=message.priority,
                          tenant=message.tenant, weight=message.tenant_weight, tier=message.tenant_priority,
                          eos_token_ids=peer.eos_token_ids, forced_token_ids=message.forced_token_ids,
                          cache_salt=message.cache_salt)
        try:
            # Checked again though the api and the tokenizer did: a peer's values are its own request's problem
            # (a forged n of 2**31 would otherwise make 2**31 sequences here), never the scheduler's.
            self.scheduler.validate(request)
            if request.request_id in self.grammar_gate:  # held: add_request cannot see it
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use", param="request_id")
            if not self._held_for_grammar(request):
                self.scheduler.add_request(request)
        except PagodaError as exc:
            self._fail(identity, message.request_id, exc.http_status, exc.message, exc.error_type, exc.param,
                       exc.code)
            return
        except AssertionError:  # a tokenizer that skipped its checks (a bug) costs its request, not the process
            log.exception("refused request %s that breaks the scheduler's invariants", message.request_id)
            self._fail(identity, message.request_id, 500, "the request was not checked before scheduling",
                       "server_error")
            return
        self.owner[message.request_id] = identity
        peer.request_ids.add(message.request_id)
        peer.num_requests += 1
        self.phases.on_add(request, time.monotonic())
        if self.tracer is not None:
            self.tracer.on_add(request, time.time())

    def _on_stop_sequence(self, message: StopSequence) -> None:
        assert self.scheduler is not None
        request = self.scheduler.requests.get(message.request_id)
        if request is not None and 0 <= message.index < len(request.sequences):
            self.scheduler.finish_sequence(request.sequences[message.index].seq_id, FinishReason.STOP)
            self._forget_if_done(message.request_id)

    def _abort(self, request_id: str) -> None:
        if self.scheduler is not None and not self.grammar_gate.drop(request_id):
            self.scheduler.abort_request(request_id)
        self._forget(request_id)

    def _forget_if_done(self, request_id: str) -> None:
        if self.scheduler is not None and request_id not in self.scheduler.requests:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.phases.on_done(request_id)
        if self.tracer is not None:
            self.tracer.on_done(request_id, time.time())
        identity = self.owner.pop(request_id, None)
        peer = self.tokenizers.get(identity) if identity is not None else None
        if peer is not None:
            peer.request_ids.discard(request_id)

    def _sweep_dead_tokenizers(self, now: float) -> None:
        """A tokenizer gone silent takes its requests with it: abort them and free their blocks. Each one is also
        failed to it, in case it was only late: then it answers its clients and comes back (see the swept set)."""
        for identity, peer in list(self.tokenizers.items()):
            if now - peer.last_seen > self.config.heartbeat_timeout:
                log.warning("tokenizer %s is silent: aborting its %d request(s)", identity.decode(errors="replace"),
                            len(peer.request_ids))
                for request_id in list(peer.request_ids):
                    self._fail(identity, request_id, 503, "this tokenizer process fell silent; try again",
                               "server_error")
                    self._abort(request_id)
                del self.tokenizers[identity]
                self.swept[identity] = peer
                while len(self.swept) > MAX_SWEPT_TOKENIZERS:
                    del self.swept[next(iter(self.swept))]

    def _on_join(self, identity: bytes, message: ApiJoin | ReplicaJoin) -> None:
        answer = self.registry.on_join(message, time.monotonic())
        if answer is not None:
            self._send_tokenizer(identity, answer)

    def _registry_tick(self, now: float) -> None:
        """Join the registry (another replica's scheduler), forget the silent, tell the tokenizers."""
        directory = self.registry.tick(now)
        if directory is not None:
            payload = self.to_tokenizers.encode(directory)
            for identity in list(self.tokenizers):
                self._send_raw(identity, payload)

    def _heartbeat_tokenizers(self) -> None:
        beat = self.to_tokenizers.encode(Heartbeat(sender=self.instance_id))
        for identity in list(self.tokenizers):
            self._send_raw(identity, beat)

    def _send_tokenizer(self, identity: bytes, message: SchedulerToTokenizer) -> None:
        """Tokens and failures travel in the peer's sequenced stream (resent until acknowledged, applied once);
        what is repeated anyway (ModelInfo answers each hello, Directory each tick) travels plain."""
        peer = self.tokenizers.get(identity)
        if peer is not None and isinstance(message, TokenDeltas | RequestFailed):
            self._send_raw(identity, seal(self.to_tokenizers, peer.link, message, time.monotonic()))
        else:
            self._send_raw(identity, self.to_tokenizers.encode(message))

    def _tend_links(self, now: float) -> None:
        """Each registered tokenizer's stream: what it has not acknowledged in time goes again; an ack we owe it
        and no frame of ours carried goes alone (at most one per ACK_DELAY_S: acks are batched)."""
        for identity, peer in self.tokenizers.items():
            link = peer.link
            for entry in link.due(now):
                log.warning("resending message %d to tokenizer %s (send %d)", entry.seq,
                            identity.decode(errors="replace"), entry.num_sends)
                self._send_raw(identity, entry.data)
            if link.ack_due(now):
                self._send_raw(identity, ack_frame(self.to_tokenizers, link))

    def _send_raw(self, identity: bytes, payload: bytes) -> None:
        try:
            self.front.send_multipart([identity, payload], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # the peer vanished (ROUTER_MANDATORY) or stopped reading (HWM): the sweep drops it
            self.num_unsent += 1
            log.debug("tokenizer %r unreachable", identity)

    def _fail(self, identity: bytes, request_id: str, status: int, message: str, error_type: str,
              param: str | None = None, code: str | None = None) -> None:
        self._send_tokenizer(identity, RequestFailed(request_id=request_id, status=status, message=message,
                                                     error_type=error_type, param=param, code=code))

    # ---------------------------------------------------------------- workers

    def _on_worker_frames(self, frames: list[zmq.Frame]) -> None:
        frame = single_frame(frames)
        message = self.from_workers.decode(frame) if frame is not None else None
        if message is None:
            return
        self.worker_last_seen = time.monotonic()
        if isinstance(message, StepResult):
            self._on_result(message)
        elif isinstance(message, WorkerReady):
            self._on_worker_ready(message)
        elif isinstance(message, GrammarCompiled):
            self._on_grammar_compiled(message)
        elif isinstance(message, Heartbeat) and message.acked >= -1:
            self._on_ack(message.sender, message.acked, message.gap, message.idle)

    def _on_ack(self, sender: str, acked: int, gap: bool = False, idle: bool = False) -> None:
        """A rank applied every sequenced message up to `acked`: those that expect no result are done once every
        rank has (a rank that missed one must get it again). `gap`: later messages wait at that rank for the one
        after `acked`, which goes again at once (a lost plan costs a round trip, not a resend interval). `idle`:
        the rank has nothing launched and sent every result (_resend_lacked)."""
        if len(self.rank_acked) > 4 * self.engine_config.tensor_parallel_size and sender not in self.rank_acked:
            return  # a rank is named worker<rank>: more names than that are not ranks
        if acked >= 0:
            self.rank_acked[sender] = max(acked, self.rank_acked.get(sender, -1))
            if len(self.rank_acked) >= self.engine_config.tensor_parallel_size:
                self.sends.acked_through(min(self.rank_acked.values()))
        if gap:
            self._resend_now(acked + 1, f"{sender} holds later ones")
        elif idle:
            self._resend_lacked(sender, acked, time.monotonic())

    def _resend_lacked(self, sender: str, acked: int, now: float) -> None:
        """An idle rank lacks what it has not acked of what went out over IDLE_NACK_S ago (a lost message with
        nothing behind it), and rank 0, which sends the results on the same socket as this ack, lost the result
        of every plan it acked that is still waiting for one."""
        for entry in list(self.sends.entries.values()):
            lost_result = (entry.seq <= acked and entry.tag >= 0 and sender == "worker0"
                           and entry.tag not in self.early_results)
            lost_message = entry.seq > acked and now - entry.sent_at >= IDLE_NACK_S
            if lost_result or lost_message:
                self._resend_now(entry.seq, f"{sender} is idle and " + ("sent no result for it" if lost_result
                                                                         else "never applied it"))

    def _resend_now(self, seq: int, why: str) -> None:
        """Send message `seq` again now (SendLog.resend_now: not twice within GAP_RESEND_S)."""
        entry = self.sends.resend_now(seq, time.monotonic())
        if entry is not None:
            log.warning("resending message %d to the workers at once: %s (send %d; step %d)", entry.seq, why,
                        entry.num_sends, entry.tag)
            self.plans.send(entry.data, copy=False)

    def _on_worker_ready(self, ready: WorkerReady) -> None:
        self.ready_ranks.add(ready.rank)
        if ready.rank == 0:
            self.rank0_ready = ready
        if self.scheduler is not None or len(self.ready_ranks) < self.engine_config.tensor_parallel_size:
            return  # every rank must be subscribed before the first plan goes out
        ready = self.rank0_ready
        assert ready is not None
        config = self.engine_config
        self.scheduler = Scheduler(
            num_blocks=ready.num_kv_blocks, block_size=ready.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=ready.max_num_batched_tokens,
            max_model_len=ready.max_model_len, vocab_size=ready.vocab_size,
            eos_token_ids=ready.eos_token_ids,
            enable_prefix_caching=config.enable_prefix_caching,
            max_inflight_plans=ready.max_inflight_plans, num_swap_blocks=ready.num_swap_blocks,
            max_logprob_entries=MAX_LOGPROB_ENTRIES)
        self.pipeline = PlanPipeline(self.scheduler)
        if self.tracer is not None:
            self.scheduler.preemption_log = []
        self.model_info = ModelInfo(max_model_len=ready.max_model_len, vocab_size=ready.vocab_size,
                                    max_num_tokens=ready.num_kv_blocks * ready.block_size,
                                    eos_token_ids=ready.eos_token_ids)
        settle_heap("scheduler")
        log.info("worker ready: %d KV blocks of %d tokens, %d host slots for swapped blocks", ready.num_kv_blocks,
                 ready.block_size, ready.num_swap_blocks)
        for identity in self.tokenizers:
            self._send_tokenizer(identity, self.model_info)

    def _on_result(self, result: StepResult) -> None:
        """Each result completes the oldest plan in flight, in plan order: one that overtook an older plan's waits
        for it; a repeat (the answer to a resent plan, or a duplicated frame) is dropped."""
        pipeline = self.pipeline
        plan = pipeline.oldest() if pipeline is not None else None
        if pipeline is None or plan is None or result.step_id != plan.step_id:
            if pipeline is not None and any(p.step_id == result.step_id for p in pipeline.inflight):
                self.early_results[result.step_id] = result
                # the worker runs plans in order: the older plan's result was lost (or is only late); its plan
                # again brings the worker's cached result
                seq = self.sends.seq_of(plan.step_id) if plan is not None else None
                if seq is not None:
                    self._resend_now(seq, f"the result of step {result.step_id} came first")
            else:
                log.debug("dropped a repeated or stale result for step %d", result.step_id)
            return
        self._apply_result(plan, result)
        while (plan := pipeline.oldest()) is not None and plan.step_id in self.early_results:
            self._apply_result(plan, self.early_results.pop(plan.step_id))

    def _apply_result(self, plan: StepPlan, result: StepResult) -> None:
        pipeline = self.pipeline
        assert pipeline is not None
        now = time.monotonic()
        seq = self.sends.seq_of(plan.step_id)
        resent = seq is not None and self.sends.entries[seq].num_sends > 1
        if seq is not None:
            self.sends.done_through(seq)
        step_s = now - self.inflight_since
        compiling = self._compiling(plan)
        if self.unsampled_constrained and result.seq_ids:
            self.unsampled_constrained.difference_update(result.seq_ids)  # their grammars are compiled now
        if not resent and not compiling:  # a recovered loss, or a compile, is no measure of how long steps take
            self.watch.record(step_s, sum(plan.num_scheduled_tokens))
        self.inflight_since = now  # the next plan in flight starts its clock
        if not result.error and not _columns_agree(result):
            log.error("step %d: the worker's result has columns of different lengths; failing the step",
                      result.step_id)
            result = StepResult(step_id=result.step_id, seq_ids=[], sampled_token_ids=[],
                                error="malformed result (columns of different lengths)")
        if result.failed and not result.error:
            self._fail_rows(result)  # before the tokens: these requests end here, the others go on
        if result.error:
            self._fail_plan(plan, result.error)  # its requests end with an error; later plans skip them
            result = StepResult(step_id=plan.step_id, seq_ids=[], sampled_token_ids=[])
        _, updates = pipeline.complete(result)
        if pipeline.scheduler.last_step_has_prefill:
            self.prefill_step_s += step_s
        else:
            self.decode_step_s += step_s
        self.generation_tokens_total += self._send_deltas(updates, result)
        self.host_s += time.monotonic() - now

    def _fail_plan(self, plan: StepPlan, error: str) -> None:
        """The worker could not run this step: its requests end with an error, and so do the sequences it swapped
        out (their host slots may never have been written; one readmitted since would read them), the rest go
        on."""
        assert self.scheduler is not None
        log.error("step %d failed on the worker: %s", plan.step_id, error)
        seq_ids = [*plan.seq_ids, *self.scheduler.swapped_out_by(plan.step_id)]
        request_ids = {seq.request.request_id for seq_id in seq_ids
                       if (seq := self.scheduler.get_sequence(seq_id)) is not None}
        for request_id in request_ids:
            identity = self.owner.get(request_id)
            if identity is not None:
                self._fail(identity, request_id, 500, f"the worker failed: {error}", "server_error")
            self._abort(request_id)

    def _fail_rows(self, result: StepResult) -> None:
        """Requests the worker dropped from this step alone (a refused value, a sampler error on their row)."""
        assert self.scheduler is not None
        for failure in result.failed:
            seq = self.scheduler.get_sequence(failure.seq_id)
            if seq is None:
                continue  # already finished or aborted
            request_id = seq.request.request_id
            log.error("step %d: request %s failed on the worker: %s", result.step_id, request_id, failure.message)
            identity = self.owner.get(request_id)
            if identity is not None:
                status = failure.status if failure.status in (400, 500) else 500
                self._fail(identity, request_id, status, failure.message,
                           "invalid_request_error" if status == 400 else "server_error",
                           param=failure.param if status == 400 and failure.param else None)
            self._abort(request_id)

    def _send_deltas(self, updates: list[SeqUpdate], result: StepResult) -> int:
        """One TokenDeltas (columns, no per-row structs) per tokenizer that owns a request in this step; returns
        how many updates carry a token."""
        columns: dict[bytes, _Columns] = {}
        with_logprobs = bool(result.sampled_logprobs)
        finished: list[str] = []
        owner = self.owner
        num_tokens = 0
        now = time.monotonic()
        for update in updates:  # once per row and step: no properties, attributes read once
            token_id = update.token_id
            has_token = token_id >= 0
            num_tokens += has_token
            seq = update.seq
            request = seq.request
            if has_token:  # vLLM's phase times (phases.py)
                request.last_token_at = now
                if not request.first_token_at:
                    request.first_token_at = now
            identity = owner.get(request.request_id)
            if identity is None:
                continue
            out = columns.get(identity)
            if out is None:
                out = columns[identity] = _Columns()
            row = len(out.request_ids)
            reason = -1 if update.finish_reason is None else int(update.finish_reason)
            out.request_ids.append(request.request_id)
            out.indices.append(seq.index)
            out.token_ids.append(token_id if has_token else -1)
            out.finish_reasons.append(reason)
            out.num_cached_tokens.append(request.sequences[0].num_cached_tokens)
            if with_logprobs and has_token and request.sampling.logprobs is not None:
                index = update.result_index
                out.logprob_rows.append(row)
                out.logprobs.append(result.sampled_logprobs[index])
                out.top_token_ids.append(result.top_token_ids[index])
                out.top_logprobs.append(result.top_logprobs[index])
            if update.prompt_scores is not None:
                out.prompt_scores.append(update.prompt_scores)
                out.prompt_score_rows.append(row)
            if reason >= 0 and request.num_finished == len(request.sequences):
                finished.append(request.request_id)
        for identity, out in columns.items():
            self._send_tokenizer(identity, TokenDeltas(out.request_ids, out.indices, out.token_ids,
                                                       out.finish_reasons, out.num_cached_tokens, out.logprob_rows,
                                                       out.logprobs, out.top_token_ids, out.top_logprobs,
                                                       out.prompt_scores, out.prompt_score_rows))
        for request_id in finished:
            self._forget(request_id)
        return num_tokens

    # ---------------------------------------------------------------- stats and shutdown

    def _check_progress(self, now: float) -> None:
        """A hung worker: every request gets an error now, /health says why, and this process exits
        (HUNG_EXIT_CODE) so that the launcher stops the server; compose restarts per its policy."""
        if self.problem:
            return
        oldest = self.pipeline.oldest() if self.pipeline is not None else None
        # Timed from the worker's latest sign of life: one that answers heartbeats while a lost plan or result
        # is being sent again is not hung (a wedged one sends nothing).
        self.problem = self.watch.verdict(now, self._step_clock() if oldest is not None else None,
                                          oldest.step_id if oldest is not None else -1,
                                          self.worker_last_seen, self.scheduler is not None,
                                          sum(oldest.num_scheduled_tokens) if oldest is not None else 1,
                                          oldest is not None and self._compiling(oldest))
        if not self.problem:
            return
        log.error("%s; failing %d request(s) and stopping", self.problem, len(self.owner))
        for request_id, identity in list(self.owner.items()):
            self._fail(identity, request_id, 503, self.problem, "server_error")
            self._abort(request_id)
        self.stats_out.send(self.stats_codec.encode(self._stats(now)))
        self.exit_code = HUNG_EXIT_CODE
        self.running = False

    def _compiling(self, plan: StepPlan) -> bool:
        """Whether a constrained sequence of this plan has not sampled yet (its grammar may still compile)."""
        return bool(self.unsampled_constrained) and not self.unsampled_constrained.isdisjoint(plan.seq_ids)

    def _step_clock(self) -> float:
        """Since when the oldest plan in flight counts as running: its send (or its predecessor's result), or the
        worker's latest message if later (idle heartbeats while a lost plan waits for its resend)."""
        return max(self.inflight_since, self.worker_last_seen)

    def _worker_alive(self, now: float) -> bool:
        if self.problem:
            return False
        pipeline = self.pipeline
        if pipeline is not None and pipeline.inflight:
            oldest = pipeline.inflight[0]
            bound = self.watch.bound(sum(oldest.num_scheduled_tokens), self._compiling(oldest))
            return now - self._step_clock() < bound
        return now - self.worker_last_seen < self.watch.idle_bound()  # a late heartbeat is no hang (health.py)

    def _stats(self, now: float) -> SchedulerStats:
        scheduler = self.scheduler
        blocks = scheduler.blocks if scheduler is not None else None
        stats = scheduler.stats if scheduler is not None else None
        running = len({seq.request.request_id for seq in scheduler.running}) if scheduler is not None else 0
        waiting_seqs = [seq for seq in scheduler.waiting if not seq.is_finished] if scheduler is not None else []
        waiting = len({seq.request.request_id for seq in waiting_seqs}) + len(self.grammar_gate)
        preempted = len({seq.request.request_id for seq in waiting_seqs if seq.num_preemptions})
        return SchedulerStats(
            time=time.time(), num_running=running, num_waiting=waiting,
            kv_blocks_free=blocks.num_free_blocks if blocks else 0, kv_blocks_total=blocks.num_blocks if blocks else 0,
            kv_cache_usage=blocks.usage_ratio() if blocks else 0.0,
            prefix_hit_tokens_total=stats.prefix_hit_tokens if stats else 0,
            prefix_query_tokens_total=stats.prefix_query_tokens if stats else 0,
            num_preemptions_total=stats.num_preemptions if stats else 0,
            num_swapped_total=stats.num_swapped if stats else 0,
            prompt_tokens_total=stats.prompt_tokens if stats else 0,
            generation_tokens_total=self.generation_tokens_total,
            num_steps_total=stats.num_steps if stats else 0, worker_ready=scheduler is not None,
            worker_alive=self._worker_alive(now), tokenizer_ids=[i.decode(errors="replace") for i in self.tokenizers],
            tokenizer_requests_total=[peer.num_requests for peer in self.tokenizers.values()],
            max_model_len=self.model_info.max_model_len if self.model_info else 0, problem=self.problem,
            num_preempted=preempted, **self._step_seconds(now), host_seconds_total=self.host_s,
            traces=self.tracer.take() if self.tracer is not None else [], **self._tenant_stats(),
            request_phases=[b.snapshot() for b in self.phases.phases], step_tokens=self.phases.step_tokens.snapshot())

    def _tenant_stats(self) -> dict[str, list]:
        shares = self.scheduler.waiting.tenants if self.scheduler is not None else {}
        held = {request.tenant for request in self.grammar_gate.requests() if request.tenant}
        names = sorted({*self.tenant_queue, *(name for name in shares if name), *held})
        waiting = dict.fromkeys(names, 0)
        if self.scheduler is not None:
            for seq in self.scheduler.waiting:
                if not seq.is_finished and seq.tenant in waiting:
                    waiting[seq.tenant] += 1
        for request in self.grammar_gate.requests():  # held for their constraint: waiting too (as num_waiting)
            if request.tenant in waiting:  # as the queue counts it: one sequence (siblings fork after its prefill)
                waiting[request.tenant] += 1
        return {"tenant_names": names, "tenant_waiting": [waiting[n] for n in names],
                "tenant_running": [shares[n].num_running if n in shares else 0 for n in names],
                "tenant_admitted_total": [int(self.tenant_queue.get(n, (0, 0.0))[0]) for n in names],
                "tenant_queue_seconds_total": [float(self.tenant_queue.get(n, (0, 0.0))[1]) for n in names]}

    def _step_seconds(self, now: float) -> dict[str, float]:
        """The step split's totals, the step in flight counted up to `now` (monotonic): a snapshot is then exact
        whenever it is taken, not only once the step's result is in (the console's shares stay <= 1)."""
        prefill, decode = self.prefill_step_s, self.decode_step_s
        if self.scheduler is not None and self.pipeline is not None and self.pipeline.inflight and not self.problem:
            running = max(0.0, now - self.inflight_since)
            if self.scheduler.oldest_inflight_has_prefill:
                prefill += running
            else:
                decode += running
        return {"prefill_step_seconds_total": prefill, "decode_step_seconds_total": decode}

    def stop(self, *_: object) -> None:
        self.running = False

    def _close(self) -> None:
        try:
            self.plans.send(self.to_workers.encode(Shutdown(reason="scheduler stopping")))
        finally:
            for sock in (self.front, self.plans, self.results, self.stats_out):
                sock.close(linger=0)
            self.registry.close()
            self.context.term()


def run_scheduler(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    service = run_service(server_config, lambda: SchedulerService(engine_config, server_config))
    if service.exit_code:
        sys.exit(service.exit_code)


def _columns_agree(result: StepResult) -> bool:
    """Every per-row column of a StepResult has one entry per request (logprob columns: or none)."""
    num_rows = len(result.seq_ids)
    optional = (result.sampled_logprobs, result.top_token_ids, result.top_logprobs)
    return (len(result.sampled_token_ids) == num_rows and all(len(c) in (0, num_rows) for c in optional)
            and all(len(ids) == len(lps) for ids, lps in zip(result.top_token_ids, result.top_logprobs,
                                                                strict=False))
            and all(len(p.token_ids) == len(p.logprobs) == len(p.top_token_ids) == len(p.top_logprobs)
                    and len(p.ranks) in (0, len(p.token_ids)) for p in result.prompt_scores)
            and all(0 < len(c.token_ids) == len(c.parents) == len(c.scores) for c in result.beam_candidates))
