"""Ad-hoc: deepseek-v2-lite prefill steps kernel by kernel (torch.profiler around LLM.generate, max_tokens=1)."""
import json, os, random, sys, time
import torch
from pagoda import LLM, SamplingParams

shape = sys.argv[1] if len(sys.argv) > 1 else "deepseek-v2-lite"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 64
llm = LLM(shape, load_format="dummy", seed=0)
vocab = llm.engine.runner.arch.vocab_size
rng = random.Random(0)
def prompts(seed):
    r = random.Random(seed)
    return [[r.randrange(100, vocab - 100) for _ in range(512)] for _ in range(n)]
sp = SamplingParams(max_tokens=1, ignore_eos=True)
llm.generate(prompts(1), sp)
torch.cuda.synchronize()
steps0 = llm.engine.scheduler.stats.num_steps
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    t0 = time.perf_counter()
    llm.generate(prompts(2), sp)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
steps = llm.engine.scheduler.stats.num_steps - steps0
agg = {}
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        k = e.name[:90]
        c, t = agg.get(k, (0, 0.0))
        agg[k] = (c + 1, t + e.device_time_total)
total = sum(t for _, t in agg.values())
print(f"{shape}: {n} x 512 tokens, {steps} steps, wall {wall*1e3:.1f} ms, kernel time {total/1e3:.1f} ms")
rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
for k, (c, t) in rows[:28]:
    print(f"{t/1e3:9.2f} ms {100*t/total:5.1f}% {c:6d}  {k}")
out = os.environ.get("OUT", "/tmp")
json.dump({"shape": shape, "prompts": n, "steps": steps, "wall_ms": wall * 1e3, "kernel_ms": total / 1e3,
           "kernels": [{"name": k, "count": c, "ms": t / 1e3} for k, (c, t) in rows]},
          open(os.path.join(out, f"prefill_prof_{shape}.json"), "w"), indent=1)
