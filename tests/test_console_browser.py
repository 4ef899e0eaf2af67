"""The console in a real browser: `pagoda serve` with SmolLM2 behind an API key, headless Chromium over the
DevTools protocol (tests/browser.py). The page asks for the key; the playground streams a chat reply (with the
per-token view), stops and regenerates, and returns schema-valid JSON under a JSON-schema constraint; the live
view's numbers move under load and a killed tokenizer shows as restarting, then ok; the request inspector
lists the requests with their timelines and no prompt text.

Screenshots go to the test's tmp folder; with PAGODA_CONSOLE_SCREENSHOTS=DIR two of them (the playground
mid-stream, the live view under load) are also written to DIR (docs/ holds the committed ones).
`make test` installs Chromium (Debian's package) and sets PAGODA_BROWSER_REQUIRED=1: there a missing browser
fails the test; elsewhere it is skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.browser import Browser, find_browser
from tests.harness import Server, running_server

pytestmark = pytest.mark.slow

KEY = "sk-console-test"
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "required": ["name", "age"], "additionalProperties": False}
CHAT_PROMPT = "Describe the colors of the rainbow in a short paragraph."


@pytest.fixture(scope="module")
def browser_binary() -> str:
    binary = find_browser()
    if binary is None:
        message = "no Chromium: `make test` installs it (apt-get install chromium), or set PAGODA_CHROMIUM"
        if os.environ.get("PAGODA_BROWSER_REQUIRED"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


def test_console_in_a_browser(smollm2_dir: Path, browser_binary: str, tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer"  # its own folder: the restart part hides it to hold the new tokenizer back
    shutil.copytree(smollm2_dir, tokenizer, ignore=shutil.ignore_patterns("*.safetensors"))
    with running_server(smollm2_dir, "--restart-on-failure", "--api-key", KEY, "--tokenizer", str(tokenizer)) as server:
        asyncio.run(_drive(server, browser_binary, tmp_path / "screenshots", tokenizer))


async def _drive(server: Server, binary: str, shots: Path, tokenizer: Path) -> None:
    async with await Browser.launch(binary) as page:
        await page.open(server.url + "/")
        for part in (_enter_key(page), _chat_streams(page, shots), _stop_and_regenerate(page), _json_schema(page),
                     _live_view(page, server, shots), _tokenizer_restart(page, server, shots, tokenizer),
                     _inspector(page, shots)):
            started = time.monotonic()
            await part
            print(f"{part.__name__}: {time.monotonic() - started:.1f} s")  # where the test's time goes (-s)
        assert page.errors == [], f"the page threw: {page.errors}"
    docs = os.environ.get("PAGODA_CONSOLE_SCREENSHOTS")
    if docs:
        for name in ("console-playground.png", "console-live.png"):
            shutil.copy(shots / name, Path(docs) / name)


async def _enter_key(page: Browser) -> None:
    """The data routes answer 401 without the key: the page asks for it, refuses a wrong one, keeps the right one."""
    await page.wait_for("!document.getElementById('key-dialog').hidden", 20, "the key dialog")
    await page.set_value("#key-input", "sk-wrong")
    await page.click("#key-save")
    await page.wait_for("document.getElementById('key-error').textContent.includes('refused')", 20,
                        "the wrong key refused")
    await page.set_value("#key-input", KEY)
    await page.click("#key-save")
    await page.wait_for("PG.info && PG.info.model === 'smollm2-135m-instruct'", 20, "the console's info")
    assert await page.evaluate("localStorage.getItem('pagoda.apiKey')") == KEY


async def _send(page: Browser, text: str, max_tokens: int) -> None:
    await page.set_value("#pg-max-tokens", str(max_tokens))
    await page.set_value("#pg-input", text)
    await page.click("#pg-send")


async def _chat_streams(page: Browser, shots: Path) -> None:
    await page.set_value("#pg-temperature", "0")
    await page.set_value("#pg-logprobs", True)
    await page.set_value("#pg-top-logprobs", "3")
    await _send(page, CHAT_PROMPT, 48)
    early = await page.wait_for("PG.play.view && PG.play.view.text.length > 0 && "
                                "{status: PG.play.status, length: PG.play.view.text.length}", 60, "the first text")
    await page.wait_for("PG.play.status !== 'streaming' || PG.play.view.text.length >= 40", 120, "more text")
    await page.screenshot(shots / "console-playground.png")  # mid-stream, unless the reply is that short
    await page.wait_for("PG.play.status === 'done'", 120, "the reply to finish")
    view = await page.evaluate("({text: PG.play.view.text, chunks: PG.play.view.chunks, finish: PG.play.view.finish,"
                               " usage: PG.play.view.usage, tokens: PG.play.view.tokens.length,"
                               " spread_ms: PG.play.view.lastAt - PG.play.view.firstAt})")
    # in pieces, over time: tens of CPU decode steps cannot all land in one read of the stream
    assert view["chunks"] >= 2 and view["spread_ms"] > 100, view
    assert early["status"] != "streaming" or early["length"] < len(view["text"]), (early, view["text"])
    assert view["finish"] in ("stop", "length")
    # one coloured span per generated token (an EOS that ended the reply has no text, and no entry)
    assert view["usage"]["completion_tokens"] - (view["finish"] == "stop") <= view["tokens"] \
        <= view["usage"]["completion_tokens"]
    spans = await page.evaluate("document.querySelectorAll('#pg-transcript .tok').length")
    assert spans == view["tokens"]
    assert (await page.text("#pg-ttft")).endswith(("ms", " s")) and "tok/s" in await page.text("#pg-tps")
    assert await page.text("#pg-finish") == view["finish"]
    # the alternatives of a token, on hover
    await page.evaluate("""(() => { const span = document.querySelector('#pg-transcript .tok');
        const box = span.getBoundingClientRect();
        span.dispatchEvent(new MouseEvent('mousemove',
                                          {bubbles: true, clientX: box.x + 2, clientY: box.y + 2})); })()""")
    assert await page.evaluate("!document.getElementById('token-tip').hidden && "
                               "document.querySelectorAll('#token-tip tr').length >= 2")
    # the request as code: the same body, in curl and in Python
    curl = await page.text("#pg-snippet-text")
    assert curl.startswith("curl -N ") and '"top_logprobs": 3' in curl
    assert "Authorization: Bearer $PAGODA_API_KEY" in curl
    await page.click(".snippet-lang[data-lang=python]")
    python = await page.text("#pg-snippet-text")
    assert "client.chat.completions.create(" in python and "top_logprobs=3," in python
    compile(python, "snippet.py", "exec")  # the Python shown is valid Python
    await page.set_value("#pg-logprobs", False)


async def _stop_and_regenerate(page: Browser) -> None:
    await _send(page, "Tell me a long story about a lighthouse keeper.", 400)
    await page.wait_for("PG.play.status === 'streaming'", 60, "the story to start")
    await page.click("#pg-stop-button")
    await page.wait_for("PG.play.status === 'stopped'", 20, "the stop")
    assert await page.text("#pg-finish") == "stopped"
    await page.set_value("#pg-max-tokens", "8")
    await page.click("#pg-regenerate")
    await page.wait_for("PG.play.status === 'done'", 60, "the regenerated reply")
    roles = await page.evaluate("PG.play.messages.map((m) => m.role)")
    assert roles == ["user", "assistant", "user", "assistant"], roles  # the stopped reply was replaced


async def _json_schema(page: Browser) -> None:
    await page.click("#pg-clear")
    await page.set_value("#pg-constraint", "json")
    assert "properties" in await page.evaluate("document.getElementById('pg-constraint-text').value")
    await page.set_value("#pg-constraint-text", json.dumps(PERSON_SCHEMA))
    await _send(page, "Describe a person as JSON with a name and an age.", 96)
    await page.wait_for("PG.play.status === 'done'", 120, "the JSON reply")
    text = await page.text("#pg-output")
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    assert await page.text("#pg-finish") == "stop"
    assert '"response_format"' in await page.evaluate("document.getElementById('pg-snippet-text').textContent") or \
        "response_format=" in await page.text("#pg-snippet-text")
    await page.set_value("#pg-constraint", "")


def _load(server: Server, stop: threading.Event, num_streams: int = 4) -> threading.Thread:
    """Streams of completions until `stop` (errors are expected once the tokenizer is killed)."""

    def one() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                try:
                    with client.stream("POST", server.url + "/v1/completions",
                                       headers={"Authorization": f"Bearer {KEY}"},
                                       json={"prompt": "Once upon a time", "max_tokens": 48, "stream": True,
                                             "ignore_eos": True}) as response:
                        for _ in response.iter_lines():
                            pass
                except httpx.HTTPError:
                    pass

    threads = [threading.Thread(target=one, daemon=True) for _ in range(num_streams)]
    for thread in threads:
        thread.start()
    joiner = threading.Thread(target=lambda: [t.join() for t in threads], daemon=True)
    joiner.start()
    return joiner


async def _live_view(page: Browser, server: Server, shots: Path) -> None:
    await page.click("#tab-button-live")
    stop = threading.Event()
    load = _load(server, stop)
    try:
        await page.wait_for("Number(document.getElementById('live-running').dataset.value) >= 2 && "
                            "Number(document.getElementById('live-tokens-out').dataset.value) > 0", 60,
                            "the live view under load")
        readings: list[dict[str, Any]] = []
        for _ in range(3):
            ticks = await page.evaluate("PG.live.ticks")
            await page.wait_for(f"PG.live.ticks > {ticks}", 10, "the next tick")
            readings.append(await page.evaluate(
                "({out: Number(document.getElementById('live-tokens-out').dataset.value),"
                " total: PG.live.latest.engine.generation_tokens_total,"
                " kv: Number(document.getElementById('live-kv').dataset.value)})"))
        await page.screenshot(shots / "console-live.png")
    finally:
        stop.set()
        await asyncio.to_thread(load.join, 120)
    assert readings[0]["total"] < readings[-1]["total"], readings
    assert len({r["out"] for r in readings}) > 1 and all(r["out"] > 0 for r in readings), readings
    assert all(r["kv"] > 0 for r in readings)
    assert await page.evaluate("PG.live.history.rows.length") >= 3
    processes = await page.evaluate("[...document.querySelectorAll('#live-processes tbody tr')]"
                                    ".map((r) => [r.dataset.name, r.dataset.state])")
    assert dict(processes) == {"worker0": "ok", "scheduler": "ok", "tokenizer0": "ok", "api0": "ok"}, processes


async def _tokenizer_restart(page: Browser, server: Server, shots: Path, tokenizer: Path) -> None:
    """While its folder is hidden every replacement tokenizer exits at start, so the row stays `restarting` until
    the test puts the folder back (a replacement that came up at once could say hello between two of the page's
    ticks, and the state would never be shown)."""
    hidden = tokenizer.with_name(tokenizer.name + ".hidden")
    tokenizer.rename(hidden)
    [old_pid] = server.children()["tokenizer"]
    os.kill(old_pid, signal.SIGKILL)
    row = "document.querySelector('#live-processes tr[data-name=tokenizer0]')"
    try:
        await page.wait_for(f"{row} && {row}.dataset.state === 'restarting'", 30, "the tokenizer shown restarting")
        await page.screenshot(shots / "console-tokenizer-restarting.png")
    finally:
        hidden.rename(tokenizer)
    await page.wait_for(f"{row}.dataset.state === 'ok' && {row}.children[3].textContent !== '{old_pid}'", 90,
                        "the new tokenizer shown ok")
    restarts = int(await page.evaluate(f"{row}.children[5].textContent"))
    assert restarts >= 1  # one for the kill, one more for each replacement that found no folder


async def _inspector(page: Browser, shots: Path) -> None:
    await page.click("#tab-button-requests")
    # the playground's chat requests, finished, with the scheduler's part of their timeline joined
    await page.wait_for("PG.inspect.requests.filter((r) => r.route === 'chat' && r.status === 'ok' && "
                        "r.timeline.some((e) => e.event === 'scheduled')).length >= 3", 30,
                        "the chat requests with their timelines")
    requests = await page.evaluate("PG.inspect.requests")
    chats = [r for r in requests if r["route"] == "chat"]
    assert [r["status"] for r in chats][-2:] == ["aborted", "ok"]  # oldest last: the first reply, then the stop
    first = chats[-1]
    events = [e["event"] for e in first["timeline"]]
    for name in ("arrived", "tokenized", "queued", "scheduled", "first token", "finished"):
        assert name in events, events
    assert [e["ms"] for e in first["timeline"]] == sorted(e["ms"] for e in first["timeline"])
    assert first["completion_tokens"] > 0 and first["finish_reasons"]
    assert all("prompt" not in r for r in requests)  # no --console-show-prompts: no prompt text kept
    await page.evaluate(f"document.querySelector('#req-table tr[data-id=\"{first['id']}\"]').click()")
    await page.wait_for("document.querySelectorAll('#req-events tr').length >= 6", 10, "the timeline")
    assert CHAT_PROMPT not in await page.evaluate("document.body.innerText")
    await page.screenshot(shots / "console-requests.png")
