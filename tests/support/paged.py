"""Run our model step by step over a paged KV cache, the way the engine does; fill a paged cache
with known K/V for the attention kernels' tests."""

from __future__ import annotations

import platform
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch

from engine.attention.backend import AttentionBackend, allocate_kv_caches
from engine.attention.metadata import SeqSlice, build_attention_metadata
from engine.model.llama import LlamaForCausalLM

# Whether this CPU has AMX tiles (the bfloat16 attention kernels then multiply through them).
HAS_AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
# Extra compiler flags that build the native kernels as for an x86 CPU with AVX2 and no
# AVX-512, and the mark of tests that run such a build beside this CPU's own: on x86 with
# AVX-512 only (on an AVX2-only CPU the native build already is that one, which the float32
# tests check; elsewhere it cannot run).
AVX2_BUILD_FLAGS = ("-march=x86-64-v3",)
needs_avx2_build_apart = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64")
    or not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
    reason="x86 with AVX-512 only (on an AVX2-only CPU the native build is that build, which "
    "the float32 tests check; elsewhere it cannot run)",
)


@dataclass(slots=True)
class PagedSeq:
    """A sequence's tokens so far, its page ids, and how many tokens have KV in the cache."""

    tokens: list[int]
    page_ids: list[int]
    num_computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # one [vocab] per step run


class PagedRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_pages: int,
        page_size: int,
    ) -> None:
        c = model.config
        self.model = model
        self.backend = backend
        self.page_size = page_size
        dtype = model.embed_tokens.weight.dtype
        self.kv_caches = allocate_kv_caches(
            c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim, dtype
        )

    def step(self, seqs: Sequence[PagedSeq], num_new: Sequence[int]) -> torch.Tensor:
        """Run ``num_new[i]`` uncomputed tokens of each sequence; [num_seqs, vocab] logits."""
        slices: list[SeqSlice] = []
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        for seq, n in zip(seqs, num_new, strict=True):
            start = seq.num_computed
            slices.append(SeqSlice(seq.page_ids, start, n))
            ids.extend(seq.tokens[start : start + n])
            positions.extend(range(start, start + n))
            last.append(len(ids) - 1)
        meta = build_attention_metadata(slices, self.page_size)
        logits: torch.Tensor = self.model(
            torch.tensor(ids),
            torch.tensor(positions),
            meta,
            self.backend,
            self.kv_caches,
            torch.tensor(last),
        )
        for seq, n, row in zip(seqs, num_new, logits, strict=True):
            seq.num_computed += n
            seq.logits.append(row)
        return logits


def filled_cache(
    kv_lens: list[int], page_size: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """A cache holding each sequence's K/V in shuffled pages; returns the tables and K/V."""
    rng = random.Random(seed)
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 1
    pages = list(range(num_pages))
    rng.shuffle(pages)
    cache = allocate_kv_caches(1, num_pages, page_size, kv_heads, dim, dtype)[0]
    tables, keys, values = [], [], []
    for n in kv_lens:
        table = [pages.pop() for _ in range(-(-n // page_size))]
        k = torch.randn(n, kv_heads, dim).to(dtype)
        v = torch.randn(n, kv_heads, dim).to(dtype)
        for pos in range(n):
            cache[table[pos // page_size], 0, pos % page_size] = k[pos]
            cache[table[pos // page_size], 1, pos % page_size] = v[pos]
        tables.append(table)
        keys.append(k)
        values.append(v)
    return cache, tables, keys, values


def csr(tables: list[list[int]], kv_lens: list[int]) -> tuple[torch.Tensor, ...]:
    """The kernel's page arguments: the tables one after another, where each starts, lengths."""
    starts = [0]
    for table in tables[:-1]:
        starts.append(starts[-1] + len(table))
    flat = [p for table in tables for p in table]
    return (
        torch.tensor(flat, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(kv_lens, dtype=torch.int32),
    )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact attention of the last ``len(q)`` positions of a sequence: q [qo, heads, dim] over
    k/v [kv, kv_heads, dim] (GQA), causal, in float64."""
    qo, kv = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / q.shape[-1] ** 0.5
    visible = torch.arange(kv)[None, :] <= torch.arange(kv - qo, kv)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def shared_prefix_cache(
    groups: list[tuple[int, list[int]]],  # (shared prefix tokens, each member's own tokens)
    page_size: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """A cache in which the members of each group share the pages of a prefix (a whole number of
    pages), as prefix-cache hits do, then hold their own tokens on pages of their own. Returns
    the cache and, per member (groups in order), its table and its whole K/V."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_pages = 1
    for prefix, tails in groups:
        assert prefix % page_size == 0
        num_pages += prefix // page_size + sum(-(-n // page_size) for n in tails)
    pages = list(range(num_pages))
    rng.shuffle(pages)
    cache = allocate_kv_caches(1, num_pages, page_size, kv_heads, dim, dtype)[0]

    def fill(table: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for i in range(k.shape[0]):
            pos = start + i
            cache[table[pos // page_size], 0, pos % page_size] = k[i]
            cache[table[pos // page_size], 1, pos % page_size] = v[i]

    tables, keys, values = [], [], []
    for prefix, tails in groups:
        shared = [pages.pop() for _ in range(prefix // page_size)]
        pk = torch.randn(prefix, kv_heads, dim, generator=gen).to(dtype)
        pv = torch.randn(prefix, kv_heads, dim, generator=gen).to(dtype)
        fill(shared, 0, pk, pv)
        for n in tails:
            table = shared + [pages.pop() for _ in range(-(-n // page_size))]
            k = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
            v = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
            fill(table, prefix, k, v)
            tables.append(table)
            keys.append(torch.cat([pk, k]))
            values.append(torch.cat([pv, v]))
    return cache, tables, keys, values
