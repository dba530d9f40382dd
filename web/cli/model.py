"""``atrium model export DIR``: write the loaded model as a Hugging Face directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from engine.model.export import export_hf
from engine.model.loader import load_model
from web.cli.env import EXIT_USAGE, env_default


def register(subparsers: Any) -> None:
    model: argparse.ArgumentParser = subparsers.add_parser("model", help="model utilities")
    commands = model.add_subparsers(dest="model_command", required=True, metavar="COMMAND")
    export = commands.add_parser(
        "export", help="write config.json, safetensors and tokenizer files to DIR"
    )
    export.add_argument("dir", type=Path)
    export.add_argument("--model", default=env_default("ATRIUM_MODEL", "default"))
    export.add_argument(
        "--dtype",
        default=env_default("ATRIUM_DTYPE", "float32"),
        choices=["bfloat16", "float16", "float32"],
    )
    export.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    try:
        loaded = load_model(args.model, dtype=getattr(torch, args.dtype))
        export_hf(loaded, args.dir)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"atrium model export: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(str(args.dir))
    return 0
