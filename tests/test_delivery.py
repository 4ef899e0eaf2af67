"""Sequenced delivery (shared/delivery.py) with plain objects: a random lossy, repeating, reordering channel in
both directions between a SendLog and an InOrder delivers every message once, in order, and the sender's log
empties; the resend timer doubles."""

from __future__ import annotations

import random

import msgspec
import pytest

from pagoda.shared.delivery import ACK_DELAY_S, GAP_RESEND_S, MAX_WAIT_S, InOrder, Link, SendLog
from pagoda.shared.messages import AbortRequest, Ack, Sequenced, TokenizerToScheduler
from pagoda.shared.transport import Codec, ack_frame, seal, unseal


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


def test_send_log_sends_a_message_the_receiver_lacks_at_once_but_not_twice_within_the_gap_interval() -> None:
    log = SendLog()
    for tag in (3, 4):
        log.record(log.take_seq(), b"m", now=0.0, wait_s=1.0, tag=tag)
    first = log.resend_now(0, 0.01)  # never sent again yet: at once, even right after its first send
    assert first is not None and (first.seq, first.num_sends, first.sent_at, first.wait_s) == (0, 2, 0.01, 1.0)
    assert log.resend_now(0, 0.01 + GAP_RESEND_S / 2) is None  # the gap report came again too soon
    again = log.resend_now(0, 0.01 + GAP_RESEND_S)
    assert again is not None and again.num_sends == 3 and log.num_resent == 2
    assert [e.seq for e in log.due(1.0)] == [1]  # seq 0's timer restarted at its last send
    log.done_through(1)
    assert log.resend_now(0, 5.0) is None and log.resend_now(9, 5.0) is None  # done, unknown: nothing


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


# ---------------------------------------------------------------- Link: both directions with one peer, over the
# real envelope (shared/transport.seal / unseal), through a channel that loses, repeats and reorders frames


def _codec() -> Codec:
    return Codec(TokenizerToScheduler)


class _Wire:
    """Frames in flight one way: each may be lost, sent twice, or overtaken by later ones."""

    def __init__(self, rng: random.Random, loss: float = 0.2) -> None:
        self.rng, self.loss, self.frames = rng, loss, []

    def send(self, data: bytes) -> None:
        for _ in range(2 if self.rng.random() < 0.1 else 1):
            if self.rng.random() >= self.loss:
                self.frames.insert(self.rng.randrange(len(self.frames) + 1), data)

    def take(self) -> bytes | None:
        return self.frames.pop(0) if self.frames else None


def _deliver(codec: Codec, link: Link, data: bytes, now: float) -> list[object]:
    message = codec.decode(data)
    assert isinstance(message, Sequenced | Ack)
    return unseal(codec, link, message, now)


@pytest.mark.parametrize("seed", range(6))
def test_two_links_deliver_both_ways_once_in_order_with_batched_acks(seed: int) -> None:
    rng, codec = random.Random(seed), _codec()
    ends = [Link(resend_s=0.5), Link(resend_s=0.5)]
    wires = [_Wire(rng), _Wire(rng)]  # wires[i]: frames from ends[i] to the other end
    got: list[list[str]] = [[], []]
    sent: list[list[str]] = [[], []]
    now, num_acks = 0.0, 0

    def tend(i: int) -> None:
        nonlocal num_acks
        for entry in ends[i].due(now):
            wires[i].send(entry.data)
        if ends[i].ack_due(now):
            num_acks += 1
            wires[i].send(ack_frame(codec, ends[i]))

    for step in range(300):
        sender = step % 2 if rng.random() < 0.8 else 1 - step % 2
        sent[sender].append(f"{sender}:{step}")
        wires[sender].send(seal(codec, ends[sender], AbortRequest(sent[sender][-1]), now))
        for i in (0, 1):
            while rng.random() < 0.7 and (data := wires[i].take()) is not None:
                got[1 - i] += [m.request_id for m in _deliver(codec, ends[1 - i], data, now)]
            tend(i)
        now += 0.01
    for _ in range(2000):
        if not (ends[0].sends.entries or ends[1].sends.entries or wires[0].frames or wires[1].frames):
            break
        now += 0.05
        for i in (0, 1):
            while (data := wires[i].take()) is not None:
                got[1 - i] += [m.request_id for m in _deliver(codec, ends[1 - i], data, now)]
            tend(i)
    assert got[1] == sent[0] and got[0] == sent[1]  # every message once, in the order it was sent
    assert not ends[0].sends.entries and not ends[1].sends.entries
    assert num_acks < 300  # batched: acks ride on frames going anyway, or go alone at most once per ACK_DELAY_S


def test_a_lost_frame_is_resent_after_one_interval_and_a_repeat_is_dropped() -> None:
    codec = _codec()
    sender, receiver = Link(resend_s=0.5), Link(resend_s=0.5)
    lost = seal(codec, sender, AbortRequest("a"), now=0.0)
    second = seal(codec, sender, AbortRequest("b"), now=0.1)
    assert _deliver(codec, receiver, second, 0.1) == []  # early: held for the gap
    assert sender.due(0.4) == []
    [entry] = [e for e in sender.due(0.5) if e.seq == 0]
    assert entry.data == lost
    assert [m.request_id for m in _deliver(codec, receiver, entry.data, 0.5)] == ["a", "b"]
    assert _deliver(codec, receiver, lost, 0.6) == []  # a repeat: not applied again, but acknowledged again
    assert receiver.ack_due(0.6 + ACK_DELAY_S)
    assert _deliver(codec, sender, ack_frame(codec, receiver), 0.7) == []
    assert not sender.sends.entries and sender.ack_owed_since is None


def test_a_peer_restart_starts_a_fresh_stream_and_its_old_frames_are_dropped() -> None:
    codec = _codec()
    tokenizer, scheduler = Link(resend_s=0.5), Link(resend_s=0.5)
    for name in ("a", "b"):
        assert [m.request_id for m in _deliver(codec, scheduler, seal(codec, tokenizer, AbortRequest(name), 0.0),
                                                0.0)] == [name]
    late = seal(codec, tokenizer, AbortRequest("late"), 0.0)  # of the old stream, still in flight
    old_stream = tokenizer.stream
    stale_ack = ack_frame(codec, scheduler)  # acknowledges the old stream through "b"
    tokenizer.restart()  # it lost the scheduler: what it sent is given up, a new stream starts at 0
    assert tokenizer.stream != old_stream and not tokenizer.sends.entries
    fresh = seal(codec, tokenizer, AbortRequest("fresh"), 1.0)
    assert codec.decode(fresh).seq == 0
    _deliver(codec, tokenizer, stale_ack, 1.0)  # an ack of the old stream completes nothing of the new one
    assert list(tokenizer.sends.entries) == [0]
    assert [m.request_id for m in _deliver(codec, scheduler, fresh, 1.0)] == ["fresh"]
    assert _deliver(codec, scheduler, late, 1.1) == []  # the retired stream's late frame: dropped
    assert [m.request_id for m in _deliver(codec, scheduler, seal(codec, tokenizer, AbortRequest("next"), 1.2),
                                            1.2)] == ["next"]


def test_a_malformed_body_takes_its_place_and_does_not_stall_the_stream() -> None:
    codec = _codec()
    sender, receiver = Link(resend_s=0.5), Link(resend_s=0.5)
    stream, seq, ack_stream, ack, state, gap = sender.next_send()
    bad = codec.encode(Sequenced(stream, seq, msgspec.Raw(b"\x05"), ack_stream, ack, state, gap))  # not a message
    assert _deliver(codec, receiver, bad, 0.0) == []
    assert [m.request_id for m in _deliver(codec, receiver, seal(codec, sender, AbortRequest("ok"), 0.0),
                                            0.0)] == ["ok"]


def test_a_peer_that_forgot_the_stream_gets_a_fresh_one() -> None:
    """The receiver restarted (or dropped us and took us back) while we were mid-stream: its new state waits for
    sequence numbers an earlier state acknowledged and we gave up. Its first ack tells us: we start afresh, and
    what it has not applied goes again in the new stream."""
    codec = _codec()
    tokenizer, api = Link(resend_s=0.5), Link(resend_s=0.5)
    for name in ("a", "b"):
        _deliver(codec, api, seal(codec, tokenizer, AbortRequest(name), 0.0), 0.0)
    _deliver(codec, tokenizer, ack_frame(codec, api), 0.1)
    assert not tokenizer.sends.entries  # both acknowledged: given up by the sender
    old_ack = ack_frame(codec, api)
    restarted_api = Link(resend_s=0.5)  # a new process at the same address: nothing of the old stream
    assert _deliver(codec, restarted_api, seal(codec, tokenizer, AbortRequest("c"), 0.2), 0.2) == []  # waits for 0
    old_stream = tokenizer.stream
    _deliver(codec, tokenizer, ack_frame(codec, restarted_api), 0.3)
    assert tokenizer.stream != old_stream and tokenizer.num_restarts == 1
    _deliver(codec, tokenizer, old_ack, 0.3)  # a late ack of the old receiver changes nothing
    [again] = tokenizer.due(0.3)  # "c", which the new receiver never applied, goes again at once in the new stream
    assert codec.decode(again.data).stream == tokenizer.stream and codec.decode(again.data).seq == 0
    assert [m.request_id for m in _deliver(codec, restarted_api, again.data, 0.3)] == ["c"]
    assert [m.request_id for m in _deliver(codec, restarted_api, seal(codec, tokenizer, AbortRequest("d"), 0.4),
                                            0.4)] == ["d"]
    _deliver(codec, tokenizer, ack_frame(codec, restarted_api), 0.5)
    assert tokenizer.num_restarts == 1 and not tokenizer.sends.entries


def test_acks_that_arrive_out_of_order_never_restart_a_stream() -> None:
    codec = _codec()
    sender, receiver = Link(resend_s=0.5), Link(resend_s=0.5)
    acks = []
    for name in ("a", "b", "c"):
        _deliver(codec, receiver, seal(codec, sender, AbortRequest(name), 0.0), 0.0)
        acks.append(ack_frame(codec, receiver))
    for frame in reversed(acks):
        _deliver(codec, sender, frame, 0.1)
    assert sender.num_restarts == 0 and not sender.sends.entries


def test_a_gap_is_reported_at_once_and_the_missing_frame_goes_again_at_once() -> None:
    codec = _codec()
    sender, receiver = Link(resend_s=0.5), Link(resend_s=0.5)
    lost = seal(codec, sender, AbortRequest("a"), 0.0)
    assert _deliver(codec, receiver, seal(codec, sender, AbortRequest("b"), 0.025), 0.025) == []
    assert receiver.ack_due(0.025)  # a new gap: no ack delay
    _deliver(codec, sender, ack_frame(codec, receiver), 0.026)
    [again] = sender.due(0.027)  # long before the 0.5 s timer
    assert again.data == lost and again.wait_s == 0.5  # the timer is not doubled by it
    assert sender.due(0.03) == []
    _deliver(codec, sender, ack_frame(codec, receiver), 0.05)  # the gap stays, but the resend is recent
    assert sender.due(0.05) == []
    _deliver(codec, sender, ack_frame(codec, receiver), 0.2)  # still missing 0.17 s later: that resend was lost
    assert [e.seq for e in sender.due(0.2)] == [0]
    assert [m.request_id for m in _deliver(codec, receiver, lost, 0.21)] == ["a", "b"]
