"""A/B of programmatic dependent launch variants: decode step graph time and outputs, same process.
usage: pdl_ab.py MODEL QUANT BATCHES CTX VARIANT... where VARIANT = label=PAGODA_PDL[:noprefetch]"""
import os, sys
import torch
from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.bench.decode_profile import make_batch
from pagoda.services.worker.models import CausalLM, Fp8Weights
from pagoda.services.worker.weights import load_model
from pagoda.shared.shapes import SHAPES

name, quant = sys.argv[1], sys.argv[2]
batches = [int(b) for b in sys.argv[3].split(",")]
ctx = int(sys.argv[4])
variants = [v.split("=", 1) for v in sys.argv[5:]]
arch = SHAPES[name]
dev = torch.device("cuda")
fp8 = {"none": None, "fp8": Fp8Weights(None), "fp8_block": Fp8Weights(128)}[quant]
model = CausalLM(arch, torch.bfloat16, dev, max_positions=ctx + 64, fp8=fp8)
load_model(model, None, "dummy", seed=0)

def setenv(setting):
    pdl, _, extra = setting.partition(":")
    os.environ["PAGODA_PDL"] = pdl
    os.environ["PAGODA_PDL_TRIGGER"] = "exit" if extra == "exit" else "first"

with torch.inference_mode():
    for B in batches:
        meta, pos, nblocks = make_batch([1] * B, [ctx + 1] * B, dev)
        if arch.mla:
            caches = [(torch.randn(nblocks, 16, 1, arch.mla.entry_dim, device=dev).mul_(0.5).to(torch.bfloat16),)
                      for _ in range(arch.num_layers)]
        else:
            caches = [tuple(torch.randn(nblocks, 16, arch.num_kv_heads, arch.head_dim, device=dev, dtype=torch.bfloat16)
                            for _ in range(2)) for _ in range(arch.num_layers)]
        ids = torch.randint(0, arch.vocab_size, (B,), device=dev)
        def fn():
            return model.compute_logits(model(ids, pos, caches, meta))
        times = {label: [] for label, _ in variants}
        bad = []
        setenv("0")
        ref = fn().float()
        for _ in range(2):
            for label, setting in variants:
                setenv(setting)
                if not torch.equal(fn().float(), ref):
                    bad.append(label)
                times[label].append(graph_time_ms(fn, reps=30))
        row = "  ".join(f"{label} {min(t):.3f}" for label, t in times.items())
        print(f"{name} {quant} B={B}: {row}  (ms; mismatched: {sorted(set(bad)) or 'none'})", flush=True)
