"""`pagoda serve` with every ZeroMQ endpoint on tcp:// (the launcher makes the cluster key pair) and frames lost,
repeated and reordered between its scheduler and worker (a fault-injecting socket on both sides,
PAGODA_TEST_FAULTS; one server for the module): a peer without the key is refused on each endpoint, a keyed peer's
forged messages cost nothing but its own requests, and every request is answered with exactly the tokens it gets
without faults (constraints, which travel once by hash, included)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from pagoda.llm import LLM
from pagoda.shared.messages import (
    AbortRequest,
    AddRequest,
    ModelInfo,
    RequestFailed,
    SamplingParams,
    SchedulerToTokenizer,
    StopSequence,
    StructuredOutputs,
    TokenizerHello,
    TokenizerToScheduler,
)
from pagoda.shared.transport import ClusterKeys, Codec
from tests.harness import HTTP, free_ports, opened, wait_until
from tests.reliability.harness import AUTH, Server, running_server, stream_completion
from tests.test_transport import handshake_events

pytestmark = [pytest.mark.slow]

ENDPOINTS = ("scheduler", "plan", "result", "stats", "api")
# what a peer of each endpoint is: (the socket type that connects to it)
PEER_KIND = {"scheduler": zmq.DEALER, "plan": zmq.SUB, "result": zmq.PUSH, "stats": zmq.SUB, "api": zmq.DEALER}
# both directions of each channel: plans and constraints (scheduler PUB), results and acknowledgements (worker
# PUSH), tokens and failures to the tokenizers (scheduler ROUTER), requests, aborts and stops to the scheduler
# (tokenizer DEALER); heartbeats, hellos and acks on those sockets are lost, repeated and reordered as well
ROLES = ("plan", "result", "scheduler_to_tokenizer", "tokenizer_to_scheduler", "tokenizer_to_api", "api_to_tokenizer")
FAULTS = ";".join(f"{role}=drop:0.15,dup:0.1,hold:0.15,seed:{seed}"
                  for seed, role in enumerate(ROLES, 1))
PROMPTS = ["The capital of France is", "Write a haiku about rain:", "1, 2, 3, 4,", "Once upon a time",
           "The best way to learn Python is", "Q: What is a paged KV cache?\nA:"]
MAX_TOKENS = 12
CHOICES = ["alpha", "beta", "gamma"]


@pytest.fixture(scope="module")
def tcp_server(smollm2_dir: Path) -> Iterator[tuple[Server, dict[str, str]]]:
    ports = free_ports(len(ENDPOINTS))
    endpoints = {name: f"tcp://127.0.0.1:{port}" for name, port in zip(ENDPOINTS, ports, strict=True)}
    flags = [f"--{name}-endpoint" if name != "api" else "--api-endpoints" for name in ENDPOINTS]
    args = [item for flag, name in zip(flags, ENDPOINTS, strict=True) for item in (flag, endpoints[name])]
    # Heartbeats cross the faulty sockets too (15% lost, 15% held back): 3 s of them on a loaded 2-core host is
    # too tight a margin (seen in about 1 run of 6: the tokenizer took the scheduler for gone after 3 s without a
    # frame, and the next frame came 2 ms later)
    args += ["--heartbeat-timeout", "10"]
    with running_server(smollm2_dir, *args, env={"PAGODA_TEST_FAULTS": FAULTS}) as server:
        yield server, endpoints


FORGERY_BODY = {"prompt": "The three primary colors are", "max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def untouched(smollm2_dir: Path) -> dict[str, Any]:
    """What the server answers without faults (greedy): the offline engine's outputs, one engine for the module,
    run before the tests' requests: an offline run beside the server's steps slows them (seen, when the scheduler
    still resent a lost plan after 3x the slowest of its last 256 steps: 3.5 s a resend and over a minute for the
    module, instead of the 0.5 s floor)."""
    offline = LLM(str(smollm2_dir), max_model_len=1024)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [forgery] = offline.generate([FORGERY_BODY["prompt"]], SamplingParams(temperature=0.0, max_tokens=16))
    [choice] = offline.generate(["Pick one:"], SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputs(choice=CHOICES)))
    return {"prompts": offline.generate(PROMPTS, greedy), "choice": choice, "forgery": forgery}


def _peer(context: zmq.Context, name: str) -> zmq.Socket:
    sock = context.socket(PEER_KIND[name])
    sock.setsockopt(zmq.LINGER, 0)
    if PEER_KIND[name] == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    return sock


def test_peers_without_the_key_are_refused_on_every_tcp_endpoint(tcp_server: tuple[Server, dict[str, str]]) -> None:
    server, endpoints = tcp_server
    keys = ClusterKeys.load(server.runtime_dir / "keys")
    context = zmq.Context()
    try:
        for name, endpoint in endpoints.items():
            plain = _peer(context, name)  # no CURVE at all
            events = handshake_events(plain, endpoint, 10.0)
            assert zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL in events, (name, events)
            impostor = _peer(context, name)  # a key pair of its own; the server's public key is no secret
            public, secret = zmq.curve_keypair()
            impostor.curve_secretkey, impostor.curve_publickey, impostor.curve_serverkey = secret, public, keys.public
            events = handshake_events(impostor, endpoint, 10.0)
            assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in events, (name, events)
            member = _peer(context, name)  # the control: the cluster's key pair gets in
            member.curve_secretkey, member.curve_publickey, member.curve_serverkey = keys.secret, keys.public, \
                keys.public
            assert zmq.EVENT_HANDSHAKE_SUCCEEDED in handshake_events(member, endpoint, 10.0), name
            for sock in (plain, impostor, member):
                sock.close(0)
    finally:
        context.term()
    assert server.healthy()


def _stream(server: Server, body: dict[str, object], on_first: object = None) -> tuple[str, str | None, str]:
    """(text, finish_reason, response id) of a streamed completion; on_first(id) runs at its first event."""
    text, finish, response_id = "", None, ""
    with HTTP.stream("POST", server.url + "/v1/completions", json=body | {"stream": True}, headers=AUTH,
                     timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            if not response_id:
                response_id = event["id"]
                if on_first is not None:
                    on_first(response_id)  # type: ignore[operator]
            for choice in event["choices"]:
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
    return text, finish, response_id


def test_a_keyed_peers_forgeries_cost_only_its_own_requests(tcp_server: tuple[Server, dict[str, str]],
                                                            untouched: dict[str, Any]) -> None:
    """A peer with the key registers as a tokenizer and claims EOS ids, sends absurd parameters, and aborts and
    stops a request it does not own: the real request ends exactly as it does untouched (the offline engine's
    answer, which the server's equals: test_lost_repeated_and_reordered_plans_and_results_heal)."""
    server, endpoints = tcp_server
    body = FORGERY_BODY
    reference = untouched["forgery"].outputs[0]
    reference_text, reference_finish = reference.text, reference.finish_reason
    ids = list(reference.token_ids)  # the tokens the request generates, claimed as EOS ids: honoured, they cut it
    keys = ClusterKeys.load(server.runtime_dir / "keys")
    context = zmq.Context()
    out, inbound = Codec(TokenizerToScheduler), Codec(SchedulerToTokenizer)
    try:
        forger = context.socket(zmq.DEALER)
        forger.setsockopt(zmq.LINGER, 0)
        forger.setsockopt(zmq.IDENTITY, b"forger")
        forger.curve_secretkey, forger.curve_publickey, forger.curve_serverkey = keys.secret, keys.public, keys.public
        forger.connect(endpoints["scheduler"])
        hello = out.encode(TokenizerHello("forger", os.getpid(), eos_token_ids=ids[:16]))
        forger.send(hello)
        assert isinstance(_receive(forger, inbound, ModelInfo, again=hello), ModelInfo)  # the answer may be lost
        huge_n = msgspec.structs.replace(SamplingParams(max_tokens=4), n=2**31)  # never validated by a constructor
        forger.send(out.encode(AddRequest("forged-n", [1, 2, 3], huge_n)))
        failed = _receive(forger, inbound, RequestFailed)  # sequenced: a lost one comes again
        assert failed.request_id == "forged-n" and failed.status == 400 and failed.param == "n"
        too_long = msgspec.structs.replace(SamplingParams(), max_tokens=2**31 - 1)
        forger.send(out.encode(AddRequest("forged-len", [1, 2, 3], too_long)))
        assert _receive(forger, inbound, RequestFailed, "forged-len").status == 400

        def forge(response_id: str) -> None:
            forger.send(out.encode(AbortRequest(response_id)))
            forger.send(out.encode(StopSequence(response_id, 0)))

        text, finish, response_id = _stream(server, body, on_first=forge)
        # the forged frames race the request's end (16 tokens): the socket stays open until the scheduler has
        # logged both (a short request can finish before they are read)
        dropped = [f"dropped a {kind} for request '{response_id}'" for kind in ("AbortRequest", "StopSequence")]
        wait_until(lambda: all(line in server.log() for line in dropped), 30, "the forged frames' drops")
    finally:
        context.destroy(linger=0)
    assert (text, finish) == (reference_text, reference_finish)
    assert server.healthy()


def _receive(sock: zmq.Socket, codec: Codec, kind: type, request_id: str | None = None,
             again: bytes | None = None) -> Any:
    """The next `kind` (for `request_id`) from the scheduler; `again` is sent every 0.5 s meanwhile."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sock.poll(500):
            message = opened(codec, codec.decode(sock.recv()))
            if isinstance(message, kind) and request_id in (None, getattr(message, "request_id", None)):
                return message
        elif again is not None:
            sock.send(again)
    raise AssertionError(f"no {kind.__name__} from the scheduler")


@pytest.mark.timeout(900)
def test_lost_repeated_and_reordered_plans_and_results_heal(tcp_server: tuple[Server, dict[str, str]],
                                                           untouched: dict[str, Any]) -> None:
    expected, choice = untouched["prompts"], untouched["choice"]
    server, _ = tcp_server
    bodies = [{"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True} for p in PROMPTS]
    bodies += [{"prompt": "Pick one:", "max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": CHOICES}}
               for _ in range(2)]  # the second names the constraint by the hash the first sent
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        outcomes = list(pool.map(lambda body: stream_completion(server, body, timeout=300), bodies))
    for outcome, want in zip(outcomes, [*expected, choice, choice], strict=True):
        assert outcome.status == 200 and outcome.error is None and outcome.done, (outcome, server.log()[-6000:])
        assert outcome.text == want.outputs[0].text, (outcome.text, want.outputs[0].text)
    assert outcomes[-1].text in CHOICES
    log = server.log()
    resent = {peer: len(re.findall(rf"resending message \d+ to {peer}", log))
              for peer in ("the workers", "tokenizer", "scheduler", "api")}
    print(f"\nfaults: resends {resent}")
    for role in ROLES:
        assert f"fault injection on the {role} socket" in log, role
    assert sum(resent.values()) > 0, "no frame was lost: the faults did not apply"
    assert server.healthy() and server.process.poll() is None
