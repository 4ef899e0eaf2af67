"""The discovery registry a scheduler keeps (shared/discovery.py has the flow): the live apis and engine replicas it
heard join, the Directory it sends the tokenizers, and its own join to another replica's registry."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq

from pagoda.shared.config import ServerConfig
from pagoda.shared.discovery import advertised, host_toward
from pagoda.shared.messages import ApiJoin, Directory, ReplicaAddress, ReplicaJoin, TokenizerToScheduler
from pagoda.shared.transport import Codec, make_socket, send_nowait

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Registry:
    """The live apis and replicas one scheduler knows (times are time.monotonic())."""

    own: ReplicaAddress  # the registry's own replica, always listed
    timeout: float  # an entry not renewed for this long is forgotten
    apis: dict[str, float] = field(default_factory=dict)  # address -> last join
    replicas: dict[int, tuple[ReplicaAddress, float]] = field(default_factory=dict)  # replica id -> (entry, last join)
    used: bool = False  # anything ever joined: only then does the scheduler send directories

    def join_api(self, address: str, now: float) -> None:
        self.apis[address] = now
        self.used = True

    def join_replica(self, entry: ReplicaAddress, now: float) -> bool:
        """Record a replica's join; False (ignored) for one claiming the registry's own replica id."""
        if entry.replica_id == self.own.replica_id:
            return False
        self.replicas[entry.replica_id] = (entry, now)  # a restart (new instance, maybe new address) replaces
        self.used = True
        return True

    def sweep(self, now: float) -> list[str]:
        """Forget entries silent past the timeout; what was forgotten, for the log."""
        gone = [a for a, seen in self.apis.items() if now - seen > self.timeout]
        for address in gone:
            del self.apis[address]
        lost = [r for r, (_, seen) in self.replicas.items() if now - seen > self.timeout]
        for replica_id in lost:
            del self.replicas[replica_id]
        return [f"api {a}" for a in gone] + [f"replica {r}" for r in lost]

    def directory(self) -> Directory:
        entries = [self.own] + [entry for _, (entry, _) in sorted(self.replicas.items())]
        return Directory(apis=sorted(self.apis), replicas=entries, registry_replica_id=self.own.replica_id)


class RegistryHost:
    """This scheduler's registry (used once an api or replica joins it); with a registry endpoint other than its
    own address, it also joins that one as a replica, every heartbeat."""

    def __init__(self, context: zmq.Context, config: ServerConfig, instance_id: str) -> None:
        own = config.endpoint("scheduler")
        host = config.advertise_host or host_toward(config.registry_endpoint or own) or "127.0.0.1"
        entry = ReplicaAddress(config.replica_id, advertised(own, host), advertised(config.endpoint("stats"), host),
                               instance_id)
        self.registry = Registry(entry, config.heartbeat_timeout)
        joins = config.registry_endpoint is not None and config.registry_endpoint != own
        self.sock = make_socket(context, zmq.DEALER, config.registry_endpoint, bind=False) if joins else None
        self._codec: Codec[TokenizerToScheduler] = Codec(TokenizerToScheduler)

    def on_join(self, message: ApiJoin | ReplicaJoin, now: float) -> Directory | None:
        """Record a join; an api's join is answered with the Directory (the replicas whose stats it watches)."""
        registry = self.registry
        if isinstance(message, ApiJoin):
            if message.address not in registry.apis:
                log.info("registry: api %s joined", message.address)
            registry.join_api(message.address, now)
            return registry.directory()
        known = registry.replicas.get(message.replica.replica_id)
        if not registry.join_replica(message.replica, now):
            log.warning("registry: ignored a join claiming this scheduler's replica id %d", message.replica.replica_id)
        elif known is None or known[0] != message.replica:
            log.info("registry: replica %d joined at %s", message.replica.replica_id, message.replica.scheduler)
        return None

    def tick(self, now: float) -> Directory | None:
        """Join the registry (another replica's scheduler), forget the silent; the Directory for the tokenizers once
        anything joined here."""
        if self.sock is not None and not send_nowait(self.sock, self._codec.encode(ReplicaJoin(self.registry.own))):
            log.debug("registry unreachable: the join waits for the next beat")
        for gone in self.registry.sweep(now):
            log.warning("registry: %s is silent: forgotten", gone)
        return self.registry.directory() if self.registry.used else None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
