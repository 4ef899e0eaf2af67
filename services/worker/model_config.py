"""The model architecture and dummy shapes now live in pagoda.shared.shapes; re-exported for the worker."""

from pagoda.shared.shapes import (  # noqa: F401
    SHAPES,
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    ModelArch,
    arch_from_hf_config,
    check_divisible,
    fit_vocab_to_tokenizer,
    load_arch,
    resolve_arch,
    tokenizer_vocab_size,
)
