"""Copies from the host to the engine's device that never make the host wait for the device.

A blocking copy to a CUDA device waits for every kernel queued before it, so a step that uploads
a list stalls the host until the device has caught up. Uploads go from pinned memory without
blocking. Off CUDA they are plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(
    values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a tensor on ``device``; on CUDA copied from pinned memory without waiting
    (the caching host allocator keeps the buffer until the copy is done)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.tensor(values, dtype=dtype, device="cpu", pin_memory=True)
    return host.to(device, non_blocking=True)
