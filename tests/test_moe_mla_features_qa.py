"""The engine's features on the mixture-of-experts and latent-attention families, as a user meets them: tiny random
DeepSeek-V2 (no q_lora, YaRN past a 32-token window, grouped softmax routing), DeepSeek-V3 (q_lora, grouped sigmoid
routing with a correction bias) and Qwen3-MoE checkpoints that transformers builds and saves with SmolLM2's
tokenizer beside them. Where transformers can say (logprobs, prompt logprobs, beams, penalties) it is the oracle in
fp32; elsewhere the same request with the feature off, or alone on a roomy cache, is. The cache layout (one
[latent | rope] entry a token and layer for MLA) meets the prefix cache, block forking for beams and n > 1,
preemption by recompute and by swap, chunked prefill and the fp8 cache here."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda import LLM, ContextLengthError, SamplingParams
from pagoda.shared.errors import ConfigError
from pagoda.shared.messages import StructuredOutputs
from pagoda.shared.shapes import load_arch
from tests.parity import random_prompts

pytestmark = pytest.mark.slow

VOCAB = 49152  # SmolLM2's tokenizer: text prompts, stop strings and grammars work
WINDOW = 32  # the DeepSeek configs' YaRN original window: prompts here go past it
BLOCK = 8
# logprobs against transformers' fp32 on the CPU: the CPU path's fp32 references agree to ~1e-5; on CUDA Triton's
# tl.dot takes fp32 operands as TF32 (10-bit mantissa), as tests/test_deepseek.py allows for
LOGPROB_ATOL = 2e-3 if torch.cuda.is_available() else 2e-4
FAMILIES = ("deepseek-v2", "deepseek-v3", "qwen3-moe")


def _sharpen_and_save(model: Any, folder: Path, correction_bias: bool = False) -> None:
    """transformers' init leaves every logit near 0 (log 49152 for every token: ties everywhere, seeds that draw the
    same tokens on any model); a wider LM head, stronger norms, router and attention give clear choices."""
    torch.manual_seed(11)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
            if name.endswith("gate.weight"):
                param.normal_(0.0, 0.5)
            if "self_attn" in name and "o_proj" not in name and name.endswith("weight") and param.dim() == 2:
                param.normal_(0.0, 1.5 / param.shape[1] ** 0.5)
        if correction_bias:
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(0.3 * torch.randn_like(buffer))
    model.save_pretrained(folder)


def _build(family: str, folder: Path, tokenizer_dir: Path) -> Path:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, eos_token_id=2, bos_token_id=1,
                  tie_word_embeddings=False)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
            "original_max_position_embeddings": WINDOW}
    mla = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
               n_routed_experts=8, first_k_dense_replace=1, max_position_embeddings=4 * WINDOW)
    torch.manual_seed(0)
    if family == "deepseek-v2":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(**common, **mla, q_lora_rank=None, n_shared_experts=2, num_experts_per_tok=3,
                                  topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                  routed_scaling_factor=1.5,
                                  rope_parameters={**yarn, "mscale": 0.707, "mscale_all_dim": 0.707})
        _sharpen_and_save(DeepseekV2ForCausalLM(config).float(), folder)
    elif family == "deepseek-v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        config = DeepseekV3Config(**common, **mla, q_lora_rank=48, n_shared_experts=1, num_experts_per_tok=2,
                                  n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                                  rope_interleave=True,
                                  rope_parameters={**yarn, "mscale": 1.0, "mscale_all_dim": 0.8})
        _sharpen_and_save(DeepseekV3ForCausalLM(config).float(), folder, correction_bias=True)
    else:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                                max_position_embeddings=512, rope_theta=10000.0)
        _sharpen_and_save(Qwen3MoeForCausalLM(config).float(), folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(request: pytest.FixtureRequest) -> Path:
    """SmolLM2's tokenizer files: the tokenizer-only copy a GPU machine is carried (bench/gpu_check.sh's
    .gpu/smollm2-tok; there the smollm2_dir fixture would try to download the weights), else the model folder's."""
    carried = Path(__file__).resolve().parents[1] / ".gpu" / "smollm2-tok"
    if (carried / "tokenizer.json").is_file():
        return carried
    return request.getfixturevalue("smollm2_dir")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    return {family: _build(family, tmp_path_factory.mktemp(family), tokenizer_dir) for family in FAMILIES}


class Family:
    """One family's folder, its roomy engine (shared by the tests) and its transformers model (the oracle)."""

    def __init__(self, name: str, folder: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.name, self.folder = name, folder
        self.llm = LLM(str(folder), dtype="float32", num_kv_blocks=256, block_size=BLOCK)
        self.hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    @property
    def mla(self) -> bool:
        return self.name.startswith("deepseek")

    def engine(self, **engine_args: Any) -> LLM:
        engine_args.setdefault("block_size", BLOCK)
        return LLM(str(self.folder), dtype="float32", **engine_args)

    def log_softmax(self, token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(self.hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)  # [T, V]

    def hf_greedy(self, prompt: list[int], new_tokens: int, **generate_args: Any) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None, **generate_args)
        return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, folders: dict[str, Path]) -> Iterator[Family]:
    yield Family(request.param, folders[request.param])


# The cache-layout tests' DeepSeek-V3 rows are extended: V3's MLA cache entry is V2's ([latent | rope] a token and
# layer; V3 differs in q_lora and routing, which its logprobs, beam, penalty and text rows here and
# tests/test_deepseek.py's V3 parity check), so the same test's [deepseek-v2] row covers them in the default run.
CACHE_FAMILIES = [pytest.param(name, marks=pytest.mark.extended) if name == "deepseek-v3" else name
                  for name in FAMILIES]


def _greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def _assert_no_blocks_held(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    assert not llm.engine.has_unfinished_requests()
    scheduler.blocks.check_integrity([])


# ---------------------------------------------------------------------------------------------------------- oracles


def test_logprobs_and_prompt_logprobs_are_transformers_log_softmax(family: Family) -> None:
    """Prompt logprobs (the prompt's token and the top 2) and sampled logprobs (top 3) of a prompt past the YaRN
    window, prefilled in chunks beside a short one: transformers' log_softmax over the same ids; greedy tokens are
    its argmax."""
    prompts = random_prompts([13, 70], VOCAB, seed=4)
    llm = family.engine(num_kv_blocks=64, max_num_batched_tokens=24)
    outputs = llm.generate(prompts, _greedy(4, logprobs=3, prompt_logprobs=2))
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        expected = family.log_softmax(prompt + list(completion.token_ids))  # [T, V]
        assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
        assert len(output.prompt_logprobs) == len(prompt)
        for i in range(1, len(prompt)):
            row = expected[i - 1]
            top = row.topk(2)
            wanted = {prompt[i]: row[prompt[i]].item(),
                      **dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))}
            got = output.prompt_logprobs[i]
            assert set(wanted) <= set(got)
            assert [got[t].logprob for t in wanted] == pytest.approx(list(wanted.values()), abs=LOGPROB_ATOL)
        for j, token in enumerate(completion.token_ids):
            row = expected[len(prompt) - 1 + j]
            assert token == int(row.argmax())
            top = row.topk(3)
            got = completion.logprobs[j]
            got_top = [got[t].logprob for t in top.indices.tolist()]
            assert got_top == pytest.approx(top.values.tolist(), abs=LOGPROB_ATOL)
    _assert_no_blocks_held(llm)


def test_beam_search_forks_latent_blocks_as_transformers_searches(family: Family) -> None:
    """Width 3 (n 2, and LLM.beam_search's n 3) over prompts that end inside a block (the beams share it, then copy
    it on write): transformers' beams and scores; every block comes back."""
    from pagoda.llm import BeamSearchParams

    prompts = random_prompts([13, 33], VOCAB, seed=7)
    expected = []  # transformers' 3 hypotheses and their scores, best first, for each prompt
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = family.hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=3,
                                     num_return_sequences=3, max_new_tokens=6, pad_token_id=0, eos_token_id=2,
                                     return_dict_in_generate=True, output_scores=True)
            expected.append(([row[len(prompt):] for row in out.sequences.tolist()], out.sequences_scores.tolist()))
    assert all(2 not in tokens for sequences, _ in expected for tokens in sequences)  # no hypothesis ended early
    outputs = family.llm.generate(prompts, SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=6,
                                                          temperature=0.0))
    for output, (sequences, scores) in zip(outputs, expected, strict=True):
        assert [list(c.token_ids) for c in output.outputs] == sequences[:2]
        assert [c.score for c in output.outputs] == pytest.approx(scores[:2], rel=1e-4, abs=LOGPROB_ATOL)
    searched = family.llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                                      BeamSearchParams(beam_width=3, max_tokens=6))
    for prompt, output, (sequences, _) in zip(prompts, searched, expected, strict=True):
        assert [s.tokens[len(prompt):] for s in output.sequences] == sequences
    _assert_no_blocks_held(family.llm)


def test_penalties_and_logit_bias_follow_transformers(family: Family) -> None:
    """repetition_penalty as transformers' processor; presence + frequency penalties and logit_bias (one token
    raised, one banned) as a processor written from OpenAI's definition, over the generated tokens only."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class OpenAIPenalties(LogitsProcessor):
        def __init__(self, prompt_len: int, presence: float, frequency: float, bias: dict[int, float]) -> None:
            self.prompt_len, self.presence, self.frequency, self.bias = prompt_len, presence, frequency, bias

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            generated = input_ids[0, self.prompt_len:].tolist()
            for token in set(generated):
                scores[0, token] -= self.presence + self.frequency * generated.count(token)
            for token, value in self.bias.items():
                scores[0, token] += value
            return scores

    prompt = random_prompts([40], VOCAB, seed=4)[0]
    repeated = family.llm.generate([prompt], _greedy(10, repetition_penalty=1.8))[0].outputs[0].token_ids
    assert list(repeated) == family.hf_greedy(prompt, 10, repetition_penalty=1.8)
    bias = {5: 3.0, family.hf_greedy(prompt, 1)[0]: -100.0}  # the greedy first token banned
    params = _greedy(12, presence_penalty=1.5, frequency_penalty=0.8, logit_bias=bias)
    penalised = family.llm.generate([prompt], params)[0].outputs[0].token_ids
    processors = LogitsProcessorList([OpenAIPenalties(len(prompt), 1.5, 0.8, bias)])
    assert list(penalised) == family.hf_greedy(prompt, 12, logits_processor=processors)


# ------------------------------------------------------------------------------------------------- the cache layout


@pytest.mark.parametrize("family", CACHE_FAMILIES, indirect=True)
def test_prefix_cache_hits_give_the_uncached_tokens_and_salts_keep_apart(family: Family) -> None:
    """Two prompts sharing 70 tokens (past the YaRN window): the second reads 64 cached tokens (8 full blocks) and
    generates what transformers does; a salted request shares nothing with unsalted ones and
    everything with its own salt."""
    shared = random_prompts([70], VOCAB, seed=1)[0]
    first, second = shared + [11, 12, 13, 14, 15], shared + [21, 22, 23, 24, 25, 26]
    wanted = [family.hf_greedy(first, 8), family.hf_greedy(second, 8)]
    llm = family.engine(num_kv_blocks=64)
    got_first = llm.generate([first], _greedy(8))[0]
    got_second = llm.generate([second], _greedy(8))[0]
    assert (got_first.num_cached_tokens, got_second.num_cached_tokens) == (0, 64)
    assert [list(got_first.outputs[0].token_ids), list(got_second.outputs[0].token_ids)] == wanted
    salted = llm.generate([{"prompt_token_ids": second, "cache_salt": "tenant-a"}], _greedy(8))[0]
    assert salted.num_cached_tokens == 0 and list(salted.outputs[0].token_ids) == wanted[1]
    salted_again = llm.generate([{"prompt_token_ids": first, "cache_salt": "tenant-a"}], _greedy(8))[0]
    assert salted_again.num_cached_tokens == 64 and list(salted_again.outputs[0].token_ids) == wanted[0]
    _assert_no_blocks_held(llm)


SMALL_SCHEMA = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 6}}, "required": ["k"],
                "additionalProperties": False}


def _mixed_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Eight prompts sharing 20 tokens, in four modes: greedy with logprobs, seeded n=2 sampling with top_p, beam
    search (width 3, n 2), seeded top_k sampling with all three penalties under a JSON schema."""
    shared = random_prompts([20], VOCAB, seed=9)[0]
    prompts = [shared + p for p in random_prompts([5, 30, 12, 41, 8, 25, 17, 33], VOCAB, seed=3)]
    modes: list[Callable[[int], SamplingParams]] = [
        lambda i: _greedy(12, logprobs=2),
        lambda i: SamplingParams(temperature=0.9, top_p=0.9, seed=i, n=2, max_tokens=12, ignore_eos=True),
        lambda i: SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=10, temperature=0.0),
        lambda i: SamplingParams(temperature=0.7, top_k=20, seed=i, max_tokens=24,
                                 presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                                 structured_outputs=StructuredOutputs(json=SMALL_SCHEMA)),
    ]
    return prompts, [modes[i % 4](i) for i in range(len(prompts))]


def _completions(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    outputs = llm.generate(prompts, params)
    for output, sampling in zip(outputs, params, strict=True):
        if sampling.structured_outputs is not None:
            assert set(json.loads(output.outputs[0].text)) == {"k"}
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("pressure", ["recompute", "swap-chunked"])
@pytest.mark.parametrize("family", CACHE_FAMILIES, indirect=True)
def test_preempted_requests_give_what_they_give_on_a_roomy_cache(family: Family, pressure: str) -> None:
    """The mixed workload on 22 blocks of 8 (beam groups and n=2 forks included): preempted by recompute (its prefix
    cache hits make that cheap), or by swap (2 MiB of host slots) with 16-token chunks; each request's completions
    equal those of the roomy engine, and every block and host slot comes back."""
    prompts, params = _mixed_workload()
    roomy = _completions(family.llm, prompts, params)
    if pressure == "recompute":
        llm = family.engine(num_kv_blocks=22)
    else:
        llm = family.engine(num_kv_blocks=22, swap_space=0.002, max_num_batched_tokens=16)
    assert _completions(llm, prompts, params) == roomy
    stats = llm.engine.scheduler.stats
    assert stats.num_preemptions > 0
    assert (stats.num_swapped > 0) == (pressure == "swap-chunked")
    _assert_no_blocks_held(llm)
    llm.engine.scheduler.host.settle()
    assert llm.engine.scheduler.host.num_free_blocks == llm.engine.scheduler.host.num_blocks


@pytest.mark.parametrize("family", CACHE_FAMILIES, indirect=True)
def test_aborting_beams_and_forks_mid_swap_returns_every_block_and_slot(family: Family) -> None:
    """A beam search, an n=3 request and two greedy ones on 22 blocks with swap space: once some sequence has been
    swapped out, all four are aborted; every block and host slot comes back and the engine serves on."""
    llm = family.engine(num_kv_blocks=22, swap_space=0.002)
    engine, scheduler = llm.engine, llm.engine.scheduler
    prompts = random_prompts([30, 41, 25, 33], VOCAB, seed=2)
    request_ids = [
        engine.add_request(prompts[0], SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=20,
                                                      temperature=0.0)),
        engine.add_request(prompts[1], SamplingParams(temperature=0.9, n=3, seed=1, max_tokens=30, ignore_eos=True)),
        *(engine.add_request(prompt, _greedy(30)) for prompt in prompts[2:]),
    ]
    for _ in range(40):
        if scheduler.stats.num_swapped > 0:
            break
        engine.step()
    assert scheduler.stats.num_swapped > 0
    for request_id in request_ids:
        engine.abort_request(request_id)
    for _ in range(4):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    _assert_no_blocks_held(llm)
    scheduler.host.settle()
    assert scheduler.host.num_free_blocks == scheduler.host.num_blocks
    assert len(llm.generate([prompts[2]], _greedy(8))[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("family", CACHE_FAMILIES, indirect=True)
def test_fp8_cache_serves_its_own_prefix_hits_and_holds_four_times_the_blocks(family: Family) -> None:
    """--kv-cache-dtype fp8 runs on the CPU: a prompt served again from its cached e4m3 blocks gives the tokens and
    logprobs of its first, uncached run; a byte budget holds 4x the fp32 blocks, and an MLA block is one
    [latent | rope] entry a token and layer (kv_lora_rank + qk_rope_head_dim values), not K and V per head."""
    prompts = random_prompts([13, 40, 70], VOCAB, seed=4)
    llm = family.engine(num_kv_blocks=64, kv_cache_dtype="fp8", kv_scale_calibration=True)
    first = llm.generate(prompts, _greedy(8, logprobs=0))
    again = llm.generate(prompts, _greedy(8, logprobs=0))
    assert [o.num_cached_tokens for o in again] == [8, 32, 64]
    for one, two in zip(first, again, strict=True):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        assert two.outputs[0].cumulative_logprob == pytest.approx(one.outputs[0].cumulative_logprob, abs=LOGPROB_ATOL)
    arch = load_arch(family.folder)
    if family.mla:
        assert arch.mla is not None
        values_per_token = arch.num_layers * (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim)
    else:
        values_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim
    budget = 1 << 20
    for kv_cache_dtype, value_bytes in (("auto", 4), ("fp8", 1)):
        runner = family.engine(kv_cache_memory=budget, kv_cache_dtype=kv_cache_dtype).engine.runner
        assert runner.kv_bytes_per_block() == BLOCK * values_per_token * value_bytes
        assert runner.num_blocks == budget // runner.kv_bytes_per_block()


@pytest.mark.parametrize(("shape", "ratio"), [("deepseek-v2-lite", 8.9), ("deepseek-v3-slice", 71.1)])
def test_latent_blocks_per_gib_against_per_head_k_and_v(shape: str, ratio: float) -> None:
    """docs/deepseek.md's figures: a bf16 GiB holds 8.9x (V2-Lite, 16 heads) and 71x (V3, 128 heads) the tokens it
    would with K (qk_nope + qk_rope) and V per head; the worker's layout and the shape's byte count agree, on every
    tensor-parallel rank (the latent is replicated)."""
    from pagoda.services.worker.models import deepseek
    from pagoda.shared.shapes import SHAPES

    arch = SHAPES[shape]
    assert arch.mla is not None
    for tp_size in (1, 2):
        assert deepseek.kv_layout(arch, tp_size).bytes_per_token(arch.num_layers, 2) == arch.kv_bytes_per_token(2)
    per_head = arch.num_layers * arch.num_heads * (arch.mla.qk_head_dim + arch.mla.v_head_dim) * 2
    assert per_head / arch.kv_bytes_per_token(2) == pytest.approx(ratio, abs=0.05)
    blocks_per_gib = (1 << 30) // (16 * arch.kv_bytes_per_token(2))
    assert blocks_per_gib == (1 << 30) // (16 * arch.num_layers * 576 * 2)


# ---------------------------------------------------------------------------------------------- what users send


def test_text_features_seeds_stops_min_tokens_and_constraints(family: Family) -> None:
    """A seeded request draws the same tokens alone and in a batch of others; a stop string taken from the greedy
    text ends it there; min_tokens holds back an EOS the bias makes certain; a JSON schema and a regex constrain the
    text (one greedy, one sampled, in one batch)."""
    llm = family.llm
    prompt = random_prompts([40], VOCAB, seed=4)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=8, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = random_prompts([3, 60, 22], VOCAB, seed=8)
    batch = llm.generate([others[0], prompt, *others[1:]],
                         [SamplingParams(temperature=0.5, max_tokens=6, seed=4), seeded, _greedy(9), _greedy(3)])
    assert batch[1].outputs[0].token_ids == alone

    text = llm.generate(["Hello there my friend"], _greedy(16))[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stopped = llm.generate(["Hello there my friend"], _greedy(16, stop=[stop]))[0].outputs[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert text.startswith(stopped.text) and stop not in stopped.text

    eos_certain = {2: 30.0}
    held = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, logit_bias=eos_certain,
                                                 min_tokens=4))[0].outputs[0]
    assert len(held.token_ids) == 5 and held.token_ids[-1] == 2 and held.finish_reason == "stop"
    assert 2 not in held.token_ids[:4]

    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "string", "maxLength": 5}},
              "required": ["a", "b"], "additionalProperties": False}
    constrained = llm.generate(["Give json", "Another"], [
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputs(json=schema)),
        SamplingParams(temperature=0.8, seed=3, max_tokens=40,
                       structured_outputs=StructuredOutputs(regex=r"[a-z]{3}-\d{2}"))])
    answer = json.loads(constrained[0].outputs[0].text)
    assert set(answer) == {"a", "b"} and 0 <= answer["a"] <= 99 and len(answer["b"]) <= 5
    assert re.fullmatch(r"[a-z]{3}-\d{2}", constrained[1].outputs[0].text)
    assert [o.outputs[0].finish_reason for o in constrained] == ["stop", "stop"]
    _assert_no_blocks_held(llm)


@pytest.mark.parametrize("family", CACHE_FAMILIES, indirect=True)
def test_context_and_capacity_refusals_name_their_limit(family: Family) -> None:
    """The context is YaRN's original window x factor for DeepSeek (128 here): a larger --max-model-len is a
    ConfigError; a request past it, or past what a 3-block cache holds, or a beam search whose beams need more
    blocks than the cache has, is a ContextLengthError and the engine serves on."""
    limit = load_arch(family.folder).context_limit
    assert limit == (4 * WINDOW if family.mla else 512)
    with pytest.raises(ConfigError) as caught:
        family.engine(max_model_len=limit + 1, num_kv_blocks=8)
    assert caught.value.param == "max_model_len" and str(limit) in caught.value.message
    with pytest.raises(ContextLengthError):
        family.llm.generate([random_prompts([limit - 4], VOCAB)[0]], _greedy(8))
    small = family.engine(num_kv_blocks=3)
    with pytest.raises(ContextLengthError) as refused:
        small.generate([random_prompts([30], VOCAB)[0]], _greedy(8))
    assert "KV cache holds at most 24 tokens" in str(refused.value)
    with pytest.raises(ContextLengthError) as beams:
        small.generate([random_prompts([12], VOCAB)[0]],
                       SamplingParams(use_beam_search=True, best_of=3, n=1, max_tokens=8, temperature=0.0))
    assert "beam search of width 3" in str(beams.value)
    assert len(small.generate([[5, 6, 7]], _greedy(4))[0].outputs[0].token_ids) == 4
    _assert_no_blocks_held(small)


# ------------------------------------------------------------------------------- processes (make test-all runs them)


@pytest.mark.extended
@pytest.mark.parametrize("name", ["deepseek-v2", "qwen3-moe"])
def test_two_tensor_parallel_ranks_generate_what_one_does(folders: dict[str, Path], name: str) -> None:
    """DeepSeek-V2 without q_lora (q_proj split by heads; the latent cache on both ranks) and Qwen3-MoE (experts
    split along their intermediate dim) on two gloo ranks: one rank's greedy tokens (test_deepseek covers V3)."""
    from tests.test_tensor_parallel import _generate_in_process, _generate_with_services

    single = _generate_in_process(folders[name])
    assert _generate_with_services(folders[name], 2) == single


@pytest.mark.extended
def test_two_served_replicas_on_a_small_swapping_cache(folders: dict[str, Path]) -> None:
    """`pagoda serve -dp 2` of DeepSeek-V2 with 20 blocks of 8 and swap space a replica: twelve concurrent requests
    get the offline engine's greedy and seeded n=2 tokens (preempted by swap on the way); echo's prompt logprobs are
    transformers'; a second prompt on a cached prefix reports its cached tokens, a salted one none."""
    import concurrent.futures

    from tests.harness import running_server

    folder = folders["deepseek-v2"]
    prompts = random_prompts([5, 30, 12, 41, 8, 25, 17, 33, 50, 20, 9, 44], VOCAB, seed=3)
    offline = LLM(str(folder), dtype="float32", num_kv_blocks=256, block_size=BLOCK)
    greedy = [list(o.outputs[0].token_ids) for o in offline.generate(prompts, _greedy(12))]
    seeded = SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=12, ignore_eos=True)
    sampled = [[list(c.token_ids) for c in o.outputs] for o in offline.generate(prompts, seeded)]
    family = Family("deepseek-v2", folder)
    with running_server(folder, "--max-model-len", str(4 * WINDOW), "--data-parallel-size", "2", "--num-kv-blocks",
                        "20", "--block-size", str(BLOCK), "--swap-space", "0.002") as server:
        client = server.client()
        model = client.models.list().data[0].id
        as_ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}

        def ids(choice: Any) -> list[int]:
            return [int(token.split(":")[1]) for token in choice.logprobs.tokens]

        def one(prompt: list[int]) -> list[int]:
            answer = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
                                               extra_body=as_ids)
            return ids(answer.choices[0])

        def two(prompt: list[int]) -> list[list[int]]:
            answer = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0.9, seed=5,
                                               n=2, logprobs=0, extra_body=as_ids)
            return [ids(choice) for choice in sorted(answer.choices, key=lambda c: c.index)]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(one, prompts)) == greedy
            assert list(pool.map(two, prompts)) == sampled
        metrics = server.metrics()
        assert sum(v for k, v in metrics.items() if k.startswith("pagoda_num_swapped_preemptions_total")) > 0

        prompt = random_prompts([40], VOCAB, seed=12)[0]
        echoed = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=0,
                                           extra_body={"return_tokens_as_token_ids": True}).choices[0]
        expected = family.log_softmax(prompt)
        assert echoed.logprobs.token_logprobs[0] is None
        assert echoed.logprobs.token_logprobs[1:] == pytest.approx(
            [expected[i - 1, prompt[i]].item() for i in range(1, len(prompt))], abs=LOGPROB_ATOL)

        def cached(prompt: list[int], **extra: Any) -> int:
            usage = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                              extra_body=extra).usage
            return usage.prompt_tokens_details.cached_tokens

        shared = random_prompts([40], VOCAB, seed=13)[0]
        assert cached(shared + [7]) == 0
        assert cached(shared + [8]) == 40 // BLOCK * BLOCK
        assert cached(shared + [9], cache_salt="tenant-b") == 0
