"""Container health check for every pagoda service (the image's HEALTHCHECK): exit 0 healthy, 1 not.

Which service runs here is read from /proc (the process running `python -m pagoda.services.<name>`;
the api where `pagoda serve` runs them all), or given as the first argument. Then:
  api        GET /health answers 200: every service behind it is up (the whole deployment is ready)
  scheduler  a stats snapshot arrives on PAGODA_STATS_ENDPOINT (its loop publishes one every 0.25 s)
  tokenizer  its process is alive (it only connects out: there is nothing to probe)
  worker     its process is alive (likewise; the api's /health reports whether it is ready)
Standard library, and for the scheduler pagoda's stats probe (pagoda/probes.py): it runs in a second and never
imports torch.
"""

from __future__ import annotations

import os
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

SERVICE_RE = re.compile(rb"-m\x00pagoda\.services\.(api|tokenizer|scheduler|worker)(?:\x00|$)")
TIMEOUT_S = 3.0


def service_processes() -> dict[str, list[int]]:
    """Live (not zombie) pagoda service processes by service name."""
    found: dict[str, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # it ended while we looked
        match = SERVICE_RE.search(cmdline)
        if match and state not in ("Z", "X"):
            found.setdefault(match.group(1).decode(), []).append(int(entry.name))
    return found


def api_healthy() -> bool:
    host = os.environ.get("PAGODA_HOST", "127.0.0.1")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"  # listening on every interface: loopback is one of them
    elif ":" in host:
        host = f"[{host}]"
    url = f"http://{host}:{os.environ.get('PAGODA_PORT', '8000')}/health"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):  # HTTPError (a 503) is a URLError
        return False


def scheduler_healthy() -> bool:
    endpoint = os.environ.get("PAGODA_STATS_ENDPOINT")
    if not endpoint:
        return True  # ipc:// in a private runtime dir: nothing to reach from here, the process check stands
    from pagoda.probes import latest_stats  # pagoda's light modules only (no torch)

    # a deployment with keys takes only CURVE peers holding them (docs/security.md)
    return latest_stats(endpoint, TIMEOUT_S, os.environ.get("PAGODA_CLUSTER_KEY_DIR")) is not None


def main(argv: list[str]) -> int:
    running = service_processes()
    if len(argv) > 1:
        service = argv[1]
    elif "api" in running or len(running) != 1:
        service = "api"  # `pagoda serve` runs all four in one container: its api speaks for them
    else:
        service = next(iter(running))
    if service not in running:
        print(f"unhealthy: no live pagoda.services.{service} process", file=sys.stderr)
        return 1
    checks = {"api": api_healthy, "scheduler": scheduler_healthy}
    if not checks.get(service, lambda: True)():
        print(f"unhealthy: {service} does not answer", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
