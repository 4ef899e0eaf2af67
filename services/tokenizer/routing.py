"""Which engine replica serves a request: prefix-cache affinity weighed against load (pure logic, no I/O).

A prompt's affinity key is a stable hash (blake2b) of the token ids of its first K full blocks, and of its
cache_salt if it has one (only requests with the same salt share cached blocks), so two tokenizer processes that
see the same system prompt compute the same key. A request with a prompt_cache_key (OpenAI's) is keyed by that
instead, with its salt: the client names which requests belong together (a conversation, a user), and they share
a replica whatever their first blocks are, also when the prompt fills no block. Each live replica gets a weight
hash(key, replica id) and the replicas are ranked by it (rendezvous, or highest-random-weight, hashing): a
replica that dies takes only its own keys' first choice with it, and gets exactly those back when it returns.
The request goes to the first replica in that ranking that is not overloaded, i.e. whose load is within a
threshold of the least-loaded live replica's; the least-loaded one always is, so a choice always exists.
Spilling in ranking order (rather than straight to the least loaded) keeps a hot prefix on a consistent
second replica, which then caches it too.

    load(replica) = waiting + running requests (its latest stats) + requests routed to it since those stats
    overloaded    = load - least load > max(min_load_gap, max_load_ratio * least load), or too few free KV
                    blocks for this prompt while another replica has them

Prompts shorter than one block (and without a prompt_cache_key) have no prefix worth keeping together: they go to
the least-loaded replica (ties broken by the same hashing, so a burst of short prompts does not pile onto one
replica).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagoda.shared.errors import ServerOverloadedError
from pagoda.shared.messages import SchedulerStats, cache_salt_bytes


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's latest stats, as its scheduler publishes them."""

    replica_id: str
    num_waiting: int
    num_running: int
    kv_blocks_free: int
    kv_blocks_total: int
    alive: bool = True


def replica_load(replica_id: str, stats: SchedulerStats | None, age_s: float | None,
                 heartbeat_timeout: float) -> ReplicaLoad:
    """A replica's load from its latest stats and their age (seconds, on the receiver's clock): alive while
    the stats are fresh and say the worker is ready and alive."""
    if stats is None or age_s is None:
        return ReplicaLoad(replica_id, 0, 0, 0, 0, alive=False)
    alive = age_s <= heartbeat_timeout and stats.worker_ready and stats.worker_alive
    return ReplicaLoad(replica_id, num_waiting=stats.num_waiting, num_running=stats.num_running,
                       kv_blocks_free=stats.kv_blocks_free, kv_blocks_total=stats.kv_blocks_total, alive=alive)


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    block_size: int = 16  # tokens per KV block (the engine's block_size)
    num_affinity_blocks: int = 4  # K: full blocks of the prompt's start that make its affinity key
    # The affine replica is overloaded past least load + max(min_load_gap, max_load_ratio x least load): a
    # few dozen requests of imbalance cost less than recomputing a long shared prefix elsewhere (SGLang's
    # router tolerates an absolute imbalance of 32 by default, too).
    min_load_gap: int = 32
    max_load_ratio: float = 0.5

    def __post_init__(self) -> None:
        assert self.block_size >= 1 and self.num_affinity_blocks >= 1
        assert self.min_load_gap >= 0 and self.max_load_ratio >= 0.0


def affinity_key(prompt_ids: Sequence[int], block_size: int, num_blocks: int, cache_salt: str = "",
                 prompt_cache_key: str = "") -> bytes | None:
    """blake2b of the first `num_blocks` full blocks' token ids (fewer if the prompt is shorter), salted by the
    request's cache_salt (the same blocks under another salt are other cache entries); None when the prompt fills
    no block. With a prompt_cache_key: blake2b of (cache_salt, prompt_cache_key), whatever the prompt. Independent
    of the process and of PYTHONHASHSEED."""
    if prompt_cache_key:
        return client_key(cache_salt, prompt_cache_key)
    num_tokens = min(len(prompt_ids) // block_size, num_blocks) * block_size
    if num_tokens == 0:
        return None
    packed = struct.pack(f"<{num_tokens}I", *prompt_ids[:num_tokens])
    if not cache_salt:
        return hashlib.blake2b(packed, digest_size=16).digest()
    salt = cache_salt_bytes(cache_salt)
    salted = struct.pack("<I", len(salt)) + salt + packed
    return hashlib.blake2b(salted, digest_size=16, person=b"pagoda-salt").digest()


def client_key(cache_salt: str, prompt_cache_key: str) -> bytes:
    """The affinity key of a request with a prompt_cache_key: a personalization of its own, so that it is no
    prefix's key, and the salt length-prefixed, so that ("ab", "c") and ("a", "bc") differ."""
    salt = cache_salt_bytes(cache_salt)
    packed = struct.pack("<I", len(salt)) + salt + cache_salt_bytes(prompt_cache_key)
    return hashlib.blake2b(packed, digest_size=16, person=b"pagoda-cachekey").digest()


def rendezvous_order(key: bytes, replica_ids: Iterable[str]) -> list[str]:
    """Replica ids from the highest weight hash(key, id) down: the same for every process and every order of
    the ids; removing an id leaves the others' relative order unchanged."""

    def weight(replica_id: str) -> bytes:
        return hashlib.blake2b(key + b"\x00" + replica_id.encode(), digest_size=8).digest()

    return sorted(replica_ids, key=lambda replica_id: (weight(replica_id), replica_id), reverse=True)


def overload_limit(least_load: int, config: RoutingConfig) -> float:
    """The largest load that still counts as not overloaded, next to a least-loaded replica's load."""
    return least_load + max(config.min_load_gap, config.max_load_ratio * least_load)


def choose_replica(prompt_ids: Sequence[int], loads: Sequence[ReplicaLoad], config: RoutingConfig,
                   routed_since_stats: dict[str, int] | None = None, cache_salt: str = "",
                   prompt_cache_key: str = "") -> str:
    """The replica for this prompt, cache salt and prompt_cache_key (see the module docstring). Raises
    ServerOverloadedError if none is alive."""
    routed = routed_since_stats or {}
    live = {r.replica_id: r for r in loads if r.alive}
    if not live:
        raise ServerOverloadedError("no engine replica is alive", code="no_replica")
    load = {rid: r.num_waiting + r.num_running + routed.get(rid, 0) for rid, r in live.items()}
    blocks_needed = math.ceil(len(prompt_ids) / config.block_size)
    roomy = {rid for rid, r in live.items() if r.kv_blocks_free >= blocks_needed}
    eligible = roomy or set(live)  # all short of blocks: the load alone decides
    least_load = min(load[rid] for rid in eligible)
    limit = overload_limit(least_load, config)
    key = affinity_key(prompt_ids, config.block_size, config.num_affinity_blocks, cache_salt, prompt_cache_key)
    if key is None:  # no full block: least loaded, ties broken by hashing the whole (short) prompt
        key = hashlib.blake2b(struct.pack(f"<{len(prompt_ids)}I", *prompt_ids), digest_size=16).digest()
        limit = least_load
    for rid in rendezvous_order(key, live):
        if rid in eligible and load[rid] <= limit:
            return rid
    raise AssertionError("the least-loaded eligible replica is always within the limit")


@dataclass(slots=True)
class PrefixRouter:
    """One tokenizer process's router: the replicas' latest stats plus what it sent since they arrived."""

    config: RoutingConfig = field(default_factory=RoutingConfig)
    loads: dict[str, ReplicaLoad] = field(default_factory=dict)
    routed_since_stats: dict[str, int] = field(default_factory=dict)

    def update(self, load: ReplicaLoad) -> None:
        """A replica's new stats (or a change of liveness); they count what it received up to now."""
        self.loads[load.replica_id] = load
        self.routed_since_stats.pop(load.replica_id, None)

    def remove(self, replica_id: str) -> None:
        self.loads.pop(replica_id, None)
        self.routed_since_stats.pop(replica_id, None)

    def choose(self, prompt_ids: Sequence[int], cache_salt: str = "", prompt_cache_key: str = "") -> str:
        replica_id = choose_replica(prompt_ids, list(self.loads.values()), self.config, self.routed_since_stats,
                                    cache_salt, prompt_cache_key)
        self.routed_since_stats[replica_id] = self.routed_since_stats.get(replica_id, 0) + 1
        return replica_id
