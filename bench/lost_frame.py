"""What a lost frame costs on a sequenced stream (shared/delivery.Link), on the CPU alone: a sender and a receiver
(a DEALER and a ROUTER made by shared/transport.make_socket over ipc://, as the tokenizer and the scheduler or an
api use them) tend their Links as the services do (a loop that polls every LINK_POLL_S while something is
unacknowledged). The sender loses a share of its frames (--drop, resends included; acks are not lost); each
message's latency is from its first send to its in-order delivery, and the table splits the messages whose first
frame was lost from the others. A loss with later frames behind it is reported by the receiver (the gap) and sent
again at once; a loss with nothing behind it waits for the timer (--resend-interval).

    python -m pagoda.bench.lost_frame                          # dense: one message per 25 ms, 10% lost
    python -m pagoda.bench.lost_frame --every-ms 1000 --messages 40   # sparse: the timer heals each loss

Checks: every message delivered exactly once and in order, every send acknowledged in the end. Prints a table
and writes JSON under $OUT when set.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import zmq

from pagoda.bench.report import write_report
from pagoda.shared.delivery import Link
from pagoda.shared.messages import AbortRequest, Ack, Sequenced, TokenizerToScheduler
from pagoda.shared.transport import Codec, ack_frame, make_socket, seal, unseal

LINK_POLL_S = 0.02  # as services/tokenizer/service.py and the api pool tend their links


def run(num_messages: int, every_s: float, drop: float, resend_s: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    folder = tempfile.mkdtemp(prefix="pglf", dir="/tmp")
    endpoint = f"ipc://{folder}/s.sock"
    context = zmq.Context()
    receiver_sock = make_socket(context, zmq.ROUTER, endpoint, bind=True)
    sender_sock = make_socket(context, zmq.DEALER, endpoint, bind=False, identity=b"sender")
    codec: Codec[TokenizerToScheduler] = Codec(TokenizerToScheduler)
    sender, receiver = Link(resend_s=resend_s), Link(resend_s=resend_s)
    sent_at: dict[int, float] = {}
    latency: dict[int, float] = {}
    order: list[int] = []
    lost_first: set[int] = set()

    def send(data: bytes) -> bool:
        if rng.random() < drop:
            return False
        sender_sock.send(data)
        return True
    poller = zmq.Poller()
    poller.register(receiver_sock, zmq.POLLIN)
    poller.register(sender_sock, zmq.POLLIN)
    start = time.monotonic()
    deadline = start + num_messages * every_s + 60.0
    next_index = 0
    try:
        while (len(order) < num_messages or sender.sends.entries) and time.monotonic() < deadline:
            now = time.monotonic()
            if next_index < num_messages and now >= start + next_index * every_s:
                sent_at[next_index] = now
                if not send(seal(codec, sender, AbortRequest(str(next_index)), now)):
                    lost_first.add(next_index)
                next_index += 1
            for sock, _ in poller.poll(LINK_POLL_S * 1000):
                if sock is receiver_sock:
                    while receiver_sock.poll(0):
                        _, payload = receiver_sock.recv_multipart()
                        message = codec.decode(payload)
                        assert isinstance(message, Sequenced | Ack)
                        arrived = time.monotonic()
                        for item in unseal(codec, receiver, message, arrived):
                            index = int(item.request_id)
                            assert index not in latency, f"message {index} delivered twice"
                            latency[index] = arrived - sent_at[index]
                            order.append(index)
                else:
                    while sender_sock.poll(0):
                        message = codec.decode(sender_sock.recv())
                        assert isinstance(message, Sequenced | Ack)
                        unseal(codec, sender, message, time.monotonic())
            now = time.monotonic()
            for entry in sender.due(now):
                send(entry.data)
            if receiver.ack_due(now):
                receiver_sock.send_multipart([b"sender", ack_frame(codec, receiver)])
    finally:
        receiver_sock.close(0)
        sender_sock.close(0)
        context.term()
    assert order == list(range(num_messages)), "not every message delivered once, in order"
    assert not sender.sends.entries, "a send was never acknowledged"
    return _summary(latency, lost_first, sender.sends.num_resent, every_s, drop, resend_s)


def _summary(latency: dict[int, float], lost_first: set[int], num_resent: int, every_s: float, drop: float,
             resend_s: float) -> dict[str, Any]:
    ms = 1000.0
    lost = sorted(v * ms for i, v in latency.items() if i in lost_first)
    others = sorted(v * ms for i, v in latency.items() if i not in lost_first)

    def pct(values: list[float], q: float) -> float | None:
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    return {
        "messages": len(latency), "every_ms": every_s * ms, "drop": drop, "resend_interval_ms": resend_s * ms,
        "resends": num_resent, "lost_first": len(lost),
        "lost_p50_ms": statistics.median(lost) if lost else None, "lost_max_ms": max(lost) if lost else None,
        "others_p50_ms": statistics.median(others) if others else None, "others_p99_ms": pct(others, 0.99),
        "others_max_ms": max(others) if others else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=400)
    parser.add_argument("--every-ms", type=float, default=25.0)
    parser.add_argument("--drop", type=float, default=0.1)
    parser.add_argument("--resend-interval", type=float, default=0.5, help="seconds (the server's default)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    result = run(args.messages, args.every_ms / 1000, args.drop, args.resend_interval, args.seed)
    print("| messages | every | lost | resend interval | resends | first frame lost: n, p50, max "
          "| the others: p50, p99, max |")
    print("|---|---|---|---|---|---|---|")

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f} ms"

    r = result
    print(f"| {r['messages']} | {r['every_ms']:.0f} ms | {r['drop']:.0%} | {r['resend_interval_ms']:.0f} ms "
          f"| {r['resends']} | {r['lost_first']}, {fmt(r['lost_p50_ms'])}, {fmt(r['lost_max_ms'])} "
          f"| {fmt(r['others_p50_ms'])}, {fmt(r['others_p99_ms'])}, {fmt(r['others_max_ms'])} |")
    write_report(result, None, "lost_frame.json", indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
