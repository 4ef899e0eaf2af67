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
        done = handled()

        async def reads_body(request: web.Request) -> web.Response:
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
            await asyncio.sleep(0.2)  # the handler is reading the body
            writer.close()
            await asyncio.wait_for(done.wait(), 10)
            await asyncio.sleep(0.1)  # the middleware has counted it
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
