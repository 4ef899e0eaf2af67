"""The console's parts without a browser: percentiles from histogram buckets, rates between snapshots, the
process and replica states, the request inspector and the scheduler's request traces, its static files and
packaging, and its routes behind the API key (an aiohttp test server on a real ApiState, no engine)."""

from __future__ import annotations

import asyncio
import fnmatch
import math
import os
import re
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from pagoda.services.api.console.inspector import RequestLog
from pagoda.services.api.console.live import LiveStats, TenantUsage
from pagoda.services.api.console.processes import (
    HUNG,
    OK,
    RESTARTING,
    STARTING,
    Observed,
    ReplicaSeen,
    TokenizerSeen,
    process_rows,
    replica_rows,
)
from pagoda.services.api.console.routes import STATIC_DIR, load_static
from pagoda.services.api.console.window import HistogramWindow, History, bucket_delta, quantile
from pagoda.services.scheduler.tracing import RequestTracer
from pagoda.shared.config import EngineConfig, ServerConfig, add_server_args, server_config_from_args
from pagoda.shared.messages import (
    FinishReason,
    GenerateRequest,
    ProcessEntry,
    ProcessTable,
    RenderSpec,
    RequestTrace,
    SamplingParams,
    SchedulerStats,
)
from tests.conftest import REPO_ROOT
from tests.test_scheduler import FakeWorker, make_request, make_scheduler, run_until_done, step

# ------------------------------------------------------------------ percentiles from buckets


def _cumulative(bounds: list[float], values: np.ndarray) -> list[tuple[float, float]]:
    return [(b, float(np.sum(values <= b))) for b in bounds] + [(math.inf, float(len(values)))]


@pytest.mark.parametrize("seed", range(4))
def test_quantile_from_buckets_is_within_the_bucket_of_the_true_quantile(seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = rng.lognormal(mean=-3.0, sigma=1.0, size=5000)
    bounds = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5]
    buckets = _cumulative(bounds, values)
    for q in (0.5, 0.9, 0.99):
        true = float(np.quantile(values, q))
        estimate = quantile(buckets, q)
        assert estimate is not None
        upper = next(b for b in bounds if b >= true)
        lower = max([0.0] + [b for b in bounds if b < true])
        assert lower <= estimate <= upper, (q, true, estimate)


def test_quantile_edges() -> None:
    assert quantile([], 0.5) is None
    assert quantile([(1.0, 0.0), (math.inf, 0.0)], 0.5) is None
    # all samples past the last finite bound: the bound is the best one can say
    assert quantile([(1.0, 0.0), (2.0, 0.0), (math.inf, 10.0)], 0.99) == 2.0
    # 10 samples evenly in (1, 2]: the median interpolates to the middle
    assert quantile([(1.0, 0.0), (2.0, 10.0), (math.inf, 10.0)], 0.5) == pytest.approx(1.5)


def test_histogram_window_reports_only_the_last_span() -> None:
    window = HistogramWindow(span_s=60.0)
    window.add(0.0, [(0.1, 0.0), (1.0, 0.0), (math.inf, 0.0)])
    window.add(30.0, [(0.1, 100.0), (1.0, 100.0), (math.inf, 100.0)])  # 100 fast ones
    window.add(95.0, [(0.1, 100.0), (1.0, 110.0), (math.inf, 110.0)])  # then 10 slow ones
    recent = window.recent()  # base: the reading at 30 s (the newest one at least 60 s old)
    assert recent[-1][1] == 10.0
    assert window.summary()["p50"] == pytest.approx(550.0)  # ms, in (100, 1000]
    assert bucket_delta([(1.0, 3.0), (math.inf, 3.0)], [(1.0, 5.0), (math.inf, 5.0)]) == [(1.0, 3.0),
                                                                                           (math.inf, 3.0)]


def test_history_keeps_the_last_rows() -> None:
    history = History(("t", "x"), length=3)
    for i in range(5):
        assert history.add({"t": float(i), "x": i * 2.0}) == [float(i), i * 2.0]
    assert history.to_dict() == {"fields": ["t", "x"], "rows": [[2.0, 4.0], [3.0, 6.0], [4.0, 8.0]]}
    history.add({"t": 9.0})
    assert history.rows[-1] == [9.0, None]


# ------------------------------------------------------------------ live stats from snapshots


def _stats(t: float, **values: Any) -> SchedulerStats:
    base: dict[str, Any] = dict(time=t, num_running=0, num_waiting=0, kv_blocks_free=90, kv_blocks_total=100,
                                kv_cache_usage=0.1, prefix_hit_tokens_total=0, prefix_query_tokens_total=0,
                                num_preemptions_total=0, prompt_tokens_total=0, generation_tokens_total=0,
                                num_steps_total=0, worker_ready=True, worker_alive=True, tokenizer_ids=["t0"],
                                tokenizer_requests_total=[0])
    base.update(values)
    return SchedulerStats(**base)


@dataclass
class FakeFeed:
    """ReplicaStatsFeed's surface that LiveStats reads."""

    snapshots: dict[str, SchedulerStats] = field(default_factory=dict)
    on_stats: Any = None

    def per_replica(self) -> list[tuple[str, SchedulerStats]]:
        return sorted(self.snapshots.items())

    def set_on_stats(self, on_stats: Any) -> None:
        self.on_stats = on_stats

    @property
    def feeds(self) -> dict[str, Any]:
        return {rid: type("Feed", (), {"latest": s, "age": lambda self: 0.1})() for rid, s in self.snapshots.items()}


class FakePool:
    num_open = 0

    def peers(self) -> list[tuple[str, int, float]]:
        return []


class FakeMetrics:
    def latency_buckets(self) -> dict[str, list[tuple[float, float]]]:
        return {"ttft": [(0.1, 0.0), (math.inf, 0.0)], "itl": [(0.1, 0.0), (math.inf, 0.0)]}


def _live(feed: FakeFeed, **kwargs: Any) -> LiveStats:
    config = ServerConfig(runtime_dir=None)
    return LiveStats(config, feed, FakeMetrics(), FakePool(), RequestLog(8, False), lambda: [],  # type: ignore[arg-type]
                     **kwargs)


def test_live_rates_come_from_counter_differences_summed_over_replicas() -> None:
    feed = FakeFeed({"0": _stats(100.0), "1": _stats(100.0)})
    live = _live(feed)
    first = live.tick()["engine"]
    assert first["tokens_out_per_s"] is None  # one reading: no rate yet
    feed.snapshots = {
        "0": _stats(102.0, generation_tokens_total=400, prompt_tokens_total=1000, num_running=3, num_preempted=1,
                    prefix_hit_tokens_total=300, prefix_query_tokens_total=1000, prefill_step_seconds_total=0.5,
                    decode_step_seconds_total=1.0, host_seconds_total=0.2, num_steps_total=40,
                    tokenizer_requests_total=[4]),
        "1": _stats(102.0, generation_tokens_total=200, num_running=2, kv_blocks_free=50,
                    decode_step_seconds_total=2.0, num_steps_total=20, tokenizer_requests_total=[2])}
    engine = live.tick()["engine"]
    # the server's throughput: each replica's rate, summed (400 and 200 tokens in 2 s), not their mean
    assert engine["tokens_out_per_s"] == pytest.approx(400 / 2 + 200 / 2)
    assert engine["tokens_in_per_s"] == pytest.approx(1000 / 2)
    assert engine["requests_per_s"] == pytest.approx(4 / 2 + 2 / 2)
    assert engine["steps_per_s"] == pytest.approx(40 / 2 + 20 / 2)
    assert engine["running"] == 5 and engine["preempted"] == 1
    assert engine["kv_blocks_used"] == 10 + 50 and engine["kv_blocks_total"] == 200
    assert engine["prefix_hit_rate"] == pytest.approx(0.3)
    # a share of the replicas' time: over 2 x 2 replica-seconds
    assert engine["prefill_frac"] == pytest.approx(0.5 / 4) and engine["decode_frac"] == pytest.approx(3.0 / 4)
    assert engine["host_frac"] == pytest.approx(0.2 / 4)
    # replica 1 restarted: its counters start again from zero and give no rate this tick
    feed.snapshots = {"0": _stats(104.0, generation_tokens_total=800, prompt_tokens_total=1000, num_steps_total=80,
                                  tokenizer_requests_total=[4]),
                      "1": _stats(104.0, generation_tokens_total=10, num_steps_total=1)}
    engine = live.tick()["engine"]
    assert engine["tokens_out_per_s"] == pytest.approx(800 / 4)  # replica 0 over its window: 100 s to 104 s
    assert live.history.rows[-1][live.history.fields.index("tokens_out_per_s")] == pytest.approx(200.0)
    # nothing generated since: the 5 s window still holds replica 0's 800 tokens of 100 s to 106 s, and replica 1
    # (counting again since its restart at 104 s) adds a rate of 0
    feed.snapshots = {"0": _stats(106.0, generation_tokens_total=800, prompt_tokens_total=1000, num_steps_total=80,
                                  tokenizer_requests_total=[4]),
                      "1": _stats(106.0, generation_tokens_total=10, num_steps_total=1)}
    assert live.tick()["engine"]["tokens_out_per_s"] == pytest.approx(800 / 6)


def test_tenant_section_is_empty_until_the_stats_carry_tenants() -> None:
    feed = FakeFeed({"0": _stats(1.0)})
    assert _live(feed).tick()["tenants"] == []
    usage = [TenantUsage("acme", running=2, requests_total=10, generation_tokens_total=1000)]
    live = _live(feed, tenant_source=lambda: usage)
    assert live.tick()["tenants"][0]["tokens_out_per_s"] is None
    usage[0] = TenantUsage("acme", running=1, requests_total=12, generation_tokens_total=1500)
    row = live.tick()["tenants"][0]
    assert row["name"] == "acme" and row["running"] == 1
    assert row["tokens_out_per_s"] is not None and row["tokens_out_per_s"] > 0


def test_live_joins_request_traces_as_they_arrive() -> None:
    feed = FakeFeed({"0": _stats(1.0)})
    live = _live(feed)
    record = live._requests.start("completion", [_generate("req-a")], True, started_mono=0.0)
    trace = RequestTrace("req-a", queued_at=record.arrived_at + 0.01, finished_at=record.arrived_at + 1.0,
                         finish_reason=0, num_prompt_tokens=5, num_output_tokens=3, num_cached_tokens=0,
                         scheduled_at=record.arrived_at + 0.02)
    feed.on_stats(_stats(2.0, traces=[trace]))
    assert record.traces["req-a"] is trace


# ------------------------------------------------------------------ process and replica states


def _observed(tokenizers: list[TokenizerSeen], replicas: list[ReplicaSeen]) -> Observed:
    return Observed(api_index=0, api_pid=10, tokenizers=tokenizers, replicas=replicas, heartbeat_interval=0.5,
                    heartbeat_timeout=5.0)


def _table(*entries: ProcessEntry, down: list[int] | None = None) -> ProcessTable:
    return ProcessTable(launcher_pid=1, time=0.0, processes=list(entries), down_replicas=down or [])


def _states(rows: list[dict[str, Any]]) -> dict[str, str]:
    return {row["name"]: row["state"] for row in rows}


def test_process_states_from_the_launcher_table_and_what_the_api_sees() -> None:
    fresh = ReplicaSeen("0", _stats(1000.0), 0.2)
    table = _table(ProcessEntry("tokenizer0", "tokenizer", 21, 900.0, num_restarts=1),
                   ProcessEntry("tokenizer1", "tokenizer", 22, 900.0),
                   ProcessEntry("tokenizer2", "tokenizer", 23, 900.0),
                   ProcessEntry("tokenizer3", "tokenizer", 24, 900.0, stopped=True),
                   ProcessEntry("tokenizer4", "tokenizer", 25, 900.0, num_restarts=3, restart_delay_s=4.0),
                   ProcessEntry("api0", "api", 10, 900.0), ProcessEntry("scheduler", "scheduler", 30, 900.0, replica=0),
                   ProcessEntry("worker0", "worker", 31, 900.0, replica=0),
                   ProcessEntry("api1", "api", 11, 900.0, num_restarts=2, restart_delay_s=2.0))
    # tokenizer4 failed at start and waits for its next try: still heard (its peers have not dropped it yet)
    seen = [TokenizerSeen("t1", 22, 0.1), TokenizerSeen("t2", 23, 4.0), TokenizerSeen("t3", 24, 0.1),
            TokenizerSeen("t4", 25, 0.1)]
    states = _states(process_rows(_observed(seen, [fresh]), table))
    assert states == {"tokenizer0": RESTARTING, "tokenizer1": OK, "tokenizer2": HUNG, "tokenizer3": HUNG,
                      "tokenizer4": RESTARTING, "api0": OK, "scheduler": OK, "worker0": OK, "api1": RESTARTING}


def test_engine_states_follow_the_replica_stats() -> None:
    def states(replica: ReplicaSeen, started_at: float = 900.0, restarts: int = 0, down: list[int] | None = None,
               stopped: bool = False) -> dict[str, str]:
        table = _table(ProcessEntry("scheduler", "scheduler", 30, started_at, restarts, 0, stopped),
                       ProcessEntry("worker0", "worker", 31, started_at, restarts, 0), down=down)
        return _states(process_rows(_observed([], [replica]), table))

    assert states(ReplicaSeen("0", _stats(1000.0, problem="the worker is hung: step 7"), 0.1)) == {
        "scheduler": OK, "worker0": HUNG}
    assert states(ReplicaSeen("0", _stats(1000.0, worker_ready=False), 0.1))["worker0"] == STARTING
    assert states(ReplicaSeen("0", _stats(1000.0), 9.0)) == {"scheduler": HUNG, "worker0": HUNG}  # stale stats
    assert states(ReplicaSeen("0", _stats(1000.0), 0.1), stopped=True)["scheduler"] == HUNG
    # stats from before the restart say nothing about the new processes
    assert states(ReplicaSeen("0", _stats(800.0), 0.1), restarts=1) == {"scheduler": RESTARTING,
                                                                      "worker0": RESTARTING}
    assert states(ReplicaSeen("0", None, None)) == {"scheduler": STARTING, "worker0": STARTING}
    assert set(states(ReplicaSeen("0", _stats(1000.0), 0.1), down=[0]).values()) == {"down"}


def test_without_a_launcher_the_rows_are_what_the_api_sees() -> None:
    observed = _observed([TokenizerSeen("tok-a", 5, 0.2), TokenizerSeen("tok-b", 6, 3.0)],
                         [ReplicaSeen("0", _stats(1.0), 0.1), ReplicaSeen("1", _stats(1.0), 7.0)])
    states = _states(process_rows(observed, None))
    assert states == {"api0": OK, "tok-a": OK, "tok-b": HUNG, "scheduler0": OK, "worker0": OK,
                      "scheduler1": HUNG, "worker1": HUNG}
    assert [(r["id"], r["state"]) for r in replica_rows(observed, None)] == [("0", OK), ("1", HUNG)]


def test_a_replica_waiting_for_its_restart_shows_restarting() -> None:
    """The launcher backs off a replica whose restarts keep failing at start: it is down (no processes) with a
    restart delay, shown restarting; a replica given up on stays down."""
    observed = _observed([], [ReplicaSeen("0", _stats(1000.0), 0.1), ReplicaSeen("1", _stats(800.0), 30.0),
                              ReplicaSeen("2", _stats(800.0), 30.0)])
    table = ProcessTable(1, 1000.0, [ProcessEntry("r0-scheduler", "scheduler", 30, 900.0, 0, 0),
                                     ProcessEntry("r0-worker0", "worker", 31, 900.0, 0, 0)],
                         down_replicas=[1, 2], replica_restart_delays={1: 4.0})
    rows = {r["id"]: r for r in replica_rows(observed, table)}
    assert (rows["0"]["state"], rows["1"]["state"], rows["2"]["state"]) == (OK, RESTARTING, "down")
    assert "4 s" in rows["1"]["detail"]
    assert msgspec.json.decode(msgspec.json.encode(table), type=ProcessTable) == table  # int keys survive JSON


# ------------------------------------------------------------------ the request inspector


def _generate(request_id: str, prompt: str = "secret prompt", **params: Any) -> GenerateRequest:
    spec = RenderSpec(0, "cmpl-" + request_id, "m", 0, True)
    return GenerateRequest(request_id, SamplingParams(max_tokens=8, **params), prompt_text=prompt, render=spec)


def test_request_log_is_bounded_and_joins_the_scheduler_trace() -> None:
    log = RequestLog(max_finished=3, show_prompts=False)
    records = []
    for i in range(5):
        record = log.start("completion", [_generate(f"r{i}")], True, started_mono=100.0 + i)
        records.append(record)
        assert "prompt" not in record.to_dict()
    assert [r["status"] for r in log.to_list()] == ["running"] * 5
    for i, record in enumerate(records):
        log.finish(record, finished=i != 4, error="", tokenized_mono=record.started_mono + 0.01,
                   first_token_mono=record.started_mono + 0.2, prompt_tokens=4, completion_tokens=8,
                   cached_tokens=0, finish_reasons=[int(FinishReason.LENGTH)])
    listed = log.to_list()
    assert [r["id"] for r in listed] == ["cmpl-r4", "cmpl-r3", "cmpl-r2"]  # newest first, the oldest dropped
    assert listed[0]["status"] == "aborted" and "left" in listed[0]["error"] and listed[1]["status"] == "ok"
    log.on_traces([RequestTrace("r0", 1.0, 2.0, 0, 4, 8, 0)])  # dropped already: ignored
    arrived = records[3].arrived_at
    log.on_traces([RequestTrace("r3", queued_at=arrived + 0.015, finished_at=arrived + 0.5, finish_reason=1,
                                num_prompt_tokens=4, num_output_tokens=8, num_cached_tokens=0,
                                scheduled_at=arrived + 0.05, num_preemptions=1, preempted_at=[arrived + 0.1],
                                rescheduled_at=[arrived + 0.15])])
    r3 = log.to_list()[1]
    assert [e["event"] for e in r3["timeline"]] == ["arrived", "tokenized", "queued", "scheduled", "preempted",
                                                    "rescheduled", "first token", "finished"]
    assert r3["timeline"][3]["ms"] == pytest.approx(50.0, abs=1.0) and r3["finish_reasons"] == ["length"]


def test_requests_a_client_named_alike_are_kept_apart_and_the_log_stays_bounded() -> None:
    """A client's request_id (vLLM's) may repeat: records are kept by the engine's ids, each still shown under the
    client's, and the log's wire index shrinks back as the oldest records are dropped."""
    log = RequestLog(max_finished=2, show_prompts=False)
    records = []
    for i in range(6):
        request = msgspec.structs.replace(_generate(f"r{i}"), render=RenderSpec(0, "cmpl-mine", "m", 0, True))
        records.append(log.start("completion", [request], True, started_mono=float(i)))
    assert len(log.to_list()) == 6 and {r["id"] for r in log.to_list()} == {"cmpl-mine"}
    for record in records:
        log.finish(record, finished=True, error="", tokenized_mono=None, first_token_mono=None, prompt_tokens=1,
                   completion_tokens=1, cached_tokens=0, finish_reasons=[int(FinishReason.STOP)])
    assert [r["status"] for r in log.to_list()] == ["ok", "ok"]
    assert not log.open and set(log._by_wire) == {"r4", "r5"}


def test_prompts_are_shown_only_when_asked() -> None:
    log = RequestLog(max_finished=2, show_prompts=True)
    record = log.start("completion", [_generate("r0", "hello there")], False, started_mono=0.0)
    assert record.to_dict()["prompt"] == "hello there"
    log.finish(record, finished=False, error="the request failed inside the engine", tokenized_mono=None,
               first_token_mono=None, prompt_tokens=0, completion_tokens=0, cached_tokens=0, finish_reasons=[-1])
    out = log.to_list()[0]
    assert out["status"] == "error" and out["error"] and out["finish_reasons"] == []


# ------------------------------------------------------------------ the scheduler's side


def test_tracer_records_scheduling_preemption_and_readmission() -> None:
    # 6 blocks of 4 tokens: the third running sequence's growth preempts the lowest ranked one
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    sched.preemption_log = []
    tracer = RequestTracer()
    worker = FakeWorker(4)
    clock = iter(range(1000))
    requests = [make_request("late", [200] * 7, max_tokens=10, priority=0, arrival_time=5.0),
                make_request("latest", [300] * 7, max_tokens=10, priority=1, arrival_time=2.0),
                make_request("early", [400] * 7, max_tokens=10, priority=1, arrival_time=1.0)]
    for request in requests[1:]:
        sched.add_request(request)
        tracer.on_add(request, float(next(clock)))
    prefill_flags = []

    def one_step() -> None:
        plan, _ = step(sched, worker)
        now = float(next(clock))
        tracer.on_preempted(sched.preemption_log, now)
        sched.preemption_log.clear()
        tracer.on_plan(plan, sched, now)
        prefill_flags.append(sched.last_step_has_prefill)
        for request in requests:
            if request.request_id in tracer.open and request.request_id not in sched.requests and request.sequences:
                tracer.on_done(request.request_id, now)

    one_step()
    sched.add_request(requests[0])
    tracer.on_add(requests[0], float(next(clock)))
    while sched.has_unfinished():
        one_step()
    traces = {t.request_id: t for t in tracer.take()}
    assert set(traces) == {"late", "latest", "early"} and not tracer.open and tracer.take() == []
    victim = traces["latest"]
    assert victim.num_preemptions == 1 and len(victim.preempted_at) == 1 and len(victim.rescheduled_at) == 1
    assert victim.queued_at < victim.scheduled_at < victim.preempted_at[0] <= victim.rescheduled_at[0] \
        < victim.finished_at
    assert all(t.num_output_tokens == 10 and t.finish_reason == FinishReason.LENGTH for t in traces.values())
    assert sum(t.num_preemptions for t in traces.values()) == sched.stats.num_preemptions
    assert all(len(t.preempted_at) == t.num_preemptions for t in traces.values())
    assert prefill_flags[0] is True and prefill_flags[-1] is False  # prompts first; the last steps only decode


def test_scheduler_marks_steps_with_prompt_tokens() -> None:
    sched = make_scheduler()
    worker = FakeWorker(16)
    sched.add_request(make_request("a", 40, max_tokens=4))
    flags = []
    while sched.has_unfinished():
        step(sched, worker)
        flags.append(sched.last_step_has_prefill)
    assert flags == [True, False, False, False]
    run_until_done(sched, worker)


# ------------------------------------------------------------------ config, static files, packaging


def test_console_flags() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    default = server_config_from_args(parser.parse_args([]))
    assert default.console and not default.console_show_prompts and default.console_max_requests == 200
    off = server_config_from_args(parser.parse_args(["--no-console", "--console-show-prompts",
                                                     "--console-max-requests", "5"]))
    assert not off.console and off.console_show_prompts and off.console_max_requests == 5


def test_static_files_are_complete_local_and_packaged() -> None:
    files = load_static()
    index = files["index.html"][0].decode()
    referenced = re.findall(r'(?:src|href)="/console/static/([^"]+)"', index)
    assert referenced and all(name in files for name in referenced), referenced
    for name, (body, _) in files.items():
        text = body.decode()
        assert not re.search(r"(?:src|href)=\"https?://|import\s+.*https?://|url\(https?://", text), \
            f"{name} loads something from the network"
    patterns = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "pagoda.services.api.console"]
    for path in STATIC_DIR.iterdir():
        assert any(fnmatch.fnmatch(f"static/{path.name}", p) for p in patterns), f"{path.name} is not package data"


# ------------------------------------------------------------------ routes and the key


async def _routes(tmp_path: Path, **config: Any) -> dict[str, Any]:
    import zmq.asyncio

    from pagoda.services.api.app import build_app
    from pagoda.services.api.server import _make_state

    context = zmq.asyncio.Context()
    state = _make_state(context, EngineConfig(), ServerConfig(runtime_dir=str(tmp_path), **config))
    out: dict[str, Any] = {}
    try:
        async with TestClient(TestServer(build_app(state))) as client:
            key = {"Authorization": f"Bearer {config['api_key']}"} if config.get("api_key") else {}
            for path in ("/", "/console/static/common.js", "/console/api/stats", "/console/api/requests",
                         "/console/api/info"):
                out[path] = (await client.get(path)).status
                out[path + " with key"] = (await client.get(path, headers=key)).status
            for path in ("/console/static/..%2f..%2froutes.py", "/console/static/%2e%2e/live.py",
                         "/console/static/nothing.js", "/console/static/__init__.py"):
                out.setdefault("traversal", []).append((await client.get(path)).status)
            if config.get("console", True):
                out["info"] = await (await client.get("/console/api/info", headers=key)).json()
                response = await client.get("/console/api/stream", headers=key)
                out["stream type"] = response.headers["Content-Type"]
                out["first event"] = (await response.content.readuntil(b"\n\n")).decode()
                response.close()
    finally:
        await state.pool.close()
        await state.stats.close()
        context.destroy(linger=0)
    return out


def test_console_data_needs_the_key_and_the_page_does_not(tmp_path: Path) -> None:
    out = asyncio.run(_routes(tmp_path, api_key="sk-test"))
    assert out["/"] == 200 and out["/console/static/common.js"] == 200
    assert set(out["traversal"]) == {404}  # only the static folder's own files, by name
    assert out["/console/api/stats"] == out["/console/api/requests"] == out["/console/api/info"] == 401
    assert out["/console/api/stats with key"] == out["/console/api/requests with key"] == 200
    assert out["info"]["auth"] is True and out["info"]["show_prompts"] is False
    assert out["stream type"].startswith("text/event-stream")
    event, data = out["first event"].split("\n", 1)
    assert event == "event: history"
    history = msgspec.json.decode(data.removeprefix("data: ").strip())
    assert "tokens_out_per_s" in history["history"]["fields"] and history["latest"]["engine"]["running"] == 0


def test_no_console_serves_no_page(tmp_path: Path) -> None:
    out = asyncio.run(_routes(tmp_path, console=False))
    assert out["/"] == 404 and out["/console/static/common.js"] == 404 and out["/console/api/stats"] == 404


def test_latency_buckets_sum_every_api_process(tmp_path: Path) -> None:
    """With several api processes the histograms live in shared files: the console reads all of them."""
    import subprocess
    import sys

    script = ("from pagoda.services.api.metrics import ApiMetrics\n"
              "import sys\n"
              "m = ApiMetrics(lambda: None)\n"
              "for v in sys.argv[1:]: m.ttft.observe(float(v))\n"
              "print(m.latency_buckets()['ttft'][-1][1])\n")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    counts = [subprocess.run([sys.executable, "-c", script, *values], env=env, capture_output=True, text=True,
                             check=True).stdout.strip() for values in (["0.03", "0.2"], ["0.5"])]
    assert counts == ["2.0", "3.0"]  # the second process sees the first one's observations too


@pytest.mark.parametrize("console", [True, False], ids=["console", "no-console"])
def test_scheduler_service_publishes_the_split_and_the_traces(tmp_path: Path, console: bool) -> None:
    """Through the service's own handlers: a prompt step then decode steps; each snapshot's step seconds count
    the step in flight up to that moment (never more than the wall time that passed), and the finished
    request's trace rides on the next snapshot, once (with the console on; off, no trace is kept)."""
    from pagoda.services.scheduler.service import SchedulerService
    from pagoda.shared.messages import (
        AddRequest,
        SchedulerToWorker,
        StepPlan,
        StepResult,
        TokenizerHello,
        TokenizerToScheduler,
        WorkerReady,
    )
    from pagoda.shared.transport import Codec
    from tests.harness import Outbox

    service = SchedulerService(EngineConfig(max_num_seqs=8), ServerConfig(runtime_dir=str(tmp_path),
                                                                          console=console))
    real = service.plans, service.front
    service.plans, service.front = Outbox(), Outbox()  # type: ignore[assignment]
    try:
        service._on_worker_ready(WorkerReady(rank=0, num_kv_blocks=64, block_size=16, max_model_len=256,
                                             vocab_size=512, eos_token_ids=[2], max_num_batched_tokens=256))
        send = Codec(TokenizerToScheduler)
        service._on_tokenizer_frames([b"tok0", send.encode(TokenizerHello("tok0", 1))])
        service._on_tokenizer_frames([b"tok0", send.encode(AddRequest(
            "req-1", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))])
        plans = Codec(SchedulerToWorker)
        snapshots = []
        started = time.monotonic()
        for token in (9, 10, 11):
            service._maybe_step()
            [plan] = [p for p in map(plans.decode, service.plans.sent) if isinstance(p, StepPlan)]  # type: ignore
            service.plans.sent.clear()  # type: ignore[attr-defined]
            snapshots.append(service._stats(time.monotonic()))  # mid-step
            service._on_result(StepResult(plan.step_id, plan.seq_ids, [token]))
        snapshots.append(service._stats(time.monotonic()))
        wall = time.monotonic() - started
    finally:
        service.plans, service.front = real
        service._close()
    first, *_, last = snapshots
    assert first.prefill_step_seconds_total > 0.0 and first.decode_step_seconds_total == 0.0  # the prompt step
    assert last.decode_step_seconds_total > 0.0
    for earlier, later in zip(snapshots, snapshots[1:], strict=False):
        assert later.prefill_step_seconds_total >= earlier.prefill_step_seconds_total
        assert later.decode_step_seconds_total >= earlier.decode_step_seconds_total
    assert last.prefill_step_seconds_total + last.decode_step_seconds_total <= wall
    assert last.host_seconds_total > 0.0
    traces = [t for s in snapshots for t in s.traces]
    if not console:
        assert traces == [] and service.tracer is None
        return
    assert [t.request_id for t in traces] == ["req-1"]
    [trace] = traces
    assert trace.queued_at <= trace.scheduled_at <= trace.finished_at and trace.num_output_tokens == 3
    assert trace.finish_reason == FinishReason.LENGTH and trace.num_prompt_tokens == 4
