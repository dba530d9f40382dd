"""The engine factory: dtype and device names resolved in engine/, an engine built from plain data
on a tiny random Llama, and started in process with the same tokens as one built by hand."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.factory import (
    EngineSpec,
    build_engine,
    load,
    resolve_device_name,
    resolve_dtype_name,
)
from engine.launch import start_engine
from engine.llm_engine import LLMEngine
from engine.model.loader import load_model
from radix_cache.prefix_cache import NoPrefixCache
from radix_cache.radix_prefix_cache import RadixPrefixCache
from tests.support.async_engine import collect, greedy_request
from tests.support.greedy import run_greedy

CONFIG = EngineConfig(
    num_pages=32, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, dtype="float32"
)
PROMPTS = [list(range(1, 20)), list(range(5, 12))]


class Stages:
    """A LoadProgress that remembers the stages it was told: name, total, unit, amount done."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float | None, str]] = []
        self.done: list[float] = []

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.seen]

    def stage(self, name: str, total: float | None = None, unit: str = "steps") -> None:
        self.seen.append((name, total, unit))
        self.done.append(0.0)

    def advance(self, amount: float = 1.0) -> None:
        self.done[-1] += amount


@pytest.fixture
def keep_threads() -> Iterator[int]:
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def test_auto_device_is_cuda_only_where_a_gpu_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    for visible, expected in [(True, "cuda"), (False, "cpu")]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda v=visible: v)
        assert resolve_device_name("auto") == expected
    assert resolve_device_name("cpu") == "cpu"
    assert resolve_device_name("cuda:1") == "cuda:1"


def test_auto_dtype_is_bfloat16_where_the_cpu_multiplies_it_natively(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    for native, expected in [(True, "bfloat16"), (False, "float32")]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=native: v)
        assert resolve_dtype_name("auto", "cpu") == expected
        assert resolve_dtype_name("float16", "cpu") == "float16"


def test_load_takes_the_dtype_by_name(tiny_llama_dir: Path) -> None:
    assert load(str(tiny_llama_dir), "bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        load(str(tiny_llama_dir), "float8")


def test_built_engine_matches_one_built_by_hand(tiny_llama_dir: Path, keep_threads: int) -> None:
    stages = Stages()
    spec = EngineSpec(model=str(tiny_llama_dir), dtype="float32", config=CONFIG, torch_threads=1)
    built = build_engine(spec, stages)
    assert torch.get_num_threads() == 1
    assert built.name == tiny_llama_dir.name
    assert isinstance(built.engine.cache, RadixPrefixCache)
    assert built.engine.config is CONFIG
    assert stages.names[-1] == "allocate KV cache"  # no step target: no timed warm-up
    by_hand = LLMEngine(load_model(str(tiny_llama_dir), torch.float32), CONFIG)
    assert run_greedy(built.engine, PROMPTS, 6)[0] == run_greedy(by_hand, PROMPTS, 6)[0]


def test_every_load_stage_has_a_total_and_reaches_it(tiny_llama_dir: Path) -> None:
    stages = Stages()
    config = dataclasses.replace(CONFIG, target_tpot_ms="auto")
    spec = EngineSpec(model=str(tiny_llama_dir), dtype="float32", config=config)
    build_engine(spec, stages)
    assert stages.names[-4:] == ["read weights", "pack weights", "allocate KV cache", "warm up"]
    units = {name: unit for name, _, unit in stages.seen}
    assert (units["read weights"], units["allocate KV cache"]) == ("bytes", "bytes")
    layers, pages = 2, 32  # tiny Llama: 2 layers, 2 KV heads of 16; float32 pages of 16 tokens
    assert stages.seen[-2][1] == pages * 2 * 16 * 2 * 16 * 4 * layers
    assert stages.seen[-3][1] == 4 * layers + 1  # four projections a layer, and the LM head
    for (name, total, _), done in zip(stages.seen, stages.done, strict=True):
        assert total is not None and done == total, name


def test_an_engine_without_prefix_cache_caches_nothing(tiny_llama_dir: Path) -> None:
    spec = EngineSpec(model=str(tiny_llama_dir), dtype="float32", config=CONFIG, prefix_cache=False)
    assert isinstance(build_engine(spec).engine.cache, NoPrefixCache)


def test_a_missing_model_fails_before_any_engine_starts(tmp_path: Path) -> None:
    spec = EngineSpec(model=str(tmp_path / "missing"), dtype="float32", config=CONFIG)
    with pytest.raises(FileNotFoundError):
        start_engine(spec, in_process=True)


def test_started_in_process_it_serves_what_the_built_engine_computes(
    tiny_llama_dir: Path,
) -> None:
    spec = EngineSpec(model=str(tiny_llama_dir), dtype="float32", config=CONFIG)
    expected = run_greedy(build_engine(spec).engine, PROMPTS[:1], 6)[0][0]
    running = start_engine(spec, in_process=True)
    assert isinstance(running.client, AsyncEngine)
    assert running.name == tiny_llama_dir.name
    assert running.max_model_len == 256
    assert running.tokenizer.encode("ab") == load_model(str(tiny_llama_dir)).tokenizer.encode("ab")

    async def generate() -> list[int]:
        try:
            outputs = await collect(running.client, greedy_request("a", PROMPTS[0], 6))
        finally:
            await running.client.shutdown()
        return [t for o in outputs for t in o.token_ids]

    assert asyncio.run(generate()) == expected
