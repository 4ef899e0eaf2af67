"""One HTTP generation request in flight: its tokenizer replies folded into choices, usage and latencies."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pagoda.services.api.errors import RequestTimeoutError, UpstreamError
from pagoda.services.api.metrics import ApiMetrics
from pagoda.services.api.pool import Reply, Ticket
from pagoda.shared.messages import Accepted, FinishReason, PositionLogprobs, RequestFailed, TextDelta

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Choice:
    """One completion of the response: choice index = prompt index * n + completion index."""

    index: int
    texts: list[str] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # filled when the deltas carry them (return_token_ids)
    finish_reason: int = -1  # a FinishReason once it ends
    last_token_at: float = 0.0  # time.monotonic() of its latest tokens, for inter-token latency

    @property
    def text(self) -> str:
        return "".join(self.texts)


class Generation:
    """Folds a ticket's replies into choices; raises UpstreamError for any failure the client must see."""

    def __init__(self, ticket: Ticket, n: int, started_at: float, metrics: ApiMetrics,
                 deadline: float | None = None) -> None:
        self.ticket = ticket
        self.deadline = deadline  # time.monotonic() past which the request ends with 408 (--request-timeout)
        self.n = n
        self.started_at = started_at  # time.monotonic() at HTTP arrival
        self._metrics = metrics
        num_prompts = len(ticket.request_ids)
        self._prompt_index = {request_id: i for i, request_id in enumerate(ticket.request_ids)}
        self.choices = [Choice(i) for i in range(num_prompts * n)]
        self.num_prompt_tokens = [0] * num_prompts
        self.num_cached_tokens = [0] * num_prompts
        self.prompt_texts: list[str] = [""] * num_prompts
        self.prompt_token_ids: list[list[int]] = [[] for _ in range(num_prompts)]  # return_token_ids
        self.prompt_logprobs: list[list[PositionLogprobs]] = [[] for _ in range(num_prompts)]  # echo + logprobs
        self._num_running = [n] * num_prompts  # unfinished completions per prompt
        self._failed: set[int] = set()  # prompts the tokenizer already ended with RequestFailed
        self._early: deque[Reply] = deque()  # replies taken off the queue, not handled yet
        self.first_token_at: float | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason >= 0 for c in self.choices)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.num_prompt_tokens)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        return sum(self.num_cached_tokens)

    def unfinished_request_ids(self) -> list[str]:
        """Wire ids the tokenizer still runs: these get an AbortRequest if the response ends early."""
        return [rid for i, rid in enumerate(self.ticket.request_ids)
                if self._num_running[i] > 0 and i not in self._failed]

    async def accept(self) -> None:
        """Wait until every prompt is tokenized and admitted; the first refusal becomes the response."""
        pending = set(self.ticket.request_ids)
        while pending:
            reply = await self._get()
            if isinstance(reply, Accepted) and reply.request_id in pending:
                i = self._prompt_index[reply.request_id]
                self.num_prompt_tokens[i] = reply.num_prompt_tokens
                self.prompt_texts[i] = reply.prompt_text or ""
                self.prompt_token_ids[i] = reply.prompt_token_ids
                pending.discard(reply.request_id)
            elif isinstance(reply, list):
                self._early.append(reply)
            else:
                self._raise_if_failed(reply)

    async def next_batch(self) -> list[tuple[Choice, TextDelta]]:
        """The deltas of this request that arrived by the time it woke, already applied to the choices: one
        wake-up (and one write) takes everything queued, not one scheduler step at a time."""
        while True:
            reply = self._early.popleft() if self._early else await self._get()
            if isinstance(reply, list):
                return self._apply(self._take_queued(reply))
            self._raise_if_failed(reply)

    def _take_queued(self, deltas: list[TextDelta]) -> list[TextDelta]:
        """`deltas` plus every batch queued behind them, up to the first reply of another kind."""
        more: list[TextDelta] | None = None
        while self._early and isinstance(self._early[0], list):
            more = more if more is not None else list(deltas)
            more.extend(self._early.popleft())
        queue = self.ticket.queue
        while not self._early and not queue.empty():
            reply = queue.get_nowait()
            if not isinstance(reply, list):
                self._early.append(reply)  # a failure is raised after the deltas before it are shown
                break
            more = more if more is not None else list(deltas)
            more.extend(reply)
        return more if more is not None else deltas

    async def _get(self) -> Reply:
        if self.deadline is None:
            return await self.ticket.queue.get()
        try:
            return await asyncio.wait_for(self.ticket.queue.get(), max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            # The handler's finally aborts what still runs: the scheduler frees its blocks.
            raise RequestTimeoutError(f"the request did not finish within {self.deadline - self.started_at:g} s "
                                      "(--request-timeout)", code="request_timeout") from None

    def _raise_if_failed(self, reply: Reply) -> None:
        if isinstance(reply, RequestFailed):
            i = self._prompt_index.get(reply.request_id)
            if i is not None:
                self._failed.add(i)
            raise UpstreamError.from_failed(reply)
        log.warning("ignored an unexpected %s for %s", type(reply).__name__, self.ticket.request_ids[0])

    def _apply(self, deltas: list[TextDelta]) -> list[tuple[Choice, TextDelta]]:
        now = time.monotonic()
        applied = []
        for delta in deltas:
            i = self._prompt_index.get(delta.request_id)
            if i is None or not 0 <= delta.index < self.n:
                log.warning("ignored a delta for %s completion %d", delta.request_id, delta.index)
                continue
            choice = self.choices[i * self.n + delta.index]
            if choice.finish_reason >= 0:
                continue  # a late duplicate after the end
            self._observe(choice, delta.num_new_tokens, now)
            choice.texts.append(delta.text)
            choice.logprobs.extend(delta.logprobs)
            choice.token_ids.extend(delta.token_ids)
            self.prompt_logprobs[i].extend(delta.prompt_logprobs)
            choice.num_tokens += delta.num_new_tokens
            self.num_cached_tokens[i] = max(self.num_cached_tokens[i], delta.num_cached_tokens)
            if delta.finish_reason >= 0:
                choice.finish_reason = delta.finish_reason
                self._num_running[i] -= 1
                _raise_if_abnormal(delta)
            applied.append((choice, delta))
        return applied

    def _observe(self, choice: Choice, num_new_tokens: int, now: float) -> None:
        if num_new_tokens <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
            self._metrics.ttft.observe(now - self.started_at)
        elif choice.last_token_at > 0.0:
            # One observation per delta, spread over its tokens (a delta is one token in steady decode).
            self._metrics.itl.observe((now - choice.last_token_at) / num_new_tokens)
        choice.last_token_at = now


def _raise_if_abnormal(delta: TextDelta) -> None:
    if delta.finish_reason == FinishReason.ABORT:
        raise UpstreamError(503, "the request was aborted by the server", "server_error")
    if delta.finish_reason == FinishReason.ERROR:
        raise UpstreamError(500, "the request failed inside the engine", "server_error")
    if delta.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
        raise UpstreamError(500, f"unknown finish reason {delta.finish_reason}", "server_error")
