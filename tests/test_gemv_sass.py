"""The committed one-row FMA tiles of the W8A16 GEMV compile for sm_90 (on the CPU, Triton's own ptxas) to a K loop
with one cross-lane reduction per output block, not one per element (bench/gemv_sass.committed_one_row_loops).
A change in how the kernel loads its tiles once made Triton lay them out for a shuffle tree at every K step: the
tile's loop grew from 261 to 433 instructions (82 shuffles against 20) and llama3-8b FP8 batch-1 decode went from
2.78 to 4.13 ms/token on the H200 with no test failing. The bounds sit between the two layouts: the working one
runs 20-21 shuffles and 261-282 instructions (325 gated) a K step on llama3-8b's tiles, the broken one 82 and 346-433
(490 gated)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_one_row_tiles_reduce_once_per_block() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "pagoda.bench.gemv_sass", "--committed-one-row"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {(row["n"], row["k"]) for row in rows} >= {(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)}
    assert any(row["gated"] for row in rows)
    for row in rows:
        assert row["shfl"] <= 32, row
        assert row["loop"] <= (360 if row["gated"] else 300), row
