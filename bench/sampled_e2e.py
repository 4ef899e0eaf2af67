"""Offline greedy vs "sampled" end to end (dummy weights): output tokens per second of the same workload.

    python -m bench.sampled_e2e --model qwen3-0.6b     # and --model llama3-8b

256 requests x 512 random prompt tokens -> 256 output tokens (EOS ignored); sampled = temperature 0.8,
top_p 0.9, top_k 50, presence 0.5, frequency 0.2, a seed per request. The issue's target: sampled >= 0.9x greedy.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from pagoda import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args()
    llm = LLM(args.model)
    vocab = llm.engine.runner.arch.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, vocab - 100, args.input_len).tolist() for _ in range(args.num_prompts)]
    common = dict(max_tokens=args.output_len, ignore_eos=True)
    settings = {
        "greedy": [SamplingParams(temperature=0.0, **common)] * args.num_prompts,
        "sampled": [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, presence_penalty=0.5, frequency_penalty=0.2,
                                   seed=i, **common) for i in range(args.num_prompts)],
    }
    llm.generate(prompts[:8], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8))  # warm-up (JIT, graphs)
    rates = {}
    for name, params in settings.items():
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rates[name] = num_tokens / seconds
        print(f"{args.model} {name:8s} {num_tokens} tokens in {seconds:.2f} s: {rates[name]:,.0f} out tok/s")
    print(f"sampled / greedy = {rates['sampled'] / rates['greedy']:.2f}")


if __name__ == "__main__":
    main()
