"""The console's HTTP routes: the page and its static files (open), and its data under /console/api/ (behind the
API key when one is set: the page asks for the key and sends it as any client does).

    GET /                          the page (static/index.html)
    GET /console/static/{name}     its scripts and styles, read once at start-up
    GET /console/api/info          the served model and the console's settings
    GET /console/api/stats         the latest live snapshot (JSON)
    GET /console/api/stream        SSE: "history" (ten minutes of rows + the latest snapshot), then "tick" per second
    GET /console/api/requests      the request inspector: in flight, then the last N finished, newest first
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from pagoda.services.api.console.inspector import RequestLog
from pagoda.services.api.console.live import LiveStats, TenantSource
from pagoda.services.api.handlers import SSE_HEADERS, ApiState, json_response

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
API_PREFIX = "/console/api/"  # the data routes: app.py protects this prefix with the API key


def load_static(folder: Path = STATIC_DIR) -> dict[str, tuple[bytes, str]]:
    """Every servable file of the folder by name, with its content type (read once: a handful of small files)."""
    files = {path.name: (path.read_bytes(), CONTENT_TYPES[path.suffix]) for path in sorted(folder.iterdir())
             if path.is_file() and path.suffix in CONTENT_TYPES}
    if "index.html" not in files:
        raise FileNotFoundError(f"the console's page is missing from {folder} (a broken install?)")
    return files


class Console:
    """What the console adds to one api process: its routes, the live stats and the request log."""

    def __init__(self, state: ApiState, health: Callable[[], list[str]],
                 tenant_source: TenantSource | None = None) -> None:
        assert state.console_requests is not None, "the request log is made with the state (console on)"
        self.state = state
        self.requests: RequestLog = state.console_requests
        self.live = LiveStats(state.config, state.stats, state.metrics, state.pool, self.requests, health,
                              tenant_source)
        self.files = load_static()

    def install(self, app: web.Application) -> None:
        app.add_routes([
            web.get("/", self.index),
            web.get("/console/static/{name}", self.static),
            web.get(API_PREFIX + "info", self.info),
            web.get(API_PREFIX + "stats", self.stats),
            web.get(API_PREFIX + "stream", self.stream),
            web.get(API_PREFIX + "requests", self.request_list),
        ])
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)

    async def _on_startup(self, app: web.Application) -> None:
        self.live.start()

    async def _on_shutdown(self, app: web.Application) -> None:
        await self.live.close()  # open streams end, so that shutdown does not wait for them

    def _file(self, name: str) -> web.Response:
        found = self.files.get(name)
        if found is None:
            raise web.HTTPNotFound()
        body, content_type = found
        return web.Response(body=body, headers={"Content-Type": content_type, "Cache-Control": "no-cache"})

    async def index(self, request: web.Request) -> web.Response:
        return self._file("index.html")

    async def static(self, request: web.Request) -> web.Response:
        return self._file(request.match_info["name"])

    async def info(self, request: web.Request) -> web.Response:
        state = self.state
        latest = state.stats.latest
        return json_response({
            "model": state.served_model_name,
            "max_model_len": latest.max_model_len if latest is not None and latest.max_model_len else None,
            "show_prompts": state.config.console_show_prompts, "max_requests": state.config.console_max_requests,
            "auth": state.config.api_key is not None, "api_index": state.config.api_index,
            "api_workers": state.config.api_workers, "tick_s": 1.0})

    async def stats(self, request: web.Request) -> web.Response:
        return json_response(self.live.latest)

    async def request_list(self, request: web.Request) -> web.Response:
        return json_response({"show_prompts": self.requests.show_prompts, "max_requests": self.requests.max_finished,
                              "requests": self.requests.to_list()})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        queue = self.live.subscribe()
        try:
            await response.write(self.live.history_event())
            while (event := await queue.get()) is not None:
                await response.write(event)
        except ConnectionResetError:
            log.debug("a console stream's client left")
        finally:
            self.live.unsubscribe(queue)
        return response
