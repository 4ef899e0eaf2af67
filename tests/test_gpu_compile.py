"""Every Triton kernel the model families and the sampler launch compiles for sm_90 (tests/gpu_compile.py),
checked on the CPU: the interpreter the rest of the suite uses accepts code the GPU compiler rejects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("gpu_compile.py")


def test_model_kernels_compile_for_hopper() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    report = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    assert "0 failed, 0 step errors" in done.stdout, report
    compiled = [line for line in done.stdout.splitlines() if line.endswith(": ok")]
    kernels = {line.split(":")[0] for line in compiled}
    # the dense, FP8 (both paths), MoE, MLA and sampling kernels were all reached
    assert {"_w8a16_kernel", "_fp8_gemm_kernel", "_paged_attention_kernel", "fp8_decode_kernel", "_moe_gemm_kernel",
            "_moe_gemv_kernel",
            "_grouped_route_kernel", "_router_gemv_kernel",
            "_mla_kernel", "_process_kernel", "_group_thresholds_kernel", "_top_p_row_kernel"} <= kernels, report
