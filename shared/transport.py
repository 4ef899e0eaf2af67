"""Typed messages over ZeroMQ: one encoder and one decoder per socket, malformed frames logged and dropped;
tcp:// sockets authenticated and encrypted with CURVE when the process has the cluster keys.

Trust: every process of one deployment holds the same CURVE key pair (`--cluster-key-dir`, a Secret). A socket
that binds a tcp:// endpoint is a CURVE server whose ZAP handler admits only clients presenting the cluster's
public key, which takes its secret key to do; a socket that connects is a CURVE client that checks the server
holds it too. ipc:// endpoints need no keys: they live in a private runtime directory (0700).

High-water marks (HWM messages queued per peer and direction) bound memory; what happens at the mark is the
socket type's rule: ROUTER (ROUTER_MANDATORY) and DEALER sends with NOBLOCK raise zmq.Again, which each service
treats as that peer being unreachable (the message is dropped and logged; the peer's heartbeat silence then ends
its requests), PUB drops for that subscriber (a lost plan is detected by its sequence number), PUSH with NOBLOCK
raises zmq.Again (the worker drops that result: the scheduler resends the plan).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import random
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio
import zmq.auth
import zmq.utils.z85

from pagoda.shared.config import FaultSpec, bind_address, test_faults
from pagoda.shared.delivery import Link
from pagoda.shared.errors import ConfigError
from pagoda.shared.messages import Ack, Sequenced

log = logging.getLogger(__name__)

T = TypeVar("T")

LINGER_MS = 0  # never block process exit on undelivered messages
MAX_FRAME_BYTES = 64 << 20  # a frame larger than this is refused by ZeroMQ itself
HWM = 100_000  # messages queued per peer and direction (a step sends a few per peer: minutes of backlog)
CLUSTER_KEY = "cluster"  # <key dir>/cluster.key_secret holds the pair, cluster.key the public half
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's authentication handler
ZAP_DOMAIN = b"pagoda"


@dataclass(frozen=True, slots=True)
class ClusterKeys:
    """The deployment's CURVE key pair (Z85 text, as zmq.auth writes them)."""

    public: bytes
    secret: bytes

    @classmethod
    def load(cls, key_dir: str | Path) -> ClusterKeys:
        path = Path(key_dir) / f"{CLUSTER_KEY}.key_secret"
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"cannot read the cluster key {path}: {exc} (make one with `pagoda cluster-keys "
                              f"{key_dir}`)", param="cluster_key_dir") from exc
        if not secret or len(public) != 40 or len(secret) != 40:
            raise ConfigError(f"{path} holds no CURVE secret key", param="cluster_key_dir")
        return cls(public, secret)

    @staticmethod
    def generate(key_dir: str | Path) -> Path:
        """A new pair in `key_dir` (made 0700; the secret file 0600); returns the secret file's path."""
        folder = Path(key_dir)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        public_path, secret_path = zmq.auth.create_certificates(folder, CLUSTER_KEY)
        os.chmod(secret_path, 0o600)
        return Path(secret_path)


_cluster_keys: ClusterKeys | None = None
_zap_contexts: set[int] = set()  # contexts (by their libzmq address) whose ZAP handler runs
_zap_lock = threading.Lock()
_warned_plain = False


def use_cluster_keys(keys: ClusterKeys | None) -> None:
    """This process's keys for every tcp:// socket it makes from now on (None: plain, unauthenticated)."""
    global _cluster_keys
    _cluster_keys = keys


PLAIN = "none"  # --cluster-key-dir none: plain tcp:// on purpose (benchmarks, a network that is the boundary)


def load_cluster_keys(key_dir: str | None) -> None:
    use_cluster_keys(ClusterKeys.load(key_dir) if key_dir and key_dir != PLAIN else None)


def _zap_handler(context: zmq.Context, allowed: bytes, bound: threading.Event) -> None:
    """Answer libzmq's authentication requests: a CURVE client holding the cluster key pair, or nothing."""
    sock = context.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(ZAP_ENDPOINT)
        bound.set()
        while True:
            try:
                frames = sock.recv_multipart()
            except zmq.ContextTerminated:
                return
            version, request_id, _domain, address, _identity, mechanism, *credentials = frames + [b""] * 6
            accepted = mechanism == b"CURVE" and bool(credentials) and hmac.compare_digest(credentials[0], allowed)
            if not accepted:
                log.warning("refused a %s peer at %s without the cluster key", mechanism.decode(errors="replace"),
                            address.decode(errors="replace"))
            sock.send_multipart([version, request_id, b"200" if accepted else b"400",
                                 b"OK" if accepted else b"not a cluster key", b"", b""])
    finally:
        with _zap_lock:
            _zap_contexts.discard(context.underlying)  # before the close lets term() return
        bound.set()
        sock.close(linger=0)


def _ensure_zap(context: zmq.Context | zmq.asyncio.Context, keys: ClusterKeys) -> None:
    """One ZAP handler thread per context, bound before any CURVE server socket of it listens (it ends with
    the context: its receive fails with ContextTerminated on term())."""
    with _zap_lock:
        if context.underlying in _zap_contexts:
            return
        sync = zmq.Context.shadow(context.underlying)
        bound = threading.Event()
        threading.Thread(target=_zap_handler, args=(sync, zmq.utils.z85.decode(keys.public), bound),
                         name="zap", daemon=True).start()
        bound.wait(10)
        _zap_contexts.add(context.underlying)


def _secure(context: zmq.Context | zmq.asyncio.Context, sock: Any, endpoint: str, bind: bool) -> None:
    """CURVE on a tcp:// socket when this process has the cluster keys."""
    global _warned_plain
    keys = _cluster_keys
    if not endpoint.startswith("tcp://"):
        return
    if keys is None:
        if not _warned_plain:
            _warned_plain = True
            log.warning("tcp endpoint %s without --cluster-key-dir: the control plane is not authenticated",
                        endpoint)
        return
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    if bind:
        _ensure_zap(context, keys)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)


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


def seal(codec: Codec[Any], link: Link[Any], message: msgspec.Struct, now: float) -> bytes:
    """`message` as the next frame of `link`'s stream (kept until acknowledged, for resending), carrying the ack
    this side owes the peer."""
    return seal_encoded(codec, link, codec.encode(message), now)


def seal_encoded(codec: Codec[Any], link: Link[Any], body: bytes, now: float) -> bytes:
    """seal() for a message already encoded (by `codec`)."""
    stream, seq, ack_stream, ack, receiver, gap = link.next_send()
    data = codec.encode(Sequenced(stream, seq, msgspec.Raw(body), ack_stream, ack, receiver, gap))
    link.record(seq, data, now)
    return data


def unseal(codec: Codec[T], link: Link[Any], message: Sequenced | Ack, now: float) -> list[T]:
    """The peer's messages now deliverable in order (none for an ack, a repeat or an early frame). A malformed
    body still takes its place in the stream (it is dropped there, not waited for)."""
    if isinstance(message, Ack):
        restarted = link.on_ack(message.stream, message.seq, message.receiver, message.gap, now)
    else:
        restarted = link.on_ack(message.ack_stream, message.ack, message.receiver, message.gap, now)
    if restarted:
        log.warning("the peer's receiver lost its state: %d unacknowledged message(s) go again in a fresh stream",
                    len(link.requeue))
        requeue, link.requeue = link.requeue, []
        for data in requeue:
            old = codec.decode(data)
            if isinstance(old, Sequenced):  # due at once: the next tend sends it
                seal_encoded(codec, link, bytes(old.body), now - link.resend_s)
    if isinstance(message, Ack):
        return []
    inner = codec.decode(message.body)
    if isinstance(inner, Sequenced | Ack):
        log.warning("dropped a sequenced frame nested in another")
        inner = None
    ready = link.receive(message.stream, message.seq, inner, now)
    return [item for item in ready if item is not None] if ready else []


def ack_frame(codec: Codec[Any], link: Link[Any]) -> bytes:
    return codec.encode(Ack(*link.ack()))


def _fault(sock: Any, msg_parts: Any, flags: int) -> list[tuple[list[bytes], int]]:
    """What a fault-injecting socket sends now for one message: nothing (lost, or held back until the next
    send), the message, or the message twice; then whatever an earlier send held back."""
    frames = [bytes(part.buffer if isinstance(part, zmq.Frame) else part) for part in msg_parts]
    released, sock.held = sock.held, []
    roll = sock.rng.random()
    if roll < sock.spec.drop:
        out = []
    elif roll < sock.spec.drop + sock.spec.hold:
        sock.held.append((frames, flags))  # sent after the next send: delayed past it
        out = []
    else:
        out = [(frames, flags)] * (2 if sock.rng.random() < sock.spec.dup else 1)
    return out + released


class FaultySocket(zmq.Socket):  # type: ignore[type-arg]
    """A socket that loses, repeats and reorders what it sends (PAGODA_TEST_FAULTS; tests only)."""

    spec: FaultSpec
    rng: random.Random
    held: list[tuple[list[bytes], int]]

    def send_multipart(self, msg_parts: Any, flags: int = 0, copy: bool = True, track: bool = False,
                       **kwargs: Any) -> Any:
        for parts, part_flags in _fault(self, msg_parts, flags):
            for part in parts[:-1]:
                zmq.Socket.send(self, part, part_flags | zmq.SNDMORE)
            zmq.Socket.send(self, parts[-1], part_flags)

    def send(self, data: Any, flags: int = 0, copy: bool = True, track: bool = False, **kwargs: Any) -> Any:
        return self.send_multipart([data], flags)


class AsyncFaultySocket(zmq.asyncio.Socket):
    """FaultySocket for an asyncio context (the api's): each send's future is the last frame's, or a done one."""

    spec: FaultSpec
    rng: random.Random
    held: list[tuple[list[bytes], int]]

    def send_multipart(self, msg_parts: Any, flags: int = 0, copy: bool = True, track: bool = False,
                       **kwargs: Any) -> Any:
        future: Any = None
        for parts, part_flags in _fault(self, msg_parts, flags):
            future = zmq.asyncio.Socket.send_multipart(self, parts, part_flags)
        if future is None:
            future = asyncio.get_event_loop().create_future()
            future.set_result(None)
        return future


def make_socket(context: zmq.Context | zmq.asyncio.Context, kind: int, endpoint: str, *, bind: bool,
                identity: bytes | None = None, subscribe: bool = True, hwm: int = HWM, role: str = "") -> Any:
    """A socket bound or connected to `endpoint`, with settings every pagoda socket shares. `role` names it for
    test-only fault injection (config.test_faults)."""
    spec = test_faults().get(role) if role else None
    if spec is None:
        sock = context.socket(kind)
    else:
        log.warning("fault injection on the %s socket: %s", role, spec)
        faulty = AsyncFaultySocket if isinstance(context, zmq.asyncio.Context) else FaultySocket
        sock = context.socket(kind, socket_class=faulty)
        sock.spec, sock.rng, sock.held = spec, random.Random(spec.seed), []
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.SNDHWM, hwm)  # bounded: see the module's notes for what each socket does at the mark
    sock.setsockopt(zmq.RCVHWM, hwm)
    _secure(context, sock, endpoint, bind)
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
