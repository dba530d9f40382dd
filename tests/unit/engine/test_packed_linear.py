"""Pre-packed projections give the plain ones' results (bf16: bit-identical; float32: to
rounding), per layer and per model; the small-batch pair product, where a weight keeps it; and
float32 weights kept as block codes, decoded exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.functional import linear

from engine.attention.torch_backend import TorchAttentionBackend
from engine.model import llama as llama_module
from engine.model import packed_linear
from engine.model.llama import Attention, DecoderLayer, LlamaForCausalLM
from engine.model.loader import LoadedModel, load_model
from engine.model.packed_linear import (
    CODE_BLOCK,
    SMALL_GEMM_SOURCE,
    Codes,
    CodesGemm,
    block_codes,
    build_codes_gemm,
    gather_pairs,
    load_codes_gemm,
    load_small_gemm,
    pack,
    packing_supported,
    pair_layout,
    project,
    project_add,
)
from engine.native.build import try_load
from tests.support.paged import AVX2_BUILD_FLAGS, PagedRunner, PagedSeq, needs_avx2_build_apart

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


SMALL_GEMM = load_small_gemm()
needs_pairs = pytest.mark.skipif(
    SMALL_GEMM is None,
    reason="no AVX512-BF16 without AMX here (or no C compiler): oneDNN runs every batch size",
)


@needs_pairs
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 64), (80, 1536), (64, 1100)])
@pytest.mark.parametrize("num_tokens", [1, 5, 12, 13, 40])
def test_the_pair_product_is_the_projection_within_bfloat16_rounding(
    out_features: int, in_features: int, num_tokens: int
) -> None:
    """Whatever oneDNN does: bias-free products and fused residual adds against float64."""
    assert SMALL_GEMM is not None
    gen = torch.Generator().manual_seed(num_tokens + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) / 8).bfloat16()
    x = torch.randn(num_tokens, 2 * in_features, generator=gen).bfloat16()[:, :in_features]
    residual = torch.randn(num_tokens, out_features, generator=gen).bfloat16()
    exact = x.double() @ weight.double().t()
    pairs = pair_layout(weight)
    tol = {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(SMALL_GEMM(x, pairs).double(), exact, **tol)
    torch.testing.assert_close(
        SMALL_GEMM(x, pairs, residual).double(), exact + residual.double(), **tol
    )


@needs_pairs
@pytest.mark.parametrize("in_features", [576, 1536])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 8, 13, 17, 64, 65, 100, 128, 129, 300])
def test_projections_with_pairs_equal_linear_and_addmm_at_every_batch_size(
    num_tokens: int, in_features: int
) -> None:
    """A weight keeps its pairs only after they matched oneDNN; then small batches take them
    (summing in the blocks found for their size) and large ones oneDNN, and both give linear's
    and addmm's bits."""
    torch.manual_seed(num_tokens)
    weight = (torch.randn(192, in_features) / 8).bfloat16()
    packed = pack(weight)
    assert packed is not None
    if packed.pairs is None:
        pytest.skip("this machine's oneDNN sums in another order: the pairs are not used")
    assert len(packed.pair_blocks) == packed_linear.PAIR_BATCH
    x = torch.randn(num_tokens, in_features + 24).bfloat16()[:, :in_features]
    residual = torch.randn(num_tokens, 192).bfloat16()
    assert torch.equal(project(x, weight, packed), linear(x, weight))
    assert torch.equal(
        project_add(x, weight, packed, residual), torch.addmm(residual, x, weight.t())
    )


@needs_pairs
def test_a_weight_takes_pairs_up_to_the_rows_it_was_checked_for() -> None:
    """Projections are checked (and then run) on pairs up to PAIR_BATCH rows, where prompts join
    decodes; a weight packed for fewer rows leaves larger steps to oneDNN."""
    torch.manual_seed(5)
    weight = (torch.randn(192, 576) / 8).bfloat16()
    full, short = pack(weight), pack(weight, max_rows=packed_linear.SMALL_BATCH)
    assert full is not None and short is not None
    if full.pairs is None or short.pairs is None:
        pytest.skip("this machine's oneDNN sums in another order: the pairs are not used")
    assert len(full.pair_blocks) == packed_linear.PAIR_BATCH
    assert len(short.pair_blocks) == packed_linear.SMALL_BATCH
    x = torch.randn(100, 576).bfloat16()
    mkldnn = torch.ops.mkldnn._linear_pointwise
    assert SMALL_GEMM is not None
    assert torch.equal(project(x, weight, short), mkldnn(x, short.onednn, None, "none", [], ""))
    assert torch.equal(
        project(x, weight, full), SMALL_GEMM(x, full.pairs, None, full.pair_blocks[99])
    )


def test_the_lm_head_is_packed_for_decode_batches_and_projections_for_more(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The LM head takes one row per sampled sequence: its pairs are checked up to SMALL_BATCH
    rows (its check is the slow one); every other projection up to PAIR_BATCH."""
    seen: list[tuple[tuple[int, ...], int]] = []
    real_pack = llama_module.pack

    def recording_pack(
        weight: torch.Tensor, max_rows: int = packed_linear.PAIR_BATCH
    ) -> packed_linear.Packed | None:
        seen.append((tuple(weight.shape), max_rows))
        return real_pack(weight, max_rows)

    monkeypatch.setattr(llama_module, "pack", recording_pack)
    model = load_model(str(tiny_llama_dir), dtype=torch.bfloat16).model
    if not BF16_PACKING:
        assert not seen
        return
    vocab_shape = tuple(model.output_weight.shape)
    assert seen[-1] == (vocab_shape, packed_linear.SMALL_BATCH)
    assert len(seen) == 4 * len(model.layers) + 1
    assert all(rows == packed_linear.PAIR_BATCH for _, rows in seen[:-1])


@needs_pairs
def test_gathered_pairs_share_one_buffer_and_give_the_same_products() -> None:
    """Every pair layout moves into one buffer (on huge pages where Linux gives them), weights
    without pairs are left as they are, and each product is unchanged bit for bit."""
    torch.manual_seed(3)
    weights = [(torch.randn(n, 576) / 8).bfloat16() for n in (192, 64, 96)]
    packs = [pack(w) for w in weights] + [None]
    if any(p is None or p.pairs is None for p in packs[:3]):
        pytest.skip("this machine's oneDNN sums in another order: the pairs are not used")
    plain = packs[1]
    assert plain is not None
    packs[1] = plain._replace(pairs=None)  # a weight that keeps oneDNN only
    gathered = gather_pairs(packs)
    assert gathered[1] is packs[1] and gathered[3] is None
    arena = [p.pairs for p in (gathered[0], gathered[2]) if p is not None and p.pairs is not None]
    assert len(arena) == 2
    assert arena[0].untyped_storage().data_ptr() == arena[1].untyped_storage().data_ptr()
    x = torch.randn(8, 576).bfloat16()
    for i in (0, 2):
        before, after = packs[i], gathered[i]
        assert before is not None and after is not None and before.pairs is not None
        assert after.pairs is not None and torch.equal(after.pairs, before.pairs)
        assert after.onednn is before.onednn and after.pair_blocks == before.pair_blocks
        assert torch.equal(project(x, weights[i], after), project(x, weights[i], before))


def test_nothing_to_gather_leaves_the_packs_as_they_are() -> None:
    packs = [None, None]
    assert gather_pairs(packs) is packs


def test_pairs_are_dropped_where_they_differ_from_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pair product that is off by one bfloat16 step anywhere is never used."""
    weight = torch.randn(64, 128).bfloat16()
    if not BF16_PACKING or SMALL_GEMM is None:
        packed = pack(weight)
        assert packed is None or packed.pairs is None
        return

    class OffByOne:
        def __call__(
            self,
            x: torch.Tensor,
            pairs: torch.Tensor,
            residual: torch.Tensor | None = None,
            block: int = 512,
        ) -> torch.Tensor:
            assert SMALL_GEMM is not None
            out = SMALL_GEMM(x, pairs, residual, block)
            out.view(torch.int16)[-1, -1] += 1
            return out

    monkeypatch.setattr(packed_linear, "_SHAPES_CHECKED", {})  # nothing known of this shape
    monkeypatch.setattr(packed_linear, "load_small_gemm", OffByOne)
    packed = pack(weight)
    assert packed is not None and packed.pairs is None
    assert packed_linear._SHAPES_CHECKED == {(64, 128, packed_linear.PAIR_BATCH): None}
    packed = pack(weight)  # a shape that failed is not tried again
    assert packed is not None and packed.pairs is None
    monkeypatch.undo()
    packed = pack(weight)
    assert packed is not None and packed.pairs is not None


@needs_pairs
def test_the_pair_product_sums_in_the_blocks_it_is_given() -> None:
    """On the check's probe rows (two huge products that cancel, small ones between them) the
    result depends on where the partial sums restart: 512-input blocks, 1024, or the whole
    1536 each give other bits, every one of them the product within bfloat16 rounding."""
    assert SMALL_GEMM is not None
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(32, 1536, generator=gen) / 8).bfloat16()
    x = packed_linear._order_probes(weight)
    pairs = pair_layout(weight)
    by_block = {b: SMALL_GEMM(x, pairs, None, b) for b in (512, 1024, 1536)}
    assert not torch.equal(by_block[512], by_block[1024])
    assert not torch.equal(by_block[1024], by_block[1536])
    assert torch.equal(by_block[1536], SMALL_GEMM(x, pairs, None, 4096))  # longer than K: whole
    small = x.clone()
    small[small.abs() > 2**20] = 0  # without the cancelling pair, a plain product
    exact = small.double() @ weight.double().t()
    for block in (512, 1024, 1536):
        torch.testing.assert_close(
            SMALL_GEMM(small, pairs, None, block).double(), exact, rtol=1e-2, atol=1e-2
        )


def test_weights_the_pair_product_cannot_take_keep_onednn_only() -> None:
    for weight in (
        torch.randn(40, 64).bfloat16(),
        torch.randn(64, 33).bfloat16(),
        torch.randn(64, 32),
    ):
        packed = pack(weight)
        assert packed is None or packed.pairs is None


@pytest.mark.parametrize("in_features", [576, 1536])
def test_order_probes_tell_summation_blocks_apart(in_features: int) -> None:
    """The check's probe rows give different first columns when the sum over the inputs is cut
    into blocks at another place: any other order than oneDNN's shows."""
    weight = (
        torch.randn(32, in_features, generator=torch.Generator().manual_seed(1)) / 8
    ).bfloat16()
    x = packed_linear._order_probes(weight).float()
    assert x.shape[0] >= 4
    w = weight[0].float()

    def blocked(block: int) -> torch.Tensor:
        total = torch.zeros(x.shape[0])
        for start in range(0, in_features, block):
            partial = torch.zeros(x.shape[0])
            for k in range(start, min(in_features, start + block)):
                partial = partial + x[:, k] * w[k]
            total = total + partial
        return total.bfloat16()

    one_pass, by_512, by_256 = blocked(in_features), blocked(512), blocked(256)
    assert not torch.equal(one_pass, by_512)
    assert not torch.equal(by_512, by_256)


def gguf_rounded(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``weight`` through llama.cpp's quantizer and back: what a GGUF file's loader yields."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = getattr(GGMLQuantizationType, kind)
    array = weight.numpy()
    return torch.from_numpy(dequantize(quantize(array, qtype), qtype).reshape(array.shape))


def decoded(codes: Codes) -> torch.Tensor:
    """The weight [out, in] the codes stand for, decoded in torch."""
    blocks, in_features, _ = codes.codes.shape
    scale = codes.scale.repeat_interleave(CODE_BLOCK, dim=1)
    offset = codes.offset.repeat_interleave(CODE_BLOCK, dim=1)
    weight = codes.codes.float() * scale + offset  # [out / 16, in, 16]
    return weight.permute(0, 2, 1).reshape(blocks * 16, in_features)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_weights_decoded_from_gguf_blocks_are_kept_as_exact_codes(kind: str) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = gguf_rounded(torch.randn(48, 96, generator=gen) / 4, kind)
    weight[3, 32:64] = 0.25  # a constant run: scale 0
    codes = block_codes(weight)
    assert codes is not None
    assert codes.codes.dtype == torch.int8 and codes.codes.shape == (3, 96, 16)
    assert torch.equal(decoded(codes), weight)
    low, high = (0, 15) if kind == "Q4_1" else (-127, 127)
    assert low <= int(codes.codes.min()) and int(codes.codes.max()) <= high


def test_weights_that_are_not_block_codes_keep_none() -> None:
    gen = torch.Generator().manual_seed(6)
    rounded = gguf_rounded(torch.randn(32, 64, generator=gen), "Q4_1")
    off = rounded.clone()
    off[7, 40] = torch.nextafter(off[7, 40], torch.tensor(9.0))  # one weight one ulp away
    for weight in (
        torch.randn(32, 64, generator=gen),  # plain float32 weights
        off,
        rounded.bfloat16(),  # only float32 products run on codes
        rounded[:24],  # rows not a multiple of 16
        gguf_rounded(torch.randn(32, 96, generator=gen), "Q4_1")[:, :80],  # runs cut short
    ):
        assert block_codes(weight) is None
    assert block_codes(rounded) is not None


CODES_GEMM = build_codes_gemm()
needs_codes = pytest.mark.skipif(CODES_GEMM is None, reason="no C compiler: oneDNN runs all")
# Whether float32 projections keep codes here at all (only where the product beats oneDNN).
uses_codes = pytest.mark.skipif(
    load_codes_gemm() is None,
    reason="no C compiler, or neither AVX-512 nor AVX2 (the codes product was never measured "
    "against oneDNN there; the product itself is tested here all the same)",
)


def test_weights_keep_codes_only_where_the_codes_product_beats_onednn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight = gguf_rounded(torch.randn(96, 64, generator=torch.Generator().manual_seed(5)), "Q8_0")
    try:
        for capability, expected in (
            ("AVX2", True),
            ("DEFAULT", False),
            ("NEON", False),
            ("AVX512", True),
        ):
            monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
            load_codes_gemm.cache_clear()
            assert packed_linear.codes_beat_onednn() is expected
            assert (load_codes_gemm() is not None) is (expected and CODES_GEMM is not None)
            packed = pack(weight)
            if packed is not None:
                assert (packed.codes is not None) is (load_codes_gemm() is not None)
    finally:
        monkeypatch.undo()
        load_codes_gemm.cache_clear()


@needs_codes
def test_the_codes_product_decodes_each_weight_exactly() -> None:
    """Rows of the identity pick single columns of the weight: 1 * w + 0 * ... is w exactly."""
    assert CODES_GEMM is not None
    weight = gguf_rounded(torch.randn(64, 96, generator=torch.Generator().manual_seed(7)), "Q4_1")
    codes = block_codes(weight)
    assert codes is not None
    for start in range(0, 96, 32):
        x = torch.eye(96)[start : start + 32]
        assert torch.equal(CODES_GEMM(x, codes), weight.t()[start : start + 32])


@needs_codes
@needs_avx2_build_apart
def test_the_codes_product_built_for_avx2_decodes_and_sums_the_same(tmp_path: Path) -> None:
    """Built for AVX2 CPUs (no AVX-512: two 8-lane halves per 16 columns), the product still
    decodes every weight exactly and gives the float32 projection."""
    avx2 = try_load(SMALL_GEMM_SOURCE, CodesGemm, tmp_path, AVX2_BUILD_FLAGS)
    assert avx2 is not None
    gen = torch.Generator().manual_seed(8)
    weight = gguf_rounded(torch.randn(48, 64, generator=gen), "Q4_1")
    codes = block_codes(weight)
    assert codes is not None
    assert torch.equal(avx2(torch.eye(64)[:13], codes), weight.t()[:13])
    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(
        avx2(x, codes).double(), x.double() @ weight.double().t(), rtol=1e-5, atol=1e-5
    )
    # Past 64 rows the panel path: the same bits for the same rows.
    many = torch.cat([x, torch.randn(70, 64, generator=gen)])
    residual = torch.randn(75, 48, generator=gen)
    assert torch.equal(avx2(many, codes)[:5], avx2(x, codes))
    assert torch.equal(avx2(many, codes, residual)[:5], avx2(x, codes, residual[:5]))


@uses_codes
@pytest.mark.parametrize("num_tokens", [1, 4, 6, 7, 8, 13, 32, 64, 65, 100, 257])
def test_the_codes_product_sums_each_output_in_input_order(num_tokens: int) -> None:
    """Where weights keep codes (AVX-512's tile or AVX2's), every output is the float32 sum of
    its products in input order, one rounding per multiply-add: the same bits whichever tile
    ran (with AVX2, past 64 rows, the panel path), and whichever group of rows a row fell in."""
    assert CODES_GEMM is not None
    gen = torch.Generator().manual_seed(40 + num_tokens)
    weight = gguf_rounded(torch.randn(48, 96, generator=gen) / 4, "Q4_1")
    codes = block_codes(weight)
    assert codes is not None
    x = torch.randn(num_tokens, 96, generator=gen)
    residual = torch.randn(num_tokens, 48, generator=gen)
    # A float32 product is exact in float64, and the sum then rounds once to float32, as a
    # fused multiply-add does (a double rounding could differ once in ~2^29 sums).
    acc = torch.zeros(num_tokens, 48)
    for k in range(96):
        acc = (acc.double() + x[:, k, None].double() * weight[:, k].double()).float()
    assert torch.equal(CODES_GEMM(x, codes), acc)
    assert torch.equal(CODES_GEMM(x, codes, residual), acc + residual)


@needs_codes
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 32), (80, 576), (48, 1536)])
@pytest.mark.parametrize("num_tokens", [1, 5, 12, 13, 40, 64])
def test_the_codes_product_is_the_float32_projection(
    out_features: int, in_features: int, num_tokens: int
) -> None:
    assert CODES_GEMM is not None
    gen = torch.Generator().manual_seed(num_tokens + in_features)
    weight = gguf_rounded(torch.randn(out_features, in_features, generator=gen) / 8, "Q4_1")
    codes = block_codes(weight)
    assert codes is not None
    x = torch.randn(num_tokens, in_features + 8, generator=gen)[:, :in_features]  # strided rows
    residual = torch.randn(num_tokens, out_features, generator=gen)
    exact = x.double() @ weight.double().t()
    tight = {"rtol": 1e-5, "atol": 1e-5}  # float32 sums in another order, nothing more
    torch.testing.assert_close(CODES_GEMM(x, codes).double(), exact, **tight)
    torch.testing.assert_close(
        CODES_GEMM(x, codes, residual).double(), exact + residual.double(), **tight
    )


@uses_codes
@needs_f32_packing
@pytest.mark.parametrize("num_tokens", [1, 7, 32, 33, 64, 65, 256, 257, 300])
def test_small_float32_steps_run_on_codes_and_large_ones_on_onednn(num_tokens: int) -> None:
    """Up to ``codes_max_rows()`` (64, or 256 with AVX2 alone) a step runs on the codes."""
    gen = torch.Generator().manual_seed(num_tokens)
    weight = gguf_rounded(torch.randn(96, 64, generator=gen), "Q8_0")
    packed = pack(weight)
    assert packed is not None and packed.codes is not None
    x = torch.randn(num_tokens, 80, generator=gen)[:, :64]
    residual = torch.randn(num_tokens, 96, generator=gen)
    assert CODES_GEMM is not None
    mkldnn = torch.ops.mkldnn._linear_pointwise
    if num_tokens <= packed_linear.codes_max_rows():
        expected = CODES_GEMM(x, packed.codes)
        expected_add = CODES_GEMM(x, packed.codes, residual)
    else:
        expected = mkldnn(x, packed.onednn, None, "none", [], "")
        expected_add = mkldnn.binary(x, residual, packed.onednn, None, "add")
    assert torch.equal(project(x, weight, packed), expected)
    assert torch.equal(project_add(x, weight, packed, residual), expected_add)
    tight = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(project(x, weight, packed), linear(x, weight), **tight)


@uses_codes
@needs_f32_packing
def test_the_default_model_keeps_its_projections_as_codes_in_float32(
    default_model_fp32: LoadedModel,
) -> None:
    """SmolLM2's GGUF is Q4_1 (and Q8_0 for the embedding): every projection and the tied LM
    head decode exactly, so all take the codes at decode batch sizes."""
    model = default_model_fp32.model
    assert model.output_packed is not None and model.output_packed.codes is not None
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        for packed in (
            layer.self_attn.qkv_packed,
            layer.self_attn.o_packed,
            layer.mlp.gate_up_packed,
            layer.mlp.down_packed,
        ):
            assert packed is not None and packed.codes is not None
