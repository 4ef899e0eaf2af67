"""Mixture-of-experts families and long-context ropes against transformers on tiny random checkpoints that
transformers itself builds and saves: greedy tokens equal in fp32 (batched, chunked prefill, under preemption),
prompts shorter and longer than the rope's original window, and the rope tables equal to transformers' own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from pagoda.services.worker.models.rope import RopeSpec, inv_freq, rope_table
from pagoda.shared.errors import ConfigError
from pagoda.shared.shapes import SHAPES, arch_from_hf_config, load_arch
from tests.parity import check_greedy_parity, pagoda_greedy, random_prompts

VOCAB = 256


def _save(model, folder: Path) -> Path:  # noqa: ANN001
    with torch.no_grad():  # transformers initialises norms to 1 and the router near 0: make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
            if name.endswith("gate.weight") or "router" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return folder


def _qwen3_moe(folder: Path, **overrides) -> Path:  # noqa: ANN003
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                  max_position_embeddings=512, rope_theta=10000.0, eos_token_id=2, tie_word_embeddings=False)
    fields.update(overrides)
    return _save(Qwen3MoeForCausalLM(Qwen3MoeConfig(**fields)).float(), folder)


def _qwen2_moe(folder: Path, shared: int = 48) -> Path:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(1)
    config = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            shared_expert_intermediate_size=shared, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                            max_position_embeddings=512, rope_theta=10000.0, eos_token_id=2)
    return _save(Qwen2MoeForCausalLM(config).float(), folder)


def _mixtral(folder: Path) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(2)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=512, rope_theta=10000.0, eos_token_id=2, bos_token_id=1)
    return _save(MixtralForCausalLM(config).float(), folder)


def _qwen3_rope(folder: Path, rope: dict, max_positions: int) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=max_positions, rope_parameters={"rope_theta": 10000.0, **rope},
                         eos_token_id=2, tie_word_embeddings=False)
    return _save(Qwen3ForCausalLM(config).float(), folder)


pytestmark = pytest.mark.slow


def test_qwen3_moe_matches_transformers(tmp_path: Path) -> None:
    """Sparse layers 0 and 2, a dense layer 1 (mlp_only_layers), top-2 of 8 renormalised."""
    folder = _qwen3_moe(tmp_path)
    arch = load_arch(folder)
    assert arch.moe is not None and arch.moe.sparse_layers == (0, 2) and arch.moe.renormalize
    check_greedy_parity(folder, random_prompts([5, 19, 40, 70], VOCAB), preempt_blocks=10)


@pytest.mark.parametrize("shared", [48, 64])
def test_qwen2_moe_matches_transformers(tmp_path: Path, shared: int) -> None:
    """The sigmoid-gated shared expert, qkv bias, top-3 of 6 not renormalised. 48 wide: a separate MLP; 64 (two
    experts' width): two more experts in the fused call, weighted by sigmoid of the gate row the router carries."""
    folder = _qwen2_moe(tmp_path, shared)
    arch = load_arch(folder)
    assert arch.moe is not None and arch.moe.shared_expert_intermediate_size == shared and not arch.moe.renormalize
    assert arch.attention_bias
    check_greedy_parity(folder, random_prompts([6, 33, 61], VOCAB, seed=6), preempt_blocks=8)
    llm = LLM(str(folder), dtype="float32")
    sparse = llm.engine.runner.model.layers[0].mlp
    assert sparse is not None and sparse.num_shared == (2 if shared == 64 else 0)
    assert sparse.w_gate_up.shape[0] == 6 + sparse.num_shared and (sparse.shared_gate_up is None) == (shared == 64)


def test_mixtral_matches_transformers(tmp_path: Path) -> None:
    folder = _mixtral(tmp_path)
    keys = load_file(str(folder / "model.safetensors")).keys()
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys
    check_greedy_parity(folder, random_prompts([9, 27, 58], VOCAB, seed=7), preempt_blocks=8)


def test_fused_expert_tensors_load_like_per_expert_keys(tmp_path: Path) -> None:
    """A checkpoint whose experts are fused [E, 2I, H] / [E, H, I] tensors (transformers 5's in-memory layout)
    generates what the per-expert one does."""
    per_expert = _qwen3_moe(tmp_path / "per_expert")
    fused = tmp_path / "fused"
    fused.mkdir()
    tensors = load_file(str(per_expert / "model.safetensors"))
    config = json.loads((per_expert / "config.json").read_text())
    num_experts = config.get("num_experts") or config["num_local_experts"]
    for layer in (0, 2):
        stem = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([tensors.pop(f"{stem}.{e}.gate_proj.weight"), tensors.pop(f"{stem}.{e}.up_proj.weight")])
                   for e in range(num_experts)]
        down = [tensors.pop(f"{stem}.{e}.down_proj.weight") for e in range(num_experts)]
        tensors[f"{stem}.gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, H]
        tensors[f"{stem}.down_proj"] = torch.stack(down)  # [E, H, I]
    save_file(tensors, str(fused / "model.safetensors"))
    (fused / "config.json").write_text(json.dumps(config))
    prompts = random_prompts([12, 30], VOCAB)
    assert pagoda_greedy(fused, prompts)[0] == pagoda_greedy(per_expert, prompts)[0]


def test_yarn_matches_transformers_past_the_original_window(tmp_path: Path) -> None:
    """YaRN x4 over a 48-token original window: prompts inside it and past it (up to 150 tokens)."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 48}
    folder = _qwen3_rope(tmp_path, rope, max_positions=64)
    arch = load_arch(folder)
    assert arch.context_limit == 192
    check_greedy_parity(folder, random_prompts([10, 40, 90, 150], VOCAB, seed=8), preempt_blocks=14)


def test_dynamic_ntk_matches_transformers_when_decoding_past_the_window(tmp_path: Path) -> None:
    """Dynamic NTK over a 40-token window: prompts inside it, decoding past it (the base grows token by token
    as transformers computes it). A prompt longer than the window is rotated by transformers with its whole
    length's base, which pagoda's position-indexed table does not reproduce (see models/rope.py)."""
    folder = _qwen3_rope(tmp_path, {"rope_type": "dynamic", "factor": 2.0}, max_positions=40)
    check_greedy_parity(folder, random_prompts([20, 30, 36], VOCAB, seed=9), preempt_blocks=7)


ROPE_CASES = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
     "beta_slow": 2, "truncate": False},
]


@pytest.mark.parametrize("rope", ROPE_CASES, ids=lambda r: "-".join(f"{v}" for v in r.values()))
def test_rope_tables_match_transformers(rope: dict) -> None:
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                         max_position_embeddings=131072, rope_parameters={"rope_theta": 1_000_000.0, **rope})
    arch = arch_from_hf_config(config.to_dict())
    spec = RopeSpec.of(arch)
    if rope["rope_type"] == "default":
        expected, factor = 1.0 / (1_000_000.0 ** (torch.arange(0, 128, 2).float() / 128)), 1.0
    else:
        expected, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    torch.testing.assert_close(inv_freq(spec), expected.float(), rtol=1e-6, atol=0)
    cos, sin = rope_table(spec, 1000, torch.float32, torch.device("cpu"))
    angles = torch.arange(1000).float()[:, None] * expected.float()[None, :]
    torch.testing.assert_close(cos[:, :64], angles.cos() * factor, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sin[:, 64:], angles.sin() * factor, rtol=1e-5, atol=1e-6)


def test_dynamic_table_follows_the_context_length() -> None:
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                         max_position_embeddings=4096,
                         rope_parameters={"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0})
    arch = arch_from_hf_config(config.to_dict())
    assert arch.context_limit == 8192
    cos, _ = rope_table(RopeSpec.of(arch), 8192, torch.float32, torch.device("cpu"))
    for position in (5, 4095, 4096, 6000, 8191):
        freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=position + 1)
        torch.testing.assert_close(cos[position, :64], (position * freq.float()).cos(), rtol=1e-4, atol=1e-5)


def test_rope_config_errors_name_what_is_missing() -> None:
    base = SHAPES["tiny-qwen3"].to_hf_config()
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        arch_from_hf_config({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}})
    with pytest.raises(ConfigError, match="not supported"):
        arch_from_hf_config({**base, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e6}})
    old_layout = {key: value for key, value in base.items() if key != "rope_parameters"}  # transformers 4 configs
    yarn = arch_from_hf_config({**old_layout, "rope_scaling": {"type": "yarn", "factor": 4.0},
                                "original_max_position_embeddings": 1024})
    assert yarn.rope_scaling is not None and yarn.rope_scaling["original_max_position_embeddings"] == 1024


def test_long_context_shapes() -> None:
    assert SHAPES["qwen3-8b-yarn"].context_limit == 131072
    assert SHAPES["llama3.1-8b"].context_limit == 131072
    moe = SHAPES["qwen3-30b-a3b"]
    assert 30.0e9 < moe.num_params() < 31.0e9  # Qwen3-30B-A3B: 30.5B total
    assert 2.9e9 < moe.layer_weight_params(1) + moe.vocab_size * moe.hidden_size < 3.5e9  # ~3.3B active
    mixtral = SHAPES["mixtral-8x7b"]
    assert 46.0e9 < mixtral.num_params() < 47.5e9  # Mixtral-8x7B: 46.7B


def _first_logits(folder: Path, prompts: list[list[int]], **engine_args) -> torch.Tensor:  # noqa: ANN003
    """The prefill logits of each prompt, as the sampler receives them (rows in completion order)."""
    llm = LLM(str(folder), dtype="float32", **engine_args)
    captured: list[torch.Tensor] = []
    sampler = llm.engine.runner.sampler

    def spying(logits: torch.Tensor, metadata):  # noqa: ANN001, ANN202
        captured.append(logits.float().clone())
        return sampler(logits, metadata)

    llm.engine.runner.sampler = spying  # type: ignore[assignment]
    for prompt in prompts:  # one at a time: one row each
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    return torch.cat(captured)


def _block_fp8_checkpoint(source: Path, folder: Path) -> dict[str, torch.Tensor]:
    """Qwen3-30B-A3B-FP8's format: every projection (attention and each expert's) e4m3 with 128 x 128 block scales
    (`weight_scale_inv`), the router, norms and embeddings unquantized."""
    from pagoda.kernels import reference as ref

    folder.mkdir()
    tensors = load_file(str(source / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = ref.quantize_fp8_blocks(tensor)
        else:
            out[name] = tensor
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(out, str(folder / "model.safetensors"))
    return out


def test_fp8_experts_quantized_at_load_and_from_a_block_checkpoint(tmp_path: Path) -> None:
    """--quantization fp8 covers the experts (e4m3 with per-row scales); a block-FP8 checkpoint's experts load bit
    for bit with their block scales; both stay close to the fp32 model."""
    folder = _qwen3_moe(tmp_path / "fp32")
    prompts = random_prompts([7, 30, 55], VOCAB, seed=12)
    base = _first_logits(folder, prompts)
    quantized = _first_logits(folder, prompts, quantization="fp8")
    checkpoint = _block_fp8_checkpoint(folder, tmp_path / "fp8")
    shipped = _first_logits(tmp_path / "fp8", prompts)
    for ours in (quantized, shipped):
        cosine = torch.nn.functional.cosine_similarity(ours, base, dim=-1)
        assert bool((cosine > 0.99).all()), cosine
    llm = LLM(str(tmp_path / "fp8"), dtype="float32")
    layer = llm.engine.runner.model.layers[2]
    assert layer.mlp is not None and layer.mlp.w_gate_up.dtype == torch.float8_e4m3fn
    expert_up = checkpoint["model.layers.2.mlp.experts.5.up_proj.weight"]
    assert torch.equal(layer.mlp.w_gate_up[5, 32:].view(torch.uint8), expert_up.view(torch.uint8))
    scale = checkpoint["model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"]  # [1, 1]: one 128 x 128 block
    assert torch.equal(layer.mlp.w_gate_up_scale[5, 32:], scale.expand(32, 1))


@pytest.mark.parametrize("shape", ["tiny-moe", "tiny-deepseek-v3"])
def test_moe_top_k_sum_in_the_next_norm_equals_the_summed_layer(shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PAGODA_FUSE_MOE_SUM=1: the sparse layers (Qwen3-MoE; DeepSeek-V3 with its shared expert fused among the
    routed ones) leave their top-k rows to the next residual add + norm, which sums them; the hidden states equal
    the summed layers' (fp32, Triton ops) through a prefill and a decode step, and the norm took the parts."""
    import dataclasses

    from pagoda.bench.decode_profile import make_batch
    from pagoda.bench.step_ab import _caches
    from pagoda.kernels import norm
    from pagoda.services.worker.models import CausalLM, Fp8Weights, triton_ops
    from pagoda.services.worker.weights import load_model

    arch, dev = SHAPES[shape], torch.device("cpu")
    parts_calls: list[int] = []

    def add_rms_norm_parts(parts: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        parts_calls.append(parts.shape[0])
        return norm.add_rms_norm_parts(parts, *args)  # type: ignore[arg-type]

    ops = dataclasses.replace(triton_ops(), add_rms_norm_parts=add_rms_norm_parts)
    model = CausalLM(arch, torch.float32, dev, max_positions=64, ops=ops)
    load_model(model, None, "dummy", seed=3)
    prefill_meta, prefill_pos, num_blocks = make_batch([12, 9], [12, 9], dev)
    decode_meta, decode_pos, _ = make_batch([1, 1], [13, 10], dev)
    ids = torch.randint(3, arch.vocab_size, (21,), generator=torch.Generator().manual_seed(4))
    results, calls = [], []
    for fuse in ("1", "0"):
        monkeypatch.setenv("PAGODA_FUSE_MOE_SUM", fuse)
        parts_calls.clear()
        torch.manual_seed(0)
        caches = _caches(arch, num_blocks, dev, torch.float32)
        with torch.inference_mode():
            prefill = model(ids, prefill_pos, caches, prefill_meta)  # [21, H]
            decode = model(ids[[11, 20]], decode_pos, caches, decode_meta)  # [2, H]
        results.append((prefill, decode))
        calls.append(list(parts_calls))
    for fused, summed in zip(*results, strict=True):
        torch.testing.assert_close(fused, summed, atol=1e-5, rtol=1e-5)
    sparse = len(arch.moe.sparse_layers)
    assert calls[1] == [] and len(calls[0]) == 2 * sparse  # every sparse layer's output, in both steps
    assert set(calls[0]) == {arch.moe.top_k + (1 if shape == "tiny-deepseek-v3" else 0)}  # routed (+ shared) rows
    # per-channel FP8: the next norm quantizes for its W8A8 GEMM (no parts there), so the layers keep their sum
    fp8_model = CausalLM(arch, torch.float32, dev, max_positions=64, ops=ops, fp8=Fp8Weights(None))
    load_model(fp8_model, None, "dummy", seed=3)
    monkeypatch.setenv("PAGODA_FUSE_MOE_SUM", "1")
    parts_calls.clear()
    with torch.inference_mode():
        fp8_model(ids, prefill_pos, _caches(arch, num_blocks, dev, torch.float32), prefill_meta)
    assert parts_calls == []
