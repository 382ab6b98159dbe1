"""ScaledObject YAML → `ScalerRecord` (pure), and `pulsescale apply -f` writing it to KV `pulse_scalers`."""

from __future__ import annotations

import asyncio
import copy
import io
import json
import random
import re
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

CORPUS = Path(__file__).resolve().parent / "manifests"
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
    assert "(every 100 ms)" in scaledobject._NOTE_POLLING  # gateway/publisher.py, README: every 100 ms


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

    monkeypatch.setattr(scaledobject, "_documents", boom)
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
