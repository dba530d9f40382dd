"""platform/k8s NetworkPolicies, evaluated as Kubernetes does for ingress: tenants reach only
gateways, only gateways reach the router, engines take requests only from the router and state
polls from gateways, and only gateways and the migration job reach the development PostgreSQL."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests.support.kustomize import (
    OVERLAYS,
    Obj,
    by_component,
    containers,
    pod_labels,
    render,
    selects,
)


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)  # named container ports


def _ingress_allowed(policies: list[Obj], source: Pod, target: Pod, port: int) -> bool:
    relevant = [
        p
        for p in policies
        if p["metadata"]["namespace"] == target.namespace
        and selects(p["spec"]["podSelector"], target.labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not relevant:
        return True  # a pod no policy selects is open
    for policy in relevant:
        for rule in policy["spec"].get("ingress", []):
            if not _port_matches(rule.get("ports"), target, port):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_matches(peer, source, target) for peer in peers):
                return True
    return False


def _port_matches(ports: list[Obj] | None, target: Pod, port: int) -> bool:
    if not ports:
        return True
    for entry in ports:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        wanted = entry.get("port")
        if wanted is None or wanted == port or target.ports.get(str(wanted)) == port:
            return True
    return False


def _peer_matches(peer: Obj, source: Pod, target: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # addresses are not modelled; the manifests use none
    namespaces = peer.get("namespaceSelector")
    namespace_labels = {"kubernetes.io/metadata.name": source.namespace}
    in_namespace = (
        source.namespace == target.namespace
        if namespaces is None
        else selects(namespaces, namespace_labels)
    )
    return in_namespace and selects(peer.get("podSelector") or {}, source.labels)


def _pods(overlay: str) -> tuple[dict[str, Pod], list[Obj]]:
    objects = render(overlay)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    pods = {}
    for component, workload in by_component(objects).items():
        namespace = workload["metadata"]["namespace"]
        named = {
            p["name"]: p["containerPort"]
            for c in containers(workload)
            for p in c.get("ports", [])
            if "name" in p
        }
        pods[component] = Pod(namespace, pod_labels(workload), named)
    any_namespace = next(iter(pods.values())).namespace
    pods["tenant"] = Pod("tenants", {"app": "client"})
    pods["neighbour"] = Pod(any_namespace, {"app": "debug"})
    pods["prometheus"] = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"})
    return pods, policies


# (source, target, target's named port): may the source open a connection?
EXPECTED = {
    ("tenant", "gateway", "http"): True,
    # /metrics, the admin API and the console: Prometheus only.
    ("tenant", "gateway", "internal"): False,
    ("neighbour", "gateway", "internal"): False,
    ("engine", "gateway", "internal"): False,
    ("prometheus", "gateway", "internal"): True,
    ("neighbour", "gateway", "http"): True,
    ("router", "gateway", "http"): True,
    ("engine", "gateway", "http"): True,  # the public-prefix feed
    ("tenant", "router", "http"): False,
    ("tenant", "engine", "http"): False,
    ("tenant", "postgres", "postgres"): False,
    ("gateway", "router", "http"): True,
    # The admin engine view: each engine's /atrium/v1/state, read with the engine token.
    ("gateway", "engine", "http"): True,
    ("gateway", "postgres", "postgres"): True,
    ("router", "engine", "http"): True,
    ("router", "postgres", "postgres"): False,
    ("engine", "router", "http"): False,
    ("engine", "engine", "http"): False,
    ("engine", "postgres", "postgres"): False,
    ("migrate", "postgres", "postgres"): True,
    ("migrate", "router", "http"): False,
    ("migrate", "engine", "http"): False,
    ("neighbour", "router", "http"): False,
    ("neighbour", "engine", "http"): False,
    ("neighbour", "postgres", "postgres"): False,
    ("prometheus", "router", "metrics"): True,
    ("prometheus", "router", "http"): False,
    ("prometheus", "engine", "http"): True,
    ("prometheus", "postgres", "postgres"): False,
}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_intended_callers_get_in(overlay: str) -> None:
    pods, policies = _pods(overlay)
    assert {"gateway", "router", "engine", "migrate"} <= set(pods)
    # dev brings its own PostgreSQL; prod uses an external one.
    assert ("postgres" in pods) == (overlay == "dev")
    # Every pod is isolated, those that serve nothing too (a pod no policy selects is open).
    for name in ("gateway", "router", "engine", "migrate", "postgres"):
        if name in pods:
            assert not _ingress_allowed(policies, pods["neighbour"], pods[name], 1), name
    wrong = []
    for (source, target, port_name), expected in EXPECTED.items():
        if target not in pods:
            continue
        port = pods[target].ports[port_name]
        if _ingress_allowed(policies, pods[source], pods[target], port) != expected:
            wrong.append(f"{source} -> {target}:{port_name} should be {expected}")
    assert wrong == []


def test_the_evaluator_tells_selected_pods_from_others() -> None:
    target = Pod("ns", {"role": "db"}, {"sql": 5432})
    allow_app = {
        "metadata": {"namespace": "ns"},
        "spec": {
            "podSelector": {"matchLabels": {"role": "db"}},
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": {"role": "app"}}}],
                    "ports": [{"port": "sql"}],
                }
            ],
        },
    }
    app, other = Pod("ns", {"role": "app"}), Pod("ns", {"role": "web"})
    assert _ingress_allowed([allow_app], app, target, 5432)
    assert not _ingress_allowed([allow_app], other, target, 5432)
    assert not _ingress_allowed([allow_app], app, target, 22)
    assert not _ingress_allowed([allow_app], Pod("elsewhere", {"role": "app"}), target, 5432)
    assert _ingress_allowed([], other, target, 5432)  # no policy selects it: open
