"""Pure-Python cost of one scheduler step (schedule + update) with N sequences decoding; no model.

`--repetition-sizes P` gives every sequence vLLM's repetition_detection over patterns of 1..P tokens (with a count
no output reaches, so all keep running), over `--tokens text` (random ids, a fifth of them from 50 common ones) or
`same` (one id again and again: every size matches, the watch's worst case)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Iterator

from pagoda.bench.workload import non_negative_int, positive_int
from pagoda.services.scheduler.scheduler import Request, Scheduler
from pagoda.shared.messages import RepetitionDetection, SamplingParams, StepResult

NEVER = 1 << 30  # a repetition count no output reaches


def measure(num_seqs: int, prompt_len: int, num_steps: int, block_size: int = 16, repetition_sizes: int = 0,
            tokens: str = "text") -> dict[str, float]:
    scheduler = Scheduler(num_blocks=num_seqs * (prompt_len + num_steps + 64) // block_size + 64,
                          block_size=block_size, max_num_seqs=num_seqs, max_num_batched_tokens=1 << 20,
                          max_model_len=prompt_len + num_steps + 64, vocab_size=50000, eos_token_ids=[2])
    watch = RepetitionDetection(max_pattern_size=repetition_sizes, min_count=NEVER) if repetition_sizes else None
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 32, repetition_detection=watch)
    for i in range(num_seqs):
        prompt = [(i * 31 + j) % 40000 + 100 for j in range(prompt_len)]
        scheduler.add_request(Request(request_id=str(i), prompt_token_ids=prompt, sampling=params, arrival_time=i))
    draws = _draws(tokens, num_seqs, num_steps + 1)
    _step(scheduler, draws)  # the prefill step
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        num_scheduled = _step(scheduler, draws)
        times.append(time.perf_counter() - start)
        assert num_scheduled == num_seqs
    times.sort()
    return {"num_seqs": num_seqs, "steps": num_steps, "repetition_sizes": repetition_sizes, "tokens": tokens,
            "mean_ms": 1e3 * statistics.fmean(times),
            "p50_ms": 1e3 * times[len(times) // 2], "p99_ms": 1e3 * times[int(len(times) * 0.99)]}


def _draws(tokens: str, num_seqs: int, num_steps: int) -> Iterator[list[int]] | None:
    """Each step's sampled ids for `text`, drawn before the clock starts (random ids, a fifth of them from 50
    common ones); None for `same`, whose ids come from the sequence ids as the bench always made them."""
    if tokens == "same":
        return None
    rng = random.Random(0)
    return iter([[rng.randrange(100, 150) if rng.random() < 0.2 else rng.randrange(1000, 40000)
                  for _ in range(num_seqs)] for _ in range(num_steps)])


def _step(scheduler: Scheduler, draws: Iterator[list[int]] | None) -> int:
    plan = scheduler.schedule()
    sampled = [1000 + (r % 500) for r in plan.seq_ids] if draws is None else next(draws)[:len(plan.seq_ids)]
    result = StepResult(step_id=plan.step_id, seq_ids=plan.seq_ids, sampled_token_ids=sampled)
    scheduler.update(plan, result)
    return len(plan.seq_ids)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-seqs", type=positive_int, default=256)
    parser.add_argument("--prompt-len", type=positive_int, default=512)
    parser.add_argument("--steps", type=positive_int, default=500)
    parser.add_argument("--repetition-sizes", type=non_negative_int, default=0,
                        help="repetition_detection over patterns of 1..N tokens on every sequence (0: off)")
    parser.add_argument("--tokens", choices=("text", "same"), default="text",
                        help="sampled ids: random text-like ones, or one id per sequence again and again")


def main(args: argparse.Namespace) -> int:
    result = measure(args.num_seqs, args.prompt_len, args.steps, repetition_sizes=args.repetition_sizes,
                     tokens=args.tokens)
    print(json.dumps(result))
    return 0
