"""Weighted fair share among tenants, driven with plain objects: the queue alone, then the scheduler with the fake
worker of test_scheduler (which checks every step's diff and makes outputs independent of batching and preemption).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pagoda.services.scheduler.fairness import FairQueue, TenantShare, may_take
from pagoda.services.scheduler.scheduler import Request, Scheduler, SeqStatus
from pagoda.shared.messages import FinishReason, SamplingParams
from tests.test_scheduler import FakeWorker, assert_all_free, default_token, make_scheduler, step


@dataclass(eq=False)
class Item:
    """A queued sequence as the queue sees one."""

    tenant: str
    rank: tuple[int, float, int]
    is_finished: bool = False


def tenant_request(req_id: str, tenant: str, *, prompt_len: int = 8, max_tokens: int = 4, weight: float = 1.0,
                   tier: int = 0, priority: int = 0, arrival_time: float = 0.0) -> Request:
    prompt = [100 + (hash((req_id, i)) % 700) for i in range(prompt_len)]
    return Request(request_id=req_id, prompt_token_ids=prompt, arrival_time=arrival_time, priority=priority,
                   sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens), tenant=tenant, weight=weight,
                   tier=tier)


def running_by_tenant(sched: Scheduler) -> dict[str, int]:
    counts: dict[str, int] = {}
    for seq in sched.running:
        counts[seq.tenant] = counts.get(seq.tenant, 0) + 1
    return counts


# ---------------------------------------------------------------- the queue alone


def test_queue_serves_the_least_loaded_tenant_and_rank_order_within_one() -> None:
    queue = FairQueue()
    for i in range(5):
        queue.push(Item("a", (0, float(i), i)))
    queue.push(Item("b", (0, 10.0, 10)))
    queue.push(Item("b", (-1, 11.0, 11)))  # a higher request priority within b
    order = []
    while (item := queue.head()) is not None:
        queue.pop(item)
        queue.tenants[item.tenant].num_running += 1
        order.append((item.tenant, item.rank[2]))
    # a's head arrived first (a tie on load 0 goes to the older head); then b, whose priority -1 leads its own
    assert order == [("a", 0), ("b", 11), ("a", 1), ("b", 10), ("a", 2), ("a", 3), ("a", 4)]
    assert len(queue) == 0


def test_queue_weights_and_tiers() -> None:
    queue = FairQueue()
    for i in range(30):
        queue.push(Item("heavy", (0, float(i), i)), weight=3.0)
        queue.push(Item("light", (0, float(i), 100 + i)), weight=1.0)
    admitted = []
    for _ in range(8):
        item = queue.head()
        assert item is not None
        queue.pop(item)
        queue.tenants[item.tenant].num_running += 1
        admitted.append(item.tenant)
    assert admitted.count("heavy") == 6 and admitted.count("light") == 2  # 3:1 of the slots
    queue.push(Item("gold", (0, 99.0, 999)), tier=-1)  # a better tier goes first whatever the loads
    assert queue.head().tenant == "gold"  # type: ignore[union-attr]


def test_queue_skips_finished_and_forgets_idle_tenants() -> None:
    queue = FairQueue()
    gone = Item("a", (0, 0.0, 0), is_finished=True)
    queue.push(gone)
    queue.push(Item("b", (0, 1.0, 1)))
    item = queue.head()
    assert item is not None and item.tenant == "b" and len(queue) == 1  # a's finished entry was dropped
    queue.forget_idle("a")
    assert "a" not in queue.tenants
    queue.forget_idle("b")
    assert "b" in queue.tenants  # it still waits


def test_may_take_never_reverses_the_order() -> None:
    a, b = TenantShare("a", num_running=4), TenantShare("b", num_running=1)
    assert may_take(b, a) and not may_take(a, b)
    a.num_running, b.num_running = 3, 2  # after one move: b is below a, and a may not take it back
    assert not may_take(a, b)
    assert not may_take(b, a)  # b at 3 would be above a at 2
    assert may_take(TenantShare("gold", tier=-1), TenantShare("c", num_running=1, tier=0))
    assert may_take(TenantShare("w", weight=3.0, num_running=2), TenantShare("x", num_running=2))  # 3/3 <= 1/1


# ---------------------------------------------------------------- the scheduler


def test_a_flood_does_not_delay_another_tenants_request() -> None:
    """Tenant a fills every slot and queues 60 more; b's request is admitted at the next step (a's lowest-ranked
    sequence gives its slot), and every request of both still completes with its own tokens."""
    sched = make_scheduler(max_num_seqs=4)
    worker = FakeWorker(sched.block_size)
    flood = [tenant_request(f"a{i}", "a", max_tokens=20, arrival_time=float(i)) for i in range(64)]
    for request in flood:
        sched.add_request(request)
    for _ in range(3):
        step(sched, worker)
    assert running_by_tenant(sched) == {"a": 4}
    late = tenant_request("b0", "b", max_tokens=3, arrival_time=100.0)
    sched.add_request(late)
    plan, updates = step(sched, worker)
    assert late.sequences[0].seq_id in plan.seq_ids, "b's request waited behind a's flood"
    assert running_by_tenant(sched) == {"a": 3, "b": 1}
    assert sched.stats.num_preemptions == 1
    steps = 0
    while sched.has_unfinished():
        step(sched, worker)
        steps += 1
        assert steps < 2000
    for request in [*flood, late]:
        seq = request.sequences[0]
        assert seq.finish_reason == FinishReason.LENGTH
        assert seq.token_ids[seq.num_prompt_tokens:] == [default_token(seq.seq_id, i)
                                                         for i in range(request.sampling.max_tokens or 0)]
    assert_all_free(sched)


def test_several_arrivals_get_their_share_in_one_step() -> None:
    """Four of b's requests arrive together while a holds all 8 slots: all four run in the next step (a gives
    four slots at once, not one a step), and no more than the even share is taken."""
    sched = make_scheduler(max_num_seqs=8)
    worker = FakeWorker(sched.block_size)
    for i in range(40):
        sched.add_request(tenant_request(f"a{i}", "a", max_tokens=30, arrival_time=float(i)))
    step(sched, worker)
    late = [tenant_request(f"b{i}", "b", max_tokens=30, arrival_time=100.0 + i) for i in range(6)]
    for request in late:
        sched.add_request(request)
    plan, _ = step(sched, worker)
    assert sum(r.sequences[0].seq_id in plan.seq_ids for r in late) == 4
    assert running_by_tenant(sched) == {"a": 4, "b": 4}


def test_same_tenant_keeps_first_come_first_served() -> None:
    """One tenant (the default, no keys): a late request waits its turn; nothing is preempted for it."""
    sched = make_scheduler(max_num_seqs=4)
    worker = FakeWorker(sched.block_size)
    for i in range(8):
        sched.add_request(tenant_request(f"a{i}", "", max_tokens=20, arrival_time=float(i)))
    step(sched, worker)
    late = tenant_request("late", "", max_tokens=3, arrival_time=100.0)
    sched.add_request(late)
    plan, _ = step(sched, worker)
    assert late.sequences[0].seq_id not in plan.seq_ids and sched.stats.num_preemptions == 0


def test_weights_share_the_running_slots() -> None:
    """Two flooding tenants weighted 3:1 get the 8 slots of each step 6:2 once the share settles, and keep it."""
    sched = make_scheduler(max_num_seqs=8, num_blocks=512)
    worker = FakeWorker(sched.block_size)
    requests = [tenant_request(f"h{i}", "heavy", max_tokens=12, weight=3.0, arrival_time=float(i)) for i in range(40)]
    requests += [tenant_request(f"l{i}", "light", max_tokens=12, arrival_time=50.0 + i) for i in range(40)]
    for request in requests:
        sched.add_request(request)
    tenant_of = {seq.seq_id: request.tenant for request in requests for seq in request.sequences}
    shares = []
    for _ in range(60):
        plan, _ = step(sched, worker)
        ran = [tenant_of[seq_id] for seq_id in plan.seq_ids]
        shares.append((ran.count("heavy"), ran.count("light")))
    assert all(share == (6, 2) for share in shares[10:]), shares


def test_priority_orders_requests_within_a_tenant_and_tiers_order_tenants() -> None:
    sched = make_scheduler(max_num_seqs=1)
    worker = FakeWorker(sched.block_size)
    sched.add_request(tenant_request("low", "a", priority=5, max_tokens=1, arrival_time=0.0))
    sched.add_request(tenant_request("high", "a", priority=-5, max_tokens=1, arrival_time=1.0))
    sched.add_request(tenant_request("batch", "b", tier=1, max_tokens=1, arrival_time=-1.0))
    order = []
    while sched.has_unfinished():
        plan, updates = step(sched, worker)
        order += [u.seq.request.request_id for u in updates if u.finish_reason is not None]
    assert order == ["high", "low", "batch"]  # tier 0 before tier 1; priority -5 before 5 within a


def test_blocks_go_to_the_tenant_below_its_share() -> None:
    """The KV pool runs out while both tenants decode: the sequence that gives its blocks is the over-share
    tenant's (a's), even though b's requests arrived last."""
    sched = make_scheduler(max_num_seqs=8, num_blocks=12, block_size=4, max_num_batched_tokens=64)
    worker = FakeWorker(sched.block_size)
    for i in range(5):
        sched.add_request(tenant_request(f"a{i}", "a", prompt_len=4, max_tokens=12, arrival_time=float(i)))
    step(sched, worker)
    sched.add_request(tenant_request("b0", "b", prompt_len=4, max_tokens=12, arrival_time=10.0))
    preempted: dict[str, int] = {}
    while sched.has_unfinished():
        before = {seq.seq_id: seq.num_preemptions for r in sched.requests.values() for seq in r.sequences}
        step(sched, worker)
        for r in list(sched.requests.values()):
            for seq in r.sequences:
                if seq.num_preemptions > before.get(seq.seq_id, 0):
                    preempted[seq.tenant] = preempted.get(seq.tenant, 0) + 1
    assert preempted.get("a", 0) > 0 and preempted.get("b", 0) == 0, preempted
    assert_all_free(sched)


@pytest.mark.parametrize("seed", range(6))
def test_random_tenants_finish_with_their_own_tokens(seed: int) -> None:
    """Tenants of random weights and tiers arriving at random steps, small pools (preemption by blocks and by
    share), aborts: every request finishes with exactly its tokens and every block is free at the end."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=rng.choice([16, 32]), block_size=8, max_num_seqs=rng.choice([2, 4, 6]),
                           max_num_batched_tokens=rng.choice([32, 64]), max_model_len=256, seed=seed)
    worker = FakeWorker(sched.block_size)
    tenants = {name: (rng.choice([0.5, 1.0, 3.0]), rng.choice([0, 0, 1])) for name in "abcd"}
    arrivals = []
    for i in range(40):
        name = rng.choice("aaabcd")  # a floods
        weight, tier = tenants[name]
        request = tenant_request(f"{name}{i}", name, prompt_len=rng.randint(1, 40), max_tokens=rng.randint(1, 20),
                                 weight=weight, tier=tier, priority=rng.randint(0, 1), arrival_time=float(i))
        arrivals.append((rng.randint(0, 30), request))
    arrivals.sort(key=lambda item: item[0])
    requests = [request for _, request in arrivals]
    aborted = {request.request_id for request in rng.sample(requests, 4)}
    num_steps = 0
    while arrivals or sched.has_unfinished():
        while arrivals and arrivals[0][0] <= num_steps:
            sched.add_request(arrivals.pop(0)[1])
        if num_steps == 10:
            for req_id in aborted:
                sched.abort_request(req_id)
        step(sched, worker)
        num_steps += 1
        assert num_steps < 5000, "the scheduler stopped making progress"
    for request in requests:
        seq = request.sequences[0]
        assert seq.status == SeqStatus.FINISHED
        if seq.finish_reason == FinishReason.ABORT:
            assert request.request_id in aborted
            continue
        assert seq.token_ids[seq.num_prompt_tokens:] == [default_token(seq.seq_id, i)
                                                         for i in range(request.sampling.max_tokens or 0)]
    assert_all_free(sched)
    assert not sched.waiting.tenants, "idle tenants are forgotten"


def test_a_sibling_of_another_tenant_gives_back_its_blocks_when_nothing_runs() -> None:
    """Regression (deadlock): a forked sibling waits holding its prompt's blocks; the queue's head is another
    tenant's request, first by the fair share (arrival across tenants) though ranked after the sibling by its
    request priority. Nothing runs and the head needs those blocks: the sibling gives them back (they stay cached),
    rather than the waiting siblings being released only when ranked below the head, which left every request
    waiting forever."""
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=40)
    worker = FakeWorker(4)
    forked = tenant_request("forked", "b", prompt_len=21, max_tokens=1, priority=0, arrival_time=2.0)
    forked.sampling = SamplingParams(temperature=0.0, max_tokens=1, n=2)
    sched.add_request(forked)
    step(sched, worker)  # the first sequence's prefill and token: it ends, its sibling forks 5 blocks and waits
    sibling = forked.sequences[1]
    assert sibling.status == SeqStatus.WAITING and len(sibling.table.block_ids) == 5
    early = tenant_request("early", "a", prompt_len=30, max_tokens=2, priority=1, arrival_time=1.0)
    sched.add_request(early)  # 8 blocks; 5 are free
    assert sched.waiting.head() is early.sequences[0]
    for _ in range(50):
        if not sched.has_unfinished():
            break
        step(sched, worker)
    assert [seq.finish_reason for seq in (*forked.sequences, *early.sequences)] == [FinishReason.LENGTH] * 3
    assert_all_free(sched)


def test_a_runner_takes_the_blocks_of_another_tenants_sibling_the_queue_would_admit_after_it() -> None:
    """Regression (livelock): tenant a's runner needs a block that a waiting sibling of tenant c holds; the sibling's
    request priority is better, but c (weight 0.5) is owed no slot of a's (weight 3), so the fair queue puts the
    runner first again. Giving way by rank, the runner was preempted, readmitted, and preempted again before its
    recomputed block was cached (two plans in flight), forever. It takes the sibling's blocks instead."""
    from tests.test_scheduler import expected_tokens, run_overlapped

    sched = make_scheduler(num_blocks=4, block_size=8, max_num_seqs=2, max_num_batched_tokens=3, max_model_len=32,
                           max_inflight_plans=2)
    worker = FakeWorker(8)
    runner = tenant_request("runner", "a", prompt_len=2, max_tokens=29, weight=3.0, priority=0, arrival_time=1.0)
    forked = tenant_request("forked", "c", prompt_len=21, weight=0.5, priority=-1, arrival_time=3.0)
    forked.sampling = SamplingParams(temperature=0.0, max_tokens=1, n=2)
    run_overlapped(sched, worker, [(0, runner), (0, forked)], max_turns=2000)
    for seq in (*runner.sequences, *forked.sequences):
        want, _ = expected_tokens(seq.seq_id, seq.request.sampling.max_tokens or 0, default_token, set())
        assert seq.finish_reason == FinishReason.LENGTH and seq.token_ids[seq.num_prompt_tokens:] == want
    assert_all_free(sched)
