"""A least-recently-used map bounded by entry count and by the entries' sizes together: the caches of things
whose memory varies by orders of magnitude (compiled grammars, the constraints the workers hold) need both."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class SizedLru(Generic[K, V]):
    """At most max_count entries whose sizes add up to at most max_bytes; the least recently used go first. The
    newest entry always stays, even one larger than max_bytes alone."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        assert max_count >= 1 and max_bytes >= 1, (max_count, max_bytes)
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()  # key -> (value, size), oldest use first
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[K]:
        """Oldest use first."""
        return list(self._entries)

    def touch(self, key: K) -> bool:
        """Whether key is held; if so it is now the most recently used."""
        if key not in self._entries:
            return False
        self._entries.move_to_end(key)
        return True

    def get(self, key: K) -> V | None:
        """The value (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def size_of(self, key: K) -> int | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def discard(self, key: K) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.total_bytes -= entry[1]

    def put(self, key: K, value: V, size: int) -> list[K]:
        """Add (or replace) an entry as the most recently used; return the keys dropped to make room."""
        assert size >= 0, size
        old = self._entries.pop(key, None)
        if old is not None:
            self.total_bytes -= old[1]
        evicted = []
        while self._entries and (len(self._entries) >= self.max_count or self.total_bytes + size > self.max_bytes):
            dropped, (_, dropped_size) = self._entries.popitem(last=False)
            self.total_bytes -= dropped_size
            evicted.append(dropped)
        self._entries[key] = (value, size)
        self.total_bytes += size
        return evicted
