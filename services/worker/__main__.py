"""`python -m pagoda.services.worker`: run the worker process on its own (compose, several hosts)."""

from __future__ import annotations

from pagoda.services.worker.service import run_worker
from pagoda.shared.service_main import service_main

if __name__ == "__main__":
    service_main("worker", run_worker)
