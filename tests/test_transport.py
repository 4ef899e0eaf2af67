"""The transport's settings with real ZeroMQ sockets: CURVE on tcp:// (keyed peers in, others refused), bounded
high-water marks (a peer that stops reading costs a bounded queue and a zmq.Again, never a blocked loop), and
bind addresses (localhost stays local)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pagoda.shared import transport
from pagoda.shared.config import bind_address
from pagoda.shared.errors import ConfigError
from pagoda.shared.transport import ClusterKeys, make_socket
from tests.harness import free_port


@pytest.fixture()
def keys(tmp_path: Path) -> Iterator[ClusterKeys]:
    ClusterKeys.generate(tmp_path / "keys")
    keys = ClusterKeys.load(tmp_path / "keys")
    transport.use_cluster_keys(keys)
    yield keys
    transport.use_cluster_keys(None)


def try_send(sock: zmq.Socket, data: bytes) -> None:
    """Send unless the socket has no peer to take it (a refused handshake leaves none)."""
    try:
        sock.send(data, zmq.NOBLOCK)
    except zmq.Again:
        pass


def handshake_events(sock: zmq.Socket, endpoint: str, timeout_s: float) -> set[int]:
    """Connect `sock` to `endpoint`; the monitor events seen within `timeout_s` (or until a handshake succeeds
    or fails)."""
    import zmq.utils.monitor

    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                      | zmq.EVENT_DISCONNECTED)
    seen: set[int] = set()
    sock.connect(endpoint)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not seen & {zmq.EVENT_HANDSHAKE_SUCCEEDED,
                                                          zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                                                          zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL}:
            if monitor.poll(100):
                seen.add(zmq.utils.monitor.recv_monitor_message(monitor)["event"])
    finally:
        sock.disable_monitor()
        monitor.close(0)
    return seen


def test_curve_admits_keyed_peers_and_refuses_the_others(keys: ClusterKeys) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()
    try:
        server = make_socket(context, zmq.ROUTER, endpoint, bind=True)
        keyed = make_socket(context, zmq.DEALER, endpoint, bind=False)
        keyed.send(b"hello")
        assert server.poll(5000) and server.recv_multipart()[1] == b"hello"
        # no keys at all: the handshake fails (CURVE server, NULL client); nothing arrives
        plain = context.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        events = handshake_events(plain, endpoint, 5.0)
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events and zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL in events
        try_send(plain, b"plain")
        # a key pair of its own, and the server's public key (which is no secret): ZAP refuses it
        public, secret = zmq.curve_keypair()
        impostor = context.socket(zmq.DEALER)
        impostor.setsockopt(zmq.LINGER, 0)
        impostor.curve_secretkey, impostor.curve_publickey, impostor.curve_serverkey = secret, public, keys.public
        events = handshake_events(impostor, endpoint, 5.0)
        assert zmq.EVENT_HANDSHAKE_SUCCEEDED not in events and zmq.EVENT_HANDSHAKE_FAILED_AUTH in events
        try_send(impostor, b"impostor")
        assert not server.poll(1000), "a peer without the cluster key got a message through"
        for sock in (server, keyed, plain, impostor):
            sock.close(0)
    finally:
        started = time.monotonic()
        context.term()  # the ZAP handler thread ends with its context
        assert time.monotonic() - started < 5


def test_a_keyed_client_refuses_a_server_without_the_key(keys: ClusterKeys) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()
    try:
        public, secret = zmq.curve_keypair()
        fake = context.socket(zmq.ROUTER)  # a listener with some other key pair at the scheduler's address
        fake.setsockopt(zmq.LINGER, 0)
        fake.curve_server, fake.curve_secretkey, fake.curve_publickey = True, secret, public
        fake.bind(endpoint)
        client = make_socket(context, zmq.DEALER, endpoint, bind=False)
        try_send(client, b"a prompt the impostor must not read")
        assert not fake.poll(1500)
        fake.close(0)
        client.close(0)
    finally:
        context.term()


def test_missing_or_broken_keys_are_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        ClusterKeys.load(tmp_path)
    (tmp_path / "cluster.key_secret").write_text("not a certificate")
    with pytest.raises(ConfigError):
        ClusterKeys.load(tmp_path)


def test_ipc_needs_no_keys(keys: ClusterKeys, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/s.sock"
    context = zmq.Context()
    try:
        server = make_socket(context, zmq.PULL, endpoint, bind=True)
        plain = context.socket(zmq.PUSH)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(endpoint)
        plain.send(b"local")
        assert server.poll(5000) and server.recv() == b"local"
        assert server.getsockopt(zmq.MECHANISM) == zmq.NULL
        server.close(0)
        plain.close(0)
    finally:
        context.term()


def test_high_water_mark_bounds_a_stalled_peer(tmp_path: Path) -> None:
    """A tokenizer that stops reading: the scheduler's ROUTER queues up to the mark, then a non-blocking send
    raises zmq.Again (the service drops that message and counts it) instead of queueing without end or
    blocking its loop."""
    endpoint = f"ipc://{tmp_path}/front.sock"
    context = zmq.Context()
    try:
        router = make_socket(context, zmq.ROUTER, endpoint, bind=True, hwm=10)
        dealer = make_socket(context, zmq.DEALER, endpoint, bind=False, identity=b"slow", hwm=10)
        dealer.send(b"hello")
        assert router.poll(5000)
        router.recv_multipart()
        sent = 0
        with pytest.raises(zmq.Again):
            for _ in range(10_000):
                router.send_multipart([b"slow", b"x" * 100], zmq.NOBLOCK)
                sent += 1
        assert 10 <= sent <= 100  # the sender's and the receiver's marks, plus what the pipe's batching holds
        received = 0
        while dealer.poll(200):
            dealer.recv()
            received += 1
        assert received == sent  # what was accepted is delivered; nothing is lost silently
        router.close(0)
        dealer.close(0)
    finally:
        context.term()


def test_bind_address_keeps_loopback_names_local() -> None:
    assert bind_address("tcp://localhost:5555") == "tcp://127.0.0.1:5555"
    assert bind_address("tcp://scheduler:5555") == "tcp://*:5555"
    assert bind_address("tcp://10.1.2.3:5555") == "tcp://10.1.2.3:5555"
    assert bind_address("ipc:///run/pagoda/plan.sock") == "ipc:///run/pagoda/plan.sock"
