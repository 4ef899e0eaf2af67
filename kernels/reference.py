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
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, kv_heads, head_dim] at flat slots (block_id * block_size + offset) of the caches
    [num_blocks, block_size, kv_heads, head_dim]. Slot -1 means padding: skipped."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if bool((slot_mapping < 0).any()):
        valid = slot_mapping >= 0  # [T]
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    k_cache.view(num_slots, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(num_slots, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first seq_len cached rows: [seq_len, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    rows = cache.index_select(0, block_table[:num_blocks].long())  # [num_blocks, block_size, kv_heads, head_dim]
    return rows.reshape(num_blocks * block_size, *cache.shape[2:])[:seq_len]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: list[int], query_lens: list[int], scale: float,
                    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of a flattened batch of query chunks over paged K/V (GQA aware).

    q [T, heads, head_dim], T = sum(query_lens); sequence b's queries are the last query_lens[b] of
    its seq_lens[b] tokens, whose K/V are already in the caches. Returns [T, heads, head_dim].
    Single-token queries (decode) run as one batch; longer chunks run one sequence at a time.
    fresh_kv: this step's k, v [T, kv_heads, head_dim] (already in the caches): a chunk with no cached
    prefix attends to them directly instead of gathering its blocks back.
    """
    out = torch.empty_like(q)  # [T, heads, head_dim]
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    decode_rows = [b for b, query_len in enumerate(query_lens) if query_len == 1]
    if decode_rows:
        _decode_batch(q, k_cache, v_cache, block_tables, seq_lens, starts, decode_rows, scale, out)
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
        attn = F.scaled_dot_product_attention(q_b, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=True)  # [heads, query_len, head_dim]
        out[start:start + query_len] = attn.transpose(0, 1)
    return out


def _decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: list[int], starts: list[int], rows: list[int], scale: float,
                  out: torch.Tensor) -> None:
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
    attn = F.scaled_dot_product_attention(q_b, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                                          attn_mask=valid[:, None, None, :], scale=scale,
                                          enable_gqa=True)  # [B, heads, 1, D]
    out[token_index] = attn.reshape(batch, num_heads, head_dim)
