"""Lifecycle and accounting invariants under messy traffic: after any mix of requests ends (finished, stopped,
aborted, preempted by recompute or swap), the engine is idle (every KV block free or only cached, no request or
sequence state left in the scheduler, the worker or the grammar rows, swap space empty), and the token counters
equal what the clients received."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pagoda import LLM, SamplingParams
from pagoda.engine import LLMEngine
from pagoda.shared.messages import StructuredOutputs
from tests.harness import Server, http_client, running_server, tiny_llama_over_smollm2_vocab, wait_until

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A 2-layer Llama of hidden size 64 over SmolLM2's vocabulary (random weights; its tokenizer and chat template),
    so that stop strings, grammars and chat run at a fraction of SmolLM2's cost."""
    return tiny_llama_over_smollm2_vocab(tmp_path_factory.mktemp("tiny-lifecycle"), smollm2_dir)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: a hidden-64 model's matmuls are too small to split, and on a busy 2-core host the
    threads' spin-waits cost each step several times its work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------------------
# the offline engine


def _random_params(rng: random.Random) -> SamplingParams:
    kind = rng.choice(["sampled", "n", "beam", "json", "stop", "one"])
    max_tokens = rng.choice([1, 2, 5, 40, 80])
    if kind == "sampled":
        return SamplingParams(temperature=0.8, max_tokens=max_tokens, seed=rng.randrange(1000), ignore_eos=True)
    if kind == "n":
        return SamplingParams(temperature=1.0, n=rng.choice([2, 3]), max_tokens=max_tokens, seed=1, ignore_eos=True)
    if kind == "beam":
        return SamplingParams(temperature=0.0, n=2, best_of=rng.choice([2, 3]), use_beam_search=True,
                              max_tokens=min(max_tokens, 8))
    if kind == "json":
        return SamplingParams(temperature=0.7, seed=3, max_tokens=max_tokens + 4,
                              structured_outputs=StructuredOutputs(json=SCHEMA))
    if kind == "stop":
        return SamplingParams(temperature=1.0, max_tokens=60, stop=["e", " the", "a"], seed=2)
    return SamplingParams(temperature=0.0, max_tokens=1)


def assert_engine_idle(engine: LLMEngine) -> None:
    """No request, sequence, plan or grammar matcher left anywhere in the engine; every KV block free (or cached,
    which counts as free), every swap slot free."""
    scheduler, runner = engine.scheduler, engine.runner
    assert not scheduler.has_unfinished() and not scheduler.running and len(scheduler.waiting) == 0
    assert not scheduler._seqs and not scheduler._inflight and not engine.pipeline.inflight
    assert all(not t.heap and not t.num_running for t in scheduler.waiting.tenants.values())
    assert not scheduler._forked_waiting, "ended sequences are still listed as forked and waiting"
    assert not scheduler._unforked_beams and not scheduler._swapped_out_by_step and not scheduler._num_beam_searches
    assert not (scheduler._beam_forks or scheduler._swap_out or scheduler._swap_in or scheduler._swap_out_seqs)
    assert not scheduler._forgotten, "ended sequences the worker was never told to drop"
    scheduler.blocks.check_integrity()
    assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks
    scheduler.host.check_integrity([])
    assert scheduler.host.num_free_blocks == scheduler.host.num_blocks, "swap slots still settling or held"
    assert not runner.num_launched
    assert not runner.state.row_of, "the worker keeps rows of ended sequences"
    assert not getattr(runner.grammars, "_seqs", {}), "the worker keeps grammar matchers of ended sequences"
    assert not engine._completions and not engine._silent
    metrics = {metric.name: metric.value for metric in engine.metrics()}
    assert metrics["pagoda_num_requests_running"] == metrics["pagoda_num_requests_waiting"] == 0
    assert metrics["pagoda_kv_cache_usage_ratio"] == 0.0


@pytest.mark.parametrize("async_scheduling,swap_space", [(False, 0.0), (True, 0.002)],
                         ids=["serial-recompute", "async-swap"])
def test_offline_engine_returns_to_idle_after_messy_traffic(tiny_dir: Path, one_thread: None,
                                                            async_scheduling: bool, swap_space: float) -> None:
    """Sampled, n > 1, beam search, JSON-schema, stop-string and one-token requests over shared prefixes, on a
    cache small enough for chunked prefill and preemption (recompute; swap where host slots are free), some aborted
    part way (waiting or running), stepped with and without deltas: the engine ends idle, and the generation
    counter equals the tokens the outputs hold."""
    llm = LLM(str(tiny_dir), max_model_len=256, num_kv_blocks=24, block_size=8, max_num_batched_tokens=32,
              max_num_seqs=8, swap_space=swap_space, async_scheduling=async_scheduling, seed=0)
    engine = llm.engine
    rng = random.Random(2)
    shared = [rng.randrange(100, 40000) for _ in range(24)]
    request_ids = []
    for _ in range(10):
        prompt = shared[:rng.randrange(4, 24)] + [rng.randrange(100, 40000) for _ in range(rng.randrange(0, 24))]
        request_ids.append(engine.add_request(prompt, _random_params(rng)))
    while engine.has_unfinished_requests():
        engine.step(deltas=rng.random() < 0.5)
        if rng.random() < 0.1:
            engine.abort_request(rng.choice(request_ids))
    assert engine.scheduler.stats.num_preemptions > 0
    if swap_space:
        assert engine.scheduler.stats.num_swapped > 0
    outputs = [engine.pop_output(request_id) for request_id in request_ids]
    assert_engine_idle(engine)
    assert not engine._outputs
    metrics = {metric.name: metric.value for metric in engine.metrics()}
    assert metrics["pagoda_generation_tokens"] == sum(len(c.token_ids) for o in outputs for c in o.outputs)
    # every request that got a token was prefilled; one aborted before its first admission never was
    served = sum(len(o.prompt_token_ids) for o in outputs if any(c.token_ids for c in o.outputs))
    assert served <= metrics["pagoda_prompt_tokens"] <= sum(len(o.prompt_token_ids) for o in outputs)
    # and it still serves, from idle
    assert llm.generate([shared], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0].finish_reason
    assert_engine_idle(engine)


def test_n_siblings_leave_no_forked_record(tiny_dir: Path, one_thread: None) -> None:
    """n > 1: the siblings forked from the first sequence's prompt blocks are listed while they wait; once their
    request ends the scheduler keeps no reference to them (nor the worker any row)."""
    llm = LLM(str(tiny_dir), max_model_len=256, num_kv_blocks=24, block_size=8, seed=0)
    [output] = llm.generate([list(range(100, 120))], SamplingParams(temperature=1.0, n=3, max_tokens=2, seed=1))
    assert [len(c.token_ids) for c in output.outputs] == [2, 2, 2]
    assert_engine_idle(llm.engine)


def test_prompt_tokens_count_requests_that_reached_the_model(tiny_dir: Path, one_thread: None) -> None:
    """pagoda_prompt_tokens counts prompt tokens computed (vLLM's vllm:prompt_tokens counts a request's prompt
    when it is prefilled): a request cancelled while it waits adds none, one preempted and recomputed counts once."""
    llm = LLM(str(tiny_dir), max_model_len=256, num_kv_blocks=24, block_size=8, max_num_seqs=1, seed=0)
    engine = llm.engine

    def prompt_tokens() -> float:
        return next(m.value for m in engine.metrics() if m.name == "pagoda_prompt_tokens")

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    served = engine.add_request(list(range(100, 110)), params)
    queued = engine.add_request(list(range(200, 230)), params)  # one seat: it waits
    engine.step()
    assert engine.scheduler.requests[queued].sequences[0].num_computed_tokens == 0
    engine.abort_request(queued)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.pop_output(served).outputs[0].token_ids) == 4
    assert engine.pop_output(queued).outputs[0].token_ids == []
    assert prompt_tokens() == 10, "the cancelled request's prompt was never computed"
    assert_engine_idle(engine)


# ------------------------------------------------------------------------------------------------------------
# the scheduler service, with a plain-Python worker


def test_scheduler_service_tells_the_worker_to_drop_what_ended_when_it_goes_idle(tmp_path: Path) -> None:
    """The served scheduler: requests that finish, stop (a tokenizer's StopSequence), are aborted while running and
    while waiting (a client gone), n > 1 and preempted on a small cache; once none is left the worker has been told
    to drop every sequence (no row, no matcher kept until the next request), and the service keeps no owner, the
    snapshot says idle."""
    import time

    from pagoda.services.scheduler.service import Peer
    from pagoda.shared.messages import AbortRequest, AddRequest, SchedulerToWorker, StepPlan, StopSequence
    from pagoda.shared.messages import SamplingParams as WireParams
    from pagoda.shared.transport import Codec
    from tests.test_async_scheduling import service_on_outboxes
    from tests.test_scheduler import FakeWorker

    to_worker = Codec(SchedulerToWorker)
    with service_on_outboxes(tmp_path, 4, num_kv_blocks=10, block_size=4, max_model_len=64, max_num_batched_tokens=16,
                             max_inflight_plans=2, num_swap_blocks=0) as (service, plans_out, _):
        identity = b"tok0"
        peer = service.tokenizers[identity] = Peer(0.0)
        worker = FakeWorker(4)
        lengths = (9, 14, 5, 11, 7, 3)
        for index, length in enumerate(lengths):
            params = WireParams(temperature=0.0, max_tokens=6 + 4 * index, ignore_eos=True, n=2 if index == 1 else 1)
            service._on_add(identity, peer, AddRequest(f"r{index}", [50 * (index + 1) + i for i in range(length)],
                                                       params))
        endings = {3: StopSequence("r3", 0), 5: AbortRequest("r2"), 6: AbortRequest("r5")}
        for turn in range(200):
            if turn in endings:
                service._on_tokenizer_message(identity, peer, endings[turn])
            service._maybe_step()
            plans = [plan for payload in plans_out.sent if isinstance(plan := to_worker.decode(payload), StepPlan)]
            plans_out.sent.clear()
            results = []
            for plan in plans:  # as the worker does: each plan runs before the next one drops what it ran
                worker.apply(plan)
                if plan.seq_ids:
                    results.append(worker.execute(plan))
            for result in results:
                service._on_result(result)
            if not service.scheduler.has_unfinished() and not service.pipeline.inflight and not plans:
                break
        scheduler = service.scheduler
        assert scheduler.stats.num_preemptions > 0
        assert not scheduler.has_unfinished() and not scheduler._forgotten
        assert worker.state == {}, f"the worker still holds sequences {sorted(worker.state)}"
        assert not service.owner and not peer.request_ids
        scheduler.blocks.check_integrity()
        stats = service._stats(time.monotonic())
        assert (stats.num_running, stats.num_waiting, stats.num_preempted) == (0, 0, 0)
        assert stats.kv_blocks_free == stats.kv_blocks_total and scheduler.host.num_free_blocks == 0


# ------------------------------------------------------------------------------------------------------------
# the served processes


@pytest.fixture(scope="module")
def small_server(tiny_dir: Path) -> Iterator[Server]:
    """`pagoda serve` on the tiny model with a cache of 24 blocks of 8 tokens and 32-token steps: chunked prefill,
    preemption by recompute and by swap; async scheduling (two plans in flight), as on a GPU."""
    with running_server(tiny_dir, "--num-kv-blocks", "24", "--block-size", "8", "--max-num-batched-tokens", "32",
                        "--max-num-seqs", "8", "--swap-space", "0.002", "--max-model-len", "256",
                        "--async-scheduling") as server:
        yield server


def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus_client's own parser, keyed by name and labels."""
    text = http_client().get(server.url + "/metrics", timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and labels.items() <= dict(sample_labels).items())


@dataclass
class Seen:
    """What one client saw: usage (None when it went away part way), finish reasons, tokens streamed."""

    kind: str
    prompt_tokens: int
    usage: dict[str, Any] | None = None
    finish_reasons: list[str] = field(default_factory=list)
    num_streamed: int = 0
    max_tokens: int = 0


def _client(server: Server, model: str, index: int) -> Seen:
    """One request of a random kind; prompts are token ids over a shared prefix, so their lengths are known."""
    rng = random.Random(index)
    prompt = list(range(300, 300 + rng.choice([4, 16, 24]))) + [1000 + index] * rng.randrange(1, 30)
    kind = ["plain", "n", "beam", "stop", "stream", "gone", "chat", "json", "impatient"][index % 9]
    max_tokens = rng.choice([1, 4, 24, 60])
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
                            "seed": index, "ignore_eos": True}
    route = "/v1/completions"
    if kind == "n":
        body["n"] = 3
    elif kind == "beam":
        body.update(use_beam_search=True, n=2, best_of=2, temperature=0.0, max_tokens=min(max_tokens, 6))
    elif kind == "stop":
        body["stop"] = ["ld", "or", "e"]
    elif kind == "gone" and index > 9:  # a chat stream of two completions
        body["n"] = 2
    if kind in ("chat", "json") or (kind == "gone" and index > 9):
        route = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"say {index}"}]
        del body["prompt"]
        if kind == "json":
            body["response_format"] = {"type": "json_object"}
            del body["ignore_eos"]
    seen = Seen(kind, len(prompt), max_tokens=body["max_tokens"] * body.get("n", 1))
    if "messages" in body:  # the chat template's tokens, as the server counts them
        tokenized = http_client().post(server.url + "/tokenize", json={"model": model, "messages": body["messages"]})
        seen.prompt_tokens = tokenized.json()["count"]
    if kind in ("stream", "gone"):
        body.update(stream=True, stream_options={"include_usage": True})
        if kind == "gone":
            body["max_tokens"] = 60
            seen.max_tokens = 60 * body.get("n", 1)
        with http_client().stream("POST", server.url + route, json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                seen.usage = chunk.get("usage") or seen.usage
                for choice in chunk["choices"]:
                    seen.num_streamed += bool(choice.get("text") or choice.get("delta", {}).get("content"))
                    if choice.get("finish_reason"):
                        seen.finish_reasons.append(choice["finish_reason"])
                if kind == "gone" and seen.num_streamed >= 3:
                    return seen  # the client goes away mid-stream: the server aborts the request
        return seen
    if kind == "impatient":  # gives up at once, while its request waits (or has barely started)
        body["max_tokens"] = seen.max_tokens = 60
        try:
            response = http_client().post(server.url + route, json=body, timeout=0.05)
        except httpx.TimeoutException:
            return seen
    else:
        response = http_client().post(server.url + route, json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    seen.usage = data["usage"]
    seen.finish_reasons = [choice["finish_reason"] for choice in data["choices"]]
    return seen


def test_served_engine_returns_to_idle_and_metrics_match_usage(small_server: Server) -> None:
    """Concurrent completions and chats (n > 1, beam search, stop strings, JSON mode, streams with usage, clients
    that leave mid-stream) on a cache that forces chunked prefill and preemption: afterwards every block is free
    (or cached), nothing runs or waits, the api serves nothing; /metrics parses, its counters did not go down, and
    its token counters and histograms agree with what the clients were told."""
    model = http_client().get(small_server.url + "/v1/models").json()["data"][0]["id"]
    before = scrape(small_server)
    with ThreadPoolExecutor(max_workers=16) as pool:
        seen = list(pool.map(lambda i: _client(small_server, model, i), range(18)))

    def idle() -> bool:
        samples = scrape(small_server)
        return (total(samples, "pagoda_num_requests_running") == total(samples, "pagoda_num_requests_waiting") == 0
                and total(samples, "pagoda_kv_blocks_free") == total(samples, "pagoda_kv_blocks_total")
                and http_client().get(small_server.url + "/load").json()["server_load"] == 0)

    wait_until(idle, 30, "the server to go idle")
    gone = [s for s in seen if s.kind == "gone" and not s.finish_reasons]
    assert gone, "no client left mid-stream"
    impatient = [s for s in seen if s.kind == "impatient" and s.usage is None]
    assert impatient, "no client gave up early"
    finished = [s for s in seen if s not in gone and s not in impatient]
    assert all(s.usage is not None for s in finished)
    # usage's prompt_tokens: the ids sent, or /tokenize's count of the chat template's tokens
    assert [s.usage["prompt_tokens"] for s in finished] == [s.prompt_tokens for s in finished]

    def grew(name: str) -> float:  # the scheduler's counters arrive with its next snapshot
        return total(scrape(small_server), name) - total(before, name)

    # a client that left mid-stream had its prompt computed; one that gave up at once may not have
    prompt_tokens = sum(s.usage["prompt_tokens"] for s in finished) + sum(s.prompt_tokens for s in gone)
    wait_until(lambda: prompt_tokens <= grew("pagoda_prompt_tokens_total")
               <= prompt_tokens + sum(s.prompt_tokens for s in impatient), 10, "the prompt tokens counted")
    completion_tokens = sum(s.usage["completion_tokens"] for s in finished)
    generated = grew("pagoda_generation_tokens_total")
    assert (completion_tokens + sum(s.num_streamed for s in gone) <= generated
            <= completion_tokens + sum(s.max_tokens for s in gone + impatient))
    after = scrape(small_server)
    assert total(after, "pagoda_num_preemptions_total") > total(before, "pagoda_num_preemptions_total")
    for (name, labels), value in before.items():
        if name.endswith(("_total", "_count", "_sum", "_bucket")):
            assert after.get((name, labels), 0.0) >= value, f"{name}{dict(labels)} went down"
    num_answered = len(finished)
    assert total(after, "pagoda_e2e_request_latency_seconds_count") - total(
        before, "pagoda_e2e_request_latency_seconds_count") == num_answered
    assert num_answered + len(gone) <= total(after, "pagoda_time_to_first_token_seconds_count") - total(
        before, "pagoda_time_to_first_token_seconds_count") <= len(seen)
    statuses = {route: total(after, "pagoda_http_requests_total", route=route, status="200")
                - total(before, "pagoda_http_requests_total", route=route, status="200")
                for route in ("/v1/completions", "/v1/chat/completions")}
    num_chats = sum(s.kind in ("chat", "json") for s in finished)
    assert statuses == {"/v1/completions": num_answered - num_chats, "/v1/chat/completions": num_chats}
