"""Log-probabilities of sampled tokens and their most likely alternatives, for a step's rows.

They are the model's own distribution: the log-softmax of the raw logits, before penalties,
logit_bias, min_tokens, temperature and top-k/top-p/min-p (vLLM's default, ``raw_logprobs``).
So a greedy token's logprob is what the model gives it, whatever filters the request sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.outputs import TokenLogprob


class RawLogprobs(NamedTuple):
    """The log-softmax of the rows that asked for logprobs, taken before logits are changed."""

    rows: list[int]  # logits rows, in order
    top_k: list[int]  # alternatives each row asked for
    values: torch.Tensor  # [len(rows), vocab_size] float32


def take_raw(logits: torch.Tensor, wanted: Sequence[int | None]) -> RawLogprobs | None:
    """Keep the log-softmax of the rows whose ``wanted`` entry is not None (None: no row asks)."""
    rows = [i for i, k in enumerate(wanted) if k is not None]
    if not rows:
        return None
    top_k = [k for k in wanted if k is not None]
    index = torch.tensor(rows, device=logits.device)
    return RawLogprobs(rows, top_k, torch.log_softmax(logits[index].float(), dim=-1))


def gather(raw: RawLogprobs | None, token_ids: torch.Tensor) -> dict[int, TokenLogprob]:
    """Each asking row's sampled token (``token_ids`` [num_rows]) with its logprob and top-k."""
    if raw is None:
        return {}
    values = raw.values
    index = torch.tensor(raw.rows, device=values.device)
    chosen_ids = token_ids.to(values.device)[index]
    chosen = values.gather(1, chosen_ids[:, None]).squeeze(1).tolist()
    max_k = max(raw.top_k)
    top_values: list[list[float]] = [[] for _ in raw.rows]
    top_ids: list[list[int]] = [[] for _ in raw.rows]
    if max_k > 0:
        top = values.topk(max_k, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    result: dict[int, TokenLogprob] = {}
    for j, (row, k, token_id) in enumerate(
        zip(raw.rows, raw.top_k, chosen_ids.tolist(), strict=True)
    ):
        pairs = tuple(zip(top_ids[j][:k], top_values[j][:k], strict=True))
        result[row] = TokenLogprob(int(token_id), float(chosen[j]), pairs)
    return result
