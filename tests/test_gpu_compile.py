"""Every Triton kernel the model families and the sampler launch compiles for sm_90 (tests/gpu_compile.py),
checked on the CPU: the interpreter the rest of the suite uses accepts code the GPU compiler rejects."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("gpu_compile.py")


def _compile_parts(parts: tuple[str, ...]) -> str:
    """gpu_compile.py's `parts` in one process each, side by side (the suite runs one test at a time a worker on
    2 cores); their stdout, after checking each compiled everything it launched."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    runs = [subprocess.Popen([sys.executable, str(SCRIPT), part], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for part in parts]
    stdout = ""
    for run in runs:
        out, err = run.communicate(timeout=900)
        report = out[-4000:] + err[-2000:]
        assert run.returncode == 0, report
        assert "0 failed, 0 step errors" in out, report
        stdout += out
    return stdout


def _compiled_kernels(stdout: str) -> set[str]:
    return {line.split(":")[0] for line in stdout.splitlines() if line.endswith(": ok")}


def test_model_kernels_compile_for_hopper() -> None:
    """Every kernel a served launch takes (parts 1 and 2)."""
    stdout = _compile_parts(("1", "2"))
    # the dense, FP8 (both paths), MoE, MLA and sampling kernels were all reached
    assert {"_w8a16_kernel", "_fp8_gemm_kernel", "_paged_attention_kernel", "fp8_decode_kernel", "_moe_gemm_kernel",
            "_moe_gemv_kernel",
            "_grouped_route_kernel", "_router_gemv_kernel",
            "_mla_kernel", "_process_kernel", "_group_thresholds_kernel", "_top_p_row_kernel"} <= \
        _compiled_kernels(stdout), stdout[-4000:]


@pytest.mark.extended  # measurement-only variants (bench/kv_fp8_bench.py's fp8 conversion modes): make test-all
def test_candidate_attention_modes_compile_for_hopper() -> None:
    """The fp8-cache attention modes no served launch takes (part 3)."""
    stdout = _compile_parts(("3",))
    assert "_paged_attention_kernel" in _compiled_kernels(stdout), stdout[-4000:]
