"""What the engine hands to its callers: the request to run and its streamed outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    """One generation as submitted to the engine (already tokenized)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant_id: str = "default"  # opaque to the engine: selects the cache namespace
    tenant_weight: float = 1.0  # fair-share weight
    allow_public_prefix: bool = True
    kv_cache_share: float | None = None  # the tenant's cap on cached pages (fraction of the cache)
    publish: bool = False  # compute the prompt's KV and keep it as a public prefix
    unpublish: bool = False  # release the public prefix of these tokens (nothing is computed)
    # Requests the caller has accepted after this one and will hand over shortly (a burst): an
    # idle engine waits briefly for them so that its first step takes them together.
    num_following: int = 0
    # Requests of this tenant the caller holds, this one included (admitted or waiting for
    # admission): a flood still crossing the gateway counts as one before its requests arrive.
    tenant_requests: int = 0
    # Another live request with the same prompt (a sibling of ``n`` > 1): this one waits until
    # that one's prompt is computed, then finds the prompt's full pages in the prefix cache.
    prefill_after: str | None = None
    # A LoRA adapter (PEFT folder at ``lora_path``) applied on top of the base model; its KV
    # lives in a cache namespace of its own within the tenant's.
    lora_name: str | None = None
    lora_path: str | None = None
    # Record the engine steps this request is in (``RequestOutput.steps``): only when traced.
    trace_steps: bool = False
    # Offline work (a Batch API line): its decodes, prompt chunks and admission sit out every
    # step in which a prompt of foreground work waits or is prefilled, so that prompt's first
    # token comes as if alone.
    background: bool = False
    # ``time.monotonic()`` when the caller accepted it: its first-token deadline counts from
    # then, not from when the engine, busy with a step, takes it (None: from then).
    arrived_at: float | None = None


class StepTrace(NamedTuple):
    """One engine step a traced request was in: a prefill chunk of it, or one of its decodes."""

    kind: str  # "prefill" | "decode"
    start_ns: int  # wall clock (epoch nanoseconds), as spans take it
    end_ns: int
    num_tokens: int  # this request's tokens in the step (a decode's accepted draft included)
    batch_size: int  # sequences in the step
    batch_tokens: int  # tokens in the step


class TokenLogprob(NamedTuple):
    """A generated token's log-probability under the model's raw distribution (engine/logprobs)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the k most likely tokens and logprobs, best first


@dataclass(frozen=True, slots=True)
class PublishedPrefix:
    num_tokens: int  # tokens of the published text
    num_cached_tokens: int  # of those, kept as shared full pages (0 with prefix caching off)


@dataclass(slots=True)
class RequestOutput:
    """An increment of a request's output; the last one has ``finished`` set.

    ``text`` is the new text since the previous output (stop strings already cut), and
    ``token_ids`` the new token ids. Counts are cumulative.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_output_tokens: int = 0
    error: str | None = None
    # With ``publish``: prompt tokens kept as a public prefix; with ``unpublish``: released.
    num_published_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per new token when the request asked
    # The steps since the previous output (prefill chunks included), for traced requests.
    steps: list[StepTrace] | None = None
