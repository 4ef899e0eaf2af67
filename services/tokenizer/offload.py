"""Large tokenizations run on threads, off the poll loop: heartbeats and other requests never wait on them.

The Rust tokenizer releases the GIL while it encodes (measured: the loop thread keeps running every
~25 ms while a 1 MB prompt encodes in 0.7 s), so one thread is enough to keep the process responsive.
A finished job wakes the loop through a pipe the loop polls alongside its sockets.
"""

from __future__ import annotations

import logging
import os
import queue
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagoda.shared.errors import PagodaError, ServerOverloadedError

log = logging.getLogger(__name__)

OFFLOAD_MIN_CHARS = 32 << 10  # prompts this long (characters, all messages together) go to a thread
OFFLOAD_MIN_TOKENS = 32 << 10  # token-id lists this long (detokenize) likewise
MAX_PENDING = 64  # jobs queued or running; past it a request is refused (503) rather than queued


@dataclass(slots=True)
class Done:
    key: str  # the request id
    value: Any  # what the job returned, or the exception it raised
    failed: bool
    on_done: Callable[[Any, bool], None]


class Offloader:
    """Runs jobs on a small pool; `drain()` (on the loop) calls each job's `on_done(value, failed)`. `run` decides
    between the loop and the pool and remembers who owns each job on the pool (`owners`)."""

    def __init__(self, num_threads: int = 1) -> None:
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenize")
        self._done: queue.SimpleQueue[Done] = queue.SimpleQueue()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self.pending: set[str] = set()  # keys of jobs not yet drained
        self.cancelled: set[str] = set()  # keys whose result is to be dropped (the request was aborted)
        self.owners: dict[str, Any] = {}  # key -> its owner (the api that sent it), for jobs `run` put on the pool

    @property
    def fd(self) -> int:
        """Readable when a job has finished: register it with the loop's poller."""
        return self._read_fd

    def full(self) -> bool:
        return len(self.pending) >= MAX_PENDING

    def run(self, key: str, owner: Any, job: Callable[[], Any], large: bool, finish: Callable[[Any], None],
            fail: Callable[[PagodaError], None], bounded: bool = True) -> None:
        """finish(job()) now, or on a thread when `large` (the loop goes on; finish then runs in drain()). A
        PagodaError from either goes to `fail`; any other error from a thread's job, as an internal one. `bounded`
        False: a job that holds no large input (a small prompt with a constraint to compile) is queued past
        MAX_PENDING (a burst of requests with one new schema waits for its one compile, not a 503)."""
        if not large:
            try:
                finish(job())
            except PagodaError as exc:
                fail(exc)
            return
        if bounded and self.full():
            fail(ServerOverloadedError("too many large prompts are being tokenized"))
            return
        self.owners[key] = owner

        def done(value: Any, failed: bool) -> None:
            self.owners.pop(key, None)
            try:
                if failed:
                    raise value
                finish(value)
            except PagodaError as exc:
                fail(exc)
            except Exception:
                log.exception("failed on the large input of %s", key)
                fail(PagodaError("internal error in the tokenizer"))

        self.submit(key, job, done)

    def submit(self, key: str, job: Callable[[], Any], on_done: Callable[[Any, bool], None]) -> None:
        assert key not in self.pending, key
        self.pending.add(key)
        future = self._pool.submit(job)
        future.add_done_callback(lambda f: self._finished(key, f, on_done))

    def cancel(self, key: str) -> bool:
        """Drop the result of a job still pending; True if there was one."""
        self.owners.pop(key, None)
        if key in self.pending:
            self.cancelled.add(key)
            return True
        return False

    def _finished(self, key: str, future: Future[Any], on_done: Callable[[Any, bool], None]) -> None:
        # On the pool's thread: only queue the result and wake the loop.
        exc = future.exception()
        self._done.put(Done(key, exc if exc is not None else future.result(), exc is not None, on_done))
        try:
            os.write(self._write_fd, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already: the loop will drain everything

    def drain(self) -> None:
        """On the loop: hand every finished job's result to its callback."""
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                return
            self.pending.discard(done.key)
            if done.key in self.cancelled:
                self.cancelled.discard(done.key)
                continue
            try:
                done.on_done(done.value, done.failed)
            except Exception:
                log.exception("failed to finish the offloaded work of %s", done.key)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        os.close(self._read_fd)
        os.close(self._write_fd)
