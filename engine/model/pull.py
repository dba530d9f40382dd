"""``pull(SOURCE, DEST)``: a Hugging Face repo id (``org/name`` or ``hf://org/name``), an archive
(``https://``, ``s3://``, ``gs://`` or a local ``.tar*`` file) or a local model folder, into DEST.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.model.pull_archive import pull_archive
from engine.model.pull_files import (
    ARCHIVE_SUFFIXES,
    RECORD,
    PullError,
    PullRecord,
    is_complete,
    pull_local,
    read_record,
)
from engine.model.pull_hub import pull_hub

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


def source_kind(source: str) -> str:
    """``hub``, ``archive`` or ``local``; raises PullError for anything else."""
    if source.startswith("hf://"):
        return "hub"
    if re.match(r"^[a-z][a-z0-9+.-]*://", source):
        return "archive"
    path = Path(source).expanduser()
    if path.is_file() and source.endswith(ARCHIVE_SUFFIXES):
        return "archive"
    if path.is_dir():
        return "local"
    if not path.is_absolute() and _REPO_ID.fullmatch(source) and not path.exists():
        return "hub"
    raise PullError(
        "model_source_not_found",
        f"{source!r} is no local folder or .tar archive, no URL and no Hugging Face repo id",
    )


def pull(
    source: str,
    dest: Path,
    *,
    revision: str | None = None,
    tokenizer_only: bool = False,
    token: str | None = None,
    sha256: str | None = None,
) -> tuple[PullRecord, bool]:
    """Pull ``source`` into ``dest``; returns the record and whether anything was fetched.

    A DEST whose record names the same source (and revision) with every file at its size is
    left as it is, without a network call: a restarted pod starts at once.
    """
    kind = source_kind(source)
    if kind == "hub" and not revision:
        raise PullError(
            "model_revision_required",
            "a Hugging Face pull needs --revision (a commit sha, tag or branch): it is pinned",
        )
    if kind == "local" and Path(source).expanduser().resolve() == dest.resolve():
        raise PullError("model_dest_is_source", "SOURCE and DEST are the same folder")
    dest.mkdir(parents=True, exist_ok=True)
    before = read_record(dest)
    if (
        before is not None
        and before.source == source
        and before.tokenizer_only == tokenizer_only
        and (kind != "hub" or revision in (before.revision, before.commit))
        and is_complete(dest, before)
    ):
        return before, False
    (dest / RECORD).unlink(missing_ok=True)  # from here on the folder is not complete
    if kind == "hub":
        return pull_hub(source, dest, revision or "", tokenizer_only, token), True
    if kind == "archive":
        return pull_archive(source, dest, tokenizer_only, sha256), True
    return pull_local(source, dest, tokenizer_only), True
