"""The torch backend against plain per-sequence attention, on random Q/K/V and page tables."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import torch_backend
from engine.attention.backend import allocate_kv_caches
from engine.attention.metadata import SeqSlice, build_attention_metadata
from engine.attention.torch_backend import TorchAttentionBackend

HEADS, KV_HEADS, DIM = 6, 2, 8


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions over all of ``k``/``v`` (one sequence)."""
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / DIM**0.5
    offset = k.shape[0] - q.shape[0]
    allowed = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + offset
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_step_matches_reference(page_size: int, seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # (tokens already cached, tokens run now): decodes, a fresh prompt, a chunk with a prefix.
    shapes = [(0, 1), (7, 1), (30, 1), (0, 13), (9, 6), (3, 1)]
    num_pages = sum(-(-(c + n) // page_size) for c, n in shapes) + 2
    pages = list(range(num_pages))
    rng.shuffle(pages)
    cache = allocate_kv_caches(1, num_pages, page_size, KV_HEADS, DIM, torch.float32)[0]
    full_k = [torch.randn(c + n, KV_HEADS, DIM) for c, n in shapes]
    full_v = [torch.randn(c + n, KV_HEADS, DIM) for c, n in shapes]
    slices = []
    for (c, n), k, v in zip(shapes, full_k, full_v, strict=True):
        table = [pages.pop() for _ in range(-(-(c + n) // page_size))]
        for pos in range(c):  # the prefix is already in the cache
            cache[table[pos // page_size], 0, pos % page_size] = k[pos]
            cache[table[pos // page_size], 1, pos % page_size] = v[pos]
        slices.append(SeqSlice(table, c, n))
    meta = build_attention_metadata(slices, page_size)
    q = torch.randn(meta.num_tokens, HEADS, DIM)
    k_new = torch.cat([k[c:] for (c, _), k in zip(shapes, full_k, strict=True)])
    v_new = torch.cat([v[c:] for (c, _), v in zip(shapes, full_v, strict=True)])
    backend = TorchAttentionBackend()
    backend.plan(meta)
    out = backend.forward(0, q, k_new, v_new, cache)
    assert out.shape == q.shape
    starts = meta.qo_indptr.tolist()
    for i, ((c, n), k, v) in enumerate(zip(shapes, full_k, full_v, strict=True)):
        expected = reference(q[starts[i] : starts[i + 1]], k, v)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, atol=1e-5, rtol=0)
        table = list(slices[i].page_ids)
        for pos in range(c, c + n):  # new K/V landed in their slots
            assert torch.equal(cache[table[pos // page_size], 0, pos % page_size], k[pos])
            assert torch.equal(cache[table[pos // page_size], 1, pos % page_size], v[pos])


def test_forward_before_plan_raises() -> None:
    cache = allocate_kv_caches(1, 1, 4, KV_HEADS, DIM, torch.float32)[0]
    x = torch.zeros(1, KV_HEADS, DIM)
    with pytest.raises(RuntimeError):
        TorchAttentionBackend().forward(0, torch.zeros(1, HEADS, DIM), x, x, cache)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_only_step_from_fused_qkv_views_matches_reference(page_size: int) -> None:
    """The batched decode path, fed strided views of one fused QKV tensor as the model does."""
    torch.manual_seed(page_size)
    kv_lens = [1, 5, 17, 33, 2]
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 1
    pages = list(range(num_pages))
    random.Random(page_size).shuffle(pages)
    cache = allocate_kv_caches(1, num_pages, page_size, KV_HEADS, DIM, torch.float32)[0]
    full_k = [torch.randn(n, KV_HEADS, DIM) for n in kv_lens]
    full_v = [torch.randn(n, KV_HEADS, DIM) for n in kv_lens]
    slices = []
    for n, k, v in zip(kv_lens, full_k, full_v, strict=True):
        table = [pages.pop() for _ in range(-(-n // page_size))]
        for pos in range(n - 1):
            cache[table[pos // page_size], 0, pos % page_size] = k[pos]
            cache[table[pos // page_size], 1, pos % page_size] = v[pos]
        slices.append(SeqSlice(table, n - 1, 1))
    meta = build_attention_metadata(slices, page_size)
    q_size, kv_size = HEADS * DIM, KV_HEADS * DIM
    qkv = torch.randn(len(kv_lens), q_size + 2 * kv_size)  # [num_seqs, q + k + v]
    q = qkv[:, :q_size].view(-1, HEADS, DIM)
    k_new, v_new = qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
    k_new.copy_(torch.stack([k[-1] for k in full_k]).flatten(1))
    v_new.copy_(torch.stack([v[-1] for v in full_v]).flatten(1))
    backend = TorchAttentionBackend()
    backend.plan(meta)
    k_view, v_view = k_new.view(-1, KV_HEADS, DIM), v_new.view(-1, KV_HEADS, DIM)
    out = backend.forward(0, q, k_view, v_view, cache)
    for i, (k, v) in enumerate(zip(full_k, full_v, strict=True)):
        torch.testing.assert_close(out[i : i + 1], reference(q[i : i + 1], k, v), atol=1e-5, rtol=0)
    # A second layer reuses the step's plan (and its gather index) on another cache.
    other = cache.clone()
    torch.testing.assert_close(backend.forward(1, q, k_view, v_view, other), out)


Layout = list[tuple[list[int], int, int]]  # (shared pages, own computed tokens, new tokens)


def _mixed_layout(page_size: int, pages: list[int], with_chunk: bool) -> Layout:
    """Two groups sharing pages (one sequence diverging after group a's first page), decodes
    alone, one shorter than a page, and optionally a chunk after group b's pages."""
    shared_a = [pages.pop() for _ in range(5)]
    shared_b = [pages.pop() for _ in range(3)]
    layout = [
        (shared_a, 3, 1),
        (shared_a, 0, 1),
        (shared_a, 2 * page_size + 1, 1),
        (shared_a[:1], page_size + 2, 1),  # shares only the first page of group a
        (shared_b, 1, 1),
        (shared_b, page_size - 1, 1),
        ([], 3 * page_size + 2, 1),
        ([], 1, 1),
    ]
    if with_chunk:
        layout.append((shared_b, 2, 5))
    return layout


def _shared_prefix_step(
    page_size: int, seed: int, with_chunk: bool, layout: Layout | None = None
) -> tuple[list[SeqSlice], list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """A step over ``layout`` (default: ``_mixed_layout``); the cache holds every computed
    token's K/V, shared pages once."""
    rng = random.Random(seed)
    pages = list(range(200))
    rng.shuffle(pages)
    if layout is None:
        layout = _mixed_layout(page_size, pages, with_chunk)
    else:
        pages = [p for p in pages if all(p not in shared for shared, _, _ in layout)]
    shared_a = sorted({p for shared, _, _ in layout for p in shared})
    shared_b: list[int] = []
    cache = allocate_kv_caches(1, 200, page_size, KV_HEADS, DIM, torch.float32)[0]
    shared_kv = {
        p: (torch.randn(page_size, KV_HEADS, DIM), torch.randn(page_size, KV_HEADS, DIM))
        for p in shared_a + shared_b
    }
    for p, (k, v) in shared_kv.items():
        cache[p, 0], cache[p, 1] = k, v
    slices, full_k, full_v = [], [], []
    for shared, own, new in layout:
        computed = len(shared) * page_size + own
        total = computed + new
        table = [*shared, *(pages.pop() for _ in range(-(-total // page_size) - len(shared)))]
        k = torch.cat([*(shared_kv[p][0] for p in shared), torch.randn(own + new, KV_HEADS, DIM)])
        v = torch.cat([*(shared_kv[p][1] for p in shared), torch.randn(own + new, KV_HEADS, DIM)])
        for pos in range(len(shared) * page_size, computed):
            cache[table[pos // page_size], 0, pos % page_size] = k[pos]
            cache[table[pos // page_size], 1, pos % page_size] = v[pos]
        slices.append(SeqSlice(table, computed, new))
        full_k.append(k)
        full_v.append(v)
    return slices, full_k, full_v, cache


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("with_chunk", [False, True])
@pytest.mark.parametrize("min_saved", [-(10**9), 10**9])
def test_decodes_sharing_pages_read_them_once_and_match_reference(
    monkeypatch: pytest.MonkeyPatch, page_size: int, with_chunk: bool, min_saved: int
) -> None:
    """With the cascade always on and never on, the same attention as the reference."""
    monkeypatch.setattr(torch_backend, "CASCADE_MIN_SAVED_TOKENS", min_saved)
    torch.manual_seed(page_size)
    slices, full_k, full_v, cache = _shared_prefix_step(page_size, page_size, with_chunk)
    meta = build_attention_metadata(slices, page_size)
    q = torch.randn(meta.num_tokens, HEADS, DIM)
    k_new = torch.cat([k[s.num_computed_tokens :] for s, k in zip(slices, full_k, strict=True)])
    v_new = torch.cat([v[s.num_computed_tokens :] for s, v in zip(slices, full_v, strict=True)])
    backend = TorchAttentionBackend()
    backend.plan(meta)
    out = backend.forward(0, q, k_new, v_new, cache)
    starts = meta.qo_indptr.tolist()
    for i, (k, v) in enumerate(zip(full_k, full_v, strict=True)):
        expected = reference(q[starts[i] : starts[i + 1]], k, v)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, atol=1e-5, rtol=0)
    # The plan is per step: the next layer reads it again and gets the same answer.
    torch.testing.assert_close(backend.forward(1, q, k_new, v_new, cache.clone()), out)


def test_cascade_spares_reading_shared_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the cascade on, the shared pages are gathered once per group, not once per decode."""
    monkeypatch.setattr(torch_backend, "CASCADE_MIN_SAVED_TOKENS", 0)
    system = list(range(100, 108))  # 8 pages of 4 tokens every decode holds
    layout = [(system, own, 1) for own in (0, 2, 3, 5)]
    slices, full_k, full_v, cache = _shared_prefix_step(4, 0, False, layout)
    meta = build_attention_metadata(slices, 4)
    gathered: list[int] = []
    original = torch.Tensor.index_select

    def counting(self: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
        gathered.append(index.numel())
        return original(self, dim, index)

    backend = TorchAttentionBackend()
    backend.plan(meta)
    q = torch.randn(meta.num_tokens, HEADS, DIM)
    k_new = torch.stack([k[-1] for k in full_k])
    v_new = torch.stack([v[-1] for v in full_v])
    monkeypatch.setattr(torch.Tensor, "index_select", counting)
    backend.forward(0, q, k_new, v_new, cache)
    cascade_rows = sum(gathered)
    monkeypatch.setattr(torch_backend, "CASCADE_MIN_SAVED_TOKENS", 10**9)
    backend.plan(meta)
    gathered.clear()
    backend.forward(0, q, k_new, v_new, cache)
    # 4 decodes of 33..38 tokens: 4 * 38 rows apiece, against 32 shared + 4 * 6 padded own.
    assert sum(gathered) == 2 * KV_HEADS * 4 * 38
    assert cascade_rows == 4 + 2 * KV_HEADS * (32 + 4 * 6)
