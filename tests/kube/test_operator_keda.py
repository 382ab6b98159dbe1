"""KEDA's meanings, or a clear refusal (issue 26, part 2): what an outside review found differing from KEDA silently,
each checked through the real operator (kopf and the `kubernetes` client) against the API server double with
pruning by the CRD on (tests/k8s_api_double.py: the API server drops what the CRD does not declare) and a real
nats-server; the cold-path case runs the real autoscaler too.

- the target's own replicas count as capacity: no scale-up at create without demand;
- ``paused-replicas: "N"`` sets the target to N through its scale subresource; ``paused: "true"`` holds its count;
- ``idleReplicaCount`` is KEDA's webhook rule, in KEDA's words, refused by ``apply`` and the operator;
- a typo in trigger metadata and ``scalingModifiers`` reach the operator (kept by the CRD) and are refused;
- an Argo Rollout target is refused by ``apply`` and the operator alike;
- a ScaledObject that was never published does not keep a valid one off its target.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from nats.aio.client import Client

from kube import coldpath
from oncall import apply
from oncall.client import EXIT_REFUSED
from tests.k8s_api_double import ApiRequest, K8sApiDouble, k8s_api  # noqa: F401 - fixture
from tests.kube.test_operator import NS, SO, Running, autoscaler, operator, scaled_object
from warmpool import protocol
from warmpool.embedded import NatsServer


@pytest.fixture
async def running(k8s_api: K8sApiDouble, nc: Client) -> AsyncIterator[Running]:  # noqa: F811
    async with operator(k8s_api, nc) as r:
        yield r


def scale_writes(api: K8sApiDouble, target: str) -> list[ApiRequest]:
    return [r for r in api.requests if r.subresource == "scale" and r.verb in ("patch", "update") and r.name == target]


def replicas(api: K8sApiDouble, target: str) -> int:
    return int(api.get("deployments", NS, target)["spec"]["replicas"])


def status(api: K8sApiDouble, name: str) -> dict[str, Any]:
    return dict((api.try_get(SO, NS, name) or {}).get("status") or {})


async def rounds(running: Running, n: int = 3) -> None:
    """`n` more rounds of the cold path's loop (each holds the pauses and asks the outstanding requests again)."""
    cold: coldpath.ColdPath = running.ctx.extra["coldpath"]
    seen = cold.rounds
    await running.api.wait_for(lambda: cold.rounds >= seen + n, 10, f"{n} more cold-path rounds")


def refused_by_apply(doc: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """`pulsescale apply --dry-run -f` of `doc`: its exit code must be a refusal; returns what it said."""
    path = tmp_path / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    capsys.readouterr()
    assert apply.apply(["-f", str(path), "--dry-run"], "pulsescale apply") == EXIT_REFUSED
    return capsys.readouterr().err


# --- the target's replicas are capacity -----------------------------------------------------------------------------


async def test_at_create_without_demand_the_targets_replicas_cover_the_minimum(
    k8s_api: K8sApiDouble,  # noqa: F811
    nc: Client,
    nats_server: NatsServer,
) -> None:
    """Deployment ``chat`` runs 3; its ScaledObject (minReplicaCount 1) is created with no demand and no warm slot.
    The autoscaler asks the cold path for 1; the 3 the target runs count as capacity and cover it: nothing is
    written (the review saw 3 -> 4)."""
    async with autoscaler(nats_server.url), operator(k8s_api, nc) as running:
        running.api.patch("deployments", NS, "chat", {"spec": {"replicas": 3}})
        running.api.create(SO, NS, scaled_object("chat", model="chat", target="chat"))
        episode = await running.api.wait_for(
            lambda: status(running.api, "chat").get(coldpath.COLD_PATH_STATUS), 15, "the cold path's episode"
        )
        assert (episode["requested"], episode["fromReplicas"], episode["toReplicas"]) == (1, 3, 3), episode
        [covered] = await running.api.wait_for(lambda: running.events("chat", "ColdPathCovered"), what="an Event")
        assert "already runs 3 replicas, which count as capacity" in covered["message"], covered["message"]
        await rounds(running)  # the status rows keep asking for the same 1: still nothing
        assert replicas(running.api, "chat") == 3
        assert scale_writes(running.api, "chat") == []
        assert "originalReplicaCount" not in status(running.api, "chat")  # never changed


# --- pausing --------------------------------------------------------------------------------------------------------


async def test_paused_replicas_sets_the_target_through_its_scale_subresource(running: Running) -> None:
    running.api.patch("deployments", NS, "chat", {"spec": {"replicas": 3}})
    so = scaled_object("chat", model="chat", target="chat", advanced={"restoreToOriginalReplicaCount": True})
    so["metadata"]["annotations"] = {"autoscaling.keda.sh/paused-replicas": "2"}
    running.api.create(SO, NS, so)
    record = await running.wait_record(f"{NS}.chat", lambda r: r is not None)
    assert record is not None and record.paused and record.paused_replicas == 2  # the pool is held at 2 too
    await running.api.wait_for(lambda: replicas(running.api, "chat") == 2, 10, "the target at 2")
    [write] = scale_writes(running.api, "chat")
    assert (write.method, write.path, write.body) == (
        "PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/chat/scale", {"spec": {"replicas": 2}}
    )  # fmt: skip
    said = await running.api.wait_for(lambda: status(running.api, "chat").get("pausedReplicaCount"), what="status")
    assert said == 2 and status(running.api, "chat")["originalReplicaCount"] == 3
    [event] = await running.api.wait_for(lambda: running.events("chat", "PausedReplicasScaled"), what="an Event")
    assert "from 3 to 2 replicas: paused-replicas is 2" in event["message"]

    # Scaled by hand while paused: put back, as KEDA's scale loop does.
    running.api.patch("deployments", NS, "chat", {"spec": {"replicas": 5}})
    await running.api.wait_for(lambda: replicas(running.api, "chat") == 2, 10, "the target back at 2")

    # The annotation goes: the status says so, the target keeps its count; the delete restores the original.
    running.api.patch(SO, NS, "chat", {"metadata": {"annotations": {"autoscaling.keda.sh/paused-replicas": None}}})
    await running.api.wait_for(lambda: "pausedReplicaCount" not in status(running.api, "chat"), what="unpaused")
    assert replicas(running.api, "chat") == 2
    running.api.delete(SO, NS, "chat")
    await running.api.wait_for(lambda: running.api.try_get(SO, NS, "chat") is None, what="the CR to go")
    assert replicas(running.api, "chat") == 3


async def test_paused_holds_the_targets_current_count(running: Running) -> None:
    """``paused: "true"`` over a Deployment at 1 with minReplicaCount 3: a cold-path request during the pause (the
    autoscaler holds a count the pool cannot give, as after a slot is lost while paused) scales nothing, as KEDA
    scales nothing while paused (it was raised to 4)."""
    so = scaled_object("chat", model="chat", target="chat", minReplicaCount=3)
    so["metadata"]["annotations"] = {"autoscaling.keda.sh/paused": "true"}
    running.api.create(SO, NS, so)
    await running.wait_condition("chat", "Ready", "True", "ScalerPublished")
    await running.wait_condition("chat", "Paused", "True", "PausedByAnnotation")
    asked = protocol.Event(type="cold.start", model="chat", ts=time.time(), desired=3, reason="no warm slot")
    await running.nc.publish(protocol.events_subject("chat"), protocol.encode(asked))
    await running.nc.flush()
    await running.api.wait_for(lambda: running.events("chat", "ColdStart"), what="the request heard")
    await rounds(running)
    assert replicas(running.api, "chat") == 1
    assert scale_writes(running.api, "chat") == []
    assert "pausedReplicaCount" not in status(running.api, "chat")  # KEDA's field is paused-replicas' only


# --- refused as KEDA's webhook refuses, in its words --------------------------------------------------------------


async def test_idle_over_a_zero_minimum_is_refused_in_kedas_words_by_apply_and_the_operator(
    running: Running, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kedas = "IdleReplicaCount=3 must be less than MinReplicaCount=1"
    so = scaled_object("chat", model="chat", target="chat", minReplicaCount=0, idleReplicaCount=3)
    running.api.create(SO, NS, so)
    cond = await running.wait_condition("chat", "Ready", "False", "InvalidSpec")
    assert f"spec.idleReplicaCount: {kedas}" in cond["message"], cond["message"]
    assert await running.record(f"{NS}.chat") is None
    assert kedas in refused_by_apply(so, tmp_path, capsys)
    # What KEDA's webhook admits with a minimum of 0: idle 0.
    running.api.create(SO, NS, scaled_object("other", model="other", target="other", minReplicaCount=0,
                                             idleReplicaCount=0))  # fmt: skip
    await running.wait_condition("other", "Ready", "True", "ScalerPublished")


# --- kept by the CRD, so the operator can refuse it -----------------------------------------------------------------


async def test_a_typo_in_trigger_metadata_survives_pruning_and_is_refused_naming_it(running: Running) -> None:
    so = scaled_object("chat", model="chat", target="chat")
    so["spec"]["triggers"][0]["metadata"]["targetQueueDepht"] = "4"  # sent by a client without strict validation
    running.api.create(SO, NS, so)
    assert running.api.get(SO, NS, "chat")["spec"]["triggers"][0]["metadata"]["targetQueueDepht"] == "4"
    cond = await running.wait_condition("chat", "Ready", "False", "InvalidSpec")
    assert (
        "spec.triggers[0].metadata.targetQueueDepht: unknown field (did you mean targetQueueDepth?)" in cond["message"]
    ), cond["message"]
    assert await running.record(f"{NS}.chat") is None


async def test_scaling_modifiers_survive_pruning_and_are_refused_with_the_reason(running: Running) -> None:
    modifiers = {"formula": "(queue + backlog) / 2", "target": "4", "metricType": "AverageValue"}
    running.api.create(SO, NS, scaled_object("chat", model="chat", target="chat",
                                             advanced={"scalingModifiers": modifiers}))  # fmt: skip
    assert running.api.get(SO, NS, "chat")["spec"]["advanced"]["scalingModifiers"] == modifiers
    cond = await running.wait_condition("chat", "Ready", "False", "InvalidSpec")
    assert "spec.advanced.scalingModifiers: not supported" in cond["message"], cond["message"]
    assert "feeds the same model's demand" in cond["message"]
    assert await running.record(f"{NS}.chat") is None


# --- scale targets ------------------------------------------------------------------------------------------------


async def test_an_argo_rollout_target_is_refused_by_apply_and_the_operator_alike(
    running: Running, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    so = scaled_object("chat", model="chat", target="chat")
    so["spec"]["scaleTargetRef"] = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "name": "chat"}
    refusal = "spec.scaleTargetRef.kind: argoproj.io/v1alpha1 Rollout is not a target pulsescale scales"
    running.api.create(SO, NS, so)
    cond = await running.wait_condition("chat", "Ready", "False", "InvalidSpec")
    assert refusal in cond["message"], cond["message"]
    assert await running.record(f"{NS}.chat") is None  # nothing published for a target nothing would scale
    assert refusal in refused_by_apply(so, tmp_path, capsys)


# --- conflicts are between published objects ----------------------------------------------------------------------


async def test_a_never_published_scaledobject_does_not_keep_a_valid_one_off_its_target(running: Running) -> None:
    # The broken one is older (and sorts first): it used to win the target although it was never published.
    running.api.create(SO, NS, scaled_object("broken", model="llama", target="chat", minReplicaCount=5,
                                             maxReplicaCount=2))  # fmt: skip
    await running.wait_condition("broken", "Ready", "False", "InvalidSpec")
    running.api.create(SO, NS, scaled_object("chat", model="chat", target="chat"))
    await running.wait_condition("chat", "Ready", "True", "ScalerPublished")
    assert await running.record(f"{NS}.chat") is not None
    # Fixed, the older one finds the target held by the published one.
    running.api.patch(SO, NS, "broken", {"spec": {"minReplicaCount": 1}})
    cond = await running.wait_condition("broken", "Ready", "False", "TargetConflict")
    assert "ScaledObject chat already scales Deployment/chat" in cond["message"], cond["message"]
    assert await running.record(f"{NS}.broken") is None
    await asyncio.sleep(0.7)  # two status rounds: the refused one is re-checked and stays refused
    assert running.condition("chat", "Ready")["status"] == "True"  # type: ignore[index]
