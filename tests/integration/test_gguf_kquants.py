"""GGUF files whose matrices are K-quant blocks (Q4_K, Q5_K, Q6_K, and a llama.cpp-style mix):
the weights as llama.cpp's block layout decodes them, greedy output token-identical (float32) to
transformers loading the same file with its own GGUF loader, and the packed projections right
on K-quant weights. Types we do not load are refused, by type and tensor."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from torch.nn.functional import linear
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine.model.loader import load_model
from engine.model.packed_linear import (
    CODE_BLOCK,
    Codes,
    load_codes_gemm,
    pack,
    packing_supported,
    project,
    project_add,
)
from tests.support import kquants
from tests.support.gguf_arch import RawMatrix, arch_dir_to_gguf
from tests.support.greedy import engine_greedy, hf_greedy
from tests.support.tiny_models import make_tiny_model

Q = GGMLQuantizationType
# K-quant blocks hold 256 weights of a row: every matrix's rows are 256 or 512 long.
SHAPE = {"hidden_size": 256, "intermediate_size": 512}
HEADS, KV_HEADS = 4, 2
NUM_NEW = 8
PROMPTS = [[(i * 37 + j * 11) % 256 for j in range(6 + 13 * i)] for i in range(3)]


def _mixed(name: str) -> GGMLQuantizationType:
    """As llama.cpp's Q4_K_M: Q6_K for the embeddings, the output and V, Q5_K for the MLP's
    down projection, Q4_K for the rest."""
    if name.startswith(("token_embd", "output")) or ".attn_v." in name:
        return Q.Q6_K
    return Q.Q5_K if ".ffn_down." in name else Q.Q4_K


CASES: dict[str, Callable[[str], GGMLQuantizationType]] = {
    "Q4_K": lambda _: Q.Q4_K,
    "Q5_K": lambda _: Q.Q5_K,
    "Q6_K": lambda _: Q.Q6_K,
    "mixed": _mixed,
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("kquant_hf"), **SHAPE)


@pytest.fixture(scope="module")
def kquant_files(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One GGUF file per case, its matrices random valid blocks of the case's types."""
    files = {}
    for case, type_of in CASES.items():
        out = tmp_path_factory.mktemp(f"kquant_{case}") / "model.gguf"
        files[case] = arch_dir_to_gguf(hf_dir, out, raw_matrix=_random_store(type_of))
    return files


def _random_store(type_of: Callable[[str], GGMLQuantizationType]) -> RawMatrix:
    """Store each matrix as random blocks of the type ``type_of`` gives its GGUF name."""

    def blocks(name: str, weight: np.ndarray) -> tuple[np.ndarray, GGMLQuantizationType]:
        qtype = type_of(name)
        seed = sum(name.encode()) * 31 + int(qtype)
        return kquants.random_blocks(qtype, *weight.shape, seed=seed), qtype

    return blocks


def _decoded(path: Path) -> dict[str, np.ndarray]:
    """Every matrix of the file, read by the ``gguf`` package's reader and decoded by the
    independent decoder, which must agree bit for bit with ``gguf.quants.dequantize``."""
    out = {}
    for tensor in GGUFReader(str(path)).tensors:
        if len(tensor.shape) != 2:
            continue
        qtype = GGMLQuantizationType(tensor.tensor_type)
        assert qtype in kquants.BLOCK_BYTES, tensor.name
        raw = np.asarray(tensor.data)
        cols = int(tensor.shape[0])  # GGUF lists the row length first
        mine = kquants.decode(qtype, raw, cols)
        np.testing.assert_array_equal(dequantize(raw, qtype), mine, err_msg=tensor.name)
        out[tensor.name] = mine
    return out


def _rotate_half_order(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows of Q or K as stored by llama.cpp's converter (each head's rows in (even, odd)
    pairs) back in the order of a rotate-half RoPE (each head's even rows, then its odd)."""
    rows, cols = weight.shape
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, cols)
    return np.concatenate([per_head[:, :, 0], per_head[:, :, 1]], axis=1).reshape(rows, cols)


@pytest.mark.parametrize("case", list(CASES))
def test_loaded_weights_are_the_blocks_decoded(case: str, kquant_files: dict[str, Path]) -> None:
    path = kquant_files[case]
    decoded = _decoded(path)
    assert len(decoded) == 2 + 7 * 2  # embeddings, output, seven matrices in each layer
    types = {GGMLQuantizationType(t.tensor_type) for t in GGUFReader(str(path)).tensors}
    assert len(types & set(kquants.BLOCK_BYTES)) == (3 if case == "mixed" else 1)
    for name, weight in decoded.items():
        assert np.isfinite(weight).all() and np.abs(weight).max() < 0.5, name
        assert len(np.unique(weight)) > weight.size // 8, name  # really spread, not constant
    state = load_model(str(path), dtype=torch.float32).model.state_dict()

    def expect(ours: str, *parts: np.ndarray) -> None:
        assert torch.equal(state[ours], torch.from_numpy(np.concatenate(parts))), ours

    expect("embed_tokens.weight", decoded["token_embd.weight"])
    expect("lm_head.weight", decoded["output.weight"])
    for i in range(2):
        blk = {name.split(".")[2]: w for name, w in decoded.items() if name.startswith(f"blk.{i}.")}
        q = _rotate_half_order(blk["attn_q"], HEADS)
        k = _rotate_half_order(blk["attn_k"], KV_HEADS)
        expect(f"layers.{i}.self_attn.qkv_proj.weight", q, k, blk["attn_v"])
        expect(f"layers.{i}.self_attn.o_proj.weight", blk["attn_output"])
        expect(f"layers.{i}.mlp.gate_up_proj.weight", blk["ffn_gate"], blk["ffn_up"])
        expect(f"layers.{i}.mlp.down_proj.weight", blk["ffn_down"])


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers_gguf_loader(case: str, kquant_files: dict[str, Path]) -> None:
    path = kquant_files[case]
    reference: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    reference.eval()  # type: ignore[no-untyped-call]
    # transformers undoes the converter's Q/K interleave on its own: so does this test's order.
    q = reference.model.layers[1].self_attn.q_proj.weight  # type: ignore[union-attr, index]
    stored_q = _decoded(path)["blk.1.attn_q.weight"]
    assert torch.equal(q, torch.from_numpy(_rotate_half_order(stored_q, HEADS)))
    expected = hf_greedy(reference, PROMPTS, NUM_NEW)  # type: ignore[arg-type]
    loaded = load_model(str(path), dtype=torch.float32)
    got, _ = engine_greedy(
        loaded,
        PROMPTS,
        NUM_NEW,
        prefix_cache=True,
        num_pages=32,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    assert got == expected
    assert len({t for row in got for t in row}) > 3  # not one token over and over


def _weight_of(codes: Codes) -> torch.Tensor:
    """The float32 weight [out, in] the codes stand for."""
    per_run = codes.scale.repeat_interleave(CODE_BLOCK, dim=1)  # [out / 16, in, 16]
    offsets = codes.offset.repeat_interleave(CODE_BLOCK, dim=1)
    tiles = codes.codes.float() * per_run + offsets
    return tiles.permute(0, 2, 1).reshape(-1, tiles.shape[1])


def _exact_q4_k_blocks(rows: int, cols: int) -> np.ndarray:
    """Q4_K blocks whose runs of 32 are Q4_1-shaped exactly: power-of-two super-block scales
    (so scale times a code is exact in half precision) and codes 0 and 15 in every run."""
    raw = kquants.random_blocks(Q.Q4_K, rows, cols, seed=5).reshape(-1, 144)
    raw[:, 0:2] = np.full(1, 2.0**-12, dtype=np.float16).view(np.uint8)
    raw[:, 2:4] = np.full(1, 2.0**-9, dtype=np.float16).view(np.uint8)
    for group in range(4):  # in each 32 code bytes: low nibbles 0 and 15, high ones 15 and 0
        raw[:, 16 + 32 * group : 18 + 32 * group] = (0xF0, 0x0F)
    return raw.reshape(rows, -1)


WEIGHTS = {
    "Q4_K": lambda rows, cols: kquants.random_blocks(Q.Q4_K, rows, cols, seed=1),
    "Q5_K": lambda rows, cols: kquants.random_blocks(Q.Q5_K, rows, cols, seed=2),
    "Q6_K": lambda rows, cols: kquants.random_blocks(Q.Q6_K, rows, cols, seed=3),
    "Q4_K_runs_as_Q4_1": _exact_q4_k_blocks,
}


@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_packed_projections_of_kquant_weights(kind: str) -> None:
    """Block codes are kept only where they give the weight back bit for bit (the product then
    decodes them as it goes); either way every step size projects as ``linear`` does."""
    qtype = Q[kind[:4]]
    raw = WEIGHTS[kind](64, 512)
    weight = torch.from_numpy(kquants.decode(qtype, raw, 512))
    if not packing_supported(weight):
        pytest.skip("oneDNN packing is not available on this CPU")
    packed = pack(weight)
    assert packed is not None
    if packed.codes is not None:
        assert torch.equal(_weight_of(packed.codes), weight)
    if kind == "Q4_K_runs_as_Q4_1" and load_codes_gemm() is not None:
        assert packed.codes is not None  # the fast path applies to these
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 3, 16, 64, 100):
        x = torch.randn(rows, 512, generator=gen)
        residual = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(project(x, weight, packed), linear(x, weight))
        torch.testing.assert_close(
            project_add(x, weight, packed, residual), residual + linear(x, weight)
        )


UNSUPPORTED = [Q.Q2_K, Q.Q3_K, Q.Q8_K, Q.IQ2_XXS, Q.IQ4_NL, Q.IQ4_XS, Q.TQ2_0, Q.MXFP4, Q.Q8_1]


@pytest.mark.parametrize("qtype", UNSUPPORTED, ids=lambda q: q.name)
def test_unsupported_types_are_refused_by_type_and_tensor(
    qtype: GGMLQuantizationType, hf_dir: Path, tmp_path: Path
) -> None:
    def blocks(name: str, weight: np.ndarray) -> tuple[np.ndarray, GGMLQuantizationType] | None:
        if name != "blk.1.ffn_down.weight":
            return None
        block, size = GGML_QUANT_SIZES[qtype]
        rows, cols = weight.shape
        return np.zeros((rows, cols // block * size), dtype=np.uint8), qtype

    path = arch_dir_to_gguf(hf_dir, tmp_path / "model.gguf", raw_matrix=blocks)
    message = f"'blk.1.ffn_down.weight' is stored as {qtype.name}, which is not supported"
    with pytest.raises(ValueError, match=message):
        load_model(str(path), dtype=torch.float32)
