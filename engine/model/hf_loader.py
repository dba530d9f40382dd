"""Load a Hugging Face model directory: config.json plus one or many *.safetensors files."""

from __future__ import annotations

import json
from collections.abc import Collection
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.load_progress import LoadProgress, NullProgress
from engine.model.config import ModelConfig
from engine.model.weights import hf_to_fused


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_hf_config(path: Path) -> ModelConfig:
    with (path / "config.json").open(encoding="utf-8") as f:
        cfg: dict[str, Any] = json.load(f)
    config = ModelConfig.from_hf_dict(cfg)
    gen = path / "generation_config.json"
    if gen.is_file():
        # generation_config.json often lists more stop ids (e.g. Llama 3's <|eot_id|>).
        with gen.open(encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or [])
        ids = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
        config = replace(config, eos_token_ids=ids)
    return config


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with index.open(encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def load_hf_state(
    path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: str,
    progress: LoadProgress | None = None,
) -> dict[str, torch.Tensor]:
    """Read the (possibly sharded) safetensors and return our fused state dict."""
    progress = progress or NullProgress()
    files = _weight_files(path)
    total = sum(f.stat().st_size for f in files)
    progress.stage("read weights", total=total, unit="bytes")
    done = 0
    with ExitStack() as stack:
        where: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                where[name] = handle

        used: set[str] = set()

        def get(name: str) -> torch.Tensor:
            nonlocal done
            if name not in where:
                raise KeyError(f"tensor {name!r} missing from {path}")
            used.add(name)
            tensor: torch.Tensor = where[name].get_tensor(name)
            done += tensor.nbytes
            progress.advance(tensor.nbytes)
            return tensor

        state = hf_to_fused(config, get, dtype, device)
        refuse_unused(where.keys() - used, str(path))
        progress.advance(max(total - done, 0))  # the files' headers and ignored tensors
        return state


# Tensors a checkpoint may carry that change nothing: RoPE tables (recomputed), and an output
# matrix saved beside tied embeddings.
_IGNORED = ("rotary_emb.inv_freq", "lm_head.weight")


def refuse_unused(names: Collection[str], source: str) -> None:
    """A weight the decoder would not use means a feature it lacks: refuse, never ignore it."""
    unused = sorted(n for n in names if not n.endswith(_IGNORED))
    if unused:
        shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
        raise ValueError(f"{source} holds weights this architecture does not use: {shown}")
