"""The scheduler's latest SchedulerStats, received on a SUB socket, for /metrics and /health."""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from pagoda.shared.messages import SchedulerStats, SchedulerToApi
from pagoda.shared.transport import Codec, make_socket, receive_forever, single_frame

log = logging.getLogger(__name__)


class StatsFeed:
    """Keeps only the newest snapshot; its age is measured on this host's clock, so skew cannot fake health."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str) -> None:
        self._sock = make_socket(context, zmq.SUB, endpoint, bind=False)
        self._codec: Codec[SchedulerToApi] = Codec(SchedulerToApi)
        self.latest: SchedulerStats | None = None
        self._received_at = 0.0  # time.monotonic() of `latest`
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._recv_loop(), name="stats-recv")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close(linger=0)

    def age(self) -> float | None:
        """Seconds since the latest snapshot arrived; None before the first one."""
        return None if self.latest is None else time.monotonic() - self._received_at

    async def _recv_loop(self) -> None:
        async for frames in receive_forever(self._sock, "stats"):
            frame = single_frame(frames)
            stats = None if frame is None else self._codec.decode(frame)
            if isinstance(stats, SchedulerStats):
                self.latest = stats
                self._received_at = time.monotonic()


class ReplicaStatsFeed:
    """One StatsFeed per engine replica (list index = replica id). `latest` and `age()` describe the live
    replicas together, so /health is 200 while one serves; `per_replica()` feeds the labelled metrics."""

    def __init__(self, context: zmq.asyncio.Context, endpoints: list[str], heartbeat_timeout: float) -> None:
        assert endpoints
        self.feeds = [StatsFeed(context, endpoint) for endpoint in endpoints]
        self._timeout = heartbeat_timeout

    def start(self) -> None:
        for feed in self.feeds:
            feed.start()

    async def close(self) -> None:
        for feed in self.feeds:
            await feed.close()

    def _serving(self, feed: StatsFeed) -> bool:
        age, stats = feed.age(), feed.latest
        return (age is not None and age <= self._timeout and stats is not None and stats.worker_ready
                and stats.worker_alive and not stats.problem)

    def down(self) -> list[str]:
        """Replicas that are not serving, each with why (empty with a single replica: /health says it all)."""
        if len(self.feeds) == 1:
            return []
        out = []
        for index, feed in enumerate(self.feeds):
            if not self._serving(feed):
                age, stats = feed.age(), feed.latest
                why = ("no stats yet" if age is None else f"stats {age:.1f} s old" if age > self._timeout
                       else (stats.problem if stats is not None and stats.problem else "worker not ready or alive"))
                out.append(f"replica {index}: {why}")
        return out

    def age(self) -> float | None:
        ages = [age for feed in self.feeds if (age := feed.age()) is not None]
        return min(ages) if ages else None

    @property
    def latest(self) -> SchedulerStats | None:
        if len(self.feeds) == 1:
            return self.feeds[0].latest
        serving = [feed.latest for feed in self.feeds if self._serving(feed)]
        if serving:
            return combine_stats([s for s in serving if s is not None])
        fresh = [feed.latest for feed in self.feeds if feed.latest is not None]
        return combine_stats(fresh) if fresh else None  # none serves: the sum still carries the problems

    def per_replica(self) -> list[tuple[str, SchedulerStats]]:
        return [(str(index), feed.latest) for index, feed in enumerate(self.feeds) if feed.latest is not None]


def combine_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Several replicas as one: counts summed, ready/alive if any is, a problem only if every one has one."""
    assert stats
    totals = {name: sum(getattr(s, name) for s in stats) for name in (
        "num_running", "num_waiting", "kv_blocks_free", "kv_blocks_total", "prefix_hit_tokens_total",
        "prefix_query_tokens_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
        "num_steps_total")}
    tokenizers: dict[str, int] = {}
    for s in stats:
        for tokenizer_id, count in zip(s.tokenizer_ids, s.tokenizer_requests_total, strict=False):
            tokenizers[tokenizer_id] = tokenizers.get(tokenizer_id, 0) + count
    healthy = [s for s in stats if not s.problem]
    usage = 1.0 - totals["kv_blocks_free"] / totals["kv_blocks_total"] if totals["kv_blocks_total"] else 0.0
    return SchedulerStats(
        time=max(s.time for s in stats), kv_cache_usage=usage, **totals,
        worker_ready=any(s.worker_ready for s in stats), worker_alive=any(s.worker_alive for s in stats),
        tokenizer_ids=list(tokenizers), tokenizer_requests_total=list(tokenizers.values()),
        max_model_len=max(s.max_model_len for s in stats),
        problem="" if healthy else "; ".join(f"replica: {s.problem}" for s in stats))
