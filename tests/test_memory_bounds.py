"""Per-key containers of the long-running processes stay bounded after many distinct inputs (no RSS or timing)."""

from __future__ import annotations

import time
from typing import Any

import llguidance

from pagoda.services.grammar.compiler import GRAMMAR_CACHE_SIZE, GrammarChecker
from pagoda.services.tokenizer.offload import Offloader
from pagoda.shared.messages import StructuredOutputs


def _schema(i: int) -> StructuredOutputs:
    return StructuredOutputs(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                   "required": [f"k{i}"]})


def test_grammar_checker_keeps_at_most_its_bound_of_distinct_constraints(ll: llguidance.LLTokenizer) -> None:
    """The tokenizer compiles every request's constraint once; a client sending a new schema each time must not
    grow the cache past its bound (each entry holds a vocab-wide start mask, ~6 KiB for SmolLM2)."""
    assert GRAMMAR_CACHE_SIZE >= 1
    checker = GrammarChecker(ll, max_entries=8)
    for i in range(40):
        checker.check(_schema(i))
        checker.check(StructuredOutputs(regex=f"a{i}[0-9]+"))
    assert len(checker._outcomes) == 8
    checker.check(_schema(39))  # the newest is still cached: a hit, no growth
    assert len(checker._outcomes) == 8


def test_offloader_forgets_cancelled_jobs_once_drained() -> None:
    """Aborted large prompts: their keys leave `pending`, `cancelled` and `owners` when their job ends."""
    offloader = Offloader(num_threads=1)
    try:
        done: list[Any] = []
        for batch in range(4):  # each batch under MAX_PENDING: none is refused as overload
            for i in range(50):
                key = f"req-{batch}-{i}"
                offloader.run(key, "api", lambda: 1, True, done.append, done.append)
                offloader.cancel(key)
            deadline = time.monotonic() + 10
            while offloader.pending and time.monotonic() < deadline:
                time.sleep(0.01)
                offloader.drain()
            assert not offloader.pending and not offloader.cancelled and not offloader.owners
        assert done == []  # a cancelled job's result (or error) is dropped
    finally:
        offloader.close()
