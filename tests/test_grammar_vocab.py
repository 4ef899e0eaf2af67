"""llguidance's tokenizer for a model (services/grammar/vocab.py): text that spells a special token is forced and
generated as text, and a model whose logits are fewer or more than the tokenizer's tokens serves structured
outputs (offline, tiny random Llamas over SmolLM2's tokenizer)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import llguidance
import numpy as np
import pytest

from pagoda import LLM
from pagoda.params import SamplingParams
from pagoda.services.grammar.compiler import GrammarChecker, grammar_text, ll_tokenizer
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.messages import StructuredOutputs

IM_END = "<|im_end|>"  # SmolLM2's EOS and end of turn, id 2
# constraints whose text holds <|im_end|> where the grammar forces it, and the answers they allow
SPELLED = [
    (StructuredOutputs(regex=r"a<\|im_end\|>b"), {"a<|im_end|>b"}),
    (StructuredOutputs(json={"const": "x<|im_end|>y"}), {'"x<|im_end|>y"'}),
    (StructuredOutputs(choice=["<|im_end|>"]), {"<|im_end|>"}),
    (StructuredOutputs(grammar='start: "a<|im_end|>b"'), {"a<|im_end|>b"}),
    # the special text forced after the model's choice (a mixed case: the choice is the model's)
    (StructuredOutputs(regex=r"(x|yz)<\|im_end\|>!"), {"x<|im_end|>!", "yz<|im_end|>!"}),
    (StructuredOutputs(json={"enum": ["<|im_end|>", "<|im_start|>user"]}), {'"<|im_end|>"', '"<|im_start|>user"'}),
]


def walk(ll: llguidance.LLTokenizer, constraint: StructuredOutputs, pick: int) -> list[int]:
    """The tokens of one complete walk of the grammar, taking allowed token number `pick` (or the last) each step;
    without the EOS that may end it."""
    matcher = llguidance.LLMatcher(ll, grammar_text(constraint), log_level=0)
    ids: list[int] = []
    while not matcher.is_stopped():
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:ll.vocab_size])  # [num_allowed] ids, ascending
        token_id = int(allowed[min(pick, len(allowed) - 1)])
        assert matcher.consume_token(token_id), matcher.get_error()
        if token_id in ll.eos_tokens:
            break
        ids.append(token_id)
        assert len(ids) < 64, ll.dbg_tokens(ids)
    return ids


@pytest.mark.parametrize(("constraint", "answers"), SPELLED)
def test_text_spelling_a_special_token_is_forced_and_walked_as_text(ll: llguidance.LLTokenizer,
                                                                   constraint: StructuredOutputs,
                                                                   answers: set[str]) -> None:
    """llguidance tokenized forced text with the Hugging Face tokenizer, which turned "<|im_end|>" into the special
    token (id 2, the EOS): the forced start held the EOS and the grammar then refused it, so the answer stopped."""
    forced = GrammarChecker(ll).check(constraint)
    assert not any(ll.is_special_token(t) for t in forced), ll.dbg_tokens(forced)
    for pick in (0, 1, 10**6):
        ids = walk(ll, constraint, pick)
        assert not any(ll.is_special_token(t) for t in ids), ll.dbg_tokens(ids)
        assert ll.decode_bytes(ids).decode() in answers
        assert ids[:len(forced)] == forced


def test_a_lark_grammar_still_names_a_special_token_unquoted(ll: llguidance.LLTokenizer) -> None:
    """llguidance's syntax for the special token itself (`<|im_end|>` outside quotes) keeps meaning the token."""
    forced = GrammarChecker(ll).check(StructuredOutputs(grammar='start: "a" <|im_end|> "b"'))
    assert forced == [ll.tokenize_str("a")[0], 2, ll.tokenize_str("b")[0]]


def test_forced_text_without_special_tokens_is_tokenized_as_the_tokenizer_does(ll: llguidance.LLTokenizer,
                                                                             tokenizer: Tokenizer) -> None:
    text = '{"sentiment": "'
    schema = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative"]}},
              "required": ["sentiment"]}
    assert GrammarChecker(ll).check(StructuredOutputs(json=schema)) == tokenizer.encode(text)


@pytest.fixture(scope="module")
def tiny_llamas(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """tiny_llama's folder for a vocab_size, made once for the module's tests."""
    folders: dict[int, Path] = {}

    def folder(vocab_size: int) -> Path:
        if vocab_size not in folders:
            folders[vocab_size] = tiny_llama(tmp_path_factory.mktemp(f"tiny{vocab_size}"), smollm2_dir, vocab_size)
        return folders[vocab_size]

    return folder


def tiny_llama(folder: Path, smollm2_dir: Path, vocab_size: int) -> Path:
    """A 2-layer random Llama with `vocab_size` logits and SmolLM2's tokenizer (49152 tokens) in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).float().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).is_file():
            shutil.copy(smollm2_dir / name, folder / name)
    return folder


def test_offline_answers_spell_special_tokens_as_text(tiny_llamas: Callable[[int], Path]) -> None:
    """End to end (offline, fast-forward on and off): the answer is the whole text, finished by the grammar. Before,
    it stopped at the special token ("a", finish_reason stop)."""
    model = tiny_llamas(49152)
    for fast_forward in (True, False):
        llm = LLM(str(model), max_model_len=128, grammar_fast_forward=fast_forward)
        for constraint, answers in SPELLED:
            params = SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=constraint)
            output = llm.generate("Say it:", params)[0].outputs[0]
            assert (output.text, output.finish_reason) in {(a, "stop") for a in answers}, (fast_forward, constraint)


@pytest.mark.parametrize("vocab_size", [49000, 49300])
def test_a_model_with_more_or_fewer_logits_than_tokens_serves_grammars(smollm2_dir: Path,
                                                                      tiny_llamas: Callable[[int], Path],
                                                                      vocab_size: int) -> None:
    """Masks have the model's width: ids past the tokenizer's are never allowed; with fewer logits than tokens, the
    tokens past them are never allowed nor forced (text the tokenizer spells with one of them is spelled with
    others). Fewer raised "structured outputs need the model's tokenizer on the worker" (llguidance refused the
    width)."""
    llm = LLM(str(tiny_llamas(vocab_size)), tokenizer=str(smollm2_dir),
              max_model_len=128)
    tail_word = Tokenizer(smollm2_dir).hf.convert_ids_to_tokens(49100).replace("Ġ", " ")  # one token past 49000
    constraints = [(StructuredOutputs(choice=["red", "blue"]), "red|blue"),
                   (StructuredOutputs(regex="[0-9]{3}"), "[0-9]{3}"),
                   (StructuredOutputs(regex=re.escape(tail_word) + "!"), re.escape(tail_word) + "!")]
    for constraint, pattern in constraints:
        params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=constraint)
        output = llm.generate("Pick one:", params)[0].outputs[0]
        assert re.fullmatch(pattern, output.text) and output.finish_reason == "stop", (constraint, output.text)
        assert max(output.token_ids) < vocab_size


def test_mask_width_is_the_models(tokenizer: Tokenizer) -> None:
    for vocab_size in (49000, 49152, 49300):
        ll = ll_tokenizer(tokenizer.hf, vocab_size, [2])
        assert ll.vocab_size == vocab_size and ll.eos_tokens == [2]
