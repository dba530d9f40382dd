"""platform/k8s models: engines pull the chosen model into their volume and load it read-only;
gateways pull config and tokenizer files only and never mount the weights; GPU engines ask for
the NVIDIA runtime and GPU nodes."""

from __future__ import annotations

import re

import pytest

from tests.support.kustomize import (
    OVERLAYS,
    Obj,
    by_component,
    containers,
    env_of,
    find,
    pod_spec,
    render,
)
from web.cli import build_parser

WITH_MODELS = [o for o in OVERLAYS if o.startswith("prod")]


def _init(workload: Obj, name: str) -> Obj:
    (found,) = [c for c in pod_spec(workload).get("initContainers", []) if c["name"] == name]
    return found


def _mounts(container: Obj) -> dict[str, Obj]:
    return {m["name"]: m for m in container.get("volumeMounts", [])}


def _volume(workload: Obj, name: str) -> Obj:
    (found,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == name]
    return found


def _expand(text: str, container: Obj) -> str:
    """``text`` with each $(VAR) replaced by where the container's VAR comes from (a ConfigMap
    key, written NAME/KEY with the generated name's hash left off), as Kubernetes expands it."""
    for name, entry in env_of(container).items():
        ref = entry.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            configmap = ref["name"].rsplit("-", 1)[0] if ref["name"] != "atrium-config" else ""
            text = text.replace(f"$({name})", f"{configmap}/{ref['key']}")
    return text


def _pull_args(container: Obj) -> list[str]:
    return [_expand(a, container) for a in container["args"]]


def _loads_from(container: Obj) -> str:
    """The model path an Atrium container serves: its own ATRIUM_MODEL, expanded."""
    names = list(env_of(container))
    model = env_of(container)["ATRIUM_MODEL"]["value"]
    # Kubernetes expands only variables defined before the entry that uses them.
    for used in re.findall(r"\$\((\w+)\)", model):
        assert names.index(used) < names.index("ATRIUM_MODEL"), used
    return _expand(model, container)


@pytest.mark.parametrize("overlay", WITH_MODELS)
def test_engines_pull_the_chosen_model_then_load_it_read_only(overlay: str) -> None:
    objects = render(overlay)
    engine = by_component(objects)["engine"]
    pull = _init(engine, "pull-model")
    argv = _pull_args(pull)
    assert argv[:2] == ["model", "pull"] and "--tokenizer-only" not in argv
    args = build_parser().parse_args(argv)
    assert args.source == "atrium-model/source"
    assert args.revision == "atrium-model/revision"  # pinned in the ConfigMap, not left out
    (model,) = [o for o in objects if o["metadata"]["name"].startswith("atrium-model-")]
    assert model["data"]["source"] and model["data"]["revision"]
    token = env_of(pull)["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert token["name"] == "atrium-hf-token" and token.get("optional") is True
    (main,) = containers(engine, init=False)
    pulled_to = _loads_from(main)
    assert pulled_to == str(args.dest) == "/models/atrium-model/source@atrium-model/revision"
    assert "ATRIUM_MODEL" not in find(objects, "ConfigMap", "atrium-config")["data"]
    mount = _mounts(main)["models"]
    assert pulled_to.startswith(mount["mountPath"] + "/") and mount["readOnly"] is True
    assert _mounts(pull)["models"].get("readOnly") is not True
    volume = _volume(engine, "models")
    if "+model-per-pod" in overlay:
        claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
        assert claim["accessModes"] == ["ReadWriteOnce"]
        assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    else:
        name = volume["persistentVolumeClaim"]["claimName"]
        claim = find(objects, "PersistentVolumeClaim", name)["spec"]
        assert claim["accessModes"] == ["ReadWriteMany"]  # one copy for every engine


@pytest.mark.parametrize("overlay", WITH_MODELS)
def test_gateways_get_the_tokenizer_only_and_never_the_weights(overlay: str) -> None:
    objects = render(overlay)
    parts = by_component(objects)
    gateway = parts["gateway"]
    pull = _init(gateway, "pull-tokenizer")
    argv = _pull_args(pull)
    args = build_parser().parse_args(argv)
    assert args.tokenizer_only and args.source == "atrium-model/source"
    assert args.revision == "atrium-model/revision"
    engine_args = build_parser().parse_args(_pull_args(_init(parts["engine"], "pull-model")))
    assert str(args.dest) == str(engine_args.dest)  # the same ATRIUM_MODEL path as engines
    (main,) = containers(gateway, init=False)
    assert _loads_from(main) == str(args.dest)
    volume = _volume(gateway, "models")
    assert "emptyDir" in volume and "persistentVolumeClaim" not in volume
    claims = [v for v in pod_spec(gateway)["volumes"] if "persistentVolumeClaim" in v]
    assert claims == []
    assert _mounts(main)["models"]["readOnly"] is True


def test_dev_serves_the_bundled_model_without_pulls() -> None:
    objects = render("dev")
    assert find(objects, "ConfigMap", "atrium-config")["data"]["ATRIUM_MODEL"] == "default"
    for workload in by_component(objects).values():
        names = [c["name"] for c in pod_spec(workload).get("initContainers", [])]
        assert not [n for n in names if n.startswith("pull-")]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_engines_ask_for_the_nvidia_runtime_and_gpu_nodes(overlay: str) -> None:
    objects = render(overlay)
    parts = by_component(objects)
    engine = pod_spec(parts["engine"])
    if overlay.startswith("prod"):
        assert engine["runtimeClassName"] == "nvidia"
        assert engine["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    else:
        assert "runtimeClassName" not in engine and "nodeSelector" not in engine
    for component in ("gateway", "router", "migrate"):
        assert "runtimeClassName" not in pod_spec(parts[component]), component


def test_engine_kernels_are_built_after_the_pull_for_the_engines_own_targets() -> None:
    engine = by_component(render("prod+engine-kernels"))["engine"]
    spec = pod_spec(engine)
    assert [c["name"] for c in spec["initContainers"]] == ["pull-model", "build-kernels"]
    (build,) = [c for c in spec["initContainers"] if c["name"] == "build-kernels"]
    (serve,) = [c for c in spec["containers"] if c["name"] == "engine"]
    # FlashInfer names its cache folder by the targets: the engine must look where they went.
    build_env = {e["name"]: e.get("value") for e in build["env"]}
    serve_env = {e["name"]: e.get("value") for e in serve["env"]}
    assert build_env["FLASHINFER_CUDA_ARCH_LIST"] == serve_env["FLASHINFER_CUDA_ARCH_LIST"]
    assert build_env["ATRIUM_MODEL"] == serve_env["ATRIUM_MODEL"]
    mounts = {m["name"]: m["mountPath"] for m in build["volumeMounts"]}
    served = {m["name"]: m["mountPath"] for m in serve["volumeMounts"]}
    assert mounts["cache"] == served["cache"] and mounts["models"] == served["models"]
    args = build_parser().parse_args(build["args"])
    assert (args.command, args.kernels_command, args.check, args.dry_run) == (
        "kernels", "build", False, False,
    )  # fmt: skip
