"""Constrained decoding off the critical path: grammars compile on a thread, masks fill on llguidance's pool
after the previous step's result is out (a deferred sampling), only the constrained rows' masks are copied;
the outputs are exactly the serial path's."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import llguidance
import pytest

from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.services.worker import grammar
from pagoda.services.worker.grammar import GrammarRows
from pagoda.services.worker.grammar_process import MaskProcess
from pagoda.shared.messages import NewRequest, SamplingParams, StepPlan, StructuredOutputs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def new_request(seq_id: int, constraint: StructuredOutputs) -> NewRequest:
    return NewRequest(seq_id, [1, 2], 2, [0], 0, SamplingParams(structured_outputs=constraint), 0)


def test_grammars_compile_off_the_step_loop(ll: llguidance.LLTokenizer, tokenizer: Tokenizer,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A new constraint's compile does not hold up the step that admits it: apply() returns while it runs, a
    token that arrives before the matcher is kept for it, and the first mask waits for it and is exact."""
    gate = threading.Event()
    build = GrammarRows._build

    def slow_build(ll_tok: llguidance.LLTokenizer, constraint: StructuredOutputs) -> llguidance.LLMatcher:
        assert gate.wait(30), "the test never opened the gate"
        return build(ll_tok, constraint)

    constraint = StructuredOutputs(json=SCHEMA)
    token_ids = tokenizer.encode('{"name', add_special_tokens=False)
    reference = GrammarRows(lambda: ll, tokenizer.vocab_size)
    reference.apply(StepPlan(0, [], [], new_requests=[new_request(1, constraint)]))
    reference.accept([1] * len(token_ids[:1]), token_ids[:1])
    expected = reference.bitmask([1])
    monkeypatch.setattr(GrammarRows, "_build", staticmethod(slow_build))
    rows = GrammarRows(lambda: ll, tokenizer.vocab_size)
    rows.apply(StepPlan(0, [], [], new_requests=[new_request(1, constraint)]))  # returns: the build waits
    rows.accept([1], token_ids[:1])  # sampled before the matcher exists (a recompute's replay works alike)
    assert not gate.is_set() and rows._seqs[1].matcher is None and rows._seqs[1].replay == token_ids[:1]
    gate.set()
    got = rows.bitmask([1])
    assert got is not None and expected is not None
    assert got[0].tolist() == [True] and got[1].tolist() == expected[1].tolist()


def test_executor_is_sized_from_the_cpus_this_process_may_use(ll: llguidance.LLTokenizer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int | None] = []

    class Recorder:
        def __init__(self, num_threads: int | None = None) -> None:
            sizes.append(num_threads)

    monkeypatch.setattr(grammar.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4})
    monkeypatch.setattr(grammar, "cgroup_cpu_quota", lambda: None)
    monkeypatch.setattr(grammar.os, "cpu_count", lambda: 512)  # the machine's count must not matter
    monkeypatch.setattr(grammar.llguidance, "LLExecutor", Recorder)
    monkeypatch.setattr(grammar, "MAX_EXECUTOR_THREADS", 8)  # above what the mask allows: the mask decides
    rows = GrammarRows(lambda: ll, 100)
    rows._ensure_executor()
    assert sizes == [4]  # 80% of the 5 CPUs of the affinity mask
    assert rows._parallel(grammar.PARALLEL_ROWS) == (5 >= grammar.PARALLEL_MIN_CPUS)
    monkeypatch.setattr(grammar, "MAX_EXECUTOR_THREADS", 2)  # and the cap bounds a larger mask
    rows = GrammarRows(lambda: ll, 100)
    rows._ensure_executor()
    assert sizes == [4, 2]


def test_cpus_respect_the_cgroup_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's CPU quota bounds the pool even when the affinity mask names every CPU of the host."""
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("1600000 100000\n")
    assert grammar.cgroup_cpu_quota(str(v2)) == 16.0
    (v2 / "cpu.max").write_text("max 100000\n")
    assert grammar.cgroup_cpu_quota(str(v2)) is None
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("250000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert grammar.cgroup_cpu_quota(str(tmp_path / "v1")) == 2.5
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert grammar.cgroup_cpu_quota(str(tmp_path / "v1")) is None
    assert grammar.cgroup_cpu_quota(str(tmp_path / "absent")) is None
    monkeypatch.setattr(grammar.os, "sched_getaffinity", lambda _pid: set(range(192)))
    monkeypatch.setattr(grammar, "cgroup_cpu_quota", lambda: 16.0)
    assert grammar.available_cpus() == 16
    monkeypatch.setattr(grammar, "cgroup_cpu_quota", lambda: 0.5)
    assert grammar.available_cpus() == 1
    monkeypatch.setattr(grammar, "cgroup_cpu_quota", lambda: None)
    assert grammar.available_cpus() == 192


# [True] (the grammar process as a third mode) is extended: test_async_scheduling.py's
# test_async_structured_outputs_equal_serial[11] runs the grammar process against the serial path, and
# test_grammar_process.py's test_masks_equal_the_in_process_rows checks its masks bit for bit, in the default run
@pytest.mark.parametrize("with_process", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_constrained_outputs_equal_with_and_without_the_parallel_path(smollm2_dir: Path, with_process: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """JSON-schema, regex and choice rows beside free ones (greedy and seeded): the serial worker (one thread,
    sampling in launch), the fast one (llguidance's pool from one row, async scheduling: each constrained
    step's sampling deferred until the step before has finished, then masks filled while its forward runs) and
    the fast one with its matchers in a grammar process give the same tokens, texts and finish reasons."""
    from pagoda import LLM
    from pagoda.services.worker.model_runner import ModelRunner

    constraints = [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=r"[0-9]{3}-[0-9]{4}"),
                   StructuredOutputs(choice=["red", "green", "blue"]), None]
    prompts = ["Describe a person as JSON:", "A phone number:", "Pick a colour:", "Once upon a time",
               "Another person as JSON:", "Call me at"]
    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 == 0 else 0.8, seed=i,
                             structured_outputs=constraints[i % 4]) for i in range(len(prompts))]
    deferred: list[int] = []
    resume = ModelRunner.resume

    def counting_resume(self: ModelRunner) -> None:
        if self._deferred is not None:
            deferred.append(self._deferred[0].plan.step_id)
        resume(self)

    monkeypatch.setattr(ModelRunner, "resume", counting_resume)
    ahead: list[int] = []  # launches whose inputs were prepared before the deferred step sampled
    prepare_ahead = ModelRunner._prepare_ahead

    def counting_prepare_ahead(self: ModelRunner, plan: StepPlan):  # noqa: ANN202
        ahead.append(plan.step_id)
        return prepare_ahead(self, plan)

    monkeypatch.setattr(ModelRunner, "_prepare_ahead", counting_prepare_ahead)
    results = {}
    modes = [(False, False), (True, False)] + ([(True, True)] if with_process else [])
    for fast, in_process in modes:
        monkeypatch.setattr(grammar, "PARALLEL_ROWS", 1 if fast else 10**6)
        monkeypatch.setattr(grammar, "PARALLEL_MIN_CPUS", 1)
        deferred.clear()
        ahead.clear()
        llm = LLM(str(smollm2_dir), async_scheduling=fast, max_model_len=256, grammar_process=in_process)
        assert isinstance(llm.engine.runner.grammars, MaskProcess) == in_process
        outputs = llm.generate(prompts, params)
        results[fast, in_process] = [(c.token_ids, c.text, c.finish_reason) for o in outputs for c in o.outputs]
        assert bool(deferred) == fast  # the fast path deferred constrained steps' sampling; the serial never
        assert bool(ahead) == fast  # and prepared the next steps' inputs while their masks filled
        llm.engine.runner.grammars.close()
    assert results[True, False] == results[False, False]
    for mode in modes[2:]:
        assert results[mode] == results[False, False]  # the grammar process's masks are the same
    assert results[modes[-1]][2][1] in ("red", "green", "blue")


def test_masks_fill_on_a_thread_after_the_result_is_out(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """resume() hands the deferred step's accept + mask fill to the mask thread and returns at once (the engine
    applies result N and plans N + 2 meanwhile); while they fill, the step is not done (the service keeps
    listening for the next plan); the next launch waits for them; the tokens equal the serial path's."""
    from pagoda import LLM
    from pagoda.services.worker.model_runner import ModelRunner

    resumed = threading.Event()  # set once resume() has returned to its caller
    started_after_return: list[bool] = []
    busy_while_filling: list[bool] = []
    fill = GrammarRows.advance_and_fill

    def gated_fill(self: GrammarRows, accepts: list[tuple[list[int], list[int]]], seq_ids: list[int]):  # noqa: ANN202
        started_after_return.append(resumed.wait(30))  # False: resume() waited for this job (deadlock for 30 s)
        return fill(self, accepts, seq_ids)

    resume = ModelRunner.resume

    def observed_resume(self: ModelRunner) -> None:
        resumed.clear()
        had_job = self._masks_job is not None
        resume(self)
        if self._masks_job is not None and not had_job:
            busy_while_filling.append(not self.step_done())
        resumed.set()

    monkeypatch.setattr(GrammarRows, "advance_and_fill", gated_fill)
    monkeypatch.setattr(ModelRunner, "resume", observed_resume)
    params = [SamplingParams(max_tokens=10, temperature=0.0, structured_outputs=StructuredOutputs(json=SCHEMA)),
              SamplingParams(max_tokens=10, temperature=0.0)]
    prompts = ["Describe a person as JSON:", "Once upon a time"]
    switch_interval = sys.getswitchinterval()
    fast = LLM(str(smollm2_dir), async_scheduling=True, max_model_len=256).generate(prompts, params)
    assert sys.getswitchinterval() == switch_interval  # shortened while masks filled, the process's again after
    monkeypatch.undo()
    serial = LLM(str(smollm2_dir), async_scheduling=False, max_model_len=256).generate(prompts, params)
    assert started_after_return and all(started_after_return)
    assert busy_while_filling and all(busy_while_filling)
    assert [c.token_ids for o in fast for c in o.outputs] == [c.token_ids for o in serial for c in o.outputs]
