"""fast-forward at batch 64 on the GPU: steps, per-step times and the host's hot spots of each mode."""
import cProfile, io, pstats, statistics, sys, time
import torch
from pagoda.llm import LLM
from pagoda.bench.fast_forward import SCHEMA, REVIEWS, KV_CACHE_BYTES
from pagoda.shared.messages import SamplingParams, StructuredOutputs
from pagoda.services.worker.model_runner import StepTimer

template = "Classify the review's sentiment and your confidence as JSON.\nReview: {}\nJSON:"
prompts = [template.format(REVIEWS[i % len(REVIEWS)]) for i in range(64)]
params = SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=StructuredOutputs(json=SCHEMA))
engines = {m: LLM("qwen3-0.6b", load_format="dummy", tokenizer=".gpu/smollm2-tok", max_model_len=512,
                  max_num_seqs=64, kv_cache_memory=KV_CACHE_BYTES, grammar_fast_forward=m == "ff")
           for m in ("ff", "plain")}
for llm in engines.values():
    llm.generate(prompts[:2], params)
    llm.generate(prompts, params)
for rnd in range(2):
    for mode, llm in engines.items():
        s0 = llm.engine.scheduler.stats.num_steps
        timer = llm.engine.runner.step_timer = StepTimer()
        torch.cuda.synchronize()
        pr = cProfile.Profile() if rnd == 1 else None
        t = time.perf_counter()
        if pr: pr.enable()
        out = llm.generate(prompts, params)
        if pr: pr.disable()
        el = time.perf_counter() - t
        llm.engine.runner.step_timer = None
        toks = [len(o.outputs[0].token_ids) for o in out]
        summary = {k: round(v, 3) for k, v in timer.summary().items()}
        per_step = [(int(d), round(a.elapsed_time(b), 2)) for d, a, b in timer.steps]
        print(f"round {rnd} {mode}: {el*1e3:.1f} ms, steps {llm.engine.scheduler.stats.num_steps - s0}, "
              f"tokens/request {statistics.mean(toks):.1f}, {summary}\n   steps (decode, device ms): {per_step}",
              flush=True)
        if pr:
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(22)
            print("\n".join(l for l in buf.getvalue().splitlines() if l.strip())[:6000])
