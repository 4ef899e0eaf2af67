"""The default swap space (--swap-space unset): which models get one, and how much host memory each rank takes."""

from __future__ import annotations

from pagoda.services.worker.model_runner import swap_pays
from pagoda.shared.config import EngineConfig
from pagoda.shared.shapes import SHAPES


def test_the_default_swap_space_goes_where_copying_beats_recomputing() -> None:
    assert swap_pays(SHAPES["llama3-8b"], SHAPES["llama3-8b"].kv_bytes_per_token(2))
    assert swap_pays(SHAPES["deepseek-v2-lite"], SHAPES["deepseek-v2-lite"].kv_bytes_per_token(2))
    assert not swap_pays(SHAPES["qwen3-0.6b"], SHAPES["qwen3-0.6b"].kv_bytes_per_token(2))  # 5.7 us vs 2.2 a token


def test_the_default_swap_space_shares_the_free_ram_among_the_hosts_gpus() -> None:
    gib = 1 << 30
    config = EngineConfig()
    assert config.resolved_swap_bytes("cpu", 512 * gib) == 0  # the cache already lives in host memory
    assert config.resolved_swap_bytes("cuda", 512 * gib) == 16 * gib
    assert config.resolved_swap_bytes("cuda", 128 * gib) == 16 * gib
    assert config.resolved_swap_bytes("cuda", 128 * gib, host_gpus=8) == 2 * gib  # an eighth of the RAM, 8 ways
    assert EngineConfig(tensor_parallel_size=4).resolved_swap_bytes("cuda", 128 * gib) == 4 * gib
    assert EngineConfig(swap_space=0.5).resolved_swap_bytes("cpu", 1 * gib) == gib // 2  # asked: as asked


def test_the_pool_is_registered_over_plain_pages_and_unregistered_before_they_are_freed() -> None:
    import gc

    import torch

    from pagoda.services.worker.device import page_locked_empty

    registered: dict[int, int] = {}
    unregistered: list[int] = []

    def register(address: int, nbytes: int) -> int:
        registered[address] = nbytes
        return 0

    pool = page_locked_empty((3, 2, 16, 8), torch.bfloat16, register, unregistered.append)
    assert pool.shape == (3, 2, 16, 8) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert registered == {pool.data_ptr(): pool.numel() * 2}  # the tensor's own bytes, all of them
    pool[2, 1, 15, 7] = 1.5  # the last element is writable (the registered range is the tensor)
    address = pool.data_ptr()
    del pool
    gc.collect()
    assert unregistered == [address]
    fp8 = page_locked_empty((4, 5), torch.float8_e4m3fn, register, unregistered.append)
    assert fp8.dtype == torch.float8_e4m3fn and registered[fp8.data_ptr()] == 20
    assert page_locked_empty((0, 5), torch.bfloat16, register, unregistered.append).numel() == 0


def test_a_cpu_cache_is_zeroed_pages_the_os_maps_when_used() -> None:
    """device.zeroed on the CPU: zeros of the shape and dtype asked for (fp8 too), contiguous, page-aligned and
    writable, its bytes owned by a fresh zeroed mapping rather than written by torch."""
    import torch

    from pagoda.services.worker.device import zeroed

    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        cache = zeroed((2, 3, 4, 16, 5), dtype, torch.device("cpu"))  # [L, kv tensors, N, bs, heads]
        assert cache.shape == (2, 3, 4, 16, 5) and cache.dtype == dtype and cache.is_contiguous()
        assert cache.data_ptr() % 4096 == 0  # page-aligned (calloc's pointer is not; unaligned rows decoded slower)
        assert not cache.float().any()
        cache[1, 2, 3, 15, 4] = 2.0  # the last element is the tensor's own
        assert float(cache.float().sum()) == 2.0
    assert zeroed((0, 7), torch.bfloat16, torch.device("cpu")).shape == (0, 7)


def test_a_worker_whose_swap_copies_fail_lets_the_plans_departures_go() -> None:
    """The worker runs a plan's swap copies before anything else of it: when they raise, the step fails, the
    scheduler ends that plan's requests and the sequences it swapped out (swapped_out_by), and the worker frees
    the rows of every sequence the plan let go, the preempted ones included; the rest run to the end and every row
    and slot comes back."""
    import random

    import pytest

    from pagoda.services.scheduler.scheduler import Request, Scheduler
    from pagoda.services.worker.model_runner import ModelRunner
    from pagoda.services.worker.models import reference_ops
    from pagoda.shared.messages import SamplingParams

    config = EngineConfig(model="tiny", load_format="dummy", device="cpu", dtype="float32", num_kv_blocks=12,
                          block_size=4, max_model_len=64, max_num_seqs=4, enforce_eager=True, seed=3,
                          swap_space=16 / (1 << 20))  # 16 KiB: a few slots of the tiny model's blocks
    runner = ModelRunner(config, ops=reference_ops())
    assert runner.num_swap_blocks > 0
    scheduler = Scheduler(num_blocks=runner.num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=64, vocab_size=runner.arch.vocab_size, num_swap_blocks=runner.num_swap_blocks)
    rng = random.Random(5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(6):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(5, 12))]
        scheduler.add_request(Request(request_id=str(i), prompt_token_ids=prompt, sampling=params, arrival_time=i))
    swap = runner._swap
    failed: list[int] = []

    def failing_swap(swap_out: list[int], swap_in: list[int]) -> None:
        if swap_out and not failed:
            raise RuntimeError("swap copy failed")
        swap(swap_out, swap_in)

    runner._swap = failing_swap  # type: ignore[method-assign]
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        result = runner.execute(plan)
        if result.error:
            failed.append(plan.step_id)
            victims = scheduler.swapped_out_by(plan.step_id)
            assert victims and not set(victims) & set(runner.state.row_of), "the victims' rows are free"
            for seq_id in [*plan.seq_ids, *victims]:
                seq = scheduler.get_sequence(seq_id)
                if seq is not None:
                    scheduler.abort_request(seq.request.request_id)
            result = type(result)(step_id=plan.step_id, seq_ids=[], sampled_token_ids=[])
        scheduler.update(plan, result)
    else:
        pytest.fail("the requests did not finish")
    assert failed, "no plan swapped a sequence out"
    plan = scheduler.schedule()  # the last departures reach the worker
    runner.execute(plan)
    assert runner.state.row_of == {} and scheduler.host.num_free_blocks == runner.num_swap_blocks


def _swapping_scheduler(max_inflight_plans: int = 1):  # noqa: ANN202  (scheduler, fake worker, the victim)
    """6 blocks of 4 and 4 host slots; three 7-token prompts of which `latest` is preempted (by swap) once the
    others need its blocks (test_scheduler's test_a_swapped_sequence_comes_back_from_its_host_slots)."""
    from tests.test_scheduler import FakeWorker, make_request, make_scheduler

    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                           num_swap_blocks=4, max_inflight_plans=max_inflight_plans)
    latest = make_request("latest", [300 + i for i in range(7)], max_tokens=10, priority=1, arrival_time=2.0)
    early = make_request("early", [400 + i for i in range(7)], max_tokens=10, priority=1, arrival_time=1.0)
    urgent = make_request("urgent", [200 + i for i in range(7)], max_tokens=10, priority=0, arrival_time=5.0)
    for request in (latest, early, urgent):
        sched.add_request(request)
    return sched, FakeWorker(4, check_kv=True), latest.sequences[0]


def test_a_failed_result_ends_the_sequences_its_plan_swapped_out() -> None:
    """The offline engine hands the scheduler the failed step's result (StepResult.error): the plan's swap-out
    copies may never have run, so the sequences it swapped out end (aborted, with an update saying so) instead of
    coming back from host slots never written; their slots are free again and the others run to the end."""
    from pagoda.shared.messages import FinishReason, StepResult
    from tests.test_scheduler import assert_all_free, run_until_done

    sched, worker, victim = _swapping_scheduler()
    for _ in range(20):
        plan = sched.schedule()
        worker.apply(plan)
        result = worker.execute(plan)
        if plan.swap_out:
            break
        sched.update(plan, result)
    assert victim.swapped is not None and plan.swap_out, "the plan swaps the victim out"
    failed = StepResult(step_id=plan.step_id, seq_ids=[], sampled_token_ids=[], error="RuntimeError: swap failed")
    updates = sched.update(plan, failed)
    assert victim.is_finished and victim.finish_reason == FinishReason.ABORT and victim.swapped is None
    assert any(update.seq is victim and update.finish_reason == FinishReason.ABORT for update in updates)
    run_until_done(sched, worker)
    assert victim.num_preemptions == 1 and victim.is_finished
    assert_all_free(sched)


def test_cancelled_plans_end_the_sequences_they_swapped_out() -> None:
    """cancel_inflight (the engine gave up on the plans in flight after a failure): whether their copies ran is
    unknown, so the sequences they swapped out end with the sequences they ran."""
    from pagoda.shared.messages import FinishReason
    from tests.test_scheduler import assert_all_free, run_until_done

    sched, worker, victim = _swapping_scheduler(max_inflight_plans=2)
    pending = []
    for _ in range(20):
        plan = sched.schedule()
        worker.apply(plan)
        pending.append((plan, worker.execute(plan)))
        if plan.swap_out:
            break
        if len(pending) == 2:
            sched.update(*pending.pop(0))
    assert victim.swapped is not None and plan.swap_out, "a plan in flight swaps the victim out"
    sched.cancel_inflight()
    assert victim.is_finished and victim.finish_reason == FinishReason.ABORT and victim.swapped is None
    assert sched.swapped_out_by(plan.step_id) == []
    worker.apply(sched.schedule())  # the departures reach the worker
    run_until_done(sched, worker)
    assert_all_free(sched)


def test_the_offline_engine_ends_what_a_failed_step_swapped_out() -> None:
    """LLMEngine.step raises when a step fails; a caller that goes on stepping gets, for each request, either an
    end without the failed step's tokens or the tokens of an undisturbed run: a sequence the failed plan swapped
    out does not come back from host slots its copies never wrote."""
    import random

    from pagoda import LLM, SamplingParams

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(20, 40))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    settings = dict(max_model_len=128, block_size=4, dtype="float32", seed=0)
    calm = [out.outputs[0].token_ids for out in LLM("tiny", **settings).generate(prompts, params)]
    engine = LLM("tiny", num_kv_blocks=40, swap_space=64 / (1 << 20), **settings).engine  # 64 KiB of slots
    swap, failed = engine.runner._swap, []

    def failing_swap(swap_out: list[int], swap_in: list[int]) -> None:
        if swap_out and not failed:
            failed.append(len(swap_out) // 2)
            raise RuntimeError("swap copy failed")
        swap(swap_out, swap_in)

    engine.runner._swap = failing_swap  # type: ignore[method-assign]
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(index))
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        try:
            engine.step(deltas=False)
        except RuntimeError as error:
            assert "swap copy failed" in str(error)
    assert failed, "no plan swapped a sequence out"
    outputs = [engine.pop_output(str(index)).outputs[0] for index in range(len(prompts))]
    assert any(len(out.token_ids) < 16 for out in outputs), "the failed step ended some requests"
    assert {out.finish_reason for out in outputs} == {"length", "error"}, "every request ends, those cut as errors"
    for out, want in zip(outputs, calm, strict=True):
        assert out.token_ids == want or out.finish_reason == "error", "a survivor came back from unwritten slots"
