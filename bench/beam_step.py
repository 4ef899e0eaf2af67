"""Host cost of one beam-search step, no model.

After a search's first step the worker chooses and continues the beams itself (BeamGroup.on_device), so with async
scheduling (two plans in flight, the default on CUDA) step N+1 is planned and applied while step N runs and the
scheduler's update of result N (BeamSearch.step, the slots' tables following the worker's choice) comes after:
none of this is between two forwards as long as it takes less than a step. With --serial (one plan in flight) it
all is. This times each part with N beam searches of width W decoding, fed random candidates (random parents:
beams change lines as they do on random weights), and counts the beam plans made while another was in flight.

    python -m pagoda.bench.beam_step --num-requests 64 --width 4 --prompt-len 512 --steps 120
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import deque
from typing import Any

import msgspec

from pagoda.bench.report import write_report
from pagoda.services.scheduler.beam import assign_slots
from pagoda.services.scheduler.scheduler import Request, Scheduler
from pagoda.services.worker.batch_state import BatchState
from pagoda.shared.messages import BeamCandidates, SamplingParams, StepPlan, StepResult

PARTS = ("update", "schedule", "worker_apply", "wire")


def fake_result(plan: StepPlan, rng: random.Random) -> StepResult:
    """Each group's candidates, best first: random tokens, random parents, scores below its beams' best; for a
    group the worker continues, the slot parents it would choose (no stop ids here: the first width)."""
    candidates = []
    for group in plan.beam_groups:
        top = max(group.scores)
        scores = sorted((top - rng.uniform(0.0, 3.0) for _ in range(group.num_candidates)), reverse=True)
        width = len(group.seq_ids)
        parents = [rng.randrange(width) for _ in scores]
        slot_parents = []
        if group.on_device:
            slot_parents = list(range(width))
            for slot, parent in zip(assign_slots(parents[:width], width), parents[:width], strict=True):
                slot_parents[slot] = parent
        candidates.append(BeamCandidates(group.seq_ids[0], [rng.randrange(100, 40000) for _ in scores], parents,
                                         scores, slot_parents))
    return StepResult(step_id=plan.step_id, seq_ids=[], sampled_token_ids=[], beam_candidates=candidates)


def measure(num_requests: int, width: int, prompt_len: int, num_steps: int, block_size: int = 16,
            seed: int = 0, serial: bool = False) -> dict[str, Any]:
    max_len = prompt_len + num_steps + 64
    num_seqs = num_requests * width
    scheduler = Scheduler(num_blocks=num_seqs * (max_len // block_size + 2), block_size=block_size,
                          max_num_seqs=num_seqs, max_num_batched_tokens=1 << 20, max_model_len=max_len,
                          vocab_size=50000, eos_token_ids=[2], max_inflight_plans=1 if serial else 2)
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
    inflight: deque[StepPlan] = deque()
    num_beam_plans = num_ahead = 0
    for step in range(num_steps):
        update_s = schedule_s = apply_s = wire_s = 0.0
        while len(inflight) < scheduler.max_inflight_plans:  # the pipeline: plan and launch while room in flight
            ahead = len(inflight)
            started = time.perf_counter()
            plan = scheduler.schedule()
            schedule_s += time.perf_counter() - started
            started = time.perf_counter()
            plan = plan_decoder.decode(encoder.encode(plan))
            wire_s += time.perf_counter() - started
            started = time.perf_counter()
            worker.apply(plan)
            apply_s += time.perf_counter() - started
            if not plan.seq_ids:
                break
            inflight.append(plan)
            if any(group.on_device for group in plan.beam_groups):
                num_beam_plans += 1
                num_ahead += ahead > 0
        if not inflight:
            break
        plan = inflight.popleft()  # its result comes back
        result = fake_result(plan, rng)
        started = time.perf_counter()
        wire = result_decoder.decode(encoder.encode(result))
        wire_s += time.perf_counter() - started
        started = time.perf_counter()
        scheduler.update(plan, wire)
        update_s = time.perf_counter() - started
        if step >= 3 and len(plan.beam_groups) == num_requests:  # every group forked and decoding
            for part, seconds in zip(PARTS, (update_s, schedule_s, apply_s, wire_s), strict=True):
                times[part].append(seconds)
    summary: dict[str, Any] = {"num_requests": num_requests, "width": width, "prompt_len": prompt_len,
                               "serial": serial, "steps_timed": len(times["update"]),
                               "beam_plans_made_ahead": f"{num_ahead}/{num_beam_plans}"}
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
    parser.add_argument("--serial", action="store_true", help="one plan in flight (every part between forwards)")
    args = parser.parse_args()
    result = measure(args.num_requests, args.width, args.prompt_len, args.steps, serial=args.serial)
    print("  ".join(f"{key} {value:.2f}" if isinstance(value, float) else f"{key} {value}"
                    for key, value in result.items()))
    write_report(result, None, "beam_step.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
