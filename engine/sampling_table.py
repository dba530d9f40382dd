"""A batch's sampling settings as device tensors, kept while the batch's rows stay the same.

Decode steps mostly sample the same requests in the same order as the step before, and a
request's settings (``SamplingParams``, its seeded generator) never change. So a step looks its
table up by its rows' key, one comparison done in C, and only a batch whose rows changed (a
request joined, left or drafted) builds a new one: its Python per row, its uploads. A step then
costs the same few tensor operations whatever its batch size; only seeded rows still draw their
noise one by one, each from its own generator.

Uploads go through pinned memory without blocking off the CPU (``engine/transfers.py``), so
building a table never waits for the device either.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from engine.transfers import upload

if TYPE_CHECKING:
    from engine.scheduler import ScheduledSeq

# A sampled sequence's key: its request (compared by identity) and its draft (a row per token).
_ROW_KEY = itemgetter(0, 3)


class RandomRows(NamedTuple):
    """The settings of the rows that sample (not greedy), in their order."""

    temperatures: torch.Tensor  # [num_rows, 1] float32, at least GREEDY_TEMPERATURE
    top_k: torch.Tensor | None  # [num_rows, 1] int64, the vocabulary for none; None: no row
    top_p: torch.Tensor | None  # [num_rows, 1] float32; None: no row filters by top-p
    min_p: torch.Tensor | None  # [num_rows, 1] float32; None: no row filters by min-p
    shared_rows: torch.Tensor | None  # [num_shared] int64: unseeded rows, when some are seeded
    num_shared: int  # rows drawing from the sampler's generator
    seeded: tuple[tuple[int, torch.Generator], ...]  # (row, its own generator)

    @classmethod
    def of(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> RandomRows:
        temperatures = [max(p.temperature, GREEDY_TEMPERATURE) for p in params]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_ps = [p.top_p for p in params]
        min_ps = [p.min_p for p in params]
        shared = [i for i, g in enumerate(generators) if g is None]
        seeded = tuple((i, g) for i, g in enumerate(generators) if g is not None)
        return cls(
            upload(temperatures, torch.float32, device)[:, None],
            upload(top_ks, torch.long, device)[:, None]
            if any(k < vocab_size for k in top_ks)
            else None,
            upload(top_ps, torch.float32, device)[:, None]
            if any(p < 1.0 for p in top_ps)
            else None,
            upload(min_ps, torch.float32, device)[:, None]
            if any(m > 0.0 for m in min_ps)
            else None,
            upload(shared, torch.long, device) if shared and seeded else None,
            len(shared),
            seeded,
        )


class SamplingTable(NamedTuple):
    """One row per logits row: what the sampler, logprobs and logit processing need to know."""

    num_rows: int
    vocab_size: int
    params: tuple[SamplingParams, ...]
    generators: tuple[torch.Generator | None, ...]
    greedy_rows: torch.Tensor | None  # [num_greedy] int64, when some rows sample
    random_rows: torch.Tensor | None  # [num_random] int64, when some rows are greedy
    random: RandomRows | None  # None: every row greedy (one argmax)
    logprobs: tuple[int | None, ...] | None  # alternatives per row; None: no row asks
    has_history: bool  # some row's logits change before sampling (engine/logits_processing)

    @classmethod
    def of(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
        has_history: bool = False,
    ) -> SamplingTable:
        if len(params) != len(generators):
            raise ValueError("one SamplingParams and one generator slot per logits row")
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        random = None
        if sampled:
            random = RandomRows.of(
                [params[i] for i in sampled], [generators[i] for i in sampled], vocab_size, device
            )
        mixed = bool(greedy) and bool(sampled)
        logprobs = tuple(p.logprobs for p in params)
        return cls(
            len(params),
            vocab_size,
            tuple(params),
            tuple(generators),
            upload(greedy, torch.long, device) if mixed else None,
            upload(sampled, torch.long, device) if mixed else None,
            random,
            logprobs if any(k is not None for k in logprobs) else None,
            has_history,
        )

    @classmethod
    def of_seqs(
        cls, sampled: Sequence[ScheduledSeq], vocab_size: int, device: torch.device
    ) -> SamplingTable:
        """The table of a step's sampled sequences (a drafted decode has a row per draft token
        too)."""
        params: list[SamplingParams] = []
        generators: list[torch.Generator | None] = []
        has_history = False
        for seq in sampled:
            request = seq.request
            rows = 1 + len(seq.draft)
            params.extend([request.params] * rows)
            generators.extend([request.generator] * rows)
            has_history = has_history or request.history is not None
        return cls.of(params, generators, vocab_size, device, has_history)


class TableCache:
    """The table of the last batch sampled, kept while the next batches' rows are the same.

    Holds the last batch's requests only (until a different batch replaces them)."""

    __slots__ = ("_key", "_table", "device", "num_builds")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.num_builds = 0  # tables built so far (a new batch each)
        self._key: list[tuple[object, ...]] = []
        self._table: SamplingTable | None = None

    def table_for(self, sampled: Sequence[ScheduledSeq], vocab_size: int) -> SamplingTable:
        """The table of ``sampled``: the last one when its rows are the same (requests, by
        identity, and drafts), else a new one."""
        key = list(map(_ROW_KEY, sampled))
        table = self._table
        if table is None or key != self._key or table.vocab_size != vocab_size:
            table = self._table = SamplingTable.of_seqs(sampled, vocab_size, self.device)
            self._key = key
            self.num_builds += 1
        return table
