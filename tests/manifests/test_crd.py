"""The ScaledObject CRD: generated from the one schema, structural, valid, and admitting/refusing what the shared
validator admits/refuses.

The API server's side is evaluated the way it works, with real implementations rather than a copy of our rules:
nulls of non-nullable fields pruned, defaults applied, the OpenAPI schema checked with `jsonschema` (unknown
fields refused, as ``kubectl apply``'s strict field validation does), then every ``x-kubernetes-validations``
rule run by a real CEL interpreter (`celpy`). The validator's side is `manifests.scaledobject`.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

from manifests import crd
from manifests.scaledobject import ScaledObjectError, from_manifest, load_documents

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "deploy" / "crd" / "scaledobjects.pulsescale.io.yaml"
DOCS_FILE = ROOT / "docs" / "scaledobject.md"
CORPUS = Path(__file__).resolve().parents[1] / "manifests"

# Refusals only the validator can make, matched on the corpus file's `# expect:` text, with the reason.
VALIDATOR_ONLY: list[tuple[str, str]] = [
    ("change apiVersion", "another CRD's apiVersion: the API server sends it to KEDA's CRD, never to ours"),
    ("duplicate", "duplicate YAML keys are the YAML reader's (kubectl's own reader refuses them too, before us)"),
    ("not a number", "trigger metadata numbers are untyped in the CRD (string or number), see manifests/crdschema.py"),
    ("annotation", "annotations are free-form strings in ObjectMeta; the pause annotations are read by the operator"),
    ("horizontalPodAutoscalerConfig", "mapping HPA behavior onto the policy is the validator's (semantic)"),
    ("scaleUp", "mapping HPA behavior onto the policy is the validator's (semantic)"),
    ("tolerance", "HPA tolerance is an untyped quantity in the CRD; the validator refuses it (cannot map)"),
    ("set twice", "defaults are applied first: CEL cannot tell an explicit advanced field from its default"),
    ("periodSeconds differ", "not a CEL rule yet: HPA policies are an unbounded list (needs a CRD-only maxItems)"),
    ("scale-up rate limits", "not a CEL rule yet: the validator's refusal of HPA scaleUp policies (semantic mapping)"),
    ("over the limit", "the per-model replica limit is the autoscaler's setting ($PULSESCALE_MAX_REPLICAS)"),
    ("-replicas", "paused-replicas is an annotation (see above)"),
    ("].metadata.", "the CRD keeps unknown trigger metadata keys (KEDA's is a string map) for the operator to refuse"),
    ("scalingModifiers", "declared in the CRD (KEDA's shape) so it reaches the operator, which refuses it with why"),
    ("another source", "one source per ScaledObject compares every trigger's parameters: the validator's (CEL cost)"),
    (
        "one ScaledObject per model",
        "two objects: the API server validates one at a time (the operator refuses the second as a duplicate target)",
    ),
]


# --- the API server, evaluated ------------------------------------------------------------------------------------


def _schema() -> dict[str, Any]:
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def _prune_and_default(node: dict[str, Any], value: Any) -> Any:
    """What the API server does before validation: drop nulls of non-nullable fields, then apply defaults."""
    if isinstance(value, dict) and node.get("type") == "object":
        out = {}
        for key, sub in value.items():
            if sub is None and not node.get("properties", {}).get(key, {}).get("nullable"):
                continue
            prop = node.get("properties", {}).get(key)
            out[key] = _prune_and_default(prop, sub) if prop else sub
        for key, prop in node.get("properties", {}).items():
            if key not in out and "default" in prop:
                out[key] = _prune_and_default(prop, copy.deepcopy(prop["default"]))
        return out
    if isinstance(value, list) and node.get("type") == "array":
        return [_prune_and_default(node["items"], v) for v in value]
    return value


def _as_jsonschema(node: dict[str, Any]) -> dict[str, Any]:
    """The structural OpenAPI schema as a draft-4 JSON Schema (boolean exclusiveMinimum), unknown fields refused."""
    if node.get("x-kubernetes-preserve-unknown-fields") and "type" not in node:
        return {}
    out = {k: v for k, v in node.items() if not k.startswith("x-kubernetes-") and k not in ("default", "nullable")}
    if node.get("type") == "object":
        out["properties"] = {k: _as_jsonschema(v) for k, v in node.get("properties", {}).items()}
        if node.get("properties") and not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if node.get("type") == "array":
        out["items"] = _as_jsonschema(node["items"])
    return out


def _rules(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, str]]]:
    found = [(path, rule) for rule in node.get("x-kubernetes-validations", [])]
    for key, prop in node.get("properties", {}).items():
        found += _rules(prop, f"{path}.{key}" if path else key)
    if "items" in node and node["items"].get("x-kubernetes-validations"):
        raise AssertionError("rules on list items: extend _rules to evaluate them per item")
    return found


_CEL = celpy.Environment()


def api_server_admits(doc: dict[str, Any]) -> str | None:
    """None when the CRD admits the object, else the API server's reason (schema path or the CEL rule's message)."""
    schema = _schema()
    obj = _prune_and_default(schema, doc)
    try:
        jsonschema.Draft4Validator(_as_jsonschema(schema)).validate(obj)
    except jsonschema.ValidationError as err:
        return f"{'.'.join(map(str, err.absolute_path))}: {err.message}"
    for path, rule in _rules(schema):
        target: Any = obj
        for part in path.split(".") if path else []:
            target = target.get(part) if isinstance(target, dict) else None
        if target is None:
            continue
        program = _CEL.program(_CEL.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(target)})
        if result is not True and result != celpy.celtypes.BoolType(True):
            return rule["message"]
    return None


def validator_admits(doc: dict[str, Any]) -> str | None:
    try:
        from_manifest(doc)
    except ScaledObjectError as err:
        return str(err)
    return None


# --- generated, valid, structural -----------------------------------------------------------------------------------


def test_the_committed_crd_is_the_generated_one() -> None:
    assert CRD_FILE.read_text() == crd.render(), (
        f"{CRD_FILE.relative_to(ROOT)} is out of date: regenerate with "
        "`pulsescale crd > deploy/crd/scaledobjects.pulsescale.io.yaml`"
    )


def test_the_committed_docs_are_the_generated_ones() -> None:
    assert DOCS_FILE.read_text() == crd.docs_markdown(), (
        "docs/scaledobject.md is out of date: regenerate with `pulsescale crd --docs > docs/scaledobject.md`"
    )


def test_pulsescale_crd_prints_the_crd_and_the_schema() -> None:
    run = [sys.executable, "-c", "import sys; from pulsescale.cli import main; sys.exit(main(sys.argv[1:]))", "crd"]
    out = subprocess.run(run, capture_output=True, text=True, check=True, timeout=60).stdout
    assert out == crd.render()
    schema = subprocess.run([*run, "--schema"], capture_output=True, text=True, check=True, timeout=60).stdout
    assert '"ScaledObjectSpec"' in schema and '"targetQueueDepth"' in schema


def test_the_crd_validates_against_the_kubernetes_schema() -> None:
    kubernetes_validate.validate(yaml.safe_load(CRD_FILE.read_text()), "1.33", strict=True)


def _walk(node: dict[str, Any], path: str) -> list[str]:
    """Violations of apiextensions' structural-schema rules under `node`."""
    bad = []
    untyped_ok = node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-int-or-string")
    if "type" not in node and not untyped_ok:
        bad.append(f"{path}: no type")
    for key in ("$ref", "anyOf", "oneOf", "allOf", "not", "definitions", "$defs", "title"):
        if key in node:
            bad.append(f"{path}: {key}")
    if "default" in node and node["default"] is None:
        bad.append(f"{path}: default null")
    if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node["exclusiveMinimum"], bool):
        bad.append(f"{path}: exclusiveMinimum must be a boolean in OpenAPI v3.0")
    for key, sub in node.get("properties", {}).items():
        bad += _walk(sub, f"{path}.{key}")
    if node.get("type") == "array":
        bad += _walk(node.get("items", {}), f"{path}[]") if "items" in node else [f"{path}: array without items"]
    return bad


def test_the_schema_is_structural() -> None:
    assert _walk(_schema(), "") == []
    # defaults are valid against their own schema (the API server refuses the CRD otherwise)
    spec = _schema()["properties"]["spec"]
    assert api_server_admits(_minimal()) is None
    assert spec["properties"]["maxReplicaCount"]["default"] == 100


def test_the_status_schema_is_the_operators_struct() -> None:
    status = _schema()["properties"]["status"]["properties"]
    for field in (
        "conditions",
        "currentReplicas",
        "desiredReplicas",
        "readyReplicas",
        "warmSlots",
        "coldRequested",
        "lastActiveTime",
        "lastScaleTime",
        "lastDecisions",
        "notes",
        "originalReplicaCount",
        "observedGeneration",
        "scaleTargetKind",
        "scaleTargetName",
    ):
        assert field in status, field
    assert status["lastDecisions"]["maxItems"] == crd.MAX_LAST_DECISIONS
    assert status["conditions"]["items"]["properties"]["type"]["enum"] == ["Active", "Fallback", "Paused", "Ready"]
    built = crd.ScaledObjectStatus(
        current_replicas=2,
        conditions=[crd.Condition(type="Ready", status="True", reason="ScalerReady")],
        last_decisions=[crd.LastDecision(time="2026-12-03T07:51:44Z", desired=2, reason="demand 7.5 / 4")],
    )
    body = {**_minimal(), "status": __import__("msgspec").to_builtins(built)}
    assert api_server_admits(body) is None
    assert body["status"]["currentReplicas"] == 2


def test_the_status_schema_admits_the_cold_path_episode_the_operator_writes() -> None:
    """kube/coldpath.py records its episode in ``status.coldPath`` so a new leader does not patch the same request
    twice: a structural schema without the field would have the API server prune it. Built as coldpath builds it,
    merged as its merge patch is, and cleared with its null."""
    from kube.coldpath import COLD_PATH_STATUS, Episode

    written = {COLD_PATH_STATUS: Episode(requested=3, from_replicas=1, to_replicas=4).to_status(1_800_000_000.0)}
    body = {**_minimal(), "status": {"currentReplicas": 1, **written}}
    assert api_server_admits(body) is None
    stored = _prune_and_default(_schema(), body)
    assert stored["status"][COLD_PATH_STATUS] == written[COLD_PATH_STATUS]  # kept, not pruned
    episode = Episode.from_status(stored["status"])
    assert episode == Episode(3, 1, 4)
    schema = _schema()["properties"]["status"]["properties"][COLD_PATH_STATUS]
    assert set(schema["properties"]) == set(written[COLD_PATH_STATUS])
    assert schema["properties"]["time"]["format"] == "date-time"
    # the end of the episode: a merge patch {"status": {"coldPath": null}} removes the key (RFC 7386)
    cleared = {**stored, "status": {k: v for k, v in stored["status"].items() if k != COLD_PATH_STATUS}}
    assert api_server_admits(cleared) is None
    # a malformed episode is refused by the API server (a negative count)
    bad = copy.deepcopy(body)
    bad["status"][COLD_PATH_STATUS]["toReplicas"] = -1
    assert api_server_admits(bad) is not None


def test_printer_columns_are_keda_s_and_the_short_name_is_not() -> None:
    version = crd.crd()["spec"]["versions"][0]
    names = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert names == ["Kind", "Target", "Min", "Max", "Ready", "Active", "Fallback", "Paused", "Age"]
    assert "so" not in crd.crd()["spec"]["names"]["shortNames"]
    assert version["subresources"] == {"status": {}}


# --- both admit, both refuse ---------------------------------------------------------------------------------------


def _minimal(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pulsescale.io/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "qwen-chat", "namespace": "inference"},
        "spec": {
            "scaleTargetRef": {"name": "qwen-chat"},
            "triggers": [{"type": "gateway-queue", "metadata": {"model": "qwen"}}],
            **spec,
        },
    }


TRIGGER = {"type": "gateway-queue", "metadata": {"model": "qwen"}}
PROMETHEUS = {
    "model": "qwen",
    "source": "prometheus",
    "serverAddress": "http://prometheus.monitoring:9090",
    "query": 'sum(vllm:num_requests_waiting{model_name="qwen"})',
}


def _without(meta: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k != key}


REFUSED_BY_BOTH: dict[str, tuple[dict[str, Any], str]] = {
    "min over max": (_minimal(minReplicaCount=5, maxReplicaCount=2), "minReplicaCount"),
    "idle not under min": (_minimal(minReplicaCount=2, idleReplicaCount=2), "idleReplicaCount"),
    # KEDA's webhook: a minReplicaCount of 0 counts 1, an unset one 0.
    "idle over a min of zero": (_minimal(minReplicaCount=0, idleReplicaCount=3), "MinReplicaCount=1"),
    "idle without min": (_minimal(idleReplicaCount=0), "MinReplicaCount=0"),
    "an Argo Rollout target": (
        _minimal(scaleTargetRef={"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "name": "qwen"}),
        "scaleTargetRef.kind",
    ),
    "an old Deployment API": (
        _minimal(scaleTargetRef={"apiVersion": "extensions/v1beta1", "kind": "Deployment", "name": "qwen"}),
        "scaleTargetRef.apiVersion",
    ),
    "no triggers": (_minimal(triggers=[]), "trigger"),
    "duplicate trigger names": (
        _minimal(triggers=[{**TRIGGER, "name": "a"}, {**TRIGGER, "name": "a"}]),
        "unique",
    ),
    "two models": (
        _minimal(triggers=[TRIGGER, {"type": "gateway-queue", "metadata": {"model": "llama"}}]),
        "same model",
    ),
    "bad name": ({**_minimal(), "metadata": {"name": "qwen.chat", "namespace": "x"}}, "name"),
    "zero window": (_minimal(advanced={"stableWindowSeconds": 0}), "stableWindowSeconds"),
    "unknown field": (_minimal(maxReplica=4), "maxReplica"),
    "other trigger type": (_minimal(triggers=[{"type": "prometheus", "metadata": {"model": "qwen"}}]), "type"),
    "metricType Value": (_minimal(triggers=[{**TRIGGER, "metricType": "Value"}]), "metricType"),
    # Revision 14: the CRD's enum and CEL rules say what the validator says of a source block.
    "unknown source": (_minimal(triggers=[{**TRIGGER, "metadata": {"model": "qwen", "source": "kafka"}}]), "source"),
    "prometheus without query": (
        _minimal(triggers=[{**TRIGGER, "metadata": _without(PROMETHEUS, "query")}]),
        "metadata.query: required with source prometheus",
    ),
    "prometheus without serverAddress": (
        _minimal(triggers=[{**TRIGGER, "metadata": _without(PROMETHEUS, "serverAddress")}]),
        "metadata.serverAddress: required with source prometheus",
    ),
    "serverAddress without its source": (
        _minimal(triggers=[{**TRIGGER, "metadata": _without(PROMETHEUS, "source")}]),
        "metadata.serverAddress: belongs to source prometheus, not gateway",
    ),
    "query with vllm-metrics": (
        _minimal(triggers=[{**TRIGGER, "metadata": {"model": "qwen", "source": "vllm-metrics", "query": "up"}}]),
        "metadata.query: belongs to source prometheus, not vllm-metrics",
    ),
    "metricsURL with prometheus": (
        _minimal(triggers=[{**TRIGGER, "metadata": {**PROMETHEUS, "metricsURL": "http://10.0.0.5:8000"}}]),
        "metadata.metricsURL: belongs to source vllm-metrics, not prometheus",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED_BY_BOTH))
def test_refused_by_the_crd_and_the_validator(case: str) -> None:
    doc, field = REFUSED_BY_BOTH[case]
    by_api, by_validator = api_server_admits(copy.deepcopy(doc)), validator_admits(copy.deepcopy(doc))
    assert by_api is not None, f"{case}: the CRD admits it"
    assert by_validator is not None, f"{case}: the validator admits it"
    assert field in by_validator


def test_keda_string_numbers_and_null_are_admitted_by_both() -> None:
    for meta in (
        {"targetQueueDepth": "4"},
        {"targetQueueDepth": 0.5},
        {"targetQueueDepth": "0.5"},
        {"activationQueueDepth": "0"},
    ):
        doc = _minimal(triggers=[{**TRIGGER, "metadata": {"model": "qwen", **meta}}], idleReplicaCount=None)
        assert api_server_admits(copy.deepcopy(doc)) is None, meta
        assert validator_admits(copy.deepcopy(doc)) is None, meta


def test_each_source_with_its_parameters_is_admitted_by_both() -> None:
    for meta in (
        {"model": "qwen", "source": "gateway"},
        PROMETHEUS,
        {"model": "qwen", "source": "vllm-metrics"},
        {"model": "qwen", "source": "vllm-metrics", "metricsURL": "http://10.0.0.5:8000,http://10.0.0.6:8000/m"},
    ):
        doc = _minimal(triggers=[{**TRIGGER, "metadata": {**meta, "targetQueueDepth": "4"}}])
        assert api_server_admits(copy.deepcopy(doc)) is None, meta
        assert validator_admits(copy.deepcopy(doc)) is None, meta


def test_a_url_the_validator_refuses_is_the_validators_alone() -> None:
    """The URLs' form is `protocol.http_url_problem`'s (VALIDATOR_ONLY): the CRD stores such an object and the
    operator reports it, naming the key."""
    bad = [
        ({**PROMETHEUS, "serverAddress": "prometheus:9090"}, "metadata.serverAddress: 'prometheus:9090': give an"),
        ({**PROMETHEUS, "serverAddress": "http://p:9090/?x=1"}, "no ?query in it"),
        ({**PROMETHEUS, "query": " "}, "metadata.query: is blank"),
        ({"model": "qwen", "source": "vllm-metrics", "metricsURL": "http://a:1,"}, "has an empty entry"),
    ]
    for meta, words in bad:
        doc = _minimal(triggers=[{**TRIGGER, "metadata": meta}])
        assert api_server_admits(copy.deepcopy(doc)) is None, meta
        message = validator_admits(copy.deepcopy(doc))
        assert message is not None and words in message, message


def test_idle_zero_with_min_zero_is_admitted_by_both_as_by_kedas_webhook() -> None:
    doc = _minimal(minReplicaCount=0, idleReplicaCount=0)
    assert api_server_admits(copy.deepcopy(doc)) is None
    assert validator_admits(copy.deepcopy(doc)) is None


def test_unknown_trigger_metadata_and_scaling_modifiers_are_kept_by_the_crd_for_the_validator() -> None:
    """A non-strict client's typo in trigger metadata, or KEDA's scalingModifiers, survives the API server's pruning
    (tests/k8s_api_double.py `prune`, as the API server does it) and is then refused by the validator."""
    from tests.k8s_api_double import prune

    typo = _minimal(triggers=[{**TRIGGER, "metadata": {"model": "qwen", "targetQueueDepht": "4"}}])
    modifiers = _minimal(advanced={"scalingModifiers": {"formula": "a + b", "target": "2"}})
    for doc, field in ((typo, "spec.triggers[0].metadata.targetQueueDepht"), (modifiers, "scalingModifiers")):
        kept = {**doc, "spec": prune(copy.deepcopy(doc), _schema())["spec"]}  # metadata is the API server's own
        assert kept == doc
        assert api_server_admits(copy.deepcopy(doc)) is None
        message = validator_admits(kept)
        assert message is not None and field in message, message


def test_the_same_model_with_idle_zero_and_min_one_is_admitted() -> None:
    doc = _minimal(minReplicaCount=1, idleReplicaCount=0, triggers=[{**TRIGGER, "name": "a"}, {**TRIGGER, "name": "b"}])
    assert api_server_admits(doc) is None
    assert validator_admits(doc) is None


EXAMPLES = sorted((ROOT / "deploy").rglob("*.yaml"))


def _scaledobjects(path: Path) -> list[dict[str, Any]]:
    return [
        d
        for d in yaml.safe_load_all(path.read_text())
        if d and d.get("kind") == "ScaledObject" and str(d.get("apiVersion", "")).startswith("pulsescale.io/")
    ]


def test_every_example_scaledobject_is_admitted_by_the_crd() -> None:
    found = [(p, d) for p in EXAMPLES for d in _scaledobjects(p)]
    assert found, "no pulsescale ScaledObject under deploy/"
    for path, doc in found:
        assert api_server_admits(doc) is None, path


KEDA = sorted((CORPUS / "keda").glob("*.yaml"))
REFUSE = sorted((CORPUS / "refuse").glob("*.yaml"))


@pytest.mark.parametrize("path", KEDA, ids=[p.name for p in KEDA])
def test_the_keda_corpus_is_admitted_by_both(path: Path) -> None:
    text = path.read_text()
    assert load_documents(text, path.name)
    for doc in yaml.safe_load_all(text):
        if doc:
            assert api_server_admits(doc) is None, path.name


def _expect(text: str) -> str:
    match = re.match(r"#\s*expect:\s*(.+)", text)
    assert match, "a refuse/ manifest starts with '# expect: <message substring>'"
    return match.group(1).strip()


@pytest.mark.parametrize("path", REFUSE, ids=[p.name for p in REFUSE])
def test_the_refuse_corpus_is_refused_by_both(path: Path) -> None:
    text = path.read_text()
    expect = _expect(text)
    with pytest.raises(ScaledObjectError) as err:
        load_documents(text, path.name)
    assert expect in str(err.value)
    only = [why for key, why in VALIDATOR_ONLY if key.lower() in (expect + path.name).lower()]
    if only:
        return  # documented: only the validator can refuse this one (see VALIDATOR_ONLY)
    try:
        docs = [d for d in yaml.safe_load_all(text) if d]
    except yaml.YAMLError:
        pytest.fail(f"{path.name}: unreadable YAML is not in VALIDATOR_ONLY")
    assert any(api_server_admits(d) is not None for d in docs), f"{path.name}: the CRD admits it ({expect})"


# --- the reference page says what the validator does (review findings, issue 11) ---------------------------------


def _row(docs: str, path: str) -> str:
    [row] = [line for line in docs.splitlines() if line.startswith(f"| `{path}` |")]
    return row


HPA = "spec.advanced.horizontalPodAutoscalerConfig.behavior"


def test_the_docs_rows_of_scale_up_and_tolerance_say_they_are_refused() -> None:
    docs = crd.docs_markdown()
    for field in ("stabilizationWindowSeconds", "policies", "selectPolicy"):
        assert "becomes" not in _row(docs, f"{HPA}.scaleUp.{field}"), field
    assert "refused" in _row(docs, f"{HPA}.scaleUp.stabilizationWindowSeconds").lower()
    assert "HPA's default" in _row(docs, f"{HPA}.scaleUp.policies")
    assert "pauses scale-out" in _row(docs, f"{HPA}.scaleUp.selectPolicy")
    for rules in ("scaleUp", "scaleDown"):
        assert "**Refused:**" in _row(docs, f"{HPA}.{rules}.tolerance")
    assert "Becomes `advanced.scaleDownStabilizationSeconds`" in _row(
        docs, f"{HPA}.scaleDown.stabilizationWindowSeconds"
    )
    assert "(>= 0)" in _row(docs, "spec.fallback.failureThreshold")
    assert "no effect" in _row(docs, "spec.scaleTargetRef.envSourceContainerName").lower()
    assert f"at most {crd.MAX_TRIGGERS} (the CRD and the validator" in docs


REFUSAL_CASES: dict[str, dict[str, Any]] = {
    # Each field the docs list under "Refused, with the reason", and a manifest the validator refuses there.
    "spec.advanced.scalingModifiers": _minimal(advanced={"scalingModifiers": {"formula": "a + b"}}),
    "spec.triggers[].metricType": _minimal(triggers=[{**TRIGGER, "metricType": "Utilization"}]),
    "spec.triggers[].type": _minimal(triggers=[{"type": "kafka", "metadata": {"model": "qwen"}}]),
    "apiVersion": {**_minimal(), "apiVersion": "keda.sh/v1alpha1"},
    f"{HPA}.scaleUp.policies": _minimal(
        advanced={
            "horizontalPodAutoscalerConfig": {
                "behavior": {"scaleUp": {"policies": [{"type": "Pods", "value": 4, "periodSeconds": 15}]}}
            }
        }
    ),
    f"{HPA}.scaleUp.stabilizationWindowSeconds": _minimal(
        advanced={"horizontalPodAutoscalerConfig": {"behavior": {"scaleUp": {"stabilizationWindowSeconds": 30}}}}
    ),
    f"{HPA}.*.tolerance": _minimal(
        advanced={"horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {"tolerance": "0.1"}}}}
    ),
    f"{HPA}.scaleDown.policies": _minimal(
        advanced={
            "horizontalPodAutoscalerConfig": {
                "behavior": {
                    "scaleDown": {
                        "policies": [
                            {"type": "Pods", "value": 1, "periodSeconds": 15},
                            {"type": "Percent", "value": 10, "periodSeconds": 60},
                        ]
                    }
                }
            }
        }
    ),
    "spec.triggers": _minimal(triggers=[TRIGGER] * (crd.MAX_TRIGGERS + 1)),
    "spec.triggers[].metadata.model": {},  # two objects of one model: tested in test_scaledobject (one apply)
    "spec.triggers[].metadata": _minimal(triggers=[{**TRIGGER, "metadata": {"model": "qwen", "queueLength": "4"}}]),
    "spec.scaleTargetRef.kind": _minimal(
        scaleTargetRef={"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "name": "qwen"}
    ),
    "spec.idleReplicaCount": _minimal(minReplicaCount=0, idleReplicaCount=3),
    "spec.triggers[].metadata.threshold": _minimal(
        triggers=[{**TRIGGER, "metadata": {**PROMETHEUS, "threshold": "4"}}]
    ),
    "spec.triggers[].metadata.source": _minimal(triggers=[{**TRIGGER, "metadata": {"model": "qwen", "source": "s3"}}]),
    "spec.triggers[].metadata.serverAddress": _minimal(
        triggers=[{**TRIGGER, "metadata": {**PROMETHEUS, "serverAddress": "http://u:p@prometheus:9090"}}]
    ),
    "spec.triggers[].metadata.metricsURL": _minimal(
        triggers=[{**TRIGGER, "metadata": {"model": "qwen", "source": "vllm-metrics", "metricsURL": "ftp://a"}}]
    ),
}


@pytest.mark.parametrize("field", sorted(REFUSAL_CASES))
def test_every_refusal_the_docs_list_is_the_validators(field: str) -> None:
    assert set(REFUSAL_CASES) == set(crd.REFUSED), "a refusal in the docs without a case here, or the reverse"
    assert f"- `{field}`: {crd.REFUSED[field]}" in crd.docs_markdown()
    if not REFUSAL_CASES[field]:
        return
    message = validator_admits(copy.deepcopy(REFUSAL_CASES[field]))
    assert message is not None, f"{field}: the validator admits it"
    where = field.replace("[]", "[0]").replace("*", "scaleDown")
    assert where in message, message
