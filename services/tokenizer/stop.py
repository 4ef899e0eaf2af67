"""Stop strings over streamed text: hold back what could still begin a stop string, cut at a match."""

from __future__ import annotations


class StopChecker:
    """One sequence's stop strings; the emitted text is the full text cut at the first stop string.

    "First" means the first to complete, as vLLM's: the sequence ends with the push (token) that completes a stop
    string, never later, so its tokens, logprobs and usage end where its text does. Of several completed by the
    same push, the one that starts earliest (of two starting at one place, the shorter); vLLM takes the first in
    its list there.

    text seen:  [ emitted ..................... | held: may begin a stop string ]
    Nothing emitted can begin a match: every position where one could still start is held.

    Text pushed as `protected` (that of the first min_tokens tokens) ends no match: a stop string counts only
    where it ends after it (it may begin inside it), as vLLM's min_tokens holds stop strings back too.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        assert all(stop), "empty stop strings are rejected by SamplingParams.validate"
        self._stop = list(dict.fromkeys(stop))
        self._include_stop_str = include_stop_str_in_output
        self._held = ""
        self._num_protected = 0  # leading chars of _held that no match may end in
        self._done = False
        self.matched_stop: str | None = None  # the stop string that ended the sequence, if any

    def push(self, delta_text: str, protected: bool = False) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string matched); no pushes after a match. `protected`: no match
        may end in `delta_text` (min_tokens are not reached yet)."""
        assert not self._done, "push after the sequence stopped"
        if not self._stop:
            return delta_text, False
        text = self._held + delta_text
        num_protected = len(text) if protected else self._num_protected
        match = self._first_match(text, num_protected)
        if match is not None:  # it ends in delta_text: the held text completes none
            return self._cut(text, match), True
        partial_start = self._partial_start(text)
        self._held = text[partial_start:]
        self._num_protected = max(0, num_protected - partial_start)
        return text[:partial_start], False

    def flush(self) -> str:
        """The held text, when the sequence ended for another reason (a match may be waiting in it)."""
        assert not self._done, "flush after the sequence stopped"
        text, self._held = self._held, ""
        self._done = True
        match = self._first_match(text, self._num_protected)
        return text if match is None else self._cut(text, match)

    def _cut(self, text: str, match: tuple[int, int]) -> str:
        start, end = match
        self._done = True
        self.matched_stop = text[start:end]
        self._held = ""
        return text[:end] if self._include_stop_str else text[:start]

    def _first_match(self, text: str, num_protected: int = 0) -> tuple[int, int] | None:
        """(start, end) of the earliest-starting, then shortest, complete match that ends past `num_protected`."""
        best: tuple[int, int] | None = None
        for stop in self._stop:
            start = text.find(stop, max(0, num_protected - len(stop) + 1))
            if start >= 0 and (best is None or (start, start + len(stop)) < best):
                best = (start, start + len(stop))
        return best

    def _partial_start(self, text: str) -> int:
        """Where the longest tail of `text` that is a proper prefix of a stop string begins."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return len(text) - longest
