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
    2 cores), through LLVM's sm_90 PTX without ptxas (a quarter of the time; tests/test_gemv_sass.py and
    test_attention_sass.py assemble the hottest kernels); their stdout, after checking each compiled everything it
    launched and within an SM's shared memory."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    runs = [subprocess.Popen([sys.executable, str(SCRIPT), "--to-ptx", part], env=env, stdout=subprocess.PIPE,
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


PROBE = '''
import sys
sys.path.insert(0, {tests!r})
import gpu_compile
import torch
import triton
import triton.language as tl


@triton.jit
def _square_dot_kernel(a_ptr, out_ptr, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    tile = tl.load(a_ptr + rows[:, None] * BLOCK + rows[None, :])
    tl.store(out_ptr + rows[:, None] * BLOCK + rows[None, :], tl.dot(tile, tile))


gpu_compile.stop_at_ptx()
gpu_compile.install()
for limit in (1024, 227 * 1024):  # the second launch takes the first's compiled kernel from the JIT's cache
    gpu_compile.MAX_SHARED_BYTES = limit
    gpu_compile.RESULTS.clear()
    _square_dot_kernel[(1,)](torch.empty(64, 64, dtype=torch.bfloat16), torch.empty(64, 64), BLOCK=64)
    print(limit, gpu_compile.RESULTS["_square_dot_kernel"])
'''


def test_a_tile_over_the_shared_memory_limit_fails(tmp_path: Path) -> None:
    """A launch would refuse a kernel that needs more shared memory than an SM block has; the compile-only driver
    reports it as a failure (the 64 x 64 bf16 dot stages its operands in shared memory: a limit of 1 KiB is below
    what it takes, the real 227 KiB above)."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(tests=str(SCRIPT.parent)))
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": "", "TRITON_CACHE_DIR": str(tmp_path / "c")}
    run = subprocess.run([sys.executable, "-P", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = dict(line.split(" ", 1) for line in run.stdout.strip().splitlines())
    assert results["1024"].startswith("FAIL out of shared memory: "), results
    assert results[str(227 * 1024)] == "ok", results
