"""The kopf operator for ScaledObject CRs: the real kopf and the real `kubernetes` client against the HTTP double
of the Kubernetes API (tests/k8s_api_double.py) and a real nats-server.

Each test runs `kube.operator.run_operator` in the test's event loop, writes ScaledObjects (and HPAs, Deployments)
into the double as `kubectl` would, and reads what the operator did: KV `pulse_scalers`, the objects' status
subresource, Events, and the double's request log.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import nats.js.errors
import pytest
from kubernetes import client as k8s
from nats.aio.client import Client
from nats.js.kv import KeyValue

from kube.context import OperatorContext
from kube.operator import FINALIZER, run_operator
from tests.k8s_api_double import K8sApiDouble, k8s_api  # noqa: F401 - fixture
from warmpool import protocol
from warmpool.registry import ensure_buckets

NS = "inference"
SO = "scaledobjects"


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
async def operator(api: K8sApiDouble, nc: Client, **settings: Any) -> AsyncIterator[Running]:
    buckets = await ensure_buckets(nc.jetstream(), names=[protocol.SCALERS_BUCKET, protocol.SLOTS_BUCKET])
    client = api_client(api)
    ctx = OperatorContext(
        nc=nc, scalers=buckets[protocol.SCALERS_BUCKET], slots=buckets[protocol.SLOTS_BUCKET], api=client,
        namespaces=(NS,), status_every_s=settings.pop("status_every_s", 0.3), **settings,
    )  # fmt: skip
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_operator(ctx, stop_flag=stop, ready_flag=ready))
    try:
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([waiter, task], timeout=10, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task.done():
            task.result()  # raises what ended it
        assert ready.is_set(), "the operator did not become ready within 10 s"
        yield Running(api, ctx, buckets[protocol.SCALERS_BUCKET], nc)
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, 15)
        finally:
            client.close()


@pytest.fixture
async def running(k8s_api: K8sApiDouble, nc: Client) -> AsyncIterator[Running]:  # noqa: F811
    async with operator(k8s_api, nc) as r:
        yield r


async def test_a_created_scaledobject_is_published_and_ready(running: Running) -> None:
    running.api.create(SO, NS, scaled_object())
    rec = await running.wait_record(f"{NS}.qwen", lambda r: r is not None)
    assert rec is not None and rec.spec.model == "qwen" and rec.spec.max_replica_count == 4
    cond = await running.wait_condition("qwen", "Ready", "True", "ScalerPublished")
    assert "inference.qwen" in cond["message"]
    obj = running.api.get(SO, NS, "qwen")
    assert FINALIZER in obj["metadata"]["finalizers"]
    assert obj["status"]["scaleTargetName"] == "qwen" and obj["status"]["observedGeneration"] == 1
