"""The goodput sweep's arithmetic: rate plans, stopping, the highest rate and the ratio."""

from __future__ import annotations

import pytest

from bench.goodput import (
    RatePlan,
    compare,
    default_drain,
    goodput,
    main,
    parse_args,
    plan_rate,
    sweep,
)
from bench.metrics import RequestRecord, Slo

LOOSE, TIGHT = Slo(2.0, 0.2), Slo(1.0, 0.1)


def answer(ttft: float) -> RequestRecord:
    """A ten-token answer at 50 ms a token after a first token at ``ttft``."""
    times = [ttft + 0.05 * i for i in range(10)]
    return RequestRecord("t0", 0.0, times, times[-1], 100, 0, 10)


def test_a_rate_plan_is_the_same_for_every_server_and_differs_by_rate() -> None:
    plan = plan_rate(1.0, 60.0, seed=0, tenants=4, max_tokens=64)
    assert plan == plan_rate(1.0, 60.0, seed=0, tenants=4, max_tokens=64)
    other = plan_rate(2.0, 60.0, seed=0, tenants=4, max_tokens=64)
    assert other.offsets != plan.offsets[: len(other.offsets)]
    assert {c.system for c in other.items}.isdisjoint({c.system for c in plan.items})
    assert len(plan.items) == len(plan.offsets)
    assert all(0 < at < 60.0 for at in plan.offsets)
    # Conversations arrive at rate / (1 + 1/3); with their follow-ups, about the rate in requests.
    assert plan.offered_req_s == pytest.approx(1.0, rel=0.35)
    assert all(c.max_tokens == 64 for c in plan.items)


def test_a_sweep_the_corpus_cannot_fill_is_refused_before_any_server_starts() -> None:
    with pytest.raises(ValueError, match="passages"):
        plan_rate(20.0, 60.0, seed=0, tenants=4, max_tokens=64)
    with pytest.raises(SystemExit, match="lower --duration"):
        main(["--rates", "0.5", "20", "--servers", "atrium"])


def test_the_default_drain_lets_every_conversation_meeting_the_loosest_slo_finish() -> None:
    # Two turns of 2 s to the first token and 127 more at 200 ms each.
    assert default_drain([TIGHT, LOOSE], max_tokens=128) == pytest.approx(2 * (2.0 + 127 * 0.2))
    args = parse_args(["--slo", "1:0.1", "--max-tokens", "32", "--rates", "2", "0.5", "2"])
    assert args.drain == pytest.approx(2 * (1.0 + 31 * 0.1))
    assert args.rates == [0.5, 2.0]
    assert parse_args(["--drain", "5"]).drain == 5.0
    with pytest.raises(SystemExit):
        parse_args(["--slo", "2s:200ms"])


def plans(*rates: float) -> list[RatePlan]:
    return [RatePlan(rate, 10.0, [], []) for rate in rates]


def test_the_sweep_stops_after_two_rates_below_the_floor_on_every_slo() -> None:
    # TTFT by rate: all meet both up to 1, the loose one only at 2, neither from 3.
    ttft = {0.5: 0.3, 1.0: 0.8, 2.0: 1.5, 3.0: 5.0, 4.0: 6.0, 6.0: 7.0}
    ran: list[float] = []

    def run(plan: RatePlan) -> list[RequestRecord]:
        ran.append(plan.rate)
        return [answer(ttft[plan.rate])] * 9 + [RequestRecord("t0", 0.0, error="HTTP 500")]

    points = sweep(plans(*ttft), run, [LOOSE, TIGHT], stop_below=0.5, stop_after=2)
    assert ran == [0.5, 1.0, 2.0, 3.0, 4.0]  # 6.0 never runs
    assert [p["attainment"][LOOSE.name] for p in points] == pytest.approx([0.9] * 3 + [0.0] * 2)
    assert [p["attainment"][TIGHT.name] for p in points] == pytest.approx([0.9] * 2 + [0.0] * 3)
    assert points[0]["num_errors"] == 1 and points[0]["ttft_s"]["p50"] == pytest.approx(0.3)
    result = goodput(points, [LOOSE, TIGHT], target=0.9)
    assert result[LOOSE.name] == {"rate": 2.0, "lower_bound": False}
    assert result[TIGHT.name] == {"rate": 1.0, "lower_bound": False}
    assert goodput(points, [LOOSE], target=0.95)[LOOSE.name]["rate"] is None
    ran.clear()
    sweep(plans(*ttft), run, [LOOSE], stop_below=0.5, stop_after=0)
    assert ran == list(ttft)  # 0: every rate


def test_goodput_met_at_the_highest_rate_run_is_only_a_lower_bound() -> None:
    points = [{"rate": r, "attainment": {LOOSE.name: 1.0}} for r in (0.5, 1.0)]
    assert goodput(points, [LOOSE], 0.9)[LOOSE.name] == {"rate": 1.0, "lower_bound": True}


def test_atrium_over_vllm_is_the_ratio_of_their_goodputs() -> None:
    def server(loose: float | None, tight: float | None, bound: bool = False) -> dict[str, object]:
        return {
            "goodput": {
                LOOSE.name: {"rate": loose, "lower_bound": bound},
                TIGHT.name: {"rate": tight, "lower_bound": False},
            }
        }

    ratios = compare(
        {"atrium": server(3.0, 1.0, bound=True), "vllm": server(2.0, None)}, [LOOSE, TIGHT]
    )
    assert ratios[LOOSE.name] == {"ratio": pytest.approx(1.5), "lower_bounds": ["atrium"]}
    assert ratios[TIGHT.name] == {"ratio": None, "lower_bounds": []}
    assert compare({"atrium": server(3.0, 1.0)}, [LOOSE]) == {}
