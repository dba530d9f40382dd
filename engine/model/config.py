"""The model's shape and hyper-parameters, built from a Hugging Face config or GGUF metadata."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.attention.backend import LayerAttention
from engine.model.architectures import (
    ACTIVATIONS,
    ARCHITECTURES,
    ArchSpec,
    layer_windows,
    refuse_unsupported,
)

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# A GGUF file's ``general.architecture`` where it differs from the config's ``model_type``.
_GGUF_ARCHITECTURES = {"gemma3": "gemma3_text"}
_NOT_GGUF = {v: k for k, v in _GGUF_ARCHITECTURES.items()}


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or {"rope_type": "linear" | "dynamic" | "llama3" | "yarn", "factor": ..., ...}
    rope_scaling: Mapping[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    # Per layer, the keys a query sees under a sliding window (itself included), 0 for the
    # whole history; empty when no layer slides.
    layer_windows: tuple[int, ...] = ()
    attn_logit_softcap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the output logits
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power, if set
    hidden_act: str = "silu"
    # Per RoPE frequency, a divisor of its inverse frequency (a GGUF's rope_freqs tensor).
    rope_freq_factors: tuple[float, ...] | None = field(default=None, hash=False)
    # The RoPE base of sliding-window layers where it differs (Gemma 3; never scaled), else None.
    rope_local_theta: float | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError("layer_windows must name every layer")
        factors = self.rope_freq_factors
        if factors is not None and len(factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freqs has {len(factors)} factors, RoPE needs {self.head_dim // 2}"
            )

    @property
    def spec(self) -> ArchSpec:
        """What this architecture changes in the decoder."""
        return ARCHITECTURES[self.architecture]

    def window(self, layer_id: int) -> int | None:
        """The sliding window of layer ``layer_id``, or None if it sees the whole history."""
        return (self.layer_windows[layer_id] or None) if self.layer_windows else None

    @property
    def attention_layers(self) -> tuple[LayerAttention, ...]:
        """Each layer's window, soft-capping and score scale (all None: plain attention)."""
        scale = None
        if self.query_pre_attn_scalar not in (None, float(self.head_dim)):
            scale = self.query_pre_attn_scalar**-0.5  # type: ignore[operator]
        return tuple(
            LayerAttention(self.window(i), self.attn_logit_softcap, scale)
            for i in range(self.num_layers)
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` (transformers 4.x or 5.x layout)."""
        arch = str(cfg.get("model_type", "llama"))
        if arch == "gemma3":
            raise ValueError(
                "model_type 'gemma3' is Gemma 3's image-and-text model; its text model "
                "(model_type 'gemma3_text', Gemma3ForCausalLM) is supported"
            )
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        spec = ARCHITECTURES[arch]
        refuse_unsupported(cfg, arch)
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        # transformers 5.x: rope_parameters holds rope_theta and the scaling; 4.x: top level.
        rope_params = dict(cfg.get("rope_parameters") or {})
        local_theta = None
        if spec.local_rope:
            rope_params, local_theta = _split_local_rope(cfg, rope_params)
        refuse_unsupported(rope_params, arch)  # Phi-3 keeps partial_rotary_factor there
        default_theta = 1_000_000.0 if spec.local_rope else 10000.0  # as transformers' classes
        theta = rope_params.get("rope_theta", cfg.get("rope_theta", default_theta))
        scaling = cfg.get("rope_scaling") or rope_params
        rope_scaling = _normalize_rope_scaling(scaling)
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=spec.qkv_bias,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            architecture=arch,
            layer_windows=layer_windows(cfg, spec, int(cfg["num_hidden_layers"])),
            attn_logit_softcap=_optional_float(cfg.get("attn_logit_softcapping")),
            final_logit_softcap=_optional_float(cfg.get("final_logit_softcapping")),
            query_pre_attn_scalar=_optional_float(cfg.get("query_pre_attn_scalar")),
            hidden_act=str(
                cfg.get("hidden_activation") or cfg.get("hidden_act") or spec.default_activation
            ),
            rope_local_theta=local_theta,
        )

    @classmethod
    def from_gguf_metadata(
        cls, meta: Mapping[str, Any], *, tied: bool, rope_freq_factors: tuple[float, ...] | None
    ) -> ModelConfig:
        """Build from GGUF key/values (``<arch>.*``); ``tied`` if the file has no output.weight."""
        gguf_arch = str(meta["general.architecture"])
        arch = _GGUF_ARCHITECTURES.get(gguf_arch, gguf_arch)
        if arch not in SUPPORTED_ARCHITECTURES or gguf_arch in _NOT_GGUF:
            supported = [_NOT_GGUF.get(a, a) for a in SUPPORTED_ARCHITECTURES]
            raise ValueError(
                f"unsupported GGUF architecture {gguf_arch!r}; supported: {', '.join(supported)}"
            )
        spec = ARCHITECTURES[arch]

        def key(name: str, default: Any = None) -> Any:
            return meta.get(f"{gguf_arch}.{name}", default)

        hidden = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        num_layers = int(key("block_count"))
        vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        scaling: dict[str, Any] | None = None
        scale_type = key("rope.scaling.type")
        if scale_type and scale_type != "none":
            scaling = {"rope_type": scale_type, "factor": float(key("rope.scaling.factor", 1.0))}
            orig = key("rope.scaling.original_context_length")
            if orig is not None:
                scaling["original_max_position_embeddings"] = int(orig)
        head_dim = int(key("attention.key_length", hidden // num_heads))
        rope_dims = key("rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != head_dim:
            raise ValueError(
                f"{arch}: RoPE over {rope_dims} of {head_dim} dimensions is not supported"
            )
        window = key("attention.sliding_window")
        windows = layer_windows({"sliding_window": window}, spec, num_layers)
        # llama.cpp scales Gemma's queries by head_dim, except the 27B's (hidden / heads).
        big = {"gemma2": 46, "gemma3_text": 62}.get(arch)
        pre_attn = hidden / num_heads if num_layers == big else None
        eos = meta.get("tokenizer.ggml.eos_token_id")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=_f32(key("rope.freq_base", 10000.0)),
            rope_scaling=_normalize_rope_scaling(scaling),
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings=tied,
            attention_bias=spec.qkv_bias,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=_as_tuple(eos),
            architecture=arch,
            layer_windows=windows,
            attn_logit_softcap=_optional_f32(key("attn_logit_softcapping")),
            final_logit_softcap=_optional_f32(key("final_logit_softcapping")),
            query_pre_attn_scalar=pre_attn,
            hidden_act=spec.default_activation,
            rope_freq_factors=rope_freq_factors,
            # llama.cpp's fixed base for Gemma 3's sliding layers (the file does not hold it).
            rope_local_theta=10000.0 if spec.local_rope and windows else None,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-loadable ``config.json`` body for this architecture's class."""
        if self.rope_freq_factors is not None:
            raise ValueError("RoPE frequency factors from a GGUF file have no config.json form")
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        rope_parameters = rope
        if self.rope_local_theta is not None:
            local = {"rope_type": "default", "rope_theta": self.rope_local_theta}
            rope_parameters = {"full_attention": rope, "sliding_attention": local}
        eos: int | list[int] | None = list(self.eos_token_ids) or None
        if len(self.eos_token_ids) == 1:
            eos = self.eos_token_ids[0]
        out: dict[str, Any] = {
            "architectures": [self.spec.hf_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "hidden_activation": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            # Both spellings: transformers 5.x reads rope_parameters, older readers the rest.
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "rope_scaling": None if self.rope_scaling is None else dict(rope),
            "attn_logit_softcapping": self.attn_logit_softcap,
            "final_logit_softcapping": self.final_logit_softcap,
            "query_pre_attn_scalar": _int_if_whole(self.query_pre_attn_scalar or self.head_dim),
            "pad_token_id": None,  # a class default (Phi-3's 32000) may lie past the vocabulary
            "sliding_window": max(self.layer_windows, default=0) or None,
        }
        if self.layer_windows and self.spec.window_rule != "all":
            out["use_sliding_window"] = True
            out["max_window_layers"] = 0
            out["layer_types"] = [
                "sliding_attention" if w else "full_attention" for w in self.layer_windows
            ]
        if self.rope_local_theta is not None:
            out["rope_local_base_freq"] = self.rope_local_theta  # for transformers 4.x
        if self.architecture in ("llama", "qwen3", "gemma2", "gemma3_text"):
            out["attention_bias"] = False
            out["mlp_bias"] = False
        return out


def _split_local_rope(
    cfg: Mapping[str, Any], rope_params: dict[str, Any]
) -> tuple[dict[str, Any], float]:
    """(the global layers' RoPE parameters, the sliding layers' base) of a config with a RoPE of
    each kind: transformers 5 nests them by layer type in ``rope_parameters``; older configs
    hold ``rope_theta``, ``rope_scaling`` and ``rope_local_base_freq``."""
    local = rope_params.get("sliding_attention")
    if "full_attention" not in rope_params and local is None:
        return rope_params, float(cfg.get("rope_local_base_freq", 10000.0))
    local = dict(local or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling {local['rope_type']!r} on sliding layers is not supported")
    theta = local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    return dict(rope_params.get("full_attention") or {}), float(theta)


def _int_if_whole(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _optional_f32(value: Any) -> float | None:
    return None if value is None else _f32(value)


def _f32(value: Any) -> float:
    """GGUF stores float32: keep its shortest decimal (1e-05, not 9.999999747e-06)."""
    return float(str(np.float32(value)))


def _normalize_rope_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Map both the old ``type`` and new ``rope_type`` spellings to one dict, or None."""
    if not scaling:
        return None
    out = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default", "none"):
        return None
    if kind not in ("linear", "dynamic", "llama3", "yarn"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    out["rope_type"] = kind
    return out
