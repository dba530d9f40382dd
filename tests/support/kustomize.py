"""Rendering platform/k8s overlays with `kubectl kustomize` and reading the objects they hold."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "platform" / "k8s"
# Overlays, and an overlay with optional components after a `+` each (rendered through a
# kustomization made for the test): every one is rendered and checked.
OVERLAYS = (
    "dev",
    "prod",
    "prod-autoscale",
    "prod+model-per-pod+engine-anti-affinity",
    "prod+engine-kernels",
)
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")

Obj = dict[str, Any]


def kubectl() -> str:
    """The kubectl binary; skipped on a developer machine without one, a failure in CI."""
    found = shutil.which("kubectl")
    if found is None:
        message = "kubectl (with its built-in kustomize) is not installed"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def overlay_dir(overlay: str) -> Path:
    """The overlay folder of an OVERLAYS entry (the part before any `+`)."""
    return K8S / "overlays" / overlay.partition("+")[0]


@functools.cache
def render(overlay: str) -> tuple[Obj, ...]:
    """Every object `kubectl kustomize platform/k8s/overlays/<overlay>` prints, offline; with
    `overlay+component+...`, that overlay with those components of platform/k8s/components."""
    name, *components = overlay.split("+")
    with tempfile.TemporaryDirectory() as folder:
        target = str(K8S / "overlays" / name)
        if components:
            # kustomize takes only relative paths to other kustomizations.
            up = os.path.relpath(K8S, folder)
            listed = "".join(f"  - {up}/components/{c}\n" for c in components)
            kustomization = "kind: Kustomization\napiVersion: kustomize.config.k8s.io/v1beta1\n"
            kustomization += f"resources:\n  - {up}/overlays/{name}\ncomponents:\n{listed}"
            Path(folder, "kustomization.yaml").write_text(kustomization)
            target = folder
        done = subprocess.run(
            [kubectl(), "kustomize", target],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def find(objects: tuple[Obj, ...], kind: str, name: str) -> Obj:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def workloads(objects: tuple[Obj, ...]) -> list[Obj]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def pod_labels(workload: Obj) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"].get("labels", {})
    return labels


def containers(workload: Obj, *, init: bool = True) -> Iterator[Obj]:
    spec = pod_spec(workload)
    yield from spec["containers"]
    if init:
        yield from spec.get("initContainers", [])


def by_component(objects: tuple[Obj, ...]) -> dict[str, Obj]:
    """Workloads keyed by their `app.kubernetes.io/component` label."""
    found: dict[str, Obj] = {}
    for workload in workloads(objects):
        component = pod_labels(workload)["app.kubernetes.io/component"]
        assert component not in found, f"two workloads are {component}"
        found[component] = workload
    return found


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against a label set."""
    if selector is None:
        return True
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        present = key in labels
        ok = {
            "In": present and labels.get(key) in values,
            "NotIn": not present or labels.get(key) not in values,
            "Exists": present,
            "DoesNotExist": not present,
        }[operator]
        if not ok:
            return False
    return True


def env_of(container: Obj) -> dict[str, Obj]:
    return {entry["name"]: entry for entry in container.get("env", [])}
