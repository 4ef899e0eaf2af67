"""The throughput benchmark's floor in the engine's storage precision (issue 25), and the trtllm-1000 plan.

Pure arithmetic: every expected figure is worked out here from the model's dimensions, not read back from the
code under test.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from pagoda.bench.roofline import (
    FP8_MATMUL_FLOPS,
    HBM_BYTES_PER_S,
    MATMUL_FLOPS,
    Precision,
    batch1_floor_ms,
    layer_weights,
    prefill_seconds,
    roofline_seconds,
    weight_bytes_per_step,
)
from pagoda.bench.throughput import _roofline, child_argv, engine_args, precision_from_args, workload_from_args
from pagoda.bench.workload import PRESETS, preset
from pagoda.cli import build_parser
from pagoda.shared.shapes import SHAPES, ModelArch

BF16 = Precision()
FP8 = Precision(quantization="fp8")
FP8_KV = Precision(kv_cache_dtype="fp8")
FP8_BOTH = Precision(quantization="fp8", kv_cache_dtype="fp8")

# llama3-8b: h 4096, 32 layers, q 4096, kv 1024, intermediate 14336; linear weights (out rows, in cols)
LLAMA_LINEARS = ((4096 + 2 * 1024, 4096), (4096, 4096), (2 * 14336, 4096), (4096, 14336))
LLAMA_LINEAR_PARAMS = 32 * sum(r * c for r, c in LLAMA_LINEARS)
LLAMA_KV_ELEMENTS_PER_TOKEN = 2 * 32 * 8 * 128  # K and V, 32 layers, 8 kv heads of 128


def test_fp8_weights_read_one_byte_per_linear_weight_plus_per_channel_scales() -> None:
    arch = SHAPES["llama3-8b"]
    saved = weight_bytes_per_step(arch, 1, BF16) - weight_bytes_per_step(arch, 1, FP8)
    scales = 32 * 4 * sum(r for r, _ in LLAMA_LINEARS)  # one fp32 per output channel
    assert saved == LLAMA_LINEAR_PARAMS - scales
    # what stays bf16: the LM head, the final norm and 2 norms per layer (the input embedding: one row per token)
    assert weight_bytes_per_step(arch, 1, FP8) == LLAMA_LINEAR_PARAMS + scales + 2 * (
        128256 * 4096 + 4096 + 32 * 2 * 4096 + 4096)
    assert weight_bytes_per_step(arch, 1, FP8_KV) == weight_bytes_per_step(arch, 1, BF16)  # KV dtype: no weights


def test_fp8_block_scales_are_one_per_row_and_128_columns() -> None:
    arch = SHAPES["llama3-8b"]
    block = Precision(quantization="fp8_block")
    extra = weight_bytes_per_step(arch, 1, block) - weight_bytes_per_step(arch, 1, FP8)
    assert extra == 32 * 4 * sum(r * (math.ceil(c / 128) - 1) for r, c in LLAMA_LINEARS)


def test_fp8_kv_cache_halves_the_cached_bytes_of_the_batch1_floor() -> None:
    arch, context = SHAPES["llama3-8b"], 4096
    saved_ms = batch1_floor_ms(arch, context, BF16) - batch1_floor_ms(arch, context, FP8_KV)
    assert saved_ms == pytest.approx(1e3 * context * LLAMA_KV_ELEMENTS_PER_TOKEN * 1 / HBM_BYTES_PER_S)
    weights_ms = 1e3 * weight_bytes_per_step(arch, 1, FP8) / HBM_BYTES_PER_S
    assert batch1_floor_ms(arch, context, FP8_BOTH) == pytest.approx(
        weights_ms + 1e3 * context * LLAMA_KV_ELEMENTS_PER_TOKEN / HBM_BYTES_PER_S)


def test_fp8_prefill_runs_the_linear_flops_at_the_fp8_peak() -> None:
    arch = SHAPES["llama3-8b"]
    workload = PRESETS["trtllm-1000"]
    tokens = workload.num_prompts * workload.input_len
    bf16_s, bf16_tokens = prefill_seconds(arch, workload, BF16)
    fp8_s, _ = prefill_seconds(arch, workload, FP8)
    linear_flops = 2 * LLAMA_LINEAR_PARAMS * tokens
    assert bf16_tokens == tokens
    assert bf16_s - fp8_s == pytest.approx(linear_flops / MATMUL_FLOPS - linear_flops / FP8_MATMUL_FLOPS)
    assert FP8_MATMUL_FLOPS == 2 * MATMUL_FLOPS
    assert prefill_seconds(arch, workload, FP8_KV)[0] == bf16_s  # an fp8 cache does not change the matmuls


def test_trtllm_row_is_below_the_fp8_floor_and_was_above_the_bf16_one() -> None:
    """TensorRT-LLM's published 17,744 out tok/s (FP8 weights + FP8 KV) beat the floor that counted everything
    as bf16: such a floor is no floor. In the engine's precision it is a fraction of it."""
    arch, workload = SHAPES["llama3-8b"], PRESETS["trtllm-1000"]
    old = roofline_seconds(arch, workload, BF16)
    new = roofline_seconds(arch, workload, FP8_BOTH)
    assert old["floor_out_tok_per_s"] < 17_744 < new["floor_out_tok_per_s"]
    kv_only = roofline_seconds(arch, workload, FP8_KV)
    # decode is KV-bound at 1024 sequences: an fp8 cache takes off about half of the decode floor
    assert 0.45 < kv_only["floor_decode_s"] / old["floor_decode_s"] < 0.6
    assert new["floor_decode_s"] < kv_only["floor_decode_s"] and new["floor_prefill_s"] < old["floor_prefill_s"]
    assert new["kv_bytes_per_token"] == LLAMA_KV_ELEMENTS_PER_TOKEN and "fp8" in new["precision"]


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_moe_fp8_counts_the_touched_experts_in_fp8(name: str) -> None:
    arch = SHAPES[name]
    moe = arch.moe
    assert moe is not None
    h, i = arch.hidden_size, moe.expert_intermediate_size
    attention = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h
    one_token = layer_weights(arch, 1, FP8)
    assert one_token.fp8_params == arch.num_layers * (attention + moe.top_k * 3 * h * i)
    assert one_token.fp8_params + one_token.plain_params == arch.layer_weight_params(1)
    assert one_token.plain_params >= arch.num_layers * h * moe.num_experts  # the bf16 router
    big = layer_weights(arch, 4096, FP8)  # every expert touched
    assert big.fp8_params == pytest.approx(arch.num_layers * (attention + moe.num_experts * 3 * h * i), rel=1e-6)
    workload = replace(PRESETS["reference"], num_prompts=16, output_len=8)
    for precision in (FP8, FP8_BOTH):
        assert (roofline_seconds(arch, workload, precision)["floor_s"]
                < roofline_seconds(arch, workload, BF16)["floor_s"])


def test_qwen2_moe_shared_expert_stays_in_the_model_dtype() -> None:
    base = SHAPES["tiny-moe"]
    assert base.moe is not None
    arch = replace(base, model_type="qwen2_moe", moe=replace(base.moe, shared_expert_intermediate_size=48))
    plain = replace(arch, moe=base.moe)
    grown = layer_weights(arch, 1, FP8).plain_params - layer_weights(plain, 1, FP8).plain_params
    assert grown == arch.num_layers * (3 * 64 * 48 + 64)  # shared gate_up + down + its sigmoid gate, in bf16
    assert layer_weights(arch, 1, FP8).fp8_params == layer_weights(plain, 1, FP8).fp8_params


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3-slice"])
def test_deepseek_floor_counts_the_latent_cache_and_keeps_kv_b_in_bf16(name: str) -> None:
    arch: ModelArch = SHAPES[name]
    mla = arch.mla
    assert mla is not None and arch.moe is not None
    context = 2048
    saved_ms = batch1_floor_ms(arch, context, BF16) - batch1_floor_ms(arch, context, FP8_KV)
    assert saved_ms == pytest.approx(1e3 * context * arch.num_layers * mla.entry_dim / HBM_BYTES_PER_S)
    weights = layer_weights(arch, 1, FP8)
    kv_b = arch.num_layers * mla.kv_lora_rank * arch.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    assert weights.plain_params >= kv_b
    assert weights.fp8_params + weights.plain_params == arch.layer_weight_params(1)
    shared = arch.moe.shared_expert_intermediate_size
    sparse = len(arch.moe.sparse_layers)
    dense_mlp = (arch.num_layers - sparse) * 3 * arch.hidden_size * arch.intermediate_size
    experts = sparse * (arch.moe.top_k + shared / arch.moe.expert_intermediate_size) * arch.moe.expert_params(
        arch.hidden_size)  # routed top-k and the shared experts (both FP8)
    q_in = mla.q_lora_rank or arch.hidden_size
    attention = arch.num_layers * arch.hidden_size * ((mla.q_lora_rank or 0) + mla.entry_dim) + arch.num_layers * (
        q_in * arch.num_heads * mla.qk_head_dim + arch.num_heads * mla.v_head_dim * arch.hidden_size)
    assert weights.fp8_params == pytest.approx(attention + dense_mlp + experts)
    floor = roofline_seconds(arch, replace(PRESETS["reference"], num_prompts=8, output_len=8), FP8_BOTH)
    assert 0 < floor["floor_s"] < roofline_seconds(arch, replace(PRESETS["reference"], num_prompts=8,
                                                                 output_len=8))["floor_s"]


def test_precision_rejects_unknown_settings() -> None:
    with pytest.raises(ValueError, match="quantization"):
        Precision(quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Precision(kv_cache_dtype="fp4")


TRTLLM_ARGV = ["bench", "throughput", "--model", "llama3-8b", "--load-format", "dummy", "--quantization", "fp8",
               "--kv-cache-dtype", "fp8", "--workload", "trtllm-1000"]


def test_trtllm_command_plans_tensorrt_llms_row_with_fp8_and_1024_seats() -> None:
    args = build_parser().parse_args(TRTLLM_ARGV)
    workload = workload_from_args(args)
    assert (workload.num_prompts, workload.input_len, workload.output_len) == (1024, 1000, 1000)
    assert workload.input_len_jitter == 0 and workload.sampling_kwargs() == {"temperature": 0.0}
    assert all(len(p) == 1000 for p in replace(workload, num_prompts=3).prompts(128256))
    engine = engine_args(args)
    assert engine["max_num_seqs"] == 1024
    assert engine["quantization"] == "fp8" and engine["kv_cache_dtype"] == "fp8"
    assert precision_from_args(args) == FP8_BOTH
    assert _roofline(args) == roofline_seconds(SHAPES["llama3-8b"], workload, FP8_BOTH)  # what the run prints
    # the child process that runs pagoda gets the same plan from its own argv
    child = build_parser().parse_args(["bench", *child_argv(args, "pagoda")[3:]])
    assert child.system == "pagoda" and engine_args(child) == engine
    assert workload_from_args(child) == workload
    explicit = build_parser().parse_args([*TRTLLM_ARGV, "--max-num-seqs", "512", "--num-prompts", "3000"])
    assert engine_args(explicit)["max_num_seqs"] == 512 and workload_from_args(explicit).num_prompts == 3000
    assert "max_num_seqs" not in engine_args(build_parser().parse_args(TRTLLM_ARGV[:-2]))  # no preset: the default
    recompute = build_parser().parse_args([*TRTLLM_ARGV, "--swap-space", "0"])  # 0 reaches the child: recompute
    child = build_parser().parse_args(["bench", *child_argv(recompute, "pagoda")[3:]])
    assert engine_args(child)["swap_space"] == 0.0 and "swap_space" not in engine


def test_throughput_flags_reject_unknown_fp8_settings() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*TRTLLM_ARGV[:-4], "--kv-cache-dtype", "fp4"])
    assert preset("trtllm-1000", "llama3-8b").input_len == 1000  # no per-model adjustment


def test_gemm_sweep_shapes_are_the_engines_linears() -> None:
    from pagoda.bench.fp8_bench import TOKEN_COUNTS, gemm_shapes, gemm_variants

    assert gemm_shapes("llama3-8b") == [(f"llama3-8b.{name}", n, k) for name, (n, k) in
                                        zip(("qkv", "o", "gate_up", "down"), LLAMA_LINEARS, strict=True)]
    assert gemm_shapes("qwen3-30b-a3b:experts") == [("qwen3-30b-a3b.expert_gate_up", 2 * 768, 2048),
                                                    ("qwen3-30b-a3b.expert_down", 2048, 768)]
    assert len(gemm_shapes("llama3-8b,llama3-8b")) == 4
    with pytest.raises(ValueError, match="unknown GEMM shape"):
        gemm_shapes("llama3-8b:attention")
    assert TOKEN_COUNTS == (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 8192)
    variants = gemm_variants()
    assert {"bf16", "fp8_rowwise_linear", "fp8_block_linear"} <= variants.keys()
    assert all(v.weights in ("bf16", "channel", "block", "none") for v in variants.values())


@pytest.mark.parametrize("name", ["glm-4.5-air", "tiny-glm4-moe"])
def test_glm4_moe_shared_experts_are_counted_in_fp8(name: str) -> None:
    """GLM-4.5's sparse block is DeepSeek's (models/glm4_moe.py: DeepseekMoe), whose shared experts the engine
    stores in FP8 (fused in as more experts, or a quantized dense MLP); the floor counted them bf16, as Qwen2-MoE's
    gated one, because only an MLA model's were taken as FP8 (tiny-glm4-moe: 12,288 of the engine's 172,032 FP8
    layer weights counted at 2 bytes)."""
    arch = SHAPES[name]
    moe = arch.moe
    assert moe is not None and arch.mla is None and not moe.shared_expert_gated
    h = arch.hidden_size
    sparse, dense = len(moe.sparse_layers), arch.num_layers - len(moe.sparse_layers)
    attention = arch.num_layers * (h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h)
    experts_per_token = moe.top_k + moe.shared_expert_intermediate_size / moe.expert_intermediate_size
    expected = attention + dense * 3 * h * arch.intermediate_size + sparse * experts_per_token * moe.expert_params(h)
    weights = layer_weights(arch, 1, FP8)
    assert weights.fp8_params == pytest.approx(expected)
    assert weights.fp8_params + weights.plain_params == pytest.approx(arch.layer_weight_params(1))


def test_decode_floor_takes_one_step_fewer_than_the_output_tokens() -> None:
    """The prefill samples every sequence's first token (its logits row is in the prefill floor), so output_len
    tokens take output_len - 1 decode steps (bench throughput's 4 x 16 -> 8 run: 8 steps, one of them the
    prefill). The floor took output_len steps, from a context of the prompt alone: one weight read and a prompt's
    KV too many, so a 1-token workload had a whole decode step in its floor."""
    from pagoda.bench.roofline import step_seconds

    arch = SHAPES["llama3-8b"]
    one = replace(PRESETS["reference"], num_prompts=8, input_len=100, output_len=1)
    assert roofline_seconds(arch, one)["floor_decode_s"] == 0.0
    floor = roofline_seconds(arch, replace(one, output_len=3))
    assert floor["floor_decode_s"] == pytest.approx(step_seconds(arch, 8, 8 * 101, BF16)
                                                    + step_seconds(arch, 8, 8 * 102, BF16))
    assert floor["floor_decode_step_ms"] == pytest.approx(1e3 * floor["floor_decode_s"] / 2)
    assert floor["floor_out_tok_per_s"] == pytest.approx(8 * 3 / (floor["floor_prefill_s"] + floor["floor_decode_s"]))


@pytest.mark.parametrize(("flags", "dtype_bytes"), [
    ([], 2), (["--dtype", "bfloat16"], 2), (["--dtype", "float16"], 2), (["--dtype", "half"], 2),
    (["--dtype", "float32"], 4), (["--dtype", "float"], 4), (["--device", "cpu"], 4),
    (["--device", "cpu", "--dtype", "bfloat16"], 2)])
def test_the_floor_counts_weights_in_the_dtype_the_engine_runs(flags: list[str], dtype_bytes: int) -> None:
    """--dtype float (vLLM's name for float32, which the engine takes) was counted at 2 bytes a weight, and so was
    --device cpu with --dtype auto, where the engine runs float32 (the run's own 'dtype': 'torch.float32')."""
    args = build_parser().parse_args(["bench", "throughput", "--model", "tiny", "--load-format", "dummy", *flags])
    assert precision_from_args(args).dtype_bytes == dtype_bytes
