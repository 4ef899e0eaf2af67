"""Outputs: token ids become text. `advance` is the one output step shared by the offline engine and the tokenizer
service (a completion's new token, or none, and the scheduler's finish reason become the text it gained and its
final finish reason); `Outputs` is the tokenizer service's side: a step's TokenDeltas become TextDeltas, or bytes
rendered by the protocol package (RenderedRows), per api; a request under a stream interval (vLLM's stream_interval)
has its deltas held back and merged before either (pacing.py), so that both honour it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagoda.services.protocol.render import PromptRenderer
from pagoda.services.tokenizer.detokenizer import REPLACEMENT_CHAR
from pagoda.services.tokenizer.logprob_text import RecentIds, prompt_context, shown_token_text
from pagoda.services.tokenizer.pacing import Pacer
from pagoda.services.tokenizer.text_stream import TextStream
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.messages import (
    FinishReason,
    GenerateRequest,
    PositionLogprobs,
    PromptScores,
    RenderedRows,
    SamplingParams,
    StopSequence,
    TextDelta,
    TextDeltas,
    TokenDeltas,
    TokenLogprob,
)

log = logging.getLogger(__name__)

RUNNING = -1  # the finish reason of a completion that goes on
REPETITION_DETECTED = "repetition_detected"  # vLLM's stop_reason where repetition_detection ended a completion


@dataclass(slots=True)
class TextStep:
    text: str  # text safe to show now (held back while a character or a possible stop string is incomplete)
    finish_reason: int  # a FinishReason, or RUNNING
    stop_string: bool  # a stop string ended it here: the scheduler, which cannot see text, must be told


def advance(stream: TextStream, token_id: int, finish_reason: int) -> TextStep:
    """Push one step's token (-1: none) into `stream`; on a finish, release what it held back.

    A stop token's own text (EOS, stop_token_ids: finish STOP with a token) is not part of the output unless the
    request includes stop strings in it (vLLM's include_stop_str_in_output); its id and logprob are, either way.
    A stop string that matches turns a running completion into STOP; one that completes only in the text
    held back until the end turns LENGTH into STOP too.
    """
    text = stream.push((token_id,) if token_id >= 0 and not hides_stop_token(stream, token_id, finish_reason) else ())
    reason = finish_reason
    stop_string = False
    if reason < 0 and stream.stopped:
        reason = FinishReason.STOP
        stop_string = True
    if reason >= 0:
        text += stream.close()
        if stream.stopped:  # a stop string completed in the text held back until now
            reason = FinishReason.STOP
    return TextStep(text, int(reason), stop_string)


def stop_reason(stream: TextStream, params: SamplingParams, token_id: int, finish_reason: int,
                tokenizer: Tokenizer | None) -> str | int | None:
    """vLLM's stop_reason of a completion that ends with this token: the stop string that matched, else the id
    of params' stop_token_ids it sampled; None for EOS (listed among the stop ids too, unless EOS is ignored, as
    vLLM checks EOS first), length, or while it runs; vLLM's "repetition_detected" where repetition_detection
    ended it. Per token: the tokenizer is asked only at such a stop."""
    if stream.stop_reason is not None:
        return stream.stop_reason
    if finish_reason == FinishReason.REPETITION:
        return REPETITION_DETECTED
    if finish_reason != FinishReason.STOP or token_id not in params.stop_token_ids:
        return None
    is_eos = tokenizer is not None and token_id == tokenizer.eos_token_id
    return None if is_eos and not params.ignore_eos else token_id


def hides_stop_token(stream: TextStream, token_id: int, finish_reason: int) -> bool:
    """Whether this step's token is a stop token whose text the output leaves out. Its id and logprob stay, as
    vLLM's (its detokenizer skips only the text), so that token_ids, logprobs and usage count the same tokens."""
    return finish_reason == FinishReason.STOP and token_id >= 0 and not stream.include_stop_token


@dataclass(slots=True)
class RequestState:
    api: int  # index of the owning api's socket
    params: SamplingParams
    streams: list[TextStream | None]  # one per completion; None once that completion finished
    num_unfinished: int
    first_prompt_token: int = -1  # prompt_logprobs: listed first (no logprob) with completion 0's first delta
    return_token_ids: bool = False  # deltas carry their token ids (asked for, or no tokenizer to make text)
    renderer: PromptRenderer | None = None  # the api asked for bytes (RenderedRows), not TextDeltas
    forced: list[int] = field(default_factory=list)  # a grammar's forced start: shown with completion 0's first token
    pacer: Pacer | None = None  # a stream interval above 1: the completions' deltas held back and merged
    # logprobs: each completion's last tokens, and the prompt's, which a token's shown string may need (logprob_text)
    recent_ids: list[RecentIds] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)


def stream_interval(params: SamplingParams, server_interval: int) -> int:
    """vLLM's rule: a request's stream_interval raises the server's --stream-interval, never lowers it."""
    return max(params.stream_interval or 1, server_interval)


@dataclass(slots=True)
class OutputBatch:
    """What one step's TokenDeltas make: messages per api, stop strings for the scheduler, requests that failed."""

    to_apis: dict[int, list[TextDeltas | RenderedRows]] = field(default_factory=dict)
    stops: list[StopSequence] = field(default_factory=list)
    failed: list[tuple[int, str]] = field(default_factory=list)  # (api, request id): an internal error


class Outputs:
    """The requests in flight here and their completions' text: token ids in, text or rendered bytes out."""

    def __init__(self, tokenizer: Tokenizer | None, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval  # the server's --stream-interval
        self.requests: dict[str, RequestState] = {}
        self._token_texts: dict[int, tuple[str, list[int]]] = {}  # token id -> (its string, its bytes)

    def add(self, api: int, request: GenerateRequest, params: SamplingParams, prompt_token_ids: list[int],
            echo: str | None, forced: list[int] | None = None, prompt_reasoning: str = "") -> RequestState:
        """A request admitted here: its completions' text streams, and its renderer when the api takes bytes
        (`prompt_reasoning`: where a chat prompt left the think block, for the reasoning parser)."""
        streams: list[TextStream | None] = [TextStream(self.tokenizer, prompt_token_ids, params)
                                            for _ in range(params.n)]
        first_token = prompt_token_ids[0] if params.prompt_logprobs is not None else -1
        renderer = (PromptRenderer(request.render, params.n, echo or "", prompt_token_ids, prompt_reasoning)
                    if request.render is not None else None)
        interval = stream_interval(params, self.stream_interval)
        state = self.requests[request.request_id] = RequestState(
            api, params, streams, params.n, first_token, request.return_token_ids or self.tokenizer is None, renderer,
            list(forced or ()), Pacer(interval, params.n) if interval > 1 else None)
        assert not state.forced or params.n == 1, "a forced start is for one completion"
        if params.logprobs is not None:
            state.recent_ids = [RecentIds(state.forced if i == 0 else ()) for i in range(params.n)]
        if params.prompt_logprobs is not None:
            state.prompt_token_ids = prompt_token_ids
        return state

    def on_token_deltas(self, message: TokenDeltas) -> OutputBatch:
        """One step's columns in, one TextDeltas and/or RenderedRows per api out (up to max_num_seqs rows)."""
        batch = OutputBatch()
        if not message.columns_agree():
            log.error("dropped a TokenDeltas frame whose columns disagree (%d rows)", len(message))
            return batch
        sends = _Sends()
        lp_at = {row: i for i, row in enumerate(message.logprob_rows)} if message.logprob_rows else None
        scores_at = dict(zip(message.prompt_score_rows, message.prompt_scores, strict=True)) \
            if message.prompt_scores else None
        for row, (request_id, index, token_id, reason) in enumerate(zip(
                message.request_ids, message.indices, message.token_ids, message.finish_reasons, strict=True)):
            state = self.requests.get(request_id)
            if state is None:
                continue  # aborted or failed here: these tokens were already on their way
            try:
                delta = self._text_delta(state, request_id, index, token_id, reason, message.num_cached_tokens[row],
                                         self._row_logprobs(message, lp_at, row, token_id, state, index)
                                         if lp_at else None,
                                         scores_at.get(row) if scores_at is not None else None, batch)
                if delta is None:
                    continue
                if state.pacer is None:
                    sends.add(state, delta)
                else:
                    for paced in state.pacer.pace(delta):
                        sends.add(state, paced)
            except Exception:
                log.exception("failed on the tokens of %s", request_id)
                batch.failed.append((state.api, request_id))
        sends.into(batch)
        return batch

    def flush(self, request_id: str) -> OutputBatch:
        """A request about to fail (the scheduler failed it or went away, the server stops): what its completions
        hold back under a stream interval, to be sent before the failure, as without an interval it would have
        been. Empty for a request that holds nothing, or is not here. A request aborted by its client (gone) is
        dropped without this: nobody would read it."""
        batch = OutputBatch()
        state = self.requests.get(request_id)
        if state is None or state.pacer is None:
            return batch
        sends = _Sends()
        try:
            for delta in state.pacer.flush():
                sends.add(state, delta)
        except Exception:  # a renderer's bug: the failure still goes out, alone
            log.exception("failed on the held output of %s", request_id)
            return batch
        sends.into(batch)
        return batch

    def _row_logprobs(self, message: TokenDeltas, lp_at: dict[int, int] | None, row: int, token_id: int,
                      state: RequestState, index: int) -> PositionLogprobs | None:
        if lp_at is None or token_id < 0:
            return None
        i = lp_at.get(row)
        if i is None:
            return None
        recent = state.recent_ids[index] if 0 <= index < len(state.recent_ids) else RecentIds()
        context = recent.ids  # the tokens before this position: read before this one joins them
        top = [self.token_logprob(t, lp, context=context)
               for t, lp in zip(message.top_token_ids[i], message.top_logprobs[i], strict=False)]
        position = PositionLogprobs(self.token_logprob(token_id, message.logprobs[i], context=context), top)
        recent.add(token_id)
        return position

    def _text_delta(self, state: RequestState, request_id: str, index: int, token_id: int, reason: int,
                    num_cached_tokens: int, logprob: PositionLogprobs | None, scores: PromptScores | None,
                    batch: OutputBatch) -> TextDelta | None:
        """The text one completion gained; finishes it (and tells the scheduler) on a stop string."""
        if not 0 <= index < len(state.streams):
            log.warning("dropped tokens for completion %d of %s (n=%d)", index, request_id, len(state.streams))
            return None
        stream = state.streams[index]
        if stream is None:
            return None  # a stop string finished it here; tokens sampled before the scheduler knew are dropped
        prompt_logprobs = self._prompt_logprobs(state, index, scores) \
            if scores is not None or state.first_prompt_token >= 0 else []
        if token_id < 0 and reason < 0:
            return TextDelta(request_id, index, "", 0, prompt_logprobs=prompt_logprobs) if prompt_logprobs else None
        token_ids = [token_id] if token_id >= 0 else []
        forced_text = ""
        if state.forced and index == 0:  # the grammar's forced start, computed with the prompt: shown first
            forced, state.forced = state.forced, []
            forced_text = stream.push(forced)
            token_ids = forced + token_ids
        step = advance(stream, token_id, reason)
        if forced_text:
            step.text = forced_text + step.text
        if step.stop_string:
            batch.stops.append(StopSequence(request_id, index))
        if step.finish_reason >= 0:
            self._finish_completion(state, request_id, index)
        logprobs = [logprob] if logprob is not None and state.params.logprobs is not None else []
        shown_ids = token_ids if state.return_token_ids else []
        return TextDelta(request_id, index, step.text, len(token_ids), step.finish_reason, logprobs,
                         num_cached_tokens, stop_reason(stream, state.params, token_id, step.finish_reason,
                                                        self.tokenizer), prompt_logprobs, shown_ids)

    def _finish_completion(self, state: RequestState, request_id: str, index: int) -> None:
        state.streams[index] = None
        state.num_unfinished -= 1
        if state.num_unfinished == 0:
            del self.requests[request_id]

    def _prompt_logprobs(self, state: RequestState, index: int, scores: PromptScores | None) -> list[PositionLogprobs]:
        """Scored prompt tokens. The prompt's first token, which nothing scores, leads completion 0's first
        delta (scores come before or with a completion's first token; a 1-token prompt has none)."""
        lead = []
        if state.first_prompt_token >= 0 and index == 0:
            lead = [PositionLogprobs(self.token_logprob(state.first_prompt_token, None), [])]
            state.first_prompt_token = -1
        if scores is None:
            return lead
        ranks = scores.ranks or [0] * len(scores.token_ids)
        positions = []
        for k, (token_id, logprob, top_ids, top_lps, rank) in enumerate(zip(
                scores.token_ids, scores.logprobs, scores.top_token_ids, scores.top_logprobs, ranks, strict=False)):
            context = prompt_context(state.prompt_token_ids, scores.first + k)
            positions.append(PositionLogprobs(
                self.token_logprob(token_id, logprob, rank, context),
                [self.token_logprob(t, lp, context=context) for t, lp in zip(top_ids, top_lps, strict=False)]))
        return lead + positions

    def token_logprob(self, token_id: int, logprob: float | None, rank: int = 0,
                      context: Sequence[int] | None = None) -> TokenLogprob:
        """A logprob entry. Its string is the token's own decode; with `context` (the sequence's tokens before its
        position: a scored position's entries), a token that holds part of a UTF-8 character shows what vLLM
        shows (logprob_text): "" for a leading piece, the character on the token that completes it. Its bytes
        stay the token's own."""
        token, raw = self._token_text(token_id)
        if context is not None and self.tokenizer is not None and token.endswith(REPLACEMENT_CHAR):
            token = shown_token_text(token_id, token, context, self._decode, self._own_text)
        return TokenLogprob(token, token_id, logprob, raw, rank)

    def _own_text(self, token_id: int) -> str:
        return self._token_text(token_id)[0]

    def _token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A token's own decode and bytes, cached."""
        cached = self._token_texts.get(token_id)
        if cached is None:
            if self.tokenizer is not None:
                token = self.tokenizer.decode([token_id], skip_special_tokens=False)
                raw = self.tokenizer.token_bytes(token_id)
            else:
                token = f"token_id:{token_id}"
                raw = token.encode("utf-8")
            cached = self._token_texts[token_id] = (token, list(raw))
        return cached

    def _decode(self, token_ids: list[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)


@dataclass(slots=True)
class _Sends:
    """The deltas one frame (or a flush) sends, grouped by api: as text (TextDeltas), or rendered (RenderedRows)."""

    texts: dict[int, list[TextDelta]] = field(default_factory=dict)  # requests that take text, by api
    rendered: dict[int, list[tuple[TextDelta, bytes]]] = field(default_factory=dict)  # requests that take bytes

    def add(self, state: RequestState, delta: TextDelta) -> None:
        if state.renderer is not None:
            self.rendered.setdefault(state.api, []).append((delta, state.renderer.render(delta)))
        else:
            self.texts.setdefault(state.api, []).append(delta)

    def into(self, batch: OutputBatch) -> None:
        for api, rows in self.rendered.items():
            batch.to_apis.setdefault(api, []).append(RenderedRows(
                [d.request_id for d, _ in rows], [d.index for d, _ in rows], [d.num_new_tokens for d, _ in rows],
                [d.finish_reason for d, _ in rows], [d.num_cached_tokens for d, _ in rows], [data for _, data in rows]))
        for api, deltas in self.texts.items():
            batch.to_apis.setdefault(api, []).append(TextDeltas(deltas))
