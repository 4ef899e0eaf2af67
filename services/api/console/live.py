"""The live view's numbers: once a second, what the engine replicas already publish (their SchedulerStats),
this process's latency histograms and tokenizer heartbeats, and the launcher's process table, folded into one
snapshot; the snapshots of the last ten minutes, for the charts; and the SSE subscribers that get each one.

Nothing here asks the scheduler or the worker for anything: the numbers are differences between snapshots
they publish anyway (4 per second), so an open console costs their step loop nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from pagoda.services.api.console.inspector import RequestLog
from pagoda.services.api.console.processes import Observed, ReplicaSeen, TokenizerSeen, process_rows, replica_rows
from pagoda.services.api.console.window import HistogramWindow, History, rate
from pagoda.services.api.metrics import ApiMetrics
from pagoda.services.api.pool import TokenizerPool
from pagoda.services.api.stats import ReplicaStatsFeed
from pagoda.shared.config import ServerConfig
from pagoda.shared.messages import PROCESS_TABLE_FILE, ProcessTable, SchedulerStats

log = logging.getLogger(__name__)

TICK_S = 1.0
RATE_WINDOW_S = 5.0  # rates and shares are averages over this trailing window (a step lands whole in one tick)
HISTORY_TICKS = 600  # ten minutes at one tick a second
LATENCY_WINDOW_S = 60.0
SUBSCRIBER_QUEUE = 4  # ticks a slow SSE client may fall behind before it misses some
HISTORY_FIELDS = ("t", "tokens_in_per_s", "tokens_out_per_s", "requests_per_s", "running", "waiting", "preempted",
                  "kv_blocks_used", "kv_blocks_total", "prefix_hit_rate", "prefill_frac", "decode_frac",
                  "host_frac", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """One tenant's counts, the hook for per-tenant usage (issue #23): a tenant source returns these; totals
    are cumulative counters, turned into per-second rates here."""

    name: str
    running: int = 0
    waiting: int = 0
    requests_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    rejected_total: int = 0


TenantSource = Callable[[], list[TenantUsage]]


def tenants_from_stats(per_replica: list[tuple[str, SchedulerStats]]) -> list[TenantUsage]:
    """The default tenant source: a `tenants` list on SchedulerStats once the scheduler publishes one, each item
    with TenantUsage's field names, summed over replicas. Empty (no section shown) until then."""
    totals: dict[str, dict[str, int]] = {}
    for _, stats in per_replica:
        for item in getattr(stats, "tenants", None) or ():
            row = totals.setdefault(str(item.name), {})
            for name in ("running", "waiting", "requests_total", "prompt_tokens_total", "generation_tokens_total",
                         "rejected_total"):
                row[name] = row.get(name, 0) + int(getattr(item, name, 0) or 0)
    return [TenantUsage(name, **counts) for name, counts in sorted(totals.items())]


class LiveStats:
    """The once-a-second snapshot, its history and its subscribers (one api process)."""

    def __init__(self, config: ServerConfig, feed: ReplicaStatsFeed, metrics: ApiMetrics, pool: TokenizerPool,
                 requests: RequestLog, health: Callable[[], list[str]],
                 tenant_source: TenantSource | None = None) -> None:
        self._config = config
        self._feed = feed
        self._metrics = metrics
        self._pool = pool
        self._requests = requests
        self._health = health
        self._tenant_source = tenant_source or (lambda: tenants_from_stats(feed.per_replica()))
        self._readings: dict[str, deque[SchedulerStats]] = {}  # each replica's snapshots of the last ticks
        self._previous_tenants: dict[str, tuple[float, TenantUsage]] = {}
        self._ttft = HistogramWindow(LATENCY_WINDOW_S)
        self._itl = HistogramWindow(LATENCY_WINDOW_S)
        self.history = History(HISTORY_FIELDS, HISTORY_TICKS)
        self.latest: dict[str, Any] = {}
        self._subscribers: set[asyncio.Queue[bytes | None]] = set()
        self._table_path = Path(config.runtime_dir) / PROCESS_TABLE_FILE if config.runtime_dir else None
        self._table: tuple[float, ProcessTable | None] = (-1.0, None)  # (file mtime, table)
        self._task: asyncio.Task[None] | None = None
        feed.set_on_stats(self._on_stats)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.tick()
        self._task = asyncio.create_task(self._loop(), name="console-live")

    async def close(self) -> None:
        """Stop ticking and end every stream."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for queue in self._subscribers:
            _offer(queue, None)

    async def _loop(self) -> None:
        """A tick every TICK_S on a fixed schedule (a slow tick does not push the later ones back)."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:
            due = max(due + TICK_S, loop.time())
            await asyncio.sleep(due - loop.time())  # a periodic sample, not a wait for something
            try:
                self.tick()
            except Exception:  # one bad tick must not end the live view
                log.exception("console tick failed")

    def subscribe(self) -> asyncio.Queue[bytes | None]:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[bytes | None]) -> None:
        self._subscribers.discard(queue)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def _on_stats(self, stats: SchedulerStats) -> None:
        if stats.traces:
            self._requests.on_traces(stats.traces)

    # ------------------------------------------------------------------ one tick

    def tick(self) -> dict[str, Any]:
        now = time.time()
        per_replica = self._feed.per_replica()
        engine = self._engine(per_replica)
        buckets = self._metrics.latency_buckets()
        self._ttft.add(now, buckets["ttft"])
        self._itl.add(now, buckets["itl"])
        ttft, itl = self._ttft.summary(), self._itl.summary()
        observed = self._observed(per_replica)
        table = self._process_table()
        problems = self._health()
        snapshot = {"t": now, "engine": engine, "latency": {"window_s": LATENCY_WINDOW_S, "ttft_ms": ttft,
                                                            "itl_ms": itl},
                    "replicas": replica_rows(observed, table), "processes": process_rows(observed, table),
                    "tenants": self._tenants(now),
                    "health": {"status": "unavailable" if problems else "ok", "problems": problems},
                    "api": {"index": self._config.api_index, "requests_in_flight": self._pool.num_open,
                            "console_clients": len(self._subscribers)}}
        snapshot["row"] = self.history.add({"t": now, **engine, "ttft_p50_ms": ttft["p50"], "ttft_p99_ms": ttft["p99"],
                                            "itl_p50_ms": itl["p50"], "itl_p99_ms": itl["p99"]})
        self.latest = snapshot
        if self._subscribers:
            event = sse_event("tick", snapshot)
            for queue in self._subscribers:
                _offer(queue, event)
        return snapshot

    def _engine(self, per_replica: list[tuple[str, SchedulerStats]]) -> dict[str, float | None]:
        """Sums over replicas; rates from each replica's counters over the last RATE_WINDOW_S: a throughput is the
        sum of the replicas' rates (the server's), a share of time their mean (deltas over replica-seconds)."""
        deltas = dict.fromkeys(_counters(None), 0.0)
        rates = dict.fromkeys(_counters(None), 0.0)
        elapsed = 0.0  # replica-seconds
        for replica_id, stats in per_replica:
            base = self._base(replica_id, stats)
            if base is None:
                continue  # first sight, or a restarted replica (counters from zero)
            replica_s = stats.time - base.time  # > 0 (_base)
            elapsed += replica_s
            old = _counters(base)
            for name, value in _counters(stats).items():
                delta = max(0.0, value - old[name])  # a tokenizer forgotten takes its count along
                deltas[name] += delta
                rates[name] += delta / replica_s
        for gone in set(self._readings) - {replica_id for replica_id, _ in per_replica}:
            del self._readings[gone]

        def per_s(name: str) -> float | None:
            return rates[name] if elapsed > 0 else None

        def share(name: str) -> float | None:
            # a step is counted whole in the snapshot its result falls in: a share may pass 1 by a step's length
            # over the window
            return min(1.0, deltas[name] / elapsed) if elapsed > 0 else None

        totals = [stats for _, stats in per_replica]
        query = sum(s.prefix_query_tokens_total for s in totals)
        return {
            "running": sum(s.num_running for s in totals), "waiting": sum(s.num_waiting for s in totals),
            "preempted": sum(s.num_preempted for s in totals),
            "kv_blocks_used": sum(s.kv_blocks_total - s.kv_blocks_free for s in totals),
            "kv_blocks_total": sum(s.kv_blocks_total for s in totals),
            "tokens_in_per_s": per_s("prompt_tokens"), "tokens_out_per_s": per_s("generation_tokens"),
            "requests_per_s": per_s("requests"), "steps_per_s": per_s("steps"),
            "preemptions_per_s": per_s("preemptions"), "prefill_frac": share("prefill_s"),
            "decode_frac": share("decode_s"), "host_frac": share("host_s"),
            "prefix_hit_rate": deltas["prefix_hit"] / deltas["prefix_query"] if deltas["prefix_query"] else None,
            "prefix_hit_rate_total": sum(s.prefix_hit_tokens_total for s in totals) / query if query else None,
            "generation_tokens_total": sum(s.generation_tokens_total for s in totals),
            "prompt_tokens_total": sum(s.prompt_tokens_total for s in totals)}

    def _base(self, replica_id: str, stats: SchedulerStats) -> SchedulerStats | None:
        """The reading rates are taken from: the newest one at least RATE_WINDOW_S older than `stats`, else the
        oldest kept; None when there is none (or the counters went back: a restart)."""
        readings = self._readings.setdefault(replica_id, deque())
        if readings and (stats.time < readings[-1].time or _went_back(stats, readings[-1])):
            readings.clear()
        if not readings or stats.time > readings[-1].time:
            readings.append(stats)
        while len(readings) > 2 and readings[1].time <= stats.time - RATE_WINDOW_S:
            readings.popleft()
        base = readings[0]
        return base if base.time < stats.time else None

    def _observed(self, per_replica: list[tuple[str, SchedulerStats]]) -> Observed:
        now = time.monotonic()
        tokenizers = [TokenizerSeen(identity, pid, now - last_seen) for identity, pid, last_seen in self._pool.peers()]
        replicas = [ReplicaSeen(replica_id, feed.latest, feed.age()) for replica_id, feed in
                    sorted(self._feed.feeds.items())]
        config = self._config
        return Observed(config.api_index, os.getpid(), tokenizers, replicas, config.heartbeat_interval,
                        config.heartbeat_timeout)

    def _process_table(self) -> ProcessTable | None:
        """The launcher's table when `pagoda serve` runs this process (re-read when the file changes)."""
        if self._table_path is None:
            return None
        try:
            mtime = self._table_path.stat().st_mtime
            if mtime != self._table[0]:
                self._table = (mtime, msgspec.json.decode(self._table_path.read_bytes(), type=ProcessTable))
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            self._table = (-1.0, None)
        table = self._table[1]
        if table is not None and not Path(f"/proc/{table.launcher_pid}").exists():
            return None  # left behind by a launcher that is gone
        return table

    def _tenants(self, now: float) -> list[dict[str, Any]]:
        rows = []
        seen: dict[str, tuple[float, TenantUsage]] = {}
        for usage in self._tenant_source():
            before = self._previous_tenants.get(usage.name)
            seen[usage.name] = (now, usage)
            elapsed = now - before[0] if before is not None else 0.0

            def per_s(name: str, usage: TenantUsage = usage, before: Any = before, elapsed: float = elapsed) -> Any:
                return None if before is None else rate(getattr(usage, name), getattr(before[1], name), elapsed)

            rows.append({"name": usage.name, "running": usage.running, "waiting": usage.waiting,
                         "requests_per_s": per_s("requests_total"), "tokens_in_per_s": per_s("prompt_tokens_total"),
                         "tokens_out_per_s": per_s("generation_tokens_total"),
                         "rejected_per_s": per_s("rejected_total"), "requests_total": usage.requests_total,
                         "prompt_tokens_total": usage.prompt_tokens_total,
                         "generation_tokens_total": usage.generation_tokens_total})
        self._previous_tenants = seen
        return rows

    def history_event(self) -> bytes:
        """What a new subscriber gets first: the last ten minutes and the latest snapshot."""
        return sse_event("history", {"history": self.history.to_dict(), "latest": self.latest})


def _counters(stats: SchedulerStats | None) -> dict[str, float]:
    """The cumulative counters rates are taken from (all zero for None: their names)."""
    if stats is None:
        return dict.fromkeys(("prompt_tokens", "generation_tokens", "requests", "steps", "preemptions",
                              "prefix_hit", "prefix_query", "prefill_s", "decode_s", "host_s"), 0.0)
    return {"prompt_tokens": stats.prompt_tokens_total, "generation_tokens": stats.generation_tokens_total,
            "requests": sum(stats.tokenizer_requests_total), "steps": stats.num_steps_total,
            "preemptions": stats.num_preemptions_total, "prefix_hit": stats.prefix_hit_tokens_total,
            "prefix_query": stats.prefix_query_tokens_total, "prefill_s": stats.prefill_step_seconds_total,
            "decode_s": stats.decode_step_seconds_total, "host_s": stats.host_seconds_total}


def _went_back(stats: SchedulerStats, previous: SchedulerStats) -> bool:
    """A counter below its previous reading: the replica restarted."""
    return (stats.generation_tokens_total < previous.generation_tokens_total
            or stats.num_steps_total < previous.num_steps_total
            or stats.prompt_tokens_total < previous.prompt_tokens_total)


def sse_event(name: str, payload: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(payload) + b"\n\n"


def _offer(queue: asyncio.Queue[bytes | None], item: bytes | None) -> None:
    """Queue without waiting: a client that falls behind misses ticks rather than holding memory."""
    if item is None:
        while not queue.empty():  # make room for the end marker
            queue.get_nowait()
    if not queue.full():
        queue.put_nowait(item)
