"""Sequenced delivery (shared/delivery.py) with plain objects: a random lossy, repeating, reordering channel in
both directions between a SendLog and an InOrder delivers every message once, in order, and the sender's log
empties; the resend timer doubles."""

from __future__ import annotations

import random

import pytest

from pagoda.shared.delivery import MAX_WAIT_S, InOrder, SendLog


def test_in_order_holds_early_items_and_reports_repeats() -> None:
    receiver: InOrder[str] = InOrder()
    assert receiver.offer(1, "b") == []  # early: held
    assert receiver.offer(1, "b") is None  # a repeat of a held one
    assert receiver.offer(0, "a") == ["a", "b"]
    assert receiver.offer(0, "a") is None and receiver.applied_through == 1
    far = InOrder(max_ahead=2)
    assert far.offer(5, "x") == [] and not far.ahead  # too far ahead: dropped, the sender sends it again


def test_send_log_resends_with_backoff_and_forgets_what_is_done() -> None:
    log = SendLog()
    for tag in (-1, 7, -1):
        log.record(log.take_seq(), b"m", now=0.0, wait_s=1.0, tag=tag)
    assert log.due(0.5) == []
    assert [e.seq for e in log.due(1.0)] == [0, 1, 2]
    assert log.due(2.5) == [] and [e.seq for e in log.due(3.0)] == [0, 1, 2]  # waited 2 s, then 4 s next
    log.acked_through(1)  # applied: the un-tagged seq 0 is done; seq 1 waits for its result
    assert list(log.entries) == [1, 2] and log.seq_of(7) == 1
    log.done_through(1)
    assert list(log.entries) == [2]
    for now in range(4, 200, 4):
        log.due(float(now))
    assert log.entries[2].wait_s == MAX_WAIT_S


@pytest.mark.parametrize("seed", range(8))
def test_a_lossy_channel_delivers_everything_once_in_order(seed: int) -> None:
    rng = random.Random(seed)
    sender, receiver = SendLog(), InOrder[int]()
    wire: list[tuple[int, bytes]] = []  # frames in flight, in any order
    acks: list[int] = []
    delivered: list[int] = []
    now = 0.0

    def transmit(seq: int, data: bytes) -> None:
        for _ in range(2 if rng.random() < 0.1 else 1):  # repeated
            if rng.random() >= 0.2:  # else lost
                wire.insert(rng.randrange(len(wire) + 1), (seq, data))  # reordered

    for value in range(200):
        seq = sender.take_seq()
        data = value.to_bytes(4, "little")
        sender.record(seq, data, now, wait_s=0.5)
        transmit(seq, data)
        while wire and rng.random() < 0.7:
            got_seq, got = wire.pop(0)
            ready = receiver.offer(got_seq, int.from_bytes(got, "little"))
            delivered += ready or []
            if rng.random() >= 0.2:
                acks.append(receiver.applied_through)  # the ack may be lost too
        for ack in acks:
            sender.acked_through(ack)
        acks.clear()
        now += 0.1
        for entry in sender.due(now):
            transmit(entry.seq, entry.data)
    for _ in range(10_000):
        if not sender.entries:
            break
        now += 0.5
        for entry in sender.due(now):
            transmit(entry.seq, entry.data)
        while wire:
            got_seq, got = wire.pop(0)
            delivered += receiver.offer(got_seq, int.from_bytes(got, "little")) or []
            if rng.random() >= 0.2:
                sender.acked_through(receiver.applied_through)
    assert delivered == list(range(200))
    assert not sender.entries
