"""Token sampling for a step: greedy, temperature, top-k, top-p and min-p, seeded per request.

Rows are filtered together; randomness comes from an exponential race (``argmax(p / q)`` with
``q ~ Exp(1)``), each seeded row drawing its noise from its own generator so that a seeded request
samples the same tokens whatever else shares the batch.

Everything runs on the logits' device: unseeded rows draw from a generator kept per device (PyTorch
refuses a CPU generator for a CUDA tensor), the rows' settings come as a ``SamplingTable`` of
tensors made there (``engine/sampling_table.py``, kept by the engine while a batch's rows stay
the same), and ``choose`` returns the chosen ids as a device tensor, so the engine copies a
step's results to the host once. Only on the CPU does a step look at a value before the end
(``_sample_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.sampling_params import SamplingParams
from engine.sampling_table import RandomRows, SamplingTable

_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny


class SamplerOutput(NamedTuple):
    token_ids: list[int]
    logprobs: list[float] | None  # log-probability of each chosen token under the raw logits


class Sampler:
    """Chooses one token per row of a step's logits."""

    __slots__ = ("_generators", "_seed")

    def __init__(self, seed: int | None = None) -> None:
        # Unseeded requests share one generator per device, made on first use; seeded ones
        # bring their own (made by the engine on its device).
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator_for(self, device: torch.device) -> torch.Generator:
        """The shared generator of ``device`` (seeded as the sampler was, else at random)."""
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator

    def __call__(
        self,
        logits: torch.Tensor,  # [num_seqs, vocab_size] float32
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        return_logprobs: bool = False,
    ) -> SamplerOutput:
        token_ids = self.sample(logits, params, generators)
        if not return_logprobs:
            return SamplerOutput(token_ids.tolist(), None)
        all_logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = all_logprobs.gather(1, token_ids[:, None]).squeeze(1)
        # One copy to the host: ids (exact in float64 below 2**53) beside their logprobs.
        ids, logprobs = torch.stack([token_ids.double(), chosen.double()]).tolist()
        return SamplerOutput([int(t) for t in ids], logprobs)

    def sample(
        self,
        logits: torch.Tensor,  # [num_seqs, vocab_size]
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:  # [num_seqs] int64, on the logits' device
        """The chosen token of every row, left on the device."""
        if len(params) != logits.shape[0]:
            raise ValueError("one SamplingParams and one generator slot per logits row")
        table = SamplingTable.of(params, generators, logits.shape[1], logits.device)
        return self.choose(logits, table)

    def choose(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size]
        table: SamplingTable,
    ) -> torch.Tensor:  # [num_rows] int64, on the logits' device
        """The chosen token of every row by the settings of ``table`` (made for these rows on
        the logits' device), left on the device."""
        num_rows = logits.shape[0]
        if table.num_rows != num_rows or table.vocab_size != logits.shape[1]:
            raise ValueError(f"a table of {table.num_rows} rows for {num_rows} logits rows")
        logits = logits.float()
        random = table.random
        if random is None:  # the common all-greedy step: one argmax over the batch
            # max's indices are argmax's (the first of equal maxima; NaN counts as the max)
            # at half the cost on CPU, where argmax runs a slower reduction.
            return logits.max(dim=-1).indices
        greedy_rows, random_rows = table.greedy_rows, table.random_rows
        if greedy_rows is None or random_rows is None:  # every row sampled: no gather, no scatter
            return self._sample_rows(logits, random)
        token_ids = torch.empty(num_rows, dtype=torch.long, device=logits.device)
        token_ids[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
        token_ids[random_rows] = self._sample_rows(logits[random_rows], random)
        return token_ids

    def _sample_rows(
        self,
        logits: torch.Tensor,  # [num_rows, vocab_size]
        rows: RandomRows,
    ) -> torch.Tensor:  # [num_rows] int64
        device = logits.device
        # A NaN logit is never chosen and +inf is the largest finite value; shifted so that each
        # row's best is 0 before the temperature divides it, nothing overflows to +inf.
        clean = torch.nan_to_num(logits, nan=float("-inf"), posinf=_FLOAT32_MAX)
        shifted = clean - clean.max(dim=-1, keepdim=True).values
        scaled = shifted / rows.temperatures
        probs = torch.softmax(_filter(scaled, rows.top_k, rows.top_p), dim=-1)
        if rows.min_p is not None:
            threshold = probs.max(dim=-1, keepdim=True).values * rows.min_p
            probs = probs.masked_fill(probs < threshold, 0.0)
        # A row with no finite logit at all has no distribution (its probabilities are all NaN;
        # any other row's are all finite): it takes its argmax instead.
        broken = probs[:, 0].isnan()
        noise = torch.empty_like(probs)
        if not rows.seeded:
            noise = _exponential(noise, self.generator_for(device))
        elif rows.shared_rows is not None:
            block = torch.empty(rows.num_shared, probs.shape[1], device=device)
            noise[rows.shared_rows] = _exponential(block, self.generator_for(device))
        for i, generator in rows.seeded:
            _exponential(noise[i], generator)
        # The noise is positive, so a filtered-out token (probability 0) scores 0 and never wins.
        chosen = (probs / noise).argmax(dim=-1)
        # On the CPU the check is cheaper than an argmax of every row; elsewhere reading it would
        # wait for the device, so the fallback is always computed.
        if device.type != "cpu" or bool(broken.any()):
            chosen = torch.where(broken, clean.argmax(dim=-1), chosen)
        return chosen


def _exponential(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill ``out`` with Exp(1) draws as ``-log(1 - U)``, U uniform in [0, 1), raised to the
    smallest normal float where U was 0: every draw finite and positive. On CPU this is five
    times faster than ``exponential_``."""
    return out.uniform_(generator=generator).neg_().log1p_().neg_().clamp_min_(_FLOAT32_TINY)


def filter_logits(
    logits: torch.Tensor,  # [num_rows, vocab_size], temperature already applied
    params: Sequence[SamplingParams],
) -> torch.Tensor:  # same shape, filtered-out tokens at -inf
    """Apply top-k, then top-p over what top-k kept; rows without filters pass unchanged."""
    rows = RandomRows.of(params, [None] * len(params), logits.shape[1], logits.device)
    return _filter(logits, rows.top_k, rows.top_p)


def _filter(
    logits: torch.Tensor,  # [num_rows, vocab_size], temperature already applied
    top_k: torch.Tensor | None,  # [num_rows, 1] int64
    top_p: torch.Tensor | None,  # [num_rows, 1] float32
) -> torch.Tensor:  # same shape, filtered-out tokens at -inf
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[1]
    device = logits.device
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size, device=device)[None, :]
    mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        mask |= ranks >= top_k
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
        # Keep a token while the mass before it is below top_p: the first one always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        mask |= mass_before >= top_p
    mask[:, 0] = False  # the best token always stays (a top_p below float32's range is 0 here)
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_ids, sorted_logits)
