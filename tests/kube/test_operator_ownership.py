"""Model names are owned per namespace (kube/records.py `ModelOwners`): a tenant cannot squat another's model.

The reproduction of the security review: namespace B writes a ScaledObject for the model team A scales, while A's
object is away (deleted to be re-created) or before A has published it at all. B's object must be ``Ready=False
ModelOwnedByOtherNamespace`` naming the owner, and never reach `pulse_scalers`; A keeps its model across an operator
restart. Real kopf, the real `kubernetes` client against the API double, a real nats-server.
"""

from __future__ import annotations

from typing import Any

import nats.js.errors
import pytest
from nats.aio.client import Client

from kube.records import MODEL_OWNERS_CONFIGMAP
from tests.k8s_api_double import RESOURCES, K8sApiDouble, k8s_api  # noqa: F401 - fixture
from tests.kube.test_operator import SO, operator, scaled_object
from warmpool import protocol

HOME = "pulsescale"  # the operator's own namespace: the ConfigMap of model owners
TEAM_A, TEAM_B = "team-a", "team-b"
MODEL = "llama"


def team_object(namespace: str, name: str, model: str = MODEL) -> dict[str, Any]:
    body = scaled_object(name, model=model, target=model)
    body["metadata"]["namespace"] = namespace
    return body


def condition(api: K8sApiDouble, namespace: str, name: str) -> dict[str, Any] | None:
    obj = api.try_get(SO, namespace, name)
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), None)


async def wait_ready(api: K8sApiDouble, namespace: str, name: str, status: str, reason: str) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        cond = condition(api, namespace, name)
        return cond if cond and (cond["status"], cond["reason"]) == (status, reason) else None

    got: dict[str, Any] = await api.wait_for(check, 10.0, f"{namespace}/{name}: Ready={status} {reason}")
    return got


async def never_published(nc: Client, key: str) -> bool:
    """No revision of `key` was ever written to pulse_scalers (not merely deleted since)."""
    kv = await nc.jetstream().key_value(protocol.SCALERS_BUCKET)
    try:
        await kv.history(key)
    except nats.js.errors.NoKeysError:
        return True
    return False


@pytest.fixture
async def teams(k8s_api: K8sApiDouble) -> K8sApiDouble:  # noqa: F811
    """The double with each team's scale target (a missing one would make Ready=False ScaleTargetNotFound)."""
    for ns in (TEAM_A, TEAM_B):
        for target in (MODEL, "phi"):  # each object's target is named after its model
            k8s_api.create("deployments", ns, {"metadata": {"name": target, "namespace": ns}, "spec": {"replicas": 1}})
    return k8s_api


async def test_another_namespace_cannot_squat_a_model_during_a_re_create_or_across_a_restart(
    teams: K8sApiDouble, nc: Client
) -> None:
    api = teams
    async with operator(api, nc, namespaces=(), home_namespace=HOME) as running:
        api.create(SO, TEAM_A, team_object(TEAM_A, "chat"))
        await wait_ready(api, TEAM_A, "chat", "True", "ScalerPublished")
        assert api.get("configmaps", HOME, MODEL_OWNERS_CONFIGMAP)["data"] == {MODEL: TEAM_A}
        # A deletes its object to re-create it; B's, written in that window, must not take the model.
        api.delete(SO, TEAM_A, "chat")
        await api.wait_for(lambda: api.try_get(SO, TEAM_A, "chat") is None, what="A's object to go")
        await running.wait_record(f"{TEAM_A}.chat", lambda r: r is None)
        api.create(SO, TEAM_B, team_object(TEAM_B, "squat"))
        cond = await wait_ready(api, TEAM_B, "squat", "False", "ModelOwnedByOtherNamespace")
        assert f"model {MODEL} is owned by namespace {TEAM_A}" in cond["message"]
        assert f"{HOME}/{MODEL_OWNERS_CONFIGMAP}" in cond["message"]  # where the platform team moves it
        await api.wait_for(
            lambda: [e for e in api.list("events", TEAM_B) if e["reason"] == "ModelOwnedByOtherNamespace"],
            what="a Warning Event on B's object",
        )
    # A restart (a new leader, an upgrade): nothing the operator kept in memory decides ownership.
    async with operator(api, nc, namespaces=(), home_namespace=HOME) as running:
        so = running.ctx.extra["scaledobjects"]

        def refused_again() -> bool:  # its own verdict, not the status written before the restart
            known = so.known.get(f"{TEAM_B}.squat")
            return known is not None and known.verdict.reason == "ModelOwnedByOtherNamespace"

        await api.wait_for(refused_again, what="the new operator to resume B's object and refuse it again")
        api.create(SO, TEAM_A, team_object(TEAM_A, "chat"))  # A is back
        await wait_ready(api, TEAM_A, "chat", "True", "ScalerPublished")
        rec = await running.wait_record(f"{TEAM_A}.chat", lambda r: r is not None)
        assert rec is not None and rec.spec.model == MODEL
        assert (condition(api, TEAM_B, "squat") or {}).get("reason") == "ModelOwnedByOtherNamespace"
    assert await never_published(nc, f"{TEAM_B}.squat")


async def test_a_model_claimed_by_the_platform_team_is_held_for_its_namespace_and_can_be_moved(
    teams: K8sApiDouble, nc: Client
) -> None:
    api = teams
    # An explicit claim before any ScaledObject exists: first-come cannot win it.
    api.create("configmaps", HOME, {"metadata": {"name": MODEL_OWNERS_CONFIGMAP}, "data": {MODEL: TEAM_A}})
    async with operator(api, nc, namespaces=(), home_namespace=HOME) as running:
        api.create(SO, TEAM_B, team_object(TEAM_B, "squat"))
        await wait_ready(api, TEAM_B, "squat", "False", "ModelOwnedByOtherNamespace")
        api.create(SO, TEAM_A, team_object(TEAM_A, "chat"))
        await wait_ready(api, TEAM_A, "chat", "True", "ScalerPublished")
        assert await never_published(nc, f"{TEAM_B}.squat")
        # Another model in B is B's own: ownership is per model, not per team.
        api.create(SO, TEAM_B, team_object(TEAM_B, "own", model="phi"))
        await wait_ready(api, TEAM_B, "own", "True", "ScalerPublished")
        # A's last edit is invalid: its previous record stays in force, but only while the model is A's.
        api.patch(SO, TEAM_A, "chat", {"spec": {"minReplicaCount": 9}})  # over maxReplicaCount
        await wait_ready(api, TEAM_A, "chat", "False", "InvalidSpec")
        # The platform team moves the model: A's record is withdrawn, then B's object goes through.
        api.patch("configmaps", HOME, MODEL_OWNERS_CONFIGMAP, {"data": {MODEL: TEAM_B}})
        cond = await wait_ready(api, TEAM_A, "chat", "False", "ModelOwnedByOtherNamespace")
        assert f"owned by namespace {TEAM_B}" in cond["message"]
        await running.wait_record(f"{TEAM_A}.chat", lambda r: r is None)
        await wait_ready(api, TEAM_B, "squat", "True", "ScalerPublished")
        assert api.get("configmaps", HOME, MODEL_OWNERS_CONFIGMAP)["data"] == {MODEL: TEAM_B, "phi": TEAM_B}


async def test_unknown_owners_publish_nothing_and_say_why(nc: Client) -> None:
    # An API server that will not serve the ConfigMap (here: the double without configmaps; on a cluster a
    # missing Role): fail closed, with the reason in the status.
    api = K8sApiDouble([r for r in RESOURCES if r.plural != "configmaps"])
    await api.start()
    try:
        api.create("deployments", TEAM_A, {"metadata": {"name": "llama", "namespace": TEAM_A}, "spec": {"replicas": 1}})
        async with operator(api, nc, namespaces=(), home_namespace=HOME):
            api.create(SO, TEAM_A, team_object(TEAM_A, "chat"))
            cond = await wait_ready(api, TEAM_A, "chat", "False", "ModelOwnerUnknown")
            assert f"ConfigMap {HOME}/{MODEL_OWNERS_CONFIGMAP}" in cond["message"]
        assert await never_published(nc, f"{TEAM_A}.chat")
    finally:
        await api.stop()
