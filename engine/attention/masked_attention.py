"""Attention with a sliding window, logit soft-capping or a score scale of its own, in torch,
over the step's CSR page table (the native kernels run plain causal attention only).

A query at position ``p`` under a window ``w`` sees keys ``p - w < j <= p`` (as transformers
masks them); tokens before the window are never read, whether they were computed in this step,
earlier, or come from the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

from engine.attention.backend import LayerAttention
from engine.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class _Chunk:
    """Query rows ``q_start:q_end`` (one sequence) attend over the flat-cache rows of K in
    ``head_rows[0]`` (V in ``head_rows[1]``) where ``mask`` allows."""

    q_start: int
    q_end: int
    head_rows: torch.Tensor  # [2, num_kv_heads, num_keys] int64 rows of the cache as [-1, dim]
    mask: torch.Tensor  # [qo_len, num_keys] bool, True where attention is allowed


@dataclass(slots=True)
class MaskedPlan:
    """A step's sequences for one window size: decodes padded into one batch, chunks apart."""

    decode_rows: torch.Tensor  # [num_decodes] int64 rows of the batch that are decodes
    decode_heads: torch.Tensor | None  # [2, num_decodes, num_kv_heads, max_keys] int64
    decode_bias: torch.Tensor | None  # [num_decodes, 1, 1, max_keys] float32: 0 or -inf
    chunks: list[_Chunk]


def _key_rows(
    pages: list[int], start: int, end: int, page_size: int, kv_heads: int
) -> torch.Tensor:
    """K/V rows (``[2, kv_heads, end - start]``) of token positions ``start:end`` of ``pages``."""
    pos = torch.arange(start, end)
    table = torch.tensor(pages, dtype=torch.int64)
    k_rows = table[pos // page_size] * (2 * page_size) + pos % page_size  # [len]
    heads = torch.arange(kv_heads)[:, None]
    k = k_rows[None, :] * kv_heads + heads  # [kv_heads, len]
    return torch.stack((k, k + page_size * kv_heads))


def plan_masked(meta: AttentionMetadata, window: int | None, num_kv_heads: int) -> MaskedPlan:
    """Which keys each query of the step sees under ``window`` (None: all before it)."""
    ps = meta.page_size
    qo_indptr = meta.qo_indptr.tolist()
    kv_indptr = meta.kv_indptr.tolist()
    page_ids = meta.kv_indices.tolist()
    decode_rows: list[int] = []
    decode_keys: list[torch.Tensor] = []
    chunks: list[_Chunk] = []
    for i, (qo_len, kv_len) in enumerate(zip(meta.qo_lens, meta.kv_lens, strict=True)):
        pages = page_ids[kv_indptr[i] : kv_indptr[i + 1]]
        first_query = kv_len - qo_len
        lo = 0 if window is None else max(0, first_query - window + 1)
        rows = _key_rows(pages, lo, kv_len, ps, num_kv_heads)
        if qo_len == 1:
            decode_rows.append(qo_indptr[i])
            decode_keys.append(rows)
            continue
        q_pos = torch.arange(first_query, kv_len)[:, None]
        k_pos = torch.arange(lo, kv_len)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        chunks.append(_Chunk(qo_indptr[i], qo_indptr[i + 1], rows, mask))
    heads = bias = None
    if decode_keys:
        longest = max(r.shape[-1] for r in decode_keys)
        # Padded with row 0 of the cache, masked out by the bias.
        heads = torch.stack(
            [torch.nn.functional.pad(r, (0, longest - r.shape[-1])) for r in decode_keys], dim=1
        )
        lens = torch.tensor([r.shape[-1] for r in decode_keys])
        valid = torch.arange(longest)[None, :] < lens[:, None]  # [num_decodes, longest]
        bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))[:, None, None, :]
    device = meta.slot_mapping.device
    return MaskedPlan(
        torch.tensor(decode_rows, dtype=torch.int64, device=device),
        None if heads is None else heads.to(device),
        None if bias is None else bias.to(device),
        [_Chunk(c.q_start, c.q_end, c.head_rows.to(device), c.mask.to(device)) for c in chunks],
    )


def _gather(kv_cache: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
    """``[2, ..., kv_heads, len, head_dim]`` K and V of ``head_rows`` in one gather."""
    head_dim = kv_cache.shape[-1]
    kv = kv_cache.view(-1, head_dim).index_select(0, head_rows.reshape(-1))
    return kv.view(*head_rows.shape, head_dim)


def _softmax_attention(
    q: torch.Tensor,  # [units, kv_heads, rows, head_dim]
    k: torch.Tensor,  # [units, kv_heads, keys, head_dim]
    v: torch.Tensor,  # [units, kv_heads, keys, head_dim]
    bias: torch.Tensor,  # broadcastable to [units, kv_heads, rows, keys] float32: 0 or -inf
    layer: LayerAttention,
) -> torch.Tensor:  # [units, kv_heads, rows, head_dim]
    # The reference's order: scale, soft-cap, mask, softmax in float32.
    scores = torch.matmul(q, k.transpose(-1, -2)).float()
    scores = scores * (q.shape[-1] ** -0.5 if layer.scale is None else layer.scale)
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    probs = (scores + bias).softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def masked_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim], K/V written
    plan: MaskedPlan,
    layer: LayerAttention,
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[-2]
    group = num_heads // num_kv_heads
    out = q.new_empty(q.shape)
    if plan.decode_heads is not None and plan.decode_bias is not None:
        n = plan.decode_rows.shape[0]
        qd = q.index_select(0, plan.decode_rows).view(n, num_kv_heads, group, head_dim)
        k, v = _gather(kv_cache, plan.decode_heads).unbind(0)  # [n, kv_heads, keys, dim]
        attended = _softmax_attention(qd, k, v, plan.decode_bias, layer)
        out[plan.decode_rows] = attended.reshape(n, num_heads, head_dim)
    for chunk in plan.chunks:
        qo = chunk.q_end - chunk.q_start
        qc = q[chunk.q_start : chunk.q_end].transpose(0, 1)  # [heads, qo, dim]
        k, v = _gather(kv_cache, chunk.head_rows).unbind(0)  # [kv_heads, keys, dim]
        if layer.softcap is None:
            attended = scaled_dot_product_attention(
                qc[None], k[None], v[None], attn_mask=chunk.mask, scale=layer.scale, enable_gqa=True
            )[0]  # [heads, qo, dim]
        else:
            bias = torch.zeros(chunk.mask.shape, device=q.device)
            bias.masked_fill_(~chunk.mask, float("-inf"))
            qg = qc.reshape(num_kv_heads, group * qo, head_dim)
            attended = _softmax_attention(qg[None], k[None], v[None], bias.repeat(group, 1), layer)
            attended = attended.view(num_heads, qo, head_dim)
        out[chunk.q_start : chunk.q_end] = attended.transpose(0, 1)
    return out
