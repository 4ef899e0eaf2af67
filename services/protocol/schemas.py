"""HTTP request bodies of the OpenAI routes as msgspec Structs, checked and turned into wire messages."""

from __future__ import annotations

import json
import logging
import re
from typing import Annotated, Any, TypeVar

import msgspec

from pagoda.services.protocol.chat_output import ChatOutputSpec
from pagoda.services.protocol.tools import named_schema, required_schema, tool_parameters
from pagoda.services.protocol.vllm import (
    DEPRECATED_FIELDS,
    backend_disables_whitespace,
    check_guided_backend,
    unsupported_reason,
)
from pagoda.shared.errors import InvalidRequestError
from pagoda.shared.messages import (
    LOGIT_BIAS_LIMIT,
    MAX_INT32,
    MAX_INT64,
    MAX_TOP_LOGPROBS,
    MIN_INT64,
    MIN_SAMPLING_TEMPERATURE,
    TEMPERATURE_RAISED_WARNING,
    ChatMessage,
    GenerateRequest,
    RepetitionDetection,
    SamplingParams,
    StructuredOutputs,
    ToolCallMessage,
    check_cache_salt,
    check_prompt_cache_key,
    raised_temperature,
)

log = logging.getLogger(__name__)

MAX_JSON_DEPTH = 128  # arrays and objects nested deeper than this are refused before decoding
# developer turns reach the template as vLLM gives them (conversation.developer_as_system)
CHAT_ROLES = ("system", "developer", "user", "assistant")

T = TypeVar("T")


class RepetitionDetectionBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's RepetitionDetectionParams as a request sends it (checked by shared.messages.RepetitionDetection)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool | None = None  # vLLM's default: true once stream_options is given
    continuous_usage_stats: bool | None = None  # vLLM's: every chunk carries the usage so far
    include_obfuscation: bool | None = None  # OpenAI's: chunks padded with an `obfuscation` field; only false here


class _GenerationBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields the two generation routes share; every one is honoured or rejected, never ignored."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # metadata only: they change nothing about the answer
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # OpenAI's: with data-parallel replicas, requests with the same key (and cache_salt) go to the same replica
    prompt_cache_key: str | None = None
    request_id: str | None = None  # vLLM's: the response's id is "cmpl-" / "chatcmpl-" + it (X-Request-Id wins)
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    # vLLM's: taken and changes nothing. Text comes from the fast (tokenizers) decoder, which has no such switch,
    # as in vLLM's detokenizer for fast tokenizers; true is its default, and clients send it
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = None
    add_special_tokens: bool | None = None
    return_token_ids: bool | None = None  # choices carry token_ids, the response the prompt's (vLLM's)
    return_tokens_as_token_ids: bool | None = None  # logprob tokens read "token_id:N" (vLLM's)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top k (-1: every token)
    allowed_token_ids: list[int] | None = None  # vLLM's: only these ids may be sampled
    logprob_token_ids: list[int] | None = None  # vLLM's: these ids' logprobs at each generated position (logprobs on)
    bad_words: list[str] | None = None  # vLLM's: each word's last token is banned after its others
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache blocks
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: what the context takes)
    truncation_side: str | None = None  # vLLM's: "left" (default: keep the last k) or "right" (the first k)
    # beam search, vLLM's fields (services/protocol/schemas._beam_kwargs)
    use_beam_search: bool | None = None
    best_of: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    # structured outputs, vLLM's extensions (response_format is OpenAI's)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # vLLM's, deprecated: names of pagoda's one grammar engine
    structural_tag: str | None = None  # vLLM's, deprecated: structured_outputs.structural_tag
    # vLLM's: at most this many tokens inside the think block (chat with --reasoning-parser); -1 or null: no budget
    thinking_token_budget: int | None = None
    # vLLM's: end a completion once its output ends in min_count copies of one pattern (finish_reason "repetition")
    repetition_detection: RepetitionDetectionBody | None = None
    # vLLM's: a streamed completion's chunks carry at least this many new tokens after its first (>= 1; at least the
    # server's --stream-interval; null: the server's)
    stream_interval: int | None = None

    @property
    def include_usage(self) -> bool:
        options = self.stream_options
        return options is not None and options.include_usage is not False

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def deprecated_fields(self) -> list[str]:
        """vLLM-deprecated fields this body uses (accepted; the response header names them)."""
        return [name for name in DEPRECATED_FIELDS if getattr(self, name, None) is not None]


class CompletionBody(_GenerationBody):
    prompt: str | list[str | int | list[int]]
    # omitted: 16 (OpenAI's and vLLM's default); null: what the context leaves (vLLM's get_max_tokens)
    max_tokens: int | None | msgspec.UnsetType = msgspec.UNSET
    logprobs: int | None = None
    echo: bool | None = None


# Turns of one conversation (chat messages, Responses input items), and tool calls over all its turns. Each costs
# the api ~17 us to convert and the tokenizer's template more: 200k tool calls (27 MiB) held an api's loop for
# ~3.4 s. 16,384 already outnumbers what a 128k-token context holds (a turn or call is 10 tokens or more).
MAX_TURNS = 16_384


class MessageBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: str
    # parts are checked by hand so that an image part gets a clear message, not "unknown field"
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_TURNS)] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns
    reasoning: str | None = None  # an earlier answer's reasoning sent back: given to the template (vLLM's)
    reasoning_content: str | None = None  # its older name
    # The rest of an answer's message, as the openai SDK hands it back (`message.model_dump()` writes every field,
    # null where the answer had none; a parse() answer adds `parsed`): taken where it adds nothing to the turn.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    parsed: Any = None  # the SDK's own parse of `content`, which is kept


# vLLM's reasoning_effort values (OpenAI's, and "max" of DeepSeek V4's templates): the chat template's variable
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class ChatBody(_GenerationBody):
    messages: Annotated[list[MessageBody], msgspec.Meta(max_length=MAX_TURNS)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, str | int | float | bool] | None = None
    echo: bool | None = None  # vLLM's: the reply's content starts with the last message (the one continued)
    service_tier: str | None = None  # OpenAI's: SERVICE_TIERS only (the Responses API's too)
    # vLLM's: the template's `reasoning_effort`, and `enable_thinking` unless chat_template_kwargs sets it
    reasoning_effort: str | None = None
    include_reasoning: bool | None = None  # vLLM's: false drops the reasoning the parser separates (default true)
    # vLLM's: retrieval documents, the template's `documents` (Command-R / Granite RAG templates); each renders once,
    # as a turn does, so they are bounded as turns are, and their text counts in --max-prompt-bytes (prompt_bytes)
    documents: Annotated[list[dict[str, str]], msgspec.Meta(max_length=MAX_TURNS)] | None = None
    # vLLM's: a Jinja template (or the name of one of the model's) that renders this prompt; served only under
    # --trust-request-chat-template, its text counted in --max-prompt-bytes
    chat_template: str | None = None


# OpenAI's service tiers that name this server's one tier; flex, scale and priority would be ignored, so are refused
SERVICE_TIERS = (None, "auto", "default")


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[MessageBody], msgspec.Meta(max_length=MAX_TURNS)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = None
    tools: list[dict[str, Any]] | None = None  # chat: rendered into the prompt as generation would
    chat_template_kwargs: dict[str, str | int | float | bool] | None = None
    chat_template: str | None = None  # as chat's


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[int]
    model: str | None = None


# --------------------------------------------------------------------------------------------
# decoding


_FIELD_RE = re.compile(r"(unknown|missing required) field `([^`]*)`")
_PATH_RE = re.compile(r" - at `\$\.?([^`]*)`$")


_JSON_STRING_RE = re.compile(rb'"(?:[^"\\]|\\.)*"')
_EMPTY_PAIR_RE = re.compile(rb"\[\]|\{\}")
_ESCAPE_RE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)  # a JSON escape; \uXXXX gives its hex digits
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def check_json_depth(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
    """InvalidRequestError if arrays/objects nest deeper than `max_depth` (the decoder recurses per level).

    C-speed passes only: strings are cut out, everything but brackets dropped, then innermost pairs are
    removed once per allowed level; brackets left over mean a deeper (or unbalanced) body."""
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return
    brackets = _JSON_STRING_RE.sub(b"", data).translate(None, _NOT_BRACKETS)
    for _ in range(max_depth):
        brackets, count = _EMPTY_PAIR_RE.subn(b"", brackets)
        if not brackets or count == 0:
            break
    if brackets:
        raise InvalidRequestError(f"the request body nests arrays or objects more than {max_depth} deep "
                                  "(or is not valid JSON)")


def decode_body(data: bytes, kind: type[T]) -> T:
    """The body as a `kind`, or InvalidRequestError naming the offending parameter."""
    check_json_depth(data)
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(_decode_error(data, exc)) from None
    except RecursionError:
        raise InvalidRequestError(f"the request body nests more than {MAX_JSON_DEPTH} deep") from None


def _decode_error(data: bytes, exc: msgspec.DecodeError) -> str:
    lone = _lone_surrogate(data)
    if lone is not None:  # JSON's grammar allows it, Unicode text does not (msgspec may call it "truncated")
        start, digits = lone
        return (f"the request body is not valid JSON: a string holds the unpaired UTF-16 surrogate \\u{digits} "
                f"(byte {start}), which no Unicode text can hold (a surrogate pair cut in half?)")
    return f"the request body is not valid JSON: {exc}"


def _lone_surrogate(data: bytes) -> tuple[int, str] | None:
    """The first \\uD800-\\uDFFF escape not in a high-then-low pair: (its byte offset, its hex digits)."""
    high: re.Match[bytes] | None = None  # a high surrogate waiting for its low half right after it
    for escape in _ESCAPE_RE.finditer(data):
        code = int(escape.group(1), 16) if escape.group(1) else -1
        if high is not None:
            if 0xDC00 <= code <= 0xDFFF and escape.start() == high.end():
                high = None
                continue
            break
        if 0xD800 <= code <= 0xDBFF:
            high = escape
        elif 0xDC00 <= code <= 0xDFFF:
            return escape.start(), escape.group(1).decode()
    if high is not None:
        return high.start(), high.group(1).decode()
    return None


def _validation_error(text: str) -> InvalidRequestError:
    path_match = _PATH_RE.search(text)
    path = path_match.group(1) if path_match else ""
    path = path.replace("[...]", "")  # a value of an object such as logit_bias: name the object
    detail = text[:path_match.start()] if path_match else text
    field_match = _FIELD_RE.search(detail)
    if field_match:
        param = f"{path}.{field_match.group(2)}" if path else field_match.group(2)
        if field_match.group(1) == "unknown":
            return InvalidRequestError(f"Unrecognized request argument supplied: {param}{unsupported_reason(param)}",
                                       param=param)
        return InvalidRequestError(f"Missing required parameter: {param}", param=param)
    if not path:
        return InvalidRequestError(f"the request body must be a JSON object: {detail}")
    return InvalidRequestError(f"Invalid value for '{path}': {detail}", param=path)


def require(ok: bool, param: str, message: str) -> None:
    """An InvalidRequestError (a 400 naming `param`) unless ok."""
    if not ok:
        raise InvalidRequestError(message, param=param)


def reject_unknown_keys(obj: dict[str, Any], allowed: set[str], param: str, shape: str) -> None:
    """A 400 naming the first key of `obj` outside `allowed` (`shape` says what the object may hold)."""
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise InvalidRequestError(f"Unrecognized argument {unknown[0]!r}: {shape}", param=f"{param}.{unknown[0]}")


_require = require


# --------------------------------------------------------------------------------------------
# bodies -> wire messages


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else stop


def _common_checks(body: _GenerationBody) -> None:
    _require(not body.store, "store", "store is not supported: nothing is kept after the answer")
    _require(body.stream_options is None or bool(body.stream), "stream_options",
             "stream_options is only allowed when stream is true")
    _require(not (body.stream_options and body.stream_options.include_obfuscation),
             "stream_options.include_obfuscation", "stream obfuscation is not implemented: chunks carry no "
             "obfuscation field")
    _require(body.prompt_logprobs is None or not body.stream, "prompt_logprobs",
             "`prompt_logprobs` are not available when `stream=True`.")
    _require(body.priority is None or MIN_INT64 <= body.priority <= MAX_INT64, "priority",
             f"priority must be an integer in [{MIN_INT64}, {MAX_INT64}]")


# The sampling fields a model's generation config gives defaults for (vLLM's); beam search takes only the
# temperature (its beams are ranked by the model's own log-probabilities: the others would reshape them).
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _sampling_kwargs(body: _GenerationBody, defaults: dict[str, float | int]) -> dict[str, Any]:
    """SamplingParams fields the client set; of the others, those the model's generation config sets (`defaults`,
    services/tokenizer/generation_config.py), and SamplingParams' own defaults for the rest. A field the client
    sent wins even when it equals SamplingParams' default: a body field left out (or null) is None."""
    names = ("n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p",
             "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
             "include_stop_str_in_output", "prompt_logprobs", "truncate_prompt_tokens", "truncation_side",
             "thinking_token_budget", "stream_interval")
    kwargs = {name: getattr(body, name) for name in names if getattr(body, name) is not None}
    for name in ("temperature",) if body.use_beam_search else GENERATION_DEFAULT_FIELDS:
        if name not in kwargs and name in defaults:
            kwargs[name] = defaults[name]
    if "temperature" in kwargs and (raised := raised_temperature(kwargs["temperature"])) is not None:
        log.warning(TEMPERATURE_RAISED_WARNING, kwargs["temperature"], MIN_SAMPLING_TEMPERATURE, raised)
        kwargs["temperature"] = raised  # vLLM's SamplingParams: a temperature in (0, 0.01) is sampled at 0.01
    if kwargs.get("seed") == -1:  # vLLM's SamplingParams read -1 as no seed
        del kwargs["seed"]
    kwargs["stop"] = _stop_list(body.stop)
    if body.logit_bias:
        kwargs["logit_bias"] = _logit_bias(body.logit_bias)
    if body.allowed_token_ids is not None:
        _require(len(body.allowed_token_ids) > 0, "allowed_token_ids", "allowed_token_ids must not be empty")
        kwargs["allowed_token_ids"] = body.allowed_token_ids
    if body.bad_words:
        kwargs["bad_words"] = body.bad_words
    if body.logprob_token_ids:  # an empty list is vLLM's "not set" (the top logprobs as usual)
        kwargs["logprob_token_ids"] = body.logprob_token_ids
    if body.repetition_detection is not None:
        watch = body.repetition_detection
        kwargs["repetition_detection"] = RepetitionDetection(
            max_pattern_size=watch.max_pattern_size, min_pattern_size=watch.min_pattern_size,
            min_count=watch.min_count)
    if body.guided_decoding_backend is not None:
        check_guided_backend(body.guided_decoding_backend)
    constraint = structured_outputs(body)
    if constraint is not None:
        kwargs["structured_outputs"] = constraint
    kwargs.update(_beam_kwargs(body))
    return kwargs


BEAM_FIELDS = ("use_beam_search", "best_of", "length_penalty", "early_stopping")


def beam_search_available() -> bool:
    """Whether this engine's SamplingParams carry beam search (the decoding-modes work, issue 26)."""
    return "use_beam_search" in SamplingParams.__struct_fields__


def _beam_kwargs(body: _GenerationBody) -> dict[str, Any]:
    """vLLM's beam-search fields, for SamplingParams to check and the engine to run; until the engine has beam
    search, only their no-op values pass (best_of = n: every sampled completion is returned)."""
    given = {name: getattr(body, name) for name in BEAM_FIELDS if getattr(body, name) is not None}
    if beam_search_available():
        _require(not (body.use_beam_search and body.stream), "stream",
                 "beam search is not streamed: its beams change until the search ends")
        return given
    _require(not given.get("use_beam_search"), "use_beam_search",
             "beam search is not available yet in this server: use_beam_search cannot be true")
    _require(given.get("best_of", body.n or 1) == (body.n or 1), "best_of",
             "best_of other than n needs beam search, which is not available yet in this server")
    _require(given.get("length_penalty", 1.0) == 1.0, "length_penalty",
             "length_penalty needs beam search, which is not available yet in this server")
    _require(given.get("early_stopping", False) is False, "early_stopping",
             "early_stopping needs beam search, which is not available yet in this server")
    return {}


# vLLM's StructuredOutputsParams fields: a constraint, and its options (StructuredOutputs says what each does)
_OPTION_KEYS = frozenset({"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                          "disable_fallback"})
_STRUCTURED_KEYS = frozenset({"json", "regex", "choice", "grammar", "json_object", "structural_tag"}) | _OPTION_KEYS


def structured_outputs(body: _GenerationBody) -> StructuredOutputs | None:
    """The one constraint a body asks for (response_format, structured_outputs or a guided_* field)."""
    given: list[tuple[str, StructuredOutputs]] = []
    if body.response_format is not None:
        constraint = _response_format(body.response_format)
        if constraint is not None:
            given.append(("response_format", constraint))
    if body.structured_outputs is not None:
        unknown = sorted(set(body.structured_outputs) - _STRUCTURED_KEYS)
        _require(not unknown, "structured_outputs",
                 f"structured_outputs supports {sorted(_STRUCTURED_KEYS)}; not {unknown}")
        try:
            constraint = msgspec.convert(body.structured_outputs, StructuredOutputs)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"Invalid value for 'structured_outputs': {exc}",
                                      param="structured_outputs") from None
        given.append(("structured_outputs", constraint))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{name}")
        if value is not None:
            given.append((f"guided_{name}", StructuredOutputs(**{name: value})))
    if body.structural_tag is not None:
        given.append(("structural_tag", StructuredOutputs(structural_tag=body.structural_tag)))
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequestError(f"give only one of {', '.join(name for name, _ in given)}", param=given[1][0])
    name, constraint = given[0]
    if body.guided_decoding_backend is not None and backend_disables_whitespace(body.guided_decoding_backend):
        constraint = msgspec.structs.replace(constraint, disable_any_whitespace=True)
    try:
        return constraint.validate()
    except InvalidRequestError as exc:
        raise InvalidRequestError(exc.message, param=_field_param(exc.param or "", name)) from None


_TAG_PARAM = "structured_outputs.structural_tag"


def _field_param(param: str, name: str) -> str:
    """A constraint error's param under the body field `name` that asked for it: the field itself, or for a part of
    a structural tag's format, its path under that field (response_format.format.tags[2].content)."""
    if name == "structured_outputs" and param.rpartition(".")[2] in _OPTION_KEYS:
        return param  # an option of the structured_outputs object: named as sent
    if not param.startswith(f"{_TAG_PARAM}.format"):
        return name
    return (_TAG_PARAM if name == "structured_outputs" else name) + param[len(_TAG_PARAM):]


def constraint_param(body: _GenerationBody) -> str | None:
    """The body field that asked for a constraint (None: none did). A grammar that does not compile is refused
    where the tokenizer is, under SamplingParams' name (structured_outputs); the client is told this field."""
    if isinstance(body, ChatBody) and _tool_choice(body, _offered_tools(body))[0] in ("required", "named"):
        return "tools"
    names = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
             "structural_tag")
    return next((name for name in names if getattr(body, name) is not None), None)


def _response_format(response_format: dict[str, Any]) -> StructuredOutputs | None:
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "structural_tag":
        return _structural_tag_format(response_format)
    _require(kind == "json_schema", "response_format.type",
             f"response_format type must be text, json_object, json_schema or structural_tag, got {kind!r}")
    spec = response_format.get("json_schema")
    _require(isinstance(spec, dict), "response_format.json_schema",
             "response_format json_schema needs a json_schema object {name, schema, strict}")
    assert isinstance(spec, dict)
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    _require(not unknown, "response_format.json_schema", f"unknown json_schema fields {unknown}")
    _check_json_schema_fields(spec)
    schema = spec.get("schema", {"type": "object"})  # OpenAI: a missing schema allows any object
    _require(isinstance(schema, dict), "response_format.json_schema.schema", "schema must be a JSON object")
    return StructuredOutputs(json=schema)


def _structural_tag_format(response_format: dict[str, Any]) -> StructuredOutputs:
    """vLLM's `{"type": "structural_tag", "structures": [...], "triggers": [...]}` (its legacy form) or xgrammar's
    `{"type": "structural_tag", "format": {...}}`: the same constraint as structured_outputs'."""
    return StructuredOutputs(structural_tag=json.dumps(response_format))


def _check_json_schema_fields(spec: dict[str, Any]) -> None:
    """json_schema's name (a non-empty string), strict (a boolean) and description (a string), where given: a 400
    naming the field, not a value taken and echoed."""
    name, strict, description = spec.get("name"), spec.get("strict"), spec.get("description")
    param = "response_format.json_schema"
    _require(name is None or (isinstance(name, str) and bool(name)), f"{param}.name",
             "json_schema name must be a non-empty string")
    _require(strict is None or isinstance(strict, bool), f"{param}.strict", "json_schema strict must be a boolean")
    _require(description is None or isinstance(description, str), f"{param}.description",
             "json_schema description must be a string")


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys, so as strings: "50256" -> 50256. A bias past OpenAI's [-100, 100]
    is clamped to it, as vLLM's server does (SamplingParams.from_optional); a value that is not a number is a 400
    (the body's decoding)."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        _require(key.isascii() and key.isdigit() and len(key) <= 10, "logit_bias",
                 f"logit_bias keys must be token ids written as decimal integers, got {key!r}")
        out[int(key)] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, value))
    return out


def completion_params(body: CompletionBody, max_logprobs: int = MAX_TOP_LOGPROBS,
                      defaults: dict[str, float | int] | None = None) -> SamplingParams:
    """`defaults`: the model's generation-config sampling defaults. An omitted max_tokens is 16, the completions
    API's own default (vLLM's too), so the generation config's max_tokens does not apply here; a null one is unset,
    as vLLM's: the generation config's max_tokens or what the context leaves after the prompt (chat's unset)."""
    _common_checks(body)
    scores_prompt = bool(body.echo) and body.logprobs is not None  # echo's logprobs cover the prompt too
    _require(not (scores_prompt and body.stream), "echo",
             "echo together with logprobs is not supported when streaming")
    max_tokens = 16 if body.max_tokens is msgspec.UNSET else body.max_tokens
    kwargs = _sampling_kwargs(body, defaults or {})
    if scores_prompt and body.prompt_logprobs is None:  # vLLM's: prompt_logprobs, else echo's logprobs
        kwargs["prompt_logprobs"] = body.logprobs
    params = SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=body.logprobs).validate(max_logprobs)
    _require(not params.bounds_thinking, "thinking_token_budget",
             "thinking_token_budget bounds the think block of a chat answer, which --reasoning-parser reads; "
             "/v1/completions renders no chat template and reads no think block (-1 or null: no budget)")
    return params


def completion_prompts(prompt: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """One entry per prompt: text, or token ids."""
    if isinstance(prompt, str):
        return [prompt]
    _require(len(prompt) > 0, "prompt", "prompt must not be empty")
    if all(isinstance(p, int) for p in prompt):
        ids: list[int] = prompt  # type: ignore[assignment]
        _require(all(0 <= t <= MAX_INT32 for t in ids), "prompt", f"token ids must be integers in [0, {MAX_INT32}]")
        return [ids]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    _require(all(isinstance(p, list) for p in prompt), "prompt",
             "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids")
    for ids in prompt:
        _require(len(ids) > 0 and all(0 <= t <= MAX_INT32 for t in ids), "prompt",  # type: ignore[union-attr]
                 f"each token id list must be non-empty and hold token ids in [0, {MAX_INT32}]")
    return list(prompt)  # type: ignore[arg-type]


def completion_requests(body: CompletionBody, base_id: str, arrival_time: float,
                        max_logprobs: int = MAX_TOP_LOGPROBS, max_completions: int | None = None,
                        defaults: dict[str, float | int] | None = None) -> list[GenerateRequest]:
    """One GenerateRequest per prompt; several prompts get ids suffixed -0, -1, ... max_completions: the most
    completions (prompts x n, or x best_of) the request may ask for (a list of many short prompts times a large n
    would otherwise hold the engine and the processes' memory from one request); None: no bound."""
    params = completion_params(body, max_logprobs, defaults)
    cache_salt = check_cache_salt(body.cache_salt)
    prompt_cache_key = check_prompt_cache_key(body.prompt_cache_key)
    prompts = completion_prompts(body.prompt)
    per_prompt = max(params.n, params.best_of or 1)
    _require(max_completions is None or len(prompts) * per_prompt <= max_completions, "prompt",
             f"the request asks for {len(prompts)} prompts x {per_prompt} completions each; this server accepts at "
             f"most {max_completions} completions a request (--max-completions-per-request)")
    requests = []
    for i, prompt in enumerate(prompts):
        request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        requests.append(GenerateRequest(
            request_id, params, prompt_text=text, prompt_token_ids=ids,
            add_special_tokens=True if body.add_special_tokens is None else body.add_special_tokens,
            priority=body.priority or 0, arrival_time=arrival_time, return_prompt_text=bool(body.echo),
            return_token_ids=bool(body.return_token_ids), cache_salt=cache_salt, prompt_cache_key=prompt_cache_key))
    return requests


# The fields of an answer's message that a client sends back with it (the openai SDK's model_dump() writes them, null
# where the answer had none) and no template renders: taken null (annotations also empty), else refused, on the
# server and in LLM.chat alike (services/tokenizer/conversation.py). field -> why a value is refused.
ANSWER_FIELDS = {
    "refusal": "a refusal is not rendered: send its text as content",
    "annotations": "annotations (citations) are not rendered",
    "audio": "audio answers are not made here",
    "function_call": "the deprecated function_call is not supported; use tool_calls",
}


def check_answer_fields(message: dict[str, Any], param: str) -> None:
    """A 400 naming `param`.field for the first of ANSWER_FIELDS that the message holds a value in."""
    for name, reason in ANSWER_FIELDS.items():
        value = message.get(name)
        _require(value is None or (name == "annotations" and value == []), f"{param}.{name}", reason)


def chat_messages(messages: list[MessageBody], param: str = "messages") -> list[ChatMessage]:
    _require(len(messages) > 0, param, "messages must not be empty")
    num_calls = sum(len(m.tool_calls or ()) for m in messages)
    _require(num_calls <= MAX_TURNS, param, f"a conversation holds at most {MAX_TURNS} tool calls, got {num_calls}")
    return [_chat_message(m, f"{param}[{i}]") for i, m in enumerate(messages)]


def _chat_message(message: MessageBody, param: str) -> ChatMessage:
    _require(message.role != "function", f"{param}.role", "the deprecated function role is not supported; "
                                                            "use tool")
    _require(message.role in CHAT_ROLES or message.role == "tool", f"{param}.role",
             f"role must be one of {', '.join(CHAT_ROLES)}, tool, got {message.role!r}")
    _require(message.tool_calls is None or message.role == "assistant", f"{param}.tool_calls",
             "only assistant messages carry tool_calls")
    check_answer_fields({name: getattr(message, name) for name in ANSWER_FIELDS}, param)
    _require((message.tool_call_id is not None) == (message.role == "tool"), f"{param}.tool_call_id",
             "tool messages need a tool_call_id (and only they have one)")
    tool_calls = _message_tool_calls(message.tool_calls or [], f"{param}.tool_calls")
    content = message.content
    if content is None and tool_calls:
        content = ""
    _require(content is not None, f"{param}.content", "content is required")
    texts: list[str] = []
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type")
            _require(kind == "text", f"{param}.content[{j}].type",
                     f"only text content parts are supported, got {kind!r}")
            _require(set(part) <= {"type", "text"} and isinstance(part.get("text"), str),
                     f"{param}.content[{j}]", "a text part is {\"type\": \"text\", \"text\": string}")
            texts.append(part["text"])
        content = "\n".join(texts)
    assert isinstance(content, str)
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    return ChatMessage(message.role, content, message.name, tool_calls,
                       message.tool_call_id, [len(text) for text in texts],
                       reasoning if message.role == "assistant" else None)


def _message_tool_calls(calls: list[dict[str, Any]], param: str) -> list[ToolCallMessage]:
    out = []
    for i, call in enumerate(calls):
        function = call.get("function")
        ok = (isinstance(call.get("id"), str) and call.get("type", "function") == "function"
              and isinstance(function, dict) and isinstance(function.get("name"), str)
              and isinstance(function.get("arguments"), str))
        _require(ok, f"{param}[{i}]", 'a tool call is {"id": string, "type": "function", "function": '
                                      '{"name": string, "arguments": string}}')
        assert isinstance(function, dict)
        out.append(ToolCallMessage(call["id"], function["name"], function["arguments"]))
    return out


# --------------------------------------------------------------------------------------------
# tools


def _tools(body: ChatBody | TokenizeBody) -> list[dict[str, Any]]:
    tools = body.tools or []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        ok = (tool.get("type") == "function" and isinstance(function, dict)
              and isinstance(function.get("name"), str) and function["name"]
              and isinstance(function.get("parameters", {}), dict))
        _require(ok, f"tools[{i}]", 'a tool is {"type": "function", "function": {"name": string, '
                                    '"description"?: string, "parameters"?: JSON schema}}')
    names = [t["function"]["name"] for t in tools]
    _require(len(set(names)) == len(names), "tools", "tool names must be unique")
    return tools


def _offered_tools(body: ChatBody) -> list[dict[str, Any]]:
    """The tools the model may call: all of them, or the subset OpenAI's allowed_tools tool_choice names (the
    others are not rendered: the model is offered those alone; OpenAI keeps them in the prompt for its cache)."""
    tools = _tools(body)
    allowed = _allowed_tools(body.tool_choice, tools)
    return tools if allowed is None else [t for t in tools if t["function"]["name"] in allowed]


def _allowed_tools(choice: Any, tools: list[dict[str, Any]]) -> set[str] | None:
    """The names of an allowed_tools tool_choice ({"type": "allowed_tools", "allowed_tools": {"mode": "auto" |
    "required", "tools": [{"type": "function", "function": {"name"}}, ...]}}: pydantic-ai sends it for a subset
    of tools to choose from), or None for another tool_choice."""
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
        return None
    reject_unknown_keys(choice, {"type", "allowed_tools"}, "tool_choice",
                        'this tool_choice is {"type", "allowed_tools"}')
    allowed = choice.get("allowed_tools")
    _require(isinstance(allowed, dict) and set(allowed) <= {"mode", "tools"}
             and allowed.get("mode") in ("auto", "required") and isinstance(allowed.get("tools"), list)
             and len(allowed["tools"]) > 0, "tool_choice.allowed_tools",
             'allowed_tools is {"mode": "auto" | "required", "tools": [{"type": "function", "function": {"name"}}, '
             '...]}')
    names = set()
    for i, ref in enumerate(allowed["tools"]):
        function = ref.get("function") if isinstance(ref, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        _require(isinstance(ref, dict) and ref.get("type") == "function" and isinstance(name, str),
                 f"tool_choice.allowed_tools.tools[{i}]", 'an allowed tool is {"type": "function", "function": '
                                                          '{"name": string}}')
        _require(any(t["function"]["name"] == name for t in tools), f"tool_choice.allowed_tools.tools[{i}]",
                 f"no tool named {name!r}")
        names.add(name)
    return names


def _tool_choice(body: ChatBody, tools: list[dict[str, Any]]) -> tuple[str, str]:
    """(mode, function name): mode none | auto | required | named; allowed_tools is its mode over the tools it
    names (_offered_tools)."""
    choice = body.tool_choice
    if choice is None:
        return ("auto" if tools else "none"), ""
    if isinstance(choice, str):
        _require(choice in ("none", "auto", "required"), "tool_choice",
                 "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\"}}")
        _require(choice == "none" or bool(tools), "tool_choice", f"tool_choice {choice!r} needs tools")
        return choice, ""
    if choice.get("type") == "allowed_tools":
        return choice["allowed_tools"]["mode"], ""  # checked by _offered_tools, which gave `tools`
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    _require(choice.get("type") == "function" and isinstance(name, str), "tool_choice",
             'a named tool_choice is {"type": "function", "function": {"name": string}} (or OpenAI\'s '
             '{"type": "allowed_tools", ...})')
    assert isinstance(name, str)
    _require(any(t["function"]["name"] == name for t in tools), "tool_choice", f"no tool named {name!r}")
    return "named", name


NO_BUDGET_HINT = " (-1 or null: no budget)"  # chat's way to send none (the Messages API's is to leave it out)


def check_thinking_budget(params: SamplingParams, reasoning_parser: str | None) -> None:
    """vLLM's thinking_token_budget bounds the think block that the reasoning parser reads: a 400 without one (vLLM
    refuses it without its reasoning config too)."""
    _require(not params.bounds_thinking or reasoning_parser is not None, "thinking_token_budget",
             "thinking_token_budget needs a reasoning model served with --reasoning-parser (qwen3, deepseek_r1): it "
             f"bounds the think block that parser reads, and this server has none{NO_BUDGET_HINT}")


def chat_output_spec(body: ChatBody, tool_parser: str, reasoning_parser: str | None) -> ChatOutputSpec:
    """How the api reads this request's choices (tools and reasoning)."""
    tools = _offered_tools(body)
    mode, name = _tool_choice(body, tools)
    return ChatOutputSpec(tool_mode=mode, tool_parser=tool_parser, tool_name=name,
                          reasoning_parser=reasoning_parser,
                          max_calls=1 if body.parallel_tool_calls is False else 0,
                          tool_parameters=tool_parameters(tool_parser, tools) if mode == "auto" else {},
                          include_reasoning=body.include_reasoning is not False)


_WHOLE_OUTPUT_CONSTRAINTS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                             "structural_tag")


def _tool_constraint(body: ChatBody, tools: list[dict[str, Any]], mode: str, name: str) -> StructuredOutputs | None:
    """tool_choice required / named decode under a schema built from the functions' parameters."""
    if mode == "required":
        return StructuredOutputs(json=required_schema(tools, parallel=body.parallel_tool_calls is not False))
    if mode == "named":
        return StructuredOutputs(json=named_schema(next(t for t in tools if t["function"]["name"] == name)))
    return None


def _chat_checks(body: ChatBody) -> None:
    _common_checks(body)
    _require(body.top_logprobs is None or bool(body.logprobs), "top_logprobs",
             "top_logprobs requires logprobs to be true")
    _require(body.service_tier in SERVICE_TIERS, "service_tier", f"service_tier {body.service_tier!r} is not "
             "supported: this server has one service tier (auto and default are it; vLLM's priority field orders "
             "requests)")
    _require(not (body.continue_final_message and body.add_generation_prompt), "continue_final_message",
             "continue_final_message and add_generation_prompt cannot both be true")
    _require(all(MIN_INT64 <= v <= MAX_INT64 for v in (body.chat_template_kwargs or {}).values()
                 if isinstance(v, int)), "chat_template_kwargs",
             f"chat_template_kwargs integers must be in [{MIN_INT64}, {MAX_INT64}]")
    check_reasoning_effort(body.reasoning_effort, "reasoning_effort")


def check_reasoning_effort(effort: object, param: str) -> None:
    """A 400 naming `param` unless `effort` is null or one of REASONING_EFFORTS (vLLM's Literal)."""
    _require(effort is None or effort in REASONING_EFFORTS, param,
             f"{param} must be one of {', '.join(REASONING_EFFORTS)} (or null), got {effort!r}")


def chat_template_variables(body: ChatBody) -> dict[str, str | int | float | bool]:
    """The variables the chat template gets beside the conversation, as vLLM's build_chat_params merges them:
    chat_template_kwargs, then reasoning_effort as given and, unless chat_template_kwargs sets it, enable_thinking =
    (reasoning_effort != "none"). A template reads whichever it declares (Jinja ignores the others). The field wins
    over a `reasoning_effort` key in chat_template_kwargs (vLLM's merge puts the request's fields last)."""
    variables = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        variables["reasoning_effort"] = body.reasoning_effort
        variables.setdefault("enable_thinking", body.reasoning_effort != "none")
    return variables


def chat_request(body: ChatBody, request_id: str, arrival_time: float, max_logprobs: int = MAX_TOP_LOGPROBS,
                 defaults: dict[str, float | int] | None = None,
                 exclude_tools_when_none: bool = False) -> GenerateRequest:
    """`defaults`: the model's generation-config sampling defaults. Its max_tokens, for an unset
    max_completion_tokens / max_tokens, is the tokenizer's to apply: capped by the context the prompt leaves
    (generation_config.with_default_max_tokens); without one, up to the model's context. The tools stay in the
    prompt under tool_choice "none" (vLLM's and OpenAI's), unless `exclude_tools_when_none`
    (--exclude-tools-when-tool-choice-none)."""
    _chat_checks(body)
    defaults = defaults or {}
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    kwargs = _sampling_kwargs(body, defaults)
    tools = _offered_tools(body)
    mode, name = _tool_choice(body, tools)
    tool_constraint = _tool_constraint(body, tools, mode, name)
    if tool_constraint is not None:
        # response_format shapes the message's text, which a forced call does not write: checked above, then it
        # gives way (OpenAI takes both; vLLM's tool schema replaces the format's). vLLM's own constraints shape the
        # whole output and conflict with the call's.
        whole = next((given for given in _WHOLE_OUTPUT_CONSTRAINTS if getattr(body, given) is not None), None)
        if whole is None and (body.response_format or {}).get("type") == "structural_tag":
            whole = "response_format"  # a structural tag shapes the whole output too
        _require(whole is None, "tool_choice", f"tool_choice {mode!r} constrains the output itself: drop {whole}")
        kwargs["structured_outputs"] = tool_constraint.validate()
    try:
        params = SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs).validate(max_logprobs)
    except InvalidRequestError as exc:  # chat names the count top_logprobs (logprobs alone, as beam search refuses)
        named = "top_logprobs" if exc.param == "logprobs" and body.top_logprobs is not None else exc.param
        raise InvalidRequestError(exc.message, param=named) from None
    messages = chat_messages(body.messages)
    continue_final = bool(body.continue_final_message)
    _require(not continue_final or messages[-1].role == "assistant", "continue_final_message",
             "continue_final_message needs an assistant message last")
    # Continuing the last message implies no new assistant turn, unless the client asked (refused above).
    add_generation_prompt = not continue_final if body.add_generation_prompt is None else body.add_generation_prompt
    return GenerateRequest(
        request_id, params, messages=messages, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final, chat_template_kwargs=chat_template_variables(body),
        # chat templates carry their own BOS; adding one more would double it (vLLM's default too)
        add_special_tokens=bool(body.add_special_tokens), priority=body.priority or 0,
        arrival_time=arrival_time, tools=[] if mode == "none" and exclude_tools_when_none else tools,
        return_token_ids=bool(body.return_token_ids), cache_salt=check_cache_salt(body.cache_salt),
        prompt_cache_key=check_prompt_cache_key(body.prompt_cache_key), documents=body.documents,
        chat_template=body.chat_template or "")


def tokenize_tools(body: TokenizeBody) -> list[dict[str, Any]]:
    """/tokenize's tools (chat only), checked as generation checks them."""
    _require(body.tools is None or body.messages is not None, "tools", "tools need messages")
    return _tools(body)


def chat_echo_text(body: ChatBody, request: GenerateRequest, role: str = "assistant") -> str:
    """vLLM's chat echo: the reply's content starts with the last message when that message has the reply's role
    (the message continued, or a prefill)."""
    last = request.messages[-1] if request.messages else None
    return last.content if body.echo and last is not None and last.role == role else ""


def chat_response_role(request: GenerateRequest, response_role: str) -> str:
    """The role of a chat answer, as vLLM gives it: --response-role when the prompt ends with a generation prompt,
    else the last message's (the answer continues that message)."""
    if request.add_generation_prompt or not request.messages:
        return response_role
    return request.messages[-1].role


def prompt_bytes(body: object) -> int:
    """UTF-8 bytes of the text a body asks to tokenize; ids count 0.

    Prompt strings, message contents, the assistant turns' tool calls (name and arguments: the template renders
    them) and reasoning, retrieval documents (their keys and values), a request's own chat template, and the tool
    definitions (as JSON, the form templates render them in)."""
    texts: list[str] = []
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, str):
        texts.append(prompt)
    elif isinstance(prompt, list):
        texts.extend(p for p in prompt if isinstance(p, str))
    for message in getattr(body, "messages", None) or []:
        if isinstance(message.content, str):
            texts.append(message.content)
        elif isinstance(message.content, list):
            texts.extend(part["text"] for part in message.content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
        texts.extend(_tool_call_texts(message.tool_calls or []))
        reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
        if isinstance(reasoning, str) and message.role == "assistant":  # an earlier answer's: the template's
            texts.append(reasoning)
    for document in getattr(body, "documents", None) or []:
        texts.extend(text for pair in document.items() for text in pair)
    template = getattr(body, "chat_template", None)
    if isinstance(template, str):
        texts.append(template)
    # len() of a str counts code points; up to 4 bytes each, so encode only when it could matter
    text_bytes = sum(len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass")) for t in texts)
    tools = getattr(body, "tools", None)
    return text_bytes + (len(msgspec.json.encode(tools)) if tools else 0)


def _tool_call_texts(calls: list[dict[str, Any]]) -> list[str]:
    """The strings of tool calls that a template renders (their shape is checked later, by _message_tool_calls)."""
    texts = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            texts.extend(v for v in (function.get("name"), function.get("arguments")) if isinstance(v, str))
    return texts
