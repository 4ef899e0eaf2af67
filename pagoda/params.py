"""vLLM's SamplingParams for the offline API: the wire's struct, taking vLLM's shapes and checked where it is made."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pagoda.services.protocol.vllm import backend_disables_whitespace, check_guided_backend
from pagoda.shared import messages
from pagoda.shared.errors import InvalidRequestError

log = logging.getLogger(__name__)

_CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class GuidedDecodingParams:
    """vLLM's structured-output parameters before it renamed them StructuredOutputsParams (`from
    vllm.sampling_params import GuidedDecodingParams`): SamplingParams(guided_decoding=...) becomes its
    structured_outputs. Exactly one constraint; its options are StructuredOutputs' (disable_any_whitespace, also
    as the backend option `disable-any-whitespace`; disable_additional_properties; whitespace_pattern; and
    disable_fallback, which changes nothing); any backend name of services/protocol/vllm.GUIDED_BACKENDS."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    backend: str | None = None
    backend_was_auto: bool = False  # vLLM's own bookkeeping
    disable_fallback: bool = False  # pagoda never falls back to another engine: holds either way
    disable_any_whitespace: bool = False  # compact JSON
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_optional(cls, **fields: Any) -> GuidedDecodingParams | None:
        """None when no constraint is given (vLLM's)."""
        if all(fields.get(name) is None for name in _CONSTRAINT_FIELDS):
            return None
        return cls(**fields)

    def structured_outputs(self) -> messages.StructuredOutputs:
        """The same constraint as pagoda's (vLLM's new) StructuredOutputs; InvalidRequestError names the field."""
        if self.backend is not None:
            try:
                check_guided_backend(self.backend)
            except InvalidRequestError as exc:
                raise InvalidRequestError(exc.message.replace("guided_decoding_backend", "guided_decoding.backend"),
                                          param="guided_decoding.backend") from None
        given = {name: getattr(self, name) for name in _CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)}
        if len(given) != 1:
            raise InvalidRequestError(f"guided_decoding needs exactly one of {', '.join(_CONSTRAINT_FIELDS)}; "
                                      f"got {', '.join(given) or 'none'}", param="guided_decoding")
        compact = self.disable_any_whitespace or backend_disables_whitespace(self.backend or "")
        try:
            return messages.StructuredOutputs(
                **given, disable_any_whitespace=compact, whitespace_pattern=self.whitespace_pattern,
                disable_additional_properties=self.disable_additional_properties,
                disable_fallback=self.disable_fallback).validate()
        except InvalidRequestError as exc:
            name = (exc.param or "").replace("structured_outputs", "guided_decoding")
            raise InvalidRequestError(exc.message, param=name if name.startswith("guided_decoding.") else
                                      "guided_decoding") from None


def raised_or_same_temperature(temperature: float) -> float:
    """vLLM's SamplingParams: a temperature in (0, 0.01) is sampled at 0.01, with vLLM's warning in the log."""
    raised = messages.raised_temperature(temperature)
    if raised is None:
        return temperature
    log.warning(messages.TEMPERATURE_RAISED_WARNING, temperature, messages.MIN_SAMPLING_TEMPERATURE, raised)
    return raised


def check_offline(params: messages.SamplingParams) -> None:
    """What the offline engine cannot honour, refused when a request is added (as vLLM's engine refuses a thinking
    budget without its reasoning config): thinking_token_budget bounds the think block that a server's
    --reasoning-parser reads, and LLM has no reasoning parser; `thinking` is the server's own reading of it."""
    if params.bounds_thinking or params.thinking is not None:
        raise InvalidRequestError("thinking_token_budget needs a reasoning parser, which the offline LLM does not "
                                  "have: serve the model with --reasoning-parser (qwen3, deepseek_r1) to bound its "
                                  "think block (-1 or None: no budget)", param="thinking_token_budget")


def _repetition_detection(fields: dict[str, Any]) -> messages.RepetitionDetection:
    unknown = sorted(set(fields) - set(messages.RepetitionDetection.__struct_fields__))
    if unknown:
        raise InvalidRequestError(f"repetition_detection takes max_pattern_size, min_pattern_size and min_count, not "
                                  f"{', '.join(unknown)}", param=f"repetition_detection.{unknown[0]}")
    return messages.RepetitionDetection(**fields)


class RequestOutputKind(Enum):
    """vLLM's (vllm.sampling_params.RequestOutputKind): what each RequestOutput of a request holds. LLM's generate and
    chat return each request's output once, when it is done: FINAL_ONLY, the kind vLLM's LLM sets itself."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams(messages.SamplingParams, frozen=False, omit_defaults=True, kw_only=True):
    """shared.messages.SamplingParams as vLLM users write it: `stop` may be one string, None stands for an empty
    list or map, seed=-1 for no seed and logprobs=True for 1, and a bad value raises InvalidRequestError (a
    ValueError naming the parameter) at construction, as vLLM's does. Mutable like vLLM's (its examples set
    fields after making one): LLM hands the engine a frozen copy (`wire`), normalized and checked again. The wire
    type stays without a __post_init__: msgspec would run it on every decode, and a worker must clamp a bad row
    alone rather than fail the whole plan (tests/reliability/test_isolation.py)."""

    # vLLM's: False leaves the output without text (and logprobs without decoded_token); LLM drops them
    detokenize: bool = True
    # vLLM's older name for structured_outputs (GuidedDecodingParams): moved there when normalized, as vLLM's
    guided_decoding: GuidedDecodingParams | None = None
    # vLLM's engine-level output kind: only what LLM does (each request's output once, when it is done)
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    # vLLM's: taken and changes nothing, as on the server (the fast decoder has no such switch; not sent on the wire)
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._normalize()
        self.validate(max_logprobs=-1)  # the logprobs bound is the engine's, checked when the request is added

    def _normalize(self) -> None:
        if isinstance(self.stop, str):  # left a str, each of its characters would be a stop string
            self.stop = [self.stop]
        for name, empty in (("stop", list), ("stop_token_ids", list), ("allowed_token_ids", list),
                            ("bad_words", list), ("logprob_token_ids", list), ("logit_bias", dict)):
            if getattr(self, name) is None:
                setattr(self, name, empty())
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        self.temperature = raised_or_same_temperature(self.temperature)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:  # vLLM's: the chosen token's logprob, and one more
                setattr(self, name, 1)
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise InvalidRequestError("give guided_decoding or structured_outputs, not both (guided_decoding is "
                                          "vLLM's older name for it)", param="guided_decoding")
            self.structured_outputs = self.guided_decoding.structured_outputs()
            self.guided_decoding = None
        if getattr(self.output_kind, "name", None) != "FINAL_ONLY":  # vLLM's own enum member passes too
            raise InvalidRequestError(f"output_kind {self.output_kind} is not supported: LLM.generate and chat return "
                                      "each request's output once, when it is done (RequestOutputKind.FINAL_ONLY, "
                                      "which vLLM's LLM sets itself); CUMULATIVE and DELTA outputs are for "
                                      "streaming engines", param="output_kind")
        if self.bad_words_token_ids:  # vLLM's is private (_bad_words_token_ids): set by the engine alone
            raise InvalidRequestError("bad_words_token_ids is made by the engine from bad_words; give bad_words",
                                      param="bad_words_token_ids")
        if isinstance(self.repetition_detection, dict):  # vLLM's pydantic dataclass takes its fields as a dict too
            self.repetition_detection = _repetition_detection(self.repetition_detection)
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop strings need detokenize=True: they are matched in the text", param="stop")

    def wire(self) -> messages.SamplingParams:
        """A frozen copy for the engine, with what was set since construction normalized (not yet validated:
        the engine validates every request it is given); without `detokenize`, which LLM applies to the output."""
        self._normalize()
        fields = messages.SamplingParams.__struct_fields__
        return messages.SamplingParams(**{name: getattr(self, name) for name in fields})

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's SamplingParams.clone)."""
        return copy.deepcopy(self)
