"""The api process: serve HTTP on a shared port until SIGTERM, then drain in-flight requests and exit."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import zmq.asyncio
from aiohttp import http_exceptions, web

from pagoda.services.api.app import build_app
from pagoda.services.api.console.inspector import RequestLog
from pagoda.services.api.handlers import ApiState
from pagoda.services.api.metrics import ApiMetrics
from pagoda.services.api.pool import TokenizerPool
from pagoda.services.api.registry import RegistryClient
from pagoda.services.api.stats import ReplicaStatsFeed
from pagoda.services.api.tenants import KeyTable, UsageLog
from pagoda.shared.config import EngineConfig, ServerConfig
from pagoda.shared.discovery import advertised, host_toward
from pagoda.shared.heap import settle_heap
from pagoda.shared.transport import load_cluster_keys

log = logging.getLogger(__name__)


class _ClientHttpErrors(logging.Filter):
    """aiohttp logs a request it cannot parse (a URL or header line past 8190 bytes, a malformed request line) with
    a traceback at ERROR, as if the server had failed; the client gets its 400. Such a record becomes one WARNING
    line naming the fault, so that server logs keep tracebacks for the server's own errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if (record.levelno >= logging.ERROR and isinstance(exc, http_exceptions.HttpProcessingError)
                and 400 <= exc.code < 500):
            record.msg, record.args = f"{record.getMessage()}: {exc.code} {exc.message}", None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


# aiohttp's protocol errors go to this logger (its own, aiohttp.server, is left as it is)
http_log = logging.getLogger(f"{__name__}.http")
http_log.addFilter(_ClientHttpErrors())

FAIL_FLUSH_S = 2.0  # after the grace period: time for handlers to write their error and return
CLOSE_TIMEOUT_S = 1.0  # then aiohttp cancels whatever is left
KEYS_POLL_S = 1.0  # how often the keys file's mtime is looked at


def served_model_name(engine_config: EngineConfig, config: ServerConfig) -> str:
    """The name responses report: the first --served-model-name, else the model folder's name."""
    names = config.served_model_names()
    return names[0] if names else os.path.basename(engine_config.model.rstrip("/")) or engine_config.model


def run_api(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT; returns after a clean shutdown."""
    load_cluster_keys(server_config.cluster_key_dir)
    try:
        import uvloop
    except ImportError:  # not on Windows; the default loop works, only slower
        asyncio.run(_serve(engine_config, server_config))
        return
    uvloop.run(_serve(engine_config, server_config))


def _cache_info(engine_config: EngineConfig) -> dict[str, str]:
    """vllm:cache_config_info's labels: the cache settings pagoda shares with vLLM's CacheConfig, as vLLM spells
    them (the block count joins from the scheduler's snapshot)."""
    return {"block_size": str(engine_config.block_size), "cache_dtype": engine_config.kv_cache_dtype,
            "enable_prefix_caching": str(engine_config.enable_prefix_caching),
            "gpu_memory_utilization": str(engine_config.gpu_memory_utilization)}


def _make_state(context: zmq.asyncio.Context, engine_config: EngineConfig, config: ServerConfig) -> ApiState:
    name = served_model_name(engine_config, config)
    if config.registry_endpoint:  # discovery: bind any port, tokenizers learn the address from the registry
        listed = config.api_endpoint_list()
        pool = TokenizerPool(context, listed[config.api_index] if listed else "tcp://*:*", config)
        stats = ReplicaStatsFeed(context, [], config.heartbeat_timeout)  # the registry lists the replicas
    else:
        pool = TokenizerPool(context, config.api_endpoint_list()[config.api_index], config)
        stats = ReplicaStatsFeed(context, config.replica_endpoint_list("stats"), config.heartbeat_timeout)
    names = tuple(config.served_model_names()) or (name,)
    return ApiState(config=config, served_model_name=name, model_names=frozenset({*names, engine_config.model}),
                    served_names=names,
                    model_root=engine_config.model,
                    pool=pool, stats=stats,
                    metrics=ApiMetrics(lambda: stats.latest, stats.per_replica, name, _cache_info(engine_config)),
                    started=int(time.time()), keys=KeyTable(config.api_keys_file) if config.api_keys_file else None,
                    usage_log=UsageLog(config.usage_log) if config.usage_log else None,
                    console_requests=RequestLog(config.console_max_requests, config.console_show_prompts)
                    if config.console else None)


async def _serve(engine_config: EngineConfig, config: ServerConfig) -> None:
    stop = _stop_on_signal()  # first: a SIGTERM during start-up still shuts down cleanly
    context = zmq.asyncio.Context()
    try:
        state = _make_state(context, engine_config, config)
        app = build_app(state)
        access_log = logging.getLogger("aiohttp.access") if log.isEnabledFor(logging.DEBUG) else None
        # keepalive_timeout also bounds a new connection that never completes its headers (slow-loris):
        # aiohttp closes a connection still waiting for a request that long after it opened.
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=CLOSE_TIMEOUT_S,
                               access_log=access_log, keepalive_timeout=config.body_read_timeout or 75.0,
                               logger=http_log)
        await runner.setup()
        registry = _registry_client(context, config, state)
        watch = asyncio.create_task(_watch_keys(state.keys)) if state.keys is not None else None
        # SIGHUP (the launcher passes its own on): read the keys file again; without one, nothing (not the
        # default action, which would end the process)
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, state.keys.reload if state.keys else _ignore)
        try:
            state.pool.start()
            state.stats.start()
            if registry is not None:
                registry.start()
            site = web.TCPSite(runner, config.host, config.port, reuse_port=True)
            await site.start()
            settle_heap(f"api {config.api_index}")
            log.info("api %d serving %s on http://%s:%d", config.api_index, state.served_model_name,
                     config.host, config.port)
            if config.metrics_need_key() and not config.api_key:
                log.warning("/metrics is closed to everyone: --metrics-access %s with a keys file takes only the "
                            "operator's key, and none is set (--api-key, --api-key-file or PAGODA_API_KEY; or "
                            "--metrics-access open to leave it open)", config.metrics_access)
            await stop.wait()
            await _drain(state, site, config.shutdown_grace)
        finally:
            if watch is not None:
                watch.cancel()
            if state.usage_log is not None:
                state.usage_log.close()
            if registry is not None:
                await registry.close()
            await runner.cleanup()
            await state.pool.close()
            await state.stats.close()
    finally:
        context.destroy(linger=0)
    log.info("api %d stopped", config.api_index)


def _registry_client(context: zmq.asyncio.Context, config: ServerConfig, state: ApiState) -> RegistryClient | None:
    if not config.registry_endpoint:
        return None
    def address() -> str | None:  # asked again each beat until the registry's name resolves
        host = config.advertise_host or host_toward(config.registry_endpoint or "")
        return None if host is None else advertised(state.pool.endpoint, host)

    return RegistryClient(context, config.registry_endpoint, address, state.stats, config.heartbeat_interval)


def _ignore() -> None:
    pass


async def _watch_keys(keys: KeyTable) -> None:
    """Keys reload without a restart when the file changes (polled; SIGHUP reloads at once)."""
    while True:
        await asyncio.sleep(KEYS_POLL_S)
        try:
            keys.maybe_reload()
        except Exception:  # never the end of the watch: a revocation after it must still take effect
            log.exception("keys file check failed; checking again in %g s", KEYS_POLL_S)


def _stop_on_signal() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _drain(state: ApiState, site: web.TCPSite, grace_s: float) -> None:
    """Stop taking connections, give in-flight requests `grace_s`, then end the rest with an error."""
    log.info("shutting down: %d request(s) in flight, %.1f s grace", state.pool.num_open, grace_s)
    state.shutting_down = True
    state.pool.stop_accepting()
    await site.stop()  # the listening socket closes; open connections keep their requests
    if await state.pool.wait_idle(grace_s):
        return
    log.warning("ending %d request(s) still in flight after the grace period", state.pool.num_open)
    state.pool.fail_all(503, "the server is shutting down")
    await state.pool.wait_idle(FAIL_FLUSH_S)
