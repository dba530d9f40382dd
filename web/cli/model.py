"""``atrium model export DIR`` (the loaded model as a Hugging Face directory) and ``atrium model
pull`` (web/cli/model_pull.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engine.factory import load
from engine.model.export import export_hf
from web.cli.env import EXIT_USAGE, env_default
from web.cli.model_pull import add_pull_command


def register(subparsers: Any) -> None:
    model: argparse.ArgumentParser = subparsers.add_parser("model", help="model utilities")
    commands = model.add_subparsers(dest="model_command", required=True, metavar="COMMAND")
    export = commands.add_parser(
        "export", help="write config.json, safetensors and tokenizer files to DIR"
    )
    export.add_argument("dir", type=Path, metavar="DIR", help="the folder to write (created)")
    export.add_argument(
        "--model",
        default=env_default("ATRIUM_MODEL", "default"),
        help="'default' (SmolLM2-135M-Instruct), a model directory or a .gguf file",
    )
    export.add_argument(
        "--dtype",
        default=env_default("ATRIUM_DTYPE", "float32"),
        choices=["bfloat16", "float16", "float32"],
        help="the weights' dtype in DIR (default float32; env ATRIUM_DTYPE)",
    )
    export.add_argument("--json", action="store_true", help='print {"dir": DIR}')
    export.set_defaults(func=run_export)
    add_pull_command(commands)


def run_export(args: argparse.Namespace) -> int:
    try:
        loaded = load(args.model, args.dtype)
        export_hf(loaded, args.dir)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"atrium model export: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps({"dir": str(args.dir)}) if args.json else str(args.dir))
    return 0
