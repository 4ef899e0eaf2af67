"""The Responses API's store (--responses-store N): finished responses kept so that previous_response_id continues
one and GET / DELETE /v1/responses/{id} and its input_items read it.

One JSON file a response in a folder every api process of the server shares (a response made by one process is
read by another), written whole and renamed into place so that a reader never sees half a file. Past N files the
oldest are removed (a background response still running is kept). A response belongs to the tenant (API key) that
made it: another tenant gets "not found".

A background response (services/api/background.py) is written while it runs (queued, in_progress), then ends once:
its terminal record is published by a hard link to `{id}.end`, which only the first of its run's end, a cancel
from any api process, or the shutdown can make (link(2) fails when the name exists, on a local folder and on NFS
alike), and then renamed over `{id}.json`. So two processes never both decide how it ended, and a loser reads the
winner's record from `{id}.end`.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

RESPONSE_ID_RE = re.compile(r"resp_[0-9a-f]{32}")  # the ids this server makes (and so the only file names read)
_OWNER, _NO_OWNER = b'{"owner":', b'{"owner":""'  # how a record starts (_temporary), and a finished one


@dataclass(slots=True, frozen=True)
class StoredResponse:
    tenant: str  # "" without API keys
    response: dict[str, Any]  # the response object, as the answer gave it
    input_items: list[dict[str, Any]]  # the conversation before its output (earlier turns included), each with an id
    owner: str = ""  # a running background response's: the api process that runs it (background.process_name())

    def conversation(self) -> list[dict[str, Any]]:
        """What a response continuing this one starts from: its input items, then its output items."""
        return [*self.input_items, *self.response.get("output", [])]


class ResponseStore:
    def __init__(self, folder: Path, capacity: int) -> None:
        assert capacity > 0, capacity
        self.folder = folder
        self.capacity = capacity
        # the folder is scanned for the oldest every this many puts of this process, on a worker thread (a scan stats
        # every file: ~120 ms at 10,000 on the 2-core build host), so a large store may hold up to that many more
        # files a process for a while; below 128 at every put, on the caller's thread
        self.evict_every = max(1, capacity // 64)
        self._puts = 0
        self._evicting = False
        self._count_lock = threading.Lock()  # puts come from the event loop's thread and from worker threads
        folder.mkdir(parents=True, exist_ok=True)

    async def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The response, or None when it is not kept (never made, not stored, dropped, deleted, another tenant's)."""
        return await asyncio.to_thread(self._get, response_id, tenant)

    async def delete(self, response_id: str, tenant: str) -> bool:
        return await asyncio.to_thread(self._delete, response_id, tenant)

    def _path(self, response_id: str) -> Path | None:
        return self.folder / f"{response_id}.json" if RESPONSE_ID_RE.fullmatch(response_id) else None

    def put_now(self, response_id: str, record: StoredResponse) -> None:
        """Keep a finished response, on the caller's thread: the api writes it before the answer's last bytes go out
        (one file; a conversation near --max-prompt-bytes, 4.4 MB, took 14.6 ms), so a client that continues it at
        once finds it. Dropping the oldest: see evict_every."""
        path = self._path(response_id)
        assert path is not None, response_id
        os.replace(self._temporary(path, record), path)
        self._count_put()

    def put_running(self, response_id: str, record: StoredResponse) -> None:
        """A background response's queued or in_progress record, which never hides its terminal one: one that ended
        meanwhile (a cancel from another process between the check and the rename) is put back over it."""
        path = self._path(response_id)
        assert path is not None, response_id
        end = path.with_suffix(".end")
        if end.exists():
            return
        os.replace(self._temporary(path, record), path)
        ended = self._read(end)
        if ended is not None:
            os.replace(self._temporary(path, ended), path)
        self._count_put()

    def end_now(self, response_id: str, record: StoredResponse) -> StoredResponse | None:
        """Publish a background response's terminal record, once (see the module's docstring): None when this call
        did, else the record that ended it first (kept unchanged). One deleted meanwhile (cancelled by another
        process, then deleted before its run saw the cancel) stays deleted: nothing is written back."""
        path = self._path(response_id)
        assert path is not None, response_id
        temporary = self._temporary(path, record)
        try:
            os.link(temporary, path.with_suffix(".end"))
        except FileExistsError:
            temporary.unlink()
            return self._read(path.with_suffix(".end"))
        if not path.exists():  # deleted (a running record is never dropped past the count)
            for name in (temporary, path.with_suffix(".end"), path.with_suffix(".events")):
                name.unlink(missing_ok=True)
            return None
        os.replace(temporary, path)
        self._count_put()
        return None

    def append_events(self, response_id: str, lines: bytes) -> None:
        """A streamed background response's events, one JSON object a line, added to its log `{id}.events` (read
        from any api process to resume the stream). One write: a reader may see a line cut short, never reordered.
        Nothing once the response is deleted (its run may not have seen the cancel yet)."""
        path = self._path(response_id)
        assert path is not None, response_id
        if not path.exists():
            return
        with open(path.with_suffix(".events"), "ab") as log:
            log.write(lines)

    def read_events(self, response_id: str, offset: int) -> bytes | None:
        """The event log's bytes from `offset` (b"": none yet); None when the response keeps no log."""
        path = self._path(response_id)
        try:
            with open(path.with_suffix(".events") if path is not None else "", "rb") as log:
                log.seek(offset)
                return log.read()
        except FileNotFoundError:
            return None

    def has_events(self, response_id: str) -> bool:
        """Whether the response keeps an event log (it was created streamed in the background)."""
        path = self._path(response_id)
        return path is not None and path.with_suffix(".events").exists()

    def drop_now(self, response_id: str) -> None:
        """Remove a background response's record that never ran (refused before its prompt was admitted)."""
        path = self._path(response_id)
        if path is not None:
            path.unlink(missing_ok=True)
            path.with_suffix(".events").unlink(missing_ok=True)

    def ended(self, response_id: str) -> bool:
        """A background response's terminal record is published (it may be in no api process's hands any more), or
        it is deleted (a cancel from another process, then a delete before its run looked)."""
        path = self._path(response_id)
        return path is None or path.with_suffix(".end").exists() or not path.exists()

    def _temporary(self, path: Path, record: StoredResponse) -> Path:
        """The record written whole beside `path`, stamped now, to be renamed or linked into place."""
        temporary = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        # the owner first: eviction tells a running record from its first bytes (_running)
        temporary.write_bytes(msgspec.json.encode({"owner": record.owner, "tenant": record.tenant,
                                                   "response": record.response, "input_items": record.input_items}))
        written = time.time_ns()  # set exactly: the file system's own stamps are as coarse as the kernel's tick
        os.utime(temporary, ns=(written, written))
        return temporary

    def _count_put(self) -> None:
        with self._count_lock:
            self._puts += 1
            if self._puts % self.evict_every or self._evicting:
                return
            self._evicting = True
        if self.evict_every == 1:  # a store of < 128: its scan is short, so the count holds exactly
            self._evict()
            return
        try:
            asyncio.get_running_loop().run_in_executor(None, self._evict)
        except RuntimeError:  # no event loop (a direct call): at once
            self._evict()

    def _get(self, response_id: str, tenant: str) -> StoredResponse | None:
        path = self._path(response_id)
        found = self._read(path) if path is not None else None
        return found if found is not None and found.tenant == tenant else None

    @staticmethod
    def _running(path: str) -> bool:
        """Whether the record is a background response's still running (only such a record names its owner), read
        from its first bytes where _temporary writes the owner (a whole record of the layout before that)."""
        try:
            with open(path, "rb") as file:
                head = file.read(len(_NO_OWNER))
        except FileNotFoundError:
            return False
        if head.startswith(_OWNER):
            return head != _NO_OWNER
        found = ResponseStore._read(Path(path))
        return found is not None and bool(found.owner)

    @staticmethod
    def _read(path: Path) -> StoredResponse | None:
        try:
            data = msgspec.json.decode(path.read_bytes())
        except (FileNotFoundError, msgspec.DecodeError):
            return None
        return StoredResponse(data["tenant"], data["response"], data["input_items"], data.get("owner", ""))

    def _delete(self, response_id: str, tenant: str) -> bool:
        path = self._path(response_id)
        if path is None or self._get(response_id, tenant) is None:
            return False
        try:
            path.unlink()
        except FileNotFoundError:
            return False  # another process deleted or dropped it meanwhile
        path.with_suffix(".end").unlink(missing_ok=True)
        path.with_suffix(".events").unlink(missing_ok=True)
        return True

    def _evict(self) -> None:
        """Past `capacity` finished responses, remove the oldest (by modification time, which put_now sets to its
        clock's ns; several processes may race to remove the same one). A background response still running is
        neither removed (it would read "not found" and could not be cancelled while its run went on, and its end
        would write it back) nor counted: so the store holds its count of finished responses and those running
        (counted, N runs going dropped every response made meanwhile at once); one whose process was killed stays
        running until a read finds it so (BackgroundRuns.settle publishes it failed)."""
        try:
            self._drop_oldest()
        finally:
            self._evicting = False

    def _drop_oldest(self) -> None:
        files = []
        with os.scandir(self.folder) as entries:
            for entry in entries:
                if entry.name.endswith(".json"):
                    try:
                        files.append((entry.stat().st_mtime_ns, entry.path))
                    except FileNotFoundError:
                        pass  # removed since the listing
        if len(files) <= self.capacity:
            return
        finished = sorted(file for file in files if not self._running(file[1]))
        for _, path in finished[:max(len(finished) - self.capacity, 0)]:
            stem = path.removesuffix(".json")
            for name in (path, stem + ".end", stem + ".events"):  # a background response's end and events with it
                try:
                    os.unlink(name)
                except FileNotFoundError:
                    pass
