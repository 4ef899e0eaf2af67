"""The tokenizer's peers: one DEALER per api and one per engine replica (ReplicaSet, which routes requests), all
polled together. With a registry (shared/discovery.py) its Directory adds apis and replicas as they appear and
drops an api it no longer lists; `apply` makes the sockets match and says what changed, the service acts on it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from pagoda.services.tokenizer.replicas import Replica, ReplicaSet
from pagoda.shared.config import ServerConfig
from pagoda.shared.delivery import Link
from pagoda.shared.errors import ConfigError
from pagoda.shared.messages import Directory, ReplicaAddress
from pagoda.shared.transport import make_socket

log = logging.getLogger(__name__)


def tokenizer_endpoints(config: ServerConfig) -> tuple[list[str], list[str]]:
    """The api addresses and every replica's scheduler address known at start. With a registry: the registry's
    scheduler only; the apis and the other replicas come in its Directory (shared/discovery.py)."""
    apis = config.api_endpoint_list()
    if config.registry_endpoint:
        return apis, [config.registry_endpoint]
    if not apis:
        raise ConfigError("no api endpoint to connect to", param="api_endpoints")
    return apis, config.replica_endpoint_list("scheduler")


def stats_endpoints(config: ServerConfig, num_replicas: int) -> list[str]:
    """Every replica's stats address, needed only to route by prefix across several replicas."""
    if config.registry_endpoint:
        return []  # from the registry's Directory
    return config.replica_endpoint_list("stats") if config.routing == "prefix" and num_replicas > 1 else []


@dataclass(slots=True)
class Changes:
    """What a Directory changed: the service says hello to what is new and gives up what is gone."""

    new_apis: list[int] = field(default_factory=list)
    gone_apis: list[tuple[int, str]] = field(default_factory=list)  # (api key, address), already closed
    moved: list[tuple[Replica, str]] = field(default_factory=list)  # (replica, its new address): the old one is lost
    new_replicas: list[Replica] = field(default_factory=list)


class Peers:
    """Sockets to the apis and replicas, a poller over them and each socket's frame handler."""

    def __init__(self, context: zmq.Context, config: ServerConfig, identity: bytes, block_size: int,
                 on_api: Callable[[int, Any], None], on_scheduler: Callable[[Any, int], None]) -> None:
        self._context = context
        self._identity = identity
        self._on_api = on_api
        self._on_scheduler = on_scheduler
        self.poller = zmq.Poller()
        self.handlers: dict[Any, Callable[[Any], None]] = {}  # socket -> what takes its frames
        api_endpoints, scheduler_endpoints = tokenizer_endpoints(config)
        self.replicas = ReplicaSet.connect(context, scheduler_endpoints,
                                           stats_endpoints(config, len(scheduler_endpoints)), identity,
                                           config.routing, block_size, config.heartbeat_timeout,
                                           discover=bool(config.registry_endpoint),
                                           resend_s=config.resend_interval)
        for replica in self.replicas.replicas:
            self._watch_replica(replica)
        self.apis: dict[int, Any] = {}  # api key -> its socket; keys never reuse (apis come and go)
        self.api_links: dict[int, Link[Any]] = {}  # api key -> the sequenced streams with it (shared/delivery.py)
        self._resend_s = config.resend_interval
        self.api_address: dict[int, str] = {}
        self._next_api = 0
        for endpoint in api_endpoints:
            self.add_api(endpoint)
        self.fixed_apis = frozenset(self.apis)  # given in the settings: never forgotten

    def watch(self, sock: Any, handler: Callable[[Any], None]) -> None:
        self.handlers[sock] = handler
        self.poller.register(sock, zmq.POLLIN)

    def add_api(self, address: str) -> int:
        api, self._next_api = self._next_api, self._next_api + 1
        sock = make_socket(self._context, zmq.DEALER, address, bind=False, identity=self._identity,
                           role="tokenizer_to_api")
        self.apis[api], self.api_address[api] = sock, address
        self.api_links[api] = Link(self._resend_s)
        self.watch(sock, lambda frame, index=api: self._on_api(index, frame))
        return api

    def remove_api(self, api: int) -> str:
        sock, address = self.apis.pop(api), self.api_address.pop(api)
        del self.api_links[api]
        self.poller.unregister(sock)
        del self.handlers[sock]
        sock.close(linger=0)
        return address

    def retire(self, replica: Replica) -> None:
        """A replica that moved: its sockets to the old address are closed (else each move kept two sockets
        reconnecting forever and a DEALER queueing every heartbeat). Its entry stays, lost, as indices name
        replicas; the service's sends to it are dropped (`_send` skips a closed socket)."""
        for sock in (replica.sock, replica.stats_sock):
            if sock is not None and sock in self.handlers:
                self.poller.unregister(sock)
                del self.handlers[sock]
            if sock is not None:
                sock.close(linger=0)

    def apply(self, directory: Directory, index: int) -> Changes:
        """The registry's live apis and replicas (it is replica `index`): connect to new ones, drop apis gone."""
        changes = Changes()
        registry = self.replicas.replicas[index]
        registry.replica_id = str(directory.registry_replica_id)
        for entry in directory.replicas:
            self._apply_replica(entry, registry, changes)
        listed = set(directory.apis)
        for address in sorted(listed - set(self.api_address.values())):
            changes.new_apis.append(self.add_api(address))
            log.info("api %s found", address)
        for api, address in list(self.api_address.items()):
            if address not in listed and api not in self.fixed_apis:
                changes.gone_apis.append((api, self.remove_api(api)))
        return changes

    def _apply_replica(self, entry: ReplicaAddress, registry: Replica, changes: Changes) -> None:
        replica_id = str(entry.replica_id)
        if replica_id == registry.replica_id:
            self._watch_stats(registry, entry.stats)
            return
        known = self.replicas.find(replica_id)
        if known is not None and known.address == entry.scheduler:
            return  # a restart at the same address: its new heartbeats' sender makes us register again
        if known is not None:  # it moved: whatever it held is lost, the old address is dropped
            changes.moved.append((known, entry.scheduler))
            known.replica_id = f"{replica_id}@{known.address}"  # out of routing's way; stays lost
        replica = self.replicas.add(replica_id, entry.scheduler, None)
        log.info("replica %s found at %s", replica_id, entry.scheduler)
        self._watch_replica(replica)
        self._watch_stats(replica, entry.stats)
        changes.new_replicas.append(replica)

    def _watch_replica(self, replica: Replica) -> None:
        self.watch(replica.sock, lambda frame, i=replica.index: self._on_scheduler(frame, i))
        if replica.stats_sock is not None:
            self.watch(replica.stats_sock, lambda frame, i=replica.index: self.replicas.on_stats(i, frame))

    def _watch_stats(self, replica: Replica, stats: str) -> None:
        if replica.stats_sock is not None or not self.replicas.use_stats:
            return
        self.replicas.watch_stats(replica, stats)
        self.watch(replica.stats_sock, lambda frame, i=replica.index: self.replicas.on_stats(i, frame))

    def close(self, linger_ms: int) -> None:
        for sock in self.handlers:  # the replicas' sockets are among them
            sock.close(linger=linger_ms)
