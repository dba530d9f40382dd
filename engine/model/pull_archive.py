"""Pull a model from a tar archive: ``https://`` (httpx), ``s3://``, ``gs://`` and other fsspec
URLs, or a local ``.tar*`` file.

A remote archive is first fetched to ``DEST/.atrium-pull/archive.part``; an interrupted fetch goes
on from the bytes it has (an HTTP Range, or a seek on the fsspec file). With ``sha256`` the whole
archive must have that digest. Only regular files at the top or one folder down are taken, by
their base name; links, devices and paths leaving DEST never are.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath
from typing import IO

import fsspec
import httpx

from engine.model.pull_files import (
    FileDigest,
    PullError,
    PullRecord,
    check_usable,
    finish,
    sha256_of,
    wanted,
)

STAGING = ".atrium-pull"
_CHUNK = 1 << 20
_RETRIES = 5
# fsspec names the package a scheme needs only in its own words: say it plainly.
_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs"}


def _fetch_http(url: str, part: Path) -> None:
    for attempt in range(_RETRIES + 1):
        have = part.stat().st_size if part.exists() else 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            with httpx.stream("GET", url, headers=headers, follow_redirects=True) as response:
                if response.status_code == 416 and have:  # nothing left to fetch
                    return
                if response.status_code not in (200, 206):
                    raise PullError("model_download_failed", f"{url}: HTTP {response.status_code}")
                # 200 to a Range request: the server sends it all again.
                with part.open("ab" if response.status_code == 206 else "wb") as f:
                    for block in response.iter_bytes():  # as it arrives: a cut keeps it
                        f.write(block)
            return
        except httpx.TransportError as exc:
            if attempt == _RETRIES:
                raise PullError("model_download_failed", f"{url}: {exc}") from exc


def _fetch_fsspec(url: str, part: Path) -> None:
    scheme = url.partition("://")[0]
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        package = _PACKAGES.get(scheme)
        needs = f"the {package} package (pip install {package})" if package else str(exc)
        raise PullError("model_source_needs_package", f"{scheme}:// needs {needs}") from exc
    have = part.stat().st_size if part.exists() else 0
    try:
        with fs.open(path, "rb") as reader, part.open("ab") as writer:
            reader.seek(have)
            shutil.copyfileobj(reader, writer, _CHUNK)
    except OSError as exc:
        raise PullError("model_download_failed", f"{url}: {exc}") from exc


def fetch(source: str, staging: Path) -> Path:
    """The archive as a local file: a local one as it is, a remote one fetched (resumably)."""
    if "://" not in source:
        return Path(source).expanduser()
    staging.mkdir(parents=True, exist_ok=True)
    part = staging / "archive.part"
    if source.startswith(("http://", "https://")):
        _fetch_http(source, part)
    else:
        _fetch_fsspec(source, part)
    return part


def _member_name(member: tarfile.TarInfo) -> str | None:
    """The base name a member lands under in DEST, or None when it is not taken."""
    path = PurePosixPath(member.name.removeprefix("./"))
    if not member.isfile() or path.is_absolute() or ".." in path.parts or len(path.parts) > 2:
        return None
    return path.name


def _extract(archive: Path, dest: Path, tokenizer_only: bool) -> dict[str, FileDigest]:
    files: dict[str, FileDigest] = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                name = _member_name(member)
                if name is None or not wanted(name, tokenizer_only):
                    continue
                if name in files:
                    raise PullError("model_archive_ambiguous", f"two files named {name}")
                reader = tar.extractfile(member)
                if reader is not None:
                    files[name] = _write(reader, dest / name)
    except (tarfile.TarError, EOFError) as exc:
        raise PullError("model_archive_unreadable", f"{archive.name}: {exc}") from exc
    return files


def _write(reader: IO[bytes], target: Path) -> FileDigest:
    digest, size = hashlib.sha256(), 0
    tmp = target.with_name(f".{target.name}.part")
    with tmp.open("wb") as writer:
        while block := reader.read(_CHUNK):
            digest.update(block)
            writer.write(block)
            size += len(block)
    os.replace(tmp, target)
    return FileDigest(size, digest.hexdigest())


def pull_archive(source: str, dest: Path, tokenizer_only: bool, sha256: str | None) -> PullRecord:
    staging = dest / STAGING
    archive = fetch(source, staging)
    if sha256 is not None and sha256_of(archive).lower() != sha256.lower():
        if archive.is_relative_to(staging):
            archive.unlink()  # a rerun fetches it anew
        raise PullError("model_checksum_mismatch", f"{source}: the archive's sha256 differs")
    files = _extract(archive, dest, tokenizer_only)
    check_usable(files, tokenizer_only, source)
    shutil.rmtree(staging, ignore_errors=True)
    record = PullRecord(source=source, tokenizer_only=tokenizer_only, files=files)
    return finish(dest, record)
