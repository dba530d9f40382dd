"""Paged attention in plain torch for CPU: decodes batched in one padded matmul, chunks apart.

It reads exactly the shared CSR page table. Everything that depends only on the step (slot
indices, decode gather index and mask, each chunk's causal mask) is built once in ``plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class _Chunk:
    """A prefill chunk of one sequence (qo_len > 1)."""

    q_start: int
    q_end: int
    fresh: bool  # no prefix in the cache: attend over this step's own K/V, plain causal
    k_rows: torch.Tensor  # [kv_len] int64 rows of the flat cache holding K (V is + page_size)
    mask: torch.Tensor | None  # [qo_len, kv_len] bool, True where attention is allowed


@dataclass(slots=True)
class _Plan:
    page_size: int
    write_rows: torch.Tensor  # [num_tokens] int64 flat-cache rows of the new tokens' K
    decode_rows: torch.Tensor  # [num_decodes] int64 rows of the batch that are decodes
    decode_k_rows: torch.Tensor  # [num_decodes, max_kv_len] int64 flat-cache rows of K
    decode_bias: torch.Tensor  # [num_decodes, 1, 1, max_kv_len] float32: 0 or -inf (padding)
    chunks: list[_Chunk]


class TorchAttentionBackend(AttentionBackend):
    """CPU backend over the shared layout ``[num_pages, 2, page_size, num_kv_heads, head_dim]``."""

    name = "torch"

    def __init__(self) -> None:
        self._plan: _Plan | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        ps = meta.page_size
        device = meta.slot_mapping.device
        # Flat view of a layer's cache is [num_pages * 2 * page_size, kv_heads, head_dim]:
        # K of slot s (page p, offset o) sits at row p * 2 * ps + o, its V at that row + ps.
        slots = meta.slot_mapping.to(torch.int64)
        write_rows = (slots // ps) * (2 * ps) + slots % ps
        qo_indptr = meta.qo_indptr.tolist()
        kv_indptr = meta.kv_indptr.tolist()
        pages = meta.kv_indices.to(torch.int64)
        decode_seqs = [i for i, n in enumerate(meta.qo_lens) if n == 1]
        chunks = [
            self._plan_chunk(meta, i, qo_indptr, kv_indptr, pages)
            for i, n in enumerate(meta.qo_lens)
            if n > 1
        ]
        decode_rows = torch.tensor([qo_indptr[i] for i in decode_seqs], dtype=torch.int64)
        if decode_seqs:
            kv_lens = torch.tensor([meta.kv_lens[i] for i in decode_seqs], dtype=torch.int64)
            max_pages = max(kv_indptr[i + 1] - kv_indptr[i] for i in decode_seqs)
            page_table = torch.zeros(len(decode_seqs), max_pages, dtype=torch.int64)
            for row, i in enumerate(decode_seqs):
                seq_pages = pages[kv_indptr[i] : kv_indptr[i + 1]]
                page_table[row, : seq_pages.shape[0]] = seq_pages
            offsets = torch.arange(ps, dtype=torch.int64)
            # [num_decodes, max_pages, page_size] -> [num_decodes, max_kv_len]
            rows = (page_table[:, :, None] * (2 * ps) + offsets).flatten(1)
            max_kv = int(kv_lens.max())
            decode_k_rows = rows[:, :max_kv].contiguous()
            valid = torch.arange(max_kv)[None, :] < kv_lens[:, None]  # [num_decodes, max_kv]
            bias = torch.zeros(valid.shape, dtype=torch.float32)
            bias.masked_fill_(~valid, float("-inf"))
            decode_bias = bias[:, None, None, :]
        else:
            decode_k_rows = torch.zeros(0, 0, dtype=torch.int64)
            decode_bias = torch.zeros(0, 1, 1, 0)
        self._plan = _Plan(
            page_size=ps,
            write_rows=write_rows,
            decode_rows=decode_rows.to(device),
            decode_k_rows=decode_k_rows.to(device),
            decode_bias=decode_bias.to(device),
            chunks=chunks,
        )

    @staticmethod
    def _plan_chunk(
        meta: AttentionMetadata,
        i: int,
        qo_indptr: list[int],
        kv_indptr: list[int],
        pages: torch.Tensor,
    ) -> _Chunk:
        ps = meta.page_size
        qo_len, kv_len = meta.qo_lens[i], meta.kv_lens[i]
        seq_pages = pages[kv_indptr[i] : kv_indptr[i + 1]]
        k_rows = (seq_pages[:, None] * (2 * ps) + torch.arange(ps, device=pages.device)).flatten()
        fresh = qo_len == kv_len
        mask = None
        if not fresh:
            # Query i sits at position kv_len - qo_len + i and sees keys up to that position.
            q_pos = torch.arange(kv_len - qo_len, kv_len, device=pages.device)[:, None]
            mask = torch.arange(kv_len, device=pages.device)[None, :] <= q_pos
        return _Chunk(qo_indptr[i], qo_indptr[i + 1], fresh, k_rows[:kv_len], mask)

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
        plan = self._plan
        if plan is None:
            raise RuntimeError("plan() must run before forward()")
        num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
        flat = kv_cache.view(-1, num_kv_heads, head_dim)  # [num_pages * 2 * page_size, kvh, d]
        flat.index_copy_(0, plan.write_rows, k)
        flat.index_copy_(0, plan.write_rows + plan.page_size, v)
        if not plan.chunks:  # a pure decode step: every row is a decode, in order
            return self._decode(q, flat, plan)
        out = torch.empty_like(q)
        if plan.decode_rows.numel():
            out[plan.decode_rows] = self._decode(q[plan.decode_rows], flat, plan)
        for chunk in plan.chunks:
            qs = q[chunk.q_start : chunk.q_end]
            if chunk.fresh:
                ks, vs = k[chunk.q_start : chunk.q_end], v[chunk.q_start : chunk.q_end]
            else:
                ks = flat.index_select(0, chunk.k_rows)
                vs = flat.index_select(0, chunk.k_rows + plan.page_size)
            out[chunk.q_start : chunk.q_end] = _sdpa_chunk(qs, ks, vs, chunk.mask)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, flat: torch.Tensor, plan: _Plan) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = flat.shape[1]
        group = num_heads // num_kv_heads
        max_kv = plan.decode_k_rows.shape[1]
        rows = plan.decode_k_rows.view(-1)
        keys = flat.index_select(0, rows).view(num_seqs, max_kv, num_kv_heads, head_dim)
        values = flat.index_select(0, rows + plan.page_size).view(keys.shape)
        # Query heads of one KV group share its keys: [seqs, kv_heads, group, head_dim].
        qg = q.view(num_seqs, num_kv_heads, group, head_dim)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1))  # [seqs, kv_heads, group, max_kv]
        scores = scores.float() * (head_dim**-0.5) + plan.decode_bias
        probs = scores.softmax(dim=-1).to(q.dtype)
        out = torch.matmul(probs, values.transpose(1, 2))  # [seqs, kv_heads, group, head_dim]
        return out.reshape(num_seqs, num_heads, head_dim)


def _sdpa_chunk(
    q: torch.Tensor,  # [qo_len, num_q_heads, head_dim]
    k: torch.Tensor,  # [kv_len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [kv_len, num_kv_heads, head_dim]
    mask: torch.Tensor | None,  # [qo_len, kv_len] bool, or None for plain causal (qo == kv)
) -> torch.Tensor:  # [qo_len, num_q_heads, head_dim]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = scaled_dot_product_attention(
        q.transpose(0, 1),  # [heads, qo_len, head_dim]
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
    )
    return out.transpose(0, 1)
