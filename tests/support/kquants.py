"""llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K) for tests: random valid blocks, and a decoder
written from the block layout of ``ggml-common.h`` and the reference ``dequantize_row_q*_K``
loops, independent of the ``gguf`` package's own decoding.

Every block covers 256 weights of one row. Q4_K and Q5_K: an f16 super-block scale ``d`` and
minimum ``dmin``, then eight 6-bit (scale, min) pairs packed into 12 bytes, one pair per
sub-block of 32 weights, each weight ``d * scale * q - dmin * min`` (q of 4 bits, or 5 with the
high bits in ``qh``). Q6_K: sixteen int8 scales, one per sub-block of 16, and a trailing f16
``d``; each weight ``d * scale * (q - 32)`` for q of 6 bits (low nibbles in ``ql``, high pairs
in ``qh``).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

Q = GGMLQuantizationType
QK_K = 256  # weights per block
BLOCK_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}
# Super-block scales drawn in [base / 2, base]: every weight then stays under about 0.3 in size.
_D_BASE = {Q.Q4_K: 2e-4, Q.Q5_K: 1e-4, Q.Q6_K: 7e-5}
_DMIN_BASE = 1.5e-3


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid ``qtype`` blocks for a [rows, cols] weight as uint8 [rows, cols / 256 * bytes]:
    random code, scale and high-bit bytes, small positive f16 super-block scales."""
    if cols % QK_K:
        raise ValueError(f"K-quant rows hold a multiple of {QK_K} weights, not {cols}")
    rng = np.random.default_rng(seed)
    n = rows * cols // QK_K
    blocks = rng.integers(0, 256, size=(n, BLOCK_BYTES[qtype]), dtype=np.uint8)

    def halves(base: float) -> np.ndarray:  # [n, 2] uint8: one f16 per block
        values = rng.uniform(base / 2, base, size=n).astype(np.float16)
        return values.view(np.uint8).reshape(n, 2)

    if qtype == Q.Q6_K:
        blocks[:, 208:210] = halves(_D_BASE[qtype])
    else:
        blocks[:, 0:2] = halves(_D_BASE[qtype])
        blocks[:, 2:4] = halves(_DMIN_BASE)
    return blocks.reshape(rows, -1)


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 little-endian halves -> [n] float32."""
    return np.ascontiguousarray(two_bytes).view("<f2").reshape(-1).astype(np.float32)


def _scale_min(packed: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Sub-block ``j``'s 6-bit scale and min from the 12 packed bytes (``get_scale_min_k4``):
    the first four pairs sit in the low 6 bits of bytes 0-3 and 4-7; the last four take their
    low 4 bits from bytes 8-11 and their top 2 bits from the top of bytes 0-7."""
    q = packed.astype(np.int32)
    if j < 4:
        return q[:, j] & 63, q[:, j + 4] & 63
    scale = (q[:, j + 4] & 0xF) | ((q[:, j - 4] >> 6) << 4)
    low = (q[:, j + 4] >> 4) | ((q[:, j] >> 6) << 4)
    return scale, low


def _decode_q4_q5(blocks: np.ndarray, five_bits: bool) -> np.ndarray:
    d, dmin, packed = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4]), blocks[:, 4:16]
    qh = blocks[:, 16:48] if five_bits else None
    qs = blocks[:, 48:176] if five_bits else blocks[:, 16:144]
    out = np.empty((blocks.shape[0], QK_K), dtype=np.float32)
    for group in range(4):  # 64 weights: the low nibbles of 32 bytes, then their high nibbles
        nibbles = qs[:, 32 * group : 32 * group + 32].astype(np.int32)
        for half in range(2):
            j = 2 * group + half
            q = (nibbles >> (4 * half)) & 0xF
            if qh is not None:  # bit j of each of the 32 high-bit bytes
                q = q | (((qh.astype(np.int32) >> j) & 1) << 4)
            scale, low = _scale_min(packed, j)
            d1 = (d * scale.astype(np.float32))[:, None]
            m1 = (dmin * low.astype(np.float32))[:, None]
            out[:, 32 * j : 32 * j + 32] = d1 * q.astype(np.float32) - m1
    return out


def _decode_q6(blocks: np.ndarray) -> np.ndarray:
    ql, qh = blocks[:, 0:128].astype(np.int32), blocks[:, 128:192].astype(np.int32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[:, 208:210])
    out = np.empty((blocks.shape[0], QK_K), dtype=np.float32)
    for part in range(2):  # 128 weights from 64 ql bytes, 32 qh bytes and 8 scales
        low, high = ql[:, 64 * part : 64 * part + 64], qh[:, 32 * part : 32 * part + 32]
        for quarter in range(4):  # 32 weights each; quarter k takes qh bits 2k and 2k + 1
            nibble_bytes = low[:, 32 * (quarter % 2) : 32 * (quarter % 2) + 32]
            q = ((nibble_bytes >> (4 * (quarter // 2))) & 0xF) | (((high >> 2 * quarter) & 3) << 4)
            for sixteen in range(2):
                sub = 8 * part + 2 * quarter + sixteen  # the scale of these 16 weights
                start = 128 * part + 32 * quarter + 16 * sixteen
                scaled = (d * scales[:, sub])[:, None]
                codes = q[:, 16 * sixteen : 16 * sixteen + 16] - 32
                out[:, start : start + 16] = scaled * codes.astype(np.float32)
    return out


def decode(qtype: GGMLQuantizationType, raw: np.ndarray, cols: int) -> np.ndarray:
    """[rows, row bytes] uint8 ``qtype`` blocks -> float32 [rows, cols]."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, BLOCK_BYTES[qtype])
    if qtype == Q.Q6_K:
        values = _decode_q6(blocks)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        values = _decode_q4_q5(blocks, five_bits=qtype == Q.Q5_K)
    else:
        raise ValueError(f"{qtype.name} is not a K-quant this decoder knows")
    return values.reshape(-1, cols)
