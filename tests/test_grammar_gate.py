"""A request with a large constraint waits out of the batch while the workers compile it (vLLM's WAITING_FOR_FSM):
the scheduler's GrammarGate and the workers' prepare / take_compiled in process (the grammar process's:
test_grammar_process.py; a served answer through the gate: test_structured_fuzz.py)."""

from __future__ import annotations

import time

import llguidance

from pagoda.services.scheduler.grammar_gate import GrammarGate
from pagoda.services.scheduler.scheduler import Request
from pagoda.services.worker.grammar import GrammarRows
from pagoda.services.worker.grammar_process import MaskProcess
from pagoda.shared.messages import SamplingParams, StructuredOutputs

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
    requests are admitted, the later ones with the first; release_all empties it oldest constraint first."""
    gate = GrammarGate(timeout_s=10.0)
    gate.hold(request("a"), "x", 0.0)
    gate.hold(request("b"), "y", 5.0)
    gate.hold(request("c"), "x", 9.0)
    assert gate.expired(9.9) == []
    assert [r.request_id for r in gate.expired(10.0)] == ["a", "c"]
    assert [r.request_id for r in gate.expired(20.0)] == ["b"] and len(gate) == 0
    gate.hold(request("d"), "z", 30.0)
    gate.hold(request("e"), "w", 31.0)
    gate.hold(request("f"), "z", 32.0)
    assert [r.request_id for r in gate.release_all()] == ["d", "f", "e"] and len(gate) == 0


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
