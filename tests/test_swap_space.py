"""The default swap space (--swap-space unset): which models get one, and how much host memory each rank takes."""

from __future__ import annotations

from pagoda.services.worker.model_runner import swap_pays
from pagoda.shared.config import EngineConfig
from pagoda.shared.shapes import SHAPES


def test_the_default_swap_space_goes_where_copying_beats_recomputing() -> None:
    assert swap_pays(SHAPES["llama3-8b"], SHAPES["llama3-8b"].kv_bytes_per_token(2))
    assert swap_pays(SHAPES["deepseek-v2-lite"], SHAPES["deepseek-v2-lite"].kv_bytes_per_token(2))
    assert not swap_pays(SHAPES["qwen3-0.6b"], SHAPES["qwen3-0.6b"].kv_bytes_per_token(2))  # 5.7 us vs 2.2 a token


def test_the_default_swap_space_shares_the_free_ram_among_the_hosts_gpus() -> None:
    gib = 1 << 30
    config = EngineConfig()
    assert config.resolved_swap_bytes("cpu", 512 * gib) == 0  # the cache already lives in host memory
    assert config.resolved_swap_bytes("cuda", 512 * gib) == 16 * gib
    assert config.resolved_swap_bytes("cuda", 128 * gib) == 16 * gib
    assert config.resolved_swap_bytes("cuda", 128 * gib, host_gpus=8) == 2 * gib  # an eighth of the RAM, 8 ways
    assert EngineConfig(tensor_parallel_size=4).resolved_swap_bytes("cuda", 128 * gib) == 4 * gib
    assert EngineConfig(swap_space=0.5).resolved_swap_bytes("cpu", 1 * gib) == gib // 2  # asked: as asked


def test_the_pool_is_registered_over_plain_pages_and_unregistered_before_they_are_freed() -> None:
    import gc

    import torch

    from pagoda.services.worker.device import page_locked_empty

    registered: dict[int, int] = {}
    unregistered: list[int] = []

    def register(address: int, nbytes: int) -> int:
        registered[address] = nbytes
        return 0

    pool = page_locked_empty((3, 2, 16, 8), torch.bfloat16, register, unregistered.append)
    assert pool.shape == (3, 2, 16, 8) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert registered == {pool.data_ptr(): pool.numel() * 2}  # the tensor's own bytes, all of them
    pool[2, 1, 15, 7] = 1.5  # the last element is writable (the registered range is the tensor)
    address = pool.data_ptr()
    del pool
    gc.collect()
    assert unregistered == [address]
    fp8 = page_locked_empty((4, 5), torch.float8_e4m3fn, register, unregistered.append)
    assert fp8.dtype == torch.float8_e4m3fn and registered[fp8.data_ptr()] == 20
    assert page_locked_empty((0, 5), torch.bfloat16, register, unregistered.append).numel() == 0
