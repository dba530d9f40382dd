"""The engine's adapters: loaded adapters kept on the host (least recently used dropped), the
resident slots, and each step's per-row layout."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.lora.adapter import AdapterError, LoraAdapter, load_adapter
from engine.lora.batch import LoraRows, LoraStep
from engine.lora.slots import AdapterSlots, LoraWeights
from engine.model.config import ModelConfig

HOST_ADAPTERS_PER_SLOT = 4  # loaded adapters kept on the host per resident slot


class LoraManager:
    """Not thread-safe: the engine thread alone calls it."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model_config = config
        self.max_rank = max_rank
        # On CPU the deltas run in float32: torch's small batched products are several times
        # faster there than in bfloat16 (measured: 8 against 40 us for a decode block), and the
        # slots are small beside the model.
        self.dtype = torch.float32 if device.type == "cpu" else dtype
        self.device = device
        self.slots = AdapterSlots(LoraWeights(config, num_slots, max_rank, self.dtype, device))
        self._host: OrderedDict[str, tuple[str, LoraAdapter]] = OrderedDict()
        self._host_limit = HOST_ADAPTERS_PER_SLOT * num_slots

    def get(self, name: str, path: str | None) -> LoraAdapter:
        """The adapter ``name`` read from ``path`` (cached on the host by name and path; a new
        path for a known name replaces it and its resident copy)."""
        if not name:
            raise AdapterError("the adapter name is empty", "model")
        if not path:
            raise AdapterError(f"adapter {name!r} has no path", "model")
        cached = self._host.get(name)
        if cached is not None and cached[0] == path:
            self._host.move_to_end(name)
            return cached[1]
        if cached is not None:
            self.slots.drop(name)
        adapter = load_adapter(name, Path(path), self.model_config, self.max_rank, self.dtype)
        self._host[name] = (path, adapter)
        while len(self._host) > self._host_limit:
            self._host.popitem(last=False)
        return adapter

    def step(self, row_slots: Sequence[int], sampled_rows: Sequence[int]) -> LoraStep | None:
        """The step's layout from each flat row's slot (-1: none) and the sampled rows' indices;
        None when no row has an adapter, so such a step runs exactly as without adapters."""
        targets = self.slots.weights.targets
        dtype = self.slots.weights.dtype
        rows = LoraRows.build(row_slots, targets, self.device, dtype)
        if rows is None:
            return None
        sampled = LoraRows.build([row_slots[r] for r in sampled_rows], targets, self.device, dtype)
        return LoraStep(self.slots.weights, rows, sampled)
