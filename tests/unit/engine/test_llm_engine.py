"""LLMEngine on a tiny random Llama: validation, aborts, stops, seeds and prefix reuse."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams
from radix_cache.radix_prefix_cache import RadixPrefixCache
from tests.support.greedy import run_all

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def make_engine(tiny: LoadedModel, **overrides: object) -> LLMEngine:
    options: dict[str, object] = {"num_pages": 32, "max_num_batched_tokens": 64, "max_num_seqs": 8}
    options.update(overrides)
    factory = options.pop("factory", None)
    return LLMEngine(tiny, EngineConfig(**options), prefix_cache_factory=factory)  # type: ignore[arg-type]


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


@pytest.mark.parametrize(
    ("prompt", "params", "error", "param"),
    [
        ([], GREEDY, InvalidRequestError, "prompt"),
        ([1, 2, 10_000], GREEDY, InvalidRequestError, "prompt"),
        ([1, 2, -1], GREEDY, InvalidRequestError, "prompt"),
        ([1] * 60, SamplingParams(max_tokens=10), PromptTooLongError, "max_tokens"),
        ([1, 2], SamplingParams(temperature=5.0), InvalidRequestError, "temperature"),
    ],
)
def test_bad_requests_get_clear_errors_and_the_engine_keeps_serving(
    tiny: LoadedModel,
    prompt: list[int],
    params: SamplingParams,
    error: type[Exception],
    param: str,
) -> None:
    engine = make_engine(tiny, max_model_len=64)
    with pytest.raises(error) as info:
        engine.add_request(GenerateRequest("bad", prompt, params))
    assert isinstance(info.value, InvalidRequestError) and info.value.param == param
    assert not engine.has_unfinished
    engine.add_request(GenerateRequest("good", [1, 2, 3], GREEDY))
    outputs = run_all(engine)["good"]
    assert outputs[-1].finish_reason == "length" and len(tokens_of(outputs)) == 8


def test_prompt_larger_than_the_kv_cache_is_refused(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, num_pages=2, page_size=16)
    with pytest.raises(PromptTooLongError, match="KV cache"):
        engine.add_request(GenerateRequest("r", list(range(33)), GREEDY))
    with pytest.raises(InvalidRequestError, match="already running"):
        engine.add_request(GenerateRequest("x", [1], GREEDY))
        engine.add_request(GenerateRequest("x", [1], GREEDY))


def test_abort_frees_pages_at_once_and_reports_abort(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    pool = engine.cache.pool
    engine.add_request(GenerateRequest("keep", list(range(40)), GREEDY))
    engine.add_request(GenerateRequest("drop", list(range(50, 90)), GREEDY))
    first = engine.step()
    used = pool.num_used_pages
    owned = [p for p in range(pool.num_pages) if pool.owner(p) == "req:drop"]
    assert owned
    assert engine.abort("drop")
    assert pool.num_used_pages == used - len(owned)
    assert all(pool.owner(p) != "req:drop" for p in range(pool.num_pages))
    assert not engine.abort("drop")
    outputs = run_all(engine)
    assert outputs["drop"][-1].finish_reason == "abort"
    assert len(tokens_of([*first, *outputs["keep"]])) == 8
    assert pool.num_free_pages == pool.num_pages


def test_stop_string_cuts_the_text(tiny: LoadedModel) -> None:
    engine = make_engine(tiny)
    prompt = list(range(65, 90))
    engine.add_request(
        GenerateRequest("free", prompt, SamplingParams(max_tokens=24, temperature=0))
    )
    text = "".join(o.text for o in run_all(engine)["free"])
    printable = [i for i in range(1, len(text) - 1) if text[i].isalnum()]
    if not printable:
        pytest.fail(f"the tiny model produced no usable text: {text!r}")
    stop = text[printable[0] : printable[0] + 1]
    params = SamplingParams(max_tokens=24, temperature=0, stop=(stop,))
    engine.add_request(GenerateRequest("stopped", prompt, params))
    outputs = run_all(engine)["stopped"]
    assert outputs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outputs) == text[: text.index(stop)]


def test_seeded_sampling_does_not_depend_on_batch_companions(tiny: LoadedModel) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    engine = make_engine(tiny)
    engine.add_request(GenerateRequest("alone", list(range(10, 30)), params))
    alone = tokens_of(run_all(engine)["alone"])
    for i in range(4):
        other = SamplingParams(max_tokens=5 + i, temperature=1.0, ignore_eos=True)
        engine.add_request(GenerateRequest(f"o{i}", list(range(i, i + 9)), other))
    engine.add_request(GenerateRequest("batched", list(range(10, 30)), params))
    assert tokens_of(run_all(engine)["batched"]) == alone
    assert len(set(alone)) > 2


@pytest.mark.parametrize("factory", [RadixPrefixCache], ids=["radix"])
def test_shared_prefix_is_reused_within_a_tenant_only(
    tiny: LoadedModel, factory: Callable[..., object]
) -> None:
    engine = make_engine(tiny, factory=factory)
    prefix = list(range(100, 150))  # three full pages and a bit
    engine.add_request(GenerateRequest("a1", [*prefix, 1], GREEDY, tenant_id="a"))
    first = run_all(engine)["a1"]
    engine.add_request(GenerateRequest("a2", [*prefix, 1], GREEDY, tenant_id="a"))
    engine.add_request(GenerateRequest("b1", [*prefix, 1], GREEDY, tenant_id="b"))
    outputs = run_all(engine)
    assert first[-1].num_cached_tokens == 0
    assert outputs["a2"][-1].num_cached_tokens == 48
    assert outputs["b1"][-1].num_cached_tokens == 0
    # Reused KV gives the very same greedy tokens.
    assert tokens_of(outputs["a2"]) == tokens_of(first) == tokens_of(outputs["b1"])
    snapshot = engine.snapshot()
    assert snapshot.num_pages_available == snapshot.num_pages_total
    assert snapshot.counters.num_finished == 3


def test_snapshot_counts_per_tenant(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, max_num_seqs=1, max_num_batched_tokens=8)
    engine.add_request(GenerateRequest("a", [1, 2, 3], GREEDY, tenant_id="x"))
    engine.add_request(GenerateRequest("b", [1, 2, 3], GREEDY, tenant_id="y"))
    engine.step()
    snapshot = engine.snapshot()
    assert snapshot.running_by_tenant == {"x": 1}
    assert snapshot.waiting_by_tenant == {"y": 1}
    assert snapshot.num_pages_free == snapshot.num_pages_total - 1
    assert snapshot.counters.num_steps == 1 and snapshot.counters.forward_s > 0


def test_a_step_time_target_measures_costs_and_keeps_outputs_the_same(tiny: LoadedModel) -> None:
    prompts = {f"r{i}": list(range(i, i + 20)) for i in range(6)}

    def run(**overrides: object) -> tuple[LLMEngine, dict[str, list[int]]]:
        engine = make_engine(tiny, **{"num_pages": 96, **overrides})
        for rid, prompt in prompts.items():
            engine.add_request(GenerateRequest(rid, prompt, GREEDY))
        return engine, {rid: tokens_of(out) for rid, out in run_all(engine).items()}

    untargeted, reference = run()
    assert untargeted.scheduler.target is None
    auto, auto_tokens = run(target_tpot_ms="auto")
    target = auto.scheduler.target
    assert target is not None
    costs = target.costs
    assert costs.per_decode_s > 0 and costs.per_prefill_token_s > 0
    assert target.target_s == pytest.approx(costs.auto_target_s())
    assert pool_is_whole(auto)  # the measurement handed back every page it borrowed
    # One decode at a time: the same greedy tokens, only later.
    tight, tight_tokens = run(target_tpot_ms=1e-6)
    assert tight.scheduler.slot_limit == 1
    assert auto_tokens == tight_tokens == reference
    # A pool with room for the long contexts: their cost is measured, and the steps' decodes
    # tell the target how much context they attend to.
    roomy, roomy_tokens = run(target_tpot_ms="auto", num_pages=2048)
    assert roomy_tokens == reference and pool_is_whole(roomy)
    assert roomy.scheduler.target is not None
    assert roomy.scheduler.target.context_per_decode > 0


def pool_is_whole(engine: LLMEngine) -> bool:
    pool = engine.cache.pool
    return all(not pool.owner(page).startswith("req:") for page in range(pool.num_pages))
