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
    head_rows: torch.Tensor | None = None  # [2, kv_heads, kv_len], see ``_head_rows``


@dataclass(slots=True)
class _Plan:
    page_size: int
    write_rows: torch.Tensor  # [num_tokens] int64 flat-cache rows of the new tokens' K
    write_v_rows: torch.Tensor  # [num_tokens] int64 the same for V (``write_rows + page_size``)
    decode_rows: torch.Tensor  # [num_decodes] int64 rows of the batch that are decodes
    decode_k_rows: torch.Tensor  # [num_decodes, max_kv_len] int64 flat-cache rows of K
    decode_bias: torch.Tensor  # [num_decodes, 1, 1, max_kv_len] float32: 0 or -inf (padding)
    chunks: list[_Chunk]
    # Built by the first layer (it needs the cache's head count), reused by the others:
    # [2, num_decodes, num_kv_heads, max_kv_len] int64 rows of the cache seen as [-1, head_dim].
    decode_head_rows: torch.Tensor | None = None

    def head_rows(self, num_kv_heads: int) -> torch.Tensor:
        """K and V rows of every decode, head-major, so one gather lands in matmul layout."""
        if self.decode_head_rows is None:
            self.decode_head_rows = _head_rows(self.decode_k_rows, self.page_size, num_kv_heads)
        return self.decode_head_rows


def _head_rows(k_rows: torch.Tensor, page_size: int, num_kv_heads: int) -> torch.Tensor:
    """Rows of the cache seen as ``[-1, head_dim]`` for K and V of ``k_rows`` [..., kv_len].

    Returns ``[2, ..., num_kv_heads, kv_len]`` int64: gathering it yields K and V head-major,
    the layout attention's matmuls read without a further copy.
    """
    heads = torch.arange(num_kv_heads, device=k_rows.device)[:, None]  # [kv_heads, 1]
    k = (k_rows * num_kv_heads).unsqueeze(-2) + heads  # [..., kv_heads, kv_len]
    return torch.stack((k, k + page_size * num_kv_heads))


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
            page_ids = meta.kv_indices.tolist()
            # Padded with page 0: its rows are read but masked out by the bias.
            padded = [
                page_ids[kv_indptr[i] : kv_indptr[i + 1]]
                + [0] * (max_pages - kv_indptr[i + 1] + kv_indptr[i])
                for i in decode_seqs
            ]
            page_table = torch.tensor(padded, dtype=torch.int64)  # [num_decodes, max_pages]
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
            write_v_rows=write_rows + ps,
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
        flat.index_copy_(0, plan.write_v_rows, v)
        if not plan.chunks:  # a pure decode step: every row is a decode, in order
            return self._decode(q, kv_cache, plan)
        out = q.new_empty(q.shape)  # contiguous even when ``q`` is a strided view
        if plan.decode_rows.numel():
            out[plan.decode_rows] = self._decode(q[plan.decode_rows], kv_cache, plan)
        for chunk in plan.chunks:
            qs = q[chunk.q_start : chunk.q_end]
            if chunk.fresh:
                ks = k[chunk.q_start : chunk.q_end].transpose(0, 1)
                vs = v[chunk.q_start : chunk.q_end].transpose(0, 1)
            else:
                if chunk.head_rows is None:
                    chunk.head_rows = _head_rows(chunk.k_rows, plan.page_size, num_kv_heads)
                index = chunk.head_rows  # [2, kv_heads, kv_len]
                kv = kv_cache.view(-1, head_dim).index_select(0, index.view(-1))
                ks, vs = kv.view(*index.shape, head_dim).unbind(0)
            out[chunk.q_start : chunk.q_end] = _sdpa_chunk(qs, ks, vs, chunk.mask)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [num_decodes, num_q_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
        plan: _Plan,
    ) -> torch.Tensor:  # [num_decodes, num_q_heads, head_dim]
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[-2]
        group = num_heads // num_kv_heads
        index = plan.head_rows(num_kv_heads)  # [2, seqs, kv_heads, max_kv]
        # One gather for K and V of every decode: [2, seqs, kv_heads, max_kv, head_dim].
        kv = kv_cache.view(-1, head_dim).index_select(0, index.view(-1))
        kv = kv.view(*index.shape, head_dim)
        # Query heads of one KV group share its keys: [seqs, kv_heads, group, head_dim].
        qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
        scores = torch.matmul(qg, kv[0].transpose(2, 3))  # [seqs, kv_heads, group, max_kv]
        scores = scores.float().mul_(head_dim**-0.5).add_(plan.decode_bias)
        probs = scores.softmax(dim=-1).to(q.dtype)
        out = torch.matmul(probs, kv[1])  # [seqs, kv_heads, group, head_dim]
        return out.view(num_seqs, num_heads, head_dim)


def _sdpa_chunk(
    q: torch.Tensor,  # [qo_len, num_q_heads, head_dim]
    k: torch.Tensor,  # [num_kv_heads, kv_len, head_dim]
    v: torch.Tensor,  # [num_kv_heads, kv_len, head_dim]
    mask: torch.Tensor | None,  # [qo_len, kv_len] bool, or None for plain causal (qo == kv)
) -> torch.Tensor:  # [qo_len, num_q_heads, head_dim]
    # 4-D inputs: with 3-D ones torch takes its unfused math path on CPU, many times slower.
    out = scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, heads, qo_len, head_dim]
        k[None],  # [1, kv_heads, kv_len, head_dim]: GQA without repeating K/V
        v[None],
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=q.shape[1] != k.shape[0],
    )
    return out[0].transpose(0, 1)
