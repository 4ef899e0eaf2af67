"""torch.argmax vs sampling.greedy_argmax over [B, 128256] bf16 logits, graph-timed, ids compared."""
import torch
from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.kernels.sampling import greedy_argmax

for B in (1, 8, 64, 256):
    logits = torch.randn(B, 128256, device="cuda").bfloat16()
    same = torch.equal(logits.argmax(dim=-1), greedy_argmax(logits))
    t_torch = graph_time_ms(lambda: logits.argmax(dim=-1), reps=50) * 1e3
    t_split = graph_time_ms(lambda: greedy_argmax(logits), reps=50) * 1e3
    print(f"argmax B={B:3d} V=128256 bf16: torch {t_torch:6.1f} us, split {t_split:6.1f} us, same ids {same}", flush=True)
