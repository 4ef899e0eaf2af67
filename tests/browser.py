"""Headless Chromium driven over the Chrome DevTools Protocol (a websocket, aiohttp's client): just what the
console's browser test needs: open a page, run script in it, wait for a condition, take screenshots, and
collect the page's uncaught errors. Debian's `chromium` package; no driver download."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
START_TIMEOUT_S = 60.0


def find_browser() -> str | None:
    """The Chromium binary: $PAGODA_CHROMIUM, else the first of BROWSER_NAMES on PATH."""
    given = os.environ.get("PAGODA_CHROMIUM")
    if given:
        return given
    return next((path for name in BROWSER_NAMES if (path := shutil.which(name))), None)


class PageError(AssertionError):
    """Script in the page threw, or a wait timed out."""


class Browser:
    """One headless Chromium with one page; use `async with Browser.launch(...) as page`."""

    def __init__(self, process: subprocess.Popen[bytes], profile: Path, session: aiohttp.ClientSession,
                 socket: aiohttp.ClientWebSocketResponse) -> None:
        self.process = process
        self.profile = profile
        self._session = session
        self._socket = socket
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.errors: list[str] = []  # uncaught exceptions and console.error calls in the page
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def launch(cls, binary: str, width: int = 1360, height: int = 900) -> Browser:
        profile = Path(tempfile.mkdtemp(prefix="pagoda-chromium-"))
        process = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
             f"--window-size={width},{height}", "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--disable-background-networking", "--disable-sync", "--hide-scrollbars",
             "--mute-audio", "--force-device-scale-factor=1", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            port = await _devtools_port(profile, process)
            session = aiohttp.ClientSession()
            async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
                targets = json.loads(await response.text())
            page = next(t for t in targets if t.get("type") == "page")
            socket = await session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=64 << 20)
        except BaseException:
            process.kill()
            process.wait()
            shutil.rmtree(profile, ignore_errors=True)
            raise
        browser = cls(process, profile, session, socket)
        await browser.send("Runtime.enable")
        await browser.send("Page.enable")
        return browser

    async def __aenter__(self) -> Browser:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self._socket.close()
        await self._session.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    # ------------------------------------------------------------------ protocol

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        message_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[message_id] = future
        await self._socket.send_str(json.dumps({"id": message_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(future, 60)
        if "error" in reply:
            raise PageError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    async def _read(self) -> None:
        async for message in self._socket:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
            elif data.get("method") == "Runtime.exceptionThrown":
                details = data["params"]["exceptionDetails"]
                self.errors.append(details.get("exception", {}).get("description") or details.get("text", "?"))
            elif data.get("method") == "Runtime.consoleAPICalled" and data["params"].get("type") == "error":
                self.errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in
                                            data["params"].get("args", [])))

    # ------------------------------------------------------------------ the page

    async def evaluate(self, expression: str) -> Any:
        """The value of a script expression (awaited when it is a promise)."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise PageError(details.get("exception", {}).get("description") or details.get("text", "?"))
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        """Poll a script condition until it is truthy (the page has no event to wait on from here); its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise PageError(f"timed out after {timeout} s waiting for {what} ({expression})")
            await asyncio.sleep(0.1)

    async def open(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'", 30,
                            f"{url} to load")

    async def set_value(self, selector: str, value: str | bool) -> None:
        """Set an input's value (or a checkbox) and fire the events a user's edit fires."""
        script = f"""(() => {{
            const node = document.querySelector({json.dumps(selector)});
            if (!node) throw new Error("no element " + {json.dumps(selector)});
            if (node.type === "checkbox") node.checked = {json.dumps(bool(value))};
            else node.value = {json.dumps(value)};
            node.dispatchEvent(new Event("input", {{bubbles: true}}));
            node.dispatchEvent(new Event("change", {{bubbles: true}}));
        }})()"""
        await self.evaluate(script)

    async def click(self, selector: str) -> None:
        await self.evaluate(f"""(() => {{
            const node = document.querySelector({json.dumps(selector)});
            if (!node) throw new Error("no element " + {json.dumps(selector)});
            node.click();
        }})()""")

    async def text(self, selector: str) -> str:
        return str(await self.evaluate(f"(document.querySelector({json.dumps(selector)}) || {{}}).textContent || ''"))

    async def screenshot(self, path: Path) -> Path:
        result = await self.send("Page.captureScreenshot", format="png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(result["data"]))
        return path


async def _devtools_port(profile: Path, process: subprocess.Popen[bytes]) -> int:
    """Chromium writes the port it picked to <profile>/DevToolsActivePort once it listens."""
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"chromium exited with code {process.returncode} at start-up")
        text = marker.read_text() if marker.exists() else ""
        if text.strip():
            return int(text.split()[0])
        await asyncio.sleep(0.05)
    raise RuntimeError(f"chromium did not open its DevTools port within {START_TIMEOUT_S} s")
