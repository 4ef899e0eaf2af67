"""The engine's load time with and without the swap space (llama3-8b FP8 + FP8 KV, trtllm-1000's 1024 seats)."""
import sys
import time

from pagoda import LLM

start = time.perf_counter()
llm = LLM("llama3-8b", load_format="dummy", quantization="fp8", kv_cache_dtype="fp8", max_num_seqs=1024,
          swap_space=float(sys.argv[1]))
print(f"swap_space {sys.argv[1]}: load {time.perf_counter() - start:.1f} s, {llm.engine.runner.num_swap_blocks} slots",
      flush=True)
