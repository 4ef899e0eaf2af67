"""Constrained decoding on the worker: one llguidance matcher per sequence, bitmasks for the rows that sample.

Lifecycle (see services/grammar/compiler.py for the whole path):
- `apply(plan)` mirrors BatchState.apply: a finished, aborted or preempted request's matcher is dropped; a new
  request (also one coming back after a preemption, or an n>1 sibling forked from its first sequence) gets a
  fresh matcher that replays the tokens it generated already (NewRequest.token_ids past the prompt), so a
  recompute or a prefix-cache hit leaves it exactly where the sequence is.
- Compilation is off the step loop: a new constraint's matcher compiles on a thread (a bounded cache of them,
  keyed by constraint); the row waits for it only when it first samples, and tokens it gets before then
  (a recompute's replay, or accept) are consumed once it is ready.
- `bitmask(seq_ids)`: for the rows of this step's sampled sequences that have an active matcher, a compact
  `[K, ceil(V/32)] int32` mask (bit j of word w: token 32*w+j allowed), one row per constrained row, filled on
  the host straight into a reused (pinned) buffer, with the `[B]` flags and the batch rows [K] it belongs to:
  only those K rows are copied to the device. A step with no grammar row does no work at all.
- `accept(seq_ids, token_ids)`: the sampled tokens advance the matchers.
- bad_words on a row with a grammar: the mask also leaves out the ids the sampler bans this step (SamplingState's
  rule, from the row's last generated ids, which its matcher sees too), so a grammar that allows only banned
  tokens fails the row (a 400 naming bad_words) instead of letting the sampler draw a token the grammar forbids.
Masks fill and matchers advance in parallel on llguidance's executor (it releases the GIL), sized from the
CPUs this process may run on (os.sched_getaffinity), for batches of PARALLEL_ROWS rows or more.

Overlap: the mask for step N+1 depends on step N's token, so the order per step is
  accept(step N tokens) -> bitmask(step N+1 rows) -> copy -> apply to step N+1 logits -> sample.
The forward of step N+1 needs no mask and is launched before step N's tokens reach the host; the runner defers
N+1's sampling until result N has gone out (ModelRunner.resume), then runs accept + bitmask (advance_and_fill)
on its mask thread while N+1's forward runs and its own thread applies result N and plans N+2; the launch of
N+2 enqueues N+1's sampling with the masks before N+2's forward.

With config.grammar_process (the default on CUDA), these rows live in a process of their own and the runner talks
to them through grammar_process.MaskProcess (same interface; the masks come back in shared memory): the runner's
mask thread is then unused, and the matchers' GIL is not the step loop's.

A grammar that is complete allows only the model's EOS ids, so the sequence ends with `stop` on its next token
(the scheduler's EOS check). Reasoning models: with `reasoning_end` set, the matcher starts once that text
(`</think>`) has appeared in the output; until then the row is unconstrained.

Thinking budgets (vLLM's thinking_token_budget, SamplingParams.thinking): a ThinkingCounter (thinking.py) per sequence
counts its tokens inside the think block; once the budget is spent its mask allows only the end marker's next id, one
step at a time (whatever its allowed_token_ids say, as vLLM forces them past its other logits processors). Its row
waits for its previous token like a grammar's while the block is open; once it closes, a sequence without a grammar
needs nothing more and is dropped here (the grammar process tells the worker's mirror, MaskReady.released_seq_ids).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import llguidance
import numpy as np
import torch

from pagoda.services.grammar.compiler import cache_key, grammar_text, load_ll_tokenizer, new_matcher
from pagoda.services.worker.thinking import ThinkingCounter
from pagoda.shared.config import MATCHER_CACHE_BYTES, MATCHER_CACHE_SIZE, EngineConfig
from pagoda.shared.hf_tokenizer import tokenizer_folder
from pagoda.shared.lru import SizedLru
from pagoda.shared.messages import NewRequest, RowFailure, StepPlan, StructuredOutputs, ThinkingBudget
from pagoda.shared.shapes import ModelArch

log = logging.getLogger(__name__)

GrammarMasks = tuple[np.ndarray, torch.Tensor, np.ndarray]  # flags [B] bool, masks [K, W] int32, their rows [K]

# From this many constrained rows, on a machine with this many CPUs, masks are filled and tokens consumed by
# llguidance's thread pool (a mask costs ~30-80 us for a 150k vocabulary: 256 rows serially would cost more
# than a decode step). Below it, or on a small CPU, one thread is faster than the pool's hand-off.
PARALLEL_ROWS = 16
PARALLEL_MIN_CPUS = 8
# llguidance's pool. On the H200 host (16 CPUs, bench/grammar_step.py, 256 rows of bench/structured.py's schema) 2
# threads beat 16 at both calls (consume_token_par 2.4 vs 3.8 ms, the masks 0.8 vs 1.5 ms; 64 rows: 0.28 vs 0.97 and
# 0.18 vs 0.48 ms): more threads contend more than they split. The masks are on the critical path once their
# latency passes a decode step's forward, so the pool stays small.
MAX_EXECUTOR_THREADS = 2
CGROUP_ROOT = "/sys/fs/cgroup"
COMPILE_THREADS = 2  # grammar compiles at once (llguidance releases the GIL while it builds one)


def available_cpus() -> int:
    """The CPUs this process may run on (a container's or taskset's share, not the machine's count): its affinity
    mask, and no more than its cgroup's CPU quota (a container limited to 16 CPUs may still see all of the host's
    in its mask; a pool sized from that burns the quota and the whole process is throttled for the period)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, int(quota))) if quota is not None else cpus


def cgroup_cpu_quota(root: str = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time per period that the cgroup allows (cgroup v2 cpu.max, or v1 cfs quota / period), or
    None when unlimited or unknown."""
    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            fields = Path(root, quota_file).read_text().split()
            if period_file is not None:
                fields += Path(root, period_file).read_text().split()
        except OSError:
            continue
        if len(fields) != 2 or fields[0] in ("max", "-1"):
            return None
        try:
            quota, period = float(fields[0]), float(fields[1])
        except ValueError:
            return None
        return quota / period if quota > 0 and period > 0 else None
    return None


# why a constrained row that its allow-list leaves without a token fails (the tokenizer refuses a list that fits
# no start of the grammar; a later token can still fall outside it)
NO_TOKEN_LEFT = "allowed_token_ids leave no token that the structured output allows next"
# why a constrained row whose bad_words ban every token its grammar allows next fails
NO_WORD_LEFT = "bad_words leave no token that the structured output allows next"
# why a constrained row fails when its matcher cannot follow its tokens (a matcher that did not build, or a token it
# refuses): a 500, never a completion that goes on unconstrained or restarts its grammar
MATCHER_LOST = "structured outputs failed on the worker"
# why a row fails whose bad_words ban the end marker's id that its thinking budget forces next
NO_END_LEFT = "bad_words ban the end of the think block that thinking_token_budget forces"
# why a row fails whose sampled token is not the end marker's id its thinking budget forced (its mask did not hold)
BUDGET_LOST = "thinking_token_budget's forced end of the think block was not sampled"
# the failures that come from the request's own values, with the field to name (a 400); any other reason is the
# grammar process's failure (a 500). The reasons cross from the grammar process as text.
REQUEST_FAULTS = {NO_TOKEN_LEFT: "allowed_token_ids", NO_WORD_LEFT: "bad_words", NO_END_LEFT: "bad_words"}


def row_failure(seq_id: int, why: str) -> RowFailure:
    """A constrained row's failure as the step result reports it."""
    param = REQUEST_FAULTS.get(why)
    return RowFailure(seq_id, 400 if param is not None else 500, why, param or "")


@dataclass(slots=True)
class BadWords:
    """A grammar row's bad_words token sequences and its last generated ids (as many as the longest word's
    prefix), advanced with the tokens its matcher consumes."""

    words: list[list[int]]
    recent: deque[int]

    @classmethod
    def of(cls, new: NewRequest) -> BadWords:
        words = [list(ids) for ids in new.sampling.bad_words_token_ids]
        recent: deque[int] = deque(maxlen=max(len(ids) for ids in words) - 1)
        recent.extend(new.token_ids[new.num_prompt_tokens:])
        return cls(words, recent)

    def banned(self) -> list[int]:
        """The ids banned next (SamplingState._bad_word_bans): each word's last id where the generated ids end
        with its others; a one-id word always."""
        tail = list(self.recent)
        return [ids[-1] for ids in self.words
                if len(ids) - 1 <= len(tail) and tail[len(tail) - (len(ids) - 1):] == ids[:-1]]


@dataclass(slots=True)
class SeqGrammar:
    """One sequence's matcher, or the text it waits for before its matcher starts."""

    constraint: StructuredOutputs
    matcher: llguidance.LLMatcher | None  # None while compiling or waiting for reasoning_end
    tail: bytes = b""  # the output's last bytes while waiting (reasoning_end may span tokens)
    failed: bool = field(default=False)
    compiling: Future[llguidance.LLMatcher] | None = None  # the pristine matcher on its way
    replay: list[int] = field(default_factory=list)  # tokens to consume once it is here


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
        self._budgets: dict[int, ThinkingCounter] = {}  # thinking budgets whose block is still open (or to come)
        self._allowed: dict[int, torch.Tensor] = {}  # allowed_token_ids: sequence id -> its fixed mask [W] int32
        self._pristine: SizedLru[bytes, Future[llguidance.LLMatcher]] = SizedLru(MATCHER_CACHE_SIZE,
                                                                                 MATCHER_CACHE_BYTES)
        self._pristine_lock = threading.Lock()
        self._compiler = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="grammar")
        self._cpus = available_cpus()
        self._executor: llguidance.LLExecutor | None = None
        self.pin_memory = pin_memory
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._flip = 0
        self._failures: list[tuple[int, str]] = []  # (sequence, why): it ends with an error, unsampled (take_failures)
        self._bad_words: dict[int, BadWords] = {}  # grammar rows with bad_words: sequence id -> words and window
        self._eos: torch.Tensor | None = None  # [W] the EOS ids' bits, once a row needs them
        self._preparing: set[str] = set()  # GrammarDef hashes being compiled (prepare) ...
        self._prepared: deque[str] = deque()  # ... and those built since take_compiled (appended by compile threads)

    @property
    def active(self) -> bool:
        return bool(self._seqs) or bool(self._budgets)

    def constrains(self, seq_ids: list[int]) -> bool:
        """Some of these requests has a grammar, a thinking budget or allowed_token_ids (their sampling needs
        bitmasks)."""
        allowed = bool(self._allowed) and any(seq_id in self._allowed for seq_id in seq_ids)
        return allowed or self.has_matchers(seq_ids)

    def has_matchers(self, seq_ids: list[int]) -> bool:
        """Some of these requests has a grammar or an open thinking budget, whose mask depends on the previous
        token."""
        return ((bool(self._seqs) and any(seq_id in self._seqs for seq_id in seq_ids))
                or (bool(self._budgets) and any(seq_id in self._budgets for seq_id in seq_ids)))

    def reset(self) -> None:
        self._seqs.clear()
        self._budgets.clear()
        self._allowed.clear()
        self._failures.clear()
        self._bad_words.clear()

    def take_failures(self) -> list[tuple[int, str]]:
        """Sequences that cannot go on, found since the last call, and why: their grammar's mask and their
        allowed_token_ids share no token, their bad_words ban all it allows, or their matcher cannot follow their
        tokens (it did not build, or refused one: MATCHER_LOST). The runner ends them with an error, unsampled."""
        failed, self._failures = self._failures, []
        return failed

    def close(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)

    @property
    def preparing(self) -> bool:
        """Some prepare()d constraint is still compiling (the worker then looks for take_compiled often)."""
        return bool(self._preparing)

    def prepare(self, digest: str, constraint: StructuredOutputs,
                on_built: Callable[[str], None] | None = None) -> None:
        """Compile a GrammarDef's constraint now, on a thread (the rows that name it later find its matcher built);
        once built (or failed: those rows then fail alone), take_compiled names it, or on_built(digest) is called
        on the compiling thread."""
        notify = on_built if on_built is not None else self._prepared.append
        try:
            future = self._compile(constraint)
        except Exception:  # noqa: BLE001 - no tokenizer: its rows fail when added; nothing to wait for
            log.exception("cannot compile constraint %s", digest[:12])
            notify(digest)
            return
        if on_built is None:
            self._preparing.add(digest)
        future.add_done_callback(lambda _: notify(digest))

    def adopt(self, constraint: StructuredOutputs, pristine: llguidance.LLMatcher) -> None:
        """Take a matcher compiled elsewhere in this process with this tokenizer (the offline engine's admission
        check), unless one is cached: rows that name the constraint copy it and never wait for a compile."""
        assert not pristine.is_error(), "only a matcher that built"
        key = cache_key(constraint)
        with self._pristine_lock:
            if self._pristine.get(key) is None:
                built: Future[llguidance.LLMatcher] = Future()
                built.set_result(pristine)
                self._pristine.put(key, built, len(key))

    def take_compiled(self) -> list[str]:
        """The prepare()d constraints built since the last call."""
        built = []
        while self._prepared:
            digest = self._prepared.popleft()
            self._preparing.discard(digest)
            built.append(digest)
        return built

    def apply(self, plan: StepPlan) -> None:
        self.drop(plan.finished_seq_ids)
        for new in plan.new_requests:
            self.add(new)

    def drop(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)
            self._budgets.pop(seq_id, None)
            self._allowed.pop(seq_id, None)
            self._bad_words.pop(seq_id, None)

    def add(self, new: NewRequest) -> None:
        self.drop([new.seq_id])
        if new.sampling.allowed_token_ids:
            self._allowed[new.seq_id] = allowed_bitmask(new.sampling.allowed_token_ids, self.vocab_size)
        constraint, thinking = new.sampling.structured_outputs, new.sampling.thinking
        if (constraint is not None or thinking is not None) and new.sampling.bad_words_token_ids:
            self._bad_words[new.seq_id] = BadWords.of(new)
        if constraint is not None:
            self._add_grammar(new, constraint)
        if thinking is not None:
            self._add_budget(new, thinking)

    def _add_grammar(self, new: NewRequest, constraint: StructuredOutputs) -> None:
        seq = SeqGrammar(constraint, None)
        self._seqs[new.seq_id] = seq
        if not constraint.reasoning_end:
            seq.compiling = self._compile(constraint)  # on a thread: this step's launch does not wait for it
        generated = new.token_ids[new.num_prompt_tokens:]
        for token_id in generated:
            self._advance(new.seq_id, seq, token_id)

    def _add_budget(self, new: NewRequest, thinking: ThinkingBudget) -> None:
        """A thinking budget's counter, caught up with the tokens the sequence generated already (a recompute)."""
        self._budgets[new.seq_id] = ThinkingCounter.of(thinking)
        generated = new.token_ids[new.num_prompt_tokens:]
        self._count_thinking([new.seq_id] * len(generated), generated)

    # ---------------------------------------------------------------- per step

    def bitmask(self, seq_ids: list[int]) -> GrammarMasks | None:
        """For this step's sampled rows [B]: (flags [B] bool, True where the row has an active matcher or
        allowed_token_ids; the masks of those K rows, [K, W] int32 on the host; their batch rows [K] int64), or
        None when no row is constrained. A row whose matcher still compiles waits for it here. The masks are one
        of two reused buffers (pinned on CUDA): the step that reads one has synced before it comes round again
        (the worker has every earlier step's tokens before it fills masks)."""
        if not self._seqs and not self._allowed and not self._budgets:
            return None
        rows = [(i, seq) for i, seq_id in enumerate(seq_ids) if (seq := self._seqs.get(seq_id)) is not None]
        ready = [(seq, i) for i, seq in rows if self._ready(seq_ids[i], seq) and seq.matcher is not None]
        picked = [(seq.matcher, i) for seq, i in ready]
        fixed = [(allowed, i) for i, seq_id in enumerate(seq_ids)
                 if (allowed := self._allowed.get(seq_id)) is not None] if self._allowed else []
        forced = self._forced(seq_ids)
        if not picked and not fixed and not forced:
            return None
        index = sorted({i for _, i in picked} | {i for _, i in fixed} | {i for _, i in forced})  # batch rows masked
        slot = {i: k for k, i in enumerate(index)}  # -> their row of the compact mask
        mask = self._buffer(len(index))  # [K, W]
        compact = [(matcher, slot[i]) for matcher, i in picked]
        if self._parallel(len(compact)):
            fill_masks_par(self._ensure_executor(), compact, mask)
        else:
            for matcher, k in compact:
                fill_mask(matcher, mask, k)
        self._check_masks(ready, seq_ids)
        filled = {i for _, i in picked}
        for allowed, i in fixed:  # allowed_token_ids: alone, or narrowing the grammar's mask
            if i in filled:
                self._narrow(mask[slot[i]], allowed, seq_ids[i], NO_TOKEN_LEFT)
            else:
                mask[slot[i]] = allowed
        if self._bad_words:
            for i in filled:
                words = self._bad_words.get(seq_ids[i])
                banned = words.banned() if words is not None else []
                if banned:  # the sampler bans these too; here a grammar left with none of its tokens fails
                    self._narrow(mask[slot[i]], ~allowed_bitmask(banned, self.vocab_size), seq_ids[i], NO_WORD_LEFT)
        for token_id, i in forced:  # the end of a spent think block: that id alone, past allowed_token_ids too
            mask[slot[i]] = allowed_bitmask([token_id], self.vocab_size)
        rows_index = np.asarray(index, dtype=np.int64)  # [K]
        flags = np.zeros(len(seq_ids), dtype=bool)  # [B]
        flags[rows_index] = True
        return flags, mask, rows_index

    def _check_masks(self, ready: list[tuple[SeqGrammar, int]], seq_ids: list[int]) -> None:
        """A matcher that failed while computing its mask (a lexer past llguidance's limit: "too many expressions
        constructed") left a mask of EOS alone: sampled, the answer would stop short of its grammar. The row fails
        instead (take_failures), and the constraint's pristine matcher, whose lexer every copy shares, is dropped
        from the cache so that the next row of it builds its own."""
        for seq, i in ready:
            assert seq.matcher is not None
            if not seq.matcher.is_error():
                continue
            why = ((seq.matcher.get_error() or "").splitlines() or [""])[0][:500]
            log.error("sequence %d: its grammar failed to compute a mask: %s", seq_ids[i], why)
            self._lose(seq_ids[i], seq, f"its grammar failed to compute a mask: {why}")
            with self._pristine_lock:
                self._pristine.discard(cache_key(seq.constraint))

    def _forced(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """(the id it must write, batch row) of each row whose thinking budget is spent; a row whose bad_words ban
        that id fails (take_failures), as its sampler would leave it no token."""
        if not self._budgets:
            return []
        forced = []
        for i, seq_id in enumerate(seq_ids):
            counter = self._budgets.get(seq_id)
            token_id = counter.forced_token_id() if counter is not None else None
            if token_id is None:
                continue
            words = self._bad_words.get(seq_id)
            if words is not None and token_id in words.banned():
                self._failures.append((seq_id, NO_END_LEFT))
            else:
                forced.append((token_id, i))
        return forced

    def _narrow(self, row: torch.Tensor, allowed: torch.Tensor, seq_id: int, why: str) -> None:
        """row [W] (the grammar's mask) &= allowed [W]. Where they share no token: a grammar that may end here keeps
        its EOS (the completion ends, as it must, whatever the list says); else the row fails for `why`
        (take_failures), as sampling would break one of the two."""
        narrowed = row & allowed
        if narrowed.any():
            row.copy_(narrowed)
            return
        ends = row & self._eos_mask()
        if ends.any():
            row.copy_(ends)
        else:
            self._failures.append((seq_id, why))

    def _eos_mask(self) -> torch.Tensor:
        """[W] int32: the tokenizer's EOS ids (a row with a matcher has a tokenizer)."""
        if self._eos is None:
            tokenizer = self._ensure_tokenizer()
            self._eos = allowed_bitmask(list(tokenizer.eos_tokens), self.vocab_size)
        return self._eos

    def accept(self, seq_ids: list[int], token_ids: list[int]) -> None:
        """Advance each constrained sequence with its sampled token."""
        if not self._seqs and not self._budgets:
            return
        if self._bad_words:
            for seq_id, token_id in zip(seq_ids, token_ids, strict=True):
                if (words := self._bad_words.get(seq_id)) is not None:
                    words.recent.append(token_id)
        if self._budgets:
            self._count_thinking(seq_ids, token_ids)
        if not self._seqs:
            return
        rows = []
        for seq_id, token_id in zip(seq_ids, token_ids, strict=True):
            if (seq := self._seqs.get(seq_id)) is None:
                continue
            # done() is asked once per row: a compile that ends between two looks would see the token kept for
            # the matcher and consumed now as well (twice)
            if seq.compiling is not None and not seq.compiling.done():
                seq.replay.append(token_id)  # still compiling: consumed when its matcher is here, nobody waits
            else:
                rows.append((seq_id, seq, token_id))
        for seq_id, seq, _ in rows:
            self._ready(seq_id, seq)
        if not self._parallel_consume(len(rows)):
            for seq_id, seq, token_id in rows:
                self._advance(seq_id, seq, token_id)
            return
        running = [(seq_id, seq, token_id) for seq_id, seq, token_id in rows
                   if seq.matcher is not None and not seq.failed and not seq.matcher.is_stopped()]
        accepted = self._ensure_executor().consume_token_par(  # it refuses an empty list (every grammar done)
            [(seq.matcher, token_id) for _, seq, token_id in running]) if running else []
        for (seq_id, seq, token_id), ok in zip(running, accepted, strict=True):
            if not ok:
                self._reject(seq_id, seq, token_id)
        for _, seq, token_id in rows:
            if seq.matcher is None and not seq.failed:
                self._watch_reasoning(seq, token_id)

    def _count_thinking(self, seq_ids: list[int], token_ids: list[int]) -> None:
        """Each open thinking budget takes its sequence's token; one whose forced id was not sampled fails."""
        tokenizer = self._ensure_tokenizer()  # none fails the step that admits the row (add)
        for seq_id, token_id in zip(seq_ids, token_ids, strict=True):
            counter = self._budgets.get(seq_id)
            if counter is None:
                continue
            if not counter.push(token_id, tokenizer.decode_bytes([token_id])):
                log.error("sequence %d: token %d is not the end id %s its thinking budget forced", seq_id, token_id,
                          counter.forced_token_id())
                del self._budgets[seq_id]
                self._failures.append((seq_id, f"{MATCHER_LOST}: {BUDGET_LOST}"))
            elif counter.done:
                self._budget_closed(seq_id)

    def _budget_closed(self, seq_id: int) -> None:
        """The sequence's think block closed (or never opened): its budget asks nothing more, and a sequence without
        a grammar no mask that depends on its tokens (_released)."""
        del self._budgets[seq_id]
        if seq_id not in self._seqs:
            self._bad_words.pop(seq_id, None)
            self._released(seq_id)

    def _released(self, seq_id: int) -> None:
        """A sequence left with no grammar nor budget here (the grammar process tells the worker's mirror)."""

    def advance_and_fill(self, accepts: list[tuple[list[int], list[int]]], seq_ids: list[int]) -> GrammarMasks | None:
        """accept() each step's tokens in order, then bitmask(seq_ids): one step's host work, which the runner
        runs on a thread while its own thread goes on (llguidance's calls release the GIL)."""
        for accepted_ids, token_ids in accepts:
            self.accept(accepted_ids, token_ids)
        return self.bitmask(seq_ids)

    # ---------------------------------------------------------------- internals

    def _ready(self, seq_id: int, seq: SeqGrammar) -> bool:
        """Take the compiled matcher (waiting if it is still on its way) and consume the tokens that came
        before it; False for a row with no matcher (waiting for reasoning_end) or one that lost it (take_failures)."""
        if seq.compiling is not None:
            future, seq.compiling = seq.compiling, None
            try:
                pristine = future.result()
            except Exception as exc:  # noqa: BLE001 - this row's grammar failed to build, not the step
                log.exception("sequence %d: its grammar did not build", seq_id)
                self._lose(seq_id, seq, f"its grammar did not build: {type(exc).__name__}: {exc}")
                return False
            if pristine.is_error():  # it would allow only EOS: an empty answer that breaks the grammar
                self._lose(seq_id, seq, f"its grammar did not build: {pristine.get_error()}")
                return False
            seq.matcher = pristine.deep_copy()
            replay, seq.replay = seq.replay, []
            for token_id in replay:
                self._advance(seq_id, seq, token_id)
        return seq.matcher is not None and not seq.failed

    def _advance(self, seq_id: int, seq: SeqGrammar, token_id: int) -> None:
        if seq.compiling is not None:
            seq.replay.append(token_id)
            return
        if seq.failed:
            return  # it ends with an error before it samples again (take_failures)
        if seq.matcher is None:
            self._watch_reasoning(seq, token_id)
            return
        if seq.matcher.is_stopped():
            return  # the next tokens are EOS; the scheduler ends the sequence on the first
        if not seq.matcher.consume_token(token_id):
            self._reject(seq_id, seq, token_id)

    def _reject(self, seq_id: int, seq: SeqGrammar, token_id: int) -> None:
        # A token outside the mask (the mask allows nothing else: a bug), or one the mask allowed but the parser
        # could not take past one of llguidance's limits (a JSON object of 8,000 optional properties: "Current row
        # has 32007 items; max is 2000"); llguidance's error says which. The matcher no longer follows the row's
        # tokens, so the row ends with an error rather than an answer its grammar forbids (a failed matcher allows
        # only EOS). Only the error's first line is kept (verbose errors would add the state and the grammar).
        assert seq.matcher is not None
        why = ((seq.matcher.get_error() or "").splitlines() or [""])[0][:500]
        log.error("sequence %d: token %d rejected by its grammar: %s", seq_id, token_id, why)
        self._lose(seq_id, seq, f"token {token_id} is outside its grammar" + (f": {why}" if why else ""))

    def _lose(self, seq_id: int, seq: SeqGrammar, why: str) -> None:
        """The row's matcher cannot follow its tokens: it is never masked or advanced again and ends with an error
        (take_failures), unsampled, instead of sampling without its grammar or after a restarted one."""
        seq.failed = True
        self._failures.append((seq_id, f"{MATCHER_LOST}: {why}"))

    def _parallel(self, num_rows: int) -> bool:
        return num_rows >= PARALLEL_ROWS and self._cpus >= PARALLEL_MIN_CPUS

    def _parallel_consume(self, num_rows: int) -> bool:
        """consume_token_par: it releases the GIL for the step loop; the grammar process consumes row by row."""
        return self._parallel(num_rows)

    def _ensure_executor(self) -> llguidance.LLExecutor:
        if self._executor is None:  # 80% of our CPUs (llguidance's own default takes the machine's), up to 2
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(MAX_EXECUTOR_THREADS, self._cpus * 4 // 5)))
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
            seq.compiling = self._compile(seq.constraint)
            seq.tail = b""

    def _compile(self, constraint: StructuredOutputs) -> Future[llguidance.LLMatcher]:
        """The constraint's pristine matcher (each row deep-copies it), compiled on a thread once per distinct
        constraint while the cache keeps it. Called from the step loop (prepare, add) and from the mask thread
        (a row's </think>), hence the lock."""
        key = cache_key(constraint)
        with self._pristine_lock:
            pristine = self._pristine.get(key)
            if pristine is None:
                tokenizer = self._ensure_tokenizer()  # no tokenizer fails here, in the step that admits the row
                pristine = self._compiler.submit(self._build, tokenizer, constraint)
                self._pristine.put(key, pristine, len(key))
        return pristine

    @staticmethod
    def _build(tokenizer: llguidance.LLTokenizer, constraint: StructuredOutputs) -> llguidance.LLMatcher:
        matcher = new_matcher(tokenizer, grammar_text(constraint, tokenizer))
        if matcher.is_error():  # the tokenizer compiled it already: this is not the client's error
            log.error("grammar failed on the worker: %s", matcher.get_error())
        return matcher

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


def fill_mask(matcher: llguidance.LLMatcher, masks: torch.Tensor, row: int) -> None:
    """masks[row] [W] int32 := the matcher's next-token bitmask (llguidance.torch.fill_next_token_bitmask, without
    importing llguidance.torch: its @torch.compile at import pulls in torch._dynamo and inductor, ~3 s of CPU that
    the grammar process spent at every start)."""
    assert masks.dtype == torch.int32 and masks.device.type == "cpu" and masks.dim() == 2
    mask = masks[row]  # [W]
    assert mask.is_contiguous()
    matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)


def fill_masks_par(executor: llguidance.LLExecutor, matchers: list[tuple[llguidance.LLMatcher, int]],
                   masks: torch.Tensor) -> None:
    """masks[k] for each (matcher, k) on llguidance's pool (llguidance.torch.fill_next_token_bitmask_par)."""
    assert masks.dtype == torch.int32 and masks.device.type == "cpu" and masks.dim() == 2 and masks.is_contiguous()
    num_rows, num_words = masks.shape
    executor.unsafe_compute_mask_ptr(matchers, masks.data_ptr(), num_words * 4, num_rows)


def allowed_bitmask(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """[ceil(V/32)] int32 with bit j of word w set for each allowed id 32*w+j (the grammar masks' layout)."""
    ids = np.unique(np.asarray([t for t in token_ids if 0 <= t < vocab_size], dtype=np.int64))  # [K]
    words = np.zeros(-(-vocab_size // 32), dtype=np.uint32)  # [W]
    np.bitwise_or.at(words, ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
    return torch.from_numpy(words.view(np.int32))  # [W]


def grammar_tokenizer_loader(config: EngineConfig, arch: ModelArch) -> Callable[[], llguidance.LLTokenizer | None]:
    """Builds llguidance's tokenizer for the model's mask width and EOS ids (GrammarRows calls it at start-up)."""

    def load() -> llguidance.LLTokenizer | None:
        folder = tokenizer_folder(config.model, config.load_format, config.tokenizer)
        if folder is None:
            return None
        return load_ll_tokenizer(folder, arch.vocab_size, list(arch.eos_token_ids))

    return load
