"""Batch lines on the real engine (tiny model) as the gateway sends them: under the tenant's
``/batch`` id at a fraction of its weight, they yield to the tenant's interactive requests."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from radix_cache.radix_prefix_cache import RadixPrefixCache
from web.tenancy.principal import Principal

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
INTERACTIVE = Principal("acme", weight=1.0)
BATCH = replace(INTERACTIVE, weight=INTERACTIVE.weight * 0.1, batch_id="batch_1", background=True)
_ids = itertools.count()


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def _engine(tiny: LoadedModel) -> LLMEngine:
    config = EngineConfig(num_pages=128, max_num_batched_tokens=64, max_num_seqs=2)
    return LLMEngine(tiny, config, prefix_cache_factory=RadixPrefixCache)


def _submit(engine: LLMEngine, principal: Principal, tag: str, prompt_len: int = 8) -> str:
    n = next(_ids)
    rid = f"{tag}{n}"
    prompt = [3 + n % 50, *(7 + (i * 13) % 200 for i in range(prompt_len - 1))]
    engine.add_request(
        GenerateRequest(
            rid, prompt, PARAMS, tenant_id=principal.engine_tenant_id,
            tenant_weight=principal.weight, background=principal.background,
        )
    )  # fmt: skip
    return rid


def test_an_interactive_request_goes_ahead_of_a_batch_backlog(tiny: LoadedModel) -> None:
    assert BATCH.engine_tenant_id == "acme/batch" and INTERACTIVE.engine_tenant_id == "acme"
    engine = _engine(tiny)
    for _ in range(10):
        _submit(engine, BATCH, "b")
    first_output: dict[str, int] = {}
    for step in range(3):  # the batch fills both slots
        for out in engine.step():
            first_output.setdefault(out.request_id, step)
    arrival = 3
    interactive = _submit(engine, INTERACTIVE, "i")
    step = arrival
    while interactive not in first_output:
        assert step < 100, "the interactive request was never served"
        for out in engine.step():
            first_output.setdefault(out.request_id, step)
        step += 1
    started_meanwhile = [
        rid for rid, at in first_output.items()
        if rid.startswith("b") and arrival <= at < first_output[interactive]
    ]  # fmt: skip
    assert started_meanwhile == []  # the next free slot went to the interactive request


def test_both_backlogged_the_interactive_requests_get_most_tokens(tiny: LoadedModel) -> None:
    engine = _engine(tiny)
    for _ in range(30):
        _submit(engine, BATCH, "b")
        _submit(engine, INTERACTIVE, "i")
    served = {"b": 0, "i": 0}
    for _ in range(2_000):
        waiting = engine.snapshot().waiting_by_tenant
        if not (waiting.get("acme") and waiting.get("acme/batch")):
            break
        for out in engine.step():
            served[out.request_id[0]] += len(out.token_ids)
    total = served["b"] + served["i"]
    assert total > 100, "the window must be long enough to measure a share"
    assert served["i"] / total > 0.75  # weight 1 against 0.1: about 10/11 when both wait


def test_batch_decodes_sit_out_the_steps_of_an_interactive_prompt(tiny: LoadedModel) -> None:
    config = EngineConfig(num_pages=128, max_num_batched_tokens=32, max_num_seqs=8)
    engine = LLMEngine(tiny, config, prefix_cache_factory=RadixPrefixCache)
    lines = {_submit(engine, BATCH, "b") for _ in range(4)}
    for _ in range(3):  # the lines are admitted and decoding
        engine.step()
    interactive = _submit(engine, INTERACTIVE, "i", prompt_len=80)  # three chunks of 32
    steps_until_first_token = 0
    while True:
        outputs = engine.step()
        steps_until_first_token += 1
        assert not lines & {o.request_id for o in outputs if o.num_output_tokens}, "a line decoded"
        if any(o.request_id == interactive and o.num_output_tokens for o in outputs):
            break
        assert steps_until_first_token < 10
    assert steps_until_first_token == 3
    decoded = {o.request_id for o in engine.step() if o.num_output_tokens}
    assert lines <= decoded  # the lines go on as soon as the prompt is done
