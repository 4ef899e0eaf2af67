"""The one place that reads settings: CLI flags, keyword arguments and PAGODA_* environment variables."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from pagoda.shared.errors import ConfigError

ENV_PREFIX = "PAGODA_"
DEFAULT_MODEL_DIR = "models/smollm2-135m-instruct"
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")


@dataclass(slots=True)
class EngineConfig:
    """Everything the scheduler and the worker need to run one model replica."""

    model: str = DEFAULT_MODEL_DIR  # a Hugging Face folder, or a dummy shape name (load_format=dummy)
    tokenizer: str | None = None  # defaults to the model folder
    load_format: str = "auto"  # auto: safetensors from the folder; dummy: random weights for a shape
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda when present, else cpu
    seed: int = 0  # dummy weights and the default sampling seeds derive from it
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | None = None  # bytes for the KV cache; None: a fraction of device memory
    gpu_memory_utilization: float = 0.90  # fraction of device memory the worker may use on CUDA
    num_kv_blocks: int | None = None  # overrides both memory settings (tests, benchmarks)
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192 on CUDA, 2048 on CPU
    enforce_eager: bool = False  # True: no CUDA graphs
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}", param="dtype")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {LOAD_FORMATS}", param="load_format")
        for name in ("block_size", "max_num_seqs", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1", param=name)
        for name in ("max_model_len", "kv_cache_memory", "num_kv_blocks", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1", param=name)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]", param="gpu_memory_utilization")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments (the offline LLM(...)), naming any unknown one."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}", param=unknown[0])
        if isinstance(kwargs.get("kv_cache_memory"), str):
            kwargs["kv_cache_memory"] = parse_bytes(kwargs["kv_cache_memory"])
        return cls(**kwargs)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch  # only the worker side asks; the api process never calls this

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self, device: str) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device.startswith("cuda") else "float32"

    def resolved_max_num_batched_tokens(self, device: str) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if device.startswith("cuda") else 2048


_BYTE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
               "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648; '512MB' -> 512000000; '1000' -> 1000."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise ConfigError(f"cannot read {text!r} as a size in bytes (e.g. 4GiB, 512MB)", param="kv_cache_memory")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def _env(name: str) -> str | None:
    return os.environ.get(ENV_PREFIX + name.upper())


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags; each defaults to its PAGODA_<NAME> environment variable, then the dataclass."""
    defaults = EngineConfig()
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=_env("model") or defaults.model,
                       help="model folder (config.json + safetensors) or dummy shape name")
    group.add_argument("--tokenizer", default=_env("tokenizer"), help="tokenizer folder (default: the model's)")
    group.add_argument("--load-format", choices=LOAD_FORMATS, default=_env("load_format") or "auto")
    group.add_argument("--shape", default=None, help="dummy shape name (same as --model with --load-format dummy)")
    group.add_argument("--dtype", choices=DTYPES, default=_env("dtype") or "auto")
    group.add_argument("--device", default=_env("device") or "auto")
    group.add_argument("--seed", type=int, default=int(_env("seed") or 0))
    group.add_argument("--max-model-len", type=int, default=_int_env("max_model_len"))
    group.add_argument("--block-size", type=int, default=int(_env("block_size") or defaults.block_size))
    group.add_argument("--kv-cache-memory", type=parse_bytes, default=_bytes_env("kv_cache_memory"),
                       help="bytes for the KV cache, e.g. 2GiB (default: a fraction of device memory)")
    group.add_argument("--gpu-memory-utilization", type=float,
                       default=float(_env("gpu_memory_utilization") or defaults.gpu_memory_utilization))
    group.add_argument("--num-kv-blocks", type=int, default=_int_env("num_kv_blocks"))
    group.add_argument("--no-prefix-caching", action="store_true",
                       default=(_env("no_prefix_caching") or "") in ("1", "true"))
    group.add_argument("--max-num-seqs", type=int, default=int(_env("max_num_seqs") or defaults.max_num_seqs))
    group.add_argument("--max-num-batched-tokens", type=int, default=_int_env("max_num_batched_tokens"))
    group.add_argument("--enforce-eager", action="store_true", default=(_env("enforce_eager") or "") in ("1", "true"))
    group.add_argument("--tensor-parallel-size", type=int, default=int(_env("tensor_parallel_size") or 1))


def _int_env(name: str) -> int | None:
    value = _env(name)
    return int(value) if value else None


def _bytes_env(name: str) -> int | None:
    value = _env(name)
    return parse_bytes(value) if value else None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    model, load_format = args.model, args.load_format
    if args.shape:
        model, load_format = args.shape, "dummy"
    return EngineConfig(
        model=model, tokenizer=args.tokenizer, load_format=load_format, dtype=args.dtype,
        device=args.device, seed=args.seed, max_model_len=args.max_model_len, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size,
    )

