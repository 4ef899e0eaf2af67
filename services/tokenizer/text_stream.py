"""One sequence's output text as tokens arrive: incremental detokenization, then stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.services.tokenizer.detokenizer import Decoder, StreamDetokenizer, new_detokenizer
from pagoda.services.tokenizer.stop import StopChecker
from pagoda.shared.messages import SamplingParams


class TextStream:
    """push() token ids, get text safe to show; `stopped` turns true when a stop string matched."""

    def __init__(self, tokenizer: Decoder | None, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._detokenizer = (new_detokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                             if tokenizer is not None else None)
        self._stop = StopChecker(params.stop, params.include_stop_str_in_output) if params.stop else None
        self._min_tokens = params.min_tokens  # stop strings end no earlier than after this many tokens
        # vLLM's include_stop_str_in_output shows a stop token's text too (EOS, stop_token_ids)
        self.include_stop_token = params.include_stop_str_in_output
        self._num_tokens = 0
        self.text = ""
        self.stopped = False
        self._closed = False

    @property
    def batchable(self) -> bool:
        """push(a + b) gives the text of push(a) then push(b), and nothing needs the text before the end: no stop
        strings, and no detokenizer or the stream one (it steps token by token; the Python one's window is not
        split the same way). Such a stream's tokens may be pushed together, late."""
        return self._stop is None and (self._detokenizer is None or isinstance(self._detokenizer, StreamDetokenizer))

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stop.matched_stop if self._stop is not None else None

    def push(self, token_ids: Sequence[int]) -> str:
        """Text these tokens finish; "" while a character or a possible stop string is incomplete."""
        if self._detokenizer is None or self._closed:
            return ""
        self._num_tokens += len(token_ids)
        return self._accept(self._detokenizer.push(token_ids), protected=self._num_tokens <= self._min_tokens)

    def close(self) -> str:
        """The sequence ended for another reason: release what was held back."""
        if self._detokenizer is None or self._closed:
            return ""
        delta = self._accept(self._detokenizer.flush(), protected=self._num_tokens <= self._min_tokens)
        if not self.stopped and self._stop is not None:
            tail = self._stop.flush()
            self.stopped = self._stop.matched_stop is not None
            self.text += tail
            delta += tail
        self._closed = True
        return delta

    def _accept(self, text: str, protected: bool = False) -> str:
        if self._stop is not None and not self.stopped:
            text, self.stopped = self._stop.push(text, protected)
            if self.stopped:
                self._closed = True
        self.text += text
        return text


def tokens_before_stop(tokenizer: Decoder | None, prompt_token_ids: Sequence[int], params: SamplingParams,
                       token_ids: Sequence[int]) -> int:
    """How many of `token_ids`, as a completion's first tokens, complete none of params' stop strings: a grammar's
    forced start is cut there, so that the token that completes one is sampled and the completion ends with it
    (forced tokens past it would count in usage and token_ids though the text ends before them)."""
    if not params.stop:
        return len(token_ids)
    stream = TextStream(tokenizer, prompt_token_ids, params)
    for i, token_id in enumerate(token_ids):
        stream.push((token_id,))
        if stream.stopped:
            return i
    return len(token_ids)
