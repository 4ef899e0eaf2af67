"""Where a model's tokenizer is, and loading it: the Hugging Face tokenizer class its tokenizer_config.json names,
imported alone. transformers' auto classes import its model side, and with it torch, which the tokenizer and api
processes never load; the class a folder names is what AutoTokenizer would pick for it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pagoda.shared.shapes import SHAPES

log = logging.getLogger(__name__)

# Any one of these marks a folder that holds a tokenizer (fast, sentencepiece, or GPT-2 style files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def has_tokenizer(path: str | Path) -> bool:
    folder = Path(path)
    return folder.is_dir() and any((folder / name).is_file() for name in TOKENIZER_FILES)


def tokenizer_folder(model: str, load_format: str, tokenizer: str | None = None) -> str | None:
    """Where the model's tokenizer is: --tokenizer if given, else the model folder's own; None when there is none
    (a dummy shape, or a folder without tokenizer files: prompts are then token ids)."""
    if tokenizer is not None:
        return tokenizer
    if load_format == "dummy" and model in SHAPES:
        return None
    if not has_tokenizer(model):
        log.warning("no tokenizer in %s: prompts must be token ids and outputs carry no text", model)
        return None
    return model


def tokenizer_class(folder: str | Path) -> Any:
    """The tokenizer class tokenizer_config.json names (a "...Fast" name is the same class in transformers 5);
    transformers' AutoTokenizer when it names none, or names something that is not a tokenizer."""
    import transformers

    path = Path(folder, "tokenizer_config.json")
    name = json.loads(path.read_text()).get("tokenizer_class") if path.is_file() else None
    if isinstance(name, str) and name.isidentifier():
        for candidate in (name, name.removesuffix("Fast")):
            cls = getattr(transformers, candidate, None)
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
                return cls
    return transformers.AutoTokenizer  # reads the model's config.json (and imports torch where it is installed)


def load_hf_tokenizer(folder: str | Path) -> Any:
    """The Hugging Face tokenizer in a local folder (never the hub)."""
    return tokenizer_class(folder).from_pretrained(str(folder), local_files_only=True)
