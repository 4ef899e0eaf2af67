"""FP8: quantization round trips, the FP8 kernels against their references, FP8 checkpoints in each supported
format loaded as they come, and the engine with FP8 weights and an FP8 KV cache against the fp32 engine.

Tolerance of the engine checks: every compared logits row has cosine similarity >= 0.99 to the fp32 engine's
(e4m3 keeps 3 mantissa bits: ~3% relative error per element, which averages out across a dot product)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagoda.bench.fp8_bench import greedy_steps
from pagoda.kernels import reference as ref
from pagoda.services.scheduler.scheduler import Request, Scheduler
from pagoda.services.worker.model_runner import ModelRunner
from pagoda.services.worker.models import CausalLM, Fp8Weights, Ops, reference_ops
from pagoda.services.worker.models.base import SingleDevice
from pagoda.services.worker.weights import SafetensorsSource, checkpoint_fp8, fill, placements
from pagoda.shared.config import EngineConfig
from pagoda.shared.errors import ConfigError
from pagoda.shared.messages import SamplingParams
from pagoda.shared.shapes import ModelArch, load_arch, resolve_arch

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
E4M3_REL = 2.0 ** -4  # half an ulp of a 3-bit mantissa
E4M3_SUBNORMAL_STEP = 2.0 ** -9


def _bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest rounding error of x quantized with scale: half an ulp, or half a subnormal step."""
    return x.abs() * E4M3_REL + scale * E4M3_SUBNORMAL_STEP / 2 + 1e-12


# ------------------------------------------------------------------ references


@pytest.mark.parametrize("group_size", [None, 16, 128])
def test_quantize_rows_round_trip(group_size: int | None) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(7, 200, generator=generator) * torch.logspace(-3, 2, 7)[:, None]  # rows of very different size
    x[3] = 0.0  # an all-zero row quantizes to zeros
    q, scale = ref.quantize_fp8_rows(x, group_size)
    groups = 1 if group_size is None else -(-200 // group_size)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (7, groups) and scale.dtype == torch.float32
    full_scale = scale.expand(7, 200) if group_size is None else ref.expand_group_scales(scale, 200, group_size)
    back = ref.dequantize_fp8(q, scale, group_size)
    assert (back - x).abs().le(_bound(x, full_scale)).all()
    assert q.float().abs().max() <= ref.FP8_MAX
    assert (back[3] == 0).all()
    # each row's (or group's) largest element maps to +-448 exactly: the scale uses the whole range
    assert torch.isclose(q[0].float().abs().max(), torch.tensor(ref.FP8_MAX))


def test_quantize_blocks_round_trip() -> None:
    generator = torch.Generator().manual_seed(1)
    w = torch.randn(300, 260, generator=generator)
    w[:128, :128] *= 50.0  # one block far larger: its scale must not leak into the others
    q, scale = ref.quantize_fp8_blocks(w, (128, 128))
    assert scale.shape == (3, 3)
    full = ref.expand_group_scales(scale.repeat_interleave(128, dim=0)[:300], 260, 128)  # [N, K]
    back = q.float() * full
    assert (back - w).abs().le(_bound(w, full)).all()
    assert scale[0, 0] > 20 * scale[0, 1]


def test_fp8_linear_reference_close_to_float() -> None:
    generator = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 256, generator=generator), torch.randn(96, 256, generator=generator) * 0.05
    bias = torch.randn(96, generator=generator)
    exact = x @ w.t() + bias
    for group_size in (None, 128):
        if group_size is None:
            w_q, w_s = ref.quantize_fp8_rows(w)
        else:
            w_q, w_blocks = ref.quantize_fp8_blocks(w, (128, 128))
            w_s = w_blocks.repeat_interleave(128, dim=0)[:96]  # [N, K / 128]: the model's layout
        out = ref.fp8_linear(x, w_q, w_s, group_size, bias)
        assert torch.nn.functional.cosine_similarity(out - bias, exact - bias, dim=1).min() > 0.998


# ------------------------------------------------------------------ Triton kernels (interpreter on CPU)


def _assert_same_quantization(q: torch.Tensor, scale: torch.Tensor, q_ref: torch.Tensor,
                              s_ref: torch.Tensor) -> None:
    """IEEE division and round-to-nearest-even as torch: the same scales and the same e4m3 bits."""
    assert torch.equal(scale.cpu(), s_ref.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.cpu().view(torch.uint8))


@pytest.mark.parametrize("group_size", [None, 32])
def test_quantize_kernel_matches_reference(group_size: int | None) -> None:
    from pagoda.kernels.fp8 import quantize_fp8_rows

    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 80, generator=generator) * torch.tensor([[0.01], [1.0], [30.0]])).to(DEVICE)
    q, scale = quantize_fp8_rows(x, group_size)
    q_ref, s_ref = ref.quantize_fp8_rows(x.cpu(), group_size)  # on the CPU: CUDA divides by a scalar's reciprocal
    _assert_same_quantization(q, scale, q_ref, s_ref)


@pytest.mark.parametrize("group_size", [None, 32])
def test_fp8_gemm_kernel_matches_reference(group_size: int | None) -> None:
    from pagoda.kernels.fp8 import fp8_gemm

    generator = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 80, generator=generator), torch.randn(40, 80, generator=generator)
    bias = torch.randn(40, generator=generator)
    x_q, x_s = ref.quantize_fp8_rows(x, group_size)
    w_q, w_s = ref.quantize_fp8_rows(w, group_size)
    expected = ref.dequantize_fp8(x_q, x_s, group_size) @ ref.dequantize_fp8(w_q, w_s, group_size).t() + bias
    to = lambda t: t.to(DEVICE)  # noqa: E731
    out = fp8_gemm(to(x_q), to(x_s), to(w_q), to(w_s), group_size, torch.float32, to(bias), block=(16, 32, 4, 1))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_fast_accumulation_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagoda.kernels import fp8

    monkeypatch.delenv("PAGODA_FP8_FAST_ACCUM", raising=False)
    assert fp8.fast_accum()
    monkeypatch.setenv("PAGODA_FP8_FAST_ACCUM", "0")
    assert not fp8.fast_accum()


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 14336])
def test_fast_accumulation_stays_close_to_the_exact_product(monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    """cuBLASLt without fp32 promotion (the default) against the fp32 product of the same e4m3 operands: H200,
    llama3-8b shapes, rel. error 2.1e-3 (K 4096) and 3.3e-3 (K 14336) against 1.7e-3 with promotion."""
    from pagoda.kernels import fp8

    generator = torch.Generator(device="cuda").manual_seed(14)
    x_q, x_s = fp8.quantize_fp8_rows(torch.randn(300, k, device="cuda", generator=generator))
    w_q, w_s = fp8.quantize_fp8_rows(torch.randn(512, k, device="cuda", generator=generator) * 0.02)
    exact = (x_q.float() * x_s) @ (w_q.float() * w_s).t()  # [300, 512]
    for setting in ("1", "0"):
        monkeypatch.setenv("PAGODA_FP8_FAST_ACCUM", setting)
        out = fp8.fp8_matmul(x_q, x_s, w_q, w_s, None, torch.bfloat16).float()
        assert ((out - exact).norm() / exact.norm()).item() < 5e-3
        assert torch.nn.functional.cosine_similarity(out, exact, dim=1).min().item() > 0.9999


@pytest.mark.gpu
@pytest.mark.parametrize("group_size", [None, 128])
@pytest.mark.parametrize("num_tokens", [1, 37, 300])
def test_fp8_linear_gpu_matches_reference(group_size: int | None, num_tokens: int) -> None:
    """cuBLASLt (per channel) and the Triton GEMM (per group) on llama-like shapes, bf16 activations."""
    from pagoda.kernels.fp8 import fp8_linear

    generator = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(num_tokens, 1024, device="cuda", generator=generator).bfloat16()
    w = (torch.randn(768, 1024, device="cuda", generator=generator) * 0.02).bfloat16()
    w_q, w_s = ref.quantize_fp8_rows(w, group_size)
    out = fp8_linear(x, w_q, w_s, group_size)
    expected = ref.fp8_linear(x.float(), w_q, w_s, group_size)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0.03, atol=0.03 * expected.abs().max().item())
    cosine = torch.nn.functional.cosine_similarity(out.float(), expected, dim=1)
    assert cosine.min() > 0.999


# ------------------------------------------------------------------ the fp8 KV cache kernels


def _paged_case(num_kv_heads: int = 2, head_dim: int = 32, block_size: int = 16, num_blocks: int = 12,
                seed: int = 6) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = 20
    return {"k": torch.randn(tokens, num_kv_heads, head_dim, generator=generator) * 3.0,
            "v": torch.randn(tokens, num_kv_heads, head_dim, generator=generator),
            "slots": torch.randperm(num_blocks * block_size, generator=generator)[:tokens],
            "cache_shape": torch.tensor([num_blocks, block_size, num_kv_heads, head_dim])}


def test_write_kv_fp8_kernel_matches_reference() -> None:
    from pagoda.kernels.kv_cache import write_kv

    case = _paged_case()
    shape = tuple(case["cache_shape"].tolist())
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.005])
    caches = [torch.zeros(shape, dtype=torch.float8_e4m3fn) for _ in range(4)]
    slots = case["slots"].clone()
    slots[3] = -1  # padding: not written
    ref.write_kv(case["k"], case["v"], caches[0], caches[1], slots, k_scale, v_scale)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    k_dev, v_dev = to(caches[2]), to(caches[3])
    write_kv(to(case["k"]), to(case["v"]), k_dev, v_dev, to(slots), to(k_scale), to(v_scale))
    for ours, expected in ((k_dev, caches[0]), (v_dev, caches[1])):
        assert torch.equal(ours.cpu().view(torch.uint8), expected.view(torch.uint8))
    # what comes back is the input within fp8 rounding, clamped at 448 * scale
    num_slots = shape[0] * shape[1]
    stored = caches[0].view(num_slots, *shape[2:])[case["slots"][:3]].float() * k_scale
    expected_k = case["k"][:3].clamp(-448 * 0.02, 448 * 0.02)
    assert (stored - expected_k).abs().le(_bound(expected_k, k_scale)).all()


def _attention_inputs(kv_dtype: torch.dtype, seed: int = 7) -> dict:
    generator = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 16
    query_lens, seq_lens = [1, 7, 1], [30, 7, 17]
    num_blocks = 12
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    k_scale, v_scale = torch.tensor([0.01]), torch.tensor([0.004])
    if kv_dtype == torch.float8_e4m3fn:
        k_cache, v_cache = ref.quantize_fp8(k_cache, k_scale), ref.quantize_fp8(v_cache, v_scale)
    block_tables = torch.randperm(num_blocks, generator=generator)[:9].view(3, 3).int()
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables, "seq_lens": seq_lens,
            "query_lens": query_lens, "k_scale": k_scale, "v_scale": v_scale}


@pytest.mark.parametrize("num_splits", [1, 2])
def test_paged_attention_fp8_kernel_matches_reference(num_splits: int) -> None:
    from pagoda.kernels.paged_attention import AttentionConfig, paged_attention

    case = _attention_inputs(torch.float8_e4m3fn)
    expected = ref.paged_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                                   case["seq_lens"], case["query_lens"], 0.2, k_scale=case["k_scale"],
                                   v_scale=case["v_scale"])
    # the fp8 reference is the float one over the dequantized cache
    dequant = ref.paged_attention(case["q"], case["k_cache"].float() * case["k_scale"],
                                  case["v_cache"].float() * case["v_scale"], case["block_tables"],
                                  case["seq_lens"], case["query_lens"], 0.2)
    torch.testing.assert_close(expected, dequant, rtol=1e-5, atol=1e-6)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    qsl = torch.tensor([0, 1, 8, 9], dtype=torch.int32)
    out = paged_attention(to(case["q"]), to(case["k_cache"]), to(case["v_cache"]), to(case["block_tables"]),
                          to(torch.tensor(case["seq_lens"], dtype=torch.int32)), to(qsl), 7, 30, 0.2,
                          config=AttentionConfig(num_splits=num_splits, decode_tile_n=16, prefill_block_m=16,
                                                 prefill_tile_n=16),
                          k_scale=to(case["k_scale"]), v_scale=to(case["v_scale"]))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-3, atol=1e-4)


# ------------------------------------------------------------------ checkpoints


TINY = dict(vocab_size=256, hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
            eos_token_id=1)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama (several and partial 128-blocks per weight: q 256 rows, k/v 128, MLP 320), fp32 safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))  # HF's init (std 0.02): larger weights make it chaotic
    folder = tmp_path_factory.mktemp("tiny-llama-fp8")
    model.save_pretrained(folder)
    return folder


def _is_linear(name: str) -> bool:
    return name.endswith("_proj.weight")


def _write_fp8_checkpoint(source_dir: Path, folder: Path, kind: str) -> dict[str, torch.Tensor]:
    """Quantize source_dir's linear weights into `kind` ("hf-block", "ct-channel", "ct-tensor"), with a
    quantization_config as such checkpoints ship; ct-tensor also carries fp8 KV scales. Returns the tensors."""
    folder.mkdir()
    source = SafetensorsSource(source_dir)
    config = json.loads((source_dir / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in source._file_of:
        tensor = source._read_whole(name)
        assert tensor is not None
        if not _is_linear(name):
            tensors[name] = tensor.bfloat16()
            continue
        stem = name.removesuffix("weight")
        if kind == "hf-block":
            tensors[name], tensors[stem + "weight_scale_inv"] = ref.quantize_fp8_blocks(tensor, (128, 128))
        elif kind == "ct-channel":
            tensors[name], tensors[stem + "weight_scale"] = ref.quantize_fp8_rows(tensor)  # [N, 1]
        else:
            scale = tensor.abs().max().float().reshape(1) / ref.FP8_MAX
            tensors[name], tensors[stem + "weight_scale"] = ref.quantize_fp8(tensor, scale), scale
            tensors[stem + "input_scale"] = torch.ones(1)  # a static activation scale: not used (dynamic wins)
    if kind == "hf-block":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": [128, 128]}
    else:
        strategy = "channel" if kind == "ct-channel" else "tensor"
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
    if kind == "ct-tensor":
        config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor"}
        for i in range(TINY["num_hidden_layers"]):
            tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 + i * 0.01)
            tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.02)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return tensors


@pytest.mark.parametrize("kind", ["hf-block", "ct-channel", "ct-tensor"])
def test_fp8_checkpoint_loads_as_it_ships(tiny_llama_dir: Path, tmp_path: Path, kind: str) -> None:
    tensors = _write_fp8_checkpoint(tiny_llama_dir, tmp_path / kind, kind)
    runner = ModelRunner(EngineConfig(model=str(tmp_path / kind), device="cpu", num_kv_blocks=16,
                                      kv_cache_dtype="fp8"))
    model = runner.model
    assert model.fp8 == Fp8Weights(group_size=128 if kind == "hf-block" else None)
    layer = model.layers[1]
    prefix = "model.layers.1."
    # weights bit for bit; scales in the model's layout
    assert torch.equal(layer.qkv_weight[256:384].view(torch.uint8),
                       tensors[prefix + "self_attn.k_proj.weight"].view(torch.uint8))
    assert torch.equal(layer.down_weight.view(torch.uint8), tensors[prefix + "mlp.down_proj.weight"].view(torch.uint8))
    if kind == "hf-block":
        blocks = tensors[prefix + "mlp.up_proj.weight_scale_inv"]  # [3, 2]: 320 rows, 256 columns
        assert layer.gate_up_weight_scale.shape == (640, 2)
        assert torch.equal(layer.gate_up_weight_scale[320 + 200], blocks[1])
        down_blocks = tensors[prefix + "mlp.down_proj.weight_scale_inv"]  # [2, 3]: 256 rows, 320 columns
        assert torch.equal(layer.down_weight_scale[:, 2], down_blocks[:, 2].repeat_interleave(128))
    elif kind == "ct-channel":
        assert torch.equal(layer.qkv_weight_scale[:256], tensors[prefix + "self_attn.q_proj.weight_scale"])
    else:
        assert torch.equal(layer.o_weight_scale, tensors[prefix + "self_attn.o_proj.weight_scale"].expand(256, 1))
        assert layer.k_scale.item() == pytest.approx(0.06) and layer.v_scale.item() == pytest.approx(0.02)
    assert model.lm_head.dtype == torch.float32 and model.embed.dtype == torch.float32
    assert runner.kv_cache.dtype == torch.float8_e4m3fn


def test_bf16_checkpoint_quantized_at_load(tiny_llama_dir: Path) -> None:
    runner = ModelRunner(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=16, quantization="fp8"))
    layer = runner.model.layers[0]
    original = SafetensorsSource(tiny_llama_dir)._read_whole("model.layers.0.mlp.up_proj.weight")
    assert original is not None
    up = ref.dequantize_fp8(layer.gate_up_weight[320:], layer.gate_up_weight_scale[320:])
    assert (up - original).abs().le(_bound(original, layer.gate_up_weight_scale[320:])).all()
    assert layer.gate_up_weight_scale.shape == (640, 1)


def test_bad_quantization_configs(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        EngineConfig(quantization="int4")
    with pytest.raises(ConfigError):
        EngineConfig(kv_cache_dtype="int8")
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    for bad in ({"quant_method": "awq"},
                {"quant_method": "compressed-tensors", "format": "pack-quantized",
                 "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}):
        (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": bad}))
        with pytest.raises(ConfigError):
            checkpoint_fp8(tmp_path)


class _HalfOfTwo(SingleDevice):
    """Rank 1 of 2 without collectives (SingleDevice's identities): enough to build and fill one rank's shard."""

    rank, size = 1, 2


def test_tensor_parallel_shard_of_a_block_checkpoint(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Rank 1 of 2 holds the row slices of qkv / gate_up (with their rows' scales) and column slices of o / down
    (with their column groups' scales). The MLP is widened to 512 so down's split falls on a 128 boundary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    wide = tmp_path / "wide"
    LlamaForCausalLM(LlamaConfig(**{**TINY, "intermediate_size": 512})).save_pretrained(wide)
    tensors = _write_fp8_checkpoint(wide, tmp_path / "block", "hf-block")
    arch = load_arch(tmp_path / "block")
    fp8 = Fp8Weights(group_size=128)
    model = CausalLM(arch, torch.float32, torch.device("cpu"), tp=_HalfOfTwo(), ops=reference_ops(), fp8=fp8)
    fill(model, SafetensorsSource(tmp_path / "block"))
    layer = model.layers[0]
    v = tensors["model.layers.0.self_attn.v_proj.weight"]  # [128, 256]: rank 1 holds rows 64..127
    assert torch.equal(layer.qkv_weight[128 + 64:].view(torch.uint8), v[64:].view(torch.uint8))
    down = tensors["model.layers.0.mlp.down_proj.weight"]  # [256, 512]: rank 1 holds columns 256..511
    assert torch.equal(layer.down_weight.view(torch.uint8), down[:, 256:].view(torch.uint8))
    down_blocks = tensors["model.layers.0.mlp.down_proj.weight_scale_inv"]  # [2, 4]
    assert torch.equal(layer.down_weight_scale, down_blocks[:, 2:].repeat_interleave(128, dim=0))
    assert all(p.scale_target is not None for p in placements(model) if _is_linear(p.hf_name))


# ------------------------------------------------------------------ the engine against fp32


def _greedy_logits(config: EngineConfig, prompts: list[list[int]], max_tokens: int = 4,
                   ops: Ops | None = None) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Greedy tokens and the logits row of each sampled step, per request (chunked prefill, prefix hits)."""
    runner = ModelRunner(config, ops=ops)
    scheduler = Scheduler(num_blocks=config.num_kv_blocks or 64, block_size=16, max_num_seqs=8,
                          max_num_batched_tokens=24, max_model_len=256, vocab_size=runner.arch.vocab_size)
    return greedy_steps(runner, scheduler, prompts, max_tokens)


def _compare(base: tuple[dict, dict], ours: tuple[dict, dict]) -> tuple[float, float]:
    """(lowest cosine similarity, top-1 agreement) over the steps whose context is the same in both runs."""
    cosines, agree = [], []
    for request_id, base_tokens in base[0].items():
        for step, (a, b) in enumerate(zip(base[1][request_id], ours[1][request_id], strict=True)):
            if base_tokens[:step] != ours[0][request_id][:step]:
                break  # greedy paths diverged: later contexts differ
            cosines.append(torch.nn.functional.cosine_similarity(a, b, dim=0).item())
            agree.append(float(a.argmax() == b.argmax()))
    return min(cosines), sum(agree) / len(agree)


@pytest.mark.parametrize("variant", [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"},
                                     {"quantization": "fp8", "kv_cache_dtype": "fp8"},
                                     {"quantization": "fp8_block", "kv_cache_dtype": "fp8"}])
def test_engine_fp8_close_to_fp32(tiny_llama_dir: Path, variant: dict) -> None:
    generator = torch.Generator().manual_seed(8)
    shared = torch.randint(2, 256, (32,), generator=generator).tolist()
    prompts = [torch.randint(2, 256, (n,), generator=generator).tolist() for n in (3, 20, 41)]
    prompts += [shared + [7, 8, 9], shared + [10, 11]]  # the second reuses the first's cached blocks
    common = dict(model=str(tiny_llama_dir), device=DEVICE, dtype="float32", num_kv_blocks=48, max_model_len=256,
                  max_num_seqs=8, enforce_eager=True)
    base = _greedy_logits(EngineConfig(**common), prompts)
    ours = _greedy_logits(EngineConfig(**common, **variant), prompts)
    cosine, agreement = _compare(base, ours)
    assert cosine >= 0.99, (variant, cosine, agreement)
    # random weights give flat logits whose top two often differ by less than the FP8 noise: a loose bound
    assert agreement >= 0.6, (variant, cosine, agreement)


def test_kv_scale_calibration_sets_scales_from_the_first_prefill(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), device="cpu", num_kv_blocks=48, max_model_len=256,
                          kv_cache_dtype="fp8", kv_scale_calibration=True)
    runner = ModelRunner(config)
    assert all(layer.calibrate_kv for layer in runner.model.layers)
    assert float(runner.model.layers[0].k_scale) == 1.0
    scheduler = Scheduler(num_blocks=48, block_size=16, max_num_seqs=8, max_num_batched_tokens=24,
                          max_model_len=256, vocab_size=runner.arch.vocab_size)
    scheduler.add_request(Request(request_id="0", prompt_token_ids=[5, 6, 7, 8, 9, 10],
                                  sampling=SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                                  arrival_time=0))
    runner.execute(scheduler.schedule())
    assert not any(layer.calibrate_kv for layer in runner.model.layers)
    for layer in runner.model.layers:  # 2 x amax / 448: the first prefill's largest K and V land at 224
        assert 0 < float(layer.k_scale) < 1.0 and 0 < float(layer.v_scale) < 1.0
        num_slots = runner.kv_cache.shape[2] * runner.kv_cache.shape[3]
    stored = runner.kv_cache[0, 0].reshape(num_slots, -1).float().abs().max()
    assert stored == pytest.approx(224.0, rel=0.07)


def test_kv_blocks_double_for_the_same_memory() -> None:
    sizes = {}
    for kv_dtype in ("auto", "fp8"):
        runner = ModelRunner(EngineConfig(model="tiny", load_format="dummy", device="cpu", dtype="bfloat16",
                                          kv_cache_memory=1 << 20, kv_cache_dtype=kv_dtype, max_model_len=256))
        sizes[kv_dtype] = runner.num_blocks
        assert runner.kv_cache.dtype == (torch.float8_e4m3fn if kv_dtype == "fp8" else torch.bfloat16)
    assert sizes["fp8"] == 2 * sizes["auto"]


def test_dummy_weights_quantize_like_loaded_ones() -> None:
    arch: ModelArch = resolve_arch("tiny-qwen3", "dummy")
    plain = CausalLM(arch, torch.float32, torch.device("cpu"), ops=reference_ops())
    quant = CausalLM(arch, torch.float32, torch.device("cpu"), ops=reference_ops(), fp8=Fp8Weights())
    from pagoda.services.worker.weights import load_model

    load_model(plain, None, "dummy", seed=3)
    load_model(quant, None, "dummy", seed=3)
    for a, b in ((plain.layers[1].gate_up_weight, quant.layers[1]), ):
        expected_q, expected_s = ref.quantize_fp8_rows(a)
        assert torch.equal(b.gate_up_weight.view(torch.uint8), expected_q.view(torch.uint8))
        assert torch.equal(b.gate_up_weight_scale, expected_s)
    assert torch.equal(plain.embed, quant.embed)


@pytest.mark.parametrize(("shape", "quantization"), [("tiny", "fp8"), ("tiny-qwen3", "fp8"), ("tiny", "fp8_block")])
def test_triton_fp8_model_matches_reference_model(shape: str, quantization: str) -> None:
    """FP8 weights and FP8 KV through the Triton ops (interpreter on CPU; cuBLASLt + Triton on GPU) against the
    reference ops: the same quantization and the same logits up to fp32 summation order."""
    from pagoda.services.worker.models import triton_ops

    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (3, 20)]
    results = []
    for ops in (reference_ops(), triton_ops()):
        config = EngineConfig(model=shape, load_format="dummy", device=DEVICE, dtype="float32", num_kv_blocks=16,
                              max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=5, quantization=quantization,
                              kv_cache_dtype="fp8")
        results.append(_greedy_logits(config, prompts, max_tokens=3, ops=ops))
    (ref_tokens, ref_logits), (tri_tokens, tri_logits) = results
    assert tri_tokens == ref_tokens
    for request_id, rows in ref_logits.items():
        for expected, ours in zip(rows, tri_logits[request_id], strict=True):
            torch.testing.assert_close(ours, expected, atol=2e-3, rtol=1e-3)


def test_quantize_kernel_long_rows_take_two_passes() -> None:
    """Rows longer than one tile (llama3-8b's down projection: 14336 columns) loop: amax first, then quantize."""
    from pagoda.kernels import fp8

    generator = torch.Generator().manual_seed(10)
    x = torch.randn(2, fp8._ROW_TILE + 300, generator=generator).to(DEVICE)
    x[1, -5] = 40.0  # the row's largest element sits in the second tile
    q, scale = fp8.quantize_fp8_rows(x)
    _assert_same_quantization(q, scale, *ref.quantize_fp8_rows(x.cpu()))  # the CPU's exact division


def _assert_close_quantization(q: torch.Tensor, scale: torch.Tensor, q_ref: torch.Tensor,
                               s_ref: torch.Tensor) -> None:
    """Fused kernels sum in another order than torch: scales within 1e-5, e4m3 values at most one step apart."""
    torch.testing.assert_close(scale.cpu(), s_ref.cpu(), rtol=1e-5, atol=0)
    back, back_ref = q.cpu().float() * scale.cpu(), q_ref.cpu().float() * s_ref.cpu()
    assert (back - back_ref).abs().le(2 * _bound(back_ref, s_ref.cpu()) + 1e-6).all()
    assert (q.cpu().view(torch.uint8) != q_ref.cpu().view(torch.uint8)).float().mean() < 0.02


@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_quant_kernel_matches_reference(with_residual: bool) -> None:
    from pagoda.kernels.fp8 import add_rms_norm_quant_fp8

    generator = torch.Generator().manual_seed(11)
    x = torch.randn(3, 96, generator=generator).to(DEVICE)
    residual = torch.randn(3, 96, generator=generator).to(DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(96, generator=generator)).to(DEVICE)
    q, scale, summed = add_rms_norm_quant_fp8(x, residual, weight, 1e-6)
    q_ref, s_ref, summed_ref = ref.add_rms_norm_quant_fp8(x, residual, weight, 1e-6)
    torch.testing.assert_close(summed, summed_ref)
    _assert_close_quantization(q, scale, q_ref, s_ref)


@pytest.mark.parametrize("parts_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_parts_quant_is_the_norm_quant_of_the_summed_parts(parts_dtype: torch.dtype) -> None:
    """Split-K partials (fp32, contiguous) or top-k rows (bf16, a strided view) summed in the norm's pass of a bf16
    model: the same bits as add_rms_norm_quant_fp8 of their in-order fp32 sum rounded to bf16 as
    norm.add_rms_norm_parts rounds it (the interpreter rounds fp32 to bf16 unlike torch); an fp32 model's
    partials give the reference's values."""
    from pagoda.kernels.fp8 import add_rms_norm_parts_quant_fp8, add_rms_norm_quant_fp8
    from pagoda.kernels.norm import add_rms_norm_parts

    generator = torch.Generator().manual_seed(14)
    rows = torch.randn(5, 3, 96, generator=generator)  # [T, S, D]
    parts = (rows.to(DEVICE).transpose(0, 1) if parts_dtype == torch.bfloat16 else
             rows.transpose(0, 1).contiguous().to(DEVICE)).to(parts_dtype)  # [S, T, D]
    residual = torch.randn(5, 96, generator=generator).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(96, generator=generator)).to(DEVICE)
    bf16 = torch.bfloat16
    summed_parts = add_rms_norm_parts(parts, bf16, torch.zeros_like(residual, dtype=bf16), weight.to(bf16),
                                      1e-6)[1]  # [T, D]: the parts' sum as the kernels round it
    fused = add_rms_norm_parts_quant_fp8(parts, bf16, residual.to(bf16), weight.to(bf16), 1e-6)
    separate = add_rms_norm_quant_fp8(summed_parts, residual.to(bf16), weight.to(bf16), 1e-6)
    assert torch.equal(fused[0].view(torch.uint8), separate[0].view(torch.uint8))
    assert torch.equal(fused[1], separate[1]) and torch.equal(fused[2], separate[2])
    fp32_parts = rows.transpose(0, 1).contiguous().to(DEVICE)  # [S, T, D]
    q, scale, summed = add_rms_norm_parts_quant_fp8(fp32_parts, torch.float32, residual, weight, 1e-6)
    q_ref, s_ref, summed_ref = ref.add_rms_norm_parts_quant_fp8(fp32_parts, torch.float32, residual, weight, 1e-6)
    torch.testing.assert_close(summed, summed_ref)
    _assert_close_quantization(q, scale, q_ref, s_ref)
    with pytest.raises(ValueError, match="parts"):
        add_rms_norm_parts_quant_fp8(parts.half(), bf16, residual.to(bf16), weight.to(bf16), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_parts_quant_fp8(parts, bf16, residual[:, :64].to(bf16), weight.to(bf16), 1e-6)


def test_silu_and_mul_quant_kernel_matches_reference() -> None:
    from pagoda.kernels.fp8 import silu_and_mul_quant_fp8

    generator = torch.Generator().manual_seed(12)
    gate_up = (torch.randn(3, 2 * 80, generator=generator) * 3).to(DEVICE)
    q, scale = silu_and_mul_quant_fp8(gate_up, tile=32)  # 80 columns: three tiles, the last partial
    _assert_close_quantization(q, scale, *ref.silu_and_mul_quant_fp8(gate_up))
    q, scale = silu_and_mul_quant_fp8(gate_up)  # the whole row in one pass (a 128-column tile, masked)
    _assert_close_quantization(q, scale, *ref.silu_and_mul_quant_fp8(gate_up))


@pytest.mark.gpu
def test_fused_quant_kernels_gpu_bf16() -> None:
    """bf16 rows of llama3-8b width through the fused kernels on the GPU (split-K partials summed in the norm: the
    bits of the norm on their sum)."""
    from pagoda.kernels.fp8 import add_rms_norm_parts_quant_fp8, add_rms_norm_quant_fp8, silu_and_mul_quant_fp8

    generator = torch.Generator(device="cuda").manual_seed(13)
    x = torch.randn(37, 4096, device="cuda", generator=generator).bfloat16()
    residual = torch.randn(37, 4096, device="cuda", generator=generator).bfloat16()
    weight = (1 + 0.1 * torch.randn(4096, device="cuda", generator=generator)).bfloat16()
    q, scale, summed = add_rms_norm_quant_fp8(x, residual, weight, 1e-5)
    q_ref, s_ref, summed_ref = ref.add_rms_norm_quant_fp8(x, residual, weight, 1e-5)
    assert torch.equal(summed, summed_ref)
    _assert_close_quantization(q, scale, q_ref, s_ref)
    gate_up = torch.randn(37, 2 * 14336, device="cuda", generator=generator).bfloat16()
    _assert_close_quantization(*silu_and_mul_quant_fp8(gate_up), *ref.silu_and_mul_quant_fp8(gate_up))
    parts = torch.randn(4, 37, 4096, device="cuda", generator=generator)  # [S, T, H]: split-K partials
    fused = add_rms_norm_parts_quant_fp8(parts, torch.bfloat16, residual, weight, 1e-5)
    in_order = ((parts[0] + parts[1]) + parts[2]) + parts[3]  # [T, H] fp32
    separate = add_rms_norm_quant_fp8(in_order.bfloat16(), residual, weight, 1e-5)
    assert torch.equal(fused[0].view(torch.uint8), separate[0].view(torch.uint8))
    assert torch.equal(fused[1], separate[1]) and torch.equal(fused[2], separate[2])


def test_offline_llm_serves_an_fp8_checkpoint_with_fp8_kv(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The whole engine (scheduler, worker, sampler) through the offline API on a pre-quantized checkpoint."""
    from pagoda import LLM

    _write_fp8_checkpoint(tiny_llama_dir, tmp_path / "ct", "ct-channel")
    llm = LLM(str(tmp_path / "ct"), kv_cache_dtype="fp8", num_kv_blocks=32, max_model_len=128)
    assert llm.engine.runner.model.fp8 is not None
    outputs = llm.generate([[5, 6, 7], [9, 10, 11, 12, 13]],
                           SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 5]


def test_fp8_settings_travel_through_the_environment() -> None:
    """The launcher hands settings to worker processes as PAGODA_* variables: the FP8 ones survive the trip."""
    import argparse

    from pagoda.shared.config import add_engine_args, engine_config_from_args, to_env

    config = EngineConfig(model="tiny", load_format="dummy", quantization="fp8", kv_cache_dtype="fp8",
                          kv_scale_calibration=True)
    env = to_env(config)
    assert env["PAGODA_QUANTIZATION"] == "fp8" and env["PAGODA_KV_SCALE_CALIBRATION"] == "1"
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        rebuilt = engine_config_from_args(parser.parse_args([]))
    assert (rebuilt.quantization, rebuilt.kv_cache_dtype, rebuilt.kv_scale_calibration) == ("fp8", "fp8", True)


@pytest.mark.gpu
def test_engine_fp8_bf16_cuda_graphs_close_to_bf16(tiny_llama_dir: Path) -> None:
    """The serving configuration: bf16 activations (cuBLASLt row-wise GEMMs, fused quantization), an fp8 KV cache
    and CUDA-graph decode steps, against the bf16 engine."""
    generator = torch.Generator().manual_seed(14)
    prompts = [torch.randint(2, 256, (n,), generator=generator).tolist() for n in (3, 20, 41, 70)]
    common = dict(model=str(tiny_llama_dir), device="cuda", dtype="bfloat16", num_kv_blocks=48, max_model_len=256,
                  max_num_seqs=8)
    base = _greedy_logits(EngineConfig(**common), prompts, max_tokens=6)
    for variant in ({"quantization": "fp8", "kv_cache_dtype": "fp8"}, {"quantization": "fp8_block"}):
        cosine, agreement = _compare(base, _greedy_logits(EngineConfig(**common, **variant), prompts, max_tokens=6))
        assert cosine >= 0.99, (variant, cosine, agreement)
