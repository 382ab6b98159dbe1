"""Leader election of the operator over a Kubernetes Lease (kube/leader.py), against the API server double.

Two replicas, each with its own credentials (a bearer token the double logs with every request), so the request
log tells who wrote what and when: a handover must never have two actors."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from nats.aio.client import Client
from nats.js.kv import KeyValue

from kube import aio, leader
from kube.context import OperatorContext
from kube.kopfrun import run_operator
from tests import k8s_api_double
from tests.k8s_api_double import K8sApiDouble
from warmpool import connect, protocol
from warmpool.embedded import NatsServer
from warmpool.registry import ensure_buckets

k8s_api = k8s_api_double.k8s_api  # the fixture

NS = "pulsescale-system"
DURATION_S = 1.5  # short leases keep the handover tests to seconds
WIRE_DURATION_S = 2  # leaseDurationSeconds: whole seconds, rounded up


def api_client(api: K8sApiDouble, tmp_path: Path, token: str) -> k8s.ApiClient:
    path = api.kubeconfig(tmp_path / f"{token}.kubeconfig", namespace=NS, token=token)
    return k8s_config.new_client_from_config(config_file=str(path))


def elector(api: K8sApiDouble, tmp_path: Path, identity: str) -> leader.LeaseElector:
    client = api_client(api, tmp_path, identity)
    settings = leader.LeaseSettings(namespace=NS, identity=identity, duration_s=DURATION_S, retry_every_s=0.1)
    return leader.LeaseElector(k8s.CoordinationV1Api(client), settings)


def writer(api: K8sApiDouble, tmp_path: Path, identity: str, log: list[tuple[str, float]]) -> leader.Act:
    """An acting side that writes an Event every 50 ms until told to stop, as a busy operator would."""
    core = k8s.CoreV1Api(api_client(api, tmp_path, identity))

    async def act(stop_flag: asyncio.Event) -> None:
        n = 0
        while not stop_flag.is_set():
            body = {"metadata": {"name": f"{identity}-{n}", "namespace": NS}, "reason": "Acting",
                    "involvedObject": {"kind": "Lease", "name": "pulsescale-operator", "namespace": NS}}  # fmt: skip
            await asyncio.to_thread(core.create_namespaced_event, NS, body)
            log.append((identity, time.monotonic()))
            n += 1
            await aio.wait_event(stop_flag, 0.05)  # not wait_for: it can lose the "kill" (ta.cancel())

    return act


def writes_by(api: K8sApiDouble, token: str) -> list[int]:
    """Indexes in the request log of the event writes made with `token`."""
    return [i for i, r in enumerate(api.requests) if r.token == token and r.resource == "events" and r.verb == "create"]


@contextlib.asynccontextmanager
async def running(*tasks: asyncio.Task[None]) -> AsyncIterator[None]:
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


async def test_one_of_two_candidates_acquires_and_the_lease_says_so(k8s_api: K8sApiDouble, tmp_path: Path) -> None:
    a, b = elector(k8s_api, tmp_path, "op-a"), elector(k8s_api, tmp_path, "op-b")
    won = await asyncio.gather(a.try_acquire_or_renew(), b.try_acquire_or_renew())
    assert sorted(won) == [False, True]
    first, second = (a, b) if won[0] else (b, a)
    assert first.leading() and not second.leading()
    lease = k8s_api.get("leases", NS, "pulsescale-operator")
    spec = lease["spec"]
    assert spec["holderIdentity"] == first.settings.identity
    assert spec["leaseDurationSeconds"] == 2  # whole seconds on the wire
    assert spec["leaseTransitions"] == 0
    # MicroTime, UTC (the client writes +00:00 for Z, which the API server reads as RFC 3339 too)
    for stamp in (spec["acquireTime"], spec["renewTime"]):
        assert abs(datetime.datetime.fromisoformat(stamp).timestamp() - time.time()) < 5
    # The other keeps reading; within a duration of its first sight it does not take over, renewals or not.
    assert not await second.try_acquire_or_renew()
    assert await first.try_acquire_or_renew()  # a renewal
    assert k8s_api.get("leases", NS, "pulsescale-operator")["spec"]["leaseTransitions"] == 0


async def test_a_stale_resource_version_loses_the_race(k8s_api: K8sApiDouble, tmp_path: Path) -> None:
    a, b = elector(k8s_api, tmp_path, "op-a"), elector(k8s_api, tmp_path, "op-b")
    b_now = [1000.0]
    b._clock = lambda: b_now[0]  # b's clock, moved by hand
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()  # first sight of this version: b's count starts now
    b_now[0] += WIRE_DURATION_S - 0.1
    assert not await b.try_acquire_or_renew()  # unchanged, but not for a whole duration yet
    b_now[0] += 0.2
    # a renews between b's read and b's write: b's replace carries the version it read, and the server says 409.
    real_read = b.api.read_namespaced_lease

    def read_then_a_renews(*args: object, **kwargs: object) -> object:
        out = real_read(*args, **kwargs)  # type: ignore[arg-type]
        asyncio.run_coroutine_threadsafe(a.try_acquire_or_renew(), loop).result(5)
        return out

    loop = asyncio.get_running_loop()
    b.api.read_namespaced_lease = read_then_a_renews  # type: ignore[method-assign]
    assert not await b.try_acquire_or_renew()
    conflicts = [r for r in k8s_api.requests if r.token == "op-b" and r.verb == "update"]
    assert conflicts, "b never tried to take the expired lease over"
    assert k8s_api.get("leases", NS, "pulsescale-operator")["spec"]["holderIdentity"] == "op-a"


async def test_handover_when_the_leader_is_killed(k8s_api: K8sApiDouble, tmp_path: Path) -> None:
    """The leader dies without releasing (a crash): the other takes over after the lease duration and acts; the
    old one's last write precedes the new one's first."""
    acts: list[tuple[str, float]] = []
    a, b = elector(k8s_api, tmp_path, "op-a"), elector(k8s_api, tmp_path, "op-b")
    stop = asyncio.Event()
    ta = asyncio.create_task(leader.run_elected(a, writer(k8s_api, tmp_path, "op-a", acts), stop=stop))
    await wait_until(lambda: acts, 5, "a first leader")
    tb = asyncio.create_task(leader.run_elected(b, writer(k8s_api, tmp_path, "op-b", acts), stop=stop))
    async with running(ta, tb):
        await asyncio.sleep(DURATION_S)  # a renews meanwhile; b must not act
        assert {who for who, _ in acts} == {"op-a"}
        ta.cancel()  # killed: no release, no clean stop
        killed_at = time.monotonic()
        await wait_until(lambda: any(who == "op-b" for who, _ in acts), 10, "b to take over")
        b_first = min(t for who, t in acts if who == "op-b")
        assert b_first - killed_at >= DURATION_S * 0.6  # it waited for the lease, not just for a read
        await wait_until(lambda: len([1 for who, _ in acts if who == "op-b"]) >= 5, 5, "b to keep acting")
    assert max(writes_by(k8s_api, "op-a")) < min(writes_by(k8s_api, "op-b"))
    assert k8s_api.get("leases", NS, "pulsescale-operator")["spec"]["leaseTransitions"] == 1


async def test_a_leader_cut_off_from_its_lease_stops_acting_before_the_other_starts(
    k8s_api: K8sApiDouble, tmp_path: Path
) -> None:
    """The leader's renewals fail (the API server unreachable for them) while its acting side could still write:
    it must stop acting before its lease can expire, so the request log never interleaves two actors."""
    acts: list[tuple[str, float]] = []
    a, b = elector(k8s_api, tmp_path, "op-a"), elector(k8s_api, tmp_path, "op-b")
    stop = asyncio.Event()
    ta = asyncio.create_task(leader.run_elected(a, writer(k8s_api, tmp_path, "op-a", acts), stop=stop))
    await wait_until(lambda: acts, 5, "a first leader")
    tb = asyncio.create_task(leader.run_elected(b, writer(k8s_api, tmp_path, "op-b", acts), stop=stop))
    async with running(ta, tb):
        await asyncio.sleep(0.3)
        # Its Lease calls now go where nothing listens (its acting side still reaches the API server).
        a.api = k8s.CoordinationV1Api(k8s.ApiClient(k8s.Configuration(host="http://127.0.0.1:9")))
        await wait_until(lambda: any(who == "op-b" for who, _ in acts), 10, "b to take over")
        await wait_until(lambda: len([1 for who, _ in acts if who == "op-b"]) >= 5, 5, "b to keep acting")
        a_last = max(t for who, t in acts if who == "op-a")
        assert not a.leading()
    assert max(writes_by(k8s_api, "op-a")) < min(writes_by(k8s_api, "op-b"))
    b_first = min(t for who, t in acts if who == "op-b")
    assert b_first > a_last


async def test_a_stop_during_an_overdue_renewal_still_releases_the_lease(k8s_api: K8sApiDouble, tmp_path: Path) -> None:
    # Under load a renewal can be overdue when SIGTERM comes: the release was skipped then (a flake of the
    # process test: holderIdentity still "op-1" after SIGTERM).
    a = elector(k8s_api, tmp_path, "op-a")
    now = [1000.0]
    a._clock = lambda: now[0]  # moved by hand: the renewal becomes overdue at once
    stop = asyncio.Event()

    async def act(stop_flag: asyncio.Event) -> None:
        await stop_flag.wait()  # stopped for the overdue renewal...
        stop.set()  # ...and SIGTERM meanwhile

    task = asyncio.create_task(leader.run_elected(a, act, stop=stop))
    async with running(task):
        await wait_until(a.leading, 5, "a to lead")
        now[0] += 100
        await asyncio.wait_for(task, 5)
    assert k8s_api.get("leases", NS, "pulsescale-operator")["spec"]["holderIdentity"] == ""


async def test_a_clean_stop_releases_the_lease_for_an_immediate_handover(k8s_api: K8sApiDouble, tmp_path: Path) -> None:
    acts: list[tuple[str, float]] = []
    a, b = elector(k8s_api, tmp_path, "op-a"), elector(k8s_api, tmp_path, "op-b")
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    ta = asyncio.create_task(leader.run_elected(a, writer(k8s_api, tmp_path, "op-a", acts), stop=stop_a))
    await wait_until(lambda: acts, 5, "a first leader")
    tb = asyncio.create_task(leader.run_elected(b, writer(k8s_api, tmp_path, "op-b", acts), stop=stop_b))
    async with running(ta, tb):
        await asyncio.sleep(0.2)
        stop_a.set()  # SIGTERM
        await asyncio.wait_for(ta, 5)
        assert k8s_api.get("leases", NS, "pulsescale-operator")["spec"]["holderIdentity"] == ""
        stopped_at = time.monotonic()
        await wait_until(lambda: any(who == "op-b" for who, _ in acts), 5, "b to take over")
        assert min(t for who, t in acts if who == "op-b") - stopped_at < DURATION_S  # no waiting out the lease
    assert max(writes_by(k8s_api, "op-a")) < min(writes_by(k8s_api, "op-b"))


def test_settings_refuse_a_nonsense_duration() -> None:
    with pytest.raises(ValueError, match="--lease-duration"):
        leader.LeaseSettings(namespace=NS, identity="x", duration_s=0.1)
    with pytest.raises(ValueError, match="identity"):
        leader.LeaseSettings(namespace=NS, identity="")


# --- two real operators ---------------------------------------------------------------------------------------------


async def test_two_operators_one_acts_and_the_other_takes_over_when_the_leader_is_cut_off(
    k8s_api: K8sApiDouble, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Two `run_operator`s behind two electors, each with its own token: the leader publishes a ScaledObject; its
    Lease calls are then cut off (its operator could still reach the API server); the other takes over and
    publishes a new ScaledObject, and the request log has no write of the old leader after the new one's first."""
    stop = asyncio.Event()
    conns: list[Client] = []
    clients: list[k8s.ApiClient] = []
    electors: dict[str, leader.LeaseElector] = {}
    tasks: list[asyncio.Task[None]] = []
    try:
        for identity in ("op-a", "op-b"):
            nc = await connect.connect(connect.NatsOptions(servers=(nats_server.url,), name=identity))
            conns.append(nc)
            buckets = await ensure_buckets(nc.jetstream(), names=[protocol.SCALERS_BUCKET, protocol.SLOTS_BUCKET])
            client = api_client(k8s_api, tmp_path, identity)
            clients.append(client)
            ctx = OperatorContext(
                nc=nc, scalers=buckets[protocol.SCALERS_BUCKET], slots=buckets[protocol.SLOTS_BUCKET], api=client,
                namespaces=(SO_NS,), identity=identity, status_every_s=0.3,
            )  # fmt: skip
            el = elector(k8s_api, tmp_path, identity)
            ctx.extra["leading"] = el.leading
            electors[identity] = el

            async def act(stop_flag: asyncio.Event, ctx: OperatorContext = ctx) -> None:
                await run_operator(ctx, stop_flag=stop_flag)

            tasks.append(asyncio.create_task(leader.run_elected(el, act, stop=stop)))
            if identity == "op-a":
                await wait_until(el.leading, 5, "op-a to lead")
        scalers = buckets[protocol.SCALERS_BUCKET]
        for name in ("first", "second"):  # the scale targets (a missing one is Ready=False ScaleTargetNotFound)
            workload = {"metadata": {"name": name, "namespace": SO_NS}, "spec": {"replicas": 1}}
            k8s_api.create("deployments", SO_NS, workload)
        k8s_api.create("scaledobjects", SO_NS, so_body("first"))
        await wait_record(scalers, f"{SO_NS}.first")
        assert not electors["op-b"].leading()
        electors["op-a"].api = k8s.CoordinationV1Api(k8s.ApiClient(k8s.Configuration(host="http://127.0.0.1:9")))
        await wait_until(electors["op-b"].leading, 15, "op-b to take over")
        k8s_api.create("scaledobjects", SO_NS, so_body("second"))
        await wait_record(scalers, f"{SO_NS}.second")
        await asyncio.sleep(0.5)  # a straggler of op-a would show now
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        for c in clients:
            c.close()
        for nc in conns:
            await nc.close()
    writes = [(i, r.token) for i, r in enumerate(k8s_api.requests) if r.verb in ("create", "update", "patch", "delete")]
    a_writes = [i for i, token in writes if token == "op-a"]
    b_writes = [i for i, token in writes if token == "op-b"]
    assert a_writes and b_writes
    b_first_action = min(i for i in b_writes if k8s_api.requests[i].resource != "leases")
    assert max(a_writes) < b_first_action, "the old leader wrote after the new one acted"
    second = k8s_api.get("scaledobjects", SO_NS, "second")
    assert {c["type"]: c["status"] for c in second["status"]["conditions"]}["Ready"] == "True"


SO_NS = "inference"


def so_body(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "pulsescale.io/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": name, "namespace": SO_NS},
        "spec": {"scaleTargetRef": {"name": name}, "maxReplicaCount": 4,
                 "triggers": [{"type": "gateway-queue", "metadata": {"model": name}}]},
    }  # fmt: skip


async def wait_record(scalers: KeyValue, key: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if (await scalers.get(key)).value:
                return
        except nats.js.errors.KeyNotFoundError:
            pass
        assert time.monotonic() < deadline, f"{key} never reached pulse_scalers"
        await asyncio.sleep(0.05)
