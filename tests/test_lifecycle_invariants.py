"""Lifecycle and accounting invariants under messy traffic: after any mix of requests ends (finished, stopped,
aborted, preempted by recompute or swap), the engine is idle (every KV block free or only cached, no request or
sequence state left in the scheduler, the worker or the grammar rows, swap space empty), and the token counters
equal what the clients received."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.engine import LLMEngine
from pagoda.shared.messages import StructuredOutputs

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A 2-layer Llama of hidden size 64 over SmolLM2's vocabulary (random weights; its tokenizer and chat template),
    so that stop strings, grammars and chat run at a fraction of SmolLM2's cost."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-lifecycle")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(30.0)  # sharper distributions than the init's
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, folder / name)
    return folder


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
    assert not scheduler._forked_waiting, "ended sequences are still listed as forked and waiting"
    assert not scheduler._unforked_beams and not scheduler._swapped_out_by_step and not scheduler._num_beam_searches
    assert not scheduler._forgotten, "ended sequences the worker was never told to drop"
    scheduler.blocks.check_integrity()
    assert scheduler.blocks.num_free_blocks == scheduler.blocks.num_blocks
    scheduler.host.check_integrity([])
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
    num_prompt_tokens = engine.num_prompt_tokens_total
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
    assert metrics["pagoda_prompt_tokens"] == num_prompt_tokens == sum(len(o.prompt_token_ids) for o in outputs)
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
