"""Twenty-sixth session probe: DeepSeek's router on the tensor cores (a bf16 router, fp32 output) against the fp32
path (copy + SIMT sgemm + split-K reduce).

    python3 bench/results/s26/router_ab.py micro            # router_logits alone at several token counts
    python3 bench/results/s26/router_ab.py step             # v2-lite decode steps (step_ab), fp32 vs low
    S26_ROUTER=fp32 python3 bench/results/s26/router_ab.py throughput ARGS  # = pagoda.bench throughput --system pagoda

S26_ROUTER=fp32 makes exact_low_precision return None (the routers keep no bf16 copy): the tree before the change.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys

import torch

import pagoda.kernels.moe as moe

_real_exact = moe.exact_low_precision
_calls = {"exact": 0, "none": 0}


def _patched(router: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    if os.environ.get("S26_ROUTER") == "fp32":
        _calls["none"] += 1
        return None
    _calls["exact"] += 1
    return _real_exact(router, dtype)


moe.exact_low_precision = _patched  # before models/deepseek.py imports it by name
atexit.register(lambda: print(f"router copies: {_calls}", file=sys.stderr, flush=True))


def micro() -> None:
    from pagoda.bench.cuda_timing import graph_time_ms

    router = (torch.randn(64, 2048, device="cuda") * 0.05).to(torch.bfloat16).float()  # [E, H]
    low = _real_exact(router, torch.bfloat16)
    assert low is not None
    print("tokens  fp32-linear  triton-gemv  tc-fp32-out (us)   max|diff| vs fp64")
    for tokens in (1, 4, 8, 16, 17, 32, 64, 256, 2048, 16384):
        h = torch.randn(tokens, 2048, device="cuda").to(torch.bfloat16)
        exact = torch.nn.functional.linear(h.double(), router.double())
        linear = 1000 * graph_time_ms(lambda h=h: torch.nn.functional.linear(h.float(), router), reps=50)
        gemv = (1000 * graph_time_ms(lambda h=h: moe.router_logits_triton(h, router), reps=50) if tokens <= 64
                else float("nan"))
        tc = 1000 * graph_time_ms(lambda h=h: torch.mm(h, low.t(), out_dtype=torch.float32), reps=50)
        diff = (torch.mm(h, low.t(), out_dtype=torch.float32).double() - exact).abs().max().item()
        print(f"{tokens:6d}  {linear:11.2f}  {gemv:11.2f}  {tc:11.2f}   {diff:.2e}", flush=True)


def step() -> None:
    from pagoda.bench import step_ab
    from pagoda.services.worker.models import deepseek

    real = deepseek.router_logits

    def per_variant(h: torch.Tensor, router: torch.Tensor, low: torch.Tensor | None = None) -> torch.Tensor:
        return real(h, router, None if os.environ.get("S26_ROUTER") == "fp32" else low)  # read at every capture

    deepseek.router_logits = per_variant
    step_ab.main(["--model", "deepseek-v2-lite", "--batches", "64,256", "--context", "640", "--rounds", "3",
                  "--profile", "fp32=S26_ROUTER=fp32", "low=S26_ROUTER=low"])


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "micro":
        micro()
    elif mode == "step":
        step()
    else:
        assert mode == "throughput"
        sys.argv = ["pagoda.bench", "throughput", "--system", "pagoda", *rest]
        runpy.run_module("pagoda.bench", run_name="__main__")
