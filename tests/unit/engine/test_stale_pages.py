"""Freed KV pages are not zeroed: whatever a page held before never reaches another request.

Attention reads a request's pages only up to its own length (the last page's tail and pages of
other requests are masked out); these tests fill every page with poison first and expect the
very tokens a clean engine produces.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from radix_cache.radix_prefix_cache import RadixPrefixCache

# Prompts whose last page is partly filled (page size 4): 10 and 7 tokens.
PROMPTS = [[5, 17, 33, 2, 90, 41, 8, 8, 120, 64], [200, 3, 77, 19, 45, 6, 250]]
PARAMS = [
    SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=1.0, seed=7, ignore_eos=True),
]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def _engine(model: LoadedModel, radix: bool) -> LLMEngine:
    config = EngineConfig(page_size=4, num_pages=16, max_num_batched_tokens=32, max_num_seqs=4)
    return LLMEngine(model, config, prefix_cache_factory=RadixPrefixCache if radix else None)


def _run(engine: LLMEngine, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for _ in range(500):
        if not engine.has_unfinished:
            break
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
    assert not engine.has_unfinished
    return tokens


def _requests(tag: str, tenant: str = "b") -> list[GenerateRequest]:
    return [
        GenerateRequest(f"{tag}{i}-{j}", prompt, params, tenant_id=tenant)
        for i, prompt in enumerate(PROMPTS)
        for j, params in enumerate(PARAMS)
    ]


@pytest.mark.parametrize("radix", [False, True], ids=["no_cache", "radix"])
@pytest.mark.parametrize("poison", [1e4, -3e4, math.nan], ids=["big", "negative", "nan"])
def test_poisoned_pages_do_not_change_any_token(
    tiny: LoadedModel, radix: bool, poison: float
) -> None:
    clean = _run(_engine(tiny, radix), _requests("r"))
    engine = _engine(tiny, radix)
    for cache in engine.runner.kv_caches:  # [num_pages, 2, page_size, num_kv_heads, head_dim]
        cache.fill_(poison)
    assert _run(engine, _requests("r")) == clean


@pytest.mark.parametrize("radix", [False, True], ids=["no_cache", "radix"])
def test_pages_another_tenant_just_freed_do_not_change_any_token(
    tiny: LoadedModel, radix: bool
) -> None:
    clean = _run(_engine(tiny, radix), _requests("r"))
    engine = _engine(tiny, radix)
    # Tenant a fills the pool (and, with the radix cache, leaves its prefixes cached, to be
    # evicted as b needs pages); then b runs on the pages a left behind.
    long_prompt = [(i * 37) % 251 for i in range(40)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    _run(engine, [GenerateRequest("a", long_prompt, params, tenant_id="a")])
    pool = engine.cache.pool
    # Its pages are free again (no cache) or held by its cached prefix (radix): b's must reuse them.
    assert pool.num_used_pages == (12 if radix else 0)
    assert _run(engine, _requests("r")) == clean
    if radix:
        engine.cache.check_integrity()
