"""Every supported architecture, from safetensors and from GGUF, greedy token-identical (float32)
to transformers' own model on the same tiny random weights, with chunked prefill and prefix-cache
hits across sliding windows; and each architecture's folder as the installed transformers writes
it from its class's default config (only the sizes set), so no default the engine assumes
differs from the one transformers applies."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from engine.attention.registry import create_backend
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel, load_model
from radix_cache.radix_prefix_cache import RadixPrefixCache
from tests.support.gguf_arch import arch_dir_to_gguf
from tests.support.greedy import hf_greedy, run_greedy
from tests.support.paged import PagedRunner, PagedSeq
from tests.support.tiny_models import (
    DEFAULT_CLASSES,
    DEFAULT_SHAPE,
    TOKEN_IDS,
    default_config,
    load_reference,
    make_tiny_model,
)

NUM_NEW = 8
SHARED = [(j * 11 + 3) % 256 for j in range(40)]  # two and a half pages: a prefix-cache hit
PROMPTS = [SHARED + [(i * 31 + j * 7) % 256 for j in range(5 + 9 * i)] for i in range(4)]
CASES = [
    ("llama3", "safetensors"),
    ("llama3", "gguf"),
    ("mistral", "safetensors"),
    ("qwen2", "safetensors"),
    ("qwen2", "gguf"),
    ("qwen2_window", "safetensors"),
    ("qwen3", "safetensors"),
    ("qwen3", "gguf"),
    ("phi3", "safetensors"),
    ("phi3", "gguf"),
    ("gemma2", "safetensors"),
    ("gemma2", "gguf"),
    ("gemma2_scaled", "safetensors"),
    ("gemma3", "safetensors"),
    ("gemma3", "gguf"),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {}


def _model_dir(arch: str, dirs: dict[str, Path], tmp: pytest.TempPathFactory) -> Path:
    if arch not in dirs:
        dirs[arch] = make_tiny_model(arch, tmp.mktemp(arch))
    return dirs[arch]


def _engine_greedy(loaded: LoadedModel) -> list[list[int]]:
    """The first prompt alone, then all of them: the others then hit its cached pages."""
    engine = LLMEngine(
        loaded,
        EngineConfig(dtype="float32", num_pages=64, max_num_batched_tokens=32, max_num_seqs=8),
        prefix_cache_factory=RadixPrefixCache,
    )
    first, _ = run_greedy(engine, PROMPTS[:1], NUM_NEW, tag="warm")
    got, outputs = run_greedy(engine, PROMPTS, NUM_NEW)
    assert sum(o.num_cached_tokens for o in outputs) >= 32 * len(PROMPTS)
    assert got[0] == first[0]
    return got


@pytest.mark.parametrize(("arch", "fmt"), CASES)
def test_greedy_matches_transformers(
    arch: str,
    fmt: str,
    model_dirs: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    hf_dir = _model_dir(arch, model_dirs, tmp_path_factory)
    path = hf_dir
    if fmt == "gguf":
        path = arch_dir_to_gguf(hf_dir, tmp_path_factory.mktemp(f"{arch}_gguf") / "model.gguf")
    loaded = load_model(str(path), dtype=torch.float32)
    expected = hf_greedy(load_reference(hf_dir), PROMPTS, NUM_NEW)  # type: ignore[arg-type]
    assert _engine_greedy(loaded) == expected


@pytest.mark.parametrize(("arch", "fmt"), CASES)
def test_logits_match_transformers(
    arch: str,
    fmt: str,
    model_dirs: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Chunks, then decodes, over shuffled pages: every step's logits as the reference's (which
    catches what greedy ids cannot, such as a final soft-cap)."""
    hf_dir = _model_dir(arch, model_dirs, tmp_path_factory)
    path = hf_dir
    if fmt == "gguf":
        path = arch_dir_to_gguf(hf_dir, tmp_path_factory.mktemp(f"{arch}_gguf") / "model.gguf")
    loaded = load_model(str(path), dtype=torch.float32)
    tokens = PROMPTS[3]
    with torch.no_grad():
        expected = load_reference(hf_dir)(torch.tensor([tokens])).logits[0]
    backend = create_backend(torch.device("cpu"), loaded.config, page_size=16, dtype=torch.float32)
    runner = PagedRunner(loaded.model, backend, num_pages=8, page_size=16)
    seq = PagedSeq(tokens, page_ids=[6, 2, 7, 0, 4])
    steps = [30, 29, 10, 1, 1, 1]
    assert sum(steps) == len(tokens)
    for n in steps:
        runner.step([seq], [n])
    ends = list(itertools.accumulate(steps))
    got = torch.stack(seq.logits)
    torch.testing.assert_close(got, expected[[e - 1 for e in ends]], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", sorted(DEFAULT_CLASSES))
def test_default_config_folders_match_transformers(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    config = default_config(arch)
    cls, head = DEFAULT_CLASSES[arch]
    defaults = cls().to_dict()
    changed = {k for k, v in config.to_dict().items() if defaults.get(k) != v}
    # Only sizes differ from the class's defaults (and what follows from them: the head size,
    # the layer types of two layers, token ids dropped for the tiny vocabulary).
    sizes = {*DEFAULT_SHAPE, *head, "head_dim", "layer_types", *TOKEN_IDS}
    assert changed <= sizes, changed - sizes
    hf_dir = make_tiny_model(arch, tmp_path_factory.mktemp(f"{arch}_default"), config=config)
    written = json.loads((hf_dir / "config.json").read_text())
    assert written["num_hidden_layers"] == 2 and written["hidden_size"] == 64
    loaded = load_model(str(hf_dir), dtype=torch.float32)
    expected = hf_greedy(load_reference(hf_dir), PROMPTS, NUM_NEW)  # type: ignore[arg-type]
    assert _engine_greedy(loaded) == expected
