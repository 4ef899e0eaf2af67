"""vLLM's repetition_detection: end a completion whose output ends in `min_count` copies of one token pattern.

A pattern of L tokens repeated `count` times at the end of the output is the same as: each of the output's last
L * (count - 1) tokens equals the token L before it. So for every L a watch keeps the run of consecutive output
tokens equal to the token L before them, ending at the newest; the output ends in the repetition once some run
reaches L * (count - 1). A new token t extends the runs of exactly the L whose earlier token (L back) is t, and
resets all the others: for few sizes one scan of the tokens before it for t (list.index, in C) and a little Python
per match, for many a few numpy operations over all sizes. Pure: no I/O, no clock.
"""

from __future__ import annotations

import numpy as np

from pagoda.shared.messages import RepetitionDetection

# Pattern sizes up to which a watch keeps its runs in a dict, its matches found by list.index: ~2 us a token on
# text-like output, ~7 us when every size matches (one token repeated). Above, in a numpy array: ~5 us a token at
# 25 sizes, ~8 us at 2048, whatever the output (the dict took ~14 us at 64 sizes and ~270 us at 2048 on one token
# repeated). Best of 5 over 4,000-token outputs on the 2-core build host, 2026-12-07 (docs/decoding.md has the
# scheduler step's cost: `python -m pagoda.bench scheduler --repetition-sizes P`).
SPARSE_MAX_SIZES = 24


class RepetitionWatch:
    """One sequence's runs, fed its output token by token (`advance`)."""

    __slots__ = ("params", "shortest", "num_seen", "runs", "sizes", "needed", "output")

    def __init__(self, params: RepetitionDetection) -> None:
        assert params.enabled and params.min_count >= 2, "a watch needs a pattern size and a count"
        self.params = params
        self.shortest = params.shortest
        self.num_seen = 0  # output tokens taken in so far
        num_sizes = params.max_pattern_size - self.shortest + 1
        self.runs: dict[int, int] = {}  # sparse: pattern size L -> the run for L ending at the newest token
        self.sizes = np.zeros(0, np.int64)  # dense: the run for L = shortest + i at [i]
        self.needed = np.zeros(0, np.int64)  # dense: the run that makes L's pattern repeat min_count times
        self.output = np.zeros(0, np.int64)  # dense: the output so far (its first num_seen entries)
        if num_sizes > SPARSE_MAX_SIZES:
            self.sizes = np.zeros(num_sizes, np.int64)
            self.needed = np.arange(self.shortest, params.max_pattern_size + 1, dtype=np.int64) * (params.min_count - 1)
            self.output = np.zeros(1024, np.int64)

    @property
    def dense(self) -> bool:
        return len(self.needed) > 0

    def advance(self, token_ids: list[int], output_start: int, end: int) -> bool:
        """Take in the output tokens token_ids[output_start + num_seen : end] (known values, no placeholder);
        whether the output up to `end` ends in a repeated pattern."""
        first = output_start + self.num_seen
        assert output_start <= first <= end <= len(token_ids), "the output only grows"
        push = self._push_dense if self.dense else self._push_sparse
        for position in range(first, end):
            push(token_ids, output_start, position)
            self.num_seen += 1
        return self.repeats()

    def repeats(self) -> bool:
        if self.dense:
            return bool((self.sizes >= self.needed).any())
        count = self.params.min_count
        return any(run >= size * (count - 1) for size, run in self.runs.items())

    def _push_sparse(self, token_ids: list[int], output_start: int, position: int) -> None:
        """token_ids[position] is in: the sizes L whose token L back is the same extend their runs by one, the others
        drop to 0 (left out of the dict)."""
        longest = min(self.params.max_pattern_size, position - output_start)  # L back stays inside the output
        token, runs, old = token_ids[position], {}, self.runs
        lo, hi = position - longest, position - self.shortest + 1  # the earlier positions to look at: [lo, hi)
        while lo < hi:
            try:
                earlier = token_ids.index(token, lo, hi)
            except ValueError:
                break
            size = position - earlier
            runs[size] = old.get(size, 0) + 1
            lo = earlier + 1
        self.runs = runs

    def _push_dense(self, token_ids: list[int], output_start: int, position: int) -> None:
        """As _push_sparse, over every size at once."""
        token, offset = token_ids[position], position - output_start
        if offset == len(self.output):
            self.output = np.concatenate([self.output, np.zeros_like(self.output)])
        self.output[offset] = token
        longest = min(self.params.max_pattern_size, offset)  # L back stays inside the output
        if longest < self.shortest:
            return  # no size reaches back yet: every run is 0
        # earlier[i] is the token L = shortest + i back
        earlier = self.output[offset - longest:offset - self.shortest + 1][::-1]
        runs = self.sizes[:len(earlier)]  # sizes past `longest` stay 0 until the output is long enough
        runs += 1
        runs *= earlier == token


def output_repeats(output: list[int], params: RepetitionDetection) -> bool:
    """The definition itself, for tests and one-off checks: the output ends in `min_count` copies of a pattern of
    `shortest`..`max_pattern_size` tokens."""
    count = params.min_count
    for size in range(params.shortest, params.max_pattern_size + 1):
        if size * count > len(output):
            return False
        tail = output[len(output) - size * count:]
        if all(tail[i] == tail[i + size] for i in range(size * (count - 1))):
            return True
    return False
