"""Host cost of one beam-search step, no model: the part of a beam step the GPU waits for.

A beam's next step needs its group's result (which beam continues which), so unlike sampled rows no plan is made
while the step runs: finish -> scheduler update (BeamSearch.step, block forks) -> schedule -> the worker applies
the plan (BatchState.apply: rows forked) all run between two forwards. This times each part with N beam searches
of width W decoding, fed random candidates (random parents: beams change lines as they do on random weights).

    python -m pagoda.bench.beam_step --num-requests 64 --width 4 --prompt-len 512 --steps 120
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec

from pagoda.services.scheduler.scheduler import Request, Scheduler
from pagoda.services.worker.batch_state import BatchState
from pagoda.shared.messages import BeamCandidates, SamplingParams, StepPlan, StepResult

PARTS = ("update", "schedule", "worker_apply", "wire")


def fake_result(plan: StepPlan, rng: random.Random) -> StepResult:
    """Each group's candidates, best first: random tokens, random parents, scores below its beams' best."""
    candidates = []
    for group in plan.beam_groups:
        top = max(group.scores)
        scores = sorted((top - rng.uniform(0.0, 3.0) for _ in range(group.num_candidates)), reverse=True)
        candidates.append(BeamCandidates(group.seq_ids[0], [rng.randrange(100, 40000) for _ in scores],
                                         [rng.randrange(len(group.seq_ids)) for _ in scores], scores))
    return StepResult(step_id=plan.step_id, seq_ids=[], sampled_token_ids=[], beam_candidates=candidates)


def measure(num_requests: int, width: int, prompt_len: int, num_steps: int, block_size: int = 16,
            seed: int = 0) -> dict[str, Any]:
    max_len = prompt_len + num_steps + 64
    num_seqs = num_requests * width
    scheduler = Scheduler(num_blocks=num_seqs * (max_len // block_size + 2), block_size=block_size,
                          max_num_seqs=num_seqs, max_num_batched_tokens=1 << 20, max_model_len=max_len,
                          vocab_size=50000, eos_token_ids=[2])
    worker = BatchState(num_seqs, max_len, block_size, (2,))
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 8, ignore_eos=True, use_beam_search=True,
                            best_of=width, n=width)
    rng = random.Random(seed)
    for i in range(num_requests):
        prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
        scheduler.add_request(Request(request_id=str(i), prompt_token_ids=prompt, sampling=params, arrival_time=i))
    encoder, plan_decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(StepPlan)
    result_decoder = msgspec.msgpack.Decoder(StepResult)
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    plan = scheduler.schedule()  # the prefills
    worker.apply(plan)
    for step in range(num_steps):
        result = fake_result(plan, rng) if plan.beam_groups else StepResult(step_id=plan.step_id, seq_ids=[],
                                                                           sampled_token_ids=[])
        started = time.perf_counter()
        wire = result_decoder.decode(encoder.encode(result))
        wire_s = time.perf_counter() - started
        started = time.perf_counter()
        scheduler.update(plan, wire)
        update_s = time.perf_counter() - started
        started = time.perf_counter()
        plan = scheduler.schedule()
        schedule_s = time.perf_counter() - started
        started = time.perf_counter()
        plan = plan_decoder.decode(encoder.encode(plan))
        wire_s += time.perf_counter() - started
        started = time.perf_counter()
        worker.apply(plan)
        apply_s = time.perf_counter() - started
        if step >= 2 and len(plan.beam_groups) == num_requests:  # every group forked and decoding
            for part, seconds in zip(PARTS, (update_s, schedule_s, apply_s, wire_s), strict=True):
                times[part].append(seconds)
    summary: dict[str, Any] = {"num_requests": num_requests, "width": width, "prompt_len": prompt_len,
                               "steps_timed": len(times["update"])}
    for part, values in times.items():
        summary[f"{part}_ms"] = 1e3 * statistics.median(values) if values else float("nan")
    summary["total_ms"] = sum(summary[f"{part}_ms"] for part in PARTS)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    result = measure(args.num_requests, args.width, args.prompt_len, args.steps)
    print("  ".join(f"{key} {value:.2f}" if isinstance(value, float) else f"{key} {value}"
                    for key, value in result.items()))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "beam_step.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
