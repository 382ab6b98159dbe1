"""The kopf operator for ScaledObject CRs: the real kopf and the real `kubernetes` client against the HTTP double
of the Kubernetes API (tests/k8s_api_double.py) and a real nats-server.

Each test runs `kube.kopfrun.run_operator` in the test's event loop, writes ScaledObjects (and HPAs, Deployments)
into the double as `kubectl` would, and reads what the operator did: KV `pulse_scalers`, the objects' status
subresource, Events, and the double's request log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.js.errors
import pytest
from kubernetes import client as k8s
from nats.aio.client import Client
from nats.js.kv import KeyValue

from autoscaler import daemon
from autoscaler.metrics import AutoscalerMetrics
from autoscaler.shards.leader import LeaseSettings
from kube.context import OperatorContext, open_buckets
from kube.kopfrun import run_operator
from kube.operator import FINALIZER
from tests.k8s_api_double import K8sApiDouble, k8s_api  # noqa: F401 - fixture
from warmpool import connect, natsauth, protocol
from warmpool.embedded import NatsServer
from warmpool.registry import ensure_buckets

NS = "inference"
SO = "scaledobjects"


TARGETS = ("qwen", "other", "llama", "chat", "batch")  # the Deployments the tests' ScaledObjects scale


def scaled_object(name: str = "qwen", *, model: str = "qwen", target: str = "qwen", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "pulsescale.io/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "scaleTargetRef": {"name": target},
            "minReplicaCount": 1,
            "maxReplicaCount": 4,
            "triggers": [{"type": "gateway-queue", "metadata": {"model": model}}],
        },
    }
    body["spec"].update(spec)
    return body


@dataclass
class Running:
    api: K8sApiDouble
    ctx: OperatorContext
    scalers: KeyValue
    nc: Client

    async def record(self, key: str) -> protocol.ScalerRecord | None:
        try:
            entry = await self.scalers.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        return None if entry.value is None else protocol.decode(entry.value, protocol.ScalerRecord)

    async def wait_record(self, key: str, pred: Callable[[protocol.ScalerRecord | None], bool],
                          timeout_s: float = 10.0) -> protocol.ScalerRecord | None:  # fmt: skip
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            rec = await self.record(key)
            if pred(rec):
                return rec
            if loop.time() > deadline:
                raise AssertionError(f"{key}: the record never matched; last {rec!r}")
            await asyncio.sleep(0.05)

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        obj = self.api.try_get(SO, NS, name)
        for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
            if cond["type"] == kind:
                return dict(cond)
        return None

    async def wait_condition(self, name: str, kind: str, status: str, reason: str | None = None,
                             timeout_s: float = 10.0) -> dict[str, Any]:  # fmt: skip
        def check() -> dict[str, Any] | None:
            cond = self.condition(name, kind)
            if cond and cond["status"] == status and (reason is None or cond["reason"] == reason):
                return cond
            return None

        return await self.api.wait_for(check, timeout_s, f"{name}: {kind}={status} {reason or ''}")

    async def wait_reported(self, name: str, timeout_s: float = 10.0, desired: int | None = None) -> dict[str, Any]:
        """The status once it carries the autoscaler's row (replica counts), with `desired` replicas if given."""

        def check() -> dict[str, Any] | None:
            status = (self.api.try_get(SO, NS, name) or {}).get("status") or {}
            if "desiredReplicas" not in status or desired not in (None, status["desiredReplicas"]):
                return None
            return status

        return await self.api.wait_for(check, timeout_s, f"{name}: the autoscaler's row in the status")

    def events(self, name: str, reason: str | None = None) -> list[dict[str, Any]]:
        return [
            e for e in self.api.list("events", NS)
            if e["involvedObject"]["name"] == name and (reason is None or e["reason"] == reason)
        ]  # fmt: skip


def api_client(api: K8sApiDouble) -> k8s.ApiClient:
    cfg = k8s.Configuration()
    cfg.host = api.url
    cfg.api_key = {"authorization": "Bearer operator-token"}
    return k8s.ApiClient(cfg)


@contextlib.asynccontextmanager
async def operator(api: K8sApiDouble, nc: Client, *, create: bool = True, **settings: Any) -> AsyncIterator[Running]:
    if create:  # as the autoscaler does; the operator's own NATS user may not create buckets
        names = [protocol.SCALERS_BUCKET, protocol.SLOTS_BUCKET, protocol.OBJECTS_BUCKET]
        await ensure_buckets(nc.jetstream(), names=names)
    buckets = await open_buckets(nc)
    api.prune_with_crds()  # what the operator writes must survive the CRD's schema, as on a cluster
    for target in settings.pop("targets", TARGETS):  # a missing scale target makes Ready=False ScaleTargetNotFound
        if api.try_get("deployments", NS, target) is None:
            api.create("deployments", NS, {"metadata": {"name": target, "namespace": NS}, "spec": {"replicas": 1}})
    ctx = OperatorContext(
        nc=nc, scalers=buckets[protocol.SCALERS_BUCKET], slots=buckets[protocol.SLOTS_BUCKET], api=api_client(api),
        namespaces=settings.pop("namespaces", (NS,)), status_every_s=settings.pop("status_every_s", 0.3), **settings,
    )  # fmt: skip
    async with running_operator(ctx):
        yield Running(api, ctx, buckets[protocol.SCALERS_BUCKET], nc)


@contextlib.asynccontextmanager
async def running_operator(ctx: OperatorContext) -> AsyncIterator[None]:
    """`run_operator(ctx)` as a task, ready (within 10 s, or what ended it is raised) for the block; then stopped
    (within 15 s, else every thread's and task's stack is printed) and its API client closed."""
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_operator(ctx, stop_flag=stop, ready_flag=ready))
    try:
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([waiter, task], timeout=10, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task.done():
            task.result()  # raises what ended it
        assert ready.is_set(), "the operator did not become ready within 10 s"
        yield
    finally:
        stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), 15)
        except TimeoutError:  # say where it hangs: every thread's stack and every task's
            for ident, frame in sys._current_frames().items():
                print(f"--- thread {ident}", file=sys.stderr)
                traceback.print_stack(frame, file=sys.stderr)
            for t in asyncio.all_tasks():
                t.print_stack(file=sys.stderr)
            raise
        finally:
            ctx.api.close()


@pytest.fixture
async def running(k8s_api: K8sApiDouble, nc: Client) -> AsyncIterator[Running]:  # noqa: F811
    async with operator(k8s_api, nc) as r:
        yield r


async def test_a_created_scaledobject_is_published_and_ready(running: Running) -> None:
    running.api.create(SO, NS, scaled_object(pollingInterval=30))  # accepted, with a note on why it does nothing
    rec = await running.wait_record(f"{NS}.qwen", lambda r: r is not None)
    assert rec is not None and rec.spec.model == "qwen" and rec.spec.max_replica_count == 4
    cond = await running.wait_condition("qwen", "Ready", "True", "ScalerPublished")
    assert "inference.qwen" in cond["message"]
    obj = running.api.get(SO, NS, "qwen")
    assert FINALIZER in obj["metadata"]["finalizers"]
    assert obj["status"]["scaleTargetName"] == "qwen" and obj["status"]["observedGeneration"] == 1
    assert rec.notes and obj["status"]["notes"] == rec.notes and "pollingInterval" in rec.notes[0]


async def revision(running: Running, key: str) -> int:
    return (await running.scalers.get(key)).revision


async def test_an_unchanged_spec_writes_nothing_and_a_changed_one_republishes(running: Running) -> None:
    running.api.create(SO, NS, scaled_object())
    await running.wait_record(f"{NS}.qwen", lambda r: r is not None)
    await running.wait_condition("qwen", "Ready", "True")
    first = await revision(running, f"{NS}.qwen")
    # An annotation the reader does not read is part of what kopf diffs (an update fires), but not of the record:
    # nothing is written.
    running.api.patch(SO, NS, "qwen", {"metadata": {"annotations": {"owner": "team-inference"}}})
    await running.api.wait_for(
        lambda: any(r.method == "PATCH" and r.name == "qwen" and r.subresource == ""
                    for r in running.api.requests[-20:]), what="kopf to handle the annotation change",
    )  # fmt: skip
    await asyncio.sleep(0.5)
    assert await revision(running, f"{NS}.qwen") == first
    # A label is in the record since revision 12 (`pulsescale get -l` reads it): written.
    running.api.patch(SO, NS, "qwen", {"metadata": {"labels": {"team": "inference"}}})
    labelled = await running.wait_record(
        f"{NS}.qwen", lambda r: r is not None and r.labels == {"team": "inference"} and r.published_by_operator
    )
    assert labelled is not None
    first = await revision(running, f"{NS}.qwen")
    running.api.patch(SO, NS, "qwen", {"spec": {"maxReplicaCount": 6}})
    rec = await running.wait_record(f"{NS}.qwen", lambda r: r is not None and r.spec.max_replica_count == 6)
    assert rec is not None and rec.generation == 2  # the CR's metadata.generation
    await running.api.wait_for(
        lambda: (running.api.get(SO, NS, "qwen").get("status") or {}).get("observedGeneration") == 2,
        what="observedGeneration 2",
    )


async def test_an_invalid_scaledobject_is_refused_with_the_validators_message(running: Running) -> None:
    bad = scaled_object("broken", target="other", minReplicaCount=5, maxReplicaCount=2)
    running.api.create(SO, NS, bad)
    cond = await running.wait_condition("broken", "Ready", "False", "InvalidSpec")
    assert "maxReplicaCount" in cond["message"] or "minReplicaCount" in cond["message"], cond
    assert await running.record(f"{NS}.broken") is None
    warning = await running.api.wait_for(lambda: running.events("broken", "InvalidSpec"), what="a Warning Event")
    assert warning[0]["type"] == "Warning" and warning[0]["message"] in cond["message"]

    # A bad edit of a published object leaves the last valid record in force, and the status says so.
    running.api.create(SO, NS, scaled_object())
    await running.wait_record(f"{NS}.qwen", lambda r: r is not None)
    running.api.patch(SO, NS, "qwen", {"spec": {"maxReplicaCount": 0}})
    cond = await running.wait_condition("qwen", "Ready", "False", "InvalidSpec")
    assert "generation 1 (the last valid spec) stays in force" in cond["message"], cond["message"]
    rec = await running.record(f"{NS}.qwen")
    assert rec is not None and rec.spec.max_replica_count == 4


async def test_our_pause_annotations_republish_the_record(running: Running) -> None:
    running.api.create(SO, NS, scaled_object())
    await running.wait_record(f"{NS}.qwen", lambda r: r is not None and not r.paused)
    running.api.patch(SO, NS, "qwen", {"metadata": {"annotations": {"pulsescale.io/paused-replicas": "2"}}})
    rec = await running.wait_record(f"{NS}.qwen", lambda r: r is not None and r.paused)
    assert rec is not None and rec.paused_replicas == 2
    running.api.patch(SO, NS, "qwen", {"metadata": {"annotations": {"pulsescale.io/paused-replicas": None}}})
    rec = await running.wait_record(f"{NS}.qwen", lambda r: r is not None and not r.paused)
    assert rec is not None and rec.paused_replicas is None


async def test_kedas_pause_annotations_republish_the_record(running: Running) -> None:
    running.api.create(SO, NS, scaled_object())
    key = f"{NS}.qwen"
    await running.wait_record(key, lambda r: r is not None and not r.paused)
    patch = {"metadata": {"annotations": {"autoscaling.keda.sh/paused": "true"}}}
    running.api.patch(SO, NS, "qwen", patch)
    await running.wait_record(key, lambda r: r is not None and r.paused and r.paused_replicas is None)
    patch = {
        "metadata": {"annotations": {"autoscaling.keda.sh/paused": None, "autoscaling.keda.sh/paused-replicas": "0"}}
    }
    running.api.patch(SO, NS, "qwen", patch)
    await running.wait_record(key, lambda r: r is not None and r.paused and r.paused_replicas == 0)
    patch = {"metadata": {"annotations": {"autoscaling.keda.sh/paused-replicas": None,
                                          "autoscaling.keda.sh/paused-scale-in": "true"}}}  # fmt: skip
    running.api.patch(SO, NS, "qwen", patch)
    await running.wait_record(key, lambda r: r is not None and not r.paused and r.paused_scale_in)
    # As KEDA: a one-way pause is not Paused; the condition's message says what is held.
    await running.api.wait_for(
        lambda: (c := running.condition("qwen", "Paused")) and c["status"] == "False"
        and "scale-in is paused by annotation" in c["message"], what="Paused=False naming the scale-in pause",
    )  # fmt: skip
    patch = {"metadata": {"annotations": {"autoscaling.keda.sh/paused-scale-in": None,
                                          "autoscaling.keda.sh/paused-scale-out": "true"}}}  # fmt: skip
    running.api.patch(SO, NS, "qwen", patch)
    await running.wait_record(key, lambda r: r is not None and r.paused_scale_out and not r.paused_scale_in)


async def test_a_second_scaledobject_on_the_same_workload_is_refused_until_the_first_goes(running: Running) -> None:
    running.api.create(SO, NS, scaled_object("first", model="qwen"))
    await running.wait_record(f"{NS}.first", lambda r: r is not None)
    running.api.create(SO, NS, scaled_object("second", model="llama", target="qwen"))
    cond = await running.wait_condition("second", "Ready", "False", "TargetConflict")
    assert "ScaledObject first" in cond["message"] and "Deployment/qwen" in cond["message"], cond["message"]
    assert await running.record(f"{NS}.second") is None
    assert running.events("second", "TargetConflict")[0]["type"] == "Warning"
    running.api.delete(SO, NS, "first")
    await running.wait_record(f"{NS}.first", lambda r: r is None)
    # The refused one is re-checked every status round: with the first gone it gets the workload.
    rec = await running.wait_record(f"{NS}.second", lambda r: r is not None)
    assert rec is not None and rec.spec.model == "llama"
    await running.wait_condition("second", "Ready", "True", "ScalerPublished")


async def test_an_hpa_on_the_workload_refuses_the_scaledobject(running: Running) -> None:
    running.api.create("horizontalpodautoscalers", NS, {
        "metadata": {"name": "qwen-hpa"},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "qwen"},
                 "minReplicas": 1, "maxReplicas": 3},
    })  # fmt: skip
    running.api.create(SO, NS, scaled_object())
    cond = await running.wait_condition("qwen", "Ready", "False", "TargetConflict")
    assert "HorizontalPodAutoscaler qwen-hpa" in cond["message"], cond["message"]
    assert await running.record(f"{NS}.qwen") is None


async def put_slot(nc: Client, model: str, node: str, slot: str, state: str) -> None:
    kv = (await ensure_buckets(nc.jetstream(), names=[protocol.SLOTS_BUCKET]))[protocol.SLOTS_BUCKET]
    record = protocol.SlotRecord(model=model, node=node, slot=slot, state=state)  # type: ignore[arg-type]
    await kv.put(f"{model}.{node}.{slot}", protocol.encode(record))


async def test_delete_removes_the_record_and_waits_for_the_models_slots(running: Running) -> None:
    running.api.create(SO, NS, scaled_object())
    await running.wait_record(f"{NS}.qwen", lambda r: r is not None)
    await running.wait_condition("qwen", "Ready", "True")
    await put_slot(running.nc, "qwen", "gpu-1", "s0", "ready")  # the autoscaler has not released it yet
    running.api.delete(SO, NS, "qwen")
    await running.wait_record(f"{NS}.qwen", lambda r: r is None)
    cond = await running.wait_condition("qwen", "Ready", "False", "Deleting")
    assert "waiting for 1 slot(s) of model qwen" in cond["message"] and "qwen.gpu-1.s0" in cond["message"]
    await running.api.wait_for(lambda: running.events("qwen", "WaitingForSlotRelease"), what="a Normal Event")
    await asyncio.sleep(0.6)
    obj = running.api.try_get(SO, NS, "qwen")
    assert obj is not None and FINALIZER in obj["metadata"]["finalizers"]  # still held by the finalizer
    await put_slot(running.nc, "qwen", "gpu-1", "s0", "warm")  # released
    await running.api.wait_for(lambda: running.api.try_get(SO, NS, "qwen") is None, what="the CR to go")


async def test_delete_gives_up_waiting_after_the_bound_and_says_so(k8s_api: K8sApiDouble, nc: Client) -> None:  # noqa: F811
    async with operator(k8s_api, nc, delete_wait_s=1.0) as running:
        running.api.create(SO, NS, scaled_object())
        await running.wait_condition("qwen", "Ready", "True")
        await put_slot(nc, "qwen", "gpu-1", "s0", "claimed")
        running.api.delete(SO, NS, "qwen")
        await running.api.wait_for(lambda: running.api.try_get(SO, NS, "qwen") is None, what="the CR to go")
        [warning] = running.events("qwen", "SlotsNotReleased")
        assert warning["type"] == "Warning" and "1 slot(s) of model qwen still held" in warning["message"]


async def test_delete_restores_the_original_replica_count(running: Running) -> None:
    running.api.patch("deployments", NS, "qwen", {
        "spec": {"replicas": 5, "selector": {"matchLabels": {"app": "qwen"}},
                 "template": {"metadata": {"labels": {"app": "qwen"}},
                              "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}}},
    })  # fmt: skip
    running.api.create(SO, NS, scaled_object(advanced={"restoreToOriginalReplicaCount": True}))
    await running.wait_condition("qwen", "Ready", "True")
    running.api.patch(SO, NS, "qwen", {"status": {"originalReplicaCount": 2}}, subresource="status")  # the cold path's
    running.api.delete(SO, NS, "qwen")
    await running.api.wait_for(lambda: running.api.try_get(SO, NS, "qwen") is None, what="the CR to go")
    assert running.api.get("deployments", NS, "qwen")["spec"]["replicas"] == 2
    [scale] = [r for r in running.api.requests if r.subresource == "scale" and r.method == "PATCH"]
    assert (scale.method, scale.path, scale.body) == (
        "PATCH",
        f"/apis/apps/v1/namespaces/{NS}/deployments/qwen/scale",
        {"spec": {"replicas": 2}},
    )
    assert running.events("qwen", "ReplicasRestored")


async def test_without_restore_the_workload_keeps_its_replicas(running: Running) -> None:
    running.api.patch("deployments", NS, "qwen", {"spec": {"replicas": 5}})
    running.api.create(SO, NS, scaled_object())
    await running.wait_condition("qwen", "Ready", "True")
    running.api.patch(SO, NS, "qwen", {"status": {"originalReplicaCount": 2}}, subresource="status")
    running.api.delete(SO, NS, "qwen")
    await running.api.wait_for(lambda: running.api.try_get(SO, NS, "qwen") is None, what="the CR to go")
    assert running.api.get("deployments", NS, "qwen")["spec"]["replicas"] == 5
    assert not [r for r in running.api.requests if r.subresource == "scale" and r.method == "PATCH"]


async def send_demand(nc: Client, model: str, *, queue_depth: int, seconds: float, every_s: float = 0.1) -> None:
    """A gateway's queue samples (as gateway/ publishes them) for `seconds`."""
    loop = asyncio.get_running_loop()
    end, seq = loop.time() + seconds, 0
    while loop.time() < end:
        seq += 1
        sample = protocol.QueueSample(
            gateway="test-gw", model=model, seq=seq, ts=time.time(), queue_depth=queue_depth, inflight=0,
            arrivals_total=seq, completions_total=0, timeouts_total=0,
        )  # fmt: skip
        await nc.publish(protocol.queue_subject(model), protocol.encode(sample))
        await asyncio.sleep(every_s)


@contextlib.asynccontextmanager
async def autoscaler(url: str, options: connect.NatsOptions | None = None) -> AsyncIterator[None]:
    """The real autoscaler daemon in this process, leading (a short lease so it leads at once)."""
    settings = daemon.AutoscalerSettings(
        nats=options or connect.NatsOptions(servers=(url,), name="test-autoscaler"),
        lease=LeaseSettings(lease_s=1.0, renew_every_s=0.2),
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    started: list[daemon.Autoscaler] = []
    task = asyncio.create_task(
        daemon.run(settings, stop=stop, ready=ready, metrics=AutoscalerMetrics(), on_started=started.append)
    )
    try:
        await asyncio.wait_for(ready.wait(), 10)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while not (started and started[0].ready() and started[0].fleet.holds_shards()):
            assert loop.time() < deadline, "the autoscaler did not lead within 5 s"
            await asyncio.sleep(0.05)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_the_status_subresource_follows_the_autoscaler(
    k8s_api: K8sApiDouble,  # noqa: F811
    nc: Client,
    nats_server: NatsServer,
) -> None:
    async with autoscaler(nats_server.url), operator(k8s_api, nc) as running:
        running.api.create(SO, NS, scaled_object())
        # No node agent: the autoscaler wants minReplicaCount and has nothing warm to give. (Its rows before its
        # first decision say 0.)
        status = await running.wait_reported("qwen", desired=1)
        assert (status["desiredReplicas"], status["readyReplicas"], status["warmSlots"]) == (1, 0, 0), status
        assert status["currentReplicas"] == 0 and status["scaleTargetKind"] == "apps/v1.Deployment"
        # The autoscaler's own pulse.events reach the object: with no warm slot it asked the cold path.
        [cold] = await running.api.wait_for(lambda: running.events("qwen", "ColdStart"), what="a ColdStart Event")
        assert "asked the cold path for 1 replica(s) of model qwen" in cold["message"], cold["message"]
        # As KEDA: replicas alone are not Active; no gateway has reported demand above the activation threshold.
        await running.wait_condition("qwen", "Active", "False", "ScalerNotActive")
        status = running.api.get(SO, NS, "qwen")["status"]
        assert {c["type"]: c["status"] for c in status["conditions"]} == {
            "Ready": "True", "Active": "False", "Fallback": "False", "Paused": "False"
        }  # fmt: skip
        assert all(c["lastTransitionTime"].endswith("Z") for c in status["conditions"])

        # Demand from a gateway makes it Active (an Event says so), and its end makes it inactive again.
        gateway = asyncio.create_task(send_demand(running.nc, "qwen", queue_depth=8, seconds=1.5))
        await running.wait_condition("qwen", "Active", "True", "ScalerActive")
        await running.api.wait_for(lambda: running.events("qwen", "Activated"), what="an Activated Event")
        await gateway
        status = running.api.get(SO, NS, "qwen")["status"]
        assert status["lastActiveTime"].endswith("Z") and status["lastDecisions"], status
        assert {"time", "desired", "reason"} <= set(status["lastDecisions"][-1])
        await running.wait_condition("qwen", "Active", "False", "ScalerNotActive")
        await running.api.wait_for(lambda: running.events("qwen", "Deactivated"), what="a Deactivated Event")

        # A pause annotation reaches the autoscaler through the record and comes back as the Paused condition.
        running.api.patch(SO, NS, "qwen", {"metadata": {"annotations": {"pulsescale.io/paused": "true"}}})
        cond = await running.wait_condition("qwen", "Paused", "True", "PausedByAnnotation")
        assert cond["observedGeneration"] == 1
        await running.api.wait_for(lambda: running.events("qwen", "Paused"), what="a Paused Event")

        # Quiet: the status is patched only when it changes. What time alone changes (the gateway's last word going
        # stale ends the pause decision's Active) is re-decided on the model's turn, once a second, later on a
        # loaded machine: within 10 s a full second (~3 status rounds at 0.3 s) must pass with no patch, which a
        # status patched every round never gives.
        def patches() -> int:
            return len([r for r in running.api.requests if r.subresource == "status"])

        deadline = time.monotonic() + 10
        while True:
            before = patches()
            await asyncio.sleep(1.0)
            after = patches()
            if after == before or time.monotonic() > deadline:
                break
        assert after == before, "status patched although nothing changed"


async def test_a_pulse_of_autoscaler_events_makes_a_few_aggregated_kubernetes_events(running: Running) -> None:
    recorder = running.ctx.extra["scaledobjects"].recorder
    recorder.min_write_interval_s = 0.5
    running.api.create(SO, NS, scaled_object())
    await running.wait_condition("qwen", "Ready", "True")
    running.api.create(SO, NS, scaled_object("other", model="llama", target="llama"))
    await running.wait_condition("other", "Ready", "True")
    before = len([r for r in running.api.requests if r.resource == "events"])
    for i in range(300):  # a pulse: the autoscaler decides on every sample
        event = protocol.Event(type="scale.decision", model="qwen", ts=float(i), desired=1 + i % 4, reason="demand")
        await running.nc.publish(protocol.events_subject("qwen"), protocol.encode(event))
    exhausted = protocol.Event(type="pool.exhausted", model="qwen", ts=1.0, reason="no warm slot on any node")
    await running.nc.publish(protocol.events_subject("qwen"), protocol.encode(exhausted))
    await running.nc.flush()

    def decisions() -> list[dict[str, Any]]:
        found = running.events("qwen", "ScaleDecision")
        return found if found and found[0]["count"] == 300 else []

    [decision] = await running.api.wait_for(decisions, what="one ScaleDecision Event counting 300")
    assert decision["type"] == "Normal" and decision["message"].startswith("desired ")
    assert decision["source"]["component"] == "pulsescale-operator"
    assert decision["involvedObject"]["uid"] == running.api.get(SO, NS, "qwen")["metadata"]["uid"]
    [pool] = await running.api.wait_for(lambda: running.events("qwen", "PoolExhausted"), what="PoolExhausted")
    assert pool["type"] == "Warning" and "no warm slot on any node" in pool["message"]
    assert not running.events("other", "ScaleDecision")  # another model's ScaledObject hears nothing
    writes = len([r for r in running.api.requests if r.resource == "events"]) - before
    assert writes <= 10, f"{writes} Event writes for one pulse"


async def test_the_operator_works_under_its_nats_role_without_a_violation(
    k8s_api: K8sApiDouble,  # noqa: F811
    tmp_path: Any,
) -> None:
    server = NatsServer(tmp_path / "nats")
    layout = natsauth.write_secure_layout(tmp_path / "auth", server.url, ["gpu-1"], tls=False)
    server.extra_config = layout.authorization
    with server:

        def options(user: str) -> connect.NatsOptions:
            env = natsauth.read_env_file(layout.credentials[user])
            return connect.options_from_args(argparse.Namespace(), name=f"test-{user}", env=env)

        async with autoscaler(server.url, options("autoscaler")):
            nc = await connect.connect(options("operator"))
            try:
                async with operator(k8s_api, nc, create=False) as running:
                    running.api.create(SO, NS, scaled_object())
                    await running.wait_record(f"{NS}.qwen", lambda r: r is not None)  # writes pulse_scalers
                    await running.wait_reported("qwen")  # asked pulse.cmd.status
                    running.api.delete(SO, NS, "qwen")  # reads pulse_slots, deletes its key
                    await running.api.wait_for(lambda: running.api.try_get(SO, NS, "qwen") is None, what="gone")
            finally:
                await nc.close()
        violations = [line for line in server.log_path.read_text().splitlines() if "Violation" in line]
        assert violations == []


async def test_a_restarted_operator_resumes_rewriting_only_what_is_missing(k8s_api: K8sApiDouble, nc: Client) -> None:  # noqa: F811
    async with operator(k8s_api, nc) as running:
        running.api.create(SO, NS, scaled_object())
        running.api.create(SO, NS, scaled_object("other", model="llama", target="llama"))
        await running.wait_condition("qwen", "Ready", "True")
        await running.wait_condition("other", "Ready", "True")
        kept = await revision(running, f"{NS}.other")
    await running.scalers.delete(f"{NS}.qwen")  # lost while no operator ran (or written over by hand)
    async with operator(k8s_api, nc) as running:
        rec = await running.wait_record(f"{NS}.qwen", lambda r: r is not None)  # kopf's resume handler
        assert rec is not None and rec.spec.model == "qwen"
        assert await revision(running, f"{NS}.other") == kept  # unchanged: not written again


def test_conditions_keep_their_transition_time_and_flips_become_events() -> None:
    from kube import status as st

    body: dict[str, Any] = {**scaled_object(), "status": {"originalReplicaCount": 3}}
    body["metadata"]["generation"] = 3
    verdict = st.Verdict(True, "ScalerPublished", "published")
    row = protocol.StatusRow(model="qwen", scaler="inference.qwen", desired=2, ready=1, activating=1, warm=3,
                             key="inference.qwen")  # fmt: skip
    first = st.body_of(st.compose(body, verdict, row, now=1000.0))
    assert first["currentReplicas"] == 2 and first["observedGeneration"] == 3 and first["warmSlots"] == 3
    assert "originalReplicaCount" not in first  # the cold path's field: never written back from a stale copy
    body["status"] = first
    fallback = msgspec.structs.replace(row, fallback=True)
    second = st.body_of(st.compose(body, verdict, fallback, now=2000.0), first)
    times = {c["type"]: c["lastTransitionTime"] for c in second["conditions"]}
    assert times["Ready"] == st.rfc3339(1000.0) and times["Fallback"] == st.rfc3339(2000.0)
    [change] = st.mode_changes(first, second)
    assert (change.type, change.event_type, change.reason) == ("Fallback", "Warning", "FallbackActivated")
    assert not st.differs(second, {**first, **second})  # nothing new: no patch


def test_pause_events_name_who_paused_and_a_resume_says_it_resumed() -> None:
    from kube import status as st

    body: dict[str, Any] = scaled_object()
    row = protocol.StatusRow(
        model="qwen", scaler="inference.qwen", desired=2, ready=2, activating=0, warm=0, key="inference.qwen",
        paused=True,
    )  # fmt: skip
    # The autoscaler paused by the record's annotation, in the round before this verdict knows it: not on-call.
    plain = st.Verdict(True, "ScalerPublished", "published")
    created = st.body_of(st.compose(body, plain, row, now=1000.0))
    paused = {c["type"]: c for c in created["conditions"]}["Paused"]
    assert (paused["reason"], paused["message"]) == ("PausedByAnnotation", "paused by annotation"), paused
    # Created already paused: the first status is news (a Paused Event).
    [change] = st.mode_changes(None, created)
    assert (change.reason, change.message) == ("Paused", "paused by annotation")
    # An on-call pause is the one with a pause override.
    command = protocol.Override(kind="pause", replicas=3, by="alice")
    by_command = st.compose(body, plain, msgspec.structs.replace(row, override=command), now=1000.0)
    assert {c.type: c.message for c in by_command.conditions}[
        "Paused"
    ] == "paused by an on-call command (holding 3) by alice"
    # Resumed, with a one-way pause left: the message says it is resumed first.
    one_way = st.Verdict(True, "ScalerPublished", "published", one_way_pause="scale-in")
    body["status"] = created
    resumed = st.body_of(st.compose(body, one_way, msgspec.structs.replace(row, paused=False), now=1001.0), created)
    [change] = st.mode_changes(created, resumed)
    assert change.reason == "Resumed" and change.message.startswith("not paused; scale-in is paused"), change


async def test_an_invalid_edit_keeps_the_status_of_the_record_in_force(running: Running) -> None:
    so = scaled_object()
    so["metadata"]["annotations"] = {"pulsescale.io/paused": "true"}
    running.api.create(SO, NS, so)
    await running.wait_condition("qwen", "Ready", "True", "ScalerPublished")
    operator_so = running.ctx.extra["scaledobjects"]
    # The autoscaler's row for it (no autoscaler runs here: the status round keeps the rows it has).
    operator_so.rows["inference.qwen"] = protocol.StatusRow(
        model="qwen", scaler="inference.qwen", desired=2, ready=2, activating=0, warm=0, key="inference.qwen",
        paused=True,
    )  # fmt: skip
    operator_so.rows_at = None
    await running.api.wait_for(
        lambda: (running.api.get(SO, NS, "qwen").get("status") or {}).get("desiredReplicas") == 2, what="desired 2"
    )
    running.api.patch(SO, NS, "qwen", {"spec": {"maxReplicaCount": 0}})
    await running.wait_condition("qwen", "Ready", "False", "InvalidSpec")
    await asyncio.sleep(0.7)  # two status rounds
    status = running.api.get(SO, NS, "qwen")["status"]
    conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert conditions["Paused"] == ("True", "PausedByAnnotation"), conditions
    assert conditions["Active"] == ("False", "ScalerNotActive"), conditions
    assert (status.get("desiredReplicas"), status.get("readyReplicas")) == (2, 2), status


async def test_a_missing_scale_target_is_not_ready_and_says_so(running: Running) -> None:
    # Published (warm slots serve without the workload) but not Ready, as KEDA keeps such an object, with an Event.
    running.api.create(SO, NS, scaled_object("ghost", model="ghost", target="nowhere"))
    cond = await running.wait_condition("ghost", "Ready", "False", "ScaleTargetNotFound")
    assert "Deployment/nowhere does not exist" in cond["message"], cond["message"]
    assert await running.record(f"{NS}.ghost") is not None
    await running.api.wait_for(lambda: running.events("ghost", "ScaleTargetNotFound"), what="a Warning Event")
    # The workload comes: Ready within a status round.
    running.api.create("deployments", NS, {"metadata": {"name": "nowhere", "namespace": NS}, "spec": {"replicas": 1}})
    await running.wait_condition("ghost", "Ready", "True", "ScalerPublished")
    # A kind other than a Deployment or StatefulSet is refused outright: tests/kube/test_operator_keda.py.


async def test_deleting_a_never_published_scaledobject_does_not_wait_for_slots(running: Running) -> None:
    running.api.create(SO, NS, scaled_object("broken", minReplicaCount=5, maxReplicaCount=2))
    await running.wait_condition("broken", "Ready", "False", "InvalidSpec")
    await put_slot(running.nc, "qwen", "gpu-1", "s0", "ready")  # held for someone else (apply, another cluster)
    running.api.delete(SO, NS, "broken")
    await running.api.wait_for(lambda: running.api.try_get(SO, NS, "broken") is None, timeout_s=3, what="gone")
    assert not running.events("broken", "WaitingForSlotRelease")


async def test_fallback_from_the_autoscaler_flips_the_condition_with_a_warning_event(
    k8s_api: K8sApiDouble,  # noqa: F811
    nc: Client,
    nats_server: NatsServer,
) -> None:
    async with autoscaler(nats_server.url), operator(k8s_api, nc) as running:
        running.api.create(SO, NS, scaled_object(advanced={"staleAfterSeconds": 0.2}))
        await running.wait_condition("qwen", "Fallback", "False", "NoFallback")
        # No gateway has ever reported this model: with a fallback section its count applies after one interval.
        running.api.patch(SO, NS, "qwen", {"spec": {"fallback": {"failureThreshold": 1, "replicas": 2}}})
        cond = await running.wait_condition("qwen", "Fallback", "True", "FallbackInForce")
        assert "fallback.failureThreshold" in cond["message"]
        [warning] = await running.api.wait_for(lambda: running.events("qwen", "FallbackActivated"), what="an Event")
        assert warning["type"] == "Warning"
        status = running.api.get(SO, NS, "qwen")["status"]
        assert status["desiredReplicas"] == 2 and "fallback" in status["lastDecisions"][-1]["reason"]


async def test_a_second_scaledobject_for_the_same_model_is_refused_until_the_first_goes(running: Running) -> None:
    running.api.create(SO, NS, scaled_object("chat", model="qwen", target="chat"))
    await running.wait_record(f"{NS}.chat", lambda r: r is not None)
    running.api.create(SO, NS, scaled_object("batch", model="qwen", target="batch"))
    cond = await running.wait_condition("batch", "Ready", "False", "ModelConflict")
    assert "model qwen is already scaled by ScaledObject inference/chat" in cond["message"], cond["message"]
    assert await running.record(f"{NS}.batch") is None
    running.api.delete(SO, NS, "chat")
    rec = await running.wait_record(f"{NS}.batch", lambda r: r is not None)
    assert rec is not None and rec.spec.model == "qwen"


async def test_a_silent_autoscaler_makes_active_and_fallback_unknown(
    k8s_api: K8sApiDouble,  # noqa: F811
    nc: Client,
    nats_server: NatsServer,
) -> None:
    async with operator(k8s_api, nc) as running:
        async with autoscaler(nats_server.url):
            running.api.create(SO, NS, scaled_object())
            await running.wait_reported("qwen")
            await running.wait_condition("qwen", "Active", "False", "ScalerNotActive")
        # The autoscaler is gone: after three unanswered rounds the conditions say so; the counts stay.
        cond = await running.wait_condition("qwen", "Active", "Unknown", "AutoscalerNotReporting")
        assert "has not answered pulse.cmd.status since" in cond["message"]
        assert running.condition("qwen", "Fallback")["status"] == "Unknown"  # type: ignore[index]
        assert "desiredReplicas" in running.api.get(SO, NS, "qwen")["status"]  # its last answer, kept


def test_kopf_logs_in_as_the_kubernetes_client_does_and_rereads_a_rotated_token() -> None:
    from kube.context import kopf_connection

    cfg = k8s.Configuration()
    cfg.host = "https://10.0.0.1:443"
    cfg.ssl_ca_cert = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    tokens = iter(["first", "second"])

    def refresh(c: k8s.Configuration) -> None:  # what load_incluster_config installs
        c.api_key = {"authorization": f"bearer {next(tokens)}"}

    cfg.refresh_api_key_hook = refresh
    client = k8s.ApiClient(cfg)
    try:
        info = kopf_connection(client)
        assert (info.server, info.scheme, info.token, info.ca_path) == (cfg.host, "bearer", "first", cfg.ssl_ca_cert)
        assert info.insecure is False
        assert kopf_connection(client).token == "second"
    finally:
        client.close()
