"""The step's page table in FlashInfer's CSR form, shared by every attention backend.

Convention: a sequence's KV for this step includes its new tokens (they are written to their
slots first), so ``kv_len = num_computed_tokens + num_new_tokens`` and query token ``i`` of a
sequence sits at position ``kv_len - qo_len + i`` (causal within the chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.transfers import upload


class SeqSlice(NamedTuple):
    """One sequence's share of a step."""

    page_ids: Sequence[int]  # its block table (at least ceil(kv_len / page_size) pages)
    num_computed_tokens: int  # tokens whose KV is already in the pages
    num_new_tokens: int  # tokens run in this step (1 for a decode)


@dataclass(slots=True)
class AttentionMetadata:
    qo_indptr: torch.Tensor  # [num_seqs + 1] int32: query offsets into the flattened batch
    kv_indptr: torch.Tensor  # [num_seqs + 1] int32: offsets into kv_indices
    kv_indices: torch.Tensor  # [total_pages] int32: page ids, sequence after sequence
    kv_last_page_len: torch.Tensor  # [num_seqs] int32: tokens in each sequence's last page (1..P)
    slot_mapping: torch.Tensor  # [num_tokens] int64: page_id * page_size + offset of each new token
    page_size: int
    # Host copies for backends that loop or plan on the CPU.
    qo_lens: list[int]
    kv_lens: list[int]
    # (lowest page id, highest page id, lowest slot, highest slot), read from the host lists
    # when the tensors live on an accelerator, so a backend checks bounds without reading them.
    host_bounds: tuple[int, int, int, int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.qo_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.qo_lens)


def build_attention_metadata(
    seqs: Sequence[SeqSlice], page_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """Build the page table for a step; cost is linear in the step's pages and tokens only."""
    qo_indptr = [0]
    kv_indptr = [0]
    kv_indices: list[int] = []
    last_page_len: list[int] = []
    slots: list[int] = []
    qo_lens: list[int] = []
    kv_lens: list[int] = []
    for seq in seqs:
        if seq.num_new_tokens <= 0:
            raise ValueError("a scheduled sequence must run at least one token")
        kv_len = seq.num_computed_tokens + seq.num_new_tokens
        num_pages = (kv_len + page_size - 1) // page_size
        if len(seq.page_ids) < num_pages:
            raise ValueError(f"block table has {len(seq.page_ids)} pages, needs {num_pages}")
        pages = seq.page_ids[:num_pages]
        kv_indices.extend(pages)
        kv_indptr.append(kv_indptr[-1] + num_pages)
        qo_indptr.append(qo_indptr[-1] + seq.num_new_tokens)
        last_page_len.append(kv_len - (num_pages - 1) * page_size)
        for pos in range(seq.num_computed_tokens, kv_len):
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        qo_lens.append(seq.num_new_tokens)
        kv_lens.append(kv_len)
    bounds = None
    if torch.device(device).type != "cpu" and slots:
        bounds = (min(kv_indices), max(kv_indices), min(slots), max(slots))
    on = torch.device(device)  # uploads that never wait for the device (engine/transfers.py)
    return AttentionMetadata(
        qo_indptr=upload(qo_indptr, torch.int32, on),
        kv_indptr=upload(kv_indptr, torch.int32, on),
        kv_indices=upload(kv_indices, torch.int32, on),
        kv_last_page_len=upload(last_page_len, torch.int32, on),
        slot_mapping=upload(slots, torch.int64, on),
        page_size=page_size,
        qo_lens=qo_lens,
        kv_lens=kv_lens,
        host_bounds=bounds,
    )
