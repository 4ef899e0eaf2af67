"""vLLM's bad_words as token sequences: each word tokenized as given and after a space, as vLLM tokenizes them."""

from __future__ import annotations

from typing import Any

import msgspec

from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import MAX_BAD_WORD_TOKENS, SamplingParams


def bad_words_token_ids(words: list[str], tokenizer: Any) -> list[list[int]]:
    """vLLM's SamplingParams.update_from_tokenizer: each word without its leading whitespace, tokenized alone (a
    word at the start of the text) and after a space (inside it); the spaced spelling counts only where it
    tokenizes to as many tokens as the bare one with a different first token (a tokenizer that adds no prefix
    space, as SmolLM2's byte-level BPE: " no" is a token of its own). InvalidRequestError names bad_words for a
    word that tokenizes to nothing or to more than MAX_BAD_WORD_TOKENS tokens."""
    sequences: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not 1 <= len(bare) <= MAX_BAD_WORD_TOKENS:
            raise InvalidRequestError(f"bad word {word!r} is {len(bare)} tokens; a bad word must be 1 to "
                                      f"{MAX_BAD_WORD_TOKENS} tokens", param="bad_words")
        sequences.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            sequences.append(spaced)
    return sequences


def with_bad_words_token_ids(params: SamplingParams, tokenizer: Any | None) -> SamplingParams:
    """params with bad_words_token_ids made from bad_words (replacing any given); unchanged without bad words."""
    if not params.bad_words:
        return params if not params.bad_words_token_ids else msgspec.structs.replace(params, bad_words_token_ids=[])
    if tokenizer is None:
        raise InvalidRequestError("bad_words need the model's tokenizer, and this model has none", param="bad_words")
    return msgspec.structs.replace(params, bad_words_token_ids=bad_words_token_ids(params.bad_words, tokenizer))
