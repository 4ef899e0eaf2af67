"""`python -m pagoda.bench <throughput|scheduler> ...`: the same as `pagoda bench ...`."""

from __future__ import annotations

import sys

from pagoda.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
