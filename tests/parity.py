"""Greedy parity against transformers on tiny random checkpoints that transformers saves in a test: the oracle for
every model family (batched, every prompt chunked, and under preemption)."""

from __future__ import annotations

from pathlib import Path

import torch

from pagoda import LLM, SamplingParams

NEW_TOKENS = 24


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def hf_greedy(folder: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS,
              stop_at_eos: bool = False) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time, in fp32; EOS stops it only with
    `stop_at_eos` (at the EOS ids its generation_config.json lists)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    if not stop_at_eos:
        model.generation_config.eos_token_id = None  # pagoda runs with ignore_eos: no stop, no suppressed EOS
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=new_tokens, pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


# A parity check's engines (several in one process, each kept by its caller) take a fixed cache: on a GPU the
# default budget is most of the device, and the next engine would find it taken.
TEST_KV_BLOCKS = 256


def pagoda_greedy(folder: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS,
                  **engine_args) -> tuple[list[list[int]], LLM]:  # noqa: ANN003
    engine_args.setdefault("num_kv_blocks", TEST_KV_BLOCKS)
    llm = LLM(str(folder), dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)], llm


def check_greedy_parity(folder: Path, prompts: list[list[int]], preempt_blocks: int) -> None:
    """Batched; every prompt chunked (a 24-token budget: chunks attend to cached context); too few blocks for all
    (preemption, recompute): each generates what transformers does."""
    expected = hf_greedy(folder, prompts)
    batched, _ = pagoda_greedy(folder, prompts)
    assert batched == expected
    chunked, _ = pagoda_greedy(folder, prompts, max_num_batched_tokens=24, enable_prefix_caching=False)
    assert chunked == expected
    pressed, llm = pagoda_greedy(folder, prompts, num_kv_blocks=preempt_blocks)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert pressed == expected
