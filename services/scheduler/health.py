"""Is the worker making progress? Step times measured, a bound derived from them, and a verdict.

A worker that is alive but stuck (SIGSTOP, a wedged device, a deadlock) still holds its sockets open:
only the time a step takes, against what steps usually take, tells. An idle worker is held to the same bound:
its heartbeats come late whenever the host is busy (seen: a 3 s heartbeat timeout fired under CPU load on a
healthy worker), and a worker that hangs while idle keeps no client waiting: the next step it is sent is
timed like any other. A dead worker is the launcher's to see (its process exits). Pure logic: no zmq, no clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

STEP_HISTORY = 256  # recent step durations the bound is derived from
BOUND_FACTOR = 10.0  # a step this many times slower than the slowest recent one counts as hung
WARMUP_STEPS = 8  # until this many steps are measured, the derived bound is at least WARMUP_BOUND_S:
WARMUP_BOUND_S = 120.0  # first steps allocate and warm caches (seen: 10 s for step 1 on a loaded CPU)
LARGE_STEP_TOKENS = 64  # steps of at least this many tokens give the per-token time a long prefill is held to
RESEND_FACTOR = 3.0  # a plan unanswered this many times what such a step usually takes is sent again
RESEND_FLOOR_S = 0.5  # ... but never sooner than this
WARMUP_RESEND_S = 5.0  # ... nor, until WARMUP_STEPS are measured, sooner than this: first steps take seconds (warm-up,
# compiles), and a worker that lacks a plan says so at once anyway (its gap or idle acknowledgement)
RESEND_QUANTILE = 0.9  # "usually": this quantile of the recent steps, so that a few slow ones (a warm-up, a long
# prefill, a CPU hiccup) do not make every lost plan of the next STEP_HISTORY steps wait for them
TYPICAL_REFRESH = 16  # the quantiles are recomputed after this many new steps (a sort of STEP_HISTORY floats)
COMPILE_BOUND_S = 120.0  # a step where a constrained row first samples may wait for its grammar to compile
IDLE_BOUND_S = 30.0  # an idle worker's silence counts as a hang only past this (or the step bound, if longer):
# no client waits on an idle worker, and a loaded host delays heartbeats by seconds


@dataclass(slots=True)
class StepWatch:
    """The bound on one step: `step_timeout` when set, else max(floor, BOUND_FACTOR x the slowest recent step,
    BOUND_FACTOR x the slowest recent time per token x this step's tokens) (a long prefill after short decode
    steps is not a hang). The time per token is that of large steps; until one is measured, that of the smaller
    ones (their fixed cost makes it an overestimate: the first long prefill after short chats is no hang either).
    Once warmed up the floor (seconds, --hang-floor) is what bounds an idle-fast worker."""

    step_timeout: float = 0.0  # fixed bound in seconds; 0: derived from measured steps
    floor: float = 8.0  # a derived bound is never below this (a loaded host, a late heartbeat)
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))
    per_token: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))  # seconds per token
    # seconds per token of the steps below LARGE_STEP_TOKENS: the bound's time per token until a large step is measured
    small_per_token: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_HISTORY))
    _typical: tuple[float, float, float] | None = None  # _typical_times(); None: to be recomputed
    _records_since_typical: int = 0

    def record(self, seconds: float, num_tokens: int = 1) -> None:
        self.durations.append(seconds)
        if num_tokens >= LARGE_STEP_TOKENS:
            self.per_token.append(seconds / num_tokens)
        else:
            self.small_per_token.append(seconds / max(num_tokens, 1))
        self._records_since_typical += 1
        if self._records_since_typical >= TYPICAL_REFRESH or len(self.durations) <= 2 * TYPICAL_REFRESH:
            self._typical = None  # few steps measured yet: each one counts at once

    def bound(self, num_tokens: int = 1, compiling: bool = False) -> float:
        """`compiling`: a constrained row of this step samples for the first time (the worker compiles grammars
        off its loop, but the row's first mask waits for it: seconds of CPU, more on a loaded host)."""
        if self.step_timeout > 0:
            return self.step_timeout
        slowest = max(self.durations, default=0.0)
        by_tokens = max(self.per_token or self.small_per_token, default=0.0) * num_tokens
        warmup = WARMUP_BOUND_S if len(self.durations) < WARMUP_STEPS else 0.0
        compile_s = COMPILE_BOUND_S if compiling else 0.0
        return max(self.floor, BOUND_FACTOR * max(slowest, by_tokens), warmup, compile_s)

    def idle_bound(self) -> float:
        return self.step_timeout if self.step_timeout > 0 else max(self.bound(), IDLE_BOUND_S)

    def resend_after(self, num_tokens: int = 1, compiling: bool = False) -> float:
        """How long a sequenced message to the worker may go unanswered before it is sent again: RESEND_FACTOR x
        what a step of num_tokens usually takes, never more than the slowest recent step: the RESEND_QUANTILE of
        recent steps, or for a long prefill that of their time per token x num_tokens. A resend that comes early is
        harmless (the worker applies each message once and answers a repeat with its cached reply; the waits
        double); one that comes late stalls every request of the plan, unless the worker shows the loss first (a gap
        or idle acknowledgement, an early result: services/scheduler/service.py). `compiling` (a constrained row
        samples first, its grammar may still compile): the slowest recent step."""
        typical_step, typical_per_token, slowest = self._typical_times()
        expected = slowest if compiling else max(typical_step, min(typical_per_token * num_tokens, slowest))
        floor = WARMUP_RESEND_S if len(self.durations) < WARMUP_STEPS else RESEND_FLOOR_S
        return max(floor, RESEND_FACTOR * expected)

    def _typical_times(self) -> tuple[float, float, float]:
        """(RESEND_QUANTILE of durations, the same of per_token, the slowest duration), refreshed every
        TYPICAL_REFRESH records."""
        if self._typical is None:
            self._typical = (quantile(self.durations, RESEND_QUANTILE), quantile(self.per_token, RESEND_QUANTILE),
                             max(self.durations, default=0.0))
            self._records_since_typical = 0
        return self._typical

    def verdict(self, now: float, step_started_at: float | None, step_id: int, worker_last_seen: float,
                ready: bool, num_tokens: int = 1, compiling: bool = False) -> str:
        """Why the worker counts as hung, or "" while it makes progress.

        step_started_at: when the step in flight went out (None: no step in flight);
        worker_last_seen: when any message (result, heartbeat) last came from it."""
        if not ready:
            return ""  # loading weights: no progress to expect yet
        if step_started_at is not None:
            running_s = now - step_started_at
            bound = self.bound(num_tokens, compiling)
            if running_s > bound:
                return (f"the worker is hung: step {step_id} has run {running_s:.1f} s (bound {bound:.1f} s, "
                        f"slowest recent step {max(self.durations, default=0.0):.2f} s)")
            return ""
        silent_s = now - worker_last_seen
        if silent_s > self.idle_bound():
            return f"the worker is hung: idle and silent for {silent_s:.1f} s (bound {self.idle_bound():.1f} s)"
        return ""


def quantile(values: deque[float], q: float) -> float:
    """The q-quantile of values (the nearest rank at or above q), 0.0 when there are none."""
    assert 0.0 <= q <= 1.0
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
