"""Plain-PyTorch references for every kernel: the CPU path of the worker and the oracle for the Triton tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Hugging Face computes it: statistics in fp32, scale in the input dtype."""
    x32 = x.float()  # [..., D]
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then normalise: returns (normed [T, D], new residual [T, D])."""
    summed = x if residual is None else x + residual  # [T, D]
    return rms_norm(summed, weight, eps), summed


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for rotate-half rope; angles in fp32 as Hugging Face does."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, head_dim / 2]
    emb = torch.cat((angles, angles), dim=-1)  # [T, head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by position; cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, heads, head_dim]
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] -> [T, I]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store k, v [T, kv_heads, head_dim] at flat slots (block_id * block_size + offset) of the caches
    [num_blocks, block_size, kv_heads, head_dim]. Slot -1 means padding: skipped. An fp8 cache stores
    k / k_scale and v / v_scale (scales [1] fp32, default 1), clamped to +-448."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if bool((slot_mapping < 0).any()):
        valid = slot_mapping >= 0  # [T]
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    k_cache.view(num_slots, *k_cache.shape[2:])[slot_mapping] = _to_cache(k, k_cache.dtype, k_scale)
    v_cache.view(num_slots, *v_cache.shape[2:])[slot_mapping] = _to_cache(v, v_cache.dtype, v_scale)


def prepare_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) * D]: per-head RMSNorm of q and k (if the weights are given), rope on both,
    k and v stored into the caches at slot_mapping (-1 skipped); q written back into qkv, returned as a
    [T, heads, D] view of it."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)  # [T, heads, D]
    k = k.reshape(num_tokens, num_kv_heads, head_dim)  # [T, kv_heads, D]
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    if q_norm is not None and k_norm is not None:
        q_new, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    else:
        q_new = q
    pos_cos, pos_sin = cos[positions], sin[positions]  # [T, D] each
    q.copy_(apply_rope(q_new, pos_cos, pos_sin))
    write_kv(apply_rope(k, pos_cos, pos_sin), v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return quantize_fp8(x, scale if scale is not None else torch.ones(1, device=x.device))


def _from_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Cached rows in the compute dtype: fp8 rows times their per-tensor scale (in fp32), others cast."""
    if x.dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return (x.float() * (scale if scale is not None else 1.0)).to(dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first seq_len cached rows: [seq_len, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    rows = cache.index_select(0, block_table[:num_blocks].long())  # [num_blocks, block_size, kv_heads, head_dim]
    return rows.reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: list[int], query_lens: list[int], scale: float,
                    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a flattened batch of query chunks over paged K/V (GQA aware).

    q [T, heads, head_dim], T = sum(query_lens); sequence b's queries are the last query_lens[b] of
    its seq_lens[b] tokens, whose K/V are already in the caches. Returns [T, heads, head_dim].
    Single-token queries (decode) run as one batch; longer chunks run one sequence at a time.
    fresh_kv: this step's k, v [T, kv_heads, head_dim] (already in the caches): a chunk with no cached
    prefix attends to them directly instead of gathering its blocks back (not with an fp8 cache: attention
    sees what the cache holds). k_scale, v_scale [1] fp32: an fp8 cache's per-tensor scales.
    """
    if k_cache.dtype == torch.float8_e4m3fn:
        fresh_kv = None
    out = torch.empty_like(q)  # [T, heads, head_dim]
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    decode_rows = [b for b, query_len in enumerate(query_lens) if query_len == 1]
    if decode_rows:
        _decode_batch(q, k_cache, v_cache, block_tables, seq_lens, starts, decode_rows, scale, out, k_scale, v_scale)
    for b, query_len in enumerate(query_lens):
        if query_len == 1:
            continue
        seq_len, start = seq_lens[b], starts[b]
        if fresh_kv is not None and query_len == seq_len:
            k = fresh_kv[0][start:start + query_len].transpose(0, 1)  # [kv_heads, L, head_dim]
            v = fresh_kv[1][start:start + query_len].transpose(0, 1)
        else:
            k = gather_kv(k_cache, block_tables[b], seq_len).transpose(0, 1)  # [kv_heads, L, head_dim]
            v = gather_kv(v_cache, block_tables[b], seq_len).transpose(0, 1)
        q_b = q[start:start + query_len].transpose(0, 1)  # [heads, query_len, head_dim]
        if query_len == seq_len:  # no cached prefix: plain causal
            mask, causal = None, True
        else:
            key_pos = torch.arange(seq_len, device=q.device)  # [L]
            query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)  # [query_len]
            mask, causal = key_pos[None, :] <= query_pos[:, None], False  # [query_len, L]
        k, v = _from_cache(k, q.dtype, k_scale), _from_cache(v, q.dtype, v_scale)
        attn = F.scaled_dot_product_attention(q_b, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=True)  # [heads, query_len, head_dim]
        out[start:start + query_len] = attn.transpose(0, 1)
    return out


def _decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: list[int], starts: list[int], rows: list[int], scale: float,
                  out: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    """All single-query sequences at once: gather their blocks, mask past each length."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    device = q.device
    rows_t = torch.tensor(rows, device=device)
    token_index = torch.tensor([starts[b] for b in rows], device=device)  # [B]
    lens = torch.tensor([seq_lens[b] for b in rows], device=device)  # [B]
    max_blocks = -(-max(seq_lens[b] for b in rows) // block_size)
    tables = block_tables[rows_t, :max_blocks].long().flatten()  # [B * max_blocks]
    batch = len(rows)
    # index_select on the first dim is a plain row gather, much faster on CPU than advanced indexing
    k = k_cache.index_select(0, tables).view(batch, max_blocks * block_size, num_kv_heads, head_dim)  # [B, L, kvh, D]
    v = v_cache.index_select(0, tables).view(batch, max_blocks * block_size, num_kv_heads, head_dim)
    q_b = q[token_index].reshape(batch, num_heads, 1, head_dim)  # [B, heads, 1, D]
    valid = torch.arange(max_blocks * block_size, device=device)[None, :] < lens[:, None]  # [B, L]
    k, v = _from_cache(k, q.dtype, k_scale), _from_cache(v, q.dtype, v_scale)
    attn = F.scaled_dot_product_attention(q_b, k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=valid[:, None, None, :], scale=scale,
                                          enable_gqa=True)  # [B, heads, 1, D]
    out[token_index] = attn.reshape(batch, num_heads, head_dim)


# ---------------------------------------------------------------------------------------------
# Multi-head latent attention (kernels/mla.py): a paged latent cache [num_blocks, block_size, R + P] holding
# [c_kv ‖ k_pe] per token, absorbed attention over it, and the expanded multi-head computation it stands for.


def write_latent(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scale: torch.Tensor | None = None) -> None:
    """Store [kv_c ‖ k_pe] ([T, R] and [T, P]) at flat slots of the cache [num_blocks, block_size, R + P];
    slot -1 is skipped. An fp8 cache stores x / kv_scale clamped to +-448 (one per-tensor scale, default 1)."""
    entries = torch.cat((kv_c, k_pe), dim=-1)  # [T, R + P]
    if bool((slot_mapping < 0).any()):
        valid = slot_mapping >= 0  # [T]
        slot_mapping, entries = slot_mapping[valid], entries[valid]
    cache.view(-1, cache.shape[2])[slot_mapping] = _to_cache(entries, cache.dtype, kv_scale)


def gather_latent(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, dtype: torch.dtype,
                  kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's first seq_len entries in dtype (fp8 dequantized): [seq_len, R + P]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    rows = cache.index_select(0, block_table[:num_blocks].long())  # [num_blocks, block_size, R + P]
    return _from_cache(rows.reshape(num_blocks * block_size, cache.shape[2])[:seq_len], dtype, kv_scale)


def _causal_mask(seq_len: int, query_len: int, device: torch.device) -> torch.Tensor:
    """[query_len, seq_len] bool: the queries are the last query_len of seq_len positions."""
    key_pos = torch.arange(seq_len, device=device)  # [L]
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)  # [query_len]
    return key_pos[None, :] <= query_pos[:, None]


def mla_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
                  query_lens: list[int], scale: float, kv_lora_rank: int,
                  kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA: q [T, heads, R + P] = [q_nope @ W_UK ‖ q_pe]; every head attends (causally) over its
    sequence's entries with scores scale * q . entry (all R + P values) and mixes their latent parts: returns
    [T, heads, R] (the caller applies W_UV). Sequence b's queries are the last query_lens[b] of its seq_lens[b]
    cached tokens; rows of sequences with no cached token come out zero. Decode rows run as one batch, longer
    chunks one sequence at a time. Softmax in fp32."""
    num_tokens, num_heads, _ = q.shape
    out = q.new_zeros((num_tokens, num_heads, kv_lora_rank))  # [T, heads, R]
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    chosen = [b for b in range(len(query_lens)) if seq_lens[b] > 0]
    decode_rows = [b for b in chosen if query_lens[b] == 1]
    if decode_rows:
        _mla_decode_batch(q, cache, block_tables, seq_lens, starts, decode_rows, scale, kv_lora_rank, out, kv_scale)
    for b in chosen:
        seq_len, start, query_len = seq_lens[b], starts[b], query_lens[b]
        if query_len <= 1:
            continue
        entries = gather_latent(cache, block_tables[b], seq_len, q.dtype, kv_scale)  # [L, R + P]
        q_b = q[start:start + query_len]  # [query_len, heads, R + P]
        scores = torch.einsum("qhd,ld->hql", q_b.float(), entries.float()) * scale  # [heads, query_len, L]
        scores = scores.masked_fill(~_causal_mask(seq_len, query_len, q.device), float("-inf"))
        mixed = torch.einsum("hql,lr->qhr", scores.softmax(dim=-1), entries[:, :kv_lora_rank].float())
        out[start:start + query_len] = mixed.to(q.dtype)
    return out


def _mla_decode_batch(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
                      starts: list[int], rows: list[int], scale: float, kv_lora_rank: int, out: torch.Tensor,
                      kv_scale: torch.Tensor | None) -> None:
    """All single-query sequences at once: gather their blocks, mask past each length."""
    device, block_size = q.device, cache.shape[1]
    token_index = torch.tensor([starts[b] for b in rows], device=device)  # [B]
    lens = torch.tensor([seq_lens[b] for b in rows], device=device)  # [B]
    max_blocks = -(-max(seq_lens[b] for b in rows) // block_size)
    tables = block_tables[torch.tensor(rows, device=device), :max_blocks].long().flatten()  # [B * max_blocks]
    entries = _from_cache(cache.index_select(0, tables), torch.float32, kv_scale)
    entries = entries.view(len(rows), max_blocks * block_size, cache.shape[2])  # [B, L, R + P]
    valid = torch.arange(max_blocks * block_size, device=device)[None, :] < lens[:, None]  # [B, L]
    # a slot past a sequence's length may hold anything (NaN included): zero it before the products
    entries = entries.masked_fill(~valid[..., None], 0.0)
    scores = torch.einsum("bhd,bld->bhl", q[token_index].float(), entries) * scale  # [B, heads, L]
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1)
    out[token_index] = torch.einsum("bhl,blr->bhr", probs, entries[..., :kv_lora_rank]).to(q.dtype)


def mla_expanded_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int],
                           query_lens: list[int], w_kv_b: torch.Tensor, qk_nope_head_dim: int, v_head_dim: int,
                           scale: float, kv_scale: torch.Tensor | None = None,
                           seqs: list[int] | None = None) -> torch.Tensor:
    """The multi-head computation MLA stands for: q [T, heads, Dn + P] = [q_nope ‖ q_pe]; each cached entry
    expands to per-head keys [k_nope ‖ k_pe] and values v, with [k_nope ‖ v] = c_kv @ w_kv_b^T per head
    (w_kv_b [heads * (Dn + Dv), R], kv_b_proj's layout); causal softmax(scale * q . k) mixes of v: returns
    [T, heads, Dv], rows of sequences not in seqs (None: all) zero."""
    num_tokens, num_heads, qk_dim = q.shape
    lat = w_kv_b.shape[1]
    out = q.new_zeros((num_tokens, num_heads, v_head_dim))  # [T, heads, Dv]
    start = 0
    for b, query_len in enumerate(query_lens):
        seq_len = seq_lens[b]
        if query_len == 0 or seq_len == 0 or (seqs is not None and b not in seqs):
            start += query_len
            continue
        entries = gather_latent(cache, block_tables[b], seq_len, q.dtype, kv_scale)  # [L, R + P]
        kv = F.linear(entries[:, :lat], w_kv_b).view(seq_len, num_heads, qk_nope_head_dim + v_head_dim)
        k_pe = entries[:, None, lat:].expand(seq_len, num_heads, qk_dim - qk_nope_head_dim)  # [L, heads, P]
        k = torch.cat((kv[..., :qk_nope_head_dim], k_pe), dim=-1).transpose(0, 1)  # [heads, L, Dn + P]
        v = kv[..., qk_nope_head_dim:].transpose(0, 1)  # [heads, L, Dv]
        q_b = q[start:start + query_len].transpose(0, 1)  # [heads, query_len, Dn + P]
        scores = (q_b.float() @ k.float().transpose(1, 2)) * scale  # [heads, query_len, L]
        scores = scores.masked_fill(~_causal_mask(seq_len, query_len, q.device), float("-inf"))
        out[start:start + query_len] = (scores.softmax(dim=-1) @ v.float()).transpose(0, 1).to(q.dtype)
        start += query_len
    return out


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rope on x [T, heads, P]: pair i = (x[2i], x[2i+1]) rotated by the angle of
    cos/sin [T, P] (rotate-half layout: columns i and i + P/2 hold pair i's angle). The output is in
    rotate-half order, [rotated x[2i] for all i ‖ rotated x[2i+1] for all i], as transformers' DeepSeek-V3 has it;
    q . k is the same in any order both sides share. Products rounded to x's dtype before the sums."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # [T, 1, P/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, heads, P/2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def mla_prepare(q: torch.Tensor, kv_a: torch.Tensor, kv_norm: torch.Tensor, eps: float, cos: torch.Tensor,
                sin: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                kv_scale: torch.Tensor | None = None, interleaved: bool = False) -> None:
    """One MLA layer's attention inputs: the rope part (last P dims) of q [T, heads, Dn + P] rotated in place,
    and the cache entries [rms_norm(c_kv) ‖ rope(k_pe)] of kv_a [T, R + P] (the kv_a projection's output)
    written at slot_mapping (-1 skipped). cos/sin [max_pos, P] are indexed by positions [T]; interleaved: the
    rope dims hold pairs (x[2i], x[2i+1]) (DeepSeek checkpoints), rotated into rotate-half order."""
    lat = kv_norm.shape[0]
    rope = kv_a.shape[1] - lat
    pos_cos, pos_sin = cos[positions], sin[positions]  # [T, P] each
    rotate = apply_rope_interleaved if interleaved else apply_rope
    q_pe = q[..., q.shape[-1] - rope:]  # [T, heads, P] view
    q_pe.copy_(rotate(q_pe, pos_cos, pos_sin))
    kv_c = rms_norm(kv_a[:, :lat], kv_norm, eps)  # [T, R]
    k_pe = rotate(kv_a[:, None, lat:], pos_cos, pos_sin)[:, 0]  # [T, P]
    write_latent(kv_c, k_pe, cache, slot_mapping, kv_scale)


# --------------------------------------------------------------------------------------------
# FP8 (e4m3): quantization, dequantization and the linear layer, as the Triton kernels and cuBLASLt compute them

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_AMAX = 1e-10  # an all-zero row or group still gets a positive scale (it quantizes to zeros)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale, clamped to +-448, cast to e4m3 (round to nearest even); scale broadcasts against x."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                      block_ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks block_ids [n] of an e4m3 cache pair [N, bs, kv_heads, D] as (e4m3 * scale).to(dtype): [n, bs, kv_heads,
    D] each (kv_cache.dequantize_blocks)."""
    ids = block_ids.long()
    return ((k_cache[ids].float() * k_scale).to(dtype), (v_cache[ids].float() * v_scale).to(dtype))


def quantize_fp8_rows(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row (per-token, per-output-channel) scales, or per row and group of group_size columns:
    x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1] or [M, ceil(K / group_size)]); x ~= q * scale."""
    num_rows, k = x.shape
    if group_size is None:
        amax = x.float().abs().amax(dim=1, keepdim=True)  # [M, 1]
        scale = amax.clamp(min=FP8_MIN_AMAX) / FP8_MAX
        return quantize_fp8(x, scale), scale
    num_groups = -(-k // group_size)
    padded = F.pad(x.float(), (0, num_groups * group_size - k)).view(num_rows, num_groups, group_size)
    scale = padded.abs().amax(dim=2).clamp(min=FP8_MIN_AMAX) / FP8_MAX  # [M, G]
    return quantize_fp8(x, expand_group_scales(scale, k, group_size)), scale


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per block of block[0] rows x block[1] columns (DeepSeek / Qwen FP8 checkpoints):
    w [N, K] -> (e4m3 [N, K], fp32 scales [ceil(N / bn), ceil(K / bk)]); w ~= q * scale of its block."""
    (n, k), (bn, bk) = w.shape, block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    scale = padded.abs().amax(dim=(1, 3)).clamp(min=FP8_MIN_AMAX) / FP8_MAX  # [nb, kb]
    full = expand_group_scales(scale.repeat_interleave(bn, dim=0)[:n], k, bk)  # [N, K]
    return quantize_fp8(w, full), scale


def expand_group_scales(scale: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """[M, ceil(K / g)] -> [M, K]: each column gets its group's scale."""
    return scale.repeat_interleave(group_size, dim=1)[:, :k]


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """e4m3 [M, K] with scales [M, 1] (per row) or [M, ceil(K / g)] (per row and group) -> fp32 [M, K]."""
    if group_size is not None:
        scale = expand_group_scales(scale, q.shape[1], group_size)
    return q.float() * scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T with W e4m3 [N, K] and fp32 scales [N, 1] or [N, ceil(K / g)]: x [..., K] is quantized
    dynamically (per token, or per token and group of g columns when group_size is set), both sides are
    dequantized and multiplied in fp32. Returns [..., N] in x's dtype."""
    k = weight.shape[1]
    x2 = x.reshape(-1, k)  # [M, K]
    x_q, x_scale = quantize_fp8_rows(x2, group_size)
    out = dequantize_fp8(x_q, x_scale, group_size) @ dequantize_fp8(weight, weight_scale, group_size).t()  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_weight_only_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           group_size: int | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only FP8 (W8A16): y = x @ (W * scale)^T in fp32 with x as it is (no activation quantization);
    W e4m3 [N, K], scales [N, 1] or [N, ceil(K / g)]. Returns [..., N] in x's dtype."""
    k = weight.shape[1]
    out = x.reshape(-1, k).float() @ dequantize_fp8(weight, weight_scale, group_size).t()  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def pow2_act_scales(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with amax / s <= 448 (amax clamped to at least FP8_MIN_AMAX), fp32."""
    mantissa, exponent = torch.frexp(amax.float().clamp(min=FP8_MIN_AMAX))  # amax = mantissa * 2^exponent, [0.5, 1)
    scale_exp = exponent - 9 + (2 * mantissa > FP8_MAX / 256).int()  # 2 * mantissa in [1, 2); 448 = 1.75 * 2^8
    return torch.ldexp(torch.ones_like(mantissa), scale_exp)


def fp8_act_tile_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int | None,
                        act_group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 with the activations quantized per row and act_group columns (the weight-only kernel's act_fp8 tiles,
    act_group = their BLOCK_K): W e4m3 [N, K] with scales [N, 1] or [N, ceil(K / g)]; both sides dequantized and
    multiplied in fp32. The scales are powers of two (pow2_act_scales), so scaling is exact. Returns [..., N] in
    x's dtype."""
    k = weight.shape[1]
    x2 = x.reshape(-1, k).float()  # [M, K]
    groups = -(-k // act_group)
    padded = F.pad(x2, (0, groups * act_group - k)).view(-1, groups, act_group)
    x_scale = pow2_act_scales(padded.abs().amax(dim=2))  # [M, G]
    x_q = quantize_fp8(x2, expand_group_scales(x_scale, k, act_group))
    out = dequantize_fp8(x_q, x_scale, act_group) @ dequantize_fp8(weight, weight_scale, group_size).t()  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_matmul(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               group_size: int | None, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMM of fp8_linear on already quantized activations: x_q e4m3 [M, K] with scales [M, 1 or G] ->
    [M, N] out_dtype."""
    out = dequantize_fp8(x_q, x_scale, group_size) @ dequantize_fp8(weight, weight_scale, group_size).t()  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def add_rms_norm_quant_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rms_norm, then per-token FP8 quantization of the normed rows: (e4m3 [T, D], scales [T, 1], summed)."""
    normed, summed = add_rms_norm(x, residual, weight, eps)
    q, scale = quantize_fp8_rows(normed)
    return q, scale, summed


def add_rms_norm_parts_quant_fp8(parts: torch.Tensor, dtype: torch.dtype, residual: torch.Tensor,
                                 weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """add_rms_norm_quant_fp8 of x = the fp32 sum over S of parts [S, T, D] (in order) rounded to dtype."""
    x = parts[0].float()  # [T, D]
    for part in parts[1:]:
        x = x + part.float()
    return add_rms_norm_quant_fp8(x.to(dtype), residual, weight, eps)


def silu_and_mul_quant_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul, then per-token FP8 quantization: (e4m3 [T, I], scales [T, 1])."""
    return quantize_fp8_rows(silu_and_mul(gate_up))


# ---------------------------------------------------------------------------------------------
# sampling (kernels/sampling.py): the fused logits pass, the token bitmask, the truncation thresholds
# and the Gumbel-max draw. These are also the worker's CPU path.
#
# Counter-based noise: a pure function of (seed, offset, vocab id), so a seeded request draws the same
# token whatever else shares its batch, and no torch.Generator per row is needed. Values are 32-bit
# words held in int64 (a product may wrap past 2^63; its low 32 bits stay exact) and every shift sees
# x >= 0. The [B, V] work runs in place (trailing underscore): fresh [B, V] temporaries cost ~3x on CPU.

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9  # odd: spreads consecutive vocab ids over the whole 32-bit range
ROW_KEY_SALT = 0x5BD1E995
UNIFORM_SCALE = 2.0**-24  # 24-bit odd numerators give u in (0, 1), exact in float32


def mul32_(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x = x * constant mod 2^32 in place, for x and constant in [0, 2^32). The int64 product may wrap
    (two's complement, as every torch backend computes it), which leaves its low 32 bits exact."""
    return x.mul_(constant).bitwise_and_(MASK32)


def mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons) in place: a bijective 32-bit finaliser with near-ideal avalanche."""
    x ^= x >> 16
    mul32_(x, 0x7FEB352D)
    x ^= x >> 15
    mul32_(x, 0x846CA68B)
    x ^= x >> 16
    return x


def row_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row [B] absorbing all 63 seed bits and the offset, word by word."""
    key = mix32_((offsets >> 32) ^ ROW_KEY_SALT)  # [B]
    key = mix32_(key ^ (offsets & MASK32))  # [B]
    key = mix32_(key ^ (seeds >> 32))  # [B]
    return mix32_(key ^ (seeds & MASK32))  # [B]


def uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u [B, V] float32 strictly inside (0, 1), a hash of (seed, offset, vocab id)."""
    vocab_ids = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [V]
    vocab_words = mul32_(vocab_ids, GOLDEN32)  # [V]
    # The golden-ratio spread makes two rows' XOR-keyed inputs almost never coincide inside [0, V).
    bits = mix32_(row_keys(seeds, offsets).unsqueeze(1) ^ vocab_words.unsqueeze(0))  # [B, V] in [0, 2^32)
    return _uniform_from_bits(bits)  # [B, V]


def _uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    numerators = bits.bitwise_right_shift_(8).bitwise_or_(1)  # odd in [1, 2^24): exact in float32
    return numerators.float().mul_(UNIFORM_SCALE)  # never 0 or 1


def gumbel_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, V]: argmax(logits + noise) samples from softmax(logits)."""
    return uniform_noise(seeds, offsets, vocab_size).log_().neg_().log_().neg_()  # [B, V] = -log(-log u)


def gumbel_noise_at(keys: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """gumbel_noise's values at single (row, id) points: keys [N] (row_keys of each point's row) and
    vocab_ids [N] int64 -> [N] float32, bit for bit the [B, V] noise's entries."""
    bits = mix32_(keys ^ mul32_(vocab_ids.clone(), GOLDEN32))  # [N] in [0, 2^32)
    return _uniform_from_bits(bits).log_().neg_().log_().neg_()  # [N]


def token_bitmask_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 words -> [B, V] bool: bit j of word w allows token 32 * w + j."""
    vocab_ids = torch.arange(vocab_size, device=bitmask.device)  # [V]
    words = bitmask[:, vocab_ids // 32]  # [B, V] int32
    return ((words >> (vocab_ids % 32).to(torch.int32)) & 1).bool()  # [B, V]; >> is arithmetic, & 1 is not


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """-inf where a row's bitmask disallows a token, for the rows flagged in `rows` [B] bool (None: all);
    returns a new tensor like logits [B, V]."""
    disallowed = ~token_bitmask_allowed(bitmask, logits.shape[1])  # [B, V]
    if rows is not None:
        disallowed &= rows.unsqueeze(1)
    return logits.masked_fill(disallowed, float("-inf"))  # [B, V]


def process_logits(logits: torch.Tensor, output_counts: torch.Tensor | None, prompt_mask: torch.Tensor | None,
                   presence: torch.Tensor | None, frequency: torch.Tensor | None, repetition: torch.Tensor | None,
                   bitmask: torch.Tensor | None = None, bitmask_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The fused pass of kernels/sampling.py: repetition (over prompt + output tokens), frequency and
    presence penalties on the raw logits, then the grammar bitmask. logits [B, V]; output_counts [B, V]
    (any number type) and prompt_mask [B, V] bool, already gathered for the batch rows. Returns new fp32 [B, V]."""
    out = logits.float()  # [B, V]; a new tensor unless logits is fp32
    if repetition is not None:
        assert output_counts is not None
        seen = output_counts > 0  # [B, V] bool
        if prompt_mask is not None:
            seen |= prompt_mask
        penalty = repetition.unsqueeze(1)  # [B, 1]
        out = torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out)  # [B, V]
    if frequency is not None:
        assert output_counts is not None
        out = out - frequency.unsqueeze(1) * output_counts.float()  # [B, V]
    if presence is not None:
        assert output_counts is not None
        out = out - presence.unsqueeze(1) * (output_counts > 0).float()  # [B, V]
    if bitmask is not None:
        out = apply_token_bitmask(out, bitmask, bitmask_rows)  # [B, V]
    if out is logits:
        out = out.clone()
    return out


def truncation_thresholds(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                          top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """Per-row threshold [B] fp32 on the processed logits [B, V]: a row keeps exactly the tokens whose
    logit is >= its threshold (-inf: all). Sort-based. The rule (ties at the threshold are all kept):
      top-k: the k-th largest logit (k <= 0: off);
      min-p: max_logit + T * log(min_p), i.e. prob >= min_p * max_prob (0: off);
      top-p (after both, vLLM V1's order): over the tokens top-k and min-p keep, with probabilities
        softmax(logit / T), the logit of the m-th largest token where m is the smallest count whose mass
        reaches top_p (1.0: off);
    the row's threshold is the largest of these. Greedy rows (T = 0) use T = 1 here."""
    num_rows, vocab_size = logits.shape
    temperature = torch.where(temperature == 0.0, 1.0, temperature)  # [B]
    threshold = torch.full((num_rows,), float("-inf"), device=logits.device)  # [B]
    if top_k is None and top_p is None and min_p is None:
        return threshold
    ordered = logits.sort(dim=-1, descending=True).values  # [B, V]
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab_size, top_k).clamp(1, vocab_size)  # [B]
        kth = ordered.gather(1, (k - 1).unsqueeze(1)).squeeze(1)  # [B]
        threshold = torch.where(top_k > 0, kth, threshold)  # [B]
    if min_p is not None:
        mth = ordered[:, 0] + temperature * torch.log(min_p)  # [B]; log 0 = -inf keeps all
        threshold = torch.maximum(threshold, mth)  # [B]
    if top_p is not None:
        kept = ordered.masked_fill(ordered < threshold.unsqueeze(1), float("-inf"))  # [B, V]
        cum_probs = (kept / temperature.unsqueeze(1)).softmax(dim=-1).cumsum(dim=-1)  # [B, V]
        m = (cum_probs < top_p.unsqueeze(1)).sum(dim=-1).clamp(max=vocab_size - 1)  # [B]: 0-based index of m-th
        pth = kept.gather(1, m.unsqueeze(1)).squeeze(1)  # [B]
        threshold = torch.where(top_p < 1.0, torch.maximum(threshold, pth), threshold)  # [B]
    return threshold


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, threshold: torch.Tensor | None,
                  seeds: torch.Tensor, offsets: torch.Tensor, greedy: torch.Tensor | None) -> torch.Tensor:
    """Token ids [B] int64: the argmax of logits [B, V] for greedy rows ([B] bool, None: none), otherwise
    argmax(logits / T + Gumbel(seed, offset, id)) over the tokens with logit >= threshold [B]."""
    temperature = torch.where(temperature == 0.0, 1.0, temperature)  # [B]; greedy rows are replaced below
    token_ids = _kept_gumbel_argmax(logits, temperature, threshold, seeds, offsets)  # [B] or None
    if token_ids is None:
        scaled = logits / temperature.unsqueeze(1)  # [B, V]
        if threshold is not None:
            scaled.masked_fill_(logits < threshold.unsqueeze(1), float("-inf"))
        noise = gumbel_noise(seeds, offsets, logits.shape[1])  # [B, V]
        token_ids = noise.add_(scaled).argmax(dim=-1)  # [B] int64
    if greedy is not None:
        token_ids = torch.where(greedy, logits.argmax(dim=-1), token_ids)  # [B]
    return token_ids


KEPT_DRAW_MAX_FRACTION = 0.25  # the draw over kept ids only while they are at most this share of [B, V]


def _kept_gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, threshold: torch.Tensor | None,
                        seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | None:
    """gumbel_argmax's sampled ids [B] from the kept ids alone (logit >= threshold; a top-p nucleus is a few
    hundred of a 49k vocabulary): their noise and scores only, instead of ~20 passes of 64-bit hashing over
    [B, V] (most of a CPU decode step's sampling). Same floats and ties (the smallest id of a row's maximum) as
    the dense draw; None where it does not pay (no threshold, a wide kept set) or a row holds a NaN score."""
    if threshold is None:
        return None
    num_rows = logits.shape[0]
    kept = ~(logits < threshold.unsqueeze(1))  # [B, V]: the dense draw's unmasked entries (NaN ones too)
    if int(kept.sum()) > KEPT_DRAW_MAX_FRACTION * kept.numel():
        return None
    rows, vocab_ids = kept.nonzero(as_tuple=True)  # [N] each
    noise = gumbel_noise_at(row_keys(seeds, offsets)[rows], vocab_ids)  # [N]
    scores = noise.add_(logits[rows, vocab_ids] / temperature[rows])  # [N]: the dense draw's entries
    if bool(scores.isnan().any()):
        return None  # argmax's NaN rule (the first NaN wins) is the dense path's to keep
    best = torch.full((num_rows,), float("-inf"), device=logits.device)  # [B]
    best = best.scatter_reduce(0, rows, scores, "amax")  # [B]
    vocab_size = logits.shape[1]
    at_best = torch.where(scores == best[rows], vocab_ids, vocab_size)  # [N]
    token_ids = torch.full((num_rows,), vocab_size, dtype=torch.int64, device=logits.device)  # [B]
    token_ids = token_ids.scatter_reduce(0, rows, at_best, "amin")  # [B]
    if bool((token_ids == vocab_size).any()):
        return None  # a row kept nothing: never with a threshold from these logits
    return token_ids


def route_grouped_topk(router_logits: torch.Tensor, top_k: int, scoring_func: str, topk_method: str,
                       num_groups: int, topk_groups: int, correction_bias: torch.Tensor | None, renormalize: bool,
                       routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeekMoE routing token by token, as DeepSeek-V2 / V3 describe it (kernels/moe.route_grouped_topk is the
    batched form): scores (softmax or sigmoid), choice scores (+ bias), the allowed groups, the k best allowed
    experts by choice score, their scores as weights (renormalised if asked) times the scaling factor. Returns
    (weights [T, k] fp32, ids [T, k] int32), experts in descending choice order."""
    num_tokens, num_experts = router_logits.shape
    group_size = num_experts // num_groups
    all_weights, all_ids = [], []
    for logits in router_logits.float():
        scores = logits.sigmoid() if scoring_func == "sigmoid" else logits.softmax(dim=-1)  # [E]
        choice = (scores + correction_bias.float() if correction_bias is not None else scores).tolist()
        allowed = list(range(num_experts))
        if topk_method != "greedy":
            members = [sorted(choice[g * group_size:(g + 1) * group_size], reverse=True) for g in range(num_groups)]
            rank = [sum(m[:2]) if topk_method == "noaux_tc" else m[0] for m in members]  # [G]
            best_groups = sorted(range(num_groups), key=lambda g: rank[g], reverse=True)[:topk_groups]
            allowed = [e for e in allowed if e // group_size in best_groups]
        chosen = sorted(allowed, key=lambda e: choice[e], reverse=True)[:top_k]
        weights = scores[chosen]  # [k]
        if renormalize:
            weights = weights / (weights.sum() + 1e-20)
        all_weights.append(weights * routed_scaling_factor)
        all_ids.append(chosen)
    return torch.stack(all_weights), torch.tensor(all_ids, dtype=torch.int32)


def moe_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, w_gate_up_scale: torch.Tensor | None = None,
                w_down_scale: torch.Tensor | None = None, group_k: int | None = None) -> torch.Tensor:
    """Mixture of experts, one expert at a time as Hugging Face computes it: x [T, H], w_gate_up [E, 2I, H],
    w_down [E, H, I], topk_weights [T, k] fp32, topk_ids [T, k] -> [T, H] in x's dtype. Each expert's output is
    rounded to x's dtype before its routing weight scales it; the k outputs of a token are summed in fp32.
    FP8 weights: e4m3 with scales [E, rows, K / group_k] (group_k None: one scale per row)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    ids = topk_ids.long()
    for expert in ids.unique().tolist():
        token_idx, slot = torch.where(ids == expert)  # [n] each
        gate_up = _expert_weight(w_gate_up, w_gate_up_scale, expert, group_k, x.dtype)  # [2I, H]
        down = _expert_weight(w_down, w_down_scale, expert, group_k, x.dtype)  # [H, I]
        hidden = silu_and_mul(F.linear(x[token_idx], gate_up))  # [n, I]
        y = F.linear(hidden, down)  # [n, H]
        out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, slot, None])
    return out.to(x.dtype)


def moe_experts_act_fp8(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w_gate_up_scale: torch.Tensor, w_down_scale: torch.Tensor,
                        group_k: int | None, act_group_up: int, act_group_down: int) -> torch.Tensor:
    """moe_experts with W8A8 experts (the grouped GEMM's act_fp8): each GEMM's activation quantized per row and
    act_group columns (fp8_act_tile_linear, the kernel's BLOCK_K of that GEMM), e4m3 weights with their scales."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    ids = topk_ids.long()
    for expert in ids.unique().tolist():
        token_idx, slot = torch.where(ids == expert)  # [n] each
        gate_up = fp8_act_tile_linear(x[token_idx], w_gate_up[expert], w_gate_up_scale[expert], group_k,
                                      act_group_up)  # [n, 2I]
        hidden = silu_and_mul(gate_up)  # [n, I]
        y = fp8_act_tile_linear(hidden, w_down[expert], w_down_scale[expert], group_k, act_group_down)  # [n, H]
        out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, slot, None])
    return out.to(x.dtype)


def moe_experts_w8a8_rows(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                          topk_ids: torch.Tensor, w_gate_up_scale: torch.Tensor,
                          w_down_scale: torch.Tensor) -> torch.Tensor:
    """moe_experts with W8A8 experts as the FP8 gmm path (moe._fused_experts_gmm_fp8) computes them: each GEMM's
    activation quantized per row (amax / 448: quantize_fp8_rows; the intermediate by silu_and_mul_quant_fp8), e4m3
    weights with per-row scales [E, rows, 1], each GEMM's output rounded to x's dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    ids = topk_ids.long()
    for expert in ids.unique().tolist():
        token_idx, slot = torch.where(ids == expert)  # [n] each
        x_q, x_scale = quantize_fp8_rows(x[token_idx])  # [n, H], [n, 1]
        gate_up = fp8_matmul(x_q, x_scale, w_gate_up[expert], w_gate_up_scale[expert], None, x.dtype)  # [n, 2I]
        act_q, act_scale = silu_and_mul_quant_fp8(gate_up)  # [n, I], [n, 1]
        y = fp8_matmul(act_q, act_scale, w_down[expert], w_down_scale[expert], None, x.dtype)  # [n, H]
        out.index_add_(0, token_idx, y.float() * topk_weights[token_idx, slot, None])
    return out.to(x.dtype)


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, expert: int, group_k: int | None,
                   dtype: torch.dtype) -> torch.Tensor:
    if w.dtype != torch.float8_e4m3fn:
        return w[expert]
    assert scale is not None
    return dequantize_fp8(w[expert], scale[expert], group_k).to(dtype)


def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """cache [planes, num_blocks, ...]: block src[i] -> dst[i] [N] in every plane, pairs with src == dst skipped
    (kernels/block_copy.py). Every source is read before any destination is written."""
    moved = src != dst  # [N]
    cache[:, dst[moved]] = cache[:, src[moved]]


def combine_top_k(o: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """kernels/moe.combine_top_k: o [rows, H], positions [T * k] (each pair's row of o), weights [T * k] fp32 ->
    [T, H]: each weighted row rounded to o's dtype, the k of a token summed in fp32, rounded once."""
    products = (o[positions.long()].float() * weights[:, None]).to(o.dtype)  # [T * k, H]
    return products.view(-1, top_k, o.shape[1]).float().sum(dim=1).to(o.dtype)  # [T, H]
