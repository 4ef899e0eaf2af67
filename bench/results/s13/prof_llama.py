"""llama3-8b batch-1 decode step, bf16 vs fp8 weights: graph time and kernel breakdown."""
import sys
import torch
from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.bench.decode_profile import make_batch, step_fn, kernel_breakdown, print_breakdown
from pagoda.services.worker.models import CausalLM, Fp8Weights
from pagoda.services.worker.weights import load_model
from pagoda.shared.shapes import SHAPES

name = sys.argv[1] if len(sys.argv) > 1 else "llama3-8b"
batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1").split(",")]
arch = SHAPES[name]
dev = torch.device("cuda")
for quant in ("none", "fp8"):
    fp8 = Fp8Weights(None) if quant == "fp8" else None
    model = CausalLM(arch, torch.bfloat16, dev, max_positions=1024, fp8=fp8)
    load_model(model, None, "dummy", seed=0)
    with torch.inference_mode():
        for B in batches:
            meta, pos, nblocks = make_batch([1] * B, [513] * B, dev)
            caches = [tuple(torch.randn(nblocks, 16, arch.num_kv_heads, arch.head_dim, device=dev, dtype=torch.bfloat16)
                            for _ in range(2)) for _ in range(arch.num_layers)]
            ids = torch.randint(0, arch.vocab_size, (B,), device=dev)
            fn = step_fn(model, ids, pos, caches, meta)
            ms = graph_time_ms(fn)
            print(f"{name} {quant} B={B}: step {ms:.3f} ms (graph)", flush=True)
            print_breakdown(f"{quant} B={B}", kernel_breakdown(fn), top=14)
    del model
    torch.cuda.empty_cache()
