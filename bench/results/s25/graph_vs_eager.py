"""llama3-8b FP8 + fp8 KV decode step at B rows: eager wall time, CUDA-graph replay time, and the kernels of each
(the profiler's sum at B=896 was 33.7 ms against 38.2 ms graph-timed)."""

from __future__ import annotations

import argparse
import time

import torch

from pagoda.bench.decode_profile import kernel_breakdown, make_batch, print_breakdown
from pagoda.services.worker.models import CausalLM, Fp8Weights
from pagoda.services.worker.weights import load_model
from pagoda.shared.shapes import SHAPES


def wall_ms(fn, reps: int = 10) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[reps // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=896)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--kv", default="fp8")
    args = parser.parse_args()
    arch, device = SHAPES[args.model], torch.device("cuda")
    fp8 = Fp8Weights(None) if args.model == "llama3-8b" else None
    model = CausalLM(arch, torch.bfloat16, device, max_positions=args.context + 64, fp8=fp8)
    load_model(model, None, "dummy", seed=0)
    meta, positions, needed = make_batch([1] * args.batch, [args.context + 1] * args.batch, device)
    dtype = torch.float8_e4m3fn if args.kv == "fp8" else torch.bfloat16
    caches = [tuple(torch.randn(needed, 16, arch.num_kv_heads, arch.head_dim, device=device).to(dtype)
                    for _ in range(2)) for _ in range(arch.num_layers)]
    ids = torch.randint(0, arch.vocab_size, (args.batch,), device=device)

    def step() -> torch.Tensor:
        return model.compute_logits(model(ids, positions, caches, meta))

    with torch.inference_mode():
        step()
        eager = wall_ms(step)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replay = wall_ms(graph.replay)
        ten = wall_ms(lambda: [graph.replay() for _ in range(10)], reps=3) / 10
        print(f"{args.model} B={args.batch} ctx {args.context} kv {args.kv}: eager {eager:.3f} ms, graph replay "
              f"{replay:.3f} ms, 10 replays {ten:.3f} ms a step", flush=True)
        print_breakdown("eager", kernel_breakdown(step), top=8)
        print_breakdown("graph", kernel_breakdown(graph.replay), top=8)


if __name__ == "__main__":
    main()
