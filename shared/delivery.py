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
        self.entries[seq] = Sent(seq, data, tag, now, wait_s)

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
