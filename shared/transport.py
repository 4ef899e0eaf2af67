"""Typed messages over ZeroMQ: one encoder and one decoder per socket, malformed frames logged and dropped."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from pagoda.shared.config import bind_address

log = logging.getLogger(__name__)

T = TypeVar("T")

LINGER_MS = 0  # never block process exit on undelivered messages
MAX_FRAME_BYTES = 64 << 20  # a frame larger than this is refused by ZeroMQ itself


class Codec(Generic[T]):
    """msgpack via msgspec for one union of message types; never pickle, never run code."""

    def __init__(self, union: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(union)
        self.num_dropped = 0

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes | memoryview | zmq.Frame) -> T | None:
        """The message, or None (logged) when the frame is not a valid message of this socket."""
        data = frame.buffer if isinstance(frame, zmq.Frame) else frame
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            self.num_dropped += 1
            log.warning("dropped a malformed frame (%d bytes): %s", len(data), exc)
            return None


def make_socket(context: zmq.Context | zmq.asyncio.Context, kind: int, endpoint: str, *, bind: bool,
                identity: bytes | None = None, subscribe: bool = True) -> Any:
    """A socket bound or connected to `endpoint`, with settings every pagoda socket shares."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.SNDHWM, 0)  # messages are small and must not be dropped on a burst
    sock.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises instead of vanishing
    if kind == zmq.SUB and subscribe:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if bind:
        sock.bind(bind_address(endpoint))
    else:
        sock.connect(endpoint)
    return sock


def drain(sock: zmq.Socket, handle: Callable[[list[Any]], None], max_messages: int = 0, copy: bool = True) -> int:
    """Hand every message waiting on `sock` (at most `max_messages`, 0: no limit) to `handle`, without blocking;
    how many there were."""
    count = 0
    while not max_messages or count < max_messages:
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            break
        count += 1
        handle(frames)
    return count


def send_nowait(sock: zmq.Socket, data: bytes) -> bool:
    """Send without blocking the loop; False when the socket cannot take it now (its peer is away)."""
    try:
        sock.send(data, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


def split_routed(frames: list[Any]) -> tuple[bytes, Any] | None:
    """A ROUTER receives [peer identity, payload]; anything else is a malformed message."""
    if len(frames) != 2:
        log.warning("dropped a routed message of %d frames", len(frames))
        return None
    identity = frames[0].bytes if isinstance(frames[0], zmq.Frame) else frames[0]
    return identity, frames[1]


def single_frame(frames: list[Any]) -> Any | None:
    if len(frames) != 1:
        log.warning("dropped a message of %d frames", len(frames))
        return None
    return frames[0]


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel these tasks and wait until each has ended (a receiver's loops, before its socket closes)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def receive_forever(sock: zmq.asyncio.Socket, name: str) -> AsyncIterator[list[Any]]:
    """Yield every multipart message until the socket closes; a receive error is logged, never fatal."""
    while True:
        try:
            frames = await sock.recv_multipart()
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.ENOTSOCK, zmq.ETERM):
                return
            log.error("%s socket receive failed: %s", name, exc)
            await asyncio.sleep(0.1)  # do not spin on a persistent error
            continue
        yield frames
