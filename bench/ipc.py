"""Cost of the process split: scheduler -> worker -> scheduler round trip of one decode step over ZeroMQ.

The worker side here decodes the plan and answers a result of the same size at once (no model), so
the time is encode + send + decode on both sides, the same sockets the services use. Also timed, in
process: the scheduler -> tokenizer message of one decode step (TokenDeltas columns), encode + decode.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time

import zmq

from pagoda.bench.workload import positive_int
from pagoda.shared.messages import (
    SchedulerToTokenizer,
    SchedulerToWorker,
    StepPlan,
    StepResult,
    TokenDeltas,
    WorkerToScheduler,
)
from pagoda.shared.transport import Codec, make_socket


def _echo_worker(plan_endpoint: str, result_endpoint: str, ready: multiprocessing.synchronize.Event) -> None:
    context = zmq.Context()
    plans = make_socket(context, zmq.SUB, plan_endpoint, bind=False)
    results = make_socket(context, zmq.PUSH, result_endpoint, bind=False)
    decoder: Codec[SchedulerToWorker] = Codec(SchedulerToWorker)
    encoder: Codec[WorkerToScheduler] = Codec(WorkerToScheduler)
    ready.set()
    while True:
        plan = decoder.decode(plans.recv(copy=False))
        if not isinstance(plan, StepPlan):
            continue
        if not plan.seq_ids:
            break
        result = StepResult(step_id=plan.step_id, seq_ids=plan.seq_ids,
                            sampled_token_ids=[1000 + r % 977 for r in plan.seq_ids])
        results.send(encoder.encode(result), copy=False)
    context.destroy(linger=0)


def decode_plan(step_id: int, num_seqs: int) -> StepPlan:
    """A steady-state decode step: one token each, a new block for every 16th sequence."""
    appended = list(range(0, num_seqs, 16))
    return StepPlan(step_id=step_id, seq_ids=list(range(num_seqs)), num_scheduled_tokens=[1] * num_seqs,
                    appended_block_seq_ids=appended, appended_block_ids=[5000 + i for i in appended])


def measure(num_seqs: int, num_steps: int) -> dict[str, float]:
    folder = tempfile.mkdtemp(prefix="pgipc")
    plan_endpoint, result_endpoint = f"ipc://{folder}/plan.sock", f"ipc://{folder}/result.sock"
    context = zmq.Context()
    plans = make_socket(context, zmq.PUB, plan_endpoint, bind=True)
    results = make_socket(context, zmq.PULL, result_endpoint, bind=True)
    ready = multiprocessing.Event()
    worker = multiprocessing.Process(target=_echo_worker, args=(plan_endpoint, result_endpoint, ready))
    worker.start()
    ready.wait(30)
    to_worker: Codec[SchedulerToWorker] = Codec(SchedulerToWorker)
    from_worker: Codec[WorkerToScheduler] = Codec(WorkerToScheduler)
    while not results.poll(10):  # until the subscription is live, probes get no answer
        plans.send(to_worker.encode(decode_plan(0, num_seqs)))
    results.recv()
    while results.poll(50):
        results.recv()
    times = []
    for step in range(1, num_steps + 1):
        start = time.perf_counter()
        plans.send(to_worker.encode(decode_plan(step, num_seqs)), copy=False)
        result = from_worker.decode(results.recv(copy=False))
        times.append(time.perf_counter() - start)
        assert isinstance(result, StepResult) and len(result.seq_ids) == num_seqs
    plans.send(to_worker.encode(StepPlan(step_id=-1, seq_ids=[], num_scheduled_tokens=[])))
    worker.join(10)
    context.destroy(linger=0)
    times.sort()
    return {"num_seqs": num_seqs, "steps": num_steps, "p50_ms": 1e3 * times[len(times) // 2],
            "p99_ms": 1e3 * times[int(0.99 * len(times))], "mean_ms": 1e3 * statistics.fmean(times),
            "plan_bytes": len(to_worker.encode(decode_plan(1, num_seqs)))}


def decode_deltas(num_seqs: int) -> TokenDeltas:
    """A steady-state decode step's news for one tokenizer: one token per sequence, none finished."""
    return TokenDeltas(request_ids=[f"cmpl-{r:032x}" for r in range(num_seqs)], indices=[0] * num_seqs,
                       token_ids=[1000 + r % 977 for r in range(num_seqs)], finish_reasons=[-1] * num_seqs,
                       num_cached_tokens=[0] * num_seqs)


def measure_deltas(num_seqs: int, num_steps: int) -> dict[str, float]:
    """Encode + decode of one step's TokenDeltas (the scheduler's and the tokenizer's share of the hop)."""
    codec: Codec[SchedulerToTokenizer] = Codec(SchedulerToTokenizer)
    message = decode_deltas(num_seqs)
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        decoded = codec.decode(codec.encode(message))
        times.append(time.perf_counter() - start)
        assert isinstance(decoded, TokenDeltas) and len(decoded) == num_seqs
    times.sort()
    return {"deltas_p50_us": 1e6 * times[len(times) // 2], "deltas_bytes": len(codec.encode(message))}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-seqs", type=positive_int, default=256)
    parser.add_argument("--steps", type=positive_int, default=2000)


def main(args: argparse.Namespace) -> int:
    print(json.dumps(measure(args.num_seqs, args.steps) | measure_deltas(args.num_seqs, args.steps)))
    return 0
