"""The grammar process (services/worker/grammar_process.py): its masks are the in-process rows' bit for bit; a
process that dies, hangs or cannot build a constraint fails only the sequences it held, and the next ones run on a
new process; nothing outlives close() or the worker's collection."""

from __future__ import annotations

import gc
import os
import signal
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import pytest
import torch

from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.services.worker import grammar_process
from pagoda.services.worker.grammar import GrammarMasks, GrammarRows, SeqGrammar
from pagoda.services.worker.grammar_process import MaskProcess, TokenizerSpec
from pagoda.shared.messages import (
    MaskBusy,
    MaskFill,
    MaskReady,
    NewRequest,
    SamplingParams,
    StepPlan,
    StructuredOutputs,
)
from tests.test_constrained_overlap import SCHEMA  # the same small schema in both files
from tests.test_grammar_gate import CONSTRAINT as PREPARED
from tests.test_grammar_gate import until_compiled


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def spec(smollm2_dir: Path, tokenizer: Tokenizer) -> TokenizerSpec:
    return TokenizerSpec(str(smollm2_dir), tokenizer.vocab_size, (tokenizer.eos_token_id,))


@pytest.fixture(scope="module")
def shared_process(spec: TokenizerSpec) -> Iterator[MaskProcess]:
    rows = MaskProcess(spec, max_rows=16)
    yield rows
    rows.close()


@pytest.fixture
def process(shared_process: MaskProcess) -> Iterator[MaskProcess]:
    """One MaskProcess for the module, its rows reset after each test (a process start costs ~4 s of CPU here: four
    tests took four): a test that kills or loses its process leaves the next one to start another, as the rows do
    when their next request is added."""
    yield shared_process
    shared_process.reset()


def new_request(seq_id: int, generated: list[int] | None = None, constraint: StructuredOutputs | None = None,
                allowed: list[int] | None = None) -> NewRequest:
    params = SamplingParams(structured_outputs=constraint, **({"allowed_token_ids": allowed} if allowed else {}))
    return NewRequest(seq_id, [1, 2, *(generated or [])], 2, [0], 0, params, 0)


def same(got: GrammarMasks | None, expected: GrammarMasks | None) -> bool:
    if got is None or expected is None:
        return got is None and expected is None
    return (got[0].tolist() == expected[0].tolist() and got[2].tolist() == expected[2].tolist()
            and torch.equal(got[1], expected[1]))


def test_masks_equal_the_in_process_rows(process: MaskProcess, spec: TokenizerSpec, tokenizer: Tokenizer) -> None:
    """JSON, regex, choice, allowed_token_ids alone and with a grammar, a free row, a recomputed row (its tokens
    replayed), a row constrained after </think>, drops and a reset: every step's flags, masks and rows are the
    same through bitmask, accept + bitmask and submit (one call per step)."""
    encode = tokenizer.hf.encode
    yes = encode("yes", add_special_tokens=False)[0]
    texts = ['{"name": "Ann", "age": 33}', "12-3456", "blue", "", "", "free", "", "<think>hm</think>yes"]
    constraints = [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex="[0-9]{2}-[0-9]{4}"),
                   StructuredOutputs(choice=["red", "blue"]), None, StructuredOutputs(choice=["yes", "no"]), None,
                   StructuredOutputs(json=SCHEMA),
                   StructuredOutputs(choice=["yes"], reasoning_end="</think>")]
    allowed = [None, None, None, [yes, 7, 40000], [yes], None, None, None]
    tokens = [encode(text, add_special_tokens=False) for text in texts]
    tokens[3] = tokens[4] = [yes]
    tokens[6] = encode('{"name": "Bo", "age": 1}', add_special_tokens=False)
    recomputed = 2  # request 6 arrives with its first two tokens generated already
    news = [new_request(i, tokens[i][:recomputed] if i == 6 else None, constraints[i], allowed[i]) for i in range(8)]
    reference = GrammarRows(spec.load, spec.vocab_size)
    try:
        for rows in (reference, process):
            rows.apply(StepPlan(0, [], [], new_requests=news))
        seq_ids = list(range(8))
        position = {i: (recomputed if i == 6 else 0) for i in seq_ids}
        for step in range(6):
            if step == 3:  # request 2 finishes, request 4 is dropped (a failure elsewhere)
                for rows in (reference, process):
                    rows.apply(StepPlan(step, [], [], finished_seq_ids=[2]))
                    rows.drop([4])
                seq_ids = [i for i in seq_ids if i not in (2, 4)]
            expected = reference.bitmask(seq_ids)
            got = process.bitmask(seq_ids) if step % 2 == 0 else process.submit([], seq_ids).result()
            assert same(got, expected), f"step {step}"
            sampled = [tokens[i][position[i]] if position[i] < len(tokens[i]) else tokenizer.eos_token_id
                       for i in seq_ids]
            for i in seq_ids:
                position[i] += 1
            reference.accept(seq_ids, sampled)
            if step % 2 == 0:
                process.accept(seq_ids, sampled)
            else:  # the runner's path: the tokens travel with the next fill
                assert same(process.advance_and_fill([(seq_ids, sampled)], seq_ids), reference.bitmask(seq_ids))
        assert process.active and process.has_matchers([7]) and not process.constrains([5])
        for rows in (reference, process):
            rows.reset()
        assert process.bitmask(seq_ids) is None and not process.active and not process.constrains(seq_ids)
        for rows in (reference, process):
            rows.apply(StepPlan(9, [], [], new_requests=[new_request(11, None, constraints[0])]))
        assert same(process.bitmask([11]), reference.bitmask([11]))
    finally:
        reference.close()
    assert process.take_failures() == []


def test_a_killed_process_fails_its_sequences_and_a_new_one_serves(spec: TokenizerSpec) -> None:
    rows = MaskProcess(spec, max_rows=4)
    constraint = StructuredOutputs(choice=["red", "blue"])
    rows.apply(StepPlan(0, [], [], new_requests=[new_request(1, None, constraint), new_request(2, None, None, [5]),
                                                 new_request(3)]))
    first = rows.bitmask([1, 2, 3])
    assert first is not None and first[2].tolist() == [0, 1]
    expected = first[1][:1].clone()  # request 1's first mask
    pid = rows.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    job = rows.submit([([1, 2, 3], [7, 5, 9])], [1, 2, 3])
    assert job.result() is None
    failures = dict(rows.take_failures())
    assert sorted(failures) == [1, 2] and all("grammar process" in why for why in failures.values())
    assert not rows.active and not rows.constrains([1, 2, 3]) and rows.pid is None
    rows.apply(StepPlan(1, [], [], new_requests=[new_request(4, None, constraint)]))  # the next request: a new one
    assert rows.pid is not None and rows.pid != pid
    again = rows.bitmask([3, 4])
    assert again is not None and again[0].tolist() == [False, True] and torch.equal(again[1], expected)
    child = rows._child
    assert child is not None
    del rows, job  # the worker's runner collected: its process stops with it
    gc.collect()
    assert child.process.poll() is not None


def test_a_silent_process_times_out_and_is_killed(process: MaskProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    process.apply(StepPlan(0, [], [], new_requests=[new_request(1, None, StructuredOutputs(regex="[a-z]+"))]))
    assert process.bitmask([1]) is not None  # started and answering
    child = process._child
    assert child is not None
    monkeypatch.setattr(grammar_process, "REPLY_TIMEOUT_S", 0.5)
    os.kill(child.process.pid, signal.SIGSTOP)  # alive, silent
    assert process.bitmask([1]) is None
    assert [seq_id for seq_id, _ in process.take_failures()] == [1]
    assert child.process.poll() == -signal.SIGKILL


def test_a_constraint_that_cannot_be_built_fails_alone(tokenizer: Tokenizer) -> None:
    """A grammar process without a tokenizer cannot build matchers: those requests fail, the process stays, and an
    allowed_token_ids row beside them keeps its mask."""
    rows = MaskProcess(TokenizerSpec(None, tokenizer.vocab_size, ()), max_rows=4)
    try:
        rows.apply(StepPlan(0, [], [], new_requests=[new_request(1, None, StructuredOutputs(regex="a+")),
                                                     new_request(2, None, None, [3, 40])]))
        pid = rows.pid
        masks = rows.bitmask([2, 1])
        assert masks is not None and masks[0].tolist() == [True, False] and masks[2].tolist() == [0]
        assert [t for t in range(64) if (int(masks[1][0, t // 32]) >> (t % 32)) & 1] == [3, 40]
        failures = rows.take_failures()
        assert [seq_id for seq_id, _ in failures] == [1] and "tokenizer" in failures[0][1]
        assert rows.pid == pid and not rows.has_matchers([1]) and rows.constrains([2])
    finally:
        rows.close()
    assert rows.pid is None


def test_a_row_left_without_a_token_fails_from_the_process_too(process: MaskProcess, tokenizer: Tokenizer) -> None:
    """An allow-list that fits the grammar's start but not what must follow: the process reports the row once
    (NO_TOKEN_LEFT, with the fill that found it) and stops masking it; the other row goes on."""
    from pagoda.services.worker.grammar import NO_TOKEN_LEFT

    r = tokenizer.hf.encode("r", add_special_tokens=False)
    choice = StructuredOutputs(choice=["red", "blue"])
    process.apply(StepPlan(0, [], [], new_requests=[new_request(1, None, choice, r), new_request(2, None, choice)]))
    assert process.bitmask([1, 2]) is not None and process.take_failures() == []
    masks = process.advance_and_fill([([1, 2], [r[0], r[0]])], [1, 2])
    assert masks is not None and process.take_failures() == [(1, NO_TOKEN_LEFT)]
    assert process.constrains([2]) and not process.constrains([1])
    process.accept([2], tokenizer.hf.encode("ed", add_special_tokens=False)[:1])
    assert process.bitmask([2]) is not None and process.take_failures() == []


def test_engine_ends_the_lost_requests_with_an_error_and_serves_the_next(smollm2_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The offline engine with its grammars in a process: the process dies in the middle of a generation; the
    constrained request ends with finish_reason "error", the free one beside it is untouched, and the same
    constrained request afterwards gets the output it got before the failure."""
    from pagoda import LLM

    llm = LLM(str(smollm2_dir), async_scheduling=True, max_model_len=256, grammar_process=True)
    runner = llm.engine.runner
    assert isinstance(runner.grammars, MaskProcess)
    prompts = ["Describe a person as JSON:", "Once upon a time"]
    params = [SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=StructuredOutputs(json=SCHEMA)),
              SamplingParams(max_tokens=12, temperature=0.0)]
    try:
        before = [c for o in llm.generate(prompts, params) for c in o.outputs]
        submit = MaskProcess.submit
        calls: list[int] = []

        def dying_submit(self: MaskProcess, *args: object, **kwargs: object) -> object:
            calls.append(1)
            if len(calls) == 3 and self._child is not None:
                self._child.process.kill()
                self._child.process.wait()
            return submit(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(MaskProcess, "submit", dying_submit)
        failed = [c for o in llm.generate(prompts, params) for c in o.outputs]
        monkeypatch.undo()
        assert len(calls) >= 3 and failed[0].finish_reason == "error"
        assert (failed[1].token_ids, failed[1].finish_reason) == (before[1].token_ids, before[1].finish_reason)
        after = [c for o in llm.generate(prompts, params) for c in o.outputs]
        assert [(c.token_ids, c.finish_reason) for c in after] == [(c.token_ids, c.finish_reason) for c in before]
    finally:
        runner.grammars.close()


def test_a_fill_waiting_for_a_compile_says_so_and_is_waited_for(tokenizer: Tokenizer,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The process side: a row whose matcher still compiles makes the fill send MaskBusy every BUSY_INTERVAL_S
    until it is built. The worker side: each MaskBusy moves the deadline (a silent process past REPLY_TIMEOUT_S
    is a hung one; a busy one is waited for up to COMPILE_TIMEOUT_S)."""
    monkeypatch.setattr(grammar_process, "BUSY_INTERVAL_S", 0.01)
    pristine: Future[object] = Future()
    calls: list[int] = []

    class Matcher:
        def deep_copy(self) -> Matcher:
            return self

        def is_error(self) -> bool:
            return False

    def busy() -> None:
        calls.append(1)
        if len(calls) == 3:
            pristine.set_result(Matcher())

    slots = torch.zeros((2, 1, 1), dtype=torch.int32)
    rows = grammar_process.SharedMaskRows(TokenizerSpec(None, 32, ()), slots, busy)
    seq = SeqGrammar(StructuredOutputs(regex="a"), None, compiling=pristine)  # type: ignore[arg-type]
    assert rows._ready(1, seq) and len(calls) == 3 and seq.matcher is not None
    rows.close()

    process = MaskProcess(TokenizerSpec(None, tokenizer.vocab_size, ()), max_rows=4)
    try:
        process.apply(StepPlan(0, [], [], new_requests=[new_request(1, None, None, [3])]))
        assert process.bitmask([1]) is not None  # started
        child = process._child
        assert child is not None
        ours, theirs = socket_pair()
        child.conn = ours  # the test answers in the process's place: busy for 3 x REPLY_TIMEOUT_S, then done
        monkeypatch.setattr(grammar_process, "REPLY_TIMEOUT_S", 0.3)

        def answer() -> None:
            fill = msgspec.msgpack.decode(theirs.recv_bytes(), type=MaskFill)
            for _ in range(6):
                theirs.send_bytes(msgspec.msgpack.encode(MaskBusy(fill.job_id)))
                threading.Event().wait(0.15)  # time passing is what is tested: no answer, only MaskBusy
            theirs.send_bytes(msgspec.msgpack.encode(MaskReady(fill.job_id, [0], 0.0, 0.0)))

        helper = threading.Thread(target=answer)
        helper.start()
        masks = process.bitmask([1])
        helper.join()
        assert masks is not None and masks[2].tolist() == [0] and process.take_failures() == []
        assert process._child is child
        theirs.close()
    finally:
        process.close()


def socket_pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


def test_the_process_is_the_default_where_steps_overlap_on_a_gpu_host_with_cpus_to_spare() -> None:
    from pagoda.shared.config import EngineConfig

    default = EngineConfig()
    assert default.resolved_grammar_process("cuda", 16)
    assert not default.resolved_grammar_process("cuda", 2)  # the step loop, the process and its pool want cores
    assert not default.resolved_grammar_process("cpu", 16)  # serial steps: masks fill inline, nothing to overlap
    assert not EngineConfig(async_scheduling=False).resolved_grammar_process("cuda", 16)
    assert EngineConfig(grammar_process=True).resolved_grammar_process("cpu", 2)
    assert not EngineConfig(grammar_process=False).resolved_grammar_process("cuda", 64)


def test_the_grammar_process_reports_a_prepared_constraint(process: MaskProcess) -> None:
    """MaskPrepare is answered by MaskCompiled between any other answers; the worker reads it while idle. A
    process that dies leaves nothing waiting: what it had not built is reported as done (the rows start another
    process when they are added)."""
    assert process.wait_started()
    process.prepare("h1", PREPARED)
    assert process.preparing
    assert until_compiled(process, "h1") == ["h1"]
    assert not process.preparing
    process.prepare("h2", StructuredOutputs(regex="[0-9]{3}"))
    process._lose("killed by the test")
    assert process.take_compiled() == ["h2"] and not process.preparing
