"""The step loop, schedule -> launch -> finish -> update, with up to `max_inflight_plans` plans launched ahead.

    schedule N -> launch N -> schedule N+1 -> launch N+1 -> finish N -> update N -> schedule N+2 -> ...

The offline engine runs it with an in-process runner (`run_step`: launch and finish are calls); the scheduler
service runs the same bookkeeping over sockets (launch = send the plan, finish = its result arriving).
Results come back in plan order. No torch, no zmq.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.services.scheduler.scheduler import Scheduler, SeqUpdate
from pagoda.shared.messages import StepPlan, StepResult


@dataclass(slots=True)
class PlanPipeline:
    """Plans sent to the runner whose results have not been applied, oldest first."""

    scheduler: Scheduler
    inflight: deque[StepPlan] = field(default_factory=deque)

    def wants_plan(self) -> bool:
        """Another plan may be scheduled now: there is work (or ended sequences the worker should drop) and room
        in flight."""
        scheduler = self.scheduler
        return ((scheduler.has_unfinished() or scheduler.has_unsent_drops())
                and len(self.inflight) < scheduler.max_inflight_plans)

    def schedule(self) -> StepPlan:
        """The next plan; one with requests is in flight until complete() gets its result."""
        plan = self.scheduler.schedule()
        if plan.seq_ids:  # a plan of forgotten ids only gets no result
            self.inflight.append(plan)
        assert len(self.inflight) == self.scheduler.num_inflight
        return plan

    def oldest(self) -> StepPlan | None:
        return self.inflight[0] if self.inflight else None

    def complete(self, result: StepResult) -> tuple[StepPlan, list[SeqUpdate]]:
        """Apply the oldest plan's result (the caller checked result.step_id against oldest())."""
        plan = self.inflight.popleft()
        assert result.step_id == plan.step_id, "results come back in plan order"
        return plan, self.scheduler.update(plan, result)

    def cancel(self) -> None:
        """Results will never come (the runner was reset): abort what those plans ran."""
        self.inflight.clear()
        self.scheduler.cancel_inflight()


def run_step(pipeline: PlanPipeline, launch: Callable[[StepPlan], bool],
             finish: Callable[[], StepResult]) -> tuple[StepResult, list[SeqUpdate]] | None:
    """One turn: schedule and launch while plans may be in flight, then finish and apply the oldest.

    `launch` returns whether the plan will have a result from `finish`. None: nothing was in flight.
    """
    while pipeline.wants_plan():
        plan = pipeline.schedule()
        launched = launch(plan)
        assert launched == bool(plan.seq_ids), "the runner answers exactly the plans that run requests"
        if not plan.seq_ids and (pipeline.inflight or not plan.finished_seq_ids):
            break  # nothing runnable now: finish what is in flight first
        # else a plan that only dropped sequences with nothing in flight (the only runner was preempted, and that
        # plan admits nothing): what waits may fit now, so schedule again, as the service's loop does
    if not pipeline.inflight:
        return None
    result = finish()
    _, updates = pipeline.complete(result)
    return result, updates


def settle_idle(pipeline: PlanPipeline, launch: Callable[[StepPlan], bool], finish: Callable[[], StepResult]) -> None:
    """With no request left: take the results of plans still in flight (their sequences ended: nothing in them is
    delivered) and send the plan that tells the runner to drop the ended sequences (rows, sampling state, grammar
    matchers), so that an idle engine holds no sequence's state until the next request instead of after it."""
    if pipeline.scheduler.has_unfinished():
        return
    while pipeline.inflight:
        pipeline.complete(finish())
    if pipeline.wants_plan():
        plan = pipeline.schedule()
        assert not plan.seq_ids
        launch(plan)
