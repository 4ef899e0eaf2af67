"""What the browser console costs the served throughput: the same streamed load on a server started with
--no-console, then on one with the console on and one console page open (its stats stream and polls).

    python -m pagoda.bench.console_overhead --model qwen3-0.6b --load-format dummy \\
        --tokenizer models/smollm2-135m-instruct --concurrency 256 --num-prompts 1024 --rounds 5

Each server gets a short warm-up level, then `rounds` measured levels of the reference workload (256 x 512 ->
256, greedy, EOS ignored), each with prompts no earlier level sent (the prefix cache would skip their
prefill). Prints each round and the ratio of the medians (the issue's bound: >= 0.99), and the console's
ticks per second (>= 1); writes JSON to $OUT/console_overhead.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from dataclasses import replace
from typing import Any

from pagoda.bench.data_parallel import serving
from pagoda.bench.report import stamp, write_report
from pagoda.bench.serve import run_level
from pagoda.bench.workload import preset

TARGET_RATIO = 0.99
TICKS_PER_S = 0.98  # one a second on a fixed schedule, with the event loop's timer jitter
MODES = {"off": ["--no-console"], "on": []}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder: real text streams (dummy weights)")
    parser.add_argument("--workload", default="reference")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=None, help="per round (default: the workload's)")
    parser.add_argument("--input-len", type=int, default=None, help="default: the workload's")
    parser.add_argument("--output-len", type=int, default=None, help="default: the workload's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--order", default="off,on", help="servers in this order (e.g. off,on,off)")
    parser.add_argument("--vocab-size", type=int, default=49152, help="random prompt ids are drawn below this")
    parser.add_argument("--serve-args", default="", help="more `pagoda serve` flags, space-separated")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def run_server(args: argparse.Namespace, mode: str, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Warm up, then the measured rounds, on one fresh server; returns the rounds and the next prompt offset."""
    workload = preset(args.workload, num_prompts=args.num_prompts, input_len=args.input_len,
                      output_len=args.output_len)
    extra = ["--load-format", args.load_format, *MODES[mode], *args.serve_args.split()]
    if args.tokenizer:
        extra += ["--tokenizer", args.tokenizer]
    rounds = []
    with serving(args.model, *extra, startup_timeout=args.startup_timeout) as server:
        warm = replace(workload, num_prompts=min(32, workload.num_prompts), output_len=16)
        asyncio.run(run_level(server.url, "m", warm.prompts(args.vocab_size, offset), 16, warm.num_prompts, None,
                              {}, 0))
        offset += warm.num_prompts
        for index in range(args.rounds):
            prompts = workload.prompts(args.vocab_size, offset)
            offset += len(prompts)
            result = asyncio.run(run_level(server.url, "m", prompts, workload.output_len, args.concurrency, None,
                                           {}, index, workload.sampling_kwargs(), console=mode == "on"))
            result["mode"], result["round"] = mode, index
            rounds.append(result)
            console = result.get("console")
            ticks = (f"  console {console['ticks_per_s']:.2f} ticks/s (max gap {console['max_gap_s']:.2f} s)"
                     if console else "")
            print(f"console {mode:<3} round {index}: {result['output_tok_per_s']:9.1f} out tok/s  "
                  f"TTFT p50 {result['ttft_p50_ms']:7.1f} ms  ITL p50 {result['itl_p50_ms']:5.1f} ms  "
                  f"failed {result['num_failed']}{ticks}", flush=True)
    return rounds, offset


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: list[dict[str, Any]] = []
    offset = 0
    for mode in args.order.split(","):
        rounds, offset = run_server(args, mode.strip(), offset)
        results += rounds
    medians = {mode: statistics.median(r["output_tok_per_s"] for r in results if r["mode"] == mode)
               for mode in ("off", "on") if any(r["mode"] == mode for r in results)}
    ratio = medians["on"] / medians["off"] if len(medians) == 2 else float("nan")
    ticks = [r["console"]["ticks_per_s"] for r in results if "console" in r]
    gaps = [r["console"]["max_gap_s"] for r in results if "console" in r]
    failed = sum(r["num_failed"] for r in results)
    print("\n| server | median out tok/s |\n|---|---:|\n" + "".join(f"| console {m} | {v:,.0f} |\n"
                                                             for m, v in medians.items()))
    print(f"ratio on/off: {ratio:.4f} (target >= {TARGET_RATIO}); console ticks/s: "
          f"{min(ticks, default=float('nan')):.3f} min (target >= 1, a tick a second; timer jitter aside), longest "
          f"gap between ticks {max(gaps, default=float('nan')):.2f} s; failed requests: {failed}")
    write_report({"date": stamp(), "args": vars(args), "medians": medians, "ratio": ratio, "rounds": results},
                 args.out, "console_overhead.json", fallback_dir="bench/out", announce=True)
    ok = failed == 0 and ratio >= TARGET_RATIO and min(ticks, default=0.0) >= TICKS_PER_S
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
