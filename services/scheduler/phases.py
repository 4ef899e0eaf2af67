"""vLLM's request phase times and per-step token counts, kept as bucket counts for the stats snapshot.

A request's phases, on this process's monotonic clock: queue (its AddRequest arrived to its first admission to a
step), prefill (first admission to its first token), decode (first token to last), inference (first admission to
last token); a preemption's wait counts in the phase it interrupts, as in vLLM. The service stamps the times on the
Request (scheduler.py); per row and step that costs two attribute writes, no lookup.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from pagoda.services.scheduler.scheduler import Request, Scheduler
from pagoda.shared.messages import (
    REQUEST_PHASE_BUCKETS_S,
    REQUEST_PHASES,
    STEP_TOKEN_BUCKETS,
    HistogramCounts,
    StepPlan,
)


@dataclass(slots=True)
class Buckets:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, one more than the bounds (the last: above them)
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # Prometheus' `le`: a value on a bound counts in it
        self.sum += value

    def snapshot(self) -> HistogramCounts:
        return HistogramCounts(counts=list(self.counts), sum=self.sum)


class PhaseClock:
    """Open requests by id (to find each one when it leaves) and the histograms of those that left."""

    def __init__(self) -> None:
        self.open: dict[str, Request] = {}
        self.phases = [Buckets(REQUEST_PHASE_BUCKETS_S) for _ in REQUEST_PHASES]
        self.step_tokens = Buckets(tuple(float(b) for b in STEP_TOKEN_BUCKETS))

    def on_add(self, request: Request, now: float) -> None:
        request.queued_at = now
        self.open[request.request_id] = request

    def on_plan(self, plan: StepPlan, scheduler: Scheduler, now: float) -> None:
        """A plan goes out: the tokens it schedules, and its first-time admissions' start."""
        if plan.seq_ids:
            self.step_tokens.observe(sum(plan.num_scheduled_tokens))
        for new in plan.new_requests:
            seq = scheduler.get_sequence(new.seq_id)
            if seq is not None and not seq.request.scheduled_at:
                seq.request.scheduled_at = now

    def on_done(self, request_id: str) -> None:
        """The request left (finished, aborted or failed): each phase it reached is observed, none made up (one
        that never ran has no prefill, one that never sampled no decode)."""
        request = self.open.pop(request_id, None)
        if request is None or not request.scheduled_at:
            return
        queue, prefill, decode, inference = self.phases
        queue.observe(max(0.0, request.scheduled_at - request.queued_at))
        if request.first_token_at:
            prefill.observe(max(0.0, request.first_token_at - request.scheduled_at))
            decode.observe(max(0.0, request.last_token_at - request.first_token_at))
            inference.observe(max(0.0, request.last_token_at - request.scheduled_at))
