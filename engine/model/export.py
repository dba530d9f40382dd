"""Write a loaded model as a Hugging Face directory that transformers and vLLM can load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from engine.model.loader import LoadedModel
from engine.model.weights import fused_to_hf

_DTYPE_NAMES = {
    "torch.float32": "float32",
    "torch.bfloat16": "bfloat16",
    "torch.float16": "float16",
}


def _write_json(path: Path, body: dict[str, Any]) -> None:
    path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def export_hf(loaded: LoadedModel, out_dir: Path) -> None:
    """config.json, model.safetensors (HF names, loaded dtype), tokenizer and generation config."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = loaded.config
    dtype = _DTYPE_NAMES.get(str(loaded.dtype), "float32")
    hf_config = {**config.to_hf_dict(), "dtype": dtype, "torch_dtype": dtype}
    _write_json(out_dir / "config.json", hf_config)
    tensors = fused_to_hf(config, loaded.model.state_dict())
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    tokenizer = loaded.tokenizer
    tokenizer.hf.save_pretrained(str(out_dir))
    # Older readers look for the chat template inside tokenizer_config.json only.
    tok_config_path = out_dir / "tokenizer_config.json"
    tok_config: dict[str, Any] = json.loads(tok_config_path.read_text(encoding="utf-8"))
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # known to 4.x and 5.x readers
    if tokenizer.chat_template is not None:
        tok_config["chat_template"] = tokenizer.chat_template
    _write_json(tok_config_path, tok_config)

    eos = list(tokenizer.eos_token_ids)
    generation: dict[str, Any] = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    if config.bos_token_id is not None:
        generation["bos_token_id"] = config.bos_token_id
    _write_json(out_dir / "generation_config.json", generation)
