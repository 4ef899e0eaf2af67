"""The worker's per-request state as persistent numpy rows: tokens, block table, sampling settings.

A plan only says which requests run and how many tokens each computes; everything else the worker
already holds here, so building a step's inputs is a handful of vectorised numpy gathers.
"""

from __future__ import annotations

import numpy as np

from pagoda.shared.messages import NewRequest, StepPlan

INT32_MAX = 2**31 - 1


class BatchState:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.eos_token_ids = list(eos_token_ids)
        max_blocks = -(-max_model_len // block_size)
        rows = max_num_seqs
        self.row_of: dict[int, int] = {}  # request id -> row
        self.free_rows = list(range(rows - 1, -1, -1))
        self.token_ids = np.zeros((rows, max_model_len), dtype=np.int32)  # [R, max_model_len]
        self.num_tokens = np.zeros(rows, dtype=np.int64)  # [R]
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int64)  # [R]
        self.num_computed = np.zeros(rows, dtype=np.int64)  # [R]
        self.block_table = np.zeros((rows, max_blocks), dtype=np.int32)  # [R, max_blocks]
        self.num_blocks = np.zeros(rows, dtype=np.int64)  # [R]
        # sampling settings, one entry per row
        self.temperature = np.ones(rows, dtype=np.float32)
        self.top_k = np.zeros(rows, dtype=np.int64)
        self.top_p = np.ones(rows, dtype=np.float32)
        self.min_p = np.zeros(rows, dtype=np.float32)
        self.presence_penalty = np.zeros(rows, dtype=np.float32)
        self.frequency_penalty = np.zeros(rows, dtype=np.float32)
        self.repetition_penalty = np.ones(rows, dtype=np.float32)
        self.seed = np.zeros(rows, dtype=np.int64)
        self.num_logprobs = np.full(rows, -1, dtype=np.int64)  # -1: none wanted
        self.num_prompt_logprobs = np.full(rows, -1, dtype=np.int64)  # -1: prompt tokens not scored
        self.min_tokens = np.zeros(rows, dtype=np.int64)
        self.banned_while_short: list[list[int]] = [[] for _ in range(rows)]  # EOS/stop ids under min_tokens
        self.has_logit_bias = np.zeros(rows, dtype=bool)
        self.logit_bias: list[dict[int, float]] = [{} for _ in range(rows)]

    def reset(self) -> None:
        """Forget every request (a new scheduler starts from nothing)."""
        self.row_of.clear()
        self.free_rows = list(range(self.max_num_seqs - 1, -1, -1))

    def apply(self, plan: StepPlan) -> None:
        """Drop finished requests, add new ones, append new blocks: the worker's side of the diff."""
        for req_id in plan.finished_req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.free_rows.append(row)
        for new in plan.new_requests:
            self._add(new)
        for req_id, block_id in zip(plan.appended_block_req_ids, plan.appended_block_ids, strict=True):
            row = self.row_of[req_id]
            self.block_table[row, self.num_blocks[row]] = block_id
            self.num_blocks[row] += 1

    def _add(self, new: NewRequest) -> None:
        assert new.req_id not in self.row_of, f"request {new.req_id} added twice"
        row = self.free_rows.pop()
        self.row_of[new.req_id] = row
        count = len(new.token_ids)
        self.token_ids[row, :count] = new.token_ids
        self.num_tokens[row] = count
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed[row] = new.num_computed_tokens
        self.block_table[row, :len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        params = new.sampling
        self.temperature[row] = 0.0 if params.is_greedy else params.temperature
        # Clamped, not trusted: a value that slipped past validation must not overflow a row and fail the
        # step for every request in it (top_k beyond the vocabulary means no cut; min_tokens beyond the context
        # means all of it).
        self.top_k[row] = min(max(params.top_k, 0), INT32_MAX)
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.seed[row] = new.seed
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self.min_tokens[row] = min(max(params.min_tokens, 0), self.max_model_len)
        banned = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        self.banned_while_short[row] = banned if params.min_tokens > 0 else []
        self.logit_bias[row] = params.logit_bias
        self.has_logit_bias[row] = bool(params.logit_bias)

    def rows_for(self, req_ids: list[int]) -> np.ndarray:
        return np.fromiter((self.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))  # [B]
