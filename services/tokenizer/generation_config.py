"""The model's generation_config.json sampling fields: defaults for what a request leaves unset (vLLM's)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from pagoda.shared.errors import ConfigError, InvalidRequestError
from pagoda.shared.messages import SamplingParams

# generation_config.json key -> SamplingParams field: the keys vLLM takes (ModelConfig.get_diff_sampling_param);
# Hugging Face's max_new_tokens is vLLM's max_tokens
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
FILE_NAME = "generation_config.json"


def sampling_defaults(model: str, generation_config: str) -> dict[str, float | int]:
    """The SamplingParams fields the generation config sets (null keys are unset), checked as a request's are.

    `generation_config`: "auto" reads the model folder's file (none there, as for a dummy shape: no defaults),
    "vllm" reads nothing (SamplingParams' own defaults), anything else is a folder that must hold the file."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        path = Path(model, FILE_NAME)
        if not path.is_file():
            return {}
    else:
        path = Path(generation_config, FILE_NAME)
        if not path.is_file():
            raise ConfigError(f"generation_config must be 'auto', 'vllm' or a folder with a {FILE_NAME}; there is "
                              f"none in {generation_config!r}", param="generation_config")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {str(path)!r}: {exc}", param="generation_config") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{str(path)!r} does not hold a JSON object", param="generation_config")
    defaults = {field: config[key] for key, field in GENERATION_FIELDS.items() if config.get(key) is not None}
    try:  # a bad value would otherwise fail every request that leaves the field unset, naming the client's field
        SamplingParams(**defaults).validate()
    except InvalidRequestError as exc:
        raise ConfigError(f"{str(path)!r} sets a sampling default SamplingParams refuses: {exc.message}",
                          param="generation_config") from None
    return defaults


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
