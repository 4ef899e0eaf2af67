"""Beam search bookkeeping, pure: the running beams and finished hypotheses of one request, advanced by each
step's best candidates, with transformers' rules (GenerationMixin._beam_search, transformers 5.x).

Each step the worker scores every continuation of every running beam, score(beam) + logprob(token), and
returns the K best over [beams x vocabulary], K = max(2, 1 + number of stop ids) x width. Then:

    hit        = the token is a stop id (EOS unless ignore_eos, stop_token_ids) or the beam reaches max length
    running    = the width best candidates that do not hit (hits last, as transformers' -1e9)
    finished  += hits among the width best candidates, scored sum(logprobs) / generated_len ** length_penalty,
                 unless the request is closed; the width best hypotheses are kept
    closed     = early_stopping True and width hypotheses, or no running beam can beat the worst hypothesis:
                 its score at the current length (early_stopping False / True) or, "never" with a positive
                 length_penalty, at max length
    done       = closed, or every candidate hits (max length)

The n best hypotheses are the answer. No torch, no zmq: tested with plain lists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

NEG = -1.0e9  # transformers' mask for a candidate that may not run or finish


@dataclass(slots=True)
class Hypothesis:
    score: float  # cumulative logprob / generated_len ** length_penalty
    cumulative_logprob: float
    token_ids: list[int]  # the generated tokens, a final stop token included
    stopped: bool  # ended on a stop id (else max length)


@dataclass(slots=True)
class BeamStep:
    """What one step decided: the next running beams (best first) as (parent beam, token, cumulative logprob)."""

    beams: list[tuple[int, int, float]]
    done: bool


@dataclass(slots=True)
class BeamSearch:
    width: int
    num_return: int
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int
    stop_ids: frozenset[int]
    num_generated: int = 0  # tokens each running beam has generated
    scores: list[float] = field(default_factory=lambda: [0.0])  # running beams' cumulative logprobs
    hypotheses: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.stop_ids)) * self.width

    def best(self) -> list[Hypothesis]:
        return self.hypotheses[:self.num_return]

    def step(self, token_ids: Sequence[int], parents: Sequence[int], scores: Sequence[float],
             history: Sequence[Sequence[int]]) -> BeamStep:
        """Apply one step's candidates, best first: token, parent (index into the running beams, whose generated
        tokens are `history`) and cumulative logprob. Returns the next running beams."""
        assert not self.done and len(token_ids) == len(parents) == len(scores) > 0
        generated = self.num_generated + 1
        hits = [token in self.stop_ids or generated >= self.max_new_tokens for token in token_ids]
        ranked = sorted(range(len(token_ids)), key=lambda k: -(scores[k] + NEG * hits[k]))  # stable: ties in order
        running = ranked[:self.width]
        closed = (len(self.hypotheses) == self.width and self.early_stopping is True) or not self.improvable
        if not closed:
            fresh = [Hypothesis(normalised(scores[k], generated, self.length_penalty), scores[k],
                                [*history[parents[k]], token_ids[k]], token_ids[k] in self.stop_ids)
                     for k in range(min(self.width, len(token_ids))) if hits[k]]
            merged = self.hypotheses + fresh
            merged.sort(key=lambda h: -h.score)  # stable: an earlier hypothesis wins a tie
            self.hypotheses = merged[:self.width]
        self.num_generated = generated
        beams = [(parents[k], token_ids[k], scores[k] + NEG * hits[k]) for k in running]
        self.scores = [score for _, _, score in beams]
        self._update_improvable(generated)
        full = len(self.hypotheses) == self.width and self.early_stopping is True
        self.done = not self.improvable or full or all(hits)
        return BeamStep(beams, self.done)

    def _update_improvable(self, generated: int) -> None:
        """Can a running beam still beat the worst kept hypothesis? (only asked once width are kept)"""
        if len(self.hypotheses) < self.width:
            return
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = generated
        best_possible = normalised(max(self.scores), best_length, self.length_penalty)
        self.improvable = self.improvable and best_possible > min(h.score for h in self.hypotheses)


def normalised(cumulative_logprob: float, length: int, length_penalty: float) -> float:
    """cumulative_logprob / length ** length_penalty. A length_penalty so large in magnitude that the power leaves
    float's range (1000 overflows at length 3, -1000 underflows to 0) saturates the quotient (to -0.0 or -inf, as
    cumulative logprobs are <= 0) where Python's float power would raise OverflowError or divide by zero."""
    try:
        penalty = float(length) ** length_penalty
    except OverflowError:
        penalty = math.inf
    if penalty == 0.0:
        return -math.inf if cumulative_logprob < 0.0 else 0.0
    return cumulative_logprob / penalty


def assign_slots(parents: Sequence[int], num_slots: int) -> list[int]:
    """The slot each new beam takes (parents: each new beam's parent slot): a parent's first child stays in the
    parent's slot (no copy, no table change); its other children take the slots of beams that have none."""
    assert len(parents) <= num_slots
    slots = [-1] * len(parents)
    taken = [False] * num_slots
    for j, parent in enumerate(parents):
        if not taken[parent]:
            slots[j] = parent
            taken[parent] = True
    free = iter(slot for slot in range(num_slots) if not taken[slot])
    for j, slot in enumerate(slots):
        if slot < 0:
            slots[j] = next(free)
    return slots
