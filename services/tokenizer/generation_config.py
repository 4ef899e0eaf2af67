"""The model's generation config sampling fields: defaults for what a request leaves unset (vLLM's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from pagoda.shared.errors import ConfigError, InvalidRequestError
from pagoda.shared.messages import SamplingParams

# generation_config.json key -> SamplingParams field: the keys vLLM takes (ModelConfig.get_diff_sampling_param);
# Hugging Face's max_new_tokens is vLLM's max_tokens
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
FILE_NAME = "generation_config.json"
MODEL_CONFIG_NAME = "config.json"
# The values transformers 4 wrote into every config.json it saved (PretrainedConfig's generation attributes): vLLM's
# fallback (GenerationConfig.from_model_config(...).to_diff_dict()) drops what equals GenerationConfig's defaults,
# so an old config.json's top_k 50 is no default of anyone's requests.
LEGACY_MODEL_DEFAULTS: dict[str, float] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def sampling_defaults(model: str, generation_config: str,
                      overrides: dict[str, Any] | None = None) -> dict[str, float | int]:
    """The SamplingParams fields the generation config sets (null keys are unset), checked as a request's are.

    `generation_config`: "auto" reads the model folder's generation_config.json, or without one (as vLLM falls back)
    the sampling keys of its config.json (no folder, as for a dummy shape: no defaults); "vllm" reads nothing
    (SamplingParams' own defaults); anything else is a folder read as "auto" reads the model's, which must hold one
    of the two files. `overrides` (vLLM's --override-generation-config) is applied over what was read, also with
    "vllm"; a null there unsets the key."""
    config = {} if generation_config == "vllm" else _read(model if generation_config == "auto" else generation_config,
                                                          must_exist=generation_config != "auto")
    config.update(_checked_overrides(overrides or {}))
    # JSON true / false are Python ints that SamplingParams' checks let through (top_k True), but the wire's
    # defaults are numbers: every tokenizer's announcement of them would be dropped as a malformed frame
    flag = next((key for key in GENERATION_FIELDS if isinstance(config.get(key), bool)), None)
    if flag is not None:
        raise ConfigError(f"the generation config's {flag} is {json.dumps(config[flag])}; it must be a number",
                          param="override_generation_config" if flag in (overrides or {}) else "generation_config")
    defaults = {field: config[key] for key, field in GENERATION_FIELDS.items() if config.get(key) is not None}
    try:  # a bad value would otherwise fail every request that leaves the field unset, naming the client's field
        SamplingParams(**defaults).validate()
    except InvalidRequestError as exc:
        overridden = any(GENERATION_FIELDS[key] == exc.param for key in overrides or {})
        raise ConfigError(f"the generation config sets a sampling default SamplingParams refuses: {exc.message}",
                          param="override_generation_config" if overridden else "generation_config") from None
    return defaults


def _read(folder: str, must_exist: bool) -> dict[str, Any]:
    """The generation config keys of a folder: its generation_config.json, else its config.json's sampling keys that
    transformers 4 did not write everywhere; {} for neither (ConfigError if must_exist)."""
    path = Path(folder, FILE_NAME)
    if path.is_file():
        return _json_object(path)
    model_path = Path(folder, MODEL_CONFIG_NAME)
    if model_path.is_file():
        config = _json_object(model_path)
        return {key: config[key] for key in GENERATION_FIELDS
                if key in config and config[key] != LEGACY_MODEL_DEFAULTS.get(key, object())}
    if must_exist:
        raise ConfigError(f"generation_config must be 'auto', 'vllm' or a folder with a {FILE_NAME} (or a "
                          f"{MODEL_CONFIG_NAME}); there is neither in {folder!r}", param="generation_config")
    return {}


def _json_object(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc}", param="generation_config") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{str(path)!r} does not hold a JSON object", param="generation_config")
    return config


def _checked_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """vLLM's --override-generation-config: only the keys it takes from a generation config (vLLM ignores the
    others; here they are refused, naming the key)."""
    unknown = sorted(set(overrides) - set(GENERATION_FIELDS))
    if unknown:
        raise ConfigError(f"override_generation_config key(s) {', '.join(map(repr, unknown))} are not sampling "
                          f"defaults; the keys are {', '.join(GENERATION_FIELDS)}", param="override_generation_config")
    return overrides


def with_default_max_tokens(params: SamplingParams, defaults: dict[str, float | int], num_prompt_tokens: int,
                            max_model_len: int) -> SamplingParams:
    """A request that left max_tokens unset (a chat request; completions default to 16 in the api) gets the
    generation config's max_new_tokens, capped by what the context leaves after its prompt, as vLLM caps it (a
    default must not turn a prompt that fits into a refused one); params unchanged otherwise. A min_tokens above
    that is refused, naming it."""
    default = defaults.get("max_tokens")
    if params.max_tokens is not None or default is None:
        return params
    max_tokens = max(1, min(int(default), max_model_len - num_prompt_tokens))  # check_prompt refuses no room
    if params.min_tokens > max_tokens:
        raise InvalidRequestError(f"min_tokens={params.min_tokens} exceeds the {max_tokens} tokens this request may "
                                  f"generate (the model's generation config max_new_tokens={default}, and the "
                                  f"context left after {num_prompt_tokens} prompt tokens)", param="min_tokens")
    return msgspec.structs.replace(params, max_tokens=max_tokens)
