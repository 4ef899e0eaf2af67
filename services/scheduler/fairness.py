"""Weighted fair share among tenants: whose waiting sequence is admitted next, and whose running one gives way.

A tenant's load is its running sequences divided by its weight. Admission takes the head of the tenant that is
first by (priority tier, load, the head's arrival): tenants of a lower tier first, then the least loaded one
relative to its weight, so a tenant that floods the queue gets its share of the running slots and no more while
others wait. Within a tenant, sequences keep their rank order (the request's priority, then arrival).

    tenant A (weight 1): [a5 a6 a7 ... a199]   running a0..a4   load 5
    tenant B (weight 1): [b0]                  running -        load 0   -> b0 is admitted next

A tenant below its share may take a running slot from one above it (`may_take`): after the move the taker is
still at or below the giver, so two tenants never trade a slot back and forth. With a single tenant every
decision is the plain rank order. Pure logic: no zmq, no torch, no clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

Rank = tuple[int, float, int]  # (request priority, arrival, sequence id): smaller runs first
MIN_WEIGHT, MAX_WEIGHT = 1e-3, 1e6
MAX_TENANT_CHARS = 128
MAX_TIER = 1 << 20  # tenant priority tiers are small ints; the bound keeps a forged one harmless


class Queued(Protocol):
    """What the queue needs of a sequence (the scheduler's Sequence)."""

    rank: Rank

    @property
    def tenant(self) -> str: ...

    @property
    def is_finished(self) -> bool: ...


@dataclass(slots=True)
class TenantShare:
    """One tenant's standing: its weight and tier (latest request's), running count and waiting heap."""

    name: str
    weight: float = 1.0
    tier: int = 0  # the key file's priority: lower tiers are served before higher ones
    num_running: int = 0
    heap: list[tuple[Rank, Queued]] = field(default_factory=list)

    def load(self, extra: int = 0) -> float:
        return (self.num_running + extra) / self.weight


def may_take(taker: TenantShare, giver: TenantShare, extra: int = 1) -> bool:
    """Whether `taker` may have one of `giver`'s running slots: a better tier, or the same tier and after the move
    the taker's load is still at most the giver's. `extra`: 1 for a slot the taker does not hold yet (admission),
    0 for one it holds (a running sequence that needs blocks)."""
    if taker is giver or giver.num_running == 0:
        return False
    if taker.tier != giver.tier:
        return taker.tier < giver.tier
    return (taker.num_running + extra) / taker.weight <= (giver.num_running - 1) / giver.weight


class FairQueue:
    """The waiting sequences, a heap per tenant; `head()` is the next one to admit."""

    def __init__(self) -> None:
        self.tenants: dict[str, TenantShare] = {}
        self._num_entries = 0  # heap entries, finished ones not yet skipped included

    def __len__(self) -> int:
        return self._num_entries

    def __iter__(self) -> Iterator[Queued]:
        for tenant in self.tenants.values():
            for _, seq in tenant.heap:
                yield seq

    def share(self, name: str, weight: float = 1.0, tier: int = 0) -> TenantShare:
        """The tenant's record, made on first sight; its weight and tier follow its latest request."""
        assert MIN_WEIGHT <= weight <= MAX_WEIGHT and abs(tier) <= MAX_TIER, "checked where the request entered"
        tenant = self.tenants.get(name)
        if tenant is None:
            tenant = self.tenants[name] = TenantShare(name)
        tenant.weight, tenant.tier = weight, tier
        return tenant

    def push(self, seq: Queued, weight: float = 1.0, tier: int = 0) -> None:
        """Queue `seq` under its tenant, whose weight and tier become these."""
        heapq.heappush(self.share(seq.tenant, weight, tier).heap, (seq.rank, seq))
        self._num_entries += 1

    def head(self, reserved: dict[str, int] | None = None) -> Queued | None:
        """The next sequence to admit (finished ones are dropped on the way), or None. `reserved`: slots already
        promised to tenants this step, counted in their load; a tenant with as many as it has waiting is passed
        over (the head returned is then the tenant's first, standing for the next of its queue)."""
        best: TenantShare | None = None
        best_key: tuple[int, float, float, int] | None = None
        for tenant in self.tenants.values():
            extra = reserved.get(tenant.name, 0) if reserved else 0
            if not self._skip_finished(tenant) or extra >= len(tenant.heap):
                continue
            _, arrival, seq_id = tenant.heap[0][0]  # a request's priority orders its own tenant's only
            key = (tenant.tier, tenant.load(extra), arrival, seq_id)
            if best_key is None or key < best_key:
                best, best_key = tenant, key
        return best.heap[0][1] if best is not None else None

    def pop(self, seq: Queued) -> None:
        """Remove `seq`, which head() just returned."""
        tenant = self.tenants[seq.tenant]
        assert tenant.heap and tenant.heap[0][1] is seq, "pop the head"
        heapq.heappop(tenant.heap)
        self._num_entries -= 1

    def _skip_finished(self, tenant: TenantShare) -> bool:
        """Drop finished sequences (aborted while waiting) from the top of the tenant's heap; True if any is left."""
        heap = tenant.heap
        while heap and heap[0][1].is_finished:
            heapq.heappop(heap)
            self._num_entries -= 1
        return bool(heap)

    def forget_idle(self, name: str) -> None:
        """Drop a tenant's record once it has nothing running and nothing waiting (bounded memory)."""
        tenant = self.tenants.get(name)
        if tenant is not None and tenant.num_running == 0 and not self._skip_finished(tenant):
            del self.tenants[name]
