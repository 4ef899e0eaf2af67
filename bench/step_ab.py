"""A/B of environment settings on one model's decode step, in one process: each variant's step (forward + LM head)
captured in a CUDA graph and timed, its logits compared with the first variant's.

    python -m pagoda.bench.step_ab --model llama3-8b --quantization fp8 --batches 1,2,8 --context 512 \\
        off="PAGODA_DENSE_GEMV=0" on="PAGODA_DENSE_GEMV=1;PAGODA_PDL=force"

A variant is LABEL=VAR=value[;VAR=value...] (settings separated by ';', so values may hold commas); the first is
the reference. Settings a kernel reads at launch (launch shapes, paths, PDL) take effect because every variant is
captured anew. Dummy weights; MLA models get a latent cache, others K/V. Prints one line per batch size (min of
--rounds) and, with --profile, each variant's kernels at the first batch size.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.bench.decode_profile import kernel_breakdown, make_batch, print_breakdown
from pagoda.shared.shapes import SHAPES


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """LABEL=VAR=value;VAR=value -> (label, settings)."""
    label, sep, settings = spec.partition("=")
    if not sep or not label:
        raise ValueError(f"a variant is LABEL=VAR=value[;VAR=value...], got {spec!r}")
    pairs = [item.split("=", 1) for item in settings.split(";") if item]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"settings of {label!r} must be VAR=value, got {settings!r}")
    return label, dict(pairs)  # type: ignore[arg-type]


def _caches(arch, num_blocks: int, device: torch.device,  # noqa: ANN001
            dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """Random caches of every layer in dtype (the model's, or e4m3 for an fp8 cache)."""
    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device).to(dtype)

    if arch.mla is not None:  # one latent "head" of R + P values a token
        return [(random(num_blocks, 16, 1, arch.mla.entry_dim),) for _ in range(arch.num_layers)]
    return [tuple(random(num_blocks, 16, arch.num_kv_heads, arch.head_dim) for _ in range(2))
            for _ in range(arch.num_layers)]


def measure(model, batch: int, context: int, variants: list[tuple[str, dict[str, str]]], rounds: int,  # noqa: ANN001
            profile: bool, timer: Callable[[Callable[[], object]], float] | None = None,
            cache_dtype: torch.dtype | None = None) -> str:
    """One batch size: each variant's step timed (default: captured in a CUDA graph; min of rounds) and whether
    its logits equal the first variant's."""
    arch, device = model.arch, model.embed.device
    timer = timer or (lambda fn: graph_time_ms(fn, reps=30))
    meta, positions, num_blocks = make_batch([1] * batch, [context + 1] * batch, device)
    caches = _caches(arch, num_blocks, device, cache_dtype or model.dtype)
    ids = torch.randint(0, arch.vocab_size, (batch,), device=device)

    def step() -> torch.Tensor:
        return model.compute_logits(model(ids, positions, caches, meta))

    os.environ.update(variants[0][1])
    reference = step().float()
    times: dict[str, list[float]] = {label: [] for label, _ in variants}
    differ: set[str] = set()
    for _ in range(rounds):
        for label, settings in variants:
            os.environ.update(settings)
            if not torch.equal(step().float(), reference):
                differ.add(label)
            times[label].append(timer(step))
    if profile:
        for label, settings in variants:
            os.environ.update(settings)
            print_breakdown(f"{label} B={batch}", kernel_breakdown(step), top=14)
    row = "  ".join(f"{label} {min(t):.3f}" for label, t in times.items())
    return (f"{model.arch.model_type} B={batch} ctx {context}: {row} (ms; logits differ from {variants[0][0]}: "
            f"{sorted(differ) or 'none'})")


def main(argv: list[str] | None = None) -> int:
    from pagoda.services.worker.models import CausalLM, Fp8Weights
    from pagoda.services.worker.weights import load_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--quantization", default="none", choices=("none", "fp8", "fp8_block"))
    parser.add_argument("--batches", default="1")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="fp8: e4m3 caches (random codes, unit scales), as --kv-cache-dtype fp8 serves")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("variants", nargs="+", help="LABEL=VAR=value[;VAR=value...]; the first is the reference")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_ab needs a CUDA device")
    variants = [parse_variant(spec) for spec in args.variants]
    arch = SHAPES[args.model]
    device = torch.device("cuda")
    fp8 = {"none": None, "fp8": Fp8Weights(None), "fp8_block": Fp8Weights(128)}[args.quantization]
    model = CausalLM(arch, torch.bfloat16, device, max_positions=args.context + 64, fp8=fp8)
    load_model(model, None, "dummy", seed=0)
    with torch.inference_mode():
        for index, batch in enumerate(int(b) for b in args.batches.split(",")):
            print(measure(model, batch, args.context, variants, args.rounds, args.profile and index == 0,
                          cache_dtype=torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
