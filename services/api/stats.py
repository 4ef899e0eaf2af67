"""The scheduler's latest SchedulerStats, received on a SUB socket, for /metrics and /health."""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from pagoda.shared.messages import SchedulerStats, SchedulerToApi
from pagoda.shared.transport import Codec, make_socket, receive_forever, single_frame

log = logging.getLogger(__name__)


class StatsFeed:
    """Keeps only the newest snapshot; its age is measured on this host's clock, so skew cannot fake health."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str) -> None:
        self._sock = make_socket(context, zmq.SUB, endpoint, bind=False)
        self._codec: Codec[SchedulerToApi] = Codec(SchedulerToApi)
        self.latest: SchedulerStats | None = None
        self._received_at = 0.0  # time.monotonic() of `latest`
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._recv_loop(), name="stats-recv")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close(linger=0)

    def age(self) -> float | None:
        """Seconds since the latest snapshot arrived; None before the first one."""
        return None if self.latest is None else time.monotonic() - self._received_at

    async def _recv_loop(self) -> None:
        async for frames in receive_forever(self._sock, "stats"):
            frame = single_frame(frames)
            stats = None if frame is None else self._codec.decode(frame)
            if isinstance(stats, SchedulerStats):
                self.latest = stats
                self._received_at = time.monotonic()
