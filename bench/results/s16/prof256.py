"""llama3-8b FP8 decode step at B=256 (contexts 512-768, the reference workload's decode), bf16 and fp8 KV:
graph time and kernel breakdown."""
import sys
import torch
from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.bench.decode_profile import make_batch, kernel_breakdown, print_breakdown
from pagoda.services.worker.models import CausalLM, Fp8Weights
from pagoda.services.worker.weights import load_model
from pagoda.shared.shapes import SHAPES

name = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b"
B = int(sys.argv[2]) if len(sys.argv) > 2 else 256
arch = SHAPES[name]
dev = torch.device("cuda")
model = CausalLM(arch, torch.bfloat16, dev, max_positions=1024, fp8=Fp8Weights(None))
load_model(model, None, "dummy", seed=0)
seq_lens = [512 + (b * 256) // B for b in range(B)]
meta, pos, nblocks = make_batch([1] * B, seq_lens, dev)
ids = torch.randint(0, arch.vocab_size, (B,), device=dev)
with torch.inference_mode():
    for kv in ("bf16", "fp8"):
        caches = []
        for _ in range(arch.num_layers):
            pair = [torch.randn(nblocks, 16, arch.num_kv_heads, arch.head_dim, device=dev, dtype=torch.bfloat16)
                    for _ in range(2)]
            if kv == "fp8":
                pair = [t.to(torch.float8_e4m3fn) for t in pair]
            caches.append(tuple(pair))
        def fn():
            return model.compute_logits(model(ids, pos, caches, meta))
        ms = min(graph_time_ms(fn, reps=20) for _ in range(2))
        print(f"{name} fp8 weights, {kv} KV, B={B} ctx 512-768: step {ms:.3f} ms (graph)", flush=True)
        print_breakdown(f"{kv} KV", kernel_breakdown(fn), top=22)
        del caches
        torch.cuda.empty_cache()
