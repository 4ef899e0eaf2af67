"""The request inspector: this api process's requests in flight and its last N finished ones, each with its
timeline, so that a slow request explains itself.

The api knows arrival, tokenized (Accepted), first token and the end; the scheduler's RequestTrace (carried by
its stats, console on only) adds queued, scheduled, preemptions and re-admissions. Times are kept as wall
clock (time.time(), both hosts' clocks) and shown as milliseconds after arrival. No prompt text unless
`--console-show-prompts`. Bounded: at most `max_finished` finished records, and the open ones are the
requests in flight (bounded by --max-inflight-requests).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pagoda.shared.messages import FinishReason, GenerateRequest, RequestTrace

MAX_PROMPT_CHARS = 4000  # prompt text shown per request (--console-show-prompts)


@dataclass(slots=True)
class RequestRecord:
    request_id: str  # the response id the client sees
    route: str  # chat | completion
    wire_ids: list[str]  # one per prompt (the scheduler's request ids)
    arrived_at: float  # time.time() at HTTP arrival
    started_mono: float  # time.monotonic() at HTTP arrival (the api's own intervals)
    stream: bool
    n: int
    max_tokens: int | None
    constraint: str  # "" or the structured-output kind
    prompt: str | None = None  # only with --console-show-prompts
    tokenized_mono: float | None = None
    first_token_mono: float | None = None
    finished_mono: float | None = None
    status: str = "running"  # running | ok | error | aborted
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    traces: dict[str, RequestTrace] = field(default_factory=dict)  # by wire id

    def to_dict(self) -> dict[str, Any]:
        def since(mono: float | None) -> float | None:
            return None if mono is None else round(1000.0 * (mono - self.started_mono), 2)

        out: dict[str, Any] = {
            "id": self.request_id, "route": self.route, "status": self.status, "error": self.error,
            "arrived_at": self.arrived_at, "stream": self.stream, "n": self.n, "max_tokens": self.max_tokens,
            "constraint": self.constraint, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
            "finish_reasons": self.finish_reasons, "num_prompts": len(self.wire_ids),
            "timeline": self.timeline(since)}
        if self.prompt is not None:
            out["prompt"] = self.prompt
        return out

    def timeline(self, since: Any) -> list[dict[str, Any]]:
        """Events in time order, each {"event", "ms"} after arrival (the scheduler's from its first prompt)."""
        events: list[tuple[str, float | None]] = [("arrived", 0.0), ("tokenized", since(self.tokenized_mono))]
        trace = self.traces.get(self.wire_ids[0]) if self.wire_ids else None
        if trace is not None:
            wall = self._wall_ms
            events.append(("queued", wall(trace.queued_at)))
            if trace.scheduled_at:
                events.append(("scheduled", wall(trace.scheduled_at)))
            events += [("preempted", wall(t)) for t in trace.preempted_at]
            events += [("rescheduled", wall(t)) for t in trace.rescheduled_at]
        events += [("first token", since(self.first_token_mono)), ("finished", since(self.finished_mono))]
        known = [{"event": name, "ms": ms} for name, ms in events if ms is not None]
        return sorted(known, key=lambda e: e["ms"])

    def _wall_ms(self, wall: float) -> float:
        return round(1000.0 * (wall - self.arrived_at), 2)

    @property
    def num_preemptions(self) -> int:
        return sum(t.num_preemptions for t in self.traces.values())


class RequestLog:
    """Records by response id: the open ones, then the finished ones (oldest dropped past `max_finished`)."""

    def __init__(self, max_finished: int, show_prompts: bool) -> None:
        assert max_finished >= 1
        self.max_finished = max_finished
        self.show_prompts = show_prompts
        self.open: dict[str, RequestRecord] = {}
        self.finished: OrderedDict[str, RequestRecord] = OrderedDict()
        self._by_wire: dict[str, RequestRecord] = {}  # every kept record's wire ids (traces join on them)
        self.num_started = 0

    def start(self, route: str, messages: list[GenerateRequest], stream: bool, started_mono: float) -> RequestRecord:
        first = messages[0]
        params = first.params
        constraint = params.structured_outputs.kind if params.structured_outputs is not None else ""
        render = first.render
        request_id = render.response_id if render is not None else first.request_id
        now_mono = time.monotonic()
        record = RequestRecord(
            request_id=request_id, route=route, wire_ids=[m.request_id for m in messages],
            arrived_at=time.time() - (now_mono - started_mono), started_mono=started_mono, stream=stream,
            n=params.n, max_tokens=params.max_tokens, constraint=constraint,
            prompt=_prompt_text(messages) if self.show_prompts else None)
        if first.tools:
            record.constraint = (record.constraint + " tools").strip()
        self.open[first.request_id] = record  # keyed by the engine's id: a client's request_id may repeat
        for wire_id in record.wire_ids:
            self._by_wire[wire_id] = record
        self.num_started += 1
        return record

    def finish(self, record: RequestRecord, *, finished: bool, error: str, tokenized_mono: float | None,
               first_token_mono: float | None, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               finish_reasons: list[int]) -> None:
        """The response ended: `finished` when every completion ran to its end."""
        record.finished_mono = time.monotonic()
        record.tokenized_mono = tokenized_mono
        record.first_token_mono = first_token_mono
        record.status = "error" if error else ("ok" if finished else "aborted")
        record.error = error or ("" if finished else "the client left before the end")
        record.prompt_tokens, record.completion_tokens = prompt_tokens, completion_tokens
        record.cached_tokens = cached_tokens
        record.finish_reasons = [FinishReason(r).openai_name for r in finish_reasons
                                 if r in FinishReason._value2member_map_]
        self.open.pop(record.wire_ids[0], None)
        self.finished[record.wire_ids[0]] = record
        while len(self.finished) > self.max_finished:
            _, old = self.finished.popitem(last=False)
            for wire_id in old.wire_ids:
                if self._by_wire.get(wire_id) is old:
                    del self._by_wire[wire_id]

    def on_traces(self, traces: list[RequestTrace]) -> None:
        """The scheduler's view of requests that ended; traces of other api processes' requests are ignored."""
        for trace in traces:
            record = self._by_wire.get(trace.request_id)
            if record is not None:
                record.traces[trace.request_id] = trace

    def to_list(self) -> list[dict[str, Any]]:
        """Newest first: in flight, then finished."""
        records = list(self.open.values())[::-1] + list(self.finished.values())[::-1]
        return [r.to_dict() for r in records]


def _prompt_text(messages: list[GenerateRequest]) -> str:
    parts = []
    for message in messages:
        if message.messages is not None:
            parts += [f"{m.role}: {m.content}" for m in message.messages]
        elif message.prompt_text is not None:
            parts.append(message.prompt_text)
        elif message.prompt_token_ids is not None:
            parts.append(f"[{len(message.prompt_token_ids)} token ids]")
    text = "\n".join(parts)
    return text if len(text) <= MAX_PROMPT_CHARS else text[:MAX_PROMPT_CHARS] + " ..."
