"""Per-row sampling state on the device: settings written once at admission, token counts updated by one
scatter of the sampled ids per step, so a step's SamplingMetadata is a gather by row index.

Rows are BatchState's rows (request slots, reused when requests finish). [rows, V] tables exist only once
some admitted row needs them: output-token counts for presence / frequency / repetition penalties,
prompt-token presence for repetition penalty; logit bias and min_tokens bans are short padded id lists.
bad_words (vLLM's) are [rows, words, tokens] id tables beside a [rows, tokens - 1] window of each row's last
generated ids, kept on the device by the same per-step scatter: a step's bans are one comparison of the two, with
no token read back to the host. A request admitted again after a preemption rebuilds its counts and window from
the tokens it carries.

The host keeps a mirror of every setting and of each row's output length (known without the token values),
so which optional parts a step needs is decided on the host with no device sync, and the sampled ids never
have to come back to the host for the state to advance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch

from pagoda.services.worker.sampler import SamplingMetadata
from pagoda.shared.messages import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGPROB_TOKEN_IDS,
    NewRequest,
    SamplingParams,
)

# columns of the per-row float table
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(6)
NUM_FLOAT_PARAMS = 6
ROW_ALIGN = 4  # [B] settings start at multiples of 4 columns: 16 bytes of fp32, 32 of int64


def _padded(num_rows: int) -> int:
    return -(-num_rows // ROW_ALIGN) * ROW_ALIGN


def _default_to_device(device: torch.device) -> Callable[[np.ndarray, str], torch.Tensor]:
    return lambda array, name: torch.from_numpy(np.ascontiguousarray(array)).to(device)


INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def admission_error(new: NewRequest, vocab_size: int, max_model_len: int, num_kv_blocks: int,
                    max_blocks_per_row: int) -> str:
    """Why the worker cannot take this request ("" when it can): a value past validation that would overflow
    a row or index out of a table (on CUDA, a device-side assert that no step survives). Checked once, when
    the request is admitted, so that it fails alone and never the step of the requests batched with it."""
    if not 1 <= new.num_prompt_tokens <= len(new.token_ids) <= max_model_len:
        return (f"{len(new.token_ids)} tokens ({new.num_prompt_tokens} of prompt) do not fit the model's "
                f"{max_model_len}")
    if not 0 <= new.num_computed_tokens <= len(new.token_ids):
        return f"num_computed_tokens {new.num_computed_tokens} is out of range"
    if not _ids_below(new.token_ids, vocab_size):
        return f"a token id is outside the vocabulary [0, {vocab_size})"
    if len(new.block_ids) > max_blocks_per_row or not _ids_below(new.block_ids, num_kv_blocks):
        return "a KV block id is out of range"
    if not INT64_MIN <= new.seed <= INT64_MAX:
        return "seed is out of the 64-bit range"
    if new.grammar_hash and new.sampling.structured_outputs is None:
        return f"its constraint {new.grammar_hash[:12]} never reached the worker"
    return _sampling_error(new.sampling, vocab_size)


def _sampling_error(params: SamplingParams, vocab_size: int) -> str:
    floats = {"temperature": params.temperature, "top_p": params.top_p, "min_p": params.min_p,
              "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
              "repetition_penalty": params.repetition_penalty}
    for name, value in floats.items():
        if not math.isfinite(value):
            return f"{name} must be a finite number"
    if params.temperature < 0 or not 0 < params.top_p <= 1 or not 0 <= params.min_p <= 1 \
            or params.repetition_penalty <= 0:
        return "a sampling value is out of range (temperature >= 0, top_p in (0, 1], min_p in [0, 1], " \
               "repetition_penalty > 0)"
    for name, count in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
        if count is not None and not 0 <= count <= vocab_size:
            return f"{name} must be in [0, {vocab_size}]"
    if not _ids_below(list(params.logit_bias), vocab_size) or not _ids_below(params.stop_token_ids, vocab_size) \
            or not _ids_below(params.allowed_token_ids, vocab_size) \
            or not _ids_below(params.logprob_token_ids, vocab_size) \
            or len(params.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS:
        return (f"a logit_bias, stop_token_ids, allowed_token_ids or logprob_token_ids id is outside the vocabulary "
                f"[0, {vocab_size}), or logprob_token_ids has more than {MAX_LOGPROB_TOKEN_IDS} ids")
    if not all(math.isfinite(value) for value in params.logit_bias.values()):
        return "logit_bias values must be finite numbers"
    if len(params.bad_words_token_ids) > 2 * MAX_BAD_WORDS or any(
            not 1 <= len(ids) <= MAX_BAD_WORD_TOKENS or not _ids_below(ids, vocab_size)
            for ids in params.bad_words_token_ids):
        return (f"bad_words_token_ids must be at most {2 * MAX_BAD_WORDS} sequences of 1 to {MAX_BAD_WORD_TOKENS} "
                f"ids in [0, {vocab_size})")
    thinking = params.thinking
    if thinking is not None and (not 1 <= len(thinking.end_token_ids) <= MAX_BAD_WORD_TOKENS
                                 or not _ids_below(thinking.end_token_ids, vocab_size) or thinking.max_tokens < 0):
        return f"thinking needs 1 to {MAX_BAD_WORD_TOKENS} end ids in [0, {vocab_size}) and max_tokens >= 0"
    return ""


def _ids_below(ids: Sequence[int], limit: int) -> bool:
    """Every id in [0, limit) (Python ints: any size is compared, none overflows)."""
    return not ids or (min(ids) >= 0 and max(ids) < limit)


class SamplingState:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, eos_token_ids: Sequence[int],
                 to_device: Callable[[np.ndarray, str], torch.Tensor] | None = None) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.to_device = to_device or _default_to_device(device)
        rows = max_rows
        # host mirrors [R]
        self.floats = np.zeros((rows, NUM_FLOAT_PARAMS), dtype=np.float32)  # [R, 6]
        self.floats[:, [TEMPERATURE, TOP_P, REPETITION]] = 1.0
        self.top_k = np.zeros(rows, dtype=np.int64)  # [R] 0 = off
        self.min_tokens = np.zeros(rows, dtype=np.int64)  # [R]
        self.num_output = np.zeros(rows, dtype=np.int64)  # [R] tokens generated so far = next offset
        self.num_logprobs = np.full(rows, -1, dtype=np.int64)  # [R] -1: none; else the top list's length
        self.num_logprob_ids = np.zeros(rows, dtype=np.int64)  # [R] logprob_token_ids entries (0: the top k)
        self.num_bias = np.zeros(rows, dtype=np.int64)  # [R] logit_bias entries
        self.num_banned = np.zeros(rows, dtype=np.int64)  # [R] ids banned while output < min_tokens
        self.num_bad_words = np.zeros(rows, dtype=np.int64)  # [R] bad_words token sequences
        self.bad_word_len = np.zeros(rows, dtype=np.int64)  # [R] tokens of the row's longest bad word
        # device tables
        self.floats_device = torch.from_numpy(self.floats.copy()).to(device)  # [R, 6] fp32
        self.seeds_device = torch.zeros(rows, dtype=torch.int64, device=device)  # [R]
        self.top_k_device = torch.zeros(rows, dtype=torch.int64, device=device)  # [R]
        self.min_tokens_device = torch.zeros(rows, dtype=torch.int64, device=device)  # [R]
        self.ones = torch.ones(rows, dtype=torch.int32, device=device)  # [R] scatter source
        self.output_counts: torch.Tensor | None = None  # [R, V] int32, made when a row first has penalties
        self.prompt_mask: torch.Tensor | None = None  # [R, V] bool, made when a row first has repetition
        self.bias_ids: torch.Tensor | None = None  # [R, K] int64 padded with 0
        self.bias_values: torch.Tensor | None = None  # [R, K] fp32 padded with 0
        self.banned_ids: torch.Tensor | None = None  # [R, K] int64 padded with -1
        self.logprob_ids: torch.Tensor | None = None  # [R, K] int64 logprob_token_ids, padded with -1 (none)
        # made when a row first has bad_words: each word's ids right-aligned, -1 (any token) before them, and
        # each row's last L - 1 generated ids right-aligned, -2 (no token) where fewer were generated
        self.bad_words: torch.Tensor | None = None  # [R, W, L] int64
        self.recent_ids: torch.Tensor | None = None  # [R, L - 1] int64
        # The last step's settings (all but the offsets and bans, which move every step) for its rows: a decode
        # batch that samples the same rows again reuses them. Admission (the only writer of settings) drops them.
        self._settings: tuple[np.ndarray, SamplingMetadata] | None = None

    # ---------------------------------------------------------------- admission

    def admit(self, entries: Sequence[tuple[int, NewRequest]]) -> None:
        """Write the settings of newly placed requests (row, request) and rebuild their token statistics."""
        if not entries:
            return
        self._settings = None
        rows = np.fromiter((row for row, _ in entries), dtype=np.int64, count=len(entries))  # [N]
        seeds = np.zeros(len(entries), dtype=np.int64)  # [N]
        for i, (row, new) in enumerate(entries):
            self._admit_host(row, new)
            seeds[i] = new.seed
        rows_t = self.to_device(rows, "admit_rows")  # [N]
        self.floats_device[rows_t] = self.to_device(self.floats[rows], "admit_floats")
        self.seeds_device[rows_t] = self.to_device(seeds, "admit_seeds")
        self.top_k_device[rows_t] = self.to_device(self.top_k[rows], "admit_top_k")
        self.min_tokens_device[rows_t] = self.to_device(self.min_tokens[rows], "admit_min_tokens")
        self._admit_counts(entries)
        self._admit_lists(entries)
        self._admit_bad_words(entries)

    def _admit_host(self, row: int, new: NewRequest) -> None:
        params = new.sampling
        self.floats[row] = (0.0 if params.is_greedy else params.temperature, params.top_p, params.min_p,
                            params.presence_penalty, params.frequency_penalty, params.repetition_penalty)
        # Clamped, not trusted: a value that slipped past validation must not overflow a row or fail the step for
        # every request in it (top_k at or beyond the vocabulary is no cut; min_tokens beyond int32 is all of them).
        self.top_k[row] = params.top_k if 0 < params.top_k < self.vocab_size else 0
        self.min_tokens[row] = min(max(params.min_tokens, 0), INT32_MAX)
        self.num_output[row] = len(new.token_ids) - new.num_prompt_tokens
        self.num_logprob_ids[row] = len(params.logprob_token_ids) if params.logprobs is not None else 0
        self.num_logprobs[row] = params.top_list_length
        self.num_bias[row] = len(params.logit_bias)
        banned = self._banned_ids(new)
        self.num_banned[row] = len(banned)
        self.num_bad_words[row] = len(params.bad_words_token_ids)
        self.bad_word_len[row] = max((len(ids) for ids in params.bad_words_token_ids), default=0)

    def _banned_ids(self, new: NewRequest) -> list[int]:
        """The ids min_tokens bans: stop_token_ids and the EOS ids, with ignore_eos too, but not an EOS id past the
        vocabulary (generation_config.json or a tokenizer larger than the model may name one): no logit to ban."""
        params = new.sampling
        if params.min_tokens <= 0:
            return []
        eos_ids = [t for t in new.eos_token_ids if t < self.vocab_size]
        return list(dict.fromkeys([*params.stop_token_ids, *eos_ids]))

    def _admit_counts(self, entries: Sequence[tuple[int, NewRequest]]) -> None:
        """Zero and refill the count rows of penalised requests (output tokens) and the prompt rows of
        repetition-penalised ones; other rows' entries are never read."""
        penalised = [(row, new) for row, new in entries if new.sampling.has_penalties]
        if not penalised:
            return
        rows, size = self.max_rows, self.vocab_size
        if self.output_counts is None:
            self.output_counts = torch.zeros((rows, size), dtype=torch.int32, device=self.device)  # [R, V]
        self._fill(self.output_counts, [(row, new.token_ids[new.num_prompt_tokens:]) for row, new in penalised],
                   accumulate=True, name="counts")
        repeated = [(row, new) for row, new in penalised if new.sampling.repetition_penalty != 1.0]
        if not repeated:
            return
        if self.prompt_mask is None:
            self.prompt_mask = torch.zeros((rows, size), dtype=torch.bool, device=self.device)  # [R, V]
        self._fill(self.prompt_mask, [(row, new.token_ids[:new.num_prompt_tokens]) for row, new in repeated],
                   accumulate=False, name="prompt")

    def _fill(self, table: torch.Tensor, rows_tokens: list[tuple[int, list[int]]], accumulate: bool,
              name: str) -> None:
        """Zero the given rows of table [R, V], then add one (or set True) at each (row, token)."""
        rows = np.asarray([row for row, _ in rows_tokens], dtype=np.int64)  # [N]
        table[self.to_device(rows, f"{name}_rows")] = 0
        lengths = [len(tokens) for _, tokens in rows_tokens]
        if sum(lengths) == 0:
            return
        flat_rows = np.repeat(rows, lengths)  # [M]
        flat_tokens = np.concatenate([np.asarray(tokens, dtype=np.int64) for _, tokens in rows_tokens])  # [M]
        index = self.to_device(np.stack([flat_rows, flat_tokens]), f"{name}_index")  # [2, M]
        values = torch.ones(len(flat_rows), dtype=table.dtype, device=self.device)  # [M]
        table.index_put_((index[0], index[1]), values, accumulate=accumulate)

    def _admit_lists(self, entries: Sequence[tuple[int, NewRequest]]) -> None:
        """Logit bias and min_tokens bans as padded per-row id lists (rewritten for every admitted row once
        the table exists: a reused row must not keep its last owner's list)."""
        rows = np.fromiter((row for row, _ in entries), dtype=np.int64, count=len(entries))  # [N]
        if self.bias_ids is not None or self.num_bias[rows].any():
            width = max(1, int(self.num_bias[rows].max()))
            ids = np.zeros((len(entries), width), dtype=np.int64)  # [N, K]
            values = np.zeros((len(entries), width), dtype=np.float32)  # [N, K]
            for i, (_, new) in enumerate(entries):
                bias = new.sampling.logit_bias
                ids[i, :len(bias)] = list(bias.keys())
                values[i, :len(bias)] = list(bias.values())
            self.bias_ids, self.bias_values = self._write_list(self.bias_ids, self.bias_values, rows, ids, values,
                                                               pad=0, name="bias")
        if self.banned_ids is not None or self.num_banned[rows].any():
            width = max(1, int(self.num_banned[rows].max()))
            banned = np.full((len(entries), width), -1, dtype=np.int64)  # [N, K]
            for i, (_, new) in enumerate(entries):
                ids = self._banned_ids(new)
                banned[i, :len(ids)] = ids
            self.banned_ids, _ = self._write_list(self.banned_ids, None, rows, banned, None, pad=-1, name="banned")
        if self.logprob_ids is not None or self.num_logprob_ids[rows].any():
            width = max(1, int(self.num_logprob_ids[rows].max()))
            listed = np.full((len(entries), width), -1, dtype=np.int64)  # [N, K]
            for i, (row, new) in enumerate(entries):
                count = int(self.num_logprob_ids[row])
                listed[i, :count] = new.sampling.logprob_token_ids[:count]
            self.logprob_ids, _ = self._write_list(self.logprob_ids, None, rows, listed, None, pad=-1,
                                                   name="logprob_ids")

    def _write_list(self, ids_table: torch.Tensor | None, values_table: torch.Tensor | None, rows: np.ndarray,
                    ids: np.ndarray, values: np.ndarray | None, pad: int,
                    name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Grow the [R, K] tables to the width needed, then write the rows (padding: id `pad`, value 0.0)."""
        width = ids.shape[1]
        if ids_table is None or ids_table.shape[1] < width:
            old = ids_table
            ids_table = torch.full((self.max_rows, width), pad, dtype=torch.int64, device=self.device)  # [R, K]
            if old is not None:
                ids_table[:, :old.shape[1]] = old
            if values is not None:
                old_values = values_table
                values_table = torch.zeros((self.max_rows, width), dtype=torch.float32, device=self.device)
                if old_values is not None:
                    values_table[:, :old_values.shape[1]] = old_values
        full_ids = np.full((len(rows), ids_table.shape[1]), pad, dtype=np.int64)  # [N, K]
        full_ids[:, :width] = ids
        rows_t = self.to_device(rows, f"{name}_rows")
        ids_table[rows_t] = self.to_device(full_ids, f"{name}_ids")
        if values is not None and values_table is not None:
            full_values = np.zeros((len(rows), values_table.shape[1]), dtype=np.float32)  # [N, K]
            full_values[:, :width] = values
            values_table[rows_t] = self.to_device(full_values, f"{name}_values")
        return ids_table, values_table

    def _admit_bad_words(self, entries: Sequence[tuple[int, NewRequest]]) -> None:
        """The bad words of admitted rows and their window of generated ids (rewritten for every admitted row once
        the tables exist: a reused row must not keep its last owner's words)."""
        rows = np.fromiter((row for row, _ in entries), dtype=np.int64, count=len(entries))  # [N]
        if self.bad_words is None and not self.num_bad_words[rows].any():
            return
        self._grow_bad_words(int(self.num_bad_words[rows].max()), int(self.bad_word_len[rows].max()))
        assert self.bad_words is not None and self.recent_ids is not None
        _, width, length = self.bad_words.shape
        words = np.full((len(entries), width, length), -1, dtype=np.int64)  # [N, W, L]
        recent = np.full((len(entries), length - 1), -2, dtype=np.int64)  # [N, L - 1]
        for i, (_, new) in enumerate(entries):
            for j, ids in enumerate(new.sampling.bad_words_token_ids):
                words[i, j, length - len(ids):] = ids
            generated = new.token_ids[new.num_prompt_tokens:][-(length - 1):]  # after a preemption: its window
            if generated:
                recent[i, length - 1 - len(generated):] = generated
        rows_t = self.to_device(rows, "bad_words_rows")
        self.bad_words[rows_t] = self.to_device(words, "bad_words")
        self.recent_ids[rows_t] = self.to_device(recent, "recent_ids")

    def _grow_bad_words(self, width: int, length: int) -> None:
        """The bad-word tables at least `width` words of `length` tokens (at least 2: the window has a column);
        rows keep their words and window, right-aligned."""
        old, old_recent = self.bad_words, self.recent_ids
        old_width, old_length = (old.shape[1], old.shape[2]) if old is not None else (0, 0)
        if old is not None and old_width >= width and old_length >= length:
            return
        width, length = max(width, old_width, 1), max(length, old_length, 2)
        table = torch.full((self.max_rows, width, length), -1, dtype=torch.int64, device=self.device)  # [R, W, L]
        recent = torch.full((self.max_rows, length - 1), -2, dtype=torch.int64, device=self.device)  # [R, L - 1]
        if old is not None and old_recent is not None:
            table[:, :old_width, length - old_length:] = old
            recent[:, length - old_length:] = old_recent
        self.bad_words, self.recent_ids = table, recent

    def _bad_word_bans(self, rows: np.ndarray, state_rows: torch.Tensor) -> torch.Tensor:
        """The ids bad_words ban this step for rows [B] (state_rows on the device): each word's last id where the
        row's generated ids end with the word's others, else -1. [B, W] int64."""
        assert self.bad_words is not None and self.recent_ids is not None
        width = int(self.num_bad_words[rows].max())
        length = max(2, int(self.bad_word_len[rows].max()))
        words = self.bad_words.index_select(0, state_rows)[:, :width, -length:]  # [B, W, L']
        recent = self.recent_ids.index_select(0, state_rows)[:, 1 - length:]  # [B, L' - 1]
        before = words[:, :, :-1]  # [B, W, L' - 1]
        ends_with = ((before < 0) | (before == recent.unsqueeze(1))).all(dim=2)  # [B, W]
        return torch.where(ends_with, words[:, :, -1], -1)  # [B, W]; padding words have last id -1

    # ---------------------------------------------------------------- per step

    def metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """The settings of the rows sampled this step [B]: the last step's when it sampled the same rows (one small
        host -> device copy of the offsets), else gathered anew (one more)."""
        num_rows = len(rows)
        cached = self._settings
        if cached is not None and np.array_equal(cached[0], rows):
            settings = cached[1]
        else:
            settings = self._gather_settings(rows)
            self._settings = (rows.copy(), settings)
        num_output = self.num_output[rows]  # [B]
        short = (num_output < self.min_tokens[rows]) & (self.num_banned[rows] > 0)  # [B] bans active
        padded = np.zeros((2, _padded(num_rows)), dtype=np.int64)  # [2, B_pad]
        padded[:, :num_rows] = (num_output, short)
        moving = self.to_device(padded, "sampling_offsets")[:, :num_rows]  # [2, B]
        metadata = replace(settings, offsets=moving[0])
        if self.banned_ids is not None and short.any():
            assert metadata.state_rows is not None
            width = int(self.num_banned[rows][short].max())
            banned = self.banned_ids.index_select(0, metadata.state_rows)[:, :width]  # [B, K]
            metadata.banned_token_ids = torch.where(moving[1].bool().unsqueeze(1), banned, -1)  # [B, K]
        if self.bad_words is not None and self.num_bad_words[rows].any():
            assert metadata.state_rows is not None
            bans = self._bad_word_bans(rows, metadata.state_rows)  # [B, W]
            if metadata.banned_token_ids is not None:
                bans = torch.cat([metadata.banned_token_ids, bans], dim=1)  # [B, K + W]
            metadata.banned_token_ids = bans
        return metadata

    def _gather_settings(self, rows: np.ndarray) -> SamplingMetadata:
        """The rows' settings on the device and which optional parts the batch needs (offsets left empty)."""
        num_rows = len(rows)
        # Columns padded to a multiple of 4 (the padding names row 0): each [B] slice of the packed tensors below
        # then starts 16-byte aligned, as every fresh tensor does. Triton specialises a kernel on its pointers'
        # alignment, so an odd B would compile new sampling-kernel variants in the middle of serving (measured on
        # an H200: a 135 ms compile inside a mixed step of a sampled run).
        host = self.floats[rows]  # [B, 6]
        temperature = host[:, TEMPERATURE]
        top_k = self.top_k[rows]  # [B]
        nucleus = (host[:, TOP_P] < 1.0) & (top_k <= 0) & (temperature > 0.0)  # [B] top-p over the whole row
        padded = np.zeros((2, _padded(num_rows)), dtype=np.int64)  # [2, B_pad]
        padded[:, :num_rows] = (rows, nucleus)
        index = self.to_device(padded, "sampling_rows")  # [2, B_pad]
        packed = index[:, :num_rows]  # [2, B]
        state_rows = packed[0]  # [B]
        floats = self.floats_device.index_select(0, index[0]).T.contiguous()[:, :num_rows]  # [6, B] of [6, B_pad]
        metadata = SamplingMetadata(temperature=floats[TEMPERATURE],
                                    seeds=self.seeds_device.index_select(0, state_rows),
                                    offsets=state_rows, state_rows=state_rows,
                                    all_greedy=bool((temperature == 0.0).all()))
        if (top_k > 0).any():
            metadata.top_k = self.top_k_device.index_select(0, state_rows)
            metadata.max_top_k = int(top_k.max())
        if (host[:, TOP_P] < 1.0).any():
            metadata.top_p = floats[TOP_P]
            metadata.top_p_without_top_k = bool(nucleus.any())
            if metadata.top_p_without_top_k:
                metadata.nucleus = packed[1]  # [B] int64 0/1 (the kernels read != 0)
        if (host[:, MIN_P] > 0.0).any():
            metadata.min_p = floats[MIN_P]
        if (host[:, PRESENCE] != 0.0).any():
            metadata.presence_penalty = floats[PRESENCE]
        if (host[:, FREQUENCY] != 0.0).any():
            metadata.frequency_penalty = floats[FREQUENCY]
        if (host[:, REPETITION] != 1.0).any():
            metadata.repetition_penalty = floats[REPETITION]
            metadata.prompt_mask = self.prompt_mask
        if metadata.presence_penalty is not None or metadata.frequency_penalty is not None or \
                metadata.repetition_penalty is not None:
            assert self.output_counts is not None, "a penalised row was admitted without its counts"
            metadata.output_counts = self.output_counts
        if self.bias_ids is not None and self.bias_values is not None and self.num_bias[rows].any():
            width = int(self.num_bias[rows].max())
            metadata.logit_bias_ids = self.bias_ids.index_select(0, state_rows)[:, :width]
            metadata.logit_bias_values = self.bias_values.index_select(0, state_rows)[:, :width]
        num_logprobs = self.num_logprobs[rows]
        if (num_logprobs >= 0).any():
            metadata.max_num_logprobs = int(num_logprobs.max())
        num_listed = self.num_logprob_ids[rows]  # [B]
        if self.logprob_ids is not None and num_listed.any():
            width = int(num_listed.max())
            metadata.logprob_token_ids = self.logprob_ids.index_select(0, state_rows)[:, :width]  # [B, K]
        return metadata

    def record(self, rows: np.ndarray, token_ids: torch.Tensor, state_rows: torch.Tensor | None = None) -> None:
        """The rows [B] sampled token_ids [B] (on the device, not read here): offsets advance, and one
        scatter adds them to the counts. state_rows: rows already on the device (metadata.state_rows)."""
        self.num_output[rows] += 1
        windows = self.recent_ids is not None and bool(self.num_bad_words[rows].any())
        if (self.output_counts is None and not windows) or len(rows) == 0:
            return
        if state_rows is None:
            state_rows = self.to_device(np.asarray(rows, dtype=np.int64), "record_rows")
        if self.output_counts is not None:
            self.output_counts.index_put_((state_rows, token_ids), self.ones[:len(rows)], accumulate=True)
        if windows:
            assert self.recent_ids is not None
            recent = self.recent_ids.index_select(0, state_rows)  # [B, L - 1]
            self.recent_ids[state_rows] = torch.cat([recent[:, 1:], token_ids.unsqueeze(1)], dim=1)
