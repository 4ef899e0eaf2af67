"""The worker process: owns the GPU (or CPU), runs one step per plan it receives, rank 0 replies.

    scheduler [PUB] --StepPlan--> [SUB] worker rank r --StepResult (rank 0)--> [PUSH] scheduler [PULL]

Each plan is launched (enqueued on the device) and later finished (its tokens read back), in plan order.
While the oldest launched step runs on the device the loop watches for the next plan: when it comes first,
it is launched before the oldest step is finished, so the device never waits for the host's round trip.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict

import msgspec
import zmq

from pagoda.shared.config import EngineConfig, ServerConfig
from pagoda.shared.delivery import InOrder
from pagoda.shared.heap import settle_heap
from pagoda.shared.messages import (
    GrammarCompiled,
    GrammarDef,
    Heartbeat,
    NewRequest,
    SchedulerToWorker,
    Shutdown,
    StepPlan,
    StructuredOutputs,
    WorkerReady,
    WorkerToScheduler,
)
from pagoda.shared.service_main import run_service
from pagoda.shared.transport import Codec, make_socket, single_frame

log = logging.getLogger(__name__)

FORCE_EXIT_S = 3.0  # after SIGTERM, the loop gets this long to end on its own
CACHED_REPLIES = 16  # results kept by plan sequence number, to answer a resent plan whose result was lost
IDLE_ACK_MS = 20  # idle this long after a step without a new plan: an ack saying so (a lost plan or result shows),
# again after twice as long, and so on up to the heartbeat interval (the scheduler may take longer than this to plan)
COMPILE_POLL_MS = 10  # idle while a GrammarDef compiles: look this often whether it is built (GrammarCompiled)


def _force_exit() -> None:
    log.warning("worker still running %.0f s after SIGTERM: exiting now", FORCE_EXIT_S)
    logging.shutdown()
    os._exit(1)


class WorkerService:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig) -> None:
        self.engine_config = engine_config
        self.config = server_config
        self.rank = server_config.worker_rank
        self.context = zmq.Context()
        # Subscribe before the slow model load so the subscription has long reached the scheduler.
        self.plans = make_socket(self.context, zmq.SUB, server_config.endpoint("plan"), bind=False)
        self.results = make_socket(self.context, zmq.PUSH, server_config.endpoint("result"), bind=False,
                                   role="result")
        self.from_scheduler: Codec[SchedulerToWorker] = Codec(SchedulerToWorker)
        self.to_scheduler: Codec[WorkerToScheduler] = Codec(WorkerToScheduler)
        self.running = True
        self.scheduler_id = ""  # the instance id of the scheduler this worker answers (its probes say it)
        self.order: InOrder[StepPlan | GrammarDef] = InOrder()  # the scheduler's sequenced stream, applied in order
        self.replies: OrderedDict[int, bytes] = OrderedDict()  # plan seq -> its result as sent
        self.seq_of_step: dict[int, int] = {}  # launched plans: step id -> seq
        self.grammar_defs: dict[str, StructuredOutputs] = {}  # constraints by hash (GrammarDef), until evicted
        self.next_idle_ack = 0.0  # while a GrammarDef compiles and nothing runs: when the next idle ack goes
        self.idle_ack_ms: int | None = None  # idle this long without a plan: an ack (IDLE_ACK_MS after a step, then
        # doubling); None: the heartbeat interval
        from pagoda.services.worker.parallel import init_tensor_parallel

        tp = init_tensor_parallel(engine_config, self.rank)
        from pagoda.services.worker.device import limit_served_cpu_threads
        from pagoda.services.worker.model_runner import ModelRunner
        from pagoda.shared.shapes import eos_token_ids

        limit_served_cpu_threads(engine_config)
        self.runner = ModelRunner(engine_config, tp)
        # The model's own EOS ids (config.json, generation_config.json); the tokenizer's reaches the scheduler
        # when a tokenizer registers, and the worker gets what it bans (min_tokens) with each new request.
        self.eos_token_ids = sorted(eos_token_ids(self.runner.arch))
        self.max_inflight_plans = engine_config.resolved_max_inflight_plans(self.runner.device.type)

    def run(self) -> None:
        self._wait_for_subscription()
        if not self.running:
            return
        settle_heap(f"worker rank {self.rank}")
        self._send_ready()
        log.info("worker rank %d ready", self.rank)
        interval_ms = int(self.config.heartbeat_interval * 1000)
        while self.running:
            if self.runner.grammars.preparing:
                self._send_compiled()
            if self.runner.num_launched:
                message = self._message_while_busy()
                if message is None:  # the device finished first: no plan to launch ahead
                    self._finish()
                    continue
            elif self.runner.grammars.preparing and not self.plans.poll(COMPILE_POLL_MS):
                now = time.monotonic()  # looking for built constraints: the idle ack at its usual pace, not each poll
                if now >= self.next_idle_ack:
                    self._send_ack(idle=True)
                    self.next_idle_ack = now + interval_ms / 1000
                continue
            elif not self.plans.poll(self.idle_ack_ms or interval_ms):
                self._send_ack(idle=True)  # the scheduler sends at once what this rank lacks
                if self.idle_ack_ms is not None:
                    self.idle_ack_ms = 2 * self.idle_ack_ms if 2 * self.idle_ack_ms < interval_ms else None
                continue
            else:
                message = self._recv()
            if isinstance(message, StepPlan | GrammarDef):
                self._on_sequenced(message)
            elif isinstance(message, Heartbeat):
                self._on_probe(message.sender)
            elif isinstance(message, Shutdown):
                log.info("worker rank %d: %s", self.rank, message.reason or "shutdown")
                break
        self._close()

    def _on_probe(self, sender: str) -> None:
        """Probes come from a scheduler that has not heard every rank. The same one again (our answer crossed
        its next probe): answer again. Another one (the scheduler restarted): its sequence ids start afresh,
        so the old requests go."""
        if sender != self.scheduler_id:
            log.warning("worker rank %d: a new scheduler (%s, was %s); starting over", self.rank, sender,
                        self.scheduler_id)
            self.scheduler_id = sender
            self.runner.discard_launched()
            self.runner.state.reset()
            self.runner.grammars.reset()
            self._reset_stream()
        self._send_ready()

    def _reset_stream(self) -> None:
        """A new scheduler numbers its stream from 0 and knows none of our constraints."""
        self.order.reset()
        self.replies.clear()
        self.seq_of_step.clear()
        self.grammar_defs.clear()

    def _send_ack(self, idle: bool = False) -> None:
        """What this rank applied, whether later messages wait here for a lost one, and `idle`: nothing launched,
        nothing waiting on the socket (a poll timed out), every result sent. The scheduler then sends what this
        rank lacks, or a plan whose result it lacks, again at once, not on its timer."""
        self._send(Heartbeat(sender=f"worker{self.rank}", acked=self.order.applied_through,
                             gap=bool(self.order.ahead), idle=idle))

    def _on_sequenced(self, message: StepPlan | GrammarDef) -> None:
        """Apply the scheduler's stream once each, in order (shared/delivery.py): an early message waits for the
        gap to fill (the scheduler resends what goes unanswered); a repeat is answered again, never applied."""
        if message.seq < 0:  # an unnumbered plan (tools, tests): as it comes
            ready: list[StepPlan | GrammarDef] | None = [message]
        else:
            ready = self.order.offer(message.seq, message)
        if ready is None:
            cached = self.replies.get(message.seq)
            if cached is not None:
                self._send_data(cached)  # its result was lost on the way
            self._send_ack()
            return
        for item in ready:
            if isinstance(item, GrammarDef):
                for digest in item.evict:
                    self.grammar_defs.pop(digest, None)
                self.grammar_defs[item.hash] = item.constraint
                self.runner.grammars.prepare(item.hash, item.constraint)  # GrammarCompiled once built
                self._send_compiled()
            else:
                self._launch(item)

    def _send_ready(self) -> None:
        runner = self.runner
        self._send(WorkerReady(rank=self.rank, num_kv_blocks=runner.num_blocks, block_size=runner.block_size,
                               max_model_len=runner.max_model_len, vocab_size=runner.arch.vocab_size,
                               eos_token_ids=self.eos_token_ids,
                               max_num_batched_tokens=self.engine_config.resolved_max_num_batched_tokens(
                                   runner.device.type), max_inflight_plans=self.max_inflight_plans,
                               num_swap_blocks=runner.num_swap_blocks))

    def _wait_for_subscription(self) -> None:
        """A PUB drops what it sends before a subscription arrives: wait for the scheduler's probe."""
        while self.running:
            if self.plans.poll(int(self.config.heartbeat_interval * 1000)):
                message = self._recv()
                if isinstance(message, Heartbeat):
                    self.scheduler_id = message.sender
                if message is not None:
                    return

    def _recv(self) -> SchedulerToWorker | None:
        frame = single_frame(self.plans.recv_multipart(copy=False))
        return self.from_scheduler.decode(frame) if frame is not None else None

    def _message_while_busy(self) -> SchedulerToWorker | None:
        """The next message if it arrives before the oldest launched step completes on the device, else None."""
        while not self.runner.step_done():
            if self.runner.grammars.preparing:
                self._send_compiled()
            if self.plans.poll(0):
                message = self._recv()
                if message is not None:
                    return message
        return None

    def _launch(self, plan: StepPlan) -> None:
        """Enqueue the plan's step; a failed launch becomes an error result in its turn (runner.launch)."""
        if self.runner.num_launched >= self.max_inflight_plans:
            self._finish()  # the scheduler sends no more than this ahead; keep the bound anyway
        if plan.seq >= 0:
            self.seq_of_step[plan.step_id] = plan.seq
        self.runner.launch(self._with_constraints(plan))

    def _with_constraints(self, plan: StepPlan) -> StepPlan:
        """New requests name their constraint by hash: put back the one its GrammarDef brought. One that never
        came stays unset with its hash, and admission refuses the request alone (sampling_state.py)."""
        if not any(new.grammar_hash for new in plan.new_requests):
            return plan
        return msgspec.structs.replace(plan, new_requests=[self._constrained(new) for new in plan.new_requests])

    def _constrained(self, new: NewRequest) -> NewRequest:
        constraint = self.grammar_defs.get(new.grammar_hash) if new.grammar_hash else None
        if constraint is None:
            return new
        return msgspec.structs.replace(new, sampling=msgspec.structs.replace(new.sampling,
                                                                             structured_outputs=constraint))

    def _finish(self) -> None:
        result = self.runner.finish()
        seq = self.seq_of_step.pop(result.step_id, -1)
        if self.rank == 0:
            data = self.to_scheduler.encode(result)
            if seq >= 0:
                self.replies[seq] = data
                while len(self.replies) > CACHED_REPLIES:
                    self.replies.popitem(last=False)
            self._send_data(data)
        self.runner.resume()  # a step waiting for grammar masks: result N is out, now N+1's masks fill
        if not self.runner.num_launched:
            self.idle_ack_ms = IDLE_ACK_MS

    def _send_compiled(self) -> None:
        """Tell the scheduler which GrammarDefs' matchers are built: it holds their requests until then."""
        for digest in self.runner.grammars.take_compiled():
            self._send(GrammarCompiled(self.rank, digest))

    def _send(self, message: WorkerToScheduler) -> None:
        self._send_data(self.to_scheduler.encode(message))

    def _send_data(self, data: bytes) -> None:
        """Never blocks the step loop: with the scheduler's queue at its high-water mark the message is dropped (a
        lost result: the scheduler sends that plan again)."""
        try:
            self.results.send(data, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("worker rank %d: dropped a message: the scheduler is not taking results", self.rank)

    def stop(self, *_: object) -> None:
        self.running = False
        # Whatever the loop is blocked in (a long step, a send nobody takes), the process ends soon.
        timer = threading.Timer(FORCE_EXIT_S, _force_exit)
        timer.daemon = True
        timer.start()

    def _close(self) -> None:
        self.runner.grammars.close()  # its process, if any, ends now (no orphan)
        self.plans.close(linger=0)
        self.results.close(linger=0)
        self.context.term()


def run_worker(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    run_service(server_config, lambda: WorkerService(engine_config, server_config))
