"""The Kubernetes API double behaves as the API server on what the operator tests rely on, seen through the real
`kubernetes` client: optimistic concurrency, subresources, finalizers, selectors, watches and error Status objects.
If the double were wrong here, the operator tests would prove nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tests.k8s_api_double import K8sApiDouble, k8s_api  # noqa: F401 - fixture

NS = "team"


@pytest.fixture
async def client(k8s_api: K8sApiDouble) -> AsyncIterator[k8s.ApiClient]:  # noqa: F811
    cfg = k8s.Configuration()
    cfg.host = k8s_api.url
    cfg.api_key = {"authorization": "Bearer t0ken"}
    api = k8s.ApiClient(cfg)
    try:
        yield api
    finally:
        api.close()


def lease(name: str, holder: str) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {"name": name},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15}}  # fmt: skip


async def test_replace_with_a_stale_resource_version_is_a_409_conflict(
    k8s_api: K8sApiDouble,  # noqa: F811
    client: k8s.ApiClient,
) -> None:
    leases = k8s.CoordinationV1Api(client)
    created = await asyncio.to_thread(leases.create_namespaced_lease, NS, lease("op", "a"))
    rv = created.metadata.resource_version
    body = lease("op", "b") | {"metadata": {"name": "op", "resourceVersion": rv}}
    replaced = await asyncio.to_thread(leases.replace_namespaced_lease, "op", NS, body)
    assert replaced.spec.holder_identity == "b" and int(replaced.metadata.resource_version) > int(rv)
    with pytest.raises(ApiException) as err:  # the same, older resourceVersion again: someone else won
        await asyncio.to_thread(leases.replace_namespaced_lease, "op", NS, lease("op", "c") | {
            "metadata": {"name": "op", "resourceVersion": rv}})  # fmt: skip
    assert err.value.status == 409 and json.loads(err.value.body)["reason"] == "Conflict"
    with pytest.raises(ApiException) as err:
        await asyncio.to_thread(leases.create_namespaced_lease, NS, lease("op", "d"))
    assert err.value.status == 409 and json.loads(err.value.body)["reason"] == "AlreadyExists"
    with pytest.raises(ApiException) as err:
        await asyncio.to_thread(leases.read_namespaced_lease, "nope", NS)
    status = json.loads(err.value.body)
    assert (err.value.status, status["kind"], status["reason"], status["code"]) == (404, "Status", "NotFound", 404)
    assert [r.token for r in k8s_api.requests] == ["t0ken"] * 5 and k8s_api.requests[1].verb == "update"


async def test_subresources_change_only_their_part(k8s_api: K8sApiDouble, client: k8s.ApiClient) -> None:  # noqa: F811
    apps = k8s.AppsV1Api(client)
    k8s_api.create("deployments", NS, {"metadata": {"name": "web"}, "spec": {
        "replicas": 2, "selector": {"matchLabels": {"app": "web"}}}, "status": {"replicas": 2}})  # fmt: skip
    scale = await asyncio.to_thread(apps.read_namespaced_deployment_scale, "web", NS)
    assert (scale.spec.replicas, scale.status.selector) == (2, "app=web")
    await asyncio.to_thread(apps.patch_namespaced_deployment_scale, "web", NS, {"spec": {"replicas": 5}})
    dep = k8s_api.get("deployments", NS, "web")
    assert dep["spec"]["replicas"] == 5 and dep["metadata"]["generation"] == 2
    k8s_api.patch("deployments", NS, "web", {"status": {"replicas": 9}, "spec": {"replicas": 1}}, subresource="status")
    dep = k8s_api.get("deployments", NS, "web")
    assert (dep["spec"]["replicas"], dep["status"]["replicas"]) == (5, 9)  # the spec part of a status write is ignored
    k8s_api.patch("deployments", NS, "web", {"status": {"replicas": 0}})
    assert k8s_api.get("deployments", NS, "web")["status"]["replicas"] == 9  # and the status part of a spec write


async def test_finalizers_hold_a_deleted_object_until_they_are_emptied(k8s_api: K8sApiDouble) -> None:  # noqa: F811
    k8s_api.create("pods", NS, {"metadata": {"generateName": "standby-", "finalizers": ["x/y"]}, "spec": {}})
    [pod] = k8s_api.list("pods", NS)
    name = pod["metadata"]["name"]
    assert name.startswith("standby-") and len(name) > len("standby-")
    k8s_api.delete("pods", NS, name)
    held = k8s_api.get("pods", NS, name)
    assert held["metadata"]["deletionTimestamp"]
    test = {"op": "test", "path": "/metadata/resourceVersion", "value": "0"}
    with pytest.raises(Exception, match="failed") as err:  # kopf's finalizer removal: a json-patch with a test
        k8s_api.patch("pods", NS, name, [test, {"op": "remove", "path": "/metadata/finalizers/0"}])
    assert getattr(err.value, "code", None) == 422
    rv = held["metadata"]["resourceVersion"]
    k8s_api.patch("pods", NS, name, [{**test, "value": rv}, {"op": "remove", "path": "/metadata/finalizers/0"}])
    assert k8s_api.try_get("pods", NS, name) is None


async def test_selectors_filter_lists(k8s_api: K8sApiDouble, client: k8s.ApiClient) -> None:  # noqa: F811
    for name, labels, node in [("a", {"standby": "true", "model": "qwen"}, "n1"), ("b", {"standby": "false"}, "n2"),
                               ("c", {"model": "llama"}, "n1")]:  # fmt: skip
        k8s_api.create(
            "pods",
            NS,
            {"metadata": {"name": name, "labels": labels}, "spec": {"nodeName": node, "containers": [{"name": "c"}]}},
        )
    core = k8s.CoreV1Api(client)

    async def names(**kw: str) -> list[str]:
        pods = await asyncio.to_thread(core.list_namespaced_pod, NS, **kw)
        return [p.metadata.name for p in pods.items]

    assert await names(label_selector="standby=true") == ["a"]
    assert await names(label_selector="standby!=true") == ["b", "c"]
    assert await names(label_selector="model in (qwen,llama),!standby") == ["c"]
    assert await names(label_selector="model notin (qwen)") == ["b", "c"]
    assert await names(label_selector="model") == ["a", "c"]
    assert await names(field_selector="spec.nodeName=n1,metadata.name!=a") == ["c"]


async def test_a_watch_replays_from_a_resource_version_and_streams_changes(k8s_api: K8sApiDouble) -> None:  # noqa: F811
    k8s_api.create("pods", NS, {"metadata": {"name": "a"}})
    listed = k8s_api.get("pods", NS, "a")["metadata"]["resourceVersion"]
    k8s_api.patch("pods", NS, "a", {"metadata": {"labels": {"x": "1"}}})
    url = f"{k8s_api.url}/api/v1/namespaces/{NS}/pods?watch=true&resourceVersion={listed}&timeoutSeconds=2"
    seen: list[tuple[str, str]] = []
    async with aiohttp.ClientSession() as http, http.get(url) as rsp:
        assert rsp.status == 200
        k8s_api.create("pods", NS, {"metadata": {"name": "b"}})
        k8s_api.delete("pods", NS, "a")
        async for line in rsp.content:
            event = json.loads(line)
            seen.append((event["type"], event["object"]["metadata"]["name"]))
    assert seen == [("MODIFIED", "a"), ("ADDED", "b"), ("DELETED", "a")]  # then closed after timeoutSeconds


async def test_with_crds_a_custom_resource_loses_the_fields_its_schema_does_not_declare() -> None:
    api = K8sApiDouble(prune_with_crds=True)
    body = {"metadata": {"name": "qwen"}, "spec": {"scaleTargetRef": {"name": "qwen"}, "maxReplicaCount": 4,
            "triggers": [{"type": "gateway-queue", "metadata": {"model": "qwen"}}], "typo": 1}}  # fmt: skip
    api.create("scaledobjects", NS, body)
    spec = api.get("scaledobjects", NS, "qwen")["spec"]
    assert "typo" not in spec and spec["triggers"][0]["metadata"] == {"model": "qwen"}
    api.patch(
        "scaledobjects", NS, "qwen", {"status": {"desiredReplicas": 2, "invented": {"x": 1}}}, subresource="status"
    )
    assert api.get("scaledobjects", NS, "qwen")["status"] == {"desiredReplicas": 2}


def test_a_node_that_preserves_unknown_fields_keeps_them_and_prunes_its_declared_ones() -> None:
    from tests.k8s_api_double import prune

    schema = {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": {
            "model": {"type": "string"},
            "inner": {"type": "object", "properties": {"a": {"type": "string"}}},
        },
    }
    value = {"model": "qwen", "targetQueueDepht": "4", "inner": {"a": "x", "b": "pruned"}}
    assert prune(value, schema) == {"model": "qwen", "targetQueueDepht": "4", "inner": {"a": "x"}}
    assert prune({"anything": [1]}, {"x-kubernetes-preserve-unknown-fields": True}) == {"anything": [1]}
    # The shipped CRD: trigger metadata keeps a typo for the operator to refuse; a typo beside it in spec is dropped.
    api = K8sApiDouble(prune_with_crds=True)
    trigger = {"type": "gateway-queue", "metadata": {"model": "qwen", "targetQueueDepht": "4"}}
    body = {
        "metadata": {"name": "qwen"},
        "spec": {"scaleTargetRef": {"name": "qwen"}, "typo": 1, "triggers": [trigger]},
    }
    api.create("scaledobjects", NS, body)
    spec = api.get("scaledobjects", NS, "qwen")["spec"]
    assert "typo" not in spec and spec["triggers"][0]["metadata"] == {"model": "qwen", "targetQueueDepht": "4"}
