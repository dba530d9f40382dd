"""Install what the GPU machine lacks from the offline bundle, one wheel at a time, loudly.

``python -m bench.gpu_install BUNDLE SITE VERSIONS_JSON``: a wheel is skipped when its module
already imports (at the bundle's version, where that matters); the first failure stops the run.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def fail(message: str) -> None:
    print(f"gpu_install: FAILED: {message}", file=sys.stderr)
    raise SystemExit(1)


def present_version(module: str) -> str | None:
    """The installed distribution's version of ``module``, or None when it cannot be found."""
    if importlib.util.find_spec(module) is None:
        return None
    dists = importlib.metadata.packages_distributions().get(module, [])
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def wheels_for_this_python(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if f"{sys.version_info.major}.{sys.version_info.minor}" not in manifest["pythons"]:
        fail(
            f"the bundle holds wheels for Python {manifest['pythons']}, this is {tag}: "
            f"rebuild it with python -m bench.gpu_bundle --python {tag[2]}.{tag[3:]}"
        )
    return [w for w in manifest["wheels"] if w["file"].split("/")[1] in ("any", tag)]


def install(bundle: Path, site: Path) -> list[dict[str, Any]]:
    manifest_path = bundle / "manifest.json"
    if not manifest_path.is_file():
        fail(f"no {manifest_path}: build the bundle with python -m bench.gpu_bundle")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    report, missing = [], []
    for wheel in wheels_for_this_python(manifest):
        path = bundle / wheel["file"]
        if not path.is_file():
            fail(f"{path} is missing from the bundle")
        if hashlib.sha256(path.read_bytes()).hexdigest() != wheel["sha256"]:
            fail(f"{path} does not match the manifest's sha256")
        found = present_version(wheel["module"])
        if found is not None and (not wheel["exact"] or found == wheel["version"]):
            report.append({"module": wheel["module"], "version": found, "installed": False})
        else:
            missing.append(wheel)
            report.append(
                {"module": wheel["module"], "version": wheel["version"], "installed": True}
            )
    if missing:  # one pip call: separate --target installs would replace each other's bin/
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
        ]
        cmd.append("--target")
        paths = [str(bundle / w["file"]) for w in missing]
        if subprocess.run([*cmd, str(site), *paths], check=False).returncode != 0:
            fail(f"pip could not install {[Path(p).name for p in paths]}")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    for wheel in missing:
        check = [sys.executable, "-c", f"import {wheel['module']}"]
        done = subprocess.run(check, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            fail(f"{wheel['module']} does not import after installing:\n{done.stderr[-3000:]}")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3:
        fail("usage: python -m bench.gpu_install BUNDLE SITE VERSIONS_JSON")
    bundle, site, versions = Path(args[0]), Path(args[1]), Path(args[2])
    site.mkdir(parents=True, exist_ok=True)
    report = install(bundle, site)
    versions.write_text(json.dumps({"python": sys.version, "packages": report}, indent=1) + "\n")
    for row in report:
        how = "installed" if row["installed"] else "present"
        print(f"  {row['module']:<20} {row['version']:<20} {how}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
