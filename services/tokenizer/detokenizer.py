"""Incremental detokenization: one sequence's new token ids in, its newly finished text out.

With a fast (Rust) tokenizer, `StreamDetokenizer` steps the tokenizers library's DecodeStream (~0.9 us per
token on SmolLM2's, against ~2.5 us for two whole-window decodes per token: `python -m pagoda.bench.detokenize`).
DecodeStream lacks two things a server needs, which StreamDetokenizer adds with plain decodes on the rare
paths: a flush (a sequence that ends inside a character must still show its bytes, as U+FFFD, like the whole
decode does; DecodeStream keeps them forever) and a bound on held tokens (a model that emits invalid bytes
would make each step re-decode an ever longer window). `IncrementalDetokenizer` is the same algorithm in
Python over any `decode`; it serves tokenizers without a Rust backend.

ByteFallback (Llama 2, Gemma, Mistral) rewrites text it already gave when more tokens come: it turns a whole run of
byte tokens into U+FFFDs, one per byte, once a byte in the run is invalid, so "世" shown from three byte tokens becomes
four U+FFFDs after a lone lead byte. No stream can take back what it showed: both detokenizers keep it, and give the
tokens after it as their own decode (DecodeStream raises "Invalid prefix" on them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import tokenizers
from tokenizers.decoders import ByteLevel, DecodeStream

REPLACEMENT_CHAR = "\ufffd"
NUM_CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output, as vLLM does
# A UTF-8 character is at most 4 bytes, so a window still ending in U+FFFD after this many held tokens
# holds invalid bytes (which the whole decode shows as U+FFFD too), not a character waiting for its
# last byte. Letting it go keeps the per-token cost bounded on a model that emits garbage bytes.
MAX_HELD_TOKENS = 32
INVALID_PREFIX = "Invalid prefix"  # how DecodeStream's error for a decoder that rewrote shown text begins


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Prefix-offset / read-offset detokenization over a short window of token ids.

    window:  [ prefix tokens (already emitted) | read tokens (held, not yet emitted) ]
              ^ 0                               ^ read_offset                        ^ len(window)
    Each push decodes the window, and emits what it adds to `prefix_text` (the decode of the prefix
    tokens alone) unless it ends in U+FFFD: then the last bytes of a character are still to come.
    Decoding from the prefix, not from the first new token, keeps what a token's text depends on
    (a leading space a SentencePiece decoder strips at the start of a text, a byte run). On each
    emission the window slides to start at the tokens just emitted, so its length is the size of the
    last push plus whatever is held: the cost per token does not grow with the sequence.

    For byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) the deltas plus `flush()` equal
    `decode(output_ids)` exactly. The first delta is the text in the prompt's context, which differs
    from decoding the output alone only where a decoder strips a leading space at the start.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window, self._prefix_text = self._context(list(prompt_token_ids[-NUM_CONTEXT_TOKENS:]))
        self._read_offset = len(self._window)

    def _context(self, tail: list[int]) -> tuple[list[int], str]:
        """The prompt tail and its text, or nothing when the prompt ends inside a character."""
        text = self._decode(tail)
        if text.endswith(REPLACEMENT_CHAR):
            # Output bytes could complete that character; the text of the output alone is then what
            # decode(output_ids) gives.
            return [], ""
        return tail, text

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Text finished by these tokens (often "", when they end inside a character)."""
        if not new_token_ids:
            return ""
        self._window.extend(new_token_ids)
        text = self._decode(self._window)
        num_held = len(self._window) - self._read_offset
        if (len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR)) \
                and num_held < MAX_HELD_TOKENS:
            return ""
        return self._emit(text)

    def flush(self) -> str:
        """Whatever is still held (the sequence ended): invalid trailing bytes come out as U+FFFD."""
        if self._read_offset == len(self._window):
            return ""
        return self._emit(self._decode(self._window))

    def _emit(self, text: str) -> str:
        if not text.startswith(self._prefix_text):  # ByteFallback rewrote shown text (module docstring)
            del self._window[:self._read_offset]
            self._read_offset, self._prefix_text = 0, ""
            text = self._decode(self._window)
        delta = text[len(self._prefix_text):]
        # Slide: the tokens just emitted become the prefix of the next window.
        del self._window[:self._read_offset]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta


class StreamDetokenizer:
    """DecodeStream plus flush() and the MAX_HELD_TOKENS bound; the deltas plus flush() equal what
    IncrementalDetokenizer gives (the whole decode, for byte-level BPE).

    held: the tokens stepped since the latest text came out (DecodeStream is holding their bytes);
    context: the tokens that made the latest text (what a flush decodes the held tokens after).
    """

    def __init__(self, backend: tokenizers.Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        tail = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        if tail and self._decode(tail).endswith(REPLACEMENT_CHAR):
            tail = []  # the prompt ends inside a character: output bytes could complete it (as IncrementalDetokenizer)
        self._stream = DecodeStream(tail, skip_special_tokens=skip_special_tokens)
        self._context = tail
        self._held: list[int] = []
        # byte-level BPE: a token's text is its bytes, so a run of tokens whose bytes are whole characters decodes
        # at once to what stepping them gives (push_many)
        self._byte_level = isinstance(backend.decoder, ByteLevel)

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Text finished by these tokens (often "", when they end inside a character)."""
        if len(new_token_ids) > 1 and self._byte_level and not self._held:
            text = self._decode(list(new_token_ids))
            if REPLACEMENT_CHAR not in text:
                # Nothing held: the text so far ends on a character boundary, and these tokens' bytes are whole
                # valid characters, so stepping them one by one would emit exactly this. The stream goes on after
                # them as it would after stepping them (their tail as its context).
                self._context = list(new_token_ids[-NUM_CONTEXT_TOKENS:])
                self._stream = DecodeStream(self._context, skip_special_tokens=self._skip_special_tokens)
                return text
        out = ""
        for token_id in new_token_ids:
            text = self._step(token_id)
            held = self._held
            if text is None:
                held.append(token_id)
                if len(held) >= MAX_HELD_TOKENS:
                    out += self._release()
                continue
            if held:
                held.append(token_id)
                self._context, self._held = held, []
            else:
                self._context = [token_id]
            out += text
        return out

    def _step(self, token_id: int) -> str | None:
        """DecodeStream's step; where ByteFallback rewrote shown text (module docstring), the held tokens and this
        one as their own text, and the stream goes on after them."""
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as exc:  # the tokenizers library raises a plain Exception
            if not str(exc).startswith(INVALID_PREFIX):
                raise
        token_ids = [*self._held, token_id]
        self._stream = DecodeStream(token_ids[-NUM_CONTEXT_TOKENS:], skip_special_tokens=self._skip_special_tokens)
        return self._decode(token_ids)

    def flush(self) -> str:
        """Whatever is still held (the sequence ended): invalid trailing bytes come out as U+FFFD."""
        return self._release() if self._held else ""

    def _release(self) -> str:
        """The held tokens' text after the context's, whatever it ends with; the stream starts over after it."""
        context = self._context[-NUM_CONTEXT_TOKENS:]
        context_text, text = self._decode(context), self._decode(context + self._held)
        text = text[len(context_text):] if text.startswith(context_text) else self._decode(self._held)
        # No context for what follows: the released tokens may end inside a character that no later byte may
        # complete without changing text already shown.
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        self._context, self._held = [], []
        return text


def new_detokenizer(tokenizer: Decoder, prompt_token_ids: Sequence[int],
                    skip_special_tokens: bool = True) -> StreamDetokenizer | IncrementalDetokenizer:
    """The stream decoder when the tokenizer has a Rust backend, else the Python one."""
    backend = getattr(tokenizer, "backend", None)
    if isinstance(backend, tokenizers.Tokenizer):
        return StreamDetokenizer(backend, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
