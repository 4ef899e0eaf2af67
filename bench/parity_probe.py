"""Where pagoda and transformers part: each pagoda op fed transformers' own inputs, compared bit for bit.

For one prompt, transformers runs a prefill and then one decode step with hooks on every sub-module.
Each of pagoda's ops (the model's `Ops`, its GEMMs) is then given the very tensors transformers fed
its counterpart, so an op's difference is its own, not carried in from earlier layers. Per op it
prints the share of output elements that differ from transformers' and the largest difference,
summed over layers. Run on the GPU (Triton ops) or on CPU (the PyTorch reference ops).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagoda.bench.hf_peer import load_hf_model
from pagoda.bench.workload import Workload
from pagoda.services.worker.models import AttentionMetadata, CausalLM
from pagoda.services.worker.models.base import reference_attention
from pagoda.services.worker.models.rope import RopeSpec, inv_freq
from pagoda.services.worker.weights import load_model
from pagoda.shared.shapes import resolve_arch


@dataclass
class Tally:
    """Differing elements and the largest absolute difference of one op, over all layers."""

    differing: int = 0
    total: int = 0
    max_abs: float = 0.0
    scale: float = 0.0

    def add(self, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
        diff = (ours.float() - theirs.float()).abs()
        self.differing += int((ours != theirs).sum())
        self.total += ours.numel()
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.scale = max(self.scale, float(theirs.float().abs().max()))

    def row(self) -> dict[str, float]:
        return {"differ": round(self.differing / max(self.total, 1), 5), "max_abs": self.max_abs, "max": self.scale}


@dataclass
class Capture:
    """What transformers' sub-modules of one layer saw and gave, keyed by a short name."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def attach_hooks(hf: torch.nn.Module, captures: list[Capture]) -> list[torch.utils.hooks.RemovableHandle]:
    handles = []
    for layer, capture in zip(hf.model.layers, captures, strict=True):
        def keep_out(name: str, capture: Capture = capture):
            return lambda _m, _args, out: capture.tensors.__setitem__(name, (out[0] if isinstance(out, tuple)
                                                                             else out).detach().clone())

        def keep_in(name: str, capture: Capture = capture):
            return lambda _m, args: capture.tensors.__setitem__(name, args[0].detach().clone())

        attn, mlp = layer.self_attn, layer.mlp
        handles.append(layer.register_forward_pre_hook(keep_in("layer_in")))
        handles.append(layer.input_layernorm.register_forward_hook(keep_out("input_norm")))
        for name in ("q_proj", "k_proj", "v_proj"):
            handles.append(getattr(attn, name).register_forward_hook(keep_out(name)))
        if hasattr(attn, "q_norm"):
            handles.append(attn.q_norm.register_forward_hook(keep_out("q_norm")))
            handles.append(attn.k_norm.register_forward_hook(keep_out("k_norm")))
        handles.append(attn.o_proj.register_forward_pre_hook(keep_in("attn_out")))
        handles.append(attn.o_proj.register_forward_hook(keep_out("o_proj")))
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(keep_in("mid_residual")))
        handles.append(layer.post_attention_layernorm.register_forward_hook(keep_out("post_norm")))
        handles.append(mlp.gate_proj.register_forward_hook(keep_out("gate")))
        handles.append(mlp.up_proj.register_forward_hook(keep_out("up")))
        handles.append(mlp.down_proj.register_forward_pre_hook(keep_in("act")))
        handles.append(mlp.down_proj.register_forward_hook(keep_out("down")))
    return handles


def hf_rope(hf: torch.nn.Module, q: torch.Tensor, k: torch.Tensor,
            positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own rope on q, k [T, heads, D]; returns the same layout."""
    module = sys.modules[type(hf.model.layers[0].self_attn).__module__]
    cos, sin = hf.model.rotary_emb(q, positions[None, :])
    q_r, k_r = module.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return q_r[0].transpose(0, 1), k_r[0].transpose(0, 1)


def single_sequence_meta(seq_len: int, query_len: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """One sequence whose blocks are 0..n-1 in order; its last query_len tokens are this step's."""
    num_blocks = -(-seq_len // block_size)
    first = seq_len - query_len
    return AttentionMetadata(
        slot_mapping=torch.arange(first, seq_len, device=device, dtype=torch.int64),
        block_tables=torch.arange(num_blocks, device=device, dtype=torch.int32)[None, :],
        seq_lens=torch.tensor([seq_len], device=device, dtype=torch.int32),
        query_start_loc=torch.tensor([0, query_len], device=device, dtype=torch.int32),
        seq_lens_host=[seq_len], query_lens_host=[query_len], max_query_len=query_len, max_seq_len=seq_len)


def probe_layers(model: CausalLM, hf: torch.nn.Module, captures: list[Capture], positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], seq_len: int, block_size: int,
                 tallies: dict[str, Tally], prefix: str) -> None:
    """Feed each pagoda op transformers' inputs for every layer; tally the differences per op."""
    ops, eps = model.ops, model.arch.rms_norm_eps
    for index, (layer, capture) in enumerate(zip(model.layers, captures, strict=True)):
        t = {name: value[0] for name, value in capture.tensors.items()}  # drop the batch dim: [T, ...]
        tokens = t["layer_in"].shape[0]
        if index == 0:
            normed = ops.rms_norm(t["layer_in"], layer.input_norm, eps)
        else:
            prev = {name: value[0] for name, value in captures[index - 1].tensors.items()}
            normed, summed = ops.add_rms_norm(prev["down"], prev["mid_residual"], layer.input_norm, eps)
            tallies[prefix + "residual_add"].add(summed, t["layer_in"])
        tallies[prefix + "input_norm"].add(normed, t["input_norm"])
        qkv = F.linear(t["input_norm"], layer.qkv_weight, layer.qkv_bias)
        q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        tallies[prefix + "qkv_gemm_fused"].add(torch.cat([q, k, v], -1),
                                               torch.cat([t["q_proj"], t["k_proj"], t["v_proj"]], -1))
        q_alone = F.linear(t["input_norm"], layer.qkv_weight[:layer.q_size])
        tallies[prefix + "q_gemm_alone"].add(q_alone, t["q_proj"])
        heads = t["q_proj"].view(tokens, layer.num_heads, layer.head_dim)
        kv_heads = t["k_proj"].view(tokens, layer.num_kv_heads, layer.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            tallies[prefix + "q_norm"].add(ops.rms_norm(heads, layer.q_norm, eps), t["q_norm"])
            heads, kv_heads = t["q_norm"], t["k_norm"]
        their_q, their_k = hf_rope(hf, heads, kv_heads, positions)
        their_qk = torch.cat([their_q.flatten(1), their_k.flatten(1)], -1)
        our_q, our_k = ops.rope(heads.clone(), kv_heads.clone(), model.rope_cache[0], model.rope_cache[1], positions)
        tallies[prefix + "rope"].add(torch.cat([our_q.flatten(1), our_k.flatten(1)], -1), their_qk)
        if index == 0:  # is it the cos/sin table or the kernel?
            their_cos, their_sin = (t[0] for t in hf.model.rotary_emb(heads, positions[None, :]))  # [T, D] each
            tallies[prefix + "rope_table"].add(torch.cat([model.rope_cache[0][positions],
                                                          model.rope_cache[1][positions]], -1),
                                               torch.cat([their_cos, their_sin], -1))
            table_q, table_k = ops.rope(heads.clone(), kv_heads.clone(), their_cos.contiguous(),
                                        their_sin.contiguous(), torch.arange(tokens, device=positions.device))
            tallies[prefix + "rope_kernel_on_their_table"].add(
                torch.cat([table_q.flatten(1), table_k.flatten(1)], -1), their_qk)
        their_v = t["v_proj"].view(tokens, layer.num_kv_heads, layer.head_dim)
        meta = single_sequence_meta(seq_len, tokens, block_size, positions.device)
        attn = ops.attention(their_q.contiguous(), their_k.contiguous(), their_v.contiguous(),
                             kv_caches[index][0], kv_caches[index][1], meta, layer.scale)
        tallies[prefix + "attention"].add(attn.reshape(tokens, -1), t["attn_out"])
        ref = reference_attention(their_q.contiguous(), their_k.contiguous(), their_v.contiguous(),
                                  kv_caches[index][0].clone(), kv_caches[index][1].clone(), meta, layer.scale)
        tallies[prefix + "attention_torch_ref"].add(ref.reshape(tokens, -1), t["attn_out"])
        tallies[prefix + "o_gemm"].add(F.linear(t["attn_out"], layer.o_weight), t["o_proj"])
        normed, summed = ops.add_rms_norm(t["o_proj"], t["layer_in"], layer.post_attn_norm, eps)
        tallies[prefix + "residual_add"].add(summed, t["mid_residual"])
        tallies[prefix + "post_norm"].add(normed, t["post_norm"])
        gate_up = F.linear(t["post_norm"], layer.gate_up_weight)
        tallies[prefix + "gate_up_gemm_fused"].add(gate_up, torch.cat([t["gate"], t["up"]], -1))
        tallies[prefix + "silu_and_mul"].add(ops.silu_and_mul(torch.cat([t["gate"], t["up"]], -1)), t["act"])
        tallies[prefix + "down_gemm"].add(F.linear(t["act"], layer.down_weight), t["down"])


def run(shape: str, prompt_len: int, dtype_name: str, device_name: str, seed: int) -> dict[str, dict[str, float]]:
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    arch = resolve_arch(shape, "dummy")
    if arch.moe is not None or arch.mla is not None or arch.rotary_dim is not None:
        # its layers are dense GQA ones in transformers' head order; GLM-4.5's q/k heads are permuted at load
        # (partial rope), so its q/k/rope rows would differ everywhere without being wrong
        raise SystemExit(f"parity_probe compares dense GQA layers only; {shape} has MoE, MLA or partial rope "
                         "(tests/test_moe_models.py, test_deepseek.py and test_glm4_moe.py check those)")
    block_size = 16
    model = CausalLM(arch, dtype, device, max_positions=prompt_len + 16)
    load_model(model, None, "dummy", seed)
    hf = load_hf_model(shape, "dummy", dtype, device, seed)
    [prompt] = Workload(1, prompt_len, 1, 0.0, seed).prompts(arch.vocab_size)
    num_blocks = -(-(prompt_len + 1) // block_size)
    kv_caches = [(torch.zeros(num_blocks, block_size, arch.num_kv_heads, arch.head_dim, dtype=dtype, device=device),
                  torch.zeros(num_blocks, block_size, arch.num_kv_heads, arch.head_dim, dtype=dtype, device=device))
                 for _ in range(arch.num_layers)]
    tallies: dict[str, Tally] = defaultdict(Tally)
    captures = [Capture() for _ in range(arch.num_layers)]
    handles = attach_hooks(hf, captures)
    ids = torch.tensor([prompt], device=device)  # [1, L]
    with torch.inference_mode():
        out = hf(ids, use_cache=True)
        # Prefill: pagoda's ops on transformers' inputs; its K/V land in our paged caches as they go.
        probe_layers(model, hf, captures, torch.arange(prompt_len, device=device), kv_caches, prompt_len,
                     block_size, tallies, "prefill.")
        # One decode step on transformers' own cache: the paged caches hold our K/V of the prompt, which
        # equal theirs wherever the prefill rope and GEMMs agreed bit for bit (tallied above).
        next_id = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        for capture in captures:
            capture.tensors.clear()
        # transformers' cache argument: `cache` from 5.2x on (`past_key_values` then warns that it goes in 5.40)
        cache_arg = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
        hf(next_id, use_cache=True, **{cache_arg: getattr(out, cache_arg)})
        probe_layers(model, hf, captures, torch.tensor([prompt_len], device=device), kv_caches, prompt_len + 1,
                     block_size, tallies, "decode.")
        for handle in handles:
            handle.remove()
        # Whole-model check: pagoda's logits for the prompt vs transformers'.
        fresh = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kv_caches]
        meta = single_sequence_meta(prompt_len, prompt_len, block_size, device)
        hidden = model(ids[0], torch.arange(prompt_len, device=device), fresh, meta)
        tallies["model.logits"].add(model.compute_logits(hidden[-1:])[0].float(), out.logits[0, -1].float())
        ours = inv_freq(RopeSpec.of(arch)).to(device)
        tallies["model.rope_inv_freq"].add(ours, hf.model.rotary_emb.inv_freq.to(ours.dtype))
    return {name: tally.row() for name, tally in sorted(tallies.items())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = run(args.shape, args.prompt_len, args.dtype, args.device, args.seed)
    print(f"{'op':34} {'differ':>9} {'max_abs':>10} {'max':>8}")
    for name, row in rows.items():
        print(f"{name:34} {row['differ']:9.5f} {row['max_abs']:10.3g} {row['max']:8.3g}")
    print("PROBE " + json.dumps(rows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
