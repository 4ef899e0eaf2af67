"""What a checkpoint's files hold against what config.json says: a folder pagoda cannot serve as transformers
would is refused at load, naming the file, tensor or field; one it serves generates transformers' greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda import LLM
from pagoda.shared.errors import ModelNotFoundError, PagodaError
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


def _shard(folder: Path) -> list[str]:
    """model.safetensors split in two shards and their index, as save_pretrained writes a large model."""
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    files = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    weight_map = {}
    for file, part in zip(files, (names[:len(names) // 2], names[len(names) // 2:]), strict=True):
        save_file({name: state[name] for name in part}, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def test_sharded_checkpoint_matches_transformers(tmp_path: Path) -> None:
    folder = _build(tmp_path, "Llama", DENSE)
    _shard(folder)
    _assert_greedy_parity(folder)


def test_shard_the_index_names_but_the_folder_lacks_is_refused(tmp_path: Path) -> None:
    """A download cut short: the index names a shard that is not there (it was a FileNotFoundError traceback from
    the worker)."""
    folder = _build(tmp_path, "Llama", DENSE)
    missing = _shard(folder)[1]
    (folder / missing).unlink()
    with pytest.raises(ModelNotFoundError, match=f"model.safetensors.index.json.*{missing}"):
        _load(folder)


@pytest.mark.parametrize("index", ['{"metadata": {}}', '{"weight_map": ["a"]}', "{not json"])
def test_index_without_a_weight_map_is_refused(tmp_path: Path, index: str) -> None:
    folder = _build(tmp_path, "Llama", DENSE)
    _shard(folder)
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ModelNotFoundError, match="model.safetensors.index.json"):
        _load(folder)


def test_truncated_safetensors_file_is_refused(tmp_path: Path) -> None:
    folder = _build(tmp_path, "Llama", DENSE)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ModelNotFoundError, match="model.safetensors"):
        _load(folder)


@pytest.mark.parametrize(("dtype", "words"), [
    (torch.float8_e4m3fn, "no fp8 quantization_config"),  # an FP8 export whose config.json lost the section
    (torch.float8_e5m2, "float8_e5m2"),
    (torch.int8, "int8"),  # integer weights: a quantized export without its quantization_config
    (torch.int32, "int32"),
])
@pytest.mark.parametrize("name", ["model.layers.0.mlp.up_proj.weight", "model.layers.1.input_layernorm.weight"])
def test_weight_of_a_dtype_pagoda_cannot_read_is_refused(tmp_path: Path, name: str, dtype: torch.dtype,
                                                         words: str) -> None:
    """A weight that is not floating point, or float8 where config.json declares no FP8 checkpoint, was cast as it
    is (integers and e5m2 into garbage weights) or failed an assertion; refused naming the tensor and its dtype."""
    folder = _build(tmp_path, "Llama", DENSE)

    def retype(state: dict[str, torch.Tensor]) -> None:
        state[name] = state[name].to(dtype)

    _rewrite(folder, retype)
    with pytest.raises(ModelNotFoundError, match=f"{name}.*{words}"):
        _load(folder)


def test_half_precision_weights_beside_float32_ones_load(tmp_path: Path) -> None:
    """Float weights of mixed dtypes (an fp16 tensor in an fp32 folder) are converted: transformers' tokens."""
    folder = _build(tmp_path, "Llama", DENSE)

    def retype(state: dict[str, torch.Tensor]) -> None:
        state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].half()

    _rewrite(folder, retype)
    _assert_greedy_parity(folder)
