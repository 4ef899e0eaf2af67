"""DeepSeek-V2 / V3 against transformers on tiny random checkpoints that transformers itself builds and saves:
greedy tokens equal in fp32 (batched, chunked prefill, under preemption) for prompts past the rope's original
window; DeepSeek routing against transformers' routers and a per-token reference; configs, shapes and the FP8
block-quantized checkpoint layout of V3."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from pagoda.kernels import reference as ref
from pagoda.kernels.moe import (
    exact_low_precision,
    route_grouped_topk,
    route_grouped_topk_torch,
    route_grouped_topk_triton,
    router_logits,
    router_logits_triton,
)
from pagoda.shared.errors import ConfigError
from pagoda.shared.shapes import SHAPES, arch_from_hf_config, load_arch
from tests.parity import TEST_KV_BLOCKS, check_greedy_parity, random_prompts
from tests.test_model_kernels import _run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 256
ORIGINAL_WINDOW = 32  # the YaRN rope's original context: prompts go past it


def _save(model, folder: Path, bias: bool = False) -> Path:  # noqa: ANN001
    """transformers initialises norms to 1, the router near 0, V3's correction bias to 0 and the projections so
    small that attention is nearly uniform: make them all matter (q . k of a few units: the rope, the softmax scale
    and which keys are visible change the tokens)."""
    torch.manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
            if name.endswith("gate.weight"):
                param.normal_(0.0, 0.5)
            if "self_attn" in name and "o_proj" not in name and name.endswith("weight") and param.dim() == 2:
                param.normal_(0.0, 1.5 / param.shape[1] ** 0.5)
        if bias:
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(0.3 * torch.randn_like(buffer))
    model.save_pretrained(folder)
    return folder


def _v2(folder: Path) -> Path:
    """No q_lora; YaRN x4 with mscale 0.707 (softmax scale x mscale^2); softmax scores, group-limited greedy."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3,
        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5, max_position_embeddings=4 * ORIGINAL_WINDOW, eos_token_id=2, bos_token_id=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                         "beta_slow": 1, "original_max_position_embeddings": ORIGINAL_WINDOW, "mscale": 0.707,
                         "mscale_all_dim": 0.707})
    return _save(DeepseekV2ForCausalLM(config).float(), folder)


def _v3(folder: Path) -> Path:
    """q_lora; interleaved rope; YaRN x4 with mscale 1.0 / mscale_all_dim 0.8 (an attention factor != 1 on the rope
    table and a softmax scale); sigmoid scores + a non-zero correction bias over 4 groups, top 2 groups;
    renormalised, x2.5."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(1)
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_interleave=True, max_position_embeddings=4 * ORIGINAL_WINDOW, eos_token_id=2, bos_token_id=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32,
                         "beta_slow": 1, "original_max_position_embeddings": ORIGINAL_WINDOW, "mscale": 1.0,
                         "mscale_all_dim": 0.8})
    return _save(DeepseekV3ForCausalLM(config).float(), folder, bias=True)


def _expand_from_16_queries(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Chunks of >= 16 queries take the expanded MLA path; the returned list collects each step's expanded chunks.
    The layer passes its own min_query_len (expand_min_query_len(heads): 512 for these models), which a partial's
    keyword would not override: patch that function."""
    from pagoda.kernels.mla import ExpandPolicy
    from pagoda.services.worker.models import deepseek

    monkeypatch.setattr(deepseek, "expand_min_query_len", lambda heads: 16)
    expanded_steps: list[list[int]] = []
    chunks = ExpandPolicy.expanded_chunks

    def counted(policy: ExpandPolicy, query_lens: list[int], seq_lens: list[int]) -> list[int]:
        expanded = chunks(policy, query_lens, seq_lens)
        if expanded:
            expanded_steps.append(expanded)
        return expanded

    monkeypatch.setattr(ExpandPolicy, "expanded_chunks", counted)
    return expanded_steps


@pytest.mark.parametrize("join", [16, 3])
def test_deepseek_v2_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, join: int) -> None:
    """Chunks of >= 16 queries take the expanded path here (prefills beside decode rows and short chunks in one
    step, chunks after cached context), and with join 3 every chunk of >= 3 queries joins them (the absorbed rows
    of such steps a sub-batch of their own); the V3 test keeps the default threshold: every chunk absorbed."""
    from pagoda.kernels.mla import ExpandPolicy
    from pagoda.services.worker.models import deepseek

    expanded_steps = _expand_from_16_queries(monkeypatch)
    monkeypatch.setattr(deepseek, "ExpandPolicy", functools.partial(ExpandPolicy, join_min_query_len=join))
    folder = _v2(tmp_path)
    arch = load_arch(folder)
    assert arch.mla is not None and arch.mla.q_lora_rank is None and arch.moe is not None
    assert arch.moe.sparse_layers == (1, 2) and arch.moe.topk_method == "group_limited_greedy"
    assert arch.context_limit == 4 * ORIGINAL_WINDOW
    check_greedy_parity(folder, random_prompts([7, 45, 100], VOCAB), preempt_blocks=10)
    assert expanded_steps, "no chunk took the expanded path"


def test_deepseek_v3_matches_transformers(tmp_path: Path) -> None:
    folder = _v3(tmp_path)
    keys = load_file(str(folder / "model.safetensors")).keys()
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys
    arch = load_arch(folder)
    assert arch.mla is not None and arch.mla.q_lora_rank == 48 and arch.mla.rope_interleave
    assert arch.moe is not None and arch.moe.scoring_func == "sigmoid" and arch.moe.topk_method == "noaux_tc"
    check_greedy_parity(folder, random_prompts([9, 50, 90], VOCAB, seed=6), preempt_blocks=10)


def test_expanded_chunks_join_a_started_launch() -> None:
    """No chunk expands on its own: none do. Once one does, every chunk of >= join queries within max_seq_len
    joins it; decode rows (one query) never do."""
    from pagoda.kernels.mla import ExpandPolicy

    policy = ExpandPolicy(min_query_len=16, max_seq_len=100, join_min_query_len=4)
    assert policy.expanded_chunks([1, 8, 15], [50, 8, 40]) == []
    assert policy.expanded_chunks([1, 20, 3, 4, 8, 1], [60, 20, 30, 101, 80, 9]) == [1, 4]
    assert policy.expanded_chunks([16, 2], [120, 2]) == []  # over max_seq_len: absorbed
    assert ExpandPolicy(min_query_len=16, join_min_query_len=64).expanded_chunks([16, 10], [16, 10]) == [0]


def test_absorbed_rows_beside_expanded_chunks_run_as_their_own_batch() -> None:
    """A step whose absorbed chunks (decode rows, short chunks) sit between expanded ones: their rows run as a
    sub-batch (gathered when they are not one run) and the layer's output equals the all-absorbed one."""
    from pagoda.bench.decode_profile import make_batch
    from pagoda.kernels.mla import ExpandPolicy
    from pagoda.services.worker.models import CausalLM, deepseek
    from pagoda.services.worker.weights import load_model

    arch = SHAPES["tiny-deepseek-v3"]
    rows = [(1, 30), (20, 20), (3, 11), (6, 30), (1, 9), (24, 40)]  # (query length, sequence length)
    meta, positions, num_blocks = make_batch([q for q, _ in rows], [s for _, s in rows], torch.device("cpu"))
    sub, span, index = deepseek._sub_batch(meta, [0, 2, 4], torch.device("cpu"))
    assert span is None and index.tolist() == [0, 21, 22, 23, 30]
    assert sub.query_lens_host == [1, 3, 1] and sub.seq_lens_host == [30, 11, 9] and sub.max_seq_len == 30
    assert sub.query_start_loc.tolist() == [0, 1, 4, 5] and sub.seq_lens.tolist() == [30, 11, 9]
    assert torch.equal(sub.block_tables, meta.block_tables[[0, 2, 4]])
    assert deepseek._sub_batch(meta, [1, 2], torch.device("cpu"))[1] == (1, 24)  # one run: a slice
    first = deepseek._step_sub_batch(meta, [0, 2, 4], torch.device("cpu"))
    assert deepseek._step_sub_batch(meta, [0, 2, 4], torch.device("cpu")) is first  # every layer of the step
    assert deepseek._step_sub_batch(meta, [0, 4], torch.device("cpu")) is not first
    other = replace(meta)  # the next step's metadata: built again
    assert deepseek._step_sub_batch(other, [0, 4], torch.device("cpu"))[0].query_lens_host == [1, 1]
    ids = torch.randint(3, 500, (positions.numel(),), generator=torch.Generator().manual_seed(3))
    outputs = []
    for policy in (ExpandPolicy(min_query_len=10**6), ExpandPolicy(min_query_len=16, join_min_query_len=4)):
        model = CausalLM(arch, torch.float32, torch.device("cpu"), max_positions=64)
        load_model(model, None, "dummy", seed=0)
        for layer in model.layers:
            layer.attn.expand = policy
        caches = [(torch.zeros(num_blocks, 16, 1, arch.mla.entry_dim),) for _ in range(arch.num_layers)]
        with torch.inference_mode():
            outputs.append(model(ids, positions, caches, meta))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ routing


ROUTINGS = {
    "v2-greedy": dict(scoring_func="softmax", topk_method="greedy", num_groups=1, topk_groups=1, renormalize=False,
                      routed_scaling_factor=1.0, bias=False),
    "v2-group-limited": dict(scoring_func="softmax", topk_method="group_limited_greedy", num_groups=8, topk_groups=3,
                             renormalize=False, routed_scaling_factor=16.0, bias=False),
    "v3-noaux-tc": dict(scoring_func="sigmoid", topk_method="noaux_tc", num_groups=8, topk_groups=4,
                        renormalize=True, routed_scaling_factor=2.5, bias=True),
    "v3-no-renormalize": dict(scoring_func="sigmoid", topk_method="noaux_tc", num_groups=4, topk_groups=1,
                              renormalize=False, routed_scaling_factor=1.0, bias=True),
}


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_grouped_routing_matches_reference(name: str, impl: str) -> None:
    """The batched PyTorch router and the Triton kernel (interpreter on CPU) against the per-token reference."""
    case = dict(ROUTINGS[name])
    generator = torch.Generator().manual_seed(len(name))
    num_experts, top_k = (256, 8) if name == "v3-noaux-tc" else (64, 6)  # DeepSeek-V3's 256 experts, 8 routed
    logits = torch.randn(40, num_experts, generator=generator) * 2  # [T, E]
    bias = torch.randn(num_experts, generator=generator) * 0.2 if case.pop("bias") else None
    route = route_grouped_topk_torch if impl == "torch" else route_grouped_topk_triton
    weights, ids = route(logits.to(DEVICE), top_k, correction_bias=None if bias is None else bias.to(DEVICE), **case)
    weights, ids = weights.cpu(), ids.cpu()
    ref_weights, ref_ids = ref.route_grouped_topk(logits, top_k, correction_bias=bias, **case)
    order = ids.long().sort(dim=1).indices
    ref_order = ref_ids.long().sort(dim=1).indices
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order))
    if case["topk_method"] != "greedy":  # every chosen expert lies in one of the topk_groups allowed groups
        groups = ids.long() // (num_experts // case["num_groups"])
        assert all(len(set(row)) <= case["topk_groups"] for row in groups.tolist())
    if bias is not None:  # the bias changes the choice, never the weights: they are the plain sigmoid scores
        scores = logits.sigmoid().gather(1, ids.long())
        expected = scores / scores.sum(1, keepdim=True) if case["renormalize"] else scores
        torch.testing.assert_close(weights, expected * case["routed_scaling_factor"])


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("num_shared", [1, 2])
def test_routing_appends_the_shared_experts(impl: str, num_shared: int) -> None:
    """num_shared > 0: the routed picks and weights as without (the scaling factor on them only), then the shared
    experts E, E + 1, .. with weight 1 in every row."""
    case = dict(ROUTINGS["v3-noaux-tc"])
    del case["bias"]
    generator = torch.Generator().manual_seed(num_shared)
    logits = (torch.randn(6, 64, generator=generator) * 2).to(DEVICE)  # [T, E]
    bias = (torch.randn(64, generator=generator) * 0.2).to(DEVICE)
    route = route_grouped_topk_torch if impl == "torch" else route_grouped_topk_triton
    routed_weights, routed_ids = route(logits, 6, correction_bias=bias, **case)
    weights, ids = route(logits, 6, correction_bias=bias, num_shared=num_shared, **case)
    assert ids.shape == weights.shape == (6, 6 + num_shared) and ids.dtype == torch.int32
    assert torch.equal(ids[:, :6], routed_ids) and torch.equal(weights[:, :6], routed_weights)
    assert ids[:, 6:].tolist() == [list(range(64, 64 + num_shared))] * 6
    assert weights[:, 6:].tolist() == [[1.0] * num_shared] * 6


@pytest.mark.parametrize(("num_experts", "hidden", "num_tokens"),
                         [(64, 2048, 3), (512, 96, 3), (60, 200, 19)])  # V2-Lite's; 2 experts a program; partial
# expert and hidden blocks
def test_router_kernel_gives_the_fp32_logits(num_experts: int, hidden: int, num_tokens: int) -> None:
    """The Triton router GEMV (bf16 activations, fp32 router) against F.linear(h.float(), router): the same fp32
    logits up to summation order, the same routing; equal router rows give bit-equal logits, so ties still go to
    the lower expert id."""
    generator = torch.Generator().manual_seed(num_experts)
    h = torch.randn(num_tokens, hidden, generator=generator).to(torch.bfloat16)  # [T, H]
    router = torch.randn(num_experts, hidden, generator=generator) * 0.05  # [E, H] fp32
    router[5] = router[2] = h[0].float() * 0.05  # two equal rows, token 0's best experts
    h, router = h.to(DEVICE), router.to(DEVICE)
    logits = router_logits_triton(h, router)  # [T, E]
    expected = torch.nn.functional.linear(h.float(), router)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[:, 5], logits[:, 2])
    case = dict(ROUTINGS["v2-greedy"])
    del case["bias"]
    weights, ids = route_grouped_topk_torch(logits, 6, correction_bias=None, **case)
    ref_weights, ref_ids = route_grouped_topk_torch(expected, 6, correction_bias=None, **case)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights)
    _, first = route_grouped_topk_triton(logits, 1, correction_bias=None, **case)  # the kernel CUDA routes with
    assert first[0].tolist() == [2]  # the tie: the lower id


def test_router_kept_in_the_model_dtype_only_when_exact() -> None:
    """A router whose fp32 values are all bf16 values (DeepSeek's checkpoints, dummy weights) gets its bf16 copy; one
    value off by an ulp of fp32, an fp32 model, or a router already in bf16 keep routing on the fp32 values alone."""
    router = (torch.randn(8, 32) * 0.05).to(torch.bfloat16).float()  # [E, H] bf16 values held in fp32
    low = exact_low_precision(router, torch.bfloat16)
    assert low is not None and low.dtype == torch.bfloat16 and torch.equal(low.float(), router)
    assert exact_low_precision(router, torch.float32) is None
    assert exact_low_precision(router.to(torch.bfloat16), torch.bfloat16) is None
    router[3, 7] = torch.nextafter(router[3, 7], torch.tensor(1.0))  # no longer a bf16 value
    assert exact_low_precision(router, torch.bfloat16) is None
    assert exact_low_precision(router, torch.float16) is None


def test_dummy_weights_give_the_router_its_low_copy_on_cuda_only() -> None:
    """weights.fill calls the model's weights_loaded hook: dummy weights (drawn in the model dtype) make the router
    exact in bf16, so on CUDA the sparse layers hold the copy; on the CPU there is no tensor-core path to use it."""
    from pagoda.services.worker.models import CausalLM
    from pagoda.services.worker.weights import load_model

    model = CausalLM(SHAPES["tiny-deepseek-v3"], torch.bfloat16, torch.device(DEVICE), max_positions=64)
    load_model(model, None, "dummy", seed=3)
    sparse = [layer.mlp for layer in model.layers if getattr(layer, "mlp", None) is not None
              and hasattr(layer.mlp, "router_low")]
    assert sparse, "the shape has a sparse layer"
    for mlp in sparse:
        if DEVICE == "cuda":
            assert mlp.router_low is not None and torch.equal(mlp.router_low.float(), mlp.router)
        else:
            assert mlp.router_low is None


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [17, 256, 4096])  # the first batch past the GEMV, a decode batch, prefill
def test_router_tensor_core_gemm_gives_the_fp32_logits(num_tokens: int) -> None:
    """Above the GEMV's batches, a bf16 router (exact) on the tensor cores with fp32 output: the fp32 logits up to
    summation order, and the same routing."""
    generator = torch.Generator().manual_seed(num_tokens)
    h = torch.randn(num_tokens, 2048, generator=generator).to(torch.bfloat16).cuda()  # [T, H]
    router = (torch.randn(64, 2048, generator=generator) * 0.05).to(torch.bfloat16).float().cuda()  # [E, H]
    low = exact_low_precision(router, torch.bfloat16)
    assert low is not None
    logits = router_logits(h, router, low)  # [T, E]
    expected = torch.nn.functional.linear(h.double(), router.double()).float()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)  # logits ~2: fp32 sums of 2048 products
    case = dict(ROUTINGS["v2-greedy"])
    del case["bias"]
    _, ids = route_grouped_topk_torch(logits, 6, correction_bias=None, **case)
    _, ref_ids = route_grouped_topk_torch(expected, 6, correction_bias=None, **case)
    assert (ids.sort(1).values != ref_ids.sort(1).values).any(1).float().mean() < 0.01  # near-ties may swap


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_routing_matches_transformers_routers(version: str) -> None:
    """The same logits through transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter and route_grouped_topk."""
    if version == "v2":
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter as Router

        config = DeepseekV2Config(hidden_size=32, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4,
                                  topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                  routed_scaling_factor=3.0)
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router

        config = DeepseekV3Config(hidden_size=32, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4,
                                  n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(3)
    router = Router(config)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
        if version == "v3":
            router.e_score_correction_bias.normal_(0.0, 0.3)
    hidden = torch.randn(50, 32)
    _, hf_weights, hf_ids = router(hidden)
    arch = arch_from_hf_config({**config.to_dict(), "vocab_size": 64, "num_hidden_layers": 2})
    moe = arch.moe
    assert moe is not None
    weights, ids = route_grouped_topk(torch.nn.functional.linear(hidden, router.weight), moe.top_k, moe.scoring_func,
                                      moe.topk_method, moe.num_groups, moe.topk_groups,
                                      router.e_score_correction_bias if version == "v3" else None, moe.renormalize,
                                      moe.routed_scaling_factor)
    order, hf_order = ids.long().sort(1).indices, hf_ids.sort(1).indices
    assert torch.equal(ids.long().gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))


# ------------------------------------------------------------------ configs, shapes, checkpoints


def test_shapes_round_trip_through_transformers_configs() -> None:
    """The dummy shapes' config.json builds the same transformers model (parameter count) and reads back equal."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for name in ("deepseek-v2-lite", "deepseek-v3-slice", "tiny-deepseek-v3"):
        arch = SHAPES[name]
        assert arch_from_hf_config(arch.to_hf_config()) == arch
    tiny = SHAPES["tiny-deepseek-v3"]
    config = AutoConfig.for_model(**tiny.to_hf_config())
    model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == tiny.num_params()
    lite = SHAPES["deepseek-v2-lite"]
    assert 15.6e9 < lite.num_params() < 15.8e9  # DeepSeek-V2-Lite: 15.7B
    assert 2.3e9 < lite.layer_weight_params(1) + lite.vocab_size * lite.hidden_size < 2.6e9  # ~2.4B active
    assert lite.kv_bytes_per_token(2) == 27 * 576 * 2  # one 576-wide latent per layer
    v3 = SHAPES["deepseek-v3-slice"]  # its layers, 61 of them (3 dense), are DeepSeek-V3: 671B, 37B active
    assert v3.moe is not None
    full = replace(v3, num_layers=61, moe=replace(v3.moe, sparse_layers=tuple(range(3, 61))))
    assert 670e9 < full.num_params() < 672e9
    assert 36e9 < full.layer_weight_params(1) + full.vocab_size * full.hidden_size < 38e9


def test_deepseek_config_errors() -> None:
    base = SHAPES["tiny-deepseek-v3"].to_hf_config()
    with pytest.raises(ConfigError, match="attention_bias"):
        arch_from_hf_config({**base, "attention_bias": True})
    with pytest.raises(ConfigError, match="n_group"):
        arch_from_hf_config({**base, "n_group": 3})
    v2 = {**base, "model_type": "deepseek_v2"}
    with pytest.raises(ConfigError, match="topk_method"):
        arch_from_hf_config({**v2, "topk_method": "seq_aux"})
    # rope over part of qk_rope_head_dim would change the math: refused, at the top level and in the rope dict
    for config in ({**base, "partial_rotary_factor": 0.5},
                   {**base, "rope_scaling": {**(base.get("rope_scaling") or {"rope_type": "default"}),
                                             "partial_rotary_factor": 0.5}}):
        with pytest.raises(ConfigError, match="partial_rotary_factor"):
            arch_from_hf_config(config)


def test_v3_fp8_block_checkpoint_loads_as_it_ships(tmp_path: Path) -> None:
    """DeepSeek-V3's FP8 layout: every projection e4m3 with 128x128 weight_scale_inv blocks (kv_b_proj included, kept
    dequantized in the model dtype for the absorbed matmuls), router and norms unquantized; the model generates
    what the dequantized fp32 checkpoint generates within FP8 activation noise."""
    from pagoda.services.worker.model_runner import ModelRunner
    from pagoda.shared.config import EngineConfig

    source = _v3(tmp_path / "fp32")
    tensors = load_file(str(source / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith("_proj.weight") or name.endswith("_mqa.weight"):
            q, scale = ref.quantize_fp8_blocks(tensor, (128, 128))
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
            dequantized[name] = ref.dequantize_fp8(q, scale.repeat_interleave(128, 0)[:q.shape[0]], 128)
        else:
            fp8[name] = dequantized[name] = tensor
    config = json.loads((source / "config.json").read_text())
    for folder, weights, quant in ((tmp_path / "fp8", fp8, True), (tmp_path / "deq", dequantized, False)):
        folder.mkdir()
        if quant:
            config = {**config, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                        "fmt": "e4m3", "weight_block_size": [128, 128]}}
        (folder / "config.json").write_text(json.dumps(config))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    runner = ModelRunner(EngineConfig(model=str(tmp_path / "fp8"), device="cpu", num_kv_blocks=16))
    layer = runner.model.layers[1]
    attn = layer.attn
    assert attn.a_weight.dtype == torch.float8_e4m3fn and attn.a_weight_scale.shape == (48 + 48, 1)
    assert torch.equal(attn.a_weight[48:].view(torch.uint8),
                       fp8["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].view(torch.uint8))
    assert attn.kv_b.dtype == torch.float32
    torch.testing.assert_close(attn.kv_b, dequantized["model.layers.1.self_attn.kv_b_proj.weight"])
    assert layer.mlp.w_down.dtype == torch.float8_e4m3fn and layer.mlp.router.dtype == torch.float32
    # teacher-forced: every prompt token's logprob under both models (greedy paths of a tiny random model part at
    # the first near tie, so tokens would compare FP8 noise, not the loading)
    prompt = random_prompts([60], VOCAB, seed=4)[0]
    ours, theirs = (_prompt_logprobs(tmp_path / name, prompt)[0] for name in ("fp8", "deq"))
    diff = (ours - theirs).abs()
    assert diff.mean() < 0.08 and diff.max() < 0.5, (diff.mean(), diff.max())  # a wrong weight: O(1)


@pytest.mark.parametrize("calibrate", [False, True])
def test_fp8_latent_cache_close_to_fp32(tmp_path: Path, calibrate: bool) -> None:
    """--kv-cache-dtype fp8: e4m3 latent entries (one per-tensor scale a layer: 1, or calibrated from the first
    prefill), prompt scored in two chunks so the second attends to fp8 entries of the first; teacher-forced logprobs
    within FP8 noise of the fp32 cache."""
    folder = _v3(tmp_path)
    prompt = random_prompts([60], VOCAB, seed=7)[0]
    base, _ = _prompt_logprobs(folder, prompt)
    ours, llm = _prompt_logprobs(folder, prompt, kv_cache_dtype="fp8", kv_scale_calibration=calibrate,
                                 max_num_batched_tokens=32)
    scales = [layer.k_scale.item() for layer in llm.engine.runner.model.layers]
    assert all(scale != 1.0 for scale in scales) if calibrate else scales == [1.0] * len(scales)
    diff = (ours - base).abs()
    assert diff.mean() < 0.08 and diff.max() < 0.5, (diff.mean(), diff.max())


def _prompt_logprobs(folder: Path, prompt: list[int], **engine_args) -> tuple[torch.Tensor, LLM]:  # noqa: ANN003
    """[len(prompt) - 1] logprobs of prompt tokens 1.. under the model, and the engine (a fixed cache: the callers
    keep two engines alive at once)."""
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=TEST_KV_BLOCKS, **engine_args)
    output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    assert output.prompt_logprobs is not None
    logprobs = [entry[token] for entry, token in zip(output.prompt_logprobs[1:], prompt[1:], strict=True)
                if entry is not None]
    return torch.tensor(logprobs), llm


def test_triton_model_matches_reference_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """tiny-deepseek-v3 (dummy weights) with the Triton kernels (interpreter on CPU) against the reference ops:
    the same logits through chunked prefill, prefix hits and decode, with chunks of >= 16 queries expanded."""
    expanded_steps = _expand_from_16_queries(monkeypatch)
    generator = torch.Generator().manual_seed(12)
    shared = torch.randint(3, 500, (32,), generator=generator).tolist()
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (3, 20, 41)]
    prompts += [shared + [7, 8, 9], shared + [10, 11]]  # the second reuses the first's cached blocks
    ref_tokens, ref_logits = _run("reference", "tiny-deepseek-v3", prompts, budget=24)
    tri_tokens, tri_logits = _run("triton", "tiny-deepseek-v3", prompts, budget=24)
    assert expanded_steps, "no chunk took the expanded path"
    assert tri_tokens == ref_tokens
    assert len(tri_logits) == len(ref_logits)
    # fp32 dots: exact under the interpreter; on a GPU Triton's tl.dot takes fp32 operands as TF32 (10-bit mantissa)
    atol = 2e-3 if DEVICE == "cuda" else 2e-4
    for ours, expected in zip(tri_logits, ref_logits, strict=True):
        torch.testing.assert_close(ours, expected, atol=atol, rtol=1e-4)


@pytest.mark.extended
def test_two_ranks_generate_what_one_does(tmp_path: Path) -> None:
    """Tensor parallel 2 (heads, kv_b and o split, q_a / kv_a and the latent cache replicated, experts split along
    their intermediate dim) generates what one rank does; the scheduler and both ranks run as processes."""
    from tests.test_tensor_parallel import _generate_in_process, _generate_with_services

    folder = _v3(tmp_path)
    single = _generate_in_process(folder)
    assert _generate_with_services(folder, 2) == single


class _Rank:
    """One rank of a tensor-parallel group, without the group: all_reduce is left to the test."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_shared_experts_fused_as_experts_match_the_shared_mlp() -> None:
    """Two shared experts (V2: shared_experts.* [2 I, H]) load as fused experts E, E + 1 from the checkpoint's own
    keys; the layer equals routed experts + the whole shared MLP computed from those keys, and two ranks' partial
    outputs (each holding half of every expert's I, shared ones included) sum to it."""
    from pagoda.services.worker.models import reference_ops
    from pagoda.services.worker.models.deepseek import DeepseekMoe
    from pagoda.services.worker.weights import DummySource

    tiny = SHAPES["tiny-deepseek-v3"]
    assert tiny.moe is not None
    inter = tiny.moe.expert_intermediate_size
    arch = replace(tiny, moe=replace(tiny.moe, shared_expert_intermediate_size=2 * inter))
    source = DummySource(seed=3, device=torch.device("cpu"), dtype=torch.float32)
    prefix = "model.layers.1.mlp."

    def build(rank: int, size: int) -> DeepseekMoe:
        layer = DeepseekMoe(arch, _Rank(rank, size), torch.float32, torch.device("cpu"), None)
        with torch.no_grad():
            for place in layer.placements(prefix, rank):
                place.target.copy_(source(place.hf_name, place.full_shape, place.shard_dim, place.shard_start,
                                          place.shard_len))
        return layer

    whole = build(0, 1)
    assert whole.num_shared == 2 and whole.shared is None and whole.w_gate_up.shape[0] == 8 + 2
    ops = reference_ops()
    h = torch.randn(5, arch.hidden_size, generator=torch.Generator().manual_seed(0))  # [T, H]
    out = whole(h, ops)  # [T, H]
    gate, up, down = (source(prefix + f"shared_experts.{name}.weight", shape, None, 0, 0)
                      for name, shape in (("gate_proj", (2 * inter, 64)), ("up_proj", (2 * inter, 64)),
                                          ("down_proj", (64, 2 * inter))))
    shared = torch.nn.functional.linear(torch.nn.functional.silu(h @ gate.T) * (h @ up.T), down)  # [T, H]
    weights, ids = route_grouped_topk(torch.nn.functional.linear(h, whole.router), 2, "sigmoid", "noaux_tc", 4, 2,
                                      whole.correction_bias, True, 2.5)
    routed = ref.moe_experts(h, whole.w_gate_up[:8], whole.w_down[:8], weights, ids)
    torch.testing.assert_close(out, routed + shared, atol=1e-5, rtol=1e-5)
    halves = [build(rank, 2) for rank in (0, 1)]
    assert halves[0].w_gate_up.shape == (10, inter, 64)  # [E + S, 2 (I / 2), H]
    torch.testing.assert_close(halves[0](h, ops) + halves[1](h, ops), out, atol=1e-5, rtol=1e-5)


def test_shared_experts_stay_apart_where_a_split_cuts_fp8_scale_blocks() -> None:
    from pagoda.services.worker.models.base import Fp8Weights
    from pagoda.services.worker.models.deepseek import fused_shared_experts

    lite = SHAPES["deepseek-v2-lite"].moe  # I = 1408 = 11 x 128, two shared experts
    assert lite is not None
    assert fused_shared_experts(lite, 1408, None) == 2
    assert fused_shared_experts(lite, 1408, Fp8Weights(128)) == 2
    assert fused_shared_experts(lite, 704, Fp8Weights(128)) == 0  # tp 2: 704 columns, a block cut in two
    assert fused_shared_experts(lite, 704, Fp8Weights(None)) == 2  # per-row scales: any split
    v3 = SHAPES["deepseek-v3-slice"].moe
    assert v3 is not None and fused_shared_experts(v3, 2048 // 32, Fp8Weights(128)) == 1  # one: as unfused


def test_o_projection_partials_summed_by_the_post_attention_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weight-only FP8 with split-K tiles forced on every GEMV: on one device o_proj leaves its partials to the
    post-attention residual norm (as the dense families do), and the logits of every step equal those with the
    sum kernel (PAGODA_FUSE_SPLIT_K=0) exactly, through chunked prefill and decode."""
    from pagoda.bench.fp8_bench import greedy_steps
    from pagoda.kernels import fp8_weight_only as w8
    from pagoda.services.scheduler.scheduler import Scheduler
    from pagoda.services.worker.model_runner import ModelRunner
    from pagoda.services.worker.models import triton_ops
    from pagoda.shared.config import EngineConfig

    arch = SHAPES["tiny-deepseek-v3"]
    o_shape = (arch.hidden_size, arch.num_heads * arch.mla.v_head_dim)
    o_outputs: list[str] = []  # what o_proj's GEMV returned each time it ran
    deferred = w8.fp8_weight_only_deferred

    def recording(x: torch.Tensor, weight: torch.Tensor, *args: object, **kwargs: object) -> object:
        out = deferred(x, weight, *args, **kwargs)
        if tuple(weight.shape) == o_shape:
            o_outputs.append(type(out).__name__)
        return out

    monkeypatch.setattr(w8, "fp8_weight_only_deferred", recording)
    # 32-wide N tiles and up to 8 rows: o_proj's 64 outputs still span two programs, the 48 of q_a / kv_a a masked
    # one, chunks several row tiles; 16 x 4 tiles interpreted 4x the programs (47 s against 23 s, same host)
    monkeypatch.setattr(w8, "pick_tiles", lambda rows, n, k, group, device: w8.GemvTiles(
        block_m=min(8, 1 << (rows - 1).bit_length()), block_n=32, block_k=16, split_k=2))
    generator = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (3, 20)]  # 20: two chunks
    runs = {}
    for fuse in ("1", "0"):
        monkeypatch.setenv("PAGODA_FUSE_SPLIT_K", fuse)
        config = EngineConfig(model="tiny-deepseek-v3", load_format="dummy", device=DEVICE, dtype="float32",
                              quantization="fp8", num_kv_blocks=48, max_model_len=256, max_num_seqs=8,
                              enforce_eager=True, seed=5)
        runner = ModelRunner(config, ops=triton_ops())
        scheduler = Scheduler(num_blocks=48, block_size=16, max_num_seqs=8, max_num_batched_tokens=16,
                              max_model_len=256, vocab_size=arch.vocab_size)
        runs[fuse] = (greedy_steps(runner, scheduler, prompts, 3), set(o_outputs))
        o_outputs.clear()
    (fused_tokens, fused_logits), fused_kinds = runs["1"]
    (plain_tokens, plain_logits), plain_kinds = runs["0"]
    assert fused_kinds == {"DeferredSum"} and plain_kinds == {"Tensor"}
    assert fused_tokens == plain_tokens
    for request_id, rows in plain_logits.items():
        for ours, expected in zip(fused_logits[request_id], rows, strict=True):
            assert torch.equal(ours, expected)
