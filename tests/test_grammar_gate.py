"""A request with a large constraint waits out of the batch while the workers compile it (vLLM's WAITING_FOR_FSM):
the scheduler's GrammarGate and the workers' prepare / take_compiled in process (the grammar process's:
test_grammar_process.py; a served answer through the gate: test_structured_fuzz.py)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llguidance

from pagoda.services.scheduler.grammar_gate import GrammarGate
from pagoda.services.scheduler.scheduler import Request
from pagoda.services.scheduler.service import Peer, SchedulerService
from pagoda.services.worker.grammar import GrammarRows
from pagoda.services.worker.grammar_process import MaskProcess
from pagoda.shared.config import MATCHER_CACHE_SIZE, SLOW_COMPILE_MIN_BYTES, EngineConfig, ServerConfig
from pagoda.shared.messages import (
    AddRequest,
    GrammarCompiled,
    GrammarDef,
    NewRequest,
    RequestFailed,
    SamplingParams,
    SchedulerToTokenizer,
    SchedulerToWorker,
    StepPlan,
    StructuredOutputs,
    WorkerReady,
)
from pagoda.shared.transport import Codec
from tests.harness import Outbox, opened

DEADLINE_S = 120.0  # a compile on a loaded 2-core host; the tests poll until it ends or this passes


def request(request_id: str) -> Request:
    return Request(request_id=request_id, prompt_token_ids=[1, 2], sampling=SamplingParams())


def test_the_gate_releases_by_constraint_in_arrival_order_and_forgets_the_aborted() -> None:
    gate = GrammarGate(timeout_s=10.0)
    for request_id, digest, now in [("a", "x", 0.0), ("b", "y", 1.0), ("c", "x", 2.0), ("d", "x", 3.0)]:
        gate.hold(request(request_id), digest, now)
    assert len(gate) == 4 and "c" in gate and gate.waits_for("x")
    assert gate.drop("c") and not gate.drop("c") and "c" not in gate
    assert [r.request_id for r in gate.release("x")] == ["a", "d"]
    assert not gate.waits_for("x") and gate.release("x") == []
    assert [r.request_id for r in gate.release("y")] == ["b"] and len(gate) == 0


def test_the_gate_lets_late_constraints_through_with_their_followers() -> None:
    """A GrammarCompiled that never comes (a dropped message) strands nothing: after timeout_s the constraint's
    requests are admitted, the later ones with the first."""
    gate = GrammarGate(timeout_s=10.0)
    gate.hold(request("a"), "x", 0.0)
    gate.hold(request("b"), "y", 5.0)
    gate.hold(request("c"), "x", 9.0)
    assert gate.expired(9.9) == []
    assert [r.request_id for r in gate.expired(10.0)] == ["a", "c"]
    assert [r.request_id for r in gate.expired(20.0)] == ["b"] and len(gate) == 0


def until_compiled(rows: GrammarRows | MaskProcess, digest: str) -> list[str]:
    built: list[str] = []
    deadline = time.monotonic() + DEADLINE_S
    while digest not in built and time.monotonic() < deadline:
        built += rows.take_compiled()
        if digest not in built:
            time.sleep(0.01)  # polling the rows' own report, with a deadline
    return built


CONSTRAINT = StructuredOutputs(regex="(ab|cd){1,8}x")


def test_rows_in_process_report_a_prepared_constraint_once(ll: llguidance.LLTokenizer) -> None:
    rows = GrammarRows(lambda: ll, vocab_size=ll.vocab_size)
    try:
        assert not rows.preparing and rows.take_compiled() == []
        rows.prepare("h1", CONSTRAINT)
        assert until_compiled(rows, "h1") == ["h1"]
        assert not rows.preparing and rows.take_compiled() == []
        rows.prepare("h2", CONSTRAINT)  # built already: reported at once, from the cache
        assert until_compiled(rows, "h2") == ["h2"]
    finally:
        rows.close()


# ---------------------------------------------------------------- the scheduler service, its sockets replaced

TO_WORKERS, TO_TOKENIZERS = Codec(SchedulerToWorker), Codec(SchedulerToTokenizer)


@contextlib.contextmanager
def service(tmp_path: Path, tp: int = 1) -> Iterator[tuple[SchedulerService, Outbox, Outbox]]:
    svc = SchedulerService(EngineConfig(max_num_seqs=8, tensor_parallel_size=tp),
                           ServerConfig(runtime_dir=str(tmp_path)))
    real = svc.plans, svc.front
    plans, front = Outbox(), Outbox()
    svc.plans, svc.front = plans, front  # type: ignore[assignment]
    try:
        for rank in range(tp):
            svc._on_worker_ready(WorkerReady(rank=rank, vocab_size=512, eos_token_ids=[2], num_kv_blocks=64,
                                             block_size=4, max_model_len=256, max_num_batched_tokens=256,
                                             max_inflight_plans=1))
        svc.tokenizers[b"tok"] = Peer(time.monotonic())
        yield svc, plans, front
    finally:
        svc.plans, svc.front = real
        svc._close()


def large(tag: str) -> StructuredOutputs:
    schema = {"type": "object", "description": tag + "x" * SLOW_COMPILE_MIN_BYTES, "properties": {"a": {}}}
    return StructuredOutputs(json=json.dumps(schema))


def add(svc: SchedulerService, request_id: str, constraint: StructuredOutputs | None = None, tenant: str = "",
        n: int = 1) -> None:
    params = SamplingParams(max_tokens=4, structured_outputs=constraint, n=n)
    svc._on_add(b"tok", svc.tokenizers[b"tok"], AddRequest(request_id, [5, 6, 7], params, tenant=tenant))


def to_workers(plans: Outbox) -> list[Any]:
    sent = [TO_WORKERS.decode(frame) for frame in plans.sent]
    plans.sent.clear()
    return sent


def failures(front: Outbox) -> list[RequestFailed]:
    sent = [opened(TO_TOKENIZERS, TO_TOKENIZERS.decode(frame[1])) for frame in front.sent]
    front.sent.clear()
    return [m for m in sent if isinstance(m, RequestFailed)]


def test_a_held_request_is_planned_once_its_constraint_is_built(tmp_path: Path) -> None:
    with service(tmp_path) as (svc, plans, _):
        add(svc, "a", large("1"))
        [definition] = [m for m in to_workers(plans) if isinstance(m, GrammarDef)]  # sent on arrival
        assert "a" in svc.grammar_gate and "a" not in svc.scheduler.requests
        svc._maybe_step()
        assert not [m for m in to_workers(plans) if isinstance(m, StepPlan)]  # nothing to run while it is held
        svc._on_grammar_compiled(GrammarCompiled(0, definition.hash))
        svc._maybe_step()
        sent = to_workers(plans)
        assert [type(m) for m in sent] == [StepPlan]  # no second GrammarDef
        assert sent[0].new_requests[0].grammar_hash == definition.hash
        add(svc, "b", large("1"))  # built now: queued at once
        assert "b" in svc.scheduler.requests and "b" not in svc.grammar_gate


def test_a_held_id_is_in_use_and_an_aborted_one_is_forgotten(tmp_path: Path) -> None:
    with service(tmp_path) as (svc, plans, front):
        add(svc, "a", large("1"))
        add(svc, "a", large("1"))
        add(svc, "a")  # the same id without a constraint: add_request cannot see the held one
        assert [f.status for f in failures(front)] == [400, 400]
        svc._abort("a")
        assert "a" not in svc.grammar_gate
        [definition] = [m for m in to_workers(plans) if isinstance(m, GrammarDef)]
        svc._on_grammar_compiled(GrammarCompiled(0, definition.hash))
        assert "a" not in svc.scheduler.requests


def test_every_rank_builds_the_constraint_before_its_requests_go(tmp_path: Path) -> None:
    with service(tmp_path, tp=2) as (svc, plans, _):
        add(svc, "a", large("1"))
        [definition] = [m for m in to_workers(plans) if isinstance(m, GrammarDef)]
        svc._on_grammar_compiled(GrammarCompiled(1, definition.hash))
        svc._on_grammar_compiled(GrammarCompiled(1, definition.hash))  # a repeat is still one rank
        assert "a" in svc.grammar_gate
        svc._on_grammar_compiled(GrammarCompiled(0, definition.hash))
        assert "a" in svc.scheduler.requests


def test_a_request_held_past_the_timeout_is_queued_and_the_loop_wakes(tmp_path: Path) -> None:
    with service(tmp_path) as (svc, _, _):
        svc.grammar_gate.timeout_s = 0.0
        svc.stalled = True
        add(svc, "a", large("1"))
        svc._next_heartbeat = 0.0
        svc.worker_last_seen = time.monotonic()
        svc._periodic()
        assert "a" in svc.scheduler.requests and not svc.stalled


def test_a_built_constraint_pushed_out_by_small_ones_is_held_again(tmp_path: Path) -> None:
    """The workers' matcher cache holds MATCHER_CACHE_SIZE constraints, small ones included: once as many small
    ones have been planned, the large one counts as not built (the scheduler keeps half the cache's count)."""
    with service(tmp_path) as (svc, plans, _):
        add(svc, "a", large("1"))
        [definition] = [m for m in to_workers(plans) if isinstance(m, GrammarDef)]
        svc._on_grammar_compiled(GrammarCompiled(0, definition.hash))
        svc._abort("a")
        for i in range(MATCHER_CACHE_SIZE // 2):
            svc._by_hash(NewRequest(i, [5], 1, [0], 0, SamplingParams(structured_outputs=StructuredOutputs(
                regex=f"x{i}")), 0), time.monotonic())
        add(svc, "b", large("1"))
        assert "b" in svc.grammar_gate


def test_held_requests_count_as_their_tenants_waiting_sequences(tmp_path: Path) -> None:
    with service(tmp_path) as (svc, plans, _):
        add(svc, "a", large("1"), tenant="acme", n=3)
        add(svc, "b", tenant="other")
        stats = svc._tenant_stats()
        held = dict(zip(stats["tenant_names"], stats["tenant_waiting"], strict=True))
        assert held["acme"] > 0 and held["other"] == 1
        [definition] = [m for m in to_workers(plans) if isinstance(m, GrammarDef)]
        svc._on_grammar_compiled(GrammarCompiled(0, definition.hash))
        assert "a" in svc.scheduler.requests
        stats = svc._tenant_stats()  # queued now: counted by the queue, as it was counted while held
        assert dict(zip(stats["tenant_names"], stats["tenant_waiting"], strict=True)) == held


def test_a_partial_compile_of_an_evicted_constraint_is_forgotten(tmp_path: Path) -> None:
    """With two ranks, one rank's answer came after the constraint was evicted and the other rank's never came:
    the timeout queues the request, and the half-built entry goes at the next heartbeat."""
    with service(tmp_path, tp=2) as (svc, plans, _):
        svc.grammar_gate.timeout_s = 0.0
        add(svc, "a", large("1"))
        [definition] = [m for m in to_workers(plans) if isinstance(m, GrammarDef)]
        svc.worker_grammars.discard(definition.hash)  # pushed out of the workers' cache by later constraints
        svc._on_grammar_compiled(GrammarCompiled(1, definition.hash))
        assert definition.hash in svc.compiled_ranks  # someone still waits for it
        svc._next_heartbeat = 0.0
        svc.worker_last_seen = time.monotonic()
        svc._periodic()
        assert "a" in svc.scheduler.requests and not svc.compiled_ranks
