"""Discovery without fixed lists: the registry a scheduler keeps of live apis and engine replicas (pure logic),
and the address a process advertises for a socket it bound.

    api (xM) ----ApiJoin(address)------------> registry (the scheduler at PAGODA_REGISTRY_ENDPOINT)
    scheduler r --ReplicaJoin(addresses)-----> registry
    tokenizer (xN) <--Directory(apis, replicas)-- registry   (every heartbeat; apis get it as the join's answer)

Every join repeats each heartbeat interval; an entry not renewed within the heartbeat timeout is forgotten,
and the next Directory leaves it out. Tokenizers then connect to every listed api and replica and drop an
api that is no longer listed; apis subscribe to every listed replica's stats. Order of start does not
matter: ZeroMQ connects retry until the other side binds, and joins repeat until the registry hears them.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field

from pagoda.shared.messages import Directory, ReplicaAddress

WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


def split_tcp(endpoint: str) -> tuple[str, int] | None:
    """('host', port) of tcp://host:port (IPv6 in brackets), else None."""
    match = re.fullmatch(r"tcp://([^:/]+|\[[^\]]+\]):(\d+)", endpoint)
    return None if match is None else (match.group(1), int(match.group(2)))


def host_toward(endpoint: str) -> str | None:
    """This host's address on the interface that routes to `endpoint`: 127.0.0.1 for an ipc:// one, None while
    it cannot be found (no route yet, or a name that does not resolve yet: ask again later)."""
    parts = split_tcp(endpoint)
    if parts is None:
        return "127.0.0.1"
    try:
        family, _, _, _, address = socket.getaddrinfo(parts[0].strip("[]"), parts[1], type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # UDP: picks the route, sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return None


def advertised(endpoint: str, host: str) -> str:
    """The address peers use for a socket bound at `endpoint`: a wildcard host becomes `host`; a name or an
    address is kept (compose and Kubernetes names resolve from every peer)."""
    parts = split_tcp(endpoint)
    if parts is None or parts[0] not in WILDCARD_HOSTS:
        return endpoint
    return f"tcp://{f'[{host}]' if ':' in host else host}:{parts[1]}"


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
