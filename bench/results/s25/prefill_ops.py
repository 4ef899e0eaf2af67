"""deepseek-v2-lite prefill step (S x L new tokens): the aten ops behind its device time, grouped by input shapes
(which ops the elementwise and copy kernels come from)."""
import sys

import torch

from pagoda.bench.decode_profile import make_batch
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
    caches = [(torch.zeros(nblocks, 16, 1, arch.mla.entry_dim, device=dev, dtype=torch.bfloat16),)
              for _ in range(arch.num_layers)]
    ids = torch.randint(0, arch.vocab_size, (seqs * qlen,), device=dev)

    def fn():
        h = model(ids, pos, caches, meta)
        return model.compute_logits(h[meta.query_start_loc[1:] - 1]).argmax(-1)

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="device_time_total", row_limit=45,
                                                             max_name_column_width=40, max_shapes_column_width=90))
