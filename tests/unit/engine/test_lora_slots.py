"""Resident adapter slots: pinned slots are never reused, idle ones go least recently used first,
and the per-row layout covers every adapter row exactly once."""

from __future__ import annotations

import torch

from engine.lora.adapter import LoraAdapter
from engine.lora.batch import LoraRows
from engine.lora.slots import AdapterSlots, LoraWeights
from engine.model.config import ModelConfig
from tests.support.tiny_llama import TINY_CONFIG


def _slots(num_slots: int) -> AdapterSlots:
    config = ModelConfig.from_hf_dict({**TINY_CONFIG, "model_type": "llama"})
    return AdapterSlots(LoraWeights(config, num_slots, 4, torch.float32, torch.device("cpu")))


def _adapter(name: str, value: float) -> LoraAdapter:
    a = torch.full((2, 64), value)
    b = torch.full((64, 2), value)
    return LoraAdapter(name, 2, 1.0, {(0, "o_proj"): (a, b)})


def test_pinned_slots_are_kept_and_idle_ones_go_oldest_first() -> None:
    slots = _slots(2)
    x, y, z = _adapter("x", 1.0), _adapter("y", 2.0), _adapter("z", 3.0)
    sx, sy = slots.acquire(x), slots.acquire(y)
    assert {sx, sy} == {0, 1}
    assert slots.acquire(z) is None  # both pinned: z waits
    assert sx is not None and sy is not None
    slots.release(sy)
    slots.release(sx)  # x is now the most recently used idle adapter
    sz = slots.acquire(z)
    assert sz == sy  # y, the older idle one, made room
    assert slots.weights.a[0]["o"][sz, :2].eq(3.0).all()
    assert slots.weights.a[0]["o"][sz, 2:].eq(0.0).all()  # the rest of the rank is zeros
    assert slots.acquire(x) == sx  # still resident: no load
    assert slots.num_loads == 3


def test_rows_layout_covers_each_adapter_row_once() -> None:
    targets = [frozenset({"o_proj"})] * 3
    row_slots = [-1, 2, 2, 0, -1, 2, 2, 2, 1, 2]
    rows = LoraRows.build(row_slots, targets, torch.device("cpu"))
    assert rows is not None
    assert sorted(rows.dest.tolist()) == [i for i, s in enumerate(row_slots) if s >= 0]
    gathered = rows.gather[rows.valid]
    assert gathered.tolist() == rows.dest.tolist()
    # Each block holds rows of its own slot alone.
    for block, slot in enumerate(rows.block_slots.tolist()):
        members = rows.gather[block * rows.block : (block + 1) * rows.block].tolist()
        assert all(row_slots[r] == slot for r in members)
    assert LoraRows.build([-1, -1], targets, torch.device("cpu")) is None
