"""Streamed text against the tokenizer's own decode, fuzzed over the tokenizer kinds models ship: byte-level BPE
(SmolLM2's own, and GPT-2 style with added special and plain tokens), SentencePiece-style BPE with byte fallback
(Llama 2's and Gemma's decoders, and a Metaspace decoder), a Unigram with a lowercasing normalizer (T5), and
WordPiece. Each tokenizer but SmolLM2's is trained here, at test time, on a few lines of multilingual text.

The oracle is the whole decode of the same ids in the prompt's context (what the first token's leading space
depends on): the deltas of both detokenizers concatenate to it, every prefix of them is a prefix of it (no
U+FFFD it does not have), and stop strings cut it where they first match in it. Where ByteFallback rewrites text
it already gave (a run of byte tokens that turns invalid becomes U+FFFDs), no stream can follow the whole decode:
there the detokenizers must not fail, and must agree with each other."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer
from transformers import PreTrainedTokenizerFast

from pagoda.services.tokenizer.detokenizer import (
    NUM_CONTEXT_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StreamDetokenizer,
)
from pagoda.services.tokenizer.output import Outputs
from pagoda.services.tokenizer.text_stream import TextStream
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.messages import FinishReason, GenerateRequest, SamplingParams, TextDelta, TokenDeltas

CORPUS = ["hello world, the quick brown fox jumps over the lazy dog.", "héllo naïve café déjà vu",
          "世界 你好 世界 日本語のテキスト", "🎉 party 🎉 👍🏽 👨\u200d👩\u200d👧",
          "e\u0301 a\u0308 o\u0302 combining marks", "Привет мир как дела", "مرحبا بالعالم",
          "I don't know, it's fine! Isn't it? We're here.",
          "x = f(a, b) + 3 * [1, 2]\n\tdef g(): return None"]
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", " hello world", "✓✓", "ab", "▁x"]  # plain (not special) added tokens


# ---- tokenizer kinds --------------------------------------------------------------------------------------------


def _save(rust: RustTokenizer, folder: Path) -> Tokenizer:
    rust.add_tokens([AddedToken(t, normalized=False) for t in ADDED_TOKENS])
    PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            additional_special_tokens=SPECIAL_TOKENS[3:]).save_pretrained(str(folder))
    return Tokenizer(folder)


def _byte_level(folder: Path) -> Tokenizer:
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL_TOKENS,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _save(rust, folder)


def byte_fallback_bpe(folder: Path, corpus: list[str], vocab_size: int, special_tokens: list[str]) -> RustTokenizer:
    """A SentencePiece-style BPE over a small alphabet, trained on `corpus` (its files written to `folder`): other
    characters are spelled as <0xXX> byte tokens. No decoder: the caller picks the family's."""
    trained = RustTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=list("abcdefghijklmnopqrstuvwxyz▁"),
        limit_alphabet=27))
    vocab_file, merges_file = trained.model.save(str(folder))
    vocab = json.loads(Path(vocab_file).read_text())
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    Path(vocab_file).write_text(json.dumps(vocab))
    rust = RustTokenizer(models.BPE.from_file(vocab_file, merges_file, byte_fallback=True, unk_token="<unk>"))
    rust.add_special_tokens(special_tokens)
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    return rust


def _byte_fallback_bpe(folder: Path) -> RustTokenizer:
    return byte_fallback_bpe(folder, CORPUS, 140, SPECIAL_TOKENS)


def _llama2(folder: Path) -> Tokenizer:
    rust = _byte_fallback_bpe(folder)
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    return _save(rust, folder / "hf")


def _gemma(folder: Path) -> Tokenizer:
    """No pre-tokenizer (spaces become "▁" in the normalizer) and no leading space stripped."""
    rust = _byte_fallback_bpe(folder)
    rust.normalizer = normalizers.Replace(" ", "▁")
    rust.pre_tokenizer = None
    rust.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return _save(rust, folder / "hf")


def _metaspace(folder: Path) -> Tokenizer:
    rust = _byte_fallback_bpe(folder)
    rust.decoder = decoders.Sequence([decoders.ByteFallback(),
                                      decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    return _save(rust, folder / "hf")


def _unigram(folder: Path) -> Tokenizer:
    """T5-like: NFKC, lowercase and strip; "▁" before every word."""
    rust = RustTokenizer(models.Unigram())
    rust.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(), normalizers.Strip()])
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    rust.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    rust.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=200, special_tokens=SPECIAL_TOKENS,
                                                             unk_token="<unk>"))
    return _save(rust, folder)


def _wordpiece(folder: Path) -> Tokenizer:
    rust = RustTokenizer(models.WordPiece(unk_token="<unk>"))
    rust.normalizer = normalizers.BertNormalizer(lowercase=True)
    rust.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    rust.decoder = decoders.WordPiece(cleanup=True)
    rust.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS))
    return _save(rust, folder)


def _smollm2(folder: Path) -> Tokenizer:
    """The real one on disk (GPT-2 style byte-level BPE with its chat special tokens), not trained here."""
    model_dir = Path(__file__).resolve().parent.parent / "models/smollm2-135m-instruct"
    if not (model_dir / "tokenizer.json").is_file():
        pytest.skip(f"no tokenizer at {model_dir}")
    return Tokenizer(model_dir)


KINDS: dict[str, Callable[[Path], Tokenizer]] = {
    "smollm2": _smollm2, "byte_level": _byte_level, "llama2": _llama2, "gemma": _gemma, "metaspace": _metaspace,
    "unigram": _unigram, "wordpiece": _wordpiece}
BYTE_FALLBACK_KINDS = ("llama2", "gemma", "metaspace")


@pytest.fixture(scope="module", params=list(KINDS))
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return KINDS[request.param](tmp_path_factory.mktemp(request.param))


# ---- helpers ----------------------------------------------------------------------------------------------------


def _detokenizers(tok: Tokenizer, prompt: list[int], skip: bool) -> list[StreamDetokenizer | IncrementalDetokenizer]:
    assert tok.backend is not None
    return [StreamDetokenizer(tok.backend, prompt, skip), IncrementalDetokenizer(tok, prompt, skip)]


def _push_all(detok: StreamDetokenizer | IncrementalDetokenizer, output: list[int],
              sizes: list[int] | None = None) -> list[str]:
    deltas, i = [], 0
    for size in sizes or [1] * len(output):
        deltas.append(detok.push(output[i:i + size]))
        i += size
    assert i >= len(output)
    return [*deltas, detok.flush()]


# ---- detokenizer ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", BYTE_FALLBACK_KINDS)
def test_byte_run_turning_invalid_after_shown_text(kind: str, tmp_path: Path) -> None:
    # "世" (three byte tokens) is shown; then a lone lead byte and a letter: the whole decode turns the run into
    # four U+FFFDs, which would rewrite the shown "世". DecodeStream raised "Invalid prefix" here (the request
    # failed with an internal error); the Python detokenizer cut the first char off the new text.
    tok = KINDS[kind](tmp_path)
    word = tok.encode("世", add_special_tokens=False)
    assert tok.hf.convert_ids_to_tokens(word)[-3:] == ["<0xE4>", "<0xB8>", "<0x96>"]
    tail = [tok.hf.convert_tokens_to_ids("<0xE4>"), *tok.encode("ab c", add_special_tokens=False)]
    output = word + tail
    assert tok.decode(output).startswith(REPLACEMENT_CHAR * 4)
    for detok in _detokenizers(tok, [], True):
        deltas = _push_all(detok, output)
        # what was shown stays, and the tokens after it come out as their own text
        assert "".join(deltas) == tok.decode(word) + tok.decode(tail), (type(detok).__name__, deltas)


def _random_case(tok: Tokenizer, rng: random.Random) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids): a run of encoded text, or ids drawn from text, special and added tokens and the
    whole vocabulary; special or added tokens put in anywhere. Shorter than MAX_HELD_TOKENS, whose release may
    show invalid bytes that later ones complete in the whole decode."""
    text_ids = tok.encode(" ".join(CORPUS), add_special_tokens=False)
    extra = tok.all_special_ids + tok.hf.convert_tokens_to_ids(ADDED_TOKENS)
    if rng.random() < 0.4:
        start = rng.randrange(len(text_ids))
        output = text_ids[start:start + rng.randint(1, 24)]
    else:
        output = [rng.choice(text_ids + extra) if rng.random() < 0.85 else rng.randrange(tok.vocab_size)
                  for _ in range(rng.randint(1, 24))]
    for _ in range(rng.choice([0, 0, 1, 3])):
        output.insert(rng.randint(0, len(output)), rng.choice(extra))
    prompt = [rng.choice(text_ids + extra) for _ in range(rng.randint(0, 8))]
    return prompt, output


def _oracle(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> tuple[str, bool]:
    """(The output's text in the prompt's context, whether the decode never rewrites text it gave.) The context is
    the prompt's tail unless that ends inside a character (the detokenizers then decode the output alone)."""
    context = prompt[-NUM_CONTEXT_TOKENS:]
    if tok.decode(context, skip).endswith(REPLACEMENT_CHAR):
        context = []
    context_text, whole = tok.decode(context, skip), tok.decode(context + output, skip)
    stable = whole.startswith(context_text) and all(
        whole.startswith(text) for i in range(len(output))
        if not (text := tok.decode(context + output[:i], skip)).endswith(REPLACEMENT_CHAR))
    return whole[len(context_text):], stable


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_follow_the_whole_decode(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(int(skip))
    num_stable = 0
    for _ in range(150):
        prompt, output = _random_case(tok, rng)
        expected, stable = _oracle(tok, prompt, output, skip)
        stream, python = (_push_all(detok, output) for detok in _detokenizers(tok, prompt, skip))
        case = (prompt, output, stream, python, expected)
        assert stream == python, case  # the same text, delta for delta
        sizes = [rng.choice([1, 2, 3, 7, 24]) for _ in output]
        chunked_stream, chunked_python = (_push_all(detok, output, sizes) for detok in _detokenizers(tok, prompt, skip))
        assert "".join(chunked_stream) == "".join(stream), (case, sizes)  # DecodeStream steps token by token
        if not stable:  # ByteFallback over invalid bytes: what was shown depends on where the pushes fell
            continue
        num_stable += 1
        assert "".join(stream) == "".join(chunked_python) == expected, (case, sizes)
        shown = ""
        for delta in stream:  # each prefix of the stream is a prefix of the text: no U+FFFD it does not have
            shown += delta
            assert expected.startswith(shown), case
    assert num_stable >= 80


def test_long_invalid_byte_runs(tok: Tokenizer) -> None:
    # Mostly byte tokens (ByteFallback's <0xNN>, or the byte-level alphabet), past MAX_HELD_TOKENS: the held tokens
    # are let go as U+FFFDs, where ByteFallback may have rewritten the context they are decoded after. No failure,
    # and the stream's text does not depend on how the tokens were pushed.
    byte_ids = [t for t, piece in enumerate(tok.hf.convert_ids_to_tokens(list(range(tok.vocab_size))))
                if piece.startswith("<0x") or len(piece) == 1]
    text_ids = tok.encode(" ".join(CORPUS), add_special_tokens=False)
    rng = random.Random(8)
    for _ in range(20):
        output = [rng.choice(byte_ids) if rng.random() < 0.8 else rng.choice(text_ids + tok.all_special_ids)
                  for _ in range(rng.randint(40, 120))]
        prompt = [rng.choice(text_ids) for _ in range(rng.randint(0, 6))]
        skip = rng.random() < 0.5
        assert tok.backend is not None
        single = "".join(_push_all(StreamDetokenizer(tok.backend, prompt, skip), output))
        sizes = [rng.choice([1, 2, 5, 40]) for _ in output]
        assert "".join(_push_all(StreamDetokenizer(tok.backend, prompt, skip), output, sizes)) == single
        _push_all(IncrementalDetokenizer(tok, prompt, skip), output, sizes)


def _reference_stop(deltas: list[str], stop: list[str], include: bool) -> tuple[str, str | None]:
    """vLLM's: the first delta (push) that completes a stop string ends the text, at the earliest-starting (then
    shortest) match it completes."""
    text = "".join(deltas)
    seen = 0
    for delta in deltas:
        seen += len(delta)
        matches = [(i, i + len(s)) for s in stop if 0 <= (i := text.find(s)) <= seen - len(s)]
        if matches:
            start, end = min(matches)
            return (text[:end] if include else text[:start]), text[start:end]
    return text, None


def test_stop_strings_cut_the_whole_decode(tok: Tokenizer) -> None:
    # Stop strings drawn from the text (so they span token boundaries and begin or end inside a token, next to
    # characters whose bytes are split over tokens), the text of special tokens, a lone combining mark.
    rng = random.Random(3)
    num_stopped = 0
    for _ in range(200):
        prompt, output = _random_case(tok, rng)
        skip = rng.random() < 0.5
        text, stable = _oracle(tok, prompt, output, skip)
        if not stable or not text:
            continue
        stop = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(text))
            stop.append(text[start:start + rng.randint(1, 6)])
        if rng.random() < 0.3:
            stop.append(rng.choice(["<|im_end|>", "</s>", "\u0301", "é", "🎉", "<think>", "世界"]))
        include = rng.random() < 0.5
        params = SamplingParams(stop=stop, include_stop_str_in_output=include, skip_special_tokens=skip,
                                max_tokens=64)
        sizes = [rng.choice([1, 1, 2, 5]) for _ in output]
        starts = list(itertools.accumulate(sizes, initial=0))
        chunks = [output[a:b] for a, b in zip(starts, starts[1:], strict=False) if a < len(output)]
        plain = TextStream(tok, prompt, msgspec.structs.replace(params, stop=[]))  # each push's text, no stops
        pushed = [plain.push(chunk) for chunk in chunks] + [plain.close()]
        assert "".join(pushed) == text
        stream = TextStream(tok, prompt, params)
        deltas = []
        for chunk in chunks:
            if stream.stopped:
                break
            deltas.append(stream.push(chunk))
        deltas.append(stream.close())
        expected, matched = _reference_stop(pushed, stop, include)
        assert ("".join(deltas), stream.stop_reason) == (expected, matched), (prompt, output, stop, deltas)
        assert stream.text == expected
        num_stopped += matched is not None
    assert num_stopped >= 50


# ---- logprobs' bytes --------------------------------------------------------------------------------------------


def test_token_bytes_spell_the_decode(tok: Tokenizer) -> None:
    """Logprobs' `bytes`: a token's raw bytes, joined over a completion, are its text's UTF-8 (SentencePiece's may
    add the leading space its decoder strips at the start). With byte-level BPE any ids' bytes, invalid UTF-8
    included, decode to what the tokenizer decodes (added tokens as their text)."""
    if tok.backend is not None and isinstance(tok.backend.decoder, decoders.WordPiece):
        pytest.skip("WordPiece's tokens have no bytes of their own: the decoder puts the spaces between words")
    rng = random.Random(4)
    for line in [*CORPUS, "a<think>b✓✓ hello world</think>▁xab"]:
        token_ids = tok.encode(line, add_special_tokens=False)
        text = tok.decode(token_ids)
        assert b"".join(tok.token_bytes(t) for t in token_ids) in (text.encode(), b" " + text.encode()), line
    if not isinstance(tok.backend.decoder, decoders.ByteLevel):
        return
    ids = [t for t in range(tok.vocab_size) if t not in tok.all_special_ids]
    for _ in range(300):
        token_ids = [rng.choice(ids) for _ in range(rng.randint(1, 12))]
        spelled = b"".join(tok.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")
        assert spelled == tok.decode(token_ids), (token_ids, tok.hf.convert_ids_to_tokens(token_ids))


# ---- the tokenizer service's outputs ----------------------------------------------------------------------------


def test_outputs_serve_random_byte_fallback_tokens(tmp_path: Path) -> None:
    # What a tiny random-weight Llama with a Llama 2 tokenizer sends (checked by hand against `pagoda serve`): before,
    # nearly each such completion failed with "internal error in the tokenizer" (DecodeStream's "Invalid prefix").
    # One token per step through Outputs, as the tokenizer service takes the scheduler's TokenDeltas.
    tok = _llama2(tmp_path)
    outputs = Outputs(tok)
    rng = random.Random(6)
    num_stable = 0
    for i in range(60):
        prompt, output = _random_case(tok, rng)
        skip = i % 2 == 0
        params = SamplingParams(max_tokens=len(output), skip_special_tokens=skip, logprobs=0)
        outputs.add(0, GenerateRequest(str(i), params, prompt_token_ids=prompt), params, prompt, None)
        deltas: list[TextDelta] = []
        for step, token_id in enumerate(output):
            reason = FinishReason.LENGTH if step == len(output) - 1 else -1
            batch = outputs.on_token_deltas(TokenDeltas([str(i)], [0], [token_id], [reason], [0], [0], [-1.0],
                                                         [[]], [[]]))
            assert not batch.failed, (prompt, output)
            deltas += [d for message in batch.to_apis.get(0, []) for d in message.deltas]  # type: ignore[union-attr]
        assert deltas[-1].finish_reason == FinishReason.LENGTH
        text = "".join(d.text for d in deltas)
        expected, stable = _oracle(tok, prompt, output, skip)
        assert text == expected or not stable, (prompt, output, text, expected)
        num_stable += stable
        spelled = b"".join(bytes(p.sampled.bytes) for d in deltas for p in d.logprobs)
        assert spelled == b"".join(tok.token_bytes(t) for t in output)
    assert num_stable >= 30  # the text was checked against the whole decode, not only the bytes
