"""How a service process starts and stops: its settings (flags or PAGODA_* variables), and SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, TypeVar

from pagoda.shared.config import (
    EngineConfig,
    ServerConfig,
    add_engine_args,
    add_server_args,
    engine_config_from_args,
    server_config_from_args,
)
from pagoda.shared.errors import PagodaError
from pagoda.shared.transport import load_cluster_keys


def parse_service_args(name: str, argv: Sequence[str]) -> tuple[EngineConfig, ServerConfig]:
    parser = argparse.ArgumentParser(prog=f"python -m pagoda.services.{name}")
    add_engine_args(parser)
    add_server_args(parser)
    args = parser.parse_args(list(argv))
    engine_config, server_config = engine_config_from_args(args), server_config_from_args(args)
    logging.basicConfig(level=server_config.log_level.upper(),
                        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(name)s: %(message)s")
    return engine_config, server_config


def service_main(name: str, run: Callable[[EngineConfig, ServerConfig], None]) -> None:
    """`python -m pagoda.services.<name>`: parse the settings, run; a bad setting is one line naming it."""
    try:
        engine_config, server_config = parse_service_args(name, sys.argv[1:])
        run(engine_config, server_config)
    except PagodaError as exc:
        print(f"error: {exc.message} ({exc.param})", file=sys.stderr)
        sys.exit(2)


@contextmanager
def stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """SIGTERM and SIGINT call `stop` (the service's loop then ends on its own) while inside; the handlers that
    were there before come back after. Off the main thread (a test's in-process service) nothing is installed."""
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: stop())
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


class Service(Protocol):
    def run(self) -> None: ...

    def stop(self) -> None: ...


ServiceT = TypeVar("ServiceT", bound=Service)


def run_service(server_config: ServerConfig, build: Callable[[], ServiceT]) -> ServiceT:
    """Load the cluster's keys (the sockets `build` makes use them), build the service, run it until SIGTERM or
    SIGINT stops it; the service comes back for what it ended with."""
    load_cluster_keys(server_config.cluster_key_dir)
    service = build()
    with stop_on_signals(service.stop):
        service.run()
    return service
