"""The operator's parts (kube/standby.py, kube/coldpath.py) with the real kopf and `kubernetes` client against the
API server double and a real nats-server; slots are driven through the real registry (`KvSlotStore`).

The double has no scheduler and no kubelet: where a test needs a pod on a node, it sets ``spec.nodeName`` and
``status.phase`` itself, as those would."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import nats.js.errors
import pytest
from nats.aio.client import Client

from autoscaler import daemon
from autoscaler.metrics import AutoscalerMetrics
from autoscaler.shards.leader import LeaseSettings
from kube import aio, coldpath, standby
from kube.context import OperatorContext
from kube.kopfrun import run_operator
from kube.operator import BACKGROUND, FINALIZER
from tests import k8s_api_double
from tests.k8s_api_double import K8sApiDouble
from tests.kube.test_operator import api_client, running_operator
from warmpool import connect, protocol
from warmpool.embedded import NatsServer
from warmpool.protocol import AgentLease, SlotRecord
from warmpool.registry import KvSlotStore, ensure_buckets

k8s_api = k8s_api_double.k8s_api  # the fixture

NS = "inference"
SO = "scaledobjects"
STANDBY = f"{standby.SCALEDOBJECT_LABEL}=qwen,{standby.STANDBY_LABEL}=true"


def deployment(name: str = "qwen", *, image: str = "vllm/vllm-openai:v0.9", replicas: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "engine", "image": image}]},
            },
        },
    }


def scaled_object(name: str = "qwen", *, size: int = 2, max_replicas: int = 10) -> dict[str, Any]:
    return {
        "apiVersion": "pulsescale.io/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "scaleTargetRef": {"name": name},
            "minReplicaCount": 1,
            "maxReplicaCount": max_replicas,
            "triggers": [{"type": "gateway-queue", "metadata": {"model": "qwen"}}],
            "warmPool": {"size": size},
        },
    }


@dataclass
class Running:
    api: K8sApiDouble
    ctx: OperatorContext

    def standby_pods(self) -> list[dict[str, Any]]:
        return [
            p for p in self.api.list("pods", NS, label_selector=STANDBY) if not p["metadata"].get("deletionTimestamp")
        ]

    async def wait_pods(self, pred: Any, what: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        def check() -> list[dict[str, Any]] | None:
            pods = self.standby_pods()
            return pods if pred(pods) else None

        result: list[dict[str, Any]] = await self.api.wait_for(check, timeout_s, what)
        return result


@contextlib.asynccontextmanager
async def operator(api: K8sApiDouble, nc: Client) -> AsyncIterator[Running]:
    api.prune_with_crds()  # what the parts write (status.coldPath) must survive the CRD's schema, as on a cluster
    buckets = await ensure_buckets(nc.jetstream(), names=[protocol.SCALERS_BUCKET, protocol.SLOTS_BUCKET])
    ctx = OperatorContext(
        nc=nc, scalers=buckets[protocol.SCALERS_BUCKET], slots=buckets[protocol.SLOTS_BUCKET], api=api_client(api),
        namespaces=(NS,), status_every_s=0.3,
    )  # fmt: skip
    async with running_operator(ctx):
        yield Running(api, ctx)


@pytest.fixture
async def running(k8s_api: K8sApiDouble, nc: Client) -> AsyncIterator[Running]:
    async with operator(k8s_api, nc) as r:
        yield r


def schedule(api: K8sApiDouble, pod: dict[str, Any], node: str) -> None:
    """What the scheduler and the kubelet would do: bind the pod to `node`, run it."""
    api.patch("pods", NS, pod["metadata"]["name"], {"spec": {"nodeName": node}})
    api.patch("pods", NS, pod["metadata"]["name"], {"status": {"phase": "Running"}}, subresource="status")


# --- standby pods ---------------------------------------------------------------------------------------------------


async def test_standby_pods_are_made_from_the_target_template_to_size(running: Running) -> None:
    running.api.create("deployments", NS, deployment())
    so = running.api.create(SO, NS, scaled_object(size=2))
    pods = await running.wait_pods(lambda ps: len(ps) == 2, "two standby pods")
    for pod in pods:
        labels = pod["metadata"]["labels"]
        assert labels["app"] == "qwen"  # the template's own labels
        assert labels[standby.SCALEDOBJECT_LABEL] == "qwen"
        assert labels[standby.MODEL_LABEL] == "qwen"
        assert labels[standby.STANDBY_LABEL] == "true" and labels[standby.SERVING_LABEL] == "false"
        template = deployment()["spec"]["template"]
        assert labels[standby.TEMPLATE_HASH_LABEL] == standby.template_hash(template)
        assert pod["spec"]["containers"][0]["image"] == "vllm/vllm-openai:v0.9"
        (owner,) = pod["metadata"]["ownerReferences"]
        assert owner["kind"] == "ScaledObject" and owner["uid"] == so["metadata"]["uid"] and owner["controller"]
    # Two more whole reconciles (the second starts only after the first has finished) add no pod.
    keeper = running.ctx.extra["standby"]
    for _ in range(2):
        seen = keeper.reconciles
        keeper.mark((NS, "qwen"))
        await running.api.wait_for(lambda: keeper.reconciles > seen, 10, "another reconcile")  # noqa: B023
    assert len(running.standby_pods()) == 2, "more pods than the size"


async def test_a_malformed_scaledobject_neither_stops_the_others_standby_pods_nor_hangs_its_delete(
    running: Running,
) -> None:
    # A trigger `metadata` that is a list: the validator refuses it; the keeper and the finalizer must not trip on
    # it (they did: an AttributeError ended the standby loop for every object, and the delete retried forever).
    running.api.create("deployments", NS, deployment())
    bad = scaled_object("bad", size=1)
    bad["spec"]["triggers"] = [{"type": "gateway-queue", "metadata": ["model", "g3"]}]
    bad["spec"]["scaleTargetRef"] = {"name": "other"}
    running.api.create(SO, NS, bad)
    await running.api.wait_for(
        lambda: FINALIZER in (running.api.get(SO, NS, "bad")["metadata"].get("finalizers") or []), 10, "bad handled"
    )
    running.api.create(SO, NS, scaled_object(size=2))
    await running.wait_pods(lambda ps: len(ps) == 2, "two standby pods for the valid object")
    running.api.delete(SO, NS, "bad")
    await running.api.wait_for(lambda: running.api.try_get(SO, NS, "bad") is None, 10, "the malformed object gone")
    assert running.ctx.died == [], "a background loop died"


async def test_background_work_that_dies_is_kept_for_healthz(k8s_api: K8sApiDouble, nc: Client) -> None:
    async with operator(k8s_api, nc) as r:
        pass  # the parts' loops ran and stopped on the stop flag: none counts as died
    assert r.ctx.died == []

    async def boom(stop: asyncio.Event) -> None:
        raise RuntimeError("a bug")

    buckets = await ensure_buckets(nc.jetstream(), names=[protocol.SCALERS_BUCKET, protocol.SLOTS_BUCKET])
    client = api_client(k8s_api)
    ctx = OperatorContext(nc=nc, scalers=buckets[protocol.SCALERS_BUCKET], slots=buckets[protocol.SLOTS_BUCKET],
                          api=client, namespaces=(NS,), extra={BACKGROUND: [boom]})  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(run_operator(ctx, stop_flag=stop))
    try:
        await k8s_api.wait_for(lambda: ctx.died, 10, "the dead loop noticed")
        assert "RuntimeError('a bug')" in ctx.died[0]
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        client.close()


async def test_a_deleted_or_failed_standby_pod_is_replaced(running: Running) -> None:
    running.api.create("deployments", NS, deployment())
    running.api.create(SO, NS, scaled_object(size=2))
    first, second = await running.wait_pods(lambda ps: len(ps) == 2, "two standby pods")
    running.api.delete("pods", NS, first["metadata"]["name"])
    pods = await running.wait_pods(
        lambda ps: len(ps) == 2 and first["metadata"]["name"] not in {p["metadata"]["name"] for p in ps},
        "the deleted pod replaced",
    )
    running.api.patch("pods", NS, second["metadata"]["name"], {"status": {"phase": "Failed"}}, subresource="status")
    pods = await running.wait_pods(
        lambda ps: len(ps) == 2 and second["metadata"]["name"] not in {p["metadata"]["name"] for p in ps},
        "the failed pod replaced",
    )
    assert all(p.get("status", {}).get("phase") != "Failed" for p in pods)


async def test_a_smaller_pool_deletes_idle_pods_never_a_serving_one(running: Running, store: KvSlotStore) -> None:
    running.api.create("deployments", NS, deployment())
    running.api.create(SO, NS, scaled_object(size=3))
    pods = await running.wait_pods(lambda ps: len(ps) == 3, "three standby pods")
    for pod in pods:
        schedule(running.api, pod, "n1")
    serving = await serve_one(running, store, "n1")
    running.api.patch(SO, NS, "qwen", {"spec": {"warmPool": {"size": 1}}})
    left = await running.wait_pods(lambda ps: len(ps) == 1, "the pool shrunk to one")
    assert left[0]["metadata"]["name"] == serving, "a serving pod was deleted"


async def test_a_changed_template_replaces_idle_pods_and_keeps_serving_ones(
    running: Running, store: KvSlotStore
) -> None:
    running.api.create("deployments", NS, deployment())
    running.api.create(SO, NS, scaled_object(size=2))
    pods = await running.wait_pods(lambda ps: len(ps) == 2, "two standby pods")
    for pod in pods:
        schedule(running.api, pod, "n1")
    serving = await serve_one(running, store, "n1")
    new = deployment(image="vllm/vllm-openai:v0.10")
    running.api.patch("deployments", NS, "qwen", {"spec": {"template": new["spec"]["template"]}})
    new_hash = standby.template_hash(new["spec"]["template"])

    def replaced(ps: list[dict[str, Any]]) -> bool:
        fresh = [p for p in ps if p["metadata"]["labels"][standby.TEMPLATE_HASH_LABEL] == new_hash]
        return len(ps) == 2 and len(fresh) == 1

    pods = await running.wait_pods(replaced, "the idle pod replaced with the new template")
    assert serving in {p["metadata"]["name"] for p in pods}, "the serving pod was replaced under its traffic"
    fresh = [p for p in pods if p["metadata"]["name"] != serving]
    assert fresh[0]["spec"]["containers"][0]["image"] == "vllm/vllm-openai:v0.10"


async def serve_one(running: Running, store: KvSlotStore, node: str) -> str:
    """A slot of qwen on `node` goes ready through the registry; returns the pod that turned serving."""
    await store.heartbeat(AgentLease(node=node, slots=["s0"], heartbeat_at=time.time(), lease_s=60))
    await store.register(SlotRecord(model="qwen", node=node, slot="s0", state="warm"))
    claim = await store.claim("qwen")
    claim = await store.advance(claim, "activating")
    await store.advance(claim, "ready", endpoint="http://10.0.0.7:8000")
    pods = await running.wait_pods(
        lambda ps: sum(p["metadata"]["labels"][standby.SERVING_LABEL] == "true" for p in ps) == 1, "one serving pod"
    )
    (pod,) = [p for p in pods if p["metadata"]["labels"][standby.SERVING_LABEL] == "true"]
    return str(pod["metadata"]["name"])


async def test_a_ready_slot_flips_a_pod_on_its_node_to_serving_and_back_on_release(
    running: Running, store: KvSlotStore
) -> None:
    running.api.create("deployments", NS, deployment())
    running.api.create(SO, NS, scaled_object(size=2))
    a, b = await running.wait_pods(lambda ps: len(ps) == 2, "two standby pods")
    schedule(running.api, a, "gpu-1")
    schedule(running.api, b, "gpu-2")
    await store.heartbeat(AgentLease(node="gpu-2", slots=["s0"], heartbeat_at=time.time(), lease_s=60))
    await store.register(SlotRecord(model="qwen", node="gpu-2", slot="s0", state="warm"))
    claim = await store.claim("qwen")
    claim = await store.advance(claim, "activating")
    await asyncio.sleep(0.3)
    assert all(p["metadata"]["labels"][standby.SERVING_LABEL] == "false" for p in running.standby_pods())
    claim = await store.advance(claim, "ready", endpoint="http://10.0.0.7:8000")

    def serving() -> list[str]:
        return [p["metadata"]["name"] for p in running.standby_pods()
                if p["metadata"]["labels"][standby.SERVING_LABEL] == "true"]  # fmt: skip

    await running.api.wait_for(lambda: serving() == [b["metadata"]["name"]], 10, "the pod on gpu-2 serving")
    pod = running.api.get("pods", NS, b["metadata"]["name"])
    assert pod["metadata"]["annotations"][standby.SLOT_ANNOTATION] == "qwen.gpu-2.s0"
    await store.release(claim)
    await running.api.wait_for(lambda: serving() == [], 10, "the pod back to standby")
    pod = running.api.get("pods", NS, b["metadata"]["name"])
    assert standby.SLOT_ANNOTATION not in (pod["metadata"].get("annotations") or {})
    assert len(running.standby_pods()) == 2


# --- pure parts -----------------------------------------------------------------------------------------------------


def pod(name: str, *, hash_: str = "h1", serving: bool = False, phase: str = "Running", node: str = "n1",
        created: str = "2026-01-01T00:00:00Z", slot: str | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "metadata": {
            "name": name,
            "creationTimestamp": created,
            "labels": {standby.TEMPLATE_HASH_LABEL: hash_, standby.SERVING_LABEL: "true" if serving else "false"},
            "annotations": {standby.SLOT_ANNOTATION: slot} if slot else {},
        },
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase},
    }


@pytest.mark.parametrize(
    ("pods", "size", "create", "delete"),
    [
        ([], 2, 2, []),
        ([pod("a"), pod("b")], 2, 0, []),
        ([pod("a"), pod("b", phase="Failed")], 2, 1, ["b"]),
        ([pod("a"), pod("b", hash_="old")], 2, 1, ["b"]),
        ([pod("a"), pod("b", hash_="old", serving=True)], 2, 0, []),  # serving: kept until released
        ([pod("a", serving=True), pod("b"), pod("c", node="")], 1, 0, ["c", "b"]),  # unscheduled goes first
        ([pod("a", serving=True), pod("b", serving=True)], 1, 0, []),  # never a serving one
        ([pod("a", created="2026-01-01T00:00:00Z"), pod("b", created="2026-01-02T00:00:00Z")], 1, 0, ["b"]),
    ],
)
def test_plan(pods: list[dict[str, Any]], size: int, create: int, delete: list[str]) -> None:
    result = standby.plan(pods, size, "h1")
    assert (result.create, list(result.delete)) == (create, delete)


def test_serving_changes_follow_ready_slots() -> None:
    pods = [pod("a", node="n1"), pod("b", node="n2", serving=True, slot="m.n2.s0"), pod("c", node="n2")]
    flips, unplaced = standby.serving_changes(pods, {"m.n1.s0": "n1", "m.n3.s0": "n3"})
    assert sorted((f.pod, f.serving, f.slot) for f in flips) == [("a", True, "m.n1.s0"), ("b", False, None)]
    assert unplaced == ["m.n3.s0"]
    flips, _ = standby.serving_changes(pods, {"m.n2.s0": "n2"})
    assert flips == []  # already serving it


async def test_a_cancel_that_meets_the_wake_up_is_not_lost() -> None:
    """The keeper's loop ends only by its stop flag or a cancel. On Python 3.11 asyncio.wait_for returns normally when
    the cancel comes in the same loop iteration as the event it waits for (a slot change as the operator stops), and
    such a loop ran on: shutdown hung. `aio.wait_event` keeps the cancel (asyncio.wait_for fails this test on 3.11)."""
    event = asyncio.Event()

    async def loop_until_cancelled() -> None:
        while True:
            await aio.wait_event(event, 10)
            event.clear()

    task = asyncio.create_task(loop_until_cancelled())
    await asyncio.sleep(0.01)
    event.set()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1)
    assert done and task.cancelled(), "the cancel was lost: the loop runs on"


# --- the cold path --------------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def autoscaler(url: str) -> AsyncIterator[None]:
    """The real autoscaler daemon in this process, leading at once (a short lease). With no node agent it has no
    warm slot, so every replica it wants goes to the cold path."""
    settings = daemon.AutoscalerSettings(
        nats=connect.NatsOptions(servers=(url,), name="test-autoscaler"),
        lease=LeaseSettings(lease_s=1.0, renew_every_s=0.2),
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(daemon.run(settings, stop=stop, ready=ready, metrics=AutoscalerMetrics()))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def scale_writes(api: K8sApiDouble) -> list[k8s_api_double.ApiRequest]:
    return [r for r in api.requests if r.subresource == "scale" and r.verb in ("patch", "update")]


async def test_the_cold_path_patches_the_scale_subresource_as_an_hpa_once_per_request(
    k8s_api: K8sApiDouble, nc: Client, nats_server: NatsServer
) -> None:
    async with autoscaler(nats_server.url), operator(k8s_api, nc) as running:
        running.api.create("deployments", NS, deployment(replicas=1))
        so = scaled_object(size=0, max_replicas=5)
        so["spec"]["minReplicaCount"] = 3  # the autoscaler wants 3 at once, and the pool has none
        running.api.create(SO, NS, so)
        await running.api.wait_for(lambda: scale_writes(running.api), 15, "a scale patch")
        [write] = scale_writes(running.api)
        assert (write.method, write.path) == ("PATCH", f"/apis/apps/v1/namespaces/{NS}/deployments/qwen/scale")
        assert write.body == {"spec": {"replicas": 3}}  # the 1 running counts: raised to 3, not by 3
        assert running.api.get("deployments", NS, "qwen")["spec"]["replicas"] == 3
        status = running.api.get(SO, NS, "qwen")["status"]
        assert status["originalReplicaCount"] == 1
        assert status[coldpath.COLD_PATH_STATUS]["fromReplicas"] == 1
        await running.api.wait_for(lambda: running_events(running.api, "ColdPathScaled"), 10, "a ColdPathScaled Event")
        [event] = running_events(running.api, "ColdPathScaled")
        assert "from 1 to 3 replicas" in event["message"]
        # The shortfall lasts (the autoscaler still counts no warm replica): its status rows keep asking for the
        # same 2 every round, and the event may come again; the workload is patched once.
        cold = running.ctx.extra["coldpath"]
        seen = cold.rounds
        await running.api.wait_for(lambda: cold.rounds >= seen + 3, 10, "three more cold-path rounds")
        assert len(scale_writes(running.api)) == 1


def running_events(api: K8sApiDouble, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.list("events", NS) if e["reason"] == reason]


async def test_cold_path_requests_are_idempotent_across_replicas_and_capped(k8s_api: K8sApiDouble, nc: Client) -> None:
    async with operator(k8s_api, nc) as running:
        running.api.create("statefulsets", NS, deployment(replicas=2))
        running.api.create(SO, NS, scaled_object(size=0, max_replicas=6))
        running.api.patch(SO, NS, "qwen", {"spec": {"scaleTargetRef": {"kind": "StatefulSet"}}})
        body = await running.api.wait_for(lambda: _published(running), 10, "the ScaledObject published")
        cold = running.ctx.extra["coldpath"]
        assert await cold.request(body, 2) is None  # the 2 it runs cover it: nothing written
        await running.api.wait_for(
            lambda: running_events(running.api, "ColdPathCovered"), 10, "a ColdPathCovered Event"
        )
        assert await cold.request(body, 4) == 4
        assert await cold.request(body, 4) is None  # the same request again (the status row after the event)
        # A new leader remembers nothing but the status: the same request is still served already.
        fresh = coldpath.ColdPath(running.ctx)
        assert await fresh.request(body, 4) is None
        assert await fresh.request(body, 9) == 6  # more within the episode: to 9, capped at 6
        writes = scale_writes(running.api)
        assert [(w.path, w.body) for w in writes] == [
            (f"/apis/apps/v1/namespaces/{NS}/statefulsets/qwen/scale", {"spec": {"replicas": 4}}),
            (f"/apis/apps/v1/namespaces/{NS}/statefulsets/qwen/scale", {"spec": {"replicas": 6}}),
        ]
        status = running.api.get(SO, NS, "qwen")["status"]
        assert status["originalReplicaCount"] == 2  # before the first change
        assert status[coldpath.COLD_PATH_STATUS]["fromReplicas"] == 2
        assert await fresh.request(body, 12) is None  # at the cap: nothing to add
        await running.api.wait_for(lambda: running_events(running.api, "ColdPathAtMax"), 10, "a ColdPathAtMax Event")


def _published(running: Running) -> dict[str, Any] | None:
    known = running.ctx.extra["scaledobjects"].known.get(f"{NS}.qwen")
    if known is None or not known.verdict.ready:
        return None
    return dict(known.body)


@pytest.mark.parametrize(
    ("current", "needed", "cap", "episode", "to"),
    [
        (1, 2, 10, None, 2),  # the target's replica counts: raised to 2, not by 2
        (3, 1, 10, None, 3),  # covered by what it runs: no change (a Deployment at 3, created without demand)
        (2, 2, 10, coldpath.Episode(2, 1, 2), 2),  # the same request: no change
        (2, 4, 10, coldpath.Episode(2, 1, 2), 4),  # a larger one within the episode
        (1, 20, 10, None, 10),  # capped
        (12, 2, 10, None, 12),  # above the cap already: never scaled down
    ],
)
def test_scale_to(current: int, needed: int, cap: int, episode: coldpath.Episode | None, to: int) -> None:
    assert coldpath.scale_to(current, needed, cap, episode)[0] == to


def test_successive_cold_path_episodes_do_not_stack() -> None:
    # An earlier episode took the workload to 4 and ended. Another shortfall of 2: the 4 cover it (it climbed
    # 1 -> 4 -> 6 -> 8 when each shortfall was added on top). A larger one raises to it; never below what runs.
    to, episode = coldpath.scale_to(4, 2, 10, None)
    assert to == 4 and episode.from_replicas == 4
    assert coldpath.scale_to(4, 5, 10, None)[0] == 5
    assert coldpath.scale_to(4, 7, 5, None)[0] == 5


# --- `pulsescale operator`, a real process ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def operator_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "PULSESCALE_NATS", "POD_"))}
    env["HOME"] = str(home)  # no ~/.kube/config of the machine running the tests
    return env


async def run_cli(*args: str, env: dict[str, str], timeout_s: float = 30.0) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pulsescale", "operator", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return int(proc.returncode or 0), out.decode()


async def test_pulsescale_operator_runs_as_a_process_and_stops_on_sigterm(
    k8s_api: K8sApiDouble, nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    await ensure_buckets(nc.jetstream())  # as the autoscaler does at its start
    kubeconfig = k8s_api.kubeconfig(tmp_path / "kubeconfig", namespace=NS, token="operator-process")
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pulsescale", "operator", "--kubeconfig", str(kubeconfig), "--namespace", NS,
        "--nats", nats_server.url, "--lease-namespace", NS, "--identity", "op-1", "--lease-duration", "2",
        "--status-every", "0.3", "--health-port", str(port),
        env=operator_env(tmp_path), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:

            async def healthy() -> bool:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/readyz") as rsp:
                        return rsp.status == 200
                except aiohttp.ClientError:
                    return False

            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while not await healthy():
                assert proc.returncode is None, (await proc.stdout.read()).decode()  # type: ignore[union-attr]
                assert loop.time() < deadline, "the operator never became ready"
                await asyncio.sleep(0.1)
        k8s_api.create(SO, NS, scaled_object(size=0))
        scalers = (await ensure_buckets(nc.jetstream(), names=[protocol.SCALERS_BUCKET]))[protocol.SCALERS_BUCKET]

        async def published() -> protocol.ScalerRecord | None:
            try:
                entry = await scalers.get(f"{NS}.qwen")
            except nats.js.errors.KeyNotFoundError:
                return None
            return None if entry.value is None else protocol.decode(entry.value, protocol.ScalerRecord)

        deadline = loop.time() + 20
        while (record := await published()) is None:
            assert loop.time() < deadline, "the ScaledObject never reached pulse_scalers"
            await asyncio.sleep(0.1)
        assert record.spec.model == "qwen"
        assert k8s_api.get("leases", NS, "pulsescale-operator")["spec"]["holderIdentity"] == "op-1"
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0, out.decode()[-3000:]
        assert k8s_api.get("leases", NS, "pulsescale-operator")["spec"]["holderIdentity"] == ""  # released
        assert all(r.token == "operator-process" for r in k8s_api.requests if r.verb)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_pulsescale_operator_without_credentials_says_how_to_give_them(tmp_path: Path) -> None:
    rc, out = await run_cli("--nats", "nats://127.0.0.1:1", env=operator_env(tmp_path))
    assert rc == 1
    assert "no Kubernetes credentials: pass --kubeconfig FILE" in out and out.count("\n") == 1, out


async def test_pulsescale_operator_without_the_crd_says_to_install_it(tmp_path: Path) -> None:
    api = K8sApiDouble([r for r in k8s_api_double.RESOURCES if r.group != "pulsescale.io"])
    await api.start()
    try:
        kubeconfig = api.kubeconfig(tmp_path / "kubeconfig", namespace=NS)
        rc, out = await run_cli("--kubeconfig", str(kubeconfig), "--nats", "nats://127.0.0.1:1",
                                env=operator_env(tmp_path))  # fmt: skip
    finally:
        await api.stop()
    assert rc == 1
    assert "the ScaledObject CRD is not installed" in out and "install it: kubectl apply -k deploy/crd" in out, out


async def test_pulsescale_operator_with_nats_unreachable_says_so(k8s_api: K8sApiDouble, tmp_path: Path) -> None:
    kubeconfig = k8s_api.kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    rc, out = await run_cli("--kubeconfig", str(kubeconfig), "--nats", f"nats://127.0.0.1:{free_port()}",
                            "--nats-connect-timeout", "1", env=operator_env(tmp_path))  # fmt: skip
    assert rc == 3  # unreachable
    assert "cannot connect to NATS" in out and "nothing listens there" in out, out


async def test_pulsescale_operator_refuses_a_namespace_glob_it_could_not_resolve(tmp_path: Path) -> None:
    # kopf resolves globs by listing Namespaces, which this operator never does: `team-*` would watch nothing.
    rc, out = await run_cli("--namespace", "team-*", "--nats", "nats://127.0.0.1:1", env=operator_env(tmp_path))
    assert rc == 2
    assert "'team-*' is not a namespace name" in out and "globs and negations are not supported" in out, out
