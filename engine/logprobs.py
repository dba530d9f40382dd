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


def gather(
    token_ids: torch.Tensor, raw: RawLogprobs | None
) -> tuple[list[int], dict[int, TokenLogprob]]:
    """Every row's chosen token (``token_ids`` [num_rows], on the logits' device) and, for each
    asking row, its logprob and top-k, brought to the host in one copy: the ids (exact in
    float64 below 2**53) beside the float32 values widened without loss."""
    if raw is None:
        return token_ids.tolist(), {}
    values = raw.values
    num_rows, num_asking = token_ids.shape[0], len(raw.rows)
    index = torch.tensor(raw.rows, dtype=torch.long, device=values.device)
    chosen_ids = token_ids.to(values.device)[index]
    chosen = values.gather(1, chosen_ids[:, None]).squeeze(1)
    parts = [token_ids.to(values.device).double(), chosen.double()]
    max_k = max(raw.top_k)
    if max_k > 0:
        top = values.topk(max_k, dim=-1)
        parts += [top.values.double().flatten(), top.indices.double().flatten()]
    flat: list[float] = torch.cat(parts).tolist()
    ids = [int(t) for t in flat[:num_rows]]
    logprobs = flat[num_rows : num_rows + num_asking]
    start = num_rows + num_asking
    span = num_asking * max_k
    top_values = flat[start : start + span]
    top_ids = flat[start + span : start + 2 * span]
    result: dict[int, TokenLogprob] = {}
    for j, (row, k) in enumerate(zip(raw.rows, raw.top_k, strict=True)):
        at = j * max_k
        pairs = tuple((int(top_ids[at + i]), top_values[at + i]) for i in range(k))
        result[row] = TokenLogprob(ids[row], logprobs[j], pairs)
    return ids, result
