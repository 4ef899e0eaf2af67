"""GLM-4.5 (glm4_moe) against transformers on tiny random checkpoints that transformers itself builds and saves:
greedy tokens equal in fp32 (batched, chunked prefill, under preemption) with rope over half of each head, q/k
RMSNorm on and off, 1 dense + 2 sparse layers routed by grouped sigmoid scores with a correction bias; the q/k head
permutation that turns the kernels' whole-head rope into the partial rope, exactly; the checkpoint as it ships
(per-expert keys, MTP layer, FP8 blocks); config refusals and the dummy shapes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda.kernels import reference as ref
from pagoda.services.worker.models.rope import RopeSpec, permute_rotary_dims, rope_table
from pagoda.shared.errors import ConfigError
from pagoda.shared.shapes import SHAPES, arch_from_hf_config, load_arch
from tests.parity import check_greedy_parity, hf_greedy, pagoda_greedy, random_prompts

VOCAB = 256


def _glm(folder: Path, qk_norm: bool, seed: int = 0) -> Path:
    """A tiny Glm4MoeForCausalLM: 4 heads of 16 over 2 kv heads, rope over the first 8 dims of each; q/k/v bias;
    layer 0 dense, layers 1-2 sparse: 8 experts in 4 groups (top 2 groups), 2 a token + 1 shared, sigmoid scores
    with a non-zero correction bias, renormalised, x2.5. transformers initialises norms to 1, biases and the
    correction bias to 0, the router near 0 and the projections small enough that attention is nearly uniform:
    make them all matter (q . k of a few units: which dims rope turns changes the tokens)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(seed)
    config = Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, use_qk_norm=qk_norm, attention_bias=True, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        num_nextn_predict_layers=0, eos_token_id=2, bos_token_id=1)
    model = Glm4MoeForCausalLM(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
            if name.endswith("gate.weight"):
                param.normal_(0.0, 0.5)
            if "self_attn" in name and name.endswith("_proj.bias"):
                param.normal_(0.0, 0.5 if "v_proj" not in name else 0.05)
            if "embed_tokens" in name or "lm_head" in name:
                param.normal_(0.0, 1.0)
            if "self_attn" in name and "o_proj" not in name and name.endswith("weight") and param.dim() == 2:
                param.normal_(0.0, 1.5 / param.shape[1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    model.save_pretrained(folder)
    return folder


def _as_shipped(folder: Path) -> None:
    """Rewrite the checkpoint the way GLM-4.5's own files are: per-expert keys (mlp.experts.{e}.gate_proj...) and
    the MTP layer after the last decoder layer (model.layers.3.*, num_nextn_predict_layers 1), which is skipped."""
    tensors = load_file(str(folder / "model.safetensors"))
    shipped: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        stem = name.removesuffix(".experts.gate_up_proj").removesuffix(".experts.down_proj")
        if name.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                shipped[f"{stem}.experts.{e}.gate_proj.weight"] = tensor[e, :inter].clone()
                shipped[f"{stem}.experts.{e}.up_proj.weight"] = tensor[e, inter:].clone()
        elif name.endswith(".experts.down_proj"):
            for e in range(tensor.shape[0]):
                shipped[f"{stem}.experts.{e}.down_proj.weight"] = tensor[e].clone()
        else:
            shipped[name] = tensor
        if name.startswith("model.layers.2."):  # an MTP layer is a whole decoder layer and more; nothing of it loads
            shipped[name.replace("model.layers.2.", "model.layers.3.")] = torch.full_like(tensor, float("nan"))
    shipped["model.layers.3.eh_proj.weight"] = torch.full((64, 128), float("nan"))
    (folder / "model.safetensors").unlink()
    save_file(shipped, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_glm4_moe_matches_transformers(tmp_path: Path, qk_norm: bool) -> None:
    folder = _glm(tmp_path, qk_norm, seed=int(qk_norm))
    arch = load_arch(folder)
    assert arch.model_type == "glm4_moe" and arch.rotary_dim == 8 and arch.qk_norm == qk_norm
    assert arch.attention_bias and not arch.o_proj_bias
    assert arch.moe is not None and arch.moe.sparse_layers == (1, 2) and arch.moe.topk_method == "noaux_tc"
    assert arch.moe.num_groups == 4 and arch.moe.routed_scaling_factor == 2.5
    check_greedy_parity(folder, random_prompts([9, 50, 90], VOCAB, seed=6 + int(qk_norm)), preempt_blocks=10)


def test_glm4_moe_with_yarn_matches_transformers_past_the_original_window(tmp_path: Path) -> None:
    """YaRN x4 over an original window of 32 on the partial rope: prompts of 50 and 90 tokens run past it, chunked
    and preempted; the pass-through dims stay unscaled, as transformers leaves them."""
    folder = _glm(tmp_path, qk_norm=True, seed=2)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                 "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    (folder / "config.json").write_text(json.dumps(config))
    assert load_arch(folder).rotary_dim == 8
    check_greedy_parity(folder, random_prompts([9, 50, 90], VOCAB, seed=3), preempt_blocks=10)


def test_glm4_moe_loads_the_checkpoint_as_it_ships(tmp_path: Path) -> None:
    """Per-expert keys and an MTP layer (NaN-filled here: loading any of it would show) give transformers' tokens."""
    folder = _glm(tmp_path / "hf", qk_norm=True, seed=2)
    prompts = random_prompts([12, 40], VOCAB, seed=3)
    expected = hf_greedy(folder, prompts)
    _as_shipped(folder)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in load_file(str(folder / "model.safetensors"))
    ours, _ = pagoda_greedy(folder, prompts)
    assert ours == expected


@pytest.mark.extended
def test_two_ranks_generate_what_one_does(tmp_path: Path) -> None:
    """Tensor parallel 2: each rank holds 2 of the 4 q heads and 1 of the 2 kv heads, each permuted as a whole head,
    and half of every expert's and the shared expert's intermediate dim; the scheduler and both ranks run as
    processes and generate what one rank does."""
    from tests.test_tensor_parallel import _generate_in_process, _generate_with_services

    folder = _glm(tmp_path, qk_norm=True, seed=5)
    single = _generate_in_process(folder)
    assert _generate_with_services(folder, 2) == single


def _hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' partial rotate-half rope: x [T, heads, D], cos/sin [T, r] over the first r dims."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    out, _ = apply_rotary_pos_emb(x.transpose(0, 1), x.transpose(0, 1), cos, sin, unsqueeze_dim=0)
    return out.transpose(0, 1)


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 8), (128, 64), (16, 4), (12, 8), (16, 16)])
def test_head_permutation_turns_whole_head_rope_into_partial_rope(head_dim: int, rotary_dim: int) -> None:
    """The kernels' rope over a whole permuted head, with the padded table (cos 1, sin 0 past rotary_dim / 2 in each
    half), equals transformers' partial rope of the head, permuted: bit for bit, in fp32 and bf16, and with YaRN's
    attention factor (which scales only the rotated dims). Hence q . k, and attention, are unchanged."""
    order = permute_rotary_dims(head_dim, rotary_dim)
    assert sorted(order.tolist()) == list(range(head_dim))
    positions = torch.tensor([0, 1, 7, 100, 511])
    for scaling in ({}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}):
        spec = RopeSpec(rotary_dim, 10000.0, scaling, 512, table_dim=head_dim)
        for dtype in (torch.float32, torch.bfloat16):
            cos, sin = rope_table(spec, 512, dtype, torch.device("cpu"))  # [P, head_dim]
            hf_cos, hf_sin = rope_table(RopeSpec(rotary_dim, 10000.0, scaling, 512), 512, dtype,
                                        torch.device("cpu"))  # [P, r]: transformers' own table
            x = torch.randn(len(positions), 3, head_dim).to(dtype)  # [T, heads, D]
            expected = _hf_rope(x, hf_cos[positions], hf_sin[positions])[..., order]
            ours = ref.apply_rope(x[..., order], cos[positions], sin[positions])
            assert torch.equal(ours, expected)
    q, k = torch.randn(5, 4, head_dim), torch.randn(5, 4, head_dim)
    torch.testing.assert_close(q[..., order] @ k[..., order].transpose(1, 2), q @ k.transpose(1, 2))


def test_rope_table_matches_transformers_partial_inv_freq() -> None:
    """The table's rotated slots are transformers' Glm4Moe rotary embedding for a config with partial_rotary_factor."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding

    config = Glm4MoeConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=512,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    arch = arch_from_hf_config(config.to_dict())
    positions = torch.arange(300)
    hf_cos, hf_sin = Glm4MoeRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = rope_table(RopeSpec.of(arch), 512, torch.float32, torch.device("cpu"))
    half, rot_half = 8, 4
    for ours, theirs in ((cos, hf_cos[0]), (sin, hf_sin[0])):
        assert torch.equal(ours[:300, :rot_half], theirs[:, :rot_half])
        assert torch.equal(ours[:300, half:half + rot_half], theirs[:, rot_half:])
    assert torch.all(cos[:, rot_half:half] == 1) and torch.all(sin[:, rot_half:half] == 0)


def test_triton_rope_and_qkv_prep_take_the_padded_table() -> None:
    """The Triton rope and the fused q/k-norm + rope + cache write read the padded table as the reference does (on
    CPU under the interpreter: bit for bit); the pass-through slots come out exactly as they went in."""
    from pagoda.kernels.qkv_prep import prepare_qkv
    from pagoda.kernels.rope import apply_rope

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    head_dim, heads, kv_heads, tokens = 16, 4, 2, 6
    cos, sin = rope_table(RopeSpec(8, 10000.0, {}, 64, table_dim=head_dim), 64, torch.float32, device)
    positions = torch.tensor([0, 3, 9, 17, 40, 63], device=device)
    q, k = torch.randn(tokens, heads, head_dim, device=device), torch.randn(tokens, kv_heads, head_dim, device=device)
    ours_q, ours_k = apply_rope(q, k, cos, sin, positions)
    torch.testing.assert_close(ours_q, ref.apply_rope(q, cos[positions], sin[positions]), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours_k, ref.apply_rope(k, cos[positions], sin[positions]), atol=1e-6, rtol=1e-6)
    passed = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15], device=device)  # slots [r/2, D/2) of each half
    assert torch.equal(ours_q[..., passed], q[..., passed]) and torch.equal(ours_k[..., passed], k[..., passed])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device)
    norms = (1 + 0.2 * torch.randn(head_dim, device=device), 1 + 0.2 * torch.randn(head_dim, device=device))
    caches = [torch.zeros(4, 16, kv_heads, head_dim, device=device) for _ in range(4)]
    slots = torch.arange(tokens, device=device) * 5
    out = prepare_qkv(qkv.clone(), heads, kv_heads, head_dim, *norms, 1e-5, cos, sin, positions, caches[0], caches[1],
                      slots, None, None)
    expected = ref.prepare_qkv(qkv.clone(), heads, kv_heads, head_dim, *norms, 1e-5, cos, sin, positions, caches[2],
                               caches[3], slots, None, None)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(caches[0], caches[2], atol=1e-6, rtol=1e-6)


def test_glm4_moe_config_errors() -> None:
    base = SHAPES["tiny-glm4-moe"].to_hf_config()
    with pytest.raises(ConfigError, match="n_group"):
        arch_from_hf_config({**base, "n_group": 3})
    with pytest.raises(ConfigError, match="partial_rotary_factor"):  # 16 x 0.3125: 5 rope dims, not pairs
        arch_from_hf_config({**base, "partial_rotary_factor": 0.3125, "rope_parameters": None})
    with pytest.raises(ConfigError, match="scoring_func"):
        arch_from_hf_config({**base, "scoring_func": "softmax"})
    with pytest.raises(ConfigError, match="mlp_bias"):
        arch_from_hf_config({**base, "mlp_bias": True})
    llama = SHAPES["tiny"].to_hf_config()  # the other families still rotate whole heads only
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        arch_from_hf_config({**llama, "partial_rotary_factor": 0.5})
    # transformers' default for glm4_moe is half the head; 1.0 means the whole head
    assert arch_from_hf_config({**base, "rope_parameters": None}).rotary_dim == 8
    assert arch_from_hf_config({**base, "rope_parameters": None, "partial_rotary_factor": 1.0}).rotary_dim is None


def test_glm4_moe_shapes_round_trip_through_transformers_configs() -> None:
    """The dummy shapes' config.json builds the same transformers model (parameter count) and reads back equal;
    GLM-4.5-Air's numbers are its model card's (106B total, 12B active)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in ("glm-4.5-air", "glm-4.5-slice", "tiny-glm4-moe"):
        arch = SHAPES[name]
        assert arch_from_hf_config(arch.to_hf_config()) == arch
    tiny = SHAPES["tiny-glm4-moe"]
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny.to_hf_config()))
    assert sum(p.numel() for p in model.parameters()) == tiny.num_params()
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.5
    air = SHAPES["glm-4.5-air"]
    assert arch_from_hf_config(GLM_45_AIR_CONFIG) == air  # the published config.json reads as the shape
    assert 106e9 < air.num_params() < 107.5e9
    assert 11.5e9 < air.layer_weight_params(1) + air.vocab_size * air.hidden_size < 13e9
    glm = SHAPES["glm-4.5-slice"]  # its layers, 92 of them (3 dense), are GLM-4.5: 355B with the MTP layer, 32B active
    assert glm.moe is not None
    full = replace(glm, num_layers=92, moe=replace(glm.moe, sparse_layers=tuple(range(3, 92))))
    assert 352e9 < full.num_params() < 354e9
    assert 32e9 < full.layer_weight_params(1) + full.vocab_size * full.hidden_size < 34e9


# zai-org/GLM-4.5-Air's config.json as published (transformers 4.54 keys: partial_rotary_factor at the top level)
GLM_45_AIR_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": [151329, 151336, 151338], "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 10944, "max_position_embeddings": 131072,
    "model_type": "glm4_moe", "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "pad_token_id": 151329,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.1", "use_cache": True, "use_qk_norm": False, "vocab_size": 151552}


def test_triton_model_matches_reference_model() -> None:
    """tiny-glm4-moe (dummy weights: q/k permuted at load, q/k norm, bias, grouped sigmoid routing) with the Triton
    kernels (interpreter on CPU) against the reference ops: the same logits through chunked prefill, prefix hits and
    decode."""
    from tests.test_model_kernels import _run

    generator = torch.Generator().manual_seed(13)
    shared = torch.randint(3, 500, (32,), generator=generator).tolist()
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (3, 20, 41)]
    prompts += [shared + [7, 8, 9], shared + [10, 11]]  # the second reuses the first's cached blocks
    ref_tokens, ref_logits = _run("reference", "tiny-glm4-moe", prompts, budget=24)
    tri_tokens, tri_logits = _run("triton", "tiny-glm4-moe", prompts, budget=24)
    assert tri_tokens == ref_tokens
    assert len(tri_logits) == len(ref_logits)
    atol = 2e-3 if torch.cuda.is_available() else 2e-4  # TF32 dots on a GPU
    for ours, expected in zip(tri_logits, ref_logits, strict=True):
        torch.testing.assert_close(ours, expected, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("kind", ["channel", "block"])
def test_glm4_moe_fp8_checkpoint_loads_as_it_ships(tmp_path: Path, kind: str) -> None:
    """GLM-4.5-FP8's layout (compressed-tensors, e4m3 with one scale per output row, router and norms unquantized;
    "channel") and DeepSeek's 128 x 128 block scales ("block"): q/k rows and their scales land permuted together,
    bit for bit, and the model scores a prompt as the dequantized fp32 checkpoint does within FP8 activation noise."""
    from pagoda.services.worker.model_runner import ModelRunner
    from pagoda.shared.config import EngineConfig
    from tests.test_deepseek import _prompt_logprobs

    source = _glm(tmp_path / "fp32", qk_norm=True, seed=4)
    _as_shipped(source)
    fp8: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if name.endswith("_proj.weight") and not name.startswith("model.layers.3."):
            if kind == "channel":
                q, scale = ref.quantize_fp8_rows(tensor, None)  # [N, K] e4m3, [N, 1]
                fp8[name], fp8[name.removesuffix("weight") + "weight_scale"] = q, scale
                dequantized[name] = q.float() * scale
            else:
                q, scale = ref.quantize_fp8_blocks(tensor, (128, 128))
                fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
                dequantized[name] = ref.dequantize_fp8(q, scale.repeat_interleave(128, 0)[:q.shape[0]], 128)
        else:
            fp8[name] = dequantized[name] = tensor
    config = json.loads((source / "config.json").read_text())
    quant = ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}}
             if kind == "channel" else
             {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    for folder, weights, quantized in ((tmp_path / "fp8", fp8, True), (tmp_path / "deq", dequantized, False)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant} if quantized
                                                       else config))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    runner = ModelRunner(EngineConfig(model=str(tmp_path / "fp8"), device="cpu", num_kv_blocks=16))
    layer = runner.model.layers[1]
    assert layer.qkv_weight.dtype == torch.float8_e4m3fn and layer.mlp.w_down.dtype == torch.float8_e4m3fn
    order = (torch.arange(0, 64, 16)[:, None] + permute_rotary_dims(16, 8)[None, :]).reshape(-1)  # 4 q heads
    q_proj = fp8["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(layer.qkv_weight[:64].view(torch.uint8), q_proj[order].view(torch.uint8))
    if kind == "channel":
        assert torch.equal(layer.qkv_weight_scale[:64], fp8["model.layers.1.self_attn.q_proj.weight_scale"][order])
    prompt = random_prompts([60], VOCAB, seed=4)[0]
    ours, theirs = (_prompt_logprobs(tmp_path / name, prompt)[0] for name in ("fp8", "deq"))
    diff = (ours - theirs).abs()
    assert diff.mean() < 0.08 and diff.max() < 0.5, (diff.mean(), diff.max())  # a wrong weight: O(1)


# --------------------------------------------------------------------------------------------
# GLM-4.5's tool calls and reasoning

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array", "items": {"type": "integer"}}, "where": {"$ref": "#/$defs/place"},
    "limit": {"type": ["integer", "null"]}, "note": {"type": "string"}}, "$defs": {"place": {"type": "object"}}}


def _glm_calls(text: str, parser: str = "glm45") -> tuple[str, list[tuple[str, dict]]]:
    from pagoda.services.protocol.tools import parse_tool_calls, tool_parameters

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "now"}}]
    content, calls = parse_tool_calls(parser, text, tool_parameters(parser, tools))
    return content, [(call.name, json.loads(call.arguments)) for call in calls]


def test_glm45_tool_calls_typed_by_the_schema() -> None:
    """GLM-4.5's template: `<tool_call>NAME\\n`, then `<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n` per argument
    (a string as it is, anything else as JSON), `</tool_call>`; content before the calls is content."""
    text = ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York, NY</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n"
            "<arg_key>hours</arg_key>\n<arg_value>[6, 18]</arg_value>\n<arg_key>where</arg_key>\n"
            '<arg_value>{"lat": 40.7}</arg_value>\n<arg_key>limit</arg_key>\n<arg_value>null</arg_value>\n</tool_call>'
            "\n<tool_call>now\n</tool_call>")
    content, calls = _glm_calls(text)
    assert content == "Let me check."
    assert calls == [("get_weather", {"city": "New York, NY", "days": 3, "metric": True, "hours": [6, 18],
                                      "where": {"lat": 40.7}, "limit": None}),
                     ("now", {})]
    # a string parameter keeps text that looks like JSON; a value that is not its type stays text; a parameter the
    # schema lacks is text; a value may hold the closing tags
    content, calls = _glm_calls("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n"
                                "<arg_key>days</arg_key>\n<arg_value>a few</arg_value>\n<arg_key>extra</arg_key>\n"
                                "<arg_value>[1]</arg_value>\n<arg_key>note</arg_key>\n"
                                "<arg_value>a </tool_call> b <arg_key></arg_value>\n</tool_call>")
    assert content == "" and calls == [("get_weather", {"city": "42", "days": "a few", "extra": "[1]",
                                                        "note": "a </tool_call> b <arg_key>"})]


@pytest.mark.parametrize("parser", ["glm45", "glm47"])
def test_glm47_form_and_open_last_call(parser: str) -> None:
    """GLM-4.7 writes the tags with no newlines (`<tool_call>NAME<arg_key>...`); either parser reads either form.
    The last call may be left open at the end of the text (a stop string, max_tokens after its last value)."""
    text = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>" \
           "<arg_value>2</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value>"
    assert _glm_calls(text, parser) == ("", [("get_weather", {"city": "Paris", "days": 2}),
                                             ("get_weather", {"city": "Rome"})])


def test_glm45_unparsable_calls_are_content() -> None:
    for text in ("<tool_call>\n<arg_key>city</arg_key>\n<arg_value>x</arg_value>\n</tool_call>",  # no name
                 "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>",  # no value tag
                 "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\n</tool_call>",  # unclosed value
                 "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>x</arg_value>\nmore</tool_call>"):
        assert _glm_calls(text) == (text, [])
    assert _glm_calls("no calls here") == ("no calls here", [])


def test_glm_names_choose_glm45_and_keep_its_special_tokens() -> None:
    from pagoda.services.protocol.tools import default_tool_parser, keeps_special_tokens
    from pagoda.shared.config import ServerConfig

    for name in ("zai-org/GLM-4.5", "zai-org/GLM-4.5-Air-FP8", "zai-org/GLM-4.6", "glm-4.7", "my-glm4_moe-ft", "glm4"):
        assert default_tool_parser([name]) == "glm45", name
    for name in ("zai-org/GLM-4.5V", "THUDM/GLM-4.1V-9B-Thinking"):  # vision models: not this format
        assert default_tool_parser([name]) == "hermes", name
    assert keeps_special_tokens("auto", "glm45")  # <tool_call>, <arg_key>... are special tokens of GLM's tokenizer
    assert ServerConfig(tool_call_parser="glm45").tool_call_parser == "glm45"
    assert ServerConfig(reasoning_parser="glm45").reasoning_parser == "qwen3"


def test_glm45_reasoning_reads_as_qwen3() -> None:
    """GLM-4.5 thinks in a `<think>` block that opens its output; with thinking off its template ends the prompt
    with an empty `<think></think>`, and the output is all content."""
    from pagoda.services.protocol.reasoning import prompt_reasoning, split_reasoning

    assert split_reasoning("qwen3", "<think>Sum them.</think>\nIt is 4.") == ("Sum them.", "It is 4.")
    closed = prompt_reasoning("[gMASK]<sop><|user|>\nHi<|assistant|>\n<think></think>",
                              ["<|user|>", "<|assistant|>"])
    assert split_reasoning("qwen3", "\nHello.", closed) == (None, "\nHello.")
