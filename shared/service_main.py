"""Arguments every service process takes: the engine and server settings (flags or PAGODA_* variables)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from pagoda.shared.config import (
    EngineConfig,
    ServerConfig,
    add_engine_args,
    add_server_args,
    engine_config_from_args,
    server_config_from_args,
)
from pagoda.shared.errors import PagodaError


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
