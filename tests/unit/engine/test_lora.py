"""LoRA adapters in the engine: token-identical to PEFT's merged model with several adapters and
the base model in one batch, bounded resident slots, and adapter-keyed prefix caching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.lora import batch as lora_batch
from engine.lora.batch import LoraStep
from engine.model.loader import LoadedModel, load_model
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams
from radix_cache.prefix_cache import adapter_namespace
from radix_cache.radix_prefix_cache import RadixPrefixCache
from tests.support.greedy import hf_greedy
from tests.support.lora import make_adapter, merged_reference
from tests.support.tiny_llama import load_reference

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, rank, alpha, targets, rsLoRA)
ADAPTERS: dict[str, tuple[int, int, float, list[str], bool]] = {
    "all": (1, 4, 8.0, ALL, False),
    "attn": (2, 8, 16.0, ["q_proj", "v_proj"], True),
    "mlp": (3, 2, 4.0, ["gate_proj", "up_proj", "down_proj", "o_proj"], False),
}
NUM_NEW = 12


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(tiny_llama_dir, root / name, seed, rank, alpha, targets, rslora)
        for name, (seed, rank, alpha, targets, rslora) in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def ours(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def _engine(ours: LoadedModel, max_loras: int, **config: int) -> LLMEngine:
    return LLMEngine(
        ours,
        EngineConfig(dtype="float32", max_loras=max_loras, max_lora_rank=8, **config),  # type: ignore[arg-type]
        prefix_cache_factory=RadixPrefixCache,
    )


def _request(
    rid: str,
    prompt: list[int],
    adapter: str | None,
    adapters: dict[str, Path],
    tenant: str = "t",
    num_new: int = NUM_NEW,
) -> GenerateRequest:
    params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
    path = None if adapter is None else str(adapters[adapter])
    return GenerateRequest(rid, prompt, params, tenant_id=tenant, lora_name=adapter, lora_path=path)


def _run(engine: LLMEngine) -> dict[str, tuple[list[int], RequestOutput]]:
    tokens: dict[str, list[int]] = {}
    last: dict[str, RequestOutput] = {}
    for _ in range(5_000):
        if not engine.has_unfinished:
            break
        for output in engine.step():
            assert output.error is None, output.error
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            last[output.request_id] = output
    assert not engine.has_unfinished
    return {rid: (tokens[rid], last[rid]) for rid in last}


def _prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 60, (count,), generator=gen).tolist()
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def _num_slots(step: LoraStep) -> int:
    """The slots whose rows shared this step's products (either layout)."""
    if step.rows.onehot is not None:
        return int((step.rows.onehot.sum(dim=0) > 0).sum())
    return len(set(step.rows.block_slots.tolist()))


@pytest.mark.parametrize("dense_max", [0, 10**6], ids=["blocks", "dense"])
def test_adapters_and_base_in_one_batch_match_peft_merged(
    ours: LoadedModel,
    tiny_llama_dir: Path,
    adapters: dict[str, Path],
    dense_max: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(lora_batch, "DENSE_MAX_ROW_SLOTS", dense_max)
    names: list[str | None] = [None, "all", "attn", "mlp"]
    prompts = _prompts(12, seed=7)
    chosen = [names[i % len(names)] for i in range(len(prompts))]
    # A small step budget: prefill chunks and decodes of different adapters share steps.
    engine = _engine(ours, max_loras=3, max_num_batched_tokens=48, max_num_seqs=16)
    steps: list[LoraStep] = []
    assert engine.lora is not None
    build = engine.lora.step

    def recording(*args: list[int]) -> LoraStep | None:
        step = build(*args)
        if step is not None:
            steps.append(step)
        return step

    engine.lora.step = recording  # type: ignore[method-assign]
    for i, (prompt, name) in enumerate(zip(prompts, chosen, strict=True)):
        engine.add_request(_request(f"r{i}", prompt, name, adapters))
    got = _run(engine)
    # Several adapters really shared steps (rows of three slots in one product).
    assert max(_num_slots(s) for s in steps) == 3
    references = {None: load_reference(tiny_llama_dir)}
    references |= {n: merged_reference(tiny_llama_dir, adapters[n]) for n in ADAPTERS}
    base_out = hf_greedy(references[None], prompts, NUM_NEW)
    for i, (prompt, name) in enumerate(zip(prompts, chosen, strict=True)):
        want = hf_greedy(references[name], [prompt], NUM_NEW)[0]
        assert got[f"r{i}"][0] == want, (i, name)
    # Each adapter changes the greedy output of at least one of its prompts.
    for name in ADAPTERS:
        rows = [i for i, n in enumerate(chosen) if n == name]
        assert any(got[f"r{i}"][0] != base_out[i] for i in rows), name


def test_more_adapters_than_slots_load_in_turn(
    ours: LoadedModel, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    prompts = _prompts(6, seed=11)
    chosen = ["all", "attn", "mlp", "attn", "all", "mlp"]
    engine = _engine(ours, max_loras=1)
    for i, (prompt, name) in enumerate(zip(prompts, chosen, strict=True)):
        engine.add_request(_request(f"r{i}", prompt, name, adapters))
    got = _run(engine)
    assert engine.lora is not None
    slots = engine.lora.slots
    assert slots.num_loads >= 3  # one slot: every adapter was loaded into it in turn
    assert slots.pins == [0]  # finished requests unpin
    for name in ADAPTERS:
        reference = merged_reference(tiny_llama_dir, adapters[name])
        rows = [i for i, n in enumerate(chosen) if n == name]
        want = hf_greedy(reference, [prompts[i] for i in rows], NUM_NEW)
        assert [got[f"r{i}"][0] for i in rows] == want, name


def test_an_adapters_prefix_serves_only_that_adapter_and_tenant(
    ours: LoadedModel, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    prompt = _prompts(1, seed=3)[0] * 3  # several full pages
    engine = _engine(ours, max_loras=2)

    def cached(rid: str, adapter: str | None, tenant: str = "t") -> tuple[int, list[int]]:
        engine.add_request(_request(rid, prompt, adapter, adapters, tenant, num_new=4))
        tokens, last = _run(engine)[rid]
        return last.num_cached_tokens, tokens

    first, with_all = cached("a1", "all")
    assert first == 0
    again, repeat = cached("a2", "all")
    assert again >= 16 and repeat == with_all  # the adapter's own prefix is reused
    base_cached, base_tokens = cached("b1", None)
    assert base_cached == 0  # the base model never reads the adapter's KV
    assert base_tokens == hf_greedy(load_reference(tiny_llama_dir), [prompt], 4)[0]
    assert cached("c1", "attn")[0] == 0  # nor another adapter
    assert cached("d1", "all", tenant="other")[0] == 0  # nor the same adapter for another tenant
    assert cached("a3", "all")[0] >= 16  # the adapter's pages are still its own


def test_public_prefix_is_not_used_through_an_adapter(
    ours: LoadedModel, adapters: dict[str, Path]
) -> None:
    engine = _engine(ours, max_loras=1)
    prompt = _prompts(1, seed=5)[0] * 2
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.add_request(GenerateRequest("pub", prompt, params, publish=True))
    _run(engine)
    engine.add_request(_request("x", prompt, "all", adapters, num_new=2))
    assert _run(engine)["x"][1].num_cached_tokens == 0
    engine.add_request(_request("y", prompt, None, adapters, num_new=2))
    assert _run(engine)["y"][1].num_cached_tokens > 0  # the base model does reuse it


def _write_adapter(root: Path, config: dict[str, object], source: Path) -> Path:
    root.mkdir()
    (root / "adapter_config.json").write_text(json.dumps(config))
    (root / "adapter_model.safetensors").write_bytes(
        (source / "adapter_model.safetensors").read_bytes()
    )
    return root


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"r": 16}, "exceeds the engine's max LoRA rank"),
        ({"target_modules": ["lm_head"]}, "not supported"),
        ({"peft_type": "IA3"}, "only LoRA"),
        ({"r": 2}, "do not fit"),
    ],
)
def test_unsupported_adapters_are_refused_at_submission(
    ours: LoadedModel,
    adapters: dict[str, Path],
    tmp_path: Path,
    change: dict[str, object],
    message: str,
) -> None:
    source = adapters["all"]
    config = json.loads((source / "adapter_config.json").read_text()) | change
    bad = _write_adapter(tmp_path / "bad", config, source)
    engine = _engine(ours, max_loras=1)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request(
            GenerateRequest("r", [1, 2, 3], params, lora_name="bad", lora_path=str(bad))
        )
    assert not engine.has_unfinished


def test_adapter_requests_are_refused_when_adapters_are_off(
    ours: LoadedModel, adapters: dict[str, Path], tmp_path: Path
) -> None:
    engine = _engine(ours, max_loras=0)
    with pytest.raises(InvalidRequestError, match="not enabled"):
        engine.add_request(_request("r", [1, 2, 3], "all", adapters))
    on = _engine(ours, max_loras=1)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(InvalidRequestError, match=r"adapter_config\.json"):
        on.add_request(
            GenerateRequest("r", [1, 2], params, lora_name="x", lora_path=str(tmp_path / "none"))
        )


def test_dropping_a_tenant_frees_its_adapters_pages_too(
    ours: LoadedModel, adapters: dict[str, Path]
) -> None:
    engine = _engine(ours, max_loras=2)
    prompt = _prompts(1, seed=9)[0] * 2
    engine.add_request(_request("own", prompt, "all", adapters, num_new=2))
    engine.add_request(_request("base", prompt, None, adapters, num_new=2))
    engine.add_request(_request("other", prompt, "all", adapters, tenant="other", num_new=2))
    _run(engine)
    before = engine.cache.pool.num_free_pages
    freed = engine.drop_tenant("t")
    assert freed > 0 and engine.cache.pool.num_free_pages == before + freed
    left = {ns for ns, snap in engine.cache.stats().items() if snap.resident_pages}
    assert left == {adapter_namespace("other", "all")}


def test_steps_without_adapter_rows_take_the_plain_path(
    ours: LoadedModel, adapters: dict[str, Path]
) -> None:
    engine = _engine(ours, max_loras=2)
    assert engine.lora is not None
    calls: list[object] = []
    build = engine.lora.step

    def recording(*args: list[int]) -> LoraStep | None:
        calls.append(args)
        return build(*args)

    engine.lora.step = recording  # type: ignore[method-assign]
    engine.add_request(_request("b", _prompts(1, seed=2)[0], None, adapters, num_new=3))
    _run(engine)
    assert calls == []  # no adapter row: the step never builds a layout
    engine.add_request(_request("l", _prompts(1, seed=2)[0], "all", adapters, num_new=3))
    _run(engine)
    assert len(calls) >= 3
