"""Per-layer decode time of a DeepSeek shape against its per-layer floor, on one GPU (CUDA only).

    python -m pagoda.bench.deepseek_bench [--model deepseek-v3-slice] [--quantization fp8_block] [--batches 1,64,256]
        [--context 1024] [--kv-cache-dtype auto|fp8] [--profile] [--out FILE]

Builds the model with dummy weights, a decode batch of B sequences of `--context` cached tokens each, and times in
CUDA graphs (as decode runs): the whole forward, and each distinct layer kind alone (the dense layer, a sparse
layer). Each layer's floor is max(bytes / 4.2 TB/s, FLOPs / 780 TFLOP/s) where bytes = the layer's weights as
stored (FP8 one byte, kv_b_proj and norms in bf16, the router in fp32) with only the experts this step's routing
really touches (counted from the router's choice; the uniform expectation is printed beside it) + the latent cache
entries the batch reads, and FLOPs = 2 x active weights x B + absorbed attention (2 (R + P) + 2 R per head and key).
JSON goes to --out, else to $OUT/deepseek_bench.json when OUT is set.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from pagoda.bench.cuda_timing import graph_time_ms
from pagoda.bench.report import write_report
from pagoda.services.worker.models import CausalLM, Fp8Weights
from pagoda.services.worker.models import deepseek as deepseek_module
from pagoda.services.worker.weights import load_model
from pagoda.shared.shapes import SHAPES, ModelArch

PEAK_BYTES_PER_S = 4.2e12
PEAK_FLOPS = 780e12
BLOCK_SIZE = 16


def _graph_ms(fn: Any, reps: int = 20) -> float:  # noqa: ANN401
    """Median device time of one call of `fn` replayed from a CUDA graph; on CPU (--smoke) the wall time of eager
    calls."""
    if torch.cuda.is_available():
        return graph_time_ms(fn, reps)
    fn()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - start) / 3 * 1e3


def kernel_breakdown(fn: Any, reps: int = 5) -> list[tuple[str, int, float]]:  # noqa: ANN401
    """(kernel, launches per call, device us per call) of eager calls of `fn`, largest first: where a layer's time
    goes beyond its floor (launch count and per-kernel time). On CPU (--smoke) the ops' own CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    fn()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = (event.self_device_time_total if cuda else event.self_cpu_time_total) / reps
        if us > 0:
            rows.append((event.key, max(1, event.count // reps), us))
    return sorted(rows, key=lambda row: -row[2])


def _print_breakdown(rows: list[tuple[str, int, float]], top: int = 15) -> None:
    print(f"    {sum(n for _, n, _ in rows)} kernels a call, {sum(us for _, _, us in rows):.1f} us eager device time; "
          f"the largest:")
    for name, count, us in rows[:top]:
        print(f"    {us:8.1f} us  x{count:<3d} {name[:100]}")


def _decode_meta(batch: int, context: int, device: torch.device) -> tuple[Any, torch.Tensor, int]:
    from pagoda.bench.decode_profile import make_batch

    return make_batch([1] * batch, [context] * batch, device)


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _layer_floor(layer: Any, arch: ModelArch, batch: int, context: int, touched: int, kv_bytes: int) -> dict:  # noqa: ANN401
    """Bytes and FLOPs one decode step of `batch` tokens needs in this layer."""
    mla = arch.mla
    assert mla is not None
    weight_bytes = _param_bytes(layer.attn) + layer.input_norm.nbytes + layer.post_attn_norm.nbytes
    flop_params = sum(p.numel() for p in layer.attn.parameters())
    if layer.mlp is not None:
        moe = layer.mlp
        expert_bytes = (moe.w_gate_up[0].nbytes + moe.w_down[0].nbytes
                        + (moe.w_gate_up_scale[0].nbytes + moe.w_down_scale[0].nbytes
                           if moe.w_gate_up_scale is not None else 0))
        # the shared experts fused in as experts E.. (moe.num_shared of them) are read by every step
        weight_bytes += moe.router.nbytes + (touched + moe.num_shared) * expert_bytes
        flop_params += moe.router.numel() + (arch.moe.top_k + moe.num_shared) * (moe.w_gate_up[0].numel()
                                                                                 + moe.w_down[0].numel())
        if moe.shared is not None:
            weight_bytes += _param_bytes(moe.shared)
            flop_params += sum(p.numel() for p in moe.shared.parameters())
    else:
        weight_bytes += _param_bytes(layer.dense_mlp)
        flop_params += sum(p.numel() for p in layer.dense_mlp.parameters())
    heads = arch.num_heads
    attn_flops = 2 * batch * context * heads * (mla.entry_dim + mla.kv_lora_rank)
    flops = 2 * flop_params * batch + attn_flops
    bytes_total = weight_bytes + kv_bytes
    floor_ms = max(bytes_total / PEAK_BYTES_PER_S, flops / PEAK_FLOPS) * 1e3
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "flops": flops, "floor_ms": floor_ms,
            "bound": "bytes" if bytes_total / PEAK_BYTES_PER_S >= flops / PEAK_FLOPS else "flops"}


def _touched_experts(run: Any, num_experts: int) -> int:  # noqa: ANN401
    """Distinct routed experts the sparse layer's router picks in one eager run of `run` (the shared experts,
    fused in as ids >= E, apart)."""
    seen: list[torch.Tensor] = []
    original = deepseek_module.route_grouped_topk

    def recording(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN401
        weights, ids = original(*args, **kwargs)
        seen.append(ids)
        return weights, ids

    deepseek_module.route_grouped_topk = recording
    try:
        run()
    finally:
        deepseek_module.route_grouped_topk = original
    ids = torch.unique(seen[0])
    return int((ids < num_experts).sum())


def bench_batch(model: CausalLM, arch: ModelArch, batch: int, context: int, kv_dtype: torch.dtype,
                profile: bool = False) -> list[dict]:
    device = model.final_norm.device
    mla, moe = arch.mla, arch.moe
    assert mla is not None and moe is not None
    meta, positions, num_blocks = _decode_meta(batch, context, device)
    caches = [(torch.randn(num_blocks, BLOCK_SIZE, 1, mla.entry_dim, device=device).mul_(0.5).to(kv_dtype),)
              for _ in range(arch.num_layers)]  # [N, bs, 1, R + P] each
    input_ids = torch.randint(0, arch.vocab_size, (batch,), device=device)
    kv_bytes = batch * context * mla.entry_dim * caches[0][0].element_size()
    rows = []
    whole_ms = _graph_ms(lambda: model(input_ids, positions, caches, meta))
    x = (torch.randn(batch, arch.hidden_size, device=device) * 0.5).to(model.dtype)  # [B, H]
    residual = torch.randn_like(x)
    sparse_index = moe.sparse_layers[0]
    dense = [i for i in range(arch.num_layers) if i not in moe.sparse_layers]
    for index in dense[:1] + [sparse_index]:
        layer = model.layers[index]

        def run(layer: Any = layer, index: int = index) -> Any:  # noqa: ANN401
            return layer(x, residual, positions, model.rope_cache, caches[index], meta, model.ops)

        touched = _touched_experts(run, moe.num_experts) if layer.mlp is not None else 0
        ms = _graph_ms(run)
        floor = _layer_floor(layer, arch, batch, context, touched, kv_bytes)
        expected = moe.expected_experts_touched(batch) if layer.mlp is not None else 0.0
        row = {"model": arch.model_type, "B": batch, "context": context, "layer": index,
               "kind": "sparse" if layer.mlp is not None else "dense", "ms": ms, "whole_forward_ms": whole_ms,
               "experts_touched": touched, "experts_touched_uniform": round(expected, 1), **floor,
               "fraction_of_floor": floor["floor_ms"] / ms}
        rows.append(row)
        print(f"B={batch:3d} ctx={context} layer {index} ({row['kind']:6s}): {ms * 1e3:8.1f} us, floor "
              f"{floor['floor_ms'] * 1e3:8.1f} us ({floor['bound']}-bound; {row['fraction_of_floor']:.2f} of it); "
              f"weights {floor['weight_bytes'] / 1e6:7.1f} MB, KV {kv_bytes / 1e6:6.1f} MB, experts touched "
              f"{touched} (uniform {expected:.0f}); whole forward {whole_ms:.2f} ms", flush=True)
        if profile:
            breakdown = kernel_breakdown(run)
            row["kernels"] = [{"name": n, "count": c, "us": us} for n, c, us in breakdown]
            _print_breakdown(breakdown)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v3-slice", choices=[n for n, a in SHAPES.items() if a.mla])
    parser.add_argument("--quantization", default="fp8_block", choices=("none", "fp8", "fp8_block"))
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="each layer kind's kernels (torch.profiler, eager)")
    parser.add_argument("--smoke", action="store_true", help="tiny-deepseek-v3 on CPU: checks the script runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.quantization, args.batches, args.context = "tiny-deepseek-v3", "none", "1,4", 40
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --smoke)")
    torch.manual_seed(0)
    arch = SHAPES[args.model]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fp8 = {"none": None, "fp8": Fp8Weights(None), "fp8_block": Fp8Weights(128)}[args.quantization]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = CausalLM(arch, dtype, device, max_positions=args.context + 16, fp8=fp8)
    load_model(model, None, "dummy", seed=0)
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name()}: {args.model} ({arch.num_params() / 1e9:.1f}B, weights "
              f"{args.quantization}), {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated", flush=True)
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else dtype
    rows: list[dict] = []
    with torch.inference_mode():
        for batch in (int(b) for b in args.batches.split(",")):
            rows += bench_batch(model, arch, batch, args.context, kv_dtype, args.profile)
            torch.cuda.empty_cache()
    write_report(rows, args.out, "deepseek_bench.json", indent=1, announce=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
