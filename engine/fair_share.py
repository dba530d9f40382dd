"""Weighted virtual token counters (VTC): admit from the backlogged tenant served least so far.

Each tenant's counter grows by ``(w_in·uncached + w_cached·cached + w_out·output) / weight`` as its
work runs. The next admission comes from the backlogged tenant with the smallest counter; a tenant
returning from idle is lifted to the smallest counter among the tenants that are backlogged or
running (or, when none are, to the largest counter any tenant has reached: an idle engine banks
nobody's credit). Tenants within ``LEVEL_BAND`` of the least-served active one count as level;
among level tenants the one with several times fewer requests waiting or running goes first
(``_request_class``; the caller's count of the tenant's requests, when larger, stands for requests
still on their way), so a tenant's short burst is not split evenly with a flood that arrives
beside it (nor goes behind a flood back from idle); then a tenant back from idle, until it is
next served; and the counter orders the rest. Beyond the band the counter alone decides,
whatever the tenants' requests cost: a tenant of long prompts and one of long answers each get
their weight's share of the work, not of the slots. Tenants served ahead of the least-served one
take at most their weighted share of a step's prefill budget (``prefill_caps``). Inside a tenant,
the request with the longest cached prefix goes first (measured once, on arrival).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from engine.policy import AdmissionPolicy
from engine.request import Request

# A capped tenant's share of a step's prefill budget is never below 1/MIN_SHARE_DIVISOR of it.
MIN_SHARE_DIVISOR = 8
# A running request is preempted to free a slot for a tenant that already runs some only when
# its tenant's counter is this far ahead (about 500 output tokens of weight-1 service): counters
# of tenants served fairly stay within a request's cost of each other, and preempting at smaller
# leads trades work (the victim's unfinished page is computed again) for no fairness.
PREEMPT_LEAD = 1024.0
# Tenants whose counters are within this of the least-served active tenant's are level (about a
# light tenant's burst of two short requests at weight 1): among them the one with the fewest
# requests in the engine goes first, so a flood arriving with a few others' prompts does not share
# the prefill with them evenly; within a step-time target, the decodes of a tenant beyond it sit
# out a step for a level tenant's prompt. Bounded: a tenant is never served ahead of one more
# than this below it.
LEVEL_BAND = 256.0
# Within a step-time target, a tenant this far ahead of one whose prompt waits (a flood, not a
# tenant served fairly: counters of those stay within about a request's cost of each other) sits
# out that prompt's step with all its work, so the step holds only the prompt and the work of
# tenants near it: the first token of a light tenant then costs a short step, not one the flood
# fills to the target. Bounded: the tenant sitting out is not served, the others are, and it is
# back once they come within this of it.
YIELD_LEAD = 1024.0


def _request_class(num_requests: int) -> float:
    """Requests in the engine on a scale of threes (0: none or 1, 1: 2-7, 2: 8-25, 3: 26-79,
    ...): level tenants in a lower class go first, and within one class the counter decides, so
    tenants keeping similar numbers of requests in flight are served by their weights while a
    burst of two beside a flood of twenty still goes first."""
    return float(math.floor(math.log(num_requests + 1, 3) + 1e-9))


@dataclass(frozen=True, slots=True)
class FairShareCosts:
    input_token: float = 1.0  # uncached prompt token
    cached_token: float = 0.1  # prompt token served from the prefix cache
    output_token: float = 2.0


@dataclass(slots=True)
class _Tenant:
    counter: float = 0.0
    weight: float = 1.0
    # (priority, sequence, request): priority is -cached prefix length; preempted ones go first.
    heap: list[tuple[float, int, Request]] = field(default_factory=list)
    num_waiting: int = 0
    # The caller's count of this tenant's requests, as the latest one to wait said (0: none).
    caller_requests: int = 0
    # Back from idle and not served since: wins ties with tenants at the same counter.
    returning: bool = False


class FairSharePolicy(AdmissionPolicy):
    """Weighted VTC across tenants, longest cached prefix first within a tenant.

    ``prefix_len`` (optional) returns the cached-prefix length of a request's prompt in its own
    namespace; it is called once per request on arrival, so admission costs O(log n) per request
    and O(tenants) per pick, whatever the queue length.
    """

    def __init__(
        self,
        costs: FairShareCosts | None = None,
        prefix_len: Callable[[Request], int] | None = None,
        preempt_lead: float = PREEMPT_LEAD,
        level_band: float = LEVEL_BAND,
        decode_lead: float | None = LEVEL_BAND,
        yield_lead: float | None = YIELD_LEAD,
    ) -> None:
        self.costs = costs or FairShareCosts()
        self._yield_lead = yield_lead
        self.preempt_lead = preempt_lead
        self.level_band = level_band
        self._decode_lead = decode_lead
        self._prefix_len = prefix_len
        self._tenants: dict[str, _Tenant] = {}
        self._backlogged: set[str] = set()
        self._removed: set[int] = set()  # id() of requests removed while still in a heap
        self._seq = itertools.count()
        self._num_waiting = 0
        self._slots: Mapping[str, int] = {}  # running requests per tenant (the scheduler's)
        self._max_counter = 0.0  # the largest counter reached: the floor of an idle engine
        self._floor = 0.0  # the least-served active tenant's counter as the step began

    # -- counters -----------------------------------------------------------------------------

    def counter(self, tenant_id: str) -> float:
        tenant = self._tenants.get(tenant_id)
        return tenant.counter if tenant else 0.0

    def begin_step(self) -> None:
        """Take the least-served active tenant's counter: the floor of this step's level band.
        O(tenants)."""
        self._floor = self._idle_floor()

    def service_key(self, request: Request) -> tuple[float, ...]:
        """The tenant's place in line: prefill budget goes first to the least-served tenant's
        work (its counter, or the band's floor while within ``level_band`` of it), then to the
        tenant with the fewest requests in the engine, then to a tenant back from idle."""
        tenant = self._tenant(request)
        return self._key(request.tenant_id, tenant)

    def _key(self, tenant_id: str, tenant: _Tenant) -> tuple[float, float, float, float]:
        counter = tenant.counter
        banded = min(counter, self._floor) if counter < self._floor + self.level_band else counter
        return (banded, self._class(tenant_id, tenant), float(not tenant.returning), counter)

    def _class(self, tenant_id: str, tenant: _Tenant) -> float:
        """The tenant's requests in the engine (waiting, running, or still on their way by the
        caller's count) on the scale of ``_request_class``."""
        requests = tenant.num_waiting + self._slots.get(tenant_id, 0)
        return _request_class(max(requests, tenant.caller_requests))

    def prefill_key(self, request: Request) -> tuple[float, ...]:
        """The admitted prompts' order: a tenant with several times fewer requests in the engine
        first (a burst beside a flood), then the earliest first-token deadline. Admission has
        already weighed the counters; ordering chunks by them as well handed two level tenants'
        prompts the chunks in turns (each chunk moves its tenant's counter past the other's),
        and both first tokens came when the later one would have in arrival order. Without a
        level band (the counters alone) the counters order the chunks too."""
        if self.level_band <= 0:
            return self.service_key(request)
        tenant = self._tenant(request)
        late = float(request.first_token_late)
        return (self._class(request.tenant_id, tenant), late, request.arrived_at or 0.0)

    @property
    def decode_lead(self) -> float | None:
        return self._decode_lead

    @property
    def yield_lead(self) -> float | None:
        return self._yield_lead

    def service(self, tenant_id: str) -> float:
        return self.counter(tenant_id)

    def charge(self, request: Request, num_uncached: int, num_cached: int, num_output: int) -> None:
        tenant = self._tenant(request)
        cost = (
            self.costs.input_token * num_uncached
            + self.costs.cached_token * num_cached
            + self.costs.output_token * num_output
        )
        tenant.counter += cost / tenant.weight
        tenant.returning = False
        self._max_counter = max(self._max_counter, tenant.counter)

    def bind_prefix_len(self, prefix_len: Callable[[Request], int]) -> None:
        self._prefix_len = prefix_len

    def bind_running(self, slots: Mapping[str, int], max_num_seqs: int) -> None:
        self._slots = slots

    def _tenant(self, request: Request) -> _Tenant:
        tenant = self._tenants.get(request.tenant_id)
        if tenant is None:
            tenant = self._tenants[request.tenant_id] = _Tenant()
        if request.tenant_weight > 0:
            tenant.weight = request.tenant_weight
        return tenant

    def _active(self) -> set[str]:
        """Tenants with requests waiting or running."""
        return self._backlogged | {t for t, n in self._slots.items() if n > 0}

    def _idle_floor(self) -> float:
        """The counter a tenant back from idle starts at: the smallest of the active tenants'
        (it gets no credit for its idle time over them), else the largest reached by anyone (an
        engine that went idle owes nobody anything). O(tenants)."""
        counters = [self._tenants[t].counter for t in self._active() if t in self._tenants]
        return min(counters) if counters else self._max_counter

    # -- queue --------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        cached = self._prefix_len(request) if self._prefix_len else 0
        request.cached_on_arrival = cached
        self._push(request, -float(cached))
        # New work only: a preempted or deferred request's count is out of date.
        self._tenants[request.tenant_id].caller_requests = request.tenant_requests

    def requeue_front(self, request: Request) -> None:
        # Preempted work resumes before anything new of its tenant.
        self._push(request, float("-inf"))

    def defer(self, request: Request) -> None:
        # It never stopped waiting: its tenant stays backlogged (no lift as if back from idle).
        self._tenant(request)
        self._backlogged.add(request.tenant_id)
        self._push(request, float("-inf"))

    def _push(self, request: Request, priority: float) -> None:
        tenant = self._tenant(request)
        tenant_id = request.tenant_id
        if tenant_id not in self._backlogged and not self._slots.get(tenant_id):
            floor = self._idle_floor()
            if tenant.counter < floor:
                tenant.counter = floor  # no credit for time spent idle
                tenant.returning = True  # but first in line among equals
        self._backlogged.add(tenant_id)
        if id(request) in self._removed:
            # A stale entry of this very request is still in the heap: drop it for good.
            tenant.heap = [entry for entry in tenant.heap if entry[2] is not request]
            heapq.heapify(tenant.heap)
            self._removed.discard(id(request))
        heapq.heappush(tenant.heap, (priority, next(self._seq), request))
        tenant.num_waiting += 1
        self._num_waiting += 1

    def _next_tenant(self, skip: Collection[str] = ()) -> _Tenant | None:
        best: _Tenant | None = None
        best_key: tuple[tuple[float, float, float, float], int] | None = None
        for tenant_id in self._backlogged:
            if tenant_id in skip:
                continue
            tenant = self._tenants[tenant_id]
            self._drop_removed(tenant)
            # Among level tenants, one with several times fewer requests in the engine goes
            # first: a round of turns serves the small queues before the flood's.
            key = (self._key(tenant_id, tenant), tenant.heap[0][1])
            if best_key is None or key < best_key:
                best, best_key = tenant, key
        return best

    def prefill_caps(self, budget: int) -> dict[str, int] | None:
        """Caps for the tenants served more than the least-served active one: each may run its
        weighted share of the step's prefill budget (at least ``budget // MIN_SHARE_DIVISOR``),
        and what it leaves is not handed to another such tenant. Steps stay short while a
        tenant runs ahead of others, so the next prompt of a tenant behind it waits for one short
        step, not for a whole budget of the leader's chunks; the least-served tenants, whose
        work goes first anyway, are not capped. None while fewer than two tenants are active.
        O(tenants)."""
        active = [t for t in self._active() if t in self._tenants]
        if len(active) < 2:
            return None
        tenants = [self._tenants[t] for t in active]
        lowest = min(tenant.counter for tenant in tenants)
        total_weight = sum(tenant.weight for tenant in tenants)
        floor = max(1, budget // MIN_SHARE_DIVISOR)
        return {
            tenant_id: max(floor, int(budget * tenant.weight / total_weight))
            for tenant_id, tenant in zip(active, tenants, strict=True)
            if tenant.counter > lowest
        }

    def _drop_removed(self, tenant: _Tenant) -> None:
        while tenant.heap and id(tenant.heap[0][2]) in self._removed:
            _, _, request = heapq.heappop(tenant.heap)
            self._removed.discard(id(request))

    def peek(self, skip: Collection[str] = ()) -> Request | None:
        tenant = self._next_tenant(skip)
        return tenant.heap[0][2] if tenant else None

    def pop(self, skip: Collection[str] = ()) -> Request:
        tenant = self._next_tenant(skip)
        if tenant is None:
            raise IndexError("no waiting request")
        _, _, request = heapq.heappop(tenant.heap)
        self._after_leave(request, tenant)
        return request

    def remove(self, request: Request) -> bool:
        tenant = self._tenants.get(request.tenant_id)
        if tenant is None or id(request) in self._removed:
            return False
        if not any(entry[2] is request for entry in tenant.heap):
            return False
        self._removed.add(id(request))
        self._after_leave(request, tenant)
        return True

    def _after_leave(self, request: Request, tenant: _Tenant) -> None:
        tenant.num_waiting -= 1
        self._num_waiting -= 1
        if tenant.num_waiting == 0:
            tenant.caller_requests = 0
            self._backlogged.discard(request.tenant_id)
            for _, _, stale in tenant.heap:
                self._removed.discard(id(stale))
            tenant.heap.clear()

    def __len__(self) -> int:
        return self._num_waiting

    def waiting(self) -> list[Request]:
        out: list[tuple[int, Request]] = []
        for tenant_id in self._backlogged:
            for _, seq, request in self._tenants[tenant_id].heap:
                if id(request) not in self._removed:
                    out.append((seq, request))
        return [request for _, request in sorted(out, key=lambda item: item[0])]

    def num_waiting_by_tenant(self) -> dict[str, int]:
        return {t: self._tenants[t].num_waiting for t in self._backlogged}

    def pick_victim(
        self, candidates: list[Request], beneficiary: Request | None = None
    ) -> Request | None:
        """Preempt from the tenant with the largest counter, its most recent admission first.
        For a ``beneficiary`` only from a tenant served at least as much as its own; unless
        the beneficiary's tenant runs nothing at all (then it is not kept waiting behind long
        generations), at least ``preempt_lead`` more."""
        if beneficiary is not None:
            floor = self.counter(beneficiary.tenant_id)
            if self._slots.get(beneficiary.tenant_id, 0) > 0:
                floor += self.preempt_lead
            candidates = [r for r in candidates if self.counter(r.tenant_id) >= floor]
        if not candidates:
            return None
        return max(candidates, key=lambda r: (self.counter(r.tenant_id), r.admitted_index))
