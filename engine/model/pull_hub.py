"""Pull from a Hugging Face hub (``HF_ENDPOINT``, else huggingface.co) at one pinned commit.

The revision is resolved to a commit once and every file is fetched at that commit, so a push to
the branch mid-pull cannot mix two versions. huggingface_hub resumes a dropped transfer from the
byte it reached (HTTP Range) and skips the files an interrupted pull completed; it checks sizes
only, so each kept file is then checked here against the hub's listing: its LFS sha256, or its git
blob id for small files. A file that differs is deleted (a rerun fetches it anew) and refused.
"""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path

import httpx2
from huggingface_hub import HfApi, RepoFile, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from engine.model.pull_files import (
    FileDigest,
    PullError,
    PullRecord,
    check_usable,
    finish,
    sha256_of,
    wanted,
)

_CHUNK = 1 << 20


def git_blob_id(path: Path) -> str:
    """The id git gives the file's content: sha1 of ``blob <size>\\0`` and the bytes."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _verify(dest: Path, entry: RepoFile) -> FileDigest:
    path = dest / entry.path
    sha256 = sha256_of(path)
    size = path.stat().st_size
    if entry.lfs is not None:
        ok = sha256 == entry.lfs.sha256 and size == entry.lfs.size
    else:
        ok = git_blob_id(path) == entry.blob_id and size == entry.size
    if not ok:
        path.unlink()
        # Its download record too: otherwise a rerun would take the deleted file as current.
        (dest / ".cache" / "huggingface" / "download" / f"{entry.path}.metadata").unlink(
            missing_ok=True
        )
        raise PullError(
            "model_checksum_mismatch",
            f"{entry.path}: the downloaded bytes do not match the hub's checksum; deleted",
        )
    return FileDigest(size, sha256)


def _hub_error(repo_id: str, revision: str, exc: Exception) -> PullError:
    if isinstance(exc, RevisionNotFoundError):
        return PullError("model_revision_not_found", f"{repo_id} has no revision {revision!r}")
    if isinstance(exc, GatedRepoError | RepositoryNotFoundError) or (
        isinstance(exc, HfHubHTTPError) and exc.response.status_code in (401, 403)
    ):
        return PullError(
            "model_hub_unauthorized",
            f"{repo_id}: not found or not allowed (a private or gated repo needs HF_TOKEN)",
        )
    return PullError("model_download_failed", f"{repo_id}: {type(exc).__name__}: {exc}")


def pull_hub(
    source: str, dest: Path, revision: str, tokenizer_only: bool, token: str | None
) -> PullRecord:
    repo_id = source.removeprefix("hf://")
    # Read now, not at import: huggingface_hub reads HF_ENDPOINT once, when first imported.
    endpoint = os.environ.get("HF_ENDPOINT") or None
    auth: str | bool = token or False  # never a token file from the home folder
    api = HfApi(endpoint=endpoint, token=auth)
    try:
        commit = api.model_info(repo_id, revision=revision).sha
        if commit is None:
            raise PullError("model_hub_unreachable", f"{repo_id}: the hub named no commit")
        entries = [
            entry
            for entry in api.list_repo_tree(repo_id, revision=commit, recursive=True)
            if isinstance(entry, RepoFile) and wanted(entry.path, tokenizer_only)
        ]
        check_usable((e.path for e in entries), tokenizer_only, f"{repo_id}@{commit}")
        snapshot_download(
            repo_id,
            revision=commit,
            local_dir=dest,
            allow_patterns=[glob.escape(e.path) for e in entries],
            token=auth,
            endpoint=endpoint,
            max_workers=4,
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, httpx2.HTTPError, OSError) as exc:
        raise _hub_error(repo_id, revision, exc) from exc
    files = {entry.path: _verify(dest, entry) for entry in entries}
    record = PullRecord(
        source=source,
        revision=revision,
        commit=commit,
        tokenizer_only=tokenizer_only,
        files=files,
    )
    return finish(dest, record)
