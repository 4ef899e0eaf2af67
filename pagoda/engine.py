"""The in-process engine: scheduler, model runner and detokenization in one loop (the offline API's core).

The server runs the same pieces in separate processes; here the step loop (services/scheduler/pipeline.py)
runs schedule -> ModelRunner.launch -> ModelRunner.finish -> update in this process, with step N+1 launched
before step N finishes when async scheduling is on.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from pagoda.outputs import CompletionOutput, Counter, Gauge, Logprob, Metric, RequestOutput, StreamDelta
from pagoda.services.grammar.compiler import GrammarChecker, cache_key, ending_ids, fast_forward_tokens
from pagoda.services.scheduler.pipeline import PlanPipeline, run_step, settle_idle
from pagoda.services.scheduler.scheduler import Request, Scheduler, Sequence, SeqUpdate
from pagoda.services.tokenizer.bad_words import with_bad_words_token_ids
from pagoda.services.tokenizer.detokenizer import REPLACEMENT_CHAR
from pagoda.services.tokenizer.logprob_text import MAX_CONTEXT_TOKENS, prompt_context, shown_token_text
from pagoda.services.tokenizer.output import advance, stop_reason
from pagoda.services.tokenizer.prompts import Prompt, encode_text_prompt, prompt_room, truncated_ids
from pagoda.services.tokenizer.text_stream import TextStream, tokens_before_stop
from pagoda.services.tokenizer.tokenizer import load_tokenizer
from pagoda.services.worker.device import resolve_device
from pagoda.services.worker.grammar import GrammarRows
from pagoda.services.worker.grammar_process import MaskProcess
from pagoda.services.worker.model_runner import ModelRunner
from pagoda.shared.config import EngineConfig
from pagoda.shared.errors import ConfigError, InvalidRequestError
from pagoda.shared.heap import settle_heap
from pagoda.shared.messages import (
    MAX_TOP_LOGPROBS,
    FinishReason,
    PromptScores,
    SamplingParams,
    StepResult,
    check_cache_salt,
    resolve_vocabulary,
)
from pagoda.shared.shapes import eos_token_ids

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Completion:
    """One returned sequence's output side: where its tokens and text go, and how much of them it holds yet.

    A step that wants no deltas (LLM.generate) leaves a completion that `lags` (no stop strings, so nothing
    reads its text before its end: TextStream.batchable; not a beam, whose tokens come whole at its end) as it
    is: its tokens are in the scheduler's sequence, from which catch_up copies them when the completion ends or
    its output is read, and they go through the detokenizer together (the same text, see TextStream.batchable).
    With logprobs such a step appends the token and its logprobs, and only the text lags."""

    output: RequestOutput
    completion: CompletionOutput
    stream: TextStream
    seq: Sequence
    lags: bool
    num_pushed: int = 0  # completion.token_ids[:num_pushed] went through the stream
    # a grammar's forced start: in the completion from the start, in no delta yet (the first one carries it)
    unsent_text: str = ""
    unsent_ids: list[int] = field(default_factory=list)

    def catch_up(self, num_known: int | None = None) -> None:
        """Copy the sequence's tokens up to num_known (default: all it knows) that steps without deltas left, and
        push what the stream has not had (their text joins completion.text)."""
        if not self.lags:
            return
        seq, token_ids = self.seq, self.completion.token_ids
        if num_known is None:
            num_known = len(seq.token_ids) - seq.num_pending
        start = seq.num_prompt_tokens + len(token_ids)
        if start < num_known:
            token_ids += seq.token_ids[start:num_known]
        if self.num_pushed < len(token_ids):
            self.completion.text += self.stream.push(token_ids[self.num_pushed:])
            self.num_pushed = len(token_ids)
        self.output.num_cached_tokens = seq.request.sequences[0].num_cached_tokens


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.tensor_parallel_size != 1:
            raise ConfigError("the in-process engine runs on one device; serve with `pagoda serve "
                              "--tensor-parallel-size N` for tensor parallelism", param="tensor_parallel_size")
        if config.max_num_batched_tokens is None:  # the offline budget, which the memory profile must see too
            device = resolve_device(config)
            config = replace(config, max_num_batched_tokens=config.resolved_max_num_batched_tokens(device, True))
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = load_tokenizer(config)
        self._token_texts: dict[int, str] = {}  # token id -> its text, for logprobs' decoded_token
        arch = self.runner.arch
        eos_ids = eos_token_ids(arch, self.tokenizer.eos_token_id if self.tokenizer is not None else None)
        device = self.runner.device.type
        self.scheduler = Scheduler(
            num_blocks=self.runner.num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.resolved_max_num_batched_tokens(device),
            max_model_len=self.runner.max_model_len, vocab_size=arch.vocab_size, eos_token_ids=eos_ids,
            enable_prefix_caching=config.enable_prefix_caching,
            max_inflight_plans=config.resolved_max_inflight_plans(device), num_swap_blocks=self.runner.num_swap_blocks)
        self.pipeline = PlanPipeline(self.scheduler)
        self._outputs: dict[str, RequestOutput] = {}
        self._completions: dict[int, _Completion] = {}  # seq id -> its output and text, while it runs
        self._silent: set[int] = set()  # seq ids whose running tokens a step without deltas leaves alone
        self._ids = itertools.count()
        self._grammars: GrammarChecker | None = None
        self.num_generation_tokens_total = 0  # tokens sampled into completions (pagoda_generation_tokens)
        settle_heap("engine")

    # ---------------------------------------------------------------- requests

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self._encode(prompt).token_ids

    def _encode(self, prompt: str | list[int]) -> Prompt:
        """The prompt's ids, and for text the special tokens the tokenizer added (which truncation keeps)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: give prompts as token ids", param="prompt")
            return encode_text_prompt(self.tokenizer, prompt)
        # the distinct element types, collected at C speed (a per-token generator cost ~0.3 ms a 512-token prompt:
        # most of add_request, and of the lead before a 256-prompt batch's first step)
        if not isinstance(prompt, list) or not all(issubclass(kind, int) and kind is not bool
                                                   for kind in set(map(type, prompt))):
            raise InvalidRequestError("a prompt is a string or a list of token ids", param="prompt")
        return Prompt(list(prompt), None, "prompt")

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """Validate and queue a request; raises InvalidRequestError (naming the parameter) on bad input.
        cache_salt (vLLM's): only requests with the same salt share prefix-cache blocks (None: unsalted)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params must be a SamplingParams", param="sampling_params")
        params.validate()  # before the prompt is encoded: a bad value fails cheaply
        salt = check_cache_salt(cache_salt)
        params = with_bad_words_token_ids(params, self.tokenizer)
        params = resolve_vocabulary(params, self.runner.arch.vocab_size, MAX_TOP_LOGPROBS)  # logprobs=-1 (refused)
        encoded = self._encode(prompt)
        token_ids = truncated_ids(encoded.token_ids, params, self._prompt_room(params.max_tokens), encoded.frame)
        forced = self._forced_start(params, len(token_ids)) if params.structured_outputs is not None else []
        forced = forced[:tokens_before_stop(self.tokenizer, token_ids, params, forced)]
        request_id = request_id if request_id is not None else str(next(self._ids))
        request = Request(request_id=request_id, prompt_token_ids=token_ids, sampling=params,
                          arrival_time=time.monotonic(), priority=priority, forced_token_ids=forced, cache_salt=salt)
        self.scheduler.check_prompt(request)  # the rest of Scheduler.validate: params were checked above
        self.scheduler.add_request(request)
        output = self._outputs[request_id] = RequestOutput(
            request_id=request_id, prompt=prompt if isinstance(prompt, str) else None, prompt_token_ids=token_ids,
            outputs=[CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None,
                                      cumulative_logprob=0.0 if params.logprobs is not None else None)
                     for i in range(params.n)],
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        for seq in request.sequences[:params.n]:  # a beam search's other beams return nothing
            stream = TextStream(self.tokenizer, token_ids, params)
            lags = stream.batchable and not params.use_beam_search
            tracked = self._completions[seq.seq_id] = _Completion(output, output.outputs[seq.index], stream, seq, lags)
            if forced:  # the grammar's forced start: output already, its text goes out with the first delta
                tracked.completion.token_ids += forced
                tracked.unsent_text = stream.push(forced)
                tracked.completion.text += tracked.unsent_text
                tracked.unsent_ids, tracked.num_pushed = list(forced), len(forced)
            if lags and params.logprobs is None:
                self._silent.add(seq.seq_id)
        return request_id

    def _prompt_room(self, max_tokens: int | None) -> int:
        """What truncate_prompt_tokens -1 keeps on this engine (prompt_room: the context and the KV cache each leave
        room for max_tokens, or one token)."""
        scheduler = self.scheduler
        return prompt_room(scheduler.max_model_len, scheduler.blocks.num_blocks * scheduler.block_size, max_tokens)

    def _forced_start(self, params: SamplingParams, num_prompt_tokens: int) -> list[int]:
        """Structured outputs: compile (cached) before queueing, InvalidRequestError if the library rejects it;
        the tokens its grammar forces at the start, when they may join the prefill (fast_forward_tokens)."""
        constraint = params.structured_outputs
        assert constraint is not None
        if self.tokenizer is None:
            raise InvalidRequestError("structured outputs need the model's tokenizer", param="structured_outputs")
        rows = self.runner.grammars
        if self._grammars is None:  # in-process rows take the matcher this check builds: one compile, none in a step
            keep = rows.adopt if isinstance(rows, GrammarRows) else None
            self._grammars = GrammarChecker(rows.tokenizer(), keep=keep)
        compiles_here = not self._grammars.cached(constraint)
        forced = self._grammars.check(constraint, None if constraint.reasoning_end else params.allowed_token_ids)
        if compiles_here and isinstance(rows, MaskProcess):  # the grammar process builds its own now, not in a step
            rows.prepare(hashlib.sha256(cache_key(constraint)).hexdigest(), constraint)
        if not self.config.grammar_fast_forward:
            return []
        scheduler = self.scheduler
        eos_ids = set(scheduler.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        capacity = scheduler.blocks.num_blocks * scheduler.block_size
        return fast_forward_tokens(forced, params, num_prompt_tokens, scheduler.max_model_len, capacity,
                                   ending_ids(params, eos_ids))

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        request = self.scheduler.abort_request(request_id)
        settle_idle(self.pipeline, self.runner.launch, self._finish_step)
        output = self._outputs.get(request_id)
        if request is None or output is None:
            return
        for seq in request.sequences[:len(output.outputs)]:
            tracked = self._completions.pop(seq.seq_id, None)
            self._silent.discard(seq.seq_id)
            if tracked is not None:
                tracked.catch_up()  # the text of every token it got, as a step with deltas would have left it
            completion = output.outputs[seq.index]
            if completion.finish_reason is None:
                completion.finish_reason = reason.openai_name

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_output(self, request_id: str) -> RequestOutput:
        self._catch_up(request_id)
        return self._outputs[request_id]

    def pop_output(self, request_id: str) -> RequestOutput:
        self._catch_up(request_id)
        return self._outputs.pop(request_id)

    def _catch_up(self, request_id: str) -> None:
        """The running completions of a request get the text of all their tokens (steps without deltas defer it)."""
        request = self.scheduler.requests.get(request_id)
        for seq in request.sequences if request is not None else ():
            tracked = self._completions.get(seq.seq_id)
            if tracked is not None:
                tracked.catch_up()

    # ---------------------------------------------------------------- one step

    def step(self, deltas: bool = True) -> list[StreamDelta]:
        """Run the step loop one turn (schedule -> launch -> finish -> update); return what each advanced
        completion gained. With async scheduling the next step is already running when this returns.
        deltas=False (LLM.generate): return nothing, and leave the text of completions without stop strings to
        their end (or to get_output): the same text, without a detokenizer call and a delta per row and step."""
        if self.runner.grammars.preparing:  # the grammar process's answers to _forced_start's prepare: read, unused
            self.runner.grammars.take_compiled()
        try:
            done = run_step(self.pipeline, self.runner.launch, self._finish_step)
        except BaseException:
            self._drop_inflight()
            self._end_failed()
            raise
        if done is None:
            if self.scheduler.has_unfinished() and not self.scheduler.running:
                raise RuntimeError("the scheduler found nothing it can run; the KV cache is too small")
            return []
        result, updates = done
        if result.error:
            self._drop_inflight()
            self._end_failed()
            raise RuntimeError(f"the model step failed: {result.error}")
        self.num_generation_tokens_total += sum(update.token_id >= 0 for update in updates)
        if result.failed:  # the worker dropped these alone (a refused value, a sampler or grammar error): "error"
            updates = self._fail_rows(result, updates)
        for update in updates:
            if update.prompt_scores is not None:
                self._add_prompt_scores(self._outputs[update.seq.request.request_id], update.prompt_scores)
        if not deltas:
            self._apply_quietly(updates, result)
            settle_idle(self.pipeline, self.runner.launch, self._finish_step)
            return []
        applied = [self._apply(update, result) for update in updates
                   if update.has_token or update.finish_reason is not None]
        settle_idle(self.pipeline, self.runner.launch, self._finish_step)  # the last request ended (stop string too)
        return applied

    def metrics(self) -> list[Metric]:
        """The engine's counters and gauges now, named as the server's /metrics names them (services/api/metrics.py),
        pagoda's and vLLM's: requests running and waiting, the KV cache, prefix-cache lookups, preemptions, prompt
        and generated tokens."""
        scheduler, blocks, stats = self.scheduler, self.scheduler.blocks, self.scheduler.stats
        waiting = {seq.request.request_id for seq in scheduler.waiting if not seq.is_finished}
        gauges = {"pagoda_num_requests_running": len({seq.request.request_id for seq in scheduler.running}),
                  "pagoda_num_requests_waiting": len(waiting), "pagoda_kv_cache_usage_ratio": blocks.usage_ratio(),
                  "pagoda_kv_blocks_free": blocks.num_free_blocks, "pagoda_kv_blocks_total": blocks.num_blocks}
        counters = {"pagoda_prefix_cache_hit_tokens": stats.prefix_hit_tokens,
                    "pagoda_prefix_cache_query_tokens": stats.prefix_query_tokens,
                    "pagoda_num_preemptions": stats.num_preemptions,
                    "pagoda_num_swapped_preemptions": stats.num_swapped,
                    "pagoda_prompt_tokens": stats.prompt_tokens,
                    "pagoda_generation_tokens": self.num_generation_tokens_total}
        # vLLM's names for the same numbers (its LLM.get_metrics() series, labelled by model and engine): scripts
        # ported from vLLM look them up by these
        labels = {"model_name": self.config.model, "engine": "0"}
        vllm_gauges = {"vllm:num_requests_running": gauges["pagoda_num_requests_running"],
                       "vllm:num_requests_waiting": gauges["pagoda_num_requests_waiting"],
                       "vllm:kv_cache_usage_perc": gauges["pagoda_kv_cache_usage_ratio"]}
        vllm_counters = {"vllm:prefix_cache_queries": counters["pagoda_prefix_cache_query_tokens"],
                         "vllm:prefix_cache_hits": counters["pagoda_prefix_cache_hit_tokens"],
                         "vllm:num_preemptions": counters["pagoda_num_preemptions"],
                         "vllm:prompt_tokens": counters["pagoda_prompt_tokens"],
                         "vllm:generation_tokens": counters["pagoda_generation_tokens"]}
        return [*(Gauge(name, {}, float(value)) for name, value in gauges.items()),
                *(Counter(name, {}, int(value)) for name, value in counters.items()),
                *(Gauge(name, dict(labels), float(value)) for name, value in vllm_gauges.items()),
                *(Counter(name, dict(labels), int(value)) for name, value in vllm_counters.items())]

    def _fail_rows(self, result: StepResult, updates: list[SeqUpdate]) -> list[SeqUpdate]:
        """The result's failed rows end with finish_reason "error" (the scheduler ended those it expected a token
        from as aborted; the others it still runs)."""
        failed = {failure.seq_id: failure.message for failure in result.failed}
        for seq_id, message in failed.items():
            seq = self.scheduler.get_sequence(seq_id)
            if seq is not None:
                log.error("request %s failed on the worker: %s", seq.request.request_id, message)
                if not seq.is_finished:
                    self.abort_request(seq.request.request_id, FinishReason.ERROR)
        return [replace(update, finish_reason=FinishReason.ERROR)
                if update.seq.seq_id in failed and update.finish_reason == FinishReason.ABORT else update
                for update in updates]

    def _finish_step(self) -> StepResult:
        """The oldest step's result; then a step deferred for grammar masks samples (ModelRunner.resume)."""
        result = self.runner.finish()
        self.runner.resume()
        return result

    def _drop_inflight(self) -> None:
        """After a failure: no launched step's result will be applied; their sequences end (aborted)."""
        self.runner.discard_launched()
        self.pipeline.cancel()

    def _end_failed(self) -> None:
        """After a failed step (step raises): the completions whose sequences the scheduler ended for it (the
        step's, those its plan swapped out, those of the plans in flight with it) end with finish_reason "error",
        with the tokens they had; a caller that steps on sees every request end."""
        for seq_id in list(self._completions):
            seq = self.scheduler.get_sequence(seq_id)
            if seq is not None and not seq.is_finished:
                continue
            tracked = self._completions.pop(seq_id)
            self._silent.discard(seq_id)
            tracked.catch_up()
            if tracked.completion.finish_reason is None:
                tracked.completion.finish_reason = FinishReason.ERROR.openai_name

    def _add_prompt_scores(self, output: RequestOutput, scores: PromptScores) -> None:
        assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == scores.first
        ranks = scores.ranks or [None] * len(scores.token_ids)
        for k, (token_id, logprob, top_ids, top_logprobs, rank) in enumerate(zip(
                scores.token_ids, scores.logprobs, scores.top_token_ids, scores.top_logprobs, ranks, strict=True)):
            context = prompt_context(output.prompt_token_ids, scores.first + k)
            output.prompt_logprobs.append(self._logprob_entry(token_id, logprob, rank, top_ids, top_logprobs,
                                                              context))

    def _logprob_entry(self, token_id: int, logprob: float, rank: int | None, top_ids: list[int],
                       top_logprobs: list[float], context: list[int], ranked: bool = True) -> dict[int, Logprob]:
        """{token id: Logprob} for a chosen token and the top k of its distribution (ranked 1..k), vLLM's order:
        the chosen token first, unless it is among the top k. ranked False: top_ids are logprob_token_ids (rank
        None: their place in the distribution is not computed). `context`: the sequence's tokens before this
        position, which a token holding part of a UTF-8 character is shown after (logprob_text)."""
        chosen = Logprob(logprob, rank, self._shown_text(token_id, context))
        entry = {token_id: chosen}
        for place, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs, strict=True), start=1):
            entry[top_id] = Logprob(top_logprob, place if ranked else None, self._shown_text(top_id, context))
        entry[token_id] = chosen
        return entry

    def _shown_text(self, token_id: int, context: list[int]) -> str | None:
        """vLLM's decoded_token: the token's own text, or for one that holds part of a UTF-8 character "" (a
        leading piece) or the character (the piece that completes it); None without a tokenizer."""
        text = self._token_text(token_id)
        if text is None or not text.endswith(REPLACEMENT_CHAR):
            return text
        assert self.tokenizer is not None
        tokenizer = self.tokenizer
        return shown_token_text(token_id, text, context,
                                lambda ids: tokenizer.decode(ids, skip_special_tokens=False), self._own_text)

    def _own_text(self, token_id: int) -> str:
        text = self._token_text(token_id)
        assert text is not None
        return text

    def _token_text(self, token_id: int) -> str | None:
        """A token's own decode, cached; None without a tokenizer."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _apply_quietly(self, updates: list[SeqUpdate], result: StepResult) -> None:
        """The updates without deltas: a running token of a silent completion costs a set lookup (catch_up copies
        it later); one of a lagging completion with logprobs appends the token and its logprobs; the others (a
        finish, stop strings, beams) are applied as with deltas."""
        silent, completions = self._silent, self._completions
        for update in updates:
            if update.finish_reason is None and update.token_id >= 0:
                if update.seq.seq_id in silent:
                    continue
                tracked = completions[update.seq.seq_id]
                if tracked.lags:  # logprobs: each step appends, so its tokens are whole (only its text lags)
                    tracked.completion.token_ids.append(update.token_id)
                    self._add_logprobs(tracked.completion, update, result)
                    continue
            if update.token_id >= 0 or update.finish_reason is not None:
                self._apply(update, result)

    def _apply(self, update: SeqUpdate, result: StepResult) -> StreamDelta:
        seq = update.seq
        tracked = self._completions[seq.seq_id]
        output, completion = tracked.output, tracked.completion
        # tokens that steps without deltas left in the sequence: all it knows but this update's
        tracked.catch_up(len(seq.token_ids) - seq.num_pending - int(update.has_token))
        new_tokens = [update.token_id] if update.has_token else []  # none: max_tokens=0 ends after the prompt
        completion.token_ids += new_tokens
        tracked.num_pushed = len(completion.token_ids)
        if update.score is not None:  # a beam search hypothesis, whole
            completion.score, completion.cumulative_logprob = update.score, update.cumulative_logprob
        output.num_cached_tokens = seq.request.sequences[0].num_cached_tokens
        if completion.logprobs is not None and update.has_token:
            self._add_logprobs(completion, update, result)
        step = advance(tracked.stream, update.token_id if update.has_token else -1,
                       -1 if update.finish_reason is None else int(update.finish_reason))
        text = step.text
        if step.stop_string:
            self.scheduler.finish_sequence(seq.seq_id, FinishReason.STOP)
        if step.finish_reason >= 0:
            del self._completions[seq.seq_id]
            self._silent.discard(seq.seq_id)
            completion.finish_reason = FinishReason(step.finish_reason).openai_name
            completion.stop_reason = stop_reason(tracked.stream, seq.request.sampling, update.token_id,
                                                 step.finish_reason, self.tokenizer)
        completion.text += text
        if tracked.unsent_ids:  # the forced start leads the first delta
            text, new_tokens = tracked.unsent_text + text, tracked.unsent_ids + new_tokens
            tracked.unsent_text, tracked.unsent_ids = "", []
        return StreamDelta(request_id=output.request_id, index=seq.index, text=text,
                           token_ids=new_tokens, finish_reason=completion.finish_reason)

    def _add_logprobs(self, completion: CompletionOutput, update: SeqUpdate, result: StepResult) -> None:
        if not result.sampled_logprobs:
            return
        assert completion.logprobs is not None
        row = update.result_index
        logprob = result.sampled_logprobs[row]
        rank = result.sampled_ranks[row] if result.sampled_ranks else None
        listed = bool(update.seq.request.sampling.logprob_token_ids)  # its ids, not its top k: no place is a rank
        context = completion.token_ids[-MAX_CONTEXT_TOKENS - 1:-1]  # the tokens before this one (appended already)
        completion.logprobs.append(self._logprob_entry(update.token_id, logprob, rank, result.top_token_ids[row],
                                                       result.top_logprobs[row], context, ranked=not listed))
        completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) + logprob


def is_model_reference(model: str) -> bool:
    """True for a folder with a config.json; dummy shapes are names, not folders."""
    return Path(model, "config.json").is_file()
