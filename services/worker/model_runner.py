"""Runs StepPlans: builds the flattened batch from persistent state, runs the model, samples on device.

A step is split in two so the host can prepare step N+1 while the device runs step N:

    launch(plan N):  apply the diff, build inputs, enqueue forward + sampling, start a non-blocking copy of
                     the sampled ids (and logprobs) into pinned memory, record an event
    finish():        wait on the oldest step's event, write its tokens into host state, build its StepResult

Decode input ids come from the device: `last_token[row]` holds each row's last sampled id, written on the
device by the sampling of the step that drew it, so step N+1 can be enqueued before the host knows step N's
tokens. On CPU the same code runs and every launch is complete when it returns. `execute` = both at once.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from pagoda.kernels import reference as kernel_ref
from pagoda.services.worker.batch_state import BatchState
from pagoda.services.worker.cuda_graphs import DecodeGraphs, PinnedStaging
from pagoda.services.worker.device import CompileWatch, page_locked_empty, resolve_device, zeroed
from pagoda.services.worker.grammar import GrammarMasks, GrammarRows, grammar_tokenizer_loader, row_failure
from pagoda.services.worker.grammar_process import MaskJob, MaskProcess, grammar_rows
from pagoda.services.worker.isolation import FaultySampler, bisect_failures
from pagoda.services.worker.models import AttentionMetadata, CausalLM, Ops, TensorParallel
from pagoda.services.worker.sampler import Sampler, SamplerOutput, SamplingMetadata, beam_candidates, beam_continue
from pagoda.services.worker.sampler_warmup import warm_up_sampler
from pagoda.services.worker.sampling_state import SamplingState, admission_error
from pagoda.services.worker.weights import load_model, resolve_fp8
from pagoda.shared.config import EngineConfig, sampler_fault_seed
from pagoda.shared.errors import ConfigError
from pagoda.shared.messages import (
    BeamCandidates,
    BeamGroup,
    PromptScores,
    RowFailure,
    StepPlan,
    StepResult,
)
from pagoda.shared.shapes import ModelArch, check_divisible, resolve_arch, resolve_max_model_len

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30
SWAP_CHUNK = 64  # blocks a swap gathers on the device at a time (64 MiB at llama3-8b's fp8 blocks)
SWAP_BYTES_PER_S = 40e9  # host <-> device copies, each way (pinned: 49-50 GiB/s measured on the H200 host)
RECOMPUTE_FLOPS_PER_S = 4e14  # a prefill token's matmuls, about half an H200's bf16 peak (assumed)
# prompt_logprobs: logits of at most this many positions at once, and at most max_num_seqs / 2, so that their
# [rows, V] fp32 logits and log-softmax together stay within the [max_num_seqs, V] logits profile_run measured.
PROMPT_SCORE_ROWS = 128
# The GIL switch interval once grammar masks fill on a thread (CPython's: 5 ms). The mask job takes the GIL three
# times (to start, after consume_token_par, after the mask fill), each time waiting up to this long for the step
# loop's thread to yield: a job of three GIL-free calls beside 3 ms of Python ended 1.64 ms after its start at
# 0.2 ms, 1.03 ms at 0.05 ms (0.4 ms alone; this project's 2-core CPU). Only a thread waiting for the GIL makes
# the interval count, so steps without grammar rows pay nothing.
MASK_SWITCH_INTERVAL_S = 0.00005


@dataclass(slots=True)
class HostBatch:
    """One step's inputs on the host, before they go to the device."""

    rows: np.ndarray  # [B] state rows in batch order
    counts: np.ndarray  # [B] tokens each sequence computes this step
    seq_lens: np.ndarray  # [B] tokens computed after this step
    query_start: np.ndarray  # [B + 1] offsets of each sequence's tokens in the flat batch
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T] flat KV cache slots
    block_tables: np.ndarray  # [B, max_blocks]
    sampled: np.ndarray  # [S] indices into the batch of the sequences that sample
    is_decode: bool  # one token per sequence
    from_device: np.ndarray  # [K] flat indices whose input token was sampled by a step the host has not finished
    from_device_rows: np.ndarray  # [K] their state rows (last_token[row] holds the token)


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step enqueued on the device whose sampled ids may still be on their way to the host."""

    plan: StepPlan
    seq_ids: list[int] = field(default_factory=list)  # [S] the requests that sampled, in result order
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [S] their state rows
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [S] index of the token
    token_ids: torch.Tensor | None = None  # [S] int64, host (pinned on CUDA): valid once the event completed
    logprobs: torch.Tensor | None = None  # [S] fp32, host, when some row asked
    top_token_ids: torch.Tensor | None = None  # [S, k] int64, host
    top_logprobs: torch.Tensor | None = None  # [S, k] fp32, host
    ranks: torch.Tensor | None = None  # [S] int64, host: each sampled token's rank (1: the likeliest)
    num_logprobs: list[int] = field(default_factory=list)  # [S] top-k each row asked for (-1: none)
    prompt_scores: list[PromptScores] = field(default_factory=list)
    event: torch.cuda.Event | None = None  # CUDA: recorded after the copies to the host
    is_decode: bool = False
    state_version: int = -1  # BatchState.version when the step was launched (its rows belonged to its requests)
    synced: bool = False  # host state holds this step's tokens
    error: str = ""  # the step failed: its requests were dropped, its result says why
    failed: list[RowFailure] = field(default_factory=list)  # requests dropped from this step alone
    beam_groups: list[BeamGroup] = field(default_factory=list)  # the beam searches that sampled, in result order
    beam_token_ids: torch.Tensor | None = None  # [G, k] int64, host: their best continuations
    beam_parents: torch.Tensor | None = None  # [G, k] int64, host
    beam_scores: torch.Tensor | None = None  # [G, k] fp32, host
    # the groups whose next beams the device chose (BeamGroup.on_device): their index in beam_groups, the slot
    # parents [D, W] (host), and each slot's state row, seq id, new token's index and the token [Bd] (host)
    device_groups: list[int] = field(default_factory=list)
    beam_slot_parents: torch.Tensor | None = None
    beam_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    beam_seq_ids: list[int] = field(default_factory=list)
    beam_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    beam_tokens: torch.Tensor | None = None


@dataclass(slots=True)
class StepTimer:
    """CUDA events around each step's device work, for the decode GPU busy fraction (benchmarks only)."""

    steps: list[tuple[bool, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)  # (decode, start, end)
    # a step whose sampling waited for grammar masks (launch deferred it): its forward's end and its sampling's
    # start, recorded once the host has the masks, keyed by its end event; the device idles between the two when
    # the masks come after the forward
    deferred: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=dict)
    host_wait_s: float = 0.0  # the step loop blocked in finish() on a step's event (the host waiting for the device)
    host_waits: int = 0

    def decode_busy_fraction(self) -> tuple[float, int]:
        """Sum of decode steps' device time / the device time between their ends, over runs of consecutive
        decode steps; and how many steps that covers. Gaps between one step's end and the next one's start are
        the device waiting for the host, and so is a deferred step's gap between its forward and its sampling.
        Call after the device is synchronized."""
        busy = span = 0.0
        count = 0
        for (prev_decode, _, prev_end), (decode, start, end) in zip(self.steps, self.steps[1:], strict=False):
            if prev_decode and decode:
                busy += start.elapsed_time(end) - self.sampling_gap_ms(end)
                span += prev_end.elapsed_time(end)
                count += 1
        return (busy / span if span > 0 else 0.0), count

    def sampling_gap_ms(self, end: torch.cuda.Event) -> float:
        """The device's idle time between a deferred step's forward and its sampling (0 for other steps)."""
        gap = self.deferred.get(id(end))
        return gap[0].elapsed_time(gap[1]) if gap is not None else 0.0

    def summary(self) -> dict[str, float]:
        """Decode GPU busy fraction, decode steps' device time (p50) and mean sampling gap, host wait per step."""
        fraction, count = self.decode_busy_fraction()
        decode = sorted(start.elapsed_time(end) - self.sampling_gap_ms(end) for is_decode, start, end in self.steps
                        if is_decode)
        gaps = [self.sampling_gap_ms(end) for is_decode, _, end in self.steps if is_decode and id(end) in self.deferred]
        return {"decode_gpu_busy_fraction": fraction, "decode_steps": count,
                "decode_step_gpu_ms_p50": decode[len(decode) // 2] if decode else 0.0,
                "sampling_gap_ms_mean": sum(gaps) / len(gaps) if gaps else 0.0, "deferred_steps": len(gaps),
                "host_wait_ms_per_step": self.host_wait_s / max(self.host_waits, 1) * 1e3}


@dataclass(slots=True)
class MaskTimes:
    """Host seconds spent on grammar masks, summed over steps (benchmarks read them; cheap to keep)."""

    steps: int = 0  # steps whose sampling had grammar masks
    fill_s: float = 0.0  # accept + mask fill (on the mask thread, or inline)
    waited_s: float = 0.0  # the step loop's thread blocked on them (inline: all of fill_s)
    latency_s: float = 0.0  # mask thread: from the job's submission (result N out) to its masks being ready
    jobs: int = 0  # jobs on the mask thread

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {"steps": self.steps, "fill_ms": self.fill_s / n * 1e3, "waited_ms": self.waited_s / n * 1e3,
                "latency_ms": self.latency_s / max(self.jobs, 1) * 1e3}


class ModelRunner:
    """Owns the model, the KV cache and the per-request state of one tensor-parallel rank."""

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None, ops: Ops | None = None) -> None:
        self.config = config
        self.device = torch.device(resolve_device(config))
        if tp is not None and self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU
        self.dtype: torch.dtype = getattr(torch, config.resolved_dtype(self.device.type))
        self.arch: ModelArch = resolve_arch(config.model, config.load_format, config.tokenizer)
        tp_size = tp.size if tp is not None else 1
        check_divisible(self.arch, tp_size)
        self.max_model_len = self._max_model_len()
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype.startswith("fp8") else self.dtype
        fp8 = resolve_fp8(config.quantization, config.model, config.load_format)
        self.model = CausalLM(self.arch, self.dtype, self.device, tp, max_positions=self.max_model_len, ops=ops,
                              fp8=fp8)
        self.bytes_read = load_model(self.model, config.model, config.load_format, config.seed)
        swap_bytes = config.resolved_swap_bytes(self.device.type, _available_ram(), _host_gpu_count())
        if config.swap_space is None and not swap_pays(self.arch, self.kv_bytes_per_block() // self.block_size):
            swap_bytes = 0  # the default only where copying beats recomputing
        self.num_swap_blocks = self.model.tp.agree_min(swap_bytes // self.kv_bytes_per_block(), self.device)
        # Pinning takes seconds (16 GiB on the H200 host: 9.7 s with torch's pinned allocator, 4.3 s registered;
        # llama3-8b's engine loaded in 9.2 s with the registered pool on this thread, 6.7 s without a pool): started
        # here, before the cache is sized, collected at the end.
        pinning = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swap-pool")
        swap_job = pinning.submit(self._allocate_swap, self.num_swap_blocks)
        pinning.shutdown(wait=False)
        self.num_blocks = self.model.tp.agree_min(self._num_kv_blocks(), self.device)
        self.kv_cache, self.kv_caches = self._allocate_kv(self.num_blocks)
        self.state = BatchState(config.max_num_seqs, self.max_model_len, self.block_size, self.arch.eos_token_ids)
        self.sampler = Sampler()
        self.grammars: GrammarRows | MaskProcess = grammar_rows(config, self.arch, self.device.type,
                                                                grammar_tokenizer_loader(config, self.arch))
        self.staging = PinnedStaging(self.device)
        self.sampling = SamplingState(config.max_num_seqs, self.arch.vocab_size, self.device, self.arch.eos_token_ids,
                                      self._to_device)
        self.last_token = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)  # [R]
        self.pending_step = np.full(config.max_num_seqs, -1, dtype=np.int64)  # [R] step whose last token host lacks
        # beams whose line the device chose (BatchState.lineage_on_device): cumulative logprob and block table
        self.beam_scores = torch.zeros(config.max_num_seqs, dtype=torch.float32, device=self.device)  # [R]
        self.beam_tables = torch.zeros(self.state.block_table.shape, dtype=torch.int32, device=self.device)  # [R, M]
        self._step_tables: torch.Tensor | None = None  # [B, M'] int32: the block tables of the step being launched
        if self.device.type == "cuda":
            from pagoda.kernels.block_copy import copy_blocks
            self._copy_block_pairs = copy_blocks
        else:
            self._copy_block_pairs = kernel_ref.copy_blocks
        self._launched: deque[LaunchedStep] = deque()  # oldest first
        # launched, its sampling waiting for grammar masks: (step, inputs, logits, timer start); see resume()
        self._deferred: tuple[LaunchedStep, HostBatch, torch.Tensor, torch.cuda.Event | None] | None = None
        # sampled tokens the host has whose matchers have not consumed them yet (seq ids, token ids), in step order
        self._unaccepted: list[tuple[list[int], list[int]]] = []
        # the deferred step's masks: on _mask_thread, or in the grammar process (MaskProcess)
        self._masks_job: Future[GrammarMasks | None] | MaskJob | None = None
        self._masks_for: list[int] = []  # the sequences (in sampling order) the job fills masks for
        self._mask_thread: ThreadPoolExecutor | None = None
        self._switch_interval: float | None = None  # the process's GIL switch interval while a mask job runs
        self.mask_times = MaskTimes()
        self._mask_rows: torch.Tensor | None = None  # [R, W] int32 on the device: this step's grammar masks
        self._forward_end: torch.cuda.Event | None = None  # the deferred step's forward ended (step_timer only)
        # step_timer only: the deferred step's masks are in (its sampling's device work starts after this event)
        self._masks_in: torch.cuda.Event | None = None
        self._timing_masks = False  # _sample records _masks_in (a deferred step, timed)
        self._lost: set[int] = set()  # requests of failed steps: later plans in flight may still name them
        self.step_timer: StepTimer | None = None
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, config.max_num_seqs,
                                       self.state.block_table.shape[1], self.max_model_len, self.staging)
            self.graphs.capture()
        self.compile_watch: CompileWatch | None = None
        if self.device.type == "cuda":
            self.warm_up()
            self.warm_up_sampler()
            self.compile_watch = CompileWatch(log)  # from here on, a Triton compile is a warm-up miss: logged
            self.compile_watch.install()
        fault_seed = sampler_fault_seed()  # tests only; installed after the warm-ups above
        if fault_seed is not None:
            self.sampler = FaultySampler(fault_seed)
        if config.kv_scale_calibration and self.kv_dtype == torch.float8_e4m3fn:
            for layer in self.model.layers:  # after the dummy passes above: the first real prefill sets them
                layer.calibrate_kv = True
        self.swap_pool = swap_job.result()  # [S, L, kv tensors, bs, heads, D] on the host
        if isinstance(self.grammars, MaskProcess):  # its start-up ran beside the capture and warm-ups above: its CPU
            self.grammars.wait_started()  # is spent before the worker reports ready, not in the first requests
        log.info("model %s: %.1fM params, %s on %s, %d KV blocks of %d tokens", config.model,
                 self.arch.num_params() / 1e6, self.dtype, self.device, self.num_blocks, self.block_size)

    # ---------------------------------------------------------------- sizing

    def _allocate_kv(self, num_blocks: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """The cache in the layout the model family asks for, and each layer's tensors (K and V, or one latent)."""
        layout = self.model.kv_layout()
        shape = (self.arch.num_layers, layout.num_tensors, num_blocks, self.block_size, layout.num_heads,
                 layout.head_dim)
        cache = zeroed(shape, self.kv_dtype, self.device)  # [L, kv tensors, N, bs, heads, D]
        per_layer = [tuple(cache[i, j] for j in range(layout.num_tensors)) for i in range(self.arch.num_layers)]
        return cache, per_layer

    def _allocate_swap(self, num_blocks: int) -> torch.Tensor:
        """Host slots for preempted sequences' blocks, each slot one block of every layer, contiguous (one copy a
        slot); pinned on CUDA so the copies run asynchronously on the step's stream."""
        layout = self.model.kv_layout()
        block_shape = (self.arch.num_layers, layout.num_tensors, self.block_size, layout.num_heads, layout.head_dim)
        if self.device.type == "cuda":
            return page_locked_empty((num_blocks, *block_shape), self.kv_dtype)
        return torch.empty((num_blocks, *block_shape), dtype=self.kv_dtype)

    def _swap(self, swap_out: list[int], swap_in: list[int]) -> None:
        """A plan's preemption copies, before anything else of it touches the cache: blocks out to host slots (a
        preempted sequence's, whose blocks this plan may give to others), then slots back into blocks (a sequence
        readmitted). On the step's stream, so they follow the steps before and precede this one's forward; in
        chunks of SWAP_CHUNK blocks, so the device gathers take little memory."""
        cache, pool = self.kv_cache, self.swap_pool
        if cache.element_size() == 1:  # fp8: moved as bytes (indexing kernels need not know the float8 types)
            cache, pool = cache.view(torch.uint8), pool.view(torch.uint8)
        if swap_out:
            blocks = self._to_device(np.asarray(swap_out[0::2], dtype=np.int64), "swap_out")  # [N] (one staging use)
            slots = swap_out[1::2]
            for start in range(0, len(slots), SWAP_CHUNK):
                gathered = cache[:, :, blocks[start:start + SWAP_CHUNK]].movedim(2, 0).contiguous()  # [C, L, kv, ...]
                for row, slot in enumerate(slots[start:start + SWAP_CHUNK]):
                    pool[slot].copy_(gathered[row], non_blocking=True)
        if swap_in:
            slots = swap_in[0::2]
            blocks = self._to_device(np.asarray(swap_in[1::2], dtype=np.int64), "swap_in")  # [N]
            for start in range(0, len(slots), SWAP_CHUNK):
                chunk = slots[start:start + SWAP_CHUNK]
                staged = torch.empty((len(chunk), *pool.shape[1:]), dtype=pool.dtype, device=self.device)
                for row, slot in enumerate(chunk):
                    staged[row].copy_(pool[slot], non_blocking=True)
                cache[:, :, blocks[start:start + SWAP_CHUNK]] = staged.movedim(0, 2)  # [L, kv tensors, C, bs, ...]

    def _max_model_len(self) -> int:
        return resolve_max_model_len(self.arch, self.config.max_model_len)

    def kv_bytes_per_block(self) -> int:
        itemsize = torch.finfo(self.kv_dtype).bits // 8
        return self.block_size * self.model.kv_layout().bytes_per_token(self.arch.num_layers, itemsize)

    def _num_kv_blocks(self) -> int:
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_memory is not None:
            budget = config.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = min(DEFAULT_CPU_KV_BYTES, _available_ram() // 4)
        num_blocks = budget // self.kv_bytes_per_block()
        if num_blocks < 1:
            detail = ""
            if config.kv_cache_memory is None and self.device.type == "cuda":
                total = torch.cuda.mem_get_info(self.device)[1]
                detail = (f" (gpu_memory_utilization {config.gpu_memory_utilization} of {total / 2**30:.1f} GiB, "
                          f"less the memory already in use on the device: this engine's weights and peak "
                          f"activations, and any other engine or process holding its own)")
            raise ConfigError(f"the KV cache budget of {budget} bytes holds no block of "
                              f"{self.kv_bytes_per_block()} bytes{detail}", param="kv_cache_memory")
        return int(num_blocks)

    def _cuda_kv_budget(self) -> int:
        """What is left of gpu_memory_utilization after weights and a profiled peak of activations (in this process,
        with whatever else its allocator holds: another engine's cache counts as in use), and what other processes
        use."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        return int(total * self.config.gpu_memory_utilization) - peak - used_by_others

    def profile_run(self) -> None:
        """A forward pass of max_num_batched_tokens prompt tokens, to find the peak activation memory."""
        num_tokens = min(self.config.resolved_max_num_batched_tokens(self.device.type), self.max_model_len)
        self.dummy_forward([num_tokens], num_logits=min(self.config.max_num_seqs, num_tokens))

    def warm_up(self) -> None:
        """Compile the kernel variants eager steps use, so no Triton JIT lands inside a served request (a compile
        stalls its step 0.1-1.3 s on an H200): steps mixing decodes and a prefill chunk, and decode-only batches
        run eagerly (prompts wholly in the prefix cache) with each of the attention's split counts. Prefill-only
        variants compile in profile_run, CUDA-graph decode in the capture."""
        self.dummy_forward([1] * 64 + [64], num_logits=65)
        self.dummy_forward([1] * 3 + [40, 24], num_logits=5)
        for num_splits in (1, 2, 4, 8, 16, 32, 64):  # pick_num_splits' values; 64 keys a split each
            if 64 * num_splits <= self.max_model_len:  # longer sequences, and so this split count, never happen
                self.dummy_forward([1], num_logits=1, context_len=64 * num_splits - 1)
        self.warm_up_experts()
        same = torch.zeros(1, dtype=torch.int64, device=self.device)  # [1] a pair that copies nothing
        self._copy_block_pairs(self.kv_cache.flatten(0, 1), same, same)  # beam search's block copy: compiled now

    @torch.inference_mode()
    def warm_up_experts(self) -> None:
        """Mixture-of-experts: the fused kernel's tiles change with the token count's power-of-two bucket; run one
        sparse layer's experts once per bucket a step can have, so each tile variant compiles now."""
        sparse = next((layer.mlp for layer in self.model.layers if getattr(layer, "mlp", None) is not None), None)
        if sparse is None:
            return
        max_tokens = self.config.resolved_max_num_batched_tokens(self.device.type)
        # the fused weights' experts and each token's picks, shared experts (DeepSeek's) included
        num_experts, top_k = sparse.w_gate_up.shape[0], sparse.moe.top_k + sparse.num_shared
        num_tokens = 1
        while num_tokens <= max_tokens:
            x = torch.zeros(num_tokens, self.arch.hidden_size, dtype=self.dtype, device=self.device)  # [T, H]
            ids = (torch.arange(num_tokens * top_k, device=self.device) % num_experts).to(torch.int32)
            weights = torch.full((num_tokens, top_k), 1.0 / top_k, device=self.device)  # [T, k]
            group = sparse.fp8.group_size if sparse.fp8 is not None else None
            self.model.ops.moe_experts(x, sparse.w_gate_up, sparse.w_down, weights, ids.view(num_tokens, top_k),
                                       sparse.w_gate_up_scale, sparse.w_down_scale, group)
            num_tokens *= 2

    @torch.inference_mode()
    def warm_up_sampler(self) -> None:
        """Compile the sampling kernels' variants on scratch state and logits in the model's dtype, so no sampled
        request waits for Triton's JIT (measured on an H200: ~4 s of compiles in the first sampled steps, and
        0.5-0.8 s ones inside later steps of batches mixing features): one batch per combination of features
        (sampler_warmup.py)."""
        started = time.perf_counter()
        count = warm_up_sampler(self.sampler, self.arch.vocab_size, self.dtype, self.device, self.arch.eos_token_ids)
        torch.cuda.synchronize(self.device)
        log.info("sampler warm-up: %d batches in %.1f s", count, time.perf_counter() - started)

    @torch.inference_mode()
    def dummy_forward(self, query_lens: list[int], num_logits: int, context_len: int = 0) -> None:
        """The model once on a synthetic batch over a scratch KV cache (the real one untouched): each sequence's
        query_lens[b] tokens follow context_len tokens already in the cache (zeros)."""
        size, device = self.block_size, self.device
        blocks_per_seq = -(-(max(query_lens) + context_len) // size)
        num_seqs = len(query_lens)
        scratch, caches = self._allocate_kv(num_seqs * blocks_per_seq)  # the real cache stays untouched
        positions = np.concatenate([np.arange(context_len, context_len + n) for n in query_lens])  # [T]
        seq_index = np.repeat(np.arange(num_seqs), query_lens)  # [T]
        query_start = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)  # [B + 1]
        seq_lens = [context_len + n for n in query_lens]  # [B]
        to = lambda array: torch.from_numpy(np.ascontiguousarray(array)).to(device)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=to(seq_index * blocks_per_seq * size + positions),
            block_tables=to(np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, -1)),
            seq_lens=to(np.asarray(seq_lens, dtype=np.int32)), query_start_loc=to(query_start),
            seq_lens_host=seq_lens, query_lens_host=list(query_lens), max_query_len=max(query_lens),
            max_seq_len=max(seq_lens))
        hidden = self.model(to(np.zeros(len(positions), dtype=np.int64)), to(positions), caches, meta)  # [T, H]
        self.model.compute_logits(hidden[-num_logits:]).float()  # the sampler's fp32 copy counts in the peak
        del scratch, caches, hidden

    # ---------------------------------------------------------------- one step

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """The serial step: launch and finish at once."""
        if not self.launch(plan):
            return StepResult(step_id=plan.step_id, seq_ids=[], sampled_token_ids=[])
        return self.finish()

    @property
    def num_launched(self) -> int:
        return len(self._launched)

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> bool:
        """Enqueue the step on the device; True if finish() will return its result (the plan runs requests).
        A step that cannot run drops its requests and finishes with StepResult.error, in order."""
        try:
            return self._launch(plan)
        except Exception as exc:  # noqa: BLE001 - one failed step must not take the worker down
            log.error("step %d failed:\n%s", plan.step_id, traceback.format_exc())
            self.recover(plan)
            self._launched.append(LaunchedStep(plan, synced=True, error=f"{type(exc).__name__}: {exc}"))
            return True

    def _launch(self, sent: StepPlan) -> bool:
        # A step deferred for its masks samples before the next forward reads its tokens. When this plan only
        # continues the running sequences, its host inputs are prepared while the masks are still on their way
        # (_prepare_ahead), so that the deferred sampling and this forward go out back to back once they come.
        ahead = self._prepares_ahead(sent)
        if not ahead:
            self._complete_deferred()
            self._grammar_barrier()
        self._swap(sent.swap_out, sent.swap_in)  # the plan's own, whatever lost requests drop from it
        plan, refused = self._refuse_bad_requests(self._without_lost(sent))
        forked_rows = self.state.apply(plan)
        self.pending_step[forked_rows] = -1  # a beam's token comes with the plan
        self._copy_blocks(plan.block_copies)
        self.sampling.admit([(self.state.row_of[new.seq_id], new) for new in plan.new_requests])
        self.grammars.apply(plan)
        for new in plan.new_requests:
            self.pending_step[self.state.row_of[new.seq_id]] = -1  # a NewRequest carries real tokens only
        if not plan.seq_ids:
            if sent.seq_ids:  # every request it ran belonged to a failed step: an empty result, in order
                self._launched.append(LaunchedStep(sent, synced=True, failed=refused))
            return bool(sent.seq_ids)
        if ahead:
            host = self._prepare_ahead(plan)
            self._complete_deferred()
            self._grammar_barrier()
            if self._lost.intersection(plan.seq_ids):  # the deferred sampling lost rows (grammar failures)
                plan = self._without_lost(plan)
                if not plan.seq_ids:
                    self._launched.append(LaunchedStep(sent, synced=True, failed=refused))
                    return True
                host = self._prepare(plan)
        else:
            host = self._prepare(plan)
        self.staging.flip()  # the previous step's copies may still read the other set of pinned buffers
        timer_start = self._timer_event()
        step = LaunchedStep(plan, is_decode=host.is_decode, state_version=self.state.version, failed=refused)
        input_ids = self._input_ids(host)  # [T] on the device
        if (self.graphs is not None and host.is_decode and self.graphs.fits(len(host.rows))
                and not self._scores_prompt(host).any()):
            logits = self.graphs.replay(input_ids, host.positions, host.slots, host.seq_lens, host.block_tables,
                                        lambda tables: self._patch_tables(tables, host))  # [B, V] fp32
        else:
            hidden = self._forward_eager(host, input_ids)
            logits = self._sampled_logits(host, hidden)
            step.prompt_scores = self._prompt_scores(plan, host, hidden)
        self.state.num_computed[host.rows] = host.seq_lens
        if logits is not None and self._waits_for_tokens(step, host):
            # Grammar masks follow the tokens of a step still running: its result goes out first (the caller
            # finishes it, then calls resume), and the masks fill while this step's forward runs.
            self._deferred = (step, host, logits, timer_start)
            self._forward_end = self._timer_event()
            self._launched.append(step)
            return True
        if logits is not None:
            self._sample(step, host, logits)
        self._record(step, timer_start)
        self._launched.append(step)
        return True

    def _prepares_ahead(self, sent: StepPlan) -> bool:
        """A step waits for its grammar masks and this plan only continues running sequences (nothing admitted,
        finished, forked or copied; no beams here or there): its inputs can be prepared before that step samples."""
        if self._deferred is None or not sent.seq_ids:
            return False
        deferred = self._deferred[0].plan
        return not (sent.new_requests or sent.finished_seq_ids or sent.block_copies or sent.beam_forks
                    or sent.beam_groups or deferred.beam_groups or sent.swap_out or sent.swap_in)

    def _prepare_ahead(self, plan: StepPlan) -> HostBatch:
        """_prepare as it will be once the deferred step has sampled: its sampled rows hold one more token, known
        on the device only (what _sample records). Rows that sampling loses make the caller prepare again."""
        assert self._deferred is not None
        step, host = self._deferred[0], self._deferred[1]
        rows = host.rows[host.sampled]  # [S]
        state = self.state
        pending = self.pending_step[rows].copy()  # [S]
        state.num_tokens[rows] += 1
        self.pending_step[rows] = step.plan.step_id
        try:
            return self._prepare(plan)
        finally:
            state.num_tokens[rows] -= 1
            self.pending_step[rows] = pending

    def _waits_for_tokens(self, step: LaunchedStep, host: HostBatch) -> bool:
        """Rows with a grammar sample in this step and an earlier step's tokens have not reached the host."""
        if not self.grammars.active or all(s.synced for s in self._launched):
            return False
        return self.grammars.has_matchers([step.plan.seq_ids[i] for i in host.sampled.tolist()])

    def resume(self) -> None:
        """Result N is out: start filling the masks of the step that launch() deferred (N + 1), after the steps
        before it have finished (their tokens advance the matchers first). The matchers advance and the masks fill
        on a thread (llguidance releases the GIL) while this thread goes on (the engine applies result N and plans
        N + 2; the service waits for that plan) and the device runs N + 1's forward; the next launch() or finish()
        enqueues N + 1's sampling with them. A no-op when nothing waits."""
        if self._deferred is None or self._masks_job is not None:
            return
        step = self._deferred[0]
        self._sync_before(step)
        seq_ids = [step.plan.seq_ids[i] for i in self._deferred[1].sampled.tolist()]
        accepts, self._unaccepted = self._unaccepted, []
        self._masks_for = seq_ids
        if isinstance(self.grammars, MaskProcess):  # no thread: the process fills them, sharing no GIL with us
            self._masks_job = self.grammars.submit(accepts, seq_ids, self._mask_job_done)
            return
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="masks")
        if self._switch_interval is None:
            # The job takes the GIL between llguidance's calls (which release it) while this thread runs Python
            # (a scheduler update, a poll loop): at the default 5 ms interval each hand-over could cost a step.
            # The interval is the process's: it comes back once the job is over (_job_over).
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._switch_interval, MASK_SWITCH_INTERVAL_S))
        self._masks_job = self._mask_thread.submit(self._fill_masks, accepts, seq_ids, time.perf_counter())

    def _job_over(self) -> None:
        """The mask job finished: the process's GIL switch interval is its own again."""
        self._masks_job = None
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    def _mask_job_done(self, fill_s: float, latency_s: float) -> None:
        """A grammar process's fill: its time there, and from submit to ready."""
        times = self.mask_times
        times.fill_s += fill_s
        times.latency_s += latency_s
        times.jobs += 1

    def _fill_masks(self, accepts: list[tuple[list[int], list[int]]], seq_ids: list[int],
                    submitted: float) -> GrammarMasks | None:
        """The mask thread's job: the matchers consume the steps' tokens, then the masks of seq_ids fill."""
        started = time.perf_counter()
        masks = self.grammars.advance_and_fill(accepts, seq_ids)
        ended = time.perf_counter()
        times = self.mask_times
        times.fill_s += ended - started
        times.latency_s += ended - submitted
        times.jobs += 1
        return masks

    def masks_pending(self) -> bool:
        """The deferred step's masks are still filling (its sampling cannot be enqueued yet)."""
        return self._masks_job is not None and not self._masks_job.done()

    @torch.inference_mode()
    def _complete_deferred(self) -> None:
        """Enqueue the deferred step's sampling (waiting for its masks); a no-op when nothing waits."""
        if self._deferred is None:
            return
        step, host, logits, timer_start = self._deferred
        self._deferred = None
        forward_end, self._forward_end = self._forward_end, None
        sampling_start = self._timer_event() if forward_end is not None else None
        self._masks_in, self._timing_masks = None, forward_end is not None
        try:
            self._sample(step, host, logits)  # records _masks_in once it has the masks (the host waited till then)
        except Exception as exc:  # noqa: BLE001 - as in launch(): the step fails, the worker goes on
            log.error("step %d failed:\n%s", step.plan.step_id, traceback.format_exc())
            self.recover(step.plan)  # waits for the mask job (_drop)
            step.error, step.synced = f"{type(exc).__name__}: {exc}", True
            return
        finally:
            self._timing_masks = False
        self._grammar_barrier()  # a job _sample did not use (its rows were all beams) must not outlive its step
        self._record(step, timer_start)
        if self.step_timer is not None and step.event is not None and forward_end is not None:
            assert sampling_start is not None
            masks_in, self._masks_in = self._masks_in, None
            self.step_timer.deferred[id(step.event)] = (forward_end, masks_in or sampling_start)

    def _grammar_barrier(self) -> None:
        """The matchers are this thread's again: the mask job is over and every synced token is consumed."""
        if self._masks_job is not None:
            try:
                self._masks_job.result()
            except Exception:  # noqa: BLE001 - the step that owned the job failed already; its error is out
                log.exception("grammar masks failed")
            self._job_over()
        if self._unaccepted:
            accepts, self._unaccepted = self._unaccepted, []
            for seq_ids, token_ids in accepts:
                self.grammars.accept(seq_ids, token_ids)

    def _copy_blocks(self, pairs: list[int]) -> None:
        """Beam search copy-on-write: whole KV blocks, (source, destination) pairs flattened, on every layer; a
        source is never a destination (it belongs to a beam that keeps its line)."""
        if not pairs:
            return
        index = self._to_device(np.asarray(pairs, dtype=np.int64), "block_copies")  # [2N]
        self.kv_cache[:, :, index[1::2]] = self.kv_cache[:, :, index[0::2]]  # [L, kv tensors, N, bs, heads, D]

    def _sample(self, step: LaunchedStep, host: HostBatch, logits: torch.Tensor) -> None:
        """Sample on the device, keep the ids there for the next step's inputs, start their copy to the host.
        Beam searches' rows go to their own selection (_select_beams)."""
        state = self.state
        sampled = host.sampled  # [S] batch indices
        if step.plan.beam_groups:
            is_beam = self._select_beams(step, host, logits)  # [S] bool
            if is_beam.all():
                return
            if is_beam.any():
                logits = logits[self._to_device(np.flatnonzero(~is_beam), "plain_rows")]  # [S', V]
                sampled = sampled[~is_beam]
        sampled_rows = host.rows[sampled]  # [S]
        positions = host.seq_lens[sampled]  # [S] index in token_ids of each sampled token
        plan_ids = step.plan.seq_ids
        seq_ids = list(plan_ids) if len(sampled) == len(plan_ids) else [plan_ids[i] for i in sampled.tolist()]
        metadata = self.sampling.metadata(sampled_rows)
        assert (self.sampling.num_output[sampled_rows] == positions - state.num_prompt_tokens[sampled_rows]).all(), \
            "the sampling offsets disagree with the plan's positions"
        if self.grammars.constrains(seq_ids):
            # Masks follow the previous steps' tokens: wait for them here, after this step's forward is enqueued,
            # so the device computes while the host advances the matchers (allowed_token_ids alone never wait).
            if self.grammars.has_matchers(seq_ids):
                self._sync_before(step)
            masks = self._grammar_masks(seq_ids)
            if self._timing_masks:
                self._masks_in, self._timing_masks = self._timer_event(), False  # the device idled until here
            failed = self._grammar_failures(step)
            if failed.intersection(seq_ids):  # their grammar process died, or their matcher failed to build
                keep = np.fromiter((seq_id not in failed for seq_id in seq_ids), dtype=bool, count=len(seq_ids))
                if not keep.any():
                    return
                logits = logits[self._to_device(np.flatnonzero(keep), "grammar_kept")]  # [S', V]
                sampled_rows, positions = sampled_rows[keep], positions[keep]
                seq_ids = [seq_id for seq_id, kept in zip(seq_ids, keep.tolist(), strict=True) if kept]
                metadata = self.sampling.metadata(sampled_rows)
                masks = narrow_masks(masks, keep)
            self._attach_grammar_masks(metadata, masks, len(seq_ids))
        state_rows = metadata.state_rows  # [S] on the device
        try:
            output = self.sampler(logits, metadata)
        except Exception:  # noqa: BLE001 - a failure that belongs to some rows must not fail the others
            log.error("step %d: sampling failed; isolating the rows that fail:\n%s", step.plan.step_id,
                      traceback.format_exc())
            kept, output = self._sample_isolating(step, logits, metadata, sampled_rows, seq_ids)
            sampled_rows, positions, seq_ids = sampled_rows[kept], positions[kept], [seq_ids[i] for i in kept]
            if output is None:
                return  # every row that sampled failed: their errors are in step.failed
            state_rows = None
        self.sampling.record(sampled_rows, output.token_ids, state_rows)  # counts, on the device
        rows_t = state_rows if state_rows is not None else self._to_device(sampled_rows, "sampled_rows")  # [S]
        self.last_token[rows_t] = output.token_ids
        assert (state.num_tokens[sampled_rows] == positions).all(), "a row samples past a token it lacks"
        state.num_tokens[sampled_rows] += 1  # the new token's value reaches host state in finish()
        self.pending_step[sampled_rows] = step.plan.step_id
        step.seq_ids = seq_ids
        step.rows, step.positions = sampled_rows, positions
        to_host = self.staging.to_host
        step.token_ids = to_host(output.token_ids, "sampled_ids")
        if output.logprobs is not None:
            assert output.top_token_ids is not None and output.top_logprobs is not None
            step.logprobs = to_host(output.logprobs, "sampled_logprobs")
            step.top_token_ids = to_host(output.top_token_ids, "top_token_ids")
            step.top_logprobs = to_host(output.top_logprobs, "top_logprobs")
            if output.ranks is not None:
                step.ranks = to_host(output.ranks, "sampled_ranks")
            step.num_logprobs = state.num_logprobs[sampled_rows].tolist()

    def _select_beams(self, step: LaunchedStep, host: HostBatch, logits: torch.Tensor) -> np.ndarray:
        """The beam searches sampling this step: each group's best continuations over [beams x vocabulary] in one
        batched selection, copied to the host for the scheduler (which decides the beams). Returns which of the
        step's sampled rows were beams [S] bool."""
        plan = step.plan
        position = {plan.seq_ids[i]: j for j, i in enumerate(host.sampled.tolist())}  # seq id -> row of logits
        groups = [g for g in plan.beam_groups if all(seq_id in position for seq_id in g.seq_ids)]
        is_beam = np.zeros(len(host.sampled), dtype=bool)  # [S]
        if not groups:
            return is_beam
        order = np.asarray([position[seq_id] for g in groups for seq_id in g.seq_ids], dtype=np.int64)  # [Bb]
        is_beam[order] = True
        sizes = [len(g.seq_ids) for g in groups]
        columns = np.stack([np.repeat(np.arange(len(groups)), sizes),  # group of each beam row
                            np.concatenate([np.arange(size) for size in sizes]), order])  # its slot, its logits row
        batch_index = host.sampled[order]  # [Bb] each beam row's index in the batch
        state_rows = host.rows[batch_index]  # [Bb]
        on_device = self.state.lineage_on_device[state_rows]  # [Bb]: its score is the device's
        columns = np.concatenate([columns, state_rows[None], on_device[None].astype(np.int64)])
        index = self._to_device(columns, "beam_rows")  # [5, Bb]
        values = np.asarray([[s for g in groups for s in g.scores],
                             [g.temperature for g in groups for _ in g.seq_ids]], dtype=np.float32)
        floats = self._to_device(values, "beam_scores")  # [2, Bb]
        beam_scores = torch.where(index[4].bool(), self.beam_scores[index[3]], floats[0])  # [Bb]
        k = max(g.num_candidates for g in groups)
        token_ids, parents, scores = beam_candidates(logits.index_select(0, index[2]), beam_scores, floats[1],
                                                     index[0], index[1], len(groups), max(sizes), k)  # [G, k] each
        step.beam_groups = groups
        to_host = self.staging.to_host
        step.beam_token_ids = to_host(token_ids, "beam_token_ids")
        step.beam_parents = to_host(parents, "beam_parents")
        step.beam_scores = to_host(scores, "beam_scores")
        if any(g.on_device for g in groups):
            self._continue_beams(step, host, batch_index, token_ids, parents, scores)
        return is_beam

    def _continue_beams(self, step: LaunchedStep, host: HostBatch, batch_index: np.ndarray, token_ids: torch.Tensor,
                        parents: torch.Tensor, scores: torch.Tensor) -> None:
        """The groups with on_device: choose their next beams here (beam_continue) and continue each slot on the
        device, so the next step's inputs need nothing from the host: its token (last_token), its score, its block
        table (beam_tables: the parent's full blocks; its own last block stays its own, the scheduler allocates
        it) and, when the last block is partial, the parent's copy of it in the slot's own block (no sync: pairs
        that keep their line copy nothing). The scheduler does the same to its tables from the result."""
        groups, size = step.beam_groups, self.block_size
        chosen = [i for i, g in enumerate(groups) if g.on_device]
        widths = [len(groups[i].seq_ids) for i in chosen]
        max_width = max(widths)
        num_stops = max(1, max(len(groups[i].stop_token_ids) for i in chosen))
        starts = np.cumsum([0] + [len(g.seq_ids) for g in groups])  # each group's first beam row
        group_batch = np.full((len(chosen), max_width), -1, dtype=np.int64)  # [D, W] batch index of each slot
        stops = np.full((len(chosen), num_stops), -1, dtype=np.int64)  # [D, S]
        for d, i in enumerate(chosen):
            group_batch[d, :widths[d]] = batch_index[starts[i]:starts[i + 1]]
            stops[d, :len(groups[i].stop_token_ids)] = groups[i].stop_token_ids
        d_of, s_of = np.nonzero(group_batch >= 0)  # [Bd] each slot's group and slot
        batch = group_batch[d_of, s_of]  # [Bd]
        rows = host.rows[batch]  # [Bd]
        seq_lens = host.seq_lens[batch]  # [Bd] tokens computed: the new token's index
        small = np.stack([d_of, s_of, batch, rows, seq_lens // size, (seq_lens - 1) // size, seq_lens % size != 0])
        index = self._to_device(small, "beam_continue")  # [7, Bd]
        d_t, s_t, batch_t, rows_t, shared_t, last_t, partial_t = index
        groups_small = np.concatenate([np.asarray([chosen, widths], dtype=np.int64), stops.T, group_batch.T]).T
        per_group = self._to_device(groups_small, "beam_chosen")  # [D, 2 + S + W]
        picked = per_group[:, 0]  # [D] their index among the step's groups
        slot_parent, slot_token, slot_score = beam_continue(
            token_ids.index_select(0, picked), parents.index_select(0, picked), scores.index_select(0, picked),
            per_group[:, 2:2 + num_stops], per_group[:, 1], max_width)  # [D, W] each
        parent_batch = per_group[:, 2 + num_stops:][d_t, slot_parent[d_t, s_t]]  # [Bd]
        tables = self._step_tables  # [B, M'] this step's block tables, on the device
        assert tables is not None
        columns = torch.arange(tables.shape[1], device=tables.device)  # [M']
        self.beam_tables[rows_t, :tables.shape[1]] = torch.where(
            columns < shared_t.unsqueeze(1), tables[parent_batch], tables[batch_t])  # [Bd, M']
        last_own = tables[batch_t, last_t]  # [Bd] the block this step wrote each slot's token into
        moved = partial_t.bool() & (parent_batch != batch_t)
        self._copy_block_pairs(self.kv_cache.flatten(0, 1), torch.where(moved, tables[parent_batch, last_t], last_own),
                               last_own)
        tokens = slot_token[d_t, s_t]  # [Bd]
        self.last_token[rows_t] = tokens
        self.beam_scores[rows_t] = slot_score[d_t, s_t]
        state = self.state
        assert (state.num_tokens[rows] == seq_lens).all(), "a beam continues past a token it lacks"
        state.num_tokens[rows] += 1  # the token's value reaches host state in finish()
        state.lineage_on_device[rows] = True
        self.pending_step[rows] = step.plan.step_id
        step.device_groups = chosen
        step.beam_rows, step.beam_positions = rows, seq_lens
        step.beam_seq_ids = [step.plan.seq_ids[b] for b in batch.tolist()]
        step.beam_tokens = self.staging.to_host(tokens, "beam_slot_tokens")
        step.beam_slot_parents = self.staging.to_host(slot_parent, "beam_slot_parents")

    def _patch_tables(self, tables: torch.Tensor, host: HostBatch) -> None:
        """The step's block tables [B, M'] on the device: a beam whose line the device chose takes its shared full
        blocks from beam_tables; the block its token goes to is its own, from the host (the scheduler's)."""
        self._step_tables = tables
        flagged = np.flatnonzero(self.state.lineage_on_device[host.rows])  # [F] batch indices
        if not len(flagged):
            return
        own = (host.seq_lens[flagged] - 1) // self.block_size  # [F] the column of the block this step writes
        index = self._to_device(np.stack([flagged, host.rows[flagged], own]), "beam_patch")  # [3, F]
        columns = torch.arange(tables.shape[1], device=tables.device)  # [M']
        tables[index[0]] = torch.where(columns < index[2].unsqueeze(1), self.beam_tables[index[1], :tables.shape[1]],
                                       tables[index[0]])  # [F, M']

    def _sample_isolating(self, step: LaunchedStep, logits: torch.Tensor, metadata: SamplingMetadata,
                          sampled_rows: np.ndarray, seq_ids: list[int]) -> tuple[np.ndarray, SamplerOutput | None]:
        """Sampling the batch raised: bisect it (isolation.py); the guilty rows' requests end with an error and
        leave the worker, the others keep their tokens. Returns the batch indices kept [K] and their output."""

        def sample_subset(index: np.ndarray) -> SamplerOutput:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the staging buffers of the last try are free again
            sub = self.sampling.metadata(sampled_rows[index])
            sub.max_num_logprobs = metadata.max_num_logprobs  # every subset's top-k columns as wide as the batch's
            index_t = torch.from_numpy(index).to(logits.device)  # [K]
            if metadata.token_bitmask is not None:
                sub.token_bitmask = metadata.token_bitmask[index_t]
                sub.bitmask_rows = metadata.bitmask_rows[index_t] if metadata.bitmask_rows is not None else None
            return self.sampler(logits[index_t], sub)

        isolated = bisect_failures(sample_subset, len(sampled_rows))
        guilty = [seq_ids[i] for i, _ in isolated.guilty]
        for (_, error), seq_id in zip(isolated.guilty, guilty, strict=True):
            log.error("step %d: sequence %d fails alone: %s", step.plan.step_id, seq_id, error)
            step.failed.append(RowFailure(seq_id, 500, f"the worker failed on this request: {error}"))
        self._drop(guilty)
        return isolated.kept, isolated.output

    def _refuse_bad_requests(self, plan: StepPlan) -> tuple[StepPlan, list[RowFailure]]:
        """New requests whose values the worker cannot hold (admission_error) fail alone, before the step."""
        if not plan.new_requests:
            return plan, []
        max_blocks = self.state.block_table.shape[1]
        failures = [RowFailure(new.seq_id, 400, f"the worker refused this request: {error}")
                    for new in plan.new_requests
                    if (error := admission_error(new, self.arch.vocab_size, self.max_model_len, self.num_blocks,
                                                 max_blocks))]
        if not failures:
            return plan, []
        for failure in failures:
            log.error("step %d: sequence %d refused: %s", plan.step_id, failure.seq_id, failure.message)
        self._lost.update(failure.seq_id for failure in failures)
        plan = msgspec.structs.replace(plan, new_requests=[n for n in plan.new_requests if n.seq_id not in self._lost])
        return self._without_lost(plan), failures

    def _timer_event(self) -> torch.cuda.Event | None:
        if self.step_timer is None or self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _record(self, step: LaunchedStep, timer_start: torch.cuda.Event | None) -> None:
        if self.device.type != "cuda":
            return  # every CPU op has run by now
        step.event = torch.cuda.Event(enable_timing=timer_start is not None)
        step.event.record()
        if self.step_timer is not None and timer_start is not None:
            self.step_timer.steps.append((step.is_decode, timer_start, step.event))

    def step_done(self) -> bool:
        """The oldest launched step's device work and copies are complete (finish() will not wait). A deferred
        oldest step is not, until its masks are ready: then its sampling is enqueued here."""
        step = self._launched[0]
        if self._deferred is not None and self._deferred[0] is step:
            if self.masks_pending():
                return False
            self._complete_deferred()
        return step.event is None or step.event.query()

    @torch.inference_mode()
    def finish(self) -> StepResult:
        """Wait for the oldest launched step; its tokens go into host state and the result."""
        if self._deferred is not None and self._deferred[0] is self._launched[0]:
            self.resume()  # masks not started yet (nobody resumed it): start them
            self._complete_deferred()  # its sampling must run before its result
        step = self._launched.popleft()
        try:
            self._sync(step)
            return self._result(step)
        except Exception as exc:  # noqa: BLE001
            log.error("step %d failed:\n%s", step.plan.step_id, traceback.format_exc())
            self.recover(step.plan)
            return StepResult(step_id=step.plan.step_id, seq_ids=[], sampled_token_ids=[],
                              error=f"{type(exc).__name__}: {exc}")

    def _sync(self, step: LaunchedStep) -> None:
        """Wait on the step's event and write its sampled ids into the rows that still hold its requests."""
        if step.synced:
            return
        if step.event is not None:
            if self.step_timer is not None:
                waited = time.perf_counter()
                step.event.synchronize()
                self.step_timer.host_wait_s += time.perf_counter() - waited
                self.step_timer.host_waits += 1
            else:
                step.event.synchronize()
        step.synced = True
        if step.beam_tokens is not None:
            self._sync_rows(step, step.beam_seq_ids, step.beam_rows, step.beam_positions, step.beam_tokens.numpy())
        if step.token_ids is None:
            return
        state = self.state
        token_ids = step.token_ids.numpy()  # [S]
        owned = state.holds(step.seq_ids, step.rows, step.state_version)  # [S] not dropped (or reused) since launch
        rows = step.rows[owned]
        state.token_ids[rows, step.positions[owned]] = token_ids[owned]
        if self.grammars.active:  # matchers advance once per token, in step order (_grammar_barrier, the mask job)
            self._unaccepted.append(([r for r, keep in zip(step.seq_ids, owned.tolist(), strict=True) if keep],
                                     token_ids[owned].tolist()))
        mine = rows[self.pending_step[rows] == step.plan.step_id]
        self.pending_step[mine] = -1

    def _sync_rows(self, step: LaunchedStep, seq_ids: list[int], rows: np.ndarray, positions: np.ndarray,
                   token_ids: np.ndarray) -> None:
        """Beams the device continued: their new tokens into the rows that still hold them."""
        state = self.state
        owned = state.holds(seq_ids, rows, step.state_version)  # [Bd] not dropped (or reused) since the launch
        kept = rows[owned]
        state.token_ids[kept, positions[owned]] = token_ids[owned]
        mine = kept[self.pending_step[kept] == step.plan.step_id]
        self.pending_step[mine] = -1

    def _sync_before(self, current: LaunchedStep) -> None:
        """Wait for the launched steps before `current` (all of them when it is not launched yet)."""
        for step in self._launched:
            if step is current:
                return
            self._sync(step)

    def _result(self, step: LaunchedStep) -> StepResult:
        result = self._tokens_result(step)
        if step.beam_groups and not step.error:
            result = msgspec.structs.replace(result, beam_candidates=self._beam_result(step))
        return msgspec.structs.replace(result, failed=step.failed) if step.failed else result

    @staticmethod
    def _beam_result(step: LaunchedStep) -> list[BeamCandidates]:
        assert step.beam_token_ids is not None and step.beam_parents is not None and step.beam_scores is not None
        token_ids, parents = step.beam_token_ids.tolist(), step.beam_parents.tolist()
        scores = step.beam_scores.tolist()
        slot_parents: dict[int, list[int]] = {}
        if step.beam_slot_parents is not None:
            chosen = step.beam_slot_parents.tolist()
            slot_parents = {i: chosen[d][:len(step.beam_groups[i].seq_ids)] for d, i in enumerate(step.device_groups)}
        return [BeamCandidates(g.seq_ids[0], token_ids[i][:g.num_candidates], parents[i][:g.num_candidates],
                               scores[i][:g.num_candidates], slot_parents.get(i, []))
                for i, g in enumerate(step.beam_groups)]

    def _tokens_result(self, step: LaunchedStep) -> StepResult:
        plan = step.plan
        if step.error:
            return StepResult(step_id=plan.step_id, seq_ids=[], sampled_token_ids=[], error=step.error)
        if step.token_ids is None:
            return StepResult(step_id=plan.step_id, seq_ids=[], sampled_token_ids=[],
                              prompt_scores=step.prompt_scores)
        token_ids = step.token_ids.tolist()
        if step.logprobs is None:
            return StepResult(step_id=plan.step_id, seq_ids=step.seq_ids, sampled_token_ids=token_ids,
                              prompt_scores=step.prompt_scores)
        assert step.top_token_ids is not None and step.top_logprobs is not None
        wanted = step.num_logprobs
        top_ids, top_logprobs = step.top_token_ids.tolist(), step.top_logprobs.tolist()
        return StepResult(
            step_id=plan.step_id, seq_ids=step.seq_ids, sampled_token_ids=token_ids,
            sampled_logprobs=step.logprobs.tolist(),
            sampled_ranks=step.ranks.tolist() if step.ranks is not None else [],
            top_token_ids=[ids[:max(k, 0)] for ids, k in zip(top_ids, wanted, strict=True)],
            top_logprobs=[lps[:max(k, 0)] for lps, k in zip(top_logprobs, wanted, strict=True)],
            prompt_scores=step.prompt_scores)

    def discard_launched(self) -> None:
        """Forget every launched step (the caller gave up on their results); wait for the device first."""
        self._grammar_barrier()
        self._deferred = None
        while self._launched:
            step = self._launched.popleft()
            if step.event is not None:
                step.event.synchronize()
            self.recover(step.plan)

    def _without_lost(self, plan: StepPlan) -> StepPlan:
        """Drop requests of a failed step from a plan sent before the scheduler heard of the failure."""
        if not self._lost:
            return plan
        self._lost.difference_update(plan.finished_seq_ids)
        if not self._lost.intersection(plan.seq_ids):
            return plan
        kept = [(r, n) for r, n in zip(plan.seq_ids, plan.num_scheduled_tokens, strict=True) if r not in self._lost]
        blocks = [(r, b) for r, b in zip(plan.appended_block_seq_ids, plan.appended_block_ids, strict=True)
                  if r not in self._lost]
        return msgspec.structs.replace(
            plan, seq_ids=[r for r, _ in kept], num_scheduled_tokens=[n for _, n in kept],
            appended_block_seq_ids=[r for r, _ in blocks], appended_block_ids=[b for _, b in blocks])

    def _input_ids(self, host: HostBatch) -> torch.Tensor:
        """The step's input ids [T] on the device: from the host, except tokens the host does not know yet,
        which come from last_token (the previous step wrote them there on the device)."""
        if len(host.from_device) == len(host.input_ids):  # a decode batch right after the step that sampled
            return self.last_token[self._to_device(host.from_device_rows, "from_device_rows")]  # [T]
        input_ids = self._to_device(host.input_ids, "input_ids")  # [T]
        if len(host.from_device):
            index = self._to_device(host.from_device, "from_device")  # [K]
            input_ids[index] = self.last_token[self._to_device(host.from_device_rows, "from_device_rows")]
        return input_ids

    def _grammar_failures(self, step: LaunchedStep) -> set[int]:
        """Sequences the grammar process lost (or whose matcher it could not build; 500), or whose grammar and
        allowed_token_ids left no token to sample (400): they end with an error in this step's result, unsampled,
        and leave the worker; the step's other rows go on."""
        failures = [row_failure(seq_id, why) for seq_id, why in self.grammars.take_failures()]
        for failure in failures:
            log.log(logging.INFO if failure.status == 400 else logging.ERROR, "step %d: sequence %d: %s",
                    step.plan.step_id, failure.seq_id, failure.message)
        step.failed += failures
        if failures:
            self._drop([failure.seq_id for failure in failures])
        return {failure.seq_id for failure in failures}

    def _grammar_masks(self, seq_ids: list[int]) -> GrammarMasks | None:
        """The sampled rows' grammar masks: the deferred step's job's (started by resume), or filled now."""
        started = time.perf_counter()
        if self._masks_job is not None and self._masks_for == seq_ids:  # filled on the mask thread since resume()
            job = self._masks_job
            try:
                masks = job.result()
            finally:
                self._job_over()
        else:
            self._grammar_barrier()
            masks = self.grammars.bitmask(seq_ids)
            self.mask_times.fill_s += time.perf_counter() - started
        self.mask_times.waited_s += time.perf_counter() - started
        self.mask_times.steps += 1
        return masks

    def _attach_grammar_masks(self, metadata: SamplingMetadata, masks: GrammarMasks | None, num_rows: int) -> None:
        """Structured outputs: the constrained rows' token bitmasks join the sampler's fused pass (the other
        rows are flagged off and pay nothing)."""
        if masks is None:
            return
        flags, compact, index = masks  # [B] bool, [K, W] int32 on the host (pinned on CUDA), [K] their rows
        if self._mask_rows is None or self._mask_rows.shape[0] < num_rows:
            self._mask_rows = torch.empty((max(num_rows, self.config.max_num_seqs), compact.shape[1]),
                                          dtype=torch.int32, device=self.device)  # [R, W]
        bitmask = self._mask_rows[:num_rows]  # [B, W]: the sampler reads the flagged rows only
        # only the K constrained rows cross to the device (a 150k vocabulary's mask is 19 KB a row)
        bitmask.index_copy_(0, self._to_device(index, "mask_rows"), compact.to(self.device, non_blocking=True))
        metadata.token_bitmask = bitmask
        metadata.bitmask_rows = self._to_device(flags, "bitmask_rows")  # [B]

    def _forward_eager(self, host: HostBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """The model on a mixed or large batch: final hidden states [T, H] of every token."""
        to = self._to_device
        tables = to(host.block_tables, "block_tables")  # [B, max_blocks]
        self._patch_tables(tables, host)
        meta = AttentionMetadata(
            slot_mapping=to(host.slots, "slots"), block_tables=tables,
            seq_lens=to(host.seq_lens.astype(np.int32), "seq_lens"),
            query_start_loc=to(host.query_start.astype(np.int32), "query_start"),
            seq_lens_host=host.seq_lens.tolist(), query_lens_host=host.counts.tolist(),
            max_query_len=int(host.counts.max()), max_seq_len=int(host.seq_lens.max()))
        return self.model(input_ids, to(host.positions, "positions"), self.kv_caches, meta)  # [T, H]

    def _sampled_logits(self, host: HostBatch, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [S, V] (model dtype) at the last token of each sequence that samples; None if none does."""
        if len(host.sampled) == 0:
            return None
        logits_indices = self._to_device(host.query_start[1:][host.sampled] - 1, "logits_indices")  # [S]
        return self.model.compute_logits(hidden[logits_indices])  # [S, V] in the model dtype

    def _scores_prompt(self, host: HostBatch) -> np.ndarray:
        """[B] bool: the sequence asked for prompt_logprobs and this step computes a position that predicts
        a prompt token (one before the last prompt token)."""
        state = self.state
        starts = host.seq_lens - host.counts  # [B]
        return (state.num_prompt_logprobs[host.rows] >= 0) & (starts < state.num_prompt_tokens[host.rows] - 1)

    def _prompt_scores(self, plan: StepPlan, host: HostBatch, hidden: torch.Tensor) -> list[PromptScores]:
        """prompt_logprobs: the logprob of each prompt token this step's chunk predicts (token p + 1 from
        position p), with the top k, for the sequences that asked. Every rank runs this (compute_logits
        gathers across tensor-parallel ranks)."""
        state = self.state
        wanted = state.num_prompt_logprobs[host.rows]  # [B]
        scores = []
        for b in np.flatnonzero(self._scores_prompt(host)).tolist():
            row, start = int(host.rows[b]), int(host.seq_lens[b] - host.counts[b])
            # positions [start, end); _scores_prompt guarantees start < end
            end = min(int(host.seq_lens[b]), int(state.num_prompt_tokens[row]) - 1)
            first_index = int(host.query_start[b])
            targets = state.token_ids[row, start + 1:end + 1].astype(np.int64)  # [N]
            picked, tops, top_ids, ranks = [], [], [], []
            step = max(1, min(PROMPT_SCORE_ROWS, self.config.max_num_seqs // 2))
            for lo in range(0, end - start, step):  # bounded [rows, V] logits at a time
                hi = min(end - start, lo + step)
                logits = self.model.compute_logits(hidden[first_index + lo:first_index + hi]).float()  # [n, V]
                log_probs = torch.log_softmax(logits, dim=-1)  # [n, V]
                target = torch.from_numpy(targets[lo:hi]).to(log_probs.device)  # [n]
                picked.append(log_probs.gather(1, target[:, None])[:, 0])  # [n]
                ranks.append((log_probs >= picked[-1][:, None]).sum(dim=-1))  # [n]: 1 for the likeliest (vLLM's)
                top = log_probs.topk(int(wanted[b]), dim=-1)  # [n, k]
                tops.append(top.values)
                top_ids.append(top.indices)
            # one host copy per sequence, after all its slices
            scores.append(PromptScores(plan.seq_ids[b], start + 1, targets.tolist(), torch.cat(picked).tolist(),
                                       torch.cat(top_ids).tolist(), torch.cat(tops).tolist(),
                                       torch.cat(ranks).tolist()))
        return scores

    def recover(self, plan: StepPlan) -> None:
        """After a failed step: forget the plan's requests (the scheduler aborts them too); plans already in
        flight may still name them, and skip them. The sequences the plan let go (finished, aborted, preempted)
        leave as its state.apply would have let them, without being skipped later: a preempted one comes back as
        a new request."""
        self._drop([*plan.seq_ids, *(new.seq_id for new in plan.new_requests)])
        self.grammars.drop(plan.finished_seq_ids)
        for seq_id in plan.finished_seq_ids:
            self.state.release(seq_id)

    def _drop(self, seq_ids: list[int]) -> None:
        """Forget these requests (failed): their rows are free; later plans in flight may still name them."""
        state = self.state
        self._grammar_barrier()
        self.grammars.drop(seq_ids)
        for seq_id in seq_ids:
            state.release(seq_id)
            self._lost.add(seq_id)

    def _prepare(self, plan: StepPlan) -> HostBatch:
        """The step's flattened inputs as numpy arrays, gathered from the persistent state."""
        state, size = self.state, self.block_size
        rows = state.rows_for(plan.seq_ids)  # [B]
        counts = np.asarray(plan.num_scheduled_tokens, dtype=np.int64)  # [B]
        starts = state.num_computed[rows]  # [B]
        seq_lens = starts + counts  # [B]
        assert (seq_lens <= state.num_tokens[rows]).all(), "plan schedules tokens the worker does not have"
        query_start = np.zeros(len(rows) + 1, dtype=np.int64)  # [B + 1]
        np.cumsum(counts, out=query_start[1:])
        num_tokens = int(query_start[-1])
        token_rows = np.repeat(rows, counts)  # [T]
        positions = np.repeat(starts - query_start[:-1], counts) + np.arange(num_tokens)  # [T]
        input_ids = state.token_ids[token_rows, positions].astype(np.int64)  # [T]
        slots = state.block_table[token_rows, positions // size].astype(np.int64) * size + positions % size  # [T]
        max_blocks = -(-int(seq_lens.max()) // size)
        # the last token of a row whose sampling step has not finished is known on the device only
        from_device = np.flatnonzero((self.pending_step[token_rows] >= 0)
                                     & (positions == state.num_tokens[token_rows] - 1))  # [K]
        return HostBatch(rows=rows, counts=counts, seq_lens=seq_lens, query_start=query_start, input_ids=input_ids,
                         positions=positions, slots=slots, block_tables=state.block_table[rows, :max_blocks],
                         sampled=np.flatnonzero(seq_lens == state.num_tokens[rows]),
                         is_decode=num_tokens == len(rows), from_device=from_device,
                         from_device_rows=token_rows[from_device])

    def _to_device(self, array: np.ndarray, name: str) -> torch.Tensor:
        """Host array -> device tensor; on CUDA through a reused pinned buffer and an async copy."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cpu":
            return tensor
        return self.staging.to_device(tensor, name)



def swap_pays(arch: ModelArch, kv_bytes_per_token: int) -> bool:
    """Whether copying a token's K/V out and back costs less than computing it again, at assumed rates
    (SWAP_BYTES_PER_S each way, RECOMPUTE_FLOPS_PER_S for a prefill token's weight matmuls; attention's share is left
    out, in recompute's favour): llama3-8b 6.6 against 35 us a token, qwen3-0.6b 5.7 against 2.2."""
    return 2 * kv_bytes_per_token / SWAP_BYTES_PER_S < 2 * arch.layer_weight_params(1) / RECOMPUTE_FLOPS_PER_S


def _host_gpu_count() -> int:
    """NVIDIA GPUs on this host, whichever this process may see (replicas on the others pin host memory too); 1
    where the driver does not say."""
    try:
        return max(1, len(os.listdir("/proc/driver/nvidia/gpus")))
    except OSError:
        return 1


def _available_ram() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


def narrow_masks(masks: GrammarMasks | None, keep: np.ndarray) -> GrammarMasks | None:
    """The masks of the kept rows (keep [B] bool) of a batch: flags [B'], the same compact masks [K, W], their rows
    renumbered [K] (a row without a mask may be dropped; one with a mask is kept)."""
    if masks is None:
        return None
    flags, compact, index = masks
    assert keep[index].all(), "a row with a mask was dropped"
    renumbered = (np.cumsum(keep) - 1)[index]  # [K]
    return flags[keep], compact, renumbered
