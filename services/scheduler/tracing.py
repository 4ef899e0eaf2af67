"""Per-request timelines for the console's request inspector: when a request was queued, first scheduled,
preempted and re-admitted, and how it ended. Pure bookkeeping: the service passes the clock in.

Costs are per request, never per step or per token: one entry at arrival, one look at each plan's new
admissions (which are per request), one RequestTrace at the end. Finished traces wait (bounded) for the next
stats snapshot, which carries them to the apis.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagoda.services.scheduler.scheduler import Request, Scheduler, Sequence
from pagoda.shared.messages import MAX_TRACE_EVENTS, RequestTrace, StepPlan

MAX_PENDING_TRACES = 1024  # finished traces kept until the next snapshot; older ones are dropped first


@dataclass(slots=True)
class _Open:
    request: Request
    queued_at: float
    scheduled_at: float = 0.0
    preempted_at: list[float] = field(default_factory=list)
    rescheduled_at: list[float] = field(default_factory=list)


@dataclass(slots=True)
class RequestTracer:
    open: dict[str, _Open] = field(default_factory=dict)
    finished: deque[RequestTrace] = field(default_factory=lambda: deque(maxlen=MAX_PENDING_TRACES))
    num_dropped: int = 0  # finished traces that never made it into a snapshot (the bound was reached)

    def on_add(self, request: Request, now: float) -> None:
        self.open[request.request_id] = _Open(request, now)

    def on_plan(self, plan: StepPlan, scheduler: Scheduler, now: float) -> None:
        """A plan went out: its new admissions were scheduled now (first time, or again after a preemption)."""
        for new in plan.new_requests:
            seq = scheduler.get_sequence(new.seq_id)
            entry = self.open.get(seq.request.request_id) if seq is not None else None
            if entry is None:
                continue
            if entry.scheduled_at == 0.0:
                entry.scheduled_at = now
            elif seq is not None and seq.num_preemptions and len(entry.rescheduled_at) < MAX_TRACE_EVENTS:
                entry.rescheduled_at.append(now)

    def on_preempted(self, seqs: Iterable[Sequence], now: float) -> None:
        for seq in seqs:
            entry = self.open.get(seq.request.request_id)
            if entry is not None and len(entry.preempted_at) < MAX_TRACE_EVENTS:
                entry.preempted_at.append(now)

    def on_done(self, request_id: str, now: float) -> None:
        """The request left the scheduler (finished, aborted or failed)."""
        entry = self.open.pop(request_id, None)
        if entry is None:
            return
        request = entry.request
        seqs = request.sequences
        first = seqs[0] if seqs else None
        reason = first.finish_reason if first is not None and first.finish_reason is not None else -1
        if len(self.finished) == self.finished.maxlen:
            self.num_dropped += 1
        self.finished.append(RequestTrace(
            request_id=request_id, queued_at=entry.queued_at, finished_at=now, finish_reason=int(reason),
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=sum(max(0, seq.num_output_tokens) for seq in seqs),
            num_cached_tokens=first.num_cached_tokens if first is not None else 0, scheduled_at=entry.scheduled_at,
            num_preemptions=sum(seq.num_preemptions for seq in seqs), preempted_at=entry.preempted_at,
            rescheduled_at=entry.rescheduled_at))

    def take(self) -> list[RequestTrace]:
        """The finished traces not sent yet, oldest first."""
        out = list(self.finished)
        self.finished.clear()
        return out
