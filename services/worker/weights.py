"""Fill a CausalLM from Hugging Face safetensors (single or sharded, each rank reading only its slice)
or from seeded random "dummy" weights that are the same whatever the tensor-parallel size.

FP8: with Fp8Weights on the model, linear weights come from an FP8 checkpoint as they are (Hugging Face
`quant_method: fp8` with block-wise `weight_scale_inv`, or compressed-tensors `float-quantized` with per-channel
or per-tensor `weight_scale`), or are quantized here per output channel from bf16/fp16/fp32 weights (also dummy
ones; on a tensor-parallel shard the channel's scale covers this rank's columns only)."""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pagoda.kernels import reference as ref
from pagoda.services.worker.models import CausalLM, Fp8Weights, Placement
from pagoda.shared.errors import ConfigError, ModelNotFoundError
from pagoda.shared.shapes import ModelArch

# (HF tensor name, its full shape, destination parameter, row offset in it, shard dim or None)
Source = Callable[[str, tuple[int, ...], int | None, int, int], torch.Tensor]


def placements(model: CausalLM) -> Iterator[Placement]:
    """Every HF tensor this rank needs and where its slice goes (scale_target: where an FP8 weight's scales go)."""
    return model.placements()


def fill(model: CausalLM, source: Source) -> None:
    group_size = model.fp8.group_size if model.fp8 is not None else None
    with torch.no_grad():
        for place in placements(model):
            tensor = source(place.hf_name, place.full_shape, place.shard_dim, place.shard_start, place.shard_len)
            assert tensor.shape == place.target.shape, (place.hf_name, tensor.shape, place.target.shape)
            order = place.row_order.to(tensor.device) if place.row_order is not None else None
            if place.scale_target is None:
                if tensor.dtype == torch.float8_e4m3fn and place.target.dtype != torch.float8_e4m3fn:
                    tensor = _dequantized(source, place, tensor)  # a weight the model keeps unquantized
                place.target.copy_(tensor if order is None else tensor.index_select(0, order))
                continue
            if order is not None:
                tensor = tensor.index_select(0, order)
            if tensor.dtype == torch.float8_e4m3fn:  # as the checkpoint ships it, with its scales
                assert isinstance(source, SafetensorsSource)
                scale = source.fp8_scale(place.hf_name, place.full_shape, place.shard_dim, place.shard_start,
                                         place.shard_len)
                if order is not None:  # per-row scales (block scales are expanded to rows): they follow their rows
                    scale = scale.index_select(0, order.to(scale.device))
            else:  # quantize here (a bf16 checkpoint, dummy weights, or a layer the checkpoint left unquantized)
                tensor, scale = ref.quantize_fp8_rows(tensor.to(place.target.device), group_size)
            assert scale.shape == place.scale_target.shape, (place.hf_name, scale.shape, place.scale_target.shape)
            place.target.copy_(tensor)
            place.scale_target.copy_(scale)
        load_kv_scales(model, source)
        model.weights_loaded()


def _dequantized(source: Source, place: Placement, tensor: torch.Tensor) -> torch.Tensor:
    """An e4m3 checkpoint weight in fp32 for a parameter the model keeps in its own dtype (MLA's kv_b_proj, whose
    per-head blocks W_UK and W_UV are applied by batched matmuls in the model dtype)."""
    assert isinstance(source, SafetensorsSource) and source.fp8 is not None and tensor.dim() == 2
    scale = source.fp8_scale(place.hf_name, place.full_shape, place.shard_dim, place.shard_start, place.shard_len)
    group = source.fp8.block[1] if source.fp8.block is not None else None
    return ref.dequantize_fp8(tensor.to(scale.device), scale, group)


def load_kv_scales(model: CausalLM, source: Source) -> None:
    """Per-layer fp8 KV-cache scales where the checkpoint has them (else they stay 1): `self_attn.k_scale` /
    `v_scale` (compressed-tensors, vLLM), `self_attn.{k,v}_proj.{k,v}_scale` (older exports) or one
    `kv_scale` for both."""
    if not isinstance(source, SafetensorsSource):
        return
    for i, layer in enumerate(model.layers):
        attn = f"model.layers.{i}.self_attn."
        for target, names in ((layer.k_scale, ("k_scale", "k_proj.k_scale", "kv_scale", "k_proj.output_scale")),
                              (layer.v_scale, ("v_scale", "v_proj.v_scale", "kv_scale", "v_proj.output_scale"))):
            value = source.scalar(*(attn + name for name in names))
            if value is not None:
                target.fill_(value)


class SafetensorsSource:
    """Reads only the requested slice of each tensor; counts the bytes it read."""

    def __init__(self, model_dir: str | Path) -> None:
        folder = Path(model_dir)
        self._handles = {name: _open_safetensors(folder / name) for name in checkpoint_files(folder)}
        self._file_of = {key: name for name, handle in self._handles.items() for key in handle.keys()}
        self.bytes_read = 0
        self.fp8 = checkpoint_fp8(folder)

    def __call__(self, name: str, full_shape: tuple[int, ...], shard_dim: int | None, start: int,
                 length: int) -> torch.Tensor:
        file = self._file_of.get(name)
        if file is None:
            fused = self._fused_expert(name, full_shape, shard_dim, start, length)
            if fused is not None:
                return fused
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
        return self._readable(name, tensor)

    def _readable(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` if its dtype is one the model takes: a float of 16 bits or more (converted to the model's), or
        e4m3 in an FP8 checkpoint; integers (a quantized export whose config.json lost its quantization_config) and
        other 8-bit floats would be cast into other numbers."""
        dtype = str(tensor.dtype).removeprefix("torch.")
        if tensor.dtype == torch.float8_e4m3fn and self.fp8 is None:
            raise ModelNotFoundError(f"weight {name!r} is {dtype} but config.json has no fp8 quantization_config "
                                     f"to say how it is scaled", param="model")
        if tensor.dtype != torch.float8_e4m3fn and (not tensor.dtype.is_floating_point or tensor.element_size() < 2):
            raise ModelNotFoundError(f"weight {name!r} is {dtype}: pagoda reads float32, bfloat16 and float16 "
                                     f"weights, and float8_e4m3fn ones of an FP8 checkpoint (is this a quantized "
                                     f"checkpoint without its quantization_config?)", param="model")
        return tensor

    def _fused_expert(self, name: str, full_shape: tuple[int, ...], shard_dim: int | None, start: int,
                      length: int) -> torch.Tensor | None:
        """One expert's projection cut from fused 3-D expert tensors (`experts.gate_up_proj` [E, 2I, H] with gate
        rows first, `experts.down_proj` [E, H, I], as transformers 5 keeps them), when the checkpoint has those
        instead of per-expert keys."""
        match = FUSED_EXPERT_NAME.fullmatch(name)
        if match is None:
            return None
        stem, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        fused = "gate_up_proj" if proj in ("gate_proj", "up_proj", "w1", "w3") else "down_proj"
        key = next((k for k in (f"{stem}.experts.{fused}", f"{stem}.experts.{fused}.weight") if k in self._file_of),
                   None)
        if key is None:
            return None
        view = self._handles[self._file_of[key]].get_slice(key)
        shape = tuple(view.get_shape())
        rows, cols = full_shape
        expected = (shape[0], 2 * rows, cols) if fused == "gate_up_proj" else (shape[0], rows, cols)
        if shape != expected or expert >= shape[0]:
            raise ModelNotFoundError(f"fused expert weight {key!r} has shape {shape}, config.json implies "
                                     f"[experts, {expected[1]}, {expected[2]}]", param="model")
        first = rows if proj in ("up_proj", "w3") else 0  # gate rows, then up rows
        one = slice(expert, expert + 1)
        if shard_dim == 0:
            tensor = view[one, first + start:first + start + length]
        elif shard_dim == 1:
            tensor = view[one, first:first + rows, start:start + length]
        else:
            tensor = view[one, first:first + rows]
        tensor = tensor[0]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return self._readable(key, tensor)

    def _read_whole(self, name: str) -> torch.Tensor | None:
        file = self._file_of.get(name)
        if file is None:
            return None
        tensor = self._handles[file].get_tensor(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def scalar(self, *names: str) -> float | None:
        """The value of the first of these one-element tensors the checkpoint has."""
        for name in names:
            tensor = self._read_whole(name)
            if tensor is not None:
                if tensor.numel() != 1:
                    raise ModelNotFoundError(f"{name!r} should hold one value, has shape {tuple(tensor.shape)}",
                                             param="model")
                return float(tensor.float().item())
        return None

    def fp8_scale(self, name: str, full_shape: tuple[int, ...], shard_dim: int | None, start: int,
                  length: int) -> torch.Tensor:
        """The fp32 scales of an e4m3 weight `name` [N, K] for this rank's slice, as the model keeps them:
        [rows, 1] per channel, or [rows, ceil(cols / g)] per row and g columns."""
        if self.fp8 is None:
            raise ModelNotFoundError(f"{name!r} is float8 but config.json has no fp8 quantization_config",
                                     param="model")
        n, k = full_shape
        stem = name.removesuffix("weight")
        if self.fp8.block is not None:
            scale = self._read_whole(stem + "weight_scale_inv")
            if scale is None:
                scale = self._read_whole(stem + "weight_scale")  # compressed-tensors block strategy
            bn, bk = self.fp8.block
            expected = (-(-n // bn), -(-k // bk))
            if scale is None or tuple(scale.shape) != expected:
                raise ModelNotFoundError(f"{name!r}: expected block scales {expected}, found "
                                         f"{None if scale is None else tuple(scale.shape)}", param="model")
            rows = scale.float().repeat_interleave(bn, dim=0)[:n]  # [N, K / bk]
            if shard_dim == 0:
                return rows[start:start + length]
            if shard_dim == 1:
                if start % bk or (length % bk and start + length != k):
                    raise ConfigError(f"{name!r}: tensor_parallel_size splits its {k} columns at {start}, inside a "
                                      f"{bk}-column scale block", param="tensor_parallel_size")
                return rows[:, start // bk:-(-(start + length) // bk)]
            return rows
        scale = self._read_whole(stem + "weight_scale")
        if scale is None or scale.numel() not in (1, n):
            raise ModelNotFoundError(f"{name!r}: expected a weight_scale of {n} or 1 values, found "
                                     f"{None if scale is None else tuple(scale.shape)}", param="model")
        rows = scale.float().reshape(-1, 1).expand(n, 1)  # [N, 1]: per tensor -> the same for every row
        return rows[start:start + length] if shard_dim == 0 else rows


INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(folder: Path) -> list[str]:
    """The safetensors files of a checkpoint: those its index's weight_map names (each must be there), else every
    *.safetensors file in the folder."""
    index = folder / INDEX_FILE
    if not index.is_file():
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise ModelNotFoundError(f"no *.safetensors files in {str(folder)!r}")
        return files
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as exc:
        raise ModelNotFoundError(f"{INDEX_FILE} in {str(folder)!r} is no JSON object: {exc}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise ModelNotFoundError(f"{INDEX_FILE} in {str(folder)!r} has no weight_map of tensor names to files")
    files = sorted(set(weight_map.values()))
    missing = [file for file in files if not (folder / file).is_file()]
    if missing:
        raise ModelNotFoundError(f"{INDEX_FILE} in {str(folder)!r} names {len(missing)} file(s) the folder lacks: "
                                 f"{', '.join(missing)} (an incomplete download?)")
    return files


def _open_safetensors(path: Path) -> safe_open:
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as exc:  # a truncated or corrupt file, one that cannot be read
        raise ModelNotFoundError(f"cannot read {path.name} in {str(path.parent)!r}: {exc}") from None


FUSED_EXPERT_NAME = re.compile(r"(.+)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")


@dataclass(frozen=True, slots=True)
class CheckpointFp8:
    """How a checkpoint stores FP8 linear weights."""

    method: str  # "fp8" (Hugging Face) or "compressed-tensors"
    block: tuple[int, int] | None  # (rows, cols) of one weight scale block; None: per channel or per tensor


def checkpoint_fp8(model_dir: str | Path) -> CheckpointFp8 | None:
    """The FP8 format config.json declares (quantization_config), None for an unquantized checkpoint; any other
    quantization is a ConfigError."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    quant = json.loads(path.read_text()).get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method == "fp8":
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"fp8 checkpoint format {quant.get('fmt')!r} is not supported (only e4m3)",
                              param="quantization")
        block = quant.get("weight_block_size")
        return CheckpointFp8("fp8", (int(block[0]), int(block[1])) if block else None)
    if method == "compressed-tensors":
        return CheckpointFp8("compressed-tensors", _compressed_tensors_block(quant))
    raise ConfigError(f"quantization_config quant_method {method!r} is not supported (fp8, compressed-tensors "
                      f"FP8)", param="quantization")


def _compressed_tensors_block(quant: dict) -> tuple[int, int] | None:
    """Check a compressed-tensors config is FP8 weights (8-bit float, channel/tensor/block strategy) on every
    group; return the block shape for the block strategy."""
    if quant.get("format") not in (None, "float-quantized", "naive-quantized"):
        raise ConfigError(f"compressed-tensors format {quant.get('format')!r} is not supported (float-quantized)",
                          param="quantization")
    blocks = set()
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        strategy = weights.get("strategy")
        if weights.get("num_bits") != 8 or weights.get("type") != "float" or strategy not in (
                "channel", "tensor", "block"):
            raise ConfigError(f"compressed-tensors weights {weights} are not FP8 per channel, tensor or block",
                              param="quantization")
        block = tuple(weights.get("block_structure") or ()) if strategy == "block" else None
        blocks.add(block)
    if len(blocks) > 1:
        raise ConfigError("compressed-tensors groups mix weight strategies", param="quantization")
    block = blocks.pop() if blocks else None
    return (int(block[0]), int(block[1])) if block else None


def resolve_fp8(quantization: str | None, model_dir: str | Path | None, load_format: str) -> Fp8Weights | None:
    """The model's FP8 layout: the checkpoint's (whatever `quantization` says), else per channel when asked."""
    found = checkpoint_fp8(model_dir) if model_dir is not None and load_format != "dummy" else None
    if found is not None:
        return Fp8Weights(group_size=found.block[1] if found.block else None)
    if quantization == "fp8":
        return Fp8Weights(group_size=None)
    if quantization == "fp8_block":
        return Fp8Weights(group_size=128)
    return None


class DummySource:
    """Seeded random weights: each full tensor is drawn from its own generator, then sliced."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype) -> None:
        self.seed, self.device, self.dtype = seed, device, dtype

    def __call__(self, name: str, full_shape: tuple[int, ...], shard_dim: int | None, start: int,
                 length: int) -> torch.Tensor:
        generator = torch.Generator(device=self.device)
        seed = self.seed * 1_000_003 + zlib.crc32(name.encode())
        if not -(2**63) <= seed < 2**64:  # into torch's range (a seed within it keeps its weights)
            seed %= 2**64
        generator.manual_seed(seed)
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
    check_tied_head(model, source)
    return source.bytes_read


def check_tied_head(model: CausalLM, source: SafetensorsSource) -> None:
    """config.json ties the LM head to the embeddings, yet the checkpoint saved an lm_head.weight: served tied when
    its values are the embeddings', refused otherwise (transformers 5 then unties them and uses lm_head.weight,
    earlier versions and vLLM the embeddings: the same folder gives other tokens in each)."""
    if not model.arch.tie_word_embeddings or "lm_head.weight" not in source._file_of:
        return
    embed = next(place for place in placements(model) if place.hf_name == "model.embed_tokens.weight")
    place = replace(embed, hf_name="lm_head.weight")
    head = source(place.hf_name, place.full_shape, place.shard_dim, place.shard_start, place.shard_len)
    if head.dtype == torch.float8_e4m3fn:
        head = _dequantized(source, place, head)
    if not torch.equal(head.to(embed.target.device, embed.target.dtype), embed.target):
        raise ConfigError("config.json says tie_word_embeddings true, but the checkpoint's lm_head.weight differs "
                          "from model.embed_tokens.weight (transformers 5 would use lm_head.weight, older versions "
                          "the embeddings): set tie_word_embeddings false to serve lm_head.weight, or remove "
                          "lm_head.weight to serve the embeddings", param="model")


def export_hf_state_dict(model: CausalLM, arch: ModelArch) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (tensor_parallel_size 1): to build a peer model."""
    assert model.tp.size == 1 and model.fp8 is None, "exports bf16/fp32 weights of one rank only"
    state: dict[str, torch.Tensor] = {}
    for place in placements(model):
        value = place.target.detach().clone()
        if place.row_order is not None:  # back to the checkpoint's row order
            value = value.index_select(0, torch.argsort(place.row_order.to(value.device)))
        state[place.hf_name] = value
    if arch.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state
