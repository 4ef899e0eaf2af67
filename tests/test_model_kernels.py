"""The whole model with the Triton kernels (Triton's interpreter on CPU, the real thing on GPU) against the
PyTorch reference ops: same logits and same greedy tokens through chunked prefill, prefix hits and decode."""

from __future__ import annotations

import pytest
import torch

from pagoda.services.scheduler.scheduler import Request, Scheduler
from pagoda.services.worker.model_runner import ModelRunner
from pagoda.services.worker.models import reference_ops, triton_ops
from pagoda.shared.config import EngineConfig
from pagoda.shared.messages import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run(ops_name: str, shape: str, prompts: list[list[int]],
         budget: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and every step's logits of a dummy-weight shape with the given ops (chunked prefill under a
    token budget, prefix caching, decode)."""
    config = EngineConfig(model=shape, load_format="dummy", device=DEVICE, dtype="float32", num_kv_blocks=48,
                          max_model_len=256, max_num_seqs=8, enforce_eager=True, seed=5)
    runner = ModelRunner(config, ops=triton_ops() if ops_name == "triton" else reference_ops())
    captured: list[torch.Tensor] = []
    sampler = runner.sampler
    runner.sampler = lambda logits, meta: (captured.append(logits.detach().cpu().clone()), sampler(logits, meta))[1]  # type: ignore[assignment]
    scheduler = Scheduler(num_blocks=48, block_size=16, max_num_seqs=8, max_num_batched_tokens=budget,
                          max_model_len=256, vocab_size=runner.arch.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(request_id=str(i), prompt_token_ids=prompt, sampling=params, arrival_time=i))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        for update in scheduler.update(plan, runner.execute(plan)):
            outputs[update.seq.request.request_id].append(update.token_id)
    return [outputs[str(i)] for i in range(len(prompts))], captured


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen3"])
def test_triton_model_matches_reference_model(shape: str) -> None:
    generator = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 500, (32,), generator=generator).tolist()
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (3, 20, 41)]
    prompts.append(shared + [7, 8, 9])  # after prompts[0..2] it hits nothing; with the next one it shares blocks
    prompts.append(shared + [10, 11])
    ref_tokens, ref_logits = _run("reference", shape, prompts, budget=24)
    tri_tokens, tri_logits = _run("triton", shape, prompts, budget=24)
    assert tri_tokens == ref_tokens
    assert len(tri_logits) == len(ref_logits)
    for ours, expected in zip(tri_logits, ref_logits, strict=True):
        torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)
