"""The physical floor of a throughput workload, what `pagoda bench throughput` prints as "x% of floor".

Prefill: FLOPs at the tensor-core peak. Decode: every step reads the weights it touches and every cached K/V byte
once (all sequences in lockstep), at HBM bandwidth, or does its FLOPs at the peak, whichever takes longer.

Everything is counted in the precision the engine stores it (issue 25):
- `--quantization fp8` / `fp8_block`: the linear layers the engine quantizes (attention projections, dense MLPs,
  routed experts, DeepSeek's and GLM-4.5's shared experts) read one byte per weight plus their fp32 scales (one per
  output channel; fp8_block: one per output row and 128 input columns), and their GEMMs run at the FP8 peak.
  Embeddings, the LM head, norms, routers, MLA's kv_b and Qwen2-MoE's shared expert stay in the model dtype (as the
  engine keeps them: services/worker/models/*.py).
- `--kv-cache-dtype fp8`: one byte per cached element (K and V, or MLA's latent entry); its scales are per layer
  and tensor, so nothing per token.

A decode step reads only its tokens' rows of the input embedding (not the table); the LM head is read whole.
Plain Python (no torch), so the benchmark's parent process and the tests can use it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.bench.workload import Workload
from pagoda.shared.config import KV_CACHE_DTYPES, QUANTIZATIONS
from pagoda.shared.shapes import ModelArch

HBM_BYTES_PER_S = 4.2e12  # measured device-to-device copy on the lent H200
MATMUL_FLOPS = 780e12  # measured dense bf16 matmul on the lent H200
# Not measured: Hopper's FP8 tensor cores run twice the dense bf16 rate (H200 datasheet: 1,979 vs 989 TFLOP/s
# dense), so the FP8 peak is taken as twice the measured bf16 figure.
FP8_MATMUL_FLOPS = 2 * MATMUL_FLOPS
FP8_SCALE_GROUP = 128  # fp8_block: one fp32 scale per output row and 128 input columns
SCALE_BYTES = 4  # fp32


@dataclass(frozen=True, slots=True)
class Precision:
    """How the benchmarked engine stores what a step reads: model dtype, weight quantization, KV cache dtype."""

    dtype_bytes: int = 2  # the model dtype (bf16 on CUDA)
    quantization: str | None = None  # None, "fp8" (per-channel scales) or "fp8_block"
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) or "fp8" / "fp8_e4m3" (one byte per element)

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"dtype_bytes must be 2 or 4, got {self.dtype_bytes}")

    @property
    def kv_bytes(self) -> int:
        """Bytes of one cached K/V (or latent) element."""
        return 1 if self.kv_cache_dtype.startswith("fp8") else self.dtype_bytes

    def scale_bytes(self, rows: int, cols: int) -> int:
        """fp32 scales of one FP8 weight [rows, cols]."""
        if self.quantization is None:
            return 0
        groups = 1 if self.quantization == "fp8" else math.ceil(cols / FP8_SCALE_GROUP)
        return SCALE_BYTES * rows * groups

    def describe(self) -> str:
        weights = {None: "weights 2 B" if self.dtype_bytes == 2 else "weights 4 B",
                   "fp8": "fp8 weights 1 B + per-channel scales",
                   "fp8_block": "fp8 weights 1 B + 128-column scales"}[self.quantization]
        peak = (f"linear FLOPs at {FP8_MATMUL_FLOPS / 1e12:.0f} TFLOP/s" if self.quantization
                else f"FLOPs at {MATMUL_FLOPS / 1e12:.0f} TFLOP/s")
        return f"{weights}, KV {self.kv_bytes} B/element, {peak}, {HBM_BYTES_PER_S / 1e12:.1f} TB/s"


def checkpoint_quantization(model: str) -> str | None:
    """What a model folder's config.json declares (its weights load as FP8 without --quantization): "fp8_block" for
    block scales, "fp8" for any other FP8 checkpoint, None otherwise."""
    path = Path(model, "config.json")
    if not path.is_file():
        return None
    quant = json.loads(path.read_text()).get("quantization_config") or {}
    if quant.get("quant_method") not in ("fp8", "compressed-tensors"):
        return None
    return "fp8_block" if quant.get("weight_block_size") else "fp8"


def fp8_linears(arch: ModelArch, layer: int) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """The linear weights (name, out rows, in cols) of one decoder layer that FP8 quantizes: (always read, one
    routed expert's). Mirrors the engine's make_linear calls (services/worker/models)."""
    h, mla, moe = arch.hidden_size, arch.mla, arch.moe
    if mla is not None:
        q_in = mla.q_lora_rank or h
        attention = [("q_a_kv_a" if mla.q_lora_rank else "kv_a", (mla.q_lora_rank or 0) + mla.entry_dim, h),
                     ("q_b" if mla.q_lora_rank else "q", arch.num_heads * mla.qk_head_dim, q_in),
                     ("o", h, arch.num_heads * mla.v_head_dim)]
    else:
        attention = [("qkv", arch.q_size + 2 * arch.kv_size, h), ("o", h, arch.q_size)]
    if moe is None or layer not in moe.sparse_layers:
        return attention + [("gate_up", 2 * arch.intermediate_size, h), ("down", h, arch.intermediate_size)], []
    expert = moe.expert_intermediate_size
    experts = [("expert_gate_up", 2 * expert, h), ("expert_down", h, expert)]
    shared = moe.shared_expert_intermediate_size
    if shared and not moe.shared_expert_gated:  # DeepSeek's and GLM-4.5's (DeepseekMoe) are quantized; Qwen2-MoE's
        # sigmoid-gated one stays in the model dtype
        attention += [("shared_gate_up", 2 * shared, h), ("shared_down", h, shared)]
    return attention, experts


@dataclass(frozen=True, slots=True)
class StepWeights:
    """What the decoder layers of one step read: parameters in FP8, their scale bytes, parameters in the model
    dtype."""

    fp8_params: float
    scale_bytes: float
    plain_params: float


def layer_weights(arch: ModelArch, num_tokens: int, precision: Precision) -> StepWeights:
    """The decoder layers' weights one step of `num_tokens` tokens touches (mixture of experts: the experts
    uniformly routed tokens are expected to touch), split by storage."""
    total = arch.layer_weight_params(num_tokens)
    if precision.quantization is None:
        return StepWeights(0.0, 0.0, total)
    touched = arch.moe.expected_experts_touched(num_tokens) if arch.moe else 0.0
    fp8_params = scale_bytes = 0.0
    for layer in range(arch.num_layers):
        dense, expert = fp8_linears(arch, layer)
        for shapes, copies in ((dense, 1.0), (expert, touched)):
            fp8_params += copies * sum(rows * cols for _, rows, cols in shapes)
            scale_bytes += copies * sum(precision.scale_bytes(rows, cols) for _, rows, cols in shapes)
    assert fp8_params <= total, "fp8_linears counts more weights than the architecture has"
    return StepWeights(fp8_params, scale_bytes, total - fp8_params)


def weight_bytes_per_step(arch: ModelArch, num_tokens: int, precision: Precision | None = None) -> float:
    """Weight bytes one step of `num_tokens` tokens reads: the decoder layers' touched weights, the LM head whole,
    the tokens' rows of an untied input embedding and the final norm."""
    precision = precision or Precision()
    layers = layer_weights(arch, num_tokens, precision)
    embed = arch.vocab_size * arch.hidden_size  # the LM head (the tied embedding too)
    rows = 0 if arch.tie_word_embeddings else num_tokens * arch.hidden_size
    plain = layers.plain_params + embed + rows + arch.hidden_size
    return layers.fp8_params + layers.scale_bytes + plain * precision.dtype_bytes


def attention_flops_per_key(arch: ModelArch, decode: bool) -> int:
    """FLOPs of one (query token, cached key) pair over all layers: QK^T and PV, 2 per multiply-add. MLA decode
    attends over the latent (absorbed: QK over [latent ‖ rope], PV over the latent); its prefill over per-head
    keys and values expanded from it."""
    mla = arch.mla
    if mla is None:
        per_head = 2 * arch.head_dim
    elif decode:
        per_head = mla.entry_dim + mla.kv_lora_rank
    else:
        per_head = mla.qk_head_dim + mla.v_head_dim
    return 2 * arch.num_layers * arch.num_heads * per_head


def step_seconds(arch: ModelArch, num_tokens: int, context_tokens: int, precision: Precision) -> float:
    """One decode step of `num_tokens` sequences holding `context_tokens` cached tokens in all: its bytes at HBM
    bandwidth or its FLOPs at the peak, whichever is longer."""
    bytes_read = weight_bytes_per_step(arch, num_tokens, precision) + context_tokens * arch.kv_bytes_per_token(
        precision.kv_bytes)
    touched_per_token = layer_weights(arch, 1, precision)  # each token multiplies only its own experts
    fp8_flops = 2 * num_tokens * touched_per_token.fp8_params
    plain_flops = (2 * num_tokens * (touched_per_token.plain_params + arch.vocab_size * arch.hidden_size)
                   + context_tokens * attention_flops_per_key(arch, decode=True))
    compute = fp8_flops / FP8_MATMUL_FLOPS + plain_flops / MATMUL_FLOPS
    return max(bytes_read / HBM_BYTES_PER_S, compute)


def batch1_floor_ms(arch: ModelArch, context_len: int, precision: Precision | None = None) -> float:
    """One decode token of one sequence after `context_len` tokens: its weights and cached K/V at HBM bandwidth."""
    return 1e3 * step_seconds(arch, 1, context_len, precision or Precision())


def prefill_seconds(arch: ModelArch, workload: Workload, precision: Precision) -> tuple[float, int]:
    """(seconds, tokens) of the workload's prefill at the matmul peak: 2 FLOPs per active weight per token (FP8
    linears at the FP8 peak), causal attention, and one row of logits per prompt. A shared prefix is computed once
    (the prefix cache serves the rest); n > 1 forks after the prompt."""
    n, p, shared = workload.num_prompts, workload.input_len, workload.shared_prefix_len
    tokens = shared + n * p
    pairs = (shared * shared + n * p * (2 * shared + p)) / 2  # causal (query, key) pairs
    per_token = layer_weights(arch, 1, precision)  # dense weights + the token's top-k experts
    fp8_flops = 2 * per_token.fp8_params * tokens
    plain_flops = (2 * per_token.plain_params * tokens + pairs * attention_flops_per_key(arch, decode=False)
                   + 2 * n * arch.vocab_size * arch.hidden_size)
    return fp8_flops / FP8_MATMUL_FLOPS + plain_flops / MATMUL_FLOPS, tokens


def roofline_seconds(arch: ModelArch, workload: Workload, precision: Precision | None = None) -> dict[str, Any]:
    """The physical floor of the workload: prefill at the matmul peak, then every decode step at its roofline.

    The prefill samples each sequence's first token (its logits row is in prefill_seconds), so output_len tokens
    take output_len - 1 decode steps; the step making token k + 1 attends over the prompt and k tokens."""
    precision = precision or Precision()
    p, o, shared = workload.input_len, workload.output_len, workload.shared_prefix_len
    seqs = workload.num_prompts * workload.n
    prefill_s, prefill_tokens = prefill_seconds(arch, workload, precision)
    decode_s = sum(step_seconds(arch, seqs, seqs * (shared + p + k), precision) for k in range(1, o))
    return {"floor_s": prefill_s + decode_s, "floor_prefill_s": prefill_s, "floor_decode_s": decode_s,
            "floor_out_tok_per_s": seqs * o / (prefill_s + decode_s),
            "floor_decode_step_ms": 1e3 * decode_s / max(o - 1, 1),
            "floor_batch1_ms_at_prompt": batch1_floor_ms(arch, shared + p, precision),
            "prefill_tokens": prefill_tokens, "weight_bytes_batch1": weight_bytes_per_step(arch, 1, precision),
            "kv_bytes_per_token": arch.kv_bytes_per_token(precision.kv_bytes),
            "precision": precision.describe()}
