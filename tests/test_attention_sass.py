"""The default decode attention launches compile for sm_90 (on the CPU, Triton's own ptxas) to a key-tile loop no
longer than what was timed on the H200, with no spills (bench/attention_sass.default_decode_loops): llama3-8b's and
qwen3-0.6b's heads, a bf16 cache (320 instructions a 64-key tile when it ran at 3.6 TB/s; 310 since the block
offsets are zero-extended 32-bit products) and an fp8 cache (qk_fp8x2 with the sums per key slot: 354, 2.5-3.3 TB/s
on its bytes; 328, 2-3% faster, since). A load-order change that
only the SASS showed once took llama3-8b FP8 batch-1 from 2.78 to 4.13 ms/token (tests/test_gemv_sass.py); a loop
that grows past these bounds needs timing on a GPU before it lands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BOUNDS = {"bf16": 341, "qk_fp8x2": 361}  # ~10% above the timed loops


@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (16, 8)])
def test_default_decode_loops_stay_short(heads: int, kv_heads: int) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "pagoda.bench.attention_sass", "--heads", str(heads),
                           "--kv-heads", str(kv_heads), "--defaults-json"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = {row["mode"]: row for row in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}
    assert set(rows) == set(BOUNDS)
    for mode, row in rows.items():
        assert row["loop"] <= BOUNDS[mode] and row["spills"] == 0, row
