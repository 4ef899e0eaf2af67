"""The scheduler alone, on a workload, with no GPU: how many decode and prefill-carrying steps it plans, how many
sequences it preempts and how many prompt tokens it recomputes, and a throughput estimate from a step-time model
fitted to one H200 run.

    python -m pagoda.bench.sched_sim --workload trtllm-1000 [--num-prompts 3000] [--num-blocks 117836]
        [--max-num-seqs 1024] [--max-num-batched-tokens 16384] [--attention-tbps 2.72] [--swap-gib 16]

The scheduler (services/scheduler/scheduler.py) is pure logic: this drives schedule() -> a fake worker that samples
one token per finished row -> update() until every request is done, exactly as the engine's loop does (one plan in
flight). Measured against the real run (H200, 2026-12-03, llama3-8b FP8 + FP8 KV, trtllm-1000, fresh process):
1,131 decode + 74 prefill-carrying steps and 71 preemptions there; 1,132 + 74 and 71 here.

The estimate (ModelCost's defaults, fitted to that run): a decode step costs a fixed 2.2 ms (weights), 12.8 us a
row (FP8 GEMMs at ~1,250 TFLOP/s) and its cached tokens' KV bytes at 2.72 TB/s; a prefill-carrying step 15.4 us a
prefill token. It reproduces that run's 68.6 s of GPU time by construction; use it to compare schedules and to see
which term a target needs, not as a measurement. Swapped blocks (--swap-gib, the worker's host slots: preempted
sequences copied out and back instead of recomputed) cost their bytes at swap_bytes_per_s each way (an assumed
40 GB/s over PCIe 5, not measured here), serialized with the steps as the worker runs them.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass

from pagoda.bench.workload import ENGINE_DEFAULTS, preset
from pagoda.services.scheduler.scheduler import Request, Scheduler
from pagoda.shared.messages import SamplingParams, StepPlan, StepResult


@dataclass(frozen=True, slots=True)
class ModelCost:
    """Seconds a step takes on the GPU, by its shape (defaults: llama3-8b FP8 + FP8 KV on one H200)."""

    decode_fixed_s: float = 2.2e-3
    decode_row_s: float = 12.8e-6
    kv_bytes_per_token: int = 65536
    attention_bytes_per_s: float = 2.72e12
    prefill_token_s: float = 15.4e-6
    swap_bytes_per_s: float = 40e9  # host <-> device copies of swapped blocks (assumed, see the module docstring)


@dataclass(slots=True)
class SimResult:
    num_prompts: int
    decode_steps: int = 0
    mixed_steps: int = 0
    prefill_tokens: int = 0  # tokens computed in prefill-carrying steps (prompts, and prompts again after preemption)
    decode_rows: int = 0  # rows over every decode step
    decode_context_tokens: int = 0  # cached tokens read over every decode step
    preemptions: int = 0
    swapped: int = 0  # of the preemptions, those copied to host slots
    swapped_block_copies: int = 0  # blocks copied out plus blocks copied back

    def estimate_s(self, cost: ModelCost, block_size: int = 16) -> float:
        decode = (self.decode_steps * cost.decode_fixed_s + self.decode_rows * cost.decode_row_s
                  + self.decode_context_tokens * cost.kv_bytes_per_token / cost.attention_bytes_per_s)
        swap = self.swapped_block_copies * block_size * cost.kv_bytes_per_token / cost.swap_bytes_per_s
        return decode + self.prefill_tokens * cost.prefill_token_s + swap


class _Worker:
    """The worker's bookkeeping reduced to lengths: a row whose tokens are all computed samples one token."""

    def __init__(self) -> None:
        self.lengths: dict[int, list[int]] = {}  # seq id -> [tokens known, tokens computed]

    def run(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished_seq_ids:
            self.lengths.pop(seq_id, None)
        for new in plan.new_requests:
            self.lengths[new.seq_id] = [len(new.token_ids), new.num_computed_tokens]
        sampled: list[int] = []
        for seq_id, count in zip(plan.seq_ids, plan.num_scheduled_tokens, strict=True):
            state = self.lengths[seq_id]
            state[1] += count
            if state[1] == state[0]:
                state[0] += 1
                sampled.append(seq_id)
        return StepResult(step_id=plan.step_id, seq_ids=sampled, sampled_token_ids=[7] * len(sampled))


def simulate(num_prompts: int, input_len: int, output_len: int, *, num_blocks: int, max_num_seqs: int,
             max_num_batched_tokens: int, block_size: int = 16, seed: int = 0,
             num_swap_blocks: int = 0) -> SimResult:
    """Run the workload through a fresh Scheduler (random prompts: no prefix hits; EOS ignored)."""
    rng = random.Random(seed)
    sched = Scheduler(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, max_model_len=input_len + output_len + block_size,
                      vocab_size=100_000, eos_token_ids=(1,), num_swap_blocks=num_swap_blocks)
    for index in range(num_prompts):
        sampling = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        sched.add_request(Request(request_id=f"r{index}", sampling=sampling, arrival_time=float(index),
                                  prompt_token_ids=[rng.randrange(2, 100_000) for _ in range(input_len)]))
    worker, result = _Worker(), SimResult(num_prompts)
    while sched.has_unfinished():
        plan = sched.schedule()
        context = sum(worker.lengths[s][0] for s in plan.seq_ids if s in worker.lengths)
        sched.update(plan, worker.run(plan))
        result.swapped_block_copies += (len(plan.swap_out) + len(plan.swap_in)) // 2
        prefill = [count for count in plan.num_scheduled_tokens if count > 1]
        if prefill:
            result.mixed_steps += 1
            result.prefill_tokens += sum(prefill)
        elif plan.seq_ids:
            result.decode_steps += 1
            result.decode_rows += len(plan.seq_ids)
            result.decode_context_tokens += context
    result.preemptions = sched.stats.num_preemptions
    result.swapped = sched.stats.num_swapped
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="trtllm-1000")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--num-blocks", type=int, default=117_836, help="KV blocks (the s17 H200 run's fp8 cache)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the preset's, else 256")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16_384, help="the offline engine's on CUDA")
    parser.add_argument("--attention-tbps", type=float, default=ModelCost().attention_bytes_per_s / 1e12,
                        help="what-if: the decode attention's rate on KV bytes (TB/s; default: the fitted 2.72)")
    parser.add_argument("--swap-gib", type=float, default=16.0,
                        help="host swap space (the engine's --swap-space; default 16, as on CUDA; 0: recompute)")
    args = parser.parse_args(argv)
    workload = preset(args.workload, num_prompts=args.num_prompts)
    seats = args.max_num_seqs or ENGINE_DEFAULTS.get(args.workload, {}).get("max_num_seqs", 256)
    cost = ModelCost(attention_bytes_per_s=args.attention_tbps * 1e12)
    block_bytes = 16 * cost.kv_bytes_per_token
    result = simulate(workload.num_prompts, workload.input_len, workload.output_len, num_blocks=args.num_blocks,
                      max_num_seqs=seats, max_num_batched_tokens=args.max_num_batched_tokens,
                      num_swap_blocks=int(args.swap_gib * (1 << 30)) // block_bytes)
    seconds = result.estimate_s(cost)
    print(json.dumps(asdict(result)))
    print(f"estimated {seconds:.1f} s of GPU time: {workload.num_prompts * workload.output_len / seconds:,.0f} out "
          f"tok/s (ModelCost, decode attention at {args.attention_tbps:.2f} TB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
