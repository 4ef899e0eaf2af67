"""The offline LLM API: bad input raises typed errors naming the parameter and leaves the engine usable;
n > 1, logprobs, stop strings, seeds and chat behave as documented."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import pytest

from pagoda import (
    LLM,
    BeamSearchParams,
    ContextLengthError,
    InvalidRequestError,
    Logprob,
    ModelNotFoundError,
    RepetitionDetectionParams,
    SamplingParams,
)
from pagoda.services.worker.grammar import GrammarRows
from pagoda.shared.config import SLOW_COMPILE_MIN_BYTES
from pagoda.shared.errors import ConfigError
from pagoda.shared.messages import StructuredOutputs

pytestmark = pytest.mark.slow

GREEDY_ARGS: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}
GREEDY = SamplingParams(**GREEDY_ARGS)
# the engine-survives check after each refusal: a prefill and three decode steps (eight tokens cost the 24 cases
# of the bad-input table 8 s of the suite for the same check)
STILL_SERVES = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), max_model_len=512)


@pytest.fixture(scope="module")
def reference_text(llm: LLM) -> str:
    return llm.generate(["The quick brown fox"], STILL_SERVES)[0].outputs[0].text


def _assert_still_serves(llm: LLM, reference_text: str) -> None:
    assert llm.generate(["The quick brown fox"], STILL_SERVES)[0].outputs[0].text == reference_text
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.scheduler.blocks.num_blocks


@pytest.mark.parametrize(("prompt", "params", "param_name", "error"), [
    ("", GREEDY_ARGS, "prompt", InvalidRequestError),
    ([], GREEDY_ARGS, "prompt", InvalidRequestError),
    ("word " * 600, GREEDY_ARGS, "prompt", ContextLengthError),
    ("hello", dict(max_tokens=600), "max_tokens", ContextLengthError),
    ("hello", dict(max_tokens=0), "max_tokens", InvalidRequestError),
    ("hello", dict(max_tokens=-3), "max_tokens", InvalidRequestError),
    ("hello", dict(top_p=0.0), "top_p", InvalidRequestError),
    ("hello", dict(top_p=1.5), "top_p", InvalidRequestError),
    ("hello", dict(temperature=-1.0), "temperature", InvalidRequestError),
    ("hello", dict(temperature=math.nan), "temperature", InvalidRequestError),
    ("hello", dict(top_k=-5), "top_k", InvalidRequestError),
    ("hello", dict(min_p=2.0), "min_p", InvalidRequestError),
    ("hello", dict(n=0), "n", InvalidRequestError),
    ("hello", dict(logprobs=99), "logprobs", InvalidRequestError),
    ("hello", dict(stop=[""]), "stop", InvalidRequestError),
    ("hello", dict(stop_token_ids=[10**9]), "stop_token_ids", InvalidRequestError),
    ("hello", dict(logit_bias={10**9: 1.0}), "logit_bias", InvalidRequestError),
    ("hello", dict(max_tokens=0), "max_tokens", InvalidRequestError),
    ("hello", dict(max_tokens=0, n=2, prompt_logprobs=0), "max_tokens", InvalidRequestError),
    ("hello", dict(prompt_logprobs=21), "prompt_logprobs", InvalidRequestError),
    ("hello", dict(logit_bias={5: math.inf}), "logit_bias", InvalidRequestError),
    ([1, 2, 10**9], GREEDY_ARGS, "prompt", InvalidRequestError),
    ([1, -4], GREEDY_ARGS, "prompt", InvalidRequestError),
    ([1, True], GREEDY_ARGS, "prompt", InvalidRequestError),  # bool is an int subclass: still not a token id
    ([1, 2.0], GREEDY_ARGS, "prompt", InvalidRequestError),
    ([3, "4"], GREEDY_ARGS, "prompt", InvalidRequestError),
    # an allow-list with no token the grammar may start with (every sampled token would break it)
    ("hello", dict(structured_outputs=StructuredOutputs(choice=["red", "blue"]), allowed_token_ids=[5, 6]),
     "allowed_token_ids", InvalidRequestError),
    # an allow-list that the bans leave empty: the sampler would draw an id outside it (id 0 on a row of -inf)
    ("hello", dict(allowed_token_ids=[2], min_tokens=3, max_tokens=5), "min_tokens", InvalidRequestError),
    ("hello", dict(allowed_token_ids=[2, 9], stop_token_ids=[9], min_tokens=1, ignore_eos=True), "min_tokens",
     InvalidRequestError),
    ("hello", dict(allowed_token_ids=[4607, 787], bad_words=["no"]), "bad_words", InvalidRequestError),
])
def test_bad_input_raises_typed_error_and_engine_survives(llm: LLM, reference_text: str, prompt: object,
                                                          params: dict[str, Any], param_name: str,
                                                          error: type[Exception]) -> None:
    """Values SamplingParams refuses at construction (as vLLM's) and those only the engine can judge (the prompt,
    the context, the vocabulary) raise the same typed errors."""
    with pytest.raises(error) as caught:
        llm.generate([prompt], SamplingParams(**params))  # type: ignore[list-item]
    assert caught.value.param == param_name  # type: ignore[attr-defined]
    assert param_name in str(caught.value) or caught.value.param == param_name  # type: ignore[attr-defined]
    _assert_still_serves(llm, reference_text)


def test_stop_reason_names_the_stop_string_or_token(llm: LLM) -> None:
    """CompletionOutput.stop_reason, as vLLM's: the stop_token_ids id that ended it, the stop string, None for
    max_tokens."""
    greedy = llm.generate(["The capital of France is"], GREEDY)[0].outputs[0]
    word = greedy.text.split()[0]
    assert greedy.finish_reason == "length" and greedy.stop_reason is None
    # the two stopped requests are independent: one generate (the engine batches them)
    by_id, by_string = llm.generate(["The capital of France is"] * 2, [
        SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[greedy.token_ids[1]]),
        SamplingParams(temperature=0.0, max_tokens=8, stop=[word])])
    assert (by_id.outputs[0].finish_reason, by_id.outputs[0].stop_reason) == ("stop", greedy.token_ids[1])
    assert (by_string.outputs[0].finish_reason, by_string.outputs[0].stop_reason) == ("stop", word)


def test_repetition_detection_ends_a_loop_offline(llm: LLM) -> None:
    """vLLM's RepetitionDetectionParams (or a dict of its fields): one allowed token loops, and the completion ends at
    the 4th copy with finish_reason "repetition" and stop_reason "repetition_detected"."""
    (dot,) = llm.get_tokenizer().encode(".", add_special_tokens=False)
    for watch in (RepetitionDetectionParams(max_pattern_size=3, min_count=4), {"max_pattern_size": 3, "min_count": 4}):
        params = SamplingParams(temperature=0.0, max_tokens=16, allowed_token_ids=[dot], repetition_detection=watch)
        [out] = llm.generate(["The capital of France is"], params)[0].outputs
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([dot] * 4, "repetition", "repetition_detected")
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(repetition_detection={"max_pattern_size": 3, "min_count": 4, "window": 2})
    assert caught.value.param == "repetition_detection.window"


def test_logprob_token_ids_offline(llm: LLM) -> None:
    """vLLM's logprob_token_ids: each position's entry holds the sampled token and the listed ids (rank None), with
    the logprobs a top-20 entry gives those of them it holds (the first position's 2nd, 5th and 10th are listed)."""
    prompt = ["The capital of France is"]
    [whole] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, logprobs=20))[0].outputs
    assert whole.logprobs is not None
    by_rank = {logprob.rank: token for token, logprob in whole.logprobs[0].items()}
    listed = [by_rank[2], 5, by_rank[10], by_rank[5]]
    [picked] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, logprobs=0,
                                                   logprob_token_ids=listed))[0].outputs
    assert picked.token_ids == whole.token_ids and picked.logprobs is not None
    for token_id, top, entry in zip(picked.token_ids, whole.logprobs, picked.logprobs, strict=True):
        assert set(entry) == {token_id, *listed} and entry[token_id] == pytest.approx(top[token_id], abs=1e-4)
        shared = [t for t in listed if t in top]
        assert [entry[t] for t in shared] == pytest.approx([top[t] for t in shared], abs=1e-4)
        assert all(entry[t].rank is None and entry[t] < 0 for t in listed if t != token_id)
    assert len([t for t in listed if t in whole.logprobs[0]]) == 3


@pytest.mark.parametrize(("values", "param_name"), [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"), ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
    ({"stop": [""]}, "stop"), ({"seed": 2**64}, "seed"), ({"logprobs": -2}, "logprobs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 4, "truncation_side": "up"}, "truncation_side"),
    # not lists (nor a map) as typed: were TypeErrors
    ({"stop": 5}, "stop"), ({"stop_token_ids": 5}, "stop_token_ids"), ({"allowed_token_ids": 5}, "allowed_token_ids"),
    ({"logit_bias": [1]}, "logit_bias"),
    # a bool is no count (Python's bool is an int: max_tokens=True ran as 1)
    ({"max_tokens": True}, "max_tokens"), ({"n": True}, "n"), ({"stop_token_ids": [False]}, "stop_token_ids"),
])
def test_sampling_params_refuse_bad_values_at_construction(values: dict[str, Any], param_name: str) -> None:
    """As vLLM's SamplingParams: a ValueError where the value is written, not at the first generate."""
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**values)
    assert isinstance(caught.value, ValueError) and caught.value.param == param_name


def test_sampling_params_take_vllms_shapes(llm: LLM) -> None:
    """stop may be one string (one stop string, not one per character) and None stands for an empty list."""
    assert SamplingParams(stop="END").stop == ["END"]
    params = SamplingParams(stop=None, stop_token_ids=None, allowed_token_ids=None, logit_bias=None)
    assert (params.stop, params.stop_token_ids, params.allowed_token_ids, params.logit_bias) == ([], [], [], {})
    prompt = "The capital of France is"
    text = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    # a word with a character that shows up before it: a stop string per character would cut the text there
    word = next(w for w in text.split()[1:] if min(text.find(c) for c in w) < text.index(w))
    [cut] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop=word))[0].outputs
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (text[:text.index(word)], "stop", word)


def test_a_bad_prompt_in_a_batch_queues_none_of_it(llm: LLM, reference_text: str) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", "also fine", ""], GREEDY)
    _assert_still_serves(llm, reference_text)


@pytest.mark.parametrize("params", [{"max_tokens": 2}, [{"max_tokens": 2}],
                                    BeamSearchParams(beam_width=2, max_tokens=2)])
def test_sampling_params_of_another_kind_are_refused_naming_them(llm: LLM, reference_text: str, params: Any) -> None:
    """A dict of fields (read as a sequence of its keys: an AttributeError from the engine), a list of dicts or a
    BeamSearchParams (a TypeError) given for sampling_params: an InvalidRequestError naming it."""
    with pytest.raises(InvalidRequestError) as caught:
        llm.generate("hello", params)
    assert caught.value.param == "sampling_params"
    _assert_still_serves(llm, reference_text)


def test_unknown_model_path_names_the_model(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as caught:
        LLM(str(tmp_path / "no-such-model"))
    assert caught.value.param == "model"
    with pytest.raises(ModelNotFoundError):
        LLM("no-such-shape", load_format="dummy")
    with pytest.raises(ConfigError) as config_error:
        LLM("tiny", no_such_argument=1)
    assert config_error.value.param == "no_such_argument"


def test_engine_seed_none_is_vllms_unseeded() -> None:
    """LLM(seed=None), vLLM's "not seeded": the default engine seed (it only draws dummy weights; requests without
    a seed of their own sample fresh randomness either way). It was a bare TypeError."""
    from pagoda.shared.config import EngineConfig

    assert EngineConfig.from_kwargs(model="tiny", seed=None).seed == EngineConfig(model="tiny").seed
    assert EngineConfig.from_kwargs(model="tiny", seed=7).seed == 7


def test_vllms_dtype_aliases() -> None:
    """vLLM's dtype names half and float are float16 and float32; other names are refused naming dtype."""
    from pagoda.shared.config import EngineConfig

    assert EngineConfig.from_kwargs(model="tiny", dtype="half").dtype == "float16"
    assert EngineConfig.from_kwargs(model="tiny", dtype="float").dtype == "float32"
    with pytest.raises(ConfigError) as caught:
        EngineConfig.from_kwargs(model="tiny", dtype="fp64")
    assert caught.value.param == "dtype"


def test_n_completions_share_the_prompt_and_differ(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    [output] = llm.generate(["Once upon a time"], params)
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in output.outputs)
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    [again] = llm.generate(["Once upon a time"], params)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs]


def test_greedy_n_gives_identical_completions(llm: LLM) -> None:
    [output] = llm.generate(["Once upon a time"], SamplingParams(n=3, temperature=0.0, max_tokens=10))
    assert len({tuple(c.token_ids) for c in output.outputs}) == 1


def test_seeded_request_is_reproducible_whatever_its_companions(llm: LLM) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate(["My favourite food is"], seeded)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.2, max_tokens=10, ignore_eos=True)  # beside the seeded row to its end
    mixed = llm.generate(["Tell me a joke", "My favourite food is", "Why is the sky blue?"],
                         [noisy, seeded, noisy])
    assert mixed[1].outputs[0].token_ids == alone


def test_logprobs_are_consistent(llm: LLM) -> None:
    [output] = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3))
    completion = output.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == len(completion.token_ids)
    total = 0.0
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert token_id in entry and len(entry) in (3, 4)
        assert entry[token_id] == max(entry.values())  # greedy picks the most likely token
        assert all(value <= 0.0 for value in entry.values())
        total += entry[token_id]
    assert completion.cumulative_logprob == pytest.approx(total)


def _assert_ranked(entry: dict[int, Logprob], chosen_id: int, k: int) -> bool:
    """An entry holds the top k ranked 1..k, likeliest first, and the chosen token; True if that one ranks past k."""
    chosen = entry[chosen_id]
    assert isinstance(chosen, Logprob) and chosen.logprob == float(chosen) and chosen.rank is not None
    by_rank = sorted(entry.values(), key=lambda value: value.rank)
    assert [value.rank for value in by_rank][:k] == list(range(1, k + 1))
    assert all(a.logprob >= b.logprob for a, b in zip(by_rank, by_rank[1:], strict=False))
    assert len(entry) == k + int(chosen.rank > k)
    return chosen.rank > k


def test_logprobs_are_vllm_logprob_objects(llm: LLM) -> None:
    """vLLM's offline API gives Logprob objects (.logprob, .rank, .decoded_token); pagoda's are those and floats."""
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=1.5, seed=7, max_tokens=12, logprobs=2, prompt_logprobs=2)
    [output] = llm.generate(["Once upon a time"], params)
    completion = output.outputs[0]
    assert completion.logprobs is not None
    past_top = [_assert_ranked(entry, token_id, 2)
                for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True)]
    assert any(past_top), "temperature 1.5 never sampled past the top two: no rank past k was checked"
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert entry[token_id].decoded_token == tokenizer.decode([token_id], skip_special_tokens=False)
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    for token_id, prompt_entry in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:], strict=True):
        assert prompt_entry is not None
        _assert_ranked(prompt_entry, token_id, 2)
    roundtrip = pickle.loads(pickle.dumps(completion.logprobs[0]))
    assert {key: (value.logprob, value.rank, value.decoded_token) for key, value in roundtrip.items()} == {
        key: (value.logprob, value.rank, value.decoded_token) for key, value in completion.logprobs[0].items()}


def test_stop_string_cuts_the_text_and_ends_the_sequence(llm: LLM) -> None:
    base = llm.generate(["Count: one, two, three,"], SamplingParams(temperature=0.0, max_tokens=24))[0]
    text = base.outputs[0].text
    stop = text[len(text) // 3:len(text) // 3 + 3]
    assert stop.strip(), "the greedy text is too short to pick a stop string from"
    # the cut and the kept request are independent: one generate (the engine batches them)
    cut, kept = llm.generate(["Count: one, two, three,"] * 2, [
        SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], include_stop_str_in_output=True)])
    assert cut.outputs[0].text == text[:text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop"
    assert len(cut.outputs[0].token_ids) < len(base.outputs[0].token_ids)
    assert kept.outputs[0].text == text[:text.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    base = llm.generate(["Count: one, two, three,"], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
    stop_id = base.token_ids[3]
    # the stopped and the held request are independent: one generate (the engine batches them)
    stopped, held = (out.outputs[0] for out in llm.generate(["Count: one, two, three,"] * 2, [
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_id], min_tokens=10)]))
    assert stopped.token_ids == base.token_ids[:base.token_ids.index(stop_id) + 1]
    assert stopped.finish_reason == "stop"
    assert stop_id not in held.token_ids[:10]
    assert len(held.token_ids) >= 10


def test_logit_bias_steers_greedy_decoding(llm: LLM) -> None:
    prompt = "Count: one, two, three,"
    base = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].token_ids
    forced_id = base[5]  # a token the model would only say later
    # the forced and the avoided request are independent: one generate (the engine batches them)
    forced, avoided = (out.outputs[0] for out in llm.generate([prompt] * 2, [
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={forced_id: 100.0}),
        SamplingParams(temperature=0.0, max_tokens=8, logit_bias={base[0]: -100.0})]))
    assert forced.token_ids == [forced_id] * 4
    assert avoided.token_ids[0] != base[0] and base[0] not in avoided.token_ids
    # Bias in one request leaves its batch companions alone.
    both = llm.generate([prompt, prompt], [SamplingParams(temperature=0.0, max_tokens=8),
                                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                          logit_bias={forced_id: 100.0})])
    assert [o.outputs[0].token_ids for o in both] == [base, [forced_id] * 4]


def test_max_tokens_zero_only_scores_the_prompt(llm: LLM, reference_text: str) -> None:
    prompt = "Count: one, two, three,"
    [scored] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=1))
    [longer] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1))
    assert scored.outputs[0].token_ids == [] and scored.outputs[0].text == ""
    assert scored.outputs[0].finish_reason == "length"
    assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == len(scored.prompt_token_ids)
    assert scored.prompt_logprobs == longer.prompt_logprobs
    _assert_still_serves(llm, reference_text)  # nothing left behind: no request, no block


def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    [output] = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=24))
    tokenizer = llm.get_tokenizer()  # vLLM's chat: the template's text, encoded without added special tokens
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert output.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert output.prompt == text  # vLLM's chat outputs carry the rendered prompt
    assert "Paris" in output.outputs[0].text
    with pytest.raises(InvalidRequestError) as caught:
        llm.chat([{"role": "user"}], GREEDY)
    assert caught.value.param == "messages"


def test_get_tokenizer_answers_as_a_hugging_face_tokenizer(llm: LLM) -> None:
    """What scripts written for vLLM's LLM.get_tokenizer() (a Hugging Face tokenizer) call: the chat template as
    text (tokenize=False), len(), and the tokenizer's other methods and attributes."""
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hello"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and "Hello" in text
    assert tokenizer.encode(text, add_special_tokens=False) == llm.engine.tokenizer.apply_chat_template(messages)
    assert len(tokenizer) == len(llm.engine.tokenizer.hf)
    ids = tokenizer.encode("Paris")
    assert tokenizer.convert_ids_to_tokens(ids) == llm.engine.tokenizer.hf.convert_ids_to_tokens(ids)
    assert tokenizer.eos_token == llm.engine.tokenizer.hf.eos_token
    with pytest.raises(AttributeError):
        tokenizer.no_such_method  # noqa: B018 - the attribute access is the test


def test_generate_takes_vllms_prompt_dicts_and_use_tqdm(llm: LLM) -> None:
    """vLLM's TextPrompt / TokensPrompt dicts, alone or mixed with plain prompts, and its use_tqdm keyword."""
    text = "The capital of France is"
    token_ids = llm.get_tokenizer().encode(text)
    plain = llm.generate([text], GREEDY)[0].outputs[0].text
    outputs = llm.generate([{"prompt_token_ids": token_ids}, {"prompt": text}, text], GREEDY, use_tqdm=False)
    assert [o.outputs[0].text for o in outputs] == [plain] * 3
    assert [o.prompt for o in outputs] == [None, text, text]
    assert all(o.prompt_token_ids == token_ids for o in outputs)
    [single] = llm.generate({"prompt_token_ids": token_ids}, GREEDY)
    assert single.outputs[0].text == plain
    # nothing is dropped silently, nor run as the other kind of prompt (text under prompt_token_ids was generated
    # from as text, ids under prompt as ids)
    for bad in ({}, {"prompt": text, "multi_modal_data": {}}, {"prompt_token_ids": text}, {"prompt": token_ids}):
        with pytest.raises(InvalidRequestError) as caught:
            llm.generate(bad, GREEDY)
        assert caught.value.param == "prompt"


def test_chat_continues_the_final_message(llm: LLM) -> None:
    conversation = [{"role": "user", "content": "Finish the saying."},
                    {"role": "assistant", "content": "An apple a day keeps the"}]
    [output] = llm.chat(conversation, GREEDY, add_generation_prompt=False, continue_final_message=True)
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
    assert output.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert output.prompt == rendered and rendered.endswith("An apple a day keeps the")  # no end-of-turn after it
    with pytest.raises(InvalidRequestError) as caught:
        llm.chat(conversation, GREEDY, continue_final_message=True)  # add_generation_prompt defaults to True
    assert caught.value.param == "continue_final_message"


@pytest.mark.parametrize("method", ["encode", "embed", "classify", "score", "reward"])
def test_pooling_methods_say_they_are_not_implemented(llm: LLM, method: str) -> None:
    with pytest.raises(NotImplementedError, match=f"LLM.{method} .*generative models only"):
        getattr(llm, method)(["hello"])


def test_streaming_deltas_concatenate_to_the_text(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    deltas = list(llm.stream("Write a haiku about autumn:", params))
    full = llm.generate(["Write a haiku about autumn:"], params)[0].outputs[0]
    assert "".join(d.text for d in deltas) == full.text
    assert deltas[-1].finish_reason == full.finish_reason


def test_priority_runs_first_when_only_one_fits(smollm2_dir: Path) -> None:
    llm = LLM(str(smollm2_dir), max_num_seqs=1)
    plans = []
    launch = llm.engine.runner.launch
    llm.engine.runner.launch = lambda plan: (plans.append(plan), launch(plan))[1]  # type: ignore[method-assign]
    llm.generate(["low", "high"], SamplingParams(temperature=0.0, max_tokens=2), priority=[5, 0])
    order = [new.seq_id for plan in plans for new in plan.new_requests]
    assert order == [1, 0], "the priority-0 request (seq 1) must be admitted first"


def test_dummy_shape_runs_on_token_ids() -> None:
    llm = LLM("tiny", seed=3)
    [output] = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 5 and output.outputs[0].text == ""
    with pytest.raises(InvalidRequestError) as caught:
        llm.generate(["text needs a tokenizer"], GREEDY)
    assert caught.value.param == "prompt"


def test_sampling_params_are_mutable_as_vllms(llm: LLM) -> None:
    """vLLM's examples set fields on a SamplingParams after making it (sampling_params.temperature = 0.5); the
    value set is the one used, a bad one is refused at generate, and a str stop set later is still one string."""
    prompt = "The capital of France is"
    greedy = llm.generate([prompt], GREEDY)[0].outputs[0]
    params = SamplingParams(max_tokens=16)
    params.temperature, params.max_tokens = 0.0, 8
    assert llm.generate([prompt], params)[0].outputs[0].text == greedy.text
    word = greedy.text.split()[1]
    params.stop = word
    [cut] = llm.generate([prompt], params)[0].outputs
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (greedy.text[:greedy.text.index(word)], "stop", word)
    params.top_p = 0.0
    with pytest.raises(InvalidRequestError) as caught:
        llm.generate([prompt], params)
    assert caught.value.param == "top_p"


def test_sampling_params_take_vllms_spellings() -> None:
    """vLLM's SamplingParams read seed=-1 as unseeded and logprobs=True as 1 (the sampled token's logprob)."""
    assert SamplingParams(seed=-1).seed is None
    assert (SamplingParams(logprobs=True).logprobs, SamplingParams(prompt_logprobs=True).prompt_logprobs) == (1, 1)


def test_default_sampling_params_come_from_the_generation_config(llm: LLM, tmp_path: Path) -> None:
    """vLLM's get_default_sampling_params (its generate.py sets fields on them) and generation_config: "auto" (the
    model folder's generation_config.json), "vllm" (none), or a folder; generate without SamplingParams uses them."""
    defaults = llm.get_default_sampling_params()  # SmolLM2's generation config sets no sampling field
    assert isinstance(defaults, SamplingParams) and defaults == SamplingParams()
    defaults.max_tokens = 3
    assert llm.get_default_sampling_params().max_tokens == 16  # a fresh copy each call
    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1, '
        '"max_new_tokens": 3, "do_sample": true, "eos_token_id": 2}')
    tiny = LLM("tiny", seed=3, generation_config=str(tmp_path))
    assert tiny.get_default_sampling_params() == SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05,
                                                                repetition_penalty=1.1, max_tokens=3)
    [output] = tiny.generate([[5, 6, 7, 8]])
    assert 1 <= len(output.outputs[0].token_ids) <= 3
    assert LLM("tiny", generation_config="vllm").get_default_sampling_params() == SamplingParams()
    with pytest.raises(ConfigError) as caught:
        LLM("tiny", generation_config=str(tmp_path / "missing"))
    assert caught.value.param == "generation_config"


def test_vllms_keywords_at_their_off_value_pass_and_others_are_refused(llm: LLM) -> None:
    """Scripts pass vLLM's lora_request=None, chat_template=None, use_tqdm / concurrency_limit to beam_search: taken;
    a LoRA adapter or another content format is refused naming the keyword, never dropped."""
    from pagoda import BeamSearchParams

    messages = [{"role": "user", "content": "Hi"}]
    plain = llm.chat(messages, STILL_SERVES)[0].outputs[0].text
    assert llm.chat(messages, STILL_SERVES, lora_request=None, chat_template=None, chat_template_content_format="auto",
                    mm_processor_kwargs=None)[0].outputs[0].text == plain
    [output] = llm.generate(["Hi"], STILL_SERVES, lora_request=None)
    assert output.outputs[0].text == llm.generate(["Hi"], STILL_SERVES)[0].outputs[0].text
    for call, param in ((lambda: llm.generate(["Hi"], STILL_SERVES, lora_request=object()), "lora_request"),
                        (lambda: llm.chat(messages, STILL_SERVES, mm_processor_kwargs={"a": 1}), "mm_processor_kwargs"),
                        (lambda: llm.chat(messages, STILL_SERVES, chat_template_content_format="x"),
                         "chat_template_content_format"),
                        (lambda: llm.beam_search(["Hi"], STILL_SERVES), "params")):
        with pytest.raises(InvalidRequestError) as caught:
            call()
        assert caught.value.param == param
    beams = BeamSearchParams(beam_width=2, max_tokens=2)
    prompts = [{"prompt": "The capital of France is"}, {"prompt": "One, two,"}]
    together = llm.beam_search(prompts, beams)
    by_one = llm.beam_search(prompts, beams, lora_request=None, use_tqdm=False, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in by_one] == [[s.tokens for s in o.sequences] for o in together]


def test_a_beam_width_that_cannot_run_names_beam_width(llm: LLM) -> None:
    """BeamSearchParams has one width, beam_width, which beam_search passes as both n and best_of: a width out of
    range was refused as "n must be an integer in [1, 128]" and one too wide for the KV cache named best_of, fields
    the caller never set."""
    from pagoda import BeamSearchParams

    for width in (0, -2, 129, 2.0, True):
        with pytest.raises(InvalidRequestError) as caught:
            llm.beam_search(["Hi"], BeamSearchParams(beam_width=width, max_tokens=2))  # type: ignore[arg-type]
        assert caught.value.param == "beam_width" and "beam_width" in caught.value.message, caught.value
    with pytest.raises(InvalidRequestError) as caught:  # 128 beams of up to 511 tokens: more than the cache holds
        llm.beam_search(["Hi"], BeamSearchParams(beam_width=128, max_tokens=510))
    assert caught.value.param == "beam_width" and "KV blocks" in caught.value.message, caught.value


def test_chat_renders_with_the_chat_template_it_is_given(llm: LLM) -> None:
    """vLLM's LLM.chat(chat_template=...): that template renders the conversation (output.prompt is its text, the
    prompt ids its encoding) in place of the model's own; one that does not compile names the keyword."""
    template = ("{% for m in messages %}<{{ m.role }}:{{ m.content }}>{% endfor %}"
                "{% if add_generation_prompt %}>{% endif %}")
    messages = [{"role": "user", "content": "Hi"}]
    [output] = llm.chat(messages, STILL_SERVES, chat_template=template)
    tokenizer = llm.get_tokenizer()
    assert output.prompt == "<user:Hi>>"
    assert output.prompt_token_ids == tokenizer.encode("<user:Hi>>", add_special_tokens=False)
    assert llm.chat(messages, STILL_SERVES)[0].prompt != output.prompt
    with pytest.raises(InvalidRequestError) as caught:
        llm.chat(messages, STILL_SERVES, chat_template="{% for m in messages %}")
    assert caught.value.param == "chat_template"


def test_outputs_have_vllms_fields(llm: LLM) -> None:
    """Fields scripts read off vLLM's RequestOutput / CompletionOutput / BeamSearchSequence, with the values vLLM
    gives a decoder-only model without LoRA or multimodal input (metrics: None, as vLLM's LLM with its default
    disable_log_stats)."""
    from pagoda import BeamSearchParams

    [output] = llm.generate(["Hi"], STILL_SERVES)
    assert (output.lora_request, output.encoder_prompt, output.encoder_prompt_token_ids, output.metrics,
            output.kv_transfer_params, output.multi_modal_placeholders) == (None, None, None, None, None, {})
    assert output.outputs[0].lora_request is None
    [beams] = llm.beam_search([{"prompt": "Hi"}], BeamSearchParams(beam_width=2, max_tokens=2))
    assert all(s.lora_request is None and s.stop_reason is None for s in beams.sequences)


def test_detokenize_false_returns_token_ids_only(llm: LLM) -> None:
    """vLLM's detokenize=False (lm-evaluation-harness scores prompts with it): the same tokens and logprobs, no
    text and no decoded_token; stop strings need the text, so they are refused with it."""
    [plain] = llm.generate(["The capital of France is"], SamplingParams(**GREEDY_ARGS, logprobs=1, prompt_logprobs=1))
    [bare] = llm.generate(["The capital of France is"], SamplingParams(**GREEDY_ARGS, logprobs=1, prompt_logprobs=1,
                                                                       detokenize=False))
    assert (bare.outputs[0].text, bare.outputs[0].token_ids) == ("", plain.outputs[0].token_ids)
    assert bare.outputs[0].logprobs == plain.outputs[0].logprobs and bare.prompt_logprobs == plain.prompt_logprobs
    assert all(lp.decoded_token is None for step in bare.outputs[0].logprobs + bare.prompt_logprobs[1:]
               for lp in step.values())
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(stop=["."], detokenize=False)
    assert caught.value.param == "stop"
    with pytest.raises(InvalidRequestError) as caught:
        list(llm.stream("Hi", SamplingParams(max_tokens=2, detokenize=False)))  # stream yields text
    assert caught.value.param == "detokenize"


def test_guided_decoding_params_are_vllms_older_structured_outputs(llm: LLM) -> None:
    """`from vllm.sampling_params import GuidedDecodingParams` and SamplingParams(guided_decoding=...): the same
    constraint as structured_outputs (vLLM renamed it), set at construction or later."""
    from pagoda.params import GuidedDecodingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["red", "blue"]))
    assert params.structured_outputs == StructuredOutputs(choice=["red", "blue"]) and params.guided_decoding is None
    assert llm.generate(["The sky is"], params)[0].outputs[0].text in ("red", "blue")
    later = SamplingParams(temperature=0.0, max_tokens=8)
    later.guided_decoding = GuidedDecodingParams(regex="[0-9]{3}", backend="xgrammar:disable-any-whitespace")
    assert len(llm.generate(["Three digits:"], later)[0].outputs[0].text) == 3
    for given, expected in [(dict(json={"type": "object"}), StructuredOutputs(json={"type": "object"})),
                            (dict(json_object=True), StructuredOutputs(json_object=True)),
                            (dict(grammar='start: "a"'), StructuredOutputs(grammar='start: "a"'))]:
        assert SamplingParams(guided_decoding=GuidedDecodingParams(**given)).structured_outputs == expected
    assert GuidedDecodingParams.from_optional(json=None, regex=None) is None
    assert GuidedDecodingParams.from_optional(regex="a+") == GuidedDecodingParams(regex="a+")


def test_thinking_token_budget_needs_a_reasoning_parser_which_llm_has_not(llm: LLM, reference_text: str) -> None:
    """vLLM's SamplingParams field is taken at construction (as vLLM's), and -1 / None (no budget) run as without
    it; a budget is refused when the request is added, naming the field (vLLM's engine refuses it without its
    reasoning config): LLM has no --reasoning-parser to read a think block. The engine still serves."""
    from pagoda.shared.messages import SamplingParams as WireParams
    from pagoda.shared.messages import ThinkingBudget

    assert SamplingParams(thinking_token_budget=10).thinking_token_budget == 10
    for off in (-1, None):
        assert llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=4,
                                                                    thinking_token_budget=off)
                            )[0].outputs[0].text == reference_text
    budget = ThinkingBudget(max_tokens=1, end="</think>", end_token_ids=[46])
    for params in (SamplingParams(temperature=0.0, max_tokens=4, thinking_token_budget=10),
                   WireParams(max_tokens=4, thinking_token_budget=0), WireParams(max_tokens=4, thinking=budget)):
        with pytest.raises(InvalidRequestError) as caught:
            llm.generate(["The quick brown fox"], params)
        assert caught.value.param == "thinking_token_budget" and "reasoning parser" in caught.value.message
        with pytest.raises(InvalidRequestError):
            llm.chat([{"role": "user", "content": "Hi"}], params)
    _assert_still_serves(llm, reference_text)


@pytest.mark.parametrize(("guided", "extra", "param"), [
    (dict(choice=["a"], regex="a"), {}, "guided_decoding"),
    ({}, {}, "guided_decoding"),
    (dict(choice=["a"]), dict(structured_outputs=StructuredOutputs(regex="b")), "guided_decoding"),
    (dict(json={"type": "object"}, whitespace_pattern=r"\s*", disable_any_whitespace=True), {},
     "guided_decoding.whitespace_pattern"),
    (dict(choice=["a"], structural_tag="{}"), {}, "guided_decoding"),
    (dict(choice=["a"], backend="sglang"), {}, "guided_decoding.backend"),
])
def test_guided_decoding_params_refuse_what_pagoda_cannot_honour(guided: dict[str, Any], extra: dict[str, Any],
                                                                 param: str) -> None:
    from pagoda.params import GuidedDecodingParams

    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(guided_decoding=GuidedDecodingParams(**guided), **extra)
    assert caught.value.param == param and param.rsplit(".", 1)[-1] in caught.value.message


def test_reset_prefix_cache_makes_the_next_run_cold(llm: LLM) -> None:
    """vLLM's LLM.reset_prefix_cache (benchmarks call it between runs): True, and the same prompt is then
    prefilled again; the answer does not change."""
    prompt = "word " * 40  # more than two full blocks
    first = llm.generate([prompt], STILL_SERVES)[0]
    again = llm.generate([prompt], STILL_SERVES)[0]
    assert again.num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    cold = llm.generate([prompt], STILL_SERVES)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].text == first.outputs[0].text


def test_prompt_dicts_take_vllms_cache_salt(llm: LLM) -> None:
    """vLLM's {"prompt": ..., "cache_salt": ...}: a prompt reuses cached prefix blocks only under its own salt (none:
    the unsalted chain); the answer does not change. An empty salt is refused naming cache_salt."""
    from pagoda import BeamSearchParams

    token_ids = llm.get_tokenizer().encode("word " * 40)  # more than two full blocks
    assert llm.reset_prefix_cache() is True

    def cached(prompt: object) -> int:
        [output] = llm.generate(prompt, STILL_SERVES)
        assert output.outputs[0].text == reference
        return output.num_cached_tokens

    reference = llm.generate([token_ids], STILL_SERVES)[0].outputs[0].text  # caches the unsalted chain
    assert cached({"prompt_token_ids": token_ids, "cache_salt": "a"}) == 0
    assert cached({"prompt_token_ids": token_ids, "cache_salt": "a"}) > 0
    assert cached({"prompt_token_ids": token_ids, "cache_salt": "b"}) == 0
    assert cached([token_ids]) > 0
    [beams] = llm.beam_search([{"prompt_token_ids": token_ids, "cache_salt": "a"}],
                              BeamSearchParams(beam_width=2, max_tokens=2))
    assert len(beams.sequences) == 2
    for bad in ("", 7, "s" * 1025):
        with pytest.raises(InvalidRequestError) as caught:
            llm.generate({"prompt_token_ids": token_ids, "cache_salt": bad}, STILL_SERVES)
        assert caught.value.param == "cache_salt"
    assert not llm.engine.has_unfinished_requests()


def test_truncate_prompt_tokens_runs_the_kept_tokens(llm: LLM) -> None:
    """vLLM's SamplingParams(truncate_prompt_tokens=k): the prompt's last k tokens run (and are reported, with their
    prompt logprobs), exactly as if only they were sent; "right" keeps the first k; -1 keeps what the context takes
    of a prompt too long for it (the fixture's 512: 511 tokens and one to generate); a larger k changes nothing."""
    text = "The capital of France is Paris, and the capital of Spain is"
    ids = llm.get_tokenizer().encode(text)
    sides = ((None, ids[-6:]), ("right", ids[:6]))
    # each side's truncated prompt and its kept tokens sent alone, and the whole prompt: one generate (independent
    # requests; the engine batches them)
    outputs = llm.generate([p for _, kept in sides for p in (text, kept)] + [text], [
        *(p for side, _ in sides for p in (
            SamplingParams(**GREEDY_ARGS, truncate_prompt_tokens=6, truncation_side=side, prompt_logprobs=0),
            SamplingParams(**GREEDY_ARGS))),
        SamplingParams(**GREEDY_ARGS, truncate_prompt_tokens=len(ids) + 5)])
    for i, (_, kept) in enumerate(sides):
        truncated, alone = outputs[2 * i], outputs[2 * i + 1]
        assert truncated.prompt_token_ids == kept and truncated.prompt == text  # vLLM's: the prompt as given
        assert truncated.outputs[0].token_ids == alone.outputs[0].token_ids
        assert truncated.prompt_logprobs is not None and len(truncated.prompt_logprobs) == 6
    whole = outputs[-1]
    assert whole.prompt_token_ids == ids
    too_long = "word " * 600
    with pytest.raises(ContextLengthError):
        llm.generate([too_long], SamplingParams(temperature=0.0, max_tokens=1))
    fitted, roomy = llm.generate([too_long] * 2, [  # independent: one generate
        SamplingParams(temperature=0.0, max_tokens=1, truncate_prompt_tokens=-1),
        SamplingParams(temperature=0.0, max_tokens=3, truncate_prompt_tokens=-1)])
    assert fitted.prompt_token_ids == llm.get_tokenizer().encode(too_long)[-511:]
    assert len(fitted.outputs[0].token_ids) == 1
    assert roomy.prompt_token_ids == llm.get_tokenizer().encode(too_long)[-509:]  # room left for max_tokens
    assert len(roomy.outputs[0].token_ids) == 3


def test_output_kind_is_taken_at_what_generate_returns(llm: LLM) -> None:
    """vLLM's RequestOutputKind: LLM returns each request's output once, when it is done (FINAL_ONLY, which vLLM's
    LLM sets itself); the streaming kinds are refused naming output_kind, also when set after construction."""
    from pagoda import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY)
    assert llm.generate("Hello", params)[0].outputs[0].finish_reason == "length"
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        with pytest.raises(InvalidRequestError) as caught:
            SamplingParams(output_kind=kind)
        assert caught.value.param == "output_kind"
    params.output_kind = RequestOutputKind.DELTA
    with pytest.raises(InvalidRequestError) as caught:
        llm.generate("Hello", params)
    assert caught.value.param == "output_kind"


def test_get_metrics_are_the_engines_counters(llm: LLM) -> None:
    """vLLM's LLM.get_metrics(): Counter and Gauge objects, named as the server's /metrics, counting what ran."""
    from pagoda.outputs import Counter, Gauge

    before = {m.name: m.value for m in llm.get_metrics()}
    prompt_ids = llm.get_tokenizer().encode("The quick brown fox")
    llm.generate([prompt_ids, prompt_ids], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    after = {m.name: m for m in llm.get_metrics()}
    assert isinstance(after["pagoda_generation_tokens"], Counter) and isinstance(after["pagoda_kv_blocks_total"], Gauge)
    assert after["pagoda_generation_tokens"].value - before["pagoda_generation_tokens"] == 6
    assert after["pagoda_prompt_tokens"].value - before["pagoda_prompt_tokens"] == 2 * len(prompt_ids)
    assert after["pagoda_num_requests_running"].value == after["pagoda_num_requests_waiting"].value == 0
    assert after["pagoda_kv_blocks_total"].value == llm.engine.scheduler.blocks.num_blocks > 0
    assert after["pagoda_prefix_cache_query_tokens"].value >= before["pagoda_prefix_cache_query_tokens"]
    # vLLM's names for the same numbers, labelled as vLLM's reader labels them
    for vllm_name, name in (("vllm:generation_tokens", "pagoda_generation_tokens"),
                            ("vllm:prompt_tokens", "pagoda_prompt_tokens"),
                            ("vllm:prefix_cache_hits", "pagoda_prefix_cache_hit_tokens"),
                            ("vllm:num_requests_running", "pagoda_num_requests_running"),
                            ("vllm:kv_cache_usage_perc", "pagoda_kv_cache_usage_ratio")):
        assert type(after[vllm_name]) is type(after[name]) and after[vllm_name].value == after[name].value
        assert after[vllm_name].labels == {"model_name": llm.engine.config.model, "engine": "0"}


def test_a_new_constraint_compiles_once_at_admission(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The matcher add_request's check builds is the one its rows copy: a large new constraint compiles once, before
    add_request returns, and no step builds it again (a second compile there froze every row of the batch)."""
    rows = llm.engine.runner.grammars
    assert isinstance(rows, GrammarRows)  # on CPU the matchers live in this process
    built: list[StructuredOutputs] = []
    build = GrammarRows._build

    def counted(tokenizer: Any, constraint: StructuredOutputs) -> Any:
        built.append(constraint)
        return build(tokenizer, constraint)

    monkeypatch.setattr(GrammarRows, "_build", staticmethod(counted))
    schema = {"type": "object", "description": "offline " + "x" * SLOW_COMPILE_MIN_BYTES, "additionalProperties": False,
              "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"]}
    constraint = StructuredOutputs(json=json.dumps(schema))
    params = SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=constraint)
    completions = llm.generate(["Pick a colour: red or blue?", "Your favourite colour, as JSON:"], [params, params])
    assert [json.loads(c.outputs[0].text)["colour"] in ("red", "blue") for c in completions] == [True, True]
    assert built == []
