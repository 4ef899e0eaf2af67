"""`python -m pagoda.services.api [flags]`: run one api process."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import zmq

from pagoda.services.api.server import run_api
from pagoda.services.api.tenants import read_keys_file
from pagoda.shared.config import (
    add_engine_args,
    add_server_args,
    engine_config_from_args,
    server_config_from_args,
)
from pagoda.shared.errors import ConfigError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.services.api",
                                     description="pagoda api process: OpenAI-compatible HTTP in front of tokenizers")
    add_engine_args(parser)
    add_server_args(parser)
    args = parser.parse_args(argv)
    try:
        engine_config = engine_config_from_args(args)
        server_config = server_config_from_args(args)
        server_config.api_endpoint_list()  # fail here, with the parameter named, rather than half started
        server_config.endpoint("stats")
        server_config.check_metrics_access()
        if server_config.api_keys_file:
            read_keys_file(server_config.api_keys_file)
    except ConfigError as exc:
        print(f"error: {exc.message} ({exc.param})", file=sys.stderr)
        return 2
    logging.basicConfig(level=server_config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s api%(process)d %(name)s %(levelname)s %(message)s")
    try:
        run_api(engine_config, server_config)
    except (OSError, zmq.ZMQError) as exc:  # e.g. the port or a socket path is taken
        logging.getLogger("pagoda.services.api").error("cannot serve: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
