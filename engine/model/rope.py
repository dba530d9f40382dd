"""Rotary position embeddings: inverse frequencies per scaling variant and the cos/sin table."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponent)  # [dim // 2]


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated, short ones kept, the band between blended smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    theta: float, dim: int, scaling: Mapping[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    factor = float(scaling["factor"])
    original = int(scaling.get("original_max_position_embeddings") or max_positions / factor)
    beta_fast = float(scaling.get("beta_fast") or 32.0)
    beta_slow = float(scaling.get("beta_slow") or 1.0)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = float(max(math.floor(correction_dim(beta_fast)), 0))
    high = float(min(math.ceil(correction_dim(beta_slow)), dim - 1))
    if low == high:
        high += 0.001
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)
    extrapolation_factor = 1 - ramp.clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_extrapolation = 1.0 / pos_freqs
    inv_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = (
        inv_interpolation * (1 - extrapolation_factor) + inv_extrapolation * extrapolation_factor
    )
    return inv_freq, float(attention_factor)


def rope_cos_sin(
    head_dim: int,
    theta: float,
    scaling: Mapping[str, Any] | None,
    max_positions: int,
    device: torch.device | str = "cpu",
    freq_factors: Sequence[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each ``[max_positions, head_dim]`` float32 (halves repeated).

    ``freq_factors`` (a GGUF's ``rope_freqs``: llama.cpp's form of Llama 3's scaling) divide
    the inverse frequencies.
    """
    inv_freq = _default_inv_freq(theta, head_dim)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    attention_factor = 1.0
    kind = None if scaling is None else scaling["rope_type"]
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])  # type: ignore[index]
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
    elif kind == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(
            theta,
            head_dim,
            scaling,  # type: ignore[arg-type]
            max_positions,
        )
    # "dynamic" (NTK) only changes the base beyond max_position_embeddings, which the engine
    # never serves, so inside the table it equals the default.
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
    cos = (emb.cos() * attention_factor).to(device)
    sin = (emb.sin() * attention_factor).to(device)
    return cos, sin


class RopeTables(NamedTuple):
    """The step's rows of the tables, gathered once by position and shared by every layer."""

    cos: torch.Tensor  # [num_tokens, 1, head_dim]
    sin: torch.Tensor  # [num_tokens, 1, head_dim], first half negated (see ``signed_sin``)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` [..., head_dim] with its first half negated, so rotate-half needs no negation."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [num_tokens, num_heads, head_dim] by cos/sin [num_tokens, 1, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def rope_inplace(x: torch.Tensor, rope: RopeTables) -> None:
    """Rotate ``x`` [num_tokens, num_heads, head_dim] (a view, any row stride) in place.

    Equals ``apply_rope`` with the plain sin: ``x * cos + cat(x2, x1) * signed_sin``.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # [num_tokens, heads, head_dim]
    torch.addcmul(x * rope.cos, swapped, rope.sin, out=x)
