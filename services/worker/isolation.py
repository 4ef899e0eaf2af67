"""One row's failure stays that row's: when sampling a batch raises, find the guilty row(s) by bisection.

The batch is sampled whole on the hot path (no per-row check, no cost). Only after it raised are halves
sampled again, recursively, until each failing subset is one row: those rows are the guilty ones, every other
row keeps the token its subset drew. Row r's draw depends on row r's logits and settings only (seeded noise is
keyed by seed and output index, not by batch position), so a row sampled in a subset draws what it would have
drawn in the whole batch. k guilty rows of B cost about 2 k log2(B) extra sampler calls.

A device-side assert on CUDA is not an exception Python sees in time (the context is lost): values that could
raise one are refused when a request is admitted (sampling_state.admission_error), before any step runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.services.worker.sampler import Sampler, SamplerOutput, SamplingMetadata, sample

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Isolated:
    """What survived: batch indices kept [K] ascending, their outputs in that order (None if K == 0), and
    (batch index, error) of each guilty row."""

    kept: np.ndarray
    output: SamplerOutput | None
    guilty: list[tuple[int, str]]


def bisect_failures(sample_subset: Callable[[np.ndarray], SamplerOutput], num_rows: int) -> Isolated:
    """The batch of num_rows failed as a whole: sample its halves, recursively, down to single rows."""
    done: list[tuple[np.ndarray, SamplerOutput]] = []
    guilty: list[tuple[int, str]] = []

    def run(index: np.ndarray) -> None:
        try:
            done.append((index, sample_subset(index)))
        except Exception as exc:  # noqa: BLE001 - whatever it is, it belongs to a row of this subset
            if len(index) == 1:
                guilty.append((int(index[0]), f"{type(exc).__name__}: {exc}"))
                return
            split(index)

    def split(index: np.ndarray) -> None:
        middle = len(index) // 2
        run(index[:middle])
        run(index[middle:])

    all_rows = np.arange(num_rows)
    if num_rows == 1:
        run(all_rows)  # (a retry of the one row: it is guilty unless the failure was transient)
    else:
        split(all_rows)
    if not done:
        return Isolated(np.zeros(0, dtype=np.int64), None, guilty)
    return Isolated(np.concatenate([index for index, _ in done]), _concat([out for _, out in done]), guilty)


def _concat(outputs: list[SamplerOutput]) -> SamplerOutput:
    first = outputs[0]
    if len(outputs) == 1:
        return first
    cat = lambda name: None if getattr(first, name) is None else torch.cat(  # noqa: E731
        [getattr(out, name) for out in outputs])
    return SamplerOutput(cat("token_ids"), cat("logprobs"), cat("top_token_ids"), cat("top_logprobs"),
                         cat("ranks"))


class InjectedFault(RuntimeError):
    """Raised by FaultySampler (tests only)."""


class FaultySampler(Sampler):
    """Test-only fault injection (PAGODA_TEST_SAMPLER_FAULT_SEED): sampling any batch holding a row with this
    seed raises, as a sampler bug on that row's values would. Reads the seeds back (a device sync): never
    installed outside tests."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        log.warning("test fault injection: sampling fails for rows with seed %d", seed)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if bool((metadata.seeds == self.seed).any()):
            raise InjectedFault(f"injected sampler fault (seed {self.seed})")
        return sample(logits, metadata)
