"""`python -m pagoda.bench <throughput|serve|scheduler|ipc> ...`: the same as `pagoda bench ...`."""

from __future__ import annotations

import argparse
import logging
import sys

from pagoda.bench.commands import add_commands


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.bench", description="pagoda benchmarks")
    parser.add_argument("--log-level", default="WARNING")
    add_commands(parser)
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return int(args.bench_main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
