"""Results of the offline API, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n completions."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    # per generated token: {token id: logprob} for the sampled token plus the top-k asked for
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop_token_ids id that ended it, else None
    score: float | None = None  # beam search: cumulative_logprob / len(token_ids) ** length_penalty, its rank

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # prompt_logprobs: per prompt token, None for the first, then {token id: logprob} for it plus the top k
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)


@dataclass(slots=True)
class StreamDelta:
    """What one step added to one completion (for streaming)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
