"""Pure helpers of the live view: rates between two counter readings, percentiles over the last minute from
cumulative histogram buckets, and a fixed-length history of numeric rows. No I/O, no clock of its own."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

Buckets = list[tuple[float, float]]  # (upper bound "le", cumulative count), ascending, the last bound +Inf


def quantile(buckets: Buckets, q: float) -> float | None:
    """The q-quantile of a cumulative histogram, interpolated linearly inside the bucket that holds it (as
    Prometheus' histogram_quantile does); the last finite bound when it falls in +Inf; None with no samples."""
    assert 0.0 <= q <= 1.0
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def bucket_delta(newer: Buckets, older: Buckets | None) -> Buckets:
    """What was observed between two readings of the same histogram (a reset, or no older one: all of newer)."""
    if older is None or len(older) != len(newer) or any(o[1] > n[1] for o, n in zip(older, newer, strict=True)):
        return newer
    return [(bound, count - old) for (bound, count), (_, old) in zip(newer, older, strict=True)]


@dataclass(slots=True)
class HistogramWindow:
    """Readings of one cumulative histogram, kept for `span_s`: what the last `span_s` seconds observed."""

    span_s: float = 60.0
    readings: deque[tuple[float, Buckets]] = field(default_factory=deque)

    def add(self, now: float, buckets: Buckets) -> None:
        self.readings.append((now, buckets))
        # keep one reading at or before now - span_s: the base the window's delta is taken from
        while len(self.readings) > 2 and self.readings[1][0] <= now - self.span_s:
            self.readings.popleft()

    def recent(self) -> Buckets:
        if not self.readings:
            return []
        newest = self.readings[-1][1]
        return bucket_delta(newest, self.readings[0][1]) if len(self.readings) > 1 else newest

    def summary(self, scale: float = 1000.0) -> dict[str, float | None]:
        """p50 / p90 / p99 (times `scale`: seconds to ms) and the count over the window."""
        recent = self.recent()
        out: dict[str, float | None] = {f"p{q}": _scaled(quantile(recent, q / 100), scale) for q in (50, 90, 99)}
        out["count"] = recent[-1][1] if recent else 0.0
        return out


def _scaled(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def rate(new_total: float, old_total: float, elapsed_s: float) -> float | None:
    """Per second between two readings of a counter; None when no time passed or the counter went back."""
    if elapsed_s <= 0 or new_total < old_total:
        return None
    return (new_total - old_total) / elapsed_s


@dataclass(slots=True)
class History:
    """The last `length` rows of a fixed set of numeric fields (one row per tick): the charts' data."""

    fields: tuple[str, ...]
    length: int = 600
    rows: deque[list[float | None]] = field(default_factory=deque)

    def add(self, values: dict[str, float | None]) -> list[float | None]:
        """Append one row (fields missing from `values` are None) and return it."""
        row = [values.get(name) for name in self.fields]
        self.rows.append(row)
        while len(self.rows) > self.length:
            self.rows.popleft()
        return row

    def to_dict(self) -> dict[str, object]:
        return {"fields": list(self.fields), "rows": list(self.rows)}
