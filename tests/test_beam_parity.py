"""Beam search against an oracle: transformers' generate(num_beams=...) where it can say, and where it cannot
(temperature, stop ids with ignore_eos, a context-bound search, width 1) a plain-PyTorch beam search over the same
model's logits with transformers' rules, itself checked against generate. Cases test_beam_search.py and
test_beam_device.py leave out: widths 1 to 8, max_tokens 1, length penalties 0 and negative with "never", stop ids,
temperature, ignore_eos, cumulative logprobs, a context-bound search, beams beside greedy rows on a small cache, the
prefix cache after beams, LLM.beam_search's fields, the tokenizer's own EOS on the served path, a length penalty
past float's range, and a first step with more candidates than the vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pagoda.services.scheduler.scheduler import Request, Scheduler
from pagoda.shared.messages import SamplingParams
from tests.test_beam_search import EOS, answer, prompts_for, tiny_llama

# ---------------------------------------------------------------------------------------------
# the oracle


@dataclass(slots=True)
class Hyp:
    score: float  # cumulative logprob / generated_len ** length_penalty
    cumulative_logprob: float
    token_ids: list[int]
    stopped: bool


def oracle_beams(model, prompt: list[int], width: int, n: int, max_new: int, length_penalty: float = 1.0,  # noqa: ANN001
                 early_stopping: bool | str = False, stop_ids: frozenset[int] = frozenset(),
                 temperature: float = 1.0) -> list[Hyp]:
    """transformers' beam search (GenerationMixin._beam_search) written plainly: each step one forward of every
    running beam over its whole sequence (no KV cache), the max(2, 1 + stops) x width best continuations, hits among
    the width best finish, the width best others run on; stop once width are finished and, by early_stopping,
    enough so or no running beam can beat the worst. Temperatures other than 0 and 1 scale the logits first."""
    num_candidates = max(2, 1 + len(stop_ids)) * width
    scale = temperature if temperature not in (0.0, 1.0) else 1.0
    running: list[tuple[list[int], float]] = [([], 0.0)]  # (generated tokens, cumulative logprob)
    finished: list[Hyp] = []
    improvable = True
    for generated in range(1, max_new + 1):
        logits = next_logits(model, [prompt + tokens for tokens, _ in running])  # [beams, vocab]
        sums = torch.log_softmax(logits / scale, dim=-1) + torch.tensor([c for _, c in running])[:, None]
        vocab = sums.shape[-1]
        # transformers' first step also offers its copies of the one beam at -1e9: never among the width best
        top, flat = torch.topk(sums.flatten(), min(num_candidates, sums.numel()))  # [num_candidates]
        candidates = [(float(s), int(i) // vocab, int(i) % vocab) for s, i in zip(top, flat, strict=True)]
        hits = [token in stop_ids or generated == max_new for _, _, token in candidates]
        if not ((early_stopping is True and len(finished) == width) or not improvable):
            finished += [Hyp(s / generated ** length_penalty, s, running[b][0] + [t], t in stop_ids)
                         for (s, b, t), hit in zip(candidates[:width], hits, strict=False) if hit]
            finished = sorted(finished, key=lambda h: -h.score)[:width]
        order = sorted(range(len(candidates)), key=lambda j: -(candidates[j][0] - 1e9 * hits[j]))[:width]
        running = [(running[candidates[j][1]][0] + [candidates[j][2]], candidates[j][0] - 1e9 * hits[j])
                   for j in order]
        if len(finished) == width:
            length = max_new if early_stopping == "never" and length_penalty > 0 else generated
            best = max(c for _, c in running) / length ** length_penalty
            improvable = improvable and best > min(h.score for h in finished)
        if not improvable or (early_stopping is True and len(finished) == width) or all(hits):
            break
    return finished[:n]


_LOGITS: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}  # (model, sequence) -> its next token's logits


def next_logits(model, sequences: list[list[int]]) -> torch.Tensor:  # noqa: ANN001
    """The fp32 logits after each sequence, each from one forward over the whole sequence (remembered: the cases
    search the same prompts, and their beams share most prefixes)."""
    keys = [(id(model), tuple(seq)) for seq in sequences]
    missing = list(dict.fromkeys(k for k in keys if k not in _LOGITS))
    if missing:  # one forward, padded on the right: a causal model's logits before the padding do not see it
        width = max(len(seq) for _, seq in missing)
        ids = torch.tensor([list(seq) + [0] * (width - len(seq)) for _, seq in missing])  # [missing, width]
        with torch.inference_mode():
            logits = model(ids, use_cache=False).logits.float()  # [missing, width, vocab]
        for row, key in enumerate(missing):
            _LOGITS[key] = logits[row, len(key[1]) - 1]
    return torch.stack([_LOGITS[k] for k in keys])  # [sequences, vocab]


def oracle_greedy(model, prompt: list[int], max_new: int, stop_ids: frozenset[int]) -> list[int]:  # noqa: ANN001
    tokens: list[int] = []
    while len(tokens) < max_new and not (tokens and tokens[-1] in stop_ids):
        tokens.append(int(next_logits(model, [prompt + tokens])[0].argmax()))
    return tokens


def assert_matches(outputs, expected: list[list[Hyp]], stop_token_ids: tuple[int, ...] = ()) -> None:  # noqa: ANN001
    for output, hyps in zip(outputs, expected, strict=True):
        assert [c.token_ids for c in output.outputs] == [h.token_ids for h in hyps]
        assert [c.score for c in output.outputs] == pytest.approx([h.score for h in hyps], rel=1e-4, abs=1e-5)
        assert [c.cumulative_logprob for c in output.outputs] == pytest.approx(
            [h.cumulative_logprob for h in hyps], rel=1e-4, abs=1e-5)
        assert [c.finish_reason for c in output.outputs] == ["stop" if h.stopped else "length" for h in hyps]
        assert [c.stop_reason for c in output.outputs] == [
            h.token_ids[-1] if h.stopped and h.token_ids[-1] in stop_token_ids else None for h in hyps]


# prompt lengths around a block (16): the first step's fork with no partial block, and with one token in it
PROMPTS = prompts_for(0) + [[5] * 16, list(range(3, 35)), [7] * 15]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    return tiny_llama(tmp_path_factory.mktemp("tiny_beam_parity"), seed=0)


@pytest.fixture(scope="module")
def model(tiny: tuple[Path, int]):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny[0]), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(tiny: tuple[Path, int]):  # noqa: ANN201
    from pagoda import LLM

    return LLM(str(tiny[0]), num_kv_blocks=128)


def beam_params(width: int, n: int, max_tokens: int | None, length_penalty: float = 1.0,
                early_stopping: bool | str = False, **kwargs) -> SamplingParams:
    return SamplingParams(use_beam_search=True, best_of=width, n=n, max_tokens=max_tokens,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          **{"temperature": 0.0, **kwargs})


# ---------------------------------------------------------------------------------------------
# the tokenizer's own EOS (the served path's request.eos_token_ids) ends beams as it ends sampled rows


def test_a_requests_own_eos_ids_end_its_beams() -> None:
    """The served path gives each request its tokenizer's EOS ids (Request.eos_token_ids) beside the model's; a
    sampled row stops on them, and so must a beam: the hypothesis ends there and the worker continues no beam on it."""
    tokenizer_eos = 9
    scheduler = Scheduler(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                          vocab_size=100, eos_token_ids=[EOS])
    params = SamplingParams(use_beam_search=True, best_of=2, n=2, max_tokens=2, temperature=0.0).validate()
    request = Request(request_id="r", prompt_token_ids=[10, 11, 12, 13, 14], sampling=params,
                      eos_token_ids=frozenset({tokenizer_eos}))
    scheduler.add_request(request)
    assert request.beam is not None and request.beam.num_candidates == 3 * 2  # two stop ids: 3 x width
    plan = scheduler.schedule()
    scheduler.update(plan, answer(plan, [tokenizer_eos, 20, 21, 22, 23, 24], [0] * 6, [-0.1, -1, -2, -3, -4, -5]))
    assert [seq.token_ids[5:] for seq in request.sequences] == [[20], [21]]  # no beam runs on from it
    plan = scheduler.schedule()
    assert tokenizer_eos in plan.beam_groups[0].stop_token_ids  # nor does the worker continue one on it
    updates = scheduler.update(plan, answer(plan, [30, 31, 32, 33, 34, 35], [0, 1, 0, 1, 0, 1],
                                            [-1.5, -2.5, -3.5, -4.5, -5.5, -6.5]))
    ends = [(u.seq.index, u.token_id, u.finish_reason) for u in updates if u.finish_reason is not None]
    assert [token for _, token, _ in ends] == [tokenizer_eos, 30]  # -0.1 / 1 beats -1.5 / 2
    assert [reason.name for _, _, reason in ends] == ["STOP", "LENGTH"]


# ---------------------------------------------------------------------------------------------
# the engine against the oracle


def test_the_oracle_is_transformers_beam_search(tiny: tuple[Path, int], model) -> None:  # noqa: ANN001
    """The oracle's beams and scores are generate(num_beams=...)'s, so the tests below hold pagoda to transformers."""
    from tests.test_beam_search import hf_beams

    folder, eos = tiny
    prompts = PROMPTS[:3]
    for width, n, length_penalty, early_stopping in ((4, 3, 1.0, False), (3, 3, 2.0, "never")):
        expected = hf_beams(folder, prompts, eos, width, n, 10, length_penalty, early_stopping)
        for prompt, (sequences, scores) in zip(prompts, expected, strict=True):
            hyps = oracle_beams(model, prompt, width, n, 10, length_penalty, early_stopping, frozenset({eos}))
            assert [h.token_ids for h in hyps] == sequences
            assert [h.score for h in hyps] == pytest.approx(scores, rel=1e-4, abs=1e-5)


CASES = [  # width, n, max_tokens, length_penalty, early_stopping
    (1, 1, 8, 1.0, False),  # one beam: the first step forks nothing
    (2, 1, 10, 1.0, False),
    (3, 2, 1, 1.0, False),  # max_tokens 1: every candidate hits at the first step
    (8, 3, 10, 0.0, "never"),  # wide; "never" without a length penalty: the heuristic at the current length
    (5, 5, 10, -1.0, "never"),  # a negative penalty favours short hypotheses: "never" at the current length too
    (6, 6, 14, 1.5, "never"),  # "never" with a positive penalty: a running beam scored at max length
    (3, 2, 10, 0.0, True),
]


@pytest.mark.parametrize("width,n,max_tokens,length_penalty,early_stopping", CASES)
def test_beams_scores_and_cumulative_logprobs_match_the_oracle(tiny: tuple[Path, int], model, llm, width: int,  # noqa: ANN001
                                                               n: int, max_tokens: int, length_penalty: float,
                                                               early_stopping: bool | str) -> None:
    """Nine prompts of 3 to 40 tokens in one batch (15, 16 and 32: a block boundary at the first fork)."""
    _, eos = tiny
    outputs = llm.generate(PROMPTS, beam_params(width, n, max_tokens, length_penalty, early_stopping))
    expected = [oracle_beams(model, prompt, width, n, max_tokens, length_penalty, early_stopping, frozenset({eos}))
                for prompt in PROMPTS]
    assert_matches(outputs, expected)
    llm.engine.scheduler.blocks.check_integrity([])


def test_stop_token_ids_temperature_and_ignore_eos_follow_the_oracle(tiny: tuple[Path, int], model, llm) -> None:  # noqa: ANN001
    """stop_token_ids end hypotheses (stop_reason: the id; three stop ids: 4 x width candidates); a temperature
    other than 0 and 1 ranks by log_softmax(logits / T); ignore_eos runs past EOS while stop ids still stop."""
    _, eos = tiny
    free = [oracle_beams(model, prompt, 3, 3, 12)[0].token_ids for prompt in PROMPTS]
    stops = tuple(sorted({tokens[2] for tokens in free[:2]} | {free[3][4]}))  # tokens the best beams meet early
    assert eos not in stops
    settings = [(stops, 1.0, False), ((), 0.7, False), ((), 1.5, False), ((), 1.0, True), (stops[:1], 1.0, True)]
    for stop_token_ids, temperature, ignore_eos in settings:
        params = beam_params(3, 3, 12, stop_token_ids=list(stop_token_ids), temperature=temperature,
                             ignore_eos=ignore_eos)
        stop_ids = frozenset(stop_token_ids) | (frozenset() if ignore_eos else {eos})
        expected = [oracle_beams(model, prompt, 3, 3, 12, stop_ids=stop_ids, temperature=temperature)
                    for prompt in PROMPTS]
        assert_matches(llm.generate(PROMPTS, params), expected, stop_token_ids)
        if stop_token_ids:
            assert any(h.stopped and h.token_ids[-1] in stop_token_ids for hyps in expected for h in hyps)
        if ignore_eos:
            assert any(eos in h.token_ids for hyps in expected for h in hyps)  # EOS met and run past


def test_a_search_without_max_tokens_runs_to_the_context(tiny: tuple[Path, int], model) -> None:  # noqa: ANN001
    """max_tokens None: each prompt's search ends at max_model_len, the length "never" scores running beams at."""
    from pagoda import LLM

    _, eos = tiny
    llm = LLM(str(tiny[0]), num_kv_blocks=64, max_model_len=40)
    prompts = [prompt for prompt in PROMPTS if len(prompt) <= 32]
    outputs = llm.generate(prompts, beam_params(3, 3, None, 0.5, "never"))
    expected = [oracle_beams(model, prompt, 3, 3, 40 - len(prompt), 0.5, "never", frozenset({eos}))
                for prompt in prompts]
    assert_matches(outputs, expected)
    assert any(len(prompt) + len(h.token_ids) == 40 for prompt, hyps in zip(prompts, expected, strict=True)
               for h in hyps)


def test_beams_beside_sampled_rows_on_a_small_cache_with_async_steps(tiny: tuple[Path, int], model) -> None:  # noqa: ANN001
    """Beam searches of several widths and greedy rows in one batch, on a cache that holds a few of them at a time
    (groups preempted and recomputed) with two plans in flight: each keeps the answer it has alone."""
    from pagoda import LLM

    _, eos = tiny
    llm = LLM(str(tiny[0]), num_kv_blocks=12, async_scheduling=True)
    specs: list[tuple | None] = [(4, 2, 12, 1.0, False), None, (3, 3, 14, 0.5, "never"), (2, 1, 12, 1.0, True), None,
                                 (4, 4, 12, 1.0, False), (3, 3, 12, 2.0, False), None, (4, 4, 14, 1.0, False)]
    params = [SamplingParams(max_tokens=12, temperature=0.0) if spec is None else beam_params(*spec) for spec in specs]
    outputs = llm.generate(PROMPTS, params)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for prompt, output, spec in zip(PROMPTS, outputs, specs, strict=True):
        if spec is None:
            assert output.outputs[0].token_ids == oracle_greedy(model, prompt, 12, frozenset({eos}))
        else:
            assert_matches([output], [oracle_beams(model, prompt, *spec, frozenset({eos}))])
    llm.engine.scheduler.blocks.check_integrity([])
    assert llm.engine.scheduler.blocks.num_free_blocks == 12


def test_blocks_beams_wrote_serve_later_prompts_from_the_prefix_cache(tiny: tuple[Path, int], model, llm) -> None:  # noqa: ANN001
    """A beam's full blocks are cached under its own tokens (slots that changed line took their new parent's): a
    prompt that continues a returned beam reuses them and gets the greedy answer."""
    _, eos = tiny
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[7]]
    outputs = llm.generate(prompts, beam_params(3, 3, 24, 1.0, False, ignore_eos=True))
    continued = [prompt + c.token_ids for prompt, output in zip(prompts, outputs, strict=True) for c in output.outputs]
    again = llm.generate(continued, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    for prompt, output in zip(continued, again, strict=True):
        assert output.outputs[0].token_ids == oracle_greedy(model, prompt, 6, frozenset())
    prompt_blocks = [len(p) // 16 * 16 for p in prompts for _ in range(3)]
    assert any(o.num_cached_tokens > cached for o, cached in zip(again, prompt_blocks, strict=True))
    llm.engine.scheduler.blocks.check_integrity([])


def test_llm_beam_search_returns_vllms_fields_as_the_oracle(tiny: tuple[Path, int], model, llm) -> None:  # noqa: ANN001
    """LLM.beam_search: per prompt the beam_width best, each the prompt's tokens and its own (the closing stop token
    left out, as vLLM's default), its cumulative logprob and score, finish and stop reasons; concurrency_limit
    searches in chunks with the same answers."""
    from pagoda import BeamSearchParams

    _, eos = tiny
    free = [oracle_beams(model, prompt, 3, 3, 10)[0].token_ids for prompt in PROMPTS[:3]]
    stop = free[0][2]
    params = BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.8, stop_token_ids=[stop])
    whole = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    chunked = llm.beam_search(PROMPTS, params, concurrency_limit=4)
    for prompt, result, again in zip(PROMPTS, whole, chunked, strict=True):
        hyps = oracle_beams(model, prompt, 3, 3, 10, 0.8, stop_ids=frozenset({eos, stop}))
        # vLLM's default include_stop_str_in_output=False: a hypothesis's closing stop token is not returned
        assert [s.tokens for s in result.sequences] == [prompt + h.token_ids[:-1 if h.stopped else None] for h in hyps]
        assert [s.cum_logprob for s in result.sequences] == pytest.approx([h.cumulative_logprob for h in hyps],
                                                                          rel=1e-4, abs=1e-5)
        assert [s.score for s in result.sequences] == pytest.approx([h.score for h in hyps], rel=1e-4, abs=1e-5)
        assert [(s.finish_reason, s.stop_reason) for s in result.sequences] == [
            ("stop" if h.stopped else "length", stop if h.stopped and h.token_ids[-1] == stop else None) for h in hyps]
        assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]
    assert any(s.stop_reason == stop for result in whole for s in result.sequences)


def test_a_length_penalty_past_floats_range_ends_the_search_instead_of_raising(llm) -> None:  # noqa: ANN001
    """length_penalty is any finite number: generated_len ** 1000 overflows a float at length 3 and ** -1000
    underflows to 0; the score saturates (-0.0 or -inf: cumulative logprobs are negative) and every search still
    answers (on the server an OverflowError in the scheduler ended the process, and every request with it)."""
    for length_penalty in (1000.0, -1000.0):
        outputs = llm.generate(PROMPTS[:3], beam_params(2, 2, 6, length_penalty))
        for output in outputs:
            assert [c.finish_reason in ("stop", "length") for c in output.outputs] == [True, True]
            assert all(c.token_ids and c.score == c.score for c in output.outputs)  # never NaN
    llm.engine.scheduler.blocks.check_integrity([])
    assert not llm.engine.scheduler.requests


def test_a_first_step_with_more_candidates_than_the_vocabulary_beside_a_wider_group(tiny: tuple[Path, int], model,  # noqa: ANN001
                                                                                    llm) -> None:
    """(1 + stop ids) x width candidates can exceed the vocabulary (here 41 x 8 > 256; on a 32k vocabulary, width 128
    with 256 stop ids). A first step has one beam, so the worker pads its candidates with -inf, and beside a group
    with more beams in the same step the padding names parents that do not exist yet: it is no continuation, not a
    malformed answer (the search ended with an error)."""
    _, eos = tiny
    stops = list(range(200, 240))
    engine = llm.engine
    wider = engine.add_request(PROMPTS[1], beam_params(4, 4, 12))
    while not engine.scheduler.requests[wider].beam.num_generated:
        engine.step()
    request_id = engine.add_request(PROMPTS[0], beam_params(8, 8, 12, stop_token_ids=stops))
    while engine.has_unfinished_requests():
        engine.step()
    expected = oracle_beams(model, PROMPTS[0], 8, 8, 12, stop_ids=frozenset(stops) | {eos})
    assert_matches([engine.get_output(request_id)], [expected], tuple(stops))
    assert_matches([engine.get_output(wider)], [oracle_beams(model, PROMPTS[1], 4, 4, 12, stop_ids=frozenset({eos}))])
