"""Resident adapter slots: every layer's LoRA weights stacked by slot, and which adapter holds
which slot (least recently used unpinned slots are reloaded first)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine.lora.adapter import LoraAdapter, target_shape
from engine.model.config import ModelConfig

# Our fused projections and the PEFT targets inside each, in the order of their output columns.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# The order of the targets' A blocks along the rank in each group: PEFT's default targets for
# Llama models (q_proj, v_proj) first, so a step whose adapters have only those reads the first
# two thirds of the stacked A and no zeros for k_proj.
RANK_ORDER: dict[str, tuple[str, ...]] = {**GROUPS, "qkv": ("q_proj", "v_proj", "k_proj")}


class LoraWeights:
    """Per layer and group: A of every target stacked along the rank in ``RANK_ORDER``, ``a``
    [slots, T * R, in], and per target in ``GROUPS``' order ``b`` [slots, R, out_t] (B
    transposed, scale folded in), R the max rank; a lower rank and an absent target are zeros
    (they add exactly nothing). The first ``s`` slots of either are one contiguous [s * rows,
    cols] matrix. ``columns`` gives each target's (first column, width) in the fused
    projection's output."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.a: list[dict[str, torch.Tensor]] = []
        self.b: list[dict[str, list[torch.Tensor]]] = []
        self.columns: dict[str, list[tuple[int, int]]] = {}
        for group, targets in GROUPS.items():
            start, cols = 0, []
            for target in targets:
                width = target_shape(config, target)[1]
                cols.append((start, width))
                start += width
            self.columns[group] = cols
        for _ in range(config.num_layers):
            a_layer: dict[str, torch.Tensor] = {}
            b_layer: dict[str, list[torch.Tensor]] = {}
            for group, targets in GROUPS.items():
                in_features = target_shape(config, targets[0])[0]
                shape = (num_slots, len(targets) * max_rank, in_features)
                a_layer[group] = torch.zeros(shape, dtype=dtype, device=device)
                b_layer[group] = [
                    torch.zeros(
                        (num_slots, max_rank, target_shape(config, t)[1]),
                        dtype=dtype,
                        device=device,
                    )
                    for t in targets
                ]
            self.a.append(a_layer)
            self.b.append(b_layer)
        self.targets: list[frozenset[str]] = [frozenset()] * num_slots

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` in ``slot`` (whatever was there is overwritten with zeros first)."""
        r, big_r = adapter.rank, self.max_rank
        for layer_a, layer_b in zip(self.a, self.b, strict=True):
            for group in GROUPS:
                layer_a[group][slot].zero_()
                for b in layer_b[group]:
                    b[slot].zero_()
        for (layer, target), (a, b) in adapter.weights.items():
            group = next(g for g, targets in GROUPS.items() if target in targets)
            t = RANK_ORDER[group].index(target)
            self.a[layer][group][slot, t * big_r : t * big_r + r].copy_(a)
            self.b[layer][group][GROUPS[group].index(target)][slot, :r].copy_(b.t())
        self.targets[slot] = adapter.targets


class AdapterSlots:
    """Which adapter holds which slot. A slot is pinned while running requests use its adapter;
    an adapter not resident takes a free slot, else the least recently used unpinned one."""

    def __init__(self, weights: LoraWeights) -> None:
        self.weights = weights
        self.slot_of: dict[str, int] = {}
        self.name_of: list[str | None] = [None] * weights.num_slots
        self.pins = [0] * weights.num_slots
        self._idle: OrderedDict[str, None] = OrderedDict()  # resident, unpinned; oldest first
        self.num_loads = 0

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """Pin ``adapter``'s slot, loading it there if needed; None when every slot is pinned."""
        slot = self.slot_of.get(adapter.name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self.weights.write(slot, adapter)
            self.slot_of[adapter.name] = slot
            self.name_of[slot] = adapter.name
            self.num_loads += 1
        self._idle.pop(adapter.name, None)
        self.pins[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """Unpin ``slot`` once; at zero its adapter stays resident, the most recently used."""
        self.pins[slot] -= 1
        if self.pins[slot] < 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        name = self.name_of[slot]
        if self.pins[slot] == 0 and name is not None:
            self._idle[name] = None

    def drop(self, name: str) -> None:
        """Forget ``name``'s resident copy (a changed adapter): loaded again on next use."""
        slot = self.slot_of.get(name)
        if slot is not None and self.pins[slot] == 0:
            del self.slot_of[name]
            self.name_of[slot] = None
            self._idle.pop(name, None)

    def _free_slot(self) -> int | None:
        for slot, name in enumerate(self.name_of):
            if name is None:
                return slot
        if not self._idle:
            return None
        victim, _ = self._idle.popitem(last=False)
        slot = self.slot_of.pop(victim)
        self.name_of[slot] = None
        return slot
