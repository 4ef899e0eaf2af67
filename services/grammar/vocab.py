"""llguidance's tokenizer for a model: the tokenizer's tokens as bytes, as many as the model has logits, and an encoder
for the text a grammar forces that never turns text into a special token.

Why not llguidance.hf.from_tokenizer alone: llguidance tokenizes the bytes a grammar forces (its fast-forward, and the
mask of a step whose next bytes are forced) with the Hugging Face tokenizer, which matches added tokens anywhere in
text. A grammar that spells a special token as text (a regex or a JSON schema's const holding "<|im_end|>") was
forced into the special token's id, which the grammar then refused (its bytes are a special token's, not the text):
SmolLM2's <|im_end|> is also its EOS, so the answer stopped there with finish_reason "stop". Here such text is
tokenized as text, from the tokens that spell it; a special token is still reached only where a Lark grammar names it
(`<|im_end|>` unquoted, llguidance's syntax for it).

Widths: the mask has the model's width (its logits). Ids past the tokenizer's vocabulary are placeholders the mask
never allows (as llguidance pads); where the model has fewer logits than the tokenizer has tokens, the tokens past
them are left out, and forced text that the tokenizer would spell with one of them is spelled with the others.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.hf


class TextEncoder:
    """llguidance's tokenizer protocol (what llguidance.TokenizerWrapper wraps): each token's bytes, the special
    token ids, EOS, and a call that tokenizes forced text. The call must not raise (llguidance's Rust side panics)."""

    def __init__(self, base: llguidance.LLTokenizer, vocab_size: int, eos_token_id: int) -> None:
        assert 0 <= eos_token_id < vocab_size, (eos_token_id, vocab_size)
        self._base = base
        self._num_tokens = min(base.vocab_size, vocab_size)  # the tokenizer's ids the model has a logit for
        special = [base.is_special_token(i) for i in range(self._num_tokens)]
        # special tokens' bytes without llguidance's marker byte: TokenizerWrapper adds it to special_token_ids
        self.tokens: list[bytes] = [base.decode_bytes([i]) for i in range(self._num_tokens)]
        self.tokens += [f"<[{i}]>".encode() for i in range(self._num_tokens, vocab_size)]  # placeholders
        self.special_token_ids: list[int] = [i for i, s in enumerate(special) if s]
        self.special_token_ids += list(range(self._num_tokens, vocab_size))
        self.eos_token_id = eos_token_id
        self.bos_token_id: int | None = None
        self._special = special
        texts = sorted({base.decode_str([i]) for i in range(base.vocab_size) if base.is_special_token(i)} - {""},
                       key=len, reverse=True)  # longest first: the regex takes the first alternative that matches
        self._special_text = re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None
        # the finished tokenizer's greedy tokenization (its trie: the model's ids, special tokens only by marker)
        self.greedy: Callable[[str], list[int]] = base.greedy_tokenize

    def __call__(self, text: str | bytes) -> list[int]:
        """The token ids of forced text: the tokenizer's own, except that text spelling a special token, and a piece
        the tokenizer would spell with an id past the model's logits, are tokenized greedily from the ordinary
        tokens."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")  # llguidance passes valid UTF-8 only
        pieces = self._special_text.split(text) if self._special_text is not None else [text]
        ids: list[int] = []
        for i, piece in enumerate(pieces):  # odd pieces: the special tokens' texts (split keeps the group)
            if not piece:
                continue
            got = [] if i % 2 else self._base.tokenize_str(piece)
            if i % 2 or any(t >= self._num_tokens or self._special[t] for t in got):
                got = self.greedy(piece)
            ids += got
        return ids


def model_ll_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over a Hugging Face fast tokenizer, with masks `vocab_size` wide (the model's logits)
    and the given EOS ids that the model has (else the tokenizer's own EOS). ValueError where none is left."""
    base = llguidance.hf.from_tokenizer(hf_tokenizer)  # the tokenizer's own width: it refuses a smaller n_vocab
    eos_ids = [t for t in eos_token_ids if 0 <= t < min(base.vocab_size, vocab_size)]
    if not eos_ids and base.eos_token < vocab_size:
        eos_ids = [base.eos_token]
    if not eos_ids:
        raise ValueError(f"no end-of-sequence token id within the model's {vocab_size} logits (the tokenizer's is "
                         f"{base.eos_token}, the model's {eos_token_ids})")
    encoder = TextEncoder(base, vocab_size, eos_ids[0])
    ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(encoder), eos_token=eos_ids)
    assert ll.vocab_size == vocab_size, (ll.vocab_size, vocab_size)
    encoder.greedy = ll.greedy_tokenize  # a reference cycle, once per process: the trie without the ids left out
    return ll
