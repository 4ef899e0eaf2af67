"""`python -m pagoda.services.scheduler`: run the scheduler process on its own (compose, several hosts)."""

from __future__ import annotations

from pagoda.services.scheduler.service import run_scheduler
from pagoda.shared.service_main import service_main

if __name__ == "__main__":
    service_main("scheduler", run_scheduler)
