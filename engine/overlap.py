"""Overlapped decode steps: the host schedules and prepares step N+1 while the device runs step N.

A synchronous step reads its chosen ids back as soon as it has launched them, then postprocesses,
schedules and prepares the next step while the device idles. With overlap, a decode step's ids
stay on the device (``transfers.Download`` brings them back without blocking) and the engine
moves on: at the next step it advances the scheduler as if the ids were known, each request
taking a placeholder token (``Request.append_placeholder``), schedules and prepares step N+1 and
launches it, with the inputs that are step N's tokens copied from step N's ids on the device
(``fill_inputs``). Only then does it wait for step N's ids, give the placeholders their values,
and detokenize, stop and finish as a synchronous step would. A request that step N ended (a stop
token or string) has one more token computed in step N+1; it is dropped, and the pages the
request held, that one's included, go back to the pool when it finishes.

Only a step that nothing on the host needs before the next one may stay in flight
(``deferrable``): decodes alone, one token each and no draft, none of whose requests constrains
its output by a grammar, changes its logits by its history (penalties, logit_bias, min_tokens),
asks for logprobs, or ends by length with this token; a step that preempted or ran out of room
does not either. Every other step runs synchronously, after the step in flight has been read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engine.request import Request
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.transfers import upload


def deferrable(out: SchedulerOutput, seqs: Sequence[ScheduledSeq], max_model_len: int) -> bool:
    """Whether the step's results may be read after the next step is launched (the module's
    rules). O(the step's sequences)."""
    if not seqs or out.preempted or out.finished or len(seqs) != len(out.seqs):
        return False
    for seq in seqs:
        request = seq.request
        params = request.params
        if (
            seq.num_new_tokens != 1
            or not seq.sample
            or seq.draft
            or request.num_output_tokens == 0  # its first token: a prompt's last chunk
            or request.grammar is not None
            or request.history is not None
            or params.logprobs is not None
        ):
            return False
        if (
            request.num_output_tokens + 1 >= params.max_tokens
            or request.num_tokens + 1 >= max_model_len
        ):
            return False  # ends by length with this token: read it now, compute nothing more
    return True


def pending_inputs(
    seqs: Sequence[ScheduledSeq], rows: Mapping[Request, int]
) -> tuple[list[int], list[int]]:
    """Where the step's inputs hold placeholders: their positions in the step's flat inputs,
    and the rows of the step in flight whose ids they are (``rows``: its placeholders' rows, by
    request). A decode's only input, or a prompt's last one after a preemption."""
    positions: list[int] = []
    sources: list[int] = []
    offset = 0
    for seq in seqs:
        request = seq.request
        if request.token_in_flight:
            row = rows.get(request)
            at = request.num_tokens - 1 - request.num_computed_tokens
            if row is not None and 0 <= at < seq.num_new_tokens:
                positions.append(offset + at)
                sources.append(row)
        offset += seq.num_new_tokens
    return positions, sources


def fill_inputs(
    input_ids: torch.Tensor,  # [num_tokens] int64, the step's inputs on the device
    positions: list[int],
    sources: list[int],
    ids: torch.Tensor,  # [num_rows] int64: the step in flight's chosen ids, on the device
) -> None:
    """Copy ``ids[sources]`` into ``input_ids[positions]`` on the device: one slice copy when
    the step's first rows are the step in flight's, in its order (decodes continuing), else
    one indexed copy."""
    n = len(positions)
    if n == 0:
        return
    if positions[-1] == n - 1 and sources == positions:  # positions increase: 0, 1, ..., n - 1
        input_ids[:n].copy_(ids[:n])
        return
    device = input_ids.device
    index = upload(sources, torch.long, device)
    input_ids.index_copy_(0, upload(positions, torch.long, device), ids.index_select(0, index))
