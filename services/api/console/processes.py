"""Each process and replica with its state, from what this api sees (tokenizer heartbeats, each replica's
stats and their age) and, under `pagoda serve`, the launcher's process table (pids, restarts, stopped).

States: ok | starting (never seen ready yet) | restarting (replaced by the launcher, the new one not seen yet)
| hung (stopped, silent or past its step bound) | down (a replica the launcher gave up on, or one whose restarts
keep failing at start: shown restarting while its next start waits). Pure: the caller
passes everything in, clocks included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.shared.messages import ProcessEntry, ProcessTable, SchedulerStats

OK, STARTING, RESTARTING, HUNG, DOWN = "ok", "starting", "restarting", "hung", "down"
TOKENIZER_LATE_BEATS = 3  # a tokenizer silent for this many heartbeat intervals is shown hung (its peers
# drop it only at heartbeat_timeout)


@dataclass(frozen=True, slots=True)
class TokenizerSeen:
    identity: str
    pid: int
    silent_s: float  # since its latest message to this api


@dataclass(frozen=True, slots=True)
class ReplicaSeen:
    replica_id: str
    stats: SchedulerStats | None
    age_s: float | None  # of `stats`, on this host's clock


@dataclass(frozen=True, slots=True)
class Observed:
    """What this api process knows at one tick."""

    api_index: int
    api_pid: int
    tokenizers: list[TokenizerSeen]
    replicas: list[ReplicaSeen]
    heartbeat_interval: float
    heartbeat_timeout: float


def process_rows(observed: Observed, table: ProcessTable | None) -> list[dict[str, Any]]:
    """One row per process: name, kind, replica, pid, state, restarts, detail."""
    if table is None:
        return _observed_rows(observed)
    replicas = {r.replica_id: r for r in observed.replicas}
    tokenizers = {t.pid: t for t in observed.tokenizers}
    rows = []
    for entry in table.processes:
        replica = replicas.get(str(entry.replica if entry.replica is not None else 0))
        if entry.restart_delay_s is not None:
            state, detail = RESTARTING, f"failing at start; next try {entry.restart_delay_s:g} s after the last"
        elif entry.module == "tokenizer":
            state, detail = _tokenizer_state(entry, tokenizers.get(entry.pid), observed)
        elif entry.module == "api":
            state, detail = (HUNG, "stopped") if entry.stopped else (OK, "this process" if entry.pid ==
                                                                       observed.api_pid else "")
        else:
            state, detail = _engine_state(entry, replica, table, observed)
        rows.append(_row(entry.name, entry.module, entry.replica, entry.pid, state, entry.num_restarts, detail))
    return rows


def _row(name: str, kind: str, replica: int | None, pid: int | None, state: str, restarts: int,
         detail: str) -> dict[str, Any]:
    return {"name": name, "kind": kind, "replica": replica, "pid": pid, "state": state, "restarts": restarts,
            "detail": detail}


def _tokenizer_state(entry: ProcessEntry, seen: TokenizerSeen | None, observed: Observed) -> tuple[str, str]:
    if entry.stopped:
        return HUNG, "stopped"
    if seen is None:
        return (RESTARTING, "replaced; waiting for its hello") if entry.num_restarts else (STARTING, "")
    if seen.silent_s > TOKENIZER_LATE_BEATS * observed.heartbeat_interval:
        return HUNG, f"silent for {seen.silent_s:.1f} s"
    return OK, ""


def _engine_state(entry: ProcessEntry, replica: ReplicaSeen | None, table: ProcessTable,
                  observed: Observed) -> tuple[str, str]:
    """A scheduler or worker rank, judged by its replica's stats (the scheduler publishes the worker's state)."""
    if entry.replica is not None and entry.replica in table.down_replicas:
        return DOWN, "replica down"
    if entry.stopped:
        return HUNG, "stopped"
    stats = replica.stats if replica is not None else None
    if stats is None or stats.time < entry.started_at:  # nothing from this incarnation yet
        return (RESTARTING, "replaced; no stats yet") if entry.num_restarts else (STARTING, "no stats yet")
    age = replica.age_s if replica is not None else None
    if age is not None and age > observed.heartbeat_timeout:
        return HUNG, f"stats {age:.1f} s old"
    if entry.module == "worker":
        return _worker_state(stats)
    return OK, ""


def _worker_state(stats: SchedulerStats) -> tuple[str, str]:
    if stats.problem:
        return HUNG, stats.problem
    if not stats.worker_ready:
        return STARTING, "loading"
    if not stats.worker_alive:
        return HUNG, "past its step bound"
    return OK, ""


def _observed_rows(observed: Observed) -> list[dict[str, Any]]:
    """No launcher (compose, Kubernetes): this api, the tokenizers it hears, each replica's scheduler and worker."""
    rows = [_row(f"api{observed.api_index}", "api", None, observed.api_pid, OK, 0, "this process")]
    for seen in sorted(observed.tokenizers, key=lambda t: t.identity):
        late = seen.silent_s > TOKENIZER_LATE_BEATS * observed.heartbeat_interval
        rows.append(_row(seen.identity, "tokenizer", None, seen.pid, HUNG if late else OK, 0,
                         f"silent for {seen.silent_s:.1f} s" if late else ""))
    for replica in sorted(observed.replicas, key=lambda r: r.replica_id):
        number = int(replica.replica_id) if replica.replica_id.isdigit() else None
        stats, age = replica.stats, replica.age_s
        if stats is None or age is None:
            scheduler, worker = (STARTING, "no stats yet"), (STARTING, "no stats yet")
        elif age > observed.heartbeat_timeout:
            scheduler = worker = (HUNG, f"stats {age:.1f} s old")
        else:
            scheduler, worker = (OK, ""), _worker_state(stats)
        rows.append(_row(f"scheduler{replica.replica_id}", "scheduler", number, None, scheduler[0], 0,
                         scheduler[1]))
        rows.append(_row(f"worker{replica.replica_id}", "worker", number, None, worker[0], 0, worker[1]))
    return rows


def replica_rows(observed: Observed, table: ProcessTable | None) -> list[dict[str, Any]]:
    """One row per engine replica: its state and load."""
    down = set(table.down_replicas) if table is not None else set()
    waiting = table.replica_restart_delays if table is not None else {}
    rows = []
    for replica in sorted(observed.replicas, key=lambda r: r.replica_id):
        stats, age = replica.stats, replica.age_s
        number = int(replica.replica_id) if replica.replica_id.isdigit() else None
        if number in waiting:
            state, detail = RESTARTING, f"failing at start; next try {waiting[number]:g} s after the last"
        elif number in down:
            state, detail = DOWN, "replica down"
        elif stats is None or age is None:
            state, detail = STARTING, "no stats yet"
        elif age > observed.heartbeat_timeout:
            state, detail = HUNG, f"stats {age:.1f} s old"
        else:
            state, detail = _worker_state(stats)
        rows.append({"id": replica.replica_id, "state": state, "detail": detail,
                     "running": stats.num_running if stats else 0, "waiting": stats.num_waiting if stats else 0,
                     "kv_usage": stats.kv_cache_usage if stats else 0.0,
                     "kv_blocks_total": stats.kv_blocks_total if stats else 0})
    return rows
