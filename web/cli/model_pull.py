"""``atrium model pull SOURCE DEST``: a model folder from a hub, an archive or a local folder."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from engine.model.pull import pull
from engine.model.pull_files import PullError

EXIT_FAILED = 1
SOURCES = (
    "SOURCE: a Hugging Face repo id (org/name; HF_TOKEN for private or gated repos, HF_ENDPOINT "
    "for a mirror), an https://, s3:// or gs:// tar archive (s3 needs s3fs, gs needs gcsfs), or "
    "a local model folder or .tar file. Only safetensors, config and tokenizer files are kept. "
    "A DEST already holding this pull is left as it is."
)


def add_pull_command(commands: Any) -> None:
    """Adds ``pull`` to the ``atrium model`` commands."""
    pull: argparse.ArgumentParser = commands.add_parser(
        "pull", help="fetch a model folder into DEST", description=SOURCES
    )
    pull.add_argument("source", metavar="SOURCE", help="where the model comes from (see above)")
    pull.add_argument("dest", type=Path, metavar="DEST", help="the folder to write")
    pull.add_argument(
        "--revision",
        help="hub only, required: a commit sha, tag or branch, resolved once to a commit",
    )
    pull.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="config and tokenizer files only (what a gateway needs), no weights",
    )
    pull.add_argument("--sha256", help="archives: the digest the whole archive must have")
    pull.add_argument(
        "--json", action="store_true", help="print {dest, files, commit, fetched} as JSON"
    )
    pull.set_defaults(func=run_pull)


def run_pull(args: argparse.Namespace) -> int:
    try:
        record, fetched = pull(
            args.source,
            args.dest,
            revision=args.revision,
            tokenizer_only=args.tokenizer_only,
            token=os.environ.get("HF_TOKEN") or None,
            sha256=args.sha256,
        )
    except PullError as exc:
        print(f"atrium model pull: {exc.code}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"atrium model pull: model_dest_unwritable: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        fields = {"dest": str(args.dest), "files": len(record.files), "commit": record.commit}
        print(json.dumps({**fields, "fetched": fetched}))
        return 0
    what = "pulled" if fetched else "already there"
    commit = f" at {record.commit}" if record.commit else ""
    print(f"{args.dest}: {len(record.files)} files {what}{commit}")
    return 0
