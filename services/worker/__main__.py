"""`python -m pagoda.services.worker`: run the worker process on its own (compose, several hosts)."""

from __future__ import annotations

import sys

from pagoda.services.launcher_args import parse_service_args
from pagoda.services.worker.service import run_worker
from pagoda.shared.errors import PagodaError

if __name__ == "__main__":
    try:
        engine_config, server_config = parse_service_args("worker", sys.argv[1:])
        run_worker(engine_config, server_config)
    except PagodaError as exc:  # a bad setting: one line naming it, not a traceback
        print(f"error: {exc.message} ({exc.param})", file=sys.stderr)
        sys.exit(2)
