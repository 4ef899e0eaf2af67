"""Scheduler policy driven with plain objects and a fake worker that rebuilds its state from the plan diff alone.

The fake worker keeps, per request id, exactly what the real worker keeps (tokens, computed count, block
ids), learned only from StepPlan fields; after every step the test compares that mirror with the
scheduler's own sequences, so a diff that forgot something fails here. Its sampled token depends only on
(sequence id, output index), so a run's outputs do not depend on batching, chunking or preemption.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.services.scheduler.scheduler import PLACEHOLDER, Request, Scheduler, SeqStatus, SeqUpdate
from pagoda.shared.errors import ContextLengthError, InvalidRequestError
from pagoda.shared.messages import FinishReason, SamplingParams, StepPlan, StepResult

EOS = 1
VOCAB_SIZE = 1000
SALTS = ("", "tenant-a", "", "tenant-b")  # cache salts the random workloads draw ("": none)
TokenFn = Callable[[int, int], int]


def default_token(seq_id: int, output_index: int) -> int:
    return (seq_id * 7 + output_index) % 50 + 10  # in [10, 60): never EOS, never a prompt-only id


def make_scheduler(**overrides: object) -> Scheduler:
    config: dict[str, object] = dict(num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=256,
                                     max_model_len=2048, vocab_size=VOCAB_SIZE, eos_token_ids=(EOS,))
    config.update(overrides)
    return Scheduler(**config)  # type: ignore[arg-type]


def make_request(request_id: str, prompt: list[int] | int, max_tokens: int | None = 8, *, priority: int = 0,
                 arrival_time: float = 0.0, cache_salt: str = "", **params: object) -> Request:
    prompt_ids = prompt if isinstance(prompt, list) else [100 + (i % 800) for i in range(prompt)]
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, arrival_time=arrival_time,
                   priority=priority, cache_salt=cache_salt)


@dataclass
class WorkerSeq:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_ids: list[int]
    salt: str = ""


@dataclass
class FakeWorker:
    """The worker's side of the diff, in plain Python; samples token_fn(seq id, output index)."""

    block_size: int
    token_fn: TokenFn = default_token
    state: dict[int, WorkerSeq] = field(default_factory=dict)
    dropped: dict[int, list[int]] = field(default_factory=dict)  # tokens held when last dropped
    num_resent: int = 0  # NewRequests for a request dropped earlier
    num_resent_with_output: int = 0  # ... that carried tokens generated before the drop
    # check_kv: each device block's slots and each host slot hold what was computed there (a digest of the tokens
    # up to that position, as K/V depend on them), copied by the plan's swaps; each step checks what it reads
    check_kv: bool = False
    # sequence id -> its request's cache_salt, mixed into the K/V digests as if K/V depended on it: a read of K/V
    # another salt computed then fails like a read of another prompt's (cache isolation)
    salts: dict[int, str] = field(default_factory=dict)
    kv: dict[int, list[int | None]] = field(default_factory=dict)
    host: dict[int, list[int | None]] = field(default_factory=dict)

    def apply(self, plan: StepPlan) -> None:
        if self.check_kv:  # the worker's order: out to the host, back in, then the rest of the plan
            for block_id, slot in zip(plan.swap_out[0::2], plan.swap_out[1::2], strict=True):
                self.host[slot] = list(self.kv.get(block_id, [None] * self.block_size))
            for slot, block_id in zip(plan.swap_in[0::2], plan.swap_in[1::2], strict=True):
                self.kv[block_id] = list(self.host[slot])
        for seq_id in plan.finished_seq_ids:
            assert seq_id in self.state, f"told to drop {seq_id}, which it never had"
            self.dropped[seq_id] = self.state.pop(seq_id).token_ids
        for new in plan.new_requests:
            assert new.seq_id not in self.state, f"request {new.seq_id} sent twice"
            assert 0 <= new.num_computed_tokens < len(new.token_ids)
            if new.seq_id in self.dropped:  # recompute after a preemption: same tokens, output included
                assert new.token_ids == self.dropped[new.seq_id]
                self.num_resent += 1
                self.num_resent_with_output += len(new.token_ids) > new.num_prompt_tokens
            self.state[new.seq_id] = WorkerSeq(list(new.token_ids), new.num_prompt_tokens,
                                               new.num_computed_tokens, list(new.block_ids),
                                               self.salts.get(new.seq_id, ""))
        for seq_id, block_id in zip(plan.appended_block_seq_ids, plan.appended_block_ids, strict=True):
            self.state[seq_id].block_ids.append(block_id)

    def execute(self, plan: StepPlan) -> StepResult:
        sampled_ids: list[int] = []
        sampled_tokens: list[int] = []
        for seq_id, count in zip(plan.seq_ids, plan.num_scheduled_tokens, strict=True):
            seq = self.state[seq_id]
            assert count >= 1
            if self.check_kv:
                self._read_and_write(seq, count)
            seq.num_computed += count
            assert seq.num_computed <= len(seq.token_ids), "plan schedules tokens the worker does not have"
            assert seq.num_computed <= len(seq.block_ids) * self.block_size, "no KV slot for a token"
            if seq.num_computed == len(seq.token_ids):
                token = self.token_fn(seq_id, len(seq.token_ids) - seq.num_prompt_tokens)
                seq.token_ids.append(token)
                sampled_ids.append(seq_id)
                sampled_tokens.append(token)
        return StepResult(step_id=plan.step_id, seq_ids=sampled_ids, sampled_token_ids=sampled_tokens)


    def _read_and_write(self, seq: WorkerSeq, count: int) -> None:
        """The K/V a step reads (every computed position) must be this sequence's; it writes its new positions."""
        size = self.block_size
        digests = _prefix_digests(seq.token_ids, seq.num_computed + count, seq.salt)
        for position, digest in enumerate(digests):
            block = self.kv.setdefault(seq.block_ids[position // size], [None] * size)
            if position < seq.num_computed:
                assert block[position % size] == digest, f"position {position} reads another sequence's K/V"
            else:
                block[position % size] = digest


def _prefix_digests(token_ids: list[int], length: int, salt: str = "") -> list[int]:
    """A digest per position of the tokens up to it (what that position's K/V depend on), and of the salt."""
    digests, digest = [], hash(salt) if salt else 0
    for token in token_ids[:length]:
        digest = hash((digest, token))
        digests.append(digest)
    return digests


def add_salted(sched: Scheduler, worker: FakeWorker, request: Request) -> None:
    """Queue a request and tell the fake worker its sequences' cache salt (their K/V digests mix it in)."""
    sched.add_request(request)
    worker.salts.update((seq.seq_id, request.cache_salt) for seq in request.sequences)


def live_tables(sched: Scheduler) -> list:
    return [seq.table for request in sched.requests.values() for seq in request.sequences if not seq.is_finished]


def step(sched: Scheduler, worker: FakeWorker,
         while_running: Callable[[], object] | None = None) -> tuple[StepPlan, list[SeqUpdate]]:
    """One schedule -> worker -> update round, checking every invariant a step must keep."""
    plan = sched.schedule()
    assert sum(plan.num_scheduled_tokens) <= sched.max_num_batched_tokens
    assert len(plan.seq_ids) == len(plan.num_scheduled_tokens) <= sched.max_num_seqs
    assert len(set(plan.seq_ids)) == len(plan.seq_ids)
    assert len(sched.running) <= sched.max_num_seqs
    worker.apply(plan)
    assert set(worker.state) == {seq.seq_id for seq in sched.running}, "worker and scheduler disagree on who runs"
    result = worker.execute(plan)
    if while_running is not None:
        while_running()  # e.g. an abort that lands while the worker runs the step
    updates = sched.update(plan, result)
    sched.blocks.check_integrity(live_tables(sched))
    assert sched.num_waiting_requests == len({seq.request.request_id for seq in sched.waiting if not seq.is_finished})
    sched.host.check_integrity([seq.swapped for request in sched.requests.values() for seq in request.sequences
                                if seq.swapped is not None])
    for seq in sched.running:
        mirror = worker.state[seq.seq_id]
        assert mirror.token_ids == seq.token_ids
        assert mirror.num_computed == seq.num_computed_tokens
        assert mirror.block_ids == seq.table.block_ids
    return plan, updates


def run_until_done(sched: Scheduler, worker: FakeWorker, max_steps: int = 10_000) -> list[StepPlan]:
    plans = []
    while sched.has_unfinished():
        assert len(plans) < max_steps, "the scheduler stopped making progress"
        plans.append(step(sched, worker)[0])
    return plans


def outputs(requests: list[Request]) -> dict[tuple[str, int], list[int]]:
    return {(r.request_id, seq.index): seq.token_ids[seq.num_prompt_tokens:] for r in requests for seq in r.sequences}


def assert_all_free(sched: Scheduler) -> None:
    assert sched.blocks.num_free_blocks == sched.blocks.num_blocks
    sched.host.settle()
    assert sched.host.num_free_blocks == sched.host.num_blocks
    sched.blocks.check_integrity(tables=[])
    assert not sched.running and not sched.requests


# ---------------------------------------------------------------- a. random workload


@pytest.mark.parametrize("seed", range(16))
def test_random_workload_keeps_budget_integrity_and_finishes(seed: int) -> None:
    """Shared prefixes under different cache salts: a step that read K/V cached for another salt would fail the
    fake worker's check, as one reading another prompt's would."""
    rng = random.Random(seed)
    block_size = rng.choice([8, 16])
    sched = make_scheduler(num_blocks=rng.choice([24, 32]) * 16 // block_size, block_size=block_size,
                           max_num_seqs=rng.choice([4, 8]), max_num_batched_tokens=rng.choice([64, 128, 256]),
                           max_model_len=512, seed=seed, num_swap_blocks=rng.choice([0, 8, 64]))
    worker = FakeWorker(block_size, check_kv=True)
    shared_prefixes = [[rng.randrange(2, VOCAB_SIZE) for _ in range(64)] for _ in range(3)]
    arrivals: list[tuple[int, Request]] = []
    for index in range(24):
        num_prompt = rng.randint(1, 300)
        prompt = [rng.randrange(2, VOCAB_SIZE) for _ in range(num_prompt)]
        if rng.random() < 0.4:
            prompt = (rng.choice(shared_prefixes) + prompt)[:num_prompt]
        n = rng.choice([1, 1, 1, 2, 3])
        request = make_request(f"r{index}", prompt, rng.randint(1, 40), n=n, priority=rng.randint(0, 2),
                               arrival_time=float(index), cache_salt=SALTS[index % len(SALTS)])
        arrivals.append((rng.randint(0, 20), request))
    arrivals.sort(key=lambda item: item[0])
    requests = [request for _, request in arrivals]

    num_steps = 0
    while arrivals or sched.has_unfinished():
        while arrivals and arrivals[0][0] <= num_steps:
            add_salted(sched, worker, arrivals.pop(0)[1])
        step(sched, worker)
        num_steps += 1
        assert num_steps < 5_000, "the scheduler stopped making progress"

    for request in requests:
        assert len(request.sequences) == request.sampling.n
        for seq in request.sequences:
            assert seq.status == SeqStatus.FINISHED and seq.finish_reason == FinishReason.LENGTH
            assert seq.num_output_tokens == request.sampling.max_tokens
            assert seq.token_ids[seq.num_prompt_tokens:] == [
                default_token(seq.seq_id, i) for i in range(seq.num_output_tokens)]
    assert sched.stats.num_preemptions > 0, "the pool is meant to be small enough to preempt"
    assert_all_free(sched)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_small_workloads_with_aborts(data: st.DataObject) -> None:
    """Tiny pools, budgets down to 1 token, n up to 3, shared prefixes (under a few cache salts), aborts before and
    during steps."""
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    num_blocks = data.draw(st.integers(max(2, -(-2 // block_size)), max(2, 64 // block_size)), label="num_blocks")
    max_model_len = data.draw(st.integers(2, min(64, num_blocks * block_size)), label="max_model_len")
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
                           max_num_seqs=data.draw(st.integers(1, 4), label="max_num_seqs"),
                           max_num_batched_tokens=data.draw(st.integers(1, 48), label="budget"),
                           enable_prefix_caching=data.draw(st.booleans(), label="prefix_caching"),
                           num_swap_blocks=data.draw(st.sampled_from([0, 2, 64]), label="swap_blocks"))
    worker = FakeWorker(block_size, check_kv=True)
    arrivals: list[tuple[int, Request]] = []
    abort_at: dict[str, tuple[int, bool]] = {}  # request id -> (step, during the step?)
    for index in range(data.draw(st.integers(1, 8), label="num_requests")):
        num_prompt = data.draw(st.integers(1, max_model_len - 1))
        prompt = data.draw(st.lists(st.integers(2, 3), min_size=num_prompt, max_size=num_prompt))
        request = make_request(f"r{index}", prompt, data.draw(st.integers(1, max_model_len - num_prompt)),
                               n=data.draw(st.integers(1, 3)), priority=data.draw(st.integers(0, 2)),
                               arrival_time=float(index), cache_salt=data.draw(st.sampled_from(SALTS)))
        arrival = data.draw(st.integers(0, 10))
        arrivals.append((arrival, request))
        if data.draw(st.integers(0, 3)) == 0:
            abort_at[request.request_id] = (arrival + data.draw(st.integers(0, 20)), data.draw(st.booleans()))
    arrivals.sort(key=lambda item: item[0])
    requests = [request for _, request in arrivals]

    num_steps = 0
    while arrivals or sched.has_unfinished():
        while arrivals and arrivals[0][0] <= num_steps:
            add_salted(sched, worker, arrivals.pop(0)[1])
        due = [(request_id, during) for request_id, (at, during) in abort_at.items() if at == num_steps]
        for request_id in [request_id for request_id, during in due if not during]:
            sched.abort_request(request_id)
        mid_step = [request_id for request_id, during in due if during]
        step(sched, worker, lambda ids=mid_step: [sched.abort_request(request_id) for request_id in ids])
        num_steps += 1
        assert num_steps < 20_000, "the scheduler stopped making progress"

    for request in requests:
        for seq in request.sequences:
            assert seq.is_finished
            if seq.finish_reason == FinishReason.ABORT:
                assert request.request_id in abort_at
                assert seq.num_output_tokens < request.sampling.max_tokens
            else:
                assert seq.finish_reason == FinishReason.LENGTH
                assert seq.num_output_tokens == request.sampling.max_tokens
            assert seq.token_ids[seq.num_prompt_tokens:] == [
                default_token(seq.seq_id, i) for i in range(seq.num_output_tokens)]
    assert_all_free(sched)


def test_waiting_siblings_give_back_their_forked_blocks_when_nothing_can_run() -> None:
    """Regression: forked siblings waiting in the queue held blocks nothing could reclaim (deadlock)."""
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64)
    worker = FakeWorker(4)
    forked = make_request("forked", [100 + i for i in range(25)], max_tokens=2, n=2, priority=2)
    sched.add_request(forked)
    step(sched, worker)
    sibling = forked.sequences[1]
    assert len(sibling.table.block_ids) == 6 and sibling.status == SeqStatus.WAITING  # max_num_seqs=1
    urgent = make_request("urgent", [500 + i for i in range(30)], max_tokens=2, priority=0)
    sched.add_request(urgent)  # needs 8 of the 4 blocks the waiting sibling leaves
    run_until_done(sched, worker, max_steps=50)
    assert urgent.sequences[0].finish_reason == FinishReason.LENGTH
    assert all(seq.num_output_tokens == 2 for seq in forked.sequences)
    assert_all_free(sched)


def test_head_blocked_by_waiting_siblings_with_nothing_running_is_admitted() -> None:
    """Regression: nothing runs, the head's cache hits are all the free blocks, forked siblings hold the rest."""
    sched = make_scheduler(num_blocks=5, block_size=1, max_model_len=5, max_num_seqs=2, max_num_batched_tokens=5)
    worker = FakeWorker(1)
    forked = make_request("forked", [2, 2, 3, 2], max_tokens=1, n=2, priority=1, arrival_time=0.0)
    filler = make_request("filler", [3, 3], max_tokens=1, priority=2, arrival_time=1.0)
    sched.add_request(forked)
    sched.add_request(filler)
    step(sched, worker)
    assert len(forked.sequences[1].table.block_ids) == 3 and forked.sequences[1].status == SeqStatus.WAITING
    urgent = make_request("urgent", [3, 3, 2], max_tokens=1, priority=0, arrival_time=2.0)  # hits filler's blocks
    sched.add_request(urgent)
    run_until_done(sched, worker, max_steps=50)
    assert urgent.sequences[0].finish_reason == FinishReason.LENGTH
    assert all(seq.num_output_tokens == 1 for seq in forked.sequences)
    assert_all_free(sched)


def test_runner_blocked_by_a_waiting_sibling_takes_its_blocks_instead_of_thrashing() -> None:
    """Regression: the only runner needed a block a waiting sibling held; it was preempted and re-admitted forever."""
    sched = make_scheduler(num_blocks=2, block_size=4, max_model_len=8, max_num_seqs=1, max_num_batched_tokens=1,
                           enable_prefix_caching=False)
    worker = FakeWorker(4)
    forked = make_request("forked", [2] * 5, max_tokens=1, n=2, arrival_time=1.0)
    sched.add_request(forked)
    step(sched, worker)
    runner = make_request("runner", [3], max_tokens=7, arrival_time=0.0)  # ranks first; needs both blocks
    sched.add_request(runner)
    run_until_done(sched, worker, max_steps=100)
    assert runner.sequences[0].num_output_tokens == 7
    assert runner.sequences[0].num_preemptions == 0
    assert all(seq.num_output_tokens == 1 for seq in forked.sequences)
    assert_all_free(sched)


# ---------------------------------------------------------------- b. chunked prefill beside decodes


def test_long_prompt_does_not_stall_decoders() -> None:
    budget = 512
    sched = make_scheduler(num_blocks=1024, max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=8192)
    worker = FakeWorker(16)
    decoders = [make_request(f"d{i}", 10 + i, max_tokens=40) for i in range(8)]
    for request in decoders:
        sched.add_request(request)
    for _ in range(3):
        step(sched, worker)
    decoder_ids = {request.sequences[0].seq_id for request in decoders}
    assert all(seq.num_output_tokens == 3 for seq in (r.sequences[0] for r in decoders))

    long_request = make_request("long", 4000, max_tokens=4)
    sched.add_request(long_request)
    long_seq = long_request.sequences[0]
    num_prefill_steps = 0
    while sched.has_unfinished():
        unfinished = {seq_id for seq_id in decoder_ids if sched.get_sequence(seq_id) is not None}
        remaining = long_seq.num_prompt_tokens - long_seq.num_computed_tokens
        plan, _ = step(sched, worker)
        scheduled = dict(zip(plan.seq_ids, plan.num_scheduled_tokens, strict=True))
        for seq_id in unfinished:
            assert scheduled.get(seq_id) == 1, "a decoding sequence was left out of a step"
        if remaining > 0:
            num_prefill_steps += 1
            assert unfinished == decoder_ids, "the decoders were meant to outlive the long prefill"
            assert scheduled[long_seq.seq_id] == min(remaining, budget - len(unfinished))
    assert num_prefill_steps == -(-4000 // (budget - 8))
    assert long_seq.finish_reason == FinishReason.LENGTH and long_seq.num_output_tokens == 4
    assert_all_free(sched)


# ---------------------------------------------------------------- c. priority


def first_scheduled_order(sched: Scheduler, worker: FakeWorker) -> list[int]:
    order: list[int] = []
    for plan in run_until_done(sched, worker):
        order.extend(new.seq_id for new in plan.new_requests)
    return order


def test_priority_then_arrival_decides_who_runs_first() -> None:
    sched = make_scheduler(max_num_seqs=1)
    specs = {"p2-t0": (2, 0.0), "p0-t3": (0, 3.0), "p1-t1": (1, 1.0), "p0-t2": (0, 2.0), "p1-t05": (1, 0.5)}
    requests = {name: make_request(name, 20, max_tokens=3, priority=p, arrival_time=t)
                for name, (p, t) in specs.items()}
    for request in requests.values():
        sched.add_request(request)
    order = first_scheduled_order(sched, FakeWorker(16))
    names = [next(n for n, r in requests.items() if r.sequences[0].seq_id == seq_id) for seq_id in order]
    assert names == ["p0-t2", "p0-t3", "p1-t05", "p1-t1", "p2-t0"]


def test_later_urgent_request_overtakes_the_waiting_queue_but_not_the_running_one() -> None:
    sched = make_scheduler(max_num_seqs=1)
    worker = FakeWorker(16)
    first = make_request("first", 20, max_tokens=5, priority=1, arrival_time=0.0)
    queued = make_request("queued", 20, max_tokens=5, priority=1, arrival_time=1.0)
    sched.add_request(first)
    sched.add_request(queued)
    step(sched, worker)
    urgent = make_request("urgent", 20, max_tokens=5, priority=0, arrival_time=2.0)
    sched.add_request(urgent)
    order = first_scheduled_order(sched, worker)
    assert order == [urgent.sequences[0].seq_id, queued.sequences[0].seq_id]
    assert first.sequences[0].num_preemptions == 0


def test_block_pressure_preempts_the_lowest_ranked_sequence() -> None:
    # 6 blocks of 4 tokens: three 7-token prompts take 2 blocks each; the 9th token needs a third block.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    worker = FakeWorker(4)
    late_urgent = make_request("late-urgent", [200] * 7, max_tokens=10, priority=0, arrival_time=5.0)
    latest = make_request("latest", [300] * 7, max_tokens=10, priority=1, arrival_time=2.0)  # added before `early`
    early = make_request("early", [400] * 7, max_tokens=10, priority=1, arrival_time=1.0)
    sched.add_request(latest)
    sched.add_request(early)
    step(sched, worker)
    sched.add_request(late_urgent)  # admitted after the others, yet it ranks first among the running
    step(sched, worker)
    assert sched.blocks.num_free_blocks == 0 and sched.stats.num_preemptions == 0
    victim = latest.sequences[0]
    plan, _ = step(sched, worker)
    assert sched.stats.num_preemptions == 1
    assert victim.status == SeqStatus.WAITING and victim.num_preemptions == 1 and victim.table.block_ids == []
    assert late_urgent.sequences[0].status == early.sequences[0].status == SeqStatus.RUNNING
    assert late_urgent.sequences[0].seq_id in plan.seq_ids and victim.seq_id not in plan.seq_ids
    assert plan.finished_seq_ids == [victim.seq_id]
    assert plan.new_requests == []  # no admission in a step that had to preempt
    run_until_done(sched, worker)
    for request in (latest, early, late_urgent):
        assert request.sequences[0].num_output_tokens == 10
    assert_all_free(sched)


# ---------------------------------------------------------------- d. preemption by recompute


def test_preempted_sequences_recompute_to_the_same_outputs() -> None:
    def workload() -> list[Request]:
        rng = random.Random(7)
        return [make_request(f"r{i}", [rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(20, 100))],
                             rng.randint(20, 40)) for i in range(12)]

    def run(num_blocks: int) -> tuple[Scheduler, FakeWorker, list[Request]]:
        sched = make_scheduler(num_blocks=num_blocks, block_size=8, max_num_seqs=8, max_num_batched_tokens=128,
                               max_model_len=256)
        worker = FakeWorker(8)
        requests = workload()
        for request in requests:
            sched.add_request(request)
        run_until_done(sched, worker)
        assert_all_free(sched)
        return sched, worker, requests

    small, small_worker, small_requests = run(num_blocks=30)
    huge, _, huge_requests = run(num_blocks=4096)
    assert small.stats.num_preemptions > 0 and huge.stats.num_preemptions == 0
    assert small_worker.num_resent_with_output > 0, "no preempted sequence came back with its output"
    assert outputs(small_requests) == outputs(huge_requests)
    for request in small_requests:
        assert request.sequences[0].finish_reason == FinishReason.LENGTH
        assert request.sequences[0].num_output_tokens == request.sampling.max_tokens


def test_preempted_sequences_swap_to_the_same_outputs_with_less_computed() -> None:
    """With host slots, preempted sequences' blocks go out and come back (the fake worker checks every K/V a
    step reads): the same outputs as with no preemption, and fewer tokens computed than recomputing them."""
    def run(num_blocks: int, num_swap_blocks: int) -> tuple[Scheduler, FakeWorker, list[Request], int]:
        rng = random.Random(7)
        requests = [make_request(f"r{i}", [rng.randrange(2, VOCAB_SIZE) for _ in range(rng.randint(20, 100))],
                                 rng.randint(20, 40)) for i in range(12)]
        sched = make_scheduler(num_blocks=num_blocks, block_size=8, max_num_seqs=8, max_num_batched_tokens=128,
                               max_model_len=256, num_swap_blocks=num_swap_blocks)
        worker = FakeWorker(8, check_kv=True)
        for request in requests:
            sched.add_request(request)
        computed = sum(sum(plan.num_scheduled_tokens) for plan in run_until_done(sched, worker))
        assert_all_free(sched)
        return sched, worker, requests, computed

    swapped, swap_worker, swapped_requests, swapped_computed = run(num_blocks=30, num_swap_blocks=64)
    recomputed, _, _, recomputed_computed = run(num_blocks=30, num_swap_blocks=0)
    _, _, roomy_requests, roomy_computed = run(num_blocks=4096, num_swap_blocks=0)
    assert swapped.stats.num_preemptions > 0 and swapped.stats.num_swapped == swapped.stats.num_preemptions
    assert recomputed.stats.num_swapped == 0 and recomputed.stats.num_preemptions > 0
    assert swap_worker.num_resent_with_output > 0, "no swapped sequence came back with its output"
    assert outputs(swapped_requests) == outputs(roomy_requests)
    assert roomy_computed <= swapped_computed < recomputed_computed


def test_a_swapped_sequence_comes_back_from_its_host_slots() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                           num_swap_blocks=4)
    worker = FakeWorker(4, check_kv=True)
    latest = make_request("latest", [300 + i for i in range(7)], max_tokens=10, priority=1, arrival_time=2.0)
    early = make_request("early", [400 + i for i in range(7)], max_tokens=10, priority=1, arrival_time=1.0)
    urgent = make_request("urgent", [200 + i for i in range(7)], max_tokens=10, priority=0, arrival_time=5.0)
    for request in (latest, early, urgent):
        sched.add_request(request)
    victim = latest.sequences[0]
    for _ in range(20):  # the 9th token of the three needs a 7th block
        held = list(victim.table.block_ids)
        plan, _ = step(sched, worker)
        if sched.stats.num_preemptions:
            break
    assert victim.status == SeqStatus.WAITING and victim.swapped is not None and victim.table.block_ids == []
    assert plan.swap_out == [item for pair in zip(held, victim.swapped, strict=True) for item in pair]
    assert victim.num_swapped_tokens == 8 and plan.new_requests == [] and plan.swap_in == []
    slots, num_tokens = list(victim.swapped), victim.num_tokens
    for _ in range(40):
        plan, _ = step(sched, worker)
        if victim.status != SeqStatus.WAITING:
            break
    (new,) = [new for new in plan.new_requests if new.seq_id == victim.seq_id]
    assert new.num_computed_tokens == 8 and new.token_ids == victim.token_ids[:num_tokens]
    assert plan.swap_in == [item for pair in zip(slots, new.block_ids[:2], strict=True) for item in pair]
    assert sched.host.num_free_blocks == 2, "slots read by this plan's copies are not free before the next plan"
    run_until_done(sched, worker)
    assert victim.num_output_tokens == 10 and victim.num_preemptions == 1
    assert_all_free(sched)


def test_preemption_recomputes_when_the_host_slots_run_out() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                           num_swap_blocks=1)  # the victim holds 2 full blocks
    worker = FakeWorker(4, check_kv=True)
    for index, request_id in enumerate(("latest", "early", "urgent")):
        sched.add_request(make_request(request_id, [300 + 10 * index + i for i in range(7)], max_tokens=10,
                                       priority=int(request_id != "urgent"), arrival_time=float(2 - index)))
    plans = run_until_done(sched, worker)
    assert sched.stats.num_preemptions > 0 and sched.stats.num_swapped == 0
    assert not any(plan.swap_out or plan.swap_in for plan in plans)
    assert_all_free(sched)


def test_an_aborted_swapped_sequence_gives_its_slots_back() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                           num_swap_blocks=4)
    worker = FakeWorker(4, check_kv=True)
    latest = make_request("latest", [300 + i for i in range(7)], max_tokens=10, priority=1, arrival_time=2.0)
    for request in (latest, make_request("early", [400 + i for i in range(7)], max_tokens=10, priority=1,
                                         arrival_time=1.0),
                    make_request("urgent", [200 + i for i in range(7)], max_tokens=10, arrival_time=5.0)):
        sched.add_request(request)
    for _ in range(20):
        step(sched, worker)
        if latest.sequences[0].swapped is not None:
            break
    assert sched.host.num_free_blocks == 2
    sched.abort_request("latest")
    assert sched.host.num_free_blocks == 4 and latest.sequences[0].swapped is None
    run_until_done(sched, worker)
    assert_all_free(sched)


def test_a_plan_that_runs_nothing_swaps_nothing_out() -> None:
    """Two plans in flight, 3 blocks of 4: `high` reaches max_len with its last token in flight (nothing left to
    run) holding 2 blocks, so `low`'s decode finds no block and no victim and `low` is preempted by a plan that runs
    nothing. Such a plan gets no result, so a failure of its copies could not end `low` (swapped_out_by): it would
    come back from slots never written. It recomputes instead."""
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                           max_inflight_plans=2, num_swap_blocks=4)
    worker = FakeWorker(4, check_kv=True)
    high = make_request("high", [200, 201, 202, 203], max_tokens=2, arrival_time=0.0)
    low = make_request("low", [300, 301, 302, 303], max_tokens=6, arrival_time=1.0)
    sched.add_request(high)
    sched.add_request(low)
    inflight: deque[tuple[StepPlan, StepResult]] = deque()
    for _ in range(2):  # both prefill; then high's last decode takes the last block
        plan = sched.schedule()
        worker.apply(plan)
        inflight.append((plan, worker.execute(plan)))
    sched.update(*inflight.popleft())
    plan = sched.schedule()
    worker.apply(plan)
    victim = low.sequences[0]
    assert plan.seq_ids == [] and plan.finished_seq_ids == [victim.seq_id] and victim.num_preemptions == 1
    assert plan.swap_out == [] and victim.swapped is None and sched.swapped_out_by(plan.step_id) == []
    assert sched.stats.num_swapped == 0 and sched.host.num_free_blocks == 4
    sched.update(*inflight.popleft())
    run_until_done(sched, worker)
    for request in (high, low):
        seq = request.sequences[0]
        assert seq.token_ids[seq.num_prompt_tokens:] == [default_token(seq.seq_id, i)
                                                         for i in range(request.sampling.max_tokens)]
    assert_all_free(sched)


# ---------------------------------------------------------------- e. prefix caching


def first_new_request(sched: Scheduler, worker: FakeWorker, request: Request):
    plan, _ = step(sched, worker)
    (new,) = [new for new in plan.new_requests if new.seq_id == request.sequences[0].seq_id]
    count = dict(zip(plan.seq_ids, plan.num_scheduled_tokens, strict=True))[new.seq_id]
    return new, count


def test_prefix_cache_hit_after_the_first_request_finishes() -> None:
    sched = make_scheduler(block_size=16)
    worker = FakeWorker(16)
    shared = [2 + i for i in range(64)]
    first = make_request("first", shared + [500 + i for i in range(10)], max_tokens=3)
    sched.add_request(first)
    new_first, _ = first_new_request(sched, worker, first)
    assert new_first.num_computed_tokens == 0
    run_until_done(sched, worker)

    second = make_request("second", shared + [700 + i for i in range(10)], max_tokens=3)
    sched.add_request(second)
    new_second, count = first_new_request(sched, worker, second)
    assert new_second.num_computed_tokens == 64 and count == 10
    assert new_second.block_ids[:4] == new_first.block_ids[:4]
    assert second.sequences[0].num_cached_tokens == 64
    assert sched.stats.prefix_hit_tokens == 64 and sched.stats.prefix_query_tokens == 74 + 74
    run_until_done(sched, worker)

    # the whole prompt cached: its last block is recomputed anyway so the step has a token to sample from
    whole = make_request("whole", list(shared), max_tokens=3)
    sched.add_request(whole)
    new_whole, count = first_new_request(sched, worker, whole)
    assert new_whole.num_computed_tokens == 48 and count == 16
    assert sched.stats.prefix_hit_tokens == 64 + 48
    run_until_done(sched, worker)
    assert whole.sequences[0].token_ids[64:] == [default_token(whole.sequences[0].seq_id, i) for i in range(3)]
    assert_all_free(sched)


def test_prefix_cache_hit_on_a_running_sequence() -> None:
    sched = make_scheduler(block_size=16)
    worker = FakeWorker(16)
    shared = [2 + i for i in range(40)]
    first = make_request("first", shared + [3], max_tokens=20)
    sched.add_request(first)
    step(sched, worker)
    second = make_request("second", shared + [4], max_tokens=3)
    sched.add_request(second)
    new_second, _ = first_new_request(sched, worker, second)
    assert new_second.num_computed_tokens == 32
    assert new_second.block_ids[:2] == first.sequences[0].table.block_ids[:2]
    run_until_done(sched, worker)
    assert_all_free(sched)


def test_no_hits_with_prefix_caching_disabled() -> None:
    sched = make_scheduler(block_size=16, enable_prefix_caching=False)
    worker = FakeWorker(16)
    prompt = list(range(2, 70))
    for name in ("a", "b"):
        request = make_request(name, prompt, max_tokens=2)
        sched.add_request(request)
        new, count = first_new_request(sched, worker, request)
        assert new.num_computed_tokens == 0 and count == len(prompt)
        run_until_done(sched, worker)
    assert sched.stats.prefix_hit_tokens == 0 and sched.blocks.num_cached_blocks == 0
    assert sched.stats.prefix_query_tokens == 0, "nothing was looked up"
    assert sched.stats.prompt_tokens == 2 * len(prompt)
    assert_all_free(sched)


def test_only_prompts_looked_up_count_as_prefix_cache_queries() -> None:
    """The query counter (vllm:prefix_cache_queries, the console's hit rate) counts the prompt tokens looked up in
    the cache, as vLLM's: a prompt_logprobs request, which skips the cache for its prompt, is no query (it was one,
    a miss of its whole prompt, under a hit rate that only fell however often its prompt was cached)."""
    sched = make_scheduler(block_size=16)
    worker = FakeWorker(16)
    prompt = list(range(2, 70))
    for name, params in (("plain", {}), ("scored", {"prompt_logprobs": 1}), ("again", {})):
        request = make_request(name, prompt, max_tokens=2, **params)
        sched.add_request(request)
        run_until_done(sched, worker)
    assert sched.stats.prefix_query_tokens == 2 * len(prompt)
    assert sched.stats.prefix_hit_tokens == 64  # "again": four blocks; "scored" found none, as it looked for none
    assert sched.stats.prompt_tokens == 3 * len(prompt)
    assert_all_free(sched)


def test_requests_share_prefix_blocks_only_under_the_same_cache_salt() -> None:
    """vLLM's cache_salt: the same prompt hits under its own salt (counted as a prefix-cache hit), never under
    another salt nor unsalted; an unsalted request still hits the unsalted chain."""
    sched = make_scheduler(block_size=16)
    worker = FakeWorker(16, check_kv=True)
    shared = [2 + i for i in range(64)]

    def admit(name: str, cache_salt: str) -> tuple[int, list[int]]:
        request = make_request(name, shared + [500 + i for i in range(10)], max_tokens=3, cache_salt=cache_salt)
        add_salted(sched, worker, request)
        new, _ = first_new_request(sched, worker, request)
        run_until_done(sched, worker)
        return new.num_computed_tokens, new.block_ids[:4]

    computed, salted_blocks = admit("a1", "tenant-a")
    assert computed == 0
    assert admit("a2", "tenant-a") == (64, salted_blocks)
    assert sched.stats.prefix_hit_tokens == 64
    assert admit("b", "tenant-b")[0] == 0
    computed, unsalted_blocks = admit("plain1", "")
    assert computed == 0 and not set(unsalted_blocks) & set(salted_blocks)
    assert admit("plain2", "") == (64, unsalted_blocks)
    assert sched.stats.prefix_hit_tokens == 128 and sched.stats.prefix_query_tokens == 5 * 74
    assert_all_free(sched)


def test_a_preempted_salted_sequence_recomputes_from_its_salts_blocks() -> None:
    """Recompute after a preemption looks the prefix up under the request's own salt (the fake worker's K/V digests
    mix the salt in: a block cached by the unsalted twin would fail its check)."""
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    worker = FakeWorker(4, check_kv=True)
    prompt = [300 + i for i in range(9)]
    twin = make_request("twin", list(prompt), max_tokens=2, arrival_time=0.0)
    add_salted(sched, worker, twin)
    run_until_done(sched, worker)  # the unsalted twin's prompt blocks stay cached
    victim = make_request("victim", list(prompt), max_tokens=12, priority=1, arrival_time=1.0, cache_salt="s")
    urgent = make_request("urgent", [200 + i for i in range(9)], max_tokens=12, priority=0, arrival_time=2.0)
    add_salted(sched, worker, victim)
    step(sched, worker)
    assert victim.sequences[0].num_cached_tokens == 0  # the twin's blocks are another chain
    add_salted(sched, worker, urgent)
    while not victim.sequences[0].num_preemptions:
        step(sched, worker)
    plans = run_until_done(sched, worker)
    (readmitted,) = [new for plan in plans for new in plan.new_requests if new.seq_id == victim.sequences[0].seq_id]
    assert readmitted.num_computed_tokens >= 8  # its own two salted prompt blocks, still cached
    assert victim.sequences[0].finish_reason == FinishReason.LENGTH
    assert_all_free(sched)


def test_an_oversized_cache_salt_from_a_peer_is_refused() -> None:
    sched = make_scheduler()
    with pytest.raises(InvalidRequestError) as info:
        sched.validate(make_request("salty", 10, cache_salt="x" * 1025))
    assert info.value.param == "cache_salt"
    sched.validate(make_request("fine", 10, cache_salt="x" * 1024))


# ---------------------------------------------------------------- f. n > 1


def test_n_siblings_fork_after_the_first_prefill() -> None:
    sched = make_scheduler(num_blocks=64, block_size=16)
    worker = FakeWorker(16)
    request = make_request("n3", 40, max_tokens=5, n=3)
    sched.add_request(request)
    first, *siblings = request.sequences
    assert len(siblings) == 2

    plan, _ = step(sched, worker)
    assert plan.seq_ids == [first.seq_id] and plan.num_scheduled_tokens == [40]
    shared = first.table.block_ids[:2]  # (40 - 1) // 16 full blocks
    assert len(first.table.block_ids) == 3
    for sibling in siblings:
        assert sibling.table.block_ids == shared and sibling.num_computed_tokens == 32
    sched.blocks.check_integrity([seq.table for seq in request.sequences])  # ref counts: 3 holders each
    assert sched.blocks.num_free_blocks == 64 - 3

    plan, _ = step(sched, worker)
    news = {new.seq_id: new for new in plan.new_requests}
    assert set(news) == {sibling.seq_id for sibling in siblings}
    scheduled = dict(zip(plan.seq_ids, plan.num_scheduled_tokens, strict=True))
    assert scheduled[first.seq_id] == 1
    for sibling in siblings:
        new = news[sibling.seq_id]
        assert new.num_computed_tokens == 32 and new.block_ids[:2] == shared and len(new.block_ids) == 3
        assert new.token_ids == request.prompt_token_ids and scheduled[sibling.seq_id] == 8
    assert sched.blocks.num_free_blocks == 64 - 5

    run_until_done(sched, worker)
    for seq in request.sequences:
        assert seq.finish_reason == FinishReason.LENGTH and seq.num_output_tokens == 5
    assert len({seq.seq_id for seq in request.sequences}) == 3
    assert_all_free(sched)


# ---------------------------------------------------------------- g. abort


def test_abort_waiting_request() -> None:
    sched = make_scheduler()
    request = make_request("w", 50)
    sched.add_request(request)
    assert sched.abort_request("w") is request
    assert request.sequences[0].finish_reason == FinishReason.ABORT
    assert not sched.has_unfinished()
    worker = FakeWorker(16)
    plan, _ = step(sched, worker)
    assert plan.seq_ids == [] and plan.new_requests == [] and plan.finished_seq_ids == []
    assert sched.abort_request("w") is None and sched.abort_request("never-seen") is None
    assert_all_free(sched)


def test_abort_running_request() -> None:
    sched = make_scheduler()
    worker = FakeWorker(16)
    request = make_request("r", 50, max_tokens=20)
    sched.add_request(request)
    for _ in range(3):
        step(sched, worker)
    assert sched.blocks.num_free_blocks < sched.blocks.num_blocks
    sched.abort_request("r")
    assert_all_free(sched)
    plan, _ = step(sched, worker)
    assert plan.finished_seq_ids == [request.sequences[0].seq_id] and plan.seq_ids == []
    assert worker.state == {}


def test_abort_mid_prefill_and_mid_step() -> None:
    sched = make_scheduler(max_num_batched_tokens=128)
    worker = FakeWorker(16)
    long_request = make_request("long", 1000, max_tokens=4)
    sched.add_request(long_request)
    step(sched, worker)
    step(sched, worker)
    assert 0 < long_request.sequences[0].num_computed_tokens < 1000
    sched.abort_request("long")
    assert_all_free(sched)
    plan, _ = step(sched, worker)
    assert plan.finished_seq_ids == [long_request.sequences[0].seq_id]

    # aborted while its step runs: the result's token is dropped, the blocks are free at once
    request = make_request("mid", 30, max_tokens=4)
    sched.add_request(request)
    plan = sched.schedule()
    worker.apply(plan)
    result = worker.execute(plan)
    sched.abort_request("mid")
    assert_all_free(sched)
    assert sched.update(plan, result) == []
    assert request.sequences[0].num_output_tokens == 0
    plan, _ = step(sched, worker)
    assert plan.finished_seq_ids == [request.sequences[0].seq_id]


def test_abort_forked_request() -> None:
    sched = make_scheduler(max_num_seqs=1)
    worker = FakeWorker(16)
    request = make_request("n3", 40, max_tokens=5, n=3)
    sched.add_request(request)
    step(sched, worker)  # the first sequence prefilled; its siblings forked and wait (max_num_seqs=1)
    first, *siblings = request.sequences
    assert all(sibling.table.block_ids for sibling in siblings)
    sched.abort_request("n3")
    assert all(seq.finish_reason == FinishReason.ABORT for seq in request.sequences)
    assert_all_free(sched)
    plan, _ = step(sched, worker)
    assert plan.finished_seq_ids == [first.seq_id] and plan.new_requests == []


# ---------------------------------------------------------------- h. validation


@pytest.mark.parametrize(("request_args", "error", "param"), [
    (dict(prompt=[]), InvalidRequestError, "prompt"),
    (dict(prompt=128), ContextLengthError, "prompt"),
    (dict(prompt=200), ContextLengthError, "prompt"),
    (dict(prompt=100, max_tokens=29), ContextLengthError, "max_tokens"),
    (dict(prompt=[5, VOCAB_SIZE, 6]), InvalidRequestError, "prompt"),
    (dict(prompt=[5, -1]), InvalidRequestError, "prompt"),
    (dict(prompt=10, stop_token_ids=[3, VOCAB_SIZE]), InvalidRequestError, "stop_token_ids"),
    (dict(prompt=10, n=0), InvalidRequestError, "n"),
    (dict(prompt=10, max_tokens=0), InvalidRequestError, "max_tokens"),
])
def test_invalid_requests_raise_and_leave_the_scheduler_working(
        request_args: dict, error: type[Exception], param: str) -> None:
    sched = make_scheduler(max_model_len=128)
    worker = FakeWorker(16)
    args = dict(max_tokens=8) | request_args
    bad = make_request("bad", args.pop("prompt"), **args)
    with pytest.raises(error) as info:
        sched.validate(bad)
    assert info.value.param == param
    if error is ContextLengthError:
        assert info.value.code == "context_length_exceeded"
    else:
        assert not isinstance(info.value, ContextLengthError)
    assert not sched.has_unfinished() and not sched.waiting

    good = make_request("bad", 100, max_tokens=28)  # the same id is free to use; exactly fills the context
    sched.add_request(good)
    run_until_done(sched, worker)
    assert good.sequences[0].num_output_tokens == 28
    assert good.sequences[0].finish_reason == FinishReason.LENGTH
    assert_all_free(sched)


def test_prompt_larger_than_the_kv_cache_and_duplicate_ids_are_refused() -> None:
    sched = make_scheduler(num_blocks=4, block_size=16, max_model_len=1024)
    with pytest.raises(ContextLengthError) as info:
        sched.validate(make_request("big", 64, max_tokens=1))  # 64 prompt slots + 1 > 4 blocks * 16
    assert info.value.param == "prompt"
    with pytest.raises(AssertionError):  # add_request only asserts what validate (or the tokenizer) checked
        sched.add_request(make_request("big", 64, max_tokens=1))
    sched.add_request(make_request("dup", 10))
    with pytest.raises(InvalidRequestError) as info:
        sched.add_request(make_request("dup", 10))
    assert info.value.param == "request_id"
    run_until_done(sched, FakeWorker(16))
    assert_all_free(sched)


# ---------------------------------------------------------------- i. stop conditions


def run_one(request: Request, token_fn: TokenFn, **overrides: object) -> tuple[Scheduler, list[SeqUpdate]]:
    sched = make_scheduler(**overrides)
    worker = FakeWorker(16, token_fn)
    sched.add_request(request)
    updates: list[SeqUpdate] = []
    while sched.has_unfinished():
        updates.extend(step(sched, worker)[1])
    assert_all_free(sched)
    return sched, updates


def eos_at(index: int, token: int = EOS) -> TokenFn:
    return lambda seq_id, output_index: token if output_index == index else default_token(seq_id, output_index)


def test_eos_stops_with_stop() -> None:
    request = make_request("eos", 10, max_tokens=10)
    _, updates = run_one(request, eos_at(3))
    seq = request.sequences[0]
    assert seq.finish_reason == FinishReason.STOP and seq.num_output_tokens == 4 and seq.token_ids[-1] == EOS
    assert [u.finish_reason for u in updates] == [None, None, None, FinishReason.STOP]
    assert [u.token_id for u in updates] == seq.token_ids[10:]


def test_ignore_eos_runs_to_max_tokens() -> None:
    request = make_request("ignore", 10, max_tokens=10, ignore_eos=True)
    run_one(request, eos_at(3))
    seq = request.sequences[0]
    assert seq.finish_reason == FinishReason.LENGTH and seq.num_output_tokens == 10
    assert seq.token_ids[10 + 3] == EOS


def test_stop_token_ids_stop_with_stop() -> None:
    request = make_request("stop-id", 10, max_tokens=10, stop_token_ids=[42])
    run_one(request, eos_at(2, token=42))
    seq = request.sequences[0]
    assert seq.finish_reason == FinishReason.STOP and seq.num_output_tokens == 3 and seq.token_ids[-1] == 42


def test_max_tokens_stops_with_length() -> None:
    request = make_request("length", 10, max_tokens=7)
    _, updates = run_one(request, default_token)
    seq = request.sequences[0]
    assert seq.finish_reason == FinishReason.LENGTH and seq.num_output_tokens == 7
    assert updates[-1].finish_reason == FinishReason.LENGTH
    assert all(u.finish_reason is None for u in updates[:-1])


def test_no_max_tokens_stops_at_the_context_length() -> None:
    request = make_request("context", 10, max_tokens=None)
    run_one(request, default_token, max_model_len=50)
    seq = request.sequences[0]
    assert seq.finish_reason == FinishReason.LENGTH and seq.num_tokens == 50


def test_finish_sequence_from_outside() -> None:
    sched = make_scheduler()
    worker = FakeWorker(16)
    request = make_request("stop-string", 10, max_tokens=20)
    sched.add_request(request)
    step(sched, worker)
    step(sched, worker)
    seq = request.sequences[0]
    sched.finish_sequence(seq.seq_id, FinishReason.STOP)  # e.g. the tokenizer matched a stop string
    assert seq.finish_reason == FinishReason.STOP and seq.num_output_tokens == 2
    assert_all_free(sched)
    plan, _ = step(sched, worker)
    assert plan.finished_seq_ids == [seq.seq_id]


# ---------------------------------------------------------------- h. overlap: two plans in flight


def check_async_mirror(sched: Scheduler, worker: FakeWorker) -> None:
    """The worker has executed every plan sent; the scheduler may not know the newest tokens yet."""
    for seq in sched.running:
        mirror = worker.state[seq.seq_id]
        known = seq.num_known_tokens
        assert mirror.token_ids[:known] == seq.token_ids[:known]
        assert seq.token_ids[known:] == [PLACEHOLDER] * seq.num_pending
        assert len(mirror.token_ids) == seq.num_tokens, "one placeholder per token the worker sampled ahead"
        assert mirror.num_computed == seq.num_computed_tokens
        assert mirror.block_ids == seq.table.block_ids


def run_overlapped(sched: Scheduler, worker: FakeWorker, arrivals: list[tuple[int, Request]],
                   aborts: dict[str, int] | None = None, max_turns: int = 20_000) -> None:
    """schedule N+1 before update N, as the async engine does; integrity after every plan and every update."""
    inflight: deque[tuple[StepPlan, StepResult]] = deque()
    aborts = dict(aborts or {})
    turn = 0
    while arrivals or sched.has_unfinished() or inflight:
        turn += 1
        assert turn < max_turns, "the scheduler stopped making progress"
        while arrivals and arrivals[0][0] <= turn:
            sched.add_request(arrivals.pop(0)[1])
        for request_id in [r for r, at in aborts.items() if at == turn]:
            sched.abort_request(request_id)  # lands while up to two plans are in flight
            sched.blocks.check_integrity(live_tables(sched))
        while sched.has_unfinished() and len(inflight) < sched.max_inflight_plans:
            plan = sched.schedule()
            assert sum(plan.num_scheduled_tokens) <= sched.max_num_batched_tokens
            assert len(set(plan.seq_ids)) == len(plan.seq_ids) <= sched.max_num_seqs
            worker.apply(plan)
            assert set(worker.state) == {seq.seq_id for seq in sched.running}
            for new in plan.new_requests:
                assert PLACEHOLDER not in new.token_ids, "a provisional token went to the worker"
            sched.blocks.check_integrity(live_tables(sched))
            if not plan.seq_ids:
                break
            inflight.append((plan, worker.execute(plan)))
            check_async_mirror(sched, worker)
        if inflight:
            plan, result = inflight.popleft()
            sched.update(plan, result)
            sched.blocks.check_integrity(live_tables(sched))
            assert all(seq.num_pending <= len(inflight) for seq in sched.running)


def expected_tokens(seq_id: int, max_tokens: int, token_fn: TokenFn, stop_ids: set[int]) -> tuple[list[int], bool]:
    """What a sequence generates when nothing interrupts it, and whether a stop token ended it."""
    tokens: list[int] = []
    for index in range(max_tokens):
        tokens.append(token_fn(seq_id, index))
        if tokens[-1] in stop_ids:
            return tokens, True
    return tokens, False


def stopping_token(seq_id: int, output_index: int) -> int:
    """EOS (1) or the stop id 7 now and then, so sequences stop at different points."""
    value = (seq_id * 13 + output_index * 5) % 23
    return EOS if value == 0 else 7 if value == 1 else 10 + value


@pytest.mark.parametrize("seed", range(12))
def test_overlapped_scheduling_gives_serial_outputs_and_keeps_blocks_whole(seed: int) -> None:
    """Two plans in flight: stops (EOS, stop ids, length) discard the extra token, preemption, n > 1 forks,
    aborts mid-flight; every output equals what the sequence generates uninterrupted, blocks always add up."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    sched = make_scheduler(num_blocks=rng.choice([12, 20, 40]) * 16 // block_size, block_size=block_size,
                           max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.choice([8, 64, 256]),
                           max_model_len=256, seed=seed, max_inflight_plans=2,
                           enable_prefix_caching=rng.random() < 0.7)
    worker = FakeWorker(block_size, stopping_token)
    arrivals: list[tuple[int, Request]] = []
    aborts: dict[str, int] = {}
    for index in range(16):
        num_prompt = rng.randint(1, 120)
        prompt = [rng.randrange(2, VOCAB_SIZE) for _ in range(num_prompt)]
        request = make_request(f"r{index}", prompt, rng.randint(0, 30) if rng.random() < 0.9 else 0,
                               n=rng.choice([1, 1, 2, 3]), stop_token_ids=[7], priority=rng.randint(0, 2),
                               arrival_time=float(index))
        if request.sampling.max_tokens == 0:
            request.sampling = SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=1)
        at = rng.randint(0, 30)
        arrivals.append((at, request))
        if rng.random() < 0.2:
            aborts[request.request_id] = at + rng.randint(0, 12)
    arrivals.sort(key=lambda item: item[0])
    requests = [request for _, request in arrivals]
    run_overlapped(sched, worker, arrivals, aborts)

    for request in requests:
        for seq in request.sequences:
            assert seq.is_finished and seq.num_pending == 0
            want, stopped = expected_tokens(seq.seq_id, request.sampling.max_tokens or 0, stopping_token, {EOS, 7})
            got = seq.token_ids[seq.num_prompt_tokens:]
            if seq.finish_reason == FinishReason.ABORT:
                assert request.request_id in aborts and got == want[:len(got)]
            else:
                assert got == want
                assert seq.finish_reason == (FinishReason.STOP if stopped else FinishReason.LENGTH)
    assert_all_free(sched)


def test_overlap_discards_the_extra_token_of_a_stopped_sequence() -> None:
    sched = make_scheduler(max_inflight_plans=2)
    worker = FakeWorker(16, lambda seq_id, index: EOS if index == 1 else 20 + index)
    request = make_request("r", 20, max_tokens=10)
    sched.add_request(request)
    seq = request.sequences[0]
    plans = []
    for _ in range(3):  # prefill (samples output 0), decode (output 1 = EOS), decode (output 2: past the end)
        plan = sched.schedule()
        worker.apply(plan)
        plans.append((plan, worker.execute(plan)))
        if len(plans) == 2:
            assert seq.token_ids[-2:] == [PLACEHOLDER, PLACEHOLDER] and seq.num_pending == 2
            assert seq.num_output_tokens == 0
            sched.update(*plans[0])
            assert seq.token_ids[-2:] == [20, PLACEHOLDER] and seq.num_output_tokens == 1
    updates = sched.update(*plans[1])
    assert [(u.token_id, u.finish_reason) for u in updates] == [(EOS, FinishReason.STOP)]
    assert seq.token_ids[seq.num_prompt_tokens:] == [20, EOS] and seq.num_pending == 0
    assert_all_free(sched)
    assert sched.update(*plans[2]) == []  # the third step's token for it is dropped, nothing freed twice
    assert_all_free(sched)


def test_overlap_does_not_plan_past_max_tokens() -> None:
    sched = make_scheduler(max_inflight_plans=2)
    worker = FakeWorker(16)
    request = make_request("r", 5, max_tokens=1)
    sched.add_request(request)
    first = sched.schedule()
    worker.apply(first)
    result = worker.execute(first)
    second = sched.schedule()  # its one token is in flight: nothing more to compute
    assert second.seq_ids == []
    updates = sched.update(first, result)
    assert [u.finish_reason for u in updates] == [FinishReason.LENGTH]
    assert_all_free(sched)


def test_preempted_with_a_token_in_flight_is_resent_only_with_real_tokens() -> None:
    """One block each: the second sequence's decode needs the first one's block while its token is in flight."""
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=12,
                           enable_prefix_caching=False, max_inflight_plans=2)
    worker = FakeWorker(4)
    low = make_request("low", [2, 3, 4], max_tokens=4, priority=1, arrival_time=1.0)
    high = make_request("high", [5, 6, 7], max_tokens=6, priority=0, arrival_time=0.0)
    sched.add_request(high)
    sched.add_request(low)
    run_overlapped(sched, worker, [])
    assert low.sequences[0].num_preemptions > 0, "the pool is meant to force a preemption"
    assert worker.num_resent_with_output > 0
    for request in (low, high):
        seq = request.sequences[0]
        assert seq.token_ids[seq.num_prompt_tokens:] == [default_token(seq.seq_id, i)
                                                         for i in range(request.sampling.max_tokens)]
    assert_all_free(sched)


def test_serial_scheduler_refuses_a_second_plan_in_flight() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("r", 5))
    sched.schedule()
    with pytest.raises(AssertionError):
        sched.schedule()


def test_add_request_trusts_validation_done_at_the_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation runs once, where a request enters: add_request (the hot path) never re-runs it."""
    calls: list[SamplingParams] = []
    original = SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate",
                        lambda self, **bounds: calls.append(self) or original(self, **bounds))
    sched = make_scheduler(max_model_len=128)
    request = make_request("r", 10, max_tokens=4)
    sched.validate(request)
    assert len(calls) == 1
    sched.add_request(request)
    assert len(calls) == 1
    run_until_done(sched, FakeWorker(16))
    assert request.sequences[0].num_output_tokens == 4


def test_min_tokens_bans_eos_with_ignore_eos_too() -> None:
    """vLLM's min_tokens bans the EOS ids whatever ignore_eos says (they are in its all_stop_token_ids): a request
    with both gets no EOS among its first min_tokens tokens; ignore_eos only keeps an EOS after them from stopping
    it. Without min_tokens nothing is banned."""
    sched = make_scheduler()
    both = make_request("both", 10, max_tokens=8, min_tokens=3, ignore_eos=True)
    only_ignore = make_request("ignore", 10, max_tokens=8, ignore_eos=True)
    for request in (both, only_ignore):
        sched.add_request(request)
    plan, _ = step(sched, FakeWorker(16))
    assert {new.seq_id: new.eos_token_ids for new in plan.new_requests} == {0: [EOS], 1: []}


def test_tokenizer_eos_stops_its_own_requests_and_reaches_the_worker_with_the_plan() -> None:
    """The worker knows no tokenizer: the scheduler stops a request on the EOS its tokenizer registered (not on
    another tokenizer's), and a new request that bans EOS until min_tokens carries the ids to ban."""
    sched = make_scheduler()
    ended = make_request("eos", 10, max_tokens=8)
    banned = make_request("min", 10, max_tokens=8, min_tokens=2)
    ignoring = make_request("ignore", 10, max_tokens=8, min_tokens=2, ignore_eos=True)
    other = make_request("other", 10, max_tokens=3)  # another tokenizer's: 5 is no EOS of its
    for request in (ended, banned, ignoring):
        request.eos_token_ids = frozenset({5})
        sched.add_request(request)
    sched.add_request(other)
    worker = FakeWorker(16, lambda seq_id, k: 5 if seq_id in (0, 3) else 20)
    plan, _ = step(sched, worker)
    by_seq = {new.seq_id: new.eos_token_ids for new in plan.new_requests}
    assert by_seq == {0: [], 1: [EOS, 5], 2: [EOS, 5], 3: []}  # ignore_eos keeps the ban (vLLM's)
    assert ended.sequences[0].finish_reason == FinishReason.STOP and ended.sequences[0].num_output_tokens == 1
    run_until_done(sched, worker)
    assert other.sequences[0].finish_reason == FinishReason.LENGTH and other.sequences[0].num_output_tokens == 3


def test_a_bounded_queue_counts_only_requests_still_waiting(tmp_path) -> None:  # noqa: ANN001
    """--max-waiting-requests: requests aborted while they wait (clients gone) no longer count against the limit,
    though the queue's heap keeps their entries until admission reaches them; a request past the limit of live ones
    is still refused with a 503."""
    import dataclasses

    from pagoda.services.scheduler.service import Peer
    from pagoda.shared.messages import AbortRequest, AddRequest, RequestFailed, SchedulerToTokenizer, Sequenced
    from pagoda.shared.messages import SamplingParams as WireParams
    from pagoda.shared.transport import Codec
    from tests.test_async_scheduling import service_on_outboxes

    codec = Codec(SchedulerToTokenizer)

    def refusals(front_out) -> list[RequestFailed]:  # noqa: ANN001
        messages = [codec.decode(frames[-1]) for frames in front_out.sent]
        front_out.sent.clear()
        messages = [codec.decode(m.body) if isinstance(m, Sequenced) else m for m in messages]
        return [m for m in messages if isinstance(m, RequestFailed)]

    with service_on_outboxes(tmp_path, 1, num_kv_blocks=64, block_size=4, max_model_len=64,
                             max_num_batched_tokens=64, max_inflight_plans=1) as (service, plans_out, front_out):
        service.config = dataclasses.replace(service.config, max_waiting_requests=2)
        identity = b"tok0"
        peer = service.tokenizers[identity] = Peer(0.0)
        params = WireParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        service._on_add(identity, peer, AddRequest("running", [5] * 7, params))
        service._maybe_step()  # max_num_seqs=1: it runs, the others wait behind it
        for name in ("gone1", "gone2"):
            service._on_add(identity, peer, AddRequest(name, [6] * 7, params))
            service._on_tokenizer_message(identity, peer, AbortRequest(name))
        service._on_add(identity, peer, AddRequest("fresh1", [7] * 7, params))
        service._on_add(identity, peer, AddRequest("fresh2", [8] * 7, params))
        assert refusals(front_out) == []
        assert {"fresh1", "fresh2"} <= set(service.scheduler.requests)
        service._on_add(identity, peer, AddRequest("over", [9] * 7, params))
        [refused] = refusals(front_out)
        assert (refused.request_id, refused.status) == ("over", 503) and "2 requests waiting" in refused.message


def test_the_step_loop_schedules_again_after_a_plan_that_only_preempted() -> None:
    """The only running sequence needs a block that a higher-ranked waiting sibling holds (forked from its first
    sequence's prompt): it is preempted, and that plan admits nothing (admission waits a step after a preemption).
    run_step schedules again rather than report nothing in flight, which the offline engine took for 'the KV cache
    is too small' and raised, though the sibling can run now."""
    from pagoda.services.scheduler.pipeline import PlanPipeline, run_step

    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=16)
    worker = FakeWorker(4)
    pipeline = PlanPipeline(sched)
    results: deque[StepResult] = deque()

    def launch(plan: StepPlan) -> bool:
        worker.apply(plan)
        if plan.seq_ids:
            results.append(worker.execute(plan))
        return bool(plan.seq_ids)

    low = make_request("low", 3, max_tokens=12, priority=2)
    sched.add_request(low)
    assert run_step(pipeline, launch, results.popleft) is not None
    high = make_request("high", 12, max_tokens=1, n=2, priority=1, arrival_time=1.0)
    sched.add_request(high)
    for _ in range(100):
        if not sched.has_unfinished():
            break
        assert run_step(pipeline, launch, results.popleft) is not None, "nothing in flight while requests wait"
    assert sched.stats.num_preemptions > 0
    assert [seq.finish_reason for seq in (*low.sequences, *high.sequences)] == [FinishReason.LENGTH] * 3
    assert_all_free(sched)


def test_a_request_whose_logprobs_would_overfill_a_steps_message_is_refused_naming_the_field() -> None:
    """A served step's logprobs travel in one message, which ZeroMQ refuses past its frame size (the step was sent
    again forever: whole-vocabulary prompt_logprobs over a 400-token prompt wedged the server). One request may make
    a step carry at most max_logprob_entries: its prompt chunk's positions, or its n rows, times k + 1."""
    sched = make_scheduler(max_logprob_entries=1000, max_num_batched_tokens=256)
    sched.validate(make_request("short", 10, prompt_logprobs=99))  # 9 positions x 100 entries
    sched.validate(make_request("at-bound", 101, prompt_logprobs=9))  # 100 positions x 10
    with pytest.raises(InvalidRequestError, match=r"ask at most 8 or send a shorter prompt") as refused:
        sched.validate(make_request("over", 102, prompt_logprobs=9))  # 101 x 10
    assert refused.value.param == "prompt_logprobs"
    # a chunk of the prompt runs a step: positions past the token budget are another step's
    sched.validate(make_request("long", 2000, max_tokens=8, prompt_logprobs=2))  # 256 x 3
    with pytest.raises(InvalidRequestError, match=r"ask at most 2\b") as refused:
        sched.validate(make_request("long-k", 2000, max_tokens=8, prompt_logprobs=3))  # 256 x 4
    assert refused.value.param == "prompt_logprobs"
    sched.validate(make_request("n", 10, logprobs=99, n=10))  # 10 rows x 100
    with pytest.raises(InvalidRequestError, match=r"ask at most 99\b") as refused:
        sched.validate(make_request("n-over", 10, logprobs=100, n=10))
    assert refused.value.param == "logprobs"
    assert not sched.requests  # refusals admitted nothing
    make_scheduler(max_num_batched_tokens=256).validate(make_request("unbounded", 102, prompt_logprobs=9))
