"""vLLM's stream_interval: a completion's deltas held back and sent merged, at least `interval` new tokens each after
its first output; its end sends what is held at once.

Per completion, as the tokenizer process makes its TextDeltas (one a step):

    step:    1    2    3    4    5    6    7    8    9   10 (end)
    sent:   [1]  .    .    .   [2-5] .    .    .   [6-9] [10]        interval 4: the first alone, then 4 by 4
    sent:   [1]  .    .   [2-4 + the end]                            an end mid-interval sends what is held with it

The text, token ids, logprobs and prompt logprobs of merged deltas are the concatenation of theirs (what a client
reads, joined, is the same with and without an interval); the end's finish and stop reasons are those of the delta
that ended it. An abnormal end (abort, error) is sent alone after what was held, as without an interval: the
renderers show no output of such a delta. A request that fails (RequestFailed, its scheduler lost, shutdown) sends
what is held before its error; one its client left is dropped with it (nobody reads it). Pure logic: `Pacer.pace`
per delta, `Pacer.flush` when the request fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.shared.messages import ANSWERED, PositionLogprobs, TextDelta


@dataclass(slots=True)
class Held:
    """One completion's output since its last sent delta: the deltas `add`ed, merged."""

    request_id: str
    index: int
    texts: list[str] = field(default_factory=list)
    num_new_tokens: int = 0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # the largest count of its deltas (the api keeps the largest too)

    def add(self, delta: TextDelta) -> None:
        """One more delta of this completion (the caller's to check: per token, kept short)."""
        self.texts.append(delta.text)
        self.num_new_tokens += delta.num_new_tokens
        if delta.logprobs:
            self.logprobs += delta.logprobs
        if delta.prompt_logprobs:
            self.prompt_logprobs += delta.prompt_logprobs
        if delta.token_ids:
            self.token_ids += delta.token_ids
        if delta.num_cached_tokens > self.num_cached_tokens:
            self.num_cached_tokens = delta.num_cached_tokens

    def delta(self, finish_reason: int = -1, stop_reason: str | int | None = None) -> TextDelta:
        """The held output as one delta: a running one, or the end (`finish_reason` >= 0) with its stop reason."""
        return TextDelta(self.request_id, self.index, "".join(self.texts), self.num_new_tokens, finish_reason,
                         self.logprobs, self.num_cached_tokens, stop_reason, self.prompt_logprobs, self.token_ids)


class Pacer:
    """A request's completions under one interval (> 1): what each holds, and whether it sent its first tokens.
    Completions (n > 1) are held independently."""

    def __init__(self, interval: int, n: int) -> None:
        assert interval > 1 and n >= 1, (interval, n)
        self.interval = interval
        self._held: list[Held | None] = [None] * n  # per completion: output not sent yet
        self._started = [False] * n  # per completion: its first tokens went out

    def pace(self, delta: TextDelta) -> list[TextDelta]:
        """The deltas to send now for this one (in order): none while the completion holds fewer than `interval`
        new tokens since its last; its first tokens and its end go out at once. Per token: kept short."""
        i = delta.index
        held = self._held[i]
        if delta.finish_reason >= 0:
            self._held[i] = None
            if held is None:
                return [delta]
            if delta.finish_reason not in ANSWERED:  # abort, error: the output so far, then the end alone
                return [held.delta(), delta]
            held.add(delta)
            return [held.delta(delta.finish_reason, delta.stop_reason)]
        if held is None:
            num_new_tokens = delta.num_new_tokens
            if num_new_tokens and (num_new_tokens >= self.interval or not self._started[i]):
                self._started[i] = True
                return [delta]  # nothing held: sent as it is
            held = self._held[i] = Held(delta.request_id, i)
        held.add(delta)
        num_new_tokens = held.num_new_tokens
        if num_new_tokens and (num_new_tokens >= self.interval or not self._started[i]):
            self._held[i] = None
            self._started[i] = True
            return [held.delta()]
        return []  # held; a prompt-only delta (prompt logprobs) waits for the first tokens, as vLLM sends them

    def flush(self) -> list[TextDelta]:
        """What every completion holds, as running deltas (the request fails: its output so far goes first); once."""
        held = [h for h in self._held if h is not None]
        self._held = [None] * len(self._held)
        return [h.delta() for h in held]
