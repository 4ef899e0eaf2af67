"""What a grammar's forced start saves: short structured answers with and without fast-forward.

    python -m pagoda.bench.fast_forward                              # CPU: SmolLM2
    python -m pagoda.bench.fast_forward --model qwen3-0.6b --load-format dummy \
        --tokenizer models/smollm2-135m-instruct --batch 64         # GPU

A classification schema (`{"sentiment": "<one of three>", "confidence": <0-9>}`: the grammar forces its
opening `{"sentiment": "`) answered greedily, first one request at a time (latency: what an agent's tool call
waits), then --batch requests at once (requests/s). Each mode runs in an engine of its own, the same prompts,
alternating for --rounds rounds; figures are medians. `steps` counts engine steps per request at batch 1: the
forced tokens are the steps fast-forward skips. The answers differ where the grammar's tokenization of the
forced text differs from the one the model would have sampled (docs/decoding.md), so each mode's outputs are
checked against the schema, not against each other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from pagoda.bench.report import write_json
from pagoda.llm import LLM
from pagoda.shared.config import DEFAULT_MODEL_DIR
from pagoda.shared.messages import SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "required": ["sentiment", "confidence"], "additionalProperties": False,
          "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                         "confidence": {"type": "integer", "minimum": 0, "maximum": 9}}}
KV_CACHE_BYTES = 2 << 30  # per engine on CUDA: --batch sequences of max_model_len tokens fit many times over
REVIEWS = ["The food was wonderful and the staff were kind.", "Cold soup, rude waiter, never again.",
           "It was a restaurant. We ate there.", "Best pizza in town, I will be back!"]


def answers_valid(texts: list[str]) -> bool:
    for text in texts:
        try:
            answer = json.loads(text)
        except ValueError:  # cut by max_tokens
            return False
        if answer["sentiment"] not in SCHEMA["properties"]["sentiment"]["enum"] or not 0 <= answer["confidence"] <= 9:
            return False
    return True


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list[str], int]:
    """One generate: wall seconds, the answers, engine steps."""
    on_cuda = llm.engine.runner.device.type == "cuda"
    steps_before = llm.engine.scheduler.stats.num_steps
    if on_cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    return elapsed, [o.outputs[0].text for o in outputs], llm.engine.scheduler.stats.num_steps - steps_before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--batch", type=int, default=16, help="requests at once in the throughput part")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args()
    engine_args: dict[str, Any] = {"max_model_len": 512, "max_num_seqs": max(args.batch, 8)}
    if args.load_format:
        engine_args["load_format"] = args.load_format
    if args.tokenizer:
        engine_args["tokenizer"] = args.tokenizer
    if torch.cuda.is_available():  # two engines share the device: each a small cache (the default takes 0.9 of it)
        engine_args["kv_cache_memory"] = KV_CACHE_BYTES
    engines = {mode: LLM(args.model, grammar_fast_forward=mode == "fast_forward", **engine_args)
               for mode in ("fast_forward", "step_by_step")}
    template = "Classify the review's sentiment and your confidence as JSON.\nReview: {}\nJSON:"
    prompts = [template.format(REVIEWS[i % len(REVIEWS)]) for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=StructuredOutputs(json=SCHEMA))
    for llm in engines.values():  # warm-up: kernels, the llguidance tokenizer, the schema's matcher
        llm.generate(prompts[:2], params)
    samples: dict[str, dict[str, list[float]]] = {m: {"latency_ms": [], "steps": [], "req_per_s": []} for m in engines}
    valid = {mode: True for mode in engines}
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for mode in order:
            llm = engines[mode]
            for prompt in prompts[:len(REVIEWS)]:
                elapsed, texts, steps = timed(llm, [prompt], params)
                samples[mode]["latency_ms"].append(elapsed * 1e3)
                samples[mode]["steps"].append(steps)
                valid[mode] &= answers_valid(texts)
            elapsed, texts, _ = timed(llm, prompts, params)
            samples[mode]["req_per_s"].append(len(prompts) / elapsed)
            valid[mode] &= answers_valid(texts)
            print(f"round {round_index + 1}/{args.rounds} {mode}: {samples[mode]['req_per_s'][-1]:.1f} req/s",
                  file=sys.stderr, flush=True)
    figures: dict[str, Any] = {"model": args.model, "batch": args.batch, "rounds": args.rounds,
                               "device": str(engines["fast_forward"].engine.runner.device)}
    for mode, values in samples.items():
        figures[mode] = {name: statistics.median(v) for name, v in values.items()} | {"answers_valid": valid[mode]}
    ff, plain = figures["fast_forward"], figures["step_by_step"]
    figures["latency_ratio"] = ff["latency_ms"] / plain["latency_ms"]
    figures["throughput_ratio"] = ff["req_per_s"] / plain["req_per_s"]
    print(json.dumps(figures, indent=2))
    print(f"batch 1: {ff['latency_ms']:.1f} ms ({ff['steps']:.0f} steps) with fast-forward vs "
          f"{plain['latency_ms']:.1f} ms ({plain['steps']:.0f} steps) without: {figures['latency_ratio']:.2f}x "
          f"the time; batch {args.batch}: "
          f"{ff['req_per_s']:.1f} vs {plain['req_per_s']:.1f} req/s ({figures['throughput_ratio']:.2f}x)")
    if args.out:
        write_json(args.out, figures)


if __name__ == "__main__":
    main()
