"""Sampler step time, old (bench/sampler_v0.py, commit c011cff) vs new (per-row state + fused kernels).

    python -m bench.sampler_bench                       # CUDA: B=256, V=151936 and 128256
    python -m bench.sampler_bench --device cpu --batch 8 --vocab 49152 --iters 20

The new path reads bf16 logits (what the LM head hands over), the old one fp32 (it upcast first anyway).
Settings: greedy; "sampled" (temperature 0.8, top_p 0.9, top_k 50, presence 0.5, frequency 0.2, seed);
top_p 0.9 only; "openai" (temperature 0.7, top_p 0.95, no top_k); "mixed" (rows cycle through greedy, openai,
T 0.8 + top_k 50 + top_p 0.9, T 1.0 + min_p 0.05: bench/workload.py's MIXED; the old sampler has no per-row
mix, so its column is empty). Each row has 512 prompt and 256 output tokens. Times are ms per step (CUDA events on GPU,
perf_counter on CPU), medians over --iters after warm-up; "new" includes building the step's metadata from
the state (a gather by row ids), "old" is the sampler call alone on prebuilt metadata (its host-side padded
arrays were built every step in the worker and are not counted). Bytes: the [B, V] fp32 passes the new path
makes (an estimate: reads plus writes of full rows), and the bandwidth they imply.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from pagoda.bench import sampler_v0 as old
from pagoda.bench.cuda_timing import event_time_ms
from pagoda.bench.report import write_report
from pagoda.bench.workload import MIXED, OPENAI
from pagoda.services.worker.sampler import sample
from pagoda.services.worker.sampling_state import SamplingState
from pagoda.shared.messages import NewRequest, SamplingParams

PROMPT_LEN, OUTPUT_LEN = 512, 256
REP_BIAS = {11: 2.0, 13: -5.0, 500: 1.5}  # logit_bias of the *_bias settings
SETTINGS: dict[str, dict | tuple[dict, ...]] = {  # a tuple: row i takes entry i % len
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_p=0.9, top_k=50, presence_penalty=0.5, frequency_penalty=0.2),
    "top_p": dict(temperature=1.0, top_p=0.9),
    "openai": dict(OPENAI),
    "mixed": MIXED,
    # OpenAI sampling with a repetition penalty and a logit bias on every row: the bias goes in before the penalty
    # (vLLM's order), through an fp32 copy of the logits (b8e7a63); a tuple, as the old sampler has neither
    "openai_rep_bias": (dict(OPENAI, repetition_penalty=1.1, logit_bias=REP_BIAS),),
    "openai_rep": (dict(OPENAI, repetition_penalty=1.1),),  # each alone: no copy (the penalty pass writes fp32)
    "openai_bias": (dict(OPENAI, logit_bias=REP_BIAS),),
}
# full [B, V] passes of the new path in units of one fp32 row read (bf16 logits read = 0.5), per setting:
# greedy: the argmax reads bf16; sampled: bf16 logits + int32 counts in, fp32 out (the threshold and the draw
# read only the groups holding the top k); top_p alone: the draw, then one rejection round over every row (later
# rounds read the few undecided rows); mixed: the fused pass (group maxima), the draw and the round for its rows;
# openai_rep_bias: the biased fp32 copy (bf16 in, fp32 out), the penalty pass (fp32 and counts in, fp32 out), the
# draw and one round
NEW_PASSES = {"greedy": 0.5, "sampled": 0.5 + 1 + 1, "top_p": 0.5 + 0.5, "openai": 0.5 + 0.5,
              "mixed": 0.5 + 0.5 * 0.75 + 0.5 * 0.25, "openai_rep_bias": 0.5 + 1 + 1 + 1 + 1 + 1 + 1,
              "openai_rep": 0.5 + 1 + 1 + 1 + 1, "openai_bias": 0.5 + 1 + 1 + 1}


def time_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            samples.append(event_time_ms(fn))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def tokens(batch: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, size=(batch, PROMPT_LEN + OUTPUT_LEN))  # [B, P + O]


def row_params(params: dict | tuple[dict, ...], row: int) -> dict:
    return params[row % len(params)] if isinstance(params, tuple) else params


def new_step(batch: int, vocab: int, params: dict | tuple[dict, ...],
             device: torch.device) -> Callable[[torch.Tensor], object]:
    state = SamplingState(batch, vocab, device, eos_token_ids=[0])
    ids = tokens(batch, vocab)
    state.admit([(row, NewRequest(seq_id=row, token_ids=ids[row].tolist(), num_prompt_tokens=PROMPT_LEN, block_ids=[],
                                  num_computed_tokens=0, sampling=SamplingParams(**row_params(params, row)),
                                  seed=1234 + row))
                 for row in range(batch)])
    rows = np.arange(batch)
    return lambda logits: sample(logits, state.metadata(rows))


def old_step(batch: int, vocab: int, params: dict, device: torch.device) -> Callable[[torch.Tensor], object]:
    ids = torch.from_numpy(tokens(batch, vocab)).to(device)  # [B, P + O]
    full = lambda value, dtype=torch.float32: torch.full((batch,), value, dtype=dtype, device=device)  # noqa: E731
    meta = old.SamplingMetadata(temperature=full(params.get("temperature", 1.0)),
                                seeds=torch.arange(batch, device=device) + 1234,
                                offsets=full(OUTPUT_LEN, torch.int64),
                                all_greedy=params.get("temperature", 1.0) == 0.0)
    if "top_k" in params:
        meta.top_k = full(params["top_k"], torch.int64)
    if "top_p" in params:
        meta.top_p = full(params["top_p"])
    if "presence_penalty" in params or "frequency_penalty" in params:
        meta.presence_penalty = full(params.get("presence_penalty", 0.0))
        meta.frequency_penalty = full(params.get("frequency_penalty", 0.0))
        meta.repetition_penalty = full(1.0)
        meta.prompt_token_ids, meta.output_token_ids = ids[:, :PROMPT_LEN], ids[:, PROMPT_LEN:]
    return lambda logits: old.sample(logits, meta)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, nargs="+", default=[151936, 128256])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--profile", action="store_true", help="also a per-kernel breakdown of the new path (CUDA)")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, B={args.batch}")
    header = ("V", "setting", "old ms", "new ms", "speedup", "new GB", "new GB/s", "same")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (7, 8, 8, 8, 8, 7, 9, 5), strict=True)))
    results: list[dict] = []
    for vocab in args.vocab:
        torch.manual_seed(0)
        logits = torch.randn(args.batch, vocab, device=device) * 3  # [B, V] fp32: the old sampler's input
        model_logits = logits.to(torch.bfloat16)  # [B, V]: the new one reads what the LM head hands over
        for name in args.settings:
            params = SETTINGS[name]
            new_fn = new_step(args.batch, vocab, params, device)
            new_ms = time_ms(lambda: new_fn(model_logits), device, args.iters)  # noqa: B023
            gb = NEW_PASSES[name] * args.batch * vocab * 4 / 1e9
            old_text = f"{'-':>8} {'-':>8}"
            same_text = "-"
            if isinstance(params, dict):  # the old sampler takes one setting for the whole batch
                old_fn = old_step(args.batch, vocab, params, device)
                old_ms = time_ms(lambda: old_fn(logits), device, args.iters)  # noqa: B023
                old_text = f"{old_ms:>8.3f} {old_ms / new_ms:>7.1f}x"
                # same seed, offset and processing: the old and new draws agree up to float rounding (and bf16's)
                same = (old_fn(logits).token_ids == new_fn(model_logits).token_ids).float().mean().item()
                same_text = f"{same:.2f}"
            print(f"{vocab:>7} {name:>8} {old_text[:8]} {new_ms:>8.3f} {old_text[9:]} {gb:>7.2f} "
                  f"{gb / new_ms * 1e3:>9.0f} {same_text:>5}")
            results.append({"vocab": vocab, "setting": name, "new_ms": new_ms})
            if args.profile and device.type == "cuda":
                from pagoda.bench.decode_profile import kernel_breakdown, print_breakdown
                print_breakdown(f"new path, {name}, V={vocab}, bf16 logits in",
                                kernel_breakdown(lambda: new_fn(model_logits)), top=12)  # noqa: B023
    write_report({"device": str(device), "batch": args.batch, "results": results}, None, "sampler_bench.json")


if __name__ == "__main__":
    main()
