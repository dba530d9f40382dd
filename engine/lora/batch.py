"""A step's rows by adapter slot, and the LoRA deltas they add to each fused projection.

Few rows (decode steps): one product of the rows with A of every slot in use, rows masked to
their own slot, then one product per target with B of those slots: a handful of operations per
projection that read each adapter's weights once. Many rows (prefill chunks): rows of one slot
are gathered into blocks of equal size, so each projection costs one batched product for A and
one per target for B, whatever the number of adapters in the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.lora.slots import GROUPS, RANK_ORDER, LoraWeights
from engine.transfers import upload

# Rows times slots in use up to which a step takes the dense products: every row meets every
# slot's A and B (zeros where it is not its own). On a 2-core Xeon (AMX; a bfloat16 model, the
# deltas in float32 as LoraManager keeps them on CPU) a 32-row decode step under one adapter cost
# 35-37% more than the base step this way against 46% in blocks; with 16 adapters the dense
# products' flops (58% of the base model's at rank 16) lose to blocks.
DENSE_MAX_ROW_SLOTS = 256


class LoraRows(NamedTuple):
    """The rows of one flat batch that have an adapter, as ``num_blocks`` blocks of ``block``
    rows (the last rows of a slot's last block repeat its first row and are dropped), or for
    the dense products ``onehot``, each row's slot among the first ``num_slots``."""

    block_slots: torch.Tensor  # [num_blocks] int64: each block's slot
    gather: torch.Tensor  # [num_blocks * block] int64: the batch row of each block row
    valid: torch.Tensor  # [num_lora_rows] int64: positions in the blocks that are real rows
    dest: torch.Tensor  # [num_lora_rows] int64: the batch row each of those adds into
    block: int
    targets: frozenset[str]  # the targets any of these rows' adapters has
    onehot: torch.Tensor | None = None  # [rows, num_slots]: 1 at each row's slot; dense only
    # Block i is slot i's only block, for every block: the slots' weights are used in place
    # rather than gathered (a copy of every adapter in use, each projection of each step).
    in_place: bool = False
    # Every row has an adapter and no block is padded: ``order`` [rows] gives each batch row's
    # place in the blocks, and deltas are added by one gather rather than a scatter-add.
    order: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        row_slots: Sequence[int],
        targets: Sequence[frozenset[str]],
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        dense_max: int | None = None,  # DENSE_MAX_ROW_SLOTS
    ) -> LoraRows | None:
        """From each row's slot (-1: no adapter); None when no row has one."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        if not by_slot:
            return None
        used = frozenset().union(*(targets[s] for s in by_slot))
        num_slots = max(by_slot) + 1
        limit = DENSE_MAX_ROW_SLOTS if dense_max is None else dense_max
        if len(row_slots) * num_slots <= limit:
            flat = [0.0] * (len(row_slots) * num_slots)
            for slot, rows in by_slot.items():
                for row in rows:
                    flat[row * num_slots + slot] = 1.0
            onehot = upload(flat, dtype, device).view(len(row_slots), -1)
            empty = torch.empty(0, dtype=torch.long, device=device)
            return cls(empty, empty, empty, empty, 0, used, onehot)
        num_rows = sum(len(rows) for rows in by_slot.values())
        # Blocks of a power of two near the mean rows per slot: the padding stays under about
        # twice the rows, and a long prefill of one adapter does not pad every other slot.
        mean = -(-num_rows // len(by_slot))
        block = min(max(len(rows) for rows in by_slot.values()), 1 << (mean - 1).bit_length())
        block_slots: list[int] = []
        gather: list[int] = []
        valid: list[int] = []
        dest: list[int] = []
        for slot, rows in sorted(by_slot.items()):
            for start in range(0, len(rows), block):
                chunk = rows[start : start + block]
                valid.extend(range(len(gather), len(gather) + len(chunk)))
                dest.extend(chunk)
                gather.extend(chunk + [chunk[0]] * (block - len(chunk)))
                block_slots.append(slot)

        def tensor(values: list[int]) -> torch.Tensor:
            return upload(values, torch.long, device)

        in_place = block_slots == list(range(len(block_slots)))
        order = None
        if len(gather) == num_rows == len(row_slots):
            places = [0] * num_rows
            for place, row in enumerate(dest):
                places[row] = place
            order = tensor(places)
        return cls(
            tensor(block_slots),
            tensor(gather),
            tensor(valid),
            tensor(dest),
            block,
            used,
            in_place=in_place,
            order=order,
        )


class LoraStep(NamedTuple):
    """The adapters of one step: the slot weights, the layout of all rows, and that of the
    sampled rows alone (the last layer's output projection and MLP see only those)."""

    weights: LoraWeights
    rows: LoraRows
    sampled: LoraRows | None

    def add(
        self,
        layer: int,
        group: str,
        x: torch.Tensor,  # [n, in]: the projection's input
        out: torch.Tensor,  # [n, out]: its output, added to in place
        sampled_rows: bool = False,  # x holds the sampled rows alone
    ) -> None:
        rows = self.sampled if sampled_rows else self.rows
        if rows is None or rows.targets.isdisjoint(GROUPS[group]):
            return
        if rows.onehot is not None:
            self._add_dense(rows, rows.onehot, layer, group, x, out)
            return
        weights = self.weights
        rank = weights.max_rank
        num_blocks = rows.block_slots.shape[0]
        # Only the leading rank blocks that some row's targets use (RANK_ORDER puts q and v first).
        ranked = RANK_ORDER[group]
        span = 1 + max(ranked.index(t) for t in rows.targets.intersection(ranked))
        a = weights.a[layer][group][:, : span * rank]
        a = a[:num_blocks] if rows.in_place else a.index_select(0, rows.block_slots)
        xs = x.index_select(0, rows.gather).to(a.dtype).view(num_blocks, rows.block, x.shape[1])
        h = torch.bmm(xs, a.transpose(1, 2))  # [blocks, block, span * R]
        for t, (target, (start, width)) in enumerate(
            zip(GROUPS[group], weights.columns[group], strict=True)
        ):
            if target not in rows.targets:
                continue
            b = weights.b[layer][group][t]  # [slots, R, out]
            b = b[:num_blocks] if rows.in_place else b.index_select(0, rows.block_slots)
            r = ranked.index(target) * rank
            delta = torch.bmm(h[:, :, r : r + rank], b)
            delta = delta.view(-1, width)  # [blocks * block, out]
            if rows.order is not None:  # a permutation of the batch rows
                out[:, start : start + width] += delta.index_select(0, rows.order).to(out.dtype)
                continue
            if delta.shape[0] != rows.valid.shape[0]:  # drop the padding rows
                delta = delta.index_select(0, rows.valid)
            out[:, start : start + width].index_add_(0, rows.dest, delta.to(out.dtype))

    def _add_dense(
        self,
        rows: LoraRows,
        onehot: torch.Tensor,  # [n, S]
        layer: int,
        group: str,
        x: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        weights = self.weights
        n, num_slots = onehot.shape
        rank = weights.max_rank
        targets = GROUPS[group]
        a = weights.a[layer][group][:num_slots]  # [S, T * R, in]
        a = a.view(-1, a.shape[-1])  # [S * T * R, in]
        h = torch.mm(x.to(a.dtype), a.t()).view(n, num_slots, len(targets), rank)
        h = h.mul_(onehot.view(n, num_slots, 1, 1))  # each row keeps its own slot's alone
        h = h.transpose(1, 2).contiguous()  # [n, T, S, R] (no copy for one target)
        for t, (target, (start, width)) in enumerate(
            zip(targets, weights.columns[group], strict=True)
        ):
            if target not in rows.targets:
                continue
            b = weights.b[layer][group][t][:num_slots].view(num_slots * rank, width)
            r = RANK_ORDER[group].index(target)  # its block along the rank of A
            delta = torch.mm(h[:, r].reshape(n, num_slots * rank), b)
            out[:, start : start + width] += delta.to(out.dtype)
