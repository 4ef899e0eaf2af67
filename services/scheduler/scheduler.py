"""Continuous-batching policy: a token budget per step, chunked prefill, prefix reuse, preemption by swap or recompute.

No phases: every running sequence's num_computed_tokens catches up with its length. A step takes, in
order: one token for each decoding sequence (rank order), then prefill chunks of running sequences,
then new admissions from the waiting queue, until the token budget or max_num_seqs runs out. When
blocks run out, the lowest-ranked sequence (priority, then latest arrival) is preempted: its blocks
are released and it waits again. Where the worker has host slots free (swap space), the plan first copies the
preempted sequence's computed blocks there (swap_out) and its readmission copies them back (swap_in) instead of
recomputing them; else its prefix-cache hits make the recompute cheaper. Beams are always recomputed.

    waiting --admit--> running --finish--> finished
       ^                  |
       '----preempt-------'

No torch, no zmq: `schedule()` returns the StepPlan message, `update()` takes the StepResult.

Overlap (asynchronous scheduling): up to `max_inflight_plans` plans may be scheduled before the oldest one's
result comes back; results come back in plan order. A sequence that samples in a plan gets one provisional
token (PLACEHOLDER) at the end of token_ids, counted in its length so its next decode can be planned and its
blocks grown; the oldest placeholder becomes the real token when its plan's result arrives. A sequence's
provisional tokens, from oldest to newest step in flight:

    [prompt ... known outputs][P(step N)][P(step N+1)]      num_pending = 0..max_inflight_plans

    result N: P(step N) -> real token   --stops (EOS, stop id, length)--> finished: P(step N+1) dropped,
                                                                           its result row ignored
    abort / stop string / preemption: finished drops every P; a preempted sequence keeps its P (the token
    is real and comes back) and is not admitted again until num_pending == 0 (a NewRequest carries only
    real tokens). A sequence whose length with placeholders reaches max_len is not scheduled: its pending
    token ends it. With max_inflight_plans = 1 (serial) a placeholder lives only inside one step.
"""

from __future__ import annotations

import bisect
import math
import random
import secrets
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum

from pagoda.services.scheduler.beam import BeamSearch, assign_slots
from pagoda.services.scheduler.block_manager import ROOT_HASH, BlockManager, BlockTable, HostBlocks, salted_root
from pagoda.services.scheduler.fairness import (
    MAX_TENANT_CHARS,
    MAX_TIER,
    MAX_WEIGHT,
    MIN_WEIGHT,
    FairQueue,
    TenantShare,
    may_take,
)
from pagoda.services.scheduler.repetition import RepetitionWatch
from pagoda.shared.errors import ContextLengthError, InvalidRequestError, min_tokens_past_room
from pagoda.shared.messages import (
    GREEDY_TEMPERATURE,
    MAX_INT64,
    MIN_INT64,
    BeamCandidates,
    BeamFork,
    BeamGroup,
    FinishReason,
    NewRequest,
    PromptScores,
    SamplingParams,
    StepPlan,
    StepResult,
    check_allowed_left,
    check_cache_salt,
)

SEED_MODULUS = 1 << 63
PLACEHOLDER = -1  # a provisional token: sampled by a step in flight, not known yet


class SeqStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(slots=True)
class Request:
    """What a client asked for, already tokenized."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first
    owner: int = 0  # the process that owns the request (deltas route back to it)
    tenant: str = ""  # whose request (an API key's tenant); the waiting queue shares slots among tenants
    weight: float = 1.0  # the tenant's weight in that share
    tier: int = 0  # the tenant's priority tier: lower tiers are served first
    eos_token_ids: frozenset[int] = frozenset()  # its tokenizer's EOS ids (besides the model's): stop on them too
    stop_ids: frozenset[int] = frozenset()  # the ids that end it with STOP (add_request: EOS unless ignored, stop ids)
    # output tokens known before any step (a grammar's forced start): the prompt's prefill computes them too
    forced_token_ids: list[int] = field(default_factory=list)
    cache_salt: str = ""  # vLLM's: only requests with the same salt share prefix-cache blocks ("": the unsalted chain)
    prefix_root: int = ROOT_HASH  # the root of its blocks' hash chain: salted_root(cache_salt), set by add_request
    sequences: list[Sequence] = field(default_factory=list)
    num_finished: int = 0
    num_queued: int = 0  # of its sequences, those in the waiting queue (not finished): it counts as waiting while > 0
    beam: BeamSearch | None = None  # a beam search: its sequences are the beams' slots
    # the service's time.monotonic() readings for vLLM's phase metrics (phases.py); 0.0: not yet
    queued_at: float = 0.0
    scheduled_at: float = 0.0  # first admitted to a step
    first_token_at: float = 0.0
    last_token_at: float = 0.0


@dataclass(slots=True, eq=False)
class Sequence:
    """One of a request's n completions: its tokens, how many are computed, and its blocks."""

    seq_id: int
    request: Request
    index: int  # 0..n-1 within the request
    token_ids: list[int]
    num_prompt_tokens: int
    max_len: int  # total tokens at which it stops for length (prompt + max_tokens, capped by context)
    seed: int
    table: BlockTable = field(default_factory=BlockTable)
    num_computed_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    next_prompt_score: int = 1  # prompt_logprobs: prompt tokens [1, this) have been scored and passed on
    rank: tuple[int, float, int] = (0, 0.0, 0)  # (priority, arrival, seq_id): smaller runs first
    num_pending: int = 0  # provisional tokens (PLACEHOLDER) at the end of token_ids: sampled by steps in flight
    # preempted by swap: the host slots holding the K/V of its first num_swapped_tokens tokens, block by block
    swapped: list[int] | None = None
    num_swapped_tokens: int = 0
    repetition: RepetitionWatch | None = None  # repetition_detection: its runs over the output, once it is watched
    queued: bool = False  # in the waiting queue and not finished (a finished one's heap entry stays until skipped)

    @property
    def num_tokens(self) -> int:
        """Tokens including provisional ones (what scheduling counts)."""
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens whose value is known."""
        return len(self.token_ids) - self.num_pending - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    @property
    def tenant(self) -> str:
        return self.request.tenant


@dataclass(slots=True)
class SeqUpdate:
    """One sequence's news from a step: the token it sampled and whether that ended it, and prompt tokens
    scored for prompt_logprobs. A prompt chunk that samples nothing gives token_id -1 with scores."""

    seq: Sequence
    token_id: int
    result_index: int  # row in the StepResult (for logprobs); -1 with token_id -1
    finish_reason: FinishReason | None
    prompt_scores: PromptScores | None = None
    score: float | None = None  # a beam search hypothesis' last token: its ranking score
    cumulative_logprob: float | None = None  # and its sum of logprobs

    @property
    def has_token(self) -> bool:
        return self.token_id >= 0


@dataclass(slots=True)
class InflightStep:
    """A plan whose result has not come back: what update() needs to apply it."""

    step_id: int
    seqs: list[Sequence]  # scheduled, in batch order
    # the sequences whose computed tokens reach a block not hashed yet, and how many they computed after this step
    # (what the prefix cache may hash once the result is in)
    commits: list[tuple[Sequence, int]]
    sampler_ids: set[int]  # seq ids that sample in this step (each got one placeholder)
    has_prefill: bool = False  # some sequence computes more than one token (a prompt chunk)


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    num_swapped: int = 0  # of the preemptions, those whose blocks went to host slots (not recomputed)
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_steps: int = 0
    # prompt tokens of requests admitted (counted at their first admission, once per request): those that reached
    # the model, as vLLM's vllm:prompt_tokens, so a request cancelled while it waits adds none
    prompt_tokens: int = 0


class Scheduler:
    """Owns the waiting queue, the running set and the block manager of one model replica."""

    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, vocab_size: int, eos_token_ids: Iterable[int] = (),
                 enable_prefix_caching: bool = True, seed: int | None = None, max_inflight_plans: int = 1,
                 num_swap_blocks: int = 0, max_logprob_entries: int = 0) -> None:
        assert max_num_batched_tokens >= 1 and max_num_seqs >= 1 and max_inflight_plans >= 1
        assert max_logprob_entries >= 0
        # the most logprob entries (a token and its alternatives each) one request may make one step carry; 0: no
        # bound (the offline engine's results stay in its process; a served step's travel in one message)
        self.max_logprob_entries = max_logprob_entries
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.host = HostBlocks(num_swap_blocks)  # the worker's swap space, in blocks
        self._swap_out: list[int] = []  # this plan's (device block, host slot) pairs, flattened
        self._swap_in: list[int] = []  # this plan's (host slot, device block) pairs, flattened
        self._swap_out_seqs: list[int] = []  # the sequences this plan swaps out
        self._swapped_out_by_step: dict[int, list[int]] = {}  # plans in flight -> the sequences they swap out
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting = FairQueue()  # a heap by rank per tenant; tenants served by weighted fair share
        self.running: list[Sequence] = []  # sorted by rank
        self.requests: dict[str, Request] = {}
        # requests with a sequence in the waiting queue: the heap keeps an aborted sequence's entry until admission
        # reaches it, so its length overstates what waits (a bounded queue refused requests for clients long gone)
        self.num_waiting_requests = 0
        self._num_beam_searches = 0  # of self.requests: none, and a step's beam bookkeeping skips its rows
        self.stats = SchedulerStats()
        self._seqs: dict[int, Sequence] = {}
        self._next_seq_id = 0
        self._step_id = 0
        self._forgotten: list[int] = []  # seq ids the worker should drop at the next plan
        self.max_inflight_plans = max_inflight_plans  # 1: serial; 2: overlap (plan N+1 while N runs)
        self._inflight: deque[InflightStep] = deque()  # plans scheduled, results not applied, oldest first
        self._forked_waiting: list[Sequence] = []  # siblings that may wait holding forked blocks
        self._beam_forks: list[tuple[Sequence, BeamFork, tuple[int, int] | None]] = []  # for the next plan
        self._unforked_beams: dict[str, int] = {}  # beam requests admitted before their first step: seats kept
        # unseeded requests: fresh randomness each (a client that sends no seed expects a random answer, after a
        # restart and on every replica alike); a seed here makes their seeds a reproducible stream (tests)
        self._rng: random.Random | None = random.Random(seed) if seed is not None else None
        self.last_step_has_prefill = False  # of the plan update() applied last (the console's step split)
        self.preemption_log: list[Sequence] | None = None  # a list: each preempted sequence is appended (console)

    # ---------------------------------------------------------------- requests in and out

    def validate(self, request: Request) -> None:
        """Raise a typed error naming the parameter if the request cannot run on this model: its sampling
        parameters, then its prompt against this model. Called once, where a request enters (the offline
        engine; in `pagoda serve` the api validates the parameters and the tokenizer the prompt). Logprobs are
        bounded here by the vocabulary: the server's --max-logprobs was applied where requests enter (a request
        asking the whole vocabulary arrives with -1 resolved to the vocabulary's size)."""
        request.sampling.validate(max_logprobs=self.vocab_size)
        check_request_fields(request)
        self.check_prompt(request)

    def check_prompt(self, request: Request) -> None:
        """The checks of `validate` that depend on this model (prompt, token ids, context, KV cache)."""
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:  # C-speed scans: prompts run to many thousands
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        if any(token >= self.vocab_size for token in request.sampling.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be < {self.vocab_size}", param="stop_token_ids")
        if any(token >= self.vocab_size for token in request.sampling.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be < {self.vocab_size}", param="logit_bias")
        check_allowed_left(request.sampling, self.eos_token_ids | request.eos_token_ids)
        self._check_forced(request)
        capacity = self.blocks.num_blocks * self.block_size  # the most tokens of one sequence the cache holds
        if len(prompt) >= min(self.max_model_len, capacity):
            raise ContextLengthError.prompt_too_long(len(prompt), "prompt", self.max_model_len, capacity)
        self._check_beam_search(request)
        self._check_logprob_entries(request)
        max_tokens = request.sampling.max_tokens
        if max_tokens is not None and len(prompt) + max_tokens > min(self.max_model_len, capacity):
            # a sequence cannot outgrow the cache: such a max_tokens could never be met
            raise ContextLengthError.max_tokens_too_large(len(prompt), max_tokens, self.max_model_len, capacity)
        if max_tokens is None and len(prompt) + request.sampling.min_tokens > min(self.max_model_len, capacity):
            raise min_tokens_past_room(request.sampling.min_tokens, len(prompt), min(self.max_model_len, capacity))

    def _check_logprob_entries(self, request: Request) -> None:
        """A served step's logprobs travel in one message (worker -> scheduler -> tokenizer -> api), which ZeroMQ
        refuses past its frame size: a step too large was sent again, forever, and the server made no progress
        (whole-vocabulary prompt_logprobs over a 400-token prompt under --max-logprobs -1). One request may make
        a step carry at most max_logprob_entries: its prompt chunk's positions (prompt_logprobs) or its n rows
        (logprobs), each with its k alternatives and the token itself. Several such requests in one step are
        not bounded together."""
        if not self.max_logprob_entries:
            return
        params = request.sampling
        prompt_positions = min(len(request.prompt_token_ids) - 1, self.max_num_batched_tokens)
        for k, param, rows in ((params.prompt_logprobs, "prompt_logprobs", prompt_positions),
                               (params.logprobs, "logprobs", max(params.n, params.best_of or 0))):
            if k is None or rows <= 0 or (k + 1) * rows <= self.max_logprob_entries:
                continue
            largest = self.max_logprob_entries // rows - 1
            raise InvalidRequestError(
                f"{param} {k} over {rows} {'prompt positions a step' if param == 'prompt_logprobs' else 'completions'}"
                f" makes more logprobs than one step of this server can carry ({self.max_logprob_entries:,} entries): "
                f"ask at most {max(largest, 0)}" + (" or send a shorter prompt" if param == "prompt_logprobs" else ""),
                param=param)

    def _check_forced(self, request: Request) -> None:
        """A grammar's forced start (compiler.fast_forward_tokens decided it): one completion, vocabulary ids, and
        room for a sampled token after it within max_tokens, the context and the KV cache."""
        forced = request.forced_token_ids
        if not forced:
            return
        params = request.sampling
        total = len(request.prompt_token_ids) + len(forced) + 1
        if (params.n != 1 or params.use_beam_search or any(not 0 <= t < self.vocab_size for t in forced)
                or (params.max_tokens is not None and len(forced) >= params.max_tokens)
                or total > self.max_model_len or self.blocks.num_blocks_for(total) > self.blocks.num_blocks):
            raise InvalidRequestError("the grammar's forced tokens do not fit this request", param="forced_token_ids")

    def _check_beam_search(self, request: Request) -> None:
        """A beam search's beams run together: they must fit one step, and the KV cache at their longest."""
        width = request.sampling.beam_width
        if width <= 1:
            return
        field = "best_of" if request.sampling.best_of is not None else "n"  # the field that set the width
        if width > min(self.max_num_seqs, self.max_num_batched_tokens):
            raise InvalidRequestError(f"a beam search of width {width} needs that many sequences in one step; this "
                                      f"server runs at most {min(self.max_num_seqs, self.max_num_batched_tokens)}",
                                      param=field)
        max_tokens = request.sampling.max_tokens
        prompt_len = len(request.prompt_token_ids)
        # as add_request bounds a sequence: by max_tokens, the context, and the cache (what one sequence can hold)
        longest = min(prompt_len + (max_tokens if max_tokens is not None else self.max_model_len), self.max_model_len,
                      self.blocks.num_blocks * self.block_size)
        if width * self.blocks.num_blocks_for(longest) > self.blocks.num_blocks:
            # every beam may end up holding blocks of its own: a group that cannot fit whole would never finish
            raise ContextLengthError(
                f"a beam search of width {width} over {longest} tokens needs up to "
                f"{width * self.blocks.num_blocks_for(longest)} KV blocks; the cache has {self.blocks.num_blocks}",
                param=field)

    def add_request(self, request: Request) -> None:
        """Queue a request that `validate` (or the api and tokenizer) already checked: only O(1) invariants
        are asserted here, on the hot path."""
        num_prompt_tokens = len(request.prompt_token_ids)
        assert 0 < num_prompt_tokens < self.max_model_len, "validate: the prompt fits the context"
        assert self.blocks.num_blocks_for(num_prompt_tokens + 1) <= self.blocks.num_blocks, "validate: KV capacity"
        assert request.sampling.n >= 1
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use", param="request_id")
        self._check_beam_search(request)  # the served path does not call check_prompt
        params = request.sampling
        eos_ids = frozenset() if params.ignore_eos else self.eos_token_ids | request.eos_token_ids
        request.stop_ids = eos_ids | frozenset(params.stop_token_ids)
        request.prefix_root = salted_root(request.cache_salt)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        # the cache can never hold more than num_blocks * block_size tokens of one sequence
        capacity = self.blocks.num_blocks * self.block_size
        max_len = min(len(request.prompt_token_ids) + max_tokens, self.max_model_len, capacity)
        base_seed = params.seed
        if base_seed is None:
            base_seed = self._rng.getrandbits(63) if self._rng is not None else secrets.randbits(63)
        if params.use_beam_search:
            # the same stop ids as a sampled row's: its tokenizer's EOS too (the served path's request.eos_token_ids)
            request.beam = BeamSearch(width=params.beam_width, num_return=params.n,
                                      length_penalty=params.length_penalty, early_stopping=params.early_stopping,
                                      max_new_tokens=max_len - len(request.prompt_token_ids), stop_ids=request.stop_ids)
        assert not request.forced_token_ids or len(request.sequences) == 0 and params.n == 1 \
            and not params.use_beam_search, "check_prompt: forced tokens are for one completion"
        for index in range(params.beam_width or params.n):
            seq = Sequence(seq_id=self._next_seq_id, request=request, index=index,
                           token_ids=[*request.prompt_token_ids, *request.forced_token_ids],
                           num_prompt_tokens=len(request.prompt_token_ids), max_len=max_len,
                           seed=(base_seed + index) % SEED_MODULUS)
            seq.rank = (request.priority, request.arrival_time, seq.seq_id)
            self._next_seq_id += 1
            request.sequences.append(seq)
            self._seqs[seq.seq_id] = seq
        self.requests[request.request_id] = request
        self._num_beam_searches += request.beam is not None
        # Siblings wait for the first sequence's prefill and then fork its blocks (see _fork_siblings).
        self._push_waiting(request.sequences[0])

    def abort_request(self, request_id: str) -> Request | None:
        """Finish every sequence of the request now and free its blocks; None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.sequences:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
        return request

    def finish_sequence(self, seq_id: int, reason: FinishReason) -> None:
        """End a sequence for a reason found outside the scheduler (a stop string, an error)."""
        seq = self._seqs.get(seq_id)
        if seq is not None and not seq.is_finished:
            self._finish(seq, reason)

    def get_sequence(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_unsent_drops(self) -> bool:
        """Sequences ended or preempted since the last plan, whose worker state (a row, a grammar matcher) the next
        plan drops: with nothing else to run, a plan of these alone goes out, so an idle worker holds none."""
        return bool(self._forgotten)

    @property
    def oldest_inflight_has_prefill(self) -> bool:
        """Whether the oldest plan in flight computes prompt tokens (False when none is in flight)."""
        return bool(self._inflight) and self._inflight[0].has_prefill

    @property
    def num_inflight(self) -> int:
        """Plans with requests scheduled whose results update() has not applied yet."""
        return len(self._inflight)

    # ---------------------------------------------------------------- one step

    def schedule(self) -> StepPlan:
        """Pick this step's work and describe it to the worker as a diff."""
        assert len(self._inflight) < self.max_inflight_plans, "update() must consume an earlier plan first"
        self.host.settle()  # slots the last plan copied back are free now (its copies precede this plan's)
        budget = self.max_num_batched_tokens
        num_tokens: dict[int, int] = {}  # seq_id -> tokens this step, in batch order
        new_requests: list[NewRequest] = []
        appended_seq_ids: list[int] = []
        appended_block_ids: list[int] = []
        if len(self.waiting.tenants) > 1:
            self._rebalance()
        preemptions_before = self.stats.num_preemptions

        # a sequence at max_len with a provisional token is done once that token arrives: nothing to compute; a
        # beam search's first step waits for its result (it forks the other beams); later ones the worker continues
        decoding, prefilling = self._runnable()
        ready: dict[str, bool] = {}  # beam searches whose every beam is one token short (_beam_count)
        size, running = self.block_size, SeqStatus.RUNNING
        for seq in decoding + prefilling:
            if budget == 0:
                break
            if seq.status is not running:
                continue  # preempted earlier in this loop
            count = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if seq.request.beam is not None:
                count = self._beam_count(seq, count, ready)
                if count == 0:
                    continue
            if seq.num_computed_tokens + count > len(seq.table.block_ids) * size:  # else its blocks hold them
                count = self._fit_running(seq, count, num_tokens)
                if count == 0:
                    continue
                new_ids = self.blocks.grow(seq.table, seq.num_computed_tokens + count)
                appended_seq_ids.extend([seq.seq_id] * len(new_ids))
                appended_block_ids.extend(new_ids)
            num_tokens[seq.seq_id] = count
            budget -= count
        budget += self._drop_partial_beam_groups(num_tokens)
        if self.stats.num_preemptions == preemptions_before:  # admitting now would only thrash
            budget = self._admit_waiting(budget, num_tokens, new_requests)

        self._step_id += 1
        beam_groups = self._beam_groups(num_tokens)
        if num_tokens:  # a step computes something: a plan that only drops ended sequences is not one
            self.stats.num_steps += 1
            # a decoding sequence computes one token: more tokens than sequences means a prompt chunk ran
            has_prefill = self.max_num_batched_tokens - budget > len(num_tokens)
            self._inflight.append(self._launch(num_tokens, has_prefill))
        forgotten, self._forgotten = self._forgotten, []
        forks = [(fork, copy) for seq, fork, copy in self._beam_forks if seq.status == SeqStatus.RUNNING]
        self._beam_forks = []
        if not num_tokens and self._swap_out_seqs:
            self._recompute_swapped_out()
        swap_out, swap_in, self._swap_out, self._swap_in = self._swap_out, self._swap_in, [], []
        if self._swap_out_seqs:
            self._swapped_out_by_step[self._step_id] = self._swap_out_seqs
            self._swap_out_seqs = []
        return StepPlan(step_id=self._step_id, seq_ids=list(num_tokens), num_scheduled_tokens=list(num_tokens.values()),
                        new_requests=new_requests, appended_block_seq_ids=appended_seq_ids,
                        appended_block_ids=appended_block_ids, finished_seq_ids=forgotten,
                        beam_forks=[fork for fork, _ in forks],
                        block_copies=[block for _, copy in forks if copy is not None for block in copy],
                        beam_groups=beam_groups, swap_out=swap_out, swap_in=swap_in)

    def _runnable(self) -> tuple[list[Sequence], list[Sequence]]:
        """The running sequences with tokens to compute, decoding (one token) and prefilling, in rank order. One at
        max_len with a provisional token is done once that token arrives: nothing to compute; a beam search's
        first step waits for its result (it forks the other beams); later ones the worker continues."""
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for seq in self.running:
            num_tokens = len(seq.token_ids)
            if seq.num_pending and (num_tokens >= seq.max_len
                                    or seq.request.beam is not None and not seq.request.beam.num_generated):
                continue
            remaining = num_tokens - seq.num_computed_tokens
            if remaining == 1:
                decoding.append(seq)
            elif remaining > 1:
                prefilling.append(seq)
        return decoding, prefilling

    # ---------------------------------------------------------------- beam search: groups move together

    @staticmethod
    def _beam_live(request: Request) -> list[Sequence]:
        """A beam search's running beams in slot order: slot 0 alone until its first step forks the others."""
        assert request.beam is not None
        return request.sequences if request.beam.num_generated else request.sequences[:1]

    def _beam_count(self, seq: Sequence, count: int, ready: dict[str, bool]) -> int:
        """A beam computes up to its last token alone (a recompute after preemption), but samples only in a step
        where every beam of its group does: the last token waits until all are one token short. ready: each
        group's answer, found once per schedule() (nothing this loop does changes it before the group's turn:
        a preemption stops the whole group)."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        request = seq.request
        assert request.beam is not None
        if not request.beam.num_generated:
            return count  # slot 0 before its first step: a group of one
        if remaining > 1:
            return min(count, remaining - 1)
        answer = ready.get(request.request_id)
        if answer is None:
            answer = ready[request.request_id] = all(
                beam.status == SeqStatus.RUNNING and (not beam.num_pending or request.beam.num_generated > 0)
                and beam.num_tokens - beam.num_computed_tokens == 1 for beam in self._beam_live(request))
        return count if answer else 0

    def _drop_partial_beam_groups(self, num_tokens: dict[int, int]) -> int:
        """Unschedule the sampling beams of a group that did not get all of its beams into this step (blocks or
        budget ran out part way); returns the tokens given back."""
        freed = 0
        seen: set[str] = set()
        for seq_id in list(num_tokens) if self._num_beam_searches else ():
            seq = self._seqs[seq_id]
            request = seq.request
            if request.beam is None or request.request_id in seen:
                continue
            seen.add(request.request_id)
            live = self._beam_live(request)
            sampling = [b for b in live if b.seq_id in num_tokens
                        and b.num_computed_tokens + num_tokens[b.seq_id] == b.num_tokens]
            if sampling and len(sampling) < len(live):
                for beam in sampling:
                    freed += num_tokens.pop(beam.seq_id)
        return freed

    def _beam_groups(self, num_tokens: dict[int, int]) -> list[BeamGroup]:
        """The beam searches whose beams all sample in this step (before _launch counts the tokens)."""
        groups: list[BeamGroup] = []
        seen: set[str] = set()
        for seq_id in num_tokens if self._num_beam_searches else ():
            request = self._seqs[seq_id].request
            beam = request.beam
            if beam is None or request.request_id in seen:
                continue
            seen.add(request.request_id)
            live = self._beam_live(request)
            if all(b.seq_id in num_tokens and b.num_computed_tokens + num_tokens[b.seq_id] == b.num_tokens
                   for b in live):
                temperature = request.sampling.temperature  # below GREEDY_TEMPERATURE: the plain log-probabilities
                # after the first step every slot is live: the worker chooses and continues the beams itself
                on_device = beam.num_generated > 0
                groups.append(BeamGroup([b.seq_id for b in live], list(beam.scores), beam.num_candidates,
                                        temperature if temperature >= GREEDY_TEMPERATURE else 0.0, on_device,
                                        sorted(beam.stop_ids) if on_device else []))
        return groups

    def _launch(self, num_tokens: dict[int, int], has_prefill: bool) -> InflightStep:
        """Count the step's tokens as computed; each sequence that reaches its end samples: one placeholder."""
        by_id = self._seqs
        seqs: list[Sequence] = []
        commits: list[tuple[Sequence, int]] = []
        samplers: set[int] = set()
        size = self.block_size if self.blocks.enable_prefix_caching else 1 << 62  # no caching: nothing to hash
        for seq_id, count in num_tokens.items():
            seq = by_id[seq_id]
            seqs.append(seq)
            computed = seq.num_computed_tokens = seq.num_computed_tokens + count
            if computed >= (len(seq.table.block_hashes) + 1) * size:  # hashes only grow until this step's update
                commits.append((seq, computed))
            length = len(seq.token_ids)
            assert computed <= length
            if computed == length:
                seq.token_ids.append(PLACEHOLDER)
                seq.num_pending += 1
                assert seq.num_pending <= self.max_inflight_plans
                samplers.add(seq_id)
        return InflightStep(self._step_id, seqs, commits, samplers, has_prefill)

    def _fit_running(self, seq: Sequence, count: int, scheduled: dict[int, int]) -> int:
        """Shrink `count` to the blocks available, preempting lower-ranked unscheduled sequences if needed."""
        while True:
            needed = self.blocks.num_blocks_for(seq.num_computed_tokens + count) - len(seq.table.block_ids)
            if needed <= self.blocks.num_free_blocks:
                return count
            victim = self._pick_victim(seq, scheduled)
            if victim is None:
                if self._release_waiting_blocks(seq):
                    continue  # forked siblings waiting behind it held blocks; try again
                if seq.num_tokens - seq.num_computed_tokens > 1:  # a prefill chunk can shrink instead
                    room = (len(seq.table.block_ids) + self.blocks.num_free_blocks) * self.block_size
                    if room > seq.num_computed_tokens:
                        return min(count, room - seq.num_computed_tokens)
                if not scheduled:
                    self._preempt(seq)  # nothing else runs: give its blocks back and wait
                return 0
            self._preempt(victim)

    def _pick_victim(self, seq: Sequence, scheduled: dict[int, int]) -> Sequence | None:
        """The running sequence that gives its blocks to `seq`, among those this step has not scheduled: of seq's
        tenant and ranked below it, or of a tenant that owes seq's a slot (fairness.may_take); the lowest-ranked
        of the most loaded tenant. With one tenant: the lowest-ranked sequence ranked below `seq`. A beam goes with
        its whole group: never seq's own group, nor one with a beam scheduled."""
        tenants = self.waiting.tenants
        own = tenants[seq.tenant]
        best: Sequence | None = None
        best_key: tuple[int, float, tuple[int, float, int]] | None = None
        for victim in reversed(self.running):
            if victim is seq or victim.seq_id in scheduled:
                continue
            request = victim.request
            if request.beam is not None and (request is seq.request or any(
                    beam.seq_id in scheduled for beam in self._beam_live(request))):
                continue
            giver = tenants[victim.tenant]
            if giver is own and victim.rank < seq.rank or giver is not own and not may_take(own, giver, extra=0):
                continue
            key = (giver.tier, giver.load(), victim.rank)
            if best_key is None or key > best_key:
                best, best_key = victim, key
        return best

    def _rebalance(self) -> None:
        """Slots or blocks are short and a tenant below its share waits: the most loaded tenant that owes it a slot
        (fairness.may_take) gives one, the running sequence with the least computed (the lowest-ranked of those)
        preempted by recompute, until the share is met or nothing is owed; the takers' sequences are admitted
        this step."""
        reserved: dict[str, int] = {}
        while True:
            seq = self.waiting.head(reserved)
            if seq is None or seq.num_pending or not self._lacks_room(seq, sum(reserved.values())):
                return
            taker = self.waiting.tenants[seq.tenant]
            extra = reserved.get(taker.name, 0) + 1
            givers = [tenant for tenant in self.waiting.tenants.values() if may_take(taker, tenant, extra)]
            if not givers:
                return  # the tenant first in line is owed nothing: neither is any other
            giver = max(givers, key=lambda tenant: (tenant.tier, tenant.load()))
            # the giver's sequence whose recompute costs least (often one it was just given): the rest progress
            victims = [victim for victim in reversed(self.running) if victim.tenant == giver.name]
            self._preempt(min(victims, key=lambda victim: victim.num_computed_tokens))
            reserved[taker.name] = extra

    def _lacks_room(self, seq: Sequence, num_reserved: int) -> bool:
        """No running slot, or too few free blocks for a first chunk of `seq`, once `num_reserved` slots are
        promised to other tenants."""
        if self._num_seats_taken() + num_reserved >= self.max_num_seqs:
            return True
        first_chunk = min(seq.num_tokens, self.max_num_batched_tokens)
        return self.blocks.num_blocks_for(first_chunk) - len(seq.table.block_ids) > self.blocks.num_free_blocks

    def _admit_waiting(self, budget: int, num_tokens: dict[int, int], new_requests: list[NewRequest]) -> int:
        while budget > 0 and self._num_seats_taken() < self.max_num_seqs:
            seq = self.waiting.head()  # weighted fair share among tenants, rank order within one
            if seq is None:
                break
            if seq.num_pending:  # preempted with a token in flight: the worker gets real tokens only
                break
            beam = seq.request.beam
            if beam is not None and self._num_seats_taken() + self._beam_seats(seq.request) > self.max_num_seqs:
                break  # a beam search's beams all run at once: seats for every one of them
            count = self._admit_one(seq, budget)
            if count == 0 and not (beam is not None and beam.num_generated
                                   and seq.num_tokens - seq.num_computed_tokens == 1):
                if not self.running and self._release_waiting_blocks(seq, every_other=True):
                    continue  # forked siblings waiting behind it held the blocks it needs
                break  # the head of the queue does not fit: FCFS, nothing overtakes it
            self.waiting.pop(seq)
            self._dequeue(seq)
            self._start_running(seq)
            if beam is not None and not beam.num_generated:
                self._unforked_beams[seq.request.request_id] = beam.width - 1  # its first step forks the rest
            if count:  # a beam with only its last token left runs when its whole group does
                num_tokens[seq.seq_id] = count
            budget -= count
            new_requests.append(NewRequest(
                seq_id=seq.seq_id, token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens,
                block_ids=list(seq.table.block_ids), num_computed_tokens=seq.num_computed_tokens,
                sampling=seq.request.sampling, seed=seq.seed, eos_token_ids=self._banned_eos(seq.request)))
        return budget

    def _banned_eos(self, request: Request) -> list[int]:
        """The EOS ids the worker bans until min_tokens (the worker knows no EOS of its own). ignore_eos does not
        lift the ban: as vLLM's, whose min_tokens bans the EOS whatever ignore_eos says."""
        params = request.sampling
        if params.min_tokens == 0:
            return []
        return sorted(self.eos_token_ids | request.eos_token_ids)

    def _release_waiting_blocks(self, seq: Sequence, every_other: bool = False) -> bool:
        """`seq` cannot get blocks: waiting sequences that would be admitted after it drop the blocks they forked
        (_after). `every_other`: all but seq, for the queue's head when nothing runs: it is admitted next whatever
        their ranks (a sibling of another tenant ranked above the head kept its blocks and nothing ever ran again).

        Forked siblings wait holding blocks and preemption only takes running sequences, so without
        this the pool can stay full with nothing running (a deadlock) or the only runner can be admitted
        and preempted forever. Their prompt blocks stay in the prefix cache, so admission finds them again.
        """
        self._forked_waiting = [sibling for sibling in self._forked_waiting
                                if sibling.status == SeqStatus.WAITING and sibling.table.block_ids]
        released = False
        for sibling in self._forked_waiting:
            if sibling is not seq and (every_other or self._after(sibling, seq)):
                self.blocks.free(sibling.table)
                sibling.num_computed_tokens = 0
                released = True
        return released

    def _after(self, waiting: Sequence, running: Sequence) -> bool:
        """Whether a waiting sequence would be admitted after `running` were that one preempted: of its tenant,
        ranked below it; of another tenant, unless that tenant is owed a running slot of `running`'s
        (fairness.may_take: preempted, `running` would come after it). The fair share, not rank alone, orders the
        queue across tenants: by rank, a runner gave way to a better-ranked sibling of another tenant, was first in
        the queue again, readmitted and preempted, over and over."""
        if waiting.tenant == running.tenant:
            return waiting.rank > running.rank
        tenants = self.waiting.tenants
        return not may_take(tenants[waiting.tenant], tenants[running.tenant], extra=1)

    def _num_seats_taken(self) -> int:
        """Running sequences, plus the beams that admitted beam searches will fork at their first step."""
        return len(self.running) + sum(self._unforked_beams.values())

    def _beam_seats(self, request: Request) -> int:
        """Seats a beam search still needs: every beam at its first admission, else its waiting beams."""
        assert request.beam is not None
        if not request.beam.num_generated:
            return request.beam.width
        return sum(1 for beam in request.sequences if beam.status == SeqStatus.WAITING)

    def _admit_one(self, seq: Sequence, budget: int) -> int:
        """Reuse cached prefix blocks, then take blocks for a first chunk; 0 if it does not fit now (or, for a
        beam, when only its last token is left: it is admitted and waits for its group)."""
        if seq.swapped is not None:
            return self._admit_swapped(seq, budget)
        table = self.blocks
        hit_ids: list[int] = []
        # cached positions are never scored: prompt_logprobs computes its whole prompt
        looked_up = table.enable_prefix_caching and seq.num_computed_tokens == 0 and not _needs_prompt_scores(seq)
        if looked_up:
            max_hit_blocks = (seq.num_tokens - 1) // self.block_size  # keep one token to compute
            hit_ids, hit_hashes = table.lookup_prefix(seq.token_ids, max_hit_blocks, seq.request.prefix_root)
        num_hit_tokens = len(hit_ids) * self.block_size
        start = seq.num_computed_tokens + num_hit_tokens
        held = len(seq.table.block_ids) + len(hit_ids)
        available = table.num_free_blocks - table.num_unreferenced(hit_ids)  # hits leave the free pool
        room = (held + available) * self.block_size - start
        count = min(seq.num_tokens - start, budget, room)
        grouped = seq.request.beam is not None and seq.request.beam.num_generated > 0  # beams that fork no more
        if grouped:
            count = min(count, seq.num_tokens - start - 1)  # _beam_count: the last token goes with the group
        if count <= 0 and not (grouped and seq.num_tokens - start == 1):
            return 0
        if hit_ids:
            table.acquire(hit_ids)
            seq.table.block_ids.extend(hit_ids)
            seq.table.block_hashes.extend(hit_hashes)
            seq.num_computed_tokens = num_hit_tokens
        if seq.num_preemptions == 0 and seq.index == 0:
            seq.num_cached_tokens = min(num_hit_tokens, seq.num_prompt_tokens)  # not a forced start's hits
            if looked_up:  # as vLLM's: a prompt not looked up (prompt_logprobs, caching off) is no query
                self.stats.prefix_query_tokens += seq.num_tokens
                self.stats.prefix_hit_tokens += num_hit_tokens
            self.stats.prompt_tokens += len(seq.request.prompt_token_ids)
        table.grow(seq.table, start + count)
        return count

    def _admit_swapped(self, seq: Sequence, budget: int) -> int:
        """A sequence preempted by swap: blocks for its swapped tokens and a first chunk; those the prefix cache
        still holds are taken from it, the others copied back from its host slots (swap_in). Its last known token
        is computed again when all were (the step needs its logits); 0 if it does not fit now."""
        assert seq.swapped is not None and not seq.table.block_ids, "swapped out: it holds host slots, no blocks"
        size, blocks = self.block_size, self.blocks
        start = min(seq.num_swapped_tokens, seq.num_tokens - 1)
        # full blocks of [0, start)
        hit_ids, hit_hashes = blocks.lookup_prefix(seq.token_ids, start // size, seq.request.prefix_root)
        available = blocks.num_free_blocks - blocks.num_unreferenced(hit_ids)
        count = min(seq.num_tokens - start, budget, (len(hit_ids) + available) * size - start)
        if count <= 0:
            return 0
        blocks.acquire(hit_ids)
        seq.table.block_ids.extend(hit_ids)
        seq.table.block_hashes.extend(hit_hashes)
        blocks.grow(seq.table, start + count)
        for index in range(len(hit_ids), blocks.num_blocks_for(start)):  # the blocks of [0, start) not cached
            self._swap_in += (seq.swapped[index], seq.table.block_ids[index])
        self.host.release_later(seq.swapped)
        seq.swapped, seq.num_computed_tokens = None, start
        return count

    def _swap_out_blocks(self, seq: Sequence) -> bool:
        """Preempting `seq`: copy its computed blocks to host slots instead of dropping them, where slots are free.
        Not for beams (a group swaps as a whole or not at all: they recompute) nor a sequence with no full block
        computed (a recompute of under one block costs less than the copies)."""
        if seq.request.beam is not None or seq.num_computed_tokens < self.block_size:
            return False
        num_blocks = self.blocks.num_blocks_for(seq.num_computed_tokens)
        slots = self.host.allocate(num_blocks)
        if slots is None:
            return False
        for block_id, slot in zip(seq.table.block_ids[:num_blocks], slots, strict=True):
            self._swap_out += (block_id, slot)
        seq.swapped, seq.num_swapped_tokens = slots, seq.num_computed_tokens
        self._swap_out_seqs.append(seq.seq_id)
        self.stats.num_swapped += 1
        return True

    def _recompute_swapped_out(self) -> None:
        """The plan being built runs nothing, so it gets no result: a failure of its copies out could not end the
        sequences it swaps out (swapped_out_by), which would come back from slots never written. They recompute."""
        for seq_id in self._swap_out_seqs:
            seq = self._seqs[seq_id]
            assert seq.swapped is not None and seq.status == SeqStatus.WAITING, "preempted by this plan"
            self.host.free(seq.swapped)
            seq.swapped = None
            self.stats.num_swapped -= 1
        self._swap_out, self._swap_out_seqs = [], []

    def swapped_out_by(self, step_id: int) -> list[int]:
        """The sequences plan step_id swapped out (its copies to their host slots), forgotten once asked for or
        once the plan's result is applied. A plan that failed on the worker may not have written their slots: the
        caller ends them rather than let them come back from those slots."""
        return self._swapped_out_by_step.pop(step_id, [])

    def update(self, plan: StepPlan, result: StepResult) -> list[SeqUpdate]:
        """Apply the oldest plan in flight: real tokens replace its placeholders, sequences that stop finish
        (dropping any later placeholder), newly full blocks are cached."""
        assert result.step_id == plan.step_id, "result for another step"
        swapped_out = self._swapped_out_by_step.pop(plan.step_id, [])  # its copies ran, unless the step failed
        if not plan.seq_ids:
            assert not swapped_out, "a plan that runs nothing swaps nothing out"
            return []  # nothing ran: no record was kept, no result will carry tokens
        step = self._inflight.popleft()
        assert step.step_id == plan.step_id, f"result of step {plan.step_id} before step {step.step_id}'s"
        self.last_step_has_prefill = step.has_prefill
        self._commit_blocks(step)
        scores = self._new_prompt_scores(result)
        # a failed step (the offline engine passes its error on; the service ended these already: swapped_out_by)
        updates: list[SeqUpdate] = self._end_swapped_out(swapped_out) if result.error else []
        resolved: set[int] = set()
        for candidates in result.beam_candidates:
            updates += self._advance_beam(candidates, step, resolved)
        seqs, samplers, finished = self._seqs, step.sampler_ids, SeqStatus.FINISHED  # the loop runs once per row
        for row, (seq_id, token_id) in enumerate(zip(result.seq_ids, result.sampled_token_ids, strict=True)):
            seq = seqs.get(seq_id)
            if seq is None or seq.status is finished or seq_id not in samplers or seq_id in resolved:
                continue  # aborted or stopped while the step ran (its provisional token is dropped)
            request = seq.request
            if request.beam is not None:
                continue  # beams take their tokens from their group's candidates only
            resolved.add(seq_id)
            prompt_scores = scores.pop(seq_id, None) if scores else None
            if request.sampling.max_tokens == 0:  # the prompt was all it wanted (scored): no token
                self._finish(seq, FinishReason.LENGTH)
                updates.append(SeqUpdate(seq, -1, -1, FinishReason.LENGTH, prompt_scores))
                continue
            # the oldest placeholder becomes the token (inline: this runs once per row and step)
            index = len(seq.token_ids) - seq.num_pending
            assert seq.num_pending > 0 and token_id >= 0 and seq.token_ids[index] == PLACEHOLDER
            seq.token_ids[index] = token_id
            seq.num_pending -= 1
            if index == seq.num_prompt_tokens and seq.index == 0 and request.sampling.n > 1:
                self._fork_siblings(seq)
            reason = None
            if token_id in request.stop_ids:  # EOS (unless ignore_eos) and stop_token_ids
                reason = FinishReason.STOP
            elif index + 1 >= seq.max_len:  # index + 1 tokens known now
                reason = FinishReason.LENGTH
            elif request.sampling.repetition_detection is not None and _ends_in_repetition(seq, index + 1):
                reason = FinishReason.REPETITION
            if reason is not None:
                self._finish(seq, reason)
            updates.append(SeqUpdate(seq, token_id, row, reason, prompt_scores))
        for seq_id in step.sampler_ids - resolved:  # the worker gave no token (it dropped the request)
            seq = self._seqs.get(seq_id)
            if seq is not None and seq.request.beam is not None and not seq.is_finished:
                updates += self._end_beam_search(seq.request, FinishReason.ABORT)
            elif seq is not None and not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
                updates.append(SeqUpdate(seq, -1, -1, FinishReason.ABORT, scores.pop(seq_id, None)))
        updates += [SeqUpdate(self._seqs[seq_id], -1, -1, None, s) for seq_id, s in scores.items()
                    if seq_id in self._seqs]
        return updates

    def _commit_blocks(self, step: InflightStep) -> None:
        """Hash the blocks a step filled (prefix caching): of the sequences _launch found reaching a new full block
        (in decode, one step in block_size), those still running (not finished, not preempted since)."""
        for seq, num_computed in step.commits:
            if seq.status is SeqStatus.RUNNING:
                assert num_computed <= len(seq.token_ids) - seq.num_pending, "hashing a provisional token"
                self.blocks.commit(seq.table, seq.token_ids, num_computed, seq.request.prefix_root)

    def cancel_inflight(self) -> None:
        """Forget every plan in flight (their results will never come): their sequences are aborted, and so are
        those they swapped out (whether their copies ran is unknown)."""
        while self._inflight:
            for seq in self._inflight.popleft().seqs:
                if not seq.is_finished:
                    self._finish(seq, FinishReason.ABORT)
        for seq_ids in self._swapped_out_by_step.values():
            self._end_swapped_out(seq_ids)
        self._swapped_out_by_step.clear()

    def _end_swapped_out(self, seq_ids: list[int]) -> list[SeqUpdate]:
        """The sequences a plan swapped out, when its copies out may not have run (it failed or was cancelled):
        their host slots may never have been written, so they end (aborted) rather than come back from them, also
        one readmitted since."""
        updates: list[SeqUpdate] = []
        for seq_id in seq_ids:
            seq = self._seqs.get(seq_id)
            if seq is not None and not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
                updates.append(SeqUpdate(seq, -1, -1, FinishReason.ABORT))
        return updates

    def _new_prompt_scores(self, result: StepResult) -> dict[int, PromptScores]:
        """The step's prompt scores that clients have not had yet (a recomputed prompt is scored again)."""
        fresh: dict[int, PromptScores] = {}
        for scores in result.prompt_scores:
            seq = self._seqs.get(scores.seq_id)
            if seq is None or seq.is_finished or not _needs_prompt_scores(seq):
                continue
            skip = seq.next_prompt_score - scores.first
            if not 0 <= skip < len(scores.token_ids):  # all seen already (recomputed), or past a gap: unusable
                continue
            if skip:
                scores = PromptScores(scores.seq_id, seq.next_prompt_score, scores.token_ids[skip:],
                                      scores.logprobs[skip:], scores.top_token_ids[skip:],
                                      scores.top_logprobs[skip:], scores.ranks[skip:])
            seq.next_prompt_score = scores.first + len(scores.token_ids)
            fresh[seq.seq_id] = scores
        return fresh

    # ---------------------------------------------------------------- beam search: one step's candidates

    def _advance_beam(self, candidates: BeamCandidates, step: InflightStep, resolved: set[int]) -> list[SeqUpdate]:
        """A beam group's best continuations: the search advances (beam.py), the placeholders go, and each slot
        continues a new beam, its own (the token appended) or another's (a table forked from that beam's,
        copy-on-write of the last partial block), which the next plan tells the worker. Done: the answer."""
        first = self._seqs.get(candidates.seq_id)
        if first is None or first.request.beam is None or first.seq_id not in step.sampler_ids:
            return []  # aborted while the step ran
        request, beam = first.request, first.request.beam
        if beam.num_generated:
            return self._follow_beams(candidates, step, resolved)
        live = self._beam_live(request)
        if any(seq.is_finished or seq.seq_id not in step.sampler_ids or seq.num_pending != 1 for seq in live):
            return []  # not the group this step ran: the worker's answer is dropped (and the beams aborted)
        resolved.update(seq.seq_id for seq in live)
        candidates = _without_padding(candidates, len(live))
        if not self._candidates_valid(candidates, len(live)):
            return self._end_beam_search(request, FinishReason.ERROR)  # a malformed answer ends this request only
        for seq in live:  # the provisional tokens: what each slot gets is decided here
            del seq.token_ids[-1]
            seq.num_pending = 0
        decided = self._decide_beams(request, candidates, live)
        if decided is None:
            return self._end_beam_search(request, None)
        beams, parents, slots = decided
        self._unforked_beams.pop(request.request_id, None)
        num_known = len(live[0].token_ids)  # every beam's, before the new tokens
        # the tokens of the beams that other slots continue (copied before any slot changes)
        known = {parent: list(live[parent].token_ids) for slot, parent in zip(slots, parents, strict=True)
                 if slot != parent}
        running = first.status == SeqStatus.RUNNING  # a group runs or waits as a whole
        if running:
            moved = [(request.sequences[slot], live[parent]) for slot, parent in zip(slots, parents, strict=True)
                     if slot != parent]
            for seq, parent_seq in moved:  # lines that end give back first the blocks their new line lacks
                self.blocks.release_tail(seq.table, self.blocks.shared_prefix(seq.table, parent_seq.table, num_known))
            if num_known % self.block_size and self.blocks.num_free_blocks < len(moved):
                self._preempt(first)  # no room for the copies of the last partial block: recompute later
                running = False
        for (parent, token, _), slot in zip(beams, slots, strict=True):
            seq = request.sequences[slot]
            if slot == parent:
                seq.token_ids.append(token)
                if running:
                    self._beam_forks.append((seq, BeamFork(seq.seq_id, seq.seq_id, token), None))
                continue
            seq.token_ids = known[parent] + [token]
            if not running:
                seq.num_computed_tokens = 0
                if slot >= len(live):  # a beam of the first step: it joins its group in the queue
                    self._push_waiting(seq)
                continue
            seq.table, copy = self.blocks.refork_for_write(seq.table, live[parent].table, len(known[parent]))
            seq.num_computed_tokens = len(known[parent])
            if seq.status != SeqStatus.RUNNING:  # a beam of the first step
                self._start_running(seq)
            self._beam_forks.append((seq, BeamFork(seq.seq_id, live[parent].seq_id, token, list(seq.table.block_ids)),
                                     copy))
        beam.scores = [0.0] * len(request.sequences)
        for (_, _, score), slot in zip(beams, slots, strict=True):
            beam.scores[slot] = score  # slot order, as the next BeamGroup sends them
        return []

    def _follow_beams(self, candidates: BeamCandidates, step: InflightStep, resolved: set[int]) -> list[SeqUpdate]:
        """A step whose beams the worker chose and continued itself (BeamGroup.on_device): the search advances the
        same way (beam.py), and each slot's tokens and table follow the worker's choice one step behind: slot s
        continuing parent p holds p's full blocks (shared by reference) and keeps its own last blocks (the worker
        copied p's partial one into it). A step planned meanwhile keeps its placeholder: the worker chose its
        input already."""
        request = self._seqs[candidates.seq_id].request
        beam = request.beam
        assert beam is not None
        live = request.sequences
        if any(seq.is_finished or seq.seq_id not in step.sampler_ids or not seq.num_pending for seq in live):
            return []  # not the group this step ran: the worker's answer is dropped (and the beams aborted)
        resolved.update(seq.seq_id for seq in live)
        if not self._candidates_valid(candidates, len(live)) or not candidates.slot_parents:
            return self._end_beam_search(request, FinishReason.ERROR)  # a malformed answer ends this request only
        later = live[0].num_pending - 1  # placeholders of steps planned after this one (their inputs are chosen)
        for seq in live:
            assert seq.num_pending == later + 1
            del seq.token_ids[-seq.num_pending:]
            seq.num_pending = 0
        decided = self._decide_beams(request, candidates, live)
        if decided is None:
            return self._end_beam_search(request, None)
        beams, parents, slots = decided
        slot_parents = list(range(len(live)))
        for slot, parent in zip(slots, parents, strict=True):
            slot_parents[slot] = parent
        if slot_parents != candidates.slot_parents:  # the worker's tables would not be ours
            return self._end_beam_search(request, FinishReason.ERROR)
        num_known = len(live[0].token_ids)
        tokens = [list(seq.token_ids) for seq in live]
        if live[0].status == SeqStatus.RUNNING:
            self._share_parent_blocks(live, slot_parents, num_known // self.block_size)
        for (parent, token, score), slot in zip(beams, slots, strict=True):
            seq = live[slot]
            seq.token_ids = tokens[parent] + [token] + [PLACEHOLDER] * later
            seq.num_pending = later
            beam.scores[slot] = score
            if seq.status != SeqStatus.RUNNING:
                seq.num_computed_tokens = 0  # preempted while the step ran: recomputed on its new line
        return []

    def _candidates_valid(self, candidates: BeamCandidates, num_live: int) -> bool:
        """Some candidates, each a token, a parent and a score, and every one continues a live beam with a token of
        the vocabulary (else the worker's answer is malformed: BeamSearch.step would fail an assert)."""
        return len(candidates.token_ids) == len(candidates.parents) == len(candidates.scores) > 0 and all(
            0 <= parent < num_live for parent in candidates.parents) and all(
            0 <= token < self.vocab_size for token in candidates.token_ids)

    def _decide_beams(self, request: Request, candidates: BeamCandidates, live: list[Sequence]
                      ) -> tuple[list[tuple[int, int, float]], list[int], list[int]] | None:
        """The search's step over the worker's best candidates (beam.py): the new beams (parent, token, score),
        their parents and the slot that continues each (assign_slots); None when the search is done."""
        beam = request.beam
        assert beam is not None
        count = min(beam.num_candidates, len(candidates.token_ids))
        decided = beam.step(candidates.token_ids[:count], candidates.parents[:count], candidates.scores[:count],
                            _Generated(live))
        if decided.done:
            return None
        parents = [parent for parent, _, _ in decided.beams]
        return decided.beams, parents, assign_slots(parents, len(request.sequences))

    def _share_parent_blocks(self, live: list[Sequence], slot_parents: list[int], num_shared: int) -> None:
        """Each slot that changes line takes its parent's first num_shared blocks (all full) instead of its own;
        blocks after those are the slot's own and stay. References are taken before any is dropped."""
        old = [seq.table for seq in live]
        tables = []
        for slot, parent in enumerate(slot_parents):
            table = old[slot]
            if parent == slot:
                tables.append(table)
                continue
            keep = self.blocks.shared_prefix(table, old[parent], num_shared * self.block_size)
            self.blocks.acquire(old[parent].block_ids[keep:num_shared])
            tables.append(BlockTable(old[parent].block_ids[:num_shared] + table.block_ids[num_shared:],
                                     list(old[parent].block_hashes[:num_shared])))
        for slot, parent in enumerate(slot_parents):
            if parent != slot:
                keep = self.blocks.shared_prefix(old[slot], old[parent], num_shared * self.block_size)
                self.blocks.release(old[slot].block_ids[keep:num_shared])
        for seq, table in zip(live, tables, strict=True):
            seq.table = table

    def _end_beam_search(self, request: Request, reason: FinishReason | None) -> list[SeqUpdate]:
        """Every slot ends; the n best hypotheses are the completions, each sent whole (reason None), or the
        completions end empty with `reason`."""
        assert request.beam is not None
        for seq in request.sequences:
            if not seq.is_finished:
                self._finish(seq, reason if reason is not None else FinishReason.STOP)
        returned = request.sequences[:request.sampling.n]
        if reason is not None:
            return [SeqUpdate(seq, -1, -1, reason) for seq in returned]
        updates: list[SeqUpdate] = []
        for seq, hypothesis in zip(returned, request.beam.best(), strict=False):
            seq.token_ids = seq.token_ids[:seq.num_prompt_tokens] + hypothesis.token_ids
            seq.finish_reason = FinishReason.STOP if hypothesis.stopped else FinishReason.LENGTH
            updates += [SeqUpdate(seq, token, -1, None) for token in hypothesis.token_ids[:-1]]
            updates.append(SeqUpdate(seq, hypothesis.token_ids[-1], -1, seq.finish_reason, score=hypothesis.score,
                                     cumulative_logprob=hypothesis.cumulative_logprob))
        return updates

    def _fork_siblings(self, first: Sequence) -> None:
        """n > 1: siblings share the first sequence's prompt blocks and recompute only the tail."""
        self._forked_waiting = [sibling for sibling in self._forked_waiting  # drop admitted/finished ones
                                if sibling.status == SeqStatus.WAITING and sibling.table.block_ids]
        for sibling in first.request.sequences[1:]:
            if sibling.is_finished:
                continue
            if first.status == SeqStatus.RUNNING:  # preempted while its first token was in flight: no blocks
                sibling.table = self.blocks.fork(first.table, sibling.num_prompt_tokens - 1)
                sibling.num_computed_tokens = len(sibling.table.block_ids) * self.block_size
            self._push_waiting(sibling)
            self._forked_waiting.append(sibling)

    # ---------------------------------------------------------------- state changes

    def _push_waiting(self, seq: Sequence) -> None:
        assert not seq.queued, "a sequence is queued once"
        seq.status = SeqStatus.WAITING
        seq.queued = True
        self.num_waiting_requests += seq.request.num_queued == 0
        seq.request.num_queued += 1
        self.waiting.push(seq, seq.request.weight, seq.request.tier)

    def _dequeue(self, seq: Sequence) -> None:
        """`seq` leaves the waiting queue (admitted, or finished while it waits: its heap entry is skipped later)."""
        seq.queued = False
        seq.request.num_queued -= 1
        self.num_waiting_requests -= seq.request.num_queued == 0

    def _start_running(self, seq: Sequence) -> None:
        bisect.insort(self.running, seq, key=_rank)
        seq.status = SeqStatus.RUNNING
        self.waiting.tenants[seq.tenant].num_running += 1

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        share: TenantShare = self.waiting.tenants[seq.tenant]
        share.num_running -= 1
        assert share.num_running >= 0

    def _preempt(self, seq: Sequence) -> None:
        """Back to waiting, blocks freed (swapped to host slots where free, else recomputed later): a beam with every
        running beam of its group."""
        group = [seq]
        if seq.request.beam is not None:
            group = [beam for beam in seq.request.sequences if beam.status == SeqStatus.RUNNING]
            self._unforked_beams.pop(seq.request.request_id, None)  # admitted again with seats for all
        for victim in group:
            self._stop_running(victim)
            self._swap_out_blocks(victim)  # before the free: its blocks' ids go into the plan's copies
            self.blocks.free(victim.table)
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            self.stats.num_preemptions += 1
            if self.preemption_log is not None:
                self.preemption_log.append(victim)
            self._forgotten.append(victim.seq_id)
            self._push_waiting(victim)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.num_pending:  # tokens of steps in flight past the end: never emitted, never counted
            del seq.token_ids[-seq.num_pending:]
            seq.num_pending = 0
        if seq.status == SeqStatus.RUNNING:
            self._stop_running(seq)
            self._forgotten.append(seq.seq_id)
        # a waiting sequence stays in the heap until admission skips it (removal from a heap is O(n))
        if seq.queued:
            self._dequeue(seq)
        self.blocks.free(seq.table)
        if seq.swapped is not None:  # nothing reads its slots any more (a copy out in flight may still write them)
            self.host.free(seq.swapped)
            seq.swapped = None
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        request = seq.request
        request.num_finished += 1
        if request.num_finished == len(request.sequences):
            del self.requests[request.request_id]
            self._num_beam_searches -= request.beam is not None
            self.waiting.forget_idle(request.tenant)
            self._unforked_beams.pop(request.request_id, None)
            if self._forked_waiting:  # its siblings, were they forked: the list must not keep an ended request
                self._forked_waiting = [sibling for sibling in self._forked_waiting if sibling.request is not request]
        elif seq.index == 0 and seq.num_output_tokens == 0:
            for sibling in request.sequences[1:]:  # never forked: they end with the first one
                if not sibling.is_finished:
                    self._finish(sibling, reason)


def check_request_fields(request: Request) -> None:
    """The fields besides sampling and prompt that order the queues: a NaN arrival or a zero weight would break
    the heaps' order, a huge tenant name or cache salt the memory."""
    if not math.isfinite(request.arrival_time):
        raise InvalidRequestError("arrival_time must be finite", param="arrival_time")
    if not MIN_INT64 <= request.priority <= MAX_INT64:
        raise InvalidRequestError("priority must fit in 64 bits", param="priority")
    if len(request.tenant) > MAX_TENANT_CHARS:
        raise InvalidRequestError(f"a tenant name has at most {MAX_TENANT_CHARS} characters", param="tenant")
    if not (math.isfinite(request.weight) and MIN_WEIGHT <= request.weight <= MAX_WEIGHT):
        raise InvalidRequestError(f"a tenant weight is in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}]", param="tenant_weight")
    if not -MAX_TIER <= request.tier <= MAX_TIER:
        raise InvalidRequestError(f"a tenant priority is in [-{MAX_TIER}, {MAX_TIER}]", param="tenant_priority")
    if request.cache_salt:
        check_cache_salt(request.cache_salt)


def _without_padding(candidates: BeamCandidates, num_live: int) -> BeamCandidates:
    """A first step's candidates less the worker's padding: one beam has fewer continuations than the group asks
    for when (1 + stop ids) x width exceeds the vocabulary, and sampler.beam_candidates pads them with -inf entries
    whose parents lie past the live beams when a group with more beams shares the step. They continue nothing."""
    if all(parent < num_live for parent in candidates.parents) or not (
            len(candidates.token_ids) == len(candidates.parents) == len(candidates.scores)):
        return candidates  # nothing to drop, or malformed (_candidates_valid says so)
    keep = [k for k, (parent, score) in enumerate(zip(candidates.parents, candidates.scores, strict=True))
            if parent < num_live or score != -math.inf]  # a finite score past the live beams stays: malformed
    return BeamCandidates(candidates.seq_id, [candidates.token_ids[k] for k in keep],
                          [candidates.parents[k] for k in keep], [candidates.scores[k] for k in keep],
                          candidates.slot_parents)


class _Generated:
    """The live beams' generated tokens, as BeamSearch.step's history: sliced only for a new hypothesis."""

    def __init__(self, live: list[Sequence]) -> None:
        self.live = live

    def __getitem__(self, index: int) -> list[int]:
        seq = self.live[index]
        return seq.token_ids[seq.num_prompt_tokens:]

    def __len__(self) -> int:
        return len(self.live)


def _needs_prompt_scores(seq: Sequence) -> bool:
    """prompt_logprobs asked and not all given yet: one completion (the first) carries them."""
    return (seq.request.sampling.prompt_logprobs is not None and seq.index == 0
            and seq.next_prompt_score < seq.num_prompt_tokens)


def _ends_in_repetition(seq: Sequence, end: int) -> bool:
    """vLLM's repetition_detection, checked after the stop ids and the length (as vLLM's check_stop) and, as there,
    only once the output has min_tokens: whether token_ids[:end] (known tokens) end in a repeated pattern."""
    sampling = seq.request.sampling
    if not sampling.detects_repetition or end - seq.num_prompt_tokens < sampling.min_tokens:
        return False
    if seq.repetition is None:
        assert sampling.repetition_detection is not None
        seq.repetition = RepetitionWatch(sampling.repetition_detection)
    return seq.repetition.advance(seq.token_ids, seq.num_prompt_tokens, end)


def _rank(seq: Sequence) -> tuple[int, float, int]:
    return seq.rank
