"""Tenants that each keep requests in flight against the scheduler, with made-up tokens.

Every finished request is replaced by its tenant's next one at once (a closed loop); the work
each tenant got is counted from the tokens themselves (prompt tokens prefilled or found cached
at admission, output tokens sampled), priced with the fair-share costs, never read back from
the policy's counters. With a step-time target, a virtual clock advances each step by the
target's cost model (no scale), and each request's time to first token is kept.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass, field

from engine.fair_share import FairShareCosts, FairSharePolicy
from engine.request import Request, owner_tag
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_target import StepTarget
from radix_cache import RadixPrefixCache
from radix_cache.page_pool import PagePool
from radix_cache.prefix_cache import tenant_namespace


@dataclass(frozen=True, slots=True)
class Shape:
    """A tenant's requests: a prefix shared by all of them, a fresh tail, the answer length."""

    shared: int
    own: int
    output: int


@dataclass(slots=True)
class ClosedLoop:
    weights: dict[str, float]
    shapes: dict[str, Shape]
    max_num_seqs: int
    budget: int = 512
    num_pages: int = 4000
    target: StepTarget | None = None
    seed: int = 0
    scheduler: Scheduler = field(init=False)
    work: Counter[str] = field(default_factory=Counter)  # priced work per tenant
    tokens: Counter[str] = field(default_factory=Counter)  # output tokens per tenant
    max_running: int = 0
    num_steps: int = 0
    rng: random.Random = field(init=False)
    ids: itertools.count[int] = field(init=False)
    prefixes: dict[str, list[int]] = field(init=False)
    admitted: set[str] = field(default_factory=set)  # request ids whose cached prefix counted
    now_s: float = 0.0  # the virtual clock (with a target)
    submitted_s: dict[str, float] = field(default_factory=dict)
    first_token_s: dict[str, list[float]] = field(default_factory=dict)  # per tenant

    def __post_init__(self) -> None:
        cache = RadixPrefixCache(PagePool(self.num_pages), 16)
        self.scheduler = Scheduler(
            cache, FairSharePolicy(), self.budget, self.max_num_seqs, target=self.target
        )
        self.rng = random.Random(self.seed)
        self.ids = itertools.count()
        self.prefixes = {t: self._words(s.shared) for t, s in self.shapes.items()}

    def _words(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, 30000) for _ in range(n)]

    def start(self, tenant: str, in_flight: int) -> None:
        for _ in range(in_flight):
            self._submit(tenant)

    def _submit(self, tenant: str) -> None:
        shape = self.shapes[tenant]
        rid = f"{tenant}-{next(self.ids)}"
        request = Request(
            request_id=rid,
            prompt_token_ids=self.prefixes[tenant] + self._words(shape.own),
            params=SamplingParams(max_tokens=shape.output, temperature=0.7),
            tenant_id=tenant,
            namespace=tenant_namespace(tenant),
            owner=owner_tag(rid),
            arrival_index=next(self.ids),
            tenant_weight=self.weights[tenant],
        )
        self.submitted_s[rid] = self.now_s
        self.scheduler.add(request)

    def run(self, steps: int, count: bool = True) -> None:
        costs = FairShareCosts()
        sched = self.scheduler
        for _ in range(steps):
            out = sched.schedule()
            if self.target is not None and out.seqs:
                num_decodes = out.num_decodes
                step = self.target.costs
                self.now_s += (
                    step.fixed_s
                    + step.per_decode_s * num_decodes
                    + step.per_prefill_token_s * (out.num_batched_tokens - num_decodes)
                )
            self.max_running = max(self.max_running, len(sched.running))
            for seq in out.seqs:
                request = seq.request
                if count and not (request.num_output_tokens and request.is_decoding):
                    # A prefill chunk; the cached prefix counts once, with the first one.
                    self.work[request.tenant_id] += costs.input_token * seq.num_new_tokens
                    if request.request_id not in self.admitted:
                        self.admitted.add(request.request_id)
                        cached = costs.cached_token * request.num_cached_tokens
                        self.work[request.tenant_id] += cached
            sched.postprocess(out)
            for seq in out.seqs:
                request = seq.request
                if not seq.sample or request.is_finished:
                    continue
                if count and request.num_output_tokens == 0:
                    waited = self.now_s - self.submitted_s[request.request_id]
                    self.first_token_s.setdefault(request.tenant_id, []).append(waited)
                request.append_token(self.rng.randrange(1000, 30000))
                if count:
                    self.work[request.tenant_id] += costs.output_token
                    self.tokens[request.tenant_id] += 1
                if request.num_output_tokens >= request.params.max_tokens:
                    sched.finish(request, "length")
                    self._submit(request.tenant_id)
            self.num_steps += 1
            if self.num_steps % 100 == 0:  # a full walk of the tree and pool: not every step
                sched.cache.check_integrity()

    def shares(self, of: Counter[str]) -> dict[str, float]:
        """Each tenant's share of ``of`` over its share of the weights (1.0: exactly)."""
        total = sum(of.values())
        weight_sum = sum(self.weights.values())
        return {t: (of[t] / total) / (w / weight_sum) for t, w in self.weights.items()}
