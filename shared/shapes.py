"""Model architecture from a Hugging Face config.json, and the named dummy shapes used by tests and benchmarks.

Plain Python (no torch): the worker sizes tensors from it, the tokenizer and the launcher read it too.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pagoda.shared.errors import ConfigError, ModelNotFoundError

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2",
                         "deepseek_v3", "glm4_moe")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                    "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                    "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                    "glm4_moe": "Glm4MoeForCausalLM"}


@dataclass(frozen=True, slots=True)
class MoeArch:
    """A mixture-of-experts MLP: which layers are sparse and how tokens are routed."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool  # norm_topk_prob: the top-k weights are rescaled to sum to 1
    sparse_layers: tuple[int, ...]  # the other layers keep a dense MLP of intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    # DeepSeekMoE: ungated shared experts, scores by softmax (V2) or sigmoid (V3), top-k over the experts of the
    # best topk_groups of num_groups groups ("group_limited_greedy": a group's best score; "noaux_tc": its two best
    # scores plus a per-expert correction bias, used for choosing only), weights times routed_scaling_factor.
    shared_expert_gated: bool = True
    scoring_func: str = "softmax"  # "softmax" | "sigmoid"
    topk_method: str = "greedy"  # "greedy" | "group_limited_greedy" | "noaux_tc"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0

    def expert_params(self, hidden_size: int) -> int:
        return 3 * hidden_size * self.expert_intermediate_size

    def expected_experts_touched(self, num_tokens: int) -> float:
        """Distinct experts a batch of uniformly routed tokens reads in one layer: E (1 - (1 - k/E)^T)."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens)


@dataclass(frozen=True, slots=True)
class MlaArch:
    """DeepSeek's multi-head latent attention: K and V come from one cached latent of kv_lora_rank values per token
    (plus a rope key of qk_rope_head_dim shared by all heads); q from the hidden state directly or through a
    q_lora_rank bottleneck."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: one q projection (DeepSeek-V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the checkpoint's rope dims are (x0, x1), (x2, x3)... pairs

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def entry_dim(self) -> int:
        """Values one token leaves in one layer's cache: [latent ‖ rope key]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def attention_params(self, hidden_size: int, num_heads: int) -> int:
        q = (hidden_size * num_heads * self.qk_head_dim if self.q_lora_rank is None else
             hidden_size * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * num_heads * self.qk_head_dim)
        kv = hidden_size * self.entry_dim + self.kv_lora_rank
        kv += self.kv_lora_rank * num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + num_heads * self.v_head_dim * hidden_size


@dataclass(frozen=True, slots=True)
class ModelArch:
    """The numbers that decide every tensor shape of a Llama-family decoder."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None  # rope_type != default: its parameters
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Llama and Qwen3 where attention_bias says)
    o_proj_bias: bool = False  # the output projection carries one too (Llama and Qwen3's attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rope
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sliding_window: int | None = None
    moe: MoeArch | None = None
    mla: MlaArch | None = None  # DeepSeek: head_dim is then the rope dims (the rope table's width)
    # GLM-4.5's partial_rotary_factor: rope over the first rotary_dim dims of each q/k head, the rest passed through
    # (None: the whole head). The worker permutes q/k rows at load so the kernels' whole-head rope does this.
    rotary_dim: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """The dims of a head that rope rotates (the checkpoint's rotary_dim, else all of head_dim)."""
        return self.rotary_dim or self.head_dim

    @property
    def context_limit(self) -> int:
        """The longest context the config supports: max_position_embeddings, or the stretched original context
        of a YaRN (original x factor) or dynamic-NTK (max x factor) rope."""
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type")
        if kind == "yarn" and scaling.get("factor"):
            original = scaling.get("original_max_position_embeddings") or self.max_position_embeddings
            return max(self.max_position_embeddings, int(original * float(scaling["factor"])))
        if kind == "dynamic":
            return int(self.max_position_embeddings * float(scaling["factor"]))
        return self.max_position_embeddings

    def _attention_params(self) -> int:
        h = self.hidden_size
        if self.mla is not None:
            return self.mla.attention_params(h, self.num_heads) + 2 * h
        biases = (self.q_size + 2 * self.kv_size if self.attention_bias else 0) + (h if self.o_proj_bias else 0)
        return (h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h + biases
                + (2 * self.head_dim if self.qk_norm else 0))

    def _mlp_params(self, layer: int, num_experts: float) -> float:
        """MLP weights of one layer: dense, or the router, `num_experts` experts and the shared expert."""
        h, moe = self.hidden_size, self.moe
        if moe is None or layer not in moe.sparse_layers:
            return 3 * h * self.intermediate_size
        gate = h if moe.shared_expert_intermediate_size and moe.shared_expert_gated else 0
        shared = 3 * h * moe.shared_expert_intermediate_size + gate
        return h * moe.num_experts + num_experts * moe.expert_params(h) + shared

    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        num_experts = self.moe.num_experts if self.moe else 0
        layers = sum(self._attention_params() + self._mlp_params(i, num_experts) for i in range(self.num_layers))
        return int(layers) + embed + self.hidden_size

    def layer_weight_params(self, num_tokens: int) -> float:
        """Weights one step of `num_tokens` tokens reads in the decoder layers: every dense weight, and of each
        sparse layer the experts uniformly routed tokens are expected to touch (embeddings and LM head apart)."""
        touched = self.moe.expected_experts_touched(num_tokens) if self.moe else 0.0
        return sum(self._attention_params() + self._mlp_params(i, touched) for i in range(self.num_layers))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V per kv head, or MLA's one latent entry, over all layers."""
        if self.mla is not None:
            return self.num_layers * self.mla.entry_dim * dtype_bytes
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json that transformers reads back into the same architecture (for peers and tests)."""
        model_type = self.model_type
        arch_name = HF_ARCHITECTURES[model_type]
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        config: dict[str, Any] = {
            "architectures": [arch_name], "model_type": model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta, "rope_parameters": rope, "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "eos_token_id": list(self.eos_token_ids) or None, "bos_token_id": self.bos_token_id,
            "torch_dtype": "bfloat16",
        }
        if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
            config["use_sliding_window"] = False
        if self.mla is not None:
            config.update(_deepseek_hf_fields(self))
        elif model_type == "glm4_moe":
            config.update(_glm4_moe_hf_fields(self))
            rope["partial_rotary_factor"] = self.rope_dim / self.head_dim
        elif self.moe is not None:
            config.update(_moe_hf_fields(self))
        return config


def _glm4_moe_hf_fields(arch: ModelArch) -> dict[str, Any]:
    moe = arch.moe
    assert moe is not None
    first_sparse = min(moe.sparse_layers, default=arch.num_layers)
    assert moe.sparse_layers == tuple(range(first_sparse, arch.num_layers)), "GLM-4.5: dense layers, then sparse"
    return {"n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.expert_intermediate_size,
            "n_shared_experts": moe.shared_expert_intermediate_size // moe.expert_intermediate_size,
            "first_k_dense_replace": first_sparse, "norm_topk_prob": moe.renormalize,
            "routed_scaling_factor": moe.routed_scaling_factor, "n_group": moe.num_groups,
            "topk_group": moe.topk_groups, "use_qk_norm": arch.qk_norm,
            "partial_rotary_factor": arch.rope_dim / arch.head_dim, "num_nextn_predict_layers": 0}


def _moe_hf_fields(arch: ModelArch) -> dict[str, Any]:
    moe = arch.moe
    assert moe is not None
    if arch.model_type == "mixtral":
        return {"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "intermediate_size": moe.expert_intermediate_size}
    dense = [i for i in range(arch.num_layers) if i not in moe.sparse_layers]
    fields: dict[str, Any] = {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                              "moe_intermediate_size": moe.expert_intermediate_size,
                              "norm_topk_prob": moe.renormalize, "decoder_sparse_step": 1, "mlp_only_layers": dense}
    if arch.model_type == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = moe.shared_expert_intermediate_size
        fields["qkv_bias"] = arch.attention_bias
    return fields


def _moe_from_hf(config: dict[str, Any], model_type: str, num_layers: int) -> MoeArch | None:
    """The sparse MLP of a Qwen-MoE or Mixtral config.json (None for dense families)."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if not num_experts:
        raise ConfigError(f"{model_type} config has no num_experts / num_local_experts", param="model")
    if model_type == "mixtral":  # every layer sparse; experts are intermediate_size wide; always renormalised
        return MoeArch(num_experts=num_experts, top_k=_count(config, "num_experts_per_tok"),
                       expert_intermediate_size=_count(config, "intermediate_size"), renormalize=True,
                       sparse_layers=tuple(range(num_layers)))
    step = config.get("decoder_sparse_step") or 1
    dense_only = set(config.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
    return MoeArch(num_experts=num_experts, top_k=_count(config, "num_experts_per_tok"),
                   expert_intermediate_size=_count(config, "moe_intermediate_size"),
                   renormalize=bool(config.get("norm_topk_prob", False)), sparse_layers=sparse,
                   shared_expert_intermediate_size=(config.get("shared_expert_intermediate_size") or 0
                                                    if model_type == "qwen2_moe" else 0))


def _deepseek_hf_fields(arch: ModelArch) -> dict[str, Any]:
    mla, moe = arch.mla, arch.moe
    assert mla is not None and moe is not None
    first_sparse = min(moe.sparse_layers, default=arch.num_layers)
    assert moe.sparse_layers == tuple(range(first_sparse, arch.num_layers)), "DeepSeek: dense layers, then sparse"
    fields: dict[str, Any] = {
        "kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim, "head_dim": mla.qk_rope_head_dim,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_intermediate_size,
        "n_shared_experts": moe.shared_expert_intermediate_size // moe.expert_intermediate_size,
        "first_k_dense_replace": first_sparse, "norm_topk_prob": moe.renormalize,
        "routed_scaling_factor": moe.routed_scaling_factor, "n_group": moe.num_groups, "topk_group": moe.topk_groups,
        "topk_method": moe.topk_method, "scoring_func": moe.scoring_func, "moe_layer_freq": 1,
    }
    if arch.model_type == "deepseek_v3":
        fields["rope_interleave"] = mla.rope_interleave
    return fields


def _deepseek_from_hf(config: dict[str, Any], model_type: str, num_layers: int) -> tuple[MlaArch, MoeArch]:
    """MLA and DeepSeekMoE of a DeepSeek-V2 / V3 config.json (their defaults as transformers 5 has them)."""
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ConfigError(f"{model_type} with attention_bias / mlp_bias is not supported", param="model")
    v3 = model_type == "deepseek_v3"
    mla = MlaArch(kv_lora_rank=config.get("kv_lora_rank", 512), q_lora_rank=config.get("q_lora_rank", 1536),
                  qk_nope_head_dim=config.get("qk_nope_head_dim", 128),
                  qk_rope_head_dim=config.get("qk_rope_head_dim", 64),
                  v_head_dim=config.get("v_head_dim") or 128,
                  rope_interleave=bool(config.get("rope_interleave", True)) if v3 else True)
    if mla.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim must be even, got {mla.qk_rope_head_dim}", param="model")
    first_dense = config.get("first_k_dense_replace", 3 if v3 else 0) or 0
    if (config.get("moe_layer_freq") or 1) != 1:
        # transformers makes every layer from first_k_dense_replace on sparse, DeepSeek's own modeling code only
        # every moe_layer_freq-th of them: no one answer to match (every DeepSeek checkpoint has 1)
        raise ConfigError(f"{model_type} with moe_layer_freq {config['moe_layer_freq']} is not supported (only 1)",
                          param="model")
    num_experts = config.get("n_routed_experts", 256 if v3 else 64)
    top_k = config.get("num_experts_per_tok") or (8 if v3 else 6)
    expert = config.get("moe_intermediate_size", 2048 if v3 else 1407)
    # transformers' V3 router is always sigmoid + correction bias over groups; its V2 router always softmax: a config
    # that asks for another (DeepSeek's own code would follow it) is refused, as glm4_moe's is
    topk_method = "noaux_tc" if v3 else (config.get("topk_method") or "greedy")
    if topk_method not in ("greedy", "group_limited_greedy", "noaux_tc") or (not v3 and topk_method == "noaux_tc"):
        raise ConfigError(f"{model_type} topk_method {topk_method!r} is not supported", param="model")
    if v3 and config.get("topk_method") not in (None, "noaux_tc"):
        raise ConfigError(f"{model_type} topk_method {config['topk_method']!r} is not supported (only 'noaux_tc', "
                          "as transformers routes)", param="model")
    scoring = "sigmoid" if v3 else "softmax"
    if config.get("scoring_func") not in (None, scoring):
        raise ConfigError(f"{model_type} scoring_func {config['scoring_func']!r} is not supported (only {scoring!r}, "
                          "as transformers routes)", param="model")
    if not v3 and config.get("norm_topk_prob"):
        # transformers' V2 router ignores it (weights x routed_scaling_factor), DeepSeek's own code renormalises
        # instead of scaling: no one answer to match (every DeepSeek-V2 checkpoint has it false)
        raise ConfigError(f"{model_type} with norm_topk_prob true is not supported", param="model")
    groups = config.get("n_group", 8 if v3 else 1) or 1
    topk_groups = config.get("topk_group", 4 if v3 else 1) or 1
    if topk_method != "greedy":
        _check_groups(model_type, num_experts, groups, topk_groups, top_k)
    moe = MoeArch(num_experts=num_experts, top_k=top_k, expert_intermediate_size=expert,
                  renormalize=bool(config.get("norm_topk_prob", v3)),
                  sparse_layers=tuple(range(first_dense, num_layers)),
                  shared_expert_intermediate_size=expert * (config.get("n_shared_experts", 1 if v3 else 2) or 0),
                  shared_expert_gated=False, scoring_func="sigmoid" if v3 else "softmax", topk_method=topk_method,
                  num_groups=groups, topk_groups=topk_groups,
                  routed_scaling_factor=float(config.get("routed_scaling_factor", 2.5 if v3 else 1.0)))
    return mla, moe


def _glm4_moe_from_hf(config: dict[str, Any], num_layers: int) -> MoeArch:
    """GLM-4.5's MoE, DeepSeek-V3's router and experts: layers from first_k_dense_replace on are sparse (the MTP
    layers after num_hidden_layers are not loaded); n_shared_experts ungated shared experts; sigmoid scores chosen
    with e_score_correction_bias among the topk_group best of n_group groups (their two best summed), weights
    renormalised where norm_topk_prob says, times routed_scaling_factor. Defaults: transformers' Glm4MoeConfig."""
    if config.get("mlp_bias"):
        raise ConfigError("glm4_moe with mlp_bias is not supported", param="model")
    for field, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if config.get(field) not in (None, expected):  # transformers' router is always these: refuse another
            raise ConfigError(f"glm4_moe {field} {config[field]!r} is not supported (only {expected!r}, as "
                              f"transformers routes)", param="model")
    num_experts = config.get("n_routed_experts") or config.get("num_local_experts") or 128
    top_k = config.get("num_experts_per_tok") or 8
    expert = config.get("moe_intermediate_size") or 1408
    groups = config.get("n_group") or 1
    topk_groups = config.get("topk_group") or 1
    _check_groups("glm4_moe", num_experts, groups, topk_groups, top_k)
    first_dense = config.get("first_k_dense_replace", 1) or 0
    return MoeArch(num_experts=num_experts, top_k=top_k, expert_intermediate_size=expert,
                   renormalize=bool(config.get("norm_topk_prob", True)),
                   sparse_layers=tuple(range(first_dense, num_layers)),
                   shared_expert_intermediate_size=expert * (config.get("n_shared_experts", 1) or 0),
                   shared_expert_gated=False, scoring_func="sigmoid", topk_method="noaux_tc", num_groups=groups,
                   topk_groups=topk_groups,
                   routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0))


def _check_groups(model_type: str, num_experts: int, groups: int, topk_groups: int, top_k: int) -> None:
    if num_experts % groups or not 0 < topk_groups <= groups or top_k > topk_groups * (num_experts // groups):
        raise ConfigError(f"{model_type}: {num_experts} experts do not split into n_group {groups} groups of which "
                          f"topk_group {topk_groups} hold num_experts_per_tok {top_k} experts", param="model")


def _rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Rope theta and scaling, wherever this config keeps them (rope_parameters, rope_theta, rope_scaling)."""
    params = dict(_section(config, "rope_parameters"))
    scaling = _section(config, "rope_scaling")
    theta = _optional_number(params, "rope_theta")
    theta = _optional_number(config, "rope_theta") if theta is None else theta
    theta = 10000.0 if theta is None else theta
    if theta <= 0:  # NaN or infinite rotations
        raise ConfigError(f"config.json rope_theta must be > 0, got {theta!r}", param="model")
    params.pop("rope_theta", None)
    params = {**scaling, **params}
    for key in ROPE_NUMBERS:
        _optional_number(params, key)
    params.pop("partial_rotary_factor", None)  # _rotary_dim reads it
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})",
                          param="rope_scaling")
    if rope_type == "default":
        return float(theta), None
    params["rope_type"] = rope_type
    params.pop("type", None)
    if params.get("factor") is not None and params["factor"] <= 0:
        raise ConfigError(f"rope_type {rope_type!r} factor must be > 0, got {params['factor']!r}", param="rope_scaling")
    if "original_max_position_embeddings" not in params and config.get("original_max_position_embeddings"):
        params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    missing = [key for key in ROPE_REQUIRED[rope_type] if params.get(key) is None]
    if rope_type == "yarn" and params.get("factor") is None and params.get("original_max_position_embeddings"):
        missing = []  # DeepSeek-V3 style: the factor is max / original
    if missing:
        raise ConfigError(f"rope_type {rope_type!r} needs {', '.join(missing)}", param="rope_scaling")
    return float(theta), params


# The numeric parameters of the rope types pagoda computes (rope.py reads them as floats)
ROPE_NUMBERS = ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "beta_fast",
                "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "partial_rotary_factor")


# Families whose rope may cover part of each head (partial_rotary_factor), and the factor transformers gives them
# when config.json leaves it out
PARTIAL_ROTARY_DEFAULTS = {"glm4_moe": 0.5}


def _rotary_dim(config: dict[str, Any], model_type: str, head_dim: int) -> int | None:
    """The dims of each head rope rotates, int(head_dim x partial_rotary_factor) as transformers takes them (from
    rope_parameters, rope_scaling, or the top level), None for the whole head; refused for the other families."""
    factor = None
    for source in (config.get("rope_parameters"), config.get("rope_scaling"), config):
        if isinstance(source, dict) and source.get("partial_rotary_factor") is not None:
            factor = float(source["partial_rotary_factor"])
            break
    if factor is None:
        factor = PARTIAL_ROTARY_DEFAULTS.get(model_type, 1.0)
    if factor == 1.0:
        return None
    if model_type not in PARTIAL_ROTARY_DEFAULTS:
        raise ConfigError(f"partial_rotary_factor {factor} is not supported for {model_type} (rope over the whole "
                          f"head only; supported for {', '.join(PARTIAL_ROTARY_DEFAULTS)})", param="rope_scaling")
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ConfigError(f"partial_rotary_factor {factor} of head_dim {head_dim} gives {rotary_dim} rope dims: "
                          f"they must be even and in 2..{head_dim}", param="rope_scaling")
    return None if rotary_dim == head_dim else rotary_dim


ROPE_REQUIRED = {
    "linear": ("factor",), "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


def _attention_biases(config: dict[str, Any], model_type: str) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) as transformers builds each family's attention: Qwen2 always biases q/k/v,
    Qwen2-MoE where qkv_bias says; Llama and Qwen3 bias all four projections where attention_bias says; Mistral
    and Mixtral never (their attention_bias key, where present, is ignored); DeepSeek refuses it (_deepseek_from_hf)."""
    if model_type == "qwen2":
        return True, False
    if model_type == "qwen2_moe":
        return bool(config.get("qkv_bias", True)), False
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        bias = bool(config.get("attention_bias", False))
        return bias, bias
    if model_type == "glm4_moe":  # q/k/v only: its o_proj never has one
        return bool(config.get("attention_bias", False)), False
    return False, False


def _sliding_window(config: dict[str, Any], model_type: str) -> int | None:
    """The attention window transformers gives the family: Mistral and Mixtral's sliding_window; the Qwen families'
    only with use_sliding_window (off by default); none for Llama and DeepSeek."""
    if model_type in ("mistral", "mixtral"):
        return config.get("sliding_window") or None
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and config.get("use_sliding_window", False):
        return config.get("sliding_window") or None
    return None


# What each family's transformers config class gives a field config.json leaves out (transformers 5.x), where it
# differs from the defaults arch_from_hf_config falls back to (eps 1e-6, rope theta 10000, 4096 positions, head_dim
# hidden / heads).
FAMILY_DEFAULTS: dict[str, dict[str, float]] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 131072},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768, "head_dim": 128},  # head_dim 128 whatever hidden / heads is
    "qwen2_moe": {"max_position_embeddings": 32768},
    "qwen3_moe": {"max_position_embeddings": 32768},
    "deepseek_v2": {"max_position_embeddings": 2048},
    "glm4_moe": {"rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
}


def read_json_object(path: Path) -> dict[str, Any]:
    """A config file's JSON object, or a ConfigError naming the file."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path.name} in {str(path.parent)!r}: {exc}", param="model") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path.name} in {str(path.parent)!r} holds no JSON object", param="model")
    return value


def _count(config: dict[str, Any], key: str, default: int | None = None) -> int:
    """config.json's `key`, a whole number >= 1; `default` where it is absent or null (required without one)."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise ConfigError(f"config.json has no {key}", param="model")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json {key} must be a whole number >= 1, got {value!r}", param="model")
    return value


def _optional_number(config: dict[str, Any], key: str) -> float | None:
    """config.json's `key`, a number, or None where it is absent or null."""
    value = config.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ConfigError(f"config.json {key} must be a number, got {value!r}", param="model")
    return value


def _number(config: dict[str, Any], key: str, default: float) -> float:
    value = _optional_number(config, key)
    return default if value is None else value


def _section(config: dict[str, Any], key: str) -> dict[str, Any]:
    """config.json's `key`, a JSON object ({} where it is absent or null)."""
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"config.json {key} must be a JSON object, got {value!r}", param="model")
    return value


def token_ids(value: Any, where: str) -> tuple[int, ...]:
    """An eos_token_id: one id, a list of them, or null (none)."""
    ids = value if isinstance(value, list) else ([] if value is None else [value])
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ConfigError(f"{where} must be a token id or a list of them, got {value!r}", param="model")
    return tuple(ids)


def arch_from_hf_config(config: dict[str, Any]) -> ModelArch:
    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})",
                          param="model")
    defaults = dict(FAMILY_DEFAULTS.get(model_type, {}))
    if (config.get("rope_parameters") or {}).get("rope_theta") is not None:
        defaults.pop("rope_theta", None)  # the theta is there, under its transformers 5 key
    config = {**config, **{key: value for key, value in defaults.items() if config.get(key) is None}}
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {config.get('hidden_act')!r} is not supported (only silu)", param="model")
    num_heads = _count(config, "num_attention_heads")
    num_kv_heads = _count(config, "num_key_value_heads", num_heads)
    if num_heads % num_kv_heads and model_type not in MLA_MODEL_TYPES:  # MLA caches a latent: no kv heads
        raise ConfigError(f"config.json: num_attention_heads {num_heads} is no multiple of num_key_value_heads "
                          f"{num_kv_heads}", param="model")
    hidden_size = _count(config, "hidden_size")
    theta, scaling = _rope_settings(config)
    eos_ids = token_ids(config.get("eos_token_id"), "config.json eos_token_id")
    window = _sliding_window(config, model_type)
    num_layers = _count(config, "num_hidden_layers")
    qkv_bias, o_proj_bias = _attention_biases(config, model_type)
    if model_type == "llama" and config.get("mlp_bias"):  # gate/up/down biases: no MLP path here adds them
        raise ConfigError(f"{model_type} with mlp_bias is not supported", param="model")
    if model_type in MLA_MODEL_TYPES:
        mla, moe = _deepseek_from_hf(config, model_type, num_layers)
        config = {**config, "head_dim": mla.qk_rope_head_dim}  # the rope table's width, as transformers sets it
    elif model_type == "glm4_moe":
        mla, moe = None, _glm4_moe_from_hf(config, num_layers)
    else:
        mla, moe = None, _moe_from_hf(config, model_type, num_layers)
    if moe is not None and moe.top_k > moe.num_experts:  # torch.topk's 'selected index k out of range' every step
        raise ConfigError(f"config.json num_experts_per_tok {moe.top_k} exceeds the {moe.num_experts} experts of a "
                          "layer", param="model")
    head_dim = _count(config, "head_dim", hidden_size // num_heads)
    if head_dim % 2:  # rope rotates pairs of dims (i, i + head_dim / 2)
        raise ConfigError(f"config.json head_dim {head_dim} (given, or hidden_size / num_attention_heads) is odd: "
                          "rope needs an even head_dim", param="model")
    rms_norm_eps = _number(config, "rms_norm_eps", 1e-6)
    if rms_norm_eps < 0:  # the root of a negative mean square: NaN
        raise ConfigError(f"config.json rms_norm_eps must be >= 0, got {rms_norm_eps!r}", param="model")
    qk_norm = model_type in ("qwen3", "qwen3_moe") or (model_type == "glm4_moe" and bool(config.get("use_qk_norm")))
    return ModelArch(
        model_type=model_type, vocab_size=_count(config, "vocab_size"), hidden_size=hidden_size,
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=_count(config, "intermediate_size"), rms_norm_eps=rms_norm_eps,
        max_position_embeddings=_count(config, "max_position_embeddings", 4096), rope_theta=theta,
        rope_scaling=scaling, tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias, o_proj_bias=o_proj_bias, qk_norm=qk_norm,
        eos_token_ids=eos_ids, bos_token_id=config.get("bos_token_id"), sliding_window=window, moe=moe, mla=mla,
        rotary_dim=_rotary_dim(config, model_type, head_dim),  # MLA families: None, or a ConfigError
    )


def load_arch(model_dir: str | Path) -> ModelArch:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"no model at {str(model_dir)!r}: expected a folder with config.json, "
                                 f"or a dummy shape ({', '.join(SHAPES)}) with load_format='dummy'")
    arch = arch_from_hf_config(read_json_object(path))
    generation = Path(model_dir) / "generation_config.json"
    if generation.is_file():  # chat models often list their end-of-turn tokens only here
        extra = token_ids(read_json_object(generation).get("eos_token_id"), "generation_config.json eos_token_id")
        merged = tuple(dict.fromkeys([*arch.eos_token_ids, *extra]))
        arch = replace(arch, eos_token_ids=merged)
    return arch


_DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1}

SHAPES: dict[str, ModelArch] = {
    "tiny": ModelArch(model_type="llama", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6,
                      max_position_embeddings=2048, rope_theta=10000.0, eos_token_ids=(2,), bos_token_id=1),
    "tiny-qwen3": ModelArch(model_type="qwen3", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=32, intermediate_size=128, rms_norm_eps=1e-6,
                            max_position_embeddings=2048, rope_theta=1_000_000.0, qk_norm=True,
                            eos_token_ids=(2,), bos_token_id=1),
    "qwen3-0.6b": ModelArch(model_type="qwen3", vocab_size=151936, hidden_size=1024, num_layers=28,
                            num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072,
                            rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1_000_000.0,
                            tie_word_embeddings=True, qk_norm=True, eos_token_ids=(151645,),
                            bos_token_id=151643),
    "llama3-8b": ModelArch(model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=32,
                           num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                           rms_norm_eps=1e-5, max_position_embeddings=8192, rope_theta=500000.0,
                           eos_token_ids=(128001, 128009), bos_token_id=128000),
    # Llama 3.1 8B: llama3 rope scaling to 128k positions
    "llama3.1-8b": ModelArch(model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=32,
                             num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                             rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                             eos_token_ids=(128001, 128008, 128009), bos_token_id=128000),
    # Qwen3-8B with the YaRN settings of its model card (factor 4 over 32k: 131,072 positions)
    "qwen3-8b-yarn": ModelArch(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_layers=36,
                               num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288,
                               rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1_000_000.0,
                               rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32768},
                               qk_norm=True, eos_token_ids=(151645,), bos_token_id=151643),
    # Qwen3-30B-A3B: 48 layers, 128 experts of 768, 8 routed per token
    "qwen3-30b-a3b": ModelArch(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48,
                               num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
                               rms_norm_eps=1e-6, max_position_embeddings=40960, rope_theta=1_000_000.0,
                               qk_norm=True, eos_token_ids=(151645,), bos_token_id=151643,
                               moe=MoeArch(num_experts=128, top_k=8, expert_intermediate_size=768, renormalize=True,
                                           sparse_layers=tuple(range(48)))),
    # Mixtral-8x7B: 8 experts of 14336, 2 routed per token
    "mixtral-8x7b": ModelArch(model_type="mixtral", vocab_size=32000, hidden_size=4096, num_layers=32,
                              num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                              rms_norm_eps=1e-5, max_position_embeddings=32768, rope_theta=1_000_000.0,
                              eos_token_ids=(2,), bos_token_id=1,
                              moe=MoeArch(num_experts=8, top_k=2, expert_intermediate_size=14336, renormalize=True,
                                          sparse_layers=tuple(range(32)))),
    # DeepSeek-V2-Lite (15.7B, 2.4B active): MLA without q_lora, 64 routed experts (6 per token) + 2 shared,
    # layer 0 dense; YaRN x40 over 4k with mscale 0.707
    "deepseek-v2-lite": ModelArch(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, num_layers=27, num_heads=16, num_kv_heads=16,
        head_dim=64, intermediate_size=10944, rms_norm_eps=1e-6, max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling=_DEEPSEEK_YARN | {"mscale": 0.707, "mscale_all_dim": 0.707}, eos_token_ids=(100001,),
        bos_token_id=100000,
        mla=MlaArch(kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoeArch(num_experts=64, top_k=6, expert_intermediate_size=1408, renormalize=False,
                    sparse_layers=tuple(range(1, 27)), shared_expert_intermediate_size=2 * 1408,
                    shared_expert_gated=False)),
    # DeepSeek-V3's layer dimensions (128 heads, q_lora 1536, 256 routed experts of 2048, 8 per token over 4 of 8
    # groups, sigmoid scores with a correction bias) with 1 dense + 4 sparse layers instead of 3 + 58: per-layer
    # figures scale to the 671B model; fits one H200 with FP8 weights (--quantization fp8_block)
    "deepseek-v3-slice": ModelArch(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, num_layers=5, num_heads=128, num_kv_heads=128,
        head_dim=64, intermediate_size=18432, rms_norm_eps=1e-6, max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling=_DEEPSEEK_YARN | {"mscale": 1.0, "mscale_all_dim": 1.0}, eos_token_ids=(1,), bos_token_id=0,
        mla=MlaArch(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoeArch(num_experts=256, top_k=8, expert_intermediate_size=2048, renormalize=True,
                    sparse_layers=(1, 2, 3, 4), shared_expert_intermediate_size=2048, shared_expert_gated=False,
                    scoring_func="sigmoid", topk_method="noaux_tc", num_groups=8, topk_groups=4,
                    routed_scaling_factor=2.5)),
    "tiny-deepseek-v3": ModelArch(
        model_type="deepseek_v3", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=16, intermediate_size=128, rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0,
        eos_token_ids=(2,), bos_token_id=1,
        mla=MlaArch(kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24),
        moe=MoeArch(num_experts=8, top_k=2, expert_intermediate_size=32, renormalize=True, sparse_layers=(1,),
                    shared_expert_intermediate_size=32, shared_expert_gated=False, scoring_func="sigmoid",
                    topk_method="noaux_tc", num_groups=4, topk_groups=2, routed_scaling_factor=2.5)),
    # GLM-4.5-Air (106B, 12B active; its config.json): GQA with q/k/v bias, rope over half of each 128-dim head
    # (theta 1e6), layer 0 dense, then 128 routed experts of 1408 (8 a token, sigmoid + correction bias) and one
    # shared expert. 214 GB in bf16; 100.7 GiB with --quantization fp8 (computed: an H200 should hold it)
    "glm-4.5-air": ModelArch(
        model_type="glm4_moe", vocab_size=151552, hidden_size=4096, num_layers=46, num_heads=96, num_kv_heads=8,
        head_dim=128, intermediate_size=10944, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_theta=1_000_000.0, attention_bias=True, eos_token_ids=(151329, 151336, 151338), rotary_dim=64,
        moe=MoeArch(num_experts=128, top_k=8, expert_intermediate_size=1408, renormalize=True,
                    sparse_layers=tuple(range(1, 46)), shared_expert_intermediate_size=1408, shared_expert_gated=False,
                    scoring_func="sigmoid", topk_method="noaux_tc", routed_scaling_factor=1.0)),
    # GLM-4.5's layer dimensions (hidden 5120, q/k RMSNorm, 160 routed experts of 1536, x2.5) with 1 dense + 4
    # sparse layers instead of 3 + 89: per-layer figures scale to the 355B model
    "glm-4.5-slice": ModelArch(
        model_type="glm4_moe", vocab_size=151552, hidden_size=5120, num_layers=5, num_heads=96, num_kv_heads=8,
        head_dim=128, intermediate_size=12288, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_theta=1_000_000.0, attention_bias=True, qk_norm=True, eos_token_ids=(151329, 151336, 151338),
        rotary_dim=64,
        moe=MoeArch(num_experts=160, top_k=8, expert_intermediate_size=1536, renormalize=True,
                    sparse_layers=(1, 2, 3, 4), shared_expert_intermediate_size=1536, shared_expert_gated=False,
                    scoring_func="sigmoid", topk_method="noaux_tc", routed_scaling_factor=2.5)),
    "tiny-glm4-moe": ModelArch(
        model_type="glm4_moe", vocab_size=512, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=2048, rope_theta=10000.0,
        attention_bias=True, qk_norm=True, eos_token_ids=(2,), bos_token_id=1, rotary_dim=8,
        moe=MoeArch(num_experts=8, top_k=2, expert_intermediate_size=32, renormalize=True, sparse_layers=(1, 2),
                    shared_expert_intermediate_size=32, shared_expert_gated=False, scoring_func="sigmoid",
                    topk_method="noaux_tc", num_groups=4, topk_groups=2, routed_scaling_factor=2.5)),
    "tiny-moe": ModelArch(model_type="qwen3_moe", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6,
                          max_position_embeddings=2048, rope_theta=10000.0, qk_norm=True, eos_token_ids=(2,),
                          bos_token_id=1, moe=MoeArch(num_experts=8, top_k=2, expert_intermediate_size=32,
                                                      renormalize=True, sparse_layers=(0, 1))),
}


def resolve_arch(model: str, load_format: str, tokenizer: str | None = None) -> ModelArch:
    """The architecture for a model folder, or for a dummy shape name (fitted to `tokenizer`'s vocabulary when one
    is given, so that dummy weights can serve real text)."""
    if load_format == "dummy" and model in SHAPES:
        return fit_vocab_to_tokenizer(SHAPES[model], tokenizer) if tokenizer else SHAPES[model]
    if load_format == "dummy" and not Path(model, "config.json").is_file():
        raise ModelNotFoundError(f"unknown dummy shape {model!r} (known: {', '.join(SHAPES)})")
    return load_arch(model)


def tokenizer_vocab_size(folder: str) -> int:
    """Token ids a tokenizer folder can produce and decode, added tokens included."""
    from tokenizers import Tokenizer as FastTokenizer  # the Rust library alone: no transformers import here

    path = Path(folder, "tokenizer.json")
    if not path.is_file():
        raise ConfigError(f"no tokenizer.json in {folder}", param="tokenizer")
    return FastTokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)


def fit_vocab_to_tokenizer(arch: ModelArch, tokenizer: str) -> ModelArch:
    """A dummy shape whose vocabulary is larger than the tokenizer's shrinks to it (sampled ids must decode);
    EOS ids outside the new vocabulary are dropped (the tokenizer's own EOS is added where EOS ids are merged)."""
    vocab_size = tokenizer_vocab_size(tokenizer)
    if vocab_size >= arch.vocab_size:
        return arch
    log.warning("dummy weights: vocabulary %d shrinks to the tokenizer's %d (%s)", arch.vocab_size, vocab_size,
                tokenizer)
    eos_ids = tuple(i for i in arch.eos_token_ids if i < vocab_size)
    bos_id = arch.bos_token_id if arch.bos_token_id is not None and arch.bos_token_id < vocab_size else None
    return replace(arch, vocab_size=vocab_size, eos_token_ids=eos_ids, bos_token_id=bos_id)


def resolve_max_model_len(arch: ModelArch, wanted: int | None) -> int:
    """The context to serve: --max-model-len (None: all the model supports), refused past the model's context limit
    and its sliding window (no sliding-window attention here: stay inside it). Checked by the launcher before any
    process starts and by the worker that sizes its cache."""
    limit = arch.context_limit
    if arch.sliding_window:
        limit = min(limit, arch.sliding_window)
    if wanted is None:
        return limit
    if wanted > limit:
        raise ConfigError(f"max_model_len {wanted} exceeds the model's context of {limit} tokens",
                          param="max_model_len")
    return wanted


def check_divisible(arch: ModelArch, tp_size: int) -> None:
    """Tensor parallelism splits heads and MLP columns evenly; say which number does not divide."""
    sizes = [("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads),
             ("intermediate_size", arch.intermediate_size)]
    if arch.moe is not None:
        sizes += [("moe_intermediate_size", arch.moe.expert_intermediate_size),
                  ("shared_expert_intermediate_size", arch.moe.shared_expert_intermediate_size)]
    for name, value in sizes:
        if value % tp_size:
            raise ConfigError(f"tensor_parallel_size {tp_size} does not divide {name} = {value}",
                              param="tensor_parallel_size")
    assert math.gcd(arch.num_heads, arch.num_kv_heads) == arch.num_kv_heads, "heads must be a multiple of kv heads"


def eos_token_ids(arch: ModelArch, tokenizer_eos_token_id: int | None = None) -> set[int]:
    """End-of-sequence ids: the model config's, generation_config's, and the tokenizer's own."""
    ids = set(arch.eos_token_ids)
    if tokenizer_eos_token_id is not None:
        ids.add(tokenizer_eos_token_id)
    return ids
