"""Kubernetes liveness of a worker or a tokenizer, as its scheduler sees it: exit 0 alive, 1 hung.

Neither process listens on anything a probe could ask, but both heart-beat to their scheduler, which says in
its stats (PAGODA_STATS_ENDPOINT) whether the worker is alive and which tokenizers it still hears from.
  worker     hung when the scheduler had it ready and now reports it not alive (silent past the heartbeat
             timeout, or a step running past the step timeout)
  tokenizer  hung when no tokenizer id the scheduler lists starts with this pod's host name + "-"
When no stats arrive the scheduler itself is down or hung: its own probe restarts it, and this one passes, so
that a scheduler failure does not also restart (and reload) the processes that depend on it.
Mounted from a ConfigMap; runs with the image's python and pagoda's own stats probe (pagoda/probes.py).
"""

from __future__ import annotations

import os
import socket
import sys

from pagoda.probes import latest_stats

TIMEOUT_S = 3.0


def is_alive(service: str, stats: object | None, hostname: str) -> bool:
    """The verdict from the latest SchedulerStats (None: none arrived)."""
    if stats is None:
        return True
    if service == "worker":
        return not (stats.worker_ready and not stats.worker_alive)
    if service == "tokenizer":
        return any(tokenizer_id.startswith(hostname + "-") for tokenizer_id in stats.tokenizer_ids)
    raise ValueError(f"unknown service {service!r} (worker or tokenizer)")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: liveness.py worker|tokenizer", file=sys.stderr)
        return 2
    endpoint = os.environ.get("PAGODA_STATS_ENDPOINT", "")
    stats = latest_stats(endpoint, TIMEOUT_S, os.environ.get("PAGODA_CLUSTER_KEY_DIR")) if endpoint else None
    if is_alive(argv[1], stats, socket.gethostname()):
        return 0
    print(f"unhealthy: the scheduler at {endpoint} does not hear this {argv[1]}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
