"""The sweep of `pulse_objects` (kube/records.py `MirrorSweep`): a record whose ScaledObject is gone without the
mirror's delete (deleted while no operator led, or the delete did not reach the bucket) is deleted by the leader, in
the namespaces it watches only, and only against a complete LIST of their ScaledObjects.

The real kopf and `kubernetes` client against the API double (tests/k8s_api_double.py) and a real nats-server, as in
tests/kube/test_operator_mirror.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import nats.js.errors
import pytest
from aiohttp import web
from nats.aio.client import Client
from nats.js.kv import KeyValue

from kube.context import OperatorContext
from kube.records import MirrorSweep, ObjectMirror, unlisted
from tests.k8s_api_double import ApiError, K8sApiDouble, k8s_api  # noqa: F401 - fixture
from tests.kube.test_operator import NS, SO, operator, scaled_object
from warmpool import protocol
from warmpool.registry import ensure_buckets

OTHER_NS = "elsewhere"  # a namespace another operator watches (the namespaced mode shares the bucket)
SWEEP_EVERY_S = 0.3
BOUND_S = 5.0  # the first sweep is at once when the operator starts leading, then every SWEEP_EVERY_S


async def objects_bucket(nc: Client) -> KeyValue:
    """`pulse_objects` as the autoscaler creates it (with the operator's other buckets)."""
    names = [protocol.SCALERS_BUCKET, protocol.SLOTS_BUCKET, protocol.OBJECTS_BUCKET]
    await ensure_buckets(nc.jetstream(), names=names)
    return await nc.jetstream().key_value(protocol.OBJECTS_BUCKET)


async def put_record(kv: KeyValue, namespace: str, name: str) -> None:
    """A record as an operator wrote it for a ScaledObject (which may since have gone)."""
    await kv.put(f"{namespace}.{name}", protocol.encode(protocol.ObjectStatus(namespace=namespace, name=name)))


async def keys(kv: KeyValue) -> set[str]:
    try:
        return set(await kv.keys())
    except nats.js.errors.NoKeysError:
        return set()


async def until_gone(kv: KeyValue, key: str, timeout_s: float = BOUND_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while key in await keys(kv):
        assert loop.time() < deadline, f"{key} was not swept within {timeout_s} s"
        await asyncio.sleep(0.05)


def swept_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "swept" in r.getMessage()]


@pytest.mark.parametrize(
    ("keys_", "listed", "namespaces", "expected"),
    [
        # in its namespace, no object: swept; an object listed: kept
        ({"inference.gone", "inference.qwen"}, {"inference.qwen"}, (NS,), ["inference.gone"]),
        # another operator's namespace: kept, listed or not
        ({"elsewhere.ghost", "inference.gone"}, set(), (NS,), ["inference.gone"]),
        # every namespace watched (cluster-wide): any unlisted key
        ({"elsewhere.ghost", "inference.qwen"}, {"inference.qwen"}, (), ["elsewhere.ghost"]),
        # dotted names are names: the namespace is what precedes the first dot
        ({"inference.a.b", "inference.a"}, {"inference.a"}, (NS,), ["inference.a.b"]),
        # a key without a namespace part names no object: left alone
        ({"nodot", "inference."}, set(), (), []),
    ],
)
def test_unlisted_is_the_keys_of_its_namespaces_that_no_listed_object_names(
    keys_: set[str], listed: set[str], namespaces: tuple[str, ...], expected: list[str]
) -> None:
    assert unlisted(keys_, listed, namespaces) == expected


async def test_the_leader_sweeps_records_of_gone_objects_in_its_namespaces_and_keeps_the_rest(
    k8s_api: K8sApiDouble,  # noqa: F811
    nc: Client,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A record left by a ScaledObject deleted while no operator ran is deleted soon after one starts leading, and
    one left later within a sweep period; another namespace's record and the live objects' records stay."""
    kv = await objects_bucket(nc)
    await put_record(kv, NS, "gone")  # its CR was deleted while no operator ran
    await put_record(kv, OTHER_NS, "ghost")  # another operator's namespace: no CR this one can see
    await put_record(kv, NS, "qwen")  # the previous leader's record of a live CR
    k8s_api.create(SO, NS, scaled_object())
    caplog.set_level(logging.INFO, logger="pulsescale.operator")
    async with operator(k8s_api, nc, mirror_sweep_every_s=SWEEP_EVERY_S) as running:
        await until_gone(kv, f"{NS}.gone")
        await running.wait_condition("qwen", "Ready", "True", "ScalerPublished")

        # Left behind while this one leads (a delete that did not reach the bucket): gone within a period or two.
        await put_record(kv, NS, "late")
        await until_gone(kv, f"{NS}.late", timeout_s=3 * SWEEP_EVERY_S + 2.0)

        await asyncio.sleep(3 * SWEEP_EVERY_S)  # more sweeps: nothing else goes
        assert {f"{OTHER_NS}.ghost", f"{NS}.qwen"} <= await keys(kv)
        assert running.ctx.mirror_swept == 2
        lines = swept_lines(caplog)
        assert len(lines) == 2, lines  # each swept key said once, with the reason
        assert f"{protocol.OBJECTS_BUCKET}/{NS}.gone" in lines[0] and "does not exist" in lines[0]
        assert f"{NS}.late" in lines[1]

        # A replica that has just started leading suspects every key it did not write (a fresh mirror): each is
        # judged by the LIST, so the live object's record and the other namespace's stay.
        so = running.ctx.extra["scaledobjects"]
        fresh = MirrorSweep(running.ctx, ObjectMirror(running.ctx))
        assert await fresh.round() == 0
        assert {f"{OTHER_NS}.ghost", f"{NS}.qwen"} <= await keys(kv)
        # Cluster-wide, the same sweep lists every namespace (one cluster-wide LIST): the other namespace's record
        # names no object and goes; the live one stays.
        everywhere = dataclasses.replace(running.ctx, namespaces=())
        assert await MirrorSweep(everywhere, ObjectMirror(everywhere)).round() == 1
        assert f"{OTHER_NS}.ghost" not in await keys(kv) and f"{NS}.qwen" in await keys(kv)
        assert so.mirror.wrote(f"{NS}.qwen")

        # Not leading: nothing is deleted.
        await put_record(kv, NS, "while-standing-by")
        running.ctx.extra["leading"] = lambda: False
        assert await fresh.round() == 0
        assert f"{NS}.while-standing-by" in await keys(kv)


async def test_nothing_is_swept_until_the_scaledobjects_are_listed_completely(
    k8s_api: K8sApiDouble,  # noqa: F811
    nc: Client,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the operator's LIST of the ScaledObjects fails its view is incomplete: nothing is deleted (an orphan
    stays), it says so once; the first complete listing sweeps it."""
    refusing = {"on": True, "refused": 0}
    serve = k8s_api._serve

    async def refuse_the_operators_list(
        request: web.Request, m: dict[str, Any], method: str, query: dict[str, str], body: Any
    ) -> web.StreamResponse:
        ours = request.headers.get("User-Agent", "").startswith("OpenAPI-Generator")  # the `kubernetes` client's
        listing = method == "GET" and not m["name"] and m["plural"] == SO and query.get("watch") not in ("true", "1")
        if refusing["on"] and ours and listing:
            refusing["refused"] += 1
            raise ApiError(503, "ServiceUnavailable", "the API server is overloaded")
        return await serve(request, m, method, query, body)

    monkeypatch.setattr(k8s_api, "_serve", refuse_the_operators_list)
    kv = await objects_bucket(nc)
    await put_record(kv, NS, "gone")
    caplog.set_level(logging.INFO, logger="pulsescale.operator")
    async with operator(k8s_api, nc, mirror_sweep_every_s=SWEEP_EVERY_S) as running:
        await asyncio.sleep(5 * SWEEP_EVERY_S)
        assert refusing["refused"] >= 2  # it tried, each period
        assert f"{NS}.gone" in await keys(kv) and running.ctx.mirror_swept == 0
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "not sweeping" in r.getMessage()]
        assert len(warned) == 1 and "503" in warned[0].getMessage()

        refusing["on"] = False
        await until_gone(kv, f"{NS}.gone", timeout_s=3 * SWEEP_EVERY_S + 2.0)
        assert running.ctx.mirror_swept == 1 and len(swept_lines(caplog)) == 1


async def test_the_mirror_never_sweeps_a_key_it_wrote_itself(nc: Client) -> None:
    """A key this replica wrote belongs to an object it follows (its delete removes it); one it did not write and
    that is still there is deleted, once."""
    kv = await objects_bucket(nc)
    # What the mirror reads of the context is its NATS connection.
    mirror = ObjectMirror(OperatorContext(nc=nc, scalers=None, slots=None, api=None))  # type: ignore[arg-type]
    await mirror.write(protocol.ObjectStatus(namespace=NS, name="followed"))
    await put_record(kv, NS, "orphan")
    assert mirror.wrote(f"{NS}.followed")
    assert not await mirror.sweep(f"{NS}.followed")
    assert await mirror.sweep(f"{NS}.orphan") and not await mirror.sweep(f"{NS}.orphan")
    assert await keys(kv) == {f"{NS}.followed"}
    assert sorted(await mirror.keys((NS,)) or []) == [f"{NS}.followed"] and await mirror.keys((OTHER_NS,)) == []
