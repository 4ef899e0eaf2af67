"""The engine against Hugging Face transformers on the real SmolLM2 model and a tiny random Qwen3:
greedy tokens equal (also under preemption and chunked prefill), logits equal, prefix reuse exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.shared.messages import StepPlan

pytestmark = pytest.mark.slow

NEW_TOKENS = 32  # issue 2 asked 64; 32 since 4fe7d33 (the transformers reference fixture took 76 s for 64)
PROMPT_LENGTHS = [5, 8, 13, 21, 34, 50, 64, 90, 120, 150, 190, 230, 270, 320, 360, 400]
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years "
    "printing shops had spread to more than two hundred cities across Europe, and the price of books fell "
    "sharply. Scholars could compare identical copies of a text for the first time, which changed how "
    "knowledge was checked and shared. Meanwhile, in the kitchen, a good loaf of bread needs only flour, "
    "water, salt and yeast, yet bakers argue endlessly about hydration, fermentation time and oven "
    "temperature. A sourdough starter is a colony of wild yeast and lactic acid bacteria that gives the "
    "bread its sour taste. Question: how many planets are in the solar system, and which one is largest? "
    "Answer: there are eight planets, and Jupiter is the largest, more than twice as massive as all the "
    "others combined. def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nprint([fibonacci(i) for i in range(10)])\nThe output of this program is a list "
    "of the first ten Fibonacci numbers. In 1969 Apollo 11 landed on the Moon; Neil Armstrong and Buzz "
    "Aldrin walked on the surface while Michael Collins orbited above. Les fleurs du jardin sont belles au "
    "printemps, et les enfants jouent dans le parc jusqu'au soir. Climate scientists measure the "
    "concentration of carbon dioxide in the atmosphere at observatories such as Mauna Loa, where the "
    "record began in 1958. The seasons follow from the tilt of the Earth's axis, not from its distance "
    "to the Sun, which is a common misconception among students and adults alike. "
)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = tokenizer.encode(TEXT * 3)
    assert len(ids) >= 300 + max(PROMPT_LENGTHS)
    # Different starting points so the prompts are not prefixes of one another.
    return [ids[(37 * i) % 300:(37 * i) % 300 + length] for i, length in enumerate(PROMPT_LENGTHS)]


# The greedy-parity prompts: every other length (5 to 360 tokens), so the reference costs half as much.
GREEDY = list(range(0, len(PROMPT_LENGTHS), 2))


@pytest.fixture(scope="module")
def greedy_prompts(prompts: list[list[int]]) -> list[list[int]]:
    return [prompts[i] for i in GREEDY]


EOS = 2  # SmolLM2's


@pytest.fixture(scope="module")
def check_hf_greedy(hf_model):  # noqa: ANN001, ANN201
    """A check that each output is transformers' greedy continuation of its prompt: every token is the argmax of
    transformers' fp32 logits after the prompt and the tokens before it, and the output runs to NEW_TOKENS or ends
    at its first EOS, where generate stops. One forward over prompt + output per prompt (generate's 32 cached
    steps a prompt took 20 s of the suite for the same tokens); a pair already checked is not checked again."""
    checked: set[tuple[int, ...]] = set()

    def check(prompts: list[list[int]], outputs: list[list[int]]) -> None:
        assert len(outputs) == len(prompts)
        for prompt, output in zip(prompts, outputs, strict=True):
            key = (len(prompt), *prompt, *output)
            if key in checked:
                continue
            assert len(output) == NEW_TOKENS or output[-1:] == [EOS], (len(prompt), output)
            assert EOS not in output[:-1], (len(prompt), output)
            with torch.inference_mode():
                logits = hf_model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1]  # [N, V]
            greedy = logits.argmax(dim=-1).tolist()
            assert output == greedy, f"prompt of {len(prompt)} tokens: ours {output}, transformers' {greedy}"
            checked.add(key)

    return check


@pytest.fixture(scope="module")
def uncached_llm(smollm2_dir: Path) -> LLM:
    """The default engine without prefix caching, for the tests that only generate with it (an engine took ~2 s of
    CPU to build)."""
    return LLM(str(smollm2_dir), enable_prefix_caching=False)


@pytest.fixture(scope="module")
def unhurried(uncached_llm: LLM, prompts: list[list[int]]) -> list:  # list[RequestOutput]
    """prompts[6:12] (64-230 tokens) with room for all: 16 greedy tokens with their logprobs, and the prompts'
    scores; what the preemption tests' cramped engines must give (each compared its own run of these before)."""
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, prompt_logprobs=1)
    return uncached_llm.generate(prompts[6:12], params)


def _pagoda_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def _record_plans(llm: LLM) -> list[StepPlan]:
    """Spy on the plans the engine sends its runner."""
    plans: list[StepPlan] = []
    runner = llm.engine.runner
    launch = runner.launch

    def recording(plan: StepPlan):  # noqa: ANN202
        plans.append(plan)
        return launch(plan)

    runner.launch = recording  # type: ignore[method-assign]
    return plans


def test_greedy_matches_transformers_batched(smollm2_dir: Path, greedy_prompts,  # noqa: ANN001
                                             check_hf_greedy) -> None:  # noqa: ANN001
    llm = LLM(str(smollm2_dir))
    plans = _record_plans(llm)
    check_hf_greedy(greedy_prompts, _pagoda_greedy(llm, greedy_prompts))
    assert max(len(plan.seq_ids) for plan in plans) == len(greedy_prompts), "the prompts never ran together"


@pytest.mark.extended  # test_prompt_logprobs_survive_preemption and test_async_scheduling cover preemption
def test_greedy_matches_transformers_under_preemption(smollm2_dir: Path, greedy_prompts,  # noqa: ANN001
                                                     check_hf_greedy) -> None:  # noqa: ANN001
    # 30 blocks x 16 tokens hold the longest sequence (392 tokens) but not all 8 at once (~80 blocks).
    llm = LLM(str(smollm2_dir), num_kv_blocks=30)
    check_hf_greedy(greedy_prompts, _pagoda_greedy(llm, greedy_prompts))
    assert llm.engine.scheduler.stats.num_preemptions > 0
    llm.engine.scheduler.blocks.check_integrity([])


def test_greedy_matches_transformers_with_every_prompt_chunked(smollm2_dir: Path, greedy_prompts,  # noqa: ANN001
                                                               check_hf_greedy) -> None:  # noqa: ANN001
    # The greedy prompts of 50 tokens and more (64 to 360), with a 49-token budget: every one is split over
    # several steps (a 4-token budget over all 16 prompts took 900 steps and 138 s of the suite for the same
    # property).
    chosen = [i for i, prompt in enumerate(greedy_prompts) if len(prompt) >= 50]
    budget = 49
    llm = LLM(str(smollm2_dir), max_num_batched_tokens=budget, enable_prefix_caching=False)
    plans = _record_plans(llm)
    check_hf_greedy([greedy_prompts[i] for i in chosen], _pagoda_greedy(llm, [greedy_prompts[i] for i in chosen]))
    assert all(sum(plan.num_scheduled_tokens) <= budget for plan in plans)
    first_chunks = [new.seq_id for plan in plans for new in plan.new_requests]
    assert len(first_chunks) == len(chosen)


def test_prompt_logprobs_match_transformers(smollm2_dir: Path, hf_model, prompts) -> None:  # noqa: ANN001
    """prompt_logprobs over chunked prompts, n=2, and a prompt whose blocks sit in the prefix cache (its scores
    must be computed anyway): each prompt token's logprob and top 3 are transformers' log_softmax."""
    llm = LLM(str(smollm2_dir), max_num_batched_tokens=48)
    chosen = [prompts[3], prompts[9], prompts[12]]
    params = [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3),
              SamplingParams(temperature=0.8, max_tokens=3, n=2, seed=5, prompt_logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)]
    llm.generate([prompts[12]], SamplingParams(temperature=0.0, max_tokens=1))  # its blocks now cached
    outputs = llm.generate(chosen, params)
    assert outputs[2].num_cached_tokens == 0  # scored prompts skip the prefix cache
    plain = llm.generate([prompts[3]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
    for prompt, param, output in zip(chosen, params, outputs, strict=True):
        with torch.inference_mode():
            expected = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [L, V]
        scores = output.prompt_logprobs
        assert scores is not None and len(scores) == len(prompt) and scores[0] is None
        k = param.prompt_logprobs
        for i in range(1, len(prompt)):
            row = expected[i - 1]
            top = row.topk(k).indices.tolist() if k else []
            assert set(scores[i]) == {prompt[i], *top}, i
            got = torch.tensor([scores[i][t] for t in [prompt[i], *top]])
            torch.testing.assert_close(got, row[[prompt[i], *top]], atol=2e-4, rtol=1e-4)


def test_prompt_logprobs_survive_preemption(smollm2_dir: Path, prompts, unhurried) -> None:  # noqa: ANN001
    """A preempted prompt is computed again: its scores still come once each, and equal an unhurried run's."""
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1)
    prompts = prompts[6:12]  # 64-230 tokens: ~58 blocks wanted against 40 (56 by the prompts), the longest fits alone
    calm = unhurried
    cramped = LLM(str(smollm2_dir), num_kv_blocks=40)
    pressed = cramped.generate(prompts, params)
    assert cramped.engine.scheduler.stats.num_preemptions > 0
    for prompt, a, b in zip(prompts, calm, pressed, strict=True):
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert len(b.prompt_logprobs) == len(prompt) and b.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            assert b.prompt_logprobs[i].keys() == a.prompt_logprobs[i].keys()
            assert b.prompt_logprobs[i][prompt[i]] == pytest.approx(a.prompt_logprobs[i][prompt[i]], abs=1e-4)


# serial: extended (make test-all); tests/test_swap_families.py and test_result_invariance.py swap under serial
# steps in the default run
@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=pytest.mark.extended), True])
def test_swapped_preemption_gives_the_unhurried_outputs(smollm2_dir: Path, prompts, unhurried,  # noqa: ANN001
                                                        async_scheduling: bool) -> None:
    """Preempted sequences' blocks go to host slots and come back (swap space) instead of being recomputed: the
    same tokens and logprobs as a run with room for all, serial and with a step in flight at each preemption."""
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    prompts = prompts[6:12]  # 64-230 tokens: ~59 blocks wanted against 40
    calm = unhurried
    swapping = LLM(str(smollm2_dir), num_kv_blocks=40, swap_space=0.25, async_scheduling=async_scheduling,
                   enable_prefix_caching=False)  # no prefix hits: every block comes back by copy
    pressed = swapping.generate(prompts, params)
    stats = swapping.engine.scheduler.stats
    assert stats.num_swapped > 0 and swapping.engine.runner.num_swap_blocks > 0
    for a, b in zip(calm, pressed, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=1e-3)
    swapping.engine.scheduler.host.settle()
    assert swapping.engine.scheduler.host.num_free_blocks == swapping.engine.scheduler.host.num_blocks


def _spy_logits(llm: LLM) -> list[torch.Tensor]:
    """Capture the logits the runner hands its sampler."""
    captured: list[torch.Tensor] = []
    sampler = llm.engine.runner.sampler

    def spying(logits: torch.Tensor, metadata):  # noqa: ANN001, ANN202
        captured.append(logits.clone())
        return sampler(logits, metadata)

    llm.engine.runner.sampler = spying  # type: ignore[assignment]
    return captured


def _hf_last_logits(model, prompt: list[int]) -> torch.Tensor:  # noqa: ANN001
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1].float()


@pytest.mark.extended  # test_prompt_logprobs_match_transformers (every position's log_softmax of chunked prompts, to
# 2e-4) and test_greedy_matches_transformers_batched (the sampler's row after each prefill: HF's argmax) cover it
def test_logits_match_transformers_smollm2(smollm2_dir: Path, hf_model, prompts) -> None:  # noqa: ANN001
    # A small budget makes the longer prompts arrive in chunks over several steps.
    llm = LLM(str(smollm2_dir), max_num_batched_tokens=96)
    captured = _spy_logits(llm)
    chosen = [prompts[0], prompts[6], prompts[11], prompts[15]]
    llm.generate(chosen, SamplingParams(temperature=0.0, max_tokens=1))
    ours = torch.cat(captured)  # rows in the order the prompts finished prefill
    for prompt in chosen:
        expected = _hf_last_logits(hf_model, prompt)
        diffs = (ours - expected).abs().amax(dim=-1)
        assert diffs.min().item() <= 1e-3, f"no pagoda row matches prompt of {len(prompt)} tokens"


def _tiny_qwen3(tmp_path: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6, eos_token_id=2)
    model = Qwen3ForCausalLM(config).float()
    with torch.no_grad():  # HF initialises norms to 1: perturb them so q/k norm weights matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(tmp_path)
    return tmp_path


def test_logits_match_transformers_tiny_qwen3(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = _tiny_qwen3(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert not hf.config.tie_word_embeddings
    generator = torch.Generator().manual_seed(1)
    chosen = [torch.randint(3, 320, (length,), generator=generator).tolist() for length in (7, 33, 70, 129)]
    llm = LLM(str(folder), max_num_batched_tokens=64, num_kv_blocks=64)
    captured = _spy_logits(llm)
    outputs = llm.generate(chosen, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    ours = torch.cat(captured)
    for prompt, output in zip(chosen, outputs, strict=True):
        # the prefill logits, then each decode step's, against transformers on the growing sequence
        sequence = prompt + output.outputs[0].token_ids
        for end in range(len(prompt), len(sequence)):
            expected = _hf_last_logits(hf, sequence[:end])
            assert (ours - expected).abs().amax(dim=-1).min().item() <= 1e-3


def test_prefix_cache_recomputes_only_the_tail(smollm2_dir: Path, prompts, uncached_llm: LLM) -> None:  # noqa: ANN001
    llm = LLM(str(smollm2_dir))
    shared = (prompts[15] * 2)[:256]
    first = shared + prompts[3][:20]
    second = shared + prompts[5][:30]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    llm.generate([first], params)
    plans = _record_plans(llm)
    [cached_output] = llm.generate([second], params)
    seq_id = plans[0].new_requests[0].seq_id
    computed = sum(count for plan in plans for req, count in zip(plan.seq_ids, plan.num_scheduled_tokens,
                                                                  strict=True) if req == seq_id)
    num_outputs = len(cached_output.outputs[0].token_ids)
    # the 30-token tail, then one decode step per generated token after the first
    assert computed == len(second) - 256 + num_outputs - 1
    assert plans[0].new_requests[0].num_computed_tokens == 256
    assert cached_output.num_cached_tokens == 256
    [uncached_output] = uncached_llm.generate([second], params)
    assert cached_output.outputs[0].token_ids == uncached_output.outputs[0].token_ids


def test_ops_bit_identical_to_transformers_in_bf16() -> None:
    """The parity probe on CPU, bf16, tiny random Qwen3: every op but attention, fed transformers' own inputs,
    gives transformers' bits; attention and the whole model stay within bf16 rounding."""
    from pagoda.bench.parity_probe import run as probe

    rows = probe("tiny-qwen3", prompt_len=40, dtype_name="bfloat16", device_name="cpu", seed=3)
    exact = [name for name in rows if name.split(".")[1] not in ("attention", "attention_torch_ref", "logits")]
    assert {"prefill.rope", "decode.rope", "prefill.qkv_gemm_fused", "decode.silu_and_mul"} <= set(exact)
    assert {name: rows[name]["differ"] for name in exact if rows[name]["differ"]} == {}
    for name in ("prefill.attention", "decode.attention", "model.logits"):
        assert rows[name]["max_abs"] <= 0.02 * rows[name]["max"], (name, rows[name])
