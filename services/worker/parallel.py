"""Tensor parallelism: one worker process per device, collectives through torch.distributed
(NCCL on GPU, gloo on CPU). Every rank runs every step; rank 0 replies to the scheduler."""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from pagoda.services.worker.device import resolve_device
from pagoda.services.worker.models import TensorParallel
from pagoda.shared.config import EngineConfig

log = logging.getLogger(__name__)

DEFAULT_INIT_ADDRESS = "tcp://127.0.0.1:29511"
INIT_TIMEOUT = timedelta(minutes=10)  # ranks load weights before they meet; big models take a while


class DistributedTP:
    """The collectives the model needs, over the default process group."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)  # in place: sum of the partial products of every rank
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]  # size x [N, V / size]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)  # [N, V]

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value (so all ranks size their KV cache alike)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())


def init_tensor_parallel(config: EngineConfig, rank: int) -> TensorParallel | None:
    """None for a single device; otherwise join this replica's process group as `rank`."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    assert 0 <= rank < size, f"rank {rank} outside tensor_parallel_size {size}"
    on_cuda = resolve_device(config).startswith("cuda")
    if on_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    address = config.tp_init_address or DEFAULT_INIT_ADDRESS
    log.info("rank %d of %d joining %s (%s)", rank, size, address, "nccl" if on_cuda else "gloo")
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=address, rank=rank, world_size=size,
                            timeout=INIT_TIMEOUT)
    return DistributedTP(rank, size)
