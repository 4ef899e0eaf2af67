"""Health probes from outside the processes: the scheduler's latest stats snapshot, which the container health check
(docker/healthcheck.py), the Kubernetes liveness probe (deploy/kubernetes/base/liveness.py) and tests all read."""

from __future__ import annotations

import zmq

from pagoda.shared.messages import SchedulerStats, SchedulerToApi
from pagoda.shared.transport import Codec, make_socket

TIMEOUT_S = 3.0


def latest_stats(endpoint: str, timeout_s: float = TIMEOUT_S) -> SchedulerStats | None:
    """The first SchedulerStats published on the scheduler's stats socket (it sends one every 0.25 s), or None when
    none arrives within `timeout_s` (the scheduler is down, hung, or elsewhere)."""
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
