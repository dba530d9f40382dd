"""Pre-packed projections give the plain ones' results (bf16: bit-identical; float32: to
rounding), per layer and per model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.functional import linear

from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.llama import Attention, DecoderLayer, LlamaForCausalLM
from engine.model.loader import load_model
from engine.model.packed_linear import pack, packing_supported, project, project_add
from tests.support.paged import PagedRunner, PagedSeq

BF16_PACKING = packing_supported(torch.empty(1, dtype=torch.bfloat16))
F32_PACKING = packing_supported(torch.empty(1, dtype=torch.float32))
needs_packing = pytest.mark.skipif(
    not BF16_PACKING, reason="this CPU's oneDNN has no bf16 kernels: the plain path is used"
)
needs_f32_packing = pytest.mark.skipif(
    not F32_PACKING, reason="torch was built without oneDNN: the plain path is used"
)


def test_bf16_and_float32_cpu_weights_are_packed_float16_is_not() -> None:
    assert pack(torch.randn(8, 4).half()) is None
    assert (pack(torch.randn(8, 4).bfloat16()) is not None) == BF16_PACKING
    assert (pack(torch.randn(8, 4)) is not None) == F32_PACKING
    assert torch.backends.mkldnn.is_available() == F32_PACKING  # type: ignore[no-untyped-call]


@needs_f32_packing
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 77, 600])
def test_packed_float32_projections_agree_with_linear_and_addmm(num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(num_tokens, 128)[:, :64]  # a strided view, as the model passes
    residual = torch.randn(num_tokens, 96)
    packed = pack(weight)
    assert packed is not None
    tight = {"rtol": 1e-5, "atol": 1e-5}  # another summation order, nothing more
    torch.testing.assert_close(project(x, weight, packed, bias), linear(x, weight, bias), **tight)
    expected = torch.addmm(residual, x, weight.t())
    torch.testing.assert_close(project_add(x, weight, packed, residual), expected, **tight)


@needs_packing
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 77])
def test_packed_projection_and_fused_add_equal_linear_and_addmm(num_tokens: int) -> None:
    torch.manual_seed(num_tokens)
    weight = torch.randn(96, 64).bfloat16()
    bias = torch.randn(96).bfloat16()
    x = torch.randn(num_tokens, 128).bfloat16()[:, :64]  # a strided view, as the model passes
    residual = torch.randn(num_tokens, 96).bfloat16()
    packed = pack(weight)
    assert packed is not None
    assert torch.equal(project(x, weight, packed), linear(x, weight))
    assert torch.equal(project(x, weight, packed, bias), linear(x, weight, bias))
    expected = torch.addmm(residual, x, weight.t())
    assert torch.equal(project_add(x, weight, packed, residual), expected)
    assert torch.equal(project_add(x, weight, None, residual), expected)


def unpack(model: LlamaForCausalLM) -> None:
    model.output_packed = None
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer) and isinstance(layer.self_attn, Attention)
        layer.self_attn.qkv_packed = layer.self_attn.o_packed = None
        layer.mlp.gate_up_packed = layer.mlp.down_packed = None


def packed_and_plain_logits(model_dir: Path, dtype: torch.dtype) -> list[torch.Tensor]:
    """A 40-token sequence run in chunks and decodes, packed (as loaded) and then unpacked."""
    model = load_model(str(model_dir), dtype=dtype).model
    assert model.output_packed is not None  # packed at load
    tokens = [
        int(t) for t in torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3))
    ]
    logits = []
    for packed in (True, False):
        if not packed:
            unpack(model)
        runner = PagedRunner(model, TorchAttentionBackend(), num_pages=4, page_size=16)
        seq = PagedSeq(tokens, [1, 3, 0, 2])
        for n in [16, 7, 1, 1, 15]:
            runner.step([seq], [n])
        logits.append(torch.stack(seq.logits))
    return logits


@needs_packing
def test_a_packed_bf16_model_gives_the_same_logits_as_the_plain_one(tiny_llama_dir: Path) -> None:
    packed, plain = packed_and_plain_logits(tiny_llama_dir, torch.bfloat16)
    assert torch.equal(packed, plain)


@needs_f32_packing
def test_a_packed_float32_model_agrees_with_the_plain_one(tiny_llama_dir: Path) -> None:
    packed, plain = packed_and_plain_logits(tiny_llama_dir, torch.float32)
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-4)
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))
