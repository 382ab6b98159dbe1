"""Contract revision 13: the operator mirrors each ScaledObject CR's conditions into KV `pulse_objects`, and
`pulsescale get so` / `describe so` (NATS only) say what the CR says, the objects it refused included.

The real kopf and `kubernetes` client against the API double (tests/k8s_api_double.py), a real nats-server, the
real autoscaler daemon where a row matters, and the CLI run through the dispatcher as tests/oncall/test_resources.py
drives it.
"""

from __future__ import annotations

import asyncio
import io
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import nats.js.errors
import pytest
import yaml
from nats.aio.client import Client

from kube import records
from kube import status as status_mod
from kube.records import ObjectMirror
from pulsescale import cli as dispatcher
from tests.k8s_api_double import K8sApiDouble, k8s_api  # noqa: F401 - fixture
from tests.kube.test_operator import NS, SO, Running, autoscaler, operator, scaled_object
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.registry import ensure_buckets

Cli = Callable[..., Awaitable[tuple[int, str, str]]]


@pytest.fixture
def cli(nats_server: NatsServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Cli:
    """`pulsescale VERB ARGS` in a thread (its own event loop) while the operator runs in the test's loop:
    (exit code, stdout, stderr). `stdin` feeds `-f -`."""

    async def run(verb: str, *args: str, stdin: str = "") -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        try:
            code = await asyncio.to_thread(dispatcher.main, [verb, *args, "--nats", nats_server.url])
        except SystemExit as exc:  # argparse's usage errors
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def labelled(body: dict[str, Any], **labels: str) -> dict[str, Any]:
    body["metadata"]["labels"] = labels
    return body


async def mirror(nc: Client) -> dict[str, protocol.ObjectStatus]:
    js = nc.jetstream()
    kv = await js.key_value(protocol.OBJECTS_BUCKET)
    found = {}
    try:
        keys = await kv.keys()
    except nats.js.errors.NoKeysError:
        return {}
    for key in keys:
        entry = await kv.get(key)
        assert entry.value is not None
        found[key] = protocol.decode(entry.value, protocol.ObjectStatus)
    return found


def said(cond: dict[str, Any] | protocol.ObjectCondition) -> tuple[str, str, str, str]:
    if isinstance(cond, protocol.ObjectCondition):
        return (cond.type, cond.status, cond.reason, cond.message)
    return (cond["type"], cond["status"], cond.get("reason", ""), cond.get("message", ""))  # the CR omits empty ones


async def until_mirrored(
    running: Running, names: set[str], timeout_s: float = 10.0
) -> dict[str, protocol.ObjectStatus]:
    """The mirror once it holds exactly `names` of NS, each with the conditions its CR carries now."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        found = {k.removeprefix(f"{NS}."): v for k, v in (await mirror(running.nc)).items()}
        crs = {n: (running.api.try_get(SO, NS, n) or {}).get("status") or {} for n in names}
        if set(found) == names and all(
            [said(c) for c in found[n].conditions] == [said(c) for c in crs[n].get("conditions") or []] for n in names
        ):
            return found
        assert loop.time() < deadline, f"the mirror never matched the CRs {sorted(names)}: {found}"
        await asyncio.sleep(0.05)


async def test_get_so_says_what_each_cr_says_and_lists_the_unpublished_ones(
    k8s_api: K8sApiDouble,  # noqa: F811
    nc: Client,
    nats_server: NatsServer,
    cli: Cli,
) -> None:
    """issue 26: `get so` showed READY True for a published object whose CR is Ready=False (its target is missing,
    the autoscaler runs it anyway), and did not list an object the operator refused."""
    async with autoscaler(nats_server.url), operator(k8s_api, nc) as running:
        running.api.create(SO, NS, labelled(scaled_object(), team="chat"))
        running.api.create(SO, NS, labelled(scaled_object("ghost", model="ghost", target="nowhere"), team="chat"))
        bad = scaled_object("broken", model="llama", target="llama", minReplicaCount=5, maxReplicaCount=2)
        running.api.create(SO, NS, labelled(bad, team="batch"))
        await running.wait_condition("qwen", "Ready", "True", "ScalerPublished")
        await running.wait_condition("ghost", "Ready", "False", "ScaleTargetNotFound")
        refused = await running.wait_condition("broken", "Ready", "False", "InvalidSpec")
        await running.wait_reported("ghost")  # the autoscaler has its row: what alone made READY True before

        found = await until_mirrored(running, {"qwen", "ghost", "broken"})
        assert (found["qwen"].published, found["ghost"].published, found["broken"].published) == (True, True, False)
        broken = found["broken"]
        assert (broken.target, broken.min_replicas, broken.max_replicas, broken.model) == ("Deployment/llama", 5, 2,
                                                                                          "llama")  # fmt: skip
        assert broken.labels == {"team": "batch"} and broken.generation == 1 and broken.created_at is not None

        code, out, err = await cli("get", "so", "-n", NS, "-o", "wide")
        assert code == 0, err
        header, *lines = [line.split() for line in out.splitlines()]
        assert header[-1] == "REASON" and header[4] == "READY"
        rows = {cells[0]: cells for cells in lines}
        assert sorted(rows) == ["broken", "ghost", "qwen"]
        for name, cells in rows.items():
            ready = running.condition(name, "Ready")
            assert ready is not None and (cells[4], cells[-1]) == (ready["status"], ready["reason"]), (name, cells)
        assert rows["broken"][1:4] == ["Deployment/llama", "5", "2"]
        assert rows["broken"][9:13] == ["llama", "-", "-", "-"]  # MODEL; no row: the autoscaler never had it

        # -l and -o jsonpath= work on the union, with the CR's conditions.
        names = "jsonpath={.items[*].metadata.name}"
        assert await cli("get", "so", "-n", NS, "-l", "team=chat", "-o", names) == (0, "ghost qwen", "")
        why = 'jsonpath={range .items[*]}{.metadata.name}:{.status.conditions[?(@.type=="Ready")].reason}{end}'
        assert await cli("get", "so", "-n", NS, "-l", "team!=chat", "-o", why) == (0, "broken:InvalidSpec", "")

        # -o yaml carries the conditions as the CR has them; an unpublished object has no spec to apply back.
        code, out, _ = await cli("get", "so", "broken", "-n", NS, "-o", "yaml")
        doc = yaml.safe_load(out)
        cr = running.api.get(SO, NS, "broken")["status"]["conditions"]
        assert [said(c) for c in doc["status"]["conditions"]] == [said(c) for c in cr]
        assert "spec" not in doc and doc["metadata"]["labels"] == {"team": "batch"}
        assert refused["message"] in out
        # A published one still round-trips through apply.
        code, out, _ = await cli("get", "so", "qwen", "-n", NS, "-o", "yaml")
        code, applied, err = await cli("apply", "-f", "-", stdin=out)
        assert (code, applied.split()[:3]) == (0, ["scaledobject", f"{NS}.qwen", "unchanged"]), applied + err

        code, out, _ = await cli("describe", "so", "broken", "-n", NS)
        assert code == 0 and "InvalidSpec" in out and refused["message"] in out and "Published:" in out
        code, out, _ = await cli("describe", "so", "ghost", "-n", NS)
        assert code == 0 and "ScaleTargetNotFound" in out and "Deployment/nowhere does not exist" in out

        # Deleting a CR removes its mirror record (after its finalizer), published or not.
        running.api.delete(SO, NS, "broken")
        running.api.delete(SO, NS, "qwen")
        await running.api.wait_for(lambda: running.api.try_get(SO, NS, "qwen") is None, what="qwen gone")
        await running.api.wait_for(lambda: running.api.try_get(SO, NS, "broken") is None, what="broken gone")
        await until_mirrored(running, {"ghost"})
        code, out, _ = await cli("get", "so", "-n", NS, "-o", names)
        assert (code, out) == (0, "ghost")


async def test_the_mirror_waits_for_its_bucket_and_fills_it_once_it_exists(
    k8s_api: K8sApiDouble,  # noqa: F811
    nc: Client,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An autoscaler before revision 13 does not create `pulse_objects`: the operator says so once and goes on (the
    CRs are written as before); once the bucket exists it mirrors every object."""
    await ensure_buckets(nc.jetstream(), names=[protocol.SCALERS_BUCKET, protocol.SLOTS_BUCKET])
    caplog.set_level(logging.WARNING, logger="pulsescale.operator")
    # The mirror first looks for its bucket as the operator starts leading (its sweep, kube/records.py MirrorSweep):
    # a short retry from the start.
    monkeypatch.setattr(records, "MIRROR_RETRY_S", 0.3)
    async with operator(k8s_api, nc, create=False) as running:
        mirror_of: ObjectMirror = running.ctx.extra["scaledobjects"].mirror
        assert mirror_of.retry_s == 0.3
        running.api.create(SO, NS, scaled_object())
        await running.wait_condition("qwen", "Ready", "True", "ScalerPublished")
        await asyncio.sleep(1.0)  # a few status rounds without the bucket
        said_once = [r for r in caplog.records if protocol.OBJECTS_BUCKET in r.getMessage()]
        assert len(said_once) == 1 and "does not exist" in said_once[0].getMessage()
        await ensure_buckets(nc.jetstream(), names=[protocol.OBJECTS_BUCKET])  # a revision 13 autoscaler starts
        found = await until_mirrored(running, {"qwen"})
        assert found["qwen"].published and found["qwen"].condition("Ready") is not None
        # Quiet: a status that does not change writes no mirror either (~3 status rounds of 0.3 s).
        kv = await nc.jetstream().key_value(protocol.OBJECTS_BUCKET)
        written = (await kv.get(f"{NS}.qwen")).revision
        await asyncio.sleep(1.0)
        assert (await kv.get(f"{NS}.qwen")).revision == written


def test_mirror_of_reads_what_it_can_and_never_guesses() -> None:
    """A body the validator refused may be any shape: what does not fit the contract is left out, a message longer
    than the contract's bound is cut and marked, more labels than a record may carry are left out whole."""
    body: dict[str, Any] = {
        "metadata": {"name": "odd.name", "namespace": NS, "generation": 3, "labels": {f"k{i}": "v" for i in range(65)},
                     "creationTimestamp": "2026-12-01T00:00:00Z"},
        "spec": {"scaleTargetRef": {"name": "Not A Name"}, "minReplicaCount": True, "maxReplicaCount": -1,
                 "triggers": "gateway-queue"},
    }  # fmt: skip
    verdict = status_mod.Verdict(False, "InvalidSpec", "x" * 5000)
    composed = status_mod.compose(body, verdict, None, 1000.0)
    rec = status_mod.mirror_of(body, composed, published=False, now=1000.0)
    assert (rec.key, rec.target, rec.model, rec.min_replicas, rec.max_replicas) == (f"{NS}.odd.name", None, None,
                                                                                    None, None)  # fmt: skip
    assert rec.labels == {} and rec.generation == 3 and rec.created_at == 1796083200.0
    ready = rec.condition("Ready")
    assert ready is not None and (ready.status, ready.reason, ready.since) == ("False", "InvalidSpec", 1000.0)
    assert len(ready.message) == 4096 and ready.message.endswith("\u2026")
    assert [c.type for c in rec.conditions] == ["Ready", "Active", "Fallback", "Paused"]
