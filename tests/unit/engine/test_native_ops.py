"""RMSNorm and RoPE in C against the model's torch code, per op (bf16 and float32) and through a
bf16 model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.llama import RMSNorm
from engine.model.loader import load_model
from engine.model.native_ops import load_native_ops
from engine.model.rope import RopeTables, rope_cos_sin, rope_inplace, signed_sin
from tests.support.paged import PagedRunner, PagedSeq

OPS = load_native_ops()
needs_ops = pytest.mark.skipif(
    OPS is None, reason="no C compiler here (the model's torch code is tested without one)"
)


@needs_ops
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_rms_norm_matches_the_torch_path(rows: int) -> None:
    """Same roundings (float32 normalise, bf16 round, bf16 scale): equal but for the order of
    the sum of squares, which may move a value by one bf16 step."""
    assert OPS is not None
    torch.manual_seed(rows)
    norm = RMSNorm(96, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = (torch.randn(rows, 192) * 3).to(torch.bfloat16)[:, :96]  # rows 192 apart
    expected = norm(x)
    got = OPS.rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    differ = got != expected
    assert differ.float().mean() <= 0.01
    step = expected.float().abs().clamp_min(1e-3) * 2**-7  # one bf16 step, at most
    assert ((got.float() - expected.float()).abs() <= step).all()


@needs_ops
@pytest.mark.parametrize(("heads", "head_dim"), [(12, 64), (3, 128), (5, 16)])
def test_rope_in_place_equals_the_torch_path_bit_for_bit(heads: int, head_dim: int) -> None:
    assert OPS is not None
    torch.manual_seed(heads)
    rows = 37
    cos, sin = rope_cos_sin(head_dim, 10000.0, None, 256)
    positions = torch.randint(0, 256, (rows,))
    tables = RopeTables(
        cos.bfloat16().index_select(0, positions).unsqueeze(1),
        signed_sin(sin).bfloat16().index_select(0, positions).unsqueeze(1),
    )
    qkv = torch.randn(rows, (heads + 4) * head_dim).bfloat16()  # Q and K heads, then more
    ours, theirs = qkv.clone(), qkv.clone()
    OPS.rope(ours[:, : heads * head_dim].view(rows, heads, head_dim), tables.cos, tables.sin)
    rope_inplace(theirs[:, : heads * head_dim].view(rows, heads, head_dim), tables)
    assert torch.equal(ours, theirs)  # the columns after the rotated heads are untouched too
    assert not torch.equal(ours, qkv)


@needs_ops
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_float32_rms_norm_and_rope_match_the_torch_path(rows: int) -> None:
    """Same formulas in float32: equal to rounding (the sum of squares goes in another order)."""
    assert OPS is not None
    torch.manual_seed(rows)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
    x = (torch.randn(rows, 192) * 3)[:, :96]  # rows 192 apart
    torch.testing.assert_close(OPS.rms_norm(x, norm.weight, norm.eps), norm(x))
    heads, head_dim = 12, 64
    cos, sin = rope_cos_sin(head_dim, 10000.0, None, 512)
    positions = torch.randint(0, 512, (rows,))
    tables = RopeTables(
        cos.index_select(0, positions).unsqueeze(1),
        signed_sin(sin).index_select(0, positions).unsqueeze(1),
    )
    qkv = torch.randn(rows, (heads + 4) * head_dim)
    ours, theirs = qkv.clone(), qkv.clone()
    OPS.rope(ours[:, : heads * head_dim].view(rows, heads, head_dim), tables.cos, tables.sin)
    rope_inplace(theirs[:, : heads * head_dim].view(rows, heads, head_dim), tables)
    torch.testing.assert_close(ours, theirs)
    assert torch.equal(ours[:, heads * head_dim :], qkv[:, heads * head_dim :])


@needs_ops
def test_unsupported_inputs_are_refused() -> None:
    assert OPS is not None
    x = torch.randn(4, 8)
    weight = torch.ones(8).bfloat16()
    with pytest.raises(ValueError, match="beside"):
        OPS.rms_norm(x, weight, 1e-5)  # float32 rows, a bf16 weight
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        OPS.rms_norm(x.half(), weight.half(), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        OPS.rms_norm(x.bfloat16(), torch.ones(6).bfloat16(), 1e-5)
    q = torch.randn(4, 2, 8).bfloat16()
    table = torch.randn(4, 8).bfloat16()
    with pytest.raises(ValueError, match="table"):
        OPS.rope(q, table, torch.randn(4, 16).bfloat16()[:, ::2])  # strided table
    with pytest.raises(ValueError, match="unsupported"):
        OPS.rope(torch.randn(4, 2, 1024).bfloat16(), table, table)


def test_bf16_and_float32_models_use_the_native_ops_when_built(tiny_llama_dir: Path) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        model = load_model(str(tiny_llama_dir), dtype=dtype).model
        assert (model.norm.native is not None) == (OPS is not None)
    assert load_model(str(tiny_llama_dir), dtype=torch.float16).model.norm.native is None


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_with_native_ops_match_the_torch_code(
    tiny_llama_dir: Path, dtype: torch.dtype
) -> None:
    model = load_model(str(tiny_llama_dir), dtype=dtype).model
    tokens = [
        int(t) for t in torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4))
    ]
    logits = []
    for ops in (OPS, None):
        model.use_native_ops(ops)
        runner = PagedRunner(model, TorchAttentionBackend(), num_pages=4, page_size=16)
        seq = PagedSeq(tokens, [1, 3, 0, 2])
        for n in [16, 7, 1, 1, 15]:
            runner.step([seq], [n])
        logits.append(torch.stack(seq.logits))
    loose = dtype == torch.bfloat16
    tolerance = {"atol": 0.05, "rtol": 0.02} if loose else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(logits[0], logits[1], **tolerance)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
