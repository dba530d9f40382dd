"""Architectures read from configs (windows per layer, refusals naming what is missing), the
masked attention path against exact attention, and export of each architecture."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention import registry
from engine.attention.backend import LayerAttention
from engine.attention.masked_attention import masked_attention, plan_masked
from engine.attention.metadata import SeqSlice, build_attention_metadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.model.config import ModelConfig
from engine.model.export import export_hf
from engine.model.loader import load_model
from tests.support.paged import filled_cache
from tests.support.tiny_llama import TINY_CONFIG, make_tiny_llama
from tests.support.tiny_models import load_reference, make_tiny_model


def hf_config(model_type: str, **extra: Any) -> dict[str, Any]:
    return {**TINY_CONFIG, "model_type": model_type, **extra}


def test_unsupported_model_type_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"'falcon'.*supported: llama, mistral, qwen2, qwen3"):
        ModelConfig.from_hf_dict(hf_config("falcon"))


@pytest.mark.parametrize(
    ("model_type", "extra", "named"),
    [
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("phi3", {"rope_parameters": {"partial_rotary_factor": 0.75}}, "partial_rotary_factor"),
        ("phi3", {"rope_parameters": {"rope_type": "longrope"}}, "longrope"),
        ("gemma2", {"hidden_activation": "relu"}, "relu"),
        ("gemma2", {"layer_types": ["chunked_attention"] * 2, "sliding_window": 8}, "chunked"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (
            "gemma3_text",
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "'linear' on sliding layers",
        ),
        ("gemma3", {}, "image-and-text model; its text model"),
    ],
)
def test_settings_the_decoder_lacks_are_refused(
    model_type: str, extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf_dict(hf_config(model_type, **extra))


@pytest.mark.parametrize(
    ("model_type", "extra", "windows"),
    [
        ("mistral", {"sliding_window": None}, ()),
        ("mistral", {"sliding_window": 8}, (8, 8)),
        # transformers 4.x Qwen2 configs: a window only with use_sliding_window, from a layer on.
        ("qwen2", {"sliding_window": 4096, "max_window_layers": 1}, ()),
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
            (0, 8),
        ),
        ("gemma2", {"sliding_window": 8}, (8, 0)),  # without layer_types: even layers slide
        ("gemma2", {"sliding_window": 8, "layer_types": ["full_attention"] * 2}, ()),
        # Gemma 3 without layer_types: every sixth layer global (or every n-th, if set).
        ("gemma3_text", {"sliding_window": 8, "num_hidden_layers": 7}, (8, 8, 8, 8, 8, 0, 8)),
        (
            "gemma3_text",
            {"sliding_window": 8, "num_hidden_layers": 4, "sliding_window_pattern": 2},
            (8, 0, 8, 0),
        ),
    ],
)
def test_layer_windows(model_type: str, extra: dict[str, Any], windows: tuple[int, ...]) -> None:
    assert ModelConfig.from_hf_dict(hf_config(model_type, **extra)).layer_windows == windows


def test_weights_the_architecture_does_not_use_are_refused(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "m")
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(TINY_CONFIG["hidden_size"])
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"does not use: model\.layers\.1\.self_attn\.o_proj\.bias"
    ):
        load_model(str(model_dir), dtype=torch.float32)


def test_a_backend_without_windows_is_refused_for_a_windowed_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class PlainOnly(TorchAttentionBackend):
        def serves(self, layer: LayerAttention) -> bool:
            return layer.plain

    monkeypatch.setattr(registry, "BACKENDS", MappingProxyType({"plain": lambda _: PlainOnly()}))
    windowed = ModelConfig.from_hf_dict(hf_config("mistral", sliding_window=8))
    device = torch.device("cpu")
    with pytest.raises(registry.BackendUnavailableError, match="sliding window of 8"):
        registry.create_backend(device, windowed, page_size=16, dtype=torch.float32, name="plain")
    plain = ModelConfig.from_hf_dict(hf_config("mistral", sliding_window=None))
    registry.create_backend(device, plain, page_size=16, dtype=torch.float32, name="plain")


def exact_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerAttention
) -> torch.Tensor:
    """Attention of the last ``len(q)`` positions over k/v, windowed and soft-capped, float64."""
    qo, kv = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scale = layer.scale or q.shape[-1] ** -0.5
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    q_pos, k_pos = torch.arange(kv - qo, kv)[:, None], torch.arange(kv)[None, :]
    visible = k_pos <= q_pos
    if layer.window is not None:
        visible &= k_pos > q_pos - layer.window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    "layer",
    [LayerAttention(window=5), LayerAttention(softcap=2.0, scale=0.3), LayerAttention(7, 3.0)],
)
def test_masked_attention_matches_exact_attention(layer: LayerAttention) -> None:
    # Two decodes (one shorter than the window) and two chunks, one over a cached prefix.
    kv_lens, qo_lens, page_size = [23, 3, 18, 9], [1, 1, 6, 9], 4
    cache, tables, keys, values = filled_cache(kv_lens, page_size, 2, 16, torch.float32, seed=3)
    meta = build_attention_metadata(
        [SeqSlice(t, n - m, m) for t, n, m in zip(tables, kv_lens, qo_lens, strict=True)],
        page_size,
    )
    q = torch.randn(sum(qo_lens), 4, 16)
    out = masked_attention(q, cache, plan_masked(meta, layer.window, 2), layer)
    starts = meta.qo_indptr.tolist()
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        rows = slice(starts[i], starts[i + 1])
        expected = exact_attention(q[rows], k, v, layer).float()
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


def test_gemma3_rope_of_each_layer_kind_from_old_and_new_configs() -> None:
    old = hf_config(
        "gemma3_text",
        rope_theta=1e6,
        rope_local_base_freq=5e3,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    new = hf_config(
        "gemma3_text",
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 5e3},
        },
    )
    for cfg in (old, new):
        config = ModelConfig.from_hf_dict(cfg)
        assert (config.rope_theta, config.rope_local_theta) == (1e6, 5e3)
        assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert ModelConfig.from_hf_dict(hf_config("gemma2")).rope_local_theta is None


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2_scaled", "gemma3"])
def test_export_reloads_in_transformers(tmp_path: Path, arch: str) -> None:
    loaded = load_model(str(make_tiny_model(arch, tmp_path / "src")), dtype=torch.float32)
    export_hf(loaded, tmp_path / "out")
    tokens = torch.tensor([[(j * 13) % 256 for j in range(30)]])
    with torch.no_grad():
        want = load_reference(tmp_path / "src")(tokens).logits
        got = load_reference(tmp_path / "out")(tokens).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gguf_partial_rope_and_unknown_architectures_are_refused() -> None:
    meta: dict[str, Any] = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.block_count": 2,
        "llama.feed_forward_length": 128,
        "llama.vocab_size": 260,
        "llama.rope.dimension_count": 8,
    }
    with pytest.raises(ValueError, match="RoPE over 8 of 16 dimensions"):
        ModelConfig.from_gguf_metadata(meta, tied=True, rope_freq_factors=None)
    falcon = {**meta, "general.architecture": "falcon"}
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        ModelConfig.from_gguf_metadata(falcon, tied=True, rope_freq_factors=None)
