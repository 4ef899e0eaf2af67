"""Discovery without fixed lists: how processes find each other through the registry a scheduler keeps of live
apis and engine replicas (services/scheduler/registry.py), and the address a process advertises for a socket it
bound.

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
