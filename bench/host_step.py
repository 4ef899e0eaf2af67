"""Host cost of the offline engine's step loop with the model's forward and sampling stubbed out.

    python -m pagoda.bench.host_step                      # 256 and 64 rows, 256 tokens each, SmolLM2's tokenizer
    python -m pagoda.bench.host_step --rows 256 --profile 25    # and cProfile's top 25 (by own time)
    python -m pagoda.bench.host_step --device cuda --tokenizer .gpu/smollm2-tok --profile 25   # a GPU host's CPU

The real LLM.generate runs: scheduler planning and update, the runner's launch (plan diff, batch inputs,
sampling metadata, result copies) and finish, the engine's per-row outputs and incremental detokenization with
SmolLM2's real tokenizer. Only the model's forward (empty hidden states), its logits (a shared zero view) and the
sampler (a gather from a table of English text's token ids, so the detokenizer sees real words) are stubs, each
a few microseconds. Greedy, ignore_eos, max_tokens new tokens per request, all requests at once. What it prints is
the wall time of the decode steps (the prefill step excluded) per step and per row: on a GPU the same host work
runs beside the device's, and a step can be no shorter than it. With --device cuda the decode steps run the CUDA
graphs of the tiny model itself (microseconds of GPU work), so the figure is the GPU path's host cost: pinned
copies, graph replays, events and every launch, besides the Python. Writes host_step.json under $OUT (or --out).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.report import report_path, write_json
from pagoda.llm import LLM
from pagoda.services.worker.sampler import SamplerOutput, SamplingMetadata
from pagoda.shared.config import DEFAULT_MODEL_DIR
from pagoda.shared.messages import SamplingParams
from pagoda.shared.shapes import SHAPES

SHAPE = "host-step-stub"  # a tiny model with SmolLM2's vocabulary: its weights are never used
TEXT = ("The city wakes early. Buses hum along the river road, bakers pull trays of bread from their ovens, and "
        "the first trams carry nurses, students and market traders toward the old town. By nine the squares are "
        "full: a man sells maps and postcards, children chase pigeons around the fountain, and tourists argue "
        "about which museum to visit first. Later, when the heat settles over the roofs, the streets grow quiet. ")


class StubModel:
    """The model's place in the runner: its forward allocates the hidden states and computes nothing."""

    def __init__(self, model: Any, hidden_size: int, vocab_size: int, max_rows: int, device: torch.device) -> None:
        self.model = model
        self.hidden_size = hidden_size
        self.logits = torch.zeros(1, vocab_size, device=device).expand(max_rows, vocab_size)  # [R, V] one zero row

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any, meta: Any) -> torch.Tensor:
        return torch.empty(len(input_ids), self.hidden_size, device=input_ids.device)  # [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[:len(hidden)]  # [S, V]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class StubSampler:
    """Each row's next token: its output offset into a table of real text's ids, shifted per row."""

    def __init__(self, table: list[int], device: torch.device) -> None:
        self.table = torch.tensor(table, dtype=torch.int64, device=device)  # [N]

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        assert metadata.state_rows is not None
        index = (metadata.state_rows * 37 + metadata.offsets) % len(self.table)  # [B]
        return SamplerOutput(token_ids=self.table[index], logprobs=None, top_token_ids=None, top_logprobs=None)


def make_llm(tokenizer: str, num_rows: int, prompt_len: int, max_tokens: int, async_scheduling: bool,
             device: str = "cpu") -> LLM:
    """The engine with the stubs in place. On CUDA the decode steps replay the CUDA graphs captured at start-up
    of the tiny model itself (2 layers of 64: microseconds of GPU work); eager steps and the sampler are stubs."""
    if SHAPE not in SHAPES:
        SHAPES[SHAPE] = replace(SHAPES["tiny-qwen3"], vocab_size=1 << 20, max_position_embeddings=1 << 16)
    max_model_len = prompt_len + max_tokens + 16
    llm = LLM(SHAPE, load_format="dummy", tokenizer=tokenizer, max_num_seqs=num_rows, max_model_len=max_model_len,
              num_kv_blocks=num_rows * (-(-max_model_len // 16)) + 16, async_scheduling=async_scheduling,
              device=device)
    runner = llm.engine.runner
    arch = runner.arch
    runner.model = StubModel(runner.model, arch.hidden_size, arch.vocab_size, num_rows,  # type: ignore[assignment]
                             runner.device)
    runner.sampler = StubSampler(llm.get_tokenizer().encode(TEXT * 4), runner.device)  # type: ignore[assignment]
    return llm


def run_once(llm: LLM, num_rows: int, prompt_len: int, max_tokens: int,
             profile: cProfile.Profile | None = None) -> dict[str, float]:
    """One generate of num_rows requests; the decode steps' host wall time (first step: the prefill, excluded)."""
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    base = tokenizer.encode(TEXT * 4)[:prompt_len - 4]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request_ids = [engine.add_request(base + tokenizer.encode(f" #{i}"), params) for i in range(num_rows)]
    step_times: list[float] = []
    while engine.has_unfinished_requests():
        if profile is not None and len(step_times) == 1:
            profile.enable()
        started = time.perf_counter()
        engine.step(deltas=False)  # as LLM.generate steps
        step_times.append(time.perf_counter() - started)
    if profile is not None:
        profile.disable()
    outputs = [engine.pop_output(request_id) for request_id in request_ids]
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs), "a request ended early"
    assert all(o.outputs[0].text for o in outputs), "no text came out"
    decode = step_times[1:]
    mean = statistics.fmean(decode)
    return {"steps": len(step_times), "prefill_ms": step_times[0] * 1e3, "decode_ms_per_step": mean * 1e3,
            "last_step_ms": step_times[-1] * 1e3,
            "decode_ms_p50": statistics.median(decode) * 1e3, "us_per_row_step": mean / num_rows * 1e6,
            "total_s": sum(step_times)}


def profile_text(profile: cProfile.Profile, top: int) -> str:
    stream = io.StringIO()
    stats = pstats.Stats(profile, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    stream.write("\n---- by cumulative time ----\n")
    stats.sort_stats("cumulative").print_stats(top)
    text = stream.getvalue()
    return text.replace(str(Path.cwd()) + "/", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 64])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per row count (median reported)")
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N for the first row count")
    parser.add_argument("--device", default="cpu", help="cpu (stubs only), or cuda: the GPU path's host cost "
                        "(pinned copies, CUDA graph replays of a tiny model, events)")
    parser.add_argument("--serial", action="store_true", help="no async scheduling (the GPU default plans ahead)")
    parser.add_argument("--out", default=None, help="write the figures here as JSON (default: $OUT/host_step.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    figures: dict[str, Any] = {"tokenizer": args.tokenizer, "device": args.device, "max_tokens": args.max_tokens,
                               "prompt_len": args.prompt_len, "cpu": _cpu_name(), "runs": {}}
    for index, rows in enumerate(args.rows):
        llm = make_llm(args.tokenizer, rows, args.prompt_len, args.max_tokens, not args.serial, args.device)
        run_once(llm, rows, args.prompt_len, 8)  # warm-up
        runs = [run_once(llm, rows, args.prompt_len, args.max_tokens) for _ in range(args.repeats)]
        best = sorted(runs, key=lambda r: r["decode_ms_per_step"])[len(runs) // 2]
        figures["runs"][str(rows)] = {"median": best, "all": runs}
        print(f"{rows:4d} rows: {best['decode_ms_per_step']:7.3f} ms/step (p50 {best['decode_ms_p50']:.3f}), "
              f"{best['us_per_row_step']:6.2f} us/row/step, prefill step {best['prefill_ms']:.1f} ms, last step "
              f"{best['last_step_ms']:.1f} ms "
              f"[runs: {', '.join(format(r['decode_ms_per_step'], '.3f') for r in runs)}]", flush=True)
        if args.profile and index == 0:
            profile = cProfile.Profile()
            run_once(llm, rows, args.prompt_len, args.max_tokens, profile)
            text = profile_text(profile, args.profile)
            figures["profile"] = text
            print(text)
        del llm
    print(json.dumps({k: v for k, v in figures.items() if k != "profile"}, indent=1))
    path = report_path(args.out, "host_step.json")
    if path is not None:
        write_json(path, figures)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cpus)"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
