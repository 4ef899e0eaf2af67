"""Tokenizer, incremental detokenizer and stop strings: streamed text must equal the whole decode."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagoda.services.tokenizer.detokenizer import MAX_HELD_TOKENS, IncrementalDetokenizer, StreamDetokenizer
from pagoda.services.tokenizer.stop import StopChecker
from pagoda.services.tokenizer.text_stream import TextStream
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.errors import InvalidRequestError, ModelNotFoundError
from pagoda.shared.messages import SamplingParams
from tests.test_detokenizer_fuzz import byte_fallback_bpe

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = Path(os.environ.get("PAGODA_TEST_MODEL_DIR") or REPO_ROOT / "models/smollm2-135m-instruct")
MULTIBYTE_TEXT = "héllo 世界 🎉 naïve"
CORPUS = ["hello world", "héllo naïve café", "世界 你好 世界", "🎉 party 🎉", "the quick brown fox",
          "jumps over the lazy dog", "ünïcödé téxt", "日本語のテキスト"]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    if not (MODEL_DIR / "tokenizer.json").is_file() and not (MODEL_DIR / "tokenizer_config.json").is_file():
        pytest.skip(f"no tokenizer at {MODEL_DIR} (set PAGODA_TEST_MODEL_DIR)")
    return Tokenizer(MODEL_DIR)


def _save(rust: RustTokenizer, folder: Path, **special: str) -> Tokenizer:
    PreTrainedTokenizerFast(tokenizer_object=rust, **special).save_pretrained(str(folder))
    return Tokenizer(folder)


@pytest.fixture(scope="module")
def tiny_bytelevel(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """GPT-2 style byte-level BPE: every byte is a token, so any id sequence is some byte string."""
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _save(rust, tmp_path_factory.mktemp("bytelevel"), eos_token="<eos>")


@pytest.fixture(scope="module")
def tiny_byte_fallback(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """Llama 2 style: Metaspace words, characters missing from the vocab spelled as <0xXX> tokens."""
    folder = tmp_path_factory.mktemp("bytefallback")
    rust = byte_fallback_bpe(folder, CORPUS, 120, ["<unk>", "<s>", "</s>"])
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    return _save(rust, folder / "hf", eos_token="</s>", unk_token="<unk>", bos_token="<s>")


def _stream(tok: Tokenizer, prompt_ids: list[int], output_ids: list[int], skip: bool,
            rng: random.Random | None = None) -> list[str]:
    """Deltas for output_ids pushed one at a time (or in random chunks), checking each against decode."""
    full = tok.decode(output_ids, skip_special_tokens=skip)
    detok = DETOK[0](tok, prompt_ids, skip_special_tokens=skip)
    deltas: list[str] = []
    i = 0
    while i < len(output_ids):
        size = rng.randint(1, 4) if rng else 1
        deltas.append(detok.push(output_ids[i:i + size]))
        i += size
        # Every prefix of the stream is a prefix of the whole decode: no U+FFFD it does not have.
        assert full.startswith("".join(deltas)), (output_ids[:i], deltas, full)
    deltas.append(detok.flush())
    assert "".join(deltas) == full, (prompt_ids, output_ids, deltas, full)
    return deltas


def _random_sequences(tok: Tokenizer, pool: list[int], num: int,
                      seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        prompt = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
        output = [rng.choice(pool) if rng.random() < 0.8 else rng.randrange(tok.vocab_size)
                  for _ in range(rng.randint(1, MAX_HELD_TOKENS - 2))]
        out.append((prompt, output))
    return out


# ---- detokenizer ------------------------------------------------------------------------------


def _stream_detokenizer(tok: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> StreamDetokenizer:
    assert tok.backend is not None
    return StreamDetokenizer(tok.backend, prompt_ids, skip_special_tokens)


DETOK: list[Callable[..., Any]] = [IncrementalDetokenizer]  # the implementation under test


@pytest.fixture(params=["python", "decode_stream"])
def detokenizer_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each detokenizer test runs on both: the tokenizers library's DecodeStream and the Python one."""
    DETOK[0] = _stream_detokenizer if request.param == "decode_stream" else IncrementalDetokenizer
    yield request.param
    DETOK[0] = IncrementalDetokenizer


@pytest.mark.usefixtures("detokenizer_kind")
@pytest.mark.parametrize("skip", [True, False])
def test_real_tokenizer_random_ids(smol: Tokenizer, skip: bool) -> None:
    # Byte tokens of multi-byte characters, emoji split over byte tokens, and the special tokens.
    pool = smol.encode(MULTIBYTE_TEXT + " 👍🏽👨‍👩‍👧 ∑ 𝔘 ☃ 日本語", add_special_tokens=False)
    pool += smol.all_special_ids
    rng = random.Random(1)
    for prompt, output in _random_sequences(smol, pool, 300, seed=int(skip)):
        _stream(smol, prompt, output, skip)
        _stream(smol, prompt, output, skip, rng)


@pytest.mark.usefixtures("detokenizer_kind")
def test_real_tokenizer_text_round_trip(smol: Tokenizer) -> None:
    chat = smol.apply_chat_template([{"role": "user", "content": "hi"}])
    for text in [MULTIBYTE_TEXT, " leading space", "a\n\nb  c", "🎉🎉🎉", "x" * 50 + " 世界"]:
        ids = smol.encode(text, add_special_tokens=False)
        for prompt in ([], chat, smol.encode("Say:", add_special_tokens=False)):
            deltas = _stream(smol, prompt, ids + [smol.eos_token_id], skip=True)
            assert "".join(deltas) == text
            assert all("\ufffd" not in d for d in deltas)
    # An emoji is several byte tokens: nothing comes out until its last byte has.
    ids = smol.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1
    detok = DETOK[0](smol, chat)
    assert [detok.push([t]) for t in ids] == [""] * (len(ids) - 1) + ["🎉"]


def test_decode_matches_transformers(smol: Tokenizer, tiny_byte_fallback: Tokenizer) -> None:
    rng = random.Random(0)
    for tok in (smol, tiny_byte_fallback):
        for _ in range(50):
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 20))]
            for skip in (True, False):
                assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip,
                                                               clean_up_tokenization_spaces=False)


@pytest.mark.usefixtures("detokenizer_kind")
@pytest.mark.parametrize("skip", [True, False])
def test_tiny_bytelevel_random_ids(tiny_bytelevel: Tokenizer, skip: bool) -> None:
    # Any id sequence, valid UTF-8 or not: byte-level decoding is lossy over the whole byte string.
    pool = list(range(tiny_bytelevel.vocab_size))
    rng = random.Random(2)
    for prompt, output in _random_sequences(tiny_bytelevel, pool, 400, seed=3 + int(skip)):
        _stream(tiny_bytelevel, prompt, output, skip)
        _stream(tiny_bytelevel, prompt, output, skip, rng)


@pytest.mark.usefixtures("detokenizer_kind")
def test_tiny_byte_fallback_text(tiny_byte_fallback: Tokenizer) -> None:
    # Valid text only: ByteFallback turns a whole run of byte tokens into U+FFFDs if any byte in it is
    # invalid, which no stream can know in advance.
    tok = tiny_byte_fallback
    assert "<0xE4>" in tok.hf.convert_ids_to_tokens(tok.encode("世", add_special_tokens=False))
    rng = random.Random(5)
    alphabet = "abcxyz ḫéï世界日本🎉👍🏽"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        ids = tok.encode(text, add_special_tokens=False)
        deltas = _stream(tok, [], ids, True, rng)
        assert all("\ufffd" not in d for d in deltas)


@pytest.mark.usefixtures("detokenizer_kind")
def test_first_token_keeps_its_space_after_a_prompt(tiny_byte_fallback: Tokenizer) -> None:
    tok = tiny_byte_fallback
    prompt = tok.encode("hello", add_special_tokens=False)
    output = tok.encode("world", add_special_tokens=False)  # "▁world": a word that follows a space
    assert tok.decode(output) == "world"  # decoded alone, the decoder strips the leading space
    detok = DETOK[0](tok, prompt)
    assert "".join(detok.push([t]) for t in output) + detok.flush() == " world"


@pytest.mark.usefixtures("detokenizer_kind")
def test_garbage_run_is_bounded(tiny_bytelevel: Tokenizer) -> None:
    # Lone continuation bytes never complete a character: held at most MAX_HELD_TOKENS tokens.
    # bytes 0xA1..0xAC are continuation bytes that byte-level BPE spells as themselves (a fixed choice: drawing
    # from the alphabet's set could pick lead bytes, which complete characters with the bytes after them)
    cont = tiny_bytelevel.hf.convert_tokens_to_ids([chr(b) for b in range(0xA1, 0xA5)])
    assert all(tiny_bytelevel.decode([i]) == "\ufffd" for i in cont)
    output = [cont[i % len(cont)] for i in range(5 * MAX_HELD_TOKENS)]
    output += tiny_bytelevel.encode("ok", add_special_tokens=False)
    detok = DETOK[0](tiny_bytelevel, [])
    deltas = [detok.push([t]) for t in output]
    assert sum(1 for d in deltas if d) >= 4
    assert "".join(deltas) + detok.flush() == tiny_bytelevel.decode(output)


@pytest.mark.parametrize("skip", [True, False])
def test_stream_chunks_emit_what_single_steps_emit(smol: Tokenizer, tiny_bytelevel: Tokenizer, skip: bool) -> None:
    # A chunk of tokens (the offline engine pushes a completion's tokens together at its end) gives exactly the
    # text of pushing them one by one, chunk for chunk, whether its bytes are whole characters (one decode) or
    # not (stepped), and the stream goes on the same after it.
    rng = random.Random(7 + int(skip))
    text_ids = smol.encode(MULTIBYTE_TEXT + " plain words and more words 日本語 🎉", add_special_tokens=False)
    for tok, pool in ((smol, text_ids + smol.all_special_ids + smol.encode("👍🏽", add_special_tokens=False)),
                      (tiny_bytelevel, list(range(tiny_bytelevel.vocab_size)))):
        for _ in range(150):
            prompt = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
            if rng.random() < 0.5:  # runs of text (whole characters: the one-decode path) or random ids
                start = rng.randrange(len(text_ids))
                output = (text_ids[start:] + text_ids)[:rng.randint(1, 80)] if tok is smol else \
                    tok.encode("héllo wörld 世界 " * 4, add_special_tokens=False)[:rng.randint(1, 60)]
            else:
                output = [rng.choice(pool) for _ in range(rng.randint(1, 80))]
            chunked = _stream_detokenizer(tok, prompt, skip)
            single = _stream_detokenizer(tok, prompt, skip)
            i = 0
            while i < len(output):
                chunk = output[i:i + rng.choice([1, 2, 5, 17, 80])]
                assert chunked.push(chunk) == "".join(single.push([t]) for t in chunk), (prompt, output, i)
                i += len(chunk)
            assert chunked.flush() == single.flush()


# ---- tokenizer --------------------------------------------------------------------------------


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Answer in 中文."},
    {"role": "assistant", "content": "四"},
    {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}]},
]


def test_chat_template_matches_transformers(smol: Tokenizer) -> None:
    expected_conv = [*CONVERSATION[:3], {"role": "user", "content": "And 3+3?"}]
    for gen in (True, False):
        expected = smol.hf.apply_chat_template(expected_conv, add_generation_prompt=gen, tokenize=True,
                                               return_dict=False)
        assert smol.apply_chat_template(CONVERSATION, add_generation_prompt=gen) == list(expected)
        assert smol.render_chat(CONVERSATION, add_generation_prompt=gen) == smol.hf.apply_chat_template(
            expected_conv, add_generation_prompt=gen, tokenize=False)
    assert smol.render_chat([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")
    # transformers' own arguments, and `messages`, which it gives the template itself (a second value was a
    # TypeError, a 400 blaming the messages)
    for kwargs in ({"tokenize": True}, {"messages": []}):
        with pytest.raises(InvalidRequestError) as info:
            smol.render_chat(CONVERSATION, chat_template_kwargs=kwargs)
        assert info.value.param == "chat_template_kwargs"


@pytest.mark.parametrize("messages", [
    [], "hello", None, [{"content": "hi"}], [{"role": "", "content": "hi"}], [{"role": 3, "content": "hi"}],
    [{"role": "user"}], [{"role": "user", "content": 5}], ["hi"],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": 1}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
])
def test_bad_messages(smol: Tokenizer, messages: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        smol.apply_chat_template(messages)  # type: ignore[arg-type]
    assert info.value.param == "messages"


def test_tokenizer_properties(smol: Tokenizer) -> None:
    assert smol.eos_token_id == 2
    assert smol.vocab_size == len(smol.hf) == 49152
    assert 2 in smol.all_special_ids
    assert smol.decode(smol.encode(MULTIBYTE_TEXT)) == MULTIBYTE_TEXT
    assert smol.decode([2], skip_special_tokens=False) == "<|im_end|>"
    assert smol.decode([2]) == ""


def test_tokenizer_errors(tiny_bytelevel: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError):  # a tokenizer with no chat template
        tiny_bytelevel.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ModelNotFoundError):
        Tokenizer(tmp_path)
    with pytest.raises(ModelNotFoundError):
        Tokenizer(tmp_path / "missing")


# ---- stop strings -----------------------------------------------------------------------------


def _reference_stop(deltas: list[str], stop: list[str], include: bool, num_protected: int = 0) -> tuple[str, bool]:
    """vLLM's: the first delta that completes a match ending past the first `num_protected` chars (min_tokens'
    text) ends the text, at the earliest-starting (then shortest) of the matches it completes."""
    full = "".join(deltas)
    seen = 0
    for delta in deltas:
        seen += len(delta)
        matches = [(i, i + len(s)) for s in stop
                   if 0 <= (i := full.find(s, max(0, num_protected - len(s) + 1))) <= seen - len(s)]
        if matches:
            start, end = min(matches)
            return full[:end] if include else full[:start], True
    return full, False


def _run_stop(deltas: list[str], stop: list[str], include: bool, num_protected: int = 0) -> tuple[str, bool]:
    """The first `num_protected` deltas are pushed as protected (min_tokens not reached)."""
    checker = StopChecker(stop, include)
    out = []
    for i, delta in enumerate(deltas):
        text, matched = checker.push(delta, protected=i < num_protected)
        out.append(text)
        if matched:
            assert checker.matched_stop in stop
            return "".join(out), True
    out.append(checker.flush())
    return "".join(out), checker.matched_stop is not None


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_stop_checker_matches_reference(data: st.DataObject) -> None:
    full = data.draw(st.text(alphabet="ab é🎉", max_size=30))
    stop = []
    for _ in range(data.draw(st.integers(1, 4))):
        if full and data.draw(st.booleans()):
            i = data.draw(st.integers(0, len(full) - 1))
            stop.append(full[i:data.draw(st.integers(i + 1, min(len(full), i + 6)))])
        else:
            stop.append(data.draw(st.text(alphabet="ab é🎉", min_size=1, max_size=5)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(full)), max_size=10)))
    deltas = [full[a:b] for a, b in zip([0, *cuts], [*cuts, len(full)], strict=True)]
    include = data.draw(st.booleans())
    assert _run_stop(deltas, stop, include) == _reference_stop(deltas, stop, include)
    num_protected = data.draw(st.integers(0, len(deltas)))
    assert _run_stop(deltas, stop, include, num_protected) == \
        _reference_stop(deltas, stop, include, len("".join(deltas[:num_protected])))


def test_stop_checker_cases() -> None:
    # Spans many deltas; the held tail comes out when the match fails.
    checker = StopChecker(["STOP"], False)
    assert checker.push("abc S") == ("abc ", False)
    assert checker.push("T") == ("", False)
    assert checker.push("Ox") == ("STOx", False)
    assert checker.push("yST") == ("y", False)
    assert checker.push("OP more") == ("", True)
    with pytest.raises(AssertionError):
        checker.push("again")
    # The stop string that completes first ends the text (vLLM's), though a longer one began before it; of two
    # completed by one delta, the earlier-starting
    assert _run_stop(["xab", "c", "d"], ["abcd", "bc"], False) == ("xa", True)
    assert _run_stop(["xab", "c", "X"], ["abcd", "bc"], False) == ("xa", True)
    assert _run_stop(["xab", "c"], ["abcd", "bc"], True) == ("xabc", True)
    assert _run_stop(["xa", "bcd"], ["cd", "abcd"], False) == ("x", True)
    assert _run_stop(["hello"], [], False) == ("hello", False)
    assert _run_stop(["a<|", "end|>b"], ["<|end|>"], True) == ("a<|end|>", True)


def test_min_tokens_hold_stop_strings_back(smol: Tokenizer) -> None:
    # vLLM's min_tokens: a stop string ends the output only where it ends after the first min_tokens tokens' text
    # (it may begin inside it); before, "min_tokens": 6, "stop": ["."] stopped at "No" after 2 tokens.
    token_ids = smol.encode("No. The sky is not blue. It is grey.", add_special_tokens=False)
    cases = [(0, "No"), (1, "No"), (2, "No. The sky is not blue"), (9, "No. The sky is not blue. It is grey")]
    for min_tokens, expected in cases:
        stream = TextStream(smol, [], SamplingParams(stop=["."], min_tokens=min_tokens, max_tokens=len(token_ids)))
        text = "".join(stream.push([token_id]) for token_id in token_ids) + stream.close()
        assert (text, stream.stopped) == (expected, True), min_tokens
    # a stop string that begins in the protected text and ends after it counts
    stream = TextStream(smol, [], SamplingParams(stop=["No. The"], min_tokens=2, max_tokens=len(token_ids)))
    assert "".join(stream.push([token_id]) for token_id in token_ids[:3]) == "" and stream.stopped


@pytest.mark.parametrize("name", ["smol", "tiny_bytelevel", "tiny_byte_fallback"])
def test_token_bytes_spell_the_text(name: str, request: pytest.FixtureRequest) -> None:
    """Logprobs' `bytes`: a token's raw bytes, also for tokens holding part of a character; joined over an
    encoding they give the text's UTF-8 (SentencePiece may add the leading space its decoder strips)."""
    tok: Tokenizer = request.getfixturevalue(name)
    partial_tokens = 0
    for text in [*CORPUS, "naïve 🤖 €5 — 日本"]:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [tok.token_bytes(i) for i in ids]
        assert b"".join(pieces) in (text.encode(), b" " + text.encode()), (name, text, pieces)
        partial_tokens += sum(1 for piece in pieces if not _is_utf8(piece))
    assert partial_tokens > 0, "the texts must include characters split across tokens"
    eos = tok.eos_token_id
    assert eos is not None and tok.token_bytes(eos) == tok.decode([eos], skip_special_tokens=False).encode()


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
