"""Every Triton kernel the model families and the sampler launch compiles for sm_90 (tests/gpu_compile.py),
checked on the CPU: the interpreter the rest of the suite uses accepts code the GPU compiler rejects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("gpu_compile.py")


def test_model_kernels_compile_for_hopper() -> None:
    """The script's two halves in two processes side by side (the suite runs one test at a time on 2 cores)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    halves = [subprocess.Popen([sys.executable, str(SCRIPT), part], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for part in ("1", "2")]
    stdout = ""
    for half in halves:
        out, err = half.communicate(timeout=900)
        report = out[-4000:] + err[-2000:]
        assert half.returncode == 0, report
        assert "0 failed, 0 step errors" in out, report
        stdout += out
    report = stdout[-4000:]
    compiled = [line for line in stdout.splitlines() if line.endswith(": ok")]
    kernels = {line.split(":")[0] for line in compiled}
    # the dense, FP8 (both paths), MoE, MLA and sampling kernels were all reached
    assert {"_w8a16_kernel", "_fp8_gemm_kernel", "_paged_attention_kernel", "fp8_decode_kernel", "_moe_gemm_kernel",
            "_moe_gemv_kernel",
            "_grouped_route_kernel", "_router_gemv_kernel",
            "_mla_kernel", "_process_kernel", "_group_thresholds_kernel", "_top_p_row_kernel"} <= kernels, report
