"""The virtual-clock replay: every request served, the same every time, a slower machine slower."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.goodput import plan_rate
from bench.metrics import Slo, attainment
from bench.schedule_replay import MACHINE, Machine, _calibration, _floats, main, replay
from engine.model.loader import load_tokenizer
from engine.tokenizer import Tokenizer

CALIBRATION = _calibration("0.0105,0.00059,1.97e-6,0.0006")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()[0]


def test_every_request_is_served_once_and_the_replay_repeats(tokenizer: Tokenizer) -> None:
    plan = plan_rate(1.0, 10.0, seed=0, tenants=2, max_tokens=16)
    machine = Machine(*_floats(MACHINE, 5))
    records = replay(plan, tokenizer, machine, CALIBRATION, 2.0, seed=0)
    # Each conversation's turns, the follow-ups sent once their first answer ended.
    assert len(records) == sum(len(c.turns) for c in plan.items)
    assert all(r.ok and 1 <= r.completion_tokens <= 16 for r in records)
    assert all(r.sent_at <= r.token_times[0] <= r.done_at for r in records)
    # A tenant's second request finds its system prompt cached.
    assert any(r.cached_tokens > 0 for r in records)
    again = replay(plan, tokenizer, machine, CALIBRATION, 2.0, seed=0)
    assert [(r.ttft, r.done_at) for r in again] == [(r.ttft, r.done_at) for r in records]


def test_a_machine_four_times_slower_meets_fewer_first_token_deadlines(
    tokenizer: Tokenizer,
) -> None:
    plan = plan_rate(1.0, 10.0, seed=1, tenants=2, max_tokens=16)
    fast = Machine(*_floats(MACHINE, 5))
    slow = Machine(*(4 * v for v in _floats(MACHINE, 5)))
    slo = Slo(2.0, 0.2)
    on_fast = replay(plan, tokenizer, fast, CALIBRATION, 2.0, seed=1)
    on_slow = replay(plan, tokenizer, slow, CALIBRATION, 2.0, seed=1)
    assert attainment(on_slow, slo) < attainment(on_fast, slo)
    assert max(r.ttft for r in on_slow) > max(r.ttft for r in on_fast)


def test_the_report_has_each_seed_and_rate(tmp_path: Path) -> None:
    argv = ["--rates", "0.5", "--duration", "8", "--seeds", "0", "1", "--max-tokens", "8"]
    assert main([*argv, "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "schedule_replay.json").read_text())
    assert set(report["seeds"]) == {"0", "1"}
    assert [p["rate"] for p in report["seeds"]["0"]["rates"]] == [0.5]
    assert 0.0 <= report["mean_attainment"]["ttft2s_tpot200ms"][0] <= 1.0
    assert (tmp_path / "schedule_replay.png").exists()
