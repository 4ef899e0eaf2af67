"""Constrained decoding on the worker: one llguidance matcher per sequence, bitmasks for the rows that sample.

Lifecycle (see services/grammar/compiler.py for the whole path):
- `apply(plan)` mirrors BatchState.apply: a finished, aborted or preempted request's matcher is dropped; a new
  request (also one coming back after a preemption, or an n>1 sibling forked from its first sequence) gets a
  fresh matcher that replays the tokens it generated already (NewRequest.token_ids past the prompt), so a
  recompute or a prefix-cache hit leaves it exactly where the sequence is.
- `bitmask(seq_ids)`: for the rows of this step's sampled sequences that have an active matcher, their row of a
  `[B, ceil(V/32)] int32` mask (bit j of word w: token 32*w+j allowed), filled on the host straight into a
  reused (pinned) buffer, and the `[B]` flags of those rows. Rows without a grammar are left unfilled and
  flagged off (the sampler skips them); a step with no grammar row does no work at all.
- `accept(seq_ids, token_ids)`: the sampled tokens advance the matchers.

Overlap: the mask for step N+1 depends on step N's token, so the order per step is
  accept(step N tokens) -> bitmask(step N+1 rows) -> copy -> apply to step N+1 logits -> sample.
The forward of step N+1 needs no mask and can be launched before step N's tokens reach the host; only the
constrained rows' masking waits for them (an asynchronous worker calls accept as soon as N's tokens land,
then bitmask for N+1 while N+1's forward runs).

A grammar that is complete allows only the model's EOS ids, so the sequence ends with `stop` on its next token
(the scheduler's EOS check). Reasoning models: with `reasoning_end` set, the matcher starts once that text
(`</think>`) has appeared in the output; until then the row is unconstrained.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import llguidance
import llguidance.torch
import numpy as np
import torch

from pagoda.services.grammar.compiler import cache_key, grammar_text, load_ll_tokenizer
from pagoda.shared.config import EngineConfig
from pagoda.shared.hf_tokenizer import tokenizer_folder
from pagoda.shared.messages import NewRequest, StepPlan, StructuredOutputs
from pagoda.shared.shapes import ModelArch

log = logging.getLogger(__name__)

MATCHER_CACHE_SIZE = 256  # pristine matchers per distinct constraint, deep-copied for each sequence
# From this many constrained rows, on a machine with this many CPUs, masks are filled and tokens consumed by
# llguidance's thread pool (a mask costs ~30-80 us for a 150k vocabulary: 256 rows serially would cost more
# than a decode step). Below it, or on a small CPU, one thread is faster than the pool's hand-off.
PARALLEL_ROWS = 16
PARALLEL_MIN_CPUS = 8


@dataclass(slots=True)
class SeqGrammar:
    """One sequence's matcher, or the text it waits for before its matcher starts."""

    constraint: StructuredOutputs
    matcher: llguidance.LLMatcher | None  # None while waiting for reasoning_end
    tail: bytes = b""  # the output's last bytes while waiting (reasoning_end may span tokens)
    failed: bool = field(default=False)


class GrammarRows:
    """The worker's matchers, keyed by the scheduler's sequence id."""

    def __init__(self, make_tokenizer: Callable[[], llguidance.LLTokenizer | None], vocab_size: int,
                 pin_memory: bool = False) -> None:
        # Built here, before the worker serves (seconds on a busy CPU, never inside a step). Not on a thread:
        # the build holds the GIL for seconds at a time (tokenizers' to_str, llguidance's constructor), which
        # starved the worker's loop until the scheduler declared it hung.
        self._tokenizer = self._load_tokenizer(make_tokenizer)
        self.vocab_size = vocab_size
        self.num_words = -(-vocab_size // 32)
        self._seqs: dict[int, SeqGrammar] = {}
        self._pristine: OrderedDict[bytes, llguidance.LLMatcher] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self.pin_memory = pin_memory
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._flip = 0

    @property
    def active(self) -> bool:
        return bool(self._seqs)

    def constrains(self, seq_ids: list[int]) -> bool:
        """Some of these requests has a grammar (their sampling needs bitmasks)."""
        return bool(self._seqs) and any(seq_id in self._seqs for seq_id in seq_ids)

    def reset(self) -> None:
        self._seqs.clear()

    def apply(self, plan: StepPlan) -> None:
        for seq_id in plan.finished_seq_ids:
            self._seqs.pop(seq_id, None)
        for new in plan.new_requests:
            self.add(new)

    def drop(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)

    def add(self, new: NewRequest) -> None:
        self._seqs.pop(new.seq_id, None)
        constraint = new.sampling.structured_outputs
        if constraint is None:
            return
        seq = SeqGrammar(constraint, None)
        self._seqs[new.seq_id] = seq
        if not constraint.reasoning_end:
            seq.matcher = self._new_matcher(constraint)
        generated = new.token_ids[new.num_prompt_tokens:]
        for token_id in generated:
            self._advance(new.seq_id, seq, token_id)

    # ---------------------------------------------------------------- per step

    def bitmask(self, seq_ids: list[int]) -> tuple[np.ndarray, torch.Tensor] | None:
        """For this step's sampled rows: (flags [B] bool, True where the row has an active matcher; the bitmask
        [B, W] int32 on the host, filled for the flagged rows only), or None when no row is constrained.
        The bitmask is one of two reused buffers (pinned on CUDA): the step that reads it has synced before
        the buffer comes round again (the worker syncs every launched step before it fills masks)."""
        if not self._seqs:
            return None
        picked = [(seq.matcher, i) for i, seq_id in enumerate(seq_ids)
                  if (seq := self._seqs.get(seq_id)) is not None and seq.matcher is not None]
        if not picked:
            return None
        mask = self._buffer(len(seq_ids))  # [B, W]
        if self._parallel(len(picked)):
            llguidance.torch.fill_next_token_bitmask_par(self._ensure_executor(), picked, mask)
        else:
            for matcher, i in picked:
                llguidance.torch.fill_next_token_bitmask(matcher, mask, i)
        flags = np.zeros(len(seq_ids), dtype=bool)  # [B]
        flags[[i for _, i in picked]] = True
        return flags, mask

    def accept(self, seq_ids: list[int], token_ids: list[int]) -> None:
        """Advance each constrained sequence with its sampled token."""
        if not self._seqs:
            return
        rows = [(seq_id, seq, token_id) for seq_id, token_id in zip(seq_ids, token_ids, strict=True)
                if (seq := self._seqs.get(seq_id)) is not None]
        if not self._parallel(len(rows)):
            for seq_id, seq, token_id in rows:
                self._advance(seq_id, seq, token_id)
            return
        running = [(seq_id, seq, token_id) for seq_id, seq, token_id in rows
                   if seq.matcher is not None and not seq.failed and not seq.matcher.is_stopped()]
        accepted = llguidance.torch.consume_token_par(self._ensure_executor(),
                                                      [(seq.matcher, token_id) for _, seq, token_id in running])
        for (seq_id, seq, token_id), ok in zip(running, accepted, strict=True):
            if not ok:
                self._reject(seq_id, seq, token_id)
        for _, seq, token_id in rows:
            if seq.matcher is None:
                self._watch_reasoning(seq, token_id)

    # ---------------------------------------------------------------- internals

    def _advance(self, seq_id: int, seq: SeqGrammar, token_id: int) -> None:
        if seq.matcher is None:
            self._watch_reasoning(seq, token_id)
            return
        if seq.failed or seq.matcher.is_stopped():
            return  # the next tokens are EOS; the scheduler ends the sequence on the first
        if not seq.matcher.consume_token(token_id):
            self._reject(seq_id, seq, token_id)

    def _reject(self, seq_id: int, seq: SeqGrammar, token_id: int) -> None:
        # Only a token outside the mask gets here (the mask allows nothing else): a bug, not bad input.
        assert seq.matcher is not None
        log.error("sequence %d: token %d rejected by its grammar: %s", seq_id, token_id, seq.matcher.get_error())
        seq.failed = True

    def _parallel(self, num_rows: int) -> bool:
        return num_rows >= PARALLEL_ROWS and (os.cpu_count() or 1) >= PARALLEL_MIN_CPUS

    def _ensure_executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """The next of two host buffers [num_rows, W] int32, grown (and pinned on CUDA) as needed."""
        self._flip ^= 1
        buffer = self._buffers[self._flip]
        if buffer is None or buffer.shape[0] < num_rows:
            buffer = torch.empty((max(num_rows, 64), self.num_words), dtype=torch.int32,
                                 pin_memory=self.pin_memory)  # [rows, W]
            self._buffers[self._flip] = buffer
        return buffer[:num_rows]

    def _watch_reasoning(self, seq: SeqGrammar, token_id: int) -> None:
        tokenizer = self._ensure_tokenizer()
        marker = seq.constraint.reasoning_end.encode()
        seq.tail = (seq.tail + tokenizer.decode_bytes([token_id]))[-(len(marker) + 64):]
        if marker in seq.tail:
            seq.matcher = self._new_matcher(seq.constraint)
            seq.tail = b""

    def _new_matcher(self, constraint: StructuredOutputs) -> llguidance.LLMatcher:
        key = cache_key(constraint)
        pristine = self._pristine.get(key)
        if pristine is None:
            pristine = llguidance.LLMatcher(self._ensure_tokenizer(), grammar_text(constraint), log_level=0)
            if pristine.is_error():  # the tokenizer compiled it already: this is not the client's error
                log.error("grammar failed on the worker: %s", pristine.get_error())
            self._pristine[key] = pristine
            if len(self._pristine) > MATCHER_CACHE_SIZE:
                self._pristine.popitem(last=False)
        else:
            self._pristine.move_to_end(key)
        return pristine.deep_copy()

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer (the in-process engine compiles with the worker's own)."""
        return self._ensure_tokenizer()

    @staticmethod
    def _load_tokenizer(make: Callable[[], llguidance.LLTokenizer | None]) -> llguidance.LLTokenizer | None:
        try:
            return make()
        except Exception:
            log.exception("cannot build the grammar tokenizer; structured outputs will fail")
            return None

    def _ensure_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            raise RuntimeError("structured outputs need the model's tokenizer on the worker")
        return self._tokenizer


def grammar_tokenizer_loader(config: EngineConfig, arch: ModelArch) -> Callable[[], llguidance.LLTokenizer | None]:
    """Builds llguidance's tokenizer for the model's mask width and EOS ids (GrammarRows calls it at start-up)."""

    def load() -> llguidance.LLTokenizer | None:
        folder = tokenizer_folder(config.model, config.load_format, config.tokenizer)
        if folder is None:
            return None
        return load_ll_tokenizer(folder, arch.vocab_size, list(arch.eos_token_ids))

    return load
