"""ScaledObject YAML → `ScalerRecord` (pure), and `pulsescale apply -f` writing it to KV `pulse_scalers`."""

from __future__ import annotations

import asyncio
import copy
import datetime
import io
import json
import random
import re
import textwrap
import time
from pathlib import Path

import msgspec
import pytest
import yaml
from nats.aio.client import Client

from manifests import loading, scaledobject
from manifests.keda import _NOTE_HPA_NAME, _NOTE_POLLING
from manifests.scaledobject import ScaledObjectError
from oncall import apply as oncall_apply
from pulsescale import cli as dispatcher
from warmpool import protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.protocol import ScalerRecord

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "scaledobject-qwen.yaml"

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
            "paused-replicas]: must be a whole number of replicas (ASCII digits 0-9), got 'two'",
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


# --- KEDA compatibility: the corpus ------------------------------------------------------------------------------

CORPUS = Path(__file__).resolve().parents[1] / "manifests"
ADMITTED = sorted((CORPUS / "keda").glob("*.yaml"))
REFUSED = sorted((CORPUS / "refuse").glob("*.yaml"))
EXPECT = "# expect: "


def test_the_corpus_is_what_the_issue_asks_for() -> None:
    assert len(ADMITTED) >= 18 and len(REFUSED) >= 10
    assert all(p.read_text().startswith(EXPECT) for p in REFUSED)


@pytest.mark.parametrize("path", ADMITTED, ids=[p.name for p in ADMITTED])
def test_a_keda_users_manifest_is_admitted(path: Path) -> None:
    [m] = scaledobject.load_documents(path.read_text(), path.name)
    assert m.record.namespace == "inference" and m.record.spec.model == "qwen"
    # What goes into KV is what the autoscaler decodes, notes and pauses included.
    assert protocol.decode(protocol.encode(m.record), ScalerRecord) == m.record


@pytest.mark.parametrize("path", REFUSED, ids=[p.name for p in REFUSED])
def test_an_invalid_manifest_is_refused_with_the_message_a_user_needs(path: Path) -> None:
    text = path.read_text()
    expected = text.splitlines()[0].removeprefix(EXPECT).strip()
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.load_documents(text, path.name)
    assert str(exc.value).startswith(f"{path.name}") and expected in str(exc.value), str(exc.value)


def _corpus(name: str) -> ScalerRecord:
    [m] = scaledobject.load_documents((CORPUS / "keda" / name).read_text(), name)
    return m.record


# --- trigger metadata, names, metricType ---------------------------------------------------------------------------


def test_string_metadata_becomes_numbers_and_the_model_stays_a_string() -> None:
    rec = _corpus("01-string-metadata.yaml")
    meta = rec.spec.triggers[0].metadata
    assert (meta.model, meta.target_queue_depth, meta.activation_queue_depth) == ("qwen", 4.0, 0.5)
    assert _corpus("02-numeric-metadata.yaml").spec.triggers[0].metadata.target_queue_depth == 6.0
    numeric_model = _edit("{model: qwen}", '{model: "7", targetQueueDepth: " 2.5 "}')
    [rec] = load(numeric_model)
    assert rec.spec.model == "7" and rec.spec.triggers[0].metadata.target_queue_depth == 2.5


@pytest.mark.parametrize(
    ("metadata", "error"),
    [
        (
            '{model: qwen, targetQueueDepth: "four"}',
            'spec.triggers[0].metadata.targetQueueDepth: "four" is not a number',
        ),
        (
            '{model: qwen, activationQueueDepth: ""}',
            'spec.triggers[0].metadata.activationQueueDepth: "" is not a number',
        ),
        ('{model: qwen, targetQueueDepth: "nan"}', 'targetQueueDepth: "nan" is not a number'),
        (
            '{model: qwen, targetQueueDepth: "0"}',
            "spec.triggers[0].metadata.targetQueueDepth: Expected `float` >= 0.001",
        ),
        ("{model: qwen, targetQueueDepth: true}", "targetQueueDepth: Expected `float`, got `bool`"),
    ],
)
def test_bad_metadata_values_name_the_field(metadata: str, error: str) -> None:
    with pytest.raises(ScaledObjectError) as exc:
        load(_edit("{model: qwen}", metadata))
    assert error in str(exc.value), str(exc.value)


def test_trigger_names_and_metric_type() -> None:
    rec = _corpus("31-two-named-triggers.yaml")
    assert [t.name for t in rec.spec.triggers] == ["interactive", "batch"]
    assert _corpus("04-metric-type-average-value.yaml").spec.triggers[0].metric_type == "AverageValue"
    with pytest.raises(ScaledObjectError, match=r"spec.triggers\[0\].metricType: 'Rate' is not a KEDA metricType"):
        load(_edit("type: gateway-queue", "type: gateway-queue\n      metricType: Rate"))


def test_keda_api_version_with_keda_triggers_says_pulsescale_has_one_trigger() -> None:
    text = _edit("pulsescale.io/v1alpha1", "keda.sh/v1alpha1").replace("type: gateway-queue", "type: kafka")
    with pytest.raises(ScaledObjectError, match=r"apiVersion: .*KEDA's own triggers \(kafka\).*gateway-queue"):
        load(text)


# --- notes: accepted, no effect, one line each ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("05-use-cached-metrics.yaml", "useCachedMetrics has no effect: a pushed trigger is never polled"),
        ("06-polling-interval.yaml", "pollingInterval has no effect"),
        ("07-authentication-ref.yaml", "authenticationRef has no effect"),
        ("08-cluster-authentication-ref.yaml", "authenticationRef has no effect"),
        ("22-hpa-name.yaml", "horizontalPodAutoscalerConfig.name has no effect: pulsescale makes no HPA"),
    ],
)
def test_each_field_without_effect_adds_one_note(name: str, says: str) -> None:
    rec = _corpus(name)
    assert len(rec.notes) == 1 and says in rec.notes[0], rec.notes
    assert "\n" not in rec.notes[0]


def test_notes_are_one_line_per_field_not_per_trigger_and_none_without_them() -> None:
    rec = _corpus("31-two-named-triggers.yaml")
    assert rec.notes == []
    both = (CORPUS / "keda" / "31-two-named-triggers.yaml").read_text()
    both = both.replace("      name: interactive\n", "      name: interactive\n      useCachedMetrics: true\n")
    both = both.replace("      name: batch\n", "      name: batch\n      useCachedMetrics: true\n")
    both = both.replace("  triggers:\n", "  pollingInterval: 30\n  triggers:\n")
    [rec] = load(both)
    assert len(rec.notes) == 2
    assert [n.split()[0] for n in rec.notes] == ["spec.triggers[].useCachedMetrics", "spec.pollingInterval"]


# --- the rest of KEDA's spec -----------------------------------------------------------------------------------------


def test_initial_cooldown_fallback_behaviors_and_restore() -> None:
    assert _corpus("09-initial-cooldown-period.yaml").spec.initial_cooldown_period == 120.0
    behaviors = {}
    for name in ("11-fallback-static", "12-fallback-current-replicas", "13-fallback-if-higher", "14-fallback-if-lower"):
        fallback = _corpus(f"{name}.yaml").spec.fallback
        assert fallback is not None
        behaviors[name] = fallback.behavior
    assert sorted(behaviors.values()) == sorted(
        ["static", "currentReplicas", "currentReplicasIfHigher", "currentReplicasIfLower"]
    )
    assert _corpus("15-restore-original-replica-count.yaml").spec.advanced.restore_to_original_replica_count


def _advanced(name: str) -> protocol.Advanced:
    return _corpus(name).spec.advanced


def test_hpa_scale_down_behavior_maps_onto_the_policy() -> None:
    default = protocol.Advanced()
    a = _advanced("16-hpa-scale-down-window.yaml")
    assert a.scale_down_stabilization_seconds == 300.0
    assert (a.scale_down_percent, a.scale_down_pods) == (default.scale_down_percent, None)
    a = _advanced("17-hpa-scale-down-percent.yaml")
    assert (a.scale_down_stabilization_seconds, a.scale_down_percent, a.scale_down_period_seconds) == (300, 100, 15)
    assert (a.scale_down_pods, a.scale_down_select_policy) == (None, "Max")
    # Pods alone: at most that many per period, whatever the percentage would allow.
    a = _advanced("18-hpa-scale-down-pods.yaml")
    assert (a.scale_down_percent, a.scale_down_pods, a.scale_down_select_policy) == (100, 1, "Min")
    assert a.scale_down_period_seconds == 60
    a = _advanced("19-hpa-scale-down-both-min.yaml")
    assert (a.scale_down_percent, a.scale_down_pods, a.scale_down_select_policy) == (10, 2, "Min")
    assert _advanced("20-hpa-scale-down-disabled.yaml").scale_down_select_policy == "Disabled"
    rec = _corpus("21-hpa-scale-up-disabled.yaml")
    assert rec.paused_scale_out and not rec.paused_scale_in and not rec.paused


HPA_DOWN = """\
  advanced:
    {extra}horizontalPodAutoscalerConfig:
      behavior:
        scaleDown:
{rules}"""


def _with_hpa(rules: str, extra: str = "") -> str:
    return GOOD.replace(
        "  triggers:\n", HPA_DOWN.format(extra=extra, rules=textwrap.indent(rules, " " * 10)) + "  triggers:\n"
    )


@pytest.mark.parametrize(
    ("rules", "extra", "error"),
    [
        (
            "policies:\n- {type: Percent, value: 150, periodSeconds: 15}\n",
            "",
            "scaleDown.policies[0].value: 150 %: scale-down removes at most 100 % of the replicas",
        ),
        (
            "policies:\n- {type: Pods, value: 1, periodSeconds: 15}\n- {type: Pods, value: 3, periodSeconds: 15}\n",
            "",
            "scaleDown.policies[1]: a second Pods policy (the first is policies[0])",
        ),
        ("selectPolicy: Min\n", "scaleDownSelectPolicy: Max\n    ", "spec.advanced.scaleDownSelectPolicy: set twice"),
        (
            "policies:\n- {type: Percent, value: 20, periodSeconds: 30}\n",
            "scaleDownPercent: 20\n    ",
            "spec.advanced.scaleDownPercent: set twice: here and by "
            "spec.advanced.horizontalPodAutoscalerConfig.behavior.scaleDown.policies",
        ),
        ("policies:\n- {type: Replicas, value: 1, periodSeconds: 15}\n", "", "(one of: Percent, Pods)"),
    ],
)
def test_hpa_behavior_that_cannot_map_is_refused_with_the_reason(rules: str, extra: str, error: str) -> None:
    with pytest.raises(ScaledObjectError) as exc:
        load(_with_hpa(rules, extra))
    assert error in str(exc.value), str(exc.value)


def test_hpa_scale_up_stabilization_is_refused_but_zero_is_fine() -> None:
    up = GOOD.replace(
        "  triggers:\n",
        "  advanced:\n    horizontalPodAutoscalerConfig:\n      behavior:\n        scaleUp:\n"
        "          stabilizationWindowSeconds: {w}\n  triggers:\n",
    )
    [rec] = load(up.replace("{w}", "0"))
    assert not rec.paused_scale_out
    with pytest.raises(ScaledObjectError, match=r"scaleUp.stabilizationWindowSeconds: scale-up stabilization is not"):
        load(up.replace("{w}", "60"))


# --- pause annotations, both families ------------------------------------------------------------------------------


def _annotated(annotations: dict[str, str], text: str = GOOD) -> ScalerRecord:
    lines = "".join(f'    {k}: "{v}"\n' for k, v in annotations.items())
    [rec] = load(text.replace("  name: qwen\n", f"  name: qwen\n  annotations:\n{lines}", 1))
    return rec


@pytest.mark.parametrize("prefix", scaledobject.ANNOTATION_PREFIXES)
def test_both_families_of_pause_annotations_are_honoured(prefix: str) -> None:
    rec = _annotated({f"{prefix}paused": "true"})
    assert (rec.paused, rec.paused_replicas) == (True, None)
    rec = _annotated({f"{prefix}paused": "false"})
    assert not rec.paused
    rec = _annotated({f"{prefix}paused-replicas": "3"})
    assert (rec.paused, rec.paused_replicas) == (True, 3)
    rec = _annotated({f"{prefix}paused": "true", f"{prefix}paused-replicas": "2"})
    assert (rec.paused, rec.paused_replicas) == (True, 2)
    rec = _annotated({f"{prefix}paused-scale-in": "true"})
    assert (rec.paused, rec.paused_scale_in, rec.paused_scale_out) == (False, True, False)
    rec = _annotated({f"{prefix}paused-scale-out": "TRUE", f"{prefix}paused-scale-in": "false"})
    assert (rec.paused, rec.paused_scale_in, rec.paused_scale_out) == (False, False, True)


def test_paused_replicas_zero_parks_at_zero_and_keda_allows_any_count() -> None:
    rec = _corpus("24-keda-paused-replicas-zero.yaml")
    assert rec.spec.min_replica_count == 1 and (rec.paused, rec.paused_replicas) == (True, 0)
    # KEDA: "any arbitrary number"; only the per-model limit applies.
    assert _annotated({"autoscaling.keda.sh/paused-replicas": "6"}).paused_replicas == 6  # over maxReplicaCount 4


@pytest.mark.parametrize(
    ("annotations", "error"),
    [
        (
            {"pulsescale.io/paused-replicas": "2", "autoscaling.keda.sh/paused-replicas": "3"},
            'metadata.annotations[autoscaling.keda.sh/paused-replicas]: "3" contradicts '
            'pulsescale.io/paused-replicas: "2"',
        ),
        (
            {"pulsescale.io/paused-scale-in": "false", "autoscaling.keda.sh/paused-scale-in": "true"},
            "metadata.annotations[autoscaling.keda.sh/paused-scale-in]: true contradicts "
            "pulsescale.io/paused-scale-in: false",
        ),
        (
            {"pulsescale.io/paused": "false", "autoscaling.keda.sh/paused-replicas": "2"},
            'metadata.annotations[autoscaling.keda.sh/paused-replicas]: contradicts pulsescale.io/paused: "false"',
        ),
        ({"autoscaling.keda.sh/paused-scale-out": "yes"}, 'must be "true" or "false", got \'yes\''),
        (
            {"autoscaling.keda.sh/paused-replicas": "-1"},
            "must be a whole number of replicas (ASCII digits 0-9), got '-1'",
        ),
    ],
)
def test_contradicting_or_bad_annotations_are_refused_naming_both(annotations: dict[str, str], error: str) -> None:
    with pytest.raises(ScaledObjectError) as exc:
        _annotated(annotations)
    assert error in str(exc.value), str(exc.value)


def test_paused_scale_out_false_contradicts_scale_up_disabled() -> None:
    text = (CORPUS / "keda" / "21-hpa-scale-up-disabled.yaml").read_text()
    with pytest.raises(ScaledObjectError, match=r'scale-out.: "false" contradicts .*scaleUp.selectPolicy: Disabled'):
        _annotated({"autoscaling.keda.sh/paused-scale-out": "false"}, text.replace("name: qwen-hpa-noup", "name: qwen"))


def test_same_content_sees_the_new_fields() -> None:
    [plain] = load(GOOD)
    assert scaledobject.same_content(plain, plain)
    assert not scaledobject.same_content(plain, _annotated({"autoscaling.keda.sh/paused-scale-in": "true"}))
    [noted] = load(GOOD.replace("  triggers:\n", "  pollingInterval: 30\n  triggers:\n"))
    assert not scaledobject.same_content(plain, noted)
    [labelled] = load(GOOD.replace("  name: qwen\n", "  name: qwen\n  labels: {team: a}\n"))
    assert not scaledobject.same_content(plain, labelled)  # a label-only edit is written: `get -l` reads them


def _labelled(count: int, extra: str = "") -> str:
    labels = ", ".join(f"k{i}: v" for i in range(count))
    return GOOD.replace("  name: qwen\n", f"  name: qwen\n  labels: {{{labels}{extra}}}\n")


def test_more_labels_than_a_record_carries_publish_the_object_without_them() -> None:
    """Review finding 8: Kubernetes sets no limit on labels, `ScalerRecord.labels` carries 64 (revision 12). An object
    with 65 (published before revision 12) is still published, without labels (none, as the operator's mirror of
    the CR: a cut set would match other selectors), and its note says so; at 64 every label is kept."""
    [rec] = load(_labelled(protocol.MAX_LABELS + 1))
    assert rec.labels == {} and rec.spec.model == "qwen"
    assert rec.notes == [scaledobject.NOTE_LABELS_DROPPED]
    assert "pulsescale get -l" in rec.notes[0] and "64" in rec.notes[0]
    assert protocol.decode(protocol.encode(rec), ScalerRecord) == rec  # what the autoscaler decodes
    [kept] = load(_labelled(protocol.MAX_LABELS))
    assert len(kept.labels) == protocol.MAX_LABELS and kept.notes == []
    # A label Kubernetes itself refuses is still named, however many there are.
    with pytest.raises(ScaledObjectError, match=r"metadata.labels\['-bad'\]: not a Kubernetes label key"):
        load(_labelled(protocol.MAX_LABELS + 1, ", -bad: v"))


async def test_apply_publishes_an_object_with_too_many_labels_and_prints_the_note(
    nats_server: NatsServer, nc: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    """Written to `pulse_scalers` (before the fix: refused, exit 1, nothing written); `get so` lists it, and `get so
    -l` cannot select it by a label it was applied with."""
    text = _labelled(protocol.MAX_LABELS + 1)
    assert await asyncio.to_thread(apply, "-f", "-", stdin=text, nats_url=nats_server.url) == 0
    out = capsys.readouterr()
    assert out.out.startswith("scaledobject default.qwen created (model qwen")
    assert f"note: default.qwen: {scaledobject.NOTE_LABELS_DROPPED}\n" in out.out
    rec = await kv_record(nc, "default.qwen")
    assert rec.labels == {} and rec.notes == [scaledobject.NOTE_LABELS_DROPPED]
    assert await asyncio.to_thread(dispatcher.main, ["get", "so", "--no-headers", "--nats", nats_server.url]) == 0
    assert capsys.readouterr().out.split()[0] == "qwen"
    assert await asyncio.to_thread(dispatcher.main, ["get", "so", "-l", "k0=v", "--nats", nats_server.url]) == 0
    assert capsys.readouterr().out == ""


# --- CR bodies from the API server -----------------------------------------------------------------------------------


def test_a_cr_body_reads_and_carries_its_creation_time() -> None:
    rec = _corpus("32-cr-body-from-api-server.yaml")
    assert rec.generation == 3 and rec.created_at == 1796136061.0  # 2026-12-01T14:41:01Z
    unquoted = GOOD.replace("  name: qwen\n", "  name: qwen\n  creationTimestamp: 2026-12-01T14:41:01Z\n")
    assert load(unquoted)[0].created_at == 1796136061.0  # YAML made it a datetime
    assert load(GOOD)[0].created_at is None
    with pytest.raises(ScaledObjectError, match=r"metadata.creationTimestamp: 'yesterday' is not an RFC 3339 time"):
        load(GOOD.replace("  name: qwen\n", "  name: qwen\n  creationTimestamp: yesterday\n"))


# --- YAML: duplicate keys, lists, directories ----------------------------------------------------------------------


def test_duplicate_keys_are_refused_with_line_and_column_at_any_depth() -> None:
    nested = _edit("{model: qwen}", "\n        model: qwen\n        model: llama")
    with pytest.raises(ScaledObjectError) as exc:
        load(nested)
    assert str(exc.value) == (
        "qwen.yaml: line 13, column 9: duplicate key 'model' (first at line 12); YAML would keep only the last one: "
        "remove one"
    )
    # A merge key (<<) may still be overridden: that is what it is for.
    merged = "base: &b {maxReplicaCount: 2}\n---\n" + GOOD.replace(
        "  maxReplicaCount: 4\n", "  <<: {maxReplicaCount: 9}\n  maxReplicaCount: 4\n"
    )
    with pytest.raises(ScaledObjectError, match="doc 1: apiVersion"):  # only the first (bogus) document fails
        load(merged)
    [rec] = load(merged.split("---\n", 1)[1])
    assert rec.spec.max_replica_count == 4


def test_a_kind_list_contributes_its_items() -> None:
    other = GOOD.replace("name: qwen\nspec", "name: qwen-b\nspec").replace("model: qwen", "model: b")
    items = [yaml.safe_load(GOOD), yaml.safe_load(other)]
    text = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items})
    docs = scaledobject.load_documents(text, "list.yaml")
    assert [(m.where, m.record.key) for m in docs] == [
        ("list.yaml doc 1 items[0]", "default.qwen"),
        ("list.yaml doc 1 items[1]", "default.qwen-b"),
    ]
    items[1]["spec"]["maxReplicaCount"] = 0
    with pytest.raises(ScaledObjectError, match=r"^list.yaml doc 1 items\[1\]: spec.maxReplicaCount"):
        scaledobject.load_documents(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items}), "list.yaml")


DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata: {name: qwen, namespace: inference}
spec: {replicas: 1}
"""
NAMESPACE = "apiVersion: v1\nkind: Namespace\nmetadata: {name: inference}\n"


def test_documents_of_other_kinds_are_skipped_and_said() -> None:
    """deploy/examples/ holds a Namespace, a Deployment and a Service beside the ScaledObjects: kubectl applies
    those; `apply` skips them, one line each, and still checks every ScaledObject."""
    skipped: list[str] = []
    text = NAMESPACE + "---\n" + DEPLOYMENT + "---\n" + GOOD
    [m] = scaledobject.load_documents(text, "all.yaml", skipped=skipped)
    assert m.record.key == "default.qwen" and m.where == "all.yaml doc 3"
    assert skipped == [
        "skipped Namespace inference (all.yaml doc 1): not a ScaledObject (kubectl applies it)",
        "skipped Deployment inference/qwen (all.yaml doc 2): not a ScaledObject (kubectl applies it)",
    ]
    # Nothing left: refused, saying what was skipped.
    with pytest.raises(ScaledObjectError, match=r"^d.yaml: no ScaledObject in it \(2 document\(s\) of other kinds"):
        scaledobject.load_documents(NAMESPACE + "---\n" + DEPLOYMENT, "d.yaml")
    # A keda.sh ScaledObject, a broken one and an unknown kind of our group are still errors, not skipped.
    keda = GOOD.replace("pulsescale.io/v1alpha1", "keda.sh/v1alpha1")
    with pytest.raises(ScaledObjectError, match=r"^k.yaml doc 2: apiVersion: expected pulsescale.io/v1alpha1"):
        scaledobject.load_documents(DEPLOYMENT + "---\n" + keda, "k.yaml")
    with pytest.raises(ScaledObjectError, match=r"^b.yaml doc 2: spec.maxReplicaCount"):
        scaledobject.load_documents(
            DEPLOYMENT + "---\n" + GOOD.replace("maxReplicaCount: 4", "maxReplicaCount: 0"), "b.yaml"
        )
    with pytest.raises(ScaledObjectError, match=r"^j.yaml doc 1: kind: expected ScaledObject, got 'ScaledJob'"):
        scaledobject.load_documents(GOOD.replace("kind: ScaledObject", "kind: ScaledJob"), "j.yaml")
    with pytest.raises(ScaledObjectError, match=r"^n.yaml doc 1: kind: expected ScaledObject, got None"):
        scaledobject.load_documents(GOOD.replace("kind: ScaledObject\n", ""), "n.yaml")


def test_the_examples_directory_loads_its_scaledobjects() -> None:
    skipped: list[str] = []
    found = scaledobject.load_path(EXAMPLE.parent, skipped=skipped)
    assert {m.record.key for m in found} == {"inference.qwen-chat", "default.tiny"}
    assert [line.split(" (")[0] for line in skipped] == [
        "skipped Namespace inference",
        "skipped Deployment inference/qwen-chat",
        "skipped Service inference/qwen-chat",
    ]
    with pytest.raises(ScaledObjectError, match=r"no ScaledObject in it \(3 document\(s\) of other kinds skipped\)"):
        scaledobject.load_path(EXAMPLE.parent / "inference-qwen.yaml")


def test_the_polling_note_says_the_gateways_push_interval() -> None:
    assert "(every 100 ms)" in _NOTE_POLLING  # gateway/publisher.py, README: every 100 ms


def _named(name: str) -> str:
    """GOOD as another ScaledObject, of its own model (one model, one ScaledObject)."""
    return GOOD.replace("name: qwen\nspec", f"name: {name}\nspec").replace("model: qwen", f"model: {name}")


def test_load_path_reads_a_directory_as_kubectl_apply_does(tmp_path: Path) -> None:
    (tmp_path / "b.yml").write_text(_named("b"))
    (tmp_path / "a.yaml").write_text(_named("a") + "---\n" + _named("a2"))
    (tmp_path / "c.json").write_text(json.dumps(yaml.safe_load(_named("c"))))
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    (tmp_path / "README.md").write_text("not a manifest")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "d.yaml").write_text(_named("d"))
    flat = scaledobject.load_path(tmp_path)
    assert [(Path(m.source).name, m.index, m.record.name) for m in flat] == [
        ("a.yaml", 1, "a"),
        ("a.yaml", 2, "a2"),
        ("b.yml", 1, "b"),
        ("c.json", 1, "c"),
    ]
    assert [m.record.name for m in scaledobject.load_path(tmp_path, recursive=True)] == ["a", "a2", "b", "c", "d"]
    assert [m.record.name for m in scaledobject.load_path(str(tmp_path / "sub" / "d.yaml"))] == ["d"]

    (tmp_path / "sub" / "e.yaml").write_text(_named("b"))
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.load_path(tmp_path, recursive=True)
    assert str(exc.value) == (
        f"{tmp_path / 'sub' / 'e.yaml'} doc 1: metadata.name: default.b is also defined by {tmp_path / 'b.yml'} doc 1"
    )
    (tmp_path / "b.yml").write_text(_named("b").replace("maxReplicaCount: 4", "maxReplicaCount: -1"))
    with pytest.raises(ScaledObjectError, match=f"^{tmp_path / 'b.yml'} doc 1: spec.maxReplicaCount"):
        scaledobject.load_path(tmp_path)


def test_load_path_refuses_an_empty_directory_an_empty_file_and_a_missing_one(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.yaml").write_text(GOOD)
    with pytest.raises(ScaledObjectError, match=r"no ScaledObject in its .yaml, .yml, .json files \(add -R"):
        scaledobject.load_path(tmp_path)
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ScaledObjectError, match=r"empty.yaml: no ScaledObject in it"):
        scaledobject.load_path(tmp_path / "empty.yaml")
    with pytest.raises(ScaledObjectError, match=r"nope.yaml: cannot read it"):
        scaledobject.load_path(tmp_path / "nope.yaml")


# --- pulsescale apply -f ----------------------------------------------------------------------------------------


def apply(*args: str, stdin: str = "", nats_url: str | None = None) -> int:
    argv = [*args, *(["--nats", nats_url] if nats_url else [])]
    return oncall_apply.apply(argv, "pulsescale apply", stdin=io.StringIO(stdin))


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
    assert dispatcher.main(["apply", "-f", str(EXAMPLE), *unreachable]) == 3
    err = capsys.readouterr().err
    assert err.startswith("pulsescale apply: cannot connect to NATS") and err.count("\n") == 1


def test_apply_same_object_in_two_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(GOOD)
    b.write_text(GOOD)
    assert apply("-f", str(a), "-f", str(b), "--dry-run") == 1
    assert f"default.qwen is also defined by {a} doc 1" in capsys.readouterr().err


# --- review findings (issue 11): one model per ScaledObject, ASCII numbers, depth, KEDA fields ------------------


def _two_of_one_model() -> str:
    a = GOOD.replace("name: qwen\nspec", "name: qwen-a\nspec")
    b = GOOD.replace("name: qwen\nspec", "name: qwen-b\nspec")
    return a + "---\n" + b


def test_two_scaledobjects_of_one_model_in_one_apply_are_refused_naming_both(tmp_path: Path) -> None:
    """The autoscaler serves one ScaledObject per model and drops the other (daemon.apply_scaler): refuse it here,
    where the user is still looking, instead of reporting both "created"."""
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.load_documents(_two_of_one_model(), "two.yaml")
    assert str(exc.value) == (
        "two.yaml doc 2: spec.triggers[0].metadata.model: qwen is also scaled by default.qwen-a (doc 1); "
        "one ScaledObject per model: merge the two or give each its own model"
    )
    (tmp_path / "a.yaml").write_text(_two_of_one_model().split("---\n")[0])
    (tmp_path / "b.yaml").write_text(_two_of_one_model().split("---\n")[1])
    with pytest.raises(
        ScaledObjectError, match=r"b.yaml doc 1: .*qwen is also scaled by default.qwen-a \(.*a.yaml doc 1\)"
    ):
        scaledobject.load_path(tmp_path)
    # Two -f arguments (load_manifests), with --dry-run too: nothing is reported valid.
    assert apply("-f", str(tmp_path / "a.yaml"), "-f", str(tmp_path / "b.yaml"), "--dry-run") == 1
    assert apply("-f", "-", "--dry-run", stdin=_two_of_one_model()) == 1


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("²", "must be a whole number of replicas (ASCII digits 0-9), got '²'"),
        ("٣", "must be a whole number of replicas (ASCII digits 0-9), got '٣'"),
        ("1_0", "must be a whole number of replicas (ASCII digits 0-9), got '1_0'"),
        ("-1", "must be a whole number of replicas (ASCII digits 0-9), got '-1'"),
    ],
)
def test_paused_replicas_are_ascii_digits_only(value: str, error: str) -> None:
    with pytest.raises(ScaledObjectError) as exc:
        _annotated({"autoscaling.keda.sh/paused-replicas": value})
    assert error in str(exc.value)
    assert _annotated({"autoscaling.keda.sh/paused-replicas": " 3 "}).paused_replicas == 3


@pytest.mark.parametrize("value", ["1_000", "١٢", "²", "0x10", "nan", "inf", "1e", "++1", "4 4"])
def test_metadata_numbers_are_ascii_decimals_only(value: str) -> None:
    with pytest.raises(ScaledObjectError, match=re.escape(f'targetQueueDepth: "{value}" is not a number')):
        load(_edit("{model: qwen}", f'{{model: qwen, targetQueueDepth: "{value}"}}'))


def test_metadata_numbers_keep_exponents_as_go_parsefloat_does() -> None:
    [rec] = load(_edit("{model: qwen}", '{model: qwen, targetQueueDepth: "1e3", activationQueueDepth: ".5"}'))
    assert rec.spec.triggers[0].metadata.target_queue_depth == 1000
    assert rec.spec.triggers[0].metadata.activation_queue_depth == 0.5


def test_max_replicas_from_env_is_ascii_digits_only() -> None:
    for text in ("٣", "²", "1_000"):
        with pytest.raises(ScaledObjectError, match="must be a whole number of replicas >= 1"):
            scaledobject.max_replicas_from_env({scaledobject.MAX_REPLICAS_ENV: text})


@pytest.mark.parametrize(
    "text",
    [
        "a: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n",
        "[" * 5000 + "]" * 5000 + "\n",
        "a:\n" + "".join(" " * i + "- \n" for i in range(1, 400)),
    ],
    ids=["mapping-3000", "list-5000", "block-400"],
)
def test_deep_nesting_is_a_named_error_not_a_traceback(text: str) -> None:
    with pytest.raises(ScaledObjectError, match=r"^deep.yaml: line \d+, column \d+: nested too deeply \(more than 64"):
        scaledobject.load_documents(text, "deep.yaml")


def test_a_huge_text_is_refused_before_parsing() -> None:
    text = GOOD + "#" + "x" * scaledobject.MAX_TEXT_BYTES
    with pytest.raises(ScaledObjectError, match=r"^big.yaml: \d+ bytes: more than a ScaledObject file"):
        scaledobject.load_documents(text, "big.yaml")


def test_loader_errors_other_than_yaml_ones_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(text: str) -> list[object]:
        raise ValueError("exponent too large")

    monkeypatch.setattr(loading, "_documents", boom)
    with pytest.raises(ScaledObjectError, match=r"^x.yaml: YAML: cannot be read \(ValueError: exponent too large\)"):
        scaledobject.load_documents(GOOD, "x.yaml")


def test_env_source_container_name_is_admitted_with_a_note() -> None:
    rec = _corpus("33-env-source-container-name.yaml")
    assert rec.spec.scale_target_ref.env_source_container_name == "vllm"
    assert [n for n in rec.notes if "envSourceContainerName" in n] == [scaledobject.NOTE_ENV_SOURCE]


def test_fallback_failure_threshold_zero_is_admitted_as_keda_s_first_failure() -> None:
    """KEDA falls back when failures > failureThreshold, so 0 is "on the first failure"; the wire (revision 5) and
    the policy read it so, without a note."""
    rec = _corpus("34-fallback-failure-threshold-zero.yaml")
    assert rec.spec.fallback is not None and rec.spec.fallback.failure_threshold == 0
    assert not [n for n in rec.notes if "failureThreshold" in n]
    with pytest.raises(ScaledObjectError, match=r"spec.fallback.failureThreshold: -1: must be >= 0"):
        load(GOOD.replace("  triggers:\n", "  fallback: {failureThreshold: -1, replicas: 2}\n  triggers:\n"))


HPA_DEFAULT_SCALE_UP = """\
  advanced:
    horizontalPodAutoscalerConfig:
      behavior:
        scaleUp:
          stabilizationWindowSeconds: 0
          selectPolicy: Max
          policies:
            - {type: Percent, value: 100, periodSeconds: 15}
            - {type: Pods, value: 4, periodSeconds: 15}
"""


def test_hpa_s_default_scale_up_is_refused_saying_removing_it_loses_nothing() -> None:
    with pytest.raises(ScaledObjectError) as exc:
        load(GOOD.replace("  triggers:\n", HPA_DEFAULT_SCALE_UP + "  triggers:\n"))
    assert "scaleUp.policies: this is the HPA's default scale-up" in str(exc.value)
    assert "removing it loses nothing" in str(exc.value)


def test_more_triggers_than_the_crd_allows_are_refused() -> None:
    trigger = "    - type: gateway-queue\n      metadata: {model: qwen}\n"
    many = GOOD.replace(trigger, trigger * (scaledobject.MAX_TRIGGERS + 1))
    assert many.count("gateway-queue") == 17
    with pytest.raises(ScaledObjectError, match=r"spec.triggers: 17 triggers: at most 16"):
        load(many)
    assert len(load(GOOD.replace(trigger, trigger * scaledobject.MAX_TRIGGERS))[0].spec.triggers) == 16


def test_apply_summary_shows_one_way_pauses(capsys: pytest.CaptureFixture[str]) -> None:
    text = GOOD.replace(
        "  name: qwen\n", '  name: qwen\n  annotations: {autoscaling.keda.sh/paused-scale-in: "true"}\n'
    )
    assert apply("-f", "-", "--dry-run", stdin=text) == 0
    assert "paused scale-in)" in capsys.readouterr().out
    up_disabled = GOOD.replace(
        "  triggers:\n",
        "  advanced:\n    horizontalPodAutoscalerConfig:\n      behavior:\n        scaleUp: {selectPolicy: Disabled}\n"
        "  triggers:\n",
    )
    assert apply("-f", "-", "--dry-run", stdin=up_disabled) == 0
    assert "paused scale-out (scaleUp.selectPolicy: Disabled))" in capsys.readouterr().out


WEIRD_VALUES: list[object] = [None, [], {}, [1], {"a": 1}, "²", "٣", "1_000", 1e400, float("nan"), True, -1, 0,
                              10**30, "", "x" * 300, 3.5, "true"]  # fmt: skip


def test_any_corpus_document_with_odd_values_raises_only_scaledobjecterror() -> None:
    """The operator runs the validator on whatever a CR holds: anything but a `ScaledObjectError` would crash its
    handler. Corpus documents with 1-3 values replaced by odd ones (seeded; found a TypeError from a list as a
    trigger type under keda.sh)."""
    docs = [d for p in sorted(CORPUS.rglob("*.yaml")) if "duplicate" not in p.name
            for d in yaml.safe_load_all(p.read_text()) if isinstance(d, dict)]  # fmt: skip
    keda = yaml.safe_load(GOOD.replace("pulsescale.io/v1alpha1", "keda.sh/v1alpha1"))
    keda["spec"]["triggers"][0]["type"] = ["gateway-queue"]  # was a TypeError (unhashable) in the apiVersion hint
    with pytest.raises(ScaledObjectError, match=r"^apiVersion: expected pulsescale.io/v1alpha1"):
        scaledobject.from_manifest(keda)
    rng = random.Random(11)

    def paths(v: object, pre: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else []
        return [pre] + [q for k, x in items for q in paths(x, (*pre, k))]

    for _ in range(3000):
        doc = copy.deepcopy(rng.choice(docs))
        for _ in range(rng.randint(1, 3)):
            *parents, last = rng.choice(paths(doc)[1:])
            node = doc
            for k in parents:
                node = node[k]
            node[last] = copy.deepcopy(rng.choice(WEIRD_VALUES))
        try:
            scaledobject.from_manifest(doc)
        except ScaledObjectError:
            pass


# --- horizontalPodAutoscalerConfig, branch by branch (`_map_hpa`) ----------------------------------------------------

BEHAVIOR = "spec.advanced.horizontalPodAutoscalerConfig.behavior"


def _hpa_doc(config: dict[str, object], **advanced: object) -> dict[str, object]:
    return {
        "apiVersion": scaledobject.API_VERSION,
        "kind": scaledobject.KIND,
        "metadata": {"name": "qwen"},
        "spec": {
            "scaleTargetRef": {"name": "qwen"},
            "maxReplicaCount": 4,
            "advanced": {**advanced, "horizontalPodAutoscalerConfig": config},
            "triggers": [{"type": "gateway-queue", "metadata": {"model": "qwen"}}],
        },
    }


def _hpa(
    up: dict[str, object] | None = None, down: dict[str, object] | None = None, **advanced: object
) -> ScalerRecord:
    behavior = {k: v for k, v in (("scaleUp", up), ("scaleDown", down)) if v is not None}
    return scaledobject.from_manifest(_hpa_doc({"behavior": behavior}, **advanced))


def _hpa_refusal(up: dict[str, object] | None = None, down: dict[str, object] | None = None, **advanced: object) -> str:
    with pytest.raises(ScaledObjectError) as exc:
        _hpa(up, down, **advanced)
    return str(exc.value)


def _scale_down(a: protocol.Advanced) -> tuple[object, ...]:
    return (a.scale_down_stabilization_seconds, a.scale_down_percent, a.scale_down_pods, a.scale_down_period_seconds,
            a.scale_down_select_policy)  # fmt: skip


DEFAULT_DOWN = _scale_down(protocol.Advanced())
P = {"type": "Percent", "periodSeconds": 15}
PODS = {"type": "Pods", "periodSeconds": 15}


@pytest.mark.parametrize(
    "up", [{}, {"selectPolicy": "Max"}, {"selectPolicy": "Min"}, {"stabilizationWindowSeconds": 0}], ids=str
)
@pytest.mark.parametrize("down", [None, {"selectPolicy": "Min"}], ids=["no scaleDown", "scaleDown"])
def test_a_scale_up_rule_that_does_not_say_disabled_leaves_scale_out_on(
    up: dict[str, object], down: dict[str, object] | None
) -> None:
    """Only ``selectPolicy: Disabled`` pauses scale-out (KEDA's paused-scale-out does that to its HPA); a scaleUp
    block without it changes nothing of the policy."""
    rec = _hpa(up, down)
    assert (rec.paused, rec.paused_scale_in, rec.paused_scale_out) == (False, False, False)
    want = DEFAULT_DOWN if down is None else (*DEFAULT_DOWN[:4], "Min")
    assert _scale_down(rec.spec.advanced) == want


def test_scale_up_disabled_pauses_scale_out_and_the_scale_down_rules_still_map() -> None:
    rec = _hpa({"selectPolicy": "Disabled"}, {"stabilizationWindowSeconds": 120, "selectPolicy": "Min"})
    assert (rec.paused, rec.paused_scale_in, rec.paused_scale_out) == (False, False, True)
    assert _scale_down(rec.spec.advanced) == (120.0, *DEFAULT_DOWN[1:4], "Min")
    assert _hpa(down={"selectPolicy": "Disabled"}).paused_scale_out is False  # scale-down's Disabled is its own


DEFAULT_UP = [{"type": "Percent", "value": 100, "periodSeconds": 15}, {"type": "Pods", "value": 4, "periodSeconds": 15}]


@pytest.mark.parametrize(
    ("up", "default"),
    [
        ({"policies": DEFAULT_UP}, True),
        ({"policies": DEFAULT_UP[::-1], "selectPolicy": "Max"}, True),  # in any order
        ({"policies": DEFAULT_UP, "selectPolicy": "Min"}, False),  # not the default any more: a real limit
        ({"policies": DEFAULT_UP, "selectPolicy": "Disabled"}, False),
        ({"policies": [{"type": "Pods", "value": 4, "periodSeconds": 60}]}, False),
        ({"policies": DEFAULT_UP[:1]}, False),
    ],
)
def test_scale_up_policies_are_refused_and_the_hpa_default_is_named(up: dict[str, object], default: bool) -> None:
    error = _hpa_refusal(up)
    assert error.startswith(f"{BEHAVIOR}.scaleUp.policies: ")
    assert ("this is the HPA's default scale-up" in error) is default
    assert ("scale-up rate limits are not applied" in error) is not default


@pytest.mark.parametrize("rules", ["scaleUp", "scaleDown"])
def test_a_tolerance_is_refused_on_either_rules(rules: str) -> None:
    tolerance: dict[str, object] = {"tolerance": "0.1" if rules == "scaleUp" else 0.1}
    up, down = (tolerance, None) if rules == "scaleUp" else (None, tolerance)
    error = _hpa_refusal(up, down)
    assert error.startswith(f"{BEHAVIOR}.{rules}.tolerance: HPA's tolerance (a dead band around the target) has no")


def test_scale_up_stabilization_is_refused_naming_the_field() -> None:
    assert _hpa_refusal({"stabilizationWindowSeconds": 1}).startswith(
        f"{BEHAVIOR}.scaleUp.stabilizationWindowSeconds: scale-up stabilization is not applied"
    )


@pytest.mark.parametrize(
    ("down", "want"),
    [
        # (stabilization, percent, pods, period, selectPolicy); percent and period unset: the scale-in hold's.
        ({"stabilizationWindowSeconds": 0}, (0.0, *DEFAULT_DOWN[1:])),
        ({"stabilizationWindowSeconds": 300}, (300.0, *DEFAULT_DOWN[1:])),
        ({"selectPolicy": "Disabled"}, (*DEFAULT_DOWN[:4], "Disabled")),
        ({"selectPolicy": "Min"}, (*DEFAULT_DOWN[:4], "Min")),
        ({"policies": [{**P, "value": 20, "periodSeconds": 30}]}, (DEFAULT_DOWN[0], 20.0, None, 30.0, "Max")),
        ({"policies": [{**P, "value": 100}]}, (DEFAULT_DOWN[0], 100.0, None, 15.0, "Max")),
        # Pods alone: at most that many, min(100 % of the replicas, Pods), whatever selectPolicy says...
        ({"policies": [{**PODS, "value": 3}]}, (DEFAULT_DOWN[0], 100.0, 3, 15.0, "Min")),
        ({"policies": [{**PODS, "value": 3}], "selectPolicy": "Max"}, (DEFAULT_DOWN[0], 100.0, 3, 15.0, "Min")),
        # ... unless scale-down is disabled altogether.
        (
            {"policies": [{**PODS, "value": 3}], "selectPolicy": "Disabled"},
            (DEFAULT_DOWN[0], 100.0, 3, 15.0, "Disabled"),
        ),
        (
            {"policies": [{**PODS, "value": 2}, {**P, "value": 10}], "selectPolicy": "Max"},
            (DEFAULT_DOWN[0], 10.0, 2, 15.0, "Max"),
        ),
        (
            {"stabilizationWindowSeconds": 60, "policies": [{**P, "value": 50}, {**PODS, "value": 1}]},
            (60.0, 50.0, 1, 15.0, "Max"),
        ),
    ],
)
def test_scale_down_rules_map_field_by_field(down: dict[str, object], want: tuple[object, ...]) -> None:
    rec = _hpa(down=down)
    got = _scale_down(rec.spec.advanced)
    assert got == want
    assert [type(v) for v in got] == [type(v) for v in want]  # seconds and percentages as floats, pods a count
    assert not rec.paused_scale_out


@pytest.mark.parametrize(
    ("down", "advanced", "error"),
    [
        (
            {"policies": [{**P, "value": 10}, {**PODS, "value": 1, "periodSeconds": 60}]},
            {},
            f"{BEHAVIOR}.scaleDown.policies: periodSeconds differ (15, 60): pulsescale has one scale-down period",
        ),
        (
            {"policies": [{**P, "value": 10}, {**PODS, "value": 1}, {**P, "value": 20}]},
            {},
            f"{BEHAVIOR}.scaleDown.policies[2]: a second Percent policy (the first is policies[0])",
        ),
        (
            {"policies": [{**PODS, "value": 1}, {**P, "value": 101}]},
            {},
            f"{BEHAVIOR}.scaleDown.policies[1].value: 101 %: scale-down removes at most 100 % of the replicas",
        ),
        (
            {"stabilizationWindowSeconds": 0},
            {"scaleDownStabilizationSeconds": 30},
            f"spec.advanced.scaleDownStabilizationSeconds: set twice: here and by {BEHAVIOR}.scaleDown."
            "stabilizationWindowSeconds (which maps onto it)",
        ),
        *(
            (
                {"policies": [{**PODS, "value": 1}]},
                {field: value},
                f"spec.advanced.{field}: set twice: here and by {BEHAVIOR}.scaleDown.policies",
            )
            for field, value in (("scaleDownPercent", 50), ("scaleDownPods", 2), ("scaleDownPeriodSeconds", 30))
        ),
        (
            {"selectPolicy": "Disabled"},
            {"scaleDownSelectPolicy": "Disabled"},
            f"spec.advanced.scaleDownSelectPolicy: set twice: here and by {BEHAVIOR}.scaleDown.selectPolicy",
        ),
    ],
)
def test_scale_down_rules_that_cannot_map_are_refused_naming_the_field(
    down: dict[str, object], advanced: dict[str, object], error: str
) -> None:
    assert _hpa_refusal(None, down, **advanced).startswith(error)


def test_advanced_fields_that_no_hpa_rule_sets_are_kept() -> None:
    """Setting a field both ways is refused; a field the HPA rules given leave alone is not set twice."""
    a = _hpa(down={"stabilizationWindowSeconds": 30}, scaleDownPercent=20, scaleDownSelectPolicy="Min").spec.advanced
    assert _scale_down(a) == (30.0, 20.0, None, DEFAULT_DOWN[3], "Min")
    a = _hpa(down={"policies": [{**P, "value": 10}]}, scaleDownStabilizationSeconds=45).spec.advanced
    assert _scale_down(a) == (45.0, 10.0, None, 15.0, "Max")
    a = _hpa(down={"selectPolicy": "Min"}, scaleDownPods=2).spec.advanced
    assert (a.scale_down_pods, a.scale_down_select_policy) == (2, "Min")


def test_an_hpa_config_without_behavior_maps_nothing_and_its_name_is_a_note() -> None:
    named = scaledobject.from_manifest(_hpa_doc({"name": "keda-hpa-qwen"}))
    assert named.notes == [_NOTE_HPA_NAME]
    assert _scale_down(named.spec.advanced) == DEFAULT_DOWN and not named.paused_scale_out
    bare = scaledobject.from_manifest(_hpa_doc({}))
    assert bare.notes == [] and _scale_down(bare.spec.advanced) == DEFAULT_DOWN
    empty = _hpa()  # behavior: {}
    assert empty.notes == [] and _scale_down(empty.spec.advanced) == DEFAULT_DOWN and not empty.paused_scale_out
    both = scaledobject.from_manifest(
        _hpa_doc({"name": "keda-hpa-qwen", "behavior": {"scaleDown": {"selectPolicy": "Min"}}})
    )
    assert both.notes == [_NOTE_HPA_NAME] and both.spec.advanced.scale_down_select_policy == "Min"


# --- capped: what the autoscaler acts on, whoever wrote the record ----------------------------------------------------


def _record(min_: int = 1, max_: int = 40, *, idle: int | None = None, paused: int | None = None) -> ScalerRecord:
    doc = yaml.safe_load(GOOD)
    doc["spec"].update(minReplicaCount=min_, maxReplicaCount=max_)
    if idle is not None:
        doc["spec"]["idleReplicaCount"] = idle
    rec = scaledobject.from_manifest(doc)
    return rec if paused is None else msgspec.structs.replace(rec, paused=True, paused_replicas=paused)


@pytest.mark.parametrize(
    ("rec", "limit"),
    [(_record(1, 16), 16), (_record(1, 16, paused=16), 16), (_record(0, 4, paused=None), 4)],
    ids=["max at the limit", "paused at the limit", "no pause"],
)
def test_capped_leaves_a_record_within_the_limit_alone(rec: ScalerRecord, limit: int) -> None:
    assert scaledobject.capped(rec, limit) == (rec, None)


@pytest.mark.parametrize(
    ("rec", "limit", "want"),
    [
        # (min, max, idle, paused replicas) acted on
        (_record(1, 40), 16, (1, 16, None, None)),
        (_record(30, 40), 16, (16, 16, None, None)),
        (_record(30, 40, idle=25), 16, (16, 16, 15, None)),  # idle stays below min
        (_record(30, 40, idle=16), 16, (16, 16, 15, None)),  # ... also when it equals the new min
        (_record(30, 40, idle=10), 16, (16, 16, 10, None)),
        (_record(5, 10, idle=3), 1, (1, 1, 0, None)),
        (_record(1, 8, paused=20), 16, (1, 8, None, 16)),  # only the pause over the limit
        (_record(1, 40, paused=3), 16, (1, 16, None, 3)),
    ],
)
def test_capped_cuts_every_count_to_the_limit(rec: ScalerRecord, limit: int, want: tuple[object, ...]) -> None:
    cut, what = scaledobject.capped(rec, limit)
    spec = cut.spec
    assert (spec.min_replica_count, spec.max_replica_count, spec.idle_replica_count, cut.paused_replicas) == want
    assert (cut.key, cut.paused, spec.model) == (rec.key, rec.paused, rec.spec.model)
    assert what == (
        f"replicas {rec.spec.min_replica_count}..{rec.spec.max_replica_count} over the limit of {limit} per model; "
        f"acting on {want[0]}..{want[1]} (raise the limit with --max-replicas or $PULSESCALE_MAX_REPLICAS)"
    )


def test_capped_cuts_schedule_floors_above_the_new_max_only() -> None:
    [m] = scaledobject.load_documents(
        GOOD.replace("maxReplicaCount: 4", "maxReplicaCount: 40").replace(
            "  triggers:\n",
            "  schedules:\n"
            "    - {name: low, start: '2026-06-01T10:00', durationSeconds: 60, replicas: 3}\n"
            "    - {name: top, start: '2026-06-02T10:00', durationSeconds: 60, replicas: 16}\n"
            "    - {name: high, start: '2026-06-03T10:00', durationSeconds: 60, replicas: 30}\n"
            "  triggers:\n",
        ),
        "s.yaml",
    )
    cut, _ = scaledobject.capped(m.record, 16)
    assert [(s.name, s.replicas) for s in cut.spec.schedules] == [("low", 3), ("top", 16), ("high", 16)]


# --- check_models: one ScaledObject per model across what is already written ------------------------------------------


def _manifests(*docs: tuple[str, str]) -> list[scaledobject.Manifest]:
    """(name, model) of each document, in one file."""
    text = "---\n".join(GOOD.replace("name: qwen\nspec", f"name: {n}\nspec").replace("model: qwen", f"model: {m}")
                        for n, m in docs)  # fmt: skip
    return scaledobject.load_documents(text, "apply.yaml")


def test_check_models_refuses_a_model_another_written_scaledobject_scales() -> None:
    written = [m.record for m in _manifests(("llama", "llama"), ("old-qwen", "qwen"))]
    written = [msgspec.structs.replace(r, namespace="prod") for r in written]
    manifests = _manifests(("mistral", "mistral"), ("qwen", "qwen"))
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.check_models(manifests, written)
    assert exc.value.field == "spec.triggers[0].metadata.model"
    assert exc.value.where == "apply.yaml doc 2"
    assert str(exc.value) == (
        "apply.yaml doc 2: spec.triggers[0].metadata.model: qwen is already scaled by prod.old-qwen in pulse_scalers; "
        "one ScaledObject per model: delete prod.old-qwen first (pulsescale delete so old-qwen -n prod), or change "
        "this one's model"
    )


def test_check_models_lets_one_apply_move_a_model_between_scaledobjects() -> None:
    written = [m.record for m in _manifests(("a", "qwen"), ("b", "llama"))]
    scaledobject.check_models(_manifests(("a", "mistral"), ("b", "qwen")), written)  # b takes qwen from a
    scaledobject.check_models(_manifests(("a", "qwen")), written)  # a rewritten with its own model
    scaledobject.check_models([], written)


# --- other_kind: what is skipped as another API's ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "want"),
    [
        ({"kind": "Service", "apiVersion": "v1", "metadata": {"name": "qwen", "namespace": "inference"}},
         "Service inference/qwen"),
        ({"kind": "Service", "apiVersion": "v1", "metadata": {"name": "qwen"}}, "Service qwen"),
        ({"kind": "Service", "apiVersion": "v1", "metadata": {"name": 5, "namespace": ""}}, "Service"),
        ({"kind": "Service", "apiVersion": "v1", "metadata": ["qwen"]}, "Service"),
        ({"kind": "Service", "apiVersion": "v1"}, "Service"),
        # Checked as a ScaledObject (broken, or ours): never skipped.
        ({"kind": 5, "apiVersion": "v1"}, None),
        ({"kind": "", "apiVersion": "v1"}, None),
        ({"kind": "List", "apiVersion": "v1"}, None),
        ({"kind": "ScaledObject", "apiVersion": "keda.sh/v1alpha1"}, None),
        ({"kind": "Service", "apiVersion": 1}, None),
        ({"kind": "Anything", "apiVersion": "pulsescale.io/v1"}, None),
        ({"kind": "Anything", "apiVersion": "pulsescale.io"}, None),
        (["not", "a", "mapping"], None),
    ],
)  # fmt: skip
def test_other_kind_names_another_apis_document(doc: object, want: str | None) -> None:
    assert scaledobject.other_kind(doc) == want


def test_a_skipped_item_of_a_list_is_said_with_its_place() -> None:
    items = [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "qwen"}}, yaml.safe_load(GOOD)]
    skipped: list[str] = []
    [m] = scaledobject.load_documents(json.dumps({"kind": "List", "items": items}), "l.yaml", skipped=skipped)
    assert (m.item, m.record.updated_at) == (1, 0.0)
    assert skipped == ["skipped Service qwen (l.yaml doc 1 items[0]): not a ScaledObject (kubectl applies it)"]


# --- the loader's refusals, located -----------------------------------------------------------------------------------


def _refusal(text: str, source: str = "x.yaml") -> ScaledObjectError:
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.load_documents(text, source)
    return exc.value


def test_a_yaml_error_is_located_by_line_and_column() -> None:
    err = _refusal("a: 1\nb: [1, 2\n")
    assert (err.field, err.where) == ("", "x.yaml")
    assert str(err).startswith("x.yaml: line 3, column 1: expected ',' or ']'")
    dup = _refusal("a: 1\n  \nb:\n  c: 1\n  c: 2\n")
    assert str(dup) == (
        "x.yaml: line 5, column 3: duplicate key 'c' (first at line 4); YAML would keep only the last one: remove one"
    )


def test_a_yaml_error_without_a_place_says_yaml() -> None:
    err = _refusal("a: \x07\n")  # a character YAML does not allow: the reader's error has no mark
    assert (err.field, err.where) == ("", "x.yaml")
    assert str(err).startswith("x.yaml: YAML: unacceptable character #x0007: special characters are not allowed")


def test_a_duplicate_key_after_a_merge_key_is_refused() -> None:
    err = _refusal("base: &b {x: 1}\nm:\n  <<: *b\n  y: 1\n  y: 2\n")
    assert "duplicate key 'y' (first at line 4)" in str(err)
    assert loading._documents("base: &b {x: 1}\nm:\n  <<: *b\n  x: 2\n") == [{"base": {"x": 1}, "m": {"x": 2}}]


def _nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        (_nested(scaledobject.MAX_DEPTH), False),
        (_nested(scaledobject.MAX_DEPTH + 1), True),
        ("[" + ", ".join(["[1]"] * 100) + ", " + _nested(scaledobject.MAX_DEPTH - 1) + "]", False),
        ("[" + ", ".join(["[1]"] * 100) + ", " + _nested(scaledobject.MAX_DEPTH) + "]", True),
        # A branch closed deep down: its sibling goes on from the same depth (60 + 5 = 65 levels).
        (_nested(60, "[1], " + _nested(5)), True),
        (_nested(60, "[1], " + _nested(4)), False),
    ],
    ids=["64 levels", "65 levels", "siblings then 64", "siblings then 65", "a branch to 65", "a branch to 64"],
)
def test_nesting_is_counted_level_by_level(text: str, refused: bool) -> None:
    if refused:
        err = _refusal(text, "deep.yaml")
        assert (err.field, err.where) == ("", "deep.yaml")
        assert re.fullmatch(r"deep.yaml: line 1, column \d+: nested too deeply \(more than 64 levels of mappings "
                            r"and lists\)", str(err))  # fmt: skip
    else:
        assert loading._documents(text)


def test_the_column_of_a_too_deep_nesting_is_one_based() -> None:
    err = _refusal("a:\n  b: " + _nested(scaledobject.MAX_DEPTH), "deep.yaml")
    # The root mapping is level 1, b's is 2: the 63rd "[" (column 6 + 62) is level 65.
    assert str(err).startswith("deep.yaml: line 2, column 68: nested too deeply")


def test_a_huge_text_is_refused_with_its_size() -> None:
    text = GOOD + "#" + "x" * scaledobject.MAX_TEXT_BYTES
    err = _refusal(text, "big.yaml")
    assert (err.field, err.where) == ("", "big.yaml")
    size = len(text.encode())
    assert str(err) == f"big.yaml: {size} bytes: more than a ScaledObject file holds (at most 3145728); wrong file?"


@pytest.mark.parametrize(
    ("error", "says"),
    [(RecursionError(), "YAML: nested too deeply to read"), (OverflowError("too big"), "YAML: cannot be read "
                                                                                        "(OverflowError: too big)")],
)  # fmt: skip
def test_a_loader_failure_is_a_located_refusal(monkeypatch: pytest.MonkeyPatch, error: Exception, says: str) -> None:
    def boom(text: str) -> list[object]:
        raise error

    monkeypatch.setattr(loading, "_documents", boom)
    err = _refusal(GOOD)
    assert (err.field, err.where, str(err)) == ("", "x.yaml", f"x.yaml: {says}")


def test_a_number_that_is_not_finite_is_refused_naming_the_field() -> None:
    text = GOOD.replace("metadata: {model: qwen}", 'metadata: {model: qwen, targetQueueDepth: "1e999"}')
    err = _refusal(text)
    assert err.field == "spec.triggers[0].metadata.targetQueueDepth"
    assert str(err) == 'x.yaml doc 1: spec.triggers[0].metadata.targetQueueDepth: "1e999" is not a finite number'


def test_a_name_outside_the_pattern_is_refused_saying_what_a_name_is() -> None:
    err = _refusal(GOOD.replace("model: qwen", "model: Qwen.Chat"))
    assert err.field == "spec.triggers[0].metadata.model"
    assert str(err).endswith(" (a name: lowercase letters, digits, '-' and '_'; no dots)")


def test_max_replicas_from_env_reads_a_whole_number_of_at_least_one() -> None:
    env = scaledobject.MAX_REPLICAS_ENV
    assert scaledobject.max_replicas_from_env({}) == scaledobject.DEFAULT_MAX_REPLICAS
    assert scaledobject.max_replicas_from_env({env: " 1 "}) == 1
    assert scaledobject.max_replicas_from_env({env: "250"}) == 250
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.max_replicas_from_env({env: "0"})
    assert (exc.value.field, str(exc.value)) == ("", "$PULSESCALE_MAX_REPLICAS is '0'; it must be a whole number of "
                                                     "replicas >= 1")  # fmt: skip


# --- load_path: what it passes on, and its refusals ----------------------------------------------------------------


def test_load_path_passes_the_time_and_the_limit_on(tmp_path: Path) -> None:
    (tmp_path / "q.yaml").write_text(GOOD)
    [m] = scaledobject.load_path(tmp_path / "q.yaml", updated_at=5.0)
    assert m.record.updated_at == 5.0
    assert scaledobject.load_path(tmp_path)[0].record.updated_at == 0.0
    with pytest.raises(ScaledObjectError, match=r"spec.maxReplicaCount: 4 is over the limit of 2 replicas"):
        scaledobject.load_path(tmp_path, max_replicas=2)


def test_load_path_refuses_a_huge_file_before_reading_it(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(scaledobject.MAX_TEXT_BYTES + 1)  # sparse: nothing is written, nothing is read
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.load_path(big)
    assert (exc.value.field, exc.value.where) == ("", str(big))
    assert str(exc.value) == f"{big}: 3145729 bytes: more than a ScaledObject file holds (at most 3145728); wrong file?"


def test_load_path_says_exactly_why_nothing_was_found(tmp_path: Path) -> None:
    (tmp_path / "svc.yaml").write_text("apiVersion: v1\nkind: Service\nmetadata: {name: qwen}\n")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.load_path(tmp_path)
    assert (exc.value.field, exc.value.where) == ("", str(tmp_path))
    assert str(exc.value) == (
        f"{tmp_path}: no ScaledObject in its .yaml, .yml, .json files (add -R for its subdirectories) (1 document(s) "
        "of other kinds skipped)"
    )
    (tmp_path / "svc.yaml").unlink()
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.load_path(tmp_path, recursive=True)
    assert str(exc.value) == f"{tmp_path}: no ScaledObject in its .yaml, .yml, .json files"
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.load_path(tmp_path / "nope.yaml")
    assert exc.value.field == "" and str(exc.value).startswith(f"{tmp_path / 'nope.yaml'}: cannot read it: ")


# --- from_manifest: each refusal names its field ----------------------------------------------------------------------


def _doc(**over: object) -> dict[str, object]:
    """GOOD as a mapping, with top-level keys replaced (None removes one)."""
    doc: dict[str, object] = yaml.safe_load(GOOD)
    for key, value in over.items():
        if value is None:
            doc.pop(key)
        else:
            doc[key] = value
    return doc


def _meta(**over: object) -> dict[str, object]:
    return _doc(metadata={"name": "qwen", **over})


@pytest.mark.parametrize(
    ("doc", "field", "text"),
    [
        (["a", "list"], "", "a manifest is a mapping with apiVersion, kind, metadata and spec; got list"),
        (_doc(apiVersion="v1"), "apiVersion", "apiVersion: expected pulsescale.io/v1alpha1, got 'v1'"),
        (_doc(metadata=None), "metadata", "metadata: missing"),
        (_doc(metadata=["qwen"]), "metadata", "metadata: must be a mapping, got list"),
        (_doc(spec=None), "spec", "spec: missing"),
        (_meta(namespace="Prod.EU"), "metadata.namespace", "metadata.namespace: 'Prod.EU' is not a pulsescale name"),
        (_meta(annotations=["paused"]), "metadata.annotations", "metadata.annotations: must be a mapping, got list"),
        (_meta(creationTimestamp=5), "metadata.creationTimestamp",
         "metadata.creationTimestamp: must be an RFC 3339 time string, got int"),
        (_doc(spec={**yaml.safe_load(GOOD)["spec"], "triggers": [5, yaml.safe_load(GOOD)["spec"]["triggers"][0]]}),
         "spec.triggers[0]", "spec.triggers[0]: Expected `object`, got `int`"),
    ],
)  # fmt: skip
def test_each_refusal_of_a_manifest_names_its_field(doc: object, field: str, text: str) -> None:
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.from_manifest(doc)
    assert exc.value.field == field
    assert str(exc.value).startswith(text), str(exc.value)


def test_an_api_version_of_another_group_gets_no_hint() -> None:
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.from_manifest(_doc(apiVersion="apps/v1"))
    assert str(exc.value) == "apiVersion: expected pulsescale.io/v1alpha1, got 'apps/v1'"


def test_unknown_fields_are_counted_and_found_inside_optional_ones() -> None:
    spec = yaml.safe_load(GOOD)["spec"]
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.from_manifest(_doc(spec={**spec, "fallback": {"failureThreshold": 1, "replica": 2}}))
    assert str(exc.value) == "spec.fallback.replica: unknown field (did you mean replicas?)"
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.from_manifest(_doc(spec={**spec, "maxReplica": 4, "minReplica": 1, "zzz": 0}))
    assert exc.value.field == "spec.maxReplica"
    assert str(exc.value) == "spec.maxReplica: unknown field (did you mean maxReplicaCount?); 2 more unknown field(s)"


def test_the_generation_is_metadatas_when_it_is_a_count() -> None:
    assert scaledobject.from_manifest(_doc()).generation == 0
    for gen, want in ((0, 0), (3, 3), (-1, 0), (True, 0), ("3", 0)):
        assert scaledobject.from_manifest(_meta(generation=gen)).generation == want, gen
    assert scaledobject.from_manifest(_meta(generation=3), generation=7).generation == 7
    rec = scaledobject.from_manifest(_doc())
    assert (rec.updated_at, rec.created_at) == (0.0, None)


def test_replica_counts_at_the_limit_are_admitted() -> None:
    spec = {**yaml.safe_load(GOOD)["spec"], "minReplicaCount": 3, "maxReplicaCount": 3}
    both = {"pulsescale.io/paused-replicas": "3", "autoscaling.keda.sh/paused-replicas": "3"}
    rec = scaledobject.from_manifest(_doc(spec=spec, metadata={"name": "qwen", "annotations": both}), max_replicas=3)
    assert (rec.spec.max_replica_count, rec.paused_replicas, rec.paused) == (3, 3, True)  # one value in both families


def test_a_creation_time_without_an_offset_is_utc() -> None:
    for stamp in ("2026-12-03T07:51:44", "2026-12-03T07:51:44Z", " 2026-12-03T08:51:44+01:00 "):
        assert scaledobject.from_manifest(_meta(creationTimestamp=stamp)).created_at == 1796284304.0, stamp
    naive = datetime.datetime(2026, 12, 3, 7, 51, 44)  # what YAML makes of an unquoted time without an offset
    assert scaledobject.from_manifest(_meta(creationTimestamp=naive)).created_at == 1796284304.0


def test_a_creation_time_without_an_offset_is_utc_whatever_the_local_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        for stamp in ("2026-12-03T07:51:44", datetime.datetime(2026, 12, 3, 7, 51, 44)):
            assert scaledobject.from_manifest(_meta(creationTimestamp=stamp)).created_at == 1796284304.0, stamp
    finally:
        monkeypatch.undo()
        time.tzset()


def test_an_empty_text_is_refused_saying_so() -> None:
    err = _refusal("# nothing here\n", "empty.yaml")
    assert (err.field, err.where, str(err)) == (
        "",
        "empty.yaml",
        "empty.yaml: no ScaledObject in it (the file is empty)",
    )


def test_a_text_of_exactly_the_limit_is_read() -> None:
    """3 MiB is at most what is read, not over it: a text of exactly that size gets as far as the YAML reader
    (which refuses the NUL bytes at once)."""
    err = _refusal("\0" * scaledobject.MAX_TEXT_BYTES, "big.yaml")
    assert str(err).startswith("big.yaml: YAML: unacceptable character #x0000")


def test_load_path_reads_a_file_of_exactly_the_limit(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(scaledobject.MAX_TEXT_BYTES)
    with pytest.raises(ScaledObjectError, match=r"YAML: unacceptable character #x0000"):
        scaledobject.load_path(big)
