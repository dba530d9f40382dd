"""Projection weights laid out once for oneDNN on CPU, instead of on every call.

A plain ``linear`` on CPU either hands oneDNN a row-major weight, which it reorders into its
blocked layout on each call (bf16: at decode batch sizes that reorder costs as much as the
product), or runs MKL's sgemm (float32: slow for the few rows of a decode step).
``torch.ops.mkldnn._reorder_linear_weight`` lays the weight out once at load time, and
``_linear_pointwise`` then runs the product (fp32 accumulation, one rounding; the residual add
fused as oneDNN's sum post-op). In bf16 the results are bit-identical to ``linear``/``addmm``
on the same inputs and the step runs 1.4–2× faster in its projections. In float32 they agree
to rounding (oneDNN sums in another order than MKL) and a 30-layer model's projections take
about 0.65× the time at 8 rows, 0.85× at 32, the same at 2048.

bf16 weights are packed on a CPU whose oneDNN supports bf16, float32 weights wherever oneDNN is
available; everything else keeps the plain path (``pack`` returns None).
"""

from __future__ import annotations

import torch
from torch.nn.functional import linear

# The batch size oneDNN chooses its blocking for; any step size runs on the result (measured
# here: a hint of 16 is within a few percent of the best hint from batch 1 to 512).
BATCH_HINT = 16


def packing_supported(weight: torch.Tensor) -> bool:
    mkldnn = torch.ops.mkldnn
    if not (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(mkldnn, "_reorder_linear_weight")
    ):
        return False
    if weight.dtype == torch.bfloat16:
        return bool(mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [out, in] in oneDNN's layout, or None where packing does not apply."""
    if not packing_supported(weight):
        return None
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
    return packed


def project(
    x: torch.Tensor,  # [n, in]
    weight: torch.Tensor,  # [out, in]
    packed: torch.Tensor | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [n, out]
    """``x @ weight.T + bias``."""
    if packed is None:
        return linear(x, weight, bias)
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


def project_add(
    x: torch.Tensor,  # [n, in]
    weight: torch.Tensor,  # [out, in]
    packed: torch.Tensor | None,
    residual: torch.Tensor,  # [n, out]
) -> torch.Tensor:  # [n, out]
    """``residual + x @ weight.T`` as one GEMM (the add is the GEMM's accumulate)."""
    if packed is None:
        return torch.addmm(residual, x, weight.t())
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")
    return out
