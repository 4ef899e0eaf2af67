"""Does where a sequence's blocks sit in the pool change the decode step? llama3-8b FP8 + fp8 KV, B sequences of
CONTEXT tokens in a pool of POOL blocks: blocks consecutive per sequence (step_ab's layout), interleaved the way
sequences that grow together get them (block j of sequence i at j * B + i), or shuffled over the whole pool."""

from __future__ import annotations

import argparse

import torch

from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.bench.decode_profile import make_batch
from pagoda.services.worker.models import CausalLM, Fp8Weights
from pagoda.services.worker.weights import load_model
from pagoda.shared.shapes import SHAPES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=896)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--pool", type=int, default=100_000)
    args = parser.parse_args()
    arch, device = SHAPES["llama3-8b"], torch.device("cuda")
    model = CausalLM(arch, torch.bfloat16, device, max_positions=args.context + 64, fp8=Fp8Weights(None))
    load_model(model, None, "dummy", seed=0)
    caches = [tuple(torch.empty(args.pool, 16, arch.num_kv_heads, arch.head_dim, device=device,
                                dtype=torch.float8_e4m3fn) for _ in range(2)) for _ in range(arch.num_layers)]
    for k, v in caches:
        k.view(torch.uint8).random_(0, 120)
        v.view(torch.uint8).random_(0, 120)
    meta, positions, needed = make_batch([1] * args.batch, [args.context + 1] * args.batch, device)
    assert needed <= args.pool
    blocks = meta.block_tables.shape[1]
    contiguous = meta.block_tables.clone()
    layouts = {
        "consecutive": contiguous,
        "interleaved": (torch.arange(blocks, device=device)[None, :] * args.batch
                        + torch.arange(args.batch, device=device)[:, None]).to(torch.int32),
        "shuffled": torch.randperm(args.pool, device=device)[:args.batch * blocks].view(args.batch, blocks)
        .to(torch.int32),
    }
    ids = torch.randint(0, arch.vocab_size, (args.batch,), device=device)
    with torch.inference_mode():
        for round_ in range(2):
            for name, table in layouts.items():
                meta.block_tables.copy_(table)
                last = meta.block_tables[:, -1].long()
                meta.slot_mapping.copy_(last * 16 + args.context % 16)
                ms = graph_time_ms(lambda: model.compute_logits(model(ids, positions, caches, meta)), reps=20)
                print(f"round {round_} {name:<12} B={args.batch} ctx {args.context}: {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
