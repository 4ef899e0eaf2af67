"""Data-parallel replicas: endpoints per replica, routing over several schedulers (prefix affinity vs
round-robin vs random, on a simulated LRU prefix cache), per-replica metrics and health, and the real
processes (`pagoda serve --data-parallel-size 2` with SmolLM2): spread, prefix hits, kill -9 of a replica."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pagoda.bench.data_parallel import Server, serving, system_prompt, wait_for_replicas
from pagoda.launcher import replica_devices
from pagoda.services.api.metrics import SnapshotCollector
from pagoda.services.api.stats import combine_stats
from pagoda.services.tokenizer.replicas import Replica, ReplicaSet
from pagoda.services.tokenizer.routing import RoutingConfig, client_key, rendezvous_order
from pagoda.shared.config import ServerConfig
from pagoda.shared.errors import ServerOverloadedError
from pagoda.shared.messages import ModelInfo, SchedulerStats
from tests.harness import opened, service_children, wait_until

BLOCK = 16
INFO = ModelInfo(max_model_len=1024, vocab_size=1000, max_num_tokens=4096, eos_token_ids=[0])


# -------------------------------------------------------------------------------------------- config


def test_replica_endpoints_are_derived_per_replica_and_listed_for_tokenizers() -> None:
    single = ServerConfig(runtime_dir="/run/p")
    assert single.replica_endpoint_list("scheduler") == ["ipc:///run/p/scheduler.sock"]  # unchanged for D=1
    config = ServerConfig(runtime_dir="/run/p", data_parallel_size=2)
    assert config.replica_endpoint_list("stats") == ["ipc:///run/p/stats-r0.sock", "ipc:///run/p/stats-r1.sock"]
    replica1 = ServerConfig(runtime_dir="/run/p", data_parallel_size=2, replica_id=1)
    assert replica1.endpoint("plan") == "ipc:///run/p/plan-r1.sock"
    listed = ServerConfig(scheduler_endpoints="tcp://a:1, tcp://b:2")
    assert listed.replica_endpoint_list("scheduler") == ["tcp://a:1", "tcp://b:2"]


def test_replica_devices_take_consecutive_groups_of_visible_gpus_and_wrap() -> None:
    devices = ["4", "5", "6", "7"]
    assert replica_devices(0, 1, devices) == "4" and replica_devices(1, 2, devices) == "6,7"
    assert replica_devices(1, 1, ["0"]) == "0"  # one GPU, two replicas: they share it
    assert replica_devices(0, 1, []) == ""


# -------------------------------------------------------------------------------------------- routing


def _replicas(num: int, routing: str) -> ReplicaSet:
    replicas = [Replica(i, sock=None, model_info=INFO) for i in range(num)]
    return ReplicaSet(replicas, routing, RoutingConfig(block_size=BLOCK), heartbeat_timeout=5.0)


def _token_workload(num_system: int, num_turns: int) -> list[tuple[int, list[int]]]:
    """(system prompt, token ids): 10-block system prompts, 1-2 block user turns; turn by turn (every system
    prompt's turn t before any turn t+1), the system prompts shuffled within a turn."""
    systems = [[random.Random(s).randrange(1, 1000) for _ in range(10 * BLOCK)] for s in range(num_system)]
    out = []
    for t in range(num_turns):
        order = list(range(num_system))
        random.Random(t).shuffle(order)
        out += [(s, systems[s] + [random.Random(s * 1000 + t).randrange(1, 1000) for _ in range(20)]) for s in order]
    return out


def _simulated_hit_rate(routing: str, num_replicas: int, blocks_per_replica: int) -> float:
    """Prefix-cache hits over the workload with one LRU cache of full blocks per replica (the block manager's
    policy, one request at a time)."""
    replica_set = _replicas(num_replicas, routing)
    caches: list[OrderedDict[tuple[int, ...], None]] = [OrderedDict() for _ in range(num_replicas)]
    hits = queries = 0
    for number, (_, prompt) in enumerate(_token_workload(8, 32)):
        cache = caches[replica_set.route(f"r{number}", prompt).index]
        for replica in replica_set.replicas:  # one at a time: the request finished before the next
            replica.routed_since_stats = 0
        blocks = [tuple(prompt[:end]) for end in range(BLOCK, len(prompt) + 1, BLOCK)]
        queries += len(prompt)
        for block in blocks:
            if block not in cache:
                break
            hits += BLOCK
        for block in blocks:
            cache[block] = None
            cache.move_to_end(block)
            while len(cache) > blocks_per_replica:
                cache.popitem(last=False)
    return hits / queries


def test_prefix_routing_keeps_the_hit_rate_of_one_replica_and_beats_round_robin_and_random() -> None:
    # The same memory in all: one replica with 2C blocks, or two with C, where C holds 7 of the 8 system prompts
    # (11 blocks each with a turn): rendezvous hashing puts 6 of them on one replica here.
    blocks = 7 * 11
    single = _simulated_hit_rate("prefix", 1, 2 * blocks)
    prefix = _simulated_hit_rate("prefix", 2, blocks)
    round_robin = _simulated_hit_rate("round_robin", 2, blocks)
    randomly = _simulated_hit_rate("random", 2, blocks)
    assert single > 0.5
    assert prefix >= 0.9 * single
    assert prefix > 1.2 * max(round_robin, randomly), (prefix, round_robin, randomly)


def test_one_system_prompt_stays_on_one_replica_and_both_replicas_are_used() -> None:
    replica_set = _replicas(2, "prefix")
    homes: dict[int, set[int]] = {}
    for number, (system, prompt) in enumerate(_token_workload(8, 4)):
        homes.setdefault(system, set()).add(replica_set.route(f"r{number}", prompt).index)
    assert all(len(home) == 1 for home in homes.values())
    assert {next(iter(home)) for home in homes.values()} == {0, 1}


def test_a_lost_replica_gets_no_requests_and_none_left_is_503() -> None:
    replica_set = _replicas(2, "prefix")
    replica_set.replicas[0].lost = True
    assert {replica_set.route(f"r{n}", prompt).index for n, (_, prompt) in enumerate(_token_workload(8, 1))} == {1}
    assert replica_set.owned_by(1) and not replica_set.owned_by(0)
    replica_set.replicas[1].model_info = None
    with pytest.raises(ServerOverloadedError):
        replica_set.route("late", [1] * 40)


def test_a_prompt_cache_key_reaches_the_router() -> None:
    """route() with a prompt_cache_key: the requests of one key go where (salt, key) ranks first, whatever their
    prompts (one of them short of a block); keys spread over both replicas; one replica takes everything."""
    replica_set = _replicas(2, "prefix")
    homes = set()
    for number in range(16):
        key = f"conversation-{number}"
        home = int(rendezvous_order(client_key("salt", key), ["0", "1"])[0])
        prompts = [prompt for _, prompt in _token_workload(3, 1)] + [[number + 1, 2, 3]]
        assert {replica_set.route(f"{key}-{i}", prompt, "salt", key).index for i, prompt in enumerate(prompts)} \
            == {home}
        for replica in replica_set.replicas:  # fresh stats: those requests finished
            replica.routed_since_stats = 0
        homes.add(home)
    assert homes == {0, 1}
    single = _replicas(1, "prefix")
    assert {single.route(f"s{n}", [n + 1] * 40, "", f"k{n}").index for n in range(8)} == {0}


# -------------------------------------------------------------------------------------------- metrics


def _stats(running: int, hits: int, alive: bool = True, tokenizers: tuple[str, ...] = ("t0",)) -> SchedulerStats:
    return SchedulerStats(time=0.0, num_running=running, num_waiting=1, kv_blocks_free=10, kv_blocks_total=20,
                          kv_cache_usage=0.5, prefix_hit_tokens_total=hits, prefix_query_tokens_total=100,
                          num_preemptions_total=0, prompt_tokens_total=100, generation_tokens_total=5,
                          num_steps_total=3, worker_ready=True, worker_alive=alive,
                          tokenizer_ids=list(tokenizers), tokenizer_requests_total=[2] * len(tokenizers))


def test_metrics_carry_a_replica_label_with_several_replicas() -> None:
    collector = SnapshotCollector(lambda: None, lambda: [("0", _stats(3, 40)), ("1", _stats(5, 60))])
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in collector.collect() for s in family.samples}
    assert samples[("pagoda_num_requests_running", (("replica", "0"),))] == 3
    assert samples[("pagoda_num_requests_running", (("replica", "1"),))] == 5
    assert samples[("pagoda_prefix_cache_hit_tokens_total", (("replica", "1"),))] == 60
    single = SnapshotCollector(lambda: _stats(3, 40), lambda: [("0", _stats(3, 40))])
    names = {(s.name, tuple(s.labels)) for family in single.collect() for s in family.samples}
    assert ("pagoda_num_requests_running", ()) in names  # one replica: the series as before


def test_combined_stats_sum_replicas_and_stay_alive_while_one_is() -> None:
    combined = combine_stats([_stats(3, 40, alive=False), _stats(5, 60, tokenizers=("t0", "t1"))])
    assert (combined.num_running, combined.prefix_hit_tokens_total, combined.kv_blocks_total) == (8, 100, 40)
    assert combined.worker_alive and combined.tokenizer_ids == ["t0", "t1"]
    assert combined.tokenizer_requests_total == [4, 2]


# -------------------------------------------------------------------------------------------- processes


def _replica_pids(server: Server, service: str, replica: int) -> list[int]:
    return service_children(server.process.pid, env=f"PAGODA_REPLICA_ID={replica}").get(service, [])


@pytest.mark.slow
def test_two_replicas_spread_hit_their_prefixes_and_survive_kill_9(smollm2_dir: Path) -> None:
    with serving(str(smollm2_dir), "--data-parallel-size", "2", "--max-model-len", "1024",
                 "--heartbeat-timeout", "3", "--num-kv-blocks", "128") as server:
        wait_for_replicas(server)
        # Spread and affinity: 4 system prompts x 2 turns, one at a time.
        prompts = [f"{system_prompt(s, 60)}User turn {t}: hello.\nAnswer:" for t in range(2) for s in range(4)]
        for prompt in prompts:
            assert server.complete(prompt, 1)[0] == 200
        deadline = time.monotonic() + 10
        while server.metric_sums().get("pagoda_tokenizer_requests_total", 0) < len(prompts):
            assert time.monotonic() < deadline, server.get("/metrics")[1]
            time.sleep(0.1)  # the stats lag the requests by a period (0.25 s), more on a loaded machine
        prompt_tokens = server.metric_by_replica("pagoda_prompt_tokens_total")
        assert prompt_tokens.keys() == {"0", "1"} and min(prompt_tokens.values()) > 0, prompt_tokens
        sums = server.metric_sums()
        hit_rate = sums["pagoda_prefix_cache_hit_tokens_total"] / sums["pagoda_prefix_cache_query_tokens_total"]
        assert hit_rate > 0.35, hit_rate  # the second turns (half the tokens) find their system prompt

        # kill -9 one replica's scheduler with requests in flight on both.
        work = [f"{system_prompt(s, 60)}Write a long story number {n}." for n in range(2) for s in range(4)]
        with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
            futures = [pool.submit(_timed_completion, server, prompt) for prompt in work]
            deadline = time.monotonic() + 60
            while min(server.metric_by_replica("pagoda_num_requests_running").values() or [0]) == 0:
                assert time.monotonic() < deadline, "requests never ran on both replicas"
                time.sleep(0.05)  # polling /metrics: nothing to wait on instead
            victim = _replica_pids(server, "scheduler", 1)
            assert len(victim) == 1
            os.kill(victim[0], signal.SIGKILL)
            killed_at = time.monotonic()
            results = [future.result() for future in futures]
        failed = [(status, ended) for status, ended in results if status != 200]
        assert failed and len(failed) < len(results), results  # replica 1's failed, replica 0's completed
        assert all(status == 503 and ended - killed_at < 5.0 for status, ended in failed), (failed, killed_at)
        # the failed requests answer first; /health learns of the dead replica from the registry a moment later
        wait_until(lambda: "replica 1" in server.get("/health")[1], 30, "/health naming the dead replica")
        status, body = server.get("/health")
        assert status == 200 and "replica 1" in body, body
        assert all(server.complete(f"{system_prompt(s, 60)}After the kill.", 2)[0] == 200 for s in range(4))
        assert server.process.poll() is None  # the launcher serves on with the survivor


def _replica_states(server: Server) -> dict[str, str]:
    """The console's engine rows: replica id -> state (ok, starting, restarting, hung, down)."""
    status, body = server.get("/console/api/stats")
    assert status == 200, body
    return {row["id"]: row["state"] for row in json.loads(body)["replicas"]}


@pytest.mark.slow
@pytest.mark.extended  # test_launcher.py (the back-off policy and the launcher's replacements) and test_console.py
# (a backed-off replica shown restarting) cover it in the default run
def test_a_replica_failing_at_start_backs_off_and_returns_when_it_can_start(smollm2_dir: Path,
                                                                            tmp_path: Path) -> None:
    """--restart-on-failure with two replicas: replica 1 killed while its model folder is gone fails at each start,
    so the launcher backs off (the console shows it restarting) while replica 0 serves on; with the folder back,
    its next start succeeds and both replicas serve again."""
    model = tmp_path / "model"  # the server's own folder (links to the files), so hiding it touches no other test
    model.mkdir()
    for path in smollm2_dir.iterdir():
        (model / path.name).symlink_to(path)
    with serving(str(model), "--data-parallel-size", "2", "--restart-on-failure", "--max-model-len", "1024",
                 "--heartbeat-timeout", "3", "--num-kv-blocks", "128") as server:
        wait_for_replicas(server)
        hidden = tmp_path / "hidden"
        model.rename(hidden)
        try:
            victim = _replica_pids(server, "scheduler", 1)
            assert len(victim) == 1
            os.kill(victim[0], signal.SIGKILL)
            wait_until(lambda: _replica_states(server).get("1") == "restarting", 90, "replica 1 shown restarting")
            assert _replica_states(server).get("0") == "ok"
            assert all(server.complete(f"{system_prompt(s, 20)}While one is down.", 2)[0] == 200 for s in range(4))
        finally:
            hidden.rename(model)
        wait_until(lambda: _replica_states(server) == {"0": "ok", "1": "ok"}, 120, "both replicas ok again")
        wait_for_replicas(server)
        assert server.process.poll() is None


def _timed_completion(server: Server, prompt: str) -> tuple[int, float]:
    status, _ = server.complete(prompt, 32)
    return status, time.monotonic()


# -------------------------------------------------------------------------------------------- tokenizer


def _received(sock: Any, codec: Any, kind: type) -> list[object]:
    """The messages of one kind that reach a ROUTER socket (zmq) until it stays quiet for 200 ms (Codec)."""
    out = []
    while sock.poll(200):
        message = opened(codec, codec.decode(sock.recv_multipart()[1]))
        if isinstance(message, kind):
            out.append(message)
    return out


@contextmanager
def _two_replica_tokenizer(tmp_path: Path, routing: str) -> Iterator[tuple[Any, list[Any], Any]]:
    """A TokenizerService in this process (no tokenizer: token-id prompts) over two fake schedulers (ROUTER
    sockets that have sent it their model info) and a fake api: (service, scheduler sockets, api socket)."""
    import zmq

    from pagoda.services.tokenizer.service import TokenizerService
    from pagoda.shared.messages import SchedulerToTokenizer
    from pagoda.shared.transport import Codec

    context = zmq.Context()
    schedulers = [context.socket(zmq.ROUTER) for _ in range(2)]
    api = context.socket(zmq.ROUTER)
    for index, sock in enumerate(schedulers):
        sock.bind(f"ipc://{tmp_path}/s{index}")
    api.bind(f"ipc://{tmp_path}/api")
    config = ServerConfig(api_endpoints=f"ipc://{tmp_path}/api", routing=routing, heartbeat_timeout=5.0,
                          scheduler_endpoints=f"ipc://{tmp_path}/s0,ipc://{tmp_path}/s1",
                          stats_endpoints=f"ipc://{tmp_path}/t0,ipc://{tmp_path}/t1", tokenizer_id="tk")
    service = TokenizerService(config, None, context)
    try:
        for index in range(2):
            service._on_scheduler_frame(Codec(SchedulerToTokenizer).encode(INFO), index)
        yield service, schedulers, api
    finally:
        service._peers.close(0)
        service._offload.close()
        for sock in [*schedulers, api]:
            sock.close(linger=0)
        context.term()


def test_tokenizer_sends_each_request_its_abort_and_its_failure_to_one_replica(tmp_path: Path) -> None:
    """Round-robin over two fake schedulers: each request, its abort and (when its replica is lost) its failure go
    to one replica; an abort from an api that did not send the request goes nowhere."""
    from pagoda.shared.messages import (
        AbortRequest,
        AddRequest,
        GenerateRequest,
        RequestFailed,
        SamplingParams,
        TokenizerToApi,
        TokenizerToScheduler,
    )
    from pagoda.shared.transport import Codec

    from_tokenizer, api_codec = Codec(TokenizerToScheduler), Codec(TokenizerToApi)
    with _two_replica_tokenizer(tmp_path, "round_robin") as (service, schedulers, api):
        for n in range(4):
            service._dispatch_api(0, GenerateRequest(f"q{n}", SamplingParams(max_tokens=2),
                                                     prompt_token_ids=[1, 2, n + 3]))
        added = [[m.request_id for m in _received(sock, from_tokenizer, AddRequest)] for sock in schedulers]
        assert sorted(added[0] + added[1]) == ["q0", "q1", "q2", "q3"] and added[0] and added[1]
        service._dispatch_api(1, AbortRequest(added[1][0]))  # another api's abort of api 0's request: dropped
        assert added[1][0] in service._requests
        service._dispatch_api(0, AbortRequest(added[1][0]))
        assert [m.request_id for m in _received(schedulers[1], from_tokenizer, AbortRequest)] == [added[1][0]]
        assert _received(schedulers[0], from_tokenizer, AbortRequest) == []
        service._lose_scheduler("silent", 0)  # replica 0 lost: only its requests fail
        failed = [m.request_id for m in _received(api, api_codec, RequestFailed)]
        assert sorted(failed) == sorted(added[0])
        service._dispatch_api(0, GenerateRequest("late", SamplingParams(max_tokens=2), prompt_token_ids=[5, 6]))
        assert [m.request_id for m in _received(schedulers[1], from_tokenizer, AddRequest)] == ["late"]


def test_the_tokenizer_routes_a_generate_requests_prompt_cache_key(tmp_path: Path) -> None:
    """Prefix routing over two fake schedulers: the prompt_cache_key of a GenerateRequest decides its replica (the
    one its key ranks first), whatever its prompt."""
    from pagoda.shared.messages import AddRequest, GenerateRequest, SamplingParams, TokenizerToScheduler
    from pagoda.shared.transport import Codec

    from_tokenizer = Codec(TokenizerToScheduler)
    with _two_replica_tokenizer(tmp_path, "prefix") as (service, schedulers, _):
        expected: dict[str, int] = {}
        for key in ("alpha", "beta", "gamma", "delta"):
            expected[key] = int(rendezvous_order(client_key("", key), ["0", "1"])[0])
            for length in (3, 2 * BLOCK, 5 * BLOCK):  # different first blocks, or none
                prompt = [(len(key) * 31 + length * 7 + j) % 900 + 1 for j in range(length)]
                service._dispatch_api(0, GenerateRequest(f"{key}-{length}", SamplingParams(max_tokens=2),
                                                         prompt_token_ids=prompt, prompt_cache_key=key))
        added = [[m.request_id for m in _received(sock, from_tokenizer, AddRequest)] for sock in schedulers]
        assert set(expected.values()) == {0, 1}  # these keys rank different replicas first
        for key, home in expected.items():
            assert [rid for rid in added[home] if rid.startswith(key)] == [f"{key}-{n}" for n in (3, 32, 80)]
            assert not [rid for rid in added[1 - home] if rid.startswith(key)]


# -------------------------------------------------------------------------------------------- discovery


def test_registry_lists_what_joined_and_forgets_the_silent() -> None:
    from pagoda.services.scheduler.registry import Registry
    from pagoda.shared.messages import ReplicaAddress

    own = ReplicaAddress(0, "tcp://scheduler:5555", "tcp://scheduler:5558", "s0")
    registry = Registry(own, timeout=2.0)
    assert registry.directory().replicas == [own] and not registry.used  # nothing joined: no directories sent
    registry.join_api("tcp://10.0.0.7:4000", now=0.0)
    registry.join_api("tcp://10.0.0.8:4000", now=1.5)
    one = ReplicaAddress(1, "tcp://replica1-scheduler:5555", "tcp://replica1-scheduler:5558", "s1")
    assert registry.join_replica(one, now=0.5) and registry.used
    assert not registry.join_replica(ReplicaAddress(0, "tcp://x:1", "tcp://x:2", "impostor"), now=0.5)
    directory = registry.directory()
    assert directory.apis == ["tcp://10.0.0.7:4000", "tcp://10.0.0.8:4000"]
    assert directory.replicas == [own, one] and directory.registry_replica_id == 0
    assert sorted(registry.sweep(now=3.0)) == ["api tcp://10.0.0.7:4000", "replica 1"]  # silent past 2 s
    assert registry.directory().apis == ["tcp://10.0.0.8:4000"] and registry.directory().replicas == [own]
    restarted = ReplicaAddress(1, "tcp://replica1-scheduler:5555", "tcp://replica1-scheduler:5558", "s1-new")
    registry.join_replica(restarted, now=3.1)  # it rejoins: listed again, as its new instance
    assert registry.directory().replicas == [own, restarted]


def test_advertised_addresses_replace_only_wildcards() -> None:
    from pagoda.shared.discovery import advertised, host_toward

    assert advertised("tcp://0.0.0.0:41234", "10.1.2.3") == "tcp://10.1.2.3:41234"  # a bound `tcp://*:*`
    assert advertised("tcp://*:5555", "fe80::1") == "tcp://[fe80::1]:5555"
    assert advertised("tcp://scheduler:5555", "10.1.2.3") == "tcp://scheduler:5555"  # names resolve for peers
    assert advertised("ipc:///run/p/api0.sock", "10.1.2.3") == "ipc:///run/p/api0.sock"
    assert host_toward("tcp://127.0.0.1:5555") == "127.0.0.1"
    assert host_toward("ipc:///run/p/scheduler.sock") == "127.0.0.1"


def test_replicas_sharing_a_gpu_must_be_given_their_kv_cache_size() -> None:
    from pagoda.launcher import check_shared_gpus
    from pagoda.shared.config import EngineConfig
    from pagoda.shared.errors import ConfigError

    with pytest.raises(ConfigError, match="kv-cache-memory"):
        check_shared_gpus(EngineConfig(), 2, ["0"])
    check_shared_gpus(EngineConfig(kv_cache_memory=40 << 30), 2, ["0"])  # each replica its half
    check_shared_gpus(EngineConfig(), 2, ["0", "1"])  # a GPU each: gpu_memory_utilization works
    check_shared_gpus(EngineConfig(device="cpu"), 2, ["0"])
    check_shared_gpus(EngineConfig(), 2, [])  # no GPU on this host


def test_tokenizer_connects_to_what_the_registry_lists_and_drops_a_forgotten_api(tmp_path: Path) -> None:
    """A TokenizerService in this process given only the registry (a fake scheduler): the Directory's api and
    second replica get its hello; requests then route over both replicas; an api no longer listed is dropped
    and its requests aborted."""
    import zmq

    from pagoda.services.tokenizer.service import TokenizerService
    from pagoda.shared.messages import (
        AbortRequest,
        AddRequest,
        Directory,
        GenerateRequest,
        ReplicaAddress,
        SamplingParams,
        SchedulerToTokenizer,
        TokenizerHello,
        TokenizerToApi,
        TokenizerToScheduler,
    )
    from pagoda.shared.transport import Codec

    context = zmq.Context()
    registry, replica1, api = (context.socket(zmq.ROUTER) for _ in range(3))
    for sock, name in ((registry, "s0"), (replica1, "s1"), (api, "api")):
        sock.bind(f"ipc://{tmp_path}/{name}")
    config = ServerConfig(registry_endpoint=f"ipc://{tmp_path}/s0", routing="round_robin", tokenizer_id="tk")
    service = TokenizerService(config, None, context)
    to_tokenizer, from_tokenizer, api_codec = Codec(SchedulerToTokenizer), Codec(TokenizerToScheduler), \
        Codec(TokenizerToApi)

    try:
        assert service._apis == {}  # nothing given but the registry
        directory = Directory(apis=[f"ipc://{tmp_path}/api"], registry_replica_id=0, replicas=[
            ReplicaAddress(0, f"ipc://{tmp_path}/s0", f"ipc://{tmp_path}/st0", "a"),
            ReplicaAddress(1, f"ipc://{tmp_path}/s1", f"ipc://{tmp_path}/st1", "b")])
        service._on_scheduler_frame(to_tokenizer.encode(directory), 0)
        service._on_scheduler_frame(to_tokenizer.encode(directory), 0)  # every heartbeat: nothing new
        assert len(_received(api, api_codec, TokenizerHello)) == 1
        assert len(_received(replica1, from_tokenizer, TokenizerHello)) == 1
        assert [r.replica_id for r in service._replicas.replicas] == ["0", "1"]
        [api_key] = service._apis
        for index in range(2):
            service._on_scheduler_frame(to_tokenizer.encode(INFO), index)
        for n in range(4):
            service._dispatch_api(api_key, GenerateRequest(f"q{n}", SamplingParams(max_tokens=2),
                                                           prompt_token_ids=[1, 2, n + 3]))
        added = [[m.request_id for m in _received(sock, from_tokenizer, AddRequest)] for sock in (registry, replica1)]
        assert sorted(added[0] + added[1]) == ["q0", "q1", "q2", "q3"] and added[0] and added[1]
        service._on_scheduler_frame(to_tokenizer.encode(Directory([], directory.replicas, 0)), 0)
        assert service._apis == {} and service._requests == {}  # the api is gone: its requests aborted
        aborted = [m.request_id for m in _received(registry, from_tokenizer, AbortRequest)]
        aborted += [m.request_id for m in _received(replica1, from_tokenizer, AbortRequest)]
        assert sorted(aborted) == ["q0", "q1", "q2", "q3"]
    finally:
        service._peers.close(0)
        service._offload.close()
        for sock in (registry, replica1, api):
            sock.close(linger=0)
        context.term()
