"""The hang verdict (pure logic), wire checks the scheduler applies to its peers, and how the scheduler service
ends requests the worker failed alone and takes back a tokenizer that was only late."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pagoda.services.scheduler.health import (
    BOUND_FACTOR,
    COMPILE_BOUND_S,
    IDLE_BOUND_S,
    RESEND_FACTOR,
    RESEND_FLOOR_S,
    STEP_HISTORY,
    TYPICAL_REFRESH,
    WARMUP_BOUND_S,
    WARMUP_RESEND_S,
    WARMUP_STEPS,
    StepWatch,
    quantile,
)
from pagoda.services.scheduler.service import IDLE_NACK_S, SchedulerService, _columns_agree
from pagoda.shared.config import EngineConfig, ServerConfig
from pagoda.shared.delivery import GAP_RESEND_S, Link
from pagoda.shared.messages import (
    AbortRequest,
    AddRequest,
    Heartbeat,
    ModelInfo,
    PromptScores,
    RequestFailed,
    RowFailure,
    SamplingParams,
    SchedulerToTokenizer,
    SchedulerToWorker,
    Sequenced,
    StepPlan,
    StepResult,
    StopSequence,
    TokenDeltas,
    TokenizerHello,
    TokenizerToScheduler,
    WorkerReady,
    WorkerToScheduler,
)
from pagoda.shared.transport import Codec, seal, unseal
from tests.harness import Outbox, opened


def test_bound_is_fixed_or_derived_with_a_floor() -> None:
    assert StepWatch(step_timeout=7.0, floor=30.0).bound() == 7.0
    watch = StepWatch(floor=2.0)
    assert watch.bound() == WARMUP_BOUND_S  # nothing measured yet: first steps may be slow
    for seconds in [0.01, 0.05, 0.02] * WARMUP_STEPS:
        watch.record(seconds)
    assert watch.bound() == 2.0  # fast steps: the floor holds
    watch.record(1.0)
    assert watch.bound() == BOUND_FACTOR * 1.0
    watch.record(2.56, num_tokens=256)  # 10 ms a token in a large step: a 2048-token prefill may take 10 x 20 s
    assert watch.bound(num_tokens=2048) == BOUND_FACTOR * 0.01 * 2048
    assert watch.bound() == BOUND_FACTOR * 2.56
    assert watch.resend_after(compiling=True) == RESEND_FACTOR * 2.56  # a compile may hold it: the slowest step
    fresh = StepWatch()
    assert fresh.resend_after() == WARMUP_RESEND_S  # first steps may take seconds
    for _ in range(WARMUP_STEPS):
        fresh.record(0.01)
    assert fresh.resend_after() == RESEND_FLOOR_S


def test_a_long_prefill_before_any_large_step_is_no_hang() -> None:
    # Short chats only (no step of LARGE_STEP_TOKENS yet), then an 8k-token prompt: seen taking 98 s on a 2-core
    # host, where a bound of 10 x the slowest step (8 s) stopped a healthy server.
    watch = StepWatch(floor=8.0)
    for num_tokens, seconds in [(40, 0.4), (1, 0.03), (1, 0.05), (2, 0.06)] * WARMUP_STEPS:
        watch.record(seconds, num_tokens)
    assert watch.bound() == 8.0  # 10 x the slowest step is below the floor
    assert watch.bound(num_tokens=8186) == BOUND_FACTOR * 0.05 * 8186  # the slowest time per token, until ...
    assert watch.verdict(100.0, 100.0 - 98.0, 9, worker_last_seen=2.0, ready=True, num_tokens=8186) == ""
    watch.record(0.5, num_tokens=256)  # ... a large step gives the time per token of a large step
    assert watch.bound(num_tokens=8186) == pytest.approx(BOUND_FACTOR * 0.5 / 256 * 8186)


def test_resend_waits_for_what_such_a_step_usually_takes() -> None:
    watch = StepWatch()
    for _ in range(200):
        watch.record(0.25)
    watch.record(6.0)  # one slow step (a warm-up, a CPU hiccup) ...
    for _ in range(TYPICAL_REFRESH):
        watch.record(0.25)
    assert watch.resend_after() == RESEND_FACTOR * 0.25  # ... does not hold every lost plan back for 18 s
    assert watch.resend_after(compiling=True) == RESEND_FACTOR * 6.0
    for _ in range(STEP_HISTORY // 5):  # slower steps now: a fifth of the history
        watch.record(0.4)
    assert watch.resend_after() == RESEND_FACTOR * 0.4
    # a long prefill plan waits in proportion to its tokens (steps of >= LARGE_STEP_TOKENS give the time a token),
    # never longer than the slowest recent step
    for _ in range(STEP_HISTORY):
        watch.record(0.125, num_tokens=256)
    watch.record(2.0, num_tokens=4096)
    for _ in range(TYPICAL_REFRESH):
        watch.record(0.125, num_tokens=256)
    per_token = 0.125 / 256
    assert watch.resend_after(num_tokens=1024) == pytest.approx(RESEND_FACTOR * per_token * 1024)
    assert watch.resend_after(num_tokens=8192) == pytest.approx(RESEND_FACTOR * 2.0)  # capped by the slowest
    assert watch.resend_after(num_tokens=256) == RESEND_FLOOR_S  # 3 x 0.125 s is below the floor


def test_quantile_is_the_nearest_rank_at_or_above() -> None:
    values = deque(float(v) for v in range(1, 11))
    assert quantile(values, 0.9) == 9.0 and quantile(values, 0.91) == 10.0 and quantile(values, 1.0) == 10.0
    assert quantile(values, 0.0) == 1.0 and quantile(values, 0.5) == 5.0
    assert quantile(deque(), 0.9) == 0.0


def test_verdict() -> None:
    watch = StepWatch(floor=2.0)
    for _ in range(WARMUP_STEPS):
        watch.record(0.1)
    assert watch.verdict(100.0, None, -1, worker_last_seen=0.0, ready=False) == ""  # loading: no verdict
    assert watch.verdict(100.0, 99.0, 7, worker_last_seen=99.0, ready=True) == ""
    hung = watch.verdict(100.0, 97.5, 7, worker_last_seen=97.5, ready=True)
    assert "step 7" in hung and "2.5 s" in hung
    # idle: late heartbeats (a busy host) are no hang until the idle bound passes (no client waits meanwhile)
    assert watch.verdict(100.0, None, -1, worker_last_seen=100.0 - IDLE_BOUND_S + 1, ready=True) == ""
    assert "silent" in watch.verdict(100.0, None, -1, worker_last_seen=100.0 - IDLE_BOUND_S - 1, ready=True)
    slow = StepWatch(floor=30.0)
    for _ in range(WARMUP_STEPS):
        slow.record(0.1)
    assert slow.verdict(100.0, None, -1, worker_last_seen=80.0, ready=True) == ""  # 20 s without a heartbeat


def test_result_columns_must_agree() -> None:
    assert _columns_agree(StepResult(0, [1, 2], [5, 6]))
    assert _columns_agree(StepResult(0, [1, 2], [5, 6], [-0.1, -0.2], [[1], []], [[-0.5], []]))
    assert not _columns_agree(StepResult(0, [1, 2], [5]))
    assert not _columns_agree(StepResult(0, [1], [5], [-0.1, -0.2]))
    assert not _columns_agree(StepResult(0, [1], [5], [-0.1], [[1, 2]], [[-0.5]]))
    assert not _columns_agree(StepResult(0, [1], [5], prompt_scores=[PromptScores(1, 1, [3, 4], [-1.0], [], [])]))


@contextlib.contextmanager
def _service(tmp_path: Path, max_inflight_plans: int) -> Iterator[SchedulerService]:
    """A SchedulerService whose plan and tokenizer sockets are outboxes, with a worker ready."""
    service = SchedulerService(EngineConfig(max_num_seqs=8), ServerConfig(runtime_dir=str(tmp_path),
                                                                          heartbeat_timeout=3.0))
    real = service.plans, service.front
    service.plans, service.front = Outbox(), Outbox()  # type: ignore[assignment]
    service._on_worker_ready(WorkerReady(rank=0, num_kv_blocks=64, block_size=16, max_model_len=256, vocab_size=512,
                                         eos_token_ids=[2], max_num_batched_tokens=256,
                                         max_inflight_plans=max_inflight_plans))
    try:
        yield service
    finally:
        service.plans, service.front = real
        service._close()


@pytest.fixture
def service(tmp_path: Path) -> Iterator[SchedulerService]:
    with _service(tmp_path, max_inflight_plans=1) as service:
        yield service


@pytest.fixture
def async_service(tmp_path: Path) -> Iterator[SchedulerService]:
    """The same with async scheduling: two plans in flight."""
    with _service(tmp_path, max_inflight_plans=2) as service:
        yield service


def _to_tokenizers(service: SchedulerService) -> list[tuple[bytes, Any]]:
    codec = Codec(SchedulerToTokenizer)
    out = [(frames[0], opened(codec, codec.decode(frames[1]))) for frames in service.front.sent]  # type: ignore[attr-defined]
    service.front.sent.clear()  # type: ignore[attr-defined]
    return out


def test_failed_rows_fail_only_their_requests(service: SchedulerService) -> None:
    identity = b"tok0"
    service._on_tokenizer_frames([identity, Codec(TokenizerToScheduler).encode(TokenizerHello("tok0", 1))])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for name in ("bad", "odd", "good"):
        service._on_tokenizer_frames([identity, Codec(TokenizerToScheduler).encode(
            AddRequest(name, [5, 6, 7], params))])
    service._maybe_step()
    [plan] = [p for p in map(Codec(SchedulerToWorker).decode, service.plans.sent)  # type: ignore[attr-defined]
              if isinstance(p, StepPlan)]
    assert len(plan.seq_ids) == 3
    bad, odd, good = plan.seq_ids
    _to_tokenizers(service)
    service._on_result(StepResult(plan.step_id, [good], [9], failed=[RowFailure(bad, 400, "refused: x"),
                                                                      RowFailure(odd, 500, "sampler: y")]))
    messages = [m for _, m in _to_tokenizers(service)]
    failed = {m.request_id: (m.status, m.error_type) for m in messages if isinstance(m, RequestFailed)}
    assert failed == {"bad": (400, "invalid_request_error"), "odd": (500, "server_error")}
    deltas = [m for m in messages if isinstance(m, TokenDeltas)]
    assert [(d.request_ids, d.token_ids) for d in deltas] == [(["good"], [9])]
    assert set(service.scheduler.requests) == {"good"}  # type: ignore[union-attr]


def test_a_late_tokenizer_comes_back_a_stranger_does_not(service: SchedulerService) -> None:
    encode = Codec(TokenizerToScheduler).encode
    late, stranger = b"tok-late", b"stranger"
    service._on_tokenizer_frames([late, encode(TokenizerHello("tok-late", 1))])
    service._on_tokenizer_frames([late, encode(AddRequest("r1", [5, 6, 7], SamplingParams(max_tokens=4)))])
    _to_tokenizers(service)
    service._sweep_dead_tokenizers(time.monotonic() + 10.0)  # silent past the timeout (a GIL-bound call, a load)
    assert late not in service.tokenizers and "r1" not in service.scheduler.requests  # type: ignore[union-attr]
    [(to, failed)] = _to_tokenizers(service)
    assert to == late and isinstance(failed, RequestFailed) and failed.status == 503  # it answers its client
    service._on_tokenizer_frames([late, encode(Heartbeat("tok-late"))])
    assert late in service.tokenizers  # back on its next heartbeat, told the model again
    assert any(isinstance(m, ModelInfo) for _, m in _to_tokenizers(service))
    service._on_tokenizer_frames([stranger, encode(Heartbeat("stranger"))])
    assert stranger not in service.tokenizers  # registration still takes a hello


def test_a_tokenizer_registered_with_another_scheduler_is_told_at_once(service: SchedulerService) -> None:
    """A tokenizer that registered with the scheduler before this one (a restart) heartbeats as if nothing
    happened: our heartbeat answers it, whose sender tells it to register again (else it keeps the old ModelInfo
    until our silence passes heartbeat_timeout, and its requests meanwhile are refused here)."""
    encode = Codec(TokenizerToScheduler).encode
    service._on_tokenizer_frames([b"tok-old", encode(Heartbeat("tok-old"))])
    assert b"tok-old" not in service.tokenizers  # registration still takes a hello
    [(to, beat)] = _to_tokenizers(service)
    assert to == b"tok-old" and beat == Heartbeat(sender=service.instance_id)
    service._on_tokenizer_frames([b"tok-old", encode(TokenizerHello("tok-old", 1, stream=1))])
    assert b"tok-old" in service.tokenizers
    assert any(isinstance(m, ModelInfo) for _, m in _to_tokenizers(service))


def test_a_peer_is_honoured_only_for_what_it_owns(service: SchedulerService) -> None:
    """Aborts and stop strings from a tokenizer that does not own the request are dropped; its EOS ids stop only
    its own requests; parameters past the bounds (n = 2**31) fail that request alone, with a 400."""
    send = Codec(TokenizerToScheduler).encode
    service._on_tokenizer_frames([b"tok0", send(TokenizerHello("tok0", 1))])
    service._on_tokenizer_frames([b"evil", send(TokenizerHello("evil", 2, eos_token_ids=[9]))])
    params = SamplingParams(temperature=0.0, max_tokens=4)
    service._on_tokenizer_frames([b"tok0", send(AddRequest("mine", [5, 6, 7], params))])
    service._on_tokenizer_frames([b"evil", send(AddRequest("huge", [5], msgspec.structs.replace(params, n=2**31)))])
    for forged in (AbortRequest("mine"), StopSequence("mine", 0)):
        service._on_tokenizer_frames([b"evil", send(forged)])
    assert set(service.scheduler.requests) == {"mine"}  # type: ignore[union-attr]
    refused = [m for identity, m in _to_tokenizers(service) if isinstance(m, RequestFailed)]
    assert [(m.request_id, m.status, m.param) for m in refused] == [("huge", 400, "n")]
    service._maybe_step()
    [plan] = [p for p in map(Codec(SchedulerToWorker).decode, service.plans.sent)  # type: ignore[attr-defined]
              if isinstance(p, StepPlan)]
    service._on_result(StepResult(plan.step_id, plan.seq_ids, [9]))  # "evil"'s EOS: no stop for tok0's request
    assert "mine" in service.scheduler.requests  # type: ignore[union-attr]
    service._on_tokenizer_frames([b"tok0", send(AbortRequest("mine"))])  # the owner's abort counts
    assert not service.scheduler.requests  # type: ignore[union-attr]


def _plans_sent(service: SchedulerService) -> list[StepPlan]:
    plans = [p for p in map(Codec(SchedulerToWorker).decode, service.plans.sent)  # type: ignore[attr-defined]
             if isinstance(p, StepPlan)]
    service.plans.sent.clear()  # type: ignore[attr-defined]
    return plans


def _two_plans_in_flight(service: SchedulerService) -> tuple[StepPlan, StepPlan]:
    encode = Codec(TokenizerToScheduler).encode
    service._on_tokenizer_frames([b"tok0", encode(TokenizerHello("tok0", 1))])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    service._on_tokenizer_frames([b"tok0", encode(AddRequest("r", [5, 6, 7], params))])
    service._maybe_step()
    service._maybe_step()  # the next plan goes out before the first one's result (async scheduling)
    first, second = _plans_sent(service)
    assert (first.seq, second.seq) == (0, 1)
    return first, second


def test_a_plan_the_worker_lacks_goes_again_at_once(async_service: SchedulerService) -> None:
    """The worker holds plan 1 and waits for plan 0 (lost): its ack says so and plan 0 goes again without waiting
    for the resend timer, at most once every GAP_RESEND_S while the gap stays."""
    service = async_service
    first, _ = _two_plans_in_flight(service)
    encode = Codec(WorkerToScheduler).encode
    service._on_worker_frames([encode(Heartbeat("worker0", acked=-1))])  # no gap: nothing to send
    assert _plans_sent(service) == []
    service._on_worker_frames([encode(Heartbeat("worker0", acked=-1, gap=True))])
    [again] = _plans_sent(service)
    assert again == first and service.sends.entries[0].num_sends == 2
    service._on_worker_frames([encode(Heartbeat("worker0", acked=-1, gap=True))])  # the same report again at once
    assert _plans_sent(service) == []


def test_an_idle_worker_shows_a_lost_plan_or_a_lost_result(service: SchedulerService) -> None:
    """Serial steps, nothing behind a loss: the worker's idle ack (nothing launched, every result sent) names what
    it applied. A plan it never applied that went out over IDLE_NACK_S ago goes again at once; one just sent is
    left alone (it may be on its way); a plan it applied whose result never came goes again for the cached result."""
    encode = Codec(WorkerToScheduler).encode
    service._on_tokenizer_frames([b"tok0", Codec(TokenizerToScheduler).encode(TokenizerHello("tok0", 1))])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    service._on_tokenizer_frames([b"tok0", Codec(TokenizerToScheduler).encode(AddRequest("r", [5, 6], params))])
    service._maybe_step()
    [plan] = _plans_sent(service)
    service._on_worker_frames([encode(Heartbeat("worker0", acked=-1, idle=True))])  # crossed the plan: in flight
    assert _plans_sent(service) == []
    service.sends.entries[plan.seq].sent_at -= IDLE_NACK_S
    service._on_worker_frames([encode(Heartbeat("worker0", acked=-1, idle=True))])
    assert _plans_sent(service) == [plan]  # lost on the way
    service.sends.entries[plan.seq].sent_at -= GAP_RESEND_S
    service._on_worker_frames([encode(Heartbeat("worker0", acked=plan.seq))])  # applied, busy: nothing to say
    assert _plans_sent(service) == []
    service._on_worker_frames([encode(Heartbeat("worker0", acked=plan.seq, idle=True))])  # applied, result lost
    assert _plans_sent(service) == [plan]


def test_a_result_that_overtakes_an_older_one_brings_that_plan_again(async_service: SchedulerService) -> None:
    """Plans run in order, so the second plan's result arriving first means the first one's was lost: the first
    plan goes again at once (the worker answers a repeat with its cached result), then both apply in order."""
    service = async_service
    first, second = _two_plans_in_flight(service)
    _to_tokenizers(service)
    service._on_result(StepResult(second.step_id, second.seq_ids, [9]))
    [again] = _plans_sent(service)
    assert again == first and not _to_tokenizers(service)  # the early result waits
    service._on_result(StepResult(first.step_id, first.seq_ids, [8]))  # the cached reply
    deltas = [m for _, m in _to_tokenizers(service) if isinstance(m, TokenDeltas)]
    assert [token for d in deltas for token in d.token_ids] == [8, 9]
    assert not service.early_results and not service.sends.entries


def test_a_step_that_may_compile_a_grammar_gets_the_compile_bound() -> None:
    watch = StepWatch(floor=2.0)
    for _ in range(WARMUP_STEPS):
        watch.record(0.1)
    assert watch.bound() == 2.0 and watch.bound(compiling=True) == COMPILE_BOUND_S
    assert watch.verdict(100.0, 95.0, 3, worker_last_seen=95.0, ready=True, compiling=True) == ""
    assert "step 3" in watch.verdict(100.0, 95.0, 3, worker_last_seen=95.0, ready=True)


def test_a_tokenizers_stream_is_applied_once_in_order_and_a_new_stream_registers_afresh(
        service: SchedulerService) -> None:
    """Requests in a tokenizer's sequenced stream are applied once, in order, whatever the wire did to them; the
    tokens go back in the scheduler's stream, carrying the ack; a repeated hello ends nothing, a hello naming a new
    stream (the tokenizer gave us up) ends what it owned and restarts the stream back."""
    codec = Codec(TokenizerToScheduler)
    tok = Link(resend_s=0.5)
    service._on_tokenizer_frames([b"tok0", codec.encode(TokenizerHello("tok0", 1, stream=tok.stream))])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first, second = (seal(codec, tok, AddRequest(name, [5, 6, 7], params), 0.0) for name in ("a", "b"))
    for frame in (second, first, first, second):  # reordered and repeated
        service._on_tokenizer_frames([b"tok0", frame])
    assert list(service.scheduler.requests) == ["a", "b"]  # type: ignore[union-attr]
    service._on_tokenizer_frames([b"tok0", codec.encode(TokenizerHello("tok0", 1, stream=tok.stream))])
    assert list(service.scheduler.requests) == ["a", "b"]  # type: ignore[union-attr]  # a repeat: nothing ends
    _to_tokenizers(service)
    service._maybe_step()
    [plan] = [p for p in map(Codec(SchedulerToWorker).decode, service.plans.sent)  # type: ignore[attr-defined]
              if isinstance(p, StepPlan)]
    service._on_result(StepResult(plan.step_id, plan.seq_ids, [9, 9]))
    back = Codec(SchedulerToTokenizer)
    [frame] = [f[1] for f in service.front.sent]  # type: ignore[attr-defined]  # one frame for the step
    envelope = back.decode(frame)
    assert isinstance(envelope, Sequenced) and (envelope.ack_stream, envelope.ack) == (tok.stream, 1)
    [deltas] = unseal(back, tok, envelope, 1.0)
    assert isinstance(deltas, TokenDeltas) and deltas.request_ids == ["a", "b"]
    old_stream = envelope.stream
    tok.restart()
    service._on_tokenizer_frames([b"tok0", codec.encode(TokenizerHello("tok0", 1, stream=tok.stream))])
    assert not service.scheduler.requests  # type: ignore[union-attr]  # orphaned: aborted
    service._on_tokenizer_frames([b"tok0", seal(codec, tok, AddRequest("c", [5, 6], params), 2.0)])
    service.front.sent.clear()  # type: ignore[attr-defined]
    service._fail(b"tok0", "c", 500, "x", "server_error")
    [frame] = [f[1] for f in service.front.sent]  # type: ignore[attr-defined]
    restarted = back.decode(frame)
    assert isinstance(restarted, Sequenced) and restarted.stream != old_stream and restarted.seq == 0


def test_a_tokenizer_mid_stream_with_a_restarted_scheduler_hears_it_at_once(service: SchedulerService) -> None:
    """A sequenced frame from a peer this scheduler does not know (its stream began with our predecessor): our
    heartbeat tells it the scheduler changed (it re-registers), and a request in it gets a 503, not silence."""
    codec = Codec(TokenizerToScheduler)
    service._on_tokenizer_frames([b"tok0", seal(codec, Link(resend_s=0.5), AddRequest("r", [5, 6], SamplingParams()),
                                                0.0)])
    messages = [m for _, m in _to_tokenizers(service)]
    assert any(isinstance(m, Heartbeat) and m.sender == service.instance_id for m in messages)
    assert [(m.request_id, m.status) for m in messages if isinstance(m, RequestFailed)] == [("r", 503)]
    assert b"tok0" not in service.tokenizers
