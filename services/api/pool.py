"""The tokenizer processes behind this api: a ZeroMQ ROUTER, their liveness, and replies routed to requests."""

#   tokenizer A --DEALER--.                       .--> Ticket(queue) --> HTTP handler
#   tokenizer B --DEALER--+--> ROUTER (this pool) +--> Ticket(queue) --> HTTP handler
#                         '<-- [identity, ApiToTokenizer] <-- submit / finish (abort)
#
# Invariants: every id in `_tickets` belongs to a ticket in `_open`; a ticket's ids are in its owner's
# `request_ids` while the owner is live; a closed ticket has nothing left to abort.

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from pagoda.shared.config import ServerConfig
from pagoda.shared.delivery import Link
from pagoda.shared.errors import InvalidRequestError, ServerOverloadedError
from pagoda.shared.messages import (
    AbortRequest,
    Accepted,
    Ack,
    ApiToTokenizer,
    DetokenizeResult,
    Heartbeat,
    PromptRendered,
    RenderedRows,
    RequestFailed,
    Sequenced,
    TextDelta,
    TextDeltas,
    TokenizeResult,
    TokenizerHello,
    TokenizerInfoResult,
    TokenizerToApi,
)
from pagoda.shared.transport import (
    Codec,
    ack_frame,
    cancel_all,
    make_socket,
    receive_forever,
    seal_encoded,
    split_routed,
    unseal,
)

log = logging.getLogger(__name__)

LINK_TICK_S = 0.02  # how often the streams are tended while something is unacknowledged (else IDLE_LINK_TICK_S)
IDLE_LINK_TICK_S = 0.1


@dataclass(slots=True)
class Rows:
    """One request's share of a RenderedRows frame: (request id, index, new tokens, finish, cached, bytes) rows."""

    rows: list[tuple[str, int, int, int, int, bytes]]


# What a handler finds in its queue: one reply, or this request's share of a TextDeltas or RenderedRows batch.
Reply = (Accepted | RequestFailed | TokenizeResult | DetokenizeResult | TokenizerInfoResult | PromptRendered
         | list[TextDelta] | Rows)


@dataclass(slots=True, eq=False)
class Ticket:
    """One HTTP request in flight: its wire request ids, the tokenizer that owns them, its reply queue."""

    request_ids: list[str]
    identity: bytes
    queue: asyncio.Queue[Reply] = field(default_factory=asyncio.Queue)
    closed: bool = False  # the pool ended it (owner lost, shutdown): the tokenizer has nothing to abort


@dataclass(slots=True)
class Peer:
    identity: bytes
    pid: int
    last_seen: float  # time.monotonic() of its latest message
    link: Link[TokenizerToApi]  # the sequenced streams both ways (shared/delivery.py)
    request_ids: set[str] = field(default_factory=set)


class TokenizerPool:
    """Registry of live tokenizers and of the requests each owns."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str, config: ServerConfig) -> None:
        self._config = config
        self._sock = make_socket(context, zmq.ROUTER, endpoint, bind=True, role="api_to_tokenizer")
        self._decoder: Codec[TokenizerToApi] = Codec(TokenizerToApi)
        self._encoder: Codec[ApiToTokenizer] = Codec(ApiToTokenizer)
        self._peers: dict[bytes, Peer] = {}
        self._tickets: dict[str, Ticket] = {}  # wire request id -> its ticket
        self._open: set[Ticket] = set()
        self._num_picks = 0  # round robin among equally loaded tokenizers
        self._accepting = True
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: list[asyncio.Task[None]] = []
        # The model's generation-config sampling defaults, as the tokenizers (which read the model folder) announce
        # them in every hello: a request can only reach a tokenizer once its hello registered it, so a request is
        # never built without them.
        self.sampling_defaults: dict[str, float | int] = {}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._recv_loop(), name="tokenizer-recv"),
                       asyncio.create_task(self._reap_loop(), name="tokenizer-reap"),
                       asyncio.create_task(self._link_loop(), name="tokenizer-links")]

    async def close(self) -> None:
        await cancel_all(self._tasks)
        self._sock.close(linger=0)

    @property
    def endpoint(self) -> str:
        """The address this pool's socket is bound at (a wildcard port resolved)."""
        return str(self._sock.getsockopt(zmq.LAST_ENDPOINT).decode())

    @property
    def num_live(self) -> int:
        return len(self._peers)

    @property
    def num_open(self) -> int:
        return len(self._open)

    def peers(self) -> list[tuple[str, int, float]]:
        """(identity, pid, time.monotonic() of its latest message) of each live tokenizer (the console)."""
        return [(p.identity.decode(errors="replace"), p.pid, p.last_seen) for p in self._peers.values()]

    def stop_accepting(self) -> None:
        self._accepting = False

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is open, False if `timeout` seconds pass first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    # ------------------------------------------------------------------ requests

    def num_registered(self, engine_ids: Collection[str]) -> int:
        """Live tokenizers that the scheduler lists as registered (`engine_ids`, from its stats): those hold the
        model's ModelInfo, or have it on the way; another one may not reach the scheduler yet (or any more)."""
        return sum(_name(identity) in engine_ids for identity in self._peers)

    def submit(self, messages: Sequence[ApiToTokenizer], engine_ids: Collection[str] = ()) -> Ticket:
        """Send one HTTP request's messages to the least loaded live tokenizer, one the scheduler lists as
        registered (`engine_ids`) if any is: another would keep the request waiting for the scheduler, and fail
        it if the scheduler never answers it. The replies go to the ticket."""
        if not self._accepting:
            raise ServerOverloadedError("the server is shutting down")
        if len(self._open) >= self._config.max_inflight_requests:
            raise ServerOverloadedError(
                f"too many requests in flight (at most {self._config.max_inflight_requests} per api process)")
        request_ids = [m.request_id for m in messages]
        bodies = [self._encode(m) for m in messages]
        while True:
            peer = self._pick(engine_ids)
            now = time.monotonic()
            if all(self._send_data(peer.identity, seal_encoded(self._encoder, peer.link, body, now), type(m).__name__)
                   for m, body in zip(messages, bodies, strict=True)):
                break
            self._drop(peer, "unreachable")  # it vanished since its last message: try the next one
        ticket = Ticket(request_ids, peer.identity)
        for request_id in request_ids:
            assert request_id not in self._tickets, request_id
            self._tickets[request_id] = ticket
        peer.request_ids.update(request_ids)
        self._open.add(ticket)
        self._idle.clear()
        return ticket

    def finish(self, ticket: Ticket, unfinished_ids: Sequence[str]) -> None:
        """Forget the ticket; the tokenizer aborts the ids that still run (the client left or gave up)."""
        if not ticket.closed:
            for request_id in unfinished_ids:
                self._send(ticket.identity, AbortRequest(request_id))
        ticket.closed = True
        self._forget(ticket)

    def fail_all(self, status: int, message: str) -> None:
        """End every open request with an error (shutdown), telling each tokenizer to abort its part."""
        for ticket in list(self._open):
            if not ticket.closed:
                for request_id in ticket.request_ids:
                    self._send(ticket.identity, AbortRequest(request_id))
                self._fail(ticket, status, message)

    def _forget(self, ticket: Ticket) -> None:
        peer = self._peers.get(ticket.identity)
        for request_id in ticket.request_ids:
            if self._tickets.get(request_id) is ticket:
                del self._tickets[request_id]
            if peer is not None:
                peer.request_ids.discard(request_id)
        self._open.discard(ticket)
        if not self._open:
            self._idle.set()

    def _fail(self, ticket: Ticket, status: int, message: str) -> None:
        ticket.closed = True
        # Ids dropped now so that late replies from a tokenizer that comes back are ignored.
        for request_id in ticket.request_ids:
            if self._tickets.get(request_id) is ticket:
                del self._tickets[request_id]
        ticket.queue.put_nowait(RequestFailed(ticket.request_ids[0], status, message, error_type="server_error"))

    def _pick(self, engine_ids: Collection[str]) -> Peer:
        if not self._peers:
            raise ServerOverloadedError("no tokenizer process is available")
        peers = [p for p in self._peers.values() if _name(p.identity) in engine_ids] or list(self._peers.values())
        least = min(len(p.request_ids) for p in peers)
        candidates = [p for p in peers if len(p.request_ids) == least]
        self._num_picks += 1
        return candidates[self._num_picks % len(candidates)]

    def _encode(self, message: ApiToTokenizer) -> bytes:
        """The wire bytes; a value the wire cannot carry (an int beyond 64 bits the checks missed) is a 400."""
        try:
            return self._encoder.encode(message)
        except (OverflowError, ValueError, TypeError, msgspec.EncodeError) as exc:
            raise InvalidRequestError(f"the request holds a value out of range: {exc}") from None

    def _send(self, identity: bytes, message: ApiToTokenizer) -> bool:
        """Send without awaiting (safe in a cancelled handler's cleanup); False if the peer is unreachable. To a
        registered tokenizer in its sequenced stream; to one dropped, plain (it may only have been slow)."""
        peer = self._peers.get(identity)
        body = self._encoder.encode(message)
        data = seal_encoded(self._encoder, peer.link, body, time.monotonic()) if peer is not None else body
        return self._send_data(identity, data, type(message).__name__)

    def _send_data(self, identity: bytes, data: bytes, what: str) -> bool:
        try:
            future = self._sock.send_multipart([identity, data])
        except zmq.ZMQError as exc:  # the socket itself is closed (shutdown)
            log.warning("cannot send %s to tokenizer %r: %s", what, identity, exc)
            return False
        # With no high-water mark the send completes at once unless another one is queued before it.
        if not future.done():
            future.add_done_callback(_log_send_error)
            return True
        exc = future.exception()
        if exc is None:
            return True
        log.warning("cannot send %s to tokenizer %r: %s", what, identity, exc)
        return False

    # ------------------------------------------------------------------ inbound

    async def _recv_loop(self) -> None:
        async for frames in receive_forever(self._sock, "tokenizer"):
            routed = split_routed(frames)
            message = None if routed is None else self._decoder.decode(routed[1])
            if routed is None or message is None:
                continue  # malformed: already logged by split_routed / Codec
            try:
                self._dispatch(routed[0], message)
            except Exception:  # one bad message must not stop every request's replies
                log.exception("failed to handle %s from tokenizer %r", type(message).__name__, routed[0])

    def _dispatch(self, identity: bytes, message: TokenizerToApi) -> None:
        peer = self._peers.get(identity)
        if isinstance(message, TokenizerHello):
            if peer is not None and peer.pid != message.pid:
                self._drop(peer, f"restarted as pid {message.pid}")
                peer = None
            if peer is None:
                log.info("tokenizer %r (pid %d) joined", identity, message.pid)
            if message.sampling_defaults != self.sampling_defaults:
                log.info("default sampling params from the model's generation config: %s (a request's own values "
                         "win; --generation-config vllm ignores the file)", message.sampling_defaults)
                self.sampling_defaults = message.sampling_defaults
        elif peer is None:
            # Registration takes a hello (tokenizers send one every few heartbeats, so an api that restarted,
            # or dropped a tokenizer that was only slow, takes it back within seconds): a stray peer's
            # heartbeat does not make it a tokenizer that requests are sent to.
            log.debug("ignored a %s from unregistered peer %r", type(message).__name__, identity[:64])
            return
        if peer is None:
            assert isinstance(message, TokenizerHello)
            peer = self._peers[identity] = Peer(identity, message.pid, time.monotonic(),
                                                Link(self._config.resend_interval))
            # Our stream to it begins now, not at our first request: a tokenizer still running the requests of a
            # process that held this address before (killed, its clients gone) sees a new stream and aborts them.
            self._send(identity, Heartbeat(f"api {os.getpid()}"))
        now = peer.last_seen = time.monotonic()
        if isinstance(message, Sequenced | Ack):
            for inner in unseal(self._decoder, peer.link, message, now):
                self._route(identity, inner)
        else:
            self._route(identity, message)

    def _route(self, identity: bytes, message: TokenizerToApi) -> None:
        if isinstance(message, (TokenizerHello, Heartbeat)):
            return
        if isinstance(message, RenderedRows):
            self._route_rows(identity, message)
            return
        if isinstance(message, TextDeltas):
            self._route_deltas(identity, message.deltas)
            return
        ticket = self._tickets.get(message.request_id)
        if ticket is not None and ticket.identity == identity:
            ticket.queue.put_nowait(message)

    def _route_deltas(self, identity: bytes, deltas: list[TextDelta]) -> None:
        """Split one batch by request so each handler wakes once per batch."""
        groups: dict[Ticket, list[TextDelta]] = {}
        for delta in deltas:
            ticket = self._tickets.get(delta.request_id)
            if ticket is not None and ticket.identity == identity:
                groups.setdefault(ticket, []).append(delta)
        for ticket, group in groups.items():
            ticket.queue.put_nowait(group)

    def _route_rows(self, identity: bytes, message: RenderedRows) -> None:
        """Split one frame by request: each handler wakes once per frame and writes its rows' bytes at once."""
        if not message.columns_agree():
            log.error("dropped a RenderedRows frame whose columns disagree (%d rows)", len(message))
            return
        groups: dict[Ticket, Rows] = {}
        tickets = self._tickets
        for row in zip(message.request_ids, message.indices, message.num_new_tokens, message.finish_reasons,
                       message.num_cached_tokens, message.data, strict=True):
            ticket = tickets.get(row[0])
            if ticket is not None and ticket.identity == identity:
                group = groups.get(ticket)
                if group is None:
                    group = groups[ticket] = Rows([])
                group.rows.append(row)
        for ticket, group in groups.items():
            ticket.queue.put_nowait(group)

    async def _link_loop(self) -> None:
        """Each tokenizer's stream: what it has not acknowledged in time goes again; an ack we owe it and no
        request carried goes alone (at most one per ACK_DELAY_S)."""
        while True:
            now = time.monotonic()
            pending = False
            for peer in list(self._peers.values()):
                for entry in peer.link.due(now):
                    log.warning("resending message %d to tokenizer %r (send %d)", entry.seq, peer.identity,
                                entry.num_sends)
                    self._send_data(peer.identity, entry.data, "a resend")
                if peer.link.ack_due(now):
                    self._send_data(peer.identity, ack_frame(self._encoder, peer.link), "an ack")
                pending = pending or bool(peer.link.sends.entries) or peer.link.ack_owed_since is not None
            await asyncio.sleep(LINK_TICK_S if pending else IDLE_LINK_TICK_S)

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.heartbeat_interval)
            now = time.monotonic()
            for peer in list(self._peers.values()):
                silent_s = now - peer.last_seen
                if silent_s > self._config.heartbeat_timeout:
                    self._drop(peer, f"silent for {silent_s:.1f} s")

    def _drop(self, peer: Peer, why: str) -> None:
        """Take a tokenizer for dead: each request it owned gets an error, and it is asked to abort them."""
        log.warning("tokenizer %r dropped (%s); failing its %d request(s)", peer.identity, why,
                    len(peer.request_ids))
        del self._peers[peer.identity]
        tickets = {self._tickets[r] for r in peer.request_ids if r in self._tickets}
        for ticket in tickets:
            # If it was only slow, the abort frees its work; if it is gone, the send fails quietly.
            for request_id in ticket.request_ids:
                self._send(peer.identity, AbortRequest(request_id))
            self._fail(ticket, 503, f"the tokenizer process serving this request is gone ({why})")


def _name(identity: bytes) -> str:
    """A tokenizer's identity as the scheduler's stats name it (SchedulerStats.tokenizer_ids)."""
    return identity.decode(errors="replace")


def _log_send_error(future: asyncio.Future[object]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("a send to a tokenizer failed: %s", future.exception())
