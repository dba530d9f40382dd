"""Everything under tests/gpu needs an NVIDIA GPU: without CUDA each test is skipped, saying so."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU); run bench/gpu_check.sh on a GPU machine")


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
