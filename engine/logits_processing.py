"""Logit changes a request asks for before sampling: penalties, logit_bias and min_tokens.

Each request that asks for any keeps a ``TokenHistory`` (per-token counts on the logits' device,
updated as tokens arrive), so a step stacks the rows' histories and changes all their logits in a
few batched tensor operations: its cost follows the step's rows, never the tokens or requests
served before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class TokenHistory:
    """What the penalties of one request need, kept up to date token by token."""

    output_counts: torch.Tensor  # [vocab_size] int32: times each token was generated
    seen: torch.Tensor | None  # [vocab_size] bool, prompt or output (repetition penalty only)
    bias_ids: torch.Tensor | None  # [num_biased] int64
    bias_values: torch.Tensor | None  # [num_biased] float32
    ban_ids: list[int]  # EOS and stop_token_ids, banned while fewer than min_tokens are out

    @classmethod
    def of(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> TokenHistory:
        counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            seen[torch.tensor(list(prompt_token_ids), dtype=torch.long, device=device)] = True
        bias_ids = bias_values = None
        if params.logit_bias:
            bias_ids = torch.tensor([t for t, _ in params.logit_bias], device=device)
            bias_values = torch.tensor(
                [b for _, b in params.logit_bias], dtype=torch.float32, device=device
            )
        bans = [] if params.ignore_eos else list(eos_token_ids)
        bans.extend(params.stop_token_ids)
        return cls(counts, seen, bias_ids, bias_values, sorted(set(bans)))

    def append(self, token_id: int) -> None:
        self.output_counts[token_id] += 1
        if self.seen is not None:
            self.seen[token_id] = True


class RowState(NamedTuple):
    """One logits row: its request's params, history and number of output tokens so far."""

    params: SamplingParams
    history: TokenHistory | None
    num_output_tokens: int


def process_logits(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, left as it is
    rows: Sequence[RowState],
) -> torch.Tensor:
    """The logits with repetition, frequency and presence penalties, then logit_bias, then
    min_tokens applied (a new tensor when any row asks for one of them)."""
    selected = [i for i, (params, history, _) in enumerate(rows) if history is not None]
    if not selected:
        return logits
    device = logits.device
    index = torch.tensor(selected, device=device)
    states = [rows[i] for i in selected]
    histories = [h for _, h, _ in states if h is not None]
    params = [p for p, _, _ in states]
    sub = logits[index]  # [num_selected, vocab_size]
    if any(p.repetition_penalty != 1.0 for p in params):
        none_seen = torch.zeros(sub.shape[1], dtype=torch.bool, device=device)
        seen = torch.stack([none_seen if h.seen is None else h.seen for h in histories])
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        # As in transformers: a seen token's positive logit is divided, a negative one multiplied.
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        counts = torch.stack([h.output_counts for h in histories]).float()
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        sub = sub - frequency * counts - presence * (counts > 0).float()
    biased = [(j, h) for j, h in enumerate(histories) if h.bias_ids is not None]
    if biased:
        row_ids = torch.cat(
            [torch.full_like(h.bias_ids, j) for j, h in biased if h.bias_ids is not None]
        )
        token_ids = torch.cat([h.bias_ids for _, h in biased if h.bias_ids is not None])
        values = torch.cat([h.bias_values for _, h in biased if h.bias_values is not None])
        sub = sub.index_put((row_ids, token_ids), values, accumulate=True)
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    for j, (p, h, num_output) in enumerate(states):
        if h is not None and num_output < p.min_tokens:
            banned_rows.extend([j] * len(h.ban_ids))
            banned_ids.extend(h.ban_ids)
    if banned_ids:
        sub[torch.tensor(banned_rows, device=device), torch.tensor(banned_ids, device=device)] = (
            float("-inf")
        )
    return logits.index_copy(0, index, sub)  # the model's logits may be inference tensors
