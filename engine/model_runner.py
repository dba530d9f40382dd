"""Turns a scheduled step into model inputs and runs one forward pass over the flat batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from engine.attention.backend import AttentionBackend, allocate_kv_caches
from engine.attention.metadata import AttentionMetadata, SeqSlice, build_attention_metadata
from engine.cuda_graphs import DecodeGraphs, GraphStep
from engine.lora.batch import LoraStep
from engine.lora.manager import LoraManager
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.scheduler import ScheduledSeq
from engine.transfers import upload


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_rows] int64: last token of each sampled sequence, and
    # every row of a drafted decode
    lora: LoraStep | None = None  # the rows' LoRA adapters; None when no row has one
    graph: GraphStep | None = None  # a decode step staged in the graphs' static buffers


class ModelRunner:
    """Owns the KV cache tensors and the attention backend for one model."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        *,
        backend: AttentionBackend,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        on_allocated: Callable[[int], object] | None = None,
        scratch_page: bool = False,
    ) -> None:
        """``on_allocated`` is told the bytes of each layer's KV tensor once it is allocated.
        ``scratch_page`` adds one page past the pool's ``num_pages`` (its id: ``num_pages``),
        which no request holds: padded decode rows write there (``engine/cuda_graphs.py``)."""
        self.model = model
        self.backend = backend
        self.page_size = page_size
        self.device = torch.device(device)
        self.lora: LoraManager | None = None  # set by the engine when adapters are on
        self.graphs: DecodeGraphs | None = None  # set by the engine when decodes pad
        self.scratch_page = num_pages if scratch_page else None
        # One tensor per layer: [num_pages, 2, page_size, num_kv_heads, head_dim]
        self.kv_caches = allocate_kv_caches(
            config.num_layers,
            num_pages + int(scratch_page),
            page_size,
            config.num_kv_heads,
            config.head_dim,
            dtype,
            self.device,
            on_allocated,
        )

    def prepare(self, seqs: Sequence[ScheduledSeq]) -> StepInputs:
        """Flatten the step's tokens (no padding); cost is linear in the step's tokens. With
        graphs, a decode-only step they hold is staged, padded, in their static buffers."""
        graphs = self.graphs
        rows = graphs.rows_for(seqs) if graphs is not None else None
        if graphs is not None and rows is not None:
            step = graphs.stage(rows)
            return StepInputs(
                step.input_ids, step.positions, step.meta, step.logits_indices, graph=step
            )
        input_ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        slices: list[SeqSlice] = []
        row_slots: list[int] = []  # each row's LoRA slot (-1: none), when adapters are on
        for seq in seqs:
            request = seq.request
            start = request.num_computed_tokens
            end = start + seq.num_new_tokens
            if self.lora is not None:
                row_slots.extend([request.lora_slot] * seq.num_new_tokens)
            if seq.draft:
                # The last token and the draft: one decode row each (row i sees the KV up to its
                # own position), so they attend like decodes, with the request's prefix shared.
                input_ids.append(request.all_token_ids[start])
                input_ids.extend(seq.draft)
                logits_indices.extend(range(len(input_ids) - seq.num_new_tokens, len(input_ids)))
                slices.extend(SeqSlice(request.block_table, pos, 1) for pos in range(start, end))
                positions.extend(range(start, end))
                continue
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            if seq.sample:
                logits_indices.append(len(input_ids) - 1)
            slices.append(SeqSlice(request.block_table, start, seq.num_new_tokens))
        device = self.device
        lora = None
        if self.lora is not None and any(slot >= 0 for slot in row_slots):
            lora = self.lora.step(row_slots, logits_indices)
        return StepInputs(  # uploads that never wait for the device (engine/transfers.py)
            input_ids=upload(input_ids, torch.long, device),
            positions=upload(positions, torch.long, device),
            meta=build_attention_metadata(slices, self.page_size, device),
            logits_indices=upload(logits_indices, torch.long, device),
            lora=lora,
        )

    def forward(self, inputs: StepInputs) -> torch.Tensor:  # [num_sampled, vocab] float32
        if inputs.graph is not None and self.graphs is not None:
            return self.graphs.run(inputs.graph)
        logits: torch.Tensor = self.model(
            inputs.input_ids,
            inputs.positions,
            inputs.meta,
            self.backend,
            self.kv_caches,
            inputs.logits_indices,
            inputs.lora,
        )
        return logits
