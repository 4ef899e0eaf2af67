"""A client that hangs up while the api reads its request, or while its answer is made, is not a server error: it
is counted as 499, with no traceback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pagoda.services.api.app import error_middleware
from pagoda.services.api.metrics import ApiMetrics

RouteHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _client_leaves(route: str, handler: RouteHandler, sent: bytes, started: asyncio.Event,
                         ended: asyncio.Event) -> ApiMetrics:
    """Serve `handler` at `route` behind the error middleware (with handler cancellation, as services/api/server.py
    runs the app); a client sends `sent` and closes its connection once the handler has `started`; returns the
    metrics once the handler has `ended` and the middleware has counted the request as 499 (a failure after 10 s)."""
    metrics = ApiMetrics(lambda: None)
    app = web.Application(middlewares=[error_middleware(metrics)])
    app.router.add_post(route, handler)
    async with TestServer(app, handler_cancellation=True) as server:
        _, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode() + sent)
        await writer.drain()
        await asyncio.wait_for(started.wait(), 10)
        writer.close()
        await asyncio.wait_for(ended.wait(), 10)

        async def counted() -> None:
            while metrics.registry.get_sample_value("pagoda_http_requests_total",
                                                    {"route": route, "status": "499"}) is None:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(counted(), 10)
    return metrics


def test_client_leaving_mid_body_is_not_counted_as_a_500(caplog: pytest.LogCaptureFixture) -> None:
    async def call() -> ApiMetrics:
        started, done = asyncio.Event(), asyncio.Event()

        async def reads_body(request: web.Request) -> web.Response:
            started.set()
            try:
                await asyncio.wait_for(request.read(), 30)  # as Handlers._body reads it
                return web.json_response({})
            finally:
                done.set()

        half_body = b"Content-Length: 1000\r\n\r\n{\"prompt\": \"half a bo"  # its read waits for the rest
        return await _client_leaves("/read", reads_body, half_body, started, done)

    with caplog.at_level(logging.INFO, logger="pagoda.services.api.app"):
        metrics = asyncio.run(call())
    assert metrics.registry.get_sample_value("pagoda_http_requests_total",
                                             {"route": "/read", "status": "500"}) is None
    assert metrics.registry.get_sample_value("pagoda_http_requests_total",
                                             {"route": "/read", "status": "499"}) == 1.0
    records = [r for r in caplog.records if r.name == "pagoda.services.api.app"]
    assert not any(r.levelno >= logging.ERROR or r.exc_info for r in records), \
        [(r.levelname, r.getMessage()) for r in records]


def test_client_leaving_while_its_answer_is_made_is_counted_as_499() -> None:
    """A client that hangs up while its request runs (a long generation): aiohttp cancels the handler
    (handler_cancellation), and the middleware counts the request as 499 rather than not at all."""

    async def call() -> ApiMetrics:
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def generates(request: web.Request) -> web.Response:
            started.set()
            try:
                await asyncio.Event().wait()  # an answer that takes longer than the client waits
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return web.json_response({})

        return await _client_leaves("/generate", generates, b"Content-Length: 2\r\n\r\n{}", started, cancelled)

    metrics = asyncio.run(call())
    assert metrics.registry.get_sample_value("pagoda_http_requests_total",
                                             {"route": "/generate", "status": "499"}) == 1.0
