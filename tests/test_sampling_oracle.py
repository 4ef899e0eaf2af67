"""Sampling parameters end to end against an independent oracle: transformers' fp32 SmolLM2 with vLLM's logits
processing written out here in plain PyTorch (allowed ids, bad words, min_tokens, logit bias, then repetition over
prompt + output and frequency / presence over output; then temperature, and top-k, top-p and min-p in the order
docs/decoding.md states), driven through the offline API. Greedy runs compare tokens; sampled runs check each token
lies in the oracle's kept set; logprobs are the model's raw ones (docs/vllm-compat.md)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda import LLM, SamplingParams

pytestmark = pytest.mark.slow

EOS = 2  # SmolLM2's <|im_end|>, its generation config's EOS
LOGPROB_TOLERANCE = 2e-3  # pagoda's CPU fp32 kernels against transformers' fp32 forward


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread while this module runs: on a shared 2-core host two threads each made transformers'
    forward of 40 tokens take 4 s instead of 0.5 s (spin-waits against the other processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), max_model_len=512)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir: Path):  # noqa: ANN201
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass
class Oracle:
    """vLLM's per-request logits processing (V1 sampler order) over raw fp32 logits [V]."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    bad_words_ids: list[list[int]] = field(default_factory=list)
    allowed_token_ids: list[int] = field(default_factory=list)

    def process(self, logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        out = logits.float().clone()  # [V]
        if self.allowed_token_ids:
            allowed = torch.zeros_like(out, dtype=torch.bool)
            allowed[self.allowed_token_ids] = True
            out[~allowed] = float("-inf")
        for word in self.bad_words_ids:
            prefix = word[:-1]
            if len(word) - 1 <= len(output_ids) and (not prefix or output_ids[-len(prefix):] == prefix):
                out[word[-1]] = float("-inf")
        if len(output_ids) < self.min_tokens:
            out[[EOS, *self.stop_token_ids]] = float("-inf")
        for token_id, bias in self.logit_bias.items():
            out[token_id] += bias
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.int64), minlength=out.shape[0]).float()  # [V]
        if self.repetition_penalty != 1.0:
            seen = counts > 0
            seen[prompt_ids] = True
            penalised = torch.where(out > 0, out / self.repetition_penalty, out * self.repetition_penalty)
            out = torch.where(seen, penalised, out)
        out = out - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).float()
        return out

    def kept(self, processed: torch.Tensor) -> torch.Tensor:
        """The ids [V] bool a sampled (temperature > 0) draw may take, on softmax(processed / T): min-p (vLLM V1
        applies it first, an argmax-invariant logits processor), then top-k, then top-p over what both keep
        (renormalised), ties at each cut kept (docs/decoding.md's rule)."""
        probs = torch.softmax(processed / self.temperature, dim=-1)  # [V]
        keep = probs > 0  # [V]
        if self.min_p > 0:
            keep &= probs >= self.min_p * probs.max()
        if self.top_k > 0:
            keep &= probs >= probs.topk(self.top_k).values[-1]
        if self.top_p < 1.0:
            ordered = torch.where(keep, probs, 0.0).sort(descending=True).values  # [V]
            count = int((ordered.cumsum(0) < self.top_p * ordered.sum()).sum()) + 1
            keep &= probs >= ordered[count - 1]
        return keep


def _forward(hf_model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits [len(ids), V]."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def step_logits(hf_model: Any, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """The raw logits [len(output_ids), V] each output token was chosen from: one forward over the prompt and the
    output (teacher forcing), so a check costs one forward whatever the output's length."""
    return _forward(hf_model, prompt_ids + output_ids)[len(prompt_ids) - 1:len(prompt_ids) + len(output_ids) - 1]


def assert_oracle_greedy(hf_model: Any, prompt_ids: list[int], output_ids: list[int], oracle: Oracle,
                         max_tokens: int, ignore_eos: bool = False) -> torch.Tensor:
    """output_ids is the greedy continuation under vLLM's processing: each token the argmax of the processed
    logits after the tokens before it (a near tie, within fp32 noise, may go either way), ending at EOS (unless
    ignore_eos) or a stop id, both included as vLLM's token_ids include them, or at max_tokens. Returns the raw
    logits [N, V]."""
    logits = step_logits(hf_model, prompt_ids, output_ids)
    for i, token in enumerate(output_ids):
        processed = oracle.process(logits[i], prompt_ids, output_ids[:i])
        best = int(processed.argmax())
        assert token == best or processed[token] >= processed[best] - 1e-4, (
            f"step {i}: pagoda {token} ({float(processed[token]):.4f}), oracle {best} ({float(processed[best]):.4f}); "
            f"output {output_ids}")
        ends = (token == EOS and not ignore_eos) or token in oracle.stop_token_ids
        assert not ends or i == len(output_ids) - 1, f"step {i}: {token} ends the output, yet it goes on"
    last = output_ids[-1]
    assert len(output_ids) == max_tokens or (last == EOS and not ignore_eos) or last in oracle.stop_token_ids
    return logits


def vllm_bad_words_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's bad-word token sequences: each word (leading whitespace stripped) encoded alone, and after a space
    where that gives as many tokens with another first token."""
    sequences = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences += [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
    return sequences


def _params(oracle: Oracle, **extra: Any) -> SamplingParams:
    fields = {name: getattr(oracle, name) for name in (
        "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "min_tokens", "stop_token_ids", "allowed_token_ids")}
    return SamplingParams(**fields, **extra)


@pytest.fixture(scope="module")
def rainbow(tokenizer: Any) -> list[int]:
    """A chat prompt whose greedy answer repeats words, so penalties change it."""
    return _chat_ids(tokenizer, "List the colors of the rainbow, repeating each color twice.")


@pytest.fixture(scope="module")
def sky(tokenizer: Any) -> list[int]:
    """A chat prompt whose greedy answer ends with EOS after about ten tokens."""
    return _chat_ids(tokenizer, "Answer with one word: what color is the sky?")


PENALTIES = [Oracle(repetition_penalty=1.5), Oracle(repetition_penalty=0.7), Oracle(frequency_penalty=1.0),
             Oracle(presence_penalty=1.5, frequency_penalty=-0.5), Oracle(repetition_penalty=1.2, presence_penalty=0.8,
                                                                         logit_bias={28: 4.0, 30: -3.0})]


def test_penalties_and_bias_give_the_oracles_greedy_tokens(llm: LLM, hf_model: Any, rainbow: list[int]) -> None:
    """Greedy decoding under each penalty setting (one batch, the settings side by side) is the argmax of vLLM's
    processing of transformers' logits at every step: repetition over prompt and output, frequency and presence over
    the output only, with their signs and scales."""
    max_tokens = 12
    outputs = llm.generate([rainbow] * len(PENALTIES), [_params(o, max_tokens=max_tokens) for o in PENALTIES])
    plain = llm.generate([rainbow], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].outputs[0].token_ids
    for oracle, output in zip(PENALTIES, outputs, strict=True):
        tokens = output.outputs[0].token_ids
        assert_oracle_greedy(hf_model, rainbow, tokens, oracle, max_tokens)
    assert sum(output.outputs[0].token_ids != plain for output in outputs) >= len(PENALTIES) - 1  # they bite


def test_logit_bias_goes_in_before_the_repetition_penalty(llm: LLM, hf_model: Any, rainbow: list[int]) -> None:
    """vLLM adds the bias to the raw logits and then applies the penalties, so a repetition penalty r scales a
    biased prompt token's logit l to (l + b) / r; pagoda gave l / r + b. The bias is chosen from transformers'
    logits so that the two orders pick different first tokens."""
    penalty = 1.5
    logits = _forward(hf_model, rainbow)[-1]  # [V]
    penalised = Oracle(repetition_penalty=penalty).process(logits, rainbow, [])
    best = int(penalised.argmax())
    token = max((t for t in set(rainbow) if logits[t] > 0 and t != best), key=lambda t: float(penalised[t]))
    rival = float(penalised[best])
    # l / r + b > rival > (l + b) / r: after the penalty the bias wins; before it, it does not
    low, high = rival - float(logits[token]) / penalty, penalty * rival - float(logits[token])
    oracle = Oracle(repetition_penalty=penalty, logit_bias={token: (low + high) / 2})
    tokens = llm.generate([rainbow], _params(oracle, max_tokens=4))[0].outputs[0].token_ids
    assert tokens[0] == int(oracle.process(logits, rainbow, []).argmax()) != token
    assert_oracle_greedy(hf_model, rainbow, tokens, oracle, 4)


@pytest.mark.parametrize("use_kernels", [False, True])
def test_bias_before_repetition_on_both_sampler_paths(use_kernels: bool) -> None:
    """The sampler alone, on the CPU path and the Triton path (the interpreter where there is no GPU): a prompt id
    with logit 12, a bias of 6 and a repetition penalty of 1.5 is (12 + 6) / 1.5 = 12 (vLLM's order), below a rival's
    13, where bias after penalty would make it 14. A greedy row and a min-p row (which keeps only the top id) take
    the rival; a row with the bias and no penalty beside them takes the biased id. Logprobs stay the raw ones."""
    from pagoda.services.worker.sampler import SamplingMetadata, sample

    device = torch.device("cuda" if use_kernels and torch.cuda.is_available() else "cpu")
    vocab_size, seen_id, rival_id = 70, 11, 40
    logits = torch.linspace(-3.0, 3.0, vocab_size).repeat(3, 1)  # [3, V]
    logits[:, seen_id], logits[:, rival_id] = 12.0, 13.0
    prompt_mask = torch.zeros(3, vocab_size, dtype=torch.bool)  # [3, V]
    prompt_mask[:, seen_id] = True
    metadata = SamplingMetadata(
        temperature=torch.tensor([0.0, 1.0, 0.0]), seeds=torch.tensor([1, 2, 3]),
        offsets=torch.zeros(3, dtype=torch.int64), min_p=torch.tensor([0.0, 0.5, 0.0]),
        repetition_penalty=torch.tensor([1.5, 1.5, 1.0]), state_rows=torch.arange(3),
        output_counts=torch.zeros(3, vocab_size, dtype=torch.int32), prompt_mask=prompt_mask,
        logit_bias_ids=torch.full((3, 1), seen_id), logit_bias_values=torch.full((3, 1), 6.0), max_num_logprobs=0)
    on_device = SamplingMetadata(**{name: value.to(device) if isinstance(value, torch.Tensor) else value
                                    for name in SamplingMetadata.__slots__
                                    for value in [getattr(metadata, name)]})
    out = sample(logits.to(device), on_device, use_kernels=use_kernels)
    oracles = [Oracle(repetition_penalty=1.5, logit_bias={seen_id: 6.0}),
               Oracle(temperature=1.0, min_p=0.5, repetition_penalty=1.5, logit_bias={seen_id: 6.0}),
               Oracle(logit_bias={seen_id: 6.0})]
    for row, (oracle, token) in enumerate(zip(oracles, out.token_ids.cpu().tolist(), strict=True)):
        processed = oracle.process(logits[row], [seen_id], [])
        if oracle.temperature == 0.0:
            assert token == int(processed.argmax())
        else:
            assert oracle.kept(processed).nonzero().squeeze(1).tolist() == [token]
    assert out.token_ids.cpu().tolist() == [rival_id, rival_id, seen_id]
    assert out.logprobs is not None
    raw = torch.log_softmax(logits, dim=-1).gather(1, out.token_ids.cpu().unsqueeze(1)).squeeze(1)  # [3]
    assert torch.allclose(out.logprobs.cpu(), raw)


def test_bans_bias_penalties_and_allowed_ids_side_by_side(llm: LLM, hf_model: Any, sky: list[int],
                                                          rainbow: list[int], tokenizer: Any) -> None:
    """One batch of greedy rows, each with other settings (so the per-row tables of bias, bans and bad-word windows
    have rows of different widths, and min_tokens bans expire at different steps), each the oracle's tokens:
    min_tokens holds EOS and stop ids back until that many tokens (also with ignore_eos); bad_words ban a word's
    last token (vLLM's tokenization: bare and after a space); allowed_token_ids keeps the rest out."""
    blue = vllm_bad_words_ids(tokenizer, ["blue"])
    free = llm.generate([sky], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0].token_ids
    assert free[-1] == EOS and blue[1][0] in free  # the cases below change this answer
    period = tokenizer.encode(".", add_special_tokens=False)[0]
    cases: list[tuple[list[int], Oracle, dict[str, Any]]] = [
        (sky, Oracle(min_tokens=len(free) + 3), {}),
        (rainbow, Oracle(repetition_penalty=1.3, logit_bias={28: 2.5}), {}),
        (sky, Oracle(bad_words_ids=blue), {"bad_words": ["blue"]}),
        (sky, Oracle(min_tokens=len(free) + 1, bad_words_ids=blue, stop_token_ids=[period]), {"bad_words": ["blue"]}),
        (rainbow, Oracle(presence_penalty=1.0, min_tokens=3), {}),
        (sky, Oracle(allowed_token_ids=sorted({*free[:6], 28, period, EOS})), {}),
        (sky, Oracle(min_tokens=5), {"ignore_eos": True}),
    ]
    max_tokens = 16
    outputs = llm.generate([prompt for prompt, _, _ in cases],
                           [_params(oracle, max_tokens=max_tokens, **extra) for _, oracle, extra in cases])
    for (prompt, oracle, extra), output in zip(cases, outputs, strict=True):
        assert_oracle_greedy(hf_model, prompt, output.outputs[0].token_ids, oracle, max_tokens,
                             ignore_eos=extra.get("ignore_eos", False))
    assert len(outputs[0].outputs[0].token_ids) >= len(free) + 3
    assert outputs[3].outputs[0].finish_reason in ("stop", "length")


@pytest.fixture(scope="module")
def poem(tokenizer: Any) -> list[int]:
    return _chat_ids(tokenizer, "Write a short poem about the sea.")


SAMPLED = [Oracle(temperature=1.5, top_k=5), Oracle(temperature=2.0, top_p=0.6, min_p=0.1),
           Oracle(temperature=1.3, top_k=8, top_p=0.7, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.3,
                  logit_bias={13: 3.0})]


def test_seeded_draws_stay_in_the_oracles_kept_set_alone_and_in_a_batch(llm: LLM, hf_model: Any,
                                                                        poem: list[int]) -> None:
    """Seeded requests (n=2 each) under top-k, top-p, min-p and penalties: every token lies in the set vLLM's
    truncation of transformers' logits keeps (after the request's own penalties, each completion its own output),
    the same tokens come back alone and in one batch with an unseeded penalised stranger, the n completions
    differ, and the logprobs returned are the raw model's."""
    max_tokens = 8
    seeded = [_params(oracle, max_tokens=max_tokens, seed=100 + i, n=2, logprobs=2) for i, oracle in enumerate(SAMPLED)]
    alone = [llm.generate([poem], params)[0] for params in seeded]
    stranger = SamplingParams(temperature=1.0, max_tokens=14, presence_penalty=0.5, top_k=3)
    batch = llm.generate([poem, "Hello there", *[poem] * (len(SAMPLED) - 1)],
                         [seeded[0], stranger, *seeded[1:]])
    batch = [batch[0], *batch[2:]]
    for oracle, single, batched in zip(SAMPLED, alone, batch, strict=True):
        tokens = [c.token_ids for c in single.outputs]
        assert tokens == [c.token_ids for c in batched.outputs]
        assert tokens[0] != tokens[1]
        for completion in single.outputs:
            output = completion.token_ids
            logits = step_logits(hf_model, poem, output)  # [N, V]
            raw = torch.log_softmax(logits, dim=-1)  # [N, V]
            assert completion.logprobs is not None
            for i, token in enumerate(output):
                kept = oracle.kept(oracle.process(logits[i], poem, output[:i]))  # [V]
                assert kept[token], f"step {i}: {token} is outside the {int(kept.sum())} ids the oracle keeps"
                entry = completion.logprobs[i]  # the sampled id and the raw top 2, with vLLM's ranks
                assert set(entry) == {token, *raw[i].topk(2).indices.tolist()}
                for token_id, logprob in entry.items():
                    assert abs(logprob - float(raw[i, token_id])) < LOGPROB_TOLERANCE
                    assert logprob.rank == int((raw[i] > raw[i, token_id]).sum()) + 1


def _tokens_to_reach(tokenizer: Any, output_ids: list[int], num_chars: int) -> int:
    """How many of output_ids it takes for their text to hold num_chars characters."""
    return next(k for k in range(1, len(output_ids) + 1)
                if len(tokenizer.decode(output_ids[:k], skip_special_tokens=True)) >= num_chars)


def _first_stop(tokenizer: Any, output_ids: list[int], text: str, stops: list[str],
                min_tokens: int) -> tuple[int, int, str]:
    """vLLM's stop rule on a known output: the first token whose text completes a stop string, counting only
    matches that end after the first min_tokens tokens' text; of those it completes, the earliest-starting. Returns
    (tokens kept, the match's start in text, the stop string)."""
    for num_tokens in range(min_tokens + 1, len(output_ids) + 1):
        seen = len(tokenizer.decode(output_ids[:num_tokens], skip_special_tokens=True))
        protected = len(tokenizer.decode(output_ids[:min_tokens], skip_special_tokens=True))
        found = [(i, len(stop), stop) for stop in stops
                 if 0 <= (i := text.find(stop, max(0, protected - len(stop) + 1))) <= seen - len(stop)]
        if found:
            start, _, stop = min(found)
            return num_tokens, start, stop
    raise AssertionError(f"no stop string of {stops} in {text!r}")


def test_stop_strings_cut_the_oracles_text(llm: LLM, hf_model: Any, tokenizer: Any, poem: list[int]) -> None:
    """Stop strings on the oracle's greedy text (a piece inside tokens, a newline, a word met twice with min_tokens
    past its first end, a word beside a longer stop string that begins earlier and never completes): the output
    ends with the token that completes the first counted match, its text is cut before the stop string (through it
    with include_stop_str_in_output), stop_reason names it; a match counts only where it ends in the text of a
    token after the first min_tokens (vLLM's detokenizer)."""
    max_tokens = 30
    free = llm.generate([poem], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].outputs[0].token_ids
    assert_oracle_greedy(hf_model, poem, free, Oracle(), max_tokens)
    text = tokenizer.decode(free, skip_special_tokens=True)
    words = [w for w in text.replace(",", " ").split() if len(w) >= 4 and text.count(w) >= 2]
    assert words and "\n" in text
    twice = words[0]
    first_end = text.index(twice) + len(twice)
    cases = [([text[len(text) // 3:len(text) // 3 + 3]], 0), (["\n"], 0), ([twice], 0),
             ([twice], _tokens_to_reach(tokenizer, free, first_end)),
             # the longer one starts first and fails only after `twice` completed: pagoda waited for it
             ([twice, text[:first_end] + " @@"], 0)]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=stops, min_tokens=min_tokens,
                             include_stop_str_in_output=include, logprobs=0)
              for stops, min_tokens in cases for include in (False, True)]
    outputs = llm.generate([poem] * len(params), params)
    for (stops, min_tokens), pair in zip(cases, zip(outputs[::2], outputs[1::2], strict=True), strict=True):
        num_tokens, start, stop = _first_stop(tokenizer, free, text, stops, min_tokens)
        for include, output in zip((False, True), pair, strict=True):
            completion = output.outputs[0]
            assert completion.token_ids == free[:num_tokens], (stops, min_tokens)
            assert completion.logprobs is not None and len(completion.logprobs) == num_tokens
            assert completion.text == text[:start + (len(stop) if include else 0)], (stops, min_tokens, include)
            assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)


def test_n_best_of_and_prompt_logprobs(llm: LLM, hf_model: Any, tokenizer: Any, sky: list[int]) -> None:
    """n=3 with best_of=3 gives three seeded completions that differ (child seeds seed + index, as vLLM's), the
    second the same as a request with seed + 1; best_of other than n is refused naming it; prompt_logprobs are
    transformers' log_softmax of the prompt with vLLM's ranks, the first position None."""
    from pagoda import InvalidRequestError

    params = SamplingParams(temperature=1.0, n=3, best_of=3, seed=11, max_tokens=6, prompt_logprobs=2)
    output = llm.generate([sky], params)[0]
    tokens = [c.token_ids for c in output.outputs]
    assert [c.index for c in output.outputs] == [0, 1, 2] and len({tuple(t) for t in tokens}) == 3
    second = llm.generate([sky], SamplingParams(temperature=1.0, seed=12, max_tokens=6))[0].outputs[0].token_ids
    assert second == tokens[1]
    with pytest.raises(InvalidRequestError) as caught:
        llm.generate([sky], SamplingParams(temperature=1.0, n=2, best_of=3, max_tokens=2))
    assert caught.value.param == "best_of"
    raw = torch.log_softmax(_forward(hf_model, sky), dim=-1)  # [P, V]
    scores = output.prompt_logprobs
    assert scores is not None and len(scores) == len(sky) and scores[0] is None
    for position, (token, entry) in enumerate(zip(sky[1:], scores[1:], strict=True)):
        expected = raw[position]  # [V]: the distribution token `position + 1` was scored from
        top = expected.topk(2).indices.tolist()
        assert set(entry) == {token, *top}, position
        for token_id, logprob in entry.items():
            assert abs(logprob - float(expected[token_id])) < LOGPROB_TOLERANCE
            assert logprob.rank == int((expected > expected[token_id]).sum()) + 1


def test_bias_before_repetition_kernel_path_draws_the_cpu_paths_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The biased copy feeding the fused pass, under every way a row is drawn (greedy, top-k from the gathered
    groups, top-k + top-p, top-p by rejection rounds, min-p, bans beside them), in bf16 logits: the Triton path
    (interpreted, small blocks, 4-id groups) draws the CPU path's tokens, and the CPU path's greedy rows are the
    oracle's argmax."""
    from pagoda.kernels import sampling as kernels
    from pagoda.services.worker.sampler import SamplingMetadata, sample

    if not torch.cuda.is_available():
        for name, value in (("PROCESS_BLOCK", 32), ("ARGMAX_BLOCK", 16), ("ARGMAX_SPLIT", 32), ("TOP_P_BLOCK", 16),
                            ("TOP_P_PIVOT_BLOCK", 16), ("TOP_K_GROUP", 4)):
            monkeypatch.setattr(kernels, name, value)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_rows, vocab_size = 8, 70
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(num_rows, vocab_size, generator=gen) * 3).to(torch.bfloat16)  # [B, V]
    prompts = [torch.randint(0, vocab_size, (6,), generator=gen).tolist() for _ in range(num_rows)]
    outputs = [torch.randint(0, vocab_size, (4,), generator=gen).tolist() for _ in range(num_rows)]
    prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool)  # [B, V]
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32)  # [B, V]
    for row in range(num_rows):
        prompt_mask[row, prompts[row]] = True
        for token in outputs[row]:
            counts[row, token] += 1
    bias_ids = torch.tensor([[p[0], o[0]] for p, o in zip(prompts, outputs, strict=True)])  # [B, 2]: seen ids
    bias_values = torch.randn(num_rows, 2, generator=gen) * 4  # [B, 2]
    metadata = SamplingMetadata(
        temperature=torch.tensor([0.0, 0.9, 1.2, 0.8, 1.0, 0.0, 1.5, 0.7]), seeds=torch.arange(num_rows) + 40,
        offsets=torch.full((num_rows,), 3), top_k=torch.tensor([0, 6, 5, 0, 0, 0, 0, 3]), max_top_k=6,
        top_p=torch.tensor([1.0, 1.0, 0.8, 0.7, 1.0, 1.0, 0.5, 1.0]), top_p_without_top_k=True,
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.2, 0.0, 0.0, 0.1]),
        repetition_penalty=torch.tensor([1.4, 1.3, 0.8, 1.2, 1.5, 1.0, 1.1, 2.0]),
        frequency_penalty=torch.full((num_rows,), 0.2), state_rows=torch.arange(num_rows), output_counts=counts,
        prompt_mask=prompt_mask, logit_bias_ids=bias_ids, logit_bias_values=bias_values,
        banned_token_ids=torch.tensor([[-1], [-1], [-1], [-1], [-1], [-1], [-1], [7]]))
    on_device = SamplingMetadata(**{name: value.to(device) if isinstance(value, torch.Tensor) else value
                                    for name in SamplingMetadata.__slots__
                                    for value in [getattr(metadata, name)]})
    expected = sample(logits, metadata, use_kernels=False).token_ids
    got = sample(logits.to(device), on_device, use_kernels=True).token_ids.cpu()
    assert got.tolist() == expected.tolist()
    for row in (0, 5):  # the greedy rows
        oracle = Oracle(repetition_penalty=float(metadata.repetition_penalty[row]), frequency_penalty=0.2,
                        logit_bias={int(t): float(v) for t, v in zip(bias_ids[row], bias_values[row], strict=True)})
        assert int(expected[row]) == int(oracle.process(logits[row].float(), prompts[row], outputs[row]).argmax())
