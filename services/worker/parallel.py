"""Tensor parallelism: one worker process per device, collectives through torch.distributed."""

from __future__ import annotations

from pagoda.services.worker.model import TensorParallel
from pagoda.shared.config import EngineConfig
from pagoda.shared.errors import ConfigError


def init_tensor_parallel(config: EngineConfig, rank: int) -> TensorParallel | None:
    """None for a single device; otherwise join the process group of this replica's ranks."""
    if config.tensor_parallel_size == 1:
        return None
    raise ConfigError("tensor_parallel_size > 1 is not available yet", param="tensor_parallel_size")
