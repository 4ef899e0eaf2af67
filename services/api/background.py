"""Background responses (the Responses API's `background: true`): generations that run on in this api process,
detached from the HTTP request that made them, their state kept in the response store for any api process to read.

    POST /v1/responses {background} --> admitted (quota, in-flight limit, tokenizer's Accepted) --> 200 `queued`
        run task: _generate as any request -----> {id}.json: queued -> in_progress -> completed / incomplete /
                                                                                         failed / cancelled ({id}.end)
    POST /v1/responses/{id}/cancel (any api process) --> publishes `cancelled` as {id}.end, first wins
        the owning process: its run task cancelled at once (the same process), or at its next look at the folder
        (another process: within CANCEL_CHECK_S) --> _generate's finally aborts it, as a client that hung up

Why the folder carries a cancel from another api process: an api reaches only tokenizers, each request's replies go
back to the api that owns it, and a tokenizer drops an aborted request without a word to that owner; an abort sent by
another api would leave the owner's run waiting for output that never comes (and break the rule that a peer acts
only on what it owns). The api processes share nothing else (SO_REUSEPORT picks one per connection; several hosts
share only the store's volume), so the owner looks at the folder for the `.end` of its runs, once every
CANCEL_CHECK_S while it has any: one stat a run, off the event loop.

Streamed (`stream: true`), a run's events go to its log in the store (`{id}.events`, one JSON event a line) and then
to its readers in this process: GET /v1/responses/{id}?stream=true&starting_after=N from any process resumes them,
reading another process's log again every TAIL_S until the last event (or the end, for a cancel). A run's writes (its
log's lines, then its end) go in order on a worker thread, one batch at a time, off the event loop; a reader here
sees an event once it is in the log, and the last one once the end is published too.

A process that dies without its shutdown (killed) cannot end its runs: their records name their owner (host, pid and
the pid's start time), and a reader on the same host that finds the owner gone publishes them `failed` (`settle`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from pagoda.services.api.response_store import ResponseStore, StoredResponse
from pagoda.services.protocol.render import encode_json
from pagoda.services.protocol.responses import ResponsesRenderer
from pagoda.shared.errors import PagodaError

log = logging.getLogger(__name__)

CANCEL_CHECK_S = 0.2  # how often an api process looks for cancels of its runs made by another process
RUNNING = ("queued", "in_progress")  # a background response's statuses before it ends
TAIL_S = 0.1  # how often a reader of another process's streamed run reads its log again while nothing new came
LAST_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})
GONE = "the api process that ran this background response ended without finishing it"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux's /proc; "" elsewhere), None when it is gone: with
    the pid it names one process, whatever later takes the pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name before ")" may hold spaces


@functools.cache
def _host() -> str:
    """Where a pid means the same process: this host's name, boot and pid namespace (containers that share the
    store's volume and a host name still differ in their namespaces)."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(path) if path.endswith("/pid") else Path(path).read_text().strip())
        except OSError:
            parts.append("")
    return "|".join(parts).replace(" ", "_")


@functools.cache
def process_name() -> str:
    """This api process, as the records of its runs name it: host, pid and the pid's start time."""
    return f"{_host()} {os.getpid()} {_start_time(os.getpid()) or ''}"


def owner_gone(owner: str) -> bool:
    """The process a record names is known to be gone: on this host, its pid is no longer that process. False when
    it cannot be told (another host, a record without one)."""
    host, _, rest = owner.partition(" ")
    pid, _, started = rest.partition(" ")
    if host != _host() or not pid.isdigit():
        return False
    now = _start_time(int(pid)) if os.path.isdir("/proc") else ("" if _pid_alive(int(pid)) else None)
    return now is None or (bool(started) and bool(now) and now != started)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class BackgroundRenderer(ResponsesRenderer):
    """A background response's renderer: it tells its run when the prompt is admitted (the POST answers then) and,
    streamed, hands it every event as it is made (its run's log, which readers follow), the last one included: the
    run's request is never streamed itself (its handler takes the body), so the closing event is made here."""

    on_accepted: Callable[[], None] = staticmethod(lambda: None)
    on_events: Callable[[list[dict[str, Any]]], None] = staticmethod(lambda events: None)
    final: dict[str, Any] | None = None

    def prompt_accepted(self, prompt_reasoning: str) -> None:
        super().prompt_accepted(prompt_reasoning)
        self.on_accepted()

    def _events(self, events: list[dict[str, Any]]) -> bytes:
        data = super()._events(events)  # numbered in place
        if self.stream and events:
            self.on_events(events)
        return data

    def _final(self, usage: dict[str, Any]) -> dict[str, Any]:
        self.final = super()._final(usage)
        return self.final

    def body(self, view: Any, usage: dict[str, Any]) -> dict[str, Any]:
        if not self.stream:
            return super().body(view, usage)
        self.closing(usage)  # response.completed / incomplete, which carries the final object (kept by on_final)
        assert self.final is not None
        return self.final


@dataclass(slots=True, eq=False)
class Run:
    response_id: str
    tenant: str
    renderer: BackgroundRenderer
    input_items: list[dict[str, Any]]
    task: asyncio.Task[None] | None = None
    accepted: asyncio.Event = field(default_factory=asyncio.Event)
    # "cancelled": its end is published by a cancel (this process cancels its task); "shutdown": this process cancels
    # it at shutdown; "ended": its own end is published (a cancel seen now must not cut the task's last steps);
    # "refused": refused before its prompt was admitted (its record is dropped)
    ending: str = ""
    events: list[tuple[int, str, bytes]] = field(default_factory=list)  # streamed: (sequence_number, type, JSON)
    num_logged: int = 0  # of events: those written to the log (what its readers here see)
    unlogged: bytes = b""  # the log's lines not yet handed to the writer
    end: StoredResponse | None = None  # its terminal record, not yet handed to the writer
    writer: asyncio.Task[None] | None = None  # the writes in flight (BackgroundRuns._write)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) when its readers may go on
    refusal: PagodaError | None = None  # refused before its prompt was admitted: the POST's answer

    def record(self, response: dict[str, Any]) -> StoredResponse:
        running = response["status"] in RUNNING
        return StoredResponse(self.tenant, response, self.input_items, process_name() if running else "")


class BackgroundRuns:
    """This api process's background responses: each one's task, its records in the store, its cancel."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self._runs: dict[str, Run] = {}
        self._watch: asyncio.Task[None] | None = None

    async def start(self, run: Run, generate: Callable[[], Awaitable[web.StreamResponse]]) -> dict[str, Any]:
        """Start the run; its response object once the prompt is admitted. A refusal before then (a tenant's quota,
        the in-flight limit, the tokenizer's 400) is raised as the POST's answer, and nothing stays stored."""
        queued = run.renderer.response("queued", None)
        await asyncio.to_thread(self.store.put_running, run.response_id, run.record(queued))
        run.renderer.on_accepted = lambda: self._accepted(run)
        run.renderer.on_events = lambda events: self._log(run, events)
        run.task = asyncio.create_task(self._run(run, generate), name=f"background {run.response_id}")
        self._runs[run.response_id] = run
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_cancels(), name="background cancels")
        accepted = asyncio.create_task(run.accepted.wait())
        try:
            # a client that leaves meanwhile cancels only this wait: the run goes on
            await asyncio.wait((run.task, accepted), return_when=asyncio.FIRST_COMPLETED)
        finally:
            accepted.cancel()
        if run.refusal is not None:
            raise run.refusal
        return queued

    def _accepted(self, run: Run) -> None:
        """The prompt is tokenized and with the engine: in_progress (written before any output can end it)."""
        run.accepted.set()
        try:
            self.store.put_running(run.response_id, run.record(run.renderer.response("in_progress", None)))
        except OSError as exc:
            log.warning("could not write background response %s: %s", run.response_id, exc)
        run.renderer.opening(None)  # streamed: response.created and response.in_progress, the log's first events

    def _log(self, run: Run, events: list[dict[str, Any]]) -> None:
        """A streamed run's new events: kept for this process's readers and appended to its log in the store."""
        lines = [encode_json(event) for event in events]
        run.events += [(event["sequence_number"], event["type"], line) for event, line in zip(events, lines,
                                                                                             strict=True)]
        run.unlogged += b"".join(line + b"\n" for line in lines)
        self._flush(run)

    def _flush(self, run: Run) -> None:
        """Hand the run's pending writes to its writer (started when none is running)."""
        if run.writer is None or run.writer.done():
            run.writer = asyncio.create_task(self._write(run), name=f"background writes {run.response_id}")

    async def _write(self, run: Run) -> None:
        """The run's pending writes, in order, until none is left: its log's new lines, then its end, on a worker
        thread; then its readers here see those events (the renderer publishes the end before it makes the last
        event: written together, the end goes after)."""
        while run.unlogged or run.end is not None:
            lines, end, num_events = run.unlogged, run.end, len(run.events)
            run.unlogged, run.end = b"", None
            await asyncio.to_thread(self._write_now, run.response_id, lines, end)
            run.num_logged = num_events
            _changed(run)

    def _write_now(self, response_id: str, lines: bytes, end: StoredResponse | None) -> None:
        if lines:
            try:
                self.store.append_events(response_id, lines)
            except OSError as exc:
                log.warning("could not log events of background response %s: %s", response_id, exc)
        if end is not None:
            try:
                self.store.end_now(response_id, end)
            except OSError as exc:
                log.warning("could not write background response %s: %s", response_id, exc)

    async def _run(self, run: Run, generate: Callable[[], Awaitable[web.StreamResponse]]) -> None:
        """The generation, as any request's; its end published once (the renderer's on_final for a normal end)."""
        try:
            await generate()
        except asyncio.CancelledError:
            if run.ending not in ("cancelled", "ended"):  # the shutdown: failed, unless an end was published first
                self._end(run, "failed", {"code": "server_error", "message": "the server shut down before the "
                                          "response finished"})
            raise
        except PagodaError as exc:
            if not run.accepted.is_set():  # refused before it ran: the POST answers with the error
                run.refusal, run.ending = exc, "refused"  # its record dropped now is no delete to watch for
                await asyncio.to_thread(self.store.drop_now, run.response_id)
                return
            self._end(run, "failed", {"code": "server_error" if exc.http_status >= 500 else exc.code or
                                      "invalid_prompt", "message": exc.message})
        except Exception:
            log.exception("background response %s failed", run.response_id)
            self._end(run, "failed", {"code": "server_error", "message": "internal server error"})
        finally:
            try:
                if run.writer is not None:  # its log and end written before it is done (a cancel may cut this)
                    await asyncio.shield(run.writer)
            finally:
                self._runs.pop(run.response_id, None)
                _changed(run)  # its readers see the end (a cancelled run logs no last event)

    def keep(self, run: Run) -> Callable[[dict[str, Any]], None]:
        """The renderer's on_final: a run's completed or incomplete object, published unless a cancel was first."""
        def keep(response: dict[str, Any]) -> None:
            self._publish(run, response)
        return keep

    def _end(self, run: Run, status: str, error: dict[str, Any]) -> None:
        """A run that failed: streamed, its last event says so (before its end is published)."""
        run.renderer.stream_error({"error": {"param": None, **error}})
        response = run.renderer.response(status, None)
        response["error"] = error
        self._publish(run, response)

    def _publish(self, run: Run, response: dict[str, Any]) -> None:
        """The run's end, published by its writer after the events before it (a second one loses, as to a
        cancel)."""
        run.ending = run.ending or "ended"
        if run.end is None:
            run.end = run.record(response)
        self._flush(run)

    async def cancel(self, found: StoredResponse) -> dict[str, Any]:
        """Cancel a background response that was still running when read: `cancelled` published (or, when its run
        ended first, that end), and its run aborted here or by its own process (the module's docstring)."""
        response = {**found.response, "status": "cancelled"}
        response_id = response["id"]
        run = self._runs.get(response_id)
        if run is not None and run.ending == "ended" and run.writer is not None:
            await asyncio.shield(run.writer)  # its own end is decided (its writer has it): that end answers
        first = await asyncio.to_thread(self.store.end_now, response_id, StoredResponse(
            found.tenant, response, found.input_items))
        if first is not None:
            return first.response  # it ended (or was cancelled) first: that end, as a second cancel answers
        if run is not None and run.task is not None:
            run.ending = "cancelled"
            run.task.cancel()  # its _generate's finally sends the abort
        return response

    async def settle(self, found: StoredResponse) -> StoredResponse:
        """A record read back: a running one whose process is gone (killed on this host) published `failed`."""
        if found.response.get("status") not in RUNNING or found.response["id"] in self._runs \
                or not owner_gone(found.owner):
            return found
        response = {**found.response, "status": "failed", "error": {"code": "server_error", "message": GONE}}
        record = StoredResponse(found.tenant, response, found.input_items)
        first = await asyncio.to_thread(self.store.end_now, response["id"], record)
        return first if first is not None else record

    async def _watch_cancels(self) -> None:
        """Cancel the runs whose end another process published (a cancel), or whose record it deleted after one
        (before this look), while there are any."""
        try:
            while self._runs:
                await asyncio.sleep(CANCEL_CHECK_S)
                runs = list(self._runs.values())
                ended = await asyncio.to_thread(self._ended, [run.response_id for run in runs])
                for run, done in zip(runs, ended, strict=True):
                    if done and run.task is not None and not run.task.done() and not run.ending:
                        run.ending = "cancelled"
                        run.task.cancel()
        finally:
            self._watch = None

    async def events(self, found: StoredResponse, starting_after: int, run: Run | None = None) -> AsyncIterator[bytes]:
        """A streamed background response's events after `starting_after` as SSE bytes, until its last: from this
        process's run while it runs here, else from its log in the store (another process's run, or one that
        ended), read again every TAIL_S while nothing new comes, until it ends."""
        run = run or self._runs.get(found.response["id"])
        source = self._run_events(run) if run is not None else self._logged_events(found)
        async for number, kind, line in source:
            if number > starting_after:
                yield b"event: " + kind.encode() + b"\ndata: " + line + b"\n\n"
            if kind in LAST_EVENTS:
                return

    async def _run_events(self, run: Run) -> AsyncIterator[tuple[int, str, bytes]]:
        i = 0
        while True:
            while i < run.num_logged:
                yield run.events[i]
                i += 1
            if run.task is None or (run.task.done() and (run.writer is None or run.writer.done())):
                return
            await run.changed.wait()

    async def _logged_events(self, found: StoredResponse) -> AsyncIterator[tuple[int, str, bytes]]:
        response_id, offset, pending, num_quiet = found.response["id"], 0, b"", 0
        last_number, current = -1, found
        while num_quiet < 2:  # ended, and nothing came in the read after: a cancel, or a log cut short
            data = await asyncio.to_thread(self.store.read_events, response_id, offset)
            if data is None:
                return  # deleted, or dropped past the store's count
            offset += len(data)
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                try:
                    event = msgspec.json.decode(line)
                except msgspec.DecodeError:  # a write cut short (a full disk): the events after it still come
                    log.warning("skipped a broken event in the log of %s", response_id)
                    continue
                last_number = event["sequence_number"]
                yield last_number, event["type"], line
            if data:
                num_quiet = 0
            else:
                read = await self.store.get(response_id, found.tenant)
                current = await self.settle(read) if read is not None else found
                ended = read is None or current.response.get("status") not in RUNNING
                num_quiet = num_quiet + 1 if ended else 0
            await asyncio.sleep(TAIL_S)
        error = current.response.get("error") if current.response.get("status") == "failed" else None
        if isinstance(error, dict):  # its process died mid-run (settle): its log has no last event to say so
            yield last_number + 1, "error", encode_json({"type": "error", "code": error.get("code"),
                                                         "message": error.get("message", ""), "param": None,
                                                         "sequence_number": last_number + 1})

    def _ended(self, response_ids: list[str]) -> list[bool]:
        return [self.store.ended(response_id) for response_id in response_ids]

    async def close(self, _app: web.Application | None = None) -> None:
        """The shutdown (after the drain's grace and its failing of what was left): every run still going ends
        `failed`, written so, never left in_progress."""
        runs = [run for run in self._runs.values() if run.task is not None and not run.task.done()]
        if runs:
            log.warning("ending %d background response(s) at shutdown", len(runs))
        started = time.monotonic()
        for run in runs:
            run.ending = run.ending or "shutdown"
            assert run.task is not None
            run.task.cancel()
        await asyncio.gather(*(run.task for run in runs if run.task is not None), return_exceptions=True)
        await asyncio.gather(*(run.writer for run in runs if run.writer is not None), return_exceptions=True)
        if self._watch is not None:
            self._watch.cancel()
        log.debug("background responses ended in %.3f s", time.monotonic() - started)


def _changed(run: Run) -> None:
    """Wake the run's readers here (each waits on the event of its time)."""
    run.changed.set()
    run.changed = asyncio.Event()
