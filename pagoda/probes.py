"""Health probes from outside the processes: the scheduler's latest stats snapshot, which the container health check
(docker/healthcheck.py), the Kubernetes liveness probe (deploy/kubernetes/base/liveness.py) and tests all read."""

from __future__ import annotations

import zmq

from pagoda.shared.messages import SchedulerStats, SchedulerToApi
from pagoda.shared.transport import Codec, load_cluster_keys, make_socket

TIMEOUT_S = 3.0


def latest_stats(endpoint: str, timeout_s: float = TIMEOUT_S, key_dir: str | None = None) -> SchedulerStats | None:
    """The first SchedulerStats published on the scheduler's stats socket (it sends one every 0.25 s), or None when
    none arrives within `timeout_s` (the scheduler is down, hung, or elsewhere). `key_dir`: the deployment's CURVE
    key pair (PAGODA_CLUSTER_KEY_DIR) for a tcp:// endpoint; None keeps this process's keys as they are."""
    if key_dir:
        load_cluster_keys(key_dir)
    codec: Codec[SchedulerToApi] = Codec(SchedulerToApi)
    context = zmq.Context()
    try:
        sock = make_socket(context, zmq.SUB, endpoint, bind=False)
        while sock.poll(int(timeout_s * 1000)):
            message = codec.decode(sock.recv())
            if isinstance(message, SchedulerStats):
                return message
        return None
    finally:
        context.destroy(linger=0)
