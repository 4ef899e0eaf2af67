"""Sequenced delivery over a socket that may lose, repeat, delay or reorder frames: the sender keeps what is not
known done and sends it again on a timer (doubling the wait each time); the receiver applies each sequence number
once, in order, holding early ones until the gap fills. Pure: no zmq, no clock (the caller passes `now`).

    sender                                   receiver
    record(seq 7) ------- lost -------x
    record(seq 8) ---------------------> offer(8): held (7 missing)
    due(now) -> [7, 8] -----------------> offer(7): [7, 8] in order;  offer(8) again: a repeat
    done_through(8) <---- result / ack ---

Repeats are harmless by construction: the receiver answers a repeat (with its cached reply, or an ack), so a lost
reply is recovered by the same resend that recovers a lost message.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

MAX_WAIT_S = 8.0  # the longest wait between two sends of one message


@dataclass(slots=True)
class Sent:
    seq: int
    data: bytes
    tag: int  # the caller's key for what completes it (a plan's step id), or -1: done once acknowledged
    sent_at: float
    wait_s: float  # until the next send if nothing completes it
    num_sends: int = 1
    first_sent_at: float = 0.0  # when it went the first time (sent_at moves with each resend)


@dataclass(slots=True)
class SendLog:
    """What a sender sent and does not know done, oldest first."""

    next_seq: int = 0
    entries: OrderedDict[int, Sent] = field(default_factory=OrderedDict)
    num_resent: int = 0

    def take_seq(self) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq

    def record(self, seq: int, data: bytes, now: float, wait_s: float, tag: int = -1) -> None:
        assert seq not in self.entries and wait_s > 0
        self.entries[seq] = Sent(seq, data, tag, now, wait_s, first_sent_at=now)

    def unanswered_s(self, now: float) -> float:
        """How long the oldest entry has waited since its first send (0 when none waits): the peer's silence."""
        oldest = next(iter(self.entries.values()), None)
        return 0.0 if oldest is None else now - oldest.first_sent_at

    def seq_of(self, tag: int) -> int | None:
        return next((e.seq for e in self.entries.values() if e.tag == tag), None)

    def done_through(self, seq: int) -> None:
        """Everything up to `seq` is done (a reply to `seq` came: the receiver applies in order)."""
        while self.entries and next(iter(self.entries)) <= seq:
            self.entries.popitem(last=False)

    def acked_through(self, seq: int) -> None:
        """The receiver applied everything up to `seq`: entries that expect no reply are done."""
        for entry in [e for e in self.entries.values() if e.seq <= seq and e.tag == -1]:
            del self.entries[entry.seq]

    def due(self, now: float) -> list[Sent]:
        """Entries to send again now, in sequence order; each one's next wait doubles."""
        out = []
        for entry in self.entries.values():
            if now - entry.sent_at >= entry.wait_s:
                entry.sent_at, entry.wait_s = now, min(entry.wait_s * 2, MAX_WAIT_S)
                entry.num_sends += 1
                out.append(entry)
        self.num_resent += len(out)
        return out

    def resend_now(self, seq: int, now: float) -> Sent | None:
        """Entry `seq` marked sent again now, where the receiver showed that it lacks it (later ones wait there,
        or a later one's reply came first) and it did not go again within GAP_RESEND_S; its timer's wait is
        unchanged. None: nothing to send (done, unknown, or just sent again)."""
        entry = self.entries.get(seq)
        if entry is None or (entry.num_sends > 1 and now - entry.sent_at < GAP_RESEND_S):
            return None
        entry.sent_at = now
        entry.num_sends += 1
        self.num_resent += 1
        return entry

    def clear(self) -> None:
        self.entries.clear()


@dataclass(slots=True)
class InOrder(Generic[T]):
    """The receiver: each sequence number once, in order; early ones wait (up to `max_ahead`) for the gap."""

    next_seq: int = 0
    max_ahead: int = 256
    ahead: dict[int, T] = field(default_factory=dict)
    num_repeats: int = 0

    def offer(self, seq: int, item: T) -> list[T] | None:
        """The items now deliverable in order (maybe none: `item` waits for a gap), or None: a repeat of one
        already delivered (or held), to be answered again, not applied."""
        if seq < self.next_seq or seq in self.ahead:
            self.num_repeats += 1
            return None
        if seq > self.next_seq:
            if seq - self.next_seq <= self.max_ahead:  # too far ahead: dropped, the sender sends it again
                self.ahead[seq] = item
            return []
        ready = [item]
        self.next_seq += 1
        while self.next_seq in self.ahead:
            ready.append(self.ahead.pop(self.next_seq))
            self.next_seq += 1
        return ready

    @property
    def applied_through(self) -> int:
        return self.next_seq - 1

    def reset(self) -> None:
        self.next_seq = 0
        self.ahead.clear()


ACK_DELAY_S = 0.05  # a receiver owes an ack at most this long when no frame of its own carries it
MAX_RETIRED_STREAMS = 8  # a peer's past stream ids whose late frames are dropped
GAP_RESEND_S = 0.1  # a frame the peer reports missing goes again at once, and again while the gap stays this long


def new_stream_id() -> int:
    """A stream id no earlier stream of this pair used (random, so a restarted process cannot repeat one)."""
    return random.getrandbits(62) + 1


@dataclass(slots=True)
class Link(Generic[T]):
    """Both directions with one peer (tokenizer <-> scheduler, api <-> tokenizer): a SendLog for what this side
    sends, under a stream id of its own, and an InOrder for the peer's stream. A stream starts at sequence 0; a
    side that gives up what it sent (it lost its peer, or the peer registered afresh) starts a new stream with
    `restart`, and the receiver, meeting a new stream id, starts over with it and drops late frames of the
    retired ones. Acks name the stream they acknowledge, so an ack from before a restart completes nothing.

        tokenizer                                  scheduler
        send(AddRequest)  -- (stream A, seq 4, ack B:9) -->  receive(A, 4): applied; ack A:4 owed
        receive(B, 10)   <-- (stream B, seq 10, ack A:4) --  send(TokenDeltas) carries the owed ack
    """

    resend_s: float  # the first wait before a send goes again (it doubles up to MAX_WAIT_S)
    stream: int = field(default_factory=new_stream_id)
    sends: SendLog = field(default_factory=SendLog)
    received: InOrder[T] = field(default_factory=lambda: InOrder(max_ahead=4096))
    peer_stream: int = 0  # 0: nothing received yet
    retired: list[int] = field(default_factory=list)
    ack_owed_since: float | None = None  # something arrived that no frame of ours has acknowledged yet
    receiver: int = field(default_factory=new_stream_id)  # names `received` in our acks: a new one, new state
    peer_receiver: int = 0  # the receiver state that acknowledges our stream (0: no ack yet)
    retired_receivers: list[int] = field(default_factory=list)
    num_restarts: int = 0  # streams given up because the peer's receiver no longer had what they needed
    gap_due: int = -1  # the seq the peer reports missing (later ones wait for it there): due at once; -1: none
    requeue: list[bytes] = field(default_factory=list)  # frames of a stream given up for a forgetful receiver:
    # the caller seals their bodies again in the new stream (that receiver applied none of them)

    def restart(self) -> None:
        """A fresh outgoing stream: what was sent and not acknowledged is given up."""
        self.stream = new_stream_id()
        self.sends = SendLog()
        self.gap_due = -1
        if self.peer_receiver:
            self.retired_receivers = [*self.retired_receivers, self.peer_receiver][-MAX_RETIRED_STREAMS:]
        self.peer_receiver = 0

    def next_send(self) -> tuple[int, int, int, int, int, bool]:
        """(stream, seq, ack stream, ack, receiver, gap) for the next sequenced frame: it carries the ack this side
        owes."""
        self.ack_owed_since = None
        return (self.stream, self.sends.take_seq(), self.peer_stream, self.received.applied_through, self.receiver,
                bool(self.received.ahead))

    def ack(self) -> tuple[int, int, int, bool]:
        """(ack stream, ack, receiver, gap) for a frame that carries only an acknowledgement; `gap`: later frames
        wait here for the one after `ack` (the sender sends that one again at once)."""
        self.ack_owed_since = None
        return self.peer_stream, self.received.applied_through, self.receiver, bool(self.received.ahead)

    def ack_due(self, now: float) -> bool:
        return self.ack_owed_since is not None and now - self.ack_owed_since >= ACK_DELAY_S

    def record(self, seq: int, data: bytes, now: float) -> None:
        self.sends.record(seq, data, now, self.resend_s)

    def receive(self, stream: int, seq: int, item: T, now: float) -> list[T] | None:
        """The peer's items now deliverable in order (see InOrder.offer); a frame of a retired stream is None."""
        if stream != self.peer_stream:
            if stream in self.retired or stream <= 0:
                return None
            if self.peer_stream:
                self.retired = [*self.retired, self.peer_stream][-MAX_RETIRED_STREAMS:]
            self.peer_stream = stream
            self.received = InOrder(max_ahead=self.received.max_ahead)
            self.receiver = new_stream_id()
        had_gap = bool(self.received.ahead)
        if self.ack_owed_since is None:
            self.ack_owed_since = now  # a repeat too: the peer missed our ack
        ready = self.received.offer(seq, item)
        if self.received.ahead and not had_gap:
            self.ack_owed_since = now - ACK_DELAY_S  # a new gap: say so now, not after the ack delay
        return ready

    def on_ack(self, stream: int, seq: int, receiver: int = 0, gap: bool = False, now: float = 0.0) -> bool:
        """The peer's `receiver` applied this side's stream `stream` through `seq` (in order: everything before it
        too). A receiver we have not heard from (the peer restarted, or forgot us and took us back) that waits for
        what an earlier one acknowledged, and we no longer hold, would wait forever: the stream starts afresh
        (what it still held goes again in the new one, see `requeue`). True: restarted."""
        if stream != self.stream or receiver in self.retired_receivers:
            return False
        if receiver and receiver != self.peer_receiver:
            oldest = next(iter(self.sends.entries), self.sends.next_seq)
            if self.peer_receiver and seq < oldest - 1:
                self.num_restarts += 1
                self.requeue = [entry.data for entry in self.sends.entries.values()]
                self.restart()
                return True
            if self.peer_receiver:
                self.retired_receivers = [*self.retired_receivers, self.peer_receiver][-MAX_RETIRED_STREAMS:]
            self.peer_receiver = receiver
        if seq >= 0:
            self.sends.done_through(seq)
        missing = self.sends.entries.get(seq + 1) if gap else None
        if missing is not None and (missing.num_sends == 1 or now - missing.sent_at >= GAP_RESEND_S):
            self.gap_due = missing.seq  # lost (or only overtaken: a repeat is harmless): sent again at once
        return False

    def due(self, now: float) -> list[Sent]:
        """What to send again now: a frame the peer reports missing (its timer unchanged), then what its timer
        says (each one's next wait doubles)."""
        out = []
        missing = self.sends.entries.get(self.gap_due)
        self.gap_due = -1
        if missing is not None:
            missing.sent_at = now
            missing.num_sends += 1
            self.sends.num_resent += 1
            out.append(missing)
        return out + self.sends.due(now)
