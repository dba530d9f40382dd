"""platform/k8s: every overlay renders, each object is valid for the pinned Kubernetes versions,
and the rules an operator relies on hold (resources, probes, non-root, pinned images, wiring).

Custom resources (PodMonitor, ScaledObject) are not in kubernetes-validate's schemas, and no
installed package ships their CRDs: they are checked against minimal structural JSON schemas in
crd_schemas/, written by hand from the field lists the Prometheus operator and KEDA publish in
their CRDs. These catch a misspelt or misplaced field, a wrong type, a missing required field; not
every rule the real CRDs enforce.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support.kustomize import (
    K8S,
    OVERLAYS,
    Obj,
    by_component,
    containers,
    env_of,
    find,
    overlay_dir,
    pod_labels,
    pod_spec,
    render,
    selects,
    workloads,
)
from web.cli import build_parser
from web.settings import Settings

# The oldest Kubernetes the manifests support and the newest whose schemas are bundled.
KUBERNETES_VERSIONS = ("1.32.0", "1.37.0")
LONG_RUNNING = ("Deployment", "StatefulSet", "DaemonSet")
# Custom resources, checked against a structural JSON schema of their CRD (crd_schemas/: written
# from the CRD's published field list, since kubernetes-validate knows core kinds only).
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.schema.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.schema.json",
}
SCHEMA_DIR = Path(__file__).parent / "crd_schemas"
ATRIUM_IMAGES = ("atrium:", "atrium-cpu:")


def validate(obj: Obj, version: str) -> None:
    """Raises when ``obj`` is not valid for Kubernetes ``version`` (or for its CRD)."""
    schema_file = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if schema_file is None:
        # strict: a misspelt or misplaced field is an error, not silently dropped.
        kubernetes_validate.validate(obj, version, strict=True)
        return
    schema = json.loads((SCHEMA_DIR / schema_file).read_text())
    jsonschema.validate(obj, schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_for_kubernetes(overlay: str, version: str) -> None:
    errors = []
    for obj in render(overlay):
        try:
            validate(obj, version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message}")
    assert errors == []


def test_the_crd_schemas_refuse_what_the_operators_would() -> None:
    """The structural schemas are strict: a misspelt field or a missing target fails."""
    monitor = next(o for o in render("prod") if o["kind"] == "PodMonitor")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    for broken in (
        {**monitor, "spec": {**monitor["spec"], "selectr": {}}},
        {**monitor, "spec": {"podMetricsEndpoints": [endpoint]}},  # no selector
        {**monitor, "spec": {**monitor["spec"], "podMetricsEndpoints": [{"interval": "15 s"}]}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            validate(broken, KUBERNETES_VERSIONS[0])
    scaled = next(o for o in render("prod-autoscale") if o["kind"] == "ScaledObject")
    with pytest.raises(jsonschema.ValidationError):
        validate({**scaled, "spec": {**scaled["spec"], "triggers": []}}, KUBERNETES_VERSIONS[0])


def test_the_example_secrets_are_valid_and_name_every_key_prod_reads() -> None:
    examples = [
        yaml.safe_load(path.read_text())
        for path in sorted((K8S / "overlays" / "prod").glob("*.example.yaml"))
    ]
    for example in examples:
        kubernetes_validate.validate(example, KUBERNETES_VERSIONS[0], strict=True)
    referenced = _secret_refs(render("prod"))
    shown = {(e["metadata"]["name"], key) for e in examples for key in e["stringData"]}
    assert referenced == shown
    assert not [o for o in render("prod") if o["kind"] == "Secret"], "prod holds no secret"


def test_dev_generates_every_secret_key_it_reads() -> None:
    objects = render("dev")
    for name, key in _secret_refs(objects):
        assert key in find(objects, "Secret", name)["data"], f"{name} lacks {key}"


def test_every_podmonitor_secret_is_one_prod_expects() -> None:
    objects = render("prod")
    referenced = _secret_refs(objects)
    for monitor in (o for o in objects if o["kind"] == "PodMonitor"):
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            credentials = endpoint.get("authorization", {}).get("credentials")
            if credentials:
                assert (credentials["name"], credentials["key"]) in referenced


@pytest.mark.parametrize(
    "folder",
    [K8S / "base", *sorted((K8S / "overlays").iterdir()), *sorted((K8S / "components").iterdir())],
    ids=lambda folder: f"{folder.parent.name}/{folder.name}",
)
def test_every_file_is_part_of_a_kustomization(folder: Path) -> None:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    used = set(kustomization.get("resources", []))
    used |= {patch["path"] for patch in kustomization.get("patches", []) if "path" in patch}
    for generator in kustomization.get("configMapGenerator", []):
        used |= set(generator.get("files", []))
    files = {p.name for p in folder.iterdir() if p.is_file()} - {"kustomization.yaml"}
    assert {f for f in files - used if not f.endswith(".example.yaml")} == set()


def test_every_overlay_and_component_is_rendered_by_the_tests() -> None:
    rendered = {part for overlay in OVERLAYS for part in overlay.split("+")}
    assert {p.name for p in (K8S / "overlays").iterdir()} <= rendered
    for overlay in OVERLAYS:
        kustomization = yaml.safe_load((overlay_dir(overlay) / "kustomization.yaml").read_text())
        rendered |= {Path(c).name for c in kustomization.get("components", [])}
    assert {p.name for p in (K8S / "components").iterdir()} <= rendered


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_have_resources_probes_and_run_as_non_root(overlay: str) -> None:
    problems = []
    for workload in workloads(render(overlay)):
        pod = pod_spec(workload)
        pod_security = pod.get("securityContext", {})
        for container in containers(workload):
            where = f"{workload['metadata']['name']}/{container['name']}"
            resources = container.get("resources", {})
            requests, limits = resources.get("requests", {}), resources.get("limits", {})
            if not {"cpu", "memory"} <= set(requests) or "memory" not in limits:
                problems.append(f"{where}: needs cpu and memory requests and a memory limit")
            security = container.get("securityContext", {})
            merged = {**pod_security, **security}
            if merged.get("runAsNonRoot") is not True or merged.get("runAsUser", 0) == 0:
                problems.append(f"{where}: must run as a non-root user id")
            if security.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: allowPrivilegeEscalation must be false")
            if security.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: the root file system must be read-only")
            if "ALL" not in security.get("capabilities", {}).get("drop", []):
                problems.append(f"{where}: must drop all capabilities")
            if merged.get("seccompProfile", {}).get("type") != "RuntimeDefault":
                problems.append(f"{where}: needs the RuntimeDefault seccomp profile")
        if workload["kind"] in LONG_RUNNING:
            for container in containers(workload, init=False):
                where = f"{workload['metadata']['name']}/{container['name']}"
                for probe in ("readinessProbe", "livenessProbe"):
                    if probe not in container:
                        problems.append(f"{where}: no {probe}")
                    elif not _probe_port_exists(container, container[probe]):
                        problems.append(f"{where}: {probe} names a port the container lacks")
    assert problems == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned(overlay: str) -> None:
    for workload in workloads(render(overlay)):
        for container in containers(workload):
            image = container["image"]
            name, _, tag = image.rpartition(":")
            pinned = "@sha256:" in image or (bool(name) and "/" not in tag and tag != "latest")
            assert pinned, f"{container['name']}: {image} has no fixed tag"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_their_pods_and_ports(overlay: str) -> None:
    objects = render(overlay)
    for service in (o for o in objects if o["kind"] == "Service"):
        targets = [w for w in workloads(objects) if selects(_as_selector(service), pod_labels(w))]
        assert len(targets) == 1, f"Service {service['metadata']['name']} selects {len(targets)}"
        names = {p.get("name") for c in containers(targets[0]) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port.get("targetPort", port["port"]) in names | _numbers(targets[0])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_and_autoscaler_cover_gateways_and_engines(overlay: str) -> None:
    objects = render(overlay)
    parts = by_component(objects)
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    for component in ("gateway", "engine"):
        labels = pod_labels(parts[component])
        assert [b for b in budgets if selects(b["spec"]["selector"], labels)], component
    autoscaler = find(objects, "HorizontalPodAutoscaler", "atrium-gateway")
    assert autoscaler["spec"]["scaleTargetRef"]["name"] == parts["gateway"]["metadata"]["name"]
    assert "replicas" not in parts["gateway"]["spec"], "a re-apply would undo the autoscaler"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_answer_health_and_have_time_to_drain(overlay: str) -> None:
    engine = by_component(render(overlay))["engine"]
    (container,) = containers(engine, init=False)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    drain = float(env_of(container)["ATRIUM_DRAIN_GRACE_S"]["value"])
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod_spec(engine)["terminationGracePeriodSeconds"] >= pre_stop + drain + 10
    gpus = container["resources"]["limits"].get("nvidia.com/gpu")
    # prod serves from GPUs; dev runs the default model on the CPU of any cluster.
    assert gpus == (1 if overlay.startswith("prod") else None)
    assert container["resources"]["requests"].get("nvidia.com/gpu") == gpus
    if gpus is None:  # a CPU engine's KV pool must fit its memory limit, named explicitly
        kv_bytes = int(env_of(container)["ATRIUM_KV_CACHE_BYTES"]["value"])
        limit = _bytes(container["resources"]["limits"]["memory"])
        assert kv_bytes <= limit // 2


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_follow_public_prefixes_from_the_gateway_service(overlay: str) -> None:
    objects = render(overlay)
    parts = by_component(objects)
    (engine,) = containers(parts["engine"], init=False)
    url = env_of(engine)["ATRIUM_GATEWAY_URL"]["value"]
    found = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", url)
    assert found is not None, url
    service = find(objects, "Service", found.group(1))
    assert int(found.group(2)) in [p["port"] for p in service["spec"]["ports"]]
    assert selects(_as_selector(service), pod_labels(parts["gateway"]))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_discovers_engines_with_the_rights_it_has(overlay: str) -> None:
    objects = render(overlay)
    parts = by_component(objects)
    router, engine = parts["router"], parts["engine"]
    (container,) = containers(router)
    args = container["args"]
    assert args[0] == "launch" and "--service-discovery" in args
    labels = dict(_values_after(args, "--selector"))
    assert selects({"matchLabels": labels}, pod_labels(engine))
    assert not selects({"matchLabels": labels}, pod_labels(parts["gateway"]))
    engine_port = containers(engine).__next__()["ports"][0]["containerPort"]
    assert _value_after(args, "--service-discovery-port") == str(engine_port)
    assert _value_after(args, "--service-discovery-namespace") == "$(POD_NAMESPACE)"
    field = env_of(container)["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert field == "metadata.namespace"
    # The engine token guards the router too, and it is the one engines check.
    assert _value_after(args, "--api-key") == "$(ATRIUM_ENGINE_TOKEN)"
    token = env_of(container)["ATRIUM_ENGINE_TOKEN"]["valueFrom"]["secretKeyRef"]["key"]
    (engine_container,) = containers(engine, init=False)
    assert env_of(engine_container)["ATRIUM_ENGINE_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == (
        token
    )
    account = pod_spec(router)["serviceAccountName"]
    binding = find(objects, "RoleBinding", "atrium-router")
    assert {"kind": "ServiceAccount", "name": account} in [
        {"kind": s["kind"], "name": s["name"]} for s in binding["subjects"]
    ]
    role = find(objects, "Role", binding["roleRef"]["name"])
    pods_rule = [r for r in role["rules"] if "pods" in r["resources"]]
    assert pods_rule and {"get", "list", "watch"} <= set(pods_rule[0]["verbs"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateways_reach_the_router_and_wait_for_the_migration(overlay: str) -> None:
    objects = render(overlay)
    parts = by_component(objects)
    gateway, migrate = parts["gateway"], parts["migrate"]
    (main,) = containers(gateway, init=False)
    url = _value_after(main["args"], "--engine-url")
    host, port = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", url).groups()  # type: ignore[union-attr]
    service = find(objects, "Service", host)
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    assert selects(_as_selector(service), pod_labels(parts["router"]))
    (job_container,) = containers(migrate)
    assert job_container["args"] == ["db", "upgrade"]
    (wait,) = [c for c in pod_spec(gateway)["initContainers"] if c["name"] == "wait-for-schema"]
    assert "atrium db check" in " ".join(wait["command"])
    database = {
        env_of(c)["ATRIUM_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["key"]
        for c in (main, wait, job_container)
    }
    assert len(database) == 1, "the job, the wait and the gateway must use one database"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_atrium_command_lines_parse_and_name_real_settings(overlay: str) -> None:
    objects = render(overlay)
    parser = build_parser()
    fields = {"ATRIUM_" + name.upper() for name in Settings.__struct_fields__}
    checked = 0
    for workload in workloads(objects):
        for container in containers(workload):
            if not container["image"].rpartition("/")[2].startswith(ATRIUM_IMAGES):
                continue
            argv = container.get("args")
            if argv is None:  # a shell loop around `atrium ...`
                found = re.search(r"\batrium ([a-z0-9 -]+)", container["command"][-1])
                assert found, f"{container['name']}: no atrium command"
                argv = found.group(1).split()
            try:
                parser.parse_args(argv)
            except SystemExit:
                pytest.fail(f"{container['name']}: `atrium {' '.join(argv)}` does not parse")
            unknown = {n for n in env_of(container) if n.startswith("ATRIUM_")} - fields
            assert unknown == set(), f"{container['name']}: no such settings {unknown}"
            checked += 1
    # The gateway, its wait for the schema, the engine, the migration job; with a model of one's
    # own, the engine's and the gateway's pulls too, and with engine-kernels its kernel build.
    engine = pod_spec(by_component(objects)["engine"])
    pulls = 2 if "models" in [v["name"] for v in engine["volumes"]] else 0
    builds = sum(c["name"] == "build-kernels" for c in engine.get("initContainers", []))
    assert checked == 4 + pulls + builds and builds == ("engine-kernels" in overlay)
    # The ConfigMaps every Atrium container reads whole (envFrom) hold settings only.
    read_whole = {
        source["configMapRef"]["name"]
        for workload in workloads(objects)
        for container in containers(workload)
        for source in container.get("envFrom", [])
        if "configMapRef" in source
    }
    assert "atrium-config" in read_whole
    for name in read_whole:
        assert set(find(objects, "ConfigMap", name)["data"]) <= fields


def _secret_refs(objects: tuple[Obj, ...]) -> set[tuple[str, str]]:
    refs = set()
    for workload in workloads(objects):
        for container in containers(workload):
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.add((ref["name"], ref["key"]))
    return refs


def _probe_port_exists(container: Obj, probe: Obj) -> bool:
    action = probe.get("httpGet") or probe.get("tcpSocket")
    if action is None:
        return "exec" in probe
    declared = {p.get("name") for p in container.get("ports", [])}
    declared |= {p["containerPort"] for p in container.get("ports", [])}
    return action["port"] in declared


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity.removesuffix(suffix)) * factor
    return int(quantity)


def _numbers(workload: Obj) -> set[int]:
    return {p["containerPort"] for c in containers(workload) for p in c.get("ports", [])}


def _as_selector(service: Obj) -> Obj:
    return {"matchLabels": service["spec"]["selector"]}


def _value_after(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _values_after(args: list[str], flag: str) -> list[tuple[str, str]]:
    values = []
    for arg in args[args.index(flag) + 1 :]:
        if arg.startswith("--"):
            break
        key, _, value = arg.partition("=")
        values.append((key, value))
    return values
