"""The engine's tenant-facing behaviour on a tiny model: weighted fair share by counted tokens,
public prefixes published by an operator, and per-tenant cache shares."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams
from radix_cache.prefix_cache import PUBLIC_NAMESPACE, tenant_namespace
from radix_cache.radix_prefix_cache import RadixPrefixCache

FIXED = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
_ids = itertools.count()


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def engine_for(tiny: LoadedModel, **overrides: int) -> LLMEngine:
    options = {"num_pages": 96, "max_num_batched_tokens": 64, "max_num_seqs": 4, **overrides}
    return LLMEngine(tiny, EngineConfig(**options), prefix_cache_factory=RadixPrefixCache)


def submit(engine: LLMEngine, tenant: str, weight: float = 1.0, **kwargs: object) -> str:
    rid = f"{tenant}-{next(_ids)}"
    prompt = kwargs.pop("prompt", [3 + next(_ids) % 50, 7, 9, 11, 13, 17, 19, 23])
    engine.add_request(
        GenerateRequest(rid, list(prompt), FIXED, tenant_id=tenant, tenant_weight=weight, **kwargs)  # type: ignore[arg-type]
    )
    return rid


def share_while_backlogged(engine: LLMEngine, tenant: str, other: str, after: int = 0) -> float:
    """Fraction of generated tokens that went to ``tenant`` while both tenants had a queue,
    counted from the step ``after`` on."""
    served = {tenant: 0, other: 0}
    for step in range(5_000):
        waiting = engine.snapshot().waiting_by_tenant
        if not (waiting.get(tenant) and waiting.get(other)):
            break
        for output in engine.step():
            if step >= after:
                served[output.request_id.split("-")[0]] += len(output.token_ids)
    total = served[tenant] + served[other]
    assert total > 200, "the window must be long enough to measure a share"
    return served[tenant] / total


def test_equal_weights_split_tokens_evenly_against_a_tenfold_flood(tiny: LoadedModel) -> None:
    engine = engine_for(tiny)
    for _ in range(500):
        submit(engine, "flood")
    for _ in range(50):
        submit(engine, "quiet")
    # The tenant with fewer requests may run up to the level band ahead first (a one-time lead
    # of about 13 of these requests): the rates are counted once it has.
    assert abs(share_while_backlogged(engine, "quiet", "flood", after=40) - 0.5) <= 0.05


def test_weights_two_to_one_give_two_thirds_of_the_tokens(tiny: LoadedModel) -> None:
    engine = engine_for(tiny)
    for _ in range(200):
        submit(engine, "gold", weight=2.0)
        submit(engine, "bronze", weight=1.0)
    # Counted once the counters are a level band apart (see above).
    assert abs(share_while_backlogged(engine, "gold", "bronze", after=80) - 2 / 3) <= 0.05


def test_a_tenant_back_from_idle_gets_no_burst(tiny: LoadedModel) -> None:
    engine = engine_for(tiny)
    for _ in range(80):
        submit(engine, "steady")
    for _ in range(60):  # steady alone: its counter grows
        engine.step()
    for _ in range(80):
        submit(engine, "steady")
    for _ in range(120):
        submit(engine, "sleeper")
    # Lifted to the backlogged minimum, the sleeper shares from now on instead of monopolising
    # (counted once the two are a level band apart).
    assert 0.45 <= share_while_backlogged(engine, "sleeper", "steady", after=40) <= 0.55


def run(engine: LLMEngine) -> dict[str, RequestOutput]:
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished:
        for output in engine.step():
            last[output.request_id] = output
    return last


def test_published_prefix_is_reused_by_allowed_tenants_only(tiny: LoadedModel) -> None:
    engine = engine_for(tiny, num_pages=64)
    system = [5 + i % 40 for i in range(48)]  # three full pages
    publisher = GenerateRequest(
        "pub", system, SamplingParams(max_tokens=1), tenant_id=PUBLIC_NAMESPACE, publish=True
    )
    engine.add_request(publisher)
    assert run(engine)["pub"].num_published_tokens == 48
    question = [*system, 60, 61, 62, 63, 64]
    allowed = submit(engine, "a", prompt=question)
    refused = submit(engine, "b", prompt=question, allow_public_prefix=False)
    outputs = run(engine)
    assert outputs[allowed].num_cached_tokens == 48
    assert outputs[refused].num_cached_tokens == 0
    # Pinned: a flood of other work cannot evict the public pages.
    for i in range(30):
        submit(engine, "c", prompt=[70 + i, *range(1, 40)])
    run(engine)
    again = submit(engine, "d", prompt=question)
    assert run(engine)[again].num_cached_tokens == 48
    engine.cache.check_integrity()


def test_tenant_cache_share_reaches_the_cache(tiny: LoadedModel) -> None:
    engine = engine_for(tiny)
    submit(engine, "capped", kv_cache_share=0.25)
    submit(engine, "free")
    run(engine)
    stats = engine.snapshot().cache_by_namespace
    assert stats[tenant_namespace("capped")].share == 0.25
    assert stats[tenant_namespace("free")].share is None


def test_a_newcomer_gets_a_slot_held_by_a_tenant_over_its_share(tiny: LoadedModel) -> None:
    engine = engine_for(tiny)  # four slots
    long_run = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(GenerateRequest(f"hog-{i}", [5, 6, 7, 8 + i], long_run, "hog"))
    for _ in range(3):
        engine.step()
    assert engine.snapshot().running_by_tenant == {"hog": 4}
    engine.add_request(GenerateRequest("guest-0", [9, 10, 11], FIXED, "guest"))
    steps_to_first_token = 0
    while steps_to_first_token < 20:
        steps_to_first_token += 1
        if any(o.request_id == "guest-0" and o.token_ids for o in engine.step()):
            break
    # Without a fair preemption the guest would wait ~57 steps for a hog to finish.
    assert steps_to_first_token <= 3
    outputs = run(engine)
    # The preempted hog resumes and every request still gets its whole answer.
    assert all(outputs[f"hog-{i}"].num_output_tokens == 60 for i in range(6))
    assert outputs["guest-0"].num_output_tokens == FIXED.max_tokens
    assert engine.stats.num_preemptions >= 1
    assert (
        engine.cache.pool.num_free_pages
        + sum(ns.resident_pages for ns in engine.cache.stats().values())
        == engine.num_pages
    )
