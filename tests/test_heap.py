"""Start-up objects frozen out of the garbage collector's scans (pagoda.shared.heap)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from pagoda import LLM
from pagoda.shared.heap import settle_heap


def test_settle_heap_freezes_what_survives_and_collects_the_rest() -> None:
    gc.unfreeze()

    class Node:
        def __init__(self) -> None:
            self.me = self  # a reference cycle: only the cyclic collector frees it

    kept, dropped = Node(), Node()
    dropped_ref = weakref.ref(dropped)
    del dropped
    frozen = settle_heap("test")
    # Frozen objects can still be freed by reference counting (threads other tests left running drop theirs at any
    # moment), so the count only ever falls after the freeze; nothing is added to it without another gc.freeze().
    assert frozen > 0
    assert 0 < gc.get_freeze_count() <= frozen
    assert dropped_ref() is None  # the unreachable cycle was collected before freezing
    assert not _tracked(kept)  # frozen objects are outside every generation the collector scans
    gc.unfreeze()
    assert _tracked(kept)


def test_offline_engine_freezes_its_start_up_objects() -> None:
    gc.unfreeze()
    llm = LLM("tiny", load_format="dummy", seed=0)
    assert gc.get_freeze_count() > 0
    assert not _tracked(llm.engine.runner.model)  # the model's modules are not scanned while serving


def _tracked(obj: Any) -> bool:
    return any(o is obj for o in gc.get_objects())
