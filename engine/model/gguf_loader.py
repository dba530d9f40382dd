"""Load a llama.cpp GGUF file: metadata, dequantized weights in HF layout, and the tokenizer.

The file is read by ``engine.model.gguf_file``; dequantization (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, …) is done by ``gguf.quants`` in numpy. For the
``llama`` architecture llama.cpp's converter permutes the rows of Q and K (interleaved RoPE); we
undo it so the weights fit the rotate-half RoPE of our model and of transformers.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize

from engine.model.config import ModelConfig
from engine.model.gguf_file import GGUFFile
from engine.model.weights import hf_to_fused

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# Arrays read in full for the tokenizer; other array fields (often huge) are skipped.
_TOKENIZER_ARRAYS = tuple(f"tokenizer.ggml.{name}" for name in ("tokens", "token_type", "merges"))


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"
    return None


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (rotate-half order → interleaved)."""
    rows = weight.shape[0]
    shaped = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of :func:`permute_rows` (interleaved → rotate-half order)."""
    rows = weight.shape[0]
    shaped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)


def dequantized_tensors(reader: GGUFFile) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in [rows, cols] order) for every tensor in the file."""
    for tensor in reader.tensors:
        # One copy out of the memory map first, then decoded in memory.
        array = dequantize(np.array(tensor.data), tensor.tensor_type)
        yield tensor.name, np.asarray(array, dtype=np.float32).reshape(tensor.shape)


def read_gguf_config(reader: GGUFFile, meta: dict[str, Any]) -> ModelConfig:
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise NotImplementedError("GGUF files with rope_freqs (Llama 3.1 RoPE) are not supported")
    return ModelConfig.from_gguf_metadata(meta, tied="output.weight" not in names)


def load_gguf_state(
    reader: GGUFFile, config: ModelConfig, dtype: torch.dtype, device: str
) -> dict[str, torch.Tensor]:
    """Dequantize every weight, undo the Q/K permutation for llama, and fuse into our layout."""
    hf: dict[str, torch.Tensor] = {}
    permuted = config.architecture in ("llama", "mistral")
    for name, raw in dequantized_tensors(reader):
        hf_name = hf_tensor_name(name)
        if hf_name is None:
            continue
        array = raw
        if permuted and hf_name.endswith("q_proj.weight"):
            array = unpermute_rows(raw, config.num_heads)
        elif permuted and hf_name.endswith("k_proj.weight"):
            array = unpermute_rows(raw, config.num_kv_heads)
        hf[hf_name] = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    missing = sorted({"model.embed_tokens.weight", "model.norm.weight"} - hf.keys())
    if missing:
        raise ValueError(f"GGUF file lacks tensors {missing}")

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise KeyError(f"tensor {name!r} missing from the GGUF file")
        return hf[name]

    return hf_to_fused(config, get, dtype, device)


def open_gguf(path: Path) -> tuple[GGUFFile, dict[str, Any]]:
    """The file and its metadata: scalars, strings and the tokenizer's arrays (tokens, types,
    merges); other arrays (often huge) are skipped."""
    reader = GGUFFile(path, arrays=_TOKENIZER_ARRAYS)
    return reader, reader.fields
