"""A request's state inside the engine: its tokens, block table, cache lock and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.draft_state import DraftState
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.detokenizer import IncrementalDetokenizer
    from engine.logits_processing import TokenHistory
    from engine.lora.adapter import LoraAdapter
    from engine.outputs import StepTrace
    from engine.structured.state import GrammarState


# The value an overlapped step's token holds until its id is read back (engine/overlap.py): a
# valid id, though every input that reads it is replaced from the device first.
PLACEHOLDER_TOKEN = 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued in the admission policy (new or preempted)
    RUNNING = "running"  # holds pages and is scheduled every step
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One generation: ``all_token_ids`` is prompt then output; KV exists for the first
    ``num_computed_tokens`` of them, in the pages of ``block_table``.

    ``block_table`` is ``[tree pages (locked through cache_node)] + [private pages]``; the first
    ``num_tree_pages`` entries are the tree's.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant_id: str
    namespace: str  # the tenant's cache namespace
    owner: str  # page owner tag of this request's private pages: "req:<id>"
    arrival_index: int  # admission order among all requests (monotonic)
    tenant_weight: float = 1.0
    allow_public_prefix: bool = True
    background: bool = False  # yields its steps to foreground prompts (GenerateRequest)
    tenant_requests: int = 0  # the caller's count of its tenant's requests (GenerateRequest)
    # The scheduler's clock when it arrived or, after a preemption, when it joined the queue again.
    queued_at: float = 0.0
    # When the caller accepted it (GenerateRequest), on the scheduler's clock once it is queued:
    # its first-token deadline counts from then.
    arrived_at: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_tree_pages: int = 0  # leading block table entries already handed to the cache
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the cache at first admission; -1: not yet
    cached_on_arrival: int = 0  # prompt tokens the cache held when it arrived (fair share measures)
    # Its first token is planned after those that can still come by their deadlines
    # (``engine/step_budget.py``).
    first_token_late: bool = False
    cache_node: object | None = None
    status: RequestStatus = RequestStatus.WAITING
    admitted_index: int = -1  # order of the latest admission into the running set
    num_preemptions: int = 0
    publish: bool = False  # computes a public prefix: its pages are pinned when it finishes
    num_published_tokens: int = 0
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    draft_state: DraftState | None = None  # n-gram drafting (engine/speculative.py)
    grammar: GrammarState | None = None  # structured output (engine/structured/)
    history: TokenHistory | None = None  # penalties, bias, min_tokens (engine/logits_processing)
    lora: LoraAdapter | None = None  # its adapter (engine/lora/), if any
    lora_slot: int = -1  # the resident slot its adapter holds while it runs; -1: none
    steps: list[StepTrace] | None = None  # traced steps not yet reported; None: not traced
    # Its last token is a placeholder: an overlapped step chose it, its id is still on the device.
    token_in_flight: bool = False

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to run before the next token can be sampled (1 when decoding)."""
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_remaining_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.history is not None:
            self.history.append(token_id)

    def append_placeholder(self) -> None:
        """Take the token an overlapped step chose before its id is known (``settle_token``
        gives it its id): the next step can be scheduled as if it were there."""
        if self.history is not None:
            raise ValueError("a request with logit processing needs its tokens' ids at once")
        self.output_token_ids.append(PLACEHOLDER_TOKEN)
        self.all_token_ids.append(PLACEHOLDER_TOKEN)
        self.token_in_flight = True

    def settle_token(self, token_id: int) -> None:
        """The placeholder's id, read back."""
        if not self.token_in_flight:
            raise ValueError("no token in flight")
        self.output_token_ids[-1] = token_id
        self.all_token_ids[-1] = token_id
        self.token_in_flight = False


def owner_tag(request_id: str) -> str:
    """The page owner tag of a request: unique per request id."""
    return f"req:{request_id}"
