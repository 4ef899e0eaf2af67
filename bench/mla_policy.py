"""Which prefill chunks of a DeepSeek model take MLA's expanded path: the same workload end to end under several
expand thresholds (kernels/mla.py ExpandPolicy.min_query_len), in one process so that one load serves all runs.

Each round runs every threshold once, in order, on fresh prompts (another seed each run: nothing in the prefix
cache); the table gives each threshold's median over the rounds, with its prefill (mixed) steps' GPU time.

    python -m pagoda.bench.mla_policy --model deepseek-v2-lite --load-format dummy --thresholds 2048,256 --rounds 2
    python -m pagoda.bench.mla_policy --smoke    # a tiny random DeepSeek-V2 on CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from typing import Any

from pagoda.bench.report import write_report
from pagoda.bench.throughput import measure_pagoda
from pagoda.bench.workload import preset


def set_threshold(llm: Any, min_query_len: int) -> int:
    """Every MLA layer's expand threshold set to min_query_len (its workspace bound kept); the layers changed."""
    from pagoda.services.worker.models.deepseek import MlaAttention

    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, MlaAttention)]
    if not layers:
        raise SystemExit("not an MLA model: no MlaAttention layers")
    for layer in layers:
        layer.expand = replace(layer.expand, min_query_len=min_query_len)
    return len(layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v2-lite")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--workload", default="reference")
    parser.add_argument("--thresholds", default="2048,256", help="comma-separated query lengths")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on CPU, to check the script itself")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from pagoda import LLM

    thresholds = [int(x) for x in args.thresholds.split(",")]
    if args.smoke:
        from pagoda.bench.interpreter import use_interpreter

        use_interpreter()
        args.model = "tiny-deepseek-v3"
        llm = LLM("tiny-deepseek-v3", load_format="dummy", device="cpu", dtype="float32", num_kv_blocks=256)
        workload = preset(args.workload, "tiny-deepseek-v3", num_prompts=4, input_len=24, output_len=4)
    else:
        llm = LLM(args.model, load_format=args.load_format)
        workload = preset(args.workload, args.model)
    rows: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        for threshold in thresholds:
            set_threshold(llm, threshold)
            run = replace(workload, seed=workload.seed + 100 + len(rows))
            result = measure_pagoda(llm, run)
            row = {"round": round_index, "min_query_len": threshold, **{k: result.get(k) for k in (
                "output_tok_per_s", "elapsed_s", "mixed_steps", "mixed_steps_gpu_s", "decode_step_gpu_ms_p50",
                "prefix_hit_tokens")}}
            rows.append(row)
            print(f"round {round_index} min_query_len {threshold:5d}: {row['output_tok_per_s']:9.0f} out tok/s, "
                  f"mixed steps GPU {row['mixed_steps_gpu_s'] or 0:.3f} s, decode p50 "
                  f"{row['decode_step_gpu_ms_p50'] or 0:.2f} ms", flush=True)
    print(f"\n{args.model} {args.workload}: median over {args.rounds} rounds")
    for threshold in thresholds:
        mine = [r for r in rows if r["min_query_len"] == threshold]
        rate = statistics.median(r["output_tok_per_s"] for r in mine)
        mixed = statistics.median(r["mixed_steps_gpu_s"] or 0.0 for r in mine)
        print(f"  min_query_len {threshold:5d}: {rate:9.0f} out tok/s, mixed steps GPU {mixed:.3f} s")
    write_report(rows, args.out, "mla_policy.json", indent=1, announce=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
