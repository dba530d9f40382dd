"""Paged attention on the CPU: decodes and prefill chunks through the native kernels that read
the paged cache in place (``native_attention.py``), or, where they are not built, decodes batched
in one padded torch matmul and prefill chunks through torch's SDPA.

It reads exactly the shared CSR page table. Everything that depends only on the step (slot
indices, decode page tables or gather index and mask, each chunk's causal mask) is built once in
``plan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch.nn.functional import scaled_dot_product_attention

from engine.attention.backend import AttentionBackend, LayerAttention
from engine.attention.masked_attention import MaskedPlan, masked_attention, plan_masked
from engine.attention.metadata import AttentionMetadata
from engine.attention.native_attention import ChunkKernel, DecodeKernel
from engine.attention.shared_prefix import group_shared_prefixes


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
class _Keys:
    """Padded key lists: unit ``u`` (a sequence, or a group sharing a prefix) attends to the
    flat-cache rows ``k_rows[u, :len_u]``; the rest is padding (page 0, masked by ``bias``)."""

    k_rows: torch.Tensor  # [units, max_len] int64 flat-cache rows of K (V is + page_size)
    bias: torch.Tensor  # [units, 1, 1, max_len] float32: 0, or -inf past the unit's length
    # Built by the first layer (it needs the cache's head count), reused by the others:
    # [2, units, num_kv_heads, max_len] int64 rows of the cache seen as [-1, head_dim].
    head_rows: torch.Tensor | None = None

    def heads(self, page_size: int, num_kv_heads: int) -> torch.Tensor:
        """K and V rows of every unit, head-major, so one gather lands in matmul layout."""
        if self.head_rows is None:
            self.head_rows = _head_rows(self.k_rows, page_size, num_kv_heads)
        return self.head_rows

    def to(self, device: torch.device) -> _Keys:
        return _Keys(self.k_rows.to(device), self.bias.to(device))


@dataclass(slots=True)
class _Cascade:
    """Decodes that share leading pages read them once per group: ``prefix`` has one unit per
    group, its members' queries side by side; ``suffix`` one unit per member slot (groups padded
    to ``members`` slots) with the slot's own tokens. One softmax runs over both parts' scores."""

    prefix: _Keys
    suffix: _Keys
    bias: torch.Tensor  # [groups, 1, members, 1, prefix_len + suffix_len] float32: 0 or -inf
    members: int  # query slots per group (the largest group; smaller ones are padded)
    query_rows: torch.Tensor  # [groups * members] int64 decode index of each slot (padding: 0)
    slots: torch.Tensor  # [num_decodes] int64 each decode's slot

    def to(self, device: torch.device) -> _Cascade:
        return _Cascade(
            self.prefix.to(device),
            self.suffix.to(device),
            self.bias.to(device),
            self.members,
            self.query_rows.to(device),
            self.slots.to(device),
        )


@dataclass(slots=True)
class _PageTables:
    """Where the native kernel finds each decode's pages in the step's CSR table."""

    pages: torch.Tensor  # [total_pages] int32: the step's ``kv_indices``
    starts: torch.Tensor  # [num_decodes] int32: each decode's first entry in ``pages``
    kv_lens: torch.Tensor  # [num_decodes] int32

    def to(self, device: torch.device) -> _PageTables:
        return _on_cpu(self, device)


@dataclass(slots=True)
class _ChunkTables:
    """Where the native chunk kernel finds each prefill chunk's rows and pages."""

    pages: torch.Tensor  # [total_pages] int32: the step's ``kv_indices``
    q_starts: torch.Tensor  # [num_chunks] int32: each chunk's first row of the batch
    q_lens: torch.Tensor  # [num_chunks] int32
    page_starts: torch.Tensor  # [num_chunks] int32: each chunk's first entry in ``pages``
    kv_lens: torch.Tensor  # [num_chunks] int32

    def to(self, device: torch.device) -> _ChunkTables:
        return _on_cpu(self, device)


_T = TypeVar("_T")


def _on_cpu(tables: _T, device: torch.device) -> _T:
    """The native kernels' tables stay where they are built: on the CPU, where they run."""
    if device.type != "cpu":
        raise ValueError(f"the native attention kernels run on the CPU, not {device}")
    return tables


@dataclass(slots=True)
class _Plan:
    page_size: int
    write_rows: torch.Tensor  # [num_tokens] int64 flat-cache rows of the new tokens' K
    write_v_rows: torch.Tensor  # [num_tokens] int64 the same for V (``write_rows + page_size``)
    decode_rows: torch.Tensor  # [num_decodes] int64 rows of the batch that are decodes
    # Each decode's pages (native kernel), whole history padded, or split by shared prefix.
    decodes: _PageTables | _Keys | _Cascade | None
    chunks: list[_Chunk]  # prefill chunks for SDPA (none when the chunk kernel takes them)
    chunk_tables: _ChunkTables | None = None  # prefill chunks for the native chunk kernel
    meta: AttentionMetadata | None = None  # for the masked plans, built when a layer needs one
    masked: dict[int | None, MaskedPlan] = field(default_factory=dict)  # by window


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

    def __init__(
        self, decode_kernel: DecodeKernel | None = None, chunk_kernel: ChunkKernel | None = None
    ) -> None:
        self._plan: _Plan | None = None
        self._kernel = decode_kernel
        self._chunk_kernel = chunk_kernel

    @property
    def native_decode(self) -> bool:
        return self._kernel is not None

    @property
    def native_chunks(self) -> bool:
        return self._chunk_kernel is not None

    def plan(self, meta: AttentionMetadata) -> None:
        ps = meta.page_size
        device = meta.slot_mapping.device
        # Flat view of a layer's cache is [num_pages * 2 * page_size, kv_heads, head_dim]:
        # K of slot s (page p, offset o) sits at row p * 2 * ps + o, its V at that row + ps.
        slots = meta.slot_mapping.to(torch.int64)
        write_rows = (slots // ps) * (2 * ps) + slots % ps
        qo_indptr = meta.qo_indptr.tolist()
        kv_indptr = meta.kv_indptr.tolist()
        decode_seqs = [i for i, n in enumerate(meta.qo_lens) if n == 1]
        chunk_seqs = [i for i, n in enumerate(meta.qo_lens) if n > 1]
        chunk_tables = None
        chunks: list[_Chunk] = []
        if chunk_seqs and self._chunk_kernel is not None:
            chunk_tables = _chunk_tables(meta, chunk_seqs, qo_indptr, kv_indptr).to(device)
        elif chunk_seqs:
            pages = meta.kv_indices.to(torch.int64)
            chunks = [self._plan_chunk(meta, i, qo_indptr, kv_indptr, pages) for i in chunk_seqs]
        decode_rows = torch.tensor([qo_indptr[i] for i in decode_seqs], dtype=torch.int64)
        decodes: _PageTables | _Keys | _Cascade | None = None
        if decode_seqs and self._kernel is not None:
            decodes = _decode_page_tables(meta, decode_seqs, kv_indptr)
        elif decode_seqs:
            page_ids = meta.kv_indices.tolist()
            tables = [page_ids[kv_indptr[i] : kv_indptr[i + 1]] for i in decode_seqs]
            kv_lens = [meta.kv_lens[i] for i in decode_seqs]
            decodes = _plan_cascade(tables, kv_lens, ps) or _keys(
                tables, [0] * len(tables), kv_lens, ps
            )
        self._plan = _Plan(
            page_size=ps,
            write_rows=write_rows,
            write_v_rows=write_rows + ps,
            decode_rows=decode_rows.to(device),
            decodes=None if decodes is None else decodes.to(device),
            chunks=chunks,
            chunk_tables=chunk_tables,
            meta=meta,
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
        plan = self._write(k, v, kv_cache)
        num_kv_heads = kv_cache.shape[-2]
        tables = plan.chunk_tables
        if not plan.chunks and tables is None:  # a pure decode step: every row a decode, in order
            return self._decode(q, kv_cache, plan)
        out = q.new_empty(q.shape)  # contiguous even when ``q`` is a strided view
        if plan.decode_rows.numel():
            out[plan.decode_rows] = self._decode(q[plan.decode_rows], kv_cache, plan)
        if tables is not None:
            assert self._chunk_kernel is not None
            self._chunk_kernel(
                q,
                kv_cache,
                out,
                tables.pages,
                tables.q_starts,
                tables.q_lens,
                tables.page_starts,
                tables.kv_lens,
            )
        for chunk in plan.chunks:
            qs = q[chunk.q_start : chunk.q_end]
            if chunk.fresh:
                ks = k[chunk.q_start : chunk.q_end].transpose(0, 1)
                vs = v[chunk.q_start : chunk.q_end].transpose(0, 1)
            else:
                if chunk.head_rows is None:
                    chunk.head_rows = _head_rows(chunk.k_rows, plan.page_size, num_kv_heads)
                ks, vs = _gather(kv_cache, chunk.head_rows).unbind(0)  # [kv_heads, kv_len, d]
            out[chunk.q_start : chunk.q_end] = _sdpa_chunk(qs, ks, vs, chunk.mask)
        return out

    def _write(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor) -> _Plan:
        """Write the step's K/V into their slots; returns the step's plan."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("plan() must run before forward()")
        num_kv_heads, head_dim = kv_cache.shape[-2], kv_cache.shape[-1]
        flat = kv_cache.view(-1, num_kv_heads, head_dim)  # [num_pages * 2 * page_size, kvh, d]
        flat.index_copy_(0, plan.write_rows, k)
        flat.index_copy_(0, plan.write_v_rows, v)
        return plan

    def serves(self, layer: LayerAttention) -> bool:
        return True

    def forward_layer(
        self,
        layer_id: int,
        q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
        layer: LayerAttention,
    ) -> torch.Tensor:  # [num_tokens, num_q_heads, head_dim]
        """Plain layers, and windowed ones whose window holds every sequence of the step, take
        :meth:`forward` (native kernels); the rest the masked torch path."""
        plan = self._plan
        if plan is None or plan.meta is None:
            raise RuntimeError("plan() must run before forward()")
        window = layer.window
        if window is not None and max(plan.meta.kv_lens) <= window:
            window = None
        if window is None and layer.softcap is None and layer.scale is None:
            return self.forward(layer_id, q, k, v, kv_cache)
        self._write(k, v, kv_cache)
        masked = plan.masked.get(window)
        if masked is None:
            masked = plan.masked[window] = plan_masked(plan.meta, window, kv_cache.shape[-2])
        return masked_attention(q, kv_cache, masked, layer._replace(window=window))

    def _decode(
        self,
        q: torch.Tensor,  # [num_decodes, num_q_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
        plan: _Plan,
    ) -> torch.Tensor:  # [num_decodes, num_q_heads, head_dim]
        decodes = plan.decodes
        if isinstance(decodes, _PageTables):
            assert self._kernel is not None
            return self._kernel(q, kv_cache, decodes.pages, decodes.starts, decodes.kv_lens)
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[-2]
        group = num_heads // num_kv_heads
        # Query heads of one KV group share its keys: [seqs, kv_heads, group, head_dim].
        qg = q.reshape(num_seqs, num_kv_heads, group, head_dim)
        if isinstance(decodes, _Keys):
            out = _padded_attention(qg, kv_cache, decodes, plan.page_size)
            return out.view(num_seqs, num_heads, head_dim)
        assert decodes is not None
        ps, members = plan.page_size, decodes.members
        units = decodes.prefix.k_rows.shape[0]
        # Slot order: [groups * members, kv_heads, group, dim]; the prefix pass sees each
        # group's slots side by side: [groups, kv_heads, members * group, dim].
        qs = qg.index_select(0, decodes.query_rows)
        qp = qs.view(units, members, num_kv_heads, group, head_dim).transpose(1, 2)
        qp = qp.reshape(units, num_kv_heads, members * group, head_dim)
        # [2, groups, kv_heads, prefix_len, dim] and [2, slots, kv_heads, suffix_len, dim]
        kp = _gather(kv_cache, decodes.prefix.heads(ps, num_kv_heads))
        ks = _gather(kv_cache, decodes.suffix.heads(ps, num_kv_heads))
        prefix_len = kp.shape[3]
        scores_p = torch.matmul(qp, kp[0].transpose(2, 3)).view(
            units, num_kv_heads, members, group, prefix_len
        )
        scores_s = torch.matmul(qs, ks[0].transpose(2, 3))  # [slots, kv_heads, group, suffix]
        scores_s = scores_s.view(units, members, num_kv_heads, group, -1).transpose(1, 2)
        # One softmax over both parts: [groups, kv_heads, members, group, prefix + suffix].
        scores = torch.cat((scores_p, scores_s), dim=-1)
        scores = scores.float().mul_(head_dim**-0.5).add_(decodes.bias)
        probs = scores.softmax(dim=-1).to(q.dtype)
        probs_p = probs[..., :prefix_len].reshape(units, num_kv_heads, members * group, -1)
        probs_s = probs[..., prefix_len:].transpose(1, 2)
        probs_s = probs_s.reshape(units * members, num_kv_heads, group, -1)
        out_p = torch.matmul(probs_p, kp[1]).view(units, num_kv_heads, members, group, head_dim)
        out_p = out_p.transpose(1, 2).reshape(units * members, num_kv_heads, group, head_dim)
        out_s = torch.matmul(probs_s, ks[1])  # [slots, kv_heads, group, dim]
        out = out_p.float().add_(out_s.float())[decodes.slots]
        return out.to(q.dtype).view(num_seqs, num_heads, head_dim)


def _chunk_tables(
    meta: AttentionMetadata, chunk_seqs: list[int], qo_indptr: list[int], kv_indptr: list[int]
) -> _ChunkTables:
    """The prefill chunks' rows and tables, read in place from the step's ``kv_indices``."""
    return _ChunkTables(
        meta.kv_indices.contiguous(),
        _int32([qo_indptr[i] for i in chunk_seqs]),
        _int32([meta.qo_lens[i] for i in chunk_seqs]),
        _int32([kv_indptr[i] for i in chunk_seqs]),
        _int32([meta.kv_lens[i] for i in chunk_seqs]),
    )


def _decode_page_tables(
    meta: AttentionMetadata, decode_seqs: list[int], kv_indptr: list[int]
) -> _PageTables:
    """The decodes' tables, read in place from the step's ``kv_indices``."""
    return _PageTables(
        meta.kv_indices.contiguous(),
        _int32([kv_indptr[i] for i in decode_seqs]),
        _int32([meta.kv_lens[i] for i in decode_seqs]),
    )


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# A cascade costs a dozen more small kernels per layer; it pays off once it spares reading
# this many K/V tokens (measured on CPU with a 135M-parameter model).
CASCADE_MIN_SAVED_TOKENS = 4096


def _plan_cascade(tables: list[list[int]], kv_lens: list[int], ps: int) -> _Cascade | None:
    """Split decodes by shared leading pages when that spares enough K/V reads, else None.

    A decode in a group reads the shared pages in the group's pass and the rest on its own; a
    decode alone reads all it has computed in its group-of-one pass and only the new token on
    its own, so both passes are non-empty for everyone (no all-masked softmax rows).
    """
    groups = group_shared_prefixes(tables, [(n - 1) // ps for n in kv_lens])
    if len(groups) == len(tables):
        return None
    prefix_lens = [0] * len(tables)
    for g in groups:
        for i in g.members:
            prefix_lens[i] = g.shared_pages * ps if len(g.members) > 1 else kv_lens[i] - 1
    group_lens = [prefix_lens[g.members[0]] for g in groups]
    suffix_max = max(n - p for n, p in zip(kv_lens, prefix_lens, strict=True))
    members = max(len(g.members) for g in groups)
    read = len(groups) * (max(group_lens) + members * suffix_max)  # padded, as gathered
    if len(tables) * max(kv_lens) - read < CASCADE_MIN_SAVED_TOKENS:
        return None
    query_rows = [0] * (len(groups) * members)
    slots = [0] * len(tables)
    # A group's prefix lies in its first member's pages; a decode's own part starts at a page
    # boundary for group members and at its new token for decodes alone. Padding slots read
    # nothing of their own (their row of the softmax still has the group's prefix).
    suffix_tables = [[0]] * len(query_rows)
    suffix_starts = [0] * len(query_rows)
    suffix_ends = [0] * len(query_rows)
    for u, g in enumerate(groups):
        for j, i in enumerate(g.members):
            slot = u * members + j
            query_rows[slot], slots[i] = i, slot
            first = prefix_lens[i] // ps
            suffix_tables[slot] = tables[i][first:]
            suffix_starts[slot] = prefix_lens[i] - first * ps
            suffix_ends[slot] = kv_lens[i] - first * ps
    prefix_tables = [
        tables[g.members[0]][: -(-n // ps)] for g, n in zip(groups, group_lens, strict=True)
    ]
    prefix = _keys(prefix_tables, [0] * len(groups), group_lens, ps)
    suffix = _keys(suffix_tables, suffix_starts, suffix_ends, ps)
    units = len(groups)
    bias = torch.cat(
        (
            prefix.bias.view(units, 1, 1, 1, -1).expand(-1, -1, members, -1, -1),
            suffix.bias.view(units, 1, members, 1, -1),
        ),
        dim=-1,
    )
    return _Cascade(
        prefix=prefix,
        suffix=suffix,
        bias=bias,
        members=members,
        query_rows=torch.tensor(query_rows, dtype=torch.int64),
        slots=torch.tensor(slots, dtype=torch.int64),
    )


def _keys(tables: list[list[int]], starts: list[int], ends: list[int], ps: int) -> _Keys:
    """Unit ``u`` reads token positions ``starts[u]:ends[u]`` of the pages ``tables[u]``."""
    max_pages = max(len(t) for t in tables)
    # Padded with page 0: its rows are read but masked out by the bias.
    page_table = torch.tensor([t + [0] * (max_pages - len(t)) for t in tables], dtype=torch.int64)
    rows = (page_table[:, :, None] * (2 * ps) + torch.arange(ps)).flatten(1)  # [units, pages*ps]
    begin = torch.tensor(starts, dtype=torch.int64)
    lens = torch.tensor(ends, dtype=torch.int64) - begin
    max_len = int(lens.max())
    steps = torch.arange(max_len)
    valid = steps[None, :] < lens[:, None]  # [units, max_len]
    cols = (begin[:, None] + steps).where(valid, 0)
    bias = torch.zeros(valid.shape, dtype=torch.float32).masked_fill_(~valid, float("-inf"))
    return _Keys(rows.gather(1, cols), bias[:, None, None, :])


def _gather(kv_cache: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
    """K and V in one gather: ``head_rows`` [2, ..., kv_heads, len] (see ``_head_rows``) gives
    ``[2, ..., kv_heads, len, head_dim]``."""
    head_dim = kv_cache.shape[-1]
    kv = kv_cache.view(-1, head_dim).index_select(0, head_rows.view(-1))
    return kv.view(*head_rows.shape, head_dim)


def _padded_attention(
    q: torch.Tensor,  # [units, num_kv_heads, rows, head_dim]
    kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
    keys: _Keys,
    page_size: int,
) -> torch.Tensor:  # [units, num_kv_heads, rows, head_dim]
    """Softmax attention of each unit's query rows over its keys."""
    kv = _gather(kv_cache, keys.heads(page_size, kv_cache.shape[-2]))
    scores = torch.matmul(q, kv[0].transpose(2, 3))  # [units, kv_heads, rows, max_len]
    scores = scores.float().mul_(q.shape[-1] ** -0.5).add_(keys.bias)
    return torch.matmul(scores.softmax(dim=-1).to(q.dtype), kv[1])


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
