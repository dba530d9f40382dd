"""platform/k8s operations: engines are scraped with their token, the autoscaler reads a gauge
engines export, the dashboard queries only series Atrium exports, no tier is a single point,
every tier drains for as long as the longest response may run, and each version's migration Job
is a new object (an upgrade is a plain apply)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

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
    kubectl,
    pod_labels,
    pod_spec,
    render,
    selects,
)
from web.engine_api import metrics as engine_metrics
from web.ops.metrics import GatewayMetrics
from web.settings import Settings

DASHBOARD = K8S / "components" / "monitoring" / "atrium-dashboard.json"


def _exported_series() -> set[str]:
    """Every series name gateways and engines export (counters with _total, histograms' parts)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names = set()
    for metric in GatewayMetrics(per_tenant=True).registry.collect():
        names |= {metric.name + suffix for suffix in suffixes[metric.type]}
    for constant in vars(engine_metrics).values():
        if isinstance(constant, str) and constant.startswith("vllm:"):
            names.add(constant)
    return names


def test_engines_are_scraped_with_the_engine_token_they_check() -> None:
    objects = render("prod")
    parts = by_component(objects)
    monitors = {o["metadata"]["name"]: o for o in objects if o["kind"] == "PodMonitor"}
    engine_monitor = monitors["atrium-engines"]
    assert selects(engine_monitor["spec"]["selector"], pod_labels(parts["engine"]))
    (endpoint,) = engine_monitor["spec"]["podMetricsEndpoints"]
    (engine,) = containers(parts["engine"], init=False)
    assert endpoint["port"] in {p["name"] for p in engine["ports"]}
    token = env_of(engine)["ATRIUM_ENGINE_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert endpoint["authorization"]["type"] == "Bearer"
    assert endpoint["authorization"]["credentials"] == {"name": token["name"], "key": token["key"]}
    for component in ("gateway", "router"):
        (monitor,) = [
            m
            for m in monitors.values()
            if selects(m["spec"]["selector"], pod_labels(parts[component]))
        ]
        ports = {p["name"] for c in containers(parts[component]) for p in c.get("ports", [])}
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports


def test_the_autoscaler_scales_engines_on_their_queue() -> None:
    objects = render("prod-autoscale")
    engine = by_component(objects)["engine"]
    scaled = find(objects, "ScaledObject", "atrium-engine")
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", engine["metadata"]["name"])
    assert scaled["metadata"]["namespace"] == engine["metadata"]["namespace"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert engine_metrics.WAITING in trigger["metadata"]["query"]
    assert float(trigger["metadata"]["threshold"]) > 0
    assert "replicas" not in engine["spec"], "an apply would undo the autoscaler"
    assert 1 < scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]
    assert "replicas" in by_component(render("prod"))["engine"]["spec"]  # fixed without it


def test_the_dashboard_asks_only_for_series_atrium_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    functions = {"sum", "rate", "histogram_quantile", "max", "by", "le", "tenant", "pod"}
    exported = _exported_series()
    used = set()
    for expr in exprs:
        without_labels = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\([^()]*\)\s*\(", " ", expr)
        used |= {n for n in re.findall(r"[a-z_:][a-z0-9_:]*", without_labels)} - functions
    used -= {"status", "reason", "endpoint"}
    assert used and used <= exported, used - exported
    # The per-tenant panels have per-tenant series to show where the dashboard ships.
    config = find(render("prod"), "ConfigMap", "atrium-config")["data"]
    assert config["ATRIUM_METRICS_TENANT_LABELS"] == "true"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("per tenant", "first token", "inter-token", "queue", "kv cache", "refusals"):
        assert topic in titles, topic
    assert any("0.99" in e for e in exprs) and any("0.5" in e for e in exprs)


def test_the_dashboard_is_shipped_for_grafanas_sidecar() -> None:
    config = find(render("prod"), "ConfigMap", "atrium-grafana-dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config["data"]["atrium-dashboard.json"]) == json.loads(DASHBOARD.read_text())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_metrics_and_admin_stay_off_the_public_service(overlay: str) -> None:
    objects = render(overlay)
    gateway = by_component(objects)["gateway"]
    (main,) = containers(gateway, init=False)
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert int(env_of(main)["ATRIUM_INTERNAL_PORT"]["value"]) == ports["internal"]
    service = find(objects, "Service", "atrium-gateway")
    exposed = {p.get("targetPort") for p in service["spec"]["ports"]}
    assert exposed == {"http"} and ports["internal"] != ports["http"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):  # health answers on both
        assert main[probe]["httpGet"]["port"] == "http"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_tier_is_a_single_point(overlay: str) -> None:
    objects = render(overlay)
    parts = by_component(objects)
    router = parts["router"]
    assert router["spec"]["replicas"] >= 2
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    (budget,) = [b for b in budgets if selects(b["spec"]["selector"], pod_labels(router))]
    assert budget["spec"]["minAvailable"] >= 1
    engine = pod_spec(parts["engine"])
    spread = {c["topologyKey"]: c for c in engine["topologySpreadConstraints"]}
    by_node = spread["kubernetes.io/hostname"]
    assert by_node["maxSkew"] == 1 and by_node["whenUnsatisfiable"] == "DoNotSchedule"
    assert selects(by_node["labelSelector"], pod_labels(parts["engine"]))
    assert not selects(by_node["labelSelector"], pod_labels(parts["gateway"]))
    anti = engine.get("affinity", {}).get("podAntiAffinity")
    assert (anti is not None) == ("engine-anti-affinity" in overlay)
    if anti:
        (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert selects(term["labelSelector"], pod_labels(parts["engine"]))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_tier_drains_for_the_longest_response_allowed(overlay: str) -> None:
    objects = render(overlay)
    parts = by_component(objects)
    config = find(objects, "ConfigMap", "atrium-config")["data"]
    longest = float(config.get("ATRIUM_MAX_STREAM_S", Settings().max_stream_s))
    assert longest == Settings().max_stream_s == 600.0
    for component in ("gateway", "engine"):
        (main,) = containers(parts[component], init=False)
        drain = float(env_of(main)["ATRIUM_DRAIN_GRACE_S"]["value"])
        pre_stop = int(main["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert drain >= longest, component
        # Room after the drain to abort leftovers and flush usage (5 s in the service, then I/O).
        grace = pod_spec(parts[component])["terminationGracePeriodSeconds"]
        assert grace >= pre_stop + drain + 20, component
    (router,) = containers(parts["router"])
    args = router["args"]
    router_drain = int(args[args.index("--shutdown-grace-period-secs") + 1])
    assert router_drain >= longest
    assert int(args[args.index("--request-timeout-secs") + 1]) >= longest
    assert pod_spec(parts["router"])["terminationGracePeriodSeconds"] >= router_drain + 5


def _job_name_and_tag(objects: tuple[Obj, ...]) -> tuple[str, str]:
    migrate = by_component(objects)["migrate"]
    (container,) = containers(migrate)
    return migrate["metadata"]["name"], container["image"].rpartition(":")[2]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_migration_job_is_named_for_its_version(overlay: str) -> None:
    name, tag = _job_name_and_tag(render(overlay))
    assert name == f"atrium-migrate-{tag}"
    # A Job's name is also the value of its pods' job-name label: 63 characters at most.
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name), name
    migrate = by_component(render(overlay))["migrate"]
    assert 0 < migrate["spec"]["ttlSecondsAfterFinished"] <= 24 * 3600  # old versions' Jobs go


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_a_new_image_tag_gives_a_new_migration_job(overlay: str, tmp_path: Path) -> None:
    """What an upgrade changes (the tag in `images:`, behind a registry with a port) renames the
    Job, so `kubectl apply -k` creates it instead of editing the finished one (refused)."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    path = copy / "overlays" / overlay / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    images = kustomization.setdefault("images", [])
    cpu = next((i for i in images if i["name"] == "atrium-cpu"), None)
    if cpu is None:
        cpu = {"name": "atrium-cpu"}
        images.append(cpu)
    cpu.update(newName="registry.example.com:5000/atrium/atrium-cpu", newTag="0.2.0-rc.1")
    path.write_text(yaml.safe_dump(kustomization))
    done = subprocess.run(
        [kubectl(), "kustomize", str(path.parent)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    objects = tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)
    assert _job_name_and_tag(objects) == ("atrium-migrate-0.2.0-rc.1", "0.2.0-rc.1")
    assert _job_name_and_tag(render(overlay))[0] != "atrium-migrate-0.2.0-rc.1"
