"""Everything under tests/gpu needs an NVIDIA GPU and FlashInfer: without them each test is skipped
with its reason. ``PREFILL_KERNEL`` (auto, fa2, fa3) picks FlashInfer's prefill kernel."""

from __future__ import annotations

import importlib
import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU); run bench/gpu_check.sh on a GPU machine")


@pytest.fixture(autouse=True)
def _needs_flashinfer() -> None:
    try:
        importlib.import_module("flashinfer")
    except ImportError as exc:  # a skip with the real cause, never a collection error
        pytest.skip(f"flashinfer does not import: {type(exc).__name__}: {exc}")


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def prefill_kernel() -> str:
    return os.environ.get("PREFILL_KERNEL", "auto")
