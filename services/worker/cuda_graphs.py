"""CUDA graphs for decode steps, and pinned host buffers for host -> device copies.

A decode step of a small model is hundreds of short kernels; launching them one by one costs more CPU
time than the GPU spends. Each padded batch size gets one graph of the whole forward plus the LM head,
replayed over static input buffers. Padding rows have slot -1 (no K/V write) and seq_len 0 (zero output).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch

from pagoda.services.worker.models import AttentionMetadata, CausalLM


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (and max_batch itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class PinnedStaging:
    """Reusable pinned buffers per named input (host -> device) and output (device -> host), in two sets.

    Copies from and into pinned memory are asynchronous: a buffer may be rewritten only once the copy that
    read it has run. With up to two steps in flight, step N uses set N % 2; when step N+2 reuses the set, the
    host has already waited on step N's event (finish), which follows all of step N's copies.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._set = 0

    def flip(self) -> None:
        """A new step: use the other set of buffers."""
        self._set ^= 1

    def _buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        key = (name, self._set)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = torch.empty(max(numel, 1024), dtype=dtype).pin_memory()
            self._buffers[key] = buffer
        return buffer[:numel]

    def pinned(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        staged = self._buffer(name, tensor.numel(), tensor.dtype).view(tensor.shape)
        staged.copy_(tensor)
        return staged

    def to_device(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self.pinned(tensor, name).to(self.device, non_blocking=True)

    def copy_into(self, dest: torch.Tensor, array: np.ndarray, name: str) -> None:
        dest.copy_(self.pinned(torch.from_numpy(np.ascontiguousarray(array)), name), non_blocking=True)

    def to_host(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Start copying a device tensor into pinned memory; read it after the step's event. On CPU: itself."""
        if tensor.device.type == "cpu":
            return tensor
        host = self._buffer("out_" + name, tensor.numel(), tensor.dtype).view(tensor.shape)
        host.copy_(tensor, non_blocking=True)
        return host


class DecodeGraphs:
    """Graphs of forward + LM head for decode batches padded to a few sizes."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_batch: int,
                 max_blocks: int, max_model_len: int, staging: PinnedStaging) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_batch)
        self.max_model_len = max_model_len
        self.staging = staging
        device, rows = model.final_norm.device, self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)  # [R]
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)  # [R]
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=device)  # [R]
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)  # [R]
        self.query_start = torch.arange(rows + 1, dtype=torch.int32, device=device)  # [R + 1]: one token each
        self.block_tables = torch.zeros((rows, max_blocks), dtype=torch.int32, device=device)  # [R, max_blocks]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def _run(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size], block_tables=self.block_tables[:size], seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start[:size + 1], seq_lens_host=[], query_lens_host=[], max_query_len=1,
            max_seq_len=self.max_model_len)  # an upper bound: the kernels read the real lengths from seq_lens
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)  # [size, H]
        return self.model.compute_logits(hidden)  # [size, V]

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory pool
                self._run(size)  # compile and warm the kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[size] = self._run(size)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def replay(self, input_ids: torch.Tensor, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
               block_tables: np.ndarray, patch: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Logits [B, V] of a decode batch of B sequences (one token each); input_ids [B] already on the device
        (gathered there from the last sampled ids: the host may not know them yet). patch: called with the
        device's block tables [B, max_blocks] once the host's are in (beams whose blocks the device chose)."""
        batch = len(positions)
        size = self.sizes[bisect.bisect_left(self.sizes, batch)]
        copy = self.staging.copy_into
        self.input_ids[:batch].copy_(input_ids)
        copy(self.positions[:batch], positions, "graph_positions")
        copy(self.slots[:batch], slots, "graph_slots")
        copy(self.seq_lens[:batch], seq_lens.astype(np.int32), "graph_seq_lens")
        copy(self.block_tables[:batch, :block_tables.shape[1]], block_tables, "graph_block_tables")
        if patch is not None:
            patch(self.block_tables[:batch, :block_tables.shape[1]])
        if size > batch:  # padding rows: no cache write, no attention
            self.slots[batch:size].fill_(-1)
            self.seq_lens[batch:size].zero_()
        self.graphs[size].replay()
        return self.logits[size][:batch]
