"""The worker's per-request state as persistent numpy rows: tokens, block table, sampling settings.

A plan only says which requests run and how many tokens each computes; everything else the worker
already holds here, so building a step's inputs is a handful of vectorised numpy gathers.
"""

from __future__ import annotations

import numpy as np

from pagoda.shared.messages import BeamFork, NewRequest, StepPlan


class BatchState:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.eos_token_ids = list(eos_token_ids)
        max_blocks = -(-max_model_len // block_size)
        rows = max_num_seqs
        self.row_of: dict[int, int] = {}  # sequence id -> row
        self.free_rows = list(range(rows - 1, -1, -1))
        # bumped whenever row_of changes: a step's rows, found at its launch, still hold its sequences while it
        # stays the same; and a plan naming the sequences of the last one in the same order has the same rows
        self.version = 0
        self._rows_key: tuple[list[int], int] | None = None  # (seq ids, version) of _rows
        self._rows = np.zeros(0, dtype=np.int64)
        self.token_ids = np.zeros((rows, max_model_len), dtype=np.int32)  # [R, max_model_len]
        self.num_tokens = np.zeros(rows, dtype=np.int64)  # [R]
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int64)  # [R]
        self.num_computed = np.zeros(rows, dtype=np.int64)  # [R]
        self.block_table = np.zeros((rows, max_blocks), dtype=np.int32)  # [R, max_blocks]
        self.num_blocks = np.zeros(rows, dtype=np.int64)  # [R]
        # logprob settings (the sampling settings live in SamplingState, on the device)
        self.num_logprobs = np.full(rows, -1, dtype=np.int64)  # -1: none wanted
        self.num_prompt_logprobs = np.full(rows, -1, dtype=np.int64)  # -1: prompt tokens not scored
        # a beam whose line the device chose (BeamGroup.on_device): its full blocks are the device's table
        # (ModelRunner.beam_tables), its history here is stale but for its last token; its own last blocks are here
        self.lineage_on_device = np.zeros(rows, dtype=bool)  # [R]

    def reset(self) -> None:
        """Forget every request (a new scheduler starts from nothing)."""
        self.row_of.clear()
        self.free_rows = list(range(self.max_num_seqs - 1, -1, -1))
        self.version += 1

    def apply(self, plan: StepPlan) -> np.ndarray:
        """Continue beams, drop finished sequences, add new ones, append new blocks: the worker's side of the diff.
        Returns the rows whose beam got a token here [K] (their next input is on the host)."""
        forked = self._fork_beams(plan.beam_forks)
        for seq_id in plan.finished_seq_ids:
            self.release(seq_id)
        for new in plan.new_requests:
            self._add(new)
        for seq_id, block_id in zip(plan.appended_block_seq_ids, plan.appended_block_ids, strict=True):
            row = self.row_of[seq_id]
            self.block_table[row, self.num_blocks[row]] = block_id
            self.num_blocks[row] += 1
        return forked

    def _fork_beams(self, forks: list[BeamFork]) -> np.ndarray:
        """Slots that change line copy their parent's row (tokens, counts, the new block table); then every slot
        appends its token. Copies go first: a parent keeps its own line, so no source is overwritten."""
        if not forks:
            return np.zeros(0, dtype=np.int64)
        self.version += 1
        placed: list[tuple[BeamFork, int]] = []
        for fork in forks:
            parent = self.row_of.get(fork.parent_seq_id)
            if parent is None:
                continue  # dropped with a failed step
            row = self.row_of.get(fork.seq_id)
            if row is None:  # a beam of the first step
                row = self.free_rows.pop()
                self.row_of[fork.seq_id] = row
            placed.append((fork, row))
            self.lineage_on_device[row] = False  # the scheduler's tables (first step of a search)
            if row != parent:
                count = self.num_tokens[parent]
                self.token_ids[row, :count] = self.token_ids[parent, :count]
                for column in (self.num_tokens, self.num_prompt_tokens, self.num_computed):
                    column[row] = column[parent]
                self.block_table[row, :len(fork.block_ids)] = fork.block_ids
                self.num_blocks[row] = len(fork.block_ids)
                self.num_logprobs[row] = self.num_prompt_logprobs[row] = -1
        for fork, row in placed:
            self.token_ids[row, self.num_tokens[row]] = fork.token_id
            self.num_tokens[row] += 1
        return np.asarray([row for _, row in placed], dtype=np.int64)  # [K]

    def _add(self, new: NewRequest) -> None:
        assert new.seq_id not in self.row_of, f"sequence {new.seq_id} added twice"
        row = self.free_rows.pop()
        self.row_of[new.seq_id] = row
        self.version += 1
        count = len(new.token_ids)
        self.token_ids[row, :count] = new.token_ids
        self.num_tokens[row] = count
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed[row] = new.num_computed_tokens
        self.block_table[row, :len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        self.lineage_on_device[row] = False
        params = new.sampling
        self.num_logprobs[row] = params.top_list_length
        self.num_prompt_logprobs[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs

    def release(self, seq_id: int) -> None:
        """The sequence leaves (finished, preempted or failed): its row is free. Unknown ids are ignored."""
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.free_rows.append(row)
            self.version += 1

    def rows_for(self, seq_ids: list[int]) -> np.ndarray:
        """The rows of these sequences [B] (read-only): the last answer again while the sequences and row_of are
        the same (decode steps of a steady batch), else one lookup per sequence."""
        key = self._rows_key
        if key is not None and key[1] == self.version and key[0] == seq_ids:
            return self._rows
        rows = np.fromiter((self.row_of[r] for r in seq_ids), dtype=np.int64, count=len(seq_ids))  # [B]
        rows.flags.writeable = False
        self._rows_key, self._rows = (list(seq_ids), self.version), rows
        return rows

    def holds(self, seq_ids: list[int], rows: np.ndarray, version: int) -> np.ndarray:
        """[N] bool: each sequence still owns the row it had when the state's version was `version`."""
        if version == self.version:
            return np.ones(len(seq_ids), dtype=bool)
        row_of = self.row_of
        return np.fromiter((row_of.get(seq_id, -1) == row for seq_id, row in zip(seq_ids, rows.tolist(), strict=True)),
                           dtype=bool, count=len(seq_ids))
