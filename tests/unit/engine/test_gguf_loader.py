"""GGUF loading: dequantization of each tensor type, name mapping, and the Q/K permutation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.gguf_file import GGUFFile, GGUFFormatError
from engine.model.gguf_loader import (
    dequantized_tensors,
    hf_tensor_name,
    permute_rows,
    unpermute_rows,
)
from engine.model.loader import load_model
from tests.support.gguf_file import add_array, hf_dir_to_gguf
from tests.support.paged import PagedRunner, PagedSeq
from tests.support.tiny_llama import load_reference

Q = GGMLQuantizationType
# Worst-case absolute error of each format for values in [-1, 1] (half a quantization step).
TOLERANCE = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 1 / 256,
    Q.Q8_0: 1 / 127,
    Q.Q4_0: 1 / 7,
    Q.Q4_1: 2 / 15,
    Q.Q5_0: 1 / 15,
    Q.Q5_1: 1 / 30,
}


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_dequantize_each_type(tmp_path: Path, qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(int(qtype))
    original = rng.uniform(-1, 1, size=(48, 96)).astype(np.float32)
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(str(path), "llama")
    add_array(writer, "blk.0.ffn_up.weight", original, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    [(name, array)] = list(dequantized_tensors(GGUFFile(path)))
    assert name == "blk.0.ffn_up.weight"
    assert array.shape == original.shape
    assert array.dtype == np.float32
    err = np.abs(array - original)
    assert err.max() <= TOLERANCE[qtype] + 1e-6
    if qtype != Q.F32:
        assert err.max() > 0  # really stored in the lossy format


def _write_fields_and_tensors(path: Path) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("t.u32", 7)
    writer.add_int64("t.i64", -(2**40))
    writer.add_float32("t.f32", 0.25)
    writer.add_float64("t.f64", -1.5)
    writer.add_bool("t.flag", True)
    writer.add_string("t.text", "héllo wörld")
    writer.add_array("t.ints", [3, 1, 4, 1, 5])
    writer.add_array("t.words", ["a", "", "ccc"])
    writer.add_array("t.floats", [0.5, 1.5])
    rng = np.random.default_rng(3)
    add_array(writer, "a.f32", rng.uniform(-1, 1, size=(3, 64)).astype(np.float32), Q.F32)
    add_array(writer, "b.q4_1", rng.uniform(-1, 1, size=(5, 64)).astype(np.float32), Q.Q4_1)
    add_array(writer, "c.f16", rng.uniform(-1, 1, size=(64,)).astype(np.float32), Q.F16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_file_reads_what_the_gguf_package_reads(tmp_path: Path) -> None:
    path = tmp_path / "f.gguf"
    _write_fields_and_tensors(path)
    ref = GGUFReader(str(path))
    wanted = {name for name in ref.fields if not name.startswith("GGUF.")}
    read = GGUFFile(path, arrays=wanted)
    assert read.fields == {name: ref.fields[name].contents() for name in wanted}
    assert read.fields["t.text"] == "héllo wörld" and read.fields["t.words"] == ["a", "", "ccc"]
    assert [t.name for t in read.tensors] == ["a.f32", "b.q4_1", "c.f16"]
    for mine, theirs in zip(read.tensors, ref.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(reversed(theirs.shape.tolist()))
        assert mine.data.tobytes() == np.asarray(theirs.data).tobytes()
    # Arrays not asked for are skipped; scalars and strings are always read.
    plain = GGUFFile(path)
    assert "t.ints" not in plain.fields and "t.words" not in plain.fields
    assert plain.fields["t.u32"] == 7 and plain.fields["t.flag"] is True
    assert [t.shape for t in plain.tensors] == [(3, 64), (5, 64), (64,)]


def test_gguf_file_refuses_what_is_not_a_whole_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "f.gguf"
    _write_fields_and_tensors(path)
    whole = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for size, message in [(0, "empty"), (40, "ends inside"), (len(whole) - 8, "past the end")]:
        cut.write_bytes(whole[:size])
        with pytest.raises(GGUFFormatError, match=message):
            GGUFFile(cut)
    cut.write_bytes(b"GGML" + whole[4:])
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(cut)
    cut.write_bytes(whole[:4] + (1).to_bytes(4, "little") + whole[8:])
    with pytest.raises(GGUFFormatError, match="version 1"):
        GGUFFile(cut)


def test_tensor_names_map_to_hf() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert (
        hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("rope_freqs.weight") is None


@pytest.mark.parametrize("num_heads", [1, 3, 4])
def test_unpermute_inverts_permute(num_heads: int) -> None:
    w = np.arange(num_heads * 8 * 5, dtype=np.float32).reshape(num_heads * 8, 5)
    permuted = permute_rows(w, num_heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rows(permuted, num_heads), w)


def _logits(model_path: Path, tokens: list[int]) -> torch.Tensor:
    loaded = load_model(str(model_path), dtype=torch.float32)
    runner = PagedRunner(loaded.model, TorchAttentionBackend(), num_pages=8, page_size=4)
    seq = PagedSeq(tokens, [5, 2, 7, 0, 1, 3, 6, 4])
    for n in [10, 7, 1]:
        runner.step([seq], [n])
    return torch.stack(seq.logits)


def test_f32_gguf_of_tiny_llama_matches_transformers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = hf_dir_to_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")
    tokens = [
        int(t) for t in torch.randint(0, 256, (18,), generator=torch.Generator().manual_seed(0))
    ]
    hf = load_reference(tiny_llama_dir, torch.float32)
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0, [9, 16, 17]]
    got = _logits(path, tokens)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_gguf_config_and_tokenizer(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = hf_dir_to_gguf(tiny_llama_dir, tmp_path / "tiny.gguf")
    from_gguf = load_model(str(path), dtype=torch.float32)
    from_hf = load_model(str(tiny_llama_dir), dtype=torch.float32)
    assert from_gguf.name == "tiny"
    assert from_gguf.config == from_hf.config
    text = "héllo <|im_end|> wörld"
    assert from_gguf.tokenizer.encode(text) == from_hf.tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    ids = from_gguf.tokenizer.apply_chat_template(messages)
    assert ids == from_hf.tokenizer.apply_chat_template(messages)
    assert from_gguf.tokenizer.eos_token_ids == from_hf.tokenizer.eos_token_ids


def test_q8_gguf_stays_close(tiny_llama_dir: Path, tmp_path: Path) -> None:
    f32 = hf_dir_to_gguf(tiny_llama_dir, tmp_path / "f32.gguf")
    q8 = hf_dir_to_gguf(tiny_llama_dir, tmp_path / "q8.gguf", lambda _: Q.Q8_0)
    tokens = list(range(40, 58))
    exact, approx = _logits(f32, tokens), _logits(q8, tokens)
    assert not torch.equal(exact, approx)
    assert (exact - approx).abs().max() < 0.05 * exact.abs().max()
