"""The native CPU prefill-chunk kernel against exact causal attention and the torch (SDPA) path."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention.metadata import SeqSlice, build_attention_metadata
from engine.attention.native_attention import (
    ChunkKernel,
    load_chunk_kernel,
    load_decode_kernel,
    try_load_chunk_kernel,
    try_load_decode_kernel,
)
from engine.attention.torch_backend import TorchAttentionBackend
from tests.support.paged import (
    AVX2_BUILD_FLAGS,
    HAS_AMX,
    causal_attention,
    csr,
    filled_cache,
    needs_avx2_build_apart,
)

KERNEL = load_chunk_kernel()
HAS_AVX512_BF16 = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
needs_kernel = pytest.mark.skipif(
    KERNEL is None, reason="no C compiler here (the SDPA chunk path is tested without one)"
)


def run_chunks(
    shapes: list[tuple[int, int]],  # (tokens cached before, tokens of the chunk)
    heads: int,
    kv_heads: int,
    dim: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int,
    kernel: ChunkKernel | None = KERNEL,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Run ``kernel`` over chunks laid out one after another; returns q, out and K/V."""
    assert kernel is not None
    kv_lens = [c + n for c, n in shapes]
    cache, tables, keys, values = filled_cache(kv_lens, page_size, kv_heads, dim, dtype, seed)
    qo_lens = [n for _, n in shapes]
    rows = sum(qo_lens)
    # Query rows as a strided view of a fused QKV projection, as the model passes them.
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim).to(dtype)
    q = qkv[:, : heads * dim].view(rows, heads, dim)
    out = torch.full_like(q, float("nan")).contiguous()
    pages, page_starts, kv = csr(tables, kv_lens)
    q_starts = torch.tensor([sum(qo_lens[:i]) for i in range(len(shapes))], dtype=torch.int32)
    kernel(
        q, cache, out, pages, q_starts, torch.tensor(qo_lens, dtype=torch.int32), page_starts, kv
    )
    return q, out, keys, values


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(9, 3, 64), (8, 8, 64), (8, 2, 128), (10, 2, 32), (6, 2, 80), (32, 2, 16)],
)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_float32_chunks_match_causal_attention(
    heads: int, kv_heads: int, dim: int, page_size: int
) -> None:
    """Group sizes 1 to 16 (48 to 3 query positions a tile), head sizes with and without a
    specialisation; fresh chunks and chunks over cached tokens, shorter and longer than a tile,
    a one-token chunk, and sequences across many pages."""
    torch.manual_seed(page_size)
    shapes = [(0, 2), (0, 5), (3, 1), (0, 50), (13, 60), (100, 7), (0, 130), (17, 16)]
    q, out, keys, values = run_chunks(
        shapes, heads, kv_heads, dim, page_size, torch.float32, seed=dim
    )
    row = 0
    for (_, n), k, v in zip(shapes, keys, values, strict=True):
        expected = causal_attention(q[row : row + n], k, v)
        torch.testing.assert_close(out[row : row + n].double(), expected, atol=3e-6, rtol=1e-5)
        row += n


def bf16_step(shapes: list[tuple[int, int]], seed: int) -> tuple[Any, ...]:
    """A bfloat16 step of SmolLM2's attention shape (9 query heads over 3 KV heads of 64, pages
    of 16): metadata, a cache holding every sequence's K/V, and the step's q and new K/V."""
    torch.manual_seed(seed)
    kv_lens = [c + n for c, n in shapes]
    cache, tables, keys, values = filled_cache(kv_lens, 16, 3, 64, torch.bfloat16, seed=seed)
    meta = build_attention_metadata(
        [SeqSlice(t, c, n) for t, (c, n) in zip(tables, shapes, strict=True)], 16
    )
    new_k = torch.cat([k[c:] for k, (c, _) in zip(keys, shapes, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(values, shapes, strict=True)])
    q = torch.randn(new_k.shape[0], 9, 64).to(torch.bfloat16)
    return meta, cache, keys, values, q, new_k, new_v


@needs_kernel
def test_bfloat16_chunks_match_the_sdpa_path_and_exact_attention() -> None:
    """In bfloat16 the kernel rounds as torch's CPU flash attention does (probabilities to
    bfloat16 for the V product, output once): close to the SDPA path and to exact attention."""
    shapes = [(0, 70), (512, 64), (40, 3)]
    meta, cache, keys, values, q, new_k, new_v = bf16_step(shapes, seed=11)
    outs = []
    for backend in (TorchAttentionBackend(), TorchAttentionBackend(chunk_kernel=KERNEL)):
        backend.plan(meta)
        outs.append(backend.forward(0, q, new_k, new_v, cache.clone()))
    sdpa_out, native_out = outs
    assert native_out.dtype == torch.bfloat16
    torch.testing.assert_close(native_out.float(), sdpa_out.float(), atol=8e-3, rtol=1.6e-2)
    row = 0
    for (_, n), k, v in zip(shapes, keys, values, strict=True):
        exact = causal_attention(q[row : row + n], k, v)
        torch.testing.assert_close(native_out[row : row + n].double(), exact, atol=2e-2, rtol=2e-2)
        row += n


@needs_kernel
@pytest.mark.parametrize(
    ("with_decode", "with_chunks"), [(True, False), (False, True), (True, True)]
)
def test_mixed_step_matches_the_torch_path(with_decode: bool, with_chunks: bool) -> None:
    """Chunks between decodes, through either kernel or both: each takes its own rows of the
    step and table, and the step's new K/V are written before either reads the cache."""
    torch.manual_seed(3)
    page_size, kv_heads, heads, dim = 4, 2, 6, 16
    shapes = [(6, 1), (0, 9), (11, 1), (5, 7), (0, 1), (40, 1), (2, 33)]
    kv_lens = [c + n for c, n in shapes]
    cache, tables, _, _ = filled_cache(kv_lens, page_size, kv_heads, dim, torch.float32, seed=3)
    meta = build_attention_metadata(
        [SeqSlice(t, c, n) for t, (c, n) in zip(tables, shapes, strict=True)], page_size
    )
    num_tokens = sum(n for _, n in shapes)
    q = torch.randn(num_tokens, heads, dim)
    k = torch.randn(num_tokens, kv_heads, dim)
    v = torch.randn(num_tokens, kv_heads, dim)
    decode = load_decode_kernel() if with_decode else None
    native = TorchAttentionBackend(decode, KERNEL if with_chunks else None)
    outs = []
    for backend in (TorchAttentionBackend(), native):
        backend.plan(meta)
        outs.append(backend.forward(0, q, k, v, cache.clone()))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    assert (native.native_decode, native.native_chunks) == (with_decode, with_chunks)


@needs_kernel
def test_inconsistent_or_unsupported_chunks_are_refused() -> None:
    assert KERNEL is not None
    cache, tables, _, _ = filled_cache([8], 4, 2, 16, torch.float32, seed=0)
    pages, page_starts, kv_lens = csr(tables, [8])
    q = torch.randn(4, 4, 16)
    out = torch.empty_like(q)
    starts, lens = torch.tensor([0], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_len < qo_len"):
        KERNEL(
            q, cache, out, pages, starts, lens, page_starts, torch.tensor([3], dtype=torch.int32)
        )
    with pytest.raises(ValueError, match="qo_len < 1"):
        KERNEL(q, cache, out, pages, starts, lens * 0, page_starts, kv_lens)
    with pytest.raises(ValueError, match="run past q"):
        KERNEL(q, cache, out, pages, starts + 1, lens, page_starts, kv_lens)
    with pytest.raises(ValueError, match="shaped like q"):
        KERNEL(q, cache, out[:2], pages, starts, lens, page_starts, kv_lens)
    with pytest.raises(ValueError, match="unsupported"):
        KERNEL(q.to(torch.bfloat16), cache, out, pages, starts, lens, page_starts, kv_lens)
    with pytest.raises(ValueError, match="int32"):
        KERNEL(q, cache, out, pages.long(), starts, lens, page_starts, kv_lens)
    small, small_tables, _, _ = filled_cache([8], 4, 2, 8, torch.float32, seed=0)
    small_q = torch.randn(4, 4, 8)
    with pytest.raises(ValueError, match="head_dim 8"):
        KERNEL(
            small_q,
            small,
            torch.empty_like(small_q),
            *csr(small_tables, [8])[:1],
            starts,
            lens,
            page_starts,
            kv_lens,
        )


def test_switched_off_means_no_chunk_kernel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ATRIUM_NATIVE_KERNELS", "0")
    assert try_load_chunk_kernel(tmp_path) is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(
    KERNEL is None or platform.machine() not in ("x86_64", "AMD64") or not HAS_AVX512_BF16,
    reason="needs the C compiler and a CPU with AVX512-BF16 (elsewhere the native build is "
    "already the widened-float32 one, which the tests above check against exact attention)",
)
def test_portable_and_pair_dot_builds_agree(tmp_path: Path) -> None:
    """Where the CPU has AVX512-BF16 the bfloat16 kernels multiply through pair dot products;
    elsewhere through widened float32. Both builds (the second forced here with
    ``-mno-avx512bf16``) give the same attention, decodes and chunks, within bfloat16 rounding."""
    decode = load_decode_kernel()
    portable_decode = try_load_decode_kernel(tmp_path, ("-mno-avx512bf16",))
    portable_chunk = try_load_chunk_kernel(tmp_path, ("-mno-avx512bf16",))
    assert decode is not None and portable_decode is not None and portable_chunk is not None
    shapes = [(0, 70), (300, 64), (40, 3), (45, 1), (130, 1), (7, 1)]
    meta, cache, keys, values, q, new_k, new_v = bf16_step(shapes, seed=21)
    outs = []
    for backend in (
        TorchAttentionBackend(decode, KERNEL),
        TorchAttentionBackend(portable_decode, portable_chunk),
    ):
        backend.plan(meta)
        outs.append(backend.forward(0, q, new_k, new_v, cache.clone()))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=8e-3, rtol=1.6e-2)
    row = 0
    for (_, n), k, v in zip(shapes, keys, values, strict=True):
        exact = causal_attention(q[row : row + n], k, v)
        for out in outs:
            torch.testing.assert_close(out[row : row + n].double(), exact, atol=2e-2, rtol=2e-2)
        row += n


@pytest.fixture(scope="module")
def pair_dot_chunk_kernel(tmp_path_factory: pytest.TempPathFactory) -> ChunkKernel | None:
    """The chunk kernel built without AMX tiles: bfloat16 through pair dot products."""
    return try_load_chunk_kernel(tmp_path_factory.mktemp("no-amx"), ("-mno-amx-tile",))


@pytest.mark.skipif(
    KERNEL is None or not HAS_AMX,
    reason="needs the C compiler and a CPU with AMX tiles (elsewhere bfloat16 chunks run "
    "through pair dot products or widened float32, both tested above)",
)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (32, 2, 32)])
@pytest.mark.parametrize("page_size", [1, 16, 48])
def test_amx_tiles_agree_with_pair_dot_products(
    pair_dot_chunk_kernel: ChunkKernel | None, heads: int, kv_heads: int, dim: int, page_size: int
) -> None:
    """On a CPU with AMX the bfloat16 chunk kernel multiplies through tile products over blocks
    of 32 keys (K read as tiles straight from pages of a multiple of 16 tokens, copied out
    otherwise). It rounds as the pair-dot build does: the two agree within bfloat16 rounding,
    and both match exact attention. Chunks shorter and longer than a block, across pages, a
    one-token chunk, and 16 query heads per KV head (three positions a tile)."""
    assert pair_dot_chunk_kernel is not None
    shapes = [(0, 2), (0, 37), (3, 1), (13, 60), (100, 7), (0, 130), (17, 16), (500, 64)]
    outs = []
    for kernel in (KERNEL, pair_dot_chunk_kernel):
        torch.manual_seed(page_size)
        q, out, keys, values = run_chunks(
            shapes, heads, kv_heads, dim, page_size, torch.bfloat16, seed=dim, kernel=kernel
        )
        outs.append(out)
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=8e-3, rtol=1.6e-2)
    row = 0
    for (_, n), k, v in zip(shapes, keys, values, strict=True):
        exact = causal_attention(q[row : row + n], k, v)
        torch.testing.assert_close(outs[0][row : row + n].double(), exact, atol=2e-2, rtol=2e-2)
        row += n


@pytest.fixture(scope="module")
def avx2_chunk_kernel(tmp_path_factory: pytest.TempPathFactory) -> ChunkKernel | None:
    """The chunk kernel as built for an x86 CPU with AVX2 and no AVX-512 (its float32 tile of
    eight-lane registers), where this CPU can run that build."""
    return try_load_chunk_kernel(tmp_path_factory.mktemp("avx2"), AVX2_BUILD_FLAGS)


@needs_kernel
@needs_avx2_build_apart
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 64), (32, 2, 16)])
def test_the_avx2_build_matches_causal_attention_in_float32(
    avx2_chunk_kernel: ChunkKernel | None, heads: int, kv_heads: int, dim: int
) -> None:
    """Built for AVX2 without AVX-512, float32 chunks (tiles of one pass of rows and of two,
    over cached tokens and fresh) still match exact attention within float32 rounding."""
    assert avx2_chunk_kernel is not None
    shapes = [(0, 2), (0, 37), (13, 60), (100, 7), (0, 130), (17, 16)]
    q, out, keys, values = run_chunks(
        shapes, heads, kv_heads, dim, 4, torch.float32, seed=dim + 5, kernel=avx2_chunk_kernel
    )
    row = 0
    for (_, n), k, v in zip(shapes, keys, values, strict=True):
        expected = causal_attention(q[row : row + n], k, v)
        torch.testing.assert_close(out[row : row + n].double(), expected, atol=3e-6, rtol=1e-5)
        row += n
