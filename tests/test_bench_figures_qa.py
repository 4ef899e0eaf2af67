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
