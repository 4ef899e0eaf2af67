"""A client that hangs up while the api reads its request is not a server error: no 500 counted, no traceback."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pagoda.services.api.app import error_middleware
from pagoda.services.api.metrics import ApiMetrics


def test_client_leaving_mid_body_is_not_counted_as_a_500(caplog: pytest.LogCaptureFixture) -> None:
    handled = asyncio.Event

    async def call() -> ApiMetrics:
        metrics = ApiMetrics(lambda: None)
        done, started = handled(), handled()

        async def reads_body(request: web.Request) -> web.Response:
            started.set()
            try:
                await asyncio.wait_for(request.read(), 30)  # as Handlers._body reads it
                return web.json_response({})
            finally:
                done.set()

        app = web.Application(middlewares=[error_middleware(metrics)])
        app.router.add_post("/read", reads_body)
        # handler_cancellation as services/api/server.py runs the app
        async with TestServer(app, handler_cancellation=True) as server:
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": \"half a bo")
            await writer.drain()
            await asyncio.wait_for(started.wait(), 10)  # the handler runs: its read waits for the rest
            writer.close()
            await asyncio.wait_for(done.wait(), 10)
            await _counted(metrics, "/read", "499")
        return metrics

    with caplog.at_level(logging.INFO, logger="pagoda.services.api.app"):
        metrics = asyncio.run(call())
    assert metrics.registry.get_sample_value("pagoda_http_requests_total",
                                             {"route": "/read", "status": "500"}) is None
    assert metrics.registry.get_sample_value("pagoda_http_requests_total",
                                             {"route": "/read", "status": "499"}) == 1.0
    records = [r for r in caplog.records if r.name == "pagoda.services.api.app"]
    assert not any(r.levelno >= logging.ERROR or r.exc_info for r in records), \
        [(r.levelname, r.getMessage()) for r in records]


async def _counted(metrics: ApiMetrics, route: str, status: str) -> None:
    """Until the middleware has counted one request of `route` with `status` (it does once the handler returns or
    is cancelled); a failure after 10 s."""
    async def counted() -> None:
        while metrics.registry.get_sample_value("pagoda_http_requests_total",
                                                {"route": route, "status": status}) is None:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(counted(), 10)


def test_client_leaving_while_its_answer_is_made_is_counted_as_499() -> None:
    """A client that hangs up while its request runs (a long generation): aiohttp cancels the handler
    (handler_cancellation), and the middleware counts the request as 499 rather than not at all."""

    async def call() -> ApiMetrics:
        metrics = ApiMetrics(lambda: None)
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def generates(request: web.Request) -> web.Response:
            started.set()
            try:
                await asyncio.Event().wait()  # an answer that takes longer than the client waits
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return web.json_response({})

        app = web.Application(middlewares=[error_middleware(metrics)])
        app.router.add_post("/generate", generates)
        async with TestServer(app, handler_cancellation=True) as server:
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2\r\n\r\n{}")
            await writer.drain()
            await asyncio.wait_for(started.wait(), 10)
            writer.close()
            await asyncio.wait_for(cancelled.wait(), 10)
            await _counted(metrics, "/generate", "499")
        return metrics

    metrics = asyncio.run(call())
    assert metrics.registry.get_sample_value("pagoda_http_requests_total",
                                             {"route": "/generate", "status": "499"}) == 1.0
