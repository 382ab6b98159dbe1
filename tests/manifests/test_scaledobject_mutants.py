"""The ScaledObject reader's behaviours that `.ci/mutation scaledobject` found unpinned (issue 24).

Each test feeds a fixed manifest (or record, or file) in and asserts the exact record or refusal out; the mutant it
was written against is named in its docstring. tests/manifests/test_scaledobject.py holds the rest of the reader's
tests; these live apart so the two can be edited side by side.
"""

from __future__ import annotations

import io
from pathlib import Path

import msgspec
import pytest
import yaml

from manifests import keda, scaledobject
from manifests.scaledobject import ScaledObjectError
from tests.manifests.test_scaledobject import GOOD  # the one good manifest the reader's tests vary
from warmpool import protocol
from warmpool.protocol import ScalerRecord


def _spec(**over: object) -> dict[str, object]:
    doc: dict[str, object] = yaml.safe_load(GOOD)
    spec = doc["spec"]
    assert isinstance(spec, dict)
    spec.update(over)
    return doc


def _refusal(doc: object, **kwargs: int) -> str:
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.from_manifest(doc, **kwargs)  # type: ignore[arg-type]
    return str(exc.value)


# --- replica limits -------------------------------------------------------------------------------------------------


def test_an_idle_count_is_refused_by_kedas_rule_before_any_limit() -> None:
    """KEDA's webhook binds idle below the minimum (a minimum of 0 counting 1), and the minimum is within the
    per-model limit, so an idle count is never over the limit on its own: ``idleReplicaCount: 1001`` with
    ``minReplicaCount: 0`` is refused in KEDA's words (it used to pass and reach the limit check)."""
    assert _refusal(_spec(minReplicaCount=0, idleReplicaCount=1001)) == (
        "spec.idleReplicaCount: IdleReplicaCount=1001 must be less than MinReplicaCount=1, as KEDA's admission webhook "
        "says: KEDA's webhook reads minReplicaCount 0 as the HPA's least, 1: with 0 only idleReplicaCount 0 is admitted"
    )
    assert _refusal(_spec(minReplicaCount=9, maxReplicaCount=9, idleReplicaCount=8), max_replicas=8).startswith(
        "spec.maxReplicaCount: 9 is over the limit of 8 replicas per model"
    )
    rec = scaledobject.from_manifest(_spec(minReplicaCount=8, maxReplicaCount=8, idleReplicaCount=7), max_replicas=8)
    assert (rec.spec.min_replica_count, rec.spec.idle_replica_count, rec.spec.max_replica_count) == (8, 7, 8)


def test_capped_keeps_the_idle_count_of_a_model_whose_minimum_is_zero() -> None:
    """`capped` lowers ``idleReplicaCount`` below a cut minimum only when that minimum is above 0 (the spec's own
    rule); with ``minReplicaCount: 0`` (idle 0, the one KEDA admits there) it is kept, never made negative (mutant
    ``lo >= 0``)."""
    rec = scaledobject.from_manifest(_spec(minReplicaCount=0, maxReplicaCount=40, idleReplicaCount=0))
    cut, what = scaledobject.capped(rec, 10)
    spec = cut.spec
    assert (spec.min_replica_count, spec.idle_replica_count, spec.max_replica_count) == (0, 0, 10)
    assert what == (
        "replicas 0..40 over the limit of 10 per model; acting on 0..10 (raise the limit with --max-replicas or "
        "$PULSESCALE_MAX_REPLICAS)"
    )
    # What the autoscaler acts on still decodes as a spec (idle >= 0).
    assert protocol.decode(protocol.encode(cut), ScalerRecord) == cut


def test_the_idle_count_refusal_says_what_to_change_for_each_minimum() -> None:
    """KEDA's idle rule names the fix that fits the minimum written: an unset ``minReplicaCount`` (read as 0) is to
    be set above the idle count; a minimum above 0 is to be raised over it, or the idle count removed (mutants of
    `check_replica_bounds`' two texts and of its ``.get`` default). A ``true`` idle count is a wrong type, left to
    msgspec to name, never run through KEDA's arithmetic as 1 (mutant ``and`` for the first ``or``)."""
    unset = _spec(idleReplicaCount=3)
    spec = unset["spec"]
    assert isinstance(spec, dict)
    del spec["minReplicaCount"]
    assert _refusal(unset) == (
        "spec.idleReplicaCount: IdleReplicaCount=3 must be less than MinReplicaCount=0, as KEDA's admission webhook "
        "says: minReplicaCount is unset, which KEDA's webhook reads as 0: set minReplicaCount above it"
    )
    assert _refusal(_spec(minReplicaCount=2, idleReplicaCount=3)) == (
        "spec.idleReplicaCount: IdleReplicaCount=3 must be less than MinReplicaCount=2, as KEDA's admission webhook "
        "says: set idleReplicaCount below minReplicaCount, or remove it"
    )
    assert _refusal(_spec(idleReplicaCount=True)) == "spec.idleReplicaCount: Expected `int | null`, got `bool`"


# --- scale target ---------------------------------------------------------------------------------------------------

_NOT_A_TARGET = (
    "is not a target pulsescale scales: the operator makes standby pods from the pod template and writes the scale "
    "subresource of an apps/v1 Deployment or apps/v1 StatefulSet only (KEDA takes anything with a /scale "
    "subresource, such as an Argo Rollout: keep that workload on KEDA, or point scaleTargetRef at a Deployment or "
    "StatefulSet)"
)


def test_a_scale_target_is_checked_with_keda_defaults_for_what_is_unset() -> None:
    """``scaleTargetRef`` without ``kind`` is a Deployment, without ``apiVersion`` is ``apps/v1`` (the wire type's
    defaults), so a lone ``apiVersion: argoproj.io/v1alpha1`` or a lone ``kind: Rollout`` is refused, never
    published with a target nothing scales (mutants of the two ``.get`` defaults). The refusal names the field
    that is wrong (``apiVersion`` when the kind is one we scale) and the targets that are taken (mutants of
    ``field``, ``allowed`` and the text). A kind that is not a string is msgspec's to name: a list there is not
    looked up in a set (mutant ``and`` for the first ``or``: TypeError, unhashable)."""
    argo = _spec(scaleTargetRef={"name": "qwen", "apiVersion": "argoproj.io/v1alpha1"})
    assert _refusal(argo) == f"spec.scaleTargetRef.apiVersion: argoproj.io/v1alpha1 Deployment {_NOT_A_TARGET}"
    rollout = _spec(scaleTargetRef={"name": "qwen", "kind": "Rollout"})
    assert _refusal(rollout) == f"spec.scaleTargetRef.kind: apps/v1 Rollout {_NOT_A_TARGET}"
    listed = _spec(scaleTargetRef={"name": "qwen", "kind": ["Deployment"]})
    assert _refusal(listed) == "spec.scaleTargetRef.kind: Expected `str`, got `array`"


# --- triggers -------------------------------------------------------------------------------------------------------


def test_a_trigger_that_is_not_a_mapping_does_not_end_the_checks_of_the_next_ones() -> None:
    """A non-mapping trigger is left for msgspec to report, but the triggers after it are still read as KEDA's:
    a ``prometheus`` trigger further down gets its own refusal naming its index (mutant ``break``)."""
    doc = _spec(triggers=["gateway-queue", {"type": "prometheus", "metadata": {"model": "qwen"}}])
    assert _refusal(doc).startswith(
        "spec.triggers[1].type: 'prometheus' is not a pulsescale trigger: pulsescale has one trigger type, "
        "'gateway-queue'"
    )
    doc = _spec(triggers=[7, {"type": "gateway-queue", "metadata": {"model": "qwen", "targetQueueDepth": "lots"}}])
    assert _refusal(doc).startswith('spec.triggers[1].metadata.targetQueueDepth: "lots" is not a number')


def test_the_metadata_numbers_are_the_wire_number_fields_optional_or_not() -> None:
    """Which metadata keys are read as numbers from KEDA's strings: a wire number, also when it is optional
    (``float | None``), never a string (mutants of `_is_number_type`'s union branch)."""
    info = msgspec.inspect.type_info
    assert frozenset({"targetQueueDepth", "activationQueueDepth"}) == keda._METADATA_NUMBERS
    assert keda._is_number_type(info(float)) and keda._is_number_type(info(int))
    assert keda._is_number_type(info(float | None)) and keda._is_number_type(info(int | str))
    assert not keda._is_number_type(info(str | None)) and not keda._is_number_type(info(str))


def test_a_trigger_read_by_the_bridge_gets_the_bridges_notes() -> None:
    """A trigger whose ``metadata.source`` the bridge reads (``vllm-metrics``, ``prometheus``) is polled by the
    bridge at its own period: its useCachedMetrics, authenticationRef and pollingInterval notes say so, where a
    gateway trigger's say the samples are pushed (mutants of ``source``, ``pulled`` and the three choices)."""
    extras = {"useCachedMetrics": True, "authenticationRef": {"name": "creds"}}
    bridged = {"type": "gateway-queue", "metadata": {"model": "qwen", "source": "vllm-metrics"}, **extras}
    rec = scaledobject.from_manifest(_spec(triggers=[bridged], pollingInterval=30))
    assert rec.notes == [keda._NOTE_CACHED_PULLED, keda._NOTE_AUTH_PULLED, keda._NOTE_POLLING_PULLED]
    assert all("pulsescale bridge reads the trigger's source" in note for note in rec.notes)
    pushed = {"type": "gateway-queue", "metadata": {"model": "qwen"}, **extras}
    rec = scaledobject.from_manifest(_spec(triggers=[pushed], pollingInterval=30))
    assert rec.notes == [keda._NOTE_CACHED, keda._NOTE_AUTH, keda._NOTE_POLLING]


# --- labels ---------------------------------------------------------------------------------------------------------


def _labelled(labels: object) -> dict[str, object]:
    doc: dict[str, object] = yaml.safe_load(GOOD)
    doc["metadata"] = {"name": "qwen", "labels": labels}
    return doc


def test_labels_at_kubernetes_length_bounds_are_kept_and_one_over_is_refused() -> None:
    """Kubernetes' label bounds, each at the edge: a key's name of 63 characters after a ``prefix/`` (the name is
    what follows the last ``/``), a prefix of 253, a value of 63 are kept; a prefix of 254 is refused (mutants of
    the ``rpartition`` separator and of each ``>``). A ``labels`` that is not a mapping and a value that is not a
    string are refused naming the field and the rule (mutants of the field name and of the text)."""
    prefix = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
    assert len(prefix) == 253
    kept = {f"example.com/{'n' * 63}": "a", f"{prefix}/team": "b", "team": "v" * 63}
    assert scaledobject.from_manifest(_labelled(kept)).labels == kept
    assert _refusal(_labelled({f"{prefix}d/team": "b"})) == (
        f"metadata.labels['{prefix}d/team']: not a Kubernetes label key ([prefix/]name, name at most 63 characters)"
    )
    assert _refusal(_labelled(["team=a"])) == "metadata.labels: must be a mapping, got list"
    assert _refusal(_labelled({"team": ["a"]})) == (
        "metadata.labels['team']: ['a'] is not a label value (a string, at most 63 characters)"
    )


# --- YAML -----------------------------------------------------------------------------------------------------------


def test_a_key_twice_after_an_unhashable_key_is_still_refused_as_a_duplicate() -> None:
    """The duplicate-key check skips an unhashable key (SafeLoader's own error is about that one) and goes on with
    the keys after it: the key twice is what is reported, with both lines (mutant ``break``)."""
    with pytest.raises(ScaledObjectError) as exc:
        scaledobject.load_documents("a: 1\n? [k]\n: 1\nb: 1\nb: 2\n", "x.yaml")
    assert str(exc.value) == (
        "x.yaml: line 5, column 1: duplicate key 'b' (first at line 4); YAML would keep only the last one: remove one"
    )


def test_an_alias_to_an_enclosing_mapping_reads_as_safeloader_reads_it() -> None:
    """The strict loader is SafeLoader plus the duplicate-key check: it builds mappings lazily as SafeLoader does,
    so an alias to an enclosing mapping (in metadata the reader ignores) reads, where deep construction refuses it
    as an "unconstructable recursive node" (mutant ``deep=True``)."""
    text = GOOD.replace("  name: qwen\n", "  name: qwen\n  managedFields: &l {self: *l}\n")
    [m] = scaledobject.load_documents(text, "x.yaml")
    assert (m.record.key, m.record.spec.model, m.record.spec.max_replica_count) == ("default.qwen", "qwen", 4)
    loaded = yaml.load(text, Loader=yaml.SafeLoader)  # SafeLoader: the reference
    assert loaded["metadata"]["managedFields"]["self"] is loaded["metadata"]["managedFields"]


# --- files ----------------------------------------------------------------------------------------------------------


def test_load_path_reads_utf8_whatever_the_locale_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest file is UTF-8 (as kubectl reads it), not the locale's encoding: under a locale whose encoding is
    ASCII (a C locale without UTF-8 coercion, say) a non-ASCII trigger name still reads (mutant ``encoding=None``)."""
    path = tmp_path / "qwen.yaml"
    path.write_bytes(
        GOOD.replace("    - type: gateway-queue\n", "    - type: gateway-queue\n      name: wärme\n").encode()
    )
    real = io.text_encoding
    monkeypatch.setattr(io, "text_encoding", lambda encoding, stacklevel=2: real(encoding or "ascii", stacklevel))
    with pytest.raises(UnicodeDecodeError):  # the locale stand-in takes effect where no encoding is given
        path.read_text()
    [m] = scaledobject.load_path(path)
    assert m.record.spec.triggers[0].name == "wärme"
    assert m.where == f"{path} doc 1"


# --- every refusal's whole text ---------------------------------------------------------------------------------------
# The refusals name the fields to write instead (targetQueueDepth, advanced.stableWindowSeconds, scaleUp.policies,
# selectPolicy: Disabled...): a field name changed there is a wrong instruction, so each text is pinned whole.

_T = {"type": "gateway-queue", "metadata": {"model": "qwen"}}
_HPA = "spec.advanced.horizontalPodAutoscalerConfig.behavior"
_AVERAGE = (
    "; pulsescale's rule is AverageValue: desired replicas = demand / targetQueueDepth per replica. Remove "
    "metricType or set AverageValue"
)


def _behavior(up: dict[str, object] | None = None, down: dict[str, object] | None = None) -> dict[str, object]:
    behavior = {k: v for k, v in (("scaleUp", up), ("scaleDown", down)) if v is not None}
    return _spec(advanced={"horizontalPodAutoscalerConfig": {"behavior": behavior}})


def _top(**over: object) -> dict[str, object]:
    doc: dict[str, object] = yaml.safe_load(GOOD)
    doc.update(over)
    return doc


def _policy(kind: str, value: int, period: int) -> dict[str, object]:
    return {"type": kind, "value": value, "periodSeconds": period}


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        pytest.param(
            _spec(triggers=[_T] * 17),
            "spec.triggers: 17 triggers: at most 16 (as the CRD); every trigger names the same model, so more than "
            "one only names them",
            id="too many triggers",
        ),
        pytest.param(
            _spec(triggers=[{**_T, "type": "prometheus"}]),
            "spec.triggers[0].type: 'prometheus' is not a pulsescale trigger: pulsescale has one trigger type, "
            "'gateway-queue', fed by the queue samples for metadata.model; to scale on a PromQL query write type: "
            "gateway-queue with metadata source: prometheus, serverAddress and query (pulsescale bridge "
            "--scaledobjects asks it), or keep this trigger on KEDA",
            id="trigger type",
        ),
        pytest.param(
            _spec(triggers=[{**_T, "type": "kafka"}]),
            "spec.triggers[0].type: 'kafka' is not a pulsescale trigger: pulsescale has one trigger type, "
            "'gateway-queue', fed by the queue samples for metadata.model; keep kafka triggers on KEDA for other "
            "workloads",
            id="trigger type kafka",
        ),
        pytest.param(
            _spec(triggers=[{**_T, "metricType": "Value"}]),
            "spec.triggers[0].metricType: Value scales on the metric as a whole (replicas x metric / target)"
            + _AVERAGE,
            id="metricType Value",
        ),
        pytest.param(
            _spec(triggers=[{**_T, "metricType": "Utilization"}]),
            "spec.triggers[0].metricType: Utilization is a percentage of the pods' resource requests (cpu/memory "
            "triggers)" + _AVERAGE,
            id="metricType Utilization",
        ),
        pytest.param(
            _spec(triggers=[{**_T, "metricType": "Bogus"}]),
            "spec.triggers[0].metricType: 'Bogus' is not a KEDA metricType either" + _AVERAGE,
            id="metricType other",
        ),
        pytest.param(
            _spec(triggers=[{**_T, "name": "a"}, {**_T, "name": "a"}]),
            "spec.triggers[1].name: 'a' is also the name of spec.triggers[0]; trigger names must be unique within a "
            "ScaledObject",
            id="trigger name twice",
        ),
        pytest.param(
            _spec(fallback={"failureThreshold": -1, "replicas": 1}),
            "spec.fallback.failureThreshold: -1: must be >= 0 (the failures tolerated before the fallback count "
            "applies; 0: fall back on the first, as KEDA)",
            id="failureThreshold",
        ),
        pytest.param(
            _spec(advanced={"scalingModifiers": {"formula": "a"}}),
            "spec.advanced.scalingModifiers: not supported: every trigger of a ScaledObject feeds the same model's "
            "demand (the gateways' queue), so there is no second metric for a formula to combine; remove it and set "
            "targetQueueDepth on the trigger",
            id="scalingModifiers",
        ),
        pytest.param(
            _behavior(down={"tolerance": 0.1}),
            f"{_HPA}.scaleDown.tolerance: HPA's tolerance (a dead band around the target) has no counterpart: "
            "pulsescale's stable window and scale-down stabilization smooth the demand instead; remove it",
            id="tolerance",
        ),
        pytest.param(
            _behavior(up={"policies": [_policy("Percent", 100, 15), _policy("Pods", 4, 15)]}),
            f"{_HPA}.scaleUp.policies: this is the HPA's default scale-up (Percent 100 and Pods 4 per 15 s, Max), "
            "which pulsescale does not apply: it scales out as fast as the demand asks, faster than this default, "
            "so removing it loses nothing. Remove scaleUp (selectPolicy: Disabled alone is honoured)",
            id="HPA default scale-up",
        ),
        pytest.param(
            _behavior(up={"policies": [_policy("Pods", 4, 60)]}),
            f"{_HPA}.scaleUp.policies: scale-up rate limits are not applied: pulsescale scales out as fast as the "
            "demand asks (warm slots activate in seconds; a limit would only queue requests). Remove "
            "scaleUp.policies; selectPolicy: Disabled (no scale-out) is honoured",
            id="scale-up rate limit",
        ),
        pytest.param(
            _behavior(up={"stabilizationWindowSeconds": 30}),
            f"{_HPA}.scaleUp.stabilizationWindowSeconds: scale-up stabilization is not applied: scale-out follows "
            "advanced.stableWindowSeconds (the averaging window) and panics on bursts; remove it or set 0",
            id="scale-up stabilization",
        ),
        pytest.param(
            _behavior(down={"policies": [_policy("Pods", 4, 60), _policy("Percent", 4, 15)]}),
            f"{_HPA}.scaleDown.policies: periodSeconds differ (15, 60): pulsescale has one scale-down period "
            "(advanced.scaleDownPeriodSeconds) for both limits; give every policy the same periodSeconds",
            id="scale-down periods",
        ),
        pytest.param(
            _top(metadata={"name": "Qwen.Chat"}),
            "metadata.name: 'Qwen.Chat' is not a pulsescale name (^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?$: lowercase "
            "letters, digits, '-' and '_', no dots, since <namespace>.<name> is the pulse_scalers key)",
            id="name",
        ),
        pytest.param(
            _top(
                apiVersion="keda.sh/v1alpha1",
                spec={"triggers": [{"type": "prometheus"}, {"type": "kafka"}, {"type": "gateway-queue"}]},
            ),
            "apiVersion: expected pulsescale.io/v1alpha1, got 'keda.sh/v1alpha1' (a KEDA ScaledObject for KEDA's own "
            "triggers (kafka, prometheus): pulsescale reads pulsescale.io/v1alpha1 with trigger type gateway-queue)",
            id="keda apiVersion, keda triggers",
        ),
        pytest.param(
            _spec(scaleTargetRef={"name": "qwen", "zzzzzz": 1}),
            "spec.scaleTargetRef.zzzzzz: unknown field (known: name, kind, apiVersion, envSourceContainerName)",
            id="unknown field, nothing close",
        ),
    ],
)
def test_each_refusal_says_exactly_what_to_write_instead(doc: dict[str, object], error: str) -> None:
    assert _refusal(doc) == error
