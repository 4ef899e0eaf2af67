"""Session 37: why deepseek-v2-lite's FP8 experts on the gmm path took 548 us at 1024 tokens (268 at 512, 630 at
2048; H200, s36 call 2). One sparse layer's experts (moe_fp8_sweep's inputs: random routing over the routed experts
plus the 2 fused shared ones) on both gmm paths (bf16 torch._grouped_mm, FP8 torch._scaled_grouped_mm) and the
Triton paths, kernel by kernel (torch.profiler, 20 launches after warm-up), at token counts around 1024; qwen3-30b-a3b
as the control."""
import functools
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from pagoda.bench.moe_fp8_sweep import make_experts
from pagoda.bench.moe_tune import _routing
from pagoda.kernels import moe
from pagoda.services.worker.models.deepseek import fused_shared_experts
from pagoda.shared.shapes import SHAPES

REPS = 20


def kernels(fn) -> tuple[float, dict[str, float]]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPS):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            per[evt.name[:70]] += evt.device_time / REPS
    return sum(per.values()), dict(per)


def main() -> None:
    device = torch.device("cuda")
    for shape, tokens in (("deepseek-v2-lite", (512, 768, 1024, 1280, 1536, 2048)), ("qwen3-30b-a3b", (1024, 2048))):
        arch = SHAPES[shape]
        spec = arch.moe
        num_shared = fused_shared_experts(spec, spec.expert_intermediate_size, None)
        experts = make_experts(spec.num_experts + num_shared, arch.hidden_size, spec.expert_intermediate_size, device)
        for t in tokens:
            weights, ids = _routing(t, spec.num_experts, spec.top_k, num_shared, device)
            x = (torch.randn(t, arch.hidden_size, device=device) * 0.5).to(torch.bfloat16)
            for label, fp8, path in (("bf16 triton", False, "triton"), ("bf16 gmm", False, "gmm"),
                                     ("fp8 triton", True, "triton"), ("fp8 gmm", True, "gmm")):
                w_gu, w_d, s_gu, s_d = experts.args(fp8)
                total, per = kernels(functools.partial(moe.fused_experts, x, w_gu, w_d, weights, ids, s_gu, s_d,
                                                       path=path))
                top = sorted(per.items(), key=lambda kv: -kv[1])[:6]
                print(f"{shape} T={t} {label}: {total:.1f} us | " + "; ".join(f"{n} {v:.1f}" for n, v in top),
                      flush=True)
        del experts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
