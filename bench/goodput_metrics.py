"""Goodput: the share of requests that meet a latency objective, and the highest request rate at
which enough of them do. Pure functions over ``RequestRecord``s (unit-tested on made-up ones)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.metrics import RequestRecord, summarize

GOODPUT_SHARE = 0.9  # the share of requests that must meet an objective at a rate


@dataclass(frozen=True, slots=True)
class Objective:
    """Time to first token and time per output token a request must stay within."""

    ttft_s: float
    tpot_s: float

    @property
    def name(self) -> str:
        return f"ttft<={self.ttft_s:g}s,tpot<={self.tpot_s * 1000:g}ms"


OBJECTIVES = (Objective(2.0, 0.200), Objective(1.0, 0.100))


def meets(record: RequestRecord, objective: Objective) -> bool:
    """A request meets the objective when it succeeded, its first token came within the TTFT
    bound and its later tokens at the TPOT bound on average (a one-token answer has no TPOT)."""
    if not record.ok or record.ttft > objective.ttft_s:
        return False
    return math.isnan(record.tpot) or record.tpot <= objective.tpot_s


def share_meeting(records: Sequence[RequestRecord], objective: Objective) -> float:
    """The share of all sent requests (errors count against) that meet the objective."""
    if not records:
        return math.nan
    return sum(meets(r, objective) for r in records) / len(records)


def rate_summary(records: Sequence[RequestRecord]) -> dict[str, object]:
    """TTFT and TPOT percentiles of one rate's requests, and the share meeting each objective."""
    ok = [r for r in records if r.ok]
    return {
        "num_requests": len(records),
        "num_errors": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "ttft_s": summarize([r.ttft for r in ok]),
        "tpot_s": summarize([r.tpot for r in ok if not math.isnan(r.tpot)]),
        "meeting": {o.name: share_meeting(records, o) for o in OBJECTIVES},
    }


def goodput_rate(shares: Mapping[float, float], share: float = GOODPUT_SHARE) -> float | None:
    """The highest swept rate at which ``share`` of requests met the objective, that rate and
    every lower one (a rate that passes above one that failed is noise, not capacity); None
    when even the lowest failed."""
    best = None
    for rate in sorted(shares):
        if not shares[rate] >= share:  # NaN fails too
            break
        best = rate
    return best


def goodput(per_rate: Mapping[float, Sequence[RequestRecord]]) -> dict[str, float | None]:
    """For each objective, the goodput rate of one server's sweep (requests a second)."""
    return {
        o.name: goodput_rate({rate: share_meeting(rs, o) for rate, rs in per_rate.items()})
        for o in OBJECTIVES
    }
