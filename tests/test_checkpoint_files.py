"""What a checkpoint's files hold against what config.json says: a folder pagoda cannot serve as transformers
would is refused at load, naming the file, tensor or field; one it serves generates transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda import LLM
from pagoda.shared.errors import PagodaError
from tests.parity import TEST_KV_BLOCKS
from tests.test_arch_variants import DENSE, _assert_greedy_parity, _build


def _rewrite(folder: Path, edit) -> None:  # noqa: ANN001
    """Rewrite model.safetensors through `edit(state_dict)`."""
    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def _save_head(state: dict[str, torch.Tensor], head: torch.Tensor) -> None:
    state["lm_head.weight"] = head


def _load(folder: Path) -> LLM:
    return LLM(str(folder), dtype="float32", num_kv_blocks=TEST_KV_BLOCKS)


def test_tied_embeddings_with_the_same_lm_head_saved_are_served_tied(tmp_path: Path) -> None:
    """tie_word_embeddings true and an lm_head.weight equal to the embeddings beside it (saved by hand, or a merge
    tool): both readings agree, served as transformers does."""
    folder = _build(tmp_path, "Llama", dict(DENSE, tie_word_embeddings=True))
    _rewrite(folder, lambda state: _save_head(state, state["model.embed_tokens.weight"].clone()))
    _assert_greedy_parity(folder)


def test_tied_embeddings_beside_another_lm_head_are_refused(tmp_path: Path) -> None:
    """tie_word_embeddings true but an lm_head.weight of other values: transformers 5 unties them and uses
    lm_head.weight, earlier versions (and vLLM) the embeddings: no one answer, refused naming both."""
    folder = _build(tmp_path, "Llama", dict(DENSE, tie_word_embeddings=True))
    _rewrite(folder, lambda state: _save_head(state, torch.randn_like(state["model.embed_tokens.weight"])))
    with pytest.raises(PagodaError, match="tie_word_embeddings.*lm_head.weight"):
        _load(folder)
