"""Structured outputs in a process of their own: the worker's matchers advance and its masks fill where no step-loop
Python competes for their GIL.

    worker (step loop)                                 grammar process (its own interpreter; no CUDA)
    MaskProcess.apply / drop / accept  -- MaskApply, MaskAccept -->  GrammarRows (compiles, consumes row by row)
    MaskProcess.submit(accepts, rows)  -- MaskFill(slot) ---------->  accept, then fill into the shared slot
    MaskJob.done() / result()          <-- MaskReady(rows) ---------  (the masks are in the slot already)

- The masks live in shared memory (an anonymous memfd mapped by both): two slots of [max_rows, ceil(V/32)] int32,
  registered as pinned memory on CUDA so the K constrained rows go straight to the device. The worker picks the
  slot of each fill: the step that read a slot has synced before the slot comes round again (as GrammarRows' two
  host buffers).
- Every message goes one way in order over one socket pair, and only a fill is answered, so the process's state
  follows the worker's calls in their order. The worker mirrors which sequences have a grammar or allowed ids, so
  `constrains` / `has_matchers` cost no round trip; the prompt never travels (a NewRequest goes with its generated
  tokens only, which a recomputed sequence's matcher replays).
- The process is `python -m pagoda.services.worker.grammar_process` with the socket and the memfd passed as file
  descriptors: no fork of a CUDA process, no re-import of the worker's __main__, no named shared memory to leak.
- Failure: a process that dies, exits, or does not answer within REPLY_TIMEOUT_S (START_TIMEOUT_S while it starts)
  is killed; every sequence it held ends with an error (take_failures: the runner reports them as RowFailure and
  drops them), and the next request with a grammar starts a new one. A constraint that fails to build a matcher
  there ends its own request only. The worker never waits without a deadline.
- Thinking budgets (SamplingParams.thinking) are rows here too while their think block is open; once it closes, a
  sequence without a grammar is named in the next MaskReady (released_seq_ids) and the mirror forgets it, unless the
  worker added it anew after that fill was sent (its recompute's row then answers for it).
- Shutdown: close() (the worker service's), the MaskProcess being collected, or the interpreter's exit stop it
  (weakref.finalize); if the worker is killed, the process reads EOF on its socket and ends.
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import llguidance
import msgspec
import numpy as np
import torch

from pagoda.services.grammar.compiler import load_ll_tokenizer
from pagoda.services.worker.grammar import (
    MAX_EXECUTOR_THREADS,
    PARALLEL_ROWS,
    GrammarMasks,
    GrammarRows,
    SeqGrammar,
    available_cpus,
)
from pagoda.shared.config import GRAMMAR_PROCESS_MIN_CPUS, EngineConfig
from pagoda.shared.hf_tokenizer import tokenizer_folder
from pagoda.shared.messages import (
    MaskAccept,
    MaskApply,
    MaskBusy,
    MaskCompiled,
    MaskFill,
    MaskPrepare,
    MaskProcessToWorker,
    MaskReady,
    MaskReset,
    MaskStarted,
    MaskStop,
    NewRequest,
    StepPlan,
    StructuredOutputs,
    WorkerToMaskProcess,
)
from pagoda.shared.shapes import ModelArch

log = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0  # spawn, import torch and llguidance, build the tokenizer (seconds on a busy CPU)
# One fill's answer, or a MaskBusy while it waits for a compile. Below the scheduler's 8 s floor on a step
# (services/scheduler/health.py): a hung grammar process fails its rows before the worker counts as hung.
REPLY_TIMEOUT_S = 5.0
COMPILE_TIMEOUT_S = 100.0  # a fill kept busy by compiles (MaskBusy) ends here (the scheduler allows 120 s)
BUSY_INTERVAL_S = 1.0  # how often a fill waiting for a compile says so
STOP_TIMEOUT_S = 5.0
POLL_SLICE_S = 1.0  # how often a wait looks whether the process is still alive
MaskDone = Callable[[float, float], None]  # (fill seconds in the process, seconds from submit to ready)


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """What the grammar process builds its llguidance tokenizer from (picklable, unlike a loader closure)."""

    folder: str | None  # None: no tokenizer (structured outputs fail)
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    def load(self) -> llguidance.LLTokenizer | None:
        return None if self.folder is None else load_ll_tokenizer(self.folder, self.vocab_size,
                                                                   list(self.eos_token_ids))


def tokenizer_spec(config: EngineConfig, arch: ModelArch) -> TokenizerSpec:
    return TokenizerSpec(tokenizer_folder(config.model, config.load_format, config.tokenizer), arch.vocab_size,
                         tuple(arch.eos_token_ids))


# ---------------------------------------------------------------- the grammar process


class SharedMaskRows(GrammarRows):
    """GrammarRows filling its masks into the worker's shared slots, consuming tokens row by row (cheaper per row
    than llguidance's pool, and no step loop here needs the GIL released)."""

    def __init__(self, spec: TokenizerSpec, slots: torch.Tensor, busy: Callable[[], None] = lambda: None) -> None:
        super().__init__(spec.load, spec.vocab_size)
        self.slots = slots  # [2, max_rows, W] int32, shared with the worker
        self.slot = 0  # where the next bitmask() goes (MaskFill.slot)
        self.busy = busy  # tells the worker a fill still waits for a compile
        self.released: list[int] = []  # sequences whose masks ended since the last MaskReady (a closed think block)

    def _released(self, seq_id: int) -> None:
        self.released.append(seq_id)

    def drop(self, seq_ids: list[int]) -> None:
        super().drop(seq_ids)
        if self.released:  # a sequence dropped, or added anew, since: what is released is no longer it
            self.released = [seq_id for seq_id in self.released if seq_id not in seq_ids]

    def _ready(self, seq_id: int, seq: SeqGrammar) -> bool:
        if seq.compiling is not None:
            while not futures.wait([seq.compiling], timeout=BUSY_INTERVAL_S).done:
                self.busy()
        return super()._ready(seq_id, seq)

    def _buffer(self, num_rows: int) -> torch.Tensor:
        assert num_rows <= self.slots.shape[1], f"{num_rows} masks do not fit {self.slots.shape[1]} rows"
        return self.slots[self.slot, :num_rows]  # [K, W]

    def _parallel_consume(self, num_rows: int) -> bool:
        return False

    def _parallel(self, num_rows: int) -> bool:
        # The masks on llguidance's pool once the CPUs hold the step loop, this process and the pool: no step loop
        # here waits on the pool's hand-off. With fewer, the pool's threads (which spin a while after each call:
        # on the 2-core box a pool in the worker delayed this process's 64-row fill from 0.4 to 2.3 ms) take the
        # cores the step loop and this process need.
        return num_rows >= PARALLEL_ROWS and self._cpus >= GRAMMAR_PROCESS_MIN_CPUS

    def _ensure_executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(MAX_EXECUTOR_THREADS, self._cpus)))
        return self._executor


def serve(conn: Connection, spec: TokenizerSpec, masks_fd: int, max_rows: int) -> None:
    """The grammar process's loop: apply the worker's messages in order until MaskStop or EOF. An exception other
    than a constraint's own failure ends the process (the worker fails its sequences and starts another)."""
    num_words = -(-spec.vocab_size // 32)
    num_bytes = 2 * max_rows * num_words * 4
    buffer = mmap.mmap(masks_fd, num_bytes)
    os.close(masks_fd)
    slots = torch.frombuffer(buffer, dtype=torch.int32, count=num_bytes // 4).view(2, max_rows, num_words)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(WorkerToMaskProcess)
    send_lock = threading.Lock()  # compile threads send MaskCompiled between the loop's answers

    def send(message: MaskProcessToWorker) -> None:
        with send_lock:
            conn.send_bytes(encoder.encode(message))

    def built(digest: str) -> None:
        try:
            send(MaskCompiled(digest))
        except (OSError, ValueError):
            pass  # the worker is gone: the loop reads EOF and ends

    job_id = [0]  # the fill in progress
    rows = SharedMaskRows(spec, slots, lambda: send(MaskBusy(job_id[0])))
    send(MaskStarted(os.getpid()))
    failed: dict[int, str] = {}  # sequences whose matcher could not be built, told with the next MaskReady
    while True:
        try:
            message = decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the worker is gone
        if isinstance(message, MaskStop):
            break
        if isinstance(message, MaskApply):
            _apply(rows, message, failed)
        elif isinstance(message, MaskAccept):
            for seq_ids, token_ids in zip(message.seq_ids, message.token_ids, strict=True):
                rows.accept(seq_ids, token_ids)
        elif isinstance(message, MaskFill):
            job_id[0] = message.job_id
            send(_fill(rows, message, failed))
            failed = {}
        elif isinstance(message, MaskPrepare):
            rows.prepare(message.hash, message.constraint, on_built=built)
        elif isinstance(message, MaskReset):
            rows.reset()
            failed.clear()
    rows.close()


def main() -> None:
    """`python -m pagoda.services.worker.grammar_process`: started by MaskProcess with the fds it passes."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--conn-fd", type=int, required=True)
    parser.add_argument("--masks-fd", type=int, required=True)
    parser.add_argument("--max-rows", type=int, required=True)
    parser.add_argument("--spec", required=True, help="JSON: [tokenizer folder or null, vocab size, [eos ids]]")
    parser.add_argument("--log-level", type=int, default=logging.WARNING)
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C goes to the worker, which stops us
    logging.basicConfig(level=args.log_level, format="%(asctime)s grammar-process %(levelname)s %(name)s: %(message)s")
    folder, vocab_size, eos_ids = json.loads(args.spec)
    serve(Connection(args.conn_fd), TokenizerSpec(folder, vocab_size, tuple(eos_ids)), args.masks_fd, args.max_rows)


def _apply(rows: SharedMaskRows, message: MaskApply, failed: dict[int, str]) -> None:
    rows.drop(message.finished_seq_ids)
    for seq_id in message.finished_seq_ids:
        failed.pop(seq_id, None)
    for new in message.new_requests:
        try:
            rows.add(new)
        except Exception as exc:  # noqa: BLE001 - this request's constraint, not the process, failed
            log.exception("sequence %d: cannot constrain it", new.seq_id)
            rows.drop([new.seq_id])
            failed[new.seq_id] = f"structured outputs failed on the worker: {type(exc).__name__}: {exc}"


def _fill(rows: SharedMaskRows, message: MaskFill, failed: dict[int, str]) -> MaskReady:
    started = time.perf_counter()
    for seq_ids, token_ids in zip(message.accept_seq_ids, message.accept_token_ids, strict=True):
        rows.accept(seq_ids, token_ids)
    rows.slot = message.slot
    masks = rows.bitmask(message.seq_ids)
    for seq_id, why in rows.take_failures():  # no token left: told now, never masked again
        rows.drop([seq_id])
        failed[seq_id] = why
    released, rows.released = rows.released, []
    ended = time.perf_counter()
    return MaskReady(message.job_id, masks[2].tolist() if masks is not None else [], ended - started, ended,
                     list(failed), list(failed.values()), released)


# ---------------------------------------------------------------- the worker's side


@dataclass(slots=True)
class _Child:
    """One grammar process: the process, its socket, the shared slots [2, max_rows, W] (and their pinned view)."""

    process: subprocess.Popen[bytes]
    conn: Connection
    buffer: mmap.mmap  # an anonymous memfd's pages, mapped here and there: no name to leak
    slots: torch.Tensor  # [2, max_rows, W] int32 over buffer
    pinned: bool = False  # slots registered with CUDA (cudaHostRegister): copies from them are asynchronous
    started: bool = False  # MaskStarted arrived
    stopped: bool = False

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """End the process (politely, then by force) and unmap the slots; idempotent."""
        if self.stopped:
            return
        self.stopped = True
        try:
            self.conn.send_bytes(msgspec.msgpack.encode(MaskStop()))
        except (OSError, ValueError):
            pass
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT_S)
        self.conn.close()
        if self.pinned:
            self.pinned = False
            try:
                torch.cuda.synchronize()  # a copy of the last masks may still read the slots (a failure at launch)
                code = int(torch.cuda.cudart().cudaHostUnregister(self.slots.data_ptr()))
            except Exception:  # noqa: BLE001 - at exit CUDA may be gone: the mapping goes with the process
                log.debug("cannot unregister the grammar masks", exc_info=True)
                code = 0
            if code != 0:
                log.warning("cudaHostUnregister of the grammar masks failed (cudaError %d)", code)
        self.slots = torch.empty(0, dtype=torch.int32)
        try:
            self.buffer.close()
        except BufferError:  # a mask view still alive somewhere: the mapping goes with it
            log.debug("grammar masks still referenced at close")


@dataclass(slots=True)
class MaskJob:
    """One fill in flight (a Future's done/result for the runner): result() is (flags [B], masks [K, W], rows [K])
    or None. A job the process failed returns None; its sequences are in take_failures()."""

    owner: MaskProcess
    job_id: int
    num_rows: int  # B: the step's sampled rows
    slot: int
    submitted: float
    on_done: MaskDone | None
    reply: MaskReady | None = None
    lost: bool = False  # the process died or timed out before answering
    masks: GrammarMasks | None = field(default=None)
    finished: bool = False

    def done(self) -> bool:
        return self.finished or self.owner._poll(self)

    def result(self) -> GrammarMasks | None:
        if not self.finished:
            self.owner._wait(self)
            self.finished = True
            self.masks = self.owner._masks(self)
            if self.reply is not None and self.on_done is not None:
                self.on_done(self.reply.fill_s, self.reply.ended_at - self.submitted)
        return self.masks


class MaskProcess:
    """GrammarRows' interface for the runner, with the matchers in a grammar process (one at a time, started on
    construction, and again after a failure when a grammar next needs one; the worker's runner waits for its start-up,
    `wait_started`, once its own is done, before it reports ready). Idle, the process blocks in a read of its socket:
    it takes no CPU while no request is constrained."""

    def __init__(self, spec: TokenizerSpec, max_rows: int, pin_memory: bool = False) -> None:
        self.spec = spec
        self.vocab_size = spec.vocab_size
        self.num_words = -(-spec.vocab_size // 32)
        self.max_rows = max_rows
        self.pin_memory = pin_memory
        self._grammar_ids: set[int] = set()  # sequences with a constraint or a thinking budget (a matcher there)
        self._added_at: dict[int, int] = {}  # each of those: the last job submitted when it was mirrored
        self._allowed_ids: set[int] = set()  # sequences with allowed_token_ids
        self._failed: dict[int, str] = {}  # sequences the process lost, until the runner takes them
        self._child: _Child | None = None
        self._finalizer: weakref.finalize | None = None
        self._job: MaskJob | None = None  # the fill whose answer is due
        self._job_id = 0
        self._flip = 0
        self._staging: torch.Tensor | None = None  # [2, max_rows, W] pinned: when the slots cannot be registered
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(MaskProcessToWorker)
        self._preparing: set[str] = set()  # MaskPrepare hashes not yet answered by a MaskCompiled
        self._prepared: list[str] = []  # answered since take_compiled
        self._start()

    # ---------------------------------------------------------------- GrammarRows' interface

    @property
    def active(self) -> bool:
        return bool(self._grammar_ids) or bool(self._failed)

    def constrains(self, seq_ids: list[int]) -> bool:
        return self.has_matchers(seq_ids) or (bool(self._allowed_ids)
                                              and any(seq_id in self._allowed_ids for seq_id in seq_ids))

    def has_matchers(self, seq_ids: list[int]) -> bool:
        """Some of these has a grammar (or lost one: the runner must hear of it before it samples)."""
        if not self._grammar_ids and not self._failed:
            return False
        return any(seq_id in self._grammar_ids or seq_id in self._failed for seq_id in seq_ids)

    @property
    def preparing(self) -> bool:
        return bool(self._preparing)

    def prepare(self, digest: str, constraint: StructuredOutputs) -> None:
        """GrammarRows.prepare in the grammar process: it answers MaskCompiled once the matcher is built."""
        if self._child is not None and not self._child.alive():
            self._lose(_ended(self._child))
        if self._child is None:
            self._start()
        if self._send(MaskPrepare(digest, constraint)):
            self._preparing.add(digest)
        else:
            self._prepared.append(digest)  # nothing to wait for: its rows start another process when added

    def take_compiled(self) -> list[str]:
        """The prepare()d constraints built since the last call (reads what the process sent, never waits)."""
        if self._preparing:
            job = self._job
            if job is not None and not job.finished and job.reply is None and not job.lost:
                self._poll(job)  # its reader takes MaskCompiled too
            else:
                self._read_idle()
        built, self._prepared = self._prepared, []
        self._preparing.difference_update(built)
        return built

    def reset(self) -> None:
        self._grammar_ids.clear()
        self._added_at.clear()
        self._allowed_ids.clear()
        self._failed.clear()
        self._preparing.clear()
        self._prepared.clear()
        if self._child is not None:
            self._send(MaskReset())

    def apply(self, plan: StepPlan) -> None:
        self._apply(plan.finished_seq_ids, plan.new_requests)

    def drop(self, seq_ids: list[int]) -> None:
        self._apply(seq_ids, [])

    def add(self, new: NewRequest) -> None:
        self._apply([], [new])

    def accept(self, seq_ids: list[int], token_ids: list[int]) -> None:
        if not self._grammar_ids:
            return
        accept_ids, accept_tokens = self._constrained([(seq_ids, token_ids)])
        if accept_ids:
            self._send(MaskAccept(accept_ids, accept_tokens))

    def bitmask(self, seq_ids: list[int]) -> GrammarMasks | None:
        if not self._grammar_ids and not self._allowed_ids:
            return None
        return self.submit([], seq_ids).result()

    def advance_and_fill(self, accepts: list[tuple[list[int], list[int]]], seq_ids: list[int]) -> GrammarMasks | None:
        return self.submit(accepts, seq_ids).result()

    def submit(self, accepts: list[tuple[list[int], list[int]]], seq_ids: list[int],
               on_done: MaskDone | None = None) -> MaskJob:
        """Send one step's accept + fill and return at once; the job's result() waits for the masks."""
        assert self._job is None or self._job.finished, "one fill at a time"
        assert len(seq_ids) <= self.max_rows, f"{len(seq_ids)} rows exceed the {self.max_rows} mask rows"
        self._flip ^= 1
        self._job_id += 1
        job = MaskJob(self, self._job_id, len(seq_ids), self._flip, time.perf_counter(), on_done)
        self._job = job
        accept_ids, accept_tokens = self._constrained(accepts) if self._grammar_ids else ([], [])
        if not self._grammar_ids and not self._allowed_ids:
            job.finished = True  # nothing constrained (the process lost every row): no masks
            return job
        if not self._send(MaskFill(job.job_id, accept_ids, accept_tokens, seq_ids, job.slot)):
            job.lost = True
        return job

    def take_failures(self) -> list[tuple[int, str]]:
        """Sequences the grammar process lost since the last call, with why; the runner ends them."""
        failures, self._failed = list(self._failed.items()), {}
        return failures

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer in this process (the offline engine checks constraints with it)."""
        if self._tokenizer is None:
            self._tokenizer = self.spec.load()
            if self._tokenizer is None:
                raise RuntimeError("structured outputs need the model's tokenizer on the worker")
        return self._tokenizer

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._child is not None:
            self._child.stop()
            self._child = None

    def wait_started(self) -> bool:
        """Block until the grammar process has imported its modules and built llguidance's tokenizer (MaskStarted):
        seconds of one core that, left to run after the worker reports ready, were taken from the first requests'
        api, tokenizer and scheduler (8-9 s of CPU in the first served round on an H100 host, no grammar sent).
        False when it ended or stayed silent for START_TIMEOUT_S (it is killed; a grammar starts another)."""
        child = self._child
        deadline = time.monotonic() + START_TIMEOUT_S
        while child is not None and child is self._child and not child.started:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._lose(f"the grammar process did not start in {START_TIMEOUT_S:.0f} s")
                break
            try:
                ready = child.conn.poll(min(remaining, POLL_SLICE_S))
                message = self._decoder.decode(child.conn.recv_bytes()) if ready else None
            except (EOFError, OSError):
                self._lose(_ended(child))
                break
            if message is None:
                if not child.alive():
                    self._lose(_ended(child))
                continue
            if not isinstance(message, MaskStarted):  # only a fill is answered, and none was sent
                self._lose(f"the grammar process sent {type(message).__name__} before it started")
                break
            child.started = True
        return self._child is not None and self._child.started

    @property
    def pid(self) -> int | None:
        """The grammar process's pid (tests)."""
        return self._child.process.pid if self._child is not None else None

    # ---------------------------------------------------------------- internals

    def _apply(self, finished: list[int], new_requests: list[NewRequest]) -> None:
        mirror_empty = not self._grammar_ids and not self._allowed_ids
        gone = [] if mirror_empty and not self._failed else [
            seq_id for seq_id in finished if seq_id in self._grammar_ids or seq_id in self._allowed_ids
            or self._failed.pop(seq_id, None) is not None]
        news = []
        for new in new_requests:
            params = new.sampling
            if params.structured_outputs is not None or params.thinking is not None or params.allowed_token_ids:
                news.append(msgspec.structs.replace(new, token_ids=new.token_ids[new.num_prompt_tokens:],
                                                    num_prompt_tokens=0, block_ids=[], num_computed_tokens=0))
            elif new.seq_id in self._grammar_ids or new.seq_id in self._allowed_ids:
                gone.append(new.seq_id)  # the id comes back without a constraint
        if not gone and not news:
            return
        for seq_id in gone:
            self._grammar_ids.discard(seq_id)
            self._added_at.pop(seq_id, None)
            self._allowed_ids.discard(seq_id)
        for new in news:  # mirrored before the send: a process found dead now fails these too
            if new.sampling.structured_outputs is not None or new.sampling.thinking is not None:
                self._grammar_ids.add(new.seq_id)
                self._added_at[new.seq_id] = self._job_id
            if new.sampling.allowed_token_ids:
                self._allowed_ids.add(new.seq_id)
        if news and self._child is not None and not self._child.alive():
            self._lose(_ended(self._child))  # not the new ones' fault
        if news and self._child is None:
            self._start()
        self._send(MaskApply(gone, news))

    def _constrained(self, accepts: list[tuple[list[int], list[int]]]) -> tuple[list[list[int]], list[list[int]]]:
        """The steps' (seq ids, tokens) narrowed to the sequences with a grammar, empty steps left out."""
        grammar_ids = self._grammar_ids
        seq_lists, token_lists = [], []
        for seq_ids, token_ids in accepts:
            kept = [(s, t) for s, t in zip(seq_ids, token_ids, strict=True) if s in grammar_ids]
            if kept:
                seq_lists.append([s for s, _ in kept])
                token_lists.append([t for _, t in kept])
        return seq_lists, token_lists

    def _start(self) -> None:
        """Start a grammar process (a fresh interpreter: CUDA lives in this one, and no fork, no __main__ import)
        with fresh shared slots, passed as file descriptors."""
        num_bytes = 2 * self.max_rows * self.num_words * 4
        masks_fd = os.memfd_create("pagoda-grammar-masks")
        ours, theirs = socket.socketpair()
        try:
            os.ftruncate(masks_fd, num_bytes)
            buffer = mmap.mmap(masks_fd, num_bytes)
            spec = json.dumps([self.spec.folder, self.spec.vocab_size, list(self.spec.eos_token_ids)])
            process = subprocess.Popen(
                [sys.executable, "-m", "pagoda.services.worker.grammar_process", "--conn-fd", str(theirs.fileno()),
                 "--masks-fd", str(masks_fd), "--max-rows", str(self.max_rows), "--spec", spec,
                 "--log-level", str(log.getEffectiveLevel())],
                pass_fds=(theirs.fileno(), masks_fd), stdin=subprocess.DEVNULL)
        finally:
            os.close(masks_fd)  # the mapping (and the process's copy) keep the pages
            theirs.close()  # the process's end: its EOF must reach us when it ends
        slots = torch.frombuffer(buffer, dtype=torch.int32, count=num_bytes // 4).view(2, self.max_rows,
                                                                                       self.num_words)
        child = _Child(process, Connection(ours.detach()), buffer, slots)
        if self.pin_memory:
            child.pinned = _register_pinned(slots)
            if not child.pinned and self._staging is None:
                log.warning("grammar masks: shared memory cannot be pinned; copying through a pinned buffer")
                self._staging = torch.empty(slots.shape, dtype=torch.int32, pin_memory=True)  # [2, rows, W]
        self._child = child
        self._finalizer = weakref.finalize(self, child.stop)
        log.info("grammar process %d started (%d mask rows of %d words)", process.pid, self.max_rows, self.num_words)

    def _send(self, message: WorkerToMaskProcess) -> bool:
        """False when the process is gone (its sequences are failed then)."""
        if self._child is None:
            self._fail_all("the grammar process is not running")
            return False
        try:
            self._child.conn.send_bytes(self._encoder.encode(message))
            return True
        except (OSError, ValueError):
            self._lose("the grammar process ended")
            return False

    def _poll(self, job: MaskJob) -> bool:
        """Read what has arrived without waiting; True once the job is answered (or lost)."""
        child = self._child
        while job.reply is None and not job.lost and child is not None and child is self._child:
            try:
                if not child.conn.poll(0):
                    break
            except (OSError, ValueError):
                self._lose("the grammar process ended")
                break
            self._read(job)
        return job.reply is not None or job.lost or self._child is None

    def _wait(self, job: MaskJob) -> None:
        """Read until the job's answer. The process is killed when it ends, or stays silent for REPLY_TIMEOUT_S
        (START_TIMEOUT_S until it has started; a fill that says it waits for compiles, up to COMPILE_TIMEOUT_S)."""
        child = self._child
        if child is None:
            job.lost = True
            return
        now = time.monotonic()
        deadline = now + (REPLY_TIMEOUT_S if child.started else START_TIMEOUT_S)
        busy_until = now + COMPILE_TIMEOUT_S
        while job.reply is None and not job.lost and child is self._child:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._lose(f"the grammar process did not answer in {time.monotonic() - now:.1f} s")
                break
            try:
                ready = child.conn.poll(min(remaining, POLL_SLICE_S))
            except (OSError, ValueError):
                self._lose("the grammar process ended")
                break
            if not ready:
                if not child.alive():
                    self._lose(_ended(child))
                continue
            heard = self._read(job)
            if heard is MaskStarted:
                deadline = time.monotonic() + REPLY_TIMEOUT_S
            elif heard is MaskBusy or heard is MaskCompiled:
                deadline = max(deadline, min(time.monotonic() + REPLY_TIMEOUT_S, busy_until))
        if job.reply is None:
            job.lost = True

    def _read(self, job: MaskJob) -> type | None:
        """One message from the process; its type (None when the process was lost)."""
        child = self._child
        assert child is not None
        try:
            message = self._decoder.decode(child.conn.recv_bytes())
        except (EOFError, OSError):
            self._lose(_ended(child))
            return None
        if isinstance(message, MaskStarted):
            child.started = True
            return MaskStarted
        if isinstance(message, MaskCompiled):
            self._prepared.append(message.hash)
            return MaskCompiled
        if message.job_id != job.job_id:
            log.error("grammar process answered job %d, expected %d", message.job_id, job.job_id)
            self._lose("the grammar process answered out of order")
            return None
        if isinstance(message, MaskBusy):
            return MaskBusy
        for seq_id, why in zip(message.failed_seq_ids, message.failed_messages, strict=True):
            if seq_id in self._grammar_ids or seq_id in self._allowed_ids:
                self._grammar_ids.discard(seq_id)
                self._allowed_ids.discard(seq_id)
                self._failed[seq_id] = why
        self._release(message.released_seq_ids, job.job_id)
        job.reply = message
        return MaskReady

    def _release(self, seq_ids: list[int], job_id: int) -> None:
        """Sequences whose think block closed with no grammar: their tokens and steps need the process no more. One
        mirrored again since the job was sent (a recompute added it anew there, after this answer) stays."""
        for seq_id in seq_ids:
            if self._added_at.get(seq_id, job_id) < job_id:
                self._grammar_ids.discard(seq_id)
                del self._added_at[seq_id]

    def _read_idle(self) -> None:
        """With no fill in flight: read what the process sent (MaskCompiled, a late MaskStarted), never waiting."""
        child = self._child
        while child is not None and child is self._child:
            try:
                if not child.conn.poll(0):
                    return
                message = self._decoder.decode(child.conn.recv_bytes())
            except (EOFError, OSError, ValueError):
                self._lose(_ended(child))
                return
            if isinstance(message, MaskCompiled):
                self._prepared.append(message.hash)
            elif isinstance(message, MaskStarted):
                child.started = True
            else:
                self._lose(f"the grammar process sent {type(message).__name__} with no fill in flight")
                return

    def _lose(self, why: str) -> None:
        """The process is gone or hung: kill it; every sequence it held fails; the next grammar starts another
        (and compiles what the lost one had not built when its rows are added: nothing is waited for)."""
        self._prepared.extend(self._preparing - set(self._prepared))
        child, self._child = self._child, None
        if child is None:
            return
        log.error("%s (pid %s); failing its %d sequences", why, child.process.pid,
                  len(self._grammar_ids | self._allowed_ids))
        child.process.kill()
        child.stop()
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._job is not None and not self._job.finished and self._job.reply is None:
            self._job.lost = True
        self._fail_all(why)

    def _fail_all(self, why: str) -> None:
        """Every sequence with a grammar or allowed ids ends with an error (take_failures)."""
        message = f"structured outputs failed on the worker: {why}"
        for seq_id in self._grammar_ids | self._allowed_ids:
            self._failed[seq_id] = message
        self._grammar_ids.clear()
        self._added_at.clear()
        self._allowed_ids.clear()

    def _masks(self, job: MaskJob) -> GrammarMasks | None:
        """The answered job's (flags [B], masks [K, W], rows [K]); None when no row has a mask or it was lost."""
        if job.reply is None or not job.reply.rows or self._child is None:
            return None
        index = np.asarray(job.reply.rows, dtype=np.int64)  # [K]
        flags = np.zeros(job.num_rows, dtype=bool)  # [B]
        flags[index] = True
        masks = self._child.slots[job.slot, :len(index)]  # [K, W]
        if self.pin_memory and not self._child.pinned:
            assert self._staging is not None
            masks = self._staging[job.slot, :len(index)].copy_(masks)
        return flags, masks, index


def _ended(child: _Child) -> str:
    code = child.process.poll()
    return "the grammar process ended" if code is None else f"the grammar process exited with status {code}"


def _register_pinned(tensor: torch.Tensor) -> bool:
    """Page-lock a host tensor this process did not allocate (the shared slots) so copies from it are asynchronous
    (as torch pins shared memory itself: cudaHostRegister, portable to every context)."""
    try:
        code = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 1))
    except Exception:  # noqa: BLE001 - no CUDA runtime binding: the staging copy works anyway
        log.exception("cudaHostRegister failed")
        return False
    if code != 0:
        log.warning("cudaHostRegister refused the grammar masks' shared memory (cudaError %d)", code)
    return code == 0


def grammar_rows(config: EngineConfig, arch: ModelArch, device_type: str, make_tokenizer: Callable[[], object],
                 ) -> GrammarRows | MaskProcess:
    """The worker's grammar rows: in a process of their own (config.grammar_process) or in this one (also when the
    model has no tokenizer: no constraint can run, and a benchmark of dummy weights needs no second process)."""
    spec = tokenizer_spec(config, arch)
    if spec.folder is not None and config.resolved_grammar_process(device_type, available_cpus()):
        return MaskProcess(spec, config.max_num_seqs, pin_memory=device_type == "cuda")
    return GrammarRows(make_tokenizer, arch.vocab_size, pin_memory=device_type == "cuda")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
