"""Async (overlap) scheduling gives the serial path's outputs: tokens, logprobs, finish reasons, prompt scores.

The same requests run through LLM(async_scheduling=False) and LLM(async_scheduling=True) on CPU with the tiny
random model (and SmolLM2's tokenizer, for text and stop strings). On CPU every launch completes before it
returns, but the async engine still launches step N+1 before it finishes step N, so step N+1's decode inputs
come from the device-side last sampled ids and the scheduler plans with provisional tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.services.scheduler.scheduler import PLACEHOLDER
from pagoda.services.scheduler.service import Peer
from pagoda.shared.config import EngineConfig
from pagoda.shared.messages import (
    AddRequest,
    RequestFailed,
    SchedulerToTokenizer,
    SchedulerToWorker,
    StepPlan,
    StepResult,
    TokenDeltas,
)
from pagoda.shared.transport import Codec
from tests.harness import Outbox, opened

VOCAB = 512  # the tiny shape's


def make_llm(smollm2_dir: Path, async_scheduling: bool, **kwargs: Any) -> LLM:
    llm = LLM("tiny", tokenizer=str(smollm2_dir), async_scheduling=async_scheduling, max_model_len=256, seed=0,
              max_num_seqs=8, **kwargs)
    assert llm.engine.scheduler.max_inflight_plans == (2 if async_scheduling else 1)
    return llm


def spy_overlap(llm: LLM) -> list[int]:
    """How many steps were launched and not finished at each launch (1 or more: the launch overlapped)."""
    seen: list[int] = []
    runner = llm.engine.runner
    launch = runner.launch

    def recording(plan: Any) -> bool:
        seen.append(runner.num_launched)
        return launch(plan)

    runner.launch = recording  # type: ignore[method-assign]
    return seen


def prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % (VOCAB - 10) + 5 for j in range(length)]
            for i, length in enumerate([5, 17, 40, 9, 33, 23, 12, 60])]


def request_params(stop_text: str, stop_id: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[stop_text]),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, logprobs=0),
        SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=16, prompt_logprobs=1),
        SamplingParams(temperature=1.0, seed=3, max_tokens=18, presence_penalty=0.5, frequency_penalty=0.3,
                       min_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=1),
    ]


def summary(outputs: list[Any]) -> list[Any]:
    return [(out.prompt_logprobs, [(c.index, c.token_ids, c.text, c.finish_reason, c.logprobs, c.cumulative_logprob)
                                   for c in out.outputs]) for out in outputs]


def rounded(value: Any) -> Any:
    """Logprobs to 1e-4: a step's batch (and so a matmul's reduction order) differs between the two runs once
    preemption recomputes a prompt, which moves fp32 logprobs by an ulp; tokens and text must match exactly."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(rounded(v) for v in value)
    return value


@pytest.fixture(scope="module")
def stops(smollm2_dir: Path) -> tuple[str, int]:
    """A stop string and a stop token that the serial run of the first requests actually meets."""
    llm = make_llm(smollm2_dir, False)
    out = llm.generate(prompts()[:2], SamplingParams(temperature=0.0, max_tokens=30))
    text, token_ids = out[1].outputs[0].text, out[0].outputs[0].token_ids
    assert len(text) > 12 and len(token_ids) > 8
    return text[6:9], token_ids[6]


@pytest.mark.parametrize("num_kv_blocks", [None, 12])
def test_async_outputs_equal_serial(smollm2_dir: Path, stops: tuple[str, int], num_kv_blocks: int | None) -> None:
    params = request_params(*stops)
    runs = {}
    for async_scheduling in (False, True):
        llm = make_llm(smollm2_dir, async_scheduling, num_kv_blocks=num_kv_blocks)
        overlap = spy_overlap(llm)
        runs[async_scheduling] = summary(llm.generate(prompts(), params))
        scheduler = llm.engine.scheduler
        scheduler.blocks.check_integrity(tables=[])
        assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks
        assert (max(overlap) >= 1) == async_scheduling, "async launches step N+1 before finishing step N"
        if num_kv_blocks is not None:
            assert scheduler.stats.num_preemptions > 0, "the small cache is meant to force preemption"
    assert rounded(runs[True]) == rounded(runs[False])
    assert [[c[:4] for c in completions] for _, completions in runs[True]] == \
        [[c[:4] for c in completions] for _, completions in runs[False]]  # tokens, text, finish: exact
    reasons = [c[3] for _, completions in runs[True] for c in completions]
    assert reasons.count("stop") >= 2 and "length" in reasons  # the stop string and the stop token were met
    assert runs[True][4][0] is not None and len(runs[True][4][0]) == len(prompts()[4])  # max_tokens=0 scored
    assert runs[True][4][1][0][1] == []


def test_abort_mid_run_leaves_the_others_unchanged(smollm2_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20)
    finals = {}
    for async_scheduling in (False, True):
        llm = make_llm(smollm2_dir, async_scheduling)
        engine = llm.engine
        ids = [engine.add_request(prompt, params) for prompt in prompts()[:4]]
        for _ in range(6):
            engine.step()
        engine.abort_request(ids[1])
        scheduler = engine.scheduler
        assert ids[1] not in scheduler.requests
        while engine.has_unfinished_requests():
            engine.step()
        finals[async_scheduling] = [engine.pop_output(i) for i in ids]
        scheduler.blocks.check_integrity(tables=[])
        assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks
    uninterrupted = make_llm(smollm2_dir, True).generate(prompts()[:4], params)
    for outputs in finals.values():
        aborted = outputs[1].outputs[0]
        assert aborted.finish_reason == "abort" and PLACEHOLDER not in aborted.token_ids
        full = uninterrupted[1].outputs[0].token_ids
        assert 0 < len(aborted.token_ids) < len(full) and aborted.token_ids == full[:len(aborted.token_ids)]
        for index in (0, 2, 3):
            assert outputs[index].outputs[0].token_ids == uninterrupted[index].outputs[0].token_ids


def test_stream_stops_at_a_stop_string_with_async(smollm2_dir: Path, stops: tuple[str, int]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=[stops[0]])
    texts = []
    for async_scheduling in (False, True):
        llm = make_llm(smollm2_dir, async_scheduling)
        deltas = list(llm.stream(prompts()[1], params))
        texts.append(("".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids],
                      deltas[-1].finish_reason))
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.scheduler.blocks.num_blocks
    assert texts[0] == texts[1] and texts[0][2] == "stop"


def test_async_scheduling_is_auto_by_device() -> None:
    assert EngineConfig().resolved_max_inflight_plans("cuda") == 2
    assert EngineConfig().resolved_max_inflight_plans("cpu") == 1
    assert EngineConfig(async_scheduling=False).resolved_max_inflight_plans("cuda") == 1
    assert EngineConfig(async_scheduling=True).resolved_max_inflight_plans("cpu") == 2


def test_no_async_scheduling_flag() -> None:
    import argparse

    from pagoda.shared.config import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).async_scheduling is None
    assert engine_config_from_args(parser.parse_args(["--no-async-scheduling"])).async_scheduling is False


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen3"])
def test_async_equals_serial_on_cuda_with_graphs(shape: str) -> None:
    """CUDA: CUDA-graph decode with device-gathered input ids, pinned double buffers, events; same outputs."""
    many = [[(11 * i + 5 * j) % (VOCAB - 10) + 5 for j in range(3 + 7 * i)] for i in range(24)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, logprobs=1),
              SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=33),
              SamplingParams(temperature=0.8, seed=2, n=2, max_tokens=25, presence_penalty=0.4)] * 8
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(shape, async_scheduling=async_scheduling, max_model_len=512, seed=0, max_num_seqs=32,
                  num_kv_blocks=64)
        assert llm.engine.runner.graphs is not None
        overlap = spy_overlap(llm)
        runs[async_scheduling] = summary(llm.generate(many, params))
        assert (max(overlap) >= 1) == async_scheduling
        assert llm.engine.scheduler.stats.num_preemptions > 0
    assert [[c[:4] for c in completions] for _, completions in runs[True]] == \
        [[c[:4] for c in completions] for _, completions in runs[False]]
    # bf16 logits: the async run's batches differ (a stopped sequence's extra row, other CUDA-graph sizes), which
    # moves logprobs by about a bf16 ulp of the logits; tokens, text and finish reasons above are exact.
    assert_close_logprobs(runs[True], runs[False], tolerance=0.05)


@pytest.mark.gpu
def test_swapped_preemption_equals_recompute_on_cuda() -> None:
    """CUDA: preempted sequences' blocks copied to pinned host slots and back on the step's stream (async
    scheduling, CUDA graphs) give the outputs a recompute gives."""
    many = [[(11 * i + 5 * j) % (VOCAB - 10) + 5 for j in range(3 + 7 * i)] for i in range(24)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, logprobs=1),
              SamplingParams(temperature=0.9, top_k=50, seed=7, max_tokens=33)] * 12
    runs = {}
    for swap_space in (0.0, 0.5):
        llm = LLM("tiny", max_model_len=512, seed=0, max_num_seqs=32, num_kv_blocks=64, swap_space=swap_space)
        runs[swap_space] = summary(llm.generate(many, params))
        stats = llm.engine.scheduler.stats
        assert stats.num_preemptions > 0 and (stats.num_swapped > 0) == (swap_space > 0)
    assert [[c[:4] for c in completions] for _, completions in runs[0.5]] == \
        [[c[:4] for c in completions] for _, completions in runs[0.0]]
    assert_close_logprobs(runs[0.5], runs[0.0], tolerance=0.05)


@pytest.mark.gpu
def test_no_triton_compile_after_start_up() -> None:
    """The start-up warm-ups compile every kernel variant serving launches: batches of odd sizes, sampled settings
    with penalties, prompts served whole from the prefix cache (eager decode-only batches), a long one alone."""
    llm = LLM("tiny-qwen3", max_model_len=2048, seed=0, max_num_seqs=32)
    watch = llm.engine.runner.compile_watch
    assert watch is not None
    many = [[(7 * i + 3 * j) % (VOCAB - 10) + 5 for j in range(20 + 13 * i)] for i in range(13)]
    sampled = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.2,
                              seed=i, max_tokens=9 + i) for i in range(13)]
    top_p_only = SamplingParams(temperature=0.7, top_p=0.8, min_p=0.05, seed=1, max_tokens=7)
    for _ in range(2):  # the second time every prompt is in the prefix cache
        llm.generate(many, sampled)
        llm.generate(many[:5], top_p_only)
        llm.generate([many[-1] * 9], SamplingParams(temperature=0.0, max_tokens=5, logprobs=1))
    assert watch.compiles == []


def assert_close_logprobs(ours: Any, theirs: Any, tolerance: float) -> None:
    """Same structure and keys everywhere; floats within `tolerance`."""
    if isinstance(ours, float) and isinstance(theirs, float):
        assert abs(ours - theirs) <= tolerance, (ours, theirs)
    elif isinstance(ours, dict):
        assert isinstance(theirs, dict) and ours.keys() == theirs.keys()
        for key in ours:
            assert_close_logprobs(ours[key], theirs[key], tolerance)
    elif isinstance(ours, (list, tuple)):
        assert isinstance(theirs, (list, tuple)) and len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            assert_close_logprobs(a, b, tolerance)
    else:
        assert ours == theirs


@contextlib.contextmanager
def service_on_outboxes(tmp_path: Path, max_num_seqs: int, **ready: Any) -> Iterator[tuple[Any, Outbox, Outbox]]:
    """A SchedulerService whose worker and front-end sockets are Outboxes (what it sends is kept, nothing is
    delivered), after a WorkerReady of the tiny vocabulary with `ready`'s fields; closed with its real sockets."""
    from pagoda.services.scheduler.service import SchedulerService
    from pagoda.shared.config import ServerConfig
    from pagoda.shared.messages import WorkerReady

    service = SchedulerService(EngineConfig(max_num_seqs=max_num_seqs), ServerConfig(runtime_dir=str(tmp_path)))
    real_sockets = service.plans, service.front
    plans_out, front_out = Outbox(), Outbox()
    service.plans, service.front = plans_out, front_out  # type: ignore[assignment]
    try:
        service._on_worker_ready(WorkerReady(rank=0, vocab_size=VOCAB, eos_token_ids=[2], **ready))
        yield service, plans_out, front_out
    finally:
        service.plans, service.front = real_sockets
        service._close()


def test_a_failed_step_also_fails_the_sequences_it_swapped_out(tmp_path: Path) -> None:
    """A plan's swap-out copies run on the worker before its forward: when the step fails, the sequences it
    preempted by swap may have host slots that were never written, so they end with an error instead of coming
    back from them; a request after it finishes."""
    from test_scheduler import FakeWorker


    to_worker, to_tokenizer = Codec(SchedulerToWorker), Codec(SchedulerToTokenizer)
    with service_on_outboxes(tmp_path, 4, num_kv_blocks=6, block_size=4, max_model_len=64, max_num_batched_tokens=64,
                             max_inflight_plans=1, num_swap_blocks=8) as (service, plans_out, front_out):
        identity = b"tok0"
        service.tokenizers[identity] = Peer(0.0)
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        for index, name in enumerate(("first", "second", "third")):
            service._on_add(identity, service.tokenizers[identity],
                            AddRequest(name, [100 * (index + 1) + i for i in range(7)], params))
        worker = FakeWorker(4)
        ended: dict[str, str] = {}
        failed_step = None
        for _ in range(80):
            if not service.scheduler.has_unfinished():
                break
            service._maybe_step()
            for payload in plans_out.sent:
                plan = to_worker.decode(payload)
                if not isinstance(plan, StepPlan):
                    continue
                if plan.swap_out and failed_step is None:  # the first plan that swaps a sequence out fails
                    failed_step = plan.step_id
                    victims = set(service.scheduler._swapped_out_by_step[plan.step_id])
                    victim_requests = {service.scheduler.get_sequence(seq_id).request.request_id
                                       for seq_id in victims}
                    running = {service.scheduler.get_sequence(seq_id).request.request_id for seq_id in plan.seq_ids}
                    service._on_result(StepResult(step_id=plan.step_id, seq_ids=[], sampled_token_ids=[],
                                                  error="RuntimeError: swap copy failed"))
                    service._on_add(identity, service.tokenizers[identity], AddRequest("after", [7] * 9, params))
                    continue
                worker.apply(plan)
                if plan.seq_ids:
                    service._on_result(worker.execute(plan))
            plans_out.sent.clear()
            for frames in front_out.sent:
                message = opened(to_tokenizer, to_tokenizer.decode(frames[1]))
                if isinstance(message, RequestFailed):
                    ended[message.request_id] = "failed"
                elif isinstance(message, TokenDeltas):
                    for request_id, reason in zip(message.request_ids, message.finish_reasons, strict=True):
                        if reason >= 0:
                            ended[request_id] = "finished"
            front_out.sent.clear()
        assert failed_step is not None, "no plan swapped a sequence out"
        assert victim_requests and not victim_requests & running, "the victims were preempted, not running"
        assert {name for name, how in ended.items() if how == "failed"} == victim_requests | running
        assert set(ended) == {"first", "second", "third", "after"} and ended["after"] == "finished"
        assert not service.scheduler.has_unfinished() and service.scheduler.host.num_free_blocks == 8
        assert service.scheduler._swapped_out_by_step == {}


def test_scheduler_service_keeps_two_plans_in_flight_and_fails_only_the_failed_steps_requests(
        tmp_path: Path) -> None:
    """SchedulerService with a worker that runs plans as they come: two plans go out before a result, results
    complete them in order, a failed step fails its own requests and the next result still applies."""
    from test_scheduler import FakeWorker, default_token


    with service_on_outboxes(tmp_path, 8, num_kv_blocks=64, block_size=16, max_model_len=256,
                             max_num_batched_tokens=256, max_inflight_plans=2) as (service, plans_out, front_out):
        identity = b"tok0"
        peer = service.tokenizers[identity] = Peer(0.0)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        to_worker, to_tokenizer = Codec(SchedulerToWorker), Codec(SchedulerToTokenizer)
        worker = FakeWorker(16)

        def sent_plans() -> list[StepPlan]:
            plans = [to_worker.decode(payload) for payload in plans_out.sent]
            plans_out.sent.clear()
            return [plan for plan in plans if isinstance(plan, StepPlan)]

        def to_tokenizers() -> list[Any]:
            messages = [opened(to_tokenizer, to_tokenizer.decode(frames[1])) for frames in front_out.sent]
            front_out.sent.clear()
            return messages

        service._on_add(identity, peer, AddRequest("doomed", list(range(5, 14)), params))
        service._maybe_step()
        first = sent_plans()
        assert len(first) == 2 and first[1].step_id == first[0].step_id + 1, "plan N+1 goes out while N runs"
        results = []
        for plan in first:
            worker.apply(plan)
            results.append(worker.execute(plan))
        for name, length in (("a", 5), ("b", 30)):
            service._on_add(identity, peer, AddRequest(name, list(range(5, 5 + length)), params))
        service._maybe_step()
        assert sent_plans() == [], "no third plan before a result"
        service._on_result(StepResult(step_id=first[0].step_id, seq_ids=[], sampled_token_ids=[],
                                      error="RuntimeError: boom"))
        failed = [m.request_id for m in to_tokenizers() if isinstance(m, RequestFailed)]
        assert failed == ["doomed"] and "doomed" not in service.scheduler.requests
        service._on_result(results[1])  # the second plan's result completes the second plan
        assert service.pipeline is not None and not service.pipeline.inflight
        assert not [m for m in to_tokenizers() if isinstance(m, TokenDeltas) and len(m)], "doomed's token dropped"
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        reasons: dict[str, int] = {}
        for _ in range(100):
            if not service.scheduler.has_unfinished():
                break
            service._maybe_step()
            plans = sent_plans()
            assert len(plans) <= 2
            for plan in plans:
                worker.apply(plan)
            for plan in plans:
                if plan.seq_ids:
                    service._on_result(worker.execute(plan))
            for message in to_tokenizers():
                assert isinstance(message, TokenDeltas)
                for request_id, token_id, reason in zip(message.request_ids, message.token_ids,
                                                        message.finish_reasons, strict=True):
                    tokens[request_id] += [token_id] if token_id >= 0 else []
                    if reason >= 0:
                        reasons[request_id] = reason
        seq_ids = {name: 1 + i for i, name in enumerate(("a", "b"))}
        for name in ("a", "b"):
            assert tokens[name] == [default_token(seq_ids[name], i) for i in range(6)]
        assert set(reasons) == {"a", "b"}
        service.scheduler.blocks.check_integrity(tables=[])
        assert service.scheduler.blocks.num_free_blocks == service.scheduler.blocks.num_blocks


# [None] (no preemption) is extended: [11] runs the serial path on the same rows with the same assertions, its rows
# preempted, against the grammar process; test_async_outputs_equal_serial[None] keeps an unpreempted async run
@pytest.mark.parametrize("num_kv_blocks", [pytest.param(None, marks=pytest.mark.extended), 11])
def test_async_structured_outputs_equal_serial(smollm2_dir: Path, num_kv_blocks: int | None) -> None:
    """Constrained rows next to free ones: with two plans in flight the mask of step N+1 must follow step N's
    token, so both modes give the same (valid) outputs, also through preemption."""
    import re

    from pagoda.shared.messages import StructuredOutputs

    pattern = r"[a-c]{3}-[0-9]{2}"
    params = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputs(regex=pattern)),
              SamplingParams(temperature=0.0, max_tokens=20),
              SamplingParams(temperature=0.9, seed=7, max_tokens=12,
                             structured_outputs=StructuredOutputs(choice=["red", "green", "blue"])),
              SamplingParams(temperature=0.8, seed=2, max_tokens=16)] * 2
    runs = {}
    # the real model (a grammar needs the tokenizer's whole vocabulary). Preempted (11 blocks: every mode preempts),
    # the async run is the grammar process's: the in-process async masks through preemption are
    # tests/test_result_invariance.py's test_constrained_and_stopped_rows_keep_their_state_through_preemption (JSON,
    # regex and choice rows over SmolLM2's vocabulary, async, preempted) and, unpreempted on SmolLM2,
    # tests/test_constrained_overlap.py's test_constrained_outputs_equal_with_and_without_the_parallel_path[False]
    modes = [(False, False), (True, False) if num_kv_blocks is None else (True, True)]
    for async_scheduling, grammar_process in modes:
        llm = LLM(str(smollm2_dir), async_scheduling=async_scheduling, max_model_len=256, max_num_seqs=8,
                  num_kv_blocks=num_kv_blocks, grammar_process=grammar_process)
        runs[async_scheduling, grammar_process] = summary(llm.generate(prompts(), params))
        llm.engine.scheduler.blocks.check_integrity(tables=[])
        llm.engine.runner.grammars.close()
        if num_kv_blocks is not None:
            assert llm.engine.scheduler.stats.num_preemptions > 0, "the small cache is meant to force preemption"
    assert [[c[:4] for c in completions] for _, completions in runs[modes[1]]] == \
        [[c[:4] for c in completions] for _, completions in runs[False, False]]
    texts = [completions[0][2] for _, completions in runs[modes[1]]]
    assert all(re.fullmatch(pattern, texts[i]) for i in (0, 4))
    assert all(texts[i] in ("red", "green", "blue") for i in (2, 6))
