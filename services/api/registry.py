"""An api's membership in the registry (shared/discovery.py): it joins every heartbeat interval with the address
tokenizers reach it at, and watches the stats of every replica the answer lists."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from pagoda.services.api.stats import ReplicaStatsFeed
from pagoda.shared.messages import ApiJoin, Directory, SchedulerToTokenizer, TokenizerToScheduler
from pagoda.shared.transport import Codec, cancel_all, make_socket, receive_forever, single_frame

log = logging.getLogger(__name__)


class RegistryClient:
    def __init__(self, context: zmq.asyncio.Context, registry_endpoint: str, address: Callable[[], str | None],
                 stats: ReplicaStatsFeed, interval: float) -> None:
        self._sock = make_socket(context, zmq.DEALER, registry_endpoint, bind=False)
        self._registry = registry_endpoint
        self._address = address  # where tokenizers reach this api; None until the route to the registry is known
        self._join: bytes | None = None
        self._decoder: Codec[SchedulerToTokenizer] = Codec(SchedulerToTokenizer)
        self._stats = stats
        self._interval = interval
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._join_loop(), name="registry-join"),
                       asyncio.create_task(self._recv_loop(), name="registry-recv")]

    async def close(self) -> None:
        await cancel_all(self._tasks)
        self._sock.close(linger=0)

    async def _join_loop(self) -> None:
        while True:
            if self._join is None and (address := self._address()) is not None:
                self._join = Codec(TokenizerToScheduler).encode(ApiJoin(address))
                log.info("api joins the registry at %s as %s", self._registry, address)
            if self._join is not None:
                try:
                    await self._sock.send(self._join)
                except zmq.ZMQError as exc:
                    log.debug("registry join not sent: %s", exc)
            await asyncio.sleep(self._interval)

    async def _recv_loop(self) -> None:
        async for frames in receive_forever(self._sock, "registry"):
            frame = single_frame(frames)
            message = None if frame is None else self._decoder.decode(frame)
            if isinstance(message, Directory):
                self._stats.watch({str(r.replica_id): r.stats for r in message.replicas})
