"""A/B of environment settings on one model's decode step: graph time and logits, same process.
usage: fuse_ab.py MODEL QUANT BATCHES CTX label=VAR=value[,VAR=value]... (the first variant is the reference)"""
import os, sys
import torch
from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.bench.decode_profile import make_batch, kernel_breakdown, print_breakdown
from pagoda.services.worker.models import CausalLM, Fp8Weights
from pagoda.services.worker.weights import load_model
from pagoda.shared.shapes import SHAPES

name, quant = sys.argv[1], sys.argv[2]
batches = [int(b) for b in sys.argv[3].split(",")]
ctx = int(sys.argv[4])
variants = []
for v in sys.argv[5:]:
    label, _, settings = v.partition("=")
    variants.append((label, dict(s.split("=", 1) for s in settings.split(",") if s)))
profile = os.environ.pop("PROFILE", "")
arch = SHAPES[name]
dev = torch.device("cuda")
fp8 = {"none": None, "fp8": Fp8Weights(None), "fp8_block": Fp8Weights(128)}[quant]
model = CausalLM(arch, torch.bfloat16, dev, max_positions=ctx + 64, fp8=fp8)
load_model(model, None, "dummy", seed=0)

with torch.inference_mode():
    for B in batches:
        meta, pos, nblocks = make_batch([1] * B, [ctx + 1] * B, dev)
        caches = [tuple(torch.randn(nblocks, 16, arch.num_kv_heads, arch.head_dim, device=dev, dtype=torch.bfloat16)
                        for _ in range(2)) for _ in range(arch.num_layers)]
        ids = torch.randint(0, arch.vocab_size, (B,), device=dev)
        def fn():
            return model.compute_logits(model(ids, pos, caches, meta))
        times = {label: [] for label, _ in variants}
        bad = []
        os.environ.update(variants[0][1])
        ref = fn().float()
        for _ in range(2):
            for label, settings in variants:
                os.environ.update(settings)
                if not torch.equal(fn().float(), ref):
                    bad.append(label)
                times[label].append(graph_time_ms(fn, reps=30))
        row = "  ".join(f"{label} {min(t):.3f}" for label, t in times.items())
        print(f"{name} {quant} B={B}: {row}  (ms; logits differ from {variants[0][0]}: {sorted(set(bad)) or 'none'})",
              flush=True)
        if profile and B == 1:
            for label, settings in variants:
                os.environ.update(settings)
                print_breakdown(f"{label} B={B}", kernel_breakdown(fn), top=12)
