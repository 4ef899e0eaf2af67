"""One HTTP generation request in flight: its tokenizer replies folded into choices, usage and latencies.

A tokenizer that renders (RenderedRows) sends the bytes to write: this process only counts tokens and joins the
bytes queued for the request into one write. One that sends text (TextDeltas) gets it rendered here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from pagoda.services.api.errors import RequestTimeoutError, UpstreamError
from pagoda.services.api.metrics import ApiMetrics
from pagoda.services.api.pool import Reply, Rows, Ticket
from pagoda.services.protocol.render import Choice, Renderer, usage_dict
from pagoda.shared.messages import ANSWERED, Accepted, FinishReason, PositionLogprobs, RequestFailed, TextDelta

log = logging.getLogger(__name__)


class Generation:
    """Folds a ticket's replies into choices; raises UpstreamError for any failure the client must see."""

    def __init__(self, ticket: Ticket, n: int, started_at: float, metrics: ApiMetrics, renderer: Renderer,
                 stream: bool, deadline: float | None = None) -> None:
        self.ticket = ticket
        self.renderer = renderer
        self.stream = stream
        self.deadline = deadline  # time.monotonic() past which the request ends with 408 (--request-timeout)
        self.n = n
        self.started_at = started_at  # time.monotonic() at HTTP arrival
        self._metrics = metrics
        self.vllm = metrics.vllm_series(ticket.identity)  # the vLLM-named series of the engine that runs it
        num_prompts = len(ticket.request_ids)
        self._prompt_index = {request_id: i for i, request_id in enumerate(ticket.request_ids)}
        self.choices = [Choice(i) for i in range(num_prompts * n)]
        self.num_prompt_tokens = [0] * num_prompts
        self.num_cached_tokens = [0] * num_prompts
        self.prompt_texts: list[str] = [""] * num_prompts
        self.prompt_token_ids: list[list[int]] = [[] for _ in range(num_prompts)]  # return_token_ids
        self.prompt_logprobs: list[list[PositionLogprobs]] = [[] for _ in range(num_prompts)]  # echo + logprobs
        self.openings: list[bytes] = [b""] * num_prompts  # rendered by the tokenizer (streaming)
        self._num_running = [n] * num_prompts  # unfinished completions per prompt
        self._failed: set[int] = set()  # prompts the tokenizer already ended with RequestFailed
        self.refused = False  # a prompt failed with a 4xx after it was admitted (e.g. its grammar cannot compile)
        self.failed_upstream = False  # a prompt ended in the engine's refusal or failure (RequestFailed)
        self._early: deque[Reply] = deque()  # replies taken off the queue, not handled yet
        self.first_token_at: float | None = None
        self.accepted_at: float | None = None  # time.monotonic() when every prompt was tokenized and admitted
        self.error = ""  # the error the client got, if any (the console's request inspector)
        # An abnormal end (abort, error) seen while applying output: raised once the output before it is written.
        self._failure: UpstreamError | None = None

    @property
    def finished(self) -> bool:
        return self._failure is None and all(c.finish_reason >= 0 for c in self.choices)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.num_prompt_tokens)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        return sum(self.num_cached_tokens)

    def usage(self) -> dict[str, Any]:
        return usage_dict(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def opening(self) -> bytes:
        """The SSE bytes before the first token: the tokenizer's, or rendered here for one that sends text."""
        return b"".join(self.openings) if any(self.openings) else self.renderer.opening(self)

    def closing(self) -> bytes:
        return self.renderer.closing(self.usage())

    def body(self) -> dict[str, Any]:
        return self.renderer.body(self, self.usage())

    def final_reasons(self) -> list[int]:
        """Each choice's FinishReason once the response is over: one still unfinished ended with its prompt's
        failure (ERROR) or was cut short by the client leaving or a timeout (ABORT)."""
        return [c.finish_reason if c.finish_reason >= 0
                else FinishReason.ERROR if i // self.n in self._failed else FinishReason.ABORT
                for i, c in enumerate(self.choices)]

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
                for choice in self.choices[i * self.n:(i + 1) * self.n]:
                    choice.num_prompt_tokens = reply.num_prompt_tokens
                self.prompt_texts[i] = reply.prompt_text or ""
                self.prompt_token_ids[i] = reply.prompt_token_ids
                self.openings[i] = reply.opening
                self.renderer.prompt_accepted(reply.prompt_reasoning)
                pending.discard(reply.request_id)
            elif isinstance(reply, list | Rows):
                self._early.append(reply)
            else:
                self._raise_if_failed(reply)
        self.accepted_at = time.monotonic()

    async def next_batch(self) -> bytes:
        """The output of this request that arrived by the time it woke, applied to the choices; with streaming,
        the SSE bytes to write. One wake-up (and one write) takes everything queued, not one step at a time.
        A completion that ended abnormally raises UpstreamError after the bytes before its end: at once when there
        are none, else at the next call (`finished` stays False until then)."""
        self._raise_failure()
        while True:
            reply = self._early.popleft() if self._early else await self._get()
            if isinstance(reply, list | Rows):
                data = b"".join([self._apply(batch) for batch in self._take_queued(reply)])
                if not data:
                    self._raise_failure()
                return data
            self._raise_if_failed(reply)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _take_queued(self, batch: list[TextDelta] | Rows) -> list[list[TextDelta] | Rows]:
        """`batch` plus every batch queued behind it, up to the first reply of another kind."""
        batches = [batch]
        while self._early and isinstance(self._early[0], list | Rows):
            batches.append(self._early.popleft())  # type: ignore[arg-type]
        queue = self.ticket.queue
        while not self._early and not queue.empty():
            reply = queue.get_nowait()
            if not isinstance(reply, list | Rows):
                self._early.append(reply)  # a failure is raised after the output before it is shown
                break
            batches.append(reply)
        return batches

    def _apply(self, batch: list[TextDelta] | Rows) -> bytes:
        return self._apply_rows(batch) if isinstance(batch, Rows) else self._apply_deltas(batch)

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
            self.refused = self.refused or 400 <= reply.status < 500
            self.failed_upstream = True
            raise UpstreamError.from_failed(reply)
        log.warning("ignored an unexpected %s for %s", type(reply).__name__, self.ticket.request_ids[0])

    def _choice(self, request_id: str, index: int) -> tuple[int, Choice | None]:
        """(prompt index, its running choice), or a None choice for a row to ignore (unknown, or already over)."""
        i = self._prompt_index.get(request_id)
        if i is None or not 0 <= index < self.n:
            log.warning("ignored output for %s completion %d", request_id, index)
            return -1, None
        choice = self.choices[i * self.n + index]
        return i, (choice if choice.finish_reason < 0 else None)  # finished: a late duplicate after the end

    def _end(self, i: int, choice: Choice, reason: int) -> None:
        choice.finish_reason = reason
        self._num_running[i] -= 1
        if self._failure is None:
            self._failure = _abnormal_end(reason)

    def _apply_rows(self, rows: Rows) -> bytes:
        """Rendered output: count, then keep the bytes (streaming: to write now; otherwise the choice's JSON)."""
        now = time.monotonic()
        out: list[bytes] = []
        for request_id, index, num_new_tokens, reason, num_cached_tokens, data in rows.rows:
            i, choice = self._choice(request_id, index)
            if choice is None:
                continue
            self._observe(choice, num_new_tokens, now)
            choice.num_tokens += num_new_tokens
            self._cached(i, num_cached_tokens)
            if self.stream:
                out.append(data)  # an abnormal end renders nothing (PromptRenderer.render)
            elif data:
                choice.rendered = data
            if reason >= 0:
                self._end(i, choice, reason)
        return b"".join(out)

    def _apply_deltas(self, deltas: list[TextDelta]) -> bytes:
        """Text from a tokenizer that does not render: folded into the choices and rendered here."""
        now = time.monotonic()
        applied = []
        for delta in deltas:
            i, choice = self._choice(delta.request_id, delta.index)
            if choice is None:
                continue
            self._observe(choice, delta.num_new_tokens, now)
            choice.apply(delta)
            self.prompt_logprobs[i].extend(delta.prompt_logprobs)
            self._cached(i, delta.num_cached_tokens)
            if delta.finish_reason >= 0:
                self._end(i, choice, delta.finish_reason)
                if delta.finish_reason not in ANSWERED:
                    continue  # answered with the error, as PromptRenderer.render does
            applied.append((choice, delta))
        return self.renderer.chunks(applied) if self.stream else b""

    def _cached(self, i: int, num_cached_tokens: int) -> None:
        """Prompt i's prefix-cache hits, as the scheduler counts them (at most the prompt, a grammar's forced start
        left out: Anthropic's input_tokens is the prompt less these)."""
        self.num_cached_tokens[i] = max(self.num_cached_tokens[i], num_cached_tokens)

    def _observe(self, choice: Choice, num_new_tokens: int, now: float) -> None:
        if num_new_tokens <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = now
            self._metrics.ttft.observe(now - self.started_at)
            self.vllm.ttft.observe(now - self.started_at)
        elif choice.last_token_at > 0.0:
            # The gap since the last delta, spread over its tokens: one observation per token (a delta is one token
            # in steady decode; several with --stream-interval), so the count is tokens and the sum decode time.
            self.vllm.itl.observe((now - choice.last_token_at) / num_new_tokens, now, num_new_tokens)  # both names
        choice.last_token_at = now

    def observe_e2e(self) -> None:
        """The response is complete: HTTP arrival to now, under both names."""
        e2e = time.monotonic() - self.started_at
        self._metrics.e2e.observe(e2e)
        self.vllm.e2e.observe(e2e)


def _abnormal_end(reason: int) -> UpstreamError | None:
    """The error a completion that ended for `reason` answers with; None for a normal end."""
    if reason == FinishReason.ABORT:
        return UpstreamError(503, "the request was aborted by the server", "server_error")
    if reason == FinishReason.ERROR:
        return UpstreamError(500, "the request failed inside the engine", "server_error")
    if reason not in ANSWERED:
        return UpstreamError(500, f"unknown finish reason {reason}", "server_error")
    return None
