"""Latency and fairness arithmetic: percentiles, per-request timings, latency objectives met,
Jain's index, shares."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError("q must be in [0, 100]")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Mean and the p50/p90/p99 of ``values`` (NaN when empty)."""
    mean = sum(values) / len(values) if values else math.nan
    out = {"mean": mean}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


def jain_index(allocations: Iterable[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when equal, 1/n when one takes all."""
    xs = list(allocations)
    if not xs:
        return math.nan
    square_sum = sum(x * x for x in xs)
    if square_sum == 0.0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * square_sum)


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times are seconds on one monotonic clock."""

    tenant: str
    sent_at: float
    token_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    done_at: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent_at if self.token_times else math.nan

    @property
    def latency(self) -> float:
        return self.done_at - self.sent_at

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first; NaN for single-token answers."""
        if self.completion_tokens < 2 or not self.token_times:
            return math.nan
        return (self.token_times[-1] - self.token_times[0]) / (self.completion_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive streamed chunks."""
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


def latency_summary(records: Sequence[RequestRecord]) -> dict[str, object]:
    """Throughput, TTFT/TPOT/ITL percentiles, cached fraction and errors of one run."""
    ok = [r for r in records if r.ok]
    start = min((r.sent_at for r in records), default=0.0)
    end = max((r.done_at for r in ok), default=start)
    duration = max(end - start, 1e-9)
    out_tokens = sum(r.completion_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    itls = [gap for r in ok for gap in r.itls]
    tpots = [r.tpot for r in ok if not math.isnan(r.tpot)]
    return {
        "num_requests": len(records),
        "num_errors": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "output_tok_s": out_tokens / duration,
        "req_s": len(ok) / duration,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": out_tokens,
        "cached_fraction": sum(r.cached_tokens for r in ok) / prompt_tokens
        if prompt_tokens
        else 0.0,
        "ttft_s": summarize([r.ttft for r in ok]),
        "tpot_s": summarize(tpots),
        "itl_s": summarize(itls),
    }


@dataclass(frozen=True, slots=True)
class Slo:
    """A per-request latency objective: the first token within ``ttft_s``, then the rest at
    ``tpot_s`` per token or faster on average."""

    ttft_s: float
    tpot_s: float

    @property
    def name(self) -> str:
        return f"ttft{self.ttft_s:g}s_tpot{self.tpot_s * 1000:g}ms"

    def met_by(self, record: RequestRecord) -> bool:
        """A failed or cut-off request misses; a one-token answer has no TPOT to miss."""
        if not record.ok or record.ttft > self.ttft_s:
            return False
        tpot = record.tpot
        return math.isnan(tpot) or tpot <= self.tpot_s


def attainment(records: Sequence[RequestRecord], slo: Slo) -> float:
    """The fraction of ``records`` that meet ``slo`` (NaN when there are none)."""
    if not records:
        return math.nan
    return sum(slo.met_by(r) for r in records) / len(records)


def highest_sustained_rate(by_rate: Mapping[float, float], target: float) -> float | None:
    """The highest measured rate at which it and every lower measured rate reached ``target``
    (an attainment); None when the lowest did not. No interpolation between measured rates; a
    pass above a failed rate is the machine's noise, not capacity."""
    best = None
    for rate in sorted(by_rate):
        if not by_rate[rate] >= target:  # NaN (nothing sent) does not pass
            break
        best = rate
    return best


def backlogged_shares(
    records: Sequence[RequestRecord], tenants: Sequence[str] | None = None
) -> dict[str, float]:
    """Each tenant's share of tokens served while every tenant had a request outstanding.

    The window runs from the last tenant's first send to the first tenant's last completion; a
    token counts at its arrival time. Shares sum to 1 (all zero when the window holds none).
    """
    names = sorted({r.tenant for r in records}) if tenants is None else list(tenants)
    by_tenant: Mapping[str, list[RequestRecord]] = {
        t: [r for r in records if r.tenant == t] for t in names
    }
    if not names or any(not rs for rs in by_tenant.values()):
        return {t: 0.0 for t in names}
    start = max(min(r.sent_at for r in rs) for rs in by_tenant.values())
    end = min(max(r.done_at for r in rs) for rs in by_tenant.values())
    served = {
        t: sum(1 for r in rs for at in r.token_times if start <= at <= end)
        for t, rs in by_tenant.items()
    }
    total = sum(served.values())
    return {t: (n / total if total else 0.0) for t, n in served.items()}


def service_over_time(
    records: Sequence[RequestRecord], bin_s: float
) -> tuple[list[float], dict[str, list[int]]]:
    """Tokens received per tenant in consecutive bins of ``bin_s`` seconds from the first send."""
    if bin_s <= 0:
        raise ValueError("bin_s must be positive")
    start = min((r.sent_at for r in records), default=0.0)
    end = max((t for r in records for t in r.token_times), default=start)
    num_bins = max(1, math.ceil((end - start) / bin_s + 1e-9))
    bins: dict[str, list[int]] = {}
    for r in records:
        row = bins.setdefault(r.tenant, [0] * num_bins)
        for at in r.token_times:
            row[min(int((at - start) / bin_s), num_bins - 1)] += 1
    return [i * bin_s for i in range(num_bins)], bins
