"""The sampler's start-up warm-up: every Triton kernel variant a served batch can launch, compiled before serving.

A variant of the sampling kernels (kernels/sampling.py) follows from which features some row of the batch uses,
never from their values: the constexpr flags (a threshold, rows drawn from the gathered groups, top-p rows over
whole rows, penalties, a prompt mask, a bitmask, min-p ...) and the dtype of the logits the draw reads (the model's,
or fp32 once penalties, a bitmask, a bias or bans rewrote them). SamplingState keeps every [B] tensor 16-byte
aligned whatever B is, so the batch size adds no variant. A compile inside a served step stalls every stream for
0.1-1.3 s on an H200 (measured: 831 ms for _group_thresholds_kernel and 548 ms for _gumbel_argmax_kernel in the
first steps of a batch mixing greedy, top-p, top-k + top-p and min-p rows, which the former hand-picked list of
batches never ran together).

So the warm-up runs one small batch for each combination of FEATURES: every subset, its rows random (T > 0),
the same with a greedy row beside them, and all of them greedy; each with and without a grammar bitmask.
Combinations whose metadata take the same path (variant_key) run once: ~200 sampler calls of a few rows.
tests/test_sampler_warmup.py records the launches (kernel, constexprs, Triton's argument specialisation) of
random served-like batches and checks that each one is among the warm-up's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from pagoda.services.worker.sampler import SamplerOutput, SamplingMetadata
from pagoda.services.worker.sampling_state import SamplingState
from pagoda.shared.messages import NewRequest, SamplingParams

SampleFn = Callable[[torch.Tensor, SamplingMetadata], SamplerOutput]
MODES = ("random", "with_greedy", "all_greedy")


def features(vocab_size: int) -> dict[str, dict[str, Any]]:
    """Each feature a row can bring to a batch (SamplingParams fields). Top-k comes as a k the gathered groups
    serve and as one past them (kernels/sampling.py's whole-row fallback: k > TOP_K_MAX or more than the row's
    groups), both below the vocabulary (a larger k is no cut)."""
    from pagoda.kernels import sampling

    num_groups = -(-vocab_size // sampling.TOP_K_GROUP)
    small_k = max(2, min(40, num_groups // 2))  # k = 1 is a greedy row
    large_k = min(max(sampling.TOP_K_MAX, num_groups) + 1, vocab_size - 1)
    return {
        "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.2},
        "repetition": {"repetition_penalty": 1.1},
        "bias": {"logit_bias": {1: 1.0}},
        "bans": {"min_tokens": 2},
        "logprobs": {"logprobs": 2},
        "top_k": {"top_k": small_k},
        "top_k_large": {"top_k": large_k},
        "top_p": {"top_p": 0.8},
        "top_k_top_p": {"top_k": small_k, "top_p": 0.9},
        "min_p": {"min_p": 0.05},
    }


def variant_key(m: SamplingMetadata, vocab_size: int) -> tuple[Any, ...]:
    """The facts about a batch that pick _sample_on_device's path and its kernels' flags (values, the batch size,
    logprobs and which penalty is set never do): what penalties, a bitmask, a bias or bans rewrite; for a batch
    with random rows, how top-k is served (none, the gathered groups, the whole-row fallback), top-p with and
    without top-k, min-p."""
    from pagoda.kernels import sampling

    rewrites = (m.presence_penalty is not None or m.frequency_penalty is not None or m.repetition_penalty is not None,
                m.repetition_penalty is not None, m.token_bitmask is not None,
                m.logit_bias_ids is not None or m.banned_token_ids is not None)
    if m.all_greedy:
        return ("greedy", *rewrites)
    num_groups = -(-vocab_size // sampling.TOP_K_GROUP)
    top_k = 0 if m.top_k is None else 1 if m.max_top_k <= min(sampling.TOP_K_MAX, num_groups) else 2
    nucleus = m.top_p is not None and m.top_p_without_top_k
    return ("random", *rewrites, top_k, m.top_p is not None, nucleus, m.min_p is not None)


def warm_up_batches(vocab_size: int, device: torch.device,
                    eos_token_ids: Sequence[int]) -> Iterator[SamplingMetadata]:
    """The metadata of one batch per distinct variant over every combination of features(), modes (random
    rows, with a greedy row, all greedy) and a grammar bitmask (all rows flagged) or none."""
    kinds = features(vocab_size)
    names = list(kinds)
    eos = list(eos_token_ids)[:1] or [0]
    # scratch rows: a random and a greedy row per feature, then a plain random and a plain greedy row
    params = [SamplingParams(temperature=t, **kinds[name]) for t in (0.8, 0.0) for name in names]
    params += [SamplingParams(temperature=0.8), SamplingParams(temperature=0.0)]
    state = SamplingState(len(params), vocab_size, device, eos)
    state.admit([(row, NewRequest(row, [1, 2, 3], 3, [], 0, p, seed=row, eos_token_ids=eos))
                 for row, p in enumerate(params)])
    plain_random, plain_greedy = len(params) - 2, len(params) - 1
    seen: set[tuple[Any, ...]] = set()
    for size in range(len(names) + 1):
        for chosen in itertools.combinations(range(len(names)), size):
            for mode in MODES:
                rows = list(chosen) if mode != "all_greedy" else [len(names) + i for i in chosen]
                if not rows:
                    rows = [plain_greedy if mode == "all_greedy" else plain_random]
                if mode == "with_greedy":
                    rows.append(plain_greedy)
                for with_bitmask in (False, True):
                    metadata = state.metadata(np.asarray(rows, dtype=np.int64))
                    if with_bitmask:
                        attach_full_bitmask(metadata, len(rows), vocab_size, device)
                    key = variant_key(metadata, vocab_size)
                    if key not in seen:
                        seen.add(key)
                        yield metadata


def attach_full_bitmask(metadata: SamplingMetadata, num_rows: int, vocab_size: int, device: torch.device) -> None:
    """A grammar bitmask allowing every id, on every row (the worker's layout: [B, ceil(V/32)] int32, row flags)."""
    metadata.token_bitmask = torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32,
                                        device=device)  # [B, W]
    metadata.bitmask_rows = torch.ones(num_rows, dtype=torch.bool, device=device)  # [B]


def warm_up_sampler(sample: SampleFn, vocab_size: int, dtype: torch.dtype, device: torch.device,
                    eos_token_ids: Sequence[int]) -> int:
    """Run `sample` once on every warm_up_batches() batch over random logits in the model's dtype, so each
    kernel variant compiles now. Returns the number of batches."""
    generator = torch.Generator(device=device).manual_seed(0)
    count = 0
    for metadata in warm_up_batches(vocab_size, device, eos_token_ids):
        num_rows = metadata.temperature.shape[0]
        logits = torch.randn(num_rows, vocab_size, device=device, generator=generator).to(dtype)  # [B, V]
        sample(logits, metadata)
        count += 1
    return count
