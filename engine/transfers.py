"""Copies between the host and the engine's device that never make the host wait for the device.

A blocking copy to or from a CUDA device waits for every kernel queued before it, so a step that
uploads a list or reads an id back in the middle stalls the host until the device has caught up.
Uploads go from pinned memory without blocking; a step's chosen ids come back the same way, with
an event to wait on only when they are needed (``engine/overlap.py``). Off CUDA both are plain
copies.
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


class Download:
    """Token ids on their way to the host: on CUDA copied into pinned memory without blocking,
    with an event recorded behind the copy; elsewhere read when waited for."""

    __slots__ = ("_event", "_values")

    def __init__(self, values: torch.Tensor) -> None:  # [n] int64, on the device
        self._event: torch.cuda.Event | None = None
        if values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, device="cpu", pin_memory=True)
            host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
            values = host
        self._values = values

    def wait(self) -> list[int]:
        """The ids, once the device has computed and copied them (the step's one wait)."""
        if self._event is not None:
            self._event.synchronize()  # type: ignore[no-untyped-call]
        ids: list[int] = self._values.tolist()
        return ids
