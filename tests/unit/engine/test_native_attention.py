"""The native CPU decode kernel against per-sequence reference attention and the torch path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.metadata import SeqSlice, build_attention_metadata
from engine.attention.native_attention import (
    DECODE_SOURCE,
    DecodeKernel,
    chunk_kernel_beats_torch,
    load_chunk_kernel,
    load_decode_kernel,
    try_load_decode_kernel,
)
from engine.attention.registry import create_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.device import cpu_has_bf16_dot
from engine.model.config import ModelConfig
from engine.model.native_ops import SOURCE as LAYER_OPS_SOURCE
from engine.native import build
from engine.native.build import build_library, native_enabled, try_load
from tests.support.paged import (
    AVX2_BUILD_FLAGS,
    causal_attention,
    csr,
    filled_cache,
    needs_avx2_build_apart,
    shared_prefix_cache,
)

KERNEL = load_decode_kernel()
needs_kernel = pytest.mark.skipif(
    KERNEL is None, reason="no C compiler here (the torch decode path is tested without one)"
)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One decode: q [heads, dim] over k/v [kv_len, kv_heads, dim], in float64."""
    return causal_attention(q[None], k, v)[0]


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"),
    [(9, 3, 64), (8, 8, 64), (8, 2, 128), (10, 2, 32), (6, 2, 80), (32, 2, 16)],
)
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_float32_decodes_match_reference(
    heads: int, kv_heads: int, dim: int, page_size: int
) -> None:
    """Every group size the kernel specialises (1, 2, 3, 4, 8) and the generic one (5, 16),
    head sizes with and without a specialisation, sequences shorter and longer than a page."""
    assert KERNEL is not None
    torch.manual_seed(page_size)
    kv_lens = [1, 2, page_size, page_size + 1, 37, 130]
    cache, tables, keys, values = filled_cache(
        kv_lens, page_size, kv_heads, dim, torch.float32, seed=dim
    )
    q = torch.randn(len(kv_lens), heads, dim)
    out = KERNEL(q, cache, *csr(tables, kv_lens))
    assert out.shape == q.shape and out.dtype == torch.float32
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        torch.testing.assert_close(out[i].double(), reference(q[i], k, v), atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("page_size", [1, 16])
def test_bfloat16_decodes_match_the_torch_path(page_size: int) -> None:
    """In bfloat16 the kernel rounds where the torch path rounds (scores, probabilities, output):
    the two agree to a bfloat16 ulp, and both stay close to exact attention."""
    torch.manual_seed(7)
    kv_lens = [1, 3, 17, 64, 300]
    cache, tables, keys, values = filled_cache(kv_lens, page_size, 3, 64, torch.bfloat16, seed=7)
    q = torch.randn(len(kv_lens), 9, 64).to(torch.bfloat16)
    new_k = torch.stack([k[-1] for k in keys])
    new_v = torch.stack([v[-1] for v in values])
    meta = build_attention_metadata(
        [SeqSlice(t, n - 1, 1) for t, n in zip(tables, kv_lens, strict=True)], page_size
    )
    outs = []
    for backend in (TorchAttentionBackend(), TorchAttentionBackend(KERNEL)):
        backend.plan(meta)
        outs.append(backend.forward(0, q, new_k, new_v, cache.clone()))
    torch_out, native_out = outs
    assert native_out.dtype == torch.bfloat16
    torch.testing.assert_close(native_out.float(), torch_out.float(), atol=4e-3, rtol=8e-3)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        exact = reference(q[i], k, v)
        torch.testing.assert_close(native_out[i].double(), exact, atol=2e-2, rtol=2e-2)


@needs_kernel
def test_query_rows_may_be_strided_views_of_fused_qkv() -> None:
    assert KERNEL is not None
    torch.manual_seed(5)
    kv_lens = [3, 20, 9]
    cache, tables, keys, values = filled_cache(kv_lens, 4, 3, 64, torch.float32, seed=5)
    qkv = torch.randn(len(kv_lens), (9 + 2 * 3) * 64)
    q = qkv[:, : 9 * 64].view(-1, 9, 64)  # rows 15 * 64 apart
    assert not q.is_contiguous()
    out = KERNEL(q, cache, *csr(tables, kv_lens))
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        torch.testing.assert_close(out[i].double(), reference(q[i], k, v), atol=2e-6, rtol=1e-5)


@needs_kernel
def test_unsupported_inputs_are_refused_not_misread() -> None:
    assert KERNEL is not None
    cache, tables, _, _ = filled_cache([5], 4, 2, 16, torch.float32, seed=0)
    tables_csr = csr(tables, [5])
    with pytest.raises(ValueError, match="unsupported"):
        KERNEL(torch.randn(1, 4, 16).to(torch.bfloat16), cache, *tables_csr)  # dtype mismatch
    with pytest.raises(ValueError, match="unsupported"):
        KERNEL(torch.randn(1, 5, 16), cache, *tables_csr)  # 5 heads over 2 KV heads
    with pytest.raises(ValueError, match="int32"):
        KERNEL(torch.randn(1, 4, 16), cache, *(t.long() for t in tables_csr))
    small, small_tables, _, _ = filled_cache([5], 4, 2, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="head_dim 8"):
        KERNEL(torch.randn(1, 4, 8), small, *csr(small_tables, [5]))
    assert not DecodeKernel.supports(torch.float32, 4, 2, 8)
    assert not DecodeKernel.supports(torch.float16, 4, 2, 64)
    assert DecodeKernel.supports(torch.bfloat16, 9, 3, 64)


def model(head_dim: int) -> ModelConfig:
    """A one-layer model with four query heads over two KV heads of ``head_dim``."""
    return ModelConfig(
        vocab_size=64,
        hidden_size=4 * head_dim,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
    )


def test_the_cpu_backend_uses_the_kernels_where_they_apply() -> None:
    cpu = torch.device("cpu")
    for dtype, head_dim, expected in [
        (torch.float32, 16, KERNEL is not None),
        (torch.bfloat16, 64, KERNEL is not None),
        (torch.float16, 64, False),
        (torch.float32, 8, False),
    ]:
        backend = create_backend(cpu, model(head_dim), page_size=16, dtype=dtype)
        assert isinstance(backend, TorchAttentionBackend)
        assert backend.native_decode is expected, (dtype, head_dim)
        chunks = expected and load_chunk_kernel() is not None and chunk_kernel_beats_torch(dtype)
        assert backend.native_chunks is chunks


def test_prefill_chunks_take_the_kernel_only_where_it_beats_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AVX-512: both dtypes. AVX2 alone: float32 (its own eight-lane tile), not bfloat16."""
    config = model(16)
    for capability, dtype, expected in (
        ("AVX2", torch.float32, True),
        ("AVX2", torch.bfloat16, False),
        ("DEFAULT", torch.float32, False),
        ("AVX512", torch.float32, True),
        ("AVX512", torch.bfloat16, True),
    ):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert chunk_kernel_beats_torch(dtype) is expected, (capability, dtype)
        backend = create_backend(torch.device("cpu"), config, page_size=16, dtype=dtype)
        assert isinstance(backend, TorchAttentionBackend)
        assert backend.native_chunks is (expected and load_chunk_kernel() is not None)
        assert backend.native_decode is (KERNEL is not None)  # decodes take it everywhere


@needs_kernel
def test_builds_once_per_source_and_reuses_the_cached_library(tmp_path: Path) -> None:
    # The smallest source: the cache works the same for every one, and this one builds in a
    # fraction of a second where the attention kernels take up to a minute on a slow CPU.
    source = LAYER_OPS_SOURCE
    stale = tmp_path / f"{source.stem}-0123456789abcdef.so"  # an older version's build
    stale.write_bytes(b"")
    other = tmp_path / f"{DECODE_SOURCE.stem}-0123456789abcdef.so"  # another source's: kept
    other.write_bytes(b"")
    first = build_library(source, tmp_path)
    assert not stale.exists() and other.exists()
    other.unlink()
    stamp = first.stat().st_mtime_ns
    assert build_library(source, tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no build folder left behind
    assert try_load(source, lambda library: library, tmp_path) == first


def test_prebuild_builds_every_source_at_once_and_leaves_failures_to_the_loaders(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "one.c").write_text("int one(void) { return 1; }\n")
    (sources / "two.c").write_text("int two(void) { return 2; }\n")
    (sources / "broken.c").write_text("int broken(void) { return }\n")
    monkeypatch.setattr(build, "FOLDER", sources)
    cache = tmp_path / "cache"
    build.prebuild(cache)
    built = sorted(p.name.split("-")[0] for p in cache.glob("*.so"))
    assert built == ["one", "two"]
    stamps = {p: p.stat().st_mtime_ns for p in cache.glob("*.so")}
    build.prebuild(cache)  # cached: nothing is built again
    assert {p: p.stat().st_mtime_ns for p in cache.glob("*.so")} == stamps
    monkeypatch.setenv("ATRIUM_NATIVE_KERNELS", "0")
    other = tmp_path / "off"
    build.prebuild(other)
    assert not other.exists()


def test_no_compiler_or_switched_off_means_no_kernel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert try_load_decode_kernel(tmp_path) is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("ATRIUM_NATIVE_KERNELS", "0")
    assert not native_enabled()
    assert try_load_decode_kernel(tmp_path) is None


@pytest.fixture(scope="module")
def alone_decode_kernel(tmp_path_factory: pytest.TempPathFactory) -> DecodeKernel | None:
    """The decode kernel built to attend every decode on its own."""
    return try_load_decode_kernel(tmp_path_factory.mktemp("alone"), ("-DATRIUM_DECODE_ALONE=1",))


@pytest.fixture(scope="module")
def no_amx_decode_kernel(tmp_path_factory: pytest.TempPathFactory) -> DecodeKernel | None:
    """The decode kernel built without AMX tiles: groups attend their prefix through pair dot
    products (what CPUs without AMX run)."""
    return try_load_decode_kernel(tmp_path_factory.mktemp("no-amx"), ("-mno-amx-tile",))


# Groups of decodes over a shared prefix (tokens, then each member's own tokens): the smallest
# prefix grouped (32 tokens), more members than one tile item holds, one-token tails, a lone
# decode, and a prefix too short to group.
SHARED_GROUPS = [(32, [1, 5]), (96, [3] * 20), (64, [40, 1, 17]), (128, [9]), (16, [2, 30])]


@pytest.mark.skipif(
    KERNEL is None or not cpu_has_bf16_dot(),
    reason="needs the C compiler and a CPU with bfloat16 pair dot products (elsewhere every "
    "decode attends on its own, tested above)",
)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (32, 2, 32)])
@pytest.mark.parametrize("page_size", [4, 16, 32])
@pytest.mark.parametrize("build", ["default", "no-amx"])
def test_decodes_over_a_shared_prefix_attend_it_together(
    alone_decode_kernel: DecodeKernel | None,
    no_amx_decode_kernel: DecodeKernel | None,
    build: str,
    heads: int,
    kv_heads: int,
    dim: int,
    page_size: int,
) -> None:
    """Decodes whose tables start with the same pages attend that prefix together (their query
    heads the rows of AMX tile products, or of pair dot products over transposed keys without
    AMX) and then each its own tokens, carrying the prefix's share in. In any order of the
    step's decodes the result matches exact attention and the build that attends every decode
    on its own, within bfloat16 rounding."""
    kernel = KERNEL if build == "default" else no_amx_decode_kernel
    assert kernel is not None and alone_decode_kernel is not None
    groups = [(max(p, page_size) // page_size * page_size, tails) for p, tails in SHARED_GROUPS]
    cache, tables, keys, values = shared_prefix_cache(
        groups, page_size, kv_heads, dim, torch.bfloat16, seed=dim + page_size
    )
    order = torch.randperm(len(tables), generator=torch.Generator().manual_seed(page_size))
    tables = [tables[i] for i in order]
    keys = [keys[i] for i in order]
    values = [values[i] for i in order]
    kv_lens = [k.shape[0] for k in keys]
    q = torch.randn(len(tables), heads, dim).to(torch.bfloat16)
    together = kernel(q, cache, *csr(tables, kv_lens))
    alone = alone_decode_kernel(q, cache, *csr(tables, kv_lens))
    torch.testing.assert_close(together.float(), alone.float(), atol=8e-3, rtol=1.6e-2)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        exact = reference(q[i], k, v)
        torch.testing.assert_close(together[i].double(), exact, atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (6, 2, 32)])
@pytest.mark.parametrize("page_size", [4, 10, 16, 32])
def test_float32_decodes_over_a_shared_prefix_attend_it_together(
    alone_decode_kernel: DecodeKernel | None, heads: int, kv_heads: int, dim: int, page_size: int
) -> None:
    """In float32 (any CPU) a group's prefix is attended once with its members' query heads as
    rows over transposed keys (or, with AVX2, transposed rows), then each member's own tokens
    with the prefix's share carried in: the same as attending each decode on its own, and as
    exact attention, within float32 rounding, in any order of the step's decodes. Pages of ten
    tokens give prefixes that end inside a block of four keys."""
    assert KERNEL is not None and alone_decode_kernel is not None
    groups = [(max(p, page_size) // page_size * page_size, tails) for p, tails in SHARED_GROUPS]
    cache, tables, keys, values = shared_prefix_cache(
        groups, page_size, kv_heads, dim, torch.float32, seed=dim + page_size + 1
    )
    order = torch.randperm(len(tables), generator=torch.Generator().manual_seed(page_size + 1))
    tables = [tables[i] for i in order]
    keys = [keys[i] for i in order]
    values = [values[i] for i in order]
    kv_lens = [k.shape[0] for k in keys]
    q = torch.randn(len(tables), heads, dim)
    together = KERNEL(q, cache, *csr(tables, kv_lens))
    alone = alone_decode_kernel(q, cache, *csr(tables, kv_lens))
    torch.testing.assert_close(together, alone, atol=2e-6, rtol=2e-5)
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        torch.testing.assert_close(
            together[i].double(), reference(q[i], k, v), atol=1e-5, rtol=1e-4
        )


@pytest.fixture(scope="module")
def avx2_decode_kernel(tmp_path_factory: pytest.TempPathFactory) -> DecodeKernel | None:
    """The decode kernel as built for an x86 CPU with AVX2 and no AVX-512 (its float32 paths
    of eight-lane registers), where this CPU can run that build."""
    return try_load_decode_kernel(tmp_path_factory.mktemp("avx2"), AVX2_BUILD_FLAGS)


@needs_kernel
@needs_avx2_build_apart
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (6, 2, 80)])
def test_the_avx2_build_attends_float32_decodes_alone_and_in_groups(
    avx2_decode_kernel: DecodeKernel | None, heads: int, kv_heads: int, dim: int
) -> None:
    """Built for AVX2 without AVX-512, float32 decodes (over shared prefixes and on their own)
    still match exact attention within float32 rounding."""
    assert avx2_decode_kernel is not None
    groups = [(p // 4 * 4, tails) for p, tails in SHARED_GROUPS]
    cache, tables, keys, values = shared_prefix_cache(
        groups, 4, kv_heads, dim, torch.float32, seed=dim + 11
    )
    kv_lens = [k.shape[0] for k in keys]
    q = torch.randn(len(tables), heads, dim)
    out = avx2_decode_kernel(q, cache, *csr(tables, kv_lens))
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        torch.testing.assert_close(out[i].double(), reference(q[i], k, v), atol=1e-5, rtol=1e-4)
