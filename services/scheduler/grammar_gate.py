"""Requests held out of the batch while the workers compile their constraint (vLLM's WAITING_FOR_FSM).

A step that samples a row whose matcher is still compiling waits for it, and every other row of the batch waits with
it: a 600 KB JSON schema compiles for ~8-11 s on the 2-core host, and every stream froze that long. So the scheduler
sends a large constraint's GrammarDef when its request arrives, the worker compiles it at once and answers
GrammarCompiled, and only then does the request join the queue. Pure bookkeeping: the scheduler service sends and
admits, this decides what waits and for how long.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.services.scheduler.scheduler import Request

GRAMMAR_HOLD_TIMEOUT_S = 120.0  # a request held longer is admitted anyway (a lost GrammarCompiled must not strand
# it; the step then waits for the compile as before). The scheduler allows a step that compiles as long.


@dataclass(slots=True)
class _Held:
    request: Request
    digest: str
    since: float  # time.monotonic() when held


@dataclass(slots=True)
class GrammarGate:
    """Held requests by id, and by the constraint hash they wait for (arrival order)."""

    timeout_s: float = GRAMMAR_HOLD_TIMEOUT_S
    held: dict[str, _Held] = field(default_factory=dict)
    by_digest: dict[str, list[str]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.held

    def requests(self) -> list[Request]:
        """Every held request, in arrival order."""
        return [entry.request for entry in self.held.values()]

    def waits_for(self, digest: str) -> bool:
        return digest in self.by_digest

    def hold(self, request: Request, digest: str, now: float) -> None:
        assert request.request_id not in self.held, request.request_id
        self.held[request.request_id] = _Held(request, digest, now)
        self.by_digest.setdefault(digest, []).append(request.request_id)

    def release(self, digest: str) -> list[Request]:
        """The requests waiting for this constraint, in arrival order: its matcher is built."""
        return [self.held.pop(request_id).request for request_id in self.by_digest.pop(digest, [])]

    def drop(self, request_id: str) -> bool:
        """Forget a held request (aborted); whether it was held."""
        entry = self.held.pop(request_id, None)
        if entry is None:
            return False
        waiting = self.by_digest[entry.digest]
        waiting.remove(request_id)
        if not waiting:
            del self.by_digest[entry.digest]
        return True

    def expired(self, now: float) -> list[Request]:
        """Requests held past timeout_s (their constraints' other requests with them), in arrival order."""
        late = {entry.digest for entry in self.held.values() if now - entry.since >= self.timeout_s}
        return [request for digest in sorted(late, key=self._first_since) for request in self.release(digest)]

    def _first_since(self, digest: str) -> float:
        return self.held[self.by_digest[digest][0]].since
