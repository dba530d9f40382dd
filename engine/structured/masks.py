"""A step's token bitmask: filled on a worker thread while the forward pass runs, then applied
to the logits of every constrained row at once.

Rows follow the engine's logits layout: each sampled sequence has one row, plus one per draft
token. Rows of unconstrained requests are left out of the application entirely.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch
import xgrammar

from engine.scheduler import ScheduledSeq
from engine.structured.state import GrammarState


class StepMask(NamedTuple):
    bitmask: torch.Tensor  # [num_rows, ceil(vocab / 32)] int32, bit set = token allowed
    rows: list[int]  # logits rows the mask applies to


class MaskFiller:
    """Fills and applies step masks; one fill in flight at a time (the engine's step)."""

    def __init__(self, vocab_width: int) -> None:
        self.vocab_width = vocab_width  # the bitmask's width in tokens (>= the logit width)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def start(self, sampled: list[ScheduledSeq]) -> Future[StepMask] | None:
        """Begin filling the mask for the sequences that sample this step (None: nothing to
        constrain). Matchers are read on the worker until the future is done."""
        work: list[tuple[GrammarState, int, tuple[int, ...], int]] = []
        row = 0
        for seq in sampled:
            request = seq.request
            if request.grammar is not None:
                remaining = request.params.max_tokens - request.num_output_tokens
                work.append((request.grammar, row, seq.draft, remaining))
            row += 1 + len(seq.draft)
        if not work:
            return None
        return self._executor.submit(self._fill, row, work)

    def _fill(
        self, num_rows: int, work: list[tuple[GrammarState, int, tuple[int, ...], int]]
    ) -> StepMask:
        bitmask = xgrammar.allocate_token_bitmask(num_rows, self.vocab_width)
        rows: list[int] = []
        for state, row, draft, remaining in work:
            try:
                state.fill(bitmask, row, draft, remaining)
            except Exception as exc:  # this request fails after the step; the others go on
                state.error = f"the grammar failed: {exc}"
                continue
            rows.extend(range(row, row + 1 + len(draft)))
        return StepMask(bitmask, rows)

    @staticmethod
    def apply(logits: torch.Tensor, mask: StepMask) -> None:
        """Set the logits of forbidden tokens to -inf, in place (float32 logits). On the CPU
        xgrammar's kernel does it; elsewhere the bitmask is copied to the logits' device once
        and unpacked there (``apply_on_device``)."""
        vocab = min(logits.shape[1], mask.bitmask.shape[1] * 32)
        if logits.device.type == "cpu":
            xgrammar.apply_token_bitmask_inplace(
                logits, mask.bitmask, indices=mask.rows, vocab_size=vocab
            )
            return
        apply_on_device(logits, mask.bitmask, mask.rows, vocab)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def apply_on_device(
    logits: torch.Tensor,  # [num_rows, width] float32, changed in place
    bitmask: torch.Tensor,  # [num_mask_rows, words] int32 on the host, bit set = allowed
    rows: list[int],  # the logits rows (and mask rows) to constrain
    vocab: int,  # tokens covered: columns at or past it are left as they are
) -> None:
    """The bitmask applied with plain tensor operations on the logits' device: one copy of the
    constrained rows' words there, each bit unpacked by a shift, forbidden logits set to -inf.
    Needs no compiled kernel (xgrammar's own GPU path compiles a Triton kernel on first use)."""
    if not rows:
        return
    device = logits.device
    index = torch.tensor(rows, dtype=torch.long, device=device)
    words = bitmask[rows].to(device, non_blocking=True)  # [len(rows), words]
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    sub = logits[index, :vocab].masked_fill(~allowed, float("-inf"))
    logits[index, :vocab] = sub
