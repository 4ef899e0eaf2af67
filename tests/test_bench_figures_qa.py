"""What `pagoda bench throughput` and `pagoda bench serve` report follows from what they measured: the counts of
one timed run are that run's own (not the warm-up's, not an earlier repeat's)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pagoda.bench.throughput import measure_pagoda
from pagoda.bench.workload import PRESETS


@pytest.fixture(scope="module")
def small_llm():  # noqa: ANN201 - an LLM
    from pagoda import LLM

    # four seats: the last two prompts find the shared prefix the first ones cached; 14 blocks of 16: the four
    # growing sequences outgrow them
    return LLM("tiny", load_format="dummy", num_kv_blocks=14, max_num_seqs=4, seed=0)


def test_each_timed_run_counts_its_own_prefix_hits_and_preemptions(small_llm: object) -> None:
    """measure_pagoda reported the scheduler's counters since the engine was made: a second run of the same
    shared-prefix workload (--repeats 2, or bench/decoding.py's several workloads in one process) said twice the
    first run's prefix_hit_tokens and num_preemptions, the warm-up's counted in too; num_steps also counted the
    64 steps of the batch-1 timing (--latency-prompt-len) made after the timed run."""
    workload = replace(PRESETS["shared-prefix"], num_prompts=6, shared_prefix_len=64, input_len=16, output_len=48)
    runs = [measure_pagoda(small_llm, replace(workload, seed=7919 * r), latency_prompt_len=8 * (r == 2))
            for r in range(3)]
    hits = [run["prefix_hit_tokens"] for run in runs]
    preemptions = [run["num_preemptions"] for run in runs]
    assert hits[0] > 0 and preemptions[0] > 0, runs[0]  # the workload does hit and preempt
    assert hits == [hits[0]] * 3, hits  # the same workload shape: the same hits each run
    assert preemptions == [preemptions[0]] * 3, preemptions
    assert all(run["num_swapped"] <= run["num_preemptions"] for run in runs)
    assert "batch1_decode_ms_p50" in runs[2] and runs[2]["num_steps"] == runs[0]["num_steps"]


class FakeClock:
    """time.perf_counter for bench/serve.py: one second later at every reading."""

    def __init__(self) -> None:
        self.now = -1.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


class FakeResponse:
    def __init__(self, status: int, lines: list[bytes]) -> None:
        self.status, self.lines = status, lines

    @property
    def content(self):  # noqa: ANN201 - an async iterator of lines, as aiohttp's StreamReader
        async def lines():  # noqa: ANN202
            for line in self.lines:
                yield line
        return lines()

    async def text(self) -> str:
        return b"".join(self.lines).decode()

    async def __aenter__(self) -> FakeResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class FakeSession:
    """An aiohttp session whose POST answers the given SSE lines."""

    def __init__(self, lines: list[bytes], status: int = 200) -> None:
        self.response = FakeResponse(status, lines)
        self.bodies: list[dict] = []

    def post(self, url: str, json: dict, headers: dict) -> FakeResponse:
        self.bodies.append(json)
        return self.response


def sse(event: object) -> bytes:
    import json

    return b"data: " + json.dumps(event).encode() + b"\n"


def completion_chunks(tokens: int, choices: int) -> list[bytes]:
    """A streamed completion of `choices` completions of `tokens` tokens each, as pagoda sends it (one chunk per
    token and completion, interleaved), its usage chunk and [DONE]."""
    lines = [sse({"choices": [{"index": c, "text": f"t{t}", "finish_reason": None}]})
             for t in range(tokens) for c in range(choices)]
    return [*lines, sse({"choices": [], "usage": {"completion_tokens": tokens * choices}}), b"data: [DONE]\n"]


def stream(lines: list[bytes], monkeypatch: pytest.MonkeyPatch, sampling: dict | None = None):  # noqa: ANN201
    import asyncio

    from pagoda.bench import serve

    monkeypatch.setattr(serve, "time", FakeClock())
    return asyncio.run(serve._one(FakeSession(lines), "http://x", "m", [1, 2], 3, {},  # type: ignore[arg-type]
                                  sampling or {"temperature": 0.0}))


def test_n_completions_time_each_completions_own_gaps(monkeypatch: pytest.MonkeyPatch) -> None:
    """With n > 1 (the n4 workload) the completions' chunks interleave: the gap from one completion's chunk to the
    next completion's (the same step) was taken as an inter-token latency (ITL p50 0.02 ms against ~110 ms per
    token, SmolLM2 on CPU), and TPOT divided by all n completions' tokens."""
    from pagoda.bench.serve import summarize

    # the clock reads 0 at the start, then 1..6 at the six token chunks (completion 0 at 1, 3, 5), 7 at usage, 8 at
    # the end
    record = stream(completion_chunks(3, 2), monkeypatch, {"temperature": 0.8, "n": 2})
    assert record.ok and record.output_tokens == 6
    assert record.ttft_s == 1.0 and record.e2e_s == 8.0
    assert record.gaps_s == [2.0, 2.0, 2.0, 2.0]  # two per completion, each from its own previous chunk
    summary = summarize([record], 8.0, 1, None)
    assert summary["itl_p50_ms"] == 2000.0
    assert summary["tpot_p50_ms"] == 1e3 * (8.0 - 1.0) / (3 - 1)  # per completion: 3 tokens, 2 after the first
    one = stream(completion_chunks(3, 1), monkeypatch)  # n = 1 as before
    assert one.gaps_s == [1.0, 1.0] and summarize([one], 5.0, 1, None)["tpot_p50_ms"] == 1e3 * (5.0 - 1.0) / 2


@pytest.mark.parametrize(("lines", "reason"), [
    ([sse({"choices": [{"index": 0, "text": "a"}]}), sse({"error": {"message": "queue full", "code": 503}}),
      b"data: [DONE]\n"], "error event: queue full"),
    ([sse({"choices": [{"index": 0, "text": "a"}]})], "without a usage chunk"),  # the server went away cleanly
    ([b"data: <html>bad gateway</html>\n"], "not a JSON event: <html>"),
    ([b"data: 5\n"], "not a JSON object: 5"),
    ([b"data: \xff\xfe\n"], "not a JSON event"),
])
def test_a_stream_that_fails_after_its_200_is_a_failure_that_says_why(lines: list[bytes], reason: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that ended with an error event (pagoda's when --max-waiting-requests refuses a streamed request,
    or a request times out before its first token) or without usage counted as failed with no reason: the level
    printed 'failed N' alone and its JSON said errors []; a line that was not JSON ended the whole run with a
    JSONDecodeError traceback (an undecodable one with a UnicodeDecodeError)."""
    record = stream(lines, monkeypatch)
    assert not record.ok and reason in record.error, record


def test_latency_percentiles_interpolate_between_ranks_as_numpy_does() -> None:
    """_pct took the value at int(q * n): the upper one of two middles, so the p50 of two requests was the slower
    one (and equal to their p99), the p50 of [1, 2, 3, 4] was 3 and the p99 of 100 samples their maximum."""
    import numpy as np

    from pagoda.bench.serve import _pct

    for values in ([10.0, 20.0], [4.0, 1.0, 3.0, 2.0], [float(v) for v in range(1, 101)], [7.0],
                   [0.3, 0.1, 0.9, 0.5, 0.2, 0.8, 0.4]):
        for q in (0.0, 0.5, 0.9, 0.99, 1.0):
            assert _pct(values, q) == pytest.approx(float(np.percentile(values, 100 * q))), (values, q)
    assert _pct([10.0, 20.0], 0.5) == 15.0 and _pct([5.0], 0.99) == 5.0
    assert _pct([float(v) for v in range(1, 101)], 0.99) == pytest.approx(99.01)


def test_poisson_arrivals_follow_the_seed_and_the_window_ends_with_the_last_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """run_level slept one more exponential gap after sending its last request: that wait, in which nothing was
    sent and every request may long have finished, was inside the measured window, so the rate level's elapsed_s
    took one mean gap (1 / rate) more and its out tok/s and req/s came out low (by 1 / num_prompts of the window
    at saturation, more at low rates)."""
    import asyncio
    import random

    from pagoda.bench import serve

    clock = {"now": 0.0}
    sent: list[float] = []

    class VirtualTime:
        @staticmethod
        def perf_counter() -> float:
            return clock["now"]

    real_sleep = asyncio.sleep

    async def virtual_sleep(delay: float) -> None:
        await real_sleep(0)  # the requests already created start now, as they do at a real sleep's start
        clock["now"] += delay

    async def instant(*args: object) -> serve.RequestRecord:
        sent.append(clock["now"])
        return serve.RequestRecord(ok=True, ttft_s=0.0, e2e_s=0.0, output_tokens=4)

    monkeypatch.setattr(serve, "time", VirtualTime())
    monkeypatch.setattr(serve.asyncio, "sleep", virtual_sleep)
    monkeypatch.setattr(serve, "_one", instant)
    result = asyncio.run(serve.run_level("http://x", "m", [[1]] * 5, 4, None, 2.0, {}, seed=7))
    rng = random.Random(7)
    gaps = [rng.expovariate(2.0) for _ in range(4)]
    assert sent == pytest.approx([sum(gaps[:i]) for i in range(5)])  # the seeded arrivals, the first at once
    assert result["elapsed_s"] == pytest.approx(sum(gaps))  # to the last request's end, which is its arrival here
    assert result["output_tok_per_s"] == pytest.approx(20 / sum(gaps))


@pytest.mark.parametrize("command", ["serve", "throughput"])
def test_an_unwritable_out_is_refused_before_the_run(command: str, tmp_path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """--out under a file (or a folder, or a read-only place) was found out when the report was written: serve's
    after every level had run, throughput's after pagoda's whole run, each a FileExistsError traceback whose
    report was lost (and throughput's peers never ran)."""
    from pagoda.bench import serve, throughput
    from pagoda.bench.report import unwritable
    from pagoda.cli import main

    def no_run(*args: object) -> None:
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(serve, "run_level", no_run)
    monkeypatch.setattr(throughput, "_run_child", no_run)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out in (blocker / "report.json", tmp_path):  # under a file; a folder
        argv = ["bench", command, "--out", str(out), "--num-prompts", "1", "--input-len", "4", "--output-len", "2"]
        argv += ["--concurrency", "1"] if command == "serve" else ["--model", "tiny", "--load-format", "dummy"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"--out {out}: cannot write the report there" in err and "Traceback" not in err, err
    fresh = tmp_path / "new" / "report.json"
    assert unwritable(fresh) is None and not fresh.exists()  # the check leaves no empty report behind
    assert unwritable(blocker) is None and blocker.exists()  # nor removes one that was there


@pytest.mark.parametrize(("flag", "value"), [
    ("--num-prompts", "0"), ("--num-prompts", "-3"), ("--input-len", "0"), ("--output-len", "0"),
    ("--output-len", "x"), ("--input-len-jitter", "1.5"), ("--input-len-jitter", "-0.5"),
    ("--input-len-jitter", "nan"), ("--repeats", "0"), ("--latency-prompt-len", "-1")])
def test_a_bad_throughput_size_flag_is_refused_naming_it(flag: str, value: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """bench throughput took any int or float: --num-prompts 0 / -3, --output-len 0 and --repeats 0 started the
    child and ended in its traceback ('pagoda failed'; the floor printed -62,736,299 out tok/s for -3 prompts);
    --input-len 0 ran 1-token prompts under a report saying 0; --input-len-jitter 1.5 or -0.5 ran, its lengths
    clipped at 1, with the flag's value reported."""
    from pagoda.cli import build_parser

    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["bench", "throughput", flag, value])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and "Traceback" not in err, err


def test_throughput_size_flags_take_their_edges() -> None:
    from pagoda.cli import build_parser

    args = build_parser().parse_args(["bench", "throughput", "--num-prompts", "1", "--output-len", "1",
                                      "--input-len-jitter", "0", "--latency-prompt-len", "0", "--repeats", "1"])
    assert (args.num_prompts, args.output_len, args.input_len_jitter, args.latency_prompt_len) == (1, 1, 0.0, 0)
    assert build_parser().parse_args(["bench", "throughput", "--input-len-jitter", "1"]).input_len_jitter == 1.0


@pytest.mark.parametrize(("flags", "message"), [
    (["--model", "nosuch"], "--model nosuch: unknown dummy shape 'nosuch'"),
    (["--input-len", "9000"], "exceed the 2048-token context of tiny"),
    (["--input-len", "8", "--output-len", "2041"], "longest prompt (9 tokens) and 2041 output tokens exceed"),
    (["--max-model-len", "99999"], "--max-model-len 99999: max_model_len 99999 exceeds"),
])
def test_a_throughput_plan_that_cannot_run_is_refused_before_any_process(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown model, a --max-model-len past the model's context or a prompt with no room for its outputs
    started the child anyway, and came back as 'pagoda failed' with 2,000 characters of its traceback (the reason
    on the last line, cut off in the JSON's error), exit 1."""
    from pagoda.bench import throughput
    from pagoda.cli import main

    def no_run(*args: object) -> None:
        raise AssertionError("a child was started")

    monkeypatch.setattr(throughput, "_run_child", no_run)
    argv = ["bench", "throughput", "--model", "tiny", "--load-format", "dummy", "--num-prompts", "2",
            "--input-len", "8", "--input-len-jitter", "0.1", "--output-len", "4", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_a_plan_that_fits_the_context_exactly_runs() -> None:
    from pagoda.bench.throughput import plan_error
    from pagoda.cli import build_parser

    args = build_parser().parse_args(["bench", "throughput", "--model", "tiny", "--load-format", "dummy",
                                      "--num-prompts", "2", "--input-len", "2000", "--input-len-jitter", "0",
                                      "--output-len", "48"])
    assert plan_error(args) is None  # 2000 + 48 = 2048: the engine takes it
