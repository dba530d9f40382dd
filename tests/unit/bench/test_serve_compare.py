"""The serving comparison's ratios: one round's, and the medians over several rounds."""

from __future__ import annotations

from typing import Any

import pytest

from bench.serve_compare import compare, main, median_ratios, parse_args


def server(tok_s: float, ttft: float, tpot: float, jain: float) -> dict[str, Any]:
    run = {
        "output_tok_s": tok_s,
        "ttft_s": {"p50": ttft, "p99": 2 * ttft},
        "tpot_s": {"p50": tpot},
    }
    flood = {
        "jain_index": jain,
        "p99_ttft_over_solo": {"t1": 3.0},
        "p99_ttft_over_without_flooder": {"t1": 1.5},
    }
    return {"runs": {"shared_prefix_c8": run}, "flood": flood}


def test_one_round_compares_the_two_servers_run_by_run() -> None:
    ratios = compare({"atrium": server(150, 0.2, 0.03, 0.6), "vllm": server(100, 0.4, 0.04, 0.4)})
    run = ratios["shared_prefix_c8"]
    assert run["output_tok_s"] == pytest.approx(1.5)
    assert run["ttft_p50"] == pytest.approx(0.5) and run["ttft_p99"] == pytest.approx(0.5)
    assert run["tpot_p50"] == pytest.approx(0.75)
    assert ratios["flood_jain"] == {"atrium": 0.6, "vllm": 0.4}
    assert compare({"atrium": server(150, 0.2, 0.03, 0.6)}) == {}


def test_rounds_give_the_median_of_each_rounds_ratio() -> None:
    """Each ratio is taken within its round; a round where one server had a slow minute moves
    the median less than it would move a ratio of averages."""
    rounds = [
        compare({"atrium": server(a, 0.3, 0.03, 0.5), "vllm": server(v, 0.3, 0.03, 0.4)})
        for a, v in [(110, 100), (300, 100), (120, 100)]
    ]
    med = median_ratios(rounds)
    run = med["shared_prefix_c8"]
    assert run["output_tok_s"] == pytest.approx(1.2)
    assert run["rounds"]["output_tok_s"] == pytest.approx([1.1, 3.0, 1.2])
    assert run["ttft_p50"] == pytest.approx(1.0)
    assert [r["flood_jain"] for r in med["flood_rounds"]] == [{"atrium": 0.5, "vllm": 0.4}] * 3
    assert median_ratios([]) == {} and median_ratios([{}, {}]) == {}


def test_one_round_unless_asked() -> None:
    assert parse_args([]).rounds == 1
    assert parse_args(["--rounds", "3"]).rounds == 3


def test_no_rounds_is_refused_before_anything_starts() -> None:
    with pytest.raises(SystemExit, match="--rounds must be at least 1"):
        main(["--rounds", "0"])
