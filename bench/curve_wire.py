"""What CURVE costs on pagoda's own sockets, on the CPU alone: the frames a streamed load sends on each socket pair
(api <-> tokenizer, tokenizer <-> scheduler, scheduler <-> worker), built from shared/messages.py as the services
build them, pushed through tcp://127.0.0.1 socket pairs made by shared/transport.make_socket, plain and CURVE.

Three measurements per mode:
- census: frames/s and bytes/s per socket direction at the served rate (`--tok-per-s` over `--streams` streams);
- flood: each direction's frames as fast as they go: CPU us per frame (the whole process: Python send and receive,
  and libzmq's I/O threads, where CURVE encrypts and decrypts) and the I/O threads' share alone;
- paced: every direction at once at the served rate for `--seconds`: CPU seconds per second of traffic (cores);
- step round trip: plan out, result back (the scheduler <-> worker critical path of every step), p50 and p99.

    python -m pagoda.bench.curve_wire                      # the 33k out tok/s, 256-stream load of bench/curve.py

Each role (api, tokenizer, scheduler, worker) has its own zmq.Context, so its own I/O thread, as its process does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq

from pagoda.bench.commands import run_script
from pagoda.bench.report import stamp, write_report
from pagoda.services.protocol.render import PromptRenderer
from pagoda.shared.messages import (
    Accepted,
    AddRequest,
    GenerateRequest,
    NewRequest,
    RenderedRows,
    RenderSpec,
    SamplingParams,
    StepPlan,
    StepResult,
    TextDelta,
    TokenDeltas,
)
from pagoda.shared.transport import ClusterKeys, make_socket, use_cluster_keys

BLOCK_SIZE = 16
TOKEN_TEXTS = [" the", " of", " and", " model", " tokens", ",", " a", " serving", " paged", " cache"]


@dataclass(frozen=True, slots=True)
class Direction:
    """One way of one socket pair: who sends what kind of frame, and how often per step or per request."""

    name: str  # e.g. "scheduler->worker plan"
    pair: str


DIRECTIONS = [
    Direction("api->tokenizer GenerateRequest", "api<->tokenizer"),
    Direction("tokenizer->api Accepted", "api<->tokenizer"),
    Direction("tokenizer->api RenderedRows", "api<->tokenizer"),
    Direction("tokenizer->scheduler AddRequest", "tokenizer<->scheduler"),
    Direction("scheduler->tokenizer TokenDeltas", "tokenizer<->scheduler"),
    Direction("scheduler->worker StepPlan", "scheduler<->worker"),
    Direction("worker->scheduler StepResult", "scheduler<->worker"),
]


@dataclass(slots=True)
class Load:
    """The served load: `streams` in flight, each `output_len` tokens after a prompt of `input_len`."""

    tok_per_s: float
    streams: int
    input_len: int
    output_len: int

    @property
    def steps_per_s(self) -> float:  # every stream decodes one token a step
        return self.tok_per_s / self.streams

    @property
    def requests_per_s(self) -> float:
        return self.tok_per_s / self.output_len


def _request_ids(count: int) -> list[str]:
    return [f"cmpl-{uuid.uuid4().hex}" for _ in range(count)]


def per_request_frames(load: Load, request_id: str, seq_id: int, created: int) -> dict[str, bytes]:
    """What one admission sends: the api's GenerateRequest (token-id prompt, rendered streaming output), the
    tokenizer's Accepted and AddRequest."""
    enc = msgspec.msgpack.Encoder()
    prompt = [(seq_id * 7919 + i * 104729) % 150000 + 100 for i in range(load.input_len)]
    params = SamplingParams(temperature=0.0, max_tokens=load.output_len, ignore_eos=True)
    spec = RenderSpec(0, request_id, "m", created, True)
    renderer = PromptRenderer(spec, 1, "", prompt)
    return {
        "api->tokenizer GenerateRequest": enc.encode(GenerateRequest(request_id, params, prompt_token_ids=prompt,
                                                                     arrival_time=time.time(), render=spec)),
        "tokenizer->api Accepted": enc.encode(Accepted(request_id, len(prompt), opening=renderer.opening())),
        "tokenizer->scheduler AddRequest": enc.encode(AddRequest(request_id, prompt, params,
                                                                 arrival_time=time.time())),
    }


def per_step_frames(load: Load, step: int, request_ids: list[str], created: int) -> dict[str, bytes]:
    """What one decode step of `load.streams` running streams sends: its plan (one new request's prompt, the
    blocks the streams crossed into, one finished sequence), the worker's result, the scheduler's TokenDeltas and
    the tokenizer's RenderedRows (real SSE chunks from the protocol renderer)."""
    enc = msgspec.msgpack.Encoder()
    num = load.streams
    seq_ids = [step * num + i for i in range(num)]
    tokens = [(step * 31 + i * 17) % 150000 + 100 for i in range(num)]
    new_len = load.input_len
    prompt = [(step * 7919 + i * 104729) % 150000 + 100 for i in range(new_len)]
    new = NewRequest(seq_ids[-1] + 1, prompt, new_len, list(range(new_len // BLOCK_SIZE)), 0,
                     SamplingParams(temperature=0.0, max_tokens=load.output_len, ignore_eos=True), 1234)
    crossing = [s for s in seq_ids if (s + step) % BLOCK_SIZE == 0]
    plan = StepPlan(step, seq_ids + [new.seq_id], [1] * num + [new_len], [new], crossing,
                    [10_000 + s for s in crossing], [seq_ids[0] - 1], seq=step)
    result = StepResult(step, seq_ids, tokens)
    deltas = TokenDeltas(request_ids, [0] * num, tokens, [-1] * num, [0] * num)
    rows = []
    for i, request_id in enumerate(request_ids):
        renderer = PromptRenderer(RenderSpec(0, request_id, "m", created, True), 1, "", [])
        rows.append(renderer.render(TextDelta(request_id, 0, TOKEN_TEXTS[(step + i) % len(TOKEN_TEXTS)], 1)))
    rendered = RenderedRows(request_ids, [0] * num, [1] * num, [-1] * num, [0] * num, rows)
    return {"scheduler->worker StepPlan": enc.encode(plan), "worker->scheduler StepResult": enc.encode(result),
            "scheduler->tokenizer TokenDeltas": enc.encode(deltas), "tokenizer->api RenderedRows": enc.encode(rendered)}


# ------------------------------------------------------------------------------------------------ sockets


@dataclass(slots=True)
class Wire:
    """The four roles' contexts and the socket pairs between them, as the services make them."""

    contexts: dict[str, zmq.Context] = field(default_factory=dict)
    sockets: list[Any] = field(default_factory=list)
    send: dict[str, Callable[[bytes], None]] = field(default_factory=dict)
    receivers: dict[Any, list[str]] = field(default_factory=dict)  # receiving socket -> directions it carries

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        for context in self.contexts.values():
            context.term()


def _port() -> str:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def _routed_pair(wire: Wire, server_role: str, client_role: str, to_client: str, to_server: str) -> None:
    """A ROUTER that binds (api, scheduler) and a DEALER that connects to it (tokenizer); the DEALER says hello
    first so that the ROUTER knows its identity (ROUTER_MANDATORY refuses unknown peers)."""
    endpoint = _port()
    router = make_socket(wire.contexts[server_role], zmq.ROUTER, endpoint, bind=True)
    dealer = make_socket(wire.contexts[client_role], zmq.DEALER, endpoint, bind=False, identity=b"tok-1")
    wire.sockets += [router, dealer]
    dealer.send(b"hello")
    assert router.poll(10_000), f"{client_role} never reached {server_role} (CURVE handshake refused?)"
    identity, _ = router.recv_multipart()
    wire.send[to_client] = lambda data, router=router, identity=identity: router.send_multipart(
        [identity, data], copy=False)
    wire.send[to_server] = lambda data, dealer=dealer: dealer.send(data, copy=False)
    wire.receivers[dealer] = [to_client]
    wire.receivers[router] = [to_server]


def open_wire(curve: bool, key_dir: str) -> Wire:
    use_cluster_keys(ClusterKeys.load(key_dir) if curve else None)
    wire = Wire({role: zmq.Context() for role in ("api", "tokenizer", "scheduler", "worker")})
    _routed_pair(wire, "api", "tokenizer", "api->tokenizer GenerateRequest", "tokenizer->api RenderedRows")
    wire.send["tokenizer->api Accepted"] = wire.send["tokenizer->api RenderedRows"]
    _routed_pair(wire, "scheduler", "tokenizer", "scheduler->tokenizer TokenDeltas", "tokenizer->scheduler AddRequest")
    plan_endpoint, result_endpoint = _port(), _port()
    plans = make_socket(wire.contexts["scheduler"], zmq.PUB, plan_endpoint, bind=True)
    subscriber = make_socket(wire.contexts["worker"], zmq.SUB, plan_endpoint, bind=False)
    results = make_socket(wire.contexts["scheduler"], zmq.PULL, result_endpoint, bind=True)
    pusher = make_socket(wire.contexts["worker"], zmq.PUSH, result_endpoint, bind=False)
    wire.sockets += [plans, subscriber, results, pusher]
    deadline = time.monotonic() + 10
    while not subscriber.poll(50):  # a PUB drops what it sends before the subscription arrives
        assert time.monotonic() < deadline, "the worker's SUB never received a plan"
        plans.send(b"probe")
    while subscriber.poll(200):
        subscriber.recv()
    wire.send["scheduler->worker StepPlan"] = lambda data: plans.send(data, copy=False)
    wire.send["worker->scheduler StepResult"] = lambda data: pusher.send(data, copy=False)
    wire.receivers[subscriber] = ["scheduler->worker StepPlan"]
    wire.receivers[results] = ["worker->scheduler StepResult"]
    return wire


# ------------------------------------------------------------------------------------------------ measuring


def io_thread_cpu_s() -> float:
    """CPU seconds of this process's libzmq I/O threads (where CURVE encrypts and decrypts every frame), from the
    scheduler's nanosecond run-time count (schedstat), not the 10 ms ticks of stat."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            if not Path(f"/proc/self/task/{tid}/comm").read_text().startswith("ZMQbg/IO"):
                continue
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total * 1e-9


def process_cpu_s() -> float:
    """CPU seconds of every thread of this process (the Python threads and libzmq's)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total * 1e-9


class Receiver:
    """Takes every frame off the receiving sockets (and msgspec-decodes it, as a service would). One thread does
    all socket I/O: a ROUTER both sends and receives, and a ZeroMQ socket is not safe to share between threads."""

    def __init__(self, wire: Wire) -> None:
        self.frames = 0
        self.bytes = 0
        self.poller = zmq.Poller()
        for sock in wire.receivers:
            self.poller.register(sock, zmq.POLLIN)
        self.decoder = msgspec.msgpack.Decoder()

    def drain(self, timeout_ms: float = 0) -> None:
        for sock, _ in self.poller.poll(timeout_ms):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self.decoder.decode(frames[-1].buffer)
                self.frames += 1
                self.bytes += len(frames[-1].buffer)

    def wait_for(self, frames: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.frames < frames:
            assert time.monotonic() < deadline, f"received {self.frames} of {frames} frames"
            self.drain(10)


def flood(wire: Wire, direction: str, frames: list[bytes], seconds: float) -> dict[str, float]:
    """Send these frames, round and round, as fast as they are taken for about `seconds`; CPU per frame (sender,
    receiver and both I/O threads together)."""
    receiver = Receiver(wire)
    send = wire.send[direction]
    cpu0, io0, wall0 = process_cpu_s(), io_thread_cpu_s(), time.perf_counter()
    sent = 0
    while sent < 200 or time.perf_counter() - wall0 < seconds:
        for data in frames:
            send(data)
            sent += 1
            receiver.wait_for(sent - 32)  # a bounded backlog: a PUB drops past its high-water mark
    receiver.wait_for(sent)
    cpu, io, wall = process_cpu_s() - cpu0, io_thread_cpu_s() - io0, time.perf_counter() - wall0
    return {"frames": sent, "mean_bytes": receiver.bytes / sent, "cpu_us_per_frame": 1e6 * cpu / sent,
            "io_thread_us_per_frame": 1e6 * io / sent, "frames_per_s": sent / wall}


def paced(wire: Wire, load: Load, steps: list[dict[str, bytes]], requests: list[dict[str, bytes]],
          seconds: float) -> dict[str, float]:
    """Every direction at once, at the served rate: a step's frames every 1/steps_per_s, admissions spread in."""
    receiver = Receiver(wire)
    interval = 1.0 / load.steps_per_s
    admissions_per_step = load.requests_per_s / load.steps_per_s
    due = 0.0
    sent = step = 0
    cpu0, io0, start = process_cpu_s(), io_thread_cpu_s(), time.perf_counter()
    while time.perf_counter() - start < seconds:
        for direction, data in steps[step % len(steps)].items():
            wire.send[direction](data)
            sent += 1
        due += admissions_per_step
        while due >= 1.0:
            due -= 1.0
            for direction, data in requests[sent % len(requests)].items():
                wire.send[direction](data)
                sent += 1
        step += 1
        while (delay := start + step * interval - time.perf_counter()) > 0:
            receiver.drain(1e3 * delay)
    receiver.wait_for(sent)
    wall = time.perf_counter() - start
    cpu, io = process_cpu_s() - cpu0, io_thread_cpu_s() - io0
    return {"seconds": wall, "steps_per_s": step / wall, "frames_per_s": sent / wall,
            "bytes_per_s": receiver.bytes / wall, "cpu_cores": cpu / wall, "io_thread_cores": io / wall}


def round_trip(wire: Wire, plan: bytes, result: bytes, count: int) -> dict[str, float]:
    """Plan out, result back, one at a time: the latency the step loop sees on each step (the worker's side
    answers in this thread as soon as the plan arrives)."""
    subscriber = next(s for s, names in wire.receivers.items() if "scheduler->worker StepPlan" in names)
    results = next(s for s, names in wire.receivers.items() if "worker->scheduler StepResult" in names)
    send_plan, send_result = wire.send["scheduler->worker StepPlan"], wire.send["worker->scheduler StepResult"]
    times = []
    for _ in range(count):
        started = time.perf_counter()
        send_plan(plan)
        assert subscriber.poll(10_000), "no plan came"
        subscriber.recv(copy=False)
        send_result(result)
        assert results.poll(10_000), "no result came back"
        results.recv(copy=False)
        times.append(1e6 * (time.perf_counter() - started))
    times.sort()
    return {"p50_us": statistics.median(times), "p99_us": times[int(0.99 * (len(times) - 1))]}


# ------------------------------------------------------------------------------------------------ report


def census(load: Load, step: dict[str, bytes], request: dict[str, bytes]) -> dict[str, dict[str, float]]:
    """Frames/s and bytes/s per direction at the served rate."""
    rows = {}
    for name, data in step.items():
        rows[name] = {"frames_per_s": load.steps_per_s, "bytes_per_frame": len(data)}
    for name, data in request.items():
        rows[name] = {"frames_per_s": load.requests_per_s, "bytes_per_frame": len(data)}
    for row in rows.values():
        row["bytes_per_s"] = row["frames_per_s"] * row["bytes_per_frame"]
        row["frames_per_token"] = row["frames_per_s"] / load.tok_per_s
    return {d.name: rows[d.name] for d in DIRECTIONS}


def measure(curve: bool, key_dir: str, load: Load, steps: list[dict[str, bytes]], requests: list[dict[str, bytes]],
            args: argparse.Namespace) -> dict[str, Any]:
    wire = open_wire(curve, key_dir)
    try:
        floods = {}
        for direction in DIRECTIONS:
            source = steps if direction.name in steps[0] else requests
            frames = [frame[direction.name] for frame in source]
            floods[direction.name] = flood(wire, direction.name, frames, args.flood_seconds)
        trip = round_trip(wire, steps[0]["scheduler->worker StepPlan"], steps[0]["worker->scheduler StepResult"],
                          args.round_trips)
        pace = paced(wire, load, steps, requests, args.seconds)
    finally:
        wire.close()
        use_cluster_keys(None)
    return {"curve": curve, "flood": floods, "round_trip": trip, "paced": pace}


def _median(runs: list[dict[str, Any]], path: Callable[[dict[str, Any]], float]) -> float:
    return statistics.median(path(run) for run in runs)


def print_report(load: Load, table: dict[str, dict[str, float]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    plain = [r for r in runs if not r["curve"]]
    curve = [r for r in runs if r["curve"]]
    print(f"load: {load.tok_per_s:.0f} out tok/s, {load.streams} streams -> {load.steps_per_s:.0f} steps/s, "
          f"{load.requests_per_s:.0f} requests/s (medians of {len(plain)} runs per mode)\n")
    print(f"{'direction':34} {'frames/s':>9} {'frames/tok':>10} {'B/frame':>8} {'KB/s':>8} "
          f"{'us/frame plain':>14} {'curve':>7} {'io plain':>8} {'io curve':>8}")
    summary = {}
    extra_cpu = 0.0
    for name, row in table.items():
        cpu_plain = _median(plain, lambda r, n=name: r["flood"][n]["cpu_us_per_frame"])
        cpu_curve = _median(curve, lambda r, n=name: r["flood"][n]["cpu_us_per_frame"])
        io_plain = _median(plain, lambda r, n=name: r["flood"][n]["io_thread_us_per_frame"])
        io_curve = _median(curve, lambda r, n=name: r["flood"][n]["io_thread_us_per_frame"])
        extra_cpu += row["frames_per_s"] * (cpu_curve - cpu_plain) * 1e-6
        summary[name] = {**row, "cpu_us_per_frame_plain": cpu_plain, "cpu_us_per_frame_curve": cpu_curve,
                         "io_us_per_frame_plain": io_plain, "io_us_per_frame_curve": io_curve}
        print(f"{name:34} {row['frames_per_s']:9.1f} {row['frames_per_token']:10.4f} {row['bytes_per_frame']:8.0f} "
              f"{row['bytes_per_s'] / 1e3:8.0f} {cpu_plain:14.1f} {cpu_curve:7.1f} {io_plain:8.1f} {io_curve:8.1f}")
    trip = {mode: {k: _median(rs, lambda r, k=k: r["round_trip"][k]) for k in ("p50_us", "p99_us")}
            for mode, rs in (("plain", plain), ("curve", curve))}
    pace = {mode: {k: _median(rs, lambda r, k=k: r["paced"][k]) for k in ("frames_per_s", "bytes_per_s",
                                                                             "cpu_cores", "io_thread_cores")}
            for mode, rs in (("plain", plain), ("curve", curve))}
    step_us = 1e6 / load.steps_per_s
    added_us = trip["curve"]["p50_us"] - trip["plain"]["p50_us"]
    print(f"\nsum over directions at this load: CURVE adds {1e3 * extra_cpu:.1f} ms CPU per second "
          f"({100 * extra_cpu:.2f}% of one core, spread over four processes)")
    for mode in ("plain", "curve"):
        print(f"paced {mode:5}: {pace[mode]['frames_per_s']:7.0f} frames/s, "
              f"{pace[mode]['bytes_per_s'] / 1e6:6.2f} MB/s,"
              f" {pace[mode]['cpu_cores']:.3f} cores ({pace[mode]['io_thread_cores']:.3f} in I/O threads); "
              f"plan->result round trip p50 {trip[mode]['p50_us']:.0f} us, p99 {trip[mode]['p99_us']:.0f} us")
    print(f"CURVE adds {added_us:.0f} us to a step's round trip: {100 * added_us / step_us:.2f}% of a "
          f"{step_us / 1e3:.1f} ms step")
    return {"directions": summary, "extra_cpu_cores": extra_cpu, "round_trip": trip, "paced": pace,
            "step_us": step_us, "round_trip_added_us": added_us, "round_trip_added_fraction": added_us / step_us}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tok-per-s", type=float, default=33_000.0, help="served output tok/s to model")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--flood-seconds", type=float, default=1.0, help="length of each direction's flood")
    parser.add_argument("--round-trips", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of the paced run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved")


def main(args: argparse.Namespace) -> int:
    load = Load(args.tok_per_s, args.streams, args.input_len, args.output_len)
    created = int(time.time())
    request_ids = _request_ids(load.streams)
    steps = [per_step_frames(load, step, request_ids, created) for step in range(16)]
    requests = [per_request_frames(load, rid, i, created) for i, rid in enumerate(_request_ids(16))]
    table = census(load, steps[0], requests[0])
    runs = []
    with tempfile.TemporaryDirectory(prefix="pagoda-curve-wire-") as key_dir:
        ClusterKeys.generate(key_dir)
        for repeat in range(args.repeats):
            for curve in (False, True) if repeat % 2 == 0 else (True, False):
                runs.append(measure(curve, key_dir, load, steps, requests, args))
                print(f"run {len(runs)}: {'curve' if curve else 'plain'} done", file=sys.stderr, flush=True)
    report = {"date": stamp(), "machine": f"{os.cpu_count()} CPUs",
              "zmq": zmq.zmq_version(), "pyzmq": zmq.__version__, "load": vars(args),
              **print_report(load, table, runs), "runs": runs}
    write_report(report, None, "curve_wire.json")
    return 0


if __name__ == "__main__":
    sys.exit(run_script(__doc__, add_arguments, main))
