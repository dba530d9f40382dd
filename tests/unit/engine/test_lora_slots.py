"""Resident adapter slots: pinned slots are never reused, idle ones go least recently used first,
and the per-row layout covers every adapter row exactly once."""

from __future__ import annotations

import pytest
import torch

from engine.lora.adapter import LoraAdapter, target_shape
from engine.lora.batch import LoraRows, LoraStep
from engine.lora.slots import GROUPS, AdapterSlots, LoraWeights
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
    rows = LoraRows.build(row_slots, targets, torch.device("cpu"), dense_max=0)
    assert rows is not None
    assert sorted(rows.dest.tolist()) == [i for i, s in enumerate(row_slots) if s >= 0]
    gathered = rows.gather[rows.valid]
    assert gathered.tolist() == rows.dest.tolist()
    # Each block holds rows of its own slot alone.
    for block, slot in enumerate(rows.block_slots.tolist()):
        members = rows.gather[block * rows.block : (block + 1) * rows.block].tolist()
        assert all(row_slots[r] == slot for r in members)
    assert LoraRows.build([-1, -1], targets, torch.device("cpu")) is None


@pytest.mark.parametrize(
    ("row_slots", "in_place", "permuted"),
    [
        ([-1, 2, 0, 2, 1, -1, 0, 2, 2, 2, 2], False, False),  # slot 2 takes two blocks: gathered
        ([1, 0, 2, -1, 2, 0, 1], True, False),  # one block per slot, slots 0..2: in place
        ([1, 0, 2, 2, 0, 1], True, True),  # every row has one, no padding: added by a gather
        ([3, 2, 3, 2, 3, 3], False, False),  # q and v alone (slot 3 pads its block to 4 rows)
        ([3, 2, 3, 2], False, True),  # q and v alone: the first two thirds of A's rank
    ],
)
def test_dense_and_block_products_add_each_rows_own_adapter(
    row_slots: list[int], in_place: bool, permuted: bool
) -> None:
    config = ModelConfig.from_hf_dict({**TINY_CONFIG, "model_type": "llama"})
    weights = LoraWeights(config, 4, 4, torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    adapters = []
    for slot, (rank, targets) in enumerate(
        [
            (4, GROUPS["qkv"] + GROUPS["gate_up"]),
            (2, ("k_proj", "up_proj")),
            (3, ("q_proj",)),
            (2, ("q_proj", "v_proj")),
        ]
    ):
        deltas = {}
        for target in targets:
            fan_in, fan_out = target_shape(config, target)
            deltas[(0, target)] = (torch.randn(rank, fan_in), torch.randn(fan_out, rank))
        adapters.append(LoraAdapter(f"a{slot}", rank, 1.0, deltas))
        weights.write(slot, adapters[-1])
    for group in ("qkv", "gate_up", "o"):
        fan_in = target_shape(config, GROUPS[group][0])[0]
        width = sum(w for _, w in weights.columns[group])
        x = torch.randn(len(row_slots), fan_in)
        expected = torch.zeros(len(row_slots), width)
        for row, slot in enumerate(row_slots):
            if slot < 0:
                continue
            for target, (start, cols) in zip(GROUPS[group], weights.columns[group], strict=True):
                if (0, target) in adapters[slot].weights:
                    a, b = adapters[slot].weights[(0, target)]
                    expected[row, start : start + cols] = x[row] @ a.t() @ b.t()
        for dense_max in (0, 10**6):  # the blocks, then the dense products
            rows = LoraRows.build(
                row_slots, weights.targets, torch.device("cpu"), dense_max=dense_max
            )
            assert rows is not None and (rows.onehot is None) == (dense_max == 0)
            assert rows.in_place == (in_place and dense_max == 0)
            assert (rows.order is not None) == (permuted and dense_max == 0)
            out = torch.zeros(len(row_slots), width)
            LoraStep(weights, rows, None).add(0, group, x, out)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
