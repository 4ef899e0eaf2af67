"""The offline LLM API against what vLLM's gives for the same calls: get_tokenizer() is the Hugging Face tokenizer
itself (its defaults, not pagoda's), and an interrupted generate leaves nothing behind in the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pagoda import LLM, SamplingParams
from pagoda.shared.shapes import load_arch

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path) -> LLM:
    return LLM(str(smollm2_dir), max_model_len=512)


def test_get_tokenizer_keeps_hugging_faces_defaults(llm: LLM, smollm2_dir: Path) -> None:
    """vLLM's get_tokenizer() returns the Hugging Face tokenizer, so a ported script's calls get its defaults:
    decode keeps special tokens, apply_chat_template adds no generation prompt, and the tokenizer is callable."""
    reference = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer = llm.get_tokenizer()
    ids = reference.encode("Hello world") + [reference.eos_token_id]
    assert tokenizer.decode(ids) == reference.decode(ids)  # ends with <|im_end|>
    assert tokenizer.decode(ids).endswith(reference.eos_token)
    assert (tokenizer.apply_chat_template(MESSAGES, tokenize=False)
            == reference.apply_chat_template(MESSAGES, tokenize=False))
    assert not tokenizer.apply_chat_template(MESSAGES, tokenize=False).endswith("assistant\n")
    assert tokenizer("Hello world")["input_ids"] == reference("Hello world")["input_ids"]
    assert tokenizer.encode("Hello world foo", truncation=True, max_length=2) == reference.encode(
        "Hello world foo", truncation=True, max_length=2)


def test_an_interrupted_generate_leaves_no_output_behind(llm: LLM) -> None:
    """A KeyboardInterrupt (or any exception) out of generate's step loop aborts its requests and forgets their
    outputs: each interrupted call kept them in the engine for as long as the LLM lived."""
    engine = llm.engine
    step = engine.step
    num_steps = 0

    def interrupted_step(deltas: bool = True) -> object:
        nonlocal num_steps
        num_steps += 1
        if num_steps == 3:
            raise KeyboardInterrupt
        return step(deltas)

    engine.step = interrupted_step  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["Hello there", "The capital of France is"], SamplingParams(n=2, max_tokens=16))
    finally:
        del engine.step  # the instance attribute goes; the method is back
    assert not engine.has_unfinished_requests()
    assert engine._outputs == {} and engine._completions == {}
    blocks = engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    assert llm.generate("Hello there", SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].finished


def test_beam_search_text_is_vllms_decode_of_the_whole_sequence(llm: LLM, smollm2_dir: Path) -> None:
    """vLLM's LLM.beam_search sets each BeamSearchSequence's text to tokenizer.decode(tokens): the prompt and the
    generated tokens, special tokens kept (the end-of-sequence one too). pagoda gave the generated text alone."""
    from pagoda import BeamSearchParams

    reference = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = "The capital of France is"
    [result] = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=6))
    for sequence in result.sequences:
        assert sequence.text == reference.decode(sequence.tokens)
        assert sequence.text.startswith(prompt)


def test_beam_search_leaves_the_end_of_sequence_out_unless_asked(llm: LLM, smollm2_dir: Path) -> None:
    """vLLM's BeamSearchParams.include_stop_str_in_output (default False): a hypothesis that ended on its
    end-of-sequence token returns without it in its tokens and text, its score unchanged; True keeps it. pagoda had
    no such field (a TypeError for scripts that pass it) and always kept the token."""
    from pagoda import BeamSearchParams

    reference = AutoTokenizer.from_pretrained(smollm2_dir)
    question = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    prompt = reference.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    params = {"beam_width": 2, "max_tokens": 24}
    [kept] = llm.beam_search([prompt], BeamSearchParams(**params, include_stop_str_in_output=True))
    [left] = llm.beam_search([prompt], BeamSearchParams(**params))
    ended = [i for i, s in enumerate(kept.sequences) if s.finish_reason == "stop"]
    assert ended, "the case needs a hypothesis that ends on its end-of-sequence token"
    for i in ended:
        assert left.sequences[i].tokens == kept.sequences[i].tokens[:-1]
        assert kept.sequences[i].tokens[-1] in (reference.eos_token_id, *load_arch(smollm2_dir).eos_token_ids)
        assert left.sequences[i].text == reference.decode(left.sequences[i].tokens)
        # the two searches run apart (the second hits the prefix cache): equal up to float noise (1e-5 on the CPU)
        assert left.sequences[i].score == pytest.approx(kept.sequences[i].score, abs=1e-4)
        assert left.sequences[i].cum_logprob == pytest.approx(kept.sequences[i].cum_logprob, abs=1e-4)


def test_spaces_between_special_tokens_is_taken_and_changes_nothing() -> None:
    """vLLM's field, as the server takes it: the engine gets the same request either way; an argument pagoda does not
    have is still a TypeError naming it."""
    assert SamplingParams(spaces_between_special_tokens=False).wire() == SamplingParams().wire()
    with pytest.raises(TypeError, match="extra_args"):
        SamplingParams(extra_args={})
