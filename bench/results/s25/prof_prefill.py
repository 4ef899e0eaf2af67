"""deepseek-v2-lite prefill step: S sequences x L new tokens (no cached context), time + kernel breakdown."""
import sys, time
import torch
from pagoda.bench.decode_profile import make_batch, kernel_breakdown, print_breakdown
from pagoda.services.worker.models import CausalLM
from pagoda.services.worker.weights import load_model
from pagoda.shared.shapes import SHAPES

name = sys.argv[1] if len(sys.argv) > 1 else "deepseek-v2-lite"
seqs, qlen = int(sys.argv[2]), int(sys.argv[3])
arch = SHAPES[name]
dev = torch.device("cuda")
model = CausalLM(arch, torch.bfloat16, dev, max_positions=4096)
load_model(model, None, "dummy", seed=0)
with torch.inference_mode():
    meta, pos, nblocks = make_batch([qlen] * seqs, [qlen] * seqs, dev)
    if arch.mla:
        caches = [(torch.zeros(nblocks, 16, 1, arch.mla.entry_dim, device=dev, dtype=torch.bfloat16),) for _ in range(arch.num_layers)]
    else:
        caches = [tuple(torch.zeros(nblocks, 16, arch.num_kv_heads, arch.head_dim, device=dev, dtype=torch.bfloat16) for _ in range(2)) for _ in range(arch.num_layers)]
    ids = torch.randint(0, arch.vocab_size, (seqs * qlen,), device=dev)
    def fn():
        h = model(ids, pos, caches, meta)
        return model.compute_logits(h[meta.query_start_loc[1:] - 1]).argmax(-1)
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / 5 * 1e3
    tok = seqs * qlen
    print(f"{name} prefill {seqs}x{qlen}: {ms:.2f} ms wall ({tok / ms * 1e3:,.0f} tok/s)", flush=True)
    rows = kernel_breakdown(fn, steps=2)
    print_breakdown(f"prefill {seqs}x{qlen}", rows, top=40)
