"""The model's fused building blocks against their plain formulas: RoPE, RMSNorm, GEMM + add."""

from __future__ import annotations

import pytest
import torch

from engine.model.llama import RMSNorm
from engine.model.packed_linear import project_add
from engine.model.rope import RopeTables, apply_rope, rope_cos_sin, rope_inplace, signed_sin


def test_inplace_rope_on_a_strided_view_equals_apply_rope() -> None:
    torch.manual_seed(0)
    num_tokens, heads, kv_heads, dim = 7, 6, 2, 16
    cos, sin = rope_cos_sin(dim, 10000.0, None, 64)
    positions = torch.tensor([0, 3, 9, 10, 11, 40, 63])
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim)
    q_and_k = qkv[:, : (heads + kv_heads) * dim].view(num_tokens, -1, dim)  # strided view
    expected = apply_rope(q_and_k, cos[positions, None], sin[positions, None])
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    rope_inplace(q_and_k, RopeTables(cos[positions, None], signed_sin(sin)[positions, None]))
    torch.testing.assert_close(q_and_k, expected, atol=1e-6, rtol=0)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # V untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_the_reference_formula(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    norm = RMSNorm(32, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    norm = norm.to(dtype)
    x = torch.randn(5, 32).to(dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    expected = norm.weight * h.to(dtype)
    atol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(norm(x), expected, atol=atol, rtol=0)


def test_project_add_is_residual_plus_projection() -> None:
    torch.manual_seed(2)
    x, weight, residual = torch.randn(4, 24), torch.randn(10, 24), torch.randn(4, 10)
    expected = residual + torch.nn.functional.linear(x, weight)
    torch.testing.assert_close(project_add(x, weight, None, residual), expected, atol=1e-5, rtol=0)
