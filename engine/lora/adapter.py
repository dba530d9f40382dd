"""One LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors), read and
checked against the base model, with its scale folded into B."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.errors import InvalidRequestError
from engine.model.config import ModelConfig

# The projections an adapter may target, by PEFT's module name: (group, input features, output
# features) where a group is one of our fused projections (q/k/v -> qkv, gate/up -> gate_up).
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Settings of PEFT's LoraConfig that change the computation and that we do not implement.
_REFUSED: dict[str, tuple[object, ...]] = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "layers_to_transform": (None,),
    "modules_to_save": (None, []),
    "rank_pattern": (None, {}),
    "alpha_pattern": (None, {}),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "layer_replication": (None,),
    "target_parameters": (None, []),
    "trainable_token_indices": (None,),
    "alora_invocation_tokens": (None,),
    "use_qalora": (False, None),
    "use_bdlora": (False, None),
}


class AdapterError(InvalidRequestError):
    """An adapter that cannot be loaded or does not fit the base model."""

    code = "invalid_adapter"


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """The deltas of one adapter: per layer, per target, A [r, in] and scale * B [out, r]."""

    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, target) -> A, B

    @property
    def targets(self) -> frozenset[str]:
        return frozenset(target for _, target in self.weights)


def target_shape(config: ModelConfig, target: str) -> tuple[int, int]:
    """(input features, output features) of a PEFT target module in ``config``'s model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, config.q_size),
        "k_proj": (hidden, config.kv_size),
        "v_proj": (hidden, config.kv_size),
        "o_proj": (config.q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[target]


def read_adapter_config(path: Path) -> dict[str, Any]:
    """``adapter_config.json`` of the adapter folder ``path``, checked for what we support."""
    config_file = path / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read {config_file.name} of adapter at {path}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_file.name} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"only LoRA adapters are supported, not {config.get('peft_type')!r}")
    for key, allowed in _REFUSED.items():
        if config.get(key) not in allowed:
            raise AdapterError(f"adapter setting {key}={config.get(key)!r} is not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise AdapterError(f"adapter rank r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if targets == "all-linear":
        targets = list(TARGETS)
    if not isinstance(targets, list) or not targets:
        raise AdapterError("target_modules must be a list of module names (or 'all-linear')")
    unknown = sorted(set(map(str, targets)) - set(TARGETS))
    if unknown:
        raise AdapterError(
            f"target_modules {unknown} are not supported (supported: {', '.join(TARGETS)})"
        )
    config["target_modules"] = targets
    return config


def load_adapter(
    name: str, path: Path, model: ModelConfig, max_rank: int, dtype: torch.dtype
) -> LoraAdapter:
    """Read the adapter at ``path`` onto the CPU in ``dtype``; refuses (``AdapterError``) an
    adapter whose rank exceeds ``max_rank`` or whose tensors do not fit ``model``."""
    config = read_adapter_config(path)
    rank = int(config["r"])
    if rank > max_rank:
        raise AdapterError(f"adapter rank {rank} exceeds the engine's max LoRA rank {max_rank}")
    alpha = float(config["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterError(f"adapter at {path} has no adapter_model.safetensors")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as handle:  # type: ignore[no-untyped-call]
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                found = _KEY.search(key)
                if found is None or found.group(2) not in TARGETS:
                    raise AdapterError(f"adapter tensor {key!r} is not a supported LoRA weight")
                layer = int(found.group(1))
                halves.setdefault((layer, found.group(2)), {})[found.group(3)] = handle.get_tensor(
                    key
                )
    except AdapterError:
        raise
    except Exception as exc:  # a truncated or foreign file: the caller's input, never a crash
        raise AdapterError(f"cannot read adapter weights at {path}: {exc}") from None
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, target), pair in sorted(halves.items()):
        if not 0 <= layer < model.num_layers:
            raise AdapterError(f"adapter layer {layer} is outside the model's {model.num_layers}")
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter layer {layer} {target} lacks its lora_A or lora_B")
        a, b = pair["A"], pair["B"]
        in_features, out_features = target_shape(model, target)
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise AdapterError(
                f"adapter layer {layer} {target}: A {tuple(a.shape)} and B {tuple(b.shape)} do not "
                f"fit the model ({rank}, {in_features}) and ({out_features}, {rank})"
            )
        # The scale goes into B once, in float32, before the cast to the model dtype.
        weights[layer, target] = (a.to(dtype), (b.float() * scaling).to(dtype))
    if not weights:
        raise AdapterError(f"adapter at {path} holds no LoRA weights")
    return LoraAdapter(name, rank, scaling, weights)
