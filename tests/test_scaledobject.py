"""ScaledObject YAML → `ScalerRecord` (pure), and `pulsescale apply -f` writing it to KV `pulse_scalers`."""

from __future__ import annotations

import asyncio
import io
import textwrap
from pathlib import Path

import pytest
import yaml
from nats.aio.client import Client

from autoscaler import oncall, scaledobject
from autoscaler.scaledobject import ScaledObjectError
from pulsescale import cli as dispatcher
from warmpool import protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.protocol import ScalerRecord

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "examples" / "scaledobject-qwen.yaml"

GOOD = """\
apiVersion: pulsescale.io/v1alpha1
kind: ScaledObject
metadata:
  name: qwen
spec:
  scaleTargetRef: {name: qwen}
  minReplicaCount: 1
  maxReplicaCount: 4
  triggers:
    - type: gateway-queue
      metadata: {model: qwen}
"""


def load(text: str, source: str = "qwen.yaml") -> list[ScalerRecord]:
    return [m.record for m in scaledobject.load_documents(textwrap.dedent(text), source)]


def test_the_example_converts() -> None:
    [m] = scaledobject.load_documents(EXAMPLE.read_text(), EXAMPLE.name)
    rec = m.record
    assert (rec.key, rec.spec.model, rec.paused) == ("inference.qwen-chat", "qwen", False)
    assert (rec.spec.min_replica_count, rec.spec.max_replica_count, rec.spec.warm_pool.size) == (1, 8, 2)
    assert rec.spec.fallback is not None and rec.spec.fallback.replicas == 2
    assert rec.spec.warm_pool.engine == "vllm" and rec.spec.advanced.panic_threshold == 2.0
    # What goes into KV is what the autoscaler decodes.
    assert protocol.decode(protocol.encode(rec), ScalerRecord) == rec


DEPLOY = EXAMPLE.parent.parent
CUSTOM_RESOURCES = [
    (path, i, doc)
    for path in sorted(DEPLOY.rglob("*.yaml"))
    for i, doc in enumerate(yaml.safe_load_all(path.read_text()), start=1)
    if isinstance(doc, dict) and str(doc.get("apiVersion", "")).startswith("pulsescale.io/")
]


@pytest.mark.parametrize(
    ("path", "index", "doc"), CUSTOM_RESOURCES, ids=[f"{p.relative_to(DEPLOY)}#{i}" for p, i, _ in CUSTOM_RESOURCES]
)
def test_every_custom_resource_under_deploy_converts(path: Path, index: int, doc: dict) -> None:  # type: ignore[type-arg]
    """test_manifests.py leaves our own kinds to this test (kubernetes-validate has no schema for them)."""
    assert doc["kind"] == scaledobject.KIND
    scaledobject.from_manifest(doc)


def test_defaults_and_annotations() -> None:
    [rec] = load(GOOD)
    assert rec.namespace == "default" and rec.name == "qwen" and not rec.paused
    paused = GOOD.replace("  name: qwen\n", '  name: qwen\n  annotations:\n    pulsescale.io/paused: "true"\n')
    [rec] = load(paused)
    assert rec.paused and rec.paused_replicas is None
    at_two = GOOD.replace("  name: qwen\n", '  name: qwen\n  annotations: {pulsescale.io/paused-replicas: "2"}\n')
    [rec] = load(at_two)
    assert rec.paused and rec.paused_replicas == 2  # as KEDA: paused-replicas alone pauses


def test_operator_bodies_carry_their_generation() -> None:
    body = yaml.safe_load(GOOD)
    body["metadata"]["generation"] = 7
    assert scaledobject.from_manifest(body, updated_at=5.0).generation == 7


def test_several_documents_and_empty_ones() -> None:
    two = (
        GOOD + "---\n---\n" + GOOD.replace("name: qwen\nspec", "name: qwen-b\nspec").replace("model: qwen", "model: b")
    )
    docs = scaledobject.load_documents(two, "two.yaml")
    assert [(m.index, m.record.key) for m in docs] == [(1, "default.qwen"), (3, "default.qwen-b")]


def _edit(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            _edit("maxReplicaCount: 4", "maxReplicaCount: 0"),
            "qwen.yaml doc 1: spec.maxReplicaCount: Expected `int` >= 1",
        ),
        (
            _edit("maxReplicaCount: 4", "maxReplicaCount: lots"),
            "qwen.yaml doc 1: spec.maxReplicaCount: Expected `int`, got `str`",
        ),
        (
            _edit("minReplicaCount: 1", "minReplicaCount: 9"),
            "qwen.yaml doc 1: spec: `minReplicaCount` must be <= `maxReplicaCount`",
        ),
        (
            _edit("{model: qwen}", "{model: Qwen2.5}"),
            "qwen.yaml doc 1: spec.triggers[0].metadata.model: Expected `str` matching regex",
        ),
        (
            _edit("type: gateway-queue", "type: prometheus"),
            "spec.triggers[0].type: 'prometheus' is not a pulsescale trigger: pulsescale has one trigger type",
        ),
        (
            _edit("  scaleTargetRef: {name: qwen}\n", ""),
            "qwen.yaml doc 1: spec.scaleTargetRef: required field is missing",
        ),
        (_edit("{name: qwen}", "{kind: Deployment}"), "spec.scaleTargetRef.name: required field is missing"),
        (
            _edit("maxReplicaCount: 4", "maxReplicas: 4"),
            "qwen.yaml doc 1: spec.maxReplicas: unknown field (did you mean maxReplicaCount?)",
        ),
        (
            _edit("{model: qwen}", "{model: qwen, targetQueueDept: 3}"),
            "spec.triggers[0].metadata.targetQueueDept: unknown field",
        ),
        (
            _edit("pulsescale.io/v1alpha1", "keda.sh/v1alpha1"),
            "qwen.yaml doc 1: apiVersion: expected pulsescale.io/v1alpha1, got 'keda.sh/v1alpha1' (change "
            "apiVersion to pulsescale.io/v1alpha1; every other field is read as KEDA's)",
        ),
        (_edit("kind: ScaledObject", "kind: ScaledJob"), "kind: expected ScaledObject, got 'ScaledJob'"),
        (_edit("name: qwen\nspec", "name: qwen.chat\nspec"), "metadata.name: 'qwen.chat' is not a pulsescale name"),
        (_edit("metadata:\n  name: qwen\n", "metadata: {}\n"), "metadata.name: required field is missing"),
        (
            _edit("  name: qwen\n", "  name: qwen\n  annotations: {pulsescale.io/paused: true}\n"),
            "metadata.annotations[pulsescale.io/paused]: must be a string, got bool True",
        ),
        (
            _edit("  name: qwen\n", '  name: qwen\n  annotations: {pulsescale.io/paused: "yes"}\n'),
            'metadata.annotations[pulsescale.io/paused]: must be "true" or "false", got \'yes\'',
        ),
        (
            _edit("  name: qwen\n", '  name: qwen\n  annotations: {pulsescale.io/paused-replicas: "1001"}\n'),
            "metadata.annotations[pulsescale.io/paused-replicas]: 1001 is over the limit of 1000 replicas per model",
        ),
        (
            _edit("  name: qwen\n", '  name: qwen\n  annotations: {pulsescale.io/paused-replicas: "two"}\n'),
            "paused-replicas]: must be a whole number of replicas, got 'two'",
        ),
        (GOOD + "---\n" + GOOD, "qwen.yaml doc 2: metadata.name: default.qwen is also defined by doc 1"),
        (GOOD + "---\n- just\n- a list\n", "qwen.yaml doc 2: a manifest is a mapping"),
        (_edit("spec:\n", "spec: 3\nx:\n"), "qwen.yaml doc 1: spec: must be a mapping, got int"),
        ("apiVersion: [unclosed\n", "qwen.yaml: line 2, column 1:"),
        ("", "qwen.yaml: no ScaledObject in it"),
    ],
)
def test_broken_manifests_name_file_document_and_field(text: str, error: str) -> None:
    with pytest.raises(ScaledObjectError) as exc:
        load(text)
    assert str(exc.value).startswith(error) or (error in str(exc.value) and not error.startswith("qwen.yaml")), str(
        exc.value
    )


# --- pulsescale apply -f ----------------------------------------------------------------------------------------


def apply(*args: str, stdin: str = "", nats_url: str | None = None) -> int:
    argv = [*args, *(["--nats", nats_url] if nats_url else [])]
    return oncall.apply(argv, "pulsescale apply", stdin=io.StringIO(stdin))


async def kv_record(nc: Client, key: str) -> ScalerRecord:
    kv = await nc.jetstream().key_value(protocol.SCALERS_BUCKET)
    entry = await kv.get(key)
    assert entry.value is not None
    return protocol.decode(entry.value, ScalerRecord)


async def test_apply_the_example(nats_server: NatsServer, nc: Client, capsys: pytest.CaptureFixture[str]) -> None:
    code = await asyncio.to_thread(apply, "-f", str(EXAMPLE), nats_url=nats_server.url)
    out = capsys.readouterr()
    assert code == 0, out.err
    assert out.out == ("scaledobject inference.qwen-chat created (model qwen, replicas 1..8, warm pool 2)\n")
    rec = await kv_record(nc, "inference.qwen-chat")
    assert rec.spec.model == "qwen" and rec.generation == 1 and rec.updated_at > 0

    assert await asyncio.to_thread(apply, "-f", str(EXAMPLE), nats_url=nats_server.url) == 0
    assert capsys.readouterr().out.startswith("scaledobject inference.qwen-chat unchanged")

    paused = EXAMPLE.read_text().replace("# pulsescale.io/paused-replicas", "pulsescale.io/paused-replicas")
    assert await asyncio.to_thread(apply, "-f", "-", stdin=paused, nats_url=nats_server.url) == 0
    assert capsys.readouterr().out == (
        "scaledobject inference.qwen-chat configured (model qwen, replicas 1..8, warm pool 2, paused at 2)\n"
    )
    rec = await kv_record(nc, "inference.qwen-chat")
    assert rec.paused and rec.paused_replicas == 2 and rec.generation == 2


async def test_apply_refuses_every_document_when_one_is_broken(
    nats_server: NatsServer, nc: Client, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(GOOD)
    bad.write_text(
        GOOD.replace("name: qwen\nspec", "name: other\nspec").replace("maxReplicaCount: 4", "maxReplicaCount: -1")
    )
    code = await asyncio.to_thread(apply, "-f", str(good), "-f", str(bad), nats_url=nats_server.url)
    err = capsys.readouterr().err
    assert code == 1
    assert err == f"pulsescale apply: {bad} doc 1: spec.maxReplicaCount: Expected `int` >= 1\n"
    kv = await nc.jetstream().key_value(protocol.SCALERS_BUCKET) if await _bucket_exists(nc) else None
    assert kv is None or not await _keys(kv)


async def _bucket_exists(nc: Client) -> bool:
    import nats.js.errors

    try:
        await nc.jetstream().key_value(protocol.SCALERS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return False
    return True


async def _keys(kv) -> list[str]:  # type: ignore[no-untyped-def]
    import nats.js.errors

    try:
        return list(await kv.keys())
    except nats.js.errors.NoKeysError:
        return []


def test_apply_dry_run_needs_no_nats(capsys: pytest.CaptureFixture[str]) -> None:
    code = apply("-f", str(EXAMPLE), "--dry-run", nats_url=f"nats://127.0.0.1:{free_port()}")
    assert code == 0
    assert capsys.readouterr().out.startswith("scaledobject inference.qwen-chat valid (model qwen")


def test_apply_missing_file_and_unreachable_nats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert apply("-f", str(tmp_path / "nope.yaml")) == 1
    assert capsys.readouterr().err.startswith(f"pulsescale apply: {tmp_path / 'nope.yaml'}: cannot read it:")
    unreachable = ["--nats", f"nats://127.0.0.1:{free_port()}", "--nats-connect-timeout", "0.5"]
    assert dispatcher.main(["apply", "-f", str(EXAMPLE), *unreachable]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pulsescale apply: cannot connect to NATS") and err.count("\n") == 1


def test_apply_same_object_in_two_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(GOOD)
    b.write_text(GOOD)
    assert apply("-f", str(a), "-f", str(b), "--dry-run") == 1
    assert f"default.qwen is also defined by {a} doc 1" in capsys.readouterr().err
