"""Per-key containers of the long-running processes stay bounded after many distinct inputs (no RSS or timing)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import llguidance

from pagoda.services.grammar.compiler import GRAMMAR_CACHE_SIZE, GrammarChecker
from pagoda.services.scheduler.service import MAX_WORKER_GRAMMAR_BYTES, MAX_WORKER_GRAMMARS
from pagoda.services.tokenizer.offload import Offloader
from pagoda.services.worker.grammar import GrammarRows
from pagoda.shared.config import MATCHER_CACHE_BYTES, MATCHER_CACHE_SIZE, ServerConfig
from pagoda.shared.lru import SizedLru
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


def test_a_sized_lru_keeps_both_bounds_and_evicts_the_least_recently_used() -> None:
    """The scheduler evicts for the workers (GrammarDef's evict list) and the worker keeps its compiled matchers
    in this map: whatever sizes distinct keys come in, it stays within its count and its bytes, the least recently
    used goes first, and only held keys are named (a bound by count alone let 512 constraints of 1 MiB each sit in
    every worker, and 256 compiled matchers of ~35 MB each)."""
    assert MAX_WORKER_GRAMMAR_BYTES < MAX_WORKER_GRAMMARS * (1 << 20)
    lru: SizedLru[str, int] = SizedLru(max_count=16, max_bytes=10_000)
    held: dict[str, int] = {}  # what a worker holds, following the evict lists
    order: list[str] = []  # their use, oldest first
    rng = random.Random(7)
    evicted_for_bytes = 0
    for i in range(3000):
        if held and rng.random() < 0.3:  # a constraint sent again
            key = rng.choice(order)
            assert lru.touch(key) if i % 2 else lru.get(key) == held[key]
            order.remove(key)
            order.append(key)
            continue
        key, size = f"g{i}", rng.choice([rng.randint(1, 300), rng.randint(1000, 4000)])
        assert not lru.touch(key) and lru.get(key) is None
        evict = lru.put(key, size, size)
        assert evict == order[:len(evict)]
        evicted_for_bytes += bool(evict) and len(held) - len(evict) < 15  # more went than the count needed
        for old in evict:
            del held[old]
        del order[:len(evict)]
        held[key] = size
        order.append(key)
        assert len(held) <= 16 and sum(held.values()) <= 10_000
        assert lru.total_bytes == sum(held.values()) and lru.keys() == order
    assert evicted_for_bytes > 0  # the byte bound decided some evictions, not only the count
    assert lru.put("huge", 1, 50_000) == order and lru.keys() == ["huge"]  # the newest stays, alone


def test_the_workers_compiled_matchers_stay_within_their_bytes(ll: llguidance.LLTokenizer) -> None:
    """Distinct large constraints (a tenant sending a new big schema each time) do not pile up compiled matchers in
    the worker past MATCHER_CACHE_BYTES of constraint text; small ones still fill the count."""
    assert MATCHER_CACHE_BYTES < MATCHER_CACHE_SIZE * (1 << 20)
    rows = GrammarRows(lambda: ll, vocab_size=ll.vocab_size)
    try:
        assert (rows._pristine.max_count, rows._pristine.max_bytes) == (MATCHER_CACHE_SIZE, MATCHER_CACHE_BYTES)
        rows._pristine = SizedLru(MATCHER_CACHE_SIZE, 4096)  # the same map, scaled down (big ones compile slowly)
        for i in range(6):  # each a regex of ~1/4 of the budget: at most 3 are kept
            rows._compile(StructuredOutputs(regex=f"{i}(" + "a" * 1024 + ")?"))
        assert len(rows._pristine) == 3 and rows._pristine.total_bytes <= 4096
        for i in range(MATCHER_CACHE_SIZE + 8):
            rows._compile(StructuredOutputs(regex=f"b{i}"))
        assert len(rows._pristine) == MATCHER_CACHE_SIZE
    finally:
        rows.close()


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


def test_a_replica_that_keeps_moving_leaves_no_socket_behind(tmp_path: Path) -> None:
    """A replica back at a new address (a pod rescheduled) is lost at its old one. Its old DEALER and SUB stayed
    open, reconnecting forever, and the DEALER queued every heartbeat (HWM 100,000): two sockets and up to
    ~10 MB per move, for the tokenizer's life. Now they are closed and unwatched; heartbeats go on."""
    import zmq

    from pagoda.services.tokenizer.service import TokenizerService
    from pagoda.shared.messages import Directory, ModelInfo, ReplicaAddress, SchedulerToTokenizer
    from pagoda.shared.transport import Codec

    context = zmq.Context()
    registry = context.socket(zmq.ROUTER)
    registry.bind(f"ipc://{tmp_path}/s0")
    config = ServerConfig(registry_endpoint=f"ipc://{tmp_path}/s0", routing="prefix", tokenizer_id="tk")
    service = TokenizerService(config, None, context)
    codec = Codec(SchedulerToTokenizer)
    info = ModelInfo(max_model_len=1024, vocab_size=1000, max_num_tokens=4096, eos_token_ids=[0])
    try:
        service._on_scheduler_frame(codec.encode(info), 0)
        watched = []
        for move in range(12):
            directory = Directory(apis=[], registry_replica_id=0, replicas=[
                ReplicaAddress(0, f"ipc://{tmp_path}/s0", f"ipc://{tmp_path}/st0", "a"),
                ReplicaAddress(1, f"ipc://{tmp_path}/s1-{move}", f"ipc://{tmp_path}/st1-{move}", "b")])
            service._on_scheduler_frame(codec.encode(directory), 0)
            service._send_heartbeats()  # a retired replica's closed socket is skipped, not an error
            watched.append(len(service._peers.handlers))
        moved = service._replicas.replicas[1:-1]
        assert len(moved) == 11 and all(r.lost for r in moved)
        assert all(r.sock.closed and (r.stats_sock is None or r.stats_sock.closed) for r in moved)
        assert watched[-1] == watched[0]  # only the live replicas' sockets are polled
    finally:
        service._peers.close(0)
        service._offload.close()
        registry.close(linger=0)
        context.term()
