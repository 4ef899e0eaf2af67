"""trtllm-1000's mixed step by kernel: llama3-8b FP8 + fp8 KV, DECODE rows at CONTEXT cached tokens beside
PREFILL prompts of CHUNK new tokens each (no cached context), eager, the way the engine runs steps that carry
chunks."""

from __future__ import annotations

import argparse
import time

import torch

from pagoda.bench.decode_profile import kernel_breakdown, make_batch, print_breakdown, step_fn
from pagoda.services.worker.models import CausalLM, Fp8Weights
from pagoda.services.worker.weights import load_model
from pagoda.shared.shapes import SHAPES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decode", type=int, default=900)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--prefill", type=int, default=15)
    parser.add_argument("--chunk", type=int, default=1000)
    parser.add_argument("--kv", default="fp8")
    args = parser.parse_args()
    arch, device = SHAPES["llama3-8b"], torch.device("cuda")
    model = CausalLM(arch, torch.bfloat16, device, max_positions=max(args.context, args.chunk) + 64,
                     fp8=Fp8Weights(None))
    load_model(model, None, "dummy", seed=0)
    query_lens = [1] * args.decode + [args.chunk] * args.prefill
    seq_lens = [args.context + 1] * args.decode + [args.chunk] * args.prefill
    meta, positions, needed = make_batch(query_lens, seq_lens, device)
    dtype = torch.float8_e4m3fn if args.kv == "fp8" else torch.bfloat16
    caches = [tuple(torch.randn(needed, 16, arch.num_kv_heads, arch.head_dim, device=device).to(dtype)
                    for _ in range(2)) for _ in range(arch.num_layers)]
    ids = torch.randint(0, arch.vocab_size, (len(positions),), device=device)
    step = step_fn(model, ids, positions, caches, meta)
    with torch.inference_mode():
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - start))
        print(f"mixed step, {args.decode} decode rows at {args.context} + {args.prefill} x {args.chunk} new, kv "
              f"{args.kv}: wall {sorted(times)[2]:.1f} ms (median of 5)")
        print_breakdown("mixed", kernel_breakdown(step), top=24)


if __name__ == "__main__":
    main()
