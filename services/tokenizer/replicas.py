"""A tokenizer's view of the engine replicas: one DEALER per scheduler, their liveness, their load (from
each scheduler's stats socket), which replica owns each request, and the routing of new requests.

Replica ids are the indices of the scheduler endpoint list (the same list order in every tokenizer and api),
or, with a registry (shared/discovery.py), the ids the replicas registered with: replicas found there are
added as they appear (add()), and `index` is then only this process's position of a replica in its list.
A replica counts as live while it is registered (it sent ModelInfo since it was last lost); the service
marks it lost when it falls silent past the heartbeat timeout, and it is live again on its next ModelInfo.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from pagoda.services.tokenizer.routing import ReplicaLoad, RoutingConfig, choose_replica, replica_load
from pagoda.shared.delivery import Link
from pagoda.shared.errors import ConfigError, ServerOverloadedError
from pagoda.shared.messages import ModelInfo, SchedulerStats, SchedulerToApi
from pagoda.shared.transport import Codec, make_socket

log = logging.getLogger(__name__)

ROUTINGS = ("prefix", "round_robin", "random")
UNKNOWN_FREE_BLOCKS = 1 << 30  # a replica without stats yet is not held back for lack of KV blocks


@dataclass(slots=True)
class Replica:
    index: int
    sock: Any  # zmq DEALER to its scheduler
    stats_sock: Any | None = None  # zmq SUB to its stats (prefix routing over several replicas only)
    heard_at: float | None = None  # None: not heard since start, or since it was lost
    lost: bool = False  # taken for dead; the next word from it gets a fresh hello
    sender: str | None = None  # its heartbeats' sender: a new one means it restarted
    model_info: ModelInfo | None = None  # set while registered
    stats: SchedulerStats | None = None
    stats_at: float | None = None  # time.monotonic() of `stats`
    routed_since_stats: int = 0
    replica_id: str = ""  # the routing's name for it, the same in every tokenizer; default: str(index)
    address: str = ""  # its scheduler's address
    link: Link[Any] = field(default_factory=lambda: Link(0.5))  # sequenced streams both ways (shared/delivery.py)

    def __post_init__(self) -> None:
        if not self.replica_id:
            self.replica_id = str(self.index)


@dataclass(slots=True)
class ReplicaSet:
    replicas: list[Replica]
    routing: str = "prefix"
    routing_config: RoutingConfig = field(default_factory=RoutingConfig)
    heartbeat_timeout: float = 5.0
    owner: dict[str, int] = field(default_factory=dict)  # request id -> replica index
    _next_round_robin: int = 0
    _rng: random.Random = field(default_factory=random.Random)
    _stats_codec: Codec[SchedulerToApi] = field(default_factory=lambda: Codec(SchedulerToApi))
    _context: Any = None  # for replicas added later (discovery)
    _identity: bytes = b""
    use_stats: bool = False  # each replica's stats are watched (prefix routing over several replicas)
    resend_s: float = 0.5  # config.resend_interval: each replica's Link

    @classmethod
    def connect(cls, context: zmq.Context, scheduler_endpoints: Sequence[str], stats_endpoints: Sequence[str],
                identity: bytes, routing: str, block_size: int, heartbeat_timeout: float,
                discover: bool = False, resend_s: float = 0.5) -> ReplicaSet:
        """Sockets to the listed replicas; with `discover`, more join later (their stats too, by add())."""
        assert routing in ROUTINGS, routing
        use_stats = routing == "prefix" and (len(scheduler_endpoints) > 1 or discover)
        if use_stats and not discover and len(stats_endpoints) != len(scheduler_endpoints):
            raise ConfigError(f"{len(scheduler_endpoints)} scheduler endpoints but {len(stats_endpoints)} stats "
                              "endpoints: prefix routing needs one of each per replica", param="stats_endpoints")
        replica_set = cls([], routing, RoutingConfig(block_size=block_size), heartbeat_timeout, _context=context,
                          _identity=identity, use_stats=use_stats, resend_s=resend_s)
        for index, endpoint in enumerate(scheduler_endpoints):
            replica_set.add(str(index), endpoint, stats_endpoints[index] if index < len(stats_endpoints) else None)
        return replica_set

    def add(self, replica_id: str, scheduler: str, stats: str | None) -> Replica:
        """A replica to send requests to (connected now; live once its ModelInfo comes)."""
        sock = make_socket(self._context, zmq.DEALER, scheduler, bind=False, identity=self._identity,
                           role="tokenizer_to_scheduler")
        replica = Replica(len(self.replicas), sock, replica_id=replica_id, address=scheduler,
                          link=Link(self.resend_s))
        self.replicas.append(replica)
        if stats is not None:
            self.watch_stats(replica, stats)
        return replica

    def watch_stats(self, replica: Replica, stats: str) -> None:
        if self.use_stats and replica.stats_sock is None:
            replica.stats_sock = make_socket(self._context, zmq.SUB, stats, bind=False)

    def find(self, replica_id: str) -> Replica | None:
        return next((r for r in self.replicas if r.replica_id == replica_id), None)

    def sockets(self) -> list[Any]:
        return [r.sock for r in self.replicas] + [r.stats_sock for r in self.replicas if r.stats_sock is not None]

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.model_info is not None and not r.lost]

    def model_info(self) -> ModelInfo | None:
        """What a live replica said about the model (every replica serves the same one)."""
        return next((r.model_info for r in self.live()), None)

    def on_stats(self, index: int, frame: Any) -> None:
        stats = self._stats_codec.decode(frame)
        if isinstance(stats, SchedulerStats):
            replica = self.replicas[index]
            replica.stats, replica.stats_at, replica.routed_since_stats = stats, time.monotonic(), 0

    def route(self, request_id: str, prompt_ids: Sequence[int], cache_salt: str = "",
              prompt_cache_key: str = "") -> Replica:
        """The replica for a new request (recorded as its owner); ServerOverloadedError if none is live. With prefix
        routing, requests of one prompt prefix and cache salt go to the same replica (load permitting), and so do
        requests of one prompt_cache_key and cache salt, whatever their prompts."""
        live = self.live()
        if not live:
            raise ServerOverloadedError("no engine replica is available; try again later", code="no_replica")
        if len(live) == 1:
            chosen = live[0]
        elif self.routing == "random":
            chosen = self._rng.choice(live)
        elif self.routing == "round_robin":
            chosen = live[self._next_round_robin % len(live)]
            self._next_round_robin += 1
        else:
            chosen = self._by_prefix(live, prompt_ids, cache_salt, prompt_cache_key)
        chosen.routed_since_stats += 1
        self.owner[request_id] = chosen.index
        return chosen

    def _by_prefix(self, live: list[Replica], prompt_ids: Sequence[int], cache_salt: str,
                   prompt_cache_key: str) -> Replica:
        now = time.monotonic()
        loads = []
        for r in live:
            age = None if r.stats_at is None else now - r.stats_at
            # Registered but no fresh stats yet (just joined): live, loaded only by what we sent it.
            fresh = age is not None and age <= self.heartbeat_timeout
            loads.append(replica_load(r.replica_id, r.stats, age, self.heartbeat_timeout) if fresh
                         else ReplicaLoad(r.replica_id, 0, 0, UNKNOWN_FREE_BLOCKS, UNKNOWN_FREE_BLOCKS))
        if not any(load.alive for load in loads):  # e.g. every worker reports not ready: registration decides
            loads = [ReplicaLoad(r.replica_id, 0, 0, UNKNOWN_FREE_BLOCKS, UNKNOWN_FREE_BLOCKS) for r in live]
        routed = {r.replica_id: r.routed_since_stats for r in live}
        chosen = choose_replica(prompt_ids, loads, self.routing_config, routed, cache_salt, prompt_cache_key)
        return next(r for r in live if r.replica_id == chosen)

    def owner_of(self, request_id: str) -> Replica | None:
        index = self.owner.get(request_id)
        return None if index is None else self.replicas[index]

    def owned_by(self, index: int) -> list[str]:
        return [request_id for request_id, owner in self.owner.items() if owner == index]

    def prune(self, in_flight: Any) -> None:
        """Forget owners of requests no longer in flight (finished, failed or aborted)."""
        for request_id in [rid for rid in self.owner if rid not in in_flight]:
            del self.owner[request_id]

    def close(self, linger_ms: int) -> None:
        for sock in self.sockets():
            sock.close(linger=linger_ms)
