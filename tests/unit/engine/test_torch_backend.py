"""The torch backend against plain per-sequence attention, on random Q/K/V and page tables."""

from __future__ import annotations

import random

import pytest
import torch

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
