"""Does a bulk L2 prefetch make the next GEMV faster, in isolation? o-proj shape (4096x4096 e4m3), M=1."""
import torch
from torch.profiler import profile, ProfilerActivity
from pagoda.kernels import l2_prefetch as lp
from pagoda.kernels.fp8_weight_only import fp8_weight_only_linear
dev = torch.device("cuda")
for n, k in ((4096, 4096), (28672, 4096)):
    w = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn)
    s = torch.ones(n, 1, device=dev)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    cap = min(w.numel(), 24 << 20)
    def run(kind, programs=64, sleep=40000):
        flush.fill_(1)
        if kind == "prefetch":
            lp.l2_prefetch([(w, cap)], programs=programs)
        elif kind == "touch":
            w.view(torch.uint8).view(-1)[:cap].max()
        if sleep:
            torch.cuda._sleep(sleep)
        fp8_weight_only_linear(x, w, s, None)
    variants = [("none", {}), ("touch", {}), ("prefetch", {"programs": 16}), ("prefetch", {"programs": 64}),
                ("prefetch", {"programs": 264}), ("prefetch", {"programs": 64, "sleep": 0}), ("none", {"sleep": 0})]
    for kind, kw in variants:
        for _ in range(3):
            run(kind, **kw)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(30):
                run(kind, **kw)
            torch.cuda.synchronize()
        times = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                times.setdefault(e.name, []).append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
        gemv = [t for name, v in times.items() if "w8a16" in name for t in v]
        pf = [t for name, v in times.items() if "prefetch" in name or "reduce" in name for t in v]
        print(f"N={n} {kind} {kw}: gemv mean {sum(gemv)/len(gemv):.2f} us min {min(gemv):.2f}"
              + (f"; prefetch/touch kernels mean {sum(pf)/len(pf):.2f} us" if pf else ""), flush=True)
