"""The weights replay on a virtual clock: what it counts, and the fair-share policy's service."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.fairness_replay import main, weighted_replay
from bench.schedule_replay import CALIBRATION, MACHINE, Machine, _calibration, _floats

FAST = Machine(*_floats(MACHINE, 5))
COSTS = _calibration(CALIBRATION)


def small(order: tuple[str, ...], machine: Machine = FAST, **weights: float) -> dict[str, Any]:
    """A short run: 8 in flight each, 48-token prompts, 24-token answers, a 12 s window."""
    return weighted_replay(
        order,
        machine,
        COSTS,
        weights=weights or {"w1": 1.0, "w2": 2.0, "w4": 4.0},
        in_flight=8,
        prompt_len=48,
        output_len=24,
        stagger_s=0.0 if weights else 4.0,
        warmup_s=6.0,
        window_s=12.0,
    )


def test_level_tenants_starting_together_are_served_alike_and_the_replay_repeats() -> None:
    run = small(("a", "b"), a=1.0, b=1.0)
    assert run["tokens"]["a"] > 0 and run["tokens"]["b"] > 0
    assert run["output_tok_s"] == pytest.approx(sum(run["tokens"].values()) / 12.0)
    for measure in ("share_over_weighted_share", "service_over_weighted_share"):
        for share in run[measure].values():
            assert share == pytest.approx(1.0, abs=0.1)
    assert run == small(("a", "b"), a=1.0, b=1.0)


@pytest.mark.parametrize("order", [("w1", "w2", "w4"), ("w4", "w2", "w1")])
def test_weights_1_2_4_are_served_within_5_percent_in_either_arrival_order(
    order: tuple[str, ...],
) -> None:
    # 96 requests kept in flight for 64 slots: the slots are contended.
    run = weighted_replay(order, FAST, COSTS, output_len=32, window_s=20.0)
    for measure in ("share_over_weighted_share", "service_over_weighted_share"):
        for tenant, share in run[measure].items():
            assert share == pytest.approx(1.0, abs=0.05), (measure, tenant, run)
    running = run["mean_running"]
    assert running["w1"] < running["w2"] < running["w4"]
    assert sum(running.values()) <= 64


def test_a_slower_machine_serves_fewer_tokens() -> None:
    slow = Machine(*(3 * v for v in _floats(MACHINE, 5)))
    order = ("w1", "w2", "w4")
    assert small(order, slow)["output_tok_s"] < small(order)["output_tok_s"]


def test_the_report_has_each_order(tmp_path: Path) -> None:
    argv = ["--orders", "w4", "--in-flight", "4", "--window", "4", "--warmup", "2"]
    assert main([*argv, "--output-len", "8", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "fairness_replay.json").read_text())
    assert set(report["runs"]) == {"w4_first"}
    assert report["runs"]["w4_first"]["order"] == ["w4", "w2", "w1"]
    assert set(report["runs"]["w4_first"]["share_over_weighted_share"]) == {"w1", "w2", "w4"}
