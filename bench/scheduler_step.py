"""Pure-Python cost of one scheduler step (schedule + update) with N sequences decoding; no model."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagoda.services.scheduler.scheduler import Request, Scheduler
from pagoda.shared.messages import SamplingParams, StepResult


def measure(num_seqs: int, prompt_len: int, num_steps: int, block_size: int = 16) -> dict[str, float]:
    scheduler = Scheduler(num_blocks=num_seqs * (prompt_len + num_steps + 64) // block_size + 64,
                          block_size=block_size, max_num_seqs=num_seqs, max_num_batched_tokens=1 << 20,
                          max_model_len=prompt_len + num_steps + 64, vocab_size=50000, eos_token_ids=[2])
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 32)
    for i in range(num_seqs):
        prompt = [(i * 31 + j) % 40000 + 100 for j in range(prompt_len)]
        scheduler.add_request(Request(request_id=str(i), prompt_token_ids=prompt, sampling=params, arrival_time=i))
    _step(scheduler)  # the prefill step
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        num_scheduled = _step(scheduler)
        times.append(time.perf_counter() - start)
        assert num_scheduled == num_seqs
    times.sort()
    return {"num_seqs": num_seqs, "steps": num_steps, "mean_ms": 1e3 * statistics.fmean(times),
            "p50_ms": 1e3 * times[len(times) // 2], "p99_ms": 1e3 * times[int(len(times) * 0.99)]}


def _step(scheduler: Scheduler) -> int:
    plan = scheduler.schedule()
    result = StepResult(step_id=plan.step_id, seq_ids=plan.seq_ids,
                        sampled_token_ids=[1000 + (r % 500) for r in plan.seq_ids])
    scheduler.update(plan, result)
    return len(plan.seq_ids)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=500)


def main(args: argparse.Namespace) -> int:
    result = measure(args.num_seqs, args.prompt_len, args.steps)
    print(json.dumps(result))
    return 0
