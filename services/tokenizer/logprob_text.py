"""Logprob entries' token strings for tokens that hold part of a UTF-8 character, as vLLM shows them.

A token's own decode ends in U+FFFD when its bytes end inside a character (byte-level BPE splits CJK and emoji
into such tokens; byte-fallback tokenizers spell them as <0xNN> tokens). vLLM (v1/engine/logprobs.py,
LogprobsProcessor._verify_tokens / _correct_decoded_token) shows such a token, in every logprob entry of its
position (the sampled or prompt token and each alternative alike), by decoding it after the last 1 to 4 tokens
before it in the sequence: the first window whose decode no longer ends in U+FFFD gives the text, less the decode of
the window's leading tokens that are whole (the trailing ones that end in U+FFFD were shown as "" and their
text goes to this token). No window completes it: "". So the leading pieces of a character show "" and the token
that completes it shows the whole character (with whatever else the pieces held, a leading space).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagoda.services.tokenizer.detokenizer import REPLACEMENT_CHAR

MAX_CONTEXT_TOKENS = 4  # a UTF-8 character is at most 4 bytes, so at most 4 tokens hold it


def shown_token_text(token_id: int, own_text: str, context_ids: Sequence[int],
                     decode: Callable[[list[int]], str], text_of: Callable[[int], str]) -> str:
    """The string a logprob entry shows for `token_id` (its own decode `own_text`) after `context_ids`, the
    sequence's tokens before its position (oldest first; only the last MAX_CONTEXT_TOKENS are read). `decode`
    decodes ids together, `text_of` one token alone."""
    if not own_text.endswith(REPLACEMENT_CHAR):
        return own_text
    context = list(context_ids[-MAX_CONTEXT_TOKENS:])
    for num_context in range(1, len(context) + 1):
        window = context[-num_context:]
        whole = decode([*window, token_id])
        if whole.endswith(REPLACEMENT_CHAR):
            continue  # the character starts further back (or its last bytes are still to come)
        num_whole = len(window)
        while num_whole > 0 and text_of(window[num_whole - 1]).endswith(REPLACEMENT_CHAR):
            num_whole -= 1  # a piece of this character: it showed "", its text is this token's
        before = decode(window[:num_whole]) if num_whole else ""
        return whole[_common_prefix_len(before, whole):]
    return ""


def _common_prefix_len(a: str, b: str) -> int:
    """Characters `a` and `b` share from the start (all of `a` when `b` starts with it; less only where decoding
    together normalised the text differently)."""
    if b.startswith(a):
        return len(a)
    num = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        num += 1
    return num


def prompt_context(prompt_token_ids: list[int], index: int) -> list[int]:
    """The context of the prompt token at `index` (1 or more: the first is never scored): the scored prompt
    tokens before it. vLLM reads its prompt logprobs' entries, and the first prompt token has none, so it is never
    context (a second token that completes a character the first began shows "")."""
    return prompt_token_ids[max(1, index - MAX_CONTEXT_TOKENS):index]


class RecentIds:
    """A completion's last MAX_CONTEXT_TOKENS tokens: the context of its next logprob entries (vLLM's: the tokens
    of its earlier entries; pagoda's grammar-forced start, which has none, leads them as the tokens before)."""

    __slots__ = ("ids",)

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self.ids: list[int] = list(ids[-MAX_CONTEXT_TOKENS:])

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        if len(self.ids) > MAX_CONTEXT_TOKENS:
            del self.ids[0]
