"""Sampling tables: a batch's settings are built once and kept while its rows stay the same.

A step whose sampled rows are the last step's (the same requests in the same order, no new
drafts) reuses the last table; a request joining or leaving, a new order or a draft builds a new
one. Sampling through a kept table draws the same tokens as through a fresh one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest
from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sampling_table import SamplingTable, TableCache
from engine.scheduler import ScheduledSeq

CPU = torch.device("cpu")


def _request(name: str, params: SamplingParams) -> Request:
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return Request(
        request_id=name,
        prompt_token_ids=[1, 2, 3],
        params=params,
        tenant_id="t",
        namespace="t",
        owner=f"req:{name}",
        arrival_index=0,
        generator=generator,
    )


GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3)
UNSEEDED = SamplingParams(temperature=0.7, min_p=0.05)


def test_an_unchanged_batch_keeps_its_table_and_a_changed_one_builds_anew() -> None:
    a, b, c = (_request(n, p) for n, p in (("a", GREEDY), ("b", SEEDED), ("c", UNSEEDED)))
    cache = TableCache(CPU)
    first = cache.table_for([ScheduledSeq(a, 1, True), ScheduledSeq(b, 1, True)], 50)
    # The same rows in new ScheduledSeq tuples (as every step makes them): the same table.
    again = cache.table_for([ScheduledSeq(a, 1, True), ScheduledSeq(b, 1, True)], 50)
    assert again is first and cache.num_builds == 1
    changes = [
        [ScheduledSeq(b, 1, True), ScheduledSeq(a, 1, True)],  # another order
        [ScheduledSeq(b, 1, True), ScheduledSeq(a, 1, True), ScheduledSeq(c, 1, True)],  # joined
        [ScheduledSeq(b, 1, True), ScheduledSeq(c, 1, True)],  # left
        [ScheduledSeq(b, 1, True), ScheduledSeq(c, 3, True, (4, 5))],  # drafted: more rows
    ]
    tables = [cache.table_for(seqs, 50) for seqs in changes]
    assert cache.num_builds == 5 and len({id(t) for t in [first, *tables]}) == 5
    assert tables[-1].num_rows == 4
    assert cache.table_for(changes[-1], 60) is not tables[-1]  # another vocabulary


def test_a_table_holds_what_each_kind_of_batch_needs() -> None:
    greedy = SamplingTable.of([GREEDY] * 3, [None] * 3, 50, CPU)
    assert greedy.random is None and greedy.greedy_rows is None and greedy.logprobs is None
    seeded = torch.Generator().manual_seed(1)
    mixed = SamplingTable.of(
        [GREEDY, SEEDED, UNSEEDED, SamplingParams(temperature=0.0, logprobs=2)],
        [None, seeded, None, None],
        50,
        CPU,
    )
    assert mixed.greedy_rows is not None and mixed.greedy_rows.tolist() == [0, 3]
    assert mixed.random_rows is not None and mixed.random_rows.tolist() == [1, 2]
    random = mixed.random
    assert random is not None and random.seeded == ((0, seeded),)
    assert random.shared_rows is not None and random.shared_rows.tolist() == [1]
    assert random.top_k is not None and random.top_k.flatten().tolist() == [20, 50]
    assert random.min_p is not None and mixed.logprobs == (None, None, None, 2)
    with pytest.raises(ValueError, match="one generator slot per logits row"):
        SamplingTable.of([GREEDY], [None, None], 50, CPU)


def test_a_kept_table_draws_as_a_fresh_one() -> None:
    params = [SEEDED, UNSEEDED, GREEDY, SEEDED]
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3

    def draws(keep: bool) -> list[list[int]]:
        generators = [
            torch.Generator().manual_seed(5),
            None,
            None,
            torch.Generator().manual_seed(6),
        ]
        sampler = Sampler(seed=2)
        table = SamplingTable.of(params, generators, 50, CPU)
        return [
            (
                sampler.choose(logits, table)
                if keep
                else sampler.sample(logits, params, generators)
            ).tolist()
            for _ in range(5)
        ]

    assert draws(keep=True) == draws(keep=False)
    with pytest.raises(ValueError, match="a table of 4 rows"):
        Sampler().choose(logits[:3], SamplingTable.of(params, [None] * 4, 50, CPU))


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def test_the_engine_builds_a_table_only_when_its_batch_changes(tiny: LoadedModel) -> None:
    config = EngineConfig(num_pages=32, max_num_batched_tokens=64, max_num_seqs=8)
    engine = LLMEngine(tiny, config)
    lengths = {"a": 6, "b": 6, "c": 9}  # a and b leave together, c three steps later
    for name, max_tokens in lengths.items():
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, ignore_eos=True)
        engine.add_request(GenerateRequest(name, [5, 6, 7, ord(name)], params))
    builds = []
    while engine.has_unfinished:
        engine.step()
        builds.append(engine.sampling_tables.num_builds)
    # One prefill step (a, b, c), then decodes of a, b, c (their rows unchanged after the
    # prefill's: one table), then of c alone: two tables in nine steps.
    assert len(builds) == 9
    assert builds == [1] * 6 + [2] * 3
