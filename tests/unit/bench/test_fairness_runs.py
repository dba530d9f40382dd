"""The fairness benchmark's request lists: each run of a server sends fresh prompts."""

from __future__ import annotations

from bench.fairness_runs import Load, run_specs, weighted_shares


def test_each_run_and_tenant_sends_prompts_no_earlier_run_sent() -> None:
    load = Load(words=[f"w{i}" for i in range(500)], prompt_len=24, output_len=8)
    orders = (["w1", "w2", "w4"], ["w4", "w2", "w1"])
    seen: dict[str, tuple[str, str]] = {}
    for order in orders:
        for tenant in order:
            specs = run_specs(load, order, tenant, 16)
            assert len(specs) == 16 and all(s.tenant == tenant for s in specs)
            for spec in specs:
                key = (",".join(order), tenant)
                assert seen.setdefault(spec.prompt, key) == key, "a prompt came back in a run"
    # The same run's list is the same every time (the benchmark is repeatable).
    assert run_specs(load, orders[0], "w2", 4) == run_specs(load, orders[0], "w2", 4)


def test_shares_over_weighted_shares() -> None:
    weights = {"a": 1.0, "b": 3.0}
    assert weighted_shares({"a": 100, "b": 300}, weights) == {"a": 1.0, "b": 1.0}
    shares = weighted_shares({"a": 200, "b": 200}, weights)
    assert shares["a"] == 2.0 and shares["b"] == 2.0 / 3.0
    assert weighted_shares({}, weights) == {"a": 0.0, "b": 0.0}
