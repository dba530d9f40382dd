"""Run our model step by step over a paged KV cache, the way the engine does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.attention.backend import AttentionBackend, allocate_kv_caches
from engine.attention.metadata import SeqSlice, build_attention_metadata
from engine.model.llama import LlamaForCausalLM


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
