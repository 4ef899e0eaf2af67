"""The sampler's start-up warm-up compiles every Triton kernel variant a served batch launches: each launch of random
served-like batches (any mix of settings, any batch size, grammar masks on some rows) is, by kernel, constexprs and
Triton's specialisation of every argument (dtype, 16-byte alignment, integers equal to 1 or divisible by 16), one
the warm-up made. Runs the kernel path (interpreted on CPU, short rows)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from pagoda.services.worker import sampler_warmup
from pagoda.services.worker.sampler import SamplerOutput, SamplingMetadata, sample
from pagoda.services.worker.sampling_state import SamplingState
from pagoda.shared.messages import NewRequest, SamplingParams

kernels = pytest.importorskip("pagoda.kernels.sampling")
jit = pytest.importorskip("triton.runtime.jit")

# groups of 4 ids and one block a row: a 96-id row spans 24 groups (the interpreter's cost is per operation)
SIZES = (("PROCESS_BLOCK", 64), ("ARGMAX_BLOCK", 64), ("ARGMAX_SPLIT", 64), ("TOP_P_BLOCK", 64),
         ("TOP_P_PIVOT_BLOCK", 64), ("TOP_K_GROUP", 4), ("NUCLEUS_ROUNDS", 1))
VOCAB = 96
EOS = 0
Launch = tuple[str, tuple[Any, ...]]


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def launch_key(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Launch:
    """What Triton keys a compiled variant on: each constexpr's value, each other argument's specialisation
    (triton.runtime.jit's, without do_not_specialize's integers), and the launch options (num_warps ...)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = inspect.signature(kernel.fn).parameters
    bound = dict(zip(params, args, strict=False)) | {k: v for k, v in kwargs.items() if k in params}
    options = getattr(kernel, "kwargs", None) or {}  # the interpreter keeps jit's arguments there
    skip = set(options.get("do_not_specialize") or getattr(kernel, "do_not_specialize", None) or ())
    parts: list[Any] = []
    for index, (name, param) in enumerate(params.items()):
        value = bound.get(name, param.default)
        if "constexpr" in str(param.annotation):
            parts.append((name, value))
        else:
            specialize = name not in skip and index not in skip
            parts.append((name, native_specialize_impl(BaseBackend, value, False, specialize, True)))
    launch = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
    return kernel.fn.__name__, (*parts, *launch)


@contextmanager
def recording() -> Iterator[set[Launch]]:
    """Record every launch of kernels/sampling.py's kernels (they still run)."""
    launches: set[Launch] = set()
    patched = [kernel for kernel in vars(kernels).values() if hasattr(kernel, "fn") and hasattr(kernel, "run")]
    for kernel in patched:
        def run(*args: Any, _kernel: Any = kernel, _run: Any = kernel.run, **kwargs: Any) -> Any:
            launches.add(launch_key(_kernel, args, {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}))
            return _run(*args, **kwargs)

        kernel.run = run  # an instance attribute over the class's method
    try:
        yield launches
    finally:
        for kernel in patched:
            del kernel.run


def kernel_sample(logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
    return sample(logits, metadata, use_kernels=True)


def random_params(rng: np.random.Generator) -> SamplingParams:
    """Settings as clients send them: each feature on or off, its value random."""
    on = lambda p: bool(rng.random() < p)  # noqa: E731
    top_k = int(rng.choice([1, int(rng.integers(2, 24)), int(rng.integers(25, VOCAB - 1)), VOCAB + 5])) if on(0.4) \
        else 0
    return SamplingParams(
        temperature=0.0 if on(0.25) else float(rng.uniform(0.2, 1.5)), top_k=top_k,
        top_p=float(rng.uniform(0.3, 0.99)) if on(0.4) else 1.0,
        min_p=float(rng.uniform(0.01, 0.2)) if on(0.2) else 0.0,
        presence_penalty=float(rng.uniform(-1, 1)) if on(0.1) else 0.0,
        frequency_penalty=float(rng.uniform(-1, 1)) if on(0.1) else 0.0,
        repetition_penalty=float(rng.uniform(0.8, 1.3)) if on(0.1) else 1.0,
        logit_bias={int(rng.integers(VOCAB)): float(rng.uniform(-5, 5))} if on(0.1) else {},
        min_tokens=int(rng.integers(1, 4)) if on(0.1) else 0, logprobs=int(rng.integers(0, 3)) if on(0.1) else None)


def served_batches(rng: np.random.Generator, num_batches: int) -> Iterator[tuple[torch.Tensor, SamplingMetadata]]:
    """Random batches: the mix issue 26's benchmark logged compiles for first (greedy, top-p, top-k + top-p,
    min-p), then random rows of random settings, any size and order, a grammar mask on some of the rows."""
    dev = device()
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.95),
             SamplingParams(temperature=0.7, top_k=8, top_p=0.9), SamplingParams(temperature=0.7, min_p=0.05)]
    params = mixed + [random_params(rng) for _ in range(28)]
    state = SamplingState(len(params), VOCAB, dev, [EOS])
    state.admit([(row, NewRequest(row, [1, 2, 3], 3, [], 0, p, seed=row, eos_token_ids=[EOS] if p.min_tokens else []))
                 for row, p in enumerate(params)])
    batches = [np.arange(4), np.arange(4)[::-1].copy()]
    batches += [rng.choice(len(params), size=int(rng.integers(1, 14)), replace=False) for _ in range(num_batches)]
    for rows in batches:
        metadata = state.metadata(rows)
        if rng.random() < 0.3:  # the worker's grammar masks: rows without a matcher flagged off
            metadata.token_bitmask = torch.from_numpy(
                rng.integers(-2**31, 2**31, size=(len(rows), -(-VOCAB // 32)), dtype=np.int64).astype(np.int32)
            ).to(dev) | 1  # [B, W] id 0 always allowed
            metadata.bitmask_rows = torch.from_numpy(rng.random(len(rows)) < 0.5).to(dev)  # [B]
        yield torch.randn(len(rows), VOCAB).to(torch.bfloat16).to(dev), metadata
        state.record(rows, torch.zeros(len(rows), dtype=torch.int64, device=dev), metadata.state_rows)


def test_warm_up_compiles_every_variant_served_batches_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available():
        for name, value in SIZES:
            monkeypatch.setattr(kernels, name, value)
    with recording() as warmed:
        sampler_warmup.warm_up_sampler(kernel_sample, VOCAB, torch.bfloat16, device(), [EOS])
        warmed = set(warmed)
    kernels_warmed = {name for name, _ in warmed}
    assert {"_group_thresholds_kernel", "_gumbel_argmax_kernel", "_nucleus_round_kernel", "_process_kernel",
            "_gathered_gumbel_kernel", "_top_p_row_kernel"} <= kernels_warmed
    rng = np.random.default_rng(26)
    with recording() as served:
        for logits, metadata in served_batches(rng, num_batches=40):
            kernel_sample(logits, metadata)
    missed = sorted(served - warmed, key=str)
    named = [(name, [part for part in parts if not isinstance(part[1], tuple)]) for name, parts in missed]
    assert served and not missed, f"{len(missed)} launches the warm-up never made, e.g. {named[:3]}: {missed[:1]}"


def test_warm_up_batches_are_distinct_variants_and_hold_every_feature_together() -> None:
    """One batch per variant; a batch with every feature of features() at once, random and greedy rows, is one
    of them (the kind the hand-picked list before missed: it ran its features together only past TOP_K_MAX)."""
    keys = [sampler_warmup.variant_key(m, VOCAB) for m in sampler_warmup.warm_up_batches(VOCAB, device(), [EOS])]
    assert len(keys) == len(set(keys))
    kinds = sampler_warmup.features(VOCAB)
    params = [SamplingParams(temperature=0.7, **kind) for name, kind in kinds.items() if name != "top_k_large"]
    params.append(SamplingParams(temperature=0.0))
    state = SamplingState(len(params), VOCAB, device(), [EOS])
    state.admit([(row, NewRequest(row, [1, 2], 2, [], 0, p, seed=row, eos_token_ids=[EOS]))
                 for row, p in enumerate(params)])
    everything = state.metadata(np.arange(len(params)))
    assert everything.top_k is not None and everything.top_p_without_top_k and everything.min_p is not None
    assert everything.banned_token_ids is not None and everything.repetition_penalty is not None
    assert sampler_warmup.variant_key(everything, VOCAB) in keys
