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

On CPUs with AVX512-BF16 but no AMX, oneDNN's bf16 kernels reach about half the machine's
pair-dot-product rate at decode batch sizes. There a bf16 weight also gets a copy laid out as
pairs for ``engine/native/small_gemm.c``, which runs steps of up to ``PAIR_BATCH`` rows --
but only where, checked on this machine at load time, it gives oneDNN's results bit for bit
(it sums in oneDNN's order -- in blocks of K whose size oneDNN picks by shape and batch size,
found per batch size at load time; a weight whose results differ keeps oneDNN for every batch).

A float32 weight that is, in every run of 32 inputs of a row, ``code * scale + offset`` exactly
for small integer codes -- as the weights decoded from a GGUF file in Q4_1 or Q8_0 are -- also
keeps those codes (``block_codes``): steps of up to ``SMALL_BATCH`` rows then run in
``small_gemm.c``, which decodes the weights as it goes and multiplies in float32. Decode steps
are bound by reading the weights, and the codes take under a third of the float32 bytes; the
products are those of the same float32 weights (summed in another order than oneDNN's).
Weights decoded from K-quants (Q4_K, Q5_K, Q6_K) rarely have that form -- their sub-block
scales are float32 products, and a Q6_K run spans two scales -- and then keep oneDNN alone; the
check is exact, so a run is never given codes that do not give it back bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import structlog
import torch
from torch.nn.functional import linear

from engine.device import cpu_has_bf16_dot, zeros_on_huge_pages
from engine.native.build import FOLDER, cpu_has_avx512, try_load

log = structlog.get_logger(__name__)

# The batch size oneDNN chooses its blocking for; any step size runs on the result (measured
# here: a hint of 16 is within a few percent of the best hint from batch 1 to 512).
BATCH_HINT = 16
SMALL_BATCH = 64  # rows up to which the codes product runs, where it applies
# With AVX2 alone: rows up to which the codes product runs (its panel path past 64 rows), where
# it beat oneDNN's float32 GEMM on SmolLM2's projections (an AMD EPYC of family 25: 1.1-1.6x at
# 65-128 rows, level at 448, 0.85-0.93x at 2,048).
CODES_PANEL_ROWS = 256
# Rows up to which a projection's pair product runs, where it applies: past decode batches to
# the steps where a few prompts join them (measured here, 30 layers' projections at 85 rows:
# 22.8 ms against oneDNN's 27.2; at 128, 31.8 against 37.0). The LM head, which takes one row
# per sampled sequence, is checked up to SMALL_BATCH only (its check is the slow one).
PAIR_BATCH = 128
SMALL_GEMM_SOURCE = FOLDER / "small_gemm.c"
# Batch sizes at which the pair product must equal oneDNN before a weight may use it. oneDNN
# picks its kernel (and so its order of sums) by shape and batch size, not by values: the first
# weight of each shape is checked at every batch size it may take, the others of that
# shape at these few, and a shape that failed once is not tried again.
CHECK_ROWS = (1, 5, 13, 64, 100)
# Blocks of inputs oneDNN has been seen to sum from zero before adding them to the total; the
# whole of K is tried too. A shape's block at each batch size is found on its first weight.
K_BLOCKS = (512, 1024)
# Per shape and largest batch: the block for each batch size from 1, or None where none matched.
_SHAPES_CHECKED: dict[tuple[int, int, int], tuple[int, ...] | None] = {}


CODE_BLOCK = 32  # inputs that share a scale and an offset in ``block_codes``


class Codes(NamedTuple):
    """A float32 weight [out, in] as int8 codes with a scale and an offset per 32 inputs:
    ``weight[16 b + c][i] == codes[b, i, c] * scale[b, i // 32, c] + offset[b, i // 32, c]``."""

    codes: torch.Tensor  # [out / 16, in, 16] int8
    scale: torch.Tensor  # [out / 16, in / 32, 16] float32
    offset: torch.Tensor  # [out / 16, in / 32, 16] float32


class Packed(NamedTuple):
    """A projection weight laid out for the CPU."""

    onednn: torch.Tensor  # oneDNN's blocked layout
    pairs: torch.Tensor | None = None  # [out / 16, in / 2, 16, 2] for the pair product, or None
    codes: Codes | None = None  # float32 weights that are block codes exactly, or None
    # With pairs: the block of inputs summed at a time at each batch size from 1 (and so the
    # largest batch the pair product takes).
    pair_blocks: tuple[int, ...] = ()


def _small_call(
    fn: Callable[..., int],
    x: torch.Tensor,  # [n, in], rows contiguous
    weight: tuple[int, ...],  # the weight's arrays (data pointers), in the C function's order
    out_features: int,
    residual: torch.Tensor | None,  # [n, out], rows contiguous
    *extra: int,  # arguments after K, before the threads
) -> torch.Tensor:  # [n, out] in x's dtype
    """Run one of ``small_gemm.c``'s products: (x, x's row stride, *weight, residual and its row
    stride, out, M, N, K, *extra, threads) -> status."""
    n, k = x.shape
    out = torch.empty((n, out_features), dtype=x.dtype)
    status = fn(
        x.data_ptr(),
        x.stride(0),
        *weight,
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0),
        out.data_ptr(),
        n,
        out_features,
        k,
        *extra,
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"small gemm failed ({status}) for {n} x {k} -> {out_features}")
    return out


def _bind(library: Path, name: str, weight_arrays: int, extra: int = 0) -> Callable[..., int]:
    """``small_gemm.c``'s function ``name``, typed for ``_small_call`` with ``weight_arrays``
    pointers for the weight and ``extra`` 64-bit integers after K."""
    fn: ctypes._NamedFuncPointer = getattr(ctypes.CDLL(str(library)), name)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, *[p] * weight_arrays, p, i64, p, i64, i64, i64, *[i64] * extra]
    fn.argtypes += [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class SmallGemm:
    """ctypes binding of ``small_gemm.c``'s bfloat16 pair product."""

    def __init__(self, library: Path) -> None:
        self._fn = _bind(library, "atrium_small_gemm_bf16", 1, extra=1)
        self.library = library

    def __call__(
        self,
        x: torch.Tensor,  # [n, in] bf16, rows contiguous
        pairs: torch.Tensor,  # from ``pair_layout``
        residual: torch.Tensor | None = None,  # [n, out] bf16, rows contiguous
        block: int = K_BLOCKS[0],  # inputs summed from zero before they join the total (even)
    ) -> torch.Tensor:  # [n, out]
        out_features = pairs.shape[0] * 16
        return _small_call(self._fn, x, (pairs.data_ptr(),), out_features, residual, block)


class CodesGemm:
    """ctypes binding of ``small_gemm.c``'s float32 product over ``Codes``."""

    def __init__(self, library: Path) -> None:
        self._fn = _bind(library, "atrium_small_gemm_codes_f32", 3)

    def __call__(
        self,
        x: torch.Tensor,  # [n, in] float32, rows contiguous
        codes: Codes,
        residual: torch.Tensor | None = None,  # [n, out] float32, rows contiguous
    ) -> torch.Tensor:  # [n, out]
        arrays = (codes.codes.data_ptr(), codes.scale.data_ptr(), codes.offset.data_ptr())
        return _small_call(self._fn, x, arrays, codes.codes.shape[0] * 16, residual)


@functools.cache
def build_codes_gemm() -> CodesGemm | None:
    """The float32 product over block codes, wherever the C compiler builds it."""
    return try_load(SMALL_GEMM_SOURCE, CodesGemm)


def codes_beat_onednn() -> bool:
    """Whether this CPU runs the codes product faster than oneDNN's float32 one: with AVX-512
    (16 columns a register; measured 2x faster at 8 rows on Ice Lake), and with AVX2 on x86,
    where ``small_gemm.c`` has paths of its own (tiles of up to six rows by sixteen columns in
    8-lane registers; measured on an AMD EPYC of family 25, 30 layers' projections at 8 rows
    ~25-34 ms against oneDNN's ~55-64, at 32 rows ~76-81 against ~97-117, at 64 level).
    Elsewhere (ARM) it was never measured, and oneDNN runs."""
    return cpu_has_avx512() or torch.backends.cpu.get_cpu_capability() == "AVX2"


@functools.cache
def codes_max_rows() -> int:
    """Rows up to which a weight with codes runs on them: ``CODES_PANEL_ROWS`` with AVX2 alone
    (``small_gemm.c``'s panel path), ``SMALL_BATCH`` elsewhere."""
    avx2_alone = not cpu_has_avx512() and torch.backends.cpu.get_cpu_capability() == "AVX2"
    return CODES_PANEL_ROWS if avx2_alone else SMALL_BATCH


@functools.cache
def load_codes_gemm() -> CodesGemm | None:
    """The float32 product over block codes where it beats oneDNN (``codes_beat_onednn``) and
    the C compiler builds it; None elsewhere (weights then keep no codes)."""
    return build_codes_gemm() if codes_beat_onednn() else None


def block_codes(weight: torch.Tensor) -> Codes | None:
    """``weight`` as ``Codes`` if every run of 32 inputs of a row is exactly ``code * scale +
    offset``, else None. Two forms are tried per run, those of llama.cpp's Q4_1 (offset the
    run's minimum, scale its range / 15 in half precision, codes 0..15) and Q8_0 (no offset,
    scale the largest magnitude / 127, codes -127..127); the scale times a code is exact in
    float32, so the decoded weight is bit for bit the one given."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    out_features, in_features = weight.shape
    if out_features % 16 or in_features % CODE_BLOCK or weight.numel() == 0:
        return None
    runs = weight.detach().reshape(out_features, in_features // CODE_BLOCK, CODE_BLOCK)
    low = runs.amin(-1, keepdim=True)
    scale_a = ((runs.amax(-1, keepdim=True) - low) / 15).half().float()
    codes_a = _codes(runs - low, scale_a, 0, 15)
    exact_a = (codes_a * scale_a + low == runs).all(-1, keepdim=True)
    scale_b = runs.abs().amax(-1, keepdim=True) / 127
    codes_b = _codes(runs, scale_b, -127, 127)
    exact_b = (codes_b * scale_b == runs).all(-1, keepdim=True)
    if not bool((exact_a | exact_b).all()):
        return None
    codes = torch.where(exact_a, codes_a, codes_b).to(torch.int8)
    scale = torch.where(exact_a, scale_a, scale_b)
    offset = torch.where(exact_a, low, torch.zeros_like(low))

    def tiles(t: torch.Tensor, width: int) -> torch.Tensor:  # [out, width] -> [out/16, width, 16]
        return t.reshape(out_features // 16, 16, width).permute(0, 2, 1).contiguous()

    runs_per_row = in_features // CODE_BLOCK
    return Codes(
        tiles(codes.reshape(out_features, in_features), in_features),
        tiles(scale.reshape(out_features, runs_per_row), runs_per_row),
        tiles(offset.reshape(out_features, runs_per_row), runs_per_row),
    )


def _codes(values: torch.Tensor, scale: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """round(values / scale) within [low, high]; 0 where the scale is 0."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.where(scale > 0, torch.round(values / safe), 0.0).clamp_(low, high)


@functools.cache
def load_small_gemm() -> SmallGemm | None:
    """The pair product where it is worth having: bf16 pair dot products and no AMX (with AMX,
    oneDNN's tile kernels are faster); None elsewhere or where it cannot be built."""
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    if amx or not cpu_has_bf16_dot():
        return None
    return try_load(SMALL_GEMM_SOURCE, SmallGemm)


def pair_layout(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (out a multiple of 16, in even) as [out / 16, in / 2, 16, 2]."""
    out_features, in_features = weight.shape
    blocks = weight.detach().reshape(out_features // 16, 16, in_features // 2, 2)
    return blocks.permute(0, 2, 1, 3).contiguous()


def _checked_pairs(
    weight: torch.Tensor, onednn: torch.Tensor, max_rows: int
) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """The pair layout of ``weight`` and the block of inputs to sum at a time at each batch size
    1 .. max_rows, if with those blocks the pair product equals oneDNN's on this machine (with
    and without a residual, at every batch size for a shape's first weight, at CHECK_ROWS for
    the others), else None."""
    gemm = load_small_gemm()
    out_features, in_features = weight.shape
    if gemm is None or weight.dtype != torch.bfloat16 or out_features % 16 or in_features % 2:
        return None
    shape = (out_features, in_features, max_rows)
    known = _SHAPES_CHECKED.get(shape, ())
    if known is None:  # a shape that failed once is not tried again
        return None
    batch_sizes = [r for r in CHECK_ROWS if r <= max_rows] if known else range(1, max_rows + 1)
    # A block as long as K or longer sums K in one piece.
    candidates = list(dict.fromkeys(min(b, in_features) for b in (*K_BLOCKS, in_features)))
    pairs = pair_layout(weight)
    gen = torch.Generator().manual_seed(out_features * 7919 + in_features)
    probes = _order_probes(weight)
    blocks: list[int] = []
    for rows in batch_sizes:
        # Magnitudes spread over many binades, so that any other summation order shows; the
        # first rows probe where the sums' blocks begin and end.
        scale = torch.exp2(torch.randint(-12, 12, (rows, in_features), generator=gen).float())
        x = (torch.randn(rows, in_features, generator=gen) * scale).to(torch.bfloat16)
        n = min(rows, probes.shape[0])
        x[:n] = probes[:n]
        residual = torch.randn(rows, out_features, generator=gen).to(torch.bfloat16)
        mkldnn = torch.ops.mkldnn._linear_pointwise
        plain = mkldnn(x, onednn, None, "none", [], "")
        added = mkldnn.binary(x, residual, onednn, None, "add")
        # The shape's known block, else the last batch size's first (oneDNN changes rarely).
        tries = [known[rows - 1]] if known else list(dict.fromkeys([*blocks[-1:], *candidates]))
        block = next(
            (
                b
                for b in tries
                if torch.equal(gemm(x, pairs, None, b), plain)
                and torch.equal(gemm(x, pairs, residual, b), added)
            ),
            None,
        )
        if block is None:
            log.debug("small_gemm_differs", shape=shape, rows=rows)
            _SHAPES_CHECKED[shape] = None
            return None
        blocks.append(block)
    if not known:
        known = _SHAPES_CHECKED[shape] = tuple(blocks)
    return pairs, known


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


def _order_probes(weight: torch.Tensor) -> torch.Tensor:
    """Inputs whose first output column depends on where partial sums start: each row has small
    values and two huge ones of opposite sign at inputs i < j with equal weights in that
    column, so the huge products cancel exactly, and the small products summed into the same
    running sum between them are lost (fixed-order floats). Positions j run across the
    input, at the ends of likely blocks."""
    in_features = weight.shape[1]
    column = weight[0].view(torch.int16).tolist()
    first: dict[int, int] = {}
    for index, bits in enumerate(column):
        first.setdefault(bits, index)
    ends = {in_features - 1, in_features // 3, in_features // 2, 2 * in_features // 3}
    ends |= {b + d for b in range(256, in_features, 256) for d in (-1, 0)}
    rows = []
    gen = torch.Generator().manual_seed(in_features)
    for end in sorted(e for e in ends if 0 < e < in_features):
        for j in range(end, max(end - 64, 0), -1):
            i = first[column[j]]
            if i < j - 1 and column[j] & 0x7FFF:  # a nonzero weight seen well before
                x = torch.rand(in_features, generator=gen) + 0.5
                x[i], x[j] = 2.0**30, -(2.0**30)
                rows.append(x)
                break
    if not rows:
        return torch.empty(0, in_features, dtype=torch.bfloat16)
    return torch.stack(rows).to(torch.bfloat16)


def pack(weight: torch.Tensor, max_rows: int = PAIR_BATCH) -> Packed | None:
    """``weight`` [out, in] laid out for oneDNN (and the pair product, for steps of up to
    ``max_rows`` rows, where it applies), or None where packing does not apply."""
    if not packing_supported(weight):
        return None
    onednn: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
    codes = block_codes(weight) if load_codes_gemm() is not None else None
    pairs, blocks = _checked_pairs(weight, onednn, max_rows) or (None, ())
    return Packed(onednn, pairs, codes, blocks)


def gather_pairs(packs: list[Packed | None]) -> list[Packed | None]:
    """``packs`` with every pair-layout weight moved into one buffer on huge pages
    (``engine.device.zeros_on_huge_pages``), the rest as they are. A decode step streams every
    weight once, each fetched a tile ahead of use: on 4 KiB pages those fetches miss the TLB
    every 4 KiB, and one weight alone is too small to be given 2 MiB pages (measured here,
    30 layers' projections and the LM head: 5-13% faster at 8 and 32 rows, the same at 1)."""
    sizes = [p.pairs.numel() if p is not None and p.pairs is not None else 0 for p in packs]
    if not any(sizes):
        return packs
    dtype = next(p.pairs.dtype for p in packs if p is not None and p.pairs is not None)
    arena = zeros_on_huge_pages((sum(sizes),), dtype)
    out: list[Packed | None] = []
    offset = 0
    for packed, size in zip(packs, sizes, strict=True):
        if packed is None or packed.pairs is None:
            out.append(packed)
            continue
        view = arena[offset : offset + size].view(packed.pairs.shape)
        view.copy_(packed.pairs)
        out.append(packed._replace(pairs=view))
        offset += size
    return out


def _small_product(
    x: torch.Tensor, packed: Packed, residual: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The small-batch product (pairs or codes) where the weight has one and the step is small
    enough; None where oneDNN should run."""
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        return None
    if packed.pairs is not None and x.shape[0] <= len(packed.pair_blocks):
        gemm = load_small_gemm()
        assert gemm is not None  # pairs are laid out only where it loaded
        return gemm(x, packed.pairs, residual, packed.pair_blocks[max(x.shape[0], 1) - 1])
    if packed.codes is not None and x.shape[0] <= codes_max_rows():
        codes_gemm = load_codes_gemm()
        assert codes_gemm is not None  # codes are kept only where it loaded
        return codes_gemm(x, packed.codes, residual)
    return None


def project(
    x: torch.Tensor,  # [n, in]
    weight: torch.Tensor,  # [out, in]
    packed: Packed | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [n, out]
    """``x @ weight.T + bias``."""
    if packed is None:
        return linear(x, weight, bias)
    if bias is None and (small := _small_product(x, packed)) is not None:
        return small
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed.onednn, bias, "none", [], "")
    return out


def project_add(
    x: torch.Tensor,  # [n, in]
    weight: torch.Tensor,  # [out, in]
    packed: Packed | None,
    residual: torch.Tensor,  # [n, out]
) -> torch.Tensor:  # [n, out]
    """``residual + x @ weight.T`` as one GEMM (the add is the GEMM's accumulate)."""
    if packed is None:
        return torch.addmm(residual, x, weight.t())
    if (small := _small_product(x, packed, residual)) is not None:
        return small
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
        x, residual, packed.onednn, None, "add"
    )
    return out
