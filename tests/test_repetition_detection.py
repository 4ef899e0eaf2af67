"""vLLM's repetition_detection: the watch against the definition, the checks on the field, and the scheduler ending
a looping completion (serial and with two plans in flight, with preemption and n > 1). Served over HTTP:
tests/test_vllm_compat.py."""

from __future__ import annotations

import random

import msgspec
import pytest

from pagoda.bench.scheduler_step import measure
from pagoda.services.protocol.schemas import ChatBody, CompletionBody, chat_request, completion_params, decode_body
from pagoda.services.scheduler.repetition import SPARSE_MAX_SIZES, RepetitionWatch, output_repeats
from pagoda.services.scheduler.scheduler import Request
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import (
    MAX_REPETITION_PATTERN,
    FinishReason,
    RepetitionDetection,
    SamplingParams,
)
from tests.test_scheduler import (
    EOS,
    FakeWorker,
    assert_all_free,
    make_request,
    make_scheduler,
    run_overlapped,
    run_until_done,
)

# ---------------------------------------------------------------- the watch against the definition


@pytest.mark.parametrize("output, params, repeats", [
    ([1, 2, 3, 1, 2, 3, 1, 2, 3], (3, 2, 3), True),
    ([1, 2, 3, 1, 2, 3], (3, 2, 3), False),  # two copies, three asked for
    ([1, 2, 3, 1, 2, 3, 1, 2, 4], (3, 2, 3), False),  # the last copy breaks off
    ([5, 6, 1, 2, 1, 2, 1, 2], (2, 1, 3), True),  # only the end counts
    ([1, 2, 1, 2, 1, 2, 5], (2, 1, 3), False),
    ([10, 20, 10, 20, 10, 20], (5, 3, 3), False),  # a 2-token pattern under min_pattern_size 3
    ([7, 7, 7, 7], (4, 0, 4), True),  # min_pattern_size 0 means 1
    ([7, 7, 7], (4, 0, 4), False),
    ([1, 2, 3, 4, 1, 2, 3, 4], (4, 4, 2), True),
    ([], (3, 1, 2), False),
])
def test_a_watch_fed_token_by_token_agrees_with_the_definition(output: list[int], params: tuple[int, int, int],
                                                               repeats: bool) -> None:
    detection = RepetitionDetection(max_pattern_size=params[0], min_pattern_size=params[1], min_count=params[2])
    assert output_repeats(output, detection) is repeats
    watch = RepetitionWatch(detection)
    seen = [watch.advance(output, 0, end) for end in range(1, len(output) + 1)]
    assert (seen[-1] if seen else False) is repeats
    assert seen == [output_repeats(output[:end], detection) for end in range(1, len(output) + 1)]


@pytest.mark.parametrize("seed", range(40))
def test_random_outputs_give_the_definitions_answer_at_every_token(seed: int) -> None:
    """Loops of random length and count spliced into random text, fed one token or several at a time, behind a
    prompt; both the sparse (few sizes) and the dense (many sizes) runs."""
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 8, 50])
    output: list[int] = []
    while len(output) < 300:
        if rng.random() < 0.5:
            output += [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        else:
            pattern = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            output += pattern * rng.randint(1, 5) + pattern[:rng.randint(0, len(pattern))]
    shortest = rng.randint(0, 6)
    widest = rng.choice([shortest + rng.randint(0, 10), shortest + SPARSE_MAX_SIZES + rng.randint(1, 40)])
    detection = RepetitionDetection(max_pattern_size=max(widest, 1), min_pattern_size=shortest,
                                    min_count=rng.randint(2, 5))
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
    token_ids = prompt + output
    watch = RepetitionWatch(detection)
    assert watch.dense is (detection.max_pattern_size - detection.shortest + 1 > SPARSE_MAX_SIZES)
    end = len(prompt)
    while end < len(token_ids):
        end = min(len(token_ids), end + rng.choice([1, 1, 1, 3]))
        assert watch.advance(token_ids, len(prompt), end) == output_repeats(token_ids[len(prompt):end], detection)


def test_a_loop_is_found_as_soon_as_its_last_copy_is_whole() -> None:
    detection = RepetitionDetection(max_pattern_size=8, min_count=3)
    loop = [4, 5, 6, 7, 8]
    output = [1, 2, 3] + loop * 3
    watch = RepetitionWatch(detection)
    found = [end for end in range(1, len(output) + 1) if watch.advance(output, 0, end)]
    assert found[0] == len(output)


# ---------------------------------------------------------------- the field's checks


@pytest.mark.parametrize("fields, param", [
    ({"max_pattern_size": 4, "min_count": 1}, "repetition_detection.min_count"),
    ({"max_pattern_size": 4}, "repetition_detection.min_count"),
    ({"max_pattern_size": -1, "min_count": 2}, "repetition_detection.max_pattern_size"),
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "repetition_detection.min_pattern_size"),
    ({"max_pattern_size": MAX_REPETITION_PATTERN + 1, "min_count": 2}, "repetition_detection.max_pattern_size"),
    ({"max_pattern_size": 4, "min_count": True}, "repetition_detection.min_count"),
])
def test_bad_settings_are_refused_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(repetition_detection=RepetitionDetection(**fields)).validate()
    assert caught.value.param == param


def test_off_settings_are_taken_and_watch_nothing() -> None:
    for fields in ({}, {"max_pattern_size": 0, "min_count": 0}, {"max_pattern_size": 0, "min_count": 7}):
        params = SamplingParams(repetition_detection=RepetitionDetection(**fields)).validate()
        assert not params.detects_repetition
    assert SamplingParams(repetition_detection=RepetitionDetection(
        max_pattern_size=MAX_REPETITION_PATTERN, min_count=2)).validate().detects_repetition


def test_beam_search_refuses_it() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(use_beam_search=True, n=2, temperature=0.0, repetition_detection=RepetitionDetection(
            max_pattern_size=4, min_count=2)).validate()
    assert caught.value.param == "repetition_detection"


def test_the_request_bodies_carry_it_to_the_sampling_params() -> None:
    watch = {"max_pattern_size": 6, "min_pattern_size": 2, "min_count": 4}
    completion = decode_body(b'{"model": "m", "prompt": "hi", "repetition_detection": '
                             + msgspec.json.encode(watch) + b"}", CompletionBody)
    assert completion_params(completion).repetition_detection == RepetitionDetection(**watch)
    chat = decode_body(msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                            "repetition_detection": watch}), ChatBody)
    assert chat_request(chat, "r", 0.0).params.repetition_detection == RepetitionDetection(**watch)


@pytest.mark.parametrize("watch", [{"max_pattern_size": 4, "min_count": 2, "window": 3},
                                   {"max_pattern_size": "4", "min_count": 2},
                                   {"max_pattern_size": 4.5, "min_count": 2}, [4, 2]])
def test_malformed_bodies_are_refused(watch: object) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        decode_body(msgspec.json.encode({"model": "m", "prompt": "hi", "repetition_detection": watch}),
                    CompletionBody)
    assert (caught.value.param or "").startswith("repetition_detection")


# ---------------------------------------------------------------- the scheduler ends looping completions


def looping_token(seq_id: int, output_index: int) -> int:
    """Odd sequences' outputs loop [20, 21, 22] from their 5th token; the others' never repeat."""
    if seq_id % 2 == 1 and output_index >= 4:
        return 20 + (output_index - 4) % 3
    return 100 + output_index


def run_loops(max_inflight_plans: int, **params: object) -> list[Request]:
    sched = make_scheduler(max_inflight_plans=max_inflight_plans, num_blocks=20, block_size=4, max_num_seqs=4)
    worker = FakeWorker(4, looping_token)
    detection = RepetitionDetection(max_pattern_size=4, min_count=3)
    requests = [make_request(f"r{i}", 10 + i, max_tokens=40, repetition_detection=detection, **params)
                for i in range(4)]
    if max_inflight_plans == 1:
        for request in requests:
            sched.add_request(request)
        run_until_done(sched, worker)
    else:
        run_overlapped(sched, worker, [(0, request) for request in requests])
    assert_all_free(sched)
    return requests


@pytest.mark.parametrize("max_inflight_plans", [1, 2])
def test_the_scheduler_ends_a_looping_completion_at_its_third_copy(max_inflight_plans: int) -> None:
    """4 + 9 tokens for the loopers (3 copies of the 3-token loop), all 40 for the others; blocks few enough that
    a looper is preempted (its tokens recomputed) on the way."""
    requests = run_loops(max_inflight_plans)
    assert any(seq.num_preemptions for request in requests for seq in request.sequences if seq.seq_id % 2)
    for request in requests:
        (seq,) = request.sequences
        output = seq.token_ids[seq.num_prompt_tokens:]
        if seq.seq_id % 2 == 1:
            assert seq.finish_reason == FinishReason.REPETITION
            assert output == [looping_token(seq.seq_id, i) for i in range(13)]
        else:
            assert seq.finish_reason == FinishReason.LENGTH and len(output) == 40


def test_min_tokens_holds_the_check_back() -> None:
    """vLLM checks nothing before min_tokens: the loop found at 13 tokens ends the output at 20, still looping."""
    for request in run_loops(1, min_tokens=20):
        (seq,) = request.sequences
        if seq.seq_id % 2 == 1:
            assert seq.finish_reason == FinishReason.REPETITION and seq.num_output_tokens == 20


def test_a_stop_token_wins_over_the_repetition_it_completes() -> None:
    sched = make_scheduler()
    worker = FakeWorker(16, lambda seq_id, index: EOS)  # EOS again and again: a loop, and a stop
    request = make_request("r", 8, max_tokens=10, ignore_eos=False,
                           repetition_detection=RepetitionDetection(max_pattern_size=1, min_count=2))
    sched.add_request(request)
    run_until_done(sched, worker)
    (seq,) = request.sequences
    assert seq.finish_reason == FinishReason.STOP and seq.num_output_tokens == 1


def test_each_of_n_completions_is_watched_on_its_own() -> None:
    sched = make_scheduler()
    worker = FakeWorker(16, looping_token)
    request = make_request("r", 8, max_tokens=30, n=2,
                           repetition_detection=RepetitionDetection(max_pattern_size=3, min_count=3))
    sched.add_request(request)
    run_until_done(sched, worker)
    reasons = {seq.seq_id % 2: (seq.finish_reason, seq.num_output_tokens) for seq in request.sequences}
    assert reasons == {1: (FinishReason.REPETITION, 13), 0: (FinishReason.LENGTH, 30)}


@pytest.mark.parametrize("sizes", [4, SPARSE_MAX_SIZES + 8])
def test_the_scheduler_bench_keeps_every_watched_sequence_running(sizes: int) -> None:
    """bench/scheduler_step.py's watched steps: a count no output reaches ends nothing (its measure asserts every
    sequence is scheduled each step), with one id repeated, the case where every size matches."""
    result = measure(num_seqs=4, prompt_len=8, num_steps=3 * sizes, repetition_sizes=sizes, tokens="same")
    assert result["repetition_sizes"] == sizes and result["mean_ms"] > 0
