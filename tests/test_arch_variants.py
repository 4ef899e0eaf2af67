"""Config variants of real public checkpoints against transformers: tiny random models of each family saved by
transformers with the fields those checkpoints set (tied embeddings, biases, head_dim apart from hidden / heads,
rope scalings in the new and the old config.json spelling, sliding windows, MoE layer layouts and routers,
DeepSeek's MLA and routing options, bf16 / fp16 weights, generation_config's EOS list). Each either generates
transformers' greedy tokens in fp32 or is refused at load with a ConfigError naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.shared.errors import ConfigError, ContextLengthError
from pagoda.shared.shapes import SUPPORTED_MODEL_TYPES, arch_from_hf_config, load_arch, resolve_max_model_len
from tests.parity import TEST_KV_BLOCKS, hf_greedy, pagoda_greedy, random_prompts

VOCAB = 256
NEW_TOKENS = 16
WINDOW = 32  # a rope's original context or an attention window: the long prompt goes past it
LENGTHS = [6, 70]
DENSE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, bos_token_id=1,
             tie_word_embeddings=False)
MOE = dict(DENSE, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
DEEPSEEK = dict(DENSE, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=16, v_head_dim=24, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": WINDOW}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": WINDOW}

Edit = Callable[[dict[str, Any]], None]


def _save(model: torch.nn.Module, folder: Path, edit: Edit | None = None) -> Path:
    """transformers initialises weights so small that the residual stream is nearly the embedding, norms to 1,
    biases, routers and V3's correction bias to 0: give every matrix unit gain and the rest random values, so a
    dropped bias, a wrong rope or a wrong routing weight changes the tokens. `edit` rewrites config.json after."""
    torch.manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif param.dim() >= 2 and "embed" not in name:
                param.normal_(0.0, param.shape[-1] ** -0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    if edit is not None:
        path = folder / "config.json"
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    return folder


def _build(folder: Path, family: str, fields: dict[str, Any], edit: Edit | None = None,
           dtype: torch.dtype = torch.float32) -> Path:
    """A random transformers `family` model (e.g. "Llama": LlamaConfig, LlamaForCausalLM) saved in `dtype`."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**fields)
    model = getattr(transformers, f"{family}ForCausalLM")(config).float()
    return _save(model.to(dtype), folder, edit)


def _old_rope(theta: float, **scaling: object) -> Edit:
    """config.json as transformers 4 wrote it: rope_theta and rope_scaling (maybe with "type"), no rope_parameters."""
    def edit(config: dict[str, Any]) -> None:
        config.pop("rope_parameters", None)
        config["rope_theta"] = theta
        config["rope_scaling"] = scaling or None
    return edit


def _set(**fields: object) -> Edit:
    return lambda config: config.update(fields)


def _assert_greedy_parity(folder: Path, lengths: list[int] = LENGTHS) -> None:
    prompts = random_prompts(lengths, VOCAB)
    expected = hf_greedy(folder, prompts, NEW_TOKENS)
    ours, _ = pagoda_greedy(folder, prompts, NEW_TOKENS)
    assert ours == expected


# (family, config fields, config.json edit): what each real checkpoint sets, scaled down
PARITY_CASES: dict[str, tuple[str, dict[str, Any], Edit | None]] = {
    # Llama-3.2-1B: tied embeddings, llama3 rope, head_dim 64 with hidden 2048 / 32 heads (here 32 != 64 / 4)
    "llama3.2-tied-llama3-rope": ("Llama", dict(DENSE, tie_word_embeddings=True, head_dim=32, rms_norm_eps=1e-5,
                                                rope_parameters={"rope_theta": 500000.0, **LLAMA3}), None),
    # Llama-2 long-context fine-tunes: linear and dynamic-NTK scaling, old spelling {"type": ...}
    "llama-linear-rope-old-keys": ("Llama", DENSE, _old_rope(10000.0, type="linear", factor=2.0)),
    "llama-dynamic-rope-old-keys": ("Llama", DENSE, _old_rope(10000.0, type="dynamic", factor=2.0)),
    # an original_max_position_embeddings beside dynamic NTK: transformers (and vLLM) grow the base past
    # max_position_embeddings only, whatever that key says
    "llama-dynamic-rope-original-key": ("Llama", DENSE, _old_rope(10000.0, type="dynamic", factor=2.0,
                                                                  original_max_position_embeddings=WINDOW)),
    "llama3.1-rope-old-keys": ("Llama", DENSE, _old_rope(500000.0, **LLAMA3)),
    # Mistral-Nemo: head_dim 128 with hidden 5120 / 32 heads, no window
    "mistral-nemo-head-dim": ("Mistral", dict(DENSE, head_dim=32, sliding_window=None), None),
    # Qwen2.5-0.5B: tied, q/k/v bias, use_sliding_window false beside a sliding_window and max_window_layers
    "qwen2.5-tied-window-off": ("Qwen2", dict(DENSE, tie_word_embeddings=True, use_sliding_window=False,
                                              sliding_window=WINDOW, max_window_layers=1), None),
    # Qwen2.5's model card YaRN (old spelling) for contexts past 32k
    "qwen2.5-yarn-old-keys": ("Qwen2", DENSE, _old_rope(10000.0, type="yarn", factor=4.0,
                                                        original_max_position_embeddings=WINDOW)),
    # Qwen3-0.6B: head_dim 128 with hidden 1024 / 16 heads (2x hidden / heads), tied
    "qwen3-0.6b-head-dim": ("Qwen3", dict(DENSE, head_dim=32, tie_word_embeddings=True), None),
    "qwen3-yarn-attention-factor": ("Qwen3", dict(DENSE, head_dim=16,
                                                  rope_parameters={**YARN, "attention_factor": 1.3}), None),
    "qwen3-yarn-no-truncate": ("Qwen3", dict(DENSE, head_dim=16, rope_parameters={
        **YARN, "truncate": False, "beta_fast": 16, "beta_slow": 2}), None),
    # Qwen1.5-MoE-A2.7B: gated shared expert, softmax weights not renormalised; here every other layer sparse
    "qwen2-moe-sparse-step-2": ("Qwen2Moe", dict(MOE, num_hidden_layers=4, shared_expert_intermediate_size=48,
                                                 decoder_sparse_step=2, norm_topk_prob=False), None),
    "qwen2-moe-mlp-only-renormalised": ("Qwen2Moe", dict(MOE, num_hidden_layers=3, shared_expert_intermediate_size=48,
                                                         mlp_only_layers=[0], norm_topk_prob=True,
                                                         tie_word_embeddings=True), None),
    "qwen2-moe-no-qkv-bias": ("Qwen2Moe", dict(MOE, shared_expert_intermediate_size=48, qkv_bias=False), None),
    # Qwen3-30B-A3B's router with the other norm_topk_prob, a dense layer and sparse_step 2
    "qwen3-moe-not-renormalised": ("Qwen3Moe", dict(MOE, num_hidden_layers=4, head_dim=16, norm_topk_prob=False,
                                                    decoder_sparse_step=2, mlp_only_layers=[3]), None),
    # Mixtral-8x7B: top-2 of 8, router_jitter_noise (training only), a window longer than the prompts
    "mixtral-jitter-window": ("Mixtral", dict(DENSE, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                                              router_jitter_noise=0.1, sliding_window=128), None),
    # DeepSeek-V2-Lite: no q_lora, greedy top-k, layer 0 dense, YaRN with mscale = mscale_all_dim = 0.707
    "deepseek-v2-lite": ("DeepseekV2", dict(DEEPSEEK, q_lora_rank=None, topk_method="greedy",
                                            first_k_dense_replace=1, rope_parameters={
                                                **YARN, "mscale": 0.707, "mscale_all_dim": 0.707}), None),
    # DeepSeek-V2: q_lora, group-limited greedy, routed_scaling_factor 16, two shared experts, no rope scaling
    "deepseek-v2-grouped": ("DeepseekV2", dict(DEEPSEEK, q_lora_rank=48, topk_method="group_limited_greedy",
                                               n_group=4, topk_group=2, routed_scaling_factor=16.0,
                                               n_shared_experts=2, first_k_dense_replace=2), None),
    # Moonlight / Kimi-K2 (deepseek_v3): one expert group, no dense layer, weights not renormalised
    "deepseek-v3-one-group": ("DeepseekV3", dict(DEEPSEEK, q_lora_rank=None, n_group=1, topk_group=1,
                                                 first_k_dense_replace=0, norm_topk_prob=False,
                                                 routed_scaling_factor=1.0), None),
    # DeepSeek-V3's YaRN in the old spelling (mscale != mscale_all_dim), rope dims not interleaved
    "deepseek-v3-yarn-old-keys-rotate-half": ("DeepseekV3", dict(DEEPSEEK, q_lora_rank=48, n_group=4, topk_group=2,
                                                                 first_k_dense_replace=1, rope_interleave=False),
                                              _old_rope(10000.0, type="yarn", factor=4.0, beta_fast=32, beta_slow=1,
                                                        original_max_position_embeddings=WINDOW, mscale=1.0,
                                                        mscale_all_dim=0.8)),
    # an rms_norm_eps other than 1e-6 (Moonlight's 1e-5; larger here so that it shows): the layer and final norms
    # read it, MLA's q_a / kv_a latent norms keep 1e-6 in transformers and DeepSeek's own code
    "deepseek-v3-rms-norm-eps": ("DeepseekV3", dict(DEEPSEEK, q_lora_rank=48, n_group=4, topk_group=2,
                                                    first_k_dense_replace=1, rms_norm_eps=0.05), None),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_config_variant_matches_transformers(tmp_path: Path, case: str) -> None:
    family, fields, edit = PARITY_CASES[case]
    _assert_greedy_parity(_build(tmp_path, family, fields, edit))


@pytest.mark.parametrize("family", ["Llama", "Qwen3", "Qwen3Moe"])
def test_attention_bias_includes_the_output_projection(tmp_path: Path, family: str) -> None:
    """Llama and Qwen3's attention_bias puts a bias on o_proj as well as on q/k/v."""
    fields = dict(MOE if family == "Qwen3Moe" else DENSE, attention_bias=True)
    folder = _build(tmp_path, family, fields)
    assert load_arch(folder).o_proj_bias
    _assert_greedy_parity(folder)


@pytest.mark.parametrize(("family", "edit"), [("Qwen2", _set(attention_bias=False)),
                                              ("Mistral", _set(attention_bias=True))])
def test_attention_bias_keys_a_family_ignores_are_ignored(tmp_path: Path, family: str, edit: Edit) -> None:
    """transformers biases Qwen2's q/k/v always and Mistral's never, whatever an attention_bias key says."""
    _assert_greedy_parity(_build(tmp_path, family, DENSE, edit))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_served_in_fp32(tmp_path: Path, dtype: torch.dtype) -> None:
    folder = _build(tmp_path, "Llama", DENSE, dtype=dtype)
    assert load_arch(folder).vocab_size == VOCAB
    _assert_greedy_parity(folder)


def test_sliding_window_bounds_the_context(tmp_path: Path) -> None:
    """No sliding-window attention here: Mistral-7B-v0.1's window caps the context, where window and full attention
    agree; a prompt past it is refused, not attended to in full."""
    folder = _build(tmp_path, "Mistral", dict(DENSE, sliding_window=WINDOW + 16))
    assert resolve_max_model_len(load_arch(folder), None) == WINDOW + 16
    _assert_greedy_parity(folder, [6, WINDOW - 4])
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=TEST_KV_BLOCKS)
    with pytest.raises(ContextLengthError):
        llm.generate([random_prompts([WINDOW + 20], VOCAB)[0]], SamplingParams(temperature=0.0, max_tokens=4))


def test_sliding_window_only_where_transformers_uses_one() -> None:
    """The Qwen families' window needs use_sliding_window (off when absent); Mistral's needs no switch."""
    from transformers import AutoConfig

    for model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mistral"):
        fields = dict(MOE if "moe" in model_type else DENSE, model_type=model_type, sliding_window=WINDOW)
        hf_window = AutoConfig.for_model(**fields).sliding_window
        assert arch_from_hf_config(fields).sliding_window == (hf_window or None)
        assert arch_from_hf_config({**fields, "use_sliding_window": True}).sliding_window == WINDOW


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_absent_fields_default_as_in_transformers(model_type: str) -> None:
    """A config.json without rms_norm_eps, a rope theta or max_position_embeddings reads them as the family's
    transformers config class defaults them (mixtral: eps 1e-5 and theta 1e6 where the others have 1e-6 and 1e4;
    the context from 2048 to 131072 positions)."""
    from transformers import AutoConfig

    fields = {"mixtral": dict(DENSE, num_local_experts=8, num_experts_per_tok=2),
              "deepseek_v2": DEEPSEEK, "deepseek_v3": DEEPSEEK}.get(model_type, MOE if "moe" in model_type else DENSE)
    fields = {key: value for key, value in fields.items() if key not in ("max_position_embeddings", "head_dim")}
    hf = AutoConfig.for_model(model_type, **fields)
    arch = arch_from_hf_config(dict(fields, model_type=model_type))
    assert (arch.rms_norm_eps, arch.rope_theta, arch.max_position_embeddings) == (
        hf.rms_norm_eps, hf.rope_parameters["rope_theta"], hf.max_position_embeddings)
    if model_type not in ("deepseek_v2", "deepseek_v3"):  # MLA's head_dim is its rope dims
        assert arch.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)


def test_qwen3_without_head_dim_reads_it_as_transformers_does(tmp_path: Path) -> None:
    """Qwen3's head_dim defaults to 128 whatever hidden_size / heads is (transformers' Qwen3Config): a config.json
    without it was read as hidden / heads and its checkpoint refused as of the wrong shape."""
    folder = _build(tmp_path, "Qwen3", dict(DENSE, hidden_size=128, head_dim=128),
                    lambda config: config.pop("head_dim"))
    _assert_greedy_parity(folder, [6])


def test_qwen3_moe_norm_topk_prob_defaults_as_in_transformers() -> None:
    from transformers import Qwen3MoeConfig

    fields = dict(MOE, model_type="qwen3_moe", head_dim=16)
    moe = arch_from_hf_config(fields).moe
    assert moe is not None and moe.renormalize == Qwen3MoeConfig(**MOE).norm_topk_prob


def test_generation_config_eos_list_stops_where_transformers_does(tmp_path: Path) -> None:
    """generation_config.json's EOS list (Llama-3-Instruct's [<|end_of_text|>, <|eot_id|>]): each prompt stops
    at the first of them that transformers' generate stops at."""
    folder = _build(tmp_path, "Llama", DENSE)
    prompts = random_prompts([6, 40], VOCAB)
    free = hf_greedy(folder, prompts, NEW_TOKENS)
    stops = [free[0][5], free[1][8]]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops, "bos_token_id": 1}))
    expected = hf_greedy(folder, prompts, NEW_TOKENS, stop_at_eos=True)
    assert all(len(tokens) < NEW_TOKENS for tokens in expected), "transformers stopped at the listed EOS ids"
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=TEST_KV_BLOCKS)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert all(out.outputs[0].finish_reason == "stop" for out in outputs)


@pytest.mark.parametrize(("model_type", "fields", "field"), [
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
])
def test_unsupported_fields_refused_by_name(model_type: str, fields: dict[str, Any], field: str) -> None:
    """Features that would otherwise be silently dropped: Llama's MLP biases; DeepSeek-V2 routing that
    transformers' V2 router does not do (it ignores norm_topk_prob, has no noaux_tc); DeepSeek's moe_layer_freq,
    which transformers ignores and DeepSeek's own code follows (sparse layers were DeepSeek's, so a checkpoint
    saved by transformers failed to load naming a missing dense weight); a router other than the one transformers
    gives the family (V2 softmax; V3 sigmoid with noaux_tc), which DeepSeek's own code would follow and pagoda served
    as transformers' (glm4_moe refuses the same)."""
    base = dict(DEEPSEEK if model_type.startswith("deepseek") else DENSE, model_type=model_type)
    arch_from_hf_config(base)
    with pytest.raises(ConfigError, match=field):
        arch_from_hf_config({**base, **fields})


@pytest.mark.extended
def test_output_projection_bias_added_once_across_ranks(tmp_path: Path) -> None:
    """Tensor parallel 2 (o_proj split by rows, its bias added by one rank) generates what one rank does."""
    from tests.test_tensor_parallel import _generate_in_process, _generate_with_services

    folder = _build(tmp_path, "Llama", dict(DENSE, attention_bias=True, head_dim=16))
    assert _generate_with_services(folder, 2) == _generate_in_process(folder)


@pytest.mark.parametrize(("edit", "field"), [
    ({"vocab_size": None}, "vocab_size"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"num_attention_heads": None}, "num_attention_heads"),
    ({"intermediate_size": None}, "intermediate_size"),
    ({"num_attention_heads": "4"}, "num_attention_heads"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"vocab_size": -5}, "vocab_size"),
    ({"num_hidden_layers": True}, "num_hidden_layers"),
    ({"head_dim": 16.5}, "head_dim"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),  # 4 heads do not share 3 kv heads out
    ({"max_position_embeddings": "2k"}, "max_position_embeddings"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    ({"eos_token_id": "2"}, "eos_token_id"),
    ({"eos_token_id": [2, None]}, "eos_token_id"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "big"}}, "rope_theta"),
    ({"rope_scaling": ["linear", 2.0]}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 0}}, "factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": -4.0,
                          "original_max_position_embeddings": 64}}, "factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}}, "rope_theta"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
])
def test_config_fields_of_no_usable_value_are_refused_by_name(edit: dict[str, Any], field: str) -> None:
    """A field config.json lacks (one written by hand) or holds as another type fails as a ConfigError naming it
    (they were KeyError, TypeError or AttributeError tracebacks at `pagoda serve`, an AssertionError for kv heads
    that do not divide the heads, or an architecture of 0 heads that failed later). A rope factor or theta of 0 or
    less, or a negative rms_norm_eps, was served (NaN rotations or norms: a linear factor of 0 gave token id 0 every
    step; a rope_theta of 0 was read as 10000)."""
    config = dict(DENSE, model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    arch_from_hf_config(config)
    for key, value in edit.items():
        config.pop(key) if value is None else config.update({key: value})
    with pytest.raises(ConfigError, match=field):
        arch_from_hf_config(config)


def _family_fields(model_type: str) -> dict[str, Any]:
    return {"mixtral": dict(DENSE, num_local_experts=8, num_experts_per_tok=2), "deepseek_v2": DEEPSEEK,
            "deepseek_v3": DEEPSEEK, "glm4_moe": dict(MOE, n_routed_experts=8)}.get(
        model_type, MOE if "moe" in model_type else DENSE)


@pytest.mark.parametrize(("model_type", "fields", "field"), [
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("qwen2_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("mixtral", {"num_local_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok"),
    ("deepseek_v2", {"topk_method": "greedy", "num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_more_experts_a_token_than_the_layer_has_are_refused(model_type: str, fields: dict[str, Any],
                                                              field: str) -> None:
    """num_experts_per_tok past the experts (transformers' topk fails on it too): the model loaded and every step
    failed with torch's 'selected index k out of range'."""
    base = dict(_family_fields(model_type), model_type=model_type)
    arch_from_hf_config(base)
    with pytest.raises(ConfigError, match=field):
        arch_from_hf_config({**base, **fields})


@pytest.mark.parametrize(("model_type", "fields"), [("llama", {"head_dim": 15}), ("qwen3", {"head_dim": 15}),
                                                    ("mistral", {"hidden_size": 60, "num_attention_heads": 4})])
def test_odd_head_dims_are_refused(model_type: str, fields: dict[str, Any]) -> None:
    """Rope rotates pairs of a head's dims: an odd head_dim (given, or hidden_size / heads) loaded and every step
    failed on a shape mismatch (transformers' rotate_half fails on it too)."""
    base = dict(_family_fields(model_type), model_type=model_type)
    arch_from_hf_config(base)
    with pytest.raises(ConfigError, match="head_dim"):
        arch_from_hf_config({**base, **fields})


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("text", ["{\"vocab_size\": 256,}", "[1, 2]"])
def test_unreadable_config_files_are_refused_naming_the_file(tmp_path: Path, name: str, text: str) -> None:
    """A config.json or generation_config.json edited into no JSON object (a trailing comma) was a JSONDecodeError
    or AttributeError traceback at `pagoda serve`, before any process started."""
    from pagoda.launcher import check_engine_config
    from pagoda.shared.config import EngineConfig

    (tmp_path / "config.json").write_text(json.dumps(dict(DENSE, model_type="llama")))
    load_arch(tmp_path)
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=name):
        load_arch(tmp_path)
    with pytest.raises(ConfigError, match=name):
        check_engine_config(EngineConfig(model=str(tmp_path), device="cpu"))


def test_eos_ids_past_the_vocabulary_stop_nothing_and_ban_nothing(tmp_path: Path) -> None:
    """generation_config.json naming an EOS id the model has no logit for (one of a tokenizer larger than the
    model): it can never be sampled, so min_tokens bans only the others (the ban indexed the logits past their end:
    every request with min_tokens failed); transformers' min_new_tokens ignores it too."""
    folder = _build(tmp_path, "Llama", DENSE)
    prompts = random_prompts([6, 40], VOCAB)
    free = hf_greedy(folder, prompts, NEW_TOKENS)
    stops = [free[0][2], free[1][10], VOCAB + 100]  # the first one banned by min_tokens 6, the second not
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops, "bos_token_id": 1}))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=6, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=TEST_KV_BLOCKS)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=6))
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert all(len(tokens) >= 6 for tokens in expected) and len(expected[1]) == 11, "min_tokens, then a listed EOS"
