"""The benchmark workloads: seeded random prompts of given lengths, the same for pagoda and every peer.

Named presets cover what users send, not only the greedy reference (issue 10):

| name          | prompts x (shared + own) tokens -> output | sampling                                         |
|---------------|-------------------------------------------|--------------------------------------------------|
| reference     | 256 x 512 -> 256                          | greedy                                           |
| sampled       | 256 x 512 -> 256                          | T 0.8, top_p 0.9, top_k 50, presence 0.5,        |
|               |                                           | frequency 0.2, seed                              |
| shared-prefix | 256 x (2048 + 64) -> 128                  | greedy; one 2048-token prefix for every prompt   |
| long          | 16 x 16384 -> 128 (llama3-8b: 16 x 7936)  | greedy                                           |
| n4            | 64 x 512 -> 256, n=4                      | T 0.8, seed                                      |
| openai        | 256 x 512 -> 256                          | T 0.7, top_p 0.95, no top_k (what OpenAI-style   |
|               |                                           | clients send)                                    |
| mixed         | 256 x 512 -> 256                          | a quarter each: greedy; T 0.7 + top_p 0.95;      |
|               |                                           | T 0.8 + top_k 50 + top_p 0.9; T 1.0 + min_p 0.05 |
| long-128k     | 1 x 130816 -> 256                         | greedy; needs a 128k-context shape               |
| long-32k      | 4 x 32512 -> 256                          | greedy                                           |
| beam4         | 64 x 512 -> 128, 4 returned               | beam search, width 4 (not streamed: offline only)|
| n4-128        | 64 x 512 -> 128, n=4                      | T 0.8, seed (beam4's sampled counterpart)        |
| trtllm-1000   | 1024 x 1000 -> 1000; max_num_seqs 1024    | greedy; TensorRT-LLM's perf-overview row (below) |

EOS is ignored everywhere, so every request produces exactly its output length.

trtllm-1000 is the row TensorRT-LLM publishes for one H200 (perf-overview, v1.0: Llama-3.1-8B FP8, 1000 input /
1000 output tokens, no length spread, EOS ignored, 17,744 output tok/s). Run it as `pagoda bench throughput
--model llama3-8b --load-format dummy --quantization fp8 --kv-cache-dtype fp8 --workload trtllm-1000`. The preset
also sets the engine's max_num_seqs to 1024 (ENGINE_DEFAULTS; an explicit --max-num-seqs wins): the default 256
seats would cap the batch far below what the GPU holds. With FP8 weights (~9 GB with the bf16 embeddings and LM
head) and an FP8 cache (64 KiB per llama3-8b token), 0.9 of an H200 leaves ~120 GB of KV, ~1.85M tokens: ~930
sequences at their full 2000 tokens, twice that at their 1000-token prompts. So 1024 seats keep the cache full to
the end (the cache, not the seats, binds over the last ~150 steps, where ~90 sequences are preempted and
recomputed), and 1024 prompts are one wave of ~1M output tokens: 60-80 s at 12-18k tok/s, short enough to run
bf16, fp8 and fp8 + fp8 KV in one GPU call. TensorRT-LLM ran 3000 requests for this row (a steady state of
requests entering and leaving); `--num-prompts 3000` reproduces that count at three times the GPU time.
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import asdict, dataclass, replace
from typing import Any

GREEDY: dict[str, Any] = {"temperature": 0.0}
SAMPLED: dict[str, Any] = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "presence_penalty": 0.5,
                           "frequency_penalty": 0.2, "seed": 1234}
OPENAI: dict[str, Any] = {"temperature": 0.7, "top_p": 0.95}
MIXED: tuple[dict[str, Any], ...] = (GREEDY, OPENAI, {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
                                     {"temperature": 1.0, "min_p": 0.05})  # request i takes MIXED[i % 4]
BEAM: dict[str, Any] = {"use_beam_search": True, "temperature": 0.0}  # best_of = n = the workload's n
SAMPLINGS: dict[str, tuple[dict[str, Any], ...]] = {"greedy": (GREEDY,), "sampled": (SAMPLED,), "openai": (OPENAI,),
                                                    "mixed": MIXED, "beam": (BEAM,)}


@dataclass(frozen=True, slots=True)
class Workload:
    num_prompts: int = 256
    input_len: int = 512  # tokens of each prompt's own part (after any shared prefix)
    output_len: int = 256
    input_len_jitter: float = 0.0  # lengths uniform in input_len * [1 - jitter, 1 + jitter]
    seed: int = 0
    shared_prefix_len: int = 0  # tokens every prompt starts with (one system prompt for all)
    n: int = 1  # completions per prompt
    sampling: str = "greedy"  # a SAMPLINGS name: "greedy", "sampled", "openai" or "mixed" (per request)

    def prompts(self, vocab_size: int, offset: int = 0) -> list[list[int]]:
        """Token ids away from the ends of the vocabulary, where special tokens usually sit. `offset` skips that
        many prompts of the seeded stream, so a later load level gets prompts no earlier level sent."""
        rng = random.Random(self.seed)
        low, high = min(100, vocab_size // 4), max(vocab_size - 300, vocab_size // 2)
        prefix = [rng.randrange(low, high) for _ in range(self.shared_prefix_len)]
        prompts = []
        for _ in range(offset + self.num_prompts):  # each prompt drawn whole, so the stream is prefix-stable
            jitter = rng.uniform(-self.input_len_jitter, self.input_len_jitter)
            length = max(1, round(self.input_len * (1 + jitter)))
            prompts.append(prefix + [rng.randrange(low, high) for _ in range(length)])
        return prompts[offset:]

    def sampling_kwargs(self, index: int = 0) -> dict[str, Any]:
        """SamplingParams / OpenAI body fields of request `index` of this workload, besides max_tokens and
        ignore_eos (only "mixed" differs between requests)."""
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"unknown sampling {self.sampling!r} (known: {', '.join(SAMPLINGS)})")
        kinds = SAMPLINGS[self.sampling]
        kwargs = dict(kinds[index % len(kinds)])
        if self.sampling == "beam":
            return {**kwargs, "best_of": self.n, "n": self.n}
        if self.n > 1:
            kwargs["n"] = self.n
            kwargs.setdefault("seed", 1234)
            if kwargs["temperature"] == 0.0:
                kwargs["temperature"] = 0.8  # n identical greedy copies would measure nothing
        return kwargs

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


PRESETS: dict[str, Workload] = {
    "reference": Workload(),
    "sampled": Workload(sampling="sampled"),
    "shared-prefix": Workload(num_prompts=256, input_len=64, output_len=128, shared_prefix_len=2048),
    "long": Workload(num_prompts=16, input_len=16384, output_len=128),
    "n4": Workload(num_prompts=64, input_len=512, output_len=256, n=4),  # n > 1: T 0.8 + seed (sampling_kwargs)
    "beam4": Workload(num_prompts=64, input_len=512, output_len=128, n=4, sampling="beam"),
    "n4-128": Workload(num_prompts=64, input_len=512, output_len=128, n=4),
    "openai": Workload(sampling="openai"),
    "mixed": Workload(sampling="mixed"),
    # 128k and 32k contexts less the outputs (prompt + 256 outputs = 131,072 / 32,768 positions)
    "long-128k": Workload(num_prompts=1, input_len=131072 - 256, output_len=256),
    "long-32k": Workload(num_prompts=4, input_len=32768 - 256, output_len=256),
    "trtllm-1000": Workload(num_prompts=1024, input_len=1000, output_len=1000),
}
# Engine settings a preset needs to mean what it says (flags given explicitly win).
ENGINE_DEFAULTS: dict[str, dict[str, Any]] = {"trtllm-1000": {"max_num_seqs": 1024}}
# llama3-8b's context is 8192 tokens: its long prompts leave room for the 128 outputs and a block of slack.
LONG_INPUT_LEN = {"llama3-8b": 7936}


def preset(name: str, model: str = "", **overrides: Any) -> Workload:
    """A named workload, adjusted for the model where it must be, with explicit overrides (None = keep)."""
    if name not in PRESETS:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(PRESETS)})")
    workload = PRESETS[name]
    if name == "long" and model in LONG_INPUT_LEN:
        workload = replace(workload, input_len=LONG_INPUT_LEN[model])
    return replace(workload, **{k: v for k, v in overrides.items() if v is not None})


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number >= 0 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 0")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    value = non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return value


def jitter_fraction(text: str) -> float:
    """An argparse type: --input-len-jitter, a fraction in [0, 1] (lengths uniform in input_len * [1 - j, 1 + j],
    so past 1 they would go below zero)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a fraction in [0, 1]")
    return value
