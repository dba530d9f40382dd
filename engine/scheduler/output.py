"""What a step's schedule hands the model runner: the sequences, and who left the running set."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from engine.request import Request


class ScheduledSeq(NamedTuple):
    request: Request
    num_new_tokens: int  # tokens run this step: all_token_ids[num_computed:], then the draft
    sample: bool  # the chunk reaches the end of the sequence: its last logits give a token
    draft: tuple[int, ...] = ()  # a decode's guessed next tokens, checked by this step's logits


class Drafter(Protocol):
    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to ``limit`` guessed tokens to follow a decoding request's tokens."""


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended for lack of KV capacity
    num_batched_tokens: int = 0
    num_decodes: int = 0  # of the sequences, decodes (the rest of the tokens are prefill/drafts)

    @property
    def is_empty(self) -> bool:
        return not self.seqs
