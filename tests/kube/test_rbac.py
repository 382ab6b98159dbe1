"""Every request the operator makes is allowed by its RBAC in deploy/ (deploy/base/operator/rbac.yaml).

The Kubernetes API double does no authorization, so this test does it: it runs the operator through what it does
on a cluster (publish, an annotation change, status from the real autoscaler, a refused duplicate and an HPA
conflict, Events, delete with the finalizer and the replica restore), then checks each logged request — verb,
API group, resource, subresource, namespace — against the ClusterRole and the namespaced Role as the API server's
RBAC authorizer would. A new call in kube/ without its rule fails here, naming the rule to add.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from nats.aio.client import Client

from tests.k8s_api_double import ApiRequest, K8sApiDouble, k8s_api  # noqa: F401 - fixture
from tests.kube.test_operator import NS, SO, autoscaler, operator, put_slot, scaled_object
from warmpool.embedded import NatsServer

RBAC = Path(__file__).resolve().parents[2] / "deploy" / "base" / "operator" / "rbac.yaml"
OPERATOR_NAMESPACE = "pulsescale"  # where the namespaced Role (leases) is bound


def rules() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(ClusterRole rules, Role rules) of the operator's service account."""
    docs = [d for d in yaml.safe_load_all(RBAC.read_text()) if d]
    cluster = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    namespaced = [r for d in docs if d["kind"] == "Role" for r in d["rules"]]
    return cluster, namespaced


def _matches(rule: dict[str, Any], req: ApiRequest) -> bool:
    resource = f"{req.resource}/{req.subresource}" if req.subresource else req.resource
    return (
        (req.group in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", []))
        and (resource in rule.get("resources", []) or "*" in rule.get("resources", []))
        and (req.verb in rule.get("verbs", []) or "*" in rule.get("verbs", []))
        and (not rule.get("resourceNames") or req.name in rule["resourceNames"])
    )


def allowed(req: ApiRequest) -> bool:
    if not req.verb:
        return True  # discovery (/api, /apis, /version) is open to every authenticated user (system:discovery)
    cluster, namespaced = rules()
    if any(_matches(r, req) for r in cluster):
        return True
    return req.namespace == OPERATOR_NAMESPACE and any(_matches(r, req) for r in namespaced)


def test_the_rbac_check_refuses_what_the_role_does_not_grant() -> None:
    secret = ApiRequest("GET", "/api/v1/namespaces/x/secrets/s", {}, "", "", "get", "", "secrets", "", "x", "s")
    delete_so = ApiRequest("DELETE", "/apis/pulsescale.io/v1alpha1/namespaces/x/scaledobjects/s", {}, "", "", "delete",
                           "pulsescale.io", "scaledobjects", "", "x", "s")  # fmt: skip
    lease_elsewhere = ApiRequest("GET", "/apis/coordination.k8s.io/v1/namespaces/x/leases/l", {}, "", "", "get",
                                 "coordination.k8s.io", "leases", "", "x", "l")  # fmt: skip
    assert not allowed(secret) and not allowed(delete_so) and not allowed(lease_elsewhere)


async def test_every_request_of_the_operator_is_allowed_by_its_role(
    k8s_api: K8sApiDouble,  # noqa: F811
    nc: Client,
    nats_server: NatsServer,
) -> None:
    # All namespaces, as deployed (kopf lists and watches cluster-wide).
    async with autoscaler(nats_server.url), operator(k8s_api, nc, namespaces=()) as running:
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
        await put_slot(nc, "qwen", "gpu-1", "s0", "ready")
        api.patch(SO, NS, "qwen", {"status": {"originalReplicaCount": 1}}, subresource="status")
        api.delete(SO, NS, "qwen")
        await running.wait_condition("qwen", "Ready", "False", "Deleting")
        await put_slot(nc, "qwen", "gpu-1", "s0", "warm")
        await api.wait_for(lambda: api.try_get(SO, NS, "qwen") is None, what="the finalizer to finish")
        assert api.get("deployments", NS, "qwen")["spec"]["replicas"] == 1
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
    ]:
        assert needed in made, f"the scenario never made {needed}"
    refused = sorted({f"{r.verb} {r.group or 'core'}/{r.resource}{'/' + r.subresource if r.subresource else ''} "
                      f"(namespace {r.namespace or '-'})" for r in api.requests if not allowed(r)})  # fmt: skip
    assert refused == [], f"add rules to {RBAC.relative_to(RBAC.parents[3])} (with the reason) for: {refused}"
