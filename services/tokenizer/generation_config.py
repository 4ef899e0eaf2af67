"""The model's generation_config.json sampling fields: defaults for what a request leaves unset (vLLM's)."""

from __future__ import annotations

import json
from pathlib import Path

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
