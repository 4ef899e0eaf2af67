"""The scheduler's latest SchedulerStats, received on a SUB socket, for /metrics and /health."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from pagoda.shared.messages import SchedulerStats, SchedulerToApi
from pagoda.shared.transport import Codec, cancel_all, make_socket, receive_forever, single_frame

log = logging.getLogger(__name__)


OnStats = Callable[[SchedulerStats], None]


class StatsFeed:
    """Keeps only the newest snapshot; its age is measured on this host's clock, so skew cannot fake health.
    `on_stats` (the console) sees every snapshot as it arrives, for what one carries once (request traces)."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str, on_stats: OnStats | None = None) -> None:
        self._sock = make_socket(context, zmq.SUB, endpoint, bind=False)
        self._codec: Codec[SchedulerToApi] = Codec(SchedulerToApi)
        self.latest: SchedulerStats | None = None
        self._received_at = 0.0  # time.monotonic() of `latest`
        self._task: asyncio.Task[None] | None = None
        self.on_stats = on_stats

    def start(self) -> None:
        self._task = asyncio.create_task(self._recv_loop(), name="stats-recv")

    async def close(self) -> None:
        if self._task is not None:
            await cancel_all([self._task])
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
                if self.on_stats is not None:
                    try:
                        self.on_stats(stats)
                    except Exception:  # the console's bookkeeping must never stop health and metrics
                        log.exception("the stats hook failed")


FORGET_AFTER_S = 60.0  # a replica the registry no longer lists is reported down this long, then forgotten


class ReplicaStatsFeed:
    """One StatsFeed per engine replica, keyed by replica id: a fixed list (index = replica id), or what the
    registry lists (watch()). `latest` and `age()` describe the live replicas together, so /health is 200
    while one serves; `per_replica()` feeds the labelled metrics."""

    def __init__(self, context: zmq.asyncio.Context, endpoints: list[str], heartbeat_timeout: float) -> None:
        self._context = context
        self.feeds: dict[str, StatsFeed] = {str(i): StatsFeed(context, e) for i, e in enumerate(endpoints)}
        self._endpoints: dict[str, str] = {str(i): e for i, e in enumerate(endpoints)}
        self._timeout = heartbeat_timeout
        self._started = False
        self._closing: set[asyncio.Task[None]] = set()
        self._on_stats: OnStats | None = None

    def set_on_stats(self, on_stats: OnStats) -> None:
        """Every replica's snapshots, as they arrive, also go to `on_stats` (replicas that join later too)."""
        self._on_stats = on_stats
        for feed in self.feeds.values():
            feed.on_stats = on_stats

    def start(self) -> None:
        self._started = True
        for feed in self.feeds.values():
            feed.start()

    async def close(self) -> None:
        for feed in self.feeds.values():
            await feed.close()
        await asyncio.gather(*self._closing, return_exceptions=True)

    def watch(self, endpoints: dict[str, str]) -> None:
        """The registry's replicas (id -> stats address): subscribe to new ones (or a moved one's new address);
        one no longer listed stays (reported down) until its stats are FORGET_AFTER_S old."""
        for replica_id, endpoint in endpoints.items():
            if self._endpoints.get(replica_id) == endpoint:
                continue
            self._drop(replica_id)
            log.info("watching replica %s's stats at %s", replica_id, endpoint)
            feed = self.feeds[replica_id] = StatsFeed(self._context, endpoint, self._on_stats)
            self._endpoints[replica_id] = endpoint
            if self._started:
                feed.start()
        for replica_id in [r for r in self.feeds if r not in endpoints]:
            age = self.feeds[replica_id].age()
            if age is None or age > FORGET_AFTER_S:
                log.info("forgot replica %s (no longer registered)", replica_id)
                self._drop(replica_id)

    def _drop(self, replica_id: str) -> None:
        feed = self.feeds.pop(replica_id, None)
        self._endpoints.pop(replica_id, None)
        if feed is not None:
            task = asyncio.ensure_future(feed.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _serving(self, feed: StatsFeed) -> bool:
        age, stats = feed.age(), feed.latest
        return (age is not None and age <= self._timeout and stats is not None and stats.worker_ready
                and stats.worker_alive and not stats.problem)

    def down(self) -> list[str]:
        """Replicas that are not serving, each with why (empty with a single replica: /health says it all)."""
        if len(self.feeds) <= 1:
            return []
        out = []
        for replica_id, feed in sorted(self.feeds.items()):
            if not self._serving(feed):
                age, stats = feed.age(), feed.latest
                why = ("no stats yet" if age is None else f"stats {age:.1f} s old" if age > self._timeout
                       else (stats.problem if stats is not None and stats.problem else "worker not ready or alive"))
                out.append(f"replica {replica_id}: {why}")
        return out

    def age(self) -> float | None:
        ages = [age for feed in self.feeds.values() if (age := feed.age()) is not None]
        return min(ages) if ages else None

    @property
    def latest(self) -> SchedulerStats | None:
        feeds = list(self.feeds.values())
        if len(feeds) == 1:
            return feeds[0].latest
        serving = [feed.latest for feed in feeds if self._serving(feed)]
        if serving:
            return combine_stats([s for s in serving if s is not None])
        fresh = [feed.latest for feed in feeds if feed.latest is not None]
        return combine_stats(fresh) if fresh else None  # none serves: the sum still carries the problems

    def per_replica(self) -> list[tuple[str, SchedulerStats]]:
        return [(replica_id, feed.latest) for replica_id, feed in sorted(self.feeds.items())
                if feed.latest is not None]


def combine_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """Several replicas as one: counts summed, ready/alive if any is, a problem only if every one has one."""
    assert stats
    totals = {name: sum(getattr(s, name) for s in stats) for name in (
        "num_running", "num_waiting", "kv_blocks_free", "kv_blocks_total", "prefix_hit_tokens_total",
        "prefix_query_tokens_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
        "num_steps_total", "num_preempted", "prefill_step_seconds_total", "decode_step_seconds_total",
        "host_seconds_total", "num_swapped_total")}
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
