"""`pulsescale apply` and the operator write the same `pulse_scalers` keys (``<namespace>.<name>``): neither may
silently replace the other's record. A record the operator publishes carries
``ScalerRecord.managed_by`` (revision 14); `apply` refuses to replace it (exit 1, `PublishedByOperator`, the fix in the
message) unless ``--force``, and the operator does not publish over a record `apply` wrote: its CR is
``Ready=False ScalerWrittenByApply`` until the record says what the CR says or is deleted.

Real kopf and `kubernetes` client against the API double, a real nats-server, the real CLI through the dispatcher.
"""

from __future__ import annotations

import asyncio
import io
import sys
from collections.abc import Awaitable, Callable

import pytest
from nats.aio.client import Client

from kube.records import applied_by_hand, marked, unmarked
from manifests import scaledobject
from pulsescale import cli as dispatcher
from tests.k8s_api_double import K8sApiDouble, k8s_api  # noqa: F401 - fixture
from tests.kube.test_operator import NS, SO, operator, scaled_object
from warmpool import protocol
from warmpool.embedded import NatsServer

Cli = Callable[..., Awaitable[tuple[int, str, str]]]


def manifest(*, hi: int, name: str = "qwen", model: str = "qwen") -> str:
    return f"""apiVersion: pulsescale.io/v1alpha1
kind: ScaledObject
metadata: {{name: {name}, namespace: {NS}}}
spec:
  scaleTargetRef: {{name: {model}}}
  minReplicaCount: 1
  maxReplicaCount: {hi}
  triggers:
    - type: gateway-queue
      metadata: {{model: {model}}}
"""


@pytest.fixture
def cli(nats_server: NatsServer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Cli:
    """`pulsescale VERB ARGS` in a thread (its own event loop): (exit code, stdout, stderr)."""

    async def run(verb: str, *args: str, stdin: str = "") -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        try:
            code = await asyncio.to_thread(dispatcher.main, [verb, *args, "--nats", nats_server.url])
        except SystemExit as exc:
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


async def test_apply_refuses_to_replace_a_record_the_operator_published(
    k8s_api: K8sApiDouble,  # noqa: F811
    nc: Client,
    cli: Cli,
) -> None:
    key = f"{NS}.qwen"
    async with operator(k8s_api, nc) as running:
        running.api.create(SO, NS, scaled_object())  # maxReplicaCount 4
        await running.wait_condition("qwen", "Ready", "True", "ScalerPublished")
        published = await running.record(key)
        assert published is not None and published.published_by_operator
        code, out, err = await cli("apply", "-f", "-", stdin=manifest(hi=9))
        assert code == 1, out + err
        assert "PublishedByOperator" in err or "published by the Kubernetes operator" in err
        assert f"kubectl -n {NS} edit pso qwen" in err and "--force" in err
        rec = await running.record(key)
        assert rec is not None and rec.spec.max_replica_count == 4, "apply replaced the operator's record"
        code, _, err = await cli("apply", "-f", "-", "--dry-run", stdin=manifest(hi=9))
        assert code == 1 and "published by the Kubernetes operator" in err
        # What the CR says already: nothing to replace, nothing refused (`get -o yaml | apply` round-trips).
        code, out, err = await cli("apply", "-f", "-", stdin=manifest(hi=4))
        assert (code, out.split()[:3]) == (0, ["scaledobject", key, "unchanged"]), out + err

        # On-call overrides it: written, with a warning; the operator leaves it and says so on the CR, through
        # status rounds and an edit of the CR alike.
        code, out, err = await cli("apply", "-f", "-", "--force", stdin=manifest(hi=9))
        assert code == 0 and "warning" in err and "ScalerWrittenByApply" in err, out + err
        cond = await running.wait_condition("qwen", "Ready", "False", "ScalerWrittenByApply")
        assert "pulsescale apply" in cond["message"] and "pulsescale delete so qwen -n inference" in cond["message"]
        running.api.patch(SO, NS, "qwen", {"spec": {"maxReplicaCount": 5}})
        await asyncio.sleep(1.0)  # an update and ~3 status rounds
        rec = await running.record(key)
        assert rec is not None and rec.spec.max_replica_count == 9 and not rec.published_by_operator
        await running.wait_condition("qwen", "Ready", "False", "ScalerWrittenByApply")
        # Handed back by making the record say what the CR says: the operator takes it over.
        code, out, err = await cli("apply", "-f", "-", "--force", stdin=manifest(hi=5))
        assert code == 0, out + err
        await running.wait_condition("qwen", "Ready", "True", "ScalerPublished")
        rec = await running.wait_record(key, lambda r: r is not None and r.published_by_operator)
        assert rec is not None and rec.spec.max_replica_count == 5


async def test_the_operator_does_not_publish_over_a_record_apply_wrote(
    k8s_api: K8sApiDouble,  # noqa: F811
    nc: Client,
    cli: Cli,
) -> None:
    key = f"{NS}.qwen"
    code, out, err = await cli("apply", "-f", "-", stdin=manifest(hi=7))
    assert code == 0, out + err
    async with operator(k8s_api, nc) as running:
        running.api.create(SO, NS, scaled_object())  # maxReplicaCount 4: not what apply wrote
        cond = await running.wait_condition("qwen", "Ready", "False", "ScalerWrittenByApply")
        assert f"{protocol.SCALERS_BUCKET}/{key}" in cond["message"]
        warning = await running.api.wait_for(lambda: running.events("qwen", "ScalerWrittenByApply"), what="an Event")
        assert warning[0]["type"] == "Warning"
        rec = await running.record(key)
        assert rec is not None and rec.spec.max_replica_count == 7, "the operator clobbered the on-call apply"
        # Deleting the CR leaves apply's record alone (the operator withdraws only what it published).
        running.api.delete(SO, NS, "qwen")
        await running.api.wait_for(lambda: running.api.try_get(SO, NS, "qwen") is None, what="the CR gone")
        rec = await running.record(key)
        assert rec is not None and rec.spec.max_replica_count == 7
        # Handed back by deleting the record: the CR is published within a status round.
        running.api.create(SO, NS, scaled_object())
        await running.wait_condition("qwen", "Ready", "False", "ScalerWrittenByApply")
        code, out, err = await cli("delete", "so", "qwen", "-n", NS)
        assert code == 0, out + err
        await running.wait_condition("qwen", "Ready", "True", "ScalerPublished")
        rec = await running.wait_record(key, lambda r: r is not None and r.published_by_operator)
        assert rec is not None and rec.spec.max_replica_count == 4


def test_the_operators_label_says_who_wrote_a_record() -> None:
    body = scaled_object()
    body["metadata"]["labels"] = {"team": "chat"}
    cr = marked(scaledobject.from_manifest(body))
    assert cr.published_by_operator and unmarked(cr).labels == {"team": "chat"}
    assert not applied_by_hand(None, cr) and not applied_by_hand(cr, cr)
    assert not applied_by_hand(unmarked(cr), cr)  # apply's, but the same: taken over (a hand-back, an old record)
    other = scaledobject.from_manifest(scaled_object(maxReplicaCount=9))
    assert applied_by_hand(other, cr)
    # The mark is a field of its own (revision 14), not a label: a CR with as many labels as a record carries is
    # published, and its labels are the CR's.
    body["metadata"]["labels"] = full = {f"k{i}": "v" for i in range(protocol.MAX_LABELS)}
    assert marked(scaledobject.from_manifest(body)).labels == full
    assert protocol.decode(protocol.encode(cr), protocol.ScalerRecord).managed_by == protocol.ScalerRecord.OPERATOR
