"""Rotary-embedding tables from a model's rope settings: default, linear, llama3, yarn and dynamic NTK.

The worker keeps one cos/sin table [positions, head_dim] per model; every attention kernel reads rows of it by
position and rotates dims (i, i + head_dim / 2) of each head. YaRN's attention factor is folded into the table (cos
and sin both scaled), as Hugging Face does. A rope over only the first rotary_dim dims of a head (GLM-4.5's
partial_rotary_factor) fills slots [rotary_dim / 2, head_dim / 2) of each half with cos 1, sin 0: those dims pass
through unchanged, and the weight loader permutes each q/k head so that its rotary pairs land on the other slots
(permute_rotary_dims).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.shared.shapes import ModelArch


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Everything that decides the table: dimension, base, scaling type and its parameters."""

    dim: int  # rotary dimensions (head_dim, its rotary part, or the rope part of an MLA head)
    theta: float
    scaling: dict[str, Any]  # {} for the default rope
    max_position_embeddings: int
    table_dim: int = 0  # the table's width (the kernels' head_dim) when it is wider than dim (0: dim)

    @classmethod
    def of(cls, arch: ModelArch, dim: int | None = None) -> RopeSpec:
        return cls(dim or arch.rope_dim, arch.rope_theta, dict(arch.rope_scaling or {}), arch.max_position_embeddings,
                   0 if dim else arch.head_dim)

    @property
    def rope_type(self) -> str:
        return self.scaling.get("rope_type", "default")


def base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """theta ** (-2i / dim) for i < dim / 2, fp32 [dim / 2]."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(spec: RopeSpec) -> float:
    factor = spec.scaling.get("factor")
    if factor is None:  # DeepSeek-V3 style: the stretch is max / original
        return spec.max_position_embeddings / float(spec.scaling["original_max_position_embeddings"])
    return float(factor)


def yarn_attention_factor(spec: RopeSpec) -> float:
    """The factor YaRN multiplies cos and sin by: given, or from factor (and mscale / mscale_all_dim)."""
    given = spec.scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = yarn_factor(spec)
    mscale, mscale_all_dim = spec.scaling.get("mscale"), spec.scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def _yarn_inv_freq(spec: RopeSpec) -> torch.Tensor:
    """Interpolate the low frequencies by `factor`, keep the high ones, ramp linearly in between (the ramp's ends
    are the dimensions that turn beta_fast and beta_slow times over the original context)."""
    dim, base = spec.dim, spec.theta
    factor = yarn_factor(spec)
    original = float(spec.scaling["original_max_position_embeddings"])
    beta_fast = float(spec.scaling.get("beta_fast") or 32)
    beta_slow = float(spec.scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if spec.scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim / 2]
    extrapolation = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    interpolation = extrapolation / factor
    keep = 1 - ramp  # 1: the original frequency (extrapolate), 0: interpolated
    return interpolation * (1 - keep) + extrapolation * keep


def _dynamic_angles(spec: RopeSpec, positions: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK: the base grows with the context once it passes the original length. A token at position p
    is rotated with the base for a context of p + 1 tokens, as Hugging Face's decoding computes it token by
    token (a prompt longer than the original context is rotated there with its whole length's base, which a
    position-indexed table cannot express; vLLM fixes one base for the maximum length instead). The original
    context is max_position_embeddings, as transformers and vLLM take it: an original_max_position_embeddings key
    beside a dynamic rope is not read."""
    dim, factor = spec.dim, float(spec.scaling["factor"])
    original = float(spec.max_position_embeddings)
    length = torch.clamp(positions.double() + 1, min=original)  # [P]
    base = spec.theta * ((factor * length / original) - (factor - 1)) ** (dim / (dim - 2))  # [P]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim / 2]
    inv_freq = 1.0 / base.float()[:, None] ** exponents[None, :]  # [P, dim / 2] in fp32, as transformers has it
    return positions.float()[:, None] * inv_freq


def inv_freq(spec: RopeSpec) -> torch.Tensor:
    """Inverse frequencies [dim / 2] fp32 for the position-independent types."""
    freq = base_inv_freq(spec.dim, spec.theta)
    kind = spec.rope_type
    if kind == "linear":
        return freq / float(spec.scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(freq, spec.scaling)
    if kind == "yarn":
        return _yarn_inv_freq(spec)
    assert kind == "default", kind
    return freq


def attention_factor(spec: RopeSpec) -> float:
    return yarn_attention_factor(spec) if spec.rope_type == "yarn" else 1.0


def rope_table(spec: RopeSpec, num_positions: int, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_positions, dim] for rotate-half rope: angles in fp32, scaled by the attention factor before
    the cast to `dtype`, as Hugging Face computes them."""
    positions = torch.arange(num_positions)  # [P]
    if spec.rope_type == "dynamic":
        angles = _dynamic_angles(spec, positions)  # [P, dim / 2]
    else:
        angles = positions.float()[:, None] * inv_freq(spec)[None, :]  # [P, dim / 2]
    factor = attention_factor(spec)
    cos, sin = angles.cos() * factor, angles.sin() * factor  # [P, dim / 2]
    pad = max(spec.table_dim, spec.dim) // 2 - spec.dim // 2
    if pad:  # pass-through slots: cos 1, sin 0 exactly (the attention factor scales only the rotated dims)
        cos = torch.cat((cos, cos.new_ones(num_positions, pad)), dim=-1)  # [P, table_dim / 2]
        sin = torch.cat((sin, sin.new_zeros(num_positions, pad)), dim=-1)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # [P, table_dim]
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def permute_rotary_dims(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Slot -> checkpoint dim of one q/k head [head_dim] int64, for a rope over its first rotary_dim dims in
    rotate-half order (pairs (i, i + r / 2), i < r / 2, as transformers' apply_rotary_pos_emb rotates them): the
    kernels rotate pairs (j, j + head_dim / 2), so checkpoint dim i goes to slot i and i + r / 2 to slot
    head_dim / 2 + i; the pass-through dims fill the rest of each half in order. q . k is unchanged when q and k
    (and their biases and norm weights) share the permutation; V and o_proj keep the checkpoint's order."""
    half, rot_half = head_dim // 2, rotary_dim // 2
    assert rotary_dim % 2 == 0 and head_dim % 2 == 0 and 0 < rotary_dim <= head_dim
    passed = torch.arange(rotary_dim, head_dim)  # [head_dim - r]
    first, second = passed[:half - rot_half], passed[half - rot_half:]
    return torch.cat((torch.arange(rot_half), first, torch.arange(rot_half, rotary_dim), second))  # [head_dim]
