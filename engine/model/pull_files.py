"""What a model pull keeps, the record it writes last, and the copy from a local folder.

Only safetensors, config and tokenizer files are kept; ``tokenizer_only`` keeps config and
tokenizer files (what a gateway loads). ``.atrium-pull.json`` is written last: a folder without it
is not pulled yet.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import msgspec

RECORD = ".atrium-pull.json"
# What `load_tokenizer` reads: config.json (eos ids, the folder's kind) and the tokenizer files.
CONFIG_FILES = frozenset({"config.json", "generation_config.json"})
TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "tokenizer.model",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    }
)
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
_CHUNK = 1 << 20


class PullError(Exception):
    """A pull that cannot go on; ``code`` is stable, the message says what to do."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class FileDigest(msgspec.Struct, frozen=True):
    size: int
    sha256: str


class PullRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What DEST holds and where it came from (written last, so its presence means complete)."""

    source: str
    revision: str | None = None  # as asked for (hub only)
    commit: str | None = None  # the commit it resolved to: every file is from this one
    tokenizer_only: bool = False
    files: dict[str, FileDigest]


def wanted(name: str, tokenizer_only: bool) -> bool:
    """Whether a file of the source belongs in DEST (top-level names only)."""
    if "/" in name or name.startswith("."):
        return False
    if name in CONFIG_FILES or name in TOKENIZER_FILES:
        return True
    return not tokenizer_only and any(fnmatch.fnmatchcase(name, p) for p in WEIGHT_PATTERNS)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def read_record(dest: Path) -> PullRecord | None:
    try:
        return msgspec.json.decode((dest / RECORD).read_bytes(), type=PullRecord)
    except (OSError, msgspec.DecodeError):
        return None


def is_complete(dest: Path, record: PullRecord | None) -> bool:
    """Every file the record names is there with its size (no hashing: a restart stays fast)."""
    if record is None or not record.files:
        return False
    for name, digest in record.files.items():
        try:
            if (dest / name).stat().st_size != digest.size:
                return False
        except OSError:
            return False
    return True


def finish(dest: Path, record: PullRecord) -> PullRecord:
    """Drop files an earlier pull left that this one does not hold, then write the record."""
    for path in dest.iterdir():
        if path.is_file() and wanted(path.name, False) and path.name not in record.files:
            path.unlink()
    tmp = dest / f"{RECORD}.tmp"
    tmp.write_bytes(msgspec.json.encode(record))
    os.replace(tmp, dest / RECORD)
    return record


def check_usable(names: Iterable[str], tokenizer_only: bool, source: str) -> None:
    """A model folder needs config.json, a tokenizer and (unless tokenizer-only) safetensors."""
    have = set(names)
    missing = []
    if "config.json" not in have:
        missing.append("config.json")
    if not have & {"tokenizer.json", "tokenizer.model"}:
        missing.append("tokenizer.json or tokenizer.model")
    if not tokenizer_only and not any(n.endswith(".safetensors") for n in have):
        missing.append("*.safetensors")
    if missing:
        raise PullError("model_files_missing", f"{source} has no {', '.join(missing)}")


def copy_verified(src: Path, dst: Path, expected: FileDigest | None = None) -> FileDigest:
    """Copy through a temporary file, hashing as it goes; a digest that differs is refused."""
    digest, size = hashlib.sha256(), 0
    tmp = dst.with_name(f".{dst.name}.part")
    with src.open("rb") as reader, tmp.open("wb") as writer:
        while block := reader.read(_CHUNK):
            digest.update(block)
            writer.write(block)
            size += len(block)
    got = FileDigest(size, digest.hexdigest())
    if expected is not None and got != expected:
        tmp.unlink()
        raise PullError("model_checksum_mismatch", f"{src}: {got} where {expected} was recorded")
    os.replace(tmp, dst)
    return got


def pull_local(source: str, dest: Path, tokenizer_only: bool) -> PullRecord:
    """Copy the kept files of a local model folder (checked against its own record, if any)."""
    folder = Path(source).expanduser().resolve()
    names = sorted(
        p.name for p in folder.iterdir() if p.is_file() and wanted(p.name, tokenizer_only)
    )
    check_usable(names, tokenizer_only, source)
    recorded = read_record(folder)
    files = {}
    for name in names:
        expected = recorded.files.get(name) if recorded is not None else None
        files[name] = copy_verified(folder / name, dest / name, expected)
    commit = recorded.commit if recorded is not None else None
    record = PullRecord(source=source, commit=commit, tokenizer_only=tokenizer_only, files=files)
    return finish(dest, record)
