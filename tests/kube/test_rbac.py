"""Every request the operator makes is allowed by its RBAC in deploy/, in both of its modes: cluster-wide
(deploy/base/operator/rbac.yaml: a ClusterRole) and namespaced (deploy/overlays/namespaced: a Role in each watched
namespace, nothing cluster-wide).

The Kubernetes API double does no authorization, so this test does it: it runs the operator through what it does
on a cluster (publish, an annotation change, status from the real autoscaler, a refused duplicate and an HPA
conflict, a second model claimed, Events, delete with the finalizer and the replica restore) and a leader election
round, then checks each logged request — verb, API group, resource, subresource, namespace, name — against the
roles bound to the operator's service account, as the API server's RBAC authorizer would (``resourceNames``
included). A new call in kube/ without its rule fails here, naming the rule to add.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest
import yaml
from kubernetes import client as k8s
from nats.aio.client import Client

from kube import leader
from kube.records import MODEL_OWNERS_CONFIGMAP
from tests.k8s_api_double import ApiRequest, K8sApiDouble, k8s_api  # noqa: F401 - fixture
from tests.kube.test_deploy import build
from tests.kube.test_operator import NS, SO, Running, api_client, autoscaler, operator, put_slot, scaled_object
from warmpool import protocol
from warmpool.embedded import NatsServer

RBAC = Path(__file__).resolve().parents[2] / "deploy" / "base" / "operator" / "rbac.yaml"
OPERATOR_NAMESPACE = "pulsescale"  # where the operator runs: its Lease and the ConfigMap of model owners
SERVICE_ACCOUNT = (OPERATOR_NAMESPACE, "pulsescale-operator")
UNWATCHED = "elsewhere"  # a namespace the namespaced operator does not serve

Rule = dict[str, Any]


@dataclass
class Grants:
    """What the operator's service account may do: rules bound cluster-wide, and rules per namespace."""

    cluster: list[Rule] = field(default_factory=list)
    namespaced: dict[str, list[Rule]] = field(default_factory=dict)

    def allows(self, req: ApiRequest) -> bool:
        if not req.verb:
            return True  # discovery (/api, /apis, /version) is open to every authenticated user (system:discovery)
        if any(_matches(r, req) for r in self.cluster):
            return True
        return bool(req.namespace) and any(_matches(r, req) for r in self.namespaced.get(req.namespace, []))


def grants(docs: Iterable[dict[str, Any]], default_namespace: str = OPERATOR_NAMESPACE) -> Grants:
    """The rules bound to `SERVICE_ACCOUNT`, resolved as the RBAC authorizer does: a ClusterRoleBinding grants its
    ClusterRole everywhere, a RoleBinding its Role (or a ClusterRole) in the binding's namespace only. An object
    without a namespace (a raw file, before kustomize sets it) is in `default_namespace`."""
    docs = [d for d in docs if d]
    roles = {
        (d["kind"], d["metadata"].get("namespace", default_namespace) if d["kind"] == "Role" else "",
         d["metadata"]["name"]): d["rules"]
        for d in docs
        if d["kind"] in ("Role", "ClusterRole")
    }  # fmt: skip
    out = Grants()
    for b in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any((s.get("namespace"), s["name"]) == SERVICE_ACCOUNT for s in b["subjects"]):
            continue
        ref = b["roleRef"]
        if b["kind"] == "ClusterRoleBinding":
            out.cluster += roles[("ClusterRole", "", ref["name"])]
            continue
        ns = b["metadata"].get("namespace", default_namespace)
        rules = roles[(ref["kind"], ns if ref["kind"] == "Role" else "", ref["name"])]
        out.namespaced.setdefault(ns, []).extend(rules)
    return out


def cluster_wide() -> Grants:
    return grants(yaml.safe_load_all(RBAC.read_text()))


def namespaced() -> Grants:
    return grants(build("overlays/namespaced"))


def _matches(rule: Rule, req: ApiRequest) -> bool:
    resource = f"{req.resource}/{req.subresource}" if req.subresource else req.resource
    return (
        (req.group in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", []))
        and (resource in rule.get("resources", []) or "*" in rule.get("resources", []))
        and (req.verb in rule.get("verbs", []) or "*" in rule.get("verbs", []))
        and (not rule.get("resourceNames") or req.name in rule["resourceNames"])
    )


def request(verb: str, group: str, resource: str, namespace: str, name: str = "", sub: str = "") -> ApiRequest:
    return ApiRequest("", "", {}, "", "", verb, group, resource, sub, namespace, name)


def test_the_rbac_check_refuses_what_the_role_does_not_grant() -> None:
    grants = cluster_wide()
    assert not grants.allows(request("get", "", "secrets", "x", "s"))
    assert not grants.allows(request("delete", "pulsescale.io", "scaledobjects", "x", "s"))
    assert not grants.allows(request("get", "coordination.k8s.io", "leases", "x", "pulsescale-operator"))
    # In its own namespace: its own Lease and ConfigMap by name, no other (create cannot name one: allowed).
    assert grants.allows(request("update", "coordination.k8s.io", "leases", OPERATOR_NAMESPACE, "pulsescale-operator"))
    assert not grants.allows(request("update", "coordination.k8s.io", "leases", OPERATOR_NAMESPACE, "kube-scheduler"))
    assert not grants.allows(request("get", "coordination.k8s.io", "leases", OPERATOR_NAMESPACE, "other"))
    assert grants.allows(request("create", "coordination.k8s.io", "leases", OPERATOR_NAMESPACE))
    assert grants.allows(request("get", "", "configmaps", OPERATOR_NAMESPACE, MODEL_OWNERS_CONFIGMAP))
    assert not grants.allows(request("get", "", "configmaps", OPERATOR_NAMESPACE, "pulse-nats-config"))
    assert not grants.allows(request("update", "", "configmaps", OPERATOR_NAMESPACE, "pulse-nats-config"))
    assert not grants.allows(request("get", "", "configmaps", NS, MODEL_OWNERS_CONFIGMAP))


def test_the_namespaced_overlay_grants_nothing_outside_the_watched_namespaces() -> None:
    grants = namespaced()
    assert grants.cluster == []
    assert set(grants.namespaced) == {OPERATOR_NAMESPACE, NS, "research"}
    assert grants.allows(request("create", "", "pods", NS))
    assert not grants.allows(request("create", "", "pods", UNWATCHED))
    assert not grants.allows(request("create", "", "pods", OPERATOR_NAMESPACE))  # its own: only Lease, ConfigMap
    assert not grants.allows(request("list", "pulsescale.io", "scaledobjects", ""))  # no cluster-wide list
    assert not grants.allows(request("patch", "apps", "deployments", UNWATCHED, "web", "scale"))


async def exercise(running: Running, nc: Client) -> None:
    """What the operator does on a cluster, with a request of each kind it makes."""
    api = running.api
    api.patch("deployments", NS, "qwen", {"spec": {"replicas": 3}})  # made by operator() (kube/test_operator.py)
    api.create(SO, NS, scaled_object(advanced={"restoreToOriginalReplicaCount": True}))
    await running.wait_reported("qwen")
    api.patch(SO, NS, "qwen", {"metadata": {"annotations": {"autoscaling.keda.sh/paused": "true"}}})
    await running.wait_condition("qwen", "Paused", "True")
    api.create(SO, NS, scaled_object("second", model="llama", target="qwen"))
    await running.wait_condition("second", "Ready", "False", "TargetConflict")
    api.create("horizontalpodautoscalers", NS, {"metadata": {"name": "h"}, "spec": {
        "scaleTargetRef": {"kind": "Deployment", "name": "third"}, "maxReplicas": 2}})  # fmt: skip
    api.create(SO, NS, scaled_object("third", model="phi", target="third"))
    await running.wait_condition("third", "Ready", "False", "TargetConflict")
    api.create(SO, NS, scaled_object("fourth", model="mistral", target="chat"))  # a second model claimed
    await running.wait_condition("fourth", "Ready", "True", "ScalerPublished")
    await put_slot(nc, "qwen", "gpu-1", "s0", "ready")
    api.patch(SO, NS, "qwen", {"status": {"originalReplicaCount": 1}}, subresource="status")
    api.delete(SO, NS, "qwen")
    await running.wait_condition("qwen", "Ready", "False", "Deleting")
    await put_slot(nc, "qwen", "gpu-1", "s0", "warm")
    await api.wait_for(lambda: api.try_get(SO, NS, "qwen") is None, what="the finalizer to finish")
    assert api.get("deployments", NS, "qwen")["spec"]["replicas"] == 1


async def elect(api: K8sApiDouble) -> None:
    """One leader election as deployed: acquire (create), renew (get, update), release on stop."""
    client = api_client(api)
    try:
        settings = leader.LeaseSettings(namespace=OPERATOR_NAMESPACE, identity="op-a", retry_every_s=0.1)
        elector = leader.LeaseElector(k8s.CoordinationV1Api(client), settings)
        assert await elector.try_acquire_or_renew() and await elector.try_acquire_or_renew()
        await elector.release()
    finally:
        client.close()


def check(api: K8sApiDouble, grants: Grants, where: str) -> None:
    made = {(r.verb, r.group, r.resource, r.subresource) for r in api.requests if r.verb}
    # The scenario reached every kind of call the operator makes (else this test proves less than it says).
    for needed in [
        ("watch", "pulsescale.io", "scaledobjects", ""),
        ("patch", "pulsescale.io", "scaledobjects", ""),
        ("patch", "pulsescale.io", "scaledobjects", "status"),
        ("list", "autoscaling", "horizontalpodautoscalers", ""),
        ("create", "", "events", ""),
        ("patch", "apps", "deployments", "scale"),
        ("get", "apps", "deployments", "scale"),  # the scale target is checked (Ready=False ScaleTargetNotFound)
        ("create", "", "configmaps", ""),  # the first model claimed
        ("update", "", "configmaps", ""),  # the second
        ("get", "", "configmaps", ""),
        ("create", "coordination.k8s.io", "leases", ""),
        ("update", "coordination.k8s.io", "leases", ""),
    ]:
        assert needed in made, f"the scenario never made {needed}"
    refused = sorted({f"{r.verb} {r.group or 'core'}/{r.resource}{'/' + r.subresource if r.subresource else ''} "
                      f"{r.name or '-'} (namespace {r.namespace or '-'})"
                      for r in api.requests if not grants.allows(r)})  # fmt: skip
    assert refused == [], f"add rules to {where} (with the reason) for: {refused}"


async def test_every_request_of_the_operator_is_allowed_by_its_role(
    k8s_api: K8sApiDouble,  # noqa: F811
    nc: Client,
    nats_server: NatsServer,
) -> None:
    # All namespaces, as deploy/base runs it (kopf lists and watches cluster-wide).
    async with autoscaler(nats_server.url), operator(k8s_api, nc, namespaces=(),
                                                     home_namespace=OPERATOR_NAMESPACE) as running:  # fmt: skip
        await exercise(running, nc)
    await elect(k8s_api)
    check(k8s_api, cluster_wide(), str(RBAC.relative_to(RBAC.parents[3])))


async def test_the_namespaced_operator_stays_in_its_namespaces_under_the_overlays_roles(
    k8s_api: K8sApiDouble,  # noqa: F811
    nc: Client,
    nats_server: NatsServer,
) -> None:
    grants = namespaced()  # before anything starts: skips without kubectl
    stray = scaled_object("stray", model="gemma", target="stray")
    stray["metadata"]["namespace"] = UNWATCHED
    k8s_api.create(SO, UNWATCHED, stray)
    async with autoscaler(nats_server.url), operator(k8s_api, nc, namespaces=(NS,),
                                                     home_namespace=OPERATOR_NAMESPACE) as running:  # fmt: skip
        await exercise(running, nc)
    await elect(k8s_api)
    check(k8s_api, grants, "deploy/overlays/namespaced/watched-namespace/role.yaml")
    touched = sorted({r.namespace or "(cluster-wide)" for r in k8s_api.requests if r.verb})
    assert touched == sorted({NS, OPERATOR_NAMESPACE}), touched
    # The object in the namespace it does not watch is as it was written: no finalizer, no status, no record.
    obj = k8s_api.get(SO, UNWATCHED, "stray")
    assert not obj["metadata"].get("finalizers") and not obj.get("status")
    kv = await nc.jetstream().key_value(protocol.SCALERS_BUCKET)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get(f"{UNWATCHED}.stray")
