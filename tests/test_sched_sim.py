"""bench/sched_sim.py: the scheduler driven to completion with no GPU, its step and preemption counts."""

from __future__ import annotations

from dataclasses import replace

from pagoda.bench.sched_sim import ModelCost, simulate


def test_ample_cache_runs_one_wave_without_preemption() -> None:
    result = simulate(40, 100, 50, num_blocks=40 * 10, max_num_seqs=64, max_num_batched_tokens=4096)
    assert result.preemptions == 0 and result.mixed_steps == 1, "every prompt in the first step's budget"
    assert result.prefill_tokens == 40 * 100, "each prompt computed once"
    # the first token comes out of the prefill; the other 49 from decode steps of all 40 rows
    assert result.decode_steps == 49 and result.decode_rows == 40 * 49
    first_decode_context = 40 * 101
    assert result.decode_context_tokens == sum(first_decode_context + 40 * i for i in range(49))


def test_a_tight_cache_preempts_and_recomputes() -> None:
    ample = simulate(40, 100, 50, num_blocks=400, max_num_seqs=64, max_num_batched_tokens=1024)
    tight = simulate(40, 100, 50, num_blocks=240, max_num_seqs=64, max_num_batched_tokens=1024)
    assert tight.preemptions > 0
    assert tight.prefill_tokens > ample.prefill_tokens, "preempted sequences are recomputed"
    assert tight.decode_steps > ample.decode_steps
    cost = ModelCost()
    assert tight.estimate_s(cost) > ample.estimate_s(cost)
    faster_attention = replace(cost, attention_bytes_per_s=2 * cost.attention_bytes_per_s)
    assert ample.estimate_s(faster_attention) < ample.estimate_s(cost)


def test_swap_space_copies_instead_of_recomputing() -> None:
    tight = simulate(40, 100, 50, num_blocks=240, max_num_seqs=64, max_num_batched_tokens=1024)
    swapping = simulate(40, 100, 50, num_blocks=240, max_num_seqs=64, max_num_batched_tokens=1024,
                        num_swap_blocks=400)
    assert swapping.preemptions > 0 and swapping.swapped == swapping.preemptions
    assert swapping.prefill_tokens < tight.prefill_tokens, "swapped sequences come back without their prompts"
    assert swapping.swapped_block_copies > 0
    cost = ModelCost()
    assert swapping.estimate_s(cost) < tight.estimate_s(cost)

