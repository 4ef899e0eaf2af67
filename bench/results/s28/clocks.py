"""Twenty-eighth session probe: the GPU's SM clock, power and clock-event reasons sampled by nvidia-smi every
~10 ms while deepseek-v2-lite runs the reference's prompts (16 new tokens each), beside each step's GPU time (the
step timer) and its host launch time. Call 2 found every kernel family of the reference's step 5 ~12% slower than
in step 4 (grouped GEMM, cuBLAS, SiLU, MLA alike): a clock drop, or something else sharing the GPU.

    python3 bench/results/s28/clocks.py
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import replace
from typing import Any

import torch

from pagoda.bench.workload import preset

FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"


def main() -> None:
    from pagoda import LLM, SamplingParams
    from pagoda.services.worker.model_runner import StepTimer

    llm = LLM("deepseek-v2-lite", load_format="dummy")
    runner = llm.engine.runner
    workload = replace(preset("reference"), output_len=16)
    warm = replace(workload, seed=workload.seed + 1, num_prompts=4).prompts(runner.arch.vocab_size)
    llm.generate(warm, [SamplingParams(max_tokens=4, ignore_eos=True)] * len(warm))
    prompts = workload.prompts(runner.arch.vocab_size)
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts)
    launch = runner._launch
    starts: list[float] = []

    def timed_launch(sent: Any) -> bool:  # noqa: ANN401
        starts.append(time.time())
        return launch(sent)

    runner._launch = timed_launch
    runner.step_timer = timer = StepTimer()
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "10"],
                           stdout=log, stderr=subprocess.STDOUT)
    time.sleep(0.5)
    t0 = time.time()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    t1 = time.time()
    time.sleep(0.3)
    smi.terminate()
    smi.wait()
    runner._launch, runner.step_timer = launch, None
    gpu_ms = [s.elapsed_time(e) for _, s, e in timer.steps]
    print("step  launch at ms  gpu ms")
    for i, (at, ms) in enumerate(zip(starts, gpu_ms, strict=False)):
        if i < 12:
            print(f"{i:>4} {1e3 * (at - t0):12.1f} {ms:7.2f}")
    print(f"generate {1e3 * (t1 - t0):.0f} ms")
    log.seek(0)
    rows = [line.strip() for line in log if line.strip()]
    print(f"{len(rows)} samples; from 200 ms before the generate to its end:")
    from datetime import datetime
    for row in rows:
        parts = [p.strip() for p in row.split(",")]
        try:
            stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        except ValueError:
            print("  ", row)
            continue
        rel = 1e3 * (stamp - t0)
        if -200 <= rel <= 1e3 * (t1 - t0) + 100:
            print(f"  {rel:8.0f} ms  " + "  ".join(parts[1:]))


if __name__ == "__main__":
    main()
