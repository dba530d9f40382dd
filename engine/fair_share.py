"""Weighted virtual token counters (VTC) with first-token deadlines: who is admitted next.

Each tenant's counter grows by ``(w_in·uncached + w_cached·cached + w_out·output) / weight`` as
its work runs. The next admission comes from the backlogged tenant with the smallest counter; a
tenant returning from idle is lifted to the smallest counter among the active tenants (or, when
none are, to the largest any tenant reached), so idleness is not banked, and it wins the tie once.
Aging: a tenant whose earliest waiting request is at risk (its first-token deadline is nearer
than the time its prompt needs at the current rates, and not yet past) goes ahead of the tenants
with nothing at risk; among tenants at risk the counters decide. A request past its deadline
falls back to the counters alone: it can no longer be saved by jumping the line, and letting it
jump would hand a flood's stale backlog the turns of the tenants within their share. Inside a
tenant, a request at risk or late goes first (earliest deadline), else the longest cached prefix.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from engine.policy import AdmissionPolicy
from engine.request import Request, RequestStatus

# A running request is preempted to free a slot for a tenant that already runs some only when
# its tenant's counter is this far ahead (about 500 output tokens of weight-1 service): counters
# of tenants served fairly stay within a request's cost of each other, and preempting at smaller
# leads trades work (the victim's unfinished page is computed again) for no fairness.
PREEMPT_LEAD = 1024.0


@dataclass(frozen=True, slots=True)
class FairShareCosts:
    input_token: float = 1.0  # uncached prompt token
    cached_token: float = 0.1  # prompt token served from the prefix cache
    output_token: float = 2.0


@dataclass(slots=True)
class _Tenant:
    counter: float = 0.0
    weight: float = 1.0
    # (priority, seq, request): priority is -cached prefix length; preempted ones go first.
    by_prefix: list[tuple[float, int, Request]] = field(default_factory=list)
    by_deadline: list[tuple[float, int, Request]] = field(default_factory=list)
    live: dict[int, Request] = field(default_factory=dict)  # seq -> request still waiting
    cached: dict[int, int] = field(default_factory=dict)  # seq -> cached prefix on arrival
    returning: bool = False  # back from idle and not served since: wins ties once

    def head(self, heap: list[tuple[float, int, Request]]) -> tuple[float, int, Request] | None:
        while heap and heap[0][1] not in self.live:
            heapq.heappop(heap)
        return heap[0] if heap else None


class FairSharePolicy(AdmissionPolicy):
    """Weighted VTC across tenants with deadline aging; O(tenants) per pick, O(log n) per
    request, whatever the queue length."""

    def __init__(
        self,
        costs: FairShareCosts | None = None,
        prefix_len: Callable[[Request], int] | None = None,
        preempt_lead: float = PREEMPT_LEAD,
    ) -> None:
        self.costs = costs or FairShareCosts()
        self.preempt_lead = preempt_lead
        self._prefix_len = prefix_len
        self._tenants: dict[str, _Tenant] = {}
        self._backlogged: set[str] = set()
        self._seq = itertools.count()
        self._where: dict[int, tuple[str, int]] = {}  # id(request) -> (tenant id, seq)
        self._slots: Mapping[str, int] = {}  # running requests per tenant (the scheduler's)
        self._max_counter = 0.0  # the largest counter reached: the floor of an idle engine

    # -- counters -----------------------------------------------------------------------------

    def counter(self, tenant_id: str) -> float:
        tenant = self._tenants.get(tenant_id)
        return tenant.counter if tenant else 0.0

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

    def service_key(self, request: Request) -> tuple[float, ...]:
        """Prefill chunks go least-served tenant first (a tenant back from idle first among
        equals), then in admission order (a waiting request after its tenant's running ones)."""
        tenant = self._tenant(request)
        running = request.status is RequestStatus.RUNNING
        order = float(request.admitted_index) if running else float("inf")
        return (tenant.counter, float(not tenant.returning), order)

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

    def _idle_floor(self) -> float:
        """The counter a tenant back from idle starts at: the smallest of the active tenants'
        (no credit for its idle time over them), else the largest reached by anyone."""
        active = self._backlogged | {t for t, n in self._slots.items() if n > 0}
        counters = [self._tenants[t].counter for t in active if t in self._tenants]
        return min(counters) if counters else self._max_counter

    # -- deadlines ----------------------------------------------------------------------------

    def _due(self, tenant: _Tenant) -> Request | None:
        """The tenant's earliest-deadline request if it is due: its deadline nearer than the
        time its prompt needs now (late ones included)."""
        entry = tenant.head(tenant.by_deadline)
        if entry is None or math.isinf(entry[0]):
            return None
        request = entry[2]
        return request if self.is_due(request) else None

    def _uncached_tokens(self, request: Request) -> int:
        where = self._where.get(id(request))
        cached = self._tenants[where[0]].cached[where[1]] if where else 0
        return max(1, request.num_tokens - cached)

    def _key(self, tenant_id: str, tenant: _Tenant) -> tuple[bool, float, bool, int]:
        due = self._due(tenant)
        at_risk = due is not None and due.deadline_s >= self._now
        head = self._head(tenant, due)
        return (not at_risk, tenant.counter, not tenant.returning, head[1])

    def _head(self, tenant: _Tenant, due: Request | None) -> tuple[float, int, Request]:
        heap = tenant.by_deadline if due is not None else tenant.by_prefix
        entry = tenant.head(heap)
        assert entry is not None  # a backlogged tenant has a live request
        return entry

    # -- queue --------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        cached = self._prefix_len(request) if self._prefix_len else 0
        self._push(request, -float(cached), cached)

    def requeue_front(self, request: Request) -> None:
        self._push(request, float("-inf"), 0)  # preempted work resumes before its tenant's new

    def defer(self, request: Request) -> None:
        self._tenant(request)
        self._backlogged.add(request.tenant_id)  # it never stopped waiting: no idle lift
        self._push(request, float("-inf"), 0)

    def _push(self, request: Request, priority: float, cached: int) -> None:
        tenant = self._tenant(request)
        tenant_id = request.tenant_id
        if tenant_id not in self._backlogged and not self._slots.get(tenant_id):
            floor = self._idle_floor()
            if tenant.counter < floor:
                tenant.counter = floor
                tenant.returning = True
        self._backlogged.add(tenant_id)
        seq = next(self._seq)
        tenant.live[seq] = request
        tenant.cached[seq] = cached
        self._where[id(request)] = (tenant_id, seq)
        heapq.heappush(tenant.by_prefix, (priority, seq, request))
        heapq.heappush(tenant.by_deadline, (request.deadline_s, seq, request))

    def _next_tenant(self, skip: Collection[str]) -> tuple[_Tenant, Request] | None:
        best: tuple[tuple[bool, float, bool, int], _Tenant] | None = None
        for tenant_id in self._backlogged:
            if tenant_id in skip:
                continue
            tenant = self._tenants[tenant_id]
            key = self._key(tenant_id, tenant)
            if best is None or key < best[0]:
                best = (key, tenant)
        if best is None:
            return None
        tenant = best[1]
        return tenant, self._head(tenant, self._due(tenant))[2]

    def peek(self, skip: Collection[str] = ()) -> Request | None:
        found = self._next_tenant(skip)
        return found[1] if found else None

    def pop(self, skip: Collection[str] = ()) -> Request:
        found = self._next_tenant(skip)
        if found is None:
            raise IndexError("no waiting request")
        self.remove(found[1])
        return found[1]

    def remove(self, request: Request) -> bool:
        where = self._where.pop(id(request), None)
        if where is None:
            return False
        tenant_id, seq = where
        tenant = self._tenants[tenant_id]
        del tenant.live[seq]
        del tenant.cached[seq]
        if not tenant.live:
            self._backlogged.discard(tenant_id)
            tenant.by_prefix.clear()
            tenant.by_deadline.clear()
        return True

    def __len__(self) -> int:
        return len(self._where)

    def waiting(self) -> list[Request]:
        entries = [
            (seq, request)
            for tenant_id in self._backlogged
            for seq, request in self._tenants[tenant_id].live.items()
        ]
        return [request for _, request in sorted(entries, key=lambda item: item[0])]

    def num_waiting_by_tenant(self) -> dict[str, int]:
        return {t: len(self._tenants[t].live) for t in self._backlogged}

    def pick_victim(
        self, candidates: list[Request], beneficiary: Request | None = None
    ) -> Request | None:
        """Preempt from the tenant with the largest counter, its most recent admission first.
        For a ``beneficiary`` only from a tenant served at least as much as its own; unless
        the beneficiary's tenant runs nothing at all, at least ``preempt_lead`` more."""
        if beneficiary is not None:
            floor = self.counter(beneficiary.tenant_id)
            if self._slots.get(beneficiary.tenant_id, 0) > 0:
                floor += self.preempt_lead
            candidates = [r for r in candidates if self.counter(r.tenant_id) >= floor]
        if not candidates:
            return None
        return max(candidates, key=lambda r: (self.counter(r.tenant_id), r.admitted_index))
