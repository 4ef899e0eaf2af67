"""vLLM's thinking_token_budget on the worker: one sequence's tokens inside its think block are counted, and once the
budget is spent the end marker's token ids are forced, one a step; the answer after them is free.

    OPENING --(the output opens the block: `<think>` after whitespace)--> THINKING
    OPENING --(it starts with anything else: no block to bound)---------> DONE
    THINKING --(the model writes the end marker itself)-----------------> DONE
    THINKING --(max_tokens written inside the block)--------------------> CLOSING
    CLOSING --(the last end id written)---------------------------------> DONE

A budget whose output starts inside the block (the prompt opened it, or deepseek_r1) starts in THINKING. CLOSING
takes up an end marker the model had begun (its last ids are the marker's first ones) where it stands. Pure logic
over token ids and their bytes: GrammarRows (grammar.py) feeds it each sampled token and masks a CLOSING row to the
one id it must write. Counting semantics are vLLM's ThinkingBudgetStateHolder's: the tokens after the opener count,
the opener and the end marker's own tokens do not (one the model writes itself counts until the marker is whole).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from pagoda.shared.messages import ThinkingBudget

TAIL_BYTES = 64  # output bytes kept past the end marker's length while thinking (a marker may span tokens)


class Phase(Enum):
    OPENING = "opening"  # the output has not yet said whether it opens a block
    THINKING = "thinking"
    CLOSING = "closing"  # the budget is spent: the end marker's ids are forced
    DONE = "done"  # the block closed, or there was none: nothing more to do


@dataclass(slots=True)
class ThinkingCounter:
    """One sequence's budget and where its output stands."""

    budget: ThinkingBudget
    phase: Phase
    num_thinking: int = 0  # tokens written inside the block
    num_forced: int = 0  # CLOSING: the end ids written so far
    text: bytes = b""  # OPENING: the output so far; THINKING: its last bytes
    recent_ids: deque[int] = field(default_factory=deque)  # the last ids inside the block (a marker begun)

    @classmethod
    def of(cls, budget: ThinkingBudget) -> ThinkingCounter:
        counter = cls(budget, Phase.OPENING if budget.start else Phase.THINKING,
                      recent_ids=deque(maxlen=max(len(budget.end_token_ids) - 1, 1)))
        if counter.phase is Phase.THINKING:
            counter._spent()
        return counter

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def forced_token_id(self) -> int | None:
        """The id the next token must be (CLOSING), or None: the model chooses."""
        if self.phase is not Phase.CLOSING:
            return None
        return self.budget.end_token_ids[self.num_forced]

    def push(self, token_id: int, token_bytes: bytes) -> bool:
        """Advance with the output's next token and its bytes; False when it is not the id CLOSING forced (the row's
        mask did not hold: the caller fails it)."""
        if self.phase is Phase.OPENING:
            self._open(token_bytes)
        elif self.phase is Phase.THINKING:
            self._think(token_id, token_bytes)
        elif self.phase is Phase.CLOSING:
            if token_id != self.budget.end_token_ids[self.num_forced]:
                return False
            self.num_forced += 1
            if self.num_forced == len(self.budget.end_token_ids):
                self.phase = Phase.DONE
        return True

    def _open(self, token_bytes: bytes) -> None:
        """OPENING: the output's start, decoded as the reasoning parser reads it (whitespace stripped); a cut
        multi-byte character at the end is left out until it is whole."""
        self.text += token_bytes
        start = self.budget.start
        stripped = self.text.decode("utf-8", "ignore").lstrip()
        if len(stripped) < len(start) and start.startswith(stripped):
            return  # may still become the opener
        if not stripped.startswith(start):
            self.phase, self.text = Phase.DONE, b""
            return
        rest = stripped[len(start):].encode()  # what the opener's last token wrote after it: not counted
        self.phase, self.text = Phase.THINKING, b""
        if not self._closes(rest):
            self._spent()

    def _think(self, token_id: int, token_bytes: bytes) -> None:
        if self._closes(token_bytes):
            return
        self.num_thinking += 1
        self.recent_ids.append(token_id)
        self._spent()

    def _closes(self, token_bytes: bytes) -> bool:
        """Whether these bytes complete the end marker in the output's tail (then DONE)."""
        end = self.budget.end.encode()
        self.text = (self.text + token_bytes)[-(len(end) + TAIL_BYTES):]
        if end in self.text:
            self.phase, self.text = Phase.DONE, b""
            return True
        return False

    def _spent(self) -> None:
        """THINKING with the budget spent: CLOSING, past the end ids the model has written already."""
        if self.num_thinking < self.budget.max_tokens:
            return
        end_ids = self.budget.end_token_ids
        recent = list(self.recent_ids)
        begun = next((k for k in range(min(len(recent), len(end_ids) - 1), 0, -1) if recent[-k:] == end_ids[:k]), 0)
        self.phase, self.num_forced, self.text = Phase.CLOSING, begun, b""
