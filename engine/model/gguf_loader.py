"""Load a llama.cpp GGUF file: metadata, dequantized weights in HF layout, and the tokenizer.

The file is read by ``engine.model.gguf_file``; dequantization of the types in
``SUPPORTED_TYPES`` is done by ``gguf.quants`` in numpy, and a file holding any other type is
refused before a weight is read. For the ``llama`` architecture llama.cpp's converter permutes
the rows of Q and K (interleaved RoPE); we undo it so the weights fit the rotate-half RoPE of our
model and of transformers. Llama 3's RoPE scaling arrives as the ``rope_freqs`` tensor; Gemma's
norms with their offset already added.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.load_progress import LoadProgress, NullProgress
from engine.model.config import ModelConfig
from engine.model.gguf_file import GGUFFile
from engine.model.hf_loader import refuse_unused
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
_GEMMA_NORMS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Where an architecture's GGUF names mean other HF tensors than Llama's.
_ARCH_BLOCK_NAMES = {
    "qwen3": {
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
    "phi3": {
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",  # gate and up rows, fused
    },
    "gemma2": _GEMMA_NORMS,
    "gemma3_text": {
        **_GEMMA_NORMS,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
}
_ROPE_FREQS = "rope_freqs.weight"
# The tensor types we load: those whose decoding is tested against an independent reference
# (the K-quants against llama.cpp's block layout). The others (Q2_K, Q3_K, the IQ and TQ
# families, MXFP4, …) are refused by name.
_TYPE_NAMES = "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K"
SUPPORTED_TYPES = tuple(GGMLQuantizationType[name] for name in _TYPE_NAMES.split())
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# Arrays read in full for the tokenizer; other array fields (often huge) are skipped.
_TOKENIZER_ARRAYS = tuple(f"tokenizer.ggml.{name}" for name in ("tokens", "token_type", "merges"))


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF name of a GGUF tensor, or None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match is None:
        return None
    names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
    if match.group(2) in names:
        return f"model.layers.{match.group(1)}.{names[match.group(2)]}"
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


def refuse_unsupported_types(reader: GGUFFile) -> None:
    """Raise ValueError naming the first tensor stored in a type outside ``SUPPORTED_TYPES``."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(t.name for t in SUPPORTED_TYPES)
            raise ValueError(
                f"GGUF tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, "
                f"which is not supported (supported: {supported})"
            )


def read_gguf_config(reader: GGUFFile, meta: dict[str, Any]) -> ModelConfig:
    refuse_unsupported_types(reader)
    factors = None
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            array = dequantize(np.array(tensor.data), tensor.tensor_type)
            factors = tuple(float(f) for f in np.asarray(array, dtype=np.float32).reshape(-1))
    tied = all(t.name != "output.weight" for t in reader.tensors)
    return ModelConfig.from_gguf_metadata(meta, tied=tied, rope_freq_factors=factors)


def load_gguf_state(
    reader: GGUFFile,
    config: ModelConfig,
    dtype: torch.dtype,
    device: str,
    progress: LoadProgress | None = None,
) -> dict[str, torch.Tensor]:
    """Dequantize every weight, undo the Q/K permutation for llama, and fuse into our layout."""
    progress = progress or NullProgress()
    stored = {tensor.name: tensor.data.nbytes for tensor in reader.tensors}  # quantized bytes
    progress.stage("read weights", total=sum(stored.values()), unit="bytes")
    hf: dict[str, torch.Tensor] = {}
    spec = config.spec
    permuted = spec.gguf_permuted_qk
    unknown: list[str] = []
    for name, raw in dequantized_tensors(reader):
        progress.advance(stored[name])
        hf_name = hf_tensor_name(name, config.architecture)
        if hf_name is None:
            if name != _ROPE_FREQS:
                unknown.append(name)
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

    used: set[str] = set()

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise KeyError(f"tensor {name!r} missing from the GGUF file")
        used.add(name)
        return hf[name]

    offset = 0.0 if spec.gguf_norm_offset_added else None
    state = hf_to_fused(config, get, dtype, device, norm_offset=offset)
    refuse_unused([*unknown, *(hf.keys() - used)], "the GGUF file")
    return state


def open_gguf(path: Path) -> tuple[GGUFFile, dict[str, Any]]:
    """The file and its metadata: scalars, strings and the tokenizer's arrays (tokens, types,
    merges); other arrays (often huge) are skipped."""
    reader = GGUFFile(path, arrays=_TOKENIZER_ARRAYS)
    return reader, reader.fields
