"""Every message that crosses a process boundary: frozen, tagged msgspec Structs, one union per socket."""

from __future__ import annotations

import math
from collections.abc import Iterable
from enum import IntEnum
from typing import Any

import msgspec

from pagoda.shared.errors import InvalidRequestError

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
LOGIT_BIAS_LIMIT = 100.0  # |bias| as OpenAI documents it: a request body's biases are clamped to it (vLLM's server)
MAX_LOGIT_BIAS_VALUE = 3.4e38  # |bias| the worker can add: it adds them in float32, past which a bias would be inf
MAX_INT32 = 2**31 - 1  # bound of counts and token ids: the worker holds them in int32/int64 rows
MIN_INT64, MAX_INT64 = -(2**63), 2**63 - 1  # seeds and priorities must fit the wire's int64
MAX_STOP_TOKEN_IDS = 1024
MAX_GRAMMAR_CHARS = 1 << 20  # a JSON schema, regex or grammar text, serialized
MAX_CHOICES = 1024
MAX_WHITESPACE_PATTERN_CHARS = 1024  # a structured output's whitespace_pattern (a regex)
# the constraint kinds of StructuredOutputs besides json_object, each a field holding its spec
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "structural_tag")
GREEDY_TEMPERATURE = 1e-5  # below it a temperature is greedy (as vLLM): x / T would overflow
# vLLM's _MAX_TEMP: a temperature in (0, this) is raised to it where SamplingParams are made (raised_temperature)
MIN_SAMPLING_TEMPERATURE = 1e-2
# vLLM's warning then (SamplingParams.__post_init__), logged with the temperature, this bound and this bound
TEMPERATURE_RAISED_WARNING = ("temperature %s is less than %s, which may cause numerical errors nan or inf in tensors. "
                              "We have maxed it out to %s.")
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # allowed_token_ids entries (more than any vocabulary)
MAX_BAD_WORDS = 128  # bad_words entries (each becomes up to two token sequences: as given, and after a space)
MAX_BAD_WORD_CHARS = 256  # characters of one bad word
MAX_BAD_WORD_TOKENS = 32  # tokens of one bad word (the worker's per-row tables are this wide)
WHOLE_VOCABULARY = -1  # logprobs / prompt_logprobs: every token (vLLM's -1), resolved where the vocabulary is known
TRUNCATE_TO_CONTEXT = -1  # truncate_prompt_tokens: as many prompt tokens as the model's context takes (vLLM's -1)
MAX_CACHE_SALT_BYTES = 1024  # UTF-8 bytes of a request's cache_salt (vLLM sets no bound)
MAX_PROMPT_CACHE_KEY_BYTES = 1024  # UTF-8 bytes of a request's prompt_cache_key (OpenAI states no bound)
MAX_REQUEST_ID_BYTES = 1024  # UTF-8 bytes of a client's request_id / X-Request-Id (vLLM sets no bound)
NO_THINKING_BUDGET = -1  # thinking_token_budget: vLLM's "unlimited", the same as null
# repetition_detection: the longest pattern a request may watch for. The scheduler compares every new token with that
# many earlier ones (services/scheduler/repetition.py: ~8 us a token at 2048 on the 2-core build host)
MAX_REPETITION_PATTERN = 2048
MAX_LOGPROB_TOKEN_IDS = 128  # logprob_token_ids entries (vLLM's MAX_LOGPROB_TOKEN_IDS)


class FinishReason(IntEnum):
    """Why a sequence ended; small ints on the wire, OpenAI strings at the API."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or the model's context
    ABORT = 2  # the client went away or the server is shutting down
    ERROR = 3  # the request failed inside the engine
    REPETITION = 4  # the output ended in a repeated pattern (vLLM's repetition_detection)

    @property
    def openai_name(self) -> str:
        return ("stop", "length", "abort", "error", "repetition")[self]


# the ends of a completion that is answered (it ended on its own terms: not aborted, not failed)
ANSWERED = frozenset({FinishReason.STOP, FinishReason.LENGTH, FinishReason.REPETITION})


class StructuredOutputs(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """A constraint on the generated text; vLLM's StructuredOutputsParams: exactly one kind is set.

    `grammar` is a Lark grammar in llguidance's dialect, or GBNF (its first rule is `name ::= ...`).
    `structural_tag` is vLLM's structural tag as JSON text, `{"structures": [{"begin", "schema", "end"}], "triggers":
    [...]}`: free text in which each trigger must go on as one of the structures whose `begin` starts with it,
    `begin`, JSON of its schema, `end` (tool calls amid text; check_structural_tag has the rules); or xgrammar's
    `{"format": {...}}`, a tree of format objects (check_structural_format).
    The options shape the JSON of `json`, `json_object` and a legacy structural tag's schemas (as vLLM's guidance
    backend applies them; the other kinds write no JSON of their own): `disable_any_whitespace` writes it compact
    (`{"a":1,"b":[1,2]}`; by default `{"a": 1, "b": [1, 2]}`, json.dumps' form), `whitespace_pattern` lets a regex's
    whitespace stand between its tokens instead, `disable_additional_properties` closes every object schema with
    properties and no additionalProperties of its own. `disable_fallback` changes nothing: the one engine never
    falls back to another.
    `reasoning_end` is set by the server, never the client: constraints start after this text appears
    in the output (a reasoning model's `</think>`); empty means from the first token.
    """

    json: str | dict[str, Any] | None = None  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False  # any JSON object
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False
    reasoning_end: str = ""

    @property
    def kind(self) -> str:
        kinds = [name for name in CONSTRAINT_KINDS if getattr(self, name) is not None]
        return kinds[0] if kinds else "json_object"

    def validate(self) -> StructuredOutputs:
        num_set = sum(getattr(self, name) is not None for name in CONSTRAINT_KINDS)
        _check(num_set + int(bool(self.json_object)) == 1, "structured_outputs",
               "structured_outputs needs exactly one of json, regex, choice, grammar, structural_tag and "
               "json_object")
        if self.structural_tag is not None:
            _check(isinstance(self.structural_tag, str) and 0 < len(self.structural_tag) <= MAX_GRAMMAR_CHARS,
                   "structured_outputs.structural_tag",
                   f"structural_tag must be JSON text of at most {MAX_GRAMMAR_CHARS} characters")
            check_structural_tag(self.structural_tag)
        _check(self.json is None or isinstance(self.json, (str, dict)), "structured_outputs.json",
               "json must be a JSON schema (an object, or its text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and 0 < len(value) <= MAX_GRAMMAR_CHARS),
                   f"structured_outputs.{name}", f"{name} must be a non-empty string of at most "
                                                 f"{MAX_GRAMMAR_CHARS} characters")
        _check(self.choice is None or (0 < len(self.choice) <= MAX_CHOICES
                                       and all(isinstance(c, str) and c for c in self.choice)),
               "structured_outputs.choice", f"choice must be 1 to {MAX_CHOICES} non-empty strings")
        _check(isinstance(self.json, dict) or len(self.json or "") <= MAX_GRAMMAR_CHARS,
               "structured_outputs.json", f"json must be at most {MAX_GRAMMAR_CHARS} characters")
        self._validate_options()
        return self

    def _validate_options(self) -> None:
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            _check(isinstance(getattr(self, name), bool), f"structured_outputs.{name}", f"{name} must be a boolean")
        pattern = self.whitespace_pattern
        _check(pattern is None or (isinstance(pattern, str) and 0 < len(pattern) <= MAX_WHITESPACE_PATTERN_CHARS),
               "structured_outputs.whitespace_pattern",
               f"whitespace_pattern must be a non-empty regex of at most {MAX_WHITESPACE_PATTERN_CHARS} characters")
        _check(pattern is None or not self.disable_any_whitespace, "structured_outputs.whitespace_pattern",
               "give whitespace_pattern (the whitespace JSON may hold between its tokens) or disable_any_whitespace "
               "(none), not both")


class ThinkingBudget(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """vLLM's thinking_token_budget as the worker enforces it (services/worker/thinking.py): set by the tokenizer
    process from the request's budget, the reasoning parser's markers and where the prompt left the think block
    (services/protocol/reasoning.thinking_budget), never by the client. The output may write `max_tokens` tokens
    inside its think block; then `end_token_ids` (the tokenizer's spelling of `end`) are forced one by one, and the
    answer after them goes on freely."""

    max_tokens: int  # tokens left to the output inside the block (the request's budget less the prompt's own)
    end: str  # the marker that closes the block (`</think>`), also when the model writes it itself
    end_token_ids: list[int]
    start: str = ""  # "": the output starts inside the block; else it has one only when it opens with this text
    # (after whitespace), and the tokens after it count

    def validate(self) -> ThinkingBudget:
        _check(_whole(self.max_tokens) and 0 <= self.max_tokens <= MAX_INT32, "thinking_token_budget",
               f"thinking's max_tokens must be an integer in [0, {MAX_INT32}]")
        _check(bool(self.end) and 0 < len(self.end_token_ids) <= MAX_BAD_WORD_TOKENS
               and all(_whole(t) and 0 <= t <= MAX_INT32 for t in self.end_token_ids),
               "thinking_token_budget", f"thinking needs its end marker as 1 to {MAX_BAD_WORD_TOKENS} token ids")
        return self


class RepetitionDetection(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """vLLM's RepetitionDetectionParams: a completion ends (finish_reason "repetition") once its output ends with
    `min_count` copies in a row of one pattern of `min_pattern_size` to `max_pattern_size` tokens (after min_tokens).
    max_pattern_size 0 turns it off; min_pattern_size 0 means 1."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0

    @property
    def shortest(self) -> int:
        return max(self.min_pattern_size, 1)

    def validate(self) -> RepetitionDetection:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            _check(_whole(value) and 0 <= value <= MAX_INT32,
                   f"repetition_detection.{name}", f"{name} must be an integer in [0, {MAX_INT32}], got {value!r}")
        _check(self.min_pattern_size <= self.max_pattern_size, "repetition_detection.min_pattern_size",
               "min_pattern_size must not exceed max_pattern_size (both 0: no repetition detection)")
        _check(self.max_pattern_size <= MAX_REPETITION_PATTERN, "repetition_detection.max_pattern_size",
               f"max_pattern_size must be at most {MAX_REPETITION_PATTERN}")
        _check(not self.enabled or self.min_count >= 2, "repetition_detection.min_count",
               "min_count must be >= 2 to detect a repeated pattern (max_pattern_size 0: no detection)")
        return self


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """How to pick tokens and when to stop; the shape of vLLM's SamplingParams.

    `validate()` raises InvalidRequestError naming the parameter; every field is honoured.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob plus the top k; -1: all
    prompt_logprobs: int | None = None  # None: none; k >= 0 (or -1: all): each prompt token's logprob (not the first)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] = {}  # token id -> added to its raw logit (before penalties, as vLLM)
    structured_outputs: StructuredOutputs | None = None  # constrained decoding (a grammar's token mask)
    # beam search (vLLM's fields): best_of beams (default n), the n best finished hypotheses returned, ranked by
    # sum(logprobs) / generated_len ** length_penalty with transformers' early_stopping (True, False, "never")
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    allowed_token_ids: list[int] = []  # non-empty: only these ids may be sampled (vLLM's allowed_token_ids)
    # vLLM's logprob_token_ids: with logprobs on, each generated position lists these ids' logprobs (in this order)
    # instead of its top `logprobs`; the sampled token's logprob comes as always
    logprob_token_ids: list[int] = []
    # vLLM's bad_words: a word's last token is banned where the output so far ends with its other tokens
    bad_words: list[str] = []
    # bad_words as token sequences (services/tokenizer/bad_words.py), made where the text is tokenized (the tokenizer
    # process, the offline engine) and always from bad_words: what the worker bans
    bad_words_token_ids: list[list[int]] = []
    # vLLM's truncate_prompt_tokens: k >= 1 keeps the prompt's last k tokens (truncation_side "right": its first k),
    # -1 as many as the model takes; applied where the prompt is tokenized (services/tokenizer/prompts.py), before
    # the prompt is checked against the context: the scheduler and the worker get the truncated prompt
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None  # "left" (None: vLLM's default) or "right"
    # vLLM's thinking_token_budget: at most this many tokens inside the think block that the reasoning parser reads
    # (chat with --reasoning-parser), then `</think>` is forced; None or -1 (vLLM's "unlimited"): no budget
    thinking_token_budget: int | None = None
    thinking: ThinkingBudget | None = None  # the budget as the worker enforces it: the tokenizer process's, only
    # vLLM's repetition_detection: the scheduler ends a completion whose output ends in a repeated pattern
    repetition_detection: RepetitionDetection | None = None
    # vLLM's stream_interval: a completion's output is sent in deltas of at least this many new tokens after its
    # first one (and whatever is left at its end); raised to the server's --stream-interval (the tokenizer process
    # holds the deltas back: services/tokenizer/pacing.py). None: the server's. Offline (LLM) it changes nothing.
    stream_interval: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def bounds_thinking(self) -> bool:
        """thinking_token_budget is a budget (not None, nor vLLM's -1)."""
        return self.thinking_token_budget is not None and self.thinking_token_budget != NO_THINKING_BUDGET

    @property
    def beam_width(self) -> int:
        """Beams of a beam search request (0: not one)."""
        return (self.best_of if self.best_of is not None else self.n) if self.use_beam_search else 0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate(self, max_logprobs: int = MAX_TOP_LOGPROBS) -> SamplingParams:
        """Check every field; return self so calls can chain. `max_logprobs` bounds logprobs and prompt_logprobs
        (vLLM's --max-logprobs; -1: no bound); their -1 (the whole vocabulary) is checked by `resolve_vocabulary`."""
        _check(_whole(self.n) and 1 <= self.n <= MAX_N, "n", f"n must be an integer in [1, {MAX_N}]")
        _check(_finite(self.temperature) and self.temperature >= 0.0, "temperature",
               "temperature must be a finite number >= 0")
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        _check(_whole(self.top_k) and (0 <= self.top_k <= MAX_INT32 or self.top_k == -1), "top_k",
               f"top_k must be -1 or 0 (disabled) or a positive integer <= {MAX_INT32}")
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2]")
        _check(_finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               "repetition_penalty", "repetition_penalty must be in (0, 10]")
        _check(self.seed is None or (_whole(self.seed) and MIN_INT64 <= self.seed <= MAX_INT64), "seed",
               f"seed must be an integer in [{MIN_INT64}, {MAX_INT64}]")
        scoring_only = self.prompt_logprobs is not None and self.n == 1  # max_tokens=0: score the prompt, no more
        _check(self.max_tokens is None or (_whole(self.max_tokens)
                                           and (0 if scoring_only else 1) <= self.max_tokens <= MAX_INT32),
               "max_tokens", f"max_tokens must be an integer in [1, {MAX_INT32}] (0 only to score a prompt: "
                             "prompt_logprobs, or echo with logprobs, and n=1)")
        _check(_whole(self.min_tokens) and 0 <= self.min_tokens <= MAX_INT32, "min_tokens",
               f"min_tokens must be an integer in [0, {MAX_INT32}]")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               "min_tokens must not exceed max_tokens")
        # a list as typed: the offline API builds these without the wire's decoding (stop=5 was a TypeError)
        for name in ("stop", "stop_token_ids", "allowed_token_ids"):
            _check(isinstance(getattr(self, name), (list, tuple)), name, f"{name} must be a list")
        _check(isinstance(self.logit_bias, dict), "logit_bias", "logit_bias must be a map of token ids to biases")
        _check(len(self.stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in self.stop),
               "stop", f"stop must be at most {MAX_STOP_STRINGS} non-empty strings")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
               and all(_whole(t) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids), "stop_token_ids",
               f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} integers in [0, {MAX_INT32}]")
        _check_logprobs(self.logprobs, "logprobs", "sample", max_logprobs)
        _check_logprobs(self.prompt_logprobs, "prompt_logprobs", "prompt", max_logprobs)
        _check(len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
               and all(_whole(t) and 0 <= t <= MAX_INT32 for t in self.allowed_token_ids),
               "allowed_token_ids", f"allowed_token_ids must be at most {MAX_ALLOWED_TOKEN_IDS} token ids in "
                                    f"[0, {MAX_INT32}]")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias",
               f"logit_bias may hold at most {MAX_LOGIT_BIAS} token ids")
        _check(all(_whole(t) and 0 <= t <= MAX_INT32 for t in self.logit_bias), "logit_bias",
               f"logit_bias keys must be token ids in [0, {MAX_INT32}]")
        # vLLM's offline SamplingParams takes any bias (its server clamps a body's to [-100, 100]: the api does too)
        _check(all(_finite(b) and abs(b) <= MAX_LOGIT_BIAS_VALUE for b in self.logit_bias.values()), "logit_bias",
               f"logit_bias values must be finite numbers in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}] "
               "(float32's range)")
        self._validate_bad_words()
        self._validate_logprob_token_ids()
        self._validate_truncation()
        self._validate_structured()
        self._validate_thinking()
        self._validate_repetition()
        self._validate_beam_search()
        self._validate_stream_interval()
        return self

    def _validate_stream_interval(self) -> None:
        interval = self.stream_interval
        _check(interval is None or (_whole(interval)
                                    and 1 <= interval <= MAX_INT32), "stream_interval",
               f"stream_interval must be an integer in [1, {MAX_INT32}] (new tokens per streamed delta), or null for "
               f"the server's --stream-interval, got {interval!r}")

    @property
    def top_list_length(self) -> int:
        """What each generated position lists beside the sampled token: logprob_token_ids, else the top `logprobs`;
        -1 without logprobs."""
        if self.logprobs is None:
            return -1
        return len(self.logprob_token_ids) if self.logprob_token_ids else self.logprobs

    @property
    def detects_repetition(self) -> bool:
        return self.repetition_detection is not None and self.repetition_detection.enabled

    def _validate_repetition(self) -> None:
        if self.repetition_detection is not None:
            _check(isinstance(self.repetition_detection, RepetitionDetection), "repetition_detection",
                   "repetition_detection must be an object of max_pattern_size, min_pattern_size and min_count")
            self.repetition_detection.validate()

    def _validate_thinking(self) -> None:
        budget = self.thinking_token_budget
        whole = _whole(budget)
        _check(budget is None or (whole and NO_THINKING_BUDGET <= budget <= MAX_INT32), "thinking_token_budget",
               f"thinking_token_budget must be an integer in [0, {MAX_INT32}], or -1 or null for no budget, "
               f"got {budget!r}")
        if self.thinking is not None:
            _check(isinstance(self.thinking, ThinkingBudget), "thinking_token_budget",
                   "thinking must be a ThinkingBudget")
            self.thinking.validate()

    def _validate_logprob_token_ids(self) -> None:
        ids = self.logprob_token_ids
        _check(isinstance(ids, list) and len(ids) <= MAX_LOGPROB_TOKEN_IDS
               and all(_whole(t) and 0 <= t <= MAX_INT32 for t in ids),
               "logprob_token_ids", f"logprob_token_ids must be at most {MAX_LOGPROB_TOKEN_IDS} token ids in "
                                    f"[0, {MAX_INT32}]")
        if not ids:
            return
        _check(len(set(ids)) == len(ids), "logprob_token_ids", "logprob_token_ids must not repeat an id")
        _check(self.logprobs is not None, "logprob_token_ids",
               "logprob_token_ids needs logprobs (completions: logprobs >= 0; chat: logprobs true): they are listed "
               "where the top logprobs would be")
        _check(self.max_tokens != 0, "logprob_token_ids",
               "logprob_token_ids scores generated positions, and max_tokens 0 generates none (prompt positions: "
               "prompt_logprobs)")

    def _validate_truncation(self) -> None:
        limit = self.truncate_prompt_tokens
        _check(limit is None or (_whole(limit)
                                 and (limit == TRUNCATE_TO_CONTEXT or 1 <= limit <= MAX_INT64)),
               "truncate_prompt_tokens", "truncate_prompt_tokens must be an integer >= 1 (the prompt tokens to keep, "
                                         f"at most 2**63 - 1) or -1 (as many as the context takes), got {limit!r}")
        _check(self.truncation_side in (None, "left", "right"), "truncation_side",
               'truncation_side must be "left" (keep the last tokens) or "right" (keep the first ones)')

    def _validate_bad_words(self) -> None:
        _check(isinstance(self.bad_words, list) and len(self.bad_words) <= MAX_BAD_WORDS
               and all(isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in self.bad_words),
               "bad_words", f"bad_words must be at most {MAX_BAD_WORDS} strings of 1 to {MAX_BAD_WORD_CHARS} "
                            "characters, each with a character other than whitespace")
        _check(len(self.bad_words_token_ids) <= 2 * len(self.bad_words)
               and all(isinstance(ids, list) and 1 <= len(ids) <= MAX_BAD_WORD_TOKENS
                       and all(_whole(t) and 0 <= t <= MAX_INT32 for t in ids)
                       for ids in self.bad_words_token_ids), "bad_words",
               f"each bad word must be 1 to {MAX_BAD_WORD_TOKENS} tokens (at most two spellings a word)")

    def _validate_beam_search(self) -> None:
        _check(isinstance(self.use_beam_search, bool), "use_beam_search", "use_beam_search must be a boolean")
        _check(self.best_of is None or (_whole(self.best_of)
                                        and 1 <= self.best_of <= MAX_N), "best_of",
               f"best_of must be an integer in [1, {MAX_N}]")
        _check(_finite(self.length_penalty), "length_penalty", "length_penalty must be a finite number")
        _check(isinstance(self.early_stopping, bool) or self.early_stopping == "never", "early_stopping",
               'early_stopping must be true, false or "never"')
        if not self.use_beam_search:
            _check(self.best_of is None or self.best_of == self.n, "best_of",
                   "best_of other than n needs use_beam_search (every sampled completion is returned)")
            _check(self.length_penalty == 1.0, "length_penalty", "length_penalty needs use_beam_search")
            _check(self.early_stopping is False, "early_stopping", "early_stopping needs use_beam_search")
            return
        _check(self.n <= self.beam_width, "n", "n must not exceed best_of, the beam width")
        # beams are ranked by the model's own log-probabilities: whatever would reshape them is refused
        for name, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("presence_penalty", 0.0),
                          ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("min_tokens", 0)):
            value = getattr(self, name)
            _check(value == off or (name == "top_k" and value == -1), name, f"{name} is not supported with beam search")
        _check(not self.logit_bias, "logit_bias", "logit_bias is not supported with beam search")
        _check(not self.allowed_token_ids, "allowed_token_ids", "allowed_token_ids is not supported with beam search")
        _check(not self.bad_words, "bad_words", "bad_words are not supported with beam search")
        _check(self.logprobs is None, "logprobs", "logprobs are not supported with beam search")
        _check(self.prompt_logprobs is None, "prompt_logprobs", "prompt_logprobs are not supported with beam search")
        _check(not self.stop, "stop", "stop strings are not supported with beam search; use stop_token_ids")
        _check(self.structured_outputs is None, "structured_outputs",
               "structured outputs are not supported with beam search")
        _check(not self.bounds_thinking and self.thinking is None, "thinking_token_budget",
               "thinking_token_budget is not supported with beam search")
        _check(not self.detects_repetition, "repetition_detection",
               "repetition_detection is not supported with beam search")

    def _validate_structured(self) -> None:
        constraint = self.structured_outputs
        if constraint is None:
            return
        _check(isinstance(constraint, StructuredOutputs), "structured_outputs",
               "structured_outputs must be a StructuredOutputs")
        constraint.validate()
        # A finished grammar only allows EOS: ignoring EOS, or banning it under min_tokens, leaves no token.
        _check(not self.ignore_eos, "ignore_eos", "ignore_eos cannot be combined with structured outputs")
        _check(self.min_tokens == 0, "min_tokens", "min_tokens cannot be combined with structured outputs")


def _check_logprobs(value: int | None, param: str, kind: str, max_logprobs: int) -> None:
    _check(value is None or (_whole(value)
                             and (value >= 0 or value == WHOLE_VOCABULARY)),
           param, f"`{param}` must be a non-negative integer or -1 (the whole vocabulary)")
    if value is not None and value > max_logprobs >= 0:
        raise InvalidRequestError(f"Requested {kind} logprobs of {value}, which is greater than max allowed: "
                                  f"{max_logprobs} (--max-logprobs)", param=param)


def resolve_vocabulary(params: SamplingParams, vocab_size: int, max_logprobs: int,
                       logprobs_field: str = "logprobs") -> SamplingParams:
    """Where the vocabulary is known: logprobs of -1 become `vocab_size` (refused past `max_logprobs`, -1: no
    bound) and allowed_token_ids, logprob_token_ids and bad_words' tokens are checked against it. `logprobs_field`
    is the name the client sent the count under (chat's top_logprobs)."""
    changes: dict[str, int] = {}
    for param, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        if getattr(params, param) == WHOLE_VOCABULARY:
            if 0 <= max_logprobs < vocab_size:
                raise InvalidRequestError(f"Requested {kind} logprobs of -1 (the whole vocabulary, {vocab_size}), "
                                          f"which is greater than max allowed: {max_logprobs} (--max-logprobs)",
                                          param=logprobs_field if param == "logprobs" else param)
            changes[param] = vocab_size
    bad = next((t for t in params.allowed_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"allowed_token_ids holds {bad}, outside the vocabulary [0, {vocab_size})",
                                  param="allowed_token_ids")
    bad = next((t for t in params.logprob_token_ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"logprob_token_ids holds {bad}, outside the vocabulary [0, {vocab_size})",
                                  param="logprob_token_ids")
    bad = next((t for ids in params.bad_words_token_ids for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"a bad word's tokens hold {bad}, outside the model's vocabulary [0, {vocab_size})",
                                  param="bad_words")
    return msgspec.structs.replace(params, **changes) if changes else params


def check_allowed_left(params: SamplingParams, eos_token_ids: Iterable[int]) -> None:
    """allowed_token_ids must leave an id the sampler may draw: InvalidRequestError names bad_words when each id is a
    one-token bad word (banned at every step), and min_tokens when the rest are EOS ids (`eos_token_ids`, banned
    until min_tokens whatever ignore_eos says) or stop_token_ids. The sampler would otherwise draw from a row of
    -inf logits, an id outside the list. bad_words_token_ids must be made already (services/tokenizer/bad_words.py);
    a longer bad word's ban depends on the tokens before it and is not foreseen here."""
    if not params.allowed_token_ids:
        return
    left = set(params.allowed_token_ids) - {ids[0] for ids in params.bad_words_token_ids if len(ids) == 1}
    if not left:
        raise InvalidRequestError("bad_words ban every id of allowed_token_ids: no token is left to sample",
                                  param="bad_words")
    if params.min_tokens > 0 and not left - set(params.stop_token_ids) - set(eos_token_ids):
        raise InvalidRequestError(f"min_tokens bans EOS and stop_token_ids until {params.min_tokens} tokens are "
                                  "generated, and allowed_token_ids holds no other id (bad words aside): no token "
                                  "is left to sample", param="min_tokens")


def _whole(value: object) -> bool:
    """An integer, not a bool (Python's bool is an int: max_tokens=True would pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def raised_temperature(temperature: float) -> float | None:
    """vLLM's clamp of a small temperature: MIN_SAMPLING_TEMPERATURE for one in (0, MIN_SAMPLING_TEMPERATURE), which
    would sample from logits / T so large they overflow (vLLM raises it, with TEMPERATURE_RAISED_WARNING in the log,
    rather than sampling greedily); None when the temperature stands (0 is greedy; a bad value is validate's)."""
    if _finite(temperature) and 0.0 < temperature < MIN_SAMPLING_TEMPERATURE:
        return MIN_SAMPLING_TEMPERATURE
    return None


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_structural_tag(text: str) -> None:
    """vLLM's structural tag: its legacy form, a JSON object of `structures`, each `{"begin": str, "schema": JSON
    schema object, "end": str}`, and `triggers`, non-empty strings (every begin starts with a trigger); or
    xgrammar's form, `{"format": {...}}`, a tree of format objects (check_structural_format). `type` may say
    "structural_tag"."""
    param = "structured_outputs.structural_tag"
    try:
        spec = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"structural_tag is not JSON: {exc}", param=param) from None
    except RecursionError:  # the decoder recurses per level; the body's depth check does not look into a string
        raise InvalidRequestError("structural_tag nests arrays or objects thousands deep", param=param) from None
    _check(isinstance(spec, dict), param, "structural_tag must be a JSON object of structures and triggers, or of "
                                          "a format")
    _check(spec.get("type", "structural_tag") == "structural_tag", param, "structural_tag's type must be "
                                                                         "\"structural_tag\"")
    if "format" in spec:
        unknown = sorted(set(spec) - {"type", "format"})
        _check(not unknown, param, f"structural_tag's format form takes type and format, not {', '.join(unknown)}")
        check_structural_format(spec["format"], f"{param}.format")
        return
    unknown = sorted(set(spec) - {"type", "structures", "triggers"})
    _check(not unknown, param, f"structural_tag takes type, structures and triggers (or format), not "
                               f"{', '.join(unknown)}")
    triggers, structures = spec.get("triggers"), spec.get("structures")
    _check(isinstance(triggers, list) and 0 < len(triggers) <= MAX_CHOICES
           and all(isinstance(t, str) and t for t in triggers), f"{param}.triggers",
           f"triggers must be 1 to {MAX_CHOICES} non-empty strings")
    _check(isinstance(structures, list) and 0 < len(structures) <= MAX_CHOICES, f"{param}.structures",
           f"structures must be a list of 1 to {MAX_CHOICES} objects")
    for i, structure in enumerate(structures):
        at = f"{param}.structures[{i}]"
        _check(isinstance(structure, dict) and set(structure) <= {"begin", "schema", "end"}
               and isinstance(structure.get("begin"), str) and isinstance(structure.get("end"), str)
               and isinstance(structure.get("schema"), dict), at,
               "a structure is {\"begin\": string, \"schema\": JSON schema object, \"end\": string}")
        _check(any(structure["begin"].startswith(t) for t in triggers), f"{at}.begin",
               f"begin {structure['begin']!r} starts with none of the triggers")


# xgrammar's structural-tag formats served: (required fields, optional fields), `type` aside
_FORMAT_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "const_string": (frozenset({"value"}), frozenset()),
    "json_schema": (frozenset({"json_schema"}), frozenset({"style", "any_order", "max_whitespace_cnt"})),
    "grammar": (frozenset({"grammar"}), frozenset()),
    "regex": (frozenset({"pattern"}), frozenset()),
    "any_text": (frozenset(), frozenset({"excludes", "max_tokens", "max_chars"})),
    "sequence": (frozenset({"elements"}), frozenset()),
    "or": (frozenset({"elements"}), frozenset()),
    "optional": (frozenset({"content"}), frozenset()),
    "plus": (frozenset({"content"}), frozenset()),
    "star": (frozenset({"content"}), frozenset()),
    "repeat": (frozenset({"min", "max", "content"}), frozenset()),
    "tag": (frozenset({"begin", "content", "end"}), frozenset()),
    "triggered_tags": (frozenset({"triggers", "tags"}), frozenset({"at_least_one", "stop_after_first", "excludes"})),
    "tags_with_separator": (frozenset({"tags", "separator"}), frozenset({"at_least_one", "stop_after_first"})),
    "dispatch": (frozenset({"rules"}), frozenset({"loop", "excludes"})),
}
# the formats refused, and why: each is a 400 naming where it stands, never a part accepted and ignored
_TOKEN_LEVEL = ("token-level formats are not supported: this server's grammars match text, and write special "
                "tokens only where a string names one (`<|python_tag|>`); use a string begin, end or trigger")
_REFUSED_FORMATS = {"token": _TOKEN_LEVEL, "exclude_token": _TOKEN_LEVEL, "any_tokens": _TOKEN_LEVEL,
                    "token_triggered_tags": _TOKEN_LEVEL, "token_dispatch": _TOKEN_LEVEL,
                    "qwen_xml_parameter": "qwen_xml_parameter (the XML style of JSON arguments) is not supported: "
                                          "use json_schema with the JSON style"}
MAX_FORMAT_NODES = 1024  # format objects in one structural tag
MAX_FORMAT_DEPTH = 32  # format objects nested in one another
MAX_FORMAT_REPEAT = 1024  # repeat's bounds (each repetition is a copy in the grammar)


def check_structural_format(node: object, at: str) -> None:
    """The shape of xgrammar's structural-tag `format` (a tree of format objects, its structural_tag.py): every
    object of a served type with its fields, sizes and depth bounded; a 400 naming the first part that is not (`at`
    is where `node` stands, e.g. response_format.format.tags[2].content). Whether free text has something to end
    it is the compiler's question (services/grammar/compiler.py)."""
    num_nodes = [0]
    _check_format(node, at, 1, num_nodes)


def _check_format(node: object, at: str, depth: int, num_nodes: list[int], default_type: str | None = None) -> None:
    num_nodes[0] += 1
    _check(num_nodes[0] <= MAX_FORMAT_NODES, at, f"a structural tag holds at most {MAX_FORMAT_NODES} format objects")
    _check(depth <= MAX_FORMAT_DEPTH, at, f"format objects nest at most {MAX_FORMAT_DEPTH} deep")
    _check(isinstance(node, dict), at, "a format must be a JSON object with a type")
    assert isinstance(node, dict)
    kind = node.get("type", default_type)
    _check(isinstance(kind, str), at, "a format needs a type (a string)")
    _check(kind not in _REFUSED_FORMATS, f"{at}.type", f"{kind}: {_REFUSED_FORMATS.get(kind)}")
    _check(kind in _FORMAT_FIELDS, f"{at}.type", f"unknown format type {kind!r}: one of "
                                                 f"{', '.join(_FORMAT_FIELDS)} is served")
    required, optional = _FORMAT_FIELDS[kind]
    unknown = sorted(set(node) - required - optional - {"type"})
    _check(not unknown, at, f"a {kind} format takes {', '.join(sorted(required | optional))}, not "
                            f"{', '.join(unknown)}")
    missing = sorted(required - set(node))
    _check(not missing, at, f"a {kind} format needs {', '.join(missing)}")
    _FORMAT_CHECKS[kind](node, at, depth, num_nodes)


def _check_child(node: dict[str, Any], key: str, at: str, depth: int, num_nodes: list[int]) -> None:
    _check_format(node[key], f"{at}.{key}", depth + 1, num_nodes)


def _check_formats(node: dict[str, Any], key: str, at: str, depth: int, num_nodes: list[int]) -> None:
    items = node[key]
    _check(isinstance(items, list) and 0 < len(items) <= MAX_CHOICES, f"{at}.{key}",
           f"{key} must be a list of 1 to {MAX_CHOICES} formats")
    for i, item in enumerate(items):
        _check_format(item, f"{at}.{key}[{i}]", depth + 1, num_nodes)


def _check_strings(node: dict[str, Any], key: str, at: str, non_empty_list: bool = False) -> list[str]:
    """node[key]: a list of non-empty strings (absent: empty, unless `non_empty_list`)."""
    items = node.get(key, [])
    _check(isinstance(items, list) and len(items) <= MAX_CHOICES and (len(items) > 0 or not non_empty_list)
           and all(isinstance(s, str) and s for s in items), f"{at}.{key}",
           f"{key} must be {'1' if non_empty_list else '0'} to {MAX_CHOICES} non-empty strings")
    return items


def _check_flags(node: dict[str, Any], at: str, *keys: str) -> None:
    for key in keys:
        _check(isinstance(node.get(key, False), bool), f"{at}.{key}", f"{key} must be a boolean")


def _check_const_string(node: dict[str, Any], at: str, depth: int, num_nodes: list[int]) -> None:
    _check(isinstance(node["value"], str), f"{at}.value", "a const_string's value must be a string")


def _check_json_schema(node: dict[str, Any], at: str, depth: int, num_nodes: list[int]) -> None:
    schema = node["json_schema"]
    _check(isinstance(schema, dict) or schema is True, f"{at}.json_schema",
           "json_schema must be a JSON schema object (or true: any JSON value)")
    _check(node.get("style", "json") == "json", f"{at}.style", "only the \"json\" style is supported (the XML "
                                                               "styles of tool arguments are not)")
    _check(node.get("any_order", False) is False, f"{at}.any_order",
           "any_order is not supported: properties are written in the schema's order")
    count = node.get("max_whitespace_cnt")
    _check(count is None or (_whole(count) and count >= 0),
           f"{at}.max_whitespace_cnt", "max_whitespace_cnt must be a non-negative integer or null")


def _check_text_field(node: dict[str, Any], key: str, at: str) -> None:
    _check(isinstance(node[key], str) and node[key], f"{at}.{key}", f"{key} must be a non-empty string")


def _check_grammar(node: dict[str, Any], at: str, depth: int, num_nodes: list[int]) -> None:
    _check_text_field(node, "grammar", at)


def _check_regex(node: dict[str, Any], at: str, depth: int, num_nodes: list[int]) -> None:
    _check_text_field(node, "pattern", at)


def _check_any_text(node: dict[str, Any], at: str, depth: int, num_nodes: list[int]) -> None:
    _check_strings(node, "excludes", at)
    for key in ("max_tokens", "max_chars"):
        _check(node.get(key) is None, f"{at}.{key}", f"any_text's {key} is not supported (free text is bounded "
                                                     "by the request's max_tokens)")


def _check_sequence(node: dict[str, Any], at: str, depth: int, num_nodes: list[int]) -> None:
    _check_formats(node, "elements", at, depth, num_nodes)


def _check_content(node: dict[str, Any], at: str, depth: int, num_nodes: list[int]) -> None:
    _check_child(node, "content", at, depth, num_nodes)


def _check_repeat(node: dict[str, Any], at: str, depth: int, num_nodes: list[int]) -> None:
    low, high = node["min"], node["max"]
    _check(_whole(low) and 0 <= low <= MAX_FORMAT_REPEAT, f"{at}.min",
           f"repeat's min must be an integer in [0, {MAX_FORMAT_REPEAT}]")
    _check(_whole(high) and (high == -1 or low <= high <= MAX_FORMAT_REPEAT),
           f"{at}.max", f"repeat's max must be -1 (no bound) or an integer in [min, {MAX_FORMAT_REPEAT}]")
    _check_child(node, "content", at, depth, num_nodes)


def _check_tag(node: dict[str, Any], at: str, depth: int, num_nodes: list[int]) -> None:
    begin, end = node["begin"], node["end"]
    for key in ("begin", "end"):
        _check(not isinstance(node[key], dict), f"{at}.{key}", _TOKEN_LEVEL)
    _check(isinstance(begin, str), f"{at}.begin", "a tag's begin must be a string")
    _check(isinstance(end, str) or (isinstance(end, list) and 0 < len(end) <= MAX_CHOICES
                                    and all(isinstance(e, str) for e in end)),
           f"{at}.end", f"a tag's end must be a string or a list of 1 to {MAX_CHOICES} strings")
    _check_child(node, "content", at, depth, num_nodes)


def _check_tags(node: dict[str, Any], at: str, depth: int, num_nodes: list[int]) -> None:
    """node's `tags`: tag formats (their type may be left out)."""
    tags = node["tags"]
    _check(isinstance(tags, list) and 0 < len(tags) <= MAX_CHOICES, f"{at}.tags",
           f"tags must be a list of 1 to {MAX_CHOICES} tag formats")
    for i, tag in enumerate(tags):
        _check(not isinstance(tag, dict) or tag.get("type", "tag") == "tag", f"{at}.tags[{i}].type",
               "each of tags must be a tag format")
        _check_format(tag, f"{at}.tags[{i}]", depth + 1, num_nodes, default_type="tag")


def _check_triggered_tags(node: dict[str, Any], at: str, depth: int, num_nodes: list[int]) -> None:
    triggers = _check_strings(node, "triggers", at, non_empty_list=True)
    _check_tags(node, at, depth, num_nodes)
    for i, tag in enumerate(node["tags"]):
        matched = [t for t in triggers if tag["begin"].startswith(t)]
        _check(len(matched) == 1, f"{at}.tags[{i}].begin", f"begin {tag['begin']!r} must start with exactly one "
                                                           f"of the triggers, not {len(matched)}")
    _check_strings(node, "excludes", at)
    _check_flags(node, at, "at_least_one", "stop_after_first")


def _check_tags_with_separator(node: dict[str, Any], at: str, depth: int, num_nodes: list[int]) -> None:
    _check_tags(node, at, depth, num_nodes)
    _check(isinstance(node["separator"], str), f"{at}.separator", "separator must be a string")
    _check_flags(node, at, "at_least_one", "stop_after_first")


def _check_dispatch(node: dict[str, Any], at: str, depth: int, num_nodes: list[int]) -> None:
    rules = node["rules"]
    _check(isinstance(rules, list) and 0 < len(rules) <= MAX_CHOICES, f"{at}.rules",
           f"rules must be a list of 1 to {MAX_CHOICES} [pattern, format] pairs")
    for i, rule in enumerate(rules):
        _check(isinstance(rule, list) and len(rule) == 2 and isinstance(rule[0], str) and rule[0], f"{at}.rules[{i}]",
               "a rule is [pattern (a non-empty string), format]")
        _check_format(rule[1], f"{at}.rules[{i}][1]", depth + 1, num_nodes)
    _check_strings(node, "excludes", at)
    _check_flags(node, at, "loop")


_FORMAT_CHECKS = {"const_string": _check_const_string, "json_schema": _check_json_schema, "grammar": _check_grammar,
                  "regex": _check_regex, "any_text": _check_any_text, "sequence": _check_sequence,
                  "or": _check_sequence, "optional": _check_content, "plus": _check_content, "star": _check_content,
                  "repeat": _check_repeat, "tag": _check_tag, "triggered_tags": _check_triggered_tags,
                  "tags_with_separator": _check_tags_with_separator, "dispatch": _check_dispatch}


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


def cache_salt_bytes(cache_salt: str) -> bytes:
    """A cache_salt (or a prompt_cache_key) as the bytes that are hashed and counted (a lone surrogate from a JSON
    escape is kept, not refused)."""
    return cache_salt.encode("utf-8", "surrogatepass")


def _check_key_string(value: object, param: str, max_bytes: int) -> str:
    """A client's optional key string: None is none (""), else a non-empty string of at most `max_bytes` UTF-8
    bytes; InvalidRequestError naming `param` otherwise."""
    if value is None:
        return ""
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty string if provided", param=param)
    _check(len(cache_salt_bytes(value)) <= max_bytes, param, f"{param} must be at most {max_bytes} bytes (UTF-8)")
    return value


def check_cache_salt(cache_salt: object) -> str:
    """A client's cache_salt (vLLM's): None is no salt (""), else a non-empty string of at most
    MAX_CACHE_SALT_BYTES UTF-8 bytes; InvalidRequestError naming cache_salt otherwise."""
    return _check_key_string(cache_salt, "cache_salt", MAX_CACHE_SALT_BYTES)


def check_prompt_cache_key(prompt_cache_key: object) -> str:
    """A client's prompt_cache_key (OpenAI's): None is none (""), else a non-empty string of at most
    MAX_PROMPT_CACHE_KEY_BYTES UTF-8 bytes; InvalidRequestError naming prompt_cache_key otherwise."""
    return _check_key_string(prompt_cache_key, "prompt_cache_key", MAX_PROMPT_CACHE_KEY_BYTES)


def check_client_request_id(request_id: object, param: str) -> str:
    """A client's name for its request (vLLM's request_id field or X-Request-Id header): None is none (""), else a
    non-empty string of at most MAX_REQUEST_ID_BYTES UTF-8 bytes; InvalidRequestError naming `param` otherwise."""
    return _check_key_string(request_id, param, MAX_REQUEST_ID_BYTES)


# --------------------------------------------------------------------------------------------
# scheduler -> worker: one plan per step, a diff against what the worker already knows


class NewRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """A sequence the worker has not seen (or forgot after a preemption): sent once. `seq_id` is the scheduler's
    int id of one sequence (a request with n > 1 has n); the client's string id never reaches the worker."""

    seq_id: int
    token_ids: list[int]  # prompt plus any tokens generated before a preemption
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose K/V already sit in block_ids (prefix cache, fork)
    sampling: SamplingParams
    seed: int  # the effective sampling seed (the request's, or one drawn at arrival)
    eos_token_ids: list[int] = []  # min_tokens > 0: the EOS ids to ban until then (ignore_eos too)
    grammar_hash: str = ""  # set: sampling.structured_outputs travelled once, in a GrammarDef with this hash


class BeamGroup(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A beam search request whose beams all sample this step: the worker returns its num_candidates best
    continuations over [beams x vocabulary], scored score + log_softmax(logits / T)."""

    seq_ids: list[int]  # its live beams, in slot order
    scores: list[float]  # each beam's cumulative logprob (a worker that chose the beams itself keeps its own)
    num_candidates: int
    temperature: float  # 0 or 1: the plain log-probabilities
    # every slot is live: the worker also chooses the next beams itself (the width best candidates that are not
    # stop ids, placed as beam.assign_slots does) and continues each slot on the device, so that the next step
    # is planned before this one's result (the scheduler follows one step behind; BeamCandidates.slot_parents)
    on_device: bool = False
    stop_token_ids: list[int] = []  # with on_device: the ids that end a beam instead of continuing it


class BeamFork(msgspec.Struct, array_like=True, frozen=True, gc=False, omit_defaults=True):
    """After a beam step: slot seq_id continues the beam of slot parent_seq_id (itself: its own line) with
    token_id. A slot that changes line (or is new) gets block_ids, its whole new table: the parent's full blocks
    and its own copy of the parent's last, partial one (StepPlan.block_copies)."""

    seq_id: int
    parent_seq_id: int
    token_id: int
    block_ids: list[int] = []


class StepPlan(msgspec.Struct, tag="plan", array_like=True, omit_defaults=True, gc=False, frozen=True):
    """What the worker runs this step.

    Batch order is `seq_ids`; each scheduled sequence computes `num_scheduled_tokens` more of its
    tokens. A sequence samples a token when this step reaches the end of its known tokens.
    """

    step_id: int
    seq_ids: list[int]
    num_scheduled_tokens: list[int]
    new_requests: list[NewRequest] = []
    appended_block_seq_ids: list[int] = []  # with appended_block_ids: (sequence, new block) pairs
    appended_block_ids: list[int] = []
    finished_seq_ids: list[int] = []  # drop their state (finished, aborted or preempted)
    beam_forks: list[BeamFork] = []  # applied before finished sequences and new ones, before appended blocks
    block_copies: list[int] = []  # (source, destination) KV block pairs, flattened: copied before the forward
    beam_groups: list[BeamGroup] = []  # beam searches sampling this step (not in sampled_token_ids)
    seq: int = -1  # place in the scheduler's sequenced stream to the workers (shared/delivery.py); -1: none
    # preemption by swap, run first (the blocks they free or fill may be any other list's): (device block, host
    # slot) pairs copied to the host, then (host slot, device block) pairs copied back, flattened
    swap_out: list[int] = []
    swap_in: list[int] = []


class GrammarDef(msgspec.Struct, tag="grammar", array_like=True, omit_defaults=True, frozen=True):
    """A constraint the worker keeps by hash until told to evict it: sent once, before the first plan whose
    NewRequest names it (in the same sequenced stream as plans), never inside every plan."""

    seq: int
    hash: str
    constraint: StructuredOutputs
    evict: list[str] = []  # hashes no plan will name any more: the worker drops them (the scheduler's LRU)


class GrammarCompiled(msgspec.Struct, tag="gcompiled", array_like=True, frozen=True):
    """A worker rank built the matcher of a GrammarDef's constraint (or failed to: its rows then fail alone at
    sampling). The worker compiles each GrammarDef as it arrives; the scheduler holds a request with a large
    constraint out of the batch until this comes, so that no step waits seconds for a compile."""

    rank: int
    hash: str


class PromptScores(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Logprobs of consecutive prompt tokens, from one step's prompt chunk (prompt_logprobs)."""

    seq_id: int
    first: int  # index in the prompt of token_ids[0]; the first prompt token (index 0) is never scored
    token_ids: list[int]
    logprobs: list[float]
    top_token_ids: list[list[int]]  # [len(token_ids)][k]
    top_logprobs: list[list[float]]
    ranks: list[int] = []  # each token's rank in its position's distribution (1: the likeliest), as vLLM's


class RowFailure(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One request the worker could not run (a value refused at admission, a sampler error on its row): it ends
    with this error; the step's other requests go on."""

    seq_id: int
    status: int  # 400: its values; 500: the worker failed on it
    message: str
    param: str = ""  # a 400's request field, as the error's `param` (empty: none named)


class BeamCandidates(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One beam group's best continuations this step, best first."""

    seq_id: int  # the group's first slot
    token_ids: list[int]
    parents: list[int]  # index into the group's seq_ids
    scores: list[float]  # cumulative logprobs
    slot_parents: list[int] = []  # BeamGroup.on_device: the parent slot each slot continues (the worker's choice)


class StepResult(msgspec.Struct, tag="result", array_like=True, omit_defaults=True, gc=False, frozen=True):
    """Tokens sampled in one step; logprob columns are filled only for requests that asked."""

    step_id: int
    seq_ids: list[int]
    sampled_token_ids: list[int]
    sampled_logprobs: list[float] = []  # aligned with seq_ids when any sequence asked, else empty
    top_token_ids: list[list[int]] = []  # likewise; an inner list is empty for logprobs=0 / None
    top_logprobs: list[list[float]] = []
    error: str = ""
    prompt_scores: list[PromptScores] = []  # requests with prompt_logprobs whose prompt ran this step
    failed: list[RowFailure] = []  # sequences dropped from this step alone (not in seq_ids)
    beam_candidates: list[BeamCandidates] = []  # one per BeamGroup of the plan that ran
    sampled_ranks: list[int] = []  # aligned with sampled_logprobs: each token's rank in its distribution (1: first)

# worker -> scheduler (besides StepResult)


class WorkerReady(msgspec.Struct, array_like=True, tag="ready", frozen=True):
    """A worker rank loaded its weights and sized its KV cache; rank 0's numbers size the scheduler."""

    rank: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    max_num_batched_tokens: int  # the token budget per step resolved for the worker's device
    max_inflight_plans: int = 1  # 2: async scheduling (the worker resolved it for its device), 1: serial
    num_swap_blocks: int = 0  # host slots of one KV block each for preempted sequences (swap space; 0: none)


class Heartbeat(msgspec.Struct, array_like=True, tag="hb", frozen=True):
    """A sign of life from a process that has nothing else to say."""

    sender: str
    num_inflight: int = 0
    acked: int = -1  # a worker: the last sequenced message it applied (shared/delivery.py)
    gap: bool = False  # a worker: later sequenced messages wait there for the one after `acked` (sent again at once)
    idle: bool = False  # a worker: nothing launched, every result sent: a plan it has not acked (sent a while ago) was
    # lost, and one it acked whose result never came lost its result (both sent again at once)


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown", frozen=True):
    reason: str = ""


# --------------------------------------------------------------------------------------------
# api <-> tokenizer


class ToolCallMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    """A tool call an assistant turn made earlier in the conversation."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ChatMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str  # system | user | assistant | tool
    content: str  # its text; text parts joined by newlines
    name: str | None = None
    tool_calls: list[ToolCallMessage] = []  # assistant turns that called tools (content may then be "")
    tool_call_id: str | None = None  # tool turns: the call this result answers
    # content sent as text parts: each part's length (content is the parts joined by newlines, so the text goes over
    # the wire once and the parts are cut back out of it)
    part_lens: list[int] = []
    reasoning: str | None = None  # an earlier answer's reasoning sent back (templates render it, Qwen3's in tool loops)

    @property
    def parts(self) -> list[str]:
        """The texts of the parts the content was sent as; [] for content sent as a string."""
        parts, start = [], 0
        for part_len in self.part_lens:
            parts.append(self.content[start:start + part_len])
            start += part_len + 1  # the newline joining it to the next
        assert not parts or start == len(self.content) + 1, "part_lens must add up to the content"
        return parts


class RenderSpec(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True):
    """How the tokenizer renders a request's output as OpenAI bytes, so that the api only writes them."""

    route: int  # 0: /v1/completions, 1: /v1/chat/completions
    response_id: str
    model: str
    created: int
    stream: bool
    want_logprobs: bool = False
    include_usage: bool = False
    echo: bool = False
    return_token_ids: bool = False
    tool_mode: str = "none"  # chat: none|auto|required|named (services/protocol/chat_output.ChatOutputSpec)
    tool_parser: str = "hermes"
    tool_name: str = ""
    reasoning_parser: str | None = None
    max_calls: int = 0
    first_choice: int = 0  # this prompt's first choice index in the response (prompt index * n)
    continuous_usage: bool = False  # every chunk carries the usage so far (vLLM's continuous_usage_stats)
    prompt_logprobs: bool = False  # the response carries the prompt's logprobs (vLLM's prompt_logprobs field)
    tokens_as_ids: bool = False  # logprob tokens read "token_id:N" (vLLM's return_tokens_as_token_ids)
    echo_text: str = ""  # chat echo: this text leads each choice's content (the last message, continued)
    role: str = "assistant"  # chat: the answer's role (--response-role; no generation prompt: the last message's)
    # chat: function name -> parameter schema, for the tool-call parsers that type arguments by it (qwen3_coder)
    tool_parameters: dict[str, Any] = {}
    include_reasoning: bool = True  # chat: false drops the reasoning the parser separates (vLLM's include_reasoning)


class GenerateRequest(msgspec.Struct, array_like=True, tag="gen", frozen=True, omit_defaults=True):
    """A validated HTTP request on its way to tokenization; exactly one of the prompt fields is set."""

    request_id: str
    params: SamplingParams
    prompt_text: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, str | int | float | bool] = {}
    add_special_tokens: bool = True
    priority: int = 0
    arrival_time: float = 0.0  # time.time() at the api
    return_prompt_text: bool = False  # echo
    tools: list[dict[str, Any]] = []  # OpenAI tool definitions to render into the prompt
    return_token_ids: bool = False  # deltas carry their token ids, Accepted the prompt's (vLLM's return_token_ids)
    render: RenderSpec | None = None  # set: the tokenizer answers with RenderedRows, not TextDeltas
    tenant: str = ""  # the API key's tenant ("": none); with its weight and tier, for the scheduler's fair share
    tenant_weight: float = 1.0
    tenant_priority: int = 0
    # vLLM's cache_salt ("": none): mixed into the hash of the prompt's first prefix-cache block, so that only
    # requests with the same salt share cached blocks (with --prefix-cache-isolation tenant, the api's per tenant)
    cache_salt: str = ""
    # OpenAI's prompt_cache_key ("": none): with data-parallel replicas, the request's routing key in place of its
    # prompt's first blocks (with cache_salt), so that requests with the same key go to the same replica's cache
    prompt_cache_key: str = ""
    # chat: the api's --tool-call-parser for this request ("": not given); the tokenizer asks for calls in the form it
    # reads where the template has a choice (a DeepSeek template: DeepSeek's tool list, else Hermes')
    tool_parser: str = ""
    # chat: vLLM's retrieval documents, the template's `documents` (None: not given; last, so that an older sender's
    # message decodes)
    documents: list[dict[str, str]] | None = None
    # chat: the request's own Jinja template, or the name of one of the model's ("": the model's own; the api lets
    # it through only under --trust-request-chat-template)
    chat_template: str = ""
    # vLLM's render routes: the tokenizer takes the prompt through every check of generation (template, truncation,
    # context, grammar) and answers PromptRendered instead of admitting it; nothing runs
    render_only: bool = False


class AbortRequest(msgspec.Struct, array_like=True, tag="abort", frozen=True):
    request_id: str


class TokenizeRequest(msgspec.Struct, array_like=True, tag="tokenize", frozen=True, omit_defaults=True):
    request_id: str
    prompt_text: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False  # the tokens' vocabulary strings too (vLLM's /tokenize)
    tools: list[dict[str, Any]] = []  # chat: tool definitions the template renders, as in generation
    chat_template_kwargs: dict[str, str | int | float | bool] = {}
    tool_parser: str = ""  # chat: as GenerateRequest's, so that a count is the prompt generation renders
    documents: list[dict[str, str]] | None = None  # chat: as GenerateRequest's (the count routes pass them on)
    chat_template: str = ""  # chat: as GenerateRequest's


class DetokenizeRequest(msgspec.Struct, array_like=True, tag="detokenize", frozen=True):
    request_id: str
    token_ids: list[int]


class TokenizerInfoRequest(msgspec.Struct, array_like=True, tag="tokenizer_info", frozen=True):
    """/tokenizer_info: the tokenizer's configuration, from the process that loaded it."""

    request_id: str


class TokenizerHello(msgspec.Struct, array_like=True, tag="hello", frozen=True):
    """A tokenizer process announces itself to an api or the scheduler (and again after a restart)."""

    tokenizer_id: str
    pid: int
    eos_token_ids: list[int] = []  # the tokenizer's end-of-sequence id (the scheduler stops on it too)
    stream: int = 0  # its sequenced stream to this peer (Sequenced): a new one means it registers afresh
    # to an api: the model's generation-config sampling defaults (vLLM's --generation-config), SamplingParams field ->
    # value, for the fields a request leaves unset (services/tokenizer/generation_config.py)
    sampling_defaults: dict[str, float | int] = {}


class Accepted(msgspec.Struct, array_like=True, tag="accepted", frozen=True, omit_defaults=True):
    """The prompt tokenized and fits: the api may start the response."""

    request_id: str
    num_prompt_tokens: int
    prompt_text: str | None = None
    prompt_token_ids: list[int] = []  # only when the request asked (return_token_ids)
    opening: bytes = b""  # rendered requests that stream: the SSE bytes of this prompt's choices before any token
    prompt_reasoning: str = ""  # chat with a reasoning parser: where the prompt left the think block


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True, gc=False):
    token: str
    token_id: int
    logprob: float | None  # None only for a prompt's first token (prompt_logprobs: nothing predicts it)
    bytes: list[int]
    rank: int = 0  # its rank in the distribution (1: the likeliest); 0: not known (prompt_logprobs give it)


class PositionLogprobs(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One generated token's logprob and the top alternatives at its position."""

    sampled: TokenLogprob
    top: list[TokenLogprob]


class TextDelta(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True, gc=False):
    """New text of one completion; finish_reason -1 while it runs."""

    request_id: str
    index: int
    text: str
    num_new_tokens: int
    finish_reason: int = -1
    logprobs: list[PositionLogprobs] = []
    num_cached_tokens: int = 0
    # what ended it, as vLLM's stop_reason: the stop string, or the stop_token_ids id; None for EOS and length
    stop_reason: str | int | None = None
    prompt_logprobs: list[PositionLogprobs] = []  # prompt tokens scored this step, in prompt order
    token_ids: list[int] = []  # the new token ids: when the request asked (return_token_ids) or no tokenizer


class TextDeltas(msgspec.Struct, array_like=True, tag="texts", frozen=True, gc=False):
    deltas: list[TextDelta]


class RenderedRows(msgspec.Struct, array_like=True, tag="rendered", frozen=True, gc=False):
    """One step's output of rendered requests for one api, as columns: row r is one completion's news.

    `data` holds the bytes to write: a streamed completion's SSE chunks for this step, or a non-streamed
    completion's choice object (JSON) once it finishes (b"" before). The counts feed usage and metrics.
    """

    request_ids: list[str]
    indices: list[int]  # the completion's index within its request (n > 1)
    num_new_tokens: list[int]
    finish_reasons: list[int]  # a FinishReason, -1 while it runs
    num_cached_tokens: list[int]
    data: list[bytes]

    def __len__(self) -> int:
        return len(self.request_ids)

    def columns_agree(self) -> bool:
        rows = len(self.request_ids)
        return (len(self.indices) == len(self.num_new_tokens) == len(self.finish_reasons)
                == len(self.num_cached_tokens) == len(self.data) == rows)


class RequestFailed(msgspec.Struct, array_like=True, tag="failed", frozen=True, omit_defaults=True):
    """The request cannot be served: an HTTP status and an OpenAI error body."""

    request_id: str
    status: int
    message: str
    error_type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class PromptRendered(msgspec.Struct, array_like=True, tag="prompt_rendered", frozen=True):
    """A render_only GenerateRequest's answer: its prompt's token ids and the sampling params it would run with."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams


class TokenizeResult(msgspec.Struct, array_like=True, tag="tokenized", frozen=True):
    request_id: str
    token_ids: list[int]
    max_model_len: int
    token_strs: list[str] = []  # when asked: one vocabulary string per token


class DetokenizeResult(msgspec.Struct, array_like=True, tag="detokenized", frozen=True):
    request_id: str
    text: str


class TokenizerInfoResult(msgspec.Struct, array_like=True, tag="tokenizer_info_result", frozen=True):
    request_id: str
    info: bytes  # a JSON object: the tokenizer's init arguments, its class and chat template (vLLM's shape)


# --------------------------------------------------------------------------------------------
# tokenizer <-> scheduler


class Sequenced(msgspec.Struct, tag="sq", array_like=True, frozen=True, gc=False):
    """A message in a sequenced stream between two peers (shared/delivery.Link): applied once, in order, and sent
    again until acknowledged. `body` is the message itself, encoded as the socket's union (never a Sequenced);
    `ack_stream` / `ack` acknowledge the reverse stream, so that acks ride on frames that go anyway."""

    stream: int
    seq: int
    body: msgspec.Raw
    ack_stream: int = 0
    ack: int = -1
    receiver: int = 0  # the sender's receiving state for the ack (shared/delivery.Link.receiver)
    gap: bool = False  # frames after `ack` wait there for a missing one: the peer sends it again at once


class Ack(msgspec.Struct, tag="ack", array_like=True, frozen=True):
    """Only an acknowledgement: the sender applied the peer's stream `stream` through `seq` (sent when no
    Sequenced frame went that way for shared/delivery.ACK_DELAY_S)."""

    stream: int
    seq: int
    receiver: int = 0  # see Sequenced
    gap: bool = False



class AddRequest(msgspec.Struct, array_like=True, tag="add", frozen=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    tenant: str = ""  # see GenerateRequest
    tenant_weight: float = 1.0
    tenant_priority: int = 0
    # structured outputs: the tokens the grammar forces at the start (compiler.fast_forward_tokens), output tokens
    # the prompt's prefill computes; the tokenizer shows them with the completion's first token
    forced_token_ids: list[int] = []
    cache_salt: str = ""  # see GenerateRequest: the root of the request's prefix-cache hash chain


class StopSequence(msgspec.Struct, array_like=True, tag="stopseq", frozen=True):
    """A stop string matched in one completion: finish it now."""

    request_id: str
    index: int


class ModelInfo(msgspec.Struct, array_like=True, tag="welcome", frozen=True):
    """What a tokenizer needs to validate prompts before they reach the scheduler."""

    max_model_len: int
    vocab_size: int
    max_num_tokens: int  # the most tokens one sequence can hold in the KV cache
    eos_token_ids: list[int]


class TokenDeltas(msgspec.Struct, tag="tokens", array_like=True, frozen=True, omit_defaults=True, gc=False):
    """One step's tokens for one tokenizer, as columns: row r is one completion's news this step.

    The columns are plain lists of ints and strings (no per-row struct): decoding costs msgspec a few
    list builds whatever the batch size. A row's token is -1 when the step sampled none for it (a prompt
    chunk that only scored prompt tokens, or an abort). Logprob columns cover only the rows listed in
    `logprob_rows` (requests that asked); `prompt_scores` only requests with prompt_logprobs, each at its row in
    `prompt_score_rows`.
    """

    request_ids: list[str]
    indices: list[int]  # the completion's index within its request (n > 1)
    token_ids: list[int]  # one per row; -1: none this step
    finish_reasons: list[int]  # a FinishReason, -1 while the completion runs
    num_cached_tokens: list[int]  # prompt tokens served from the prefix cache (the request's)
    logprob_rows: list[int] = []  # rows whose request asked for logprobs, ascending
    logprobs: list[float] = []  # aligned with logprob_rows: the sampled token's logprob
    top_token_ids: list[list[int]] = []  # aligned with logprob_rows; empty inner lists for logprobs=0
    top_logprobs: list[list[float]] = []
    prompt_scores: list[PromptScores] = []
    prompt_score_rows: list[int] = []  # aligned with prompt_scores: the row each belongs to

    def __len__(self) -> int:
        return len(self.request_ids)

    def columns_agree(self) -> bool:
        """Every per-row column has one entry per row, and the logprob columns agree: a frame that breaks
        this is dropped whole, never half applied."""
        rows = len(self.request_ids)
        if not (len(self.indices) == len(self.token_ids) == len(self.finish_reasons)
                == len(self.num_cached_tokens) == rows):
            return False
        num_lp = len(self.logprob_rows)
        return (len(self.logprobs) == num_lp and len(self.top_token_ids) == num_lp
                and len(self.top_logprobs) == num_lp and all(0 <= r < rows for r in self.logprob_rows)
                and len(self.prompt_score_rows) == len(self.prompt_scores)
                and all(0 <= r < rows for r in self.prompt_score_rows))


# --------------------------------------------------------------------------------------------
# scheduler -> api: state for /metrics and /health


MAX_TRACE_EVENTS = 16  # preemption and re-admission times one RequestTrace keeps


class RequestTrace(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True, gc=False):
    """One finished request as the scheduler saw it (collected only while the console is on): wall times
    (time.time() on the scheduler's host) for the api's request inspector."""

    request_id: str
    queued_at: float  # the AddRequest arrived
    finished_at: float
    finish_reason: int  # the first sequence's FinishReason
    num_prompt_tokens: int
    num_output_tokens: int  # over all n sequences
    num_cached_tokens: int
    scheduled_at: float = 0.0  # first admitted to a step (0: never ran)
    num_preemptions: int = 0
    preempted_at: list[float] = []  # the first MAX_TRACE_EVENTS preemptions
    rescheduled_at: list[float] = []  # admitted again after a preemption (same bound)


# Bucket upper bounds of the histograms the scheduler keeps (vLLM's, so that its dashboards read them unchanged)
REQUEST_PHASE_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
REQUEST_PHASES = ("queue", "prefill", "decode", "inference")  # the order of SchedulerStats.request_phases
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class HistogramCounts(msgspec.Struct, array_like=True, frozen=True):
    """A histogram the scheduler keeps: observations per bucket (not cumulative; one more than the bounds, the
    last for those above the top bound) and their sum."""

    counts: list[int]
    sum: float = 0.0


class SchedulerStats(msgspec.Struct, array_like=True, tag="stats", frozen=True):
    time: float
    num_running: int
    num_waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_cache_usage: float
    prefix_hit_tokens_total: int
    prefix_query_tokens_total: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_steps_total: int
    worker_ready: bool
    worker_alive: bool
    tokenizer_ids: list[str]
    tokenizer_requests_total: list[int]  # requests each tokenizer (aligned with tokenizer_ids) has sent
    max_model_len: int = 0
    problem: str = ""  # why the worker counts as hung (its step ran past the bound); "" while it progresses
    num_preempted: int = 0  # requests waiting again after a preemption
    prefill_step_seconds_total: float = 0.0  # wall time of steps that computed prompt tokens (any mix)
    decode_step_seconds_total: float = 0.0  # wall time of steps that only decoded
    host_seconds_total: float = 0.0  # the scheduler's own time handling results and planning steps
    traces: list[RequestTrace] = []  # requests finished since the previous snapshot (console on only)
    tenant_names: list[str] = []  # tenants seen (keys file in use), with these columns aligned to them:
    tenant_waiting: list[int] = []  # sequences waiting now
    tenant_running: list[int] = []  # sequences running now
    tenant_admitted_total: list[int] = []  # requests admitted (first time) so far
    tenant_queue_seconds_total: list[float] = []  # their time from arrival to first admission, summed
    num_swapped_total: int = 0  # of the preemptions, those whose blocks went to host memory (not recomputed)
    # requests that left, per phase of REQUEST_PHASES over REQUEST_PHASE_BUCKETS_S (empty: none kept)
    request_phases: list[HistogramCounts] = []
    step_tokens: HistogramCounts | None = None  # tokens each step scheduled, over STEP_TOKEN_BUCKETS


class ReplicaAddress(msgspec.Struct, array_like=True, frozen=True):
    """Where one engine replica's scheduler takes tokenizers and publishes stats (tcp, reachable by peers)."""

    replica_id: int
    scheduler: str
    stats: str
    instance: str  # the scheduler's instance id: a new one means the replica restarted


class ApiJoin(msgspec.Struct, array_like=True, tag="api_join", frozen=True):
    """An api joins the registry (repeated every heartbeat interval): where tokenizers reach it."""

    address: str


class ReplicaJoin(msgspec.Struct, array_like=True, tag="replica_join", frozen=True):
    """Another replica's scheduler joins the registry (repeated every heartbeat interval)."""

    replica: ReplicaAddress


class Directory(msgspec.Struct, array_like=True, tag="directory", frozen=True):
    """The registry's view: every live api and every live replica (the registry's own replica included)."""

    apis: list[str]
    replicas: list[ReplicaAddress]
    registry_replica_id: int  # the replica whose scheduler keeps this registry


# --------------------------------------------------------------------------------------------
# launcher -> api: the supervised processes, a JSON file in the runtime dir (the console's process table)


class ProcessEntry(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str  # tokenizer0, api0, worker0, scheduler, r1-worker0 ...
    module: str  # api | tokenizer | scheduler | worker
    pid: int
    started_at: float  # time.time() of its spawn
    num_restarts: int = 0
    replica: int | None = None
    stopped: bool = False  # the kernel reports it stopped (SIGSTOP, a debugger)
    restart_delay_s: float | None = None  # failing at start: gone, its replacement due this long after it failed


PROCESS_TABLE_FILE = "processes.json"  # in the runtime dir


class ProcessTable(msgspec.Struct, frozen=True, omit_defaults=True):
    """What `pagoda serve` supervises, rewritten whenever it changes."""

    launcher_pid: int
    time: float
    processes: list[ProcessEntry]
    down_replicas: list[int] = []
    # replicas whose restarts keep failing at start: replica -> the delay before its next start (down meanwhile)
    replica_restart_delays: dict[int, float] = {}


# --------------------------------------------------------------------------------------------
# worker -> its grammar process (services/worker/grammar_process.py), over a pipe, and back


class MaskApply(msgspec.Struct, tag="mapply", array_like=True, omit_defaults=True, gc=False, frozen=True):
    """Drop these sequences' matchers, then add these (prompt trimmed: token_ids are the generated ones only)."""

    finished_seq_ids: list[int]
    new_requests: list[NewRequest] = []


class MaskAccept(msgspec.Struct, tag="maccept", array_like=True, gc=False, frozen=True):
    """Sampled tokens of constrained sequences, one list pair per step, oldest first."""

    seq_ids: list[list[int]]
    token_ids: list[list[int]]


class MaskFill(msgspec.Struct, tag="mfill", array_like=True, gc=False, frozen=True):
    """Accept these steps' tokens, then fill the masks of the step whose sampled sequences are seq_ids (batch
    order) into shared-memory slot `slot`; answered by one MaskReady."""

    job_id: int
    accept_seq_ids: list[list[int]]
    accept_token_ids: list[list[int]]
    seq_ids: list[int]
    slot: int


class MaskPrepare(msgspec.Struct, tag="mprepare", array_like=True, frozen=True):
    """Compile this constraint now (a GrammarDef came); answered by a MaskCompiled whenever it is built, between
    any other answers."""

    hash: str
    constraint: StructuredOutputs


class MaskReset(msgspec.Struct, tag="mreset", array_like=True, frozen=True):
    """Forget every sequence (a new scheduler)."""


class MaskStop(msgspec.Struct, tag="mstop", array_like=True, frozen=True):
    """Exit."""


class MaskStarted(msgspec.Struct, tag="mstarted", array_like=True, frozen=True):
    """The grammar process attached the shared masks and built its tokenizer (first message it sends)."""

    pid: int


class MaskBusy(msgspec.Struct, tag="mbusy", array_like=True, frozen=True):
    """Still filling job_id: waiting for a grammar to compile (sent every second meanwhile; a silent process is
    a hung one)."""

    job_id: int


class MaskCompiled(msgspec.Struct, tag="mcompiled", array_like=True, frozen=True):
    """A MaskPrepare's constraint is built (or failed to build)."""

    hash: str


class MaskReady(msgspec.Struct, tag="mready", array_like=True, omit_defaults=True, gc=False, frozen=True):
    """The masks of a MaskFill: rows [K] are the batch rows whose masks fill the slot's first K rows."""

    job_id: int
    rows: list[int]
    fill_s: float  # accept + fill, in the grammar process
    ended_at: float  # its time.perf_counter() when they were ready (CLOCK_MONOTONIC: one clock per host)
    failed_seq_ids: list[int] = []  # sequences it could not take (their matcher failed to build): dropped there
    failed_messages: list[str] = []
    # sequences that need no more masks: their thinking budget's block closed and they have no grammar (dropped there)
    released_seq_ids: list[int] = []


# One union per socket direction; decoders are built once per process from these.
# an api's Heartbeat opens its sequenced stream to a tokenizer it registers (services/api/pool.py)
ApiToTokenizer = (GenerateRequest | AbortRequest | TokenizeRequest | DetokenizeRequest | TokenizerInfoRequest
                  | Heartbeat | Sequenced | Ack)
TokenizerToApi = (TokenizerHello | Heartbeat | Accepted | TextDeltas | RenderedRows | RequestFailed | TokenizeResult
                  | DetokenizeResult | TokenizerInfoResult | PromptRendered | Sequenced | Ack)
TokenizerToScheduler = (TokenizerHello | Heartbeat | AddRequest | AbortRequest | StopSequence | ApiJoin | ReplicaJoin
                        | Sequenced | Ack)
SchedulerToTokenizer = ModelInfo | TokenDeltas | RequestFailed | Heartbeat | Directory | Sequenced | Ack
SchedulerToWorker = StepPlan | GrammarDef | Shutdown | Heartbeat  # heartbeats double as subscription probes
WorkerToScheduler = WorkerReady | StepResult | Heartbeat | GrammarCompiled
SchedulerToApi = SchedulerStats
WorkerToMaskProcess = MaskApply | MaskAccept | MaskFill | MaskPrepare | MaskReset | MaskStop
MaskProcessToWorker = MaskStarted | MaskBusy | MaskReady | MaskCompiled
