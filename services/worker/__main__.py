"""`python -m pagoda.services.worker`: run the worker process on its own (compose, several hosts)."""

from __future__ import annotations

from pagoda.services.launcher_args import service_main
from pagoda.services.worker.service import run_worker

if __name__ == "__main__":
    service_main("worker", run_worker)
