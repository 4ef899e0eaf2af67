"""Beam search against an oracle: transformers' generate(num_beams=...) where it can say, and where it cannot
(temperature, stop ids with ignore_eos, a context-bound search, width 1) a plain-PyTorch beam search over the same
model's logits with transformers' rules, itself checked against generate. Cases test_beam_search.py and
test_beam_device.py leave out: widths 1 to 8, max_tokens 1, length penalties 0 and negative with "never", stop ids,
temperature, ignore_eos, cumulative logprobs, a context-bound search, beams beside greedy rows on a small cache, the
prefix cache after beams, LLM.beam_search's fields, and the tokenizer's own EOS on the served path."""

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
        ids = torch.tensor([prompt + tokens for tokens, _ in running])  # [beams, prompt + generated - 1]
        with torch.inference_mode():
            logits = model(ids).logits[:, -1].float()  # [beams, vocab]
        sums = torch.log_softmax(logits / scale, dim=-1) + torch.tensor([c for _, c in running])[:, None]
        vocab = sums.shape[-1]
        top, flat = torch.topk(sums.flatten(), num_candidates)  # [num_candidates]
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


def oracle_greedy(model, prompt: list[int], max_new: int, stop_ids: frozenset[int]) -> list[int]:  # noqa: ANN001
    tokens: list[int] = []
    while len(tokens) < max_new and not (tokens and tokens[-1] in stop_ids):
        with torch.inference_mode():
            tokens.append(int(model(torch.tensor([prompt + tokens])).logits[0, -1].argmax()))
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
