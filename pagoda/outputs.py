"""Results of the offline API, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class Logprob(float):
    """A token's logprob as vLLM's offline API gives it (`.logprob`, `.rank`, `.decoded_token`), and still the float
    it was before (arithmetic, comparisons, json). rank: the token's place in its distribution, 1 for the likeliest
    (None where unknown); decoded_token: its text (None for a model without a tokenizer)."""

    __slots__ = ("rank", "decoded_token")
    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        value = super().__new__(cls, logprob)
        value.rank, value.decoded_token = rank, decoded_token
        return value

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __reduce__(self) -> tuple:
        return Logprob, (float(self), self.rank, self.decoded_token)


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n completions."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    # per generated token: {token id: Logprob} for the sampled token plus the top-k asked for
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "repetition", "abort", "error" or None while running
    # vLLM's: the stop string or stop_token_ids id that ended it, "repetition_detected" (repetition_detection),
    # else None
    stop_reason: str | int | None = None
    score: float | None = None  # beam search: cumulative_logprob / len(token_ids) ** length_penalty, its rank
    lora_request: None = None  # vLLM's: LoRA adapters are not implemented

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
    # prompt_logprobs: per prompt token, None for the first, then {token id: Logprob} for it plus the top k
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # vLLM's, at the values it gives a decoder-only model without LoRA, multimodal input, KV transfer, or stats
    # (its LLM's default disable_log_stats leaves metrics None)
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    metrics: None = None
    kv_transfer_params: None = None
    multi_modal_placeholders: dict[str, Any] = field(default_factory=dict)

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


@dataclass(slots=True)
class Metric:
    """One series of LLM.get_metrics(), vLLM's shape (vllm.v1.metrics.reader.Metric): a name and its labels."""

    name: str
    labels: dict[str, str]


@dataclass(slots=True)
class Counter(Metric):
    """A count that only grows (vLLM's reader.Counter): the name is the Prometheus family's, without _total."""

    value: int


@dataclass(slots=True)
class Gauge(Metric):
    """A value now (vLLM's reader.Gauge)."""

    value: float
