"""The tokenizer process's per-token output work in one process, no sockets: one step's TokenDeltas for R streamed
requests (rendered by the tokenizer, as the api asks) through Outputs.on_token_deltas, then encoded as the frames
the api gets. Prints microseconds per row (one streamed token).

    python -m pagoda.bench.tokenizer_rows --rows 64 --steps 256 --repeat 5

A CPU micro-benchmark for A/B of the tokenizer's hot path (bench/stream_cpu.py measures the served processes)."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec

from pagoda.services.tokenizer.output import Outputs
from pagoda.services.tokenizer.tokenizer import Tokenizer
from pagoda.shared.messages import GenerateRequest, RenderSpec, SamplingParams, TokenDeltas

SMOLLM2 = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"


def one_run(tokenizer: Tokenizer, rows: int, steps: int, chat: bool, seed: int) -> float:
    """Seconds of CPU for `steps` steps of `rows` requests."""
    rng = random.Random(seed)
    outputs = Outputs(tokenizer)
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=steps, ignore_eos=True)
    ids = [f"cmpl-{seed}-{i}" for i in range(rows)]
    for request_id in ids:
        spec = RenderSpec(int(chat), request_id, "m", 1700000000, True, include_usage=True)
        outputs.add(0, GenerateRequest(request_id, params, prompt_token_ids=[1, 2, 3], render=spec), params,
                    [rng.randrange(100, 49000) for _ in range(32)], None)
    frames = [TokenDeltas(ids, [0] * rows, [rng.randrange(100, 49000) for _ in range(rows)],
                          [-1 if s < steps - 1 else 1] * rows, [0] * rows) for s in range(steps)]
    encoder = msgspec.msgpack.Encoder()
    start = time.process_time()
    for frame in frames:
        batch = outputs.on_token_deltas(frame)
        for messages in batch.to_apis.values():
            for message in messages:
                encoder.encode(message)
    return time.process_time() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chat", action="store_true")
    args = parser.parse_args(argv)
    tokenizer = Tokenizer(SMOLLM2)
    runs = [1e6 * one_run(tokenizer, args.rows, args.steps, args.chat, r) / (args.rows * args.steps)
            for r in range(args.repeat)]
    print(f"us per row: median {statistics.median(runs):.2f} (runs: {', '.join(f'{r:.2f}' for r in runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
