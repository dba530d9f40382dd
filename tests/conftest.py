"""Shared fixtures for the whole suite.

Imports stay inside the fixtures: tests/gpu runs on a GPU machine that has torch, pytest and
FlashInfer but none of the loaders' packages (gguf, transformers), and this file loads there too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from engine.model.loader import LoadedModel

# The suite runs more workers than cores, each with its servers and their engines: OpenMP threads
# that spin while they wait for work (libgomp's default) then burn the cores the others need.
# Three slow modules side by side beside mypy on 2 cores took 382 s wall and 741 s CPU spinning,
# 52 s and 88 s passive. Set before torch loads here; the servers tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def _fresh_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from structlog's defaults, with loggers never cached: a benchmark run
    in-process leaves a warnings-only filter behind, and the gateway caches each logger's
    configuration on first use; either would hide events from ``capture_logs``."""
    import structlog

    configure = structlog.configure

    def uncached(**settings: Any) -> None:
        configure(**{**settings, "cache_logger_on_first_use": False})

    monkeypatch.setattr(structlog, "configure", uncached)
    yield
    structlog.reset_defaults()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, hidden 64, 4 heads, 2 KV heads) as an HF directory."""
    from tests.support.tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def default_model_fp32() -> LoadedModel:
    """The default SmolLM2-135M-Instruct in float32 (about ten seconds to load: slow tests only)."""
    import torch

    from engine.model.loader import load_model

    return load_model("default", dtype=torch.float32)
