"""Prefix-aware routing (services/tokenizer/routing.py) with plain objects: affinity is consistent across
router instances and processes, follows replicas dying and returning, yields to load, and on the issue's
workload (8 system prompts x 32 user turns) keeps the prefix-cache hit rate of one big cache."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import pytest

from pagoda.services.tokenizer.routing import (
    PrefixRouter,
    ReplicaLoad,
    RoutingConfig,
    affinity_key,
    choose_replica,
    client_key,
    overload_limit,
    rendezvous_order,
    replica_load,
)
from pagoda.shared.errors import ServerOverloadedError

BLOCK = 16


def idle(replica_id: str, running: int = 0, waiting: int = 0, free: int = 1000, alive: bool = True) -> ReplicaLoad:
    return ReplicaLoad(replica_id, num_waiting=waiting, num_running=running, kv_blocks_free=free,
                       kv_blocks_total=1000, alive=alive)


def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(150_000) for _ in range(length)] for _ in range(count)]


# ------------------------------------------------------------------ the affinity key and the ranking


def test_affinity_key_covers_the_first_full_blocks_only() -> None:
    [prompt] = random_prompts(1, 10 * BLOCK)
    key = affinity_key(prompt, BLOCK, 4)
    assert key is not None and len(key) == 16
    # Whatever follows the first 4 blocks does not change the key; a change inside them does.
    assert affinity_key(prompt[:4 * BLOCK] + [7] * 30, BLOCK, 4) == key
    assert affinity_key(prompt[:4 * BLOCK + 5], BLOCK, 4) == key
    changed = list(prompt)
    changed[4 * BLOCK - 1] += 1
    assert affinity_key(changed, BLOCK, 4) != key
    # Shorter prompts key on the full blocks they have; none at all: no key.
    assert affinity_key(prompt[:2 * BLOCK + 3], BLOCK, 4) == affinity_key(prompt[:2 * BLOCK], BLOCK, 4) != key
    assert affinity_key(prompt[:BLOCK - 1], BLOCK, 4) is None


def test_a_cache_salt_keys_its_own_affinity() -> None:
    """Salted requests share cached blocks only with their salt: one salt and prefix always route together, and the
    same prefix under other salts spreads over the replicas like other prefixes (no salt: the key as before)."""
    [prompt] = random_prompts(1, 5 * BLOCK, seed=4)
    plain = affinity_key(prompt, BLOCK, 4)
    assert affinity_key(prompt, BLOCK, 4, "") == plain
    salted = affinity_key(prompt, BLOCK, 4, "tenant-a")
    assert salted is not None and salted != plain
    assert affinity_key(prompt[:4 * BLOCK] + [9], BLOCK, 4, "tenant-a") == salted  # still only the first blocks
    assert affinity_key(prompt, BLOCK, 4, "tenant-b") != salted
    assert affinity_key(prompt[:BLOCK - 1], BLOCK, 4, "tenant-a") is None
    loads = [idle(f"r{i}") for i in range(4)]
    first, second = PrefixRouter(), PrefixRouter()
    for load in loads:
        first.update(load)
        second.update(load)
    chosen = set()
    for index in range(40):
        salt = f"salt-{index}"
        replica = first.choose(prompt + [index], salt)
        assert second.choose(prompt + [1000 + index], salt) == replica
        assert choose_replica(prompt, loads, RoutingConfig(), cache_salt=salt) == replica
        chosen.add(replica)
        first.update(idle(replica))
        second.update(idle(replica))
    assert chosen == {"r0", "r1", "r2", "r3"}  # one prefix under many salts spreads


def test_a_prompt_cache_key_is_the_key_whatever_the_prompt() -> None:
    """OpenAI's prompt_cache_key: requests that name the same key (under the same salt) share a key whatever their
    prompts, short ones too; the salt still separates, and no key is any prefix's."""
    prompts = random_prompts(4, 6 * BLOCK, seed=9)
    keyed = affinity_key(prompts[0], BLOCK, 4, prompt_cache_key="conversation-1")
    assert keyed == client_key("", "conversation-1") and keyed is not None and len(keyed) == 16
    for prompt in [*prompts, prompts[0][:BLOCK - 1], [5], []]:
        assert affinity_key(prompt, BLOCK, 4, prompt_cache_key="conversation-1") == keyed
    assert affinity_key(prompts[0], BLOCK, 4, prompt_cache_key="conversation-2") != keyed
    salted = affinity_key(prompts[0], BLOCK, 4, "tenant-a", "conversation-1")
    assert salted not in (keyed, affinity_key(prompts[0], BLOCK, 4, "tenant-b", "conversation-1"))
    assert affinity_key(prompts[1], BLOCK, 4, "tenant-a", "conversation-1") == salted
    assert client_key("ab", "c") != client_key("a", "bc")  # the pair, not its concatenation
    prefix_keys = {affinity_key(p, BLOCK, 4, salt) for p in prompts for salt in ("", "tenant-a")}
    assert not prefix_keys & {keyed, salted}
    assert affinity_key(prompts[0], BLOCK, 4, prompt_cache_key="") == affinity_key(prompts[0], BLOCK, 4)  # none


def test_requests_with_one_prompt_cache_key_go_to_one_replica() -> None:
    """Different prompts (other first blocks, or no full block) with one key go where that key ranks first, from
    any router; different keys spread over the replicas; the same key under another salt is another key."""
    loads = [idle(f"r{i}") for i in range(4)]
    first, second = PrefixRouter(), PrefixRouter()
    for load in loads:
        first.update(load)
    for load in reversed(loads):
        second.update(load)
    homes: dict[str, str] = {}
    for index in range(40):
        key = f"user-{index}"
        home = rendezvous_order(client_key("", key), [load.replica_id for load in loads])[0]
        prompts = [*random_prompts(3, 5 * BLOCK, seed=index), [index, 1, 2]]  # the last one fills no block
        assert {first.choose(p, prompt_cache_key=key) for p in prompts} == {home}
        assert {second.choose(p, prompt_cache_key=key) for p in prompts} == {home}
        assert {choose_replica(p, loads, RoutingConfig(), prompt_cache_key=key) for p in prompts} == {home}
        for router in (first, second):
            router.update(idle(home))  # fresh stats: the requests finished
        homes[key] = home
    counts = Counter(homes.values())
    assert set(counts) == {"r0", "r1", "r2", "r3"} and max(counts.values()) <= 20  # the keys spread
    salted = Counter(choose_replica([1] * 64, loads, RoutingConfig(), cache_salt=f"salt-{i}",
                                    prompt_cache_key="user-0") for i in range(40))
    assert len(salted) == 4  # one key under many salts spreads like many keys


def test_the_ranking_is_the_same_in_another_process() -> None:
    """blake2b, not Python's salted hash(): a tokenizer started with another PYTHONHASHSEED agrees."""
    ids = [f"replica-{i}" for i in range(5)]
    prompts = random_prompts(20, 3 * BLOCK, seed=3)
    here = [rendezvous_order(affinity_key(p, BLOCK, 4), ids) for p in prompts]
    script = (
        "import sys, json\n"
        "from pagoda.services.tokenizer.routing import affinity_key, rendezvous_order\n"
        "prompts, ids = json.loads(sys.stdin.read())\n"
        "print(json.dumps([rendezvous_order(affinity_key(p, 16, 4), ids[::-1]) for p in prompts]))\n"
    )
    import json

    result = subprocess.run([sys.executable, "-c", script], input=json.dumps([prompts, ids]), capture_output=True,
                            text=True, timeout=60, env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == here
    assert len({tuple(order) for order in here}) > 5  # the keys really spread over different rankings


def test_same_prefix_goes_to_the_same_replica_from_two_routers() -> None:
    loads = [idle(f"r{i}") for i in range(4)]
    first, second = PrefixRouter(), PrefixRouter()
    for load in loads:
        first.update(load)
    for load in reversed(loads):  # another order of learning about the replicas
        second.update(load)
    system_prompts = random_prompts(40, 5 * BLOCK, seed=1)
    rng = random.Random(2)
    chosen = []
    for system in system_prompts:
        a = first.choose(system + [rng.randrange(1000) for _ in range(rng.randrange(1, 50))])
        b = second.choose(system + [rng.randrange(1000) for _ in range(rng.randrange(1, 50))])
        assert a == b
        first.update(idle(a))  # fresh stats: what was sent is counted in them (here: finished)
        second.update(idle(b))
        chosen.append(a)
    counts = Counter(chosen)
    assert set(counts) == {"r0", "r1", "r2", "r3"} and max(counts.values()) <= 20  # the prefixes spread


def test_a_dead_replicas_share_moves_to_the_others_and_returns() -> None:
    ids = [f"r{i}" for i in range(4)]
    prompts = random_prompts(400, 4 * BLOCK, seed=4)
    config = RoutingConfig()

    def routes(dead: set[str]) -> list[str]:
        loads = [idle(i, alive=i not in dead) for i in ids]
        return [choose_replica(p, loads, config) for p in prompts]

    before = routes(set())
    during = routes({"r2"})
    after = routes(set())
    assert after == before
    moved = [(b, d) for b, d in zip(before, during, strict=True) if b != d]
    assert moved and all(b == "r2" for b, _ in moved)  # only the dead replica's prompts move...
    assert "r2" not in during
    assert len({d for _, d in moved}) == 3  # ...and they spread over all the survivors
    assert len(moved) == before.count("r2")


def test_no_live_replica_is_an_error() -> None:
    with pytest.raises(ServerOverloadedError) as info:
        choose_replica([1] * 64, [idle("r0", alive=False), idle("r1", alive=False)], RoutingConfig())
    assert info.value.http_status == 503
    with pytest.raises(ServerOverloadedError):
        PrefixRouter().choose([1] * 64)


def test_replica_load_from_stats() -> None:
    from pagoda.shared.messages import SchedulerStats

    stats = SchedulerStats(time=0.0, num_running=3, num_waiting=2, kv_blocks_free=40, kv_blocks_total=100,
                           kv_cache_usage=0.6, prefix_hit_tokens_total=0, prefix_query_tokens_total=0,
                           num_preemptions_total=0, prompt_tokens_total=0, generation_tokens_total=0,
                           num_steps_total=0, worker_ready=True, worker_alive=True, tokenizer_ids=[],
                           tokenizer_requests_total=[])
    assert replica_load("r0", stats, 0.1, 5.0) == ReplicaLoad("r0", 2, 3, 40, 100, alive=True)
    assert not replica_load("r0", stats, 5.1, 5.0).alive  # stale: the scheduler stopped publishing
    for change in ({"worker_alive": False}, {"worker_ready": False}):
        assert not replica_load("r0", msgspec.structs.replace(stats, **change), 0.1, 5.0).alive
    assert not replica_load("r0", None, None, 5.0).alive


# ------------------------------------------------------------------ load


def _affine_and_other(prompt: Sequence[int], ids: Sequence[str]) -> tuple[str, str]:
    order = rendezvous_order(affinity_key(prompt, BLOCK, 4), ids)
    return order[0], order[1]


def test_an_overloaded_affine_replica_spills() -> None:
    config = RoutingConfig(min_load_gap=4, max_load_ratio=0.5)
    [prompt] = random_prompts(1, 6 * BLOCK, seed=5)
    affine, other = _affine_and_other(prompt, ["r0", "r1"])
    for least in (0, 3, 10, 40):
        limit = overload_limit(least, config)
        assert limit == least + max(4, 0.5 * least)
        at_limit = [idle(affine, running=int(limit)), idle(other, running=least)]
        past_limit = [idle(affine, running=int(limit) + 1), idle(other, running=least)]
        assert choose_replica(prompt, at_limit, config) == affine
        assert choose_replica(prompt, past_limit, config) == other
    # waiting requests count as load too
    assert choose_replica(prompt, [idle(affine, running=2, waiting=9), idle(other, running=2)], config) == other


def test_a_prompt_cache_key_spills_as_a_prefix_does() -> None:
    """A keyed request stays on its key's replica up to the overload limit, also when its prompt fills no block
    (such a prompt without a key goes to the least loaded at once), and past it spills to the key's second choice."""
    config = RoutingConfig(min_load_gap=4, max_load_ratio=0.5)
    affine, other = rendezvous_order(client_key("", "k"), ["r0", "r1"])
    for prompt in (random_prompts(1, 6 * BLOCK, seed=10)[0], [1, 2, 3]):
        for least in (0, 3, 10, 40):
            limit = int(overload_limit(least, config))
            at_limit = [idle(affine, running=limit), idle(other, running=least)]
            past_limit = [idle(affine, running=limit + 1), idle(other, running=least)]
            assert choose_replica(prompt, at_limit, config, prompt_cache_key="k") == affine
            assert choose_replica(prompt, past_limit, config, prompt_cache_key="k") == other
    short_loads = [idle(affine, running=2), idle(other, running=0)]
    assert choose_replica([1, 2, 3], short_loads, config) == other  # no key: the least loaded
    assert choose_replica([1, 2, 3], short_loads, config, prompt_cache_key="k") == affine
    # a burst between stats: the router's own sends count, and the overflow spills to the second choice
    router = PrefixRouter(config)
    router.update(idle(affine))
    router.update(idle(other))
    burst = Counter(router.choose(prompt, prompt_cache_key="k") for prompt in random_prompts(40, 2 * BLOCK, seed=11))
    assert burst[affine] > burst[other] > 0
    assert burst[affine] - burst[other] <= 4 + 0.5 * burst[other] + 1


def test_spilling_follows_the_ranking_not_just_the_least_loaded() -> None:
    """A hot prefix overflows onto its consistent second choice (which then caches it) while that one is not
    overloaded itself, rather than onto whichever replica is idlest at the moment."""
    config = RoutingConfig(min_load_gap=2, max_load_ratio=0.0)
    ids = ["r0", "r1", "r2"]
    [prompt] = random_prompts(1, 6 * BLOCK, seed=6)
    first, second, third = rendezvous_order(affinity_key(prompt, BLOCK, 4), ids)
    loads = {first: 20, second: 2, third: 0}
    assert choose_replica(prompt, [idle(i, running=n) for i, n in loads.items()], config) == second
    loads[second] = 3  # now past the least load (0) + 2
    assert choose_replica(prompt, [idle(i, running=n) for i, n in loads.items()], config) == third


def test_a_replica_without_free_blocks_for_the_prompt_is_passed_over() -> None:
    config = RoutingConfig()
    [prompt] = random_prompts(1, 10 * BLOCK, seed=7)  # needs 10 blocks
    affine, other = _affine_and_other(prompt, ["r0", "r1"])
    assert choose_replica(prompt, [idle(affine, free=9), idle(other, free=100)], config) == other
    assert choose_replica(prompt, [idle(affine, free=10), idle(other, free=100)], config) == affine
    # every replica short of blocks: the affinity and the load decide as usual
    assert choose_replica(prompt, [idle(affine, free=1), idle(other, free=2)], config) == affine


def test_a_burst_between_stats_spreads_by_what_the_router_sent() -> None:
    """Stats arrive a few times a second; between them the router counts its own sends as load."""
    router = PrefixRouter(RoutingConfig(min_load_gap=4, max_load_ratio=0.5))
    router.update(idle("r0"))
    router.update(idle("r1"))
    [system] = random_prompts(1, 8 * BLOCK, seed=8)
    affine, other = _affine_and_other(system, ["r0", "r1"])
    burst = Counter(router.choose(system + [i]) for i in range(40))
    assert burst[affine] > burst[other] > 0  # mostly affine, the overflow beyond the gap spills
    assert burst[affine] - burst[other] <= 4 + 0.5 * burst[other] + 1
    router.update(idle(affine))
    router.update(idle(other))  # fresh stats: the burst has finished
    assert router.choose(system + [99]) == affine


def test_short_prompts_go_to_the_least_loaded() -> None:
    router = PrefixRouter()
    router.update(idle("r0", running=5))
    router.update(idle("r1", running=0))
    router.update(idle("r2", running=1))
    picks = [router.choose([i, i + 1, i + 2]) for i in range(9)]  # no full block: no affinity
    # the least loaded first, then ties: the loads end even (r0 5, r1 5, r2 5)
    assert picks[0] == "r1"
    assert Counter(picks) == Counter({"r1": 5, "r2": 4})


# ------------------------------------------------------------------ the workload, simulated


@dataclass(slots=True)
class PrefixCache:
    """A replica's prefix cache: full blocks keyed by the chain of token ids up to them, LRU eviction."""

    capacity_blocks: int
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def serve(self, prompt: Sequence[int]) -> int:
        """Prompt tokens found cached (leading full blocks); the prompt's full blocks are cached after."""
        hit_blocks, parent, missing = 0, 0, False
        for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
            parent = hash((parent, tuple(prompt[start:start + BLOCK])))
            if not missing and parent in self.blocks:
                hit_blocks += 1
                self.blocks.move_to_end(parent)
                continue
            missing = True
            self.blocks[parent] = None
            self.blocks.move_to_end(parent)
            while len(self.blocks) > self.capacity_blocks:
                self.blocks.popitem(last=False)
        return hit_blocks * BLOCK


NUM_SYSTEM_PROMPTS, NUM_TURNS = 8, 32
SYSTEM_LEN, TURN_LEN = 32 * BLOCK, 4 * BLOCK + 5
REPLICA_BLOCKS = 256  # each replica's cache: 6 of the 8 system prompts (32 blocks each) and the turns in flight
IN_FLIGHT = 32  # a request stays running while the next 32 arrive (the load the router sees)
STATS_EVERY = 4  # stats reach the router every 4 arrivals (in between it counts its own sends)


def workload(seed: int) -> list[list[int]]:
    """8 system prompts x 32 user turns, arriving interleaved in random order."""
    rng = random.Random(seed)
    systems = random_prompts(NUM_SYSTEM_PROMPTS, SYSTEM_LEN, seed=seed + 1000)
    requests = [system + [rng.randrange(150_000) for _ in range(TURN_LEN)]
                for system in systems for _ in range(NUM_TURNS)]
    rng.shuffle(requests)
    return requests


def hit_rate(requests: list[list[int]], caches: dict[str, PrefixCache],
             route: Callable[[int, list[int], dict[str, ReplicaLoad]], str]) -> tuple[float, Counter[str]]:
    """Cached prompt tokens / prompt tokens, routing each request with route(index, prompt, stats)."""
    in_flight: list[str] = []
    stats = {rid: idle(rid) for rid in caches}
    hits = queried = 0
    spread: Counter[str] = Counter()
    for index, prompt in enumerate(requests):
        if index % STATS_EVERY == 0:
            running = Counter(in_flight[-IN_FLIGHT:])
            stats = {rid: idle(rid, running=running[rid]) for rid in caches}
        replica = route(index, prompt, stats)
        in_flight.append(replica)
        spread[replica] += 1
        hits += caches[replica].serve(prompt)
        queried += len(prompt)
    return hits / queried, spread


def simulate(seed: int, num_replicas: int = 2) -> dict[str, float]:
    requests = workload(seed)
    ids = [f"replica-{i}" for i in range(num_replicas)]

    def fresh() -> dict[str, PrefixCache]:
        return {rid: PrefixCache(REPLICA_BLOCKS) for rid in ids}

    # One replica with the KV cache of all of them together: what routing tries to keep.
    single, _ = hit_rate(requests, {"one": PrefixCache(REPLICA_BLOCKS * num_replicas)}, lambda i, p, s: "one")
    rng = random.Random(seed)
    random_rate, _ = hit_rate(requests, fresh(), lambda i, p, s: rng.choice(ids))
    round_robin, _ = hit_rate(requests, fresh(), lambda i, p, s: ids[i % num_replicas])
    router = PrefixRouter(RoutingConfig(block_size=BLOCK, num_affinity_blocks=4))
    last_stats: dict[str, ReplicaLoad] = {}

    def cache_aware(index: int, prompt: list[int], stats: dict[str, ReplicaLoad]) -> str:
        if stats is not last_stats.get("_"):
            for load in stats.values():
                router.update(load)
            last_stats["_"] = stats  # type: ignore[assignment]
        return router.choose(prompt)

    aware, spread = hit_rate(requests, fresh(), cache_aware)
    return {"single": single, "cache_aware": aware, "round_robin": round_robin, "random": random_rate,
            "min_share": min(spread.values()) / len(requests) if len(spread) == num_replicas else 0.0}


def test_cache_aware_routing_keeps_the_hit_rate_of_one_big_cache() -> None:
    figures = simulate(seed=0)
    print("\nprefix-cache hit rate, 8 system prompts x 32 turns, 2 replicas of "
          f"{REPLICA_BLOCKS} blocks: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    check_figures(figures)


def check_figures(figures: dict[str, float]) -> None:
    assert figures["cache_aware"] >= 0.9 * figures["single"], figures
    for blind in ("random", "round_robin"):
        # far above: at least a tenth of all prompt tokens more from the cache, and at most 0.6x the misses
        assert figures["cache_aware"] >= figures[blind] + 0.1, (blind, figures)
        assert 1 - figures["cache_aware"] <= 0.6 * (1 - figures[blind]), (blind, figures)
    assert figures["min_share"] >= 0.2, figures  # both replicas work (8 prefixes split no worse than 6:2)


def test_the_result_holds_across_workload_orders() -> None:
    for seed in range(1, 6):
        check_figures(simulate(seed))
