"""Fill a CausalLM from Hugging Face safetensors (single or sharded, each rank reading only its slice)
or from seeded random "dummy" weights that are the same whatever the tensor-parallel size."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pagoda.services.worker.model import CausalLM
from pagoda.services.worker.model_config import ModelArch
from pagoda.shared.errors import ModelNotFoundError

# (HF tensor name, its full shape, destination parameter, row offset in it, shard dim or None)
Source = Callable[[str, tuple[int, ...], int | None, int, int], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Placement:
    hf_name: str
    full_shape: tuple[int, ...]
    target: torch.Tensor  # the parameter (or its row range) to fill
    shard_dim: int | None  # None: replicated on every rank
    shard_start: int = 0
    shard_len: int = 0


def placements(model: CausalLM) -> Iterator[Placement]:
    """Every HF tensor this rank needs and where its slice goes."""
    arch, rank = model.arch, model.tp.rank
    h, d = arch.hidden_size, arch.head_dim
    vocab_rows = min(model.vocab_per_rank, arch.vocab_size - model.vocab_start)
    yield Placement("model.embed_tokens.weight", (arch.vocab_size, h), model.embed[:vocab_rows], 0,
                    model.vocab_start, vocab_rows)
    if not arch.tie_word_embeddings:
        yield Placement("lm_head.weight", (arch.vocab_size, h), model.lm_head[:vocab_rows], 0,
                        model.vocab_start, vocab_rows)
    yield Placement("model.norm.weight", (h,), model.final_norm, None)
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        q, kv = layer.q_size, layer.kv_size
        local_mlp = layer.down_weight.shape[1]
        yield Placement(prefix + "input_layernorm.weight", (h,), layer.input_norm, None)
        yield Placement(prefix + "post_attention_layernorm.weight", (h,), layer.post_attn_norm, None)
        for name, rows, size, full in (("q_proj", slice(0, q), q, arch.q_size),
                                       ("k_proj", slice(q, q + kv), kv, arch.kv_size),
                                       ("v_proj", slice(q + kv, q + 2 * kv), kv, arch.kv_size)):
            attn = prefix + "self_attn." + name
            yield Placement(attn + ".weight", (full, h), layer.qkv_weight[rows], 0, rank * size, size)
            if layer.qkv_bias is not None:
                yield Placement(attn + ".bias", (full,), layer.qkv_bias[rows], 0, rank * size, size)
        yield Placement(prefix + "self_attn.o_proj.weight", (h, arch.q_size), layer.o_weight, 1, rank * q, q)
        if layer.q_norm is not None and layer.k_norm is not None:
            yield Placement(prefix + "self_attn.q_norm.weight", (d,), layer.q_norm, None)
            yield Placement(prefix + "self_attn.k_norm.weight", (d,), layer.k_norm, None)
        full_mlp = arch.intermediate_size
        yield Placement(prefix + "mlp.gate_proj.weight", (full_mlp, h), layer.gate_up_weight[:local_mlp], 0,
                        rank * local_mlp, local_mlp)
        yield Placement(prefix + "mlp.up_proj.weight", (full_mlp, h), layer.gate_up_weight[local_mlp:], 0,
                        rank * local_mlp, local_mlp)
        yield Placement(prefix + "mlp.down_proj.weight", (h, full_mlp), layer.down_weight, 1,
                        rank * local_mlp, local_mlp)


def fill(model: CausalLM, source: Source) -> None:
    with torch.no_grad():
        for place in placements(model):
            tensor = source(place.hf_name, place.full_shape, place.shard_dim, place.shard_start, place.shard_len)
            assert tensor.shape == place.target.shape, (place.hf_name, tensor.shape, place.target.shape)
            place.target.copy_(tensor)


class SafetensorsSource:
    """Reads only the requested slice of each tensor; counts the bytes it read."""

    def __init__(self, model_dir: str | Path) -> None:
        folder = Path(model_dir)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if not files:
                raise ModelNotFoundError(f"no *.safetensors files in {str(folder)!r}")
        self._handles = {name: safe_open(str(folder / name), framework="pt") for name in files}
        self._file_of = {key: name for name, handle in self._handles.items() for key in handle.keys()}
        self.bytes_read = 0

    def __call__(self, name: str, full_shape: tuple[int, ...], shard_dim: int | None, start: int,
                 length: int) -> torch.Tensor:
        file = self._file_of.get(name)
        if file is None:
            raise ModelNotFoundError(f"weight {name!r} is missing from the checkpoint", param="model")
        view = self._handles[file].get_slice(name)
        shape = tuple(view.get_shape())
        if shape != full_shape:
            raise ModelNotFoundError(f"weight {name!r} has shape {shape}, config.json implies {full_shape}",
                                     param="model")
        if shard_dim is None:
            tensor = view[:]
        elif shard_dim == 0:
            tensor = view[start:start + length]
        else:
            tensor = view[:, start:start + length]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


class DummySource:
    """Seeded random weights: each full tensor is drawn from its own generator, then sliced."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        self.seed, self.device, self.dtype = seed, device, dtype

    def __call__(self, name: str, full_shape: tuple[int, ...], shard_dim: int | None, start: int,
                 length: int) -> torch.Tensor:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):
            full = 1.0 + 0.1 * torch.randn(full_shape, generator=generator, device=self.device)
        else:
            full = 0.02 * torch.randn(full_shape, generator=generator, device=self.device)  # [*full_shape]
        if shard_dim is not None:
            full = full.narrow(shard_dim, start, length)
        return full.to(self.dtype)


def load_model(model: CausalLM, model_dir: str | Path | None, load_format: str, seed: int) -> int:
    """Fill `model`; return the bytes read from disk (0 for dummy weights)."""
    device = model.final_norm.device
    if load_format == "dummy":
        fill(model, DummySource(seed, device, model.dtype))
        return 0
    assert model_dir is not None
    source = SafetensorsSource(model_dir)
    fill(model, source)
    return source.bytes_read


def export_hf_state_dict(model: CausalLM, arch: ModelArch) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (tensor_parallel_size 1): to build a peer model."""
    assert model.tp.size == 1
    state: dict[str, torch.Tensor] = {}
    for place in placements(model):
        state[place.hf_name] = place.target.detach().clone()
    if arch.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state
