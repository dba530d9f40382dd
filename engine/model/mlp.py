"""The gated MLP of every supported architecture (SwiGLU, or Gemma's GeGLU), and the scratch rows
its layers share."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.functional import gelu, silu

from engine.model.config import ModelConfig
from engine.model.packed_linear import Packed, project, project_add

if TYPE_CHECKING:
    from engine.lora.batch import LoraStep


class Scratch:
    """One buffer the layers take turns with (each layer's SwiGLU output lives until its down
    projection has read it); grown to the largest step, so steps reuse memory already mapped."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def rows(self, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:  # [rows, cols]
        buffer = self._buffer
        if (
            buffer is None
            or buffer.shape[0] < rows
            or buffer.shape[1] != cols
            or buffer.dtype != like.dtype
            or buffer.device != like.device
        ):
            buffer = self._buffer = like.new_empty((rows, cols))
        return buffer[:rows]


class MLP(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int = 0, scratch: Scratch | None = None
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.scratch = scratch
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_packed: Packed | None = None
        self.down_packed: Packed | None = None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden], normalised
        residual: torch.Tensor | None,  # [num_tokens, hidden], or None: the output alone
        lora: LoraStep | None = None,  # the step's adapters, if any row has one
        sampled_rows: bool = False,  # x holds the step's sampled rows alone
    ) -> torch.Tensor:  # [num_tokens, hidden]: residual + MLP output
        gate_up = project(x, self.gate_up_proj.weight, self.gate_up_packed)  # [n, 2 * inter]
        if lora is not None:
            lora.add(self.layer_id, "gate_up", x, gate_up, sampled_rows)
        inter = self.intermediate_size
        # SwiGLU: SiLU in place over the gate half, then the product into contiguous rows of the
        # shared scratch (oneDNN would copy strided rows first; a new tensor would be mapped and
        # faulted in every layer). The same element-wise bits either way.
        if self.gelu:  # Gemma's GeGLU
            gate = gelu(gate_up[:, :inter], approximate="tanh")
        else:
            gate = silu(gate_up[:, :inter], inplace=True)
        out = None if self.scratch is None else self.scratch.rows(x.shape[0], inter, gate)
        hidden = torch.mul(gate, gate_up[:, inter:], out=out)
        if residual is None:
            down = project(hidden, self.down_proj.weight, self.down_packed)
        else:
            down = project_add(hidden, self.down_proj.weight, self.down_packed, residual)
        if lora is not None:
            lora.add(self.layer_id, "down", hidden, down, sampled_rows)
        return down
