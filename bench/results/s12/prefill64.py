"""The first (prefill) step of 64 short requests on qwen3-0.6b: free vs constrained, device time per step, and a
kernel profile of that step."""
import statistics, time
import torch
from pagoda.llm import LLM
from pagoda.bench.fast_forward import SCHEMA, REVIEWS, KV_CACHE_BYTES
from pagoda.shared.messages import SamplingParams, StructuredOutputs
from pagoda.services.worker.model_runner import StepTimer

template = "Classify the review's sentiment and your confidence as JSON.\nReview: {}\nJSON:"
prompts = [template.format(REVIEWS[i % len(REVIEWS)]) + f" ({i})" for i in range(64)]
llm = LLM("qwen3-0.6b", load_format="dummy", tokenizer=".gpu/smollm2-tok", max_model_len=512, max_num_seqs=64,
          kv_cache_memory=KV_CACHE_BYTES)
modes = {"free": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
         "schema": SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputs(json=SCHEMA))}
for p in modes.values():
    llm.generate(prompts, p)
for rnd in range(3):
    for mode, p in modes.items():
        llm.engine.scheduler.reset_prefix_cache() if hasattr(llm.engine.scheduler, "reset_prefix_cache") else None
        timer = llm.engine.runner.step_timer = StepTimer()
        torch.cuda.synchronize(); t = time.perf_counter()
        llm.generate([q + f" r{rnd}" for q in prompts], p)
        torch.cuda.synchronize(); el = time.perf_counter() - t
        llm.engine.runner.step_timer = None
        print(f"round {rnd} {mode}: {el*1e3:.1f} ms; steps (decode, device ms): "
              f"{[(int(d), round(a.elapsed_time(b), 2)) for d, a, b in timer.steps]}", flush=True)
for mode, p in modes.items():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate([q + " prof" + mode for q in prompts], SamplingParams(**{**{f: getattr(p, f) for f in ("temperature", "structured_outputs")}, "max_tokens": 1, "ignore_eos": p.ignore_eos}))
    print(f"== {mode}, one step (max_tokens 1)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
