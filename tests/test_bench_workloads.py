"""The benchmark workloads and dummy shapes fitted to a real tokenizer (what the GPU benchmarks run)."""

from dataclasses import replace
from pathlib import Path

import pytest

from pagoda.bench.serve import best_rate
from pagoda.bench.throughput import roofline_seconds
from pagoda.bench.workload import PRESETS, Workload, preset
from pagoda.shared.shapes import SHAPES, fit_vocab_to_tokenizer, resolve_arch


def test_presets_have_the_shapes_the_issue_names() -> None:
    shared = preset("shared-prefix")
    assert (shared.num_prompts, shared.shared_prefix_len, shared.input_len, shared.output_len) == (256, 2048, 64, 128)
    assert preset("long", "qwen3-0.6b").input_len == 16384
    llama_long = preset("long", "llama3-8b")
    assert llama_long.input_len + llama_long.output_len <= SHAPES["llama3-8b"].max_position_embeddings
    n4 = preset("n4")
    assert n4.n == 4 and n4.sampling_kwargs()["temperature"] == 0.8 and n4.sampling_kwargs()["n"] == 4
    assert preset("reference").sampling_kwargs() == {"temperature": 0.0}
    sampled = preset("sampled").sampling_kwargs()
    assert sampled["top_k"] == 50 and sampled["top_p"] == 0.9 and "seed" in sampled
    assert preset("reference", num_prompts=3, input_len=None).num_prompts == 3
    with pytest.raises(ValueError, match="unknown workload"):
        preset("nope")


def test_shared_prefix_prompts_share_exactly_the_prefix() -> None:
    workload = replace(PRESETS["shared-prefix"], num_prompts=4, shared_prefix_len=32, input_len=8)
    prompts = workload.prompts(1000)
    assert all(len(p) == 40 for p in prompts)
    assert all(p[:32] == prompts[0][:32] for p in prompts)
    assert len({tuple(p[32:]) for p in prompts}) == 4


def test_later_levels_get_prompts_no_earlier_level_sent() -> None:
    workload = replace(PRESETS["reference"], num_prompts=5, input_len=16)
    first, second = workload.prompts(1000), workload.prompts(1000, offset=5)
    both = replace(workload, num_prompts=10).prompts(1000)
    assert first + second == both
    assert not {tuple(p) for p in first} & {tuple(p) for p in second}


def test_roofline_counts_a_shared_prefix_once_and_every_completion() -> None:
    arch = SHAPES["qwen3-0.6b"]
    plain = roofline_seconds(arch, replace(PRESETS["reference"], input_len=64))
    shared = roofline_seconds(arch, replace(PRESETS["reference"], input_len=64, shared_prefix_len=2048))
    assert shared["floor_prefill_s"] < 2 * plain["floor_prefill_s"] + 0.05  # not 256 prefixes
    assert shared["floor_decode_s"] > plain["floor_decode_s"]  # longer contexts to read
    n4 = roofline_seconds(arch, replace(PRESETS["reference"], n=4))
    assert n4["floor_out_tok_per_s"] > roofline_seconds(arch, PRESETS["reference"])["floor_out_tok_per_s"]


def test_best_rate_is_the_highest_rate_within_both_bounds() -> None:
    def level(rate: float, ttft: float, itl: float, failed: int = 0) -> dict:
        return {"request_rate": rate, "concurrency": None, "num_failed": failed, "ttft_p99_ms": ttft,
                "itl_p99_ms": itl}

    levels = [level(1, 100, 10), level(2, 900, 40), level(4, 1500, 30), level(8, 200, 20, failed=1)]
    assert best_rate(levels, 1000, 50) == 2
    assert best_rate(levels, 50, 50) is None


def test_dummy_shape_shrinks_to_a_smaller_tokenizer_vocabulary(smollm2_dir: Path) -> None:
    big = replace(SHAPES["tiny"], vocab_size=60000, eos_token_ids=(2, 59000), bos_token_id=59001)
    fitted = fit_vocab_to_tokenizer(big, str(smollm2_dir))
    assert fitted.vocab_size == 49152
    assert fitted.eos_token_ids == (2,) and fitted.bos_token_id is None
    assert fit_vocab_to_tokenizer(SHAPES["tiny"], str(smollm2_dir)) == SHAPES["tiny"]  # smaller: unchanged
    assert resolve_arch("qwen3-0.6b", "dummy", str(smollm2_dir)).vocab_size == 49152


def test_dummy_weights_with_a_tokenizer_generate_text(smollm2_dir: Path) -> None:
    from pagoda import LLM, SamplingParams

    llm = LLM("tiny", load_format="dummy", tokenizer=str(smollm2_dir), num_kv_blocks=64)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6
    assert out.outputs[0].text == llm.engine.tokenizer.decode(out.outputs[0].token_ids)


def test_openai_and_mixed_presets_sample_as_clients_do() -> None:
    openai = preset("openai").sampling_kwargs()
    assert openai == {"temperature": 0.7, "top_p": 0.95}  # no top_k, as the OpenAI SDK sends
    mixed = preset("mixed")
    kinds = [mixed.sampling_kwargs(i) for i in range(8)]
    assert kinds[:4] == kinds[4:] and len({str(k) for k in kinds[:4]}) == 4  # a quarter each, cycling
    assert kinds[0]["temperature"] == 0.0 and kinds[1] == openai
    assert "top_k" in kinds[2] and "top_p" in kinds[2] and "min_p" in kinds[3]
    assert preset("reference").sampling_kwargs(3) == {"temperature": 0.0}


def test_beam_preset_and_its_sampled_counterpart_share_shapes() -> None:
    beam, sampled = preset("beam4"), preset("n4-128")
    assert (beam.num_prompts, beam.input_len, beam.output_len, beam.n) == (64, 512, 128, 4)
    assert (sampled.num_prompts, sampled.input_len, sampled.output_len, sampled.n) == (64, 512, 128, 4)
    assert beam.sampling_kwargs() == {"use_beam_search": True, "temperature": 0.0, "best_of": 4, "n": 4}
    assert sampled.sampling_kwargs()["n"] == 4 and sampled.sampling_kwargs()["temperature"] == 0.8


def test_decoding_bench_finds_a_tokenizer_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/decoding.py's --tokenizer default: the model folder when present, else the GPU machine's copy."""
    from pagoda.bench import decoding

    monkeypatch.chdir(tmp_path)
    assert decoding.default_tokenizer() == decoding.TOKENIZER_FOLDERS[0]  # none present: the usual one is named
    (tmp_path / ".gpu" / "smollm2-tok").mkdir(parents=True)
    assert decoding.default_tokenizer() == ".gpu/smollm2-tok"
    (tmp_path / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    assert decoding.default_tokenizer() == "models/smollm2-135m-instruct"
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        decoding.child("structured", tmp_path, str(tmp_path / "absent"))


def test_repeated_runs_use_fresh_prompts_and_report_the_median(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.bench import throughput

    calls: list[tuple[int, int]] = []
    rates = {0: 300.0, 7919: 100.0, 2 * 7919: 200.0}

    def fake_measure(llm: object, workload: Workload, load_s: float, latency_prompt_len: int) -> dict[str, object]:
        calls.append((workload.seed, latency_prompt_len))
        result: dict[str, object] = {"output_tok_per_s": rates[workload.seed], "seed": workload.seed,
                                     "elapsed_s": 1e4 / rates[workload.seed]}
        if latency_prompt_len:
            result["batch1_decode_ms_p50"] = 1.5
        return result

    monkeypatch.setattr(throughput, "measure_pagoda", fake_measure)
    result = throughput.measure_repeated(object(), Workload(num_prompts=2, seed=0), repeats=3, latency_prompt_len=64)
    assert [seed for seed, _ in calls] == [0, 7919, 2 * 7919]  # each run its own prompts
    assert [latency for _, latency in calls] == [0, 0, 64]  # batch-1 timed once, after the last run
    assert result["seed"] == 2 * 7919 and result["output_tok_per_s"] == 200.0  # the median run
    assert result["repeat_tok_per_s"] == [300.0, 100.0, 200.0]
    assert result["repeat_tok_per_s_mean"] == 200.0
    assert result["batch1_decode_ms_p50"] == 1.5
    assert [run["elapsed_s"] for run in result["repeat_steps"]] == [1e4 / 300, 1e4 / 100, 1e4 / 200]  # every run's
    single = throughput.measure_repeated(object(), Workload(num_prompts=2, seed=0), repeats=1)
    assert "repeats" not in single and single["output_tok_per_s"] == 300.0
