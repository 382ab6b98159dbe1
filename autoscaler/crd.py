"""The ScaledObject CRD (``scaledobjects.pulsescale.io``, ``v1alpha1``), generated from the one schema.

The spec's OpenAPI schema is `msgspec.json.schema(protocol.ScaledObjectSpec)` made *structural* (every ``$ref``
inlined, every node typed), so the CRD, ``pulsescale apply``'s validation (autoscaler/scaledobject.py decodes
into the same type) and docs/scaledobject.md cannot drift apart. The status is `ScaledObjectStatus`, the struct
the operator builds and patches, so its schema cannot drift from what the operator writes either. Descriptions
are the field docstrings of those types (read from their source with `ast`), else `FIELD_NOTES` below.

What the conversion decides, and why:

- ``X | None`` fields are emitted as ``X`` without ``nullable``: the API server prunes a ``null`` of a field
  that is not nullable (then applies its default), which is what the wire does with ``None`` (absent == null ==
  the default). A nullable field would keep the ``null`` and every CEL rule over it would have to guard it.
- ``default: null`` is dropped (nothing to default); every other default is the type's, so the stored object
  shows the values the autoscaler uses.
- Trigger metadata numbers (``targetQueueDepth``, ``activationQueueDepth``) are strings in KEDA (``"4"``) and
  numbers in our examples (``4``, ``0.5``). ``x-kubernetes-int-or-string`` refuses the number ``0.5`` and
  ``type: number`` refuses ``"4"``, and a structural schema may not put types under ``anyOf``. What admits both
  is an untyped node with ``x-kubernetes-preserve-unknown-fields: true``; the shared validator (run by
  ``apply`` and by the operator before anything is published) converts the value and refuses a non-number with
  the field's name. The cost: the API server itself does not check those two values (CEL cannot read an
  untyped node), so ``kubectl apply`` of ``targetQueueDepth: "four"`` is stored and then reported by the
  operator in ``status.conditions[Ready]`` and an Event. HPA's ``tolerance`` (a quantity: string or number) is
  emitted the same way.
- ``exclusiveMinimum: X`` (JSON Schema 2020-12) becomes ``minimum: X, exclusiveMinimum: true`` (OpenAPI v3.0,
  what apiextensions.k8s.io/v1 reads); enums get ``type: string``.
- CEL ``x-kubernetes-validations`` repeat the cross-field rules of `ScaledObjectSpec.__post_init__` and the
  validator with the same wording: min <= max, idle < min (when min > 0), unique trigger names, one model, a
  pulsescale name in ``metadata.name``. ``metadata.namespace`` needs no rule: a namespace is a DNS label, always
  a pulsescale name. ``spec.triggers`` gets ``maxItems`` (`MAX_TRIGGERS`, the validator's bound too), because the
  API server refuses a CEL rule whose worst-case cost over an unbounded list is too high.
- ``spec.schedules`` (revision 8): CEL repeats the floor <= ``maxReplicaCount`` and unique names; whether two
  windows overlap needs the zone database (DST), so the validator alone refuses it (the operator reports it).
- `_CRD_BOUNDS` adds bounds the CRD needs beyond the wire's (none today: ``fallback.failureThreshold`` 0 is the
  wire's own minimum since revision 5).
- The HPA ``behavior`` rules are one struct for ``scaleUp`` and ``scaleDown``, mapped differently (scale-down onto
  the policy, scale-up mostly refused): `PATH_NOTES` describes each by its path, in the CRD and the docs, and
  `REFUSED` lists what the validator refuses with the reason (tests/test_crd.py checks each against it).

Pure: no I/O libraries. `main` (``pulsescale crd``) prints; it writes nothing.
"""

from __future__ import annotations

import argparse
import ast
import copy
import functools
import inspect
import json
import re
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Annotated, Any, Final, Literal

import msgspec
import yaml

from autoscaler import scaledobject
from warmpool import protocol
from warmpool.protocol import NAME_PATTERN, Count, ScaledObjectSpec

__all__ = [
    "CEL_RULES",
    "CONDITION_TYPES",
    "CRD_NAME",
    "FIELD_NOTES",
    "GROUP",
    "MAX_LAST_DECISIONS",
    "MAX_TRIGGERS",
    "PATH_NOTES",
    "REFUSED",
    "SHORT_NAMES",
    "VERSION",
    "ColdPathStatus",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "LastDecision",
    "ScaledObjectStatus",
    "crd",
    "docs_markdown",
    "main",
    "render",
    "spec_json_schema",
    "status_schema",
    "spec_schema",
    "structural",
]

MAX_LAST_DECISIONS: Final = 10
"""Decisions kept in ``status.lastDecisions`` (newest last): enough to explain the last minutes, small enough that
the object stays far below etcd's 1.5 MiB."""

ACTIVE_WINDOW_S: Final = 10.0
"""`scaler_active`'s default: demand above the activation threshold this recently is Active (the operator's two
status rounds at 5 s; `pulsescale get so` polls once)."""


def scaler_active(last_active_at: float | None, now: float, window_s: float = ACTIVE_WINDOW_S) -> bool:
    """KEDA's ``Active``: the trigger's demand was above its activation threshold within `window_s` (the
    autoscaler's `StatusRow.last_active_at`), not "it has replicas" (minReplicaCount > 0 is not activity). The one
    rule of the CR's condition (kube/status.py) and `pulsescale get so` (autoscaler/resources.py); no report of
    demand yet is not Active."""
    return last_active_at is not None and now - last_active_at <= window_s


ConditionType = Literal["Ready", "Active", "Fallback", "Paused"]
CONDITION_TYPES: Final[tuple[ConditionType, ...]] = ("Ready", "Active", "Fallback", "Paused")
ConditionStatus = Literal["True", "False", "Unknown"]

# RFC 3339 times (``2026-12-03T07:51:44Z``), as Kubernetes writes every timestamp; kubectl renders them as ages.
Rfc3339 = Annotated[str, msgspec.Meta(extra_json_schema={"format": "date-time"})]


class _Camel(msgspec.Struct, kw_only=True, rename="camel", omit_defaults=True):
    pass


class Condition(_Camel, kw_only=True):
    """One ``status.conditions`` entry, as metav1.Condition (KEDA's ScaledObject conditions have these types)."""

    type: ConditionType
    status: ConditionStatus
    reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    """CamelCase machine word (``ScalerReady``, ``MetricsStale``, ``PausedByAnnotation``)."""
    message: Annotated[str, msgspec.Meta(max_length=32_768)] = ""
    last_transition_time: Rfc3339 | None = None
    """When `status` last changed (not when the condition was last written)."""
    observed_generation: Count | None = None


class LastDecision(_Camel, kw_only=True):
    """One of the autoscaler's recent decisions (protocol.DecisionRow, with an RFC 3339 time)."""

    time: Rfc3339
    desired: Count
    reason: Annotated[str, msgspec.Meta(max_length=4096)]


class ColdPathStatus(_Camel, kw_only=True):
    """The cold path's current episode (kube/coldpath.py `Episode`): recorded before the scale patch so a repeated
    request, or a new leader re-reading the status, does not patch the same shortfall twice."""

    requested: Count
    """Replicas the autoscaler asked for (the warm pool's shortfall) in this episode's last request."""
    from_replicas: Count
    """The target's replica count when the episode began: every request adds to this, not to the current count."""
    to_replicas: Count
    """The count patched to (at most ``maxReplicaCount``)."""
    time: Rfc3339
    """When the episode was last written."""


class ScaledObjectStatus(_Camel, kw_only=True):
    """``status`` of a pulsescale ScaledObject: what the operator patches from the autoscaler's `StatusRow`.

    Field names are KEDA's where KEDA has one (``conditions``, ``originalReplicaCount``, ``lastActiveTime``,
    ``scaleTargetKind``); the rest say what pulsescale adds (warm slots, the cold path, decisions with reasons).
    Every field is optional so a partial patch (merge patch of the status subresource) is a valid status.
    """

    conditions: list[Condition] | None = None
    observed_generation: Count | None = None
    """The ``metadata.generation`` of the spec this status describes."""
    scale_target_kind: Annotated[str, msgspec.Meta(max_length=381)] | None = None
    """``<apiVersion>.<kind>`` of the target as KEDA writes it (``apps/v1.Deployment``)."""
    scale_target_name: Annotated[str, msgspec.Meta(max_length=253)] | None = None
    current_replicas: Count | None = None
    """Replicas serving or starting (ready + activating), as the autoscaler counts them."""
    desired_replicas: Count | None = None
    ready_replicas: Count | None = None
    warm_slots: Count | None = None
    """Claimable warm slots for the model (warm, not drained, their agent's lease fresh)."""
    cold_requested: Count | None = None
    """Replicas last asked of the cold path (the target's scale subresource) because the pool could not give them."""
    last_active_time: Rfc3339 | None = None
    """Last time demand was above the trigger's activation threshold."""
    last_scale_time: Rfc3339 | None = None
    """Last time the desired count changed."""
    last_decisions: Annotated[list[LastDecision], msgspec.Meta(max_length=MAX_LAST_DECISIONS)] | None = None
    notes: Annotated[list[Annotated[str, msgspec.Meta(max_length=1024)]], msgspec.Meta(max_length=64)] | None = None
    """One line per accepted field that has no effect here, and why (the ScalerRecord's notes: a fixed set, at most
    two per trigger and three more)."""
    original_replica_count: Count | None = None
    """The target's replica count before the first scale, for ``advanced.restoreToOriginalReplicaCount``."""
    cold_path: ColdPathStatus | None = None
    """The cold path's current episode; removed (merge patch ``null``) when the autoscaler's shortfall is met."""


# --- the CRD ----------------------------------------------------------------------------------------------------

GROUP: Final = "pulsescale.io"
VERSION: Final = "v1alpha1"
PLURAL: Final = "scaledobjects"
CRD_NAME: Final = f"{PLURAL}.{GROUP}"
SHORT_NAMES: Final = ("pso",)
"""Not KEDA's ``so``: with both CRDs installed (a migration), ``kubectl get so`` would pick one of the two
silently. ``pso`` is free, and ``kubectl get scaledobjects.pulsescale.io`` always names ours."""
MAX_TRIGGERS: Final = scaledobject.MAX_TRIGGERS
"""``spec.triggers`` maxItems, the validator's bound: every trigger names the same model, so more than a few is a
mistake, and the API server refuses a CEL rule (unique names) whose cost over an unbounded list is too high."""
MAX_NAME_LENGTH: Final = 63
"""Trigger names and the like are bounded so the CEL cost estimate stays small."""

# Fields whose JSON number may also be written as a string (KEDA writes every trigger metadata value as one).
_STRING_OR_NUMBER: Final = frozenset(
    {("TriggerMetadata", "targetQueueDepth"), ("TriggerMetadata", "activationQueueDepth")}
)

_NAME_HINT: Final = "a name: lowercase letters, digits, '-' and '_'; no dots"

CEL_RULES: Final[dict[str, list[dict[str, str]]]] = {
    # JSON pointer-ish path of the node (``""`` is the root, ``spec``) -> its rules.
    "": [
        {
            "rule": f"self.metadata.name.matches('{NAME_PATTERN}')",
            "message": f"metadata.name must be a pulsescale name ({_NAME_HINT}, at most 63 characters): it is "
            "half of the pulse_scalers key <namespace>.<name>",
        },
    ],
    "spec": [
        {
            "rule": "!has(self.minReplicaCount) || !has(self.maxReplicaCount) || "
            "self.minReplicaCount <= self.maxReplicaCount",
            "message": "`minReplicaCount` must be <= `maxReplicaCount`",
        },
        {
            "rule": "!has(self.idleReplicaCount) || !has(self.minReplicaCount) || self.minReplicaCount == 0 || "
            "self.idleReplicaCount < self.minReplicaCount",
            "message": "`idleReplicaCount` must be < `minReplicaCount` (as in KEDA)",
        },
        {
            "rule": "self.triggers.size() >= 1",
            "message": "at least one trigger is required (type: gateway-queue)",
        },
        {
            "rule": "self.triggers.all(t, self.triggers.all(u, u.metadata.model == t.metadata.model))",
            "message": "all triggers of one ScaledObject must name the same model",
        },
        {
            "rule": "self.triggers.all(t, !has(t.name) || "
            "self.triggers.exists_one(u, has(u.name) && u.name == t.name))",
            "message": "trigger names must be unique within the ScaledObject",
        },
        {
            "rule": "!has(self.schedules) || !has(self.maxReplicaCount) || "
            "self.schedules.all(s, s.replicas <= self.maxReplicaCount)",
            "message": "a schedule's `replicas` must be <= `maxReplicaCount`",
        },
        {
            "rule": "!has(self.schedules) || self.schedules.all(s, self.schedules.exists_one(u, u.name == s.name))",
            "message": "schedule names must be unique within the ScaledObject",
        },
    ],
}


def _field_docs(module: ModuleType) -> dict[str, dict[str, str]]:
    """Class name -> Python field name -> the string literal right under its annotation (the field docstrings).

    One parse of the module's source (`inspect.getsource` per class re-reads the module each time)."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):  # no source (a frozen build): descriptions then come from FIELD_NOTES alone
        return {}
    out: dict[str, dict[str, str]] = {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        fields = out.setdefault(cls.name, {})
        for node, after in zip(cls.body, [*cls.body[1:], None], strict=True):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                fields[node.target.id] = _plain(after.value.value)
    return out


_REVISION: Final = re.compile(r"^Revision \d+(?:, (as [^:]+))?: ")


def _plain(doc: str) -> str:
    """A docstring as one line of user-facing text: no wire-revision prefix, Markdown code spans."""
    text = " ".join(doc.split()).replace("``", "`")
    text = _REVISION.sub(lambda m: f"{m.group(1)}: " if m.group(1) else "", text)
    return text[:1].upper() + text[1:]


def _structs() -> dict[str, type[msgspec.Struct]]:
    """Every Struct the two schemas name, by the name msgspec gives its ``$defs`` entry."""
    found: dict[str, type[msgspec.Struct]] = {}
    for module in (protocol, sys.modules[__name__]):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, msgspec.Struct):
                found.setdefault(value.__name__, value)
    return found


FIELD_NOTES: Final[dict[str, tuple[str, str]]] = {
    # "<Struct>.<camelName>" -> (meaning where the type has no docstring, the KEDA field it mirrors or "").
    "ScaledObjectSpec.scaleTargetRef": (
        "The workload the replicas belong to (its pod template makes the standby "
        "pods; the cold path patches its scale subresource).",
        "spec.scaleTargetRef",
    ),
    "ScaledObjectSpec.triggers": (
        "Where demand comes from: one `gateway-queue` trigger (more only to name them; all name the same model).",
        "spec.triggers",
    ),
    "ScaledObjectSpec.minReplicaCount": ("Replicas kept serving with no demand.", "spec.minReplicaCount"),
    "ScaledObjectSpec.maxReplicaCount": ("Most replicas the policy asks for.", "spec.maxReplicaCount"),
    "ScaledObjectSpec.idleReplicaCount": (
        "Replicas with no demand after `cooldownPeriod` (must be < `minReplicaCount`); unset: `minReplicaCount`.",
        "spec.idleReplicaCount",
    ),
    "ScaledObjectSpec.cooldownPeriod": ("", "spec.cooldownPeriod"),
    "ScaledObjectSpec.fallback": ("Replicas to hold while the gateways' samples are missing.", "spec.fallback"),
    "ScaledObjectSpec.advanced": (
        "The policy's windows and rates (pulsescale's; HPA behavior maps here).",
        "spec.advanced",
    ),
    "ScaledObjectSpec.warmPool": ("Standby slots kept staged for this model (pulsescale's; no KEDA field).", ""),
    "ScaledObjectSpec.pollingInterval": ("", "spec.pollingInterval (no effect: the trigger is pushed)"),
    "ScaledObjectSpec.initialCooldownPeriod": ("", "spec.initialCooldownPeriod"),
    "ScaleTargetRef.envSourceContainerName": ("", "spec.scaleTargetRef.envSourceContainerName (no effect)"),
    "ScaleTargetRef.name": ("Name of the target workload in the ScaledObject's namespace.", "spec.scaleTargetRef.name"),
    "ScaleTargetRef.kind": ("Kind of the target (anything with a scale subresource).", "spec.scaleTargetRef.kind"),
    "ScaleTargetRef.apiVersion": ("API version of the target.", "spec.scaleTargetRef.apiVersion"),
    "Trigger.type": (
        "Always `gateway-queue`: demand pushed by the gateways (other KEDA scalers are refused).",
        "spec.triggers[].type",
    ),
    "Trigger.metadata": ("The trigger's parameters.", "spec.triggers[].metadata"),
    "Trigger.name": ("", "spec.triggers[].name"),
    "Trigger.metricType": ("", "spec.triggers[].metricType"),
    "Trigger.useCachedMetrics": ("", "spec.triggers[].useCachedMetrics (no effect)"),
    "Trigger.authenticationRef": ("", "spec.triggers[].authenticationRef (no effect)"),
    "TriggerMetadata.model": ("The model name the gateways report demand for.", ""),
    "TriggerMetadata.targetQueueDepth": ("", "the scaler's target value (a string in KEDA; string or number here)"),
    "TriggerMetadata.activationQueueDepth": ("", "the scaler's activation value (string or number)"),
    "AuthenticationRef.name": ("TriggerAuthentication name (not read).", "authenticationRef.name"),
    "AuthenticationRef.kind": (
        "TriggerAuthentication or ClusterTriggerAuthentication (not read).",
        "authenticationRef.kind",
    ),
    "Fallback.failureThreshold": ("", "spec.fallback.failureThreshold"),
    "Fallback.replicas": ("Replicas held while the fallback is in force (`static`).", "spec.fallback.replicas"),
    "Fallback.behavior": ("", "spec.fallback.behavior"),
    "Advanced.stableWindowSeconds": ("Averaging window of the demand in stable mode.", ""),
    "Advanced.panicWindowSeconds": ("Averaging window of the demand in panic mode.", ""),
    "Advanced.panicThreshold": ("", ""),
    "Advanced.scaleDownStabilizationSeconds": (
        "Scale down to the highest recommendation of this window.",
        "behavior.scaleDown.stabilizationWindowSeconds",
    ),
    "Advanced.scaleDownPercent": ("", "behavior.scaleDown.policies[type=Percent].value"),
    "Advanced.scaleDownPeriodSeconds": (
        "Period of the scale-down rate limits.",
        "behavior.scaleDown.policies[].periodSeconds",
    ),
    "Advanced.staleAfterSeconds": ("", ""),
    "Advanced.leadTimeSeconds": ("", ""),
    "Advanced.scaleDownPods": ("", "behavior.scaleDown.policies[type=Pods].value"),
    "Advanced.scaleDownSelectPolicy": ("", "behavior.scaleDown.selectPolicy"),
    "Advanced.restoreToOriginalReplicaCount": ("", "spec.advanced.restoreToOriginalReplicaCount"),
    "Advanced.horizontalPodAutoscalerConfig": (
        "KEDA's HPA settings: `behavior.scaleDown` is mapped onto the "
        "fields above; what cannot map is refused with the reason; no HPA "
        "is created.",
        "spec.advanced.horizontalPodAutoscalerConfig",
    ),
    "HorizontalPodAutoscalerConfig.name": (
        "Name KEDA would give its HPA (no effect: no HPA is created).",
        "horizontalPodAutoscalerConfig.name",
    ),
    "HorizontalPodAutoscalerConfig.behavior": (
        "autoscaling/v2 HPA behavior.",
        "horizontalPodAutoscalerConfig.behavior",
    ),
    "HPABehavior.scaleUp": (
        "Scale-up rules (pulsescale scales out as the pulse demands; see the validator).",
        "behavior.scaleUp",
    ),
    "HPABehavior.scaleDown": ("Scale-down rules, mapped onto `advanced`.", "behavior.scaleDown"),
    "HPAScalingRules.stabilizationWindowSeconds": (
        "scaleDown: becomes `advanced.scaleDownStabilizationSeconds`.",
        "behavior.*.stabilizationWindowSeconds",
    ),
    "HPAScalingRules.selectPolicy": ("scaleDown: becomes `advanced.scaleDownSelectPolicy`.", "behavior.*.selectPolicy"),
    "HPAScalingRules.policies": (
        "scaleDown: `Percent`/`Pods` with one period become `advanced.scaleDown*`.",
        "behavior.*.policies",
    ),
    "HPAScalingRules.tolerance": ("HPA tolerance (a quantity: string or number).", "behavior.*.tolerance"),
    "HPAScalingPolicy.type": ("`Pods` or `Percent`.", "policies[].type"),
    "HPAScalingPolicy.value": ("Replicas or percent removed per period.", "policies[].value"),
    "HPAScalingPolicy.periodSeconds": ("Period of the policy.", "policies[].periodSeconds"),
    "Condition.type": (
        "`Ready` (the spec was accepted and published), `Active` (demand above activation), "
        "`Fallback` (metrics stale, fallback count in force), `Paused` (annotation or on-call).",
        "",
    ),
    "Condition.status": ("`True`, `False` or `Unknown`.", ""),
    "Condition.message": ("One line for people (the validator's error when `Ready` is `False`).", ""),
    "Condition.observedGeneration": ("The `metadata.generation` this condition was computed from.", ""),
    "ScaledObjectStatus.conditions": ("One entry per type, as KEDA's.", "status.conditions"),
    "ScaledObjectStatus.scaleTargetName": ("Name of the target workload.", "status.scaleTargetGVKR"),
    "ScaledObjectStatus.desiredReplicas": ("Replicas the policy asks for now.", ""),
    "ScaledObjectStatus.readyReplicas": ("Replicas serving (slots `ready`).", ""),
    "ScaledObjectStatus.lastDecisions": (f"The last {MAX_LAST_DECISIONS} decisions, newest last.", ""),
    "LastDecision.time": ("When (RFC 3339).", ""),
    "LastDecision.desired": ("The count decided.", ""),
    "LastDecision.reason": ("Why, in the policy's words.", ""),
    "WarmPool.size": ("Standby slots (and standby pods on Kubernetes) kept staged.", ""),
    "WarmPool.image": ("Rootfs image of the engine (EROFS), or none.", ""),
    "WarmPool.weights": ("Model weights directory staged into /dev/shm.", ""),
    "WarmPool.engine": ("Engine the node agent runs.", ""),
    "WarmPool.loader": ("How weights reach the GPU.", ""),
}


_HPA: Final = "spec.advanced.horizontalPodAutoscalerConfig.behavior"
_REFUSED_WITH_POLICIES: Final = "Refused with `scaleUp.policies`."

PATH_NOTES: Final[dict[str, str]] = {
    # Full field path -> its meaning, where one struct means different things at different paths.
    f"{_HPA}.scaleUp": "Scale-up rules. Only `selectPolicy` and a zero `stabilizationWindowSeconds` are accepted: "
    "pulsescale scales out as fast as the demand asks.",
    f"{_HPA}.scaleUp.stabilizationWindowSeconds": "Only `0` is accepted; a scale-up stabilization is refused "
    "(scale-out follows `advanced.stableWindowSeconds` and panics on bursts).",
    f"{_HPA}.scaleUp.selectPolicy": "`Disabled` pauses scale-out (what KEDA's `paused-scale-out` annotation does "
    "to its HPA); `Max`/`Min` change nothing (no scale-up policy applies).",
    f"{_HPA}.scaleUp.policies": "**Refused:** scale-up rate limits, HPA's default (Percent 100 and Pods 4 per 15 s) "
    "included; pulsescale scales out faster without them, so removing them loses nothing.",
    f"{_HPA}.scaleUp.policies[].type": _REFUSED_WITH_POLICIES,
    f"{_HPA}.scaleUp.policies[].value": _REFUSED_WITH_POLICIES,
    f"{_HPA}.scaleUp.policies[].periodSeconds": _REFUSED_WITH_POLICIES,
    f"{_HPA}.scaleUp.tolerance": "**Refused:** HPA's dead band around the target has no counterpart (a quantity: "
    "string or number).",
    f"{_HPA}.scaleDown.tolerance": "**Refused:** HPA's dead band around the target has no counterpart; the stable "
    "window and the scale-down stabilization smooth the demand instead.",
    f"{_HPA}.scaleDown.stabilizationWindowSeconds": "Becomes `advanced.scaleDownStabilizationSeconds`.",
    f"{_HPA}.scaleDown.selectPolicy": "Becomes `advanced.scaleDownSelectPolicy` (`Disabled`: never scale down).",
    f"{_HPA}.scaleDown.policies": "`Percent` and/or `Pods` with one `periodSeconds` become "
    "`advanced.scaleDownPercent`/`scaleDownPods`/`scaleDownPeriodSeconds`.",
    f"{_HPA}.scaleDown.policies[].value": "Replicas, or percent of them, removed per period.",
    "spec.fallback.failureThreshold": "Missed intervals (of `advanced.staleAfterSeconds`, counted from the last "
    "decision with fresh demand) tolerated: the fallback count applies at the next one, as KEDA's failures > "
    "failureThreshold; `0` falls back at the first.",
}

_CRD_BOUNDS: Final[dict[tuple[str, str], dict[str, Any]]] = {}

REFUSED: Final[dict[str, str]] = {
    # Field -> why the validator refuses it (docs/scaledobject.md "Refused, with the reason").
    "apiVersion": f"`keda.sh/v1alpha1` with a `{scaledobject.TRIGGER_TYPE}` trigger: change it to "
    f"`{scaledobject.API_VERSION}`; every other field reads as KEDA's.",
    "spec.triggers[].type": f"any type but `{scaledobject.TRIGGER_TYPE}` (`prometheus`, `kafka`, `cpu`...): "
    "pulsescale has one trigger, the demand the gateways push for `metadata.model`; keep those on KEDA.",
    "spec.triggers[].metricType": "`Value` and `Utilization`: pulsescale's rule is `AverageValue` (desired replicas = "
    "demand / `targetQueueDepth` per replica).",
    "spec.triggers": f"more than {MAX_TRIGGERS} triggers (the CRD's `maxItems` too): all name the same model.",
    "spec.triggers[].metadata.model": "a second ScaledObject of one model, in one apply or already in "
    "`pulse_scalers`: the autoscaler serves one ScaledObject per model (delete the other first).",
    "spec.advanced.scalingModifiers": "every trigger of a ScaledObject feeds the same model's demand, so there is "
    "no second metric for a formula to combine.",
    f"{_HPA}.scaleUp.policies": "scale-up rate limits: pulsescale scales out as fast as the demand asks, from warm "
    "slots. HPA's default (Percent 100 and Pods 4 per 15 s, `Max`) is slower, so removing it loses nothing.",
    f"{_HPA}.scaleUp.stabilizationWindowSeconds": "other than 0: scale-out follows `advanced.stableWindowSeconds` "
    "and panics on bursts.",
    f"{_HPA}.*.tolerance": "HPA's dead band around the target has no counterpart.",
    f"{_HPA}.scaleDown.policies": "different `periodSeconds`, two policies of one type, or `Percent` over 100: the "
    "policy has one `advanced.scaleDownPeriodSeconds` for both limits. Setting a mapped field both here and in "
    "`advanced` is refused too (keep one).",
}


def _description(struct: str, camel: str, docs: dict[str, dict[str, str]]) -> str:
    note = FIELD_NOTES.get(f"{struct}.{camel}", ("", ""))[0]
    return docs.get(struct, {}).get(camel) or note


@functools.cache
def _docs_by_struct() -> dict[str, dict[str, str]]:
    """Struct name -> camelCase field name -> docstring."""
    raw = {**_field_docs(protocol), **_field_docs(sys.modules[__name__])}
    out: dict[str, dict[str, str]] = {}
    for name, cls in _structs().items():
        found = raw.get(name, {})
        out[name] = {f.encode_name: found[f.name] for f in msgspec.structs.fields(cls) if f.name in found}
    return out


def structural(schema: dict[str, Any]) -> dict[str, Any]:
    """A msgspec JSON Schema (2020-12, ``$defs``) as an apiextensions.k8s.io/v1 structural OpenAPI v3 schema."""
    defs = schema.get("$defs", {})
    docs = _docs_by_struct()

    def walk(node: dict[str, Any], owner: str | None, field: str | None) -> dict[str, Any]:
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[1]
            resolved = walk(defs[name], name, None)
            if node.get("default") is not None:
                resolved["default"] = node["default"]
            return resolved
        if (owner, field) in _STRING_OR_NUMBER:
            return _untyped(node)
        if "anyOf" in node:
            options = [o for o in node["anyOf"] if o.get("type") != "null"]
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            if len(options) == 1:
                return walk({**options[0], **rest}, owner, field)
            return _untyped(rest)  # string-or-number (HPA tolerance): see the module docstring
        out: dict[str, Any] = {}
        kind = node.get("type")
        if kind is None and "enum" in node:
            kind = "string"
        if kind is None:
            raise ValueError(f"schema node without a type at {owner}.{field}: {node}")
        out["type"] = kind
        if node.get("description"):
            out["description"] = " ".join(node["description"].split())
        for key in (
            "enum",
            "format",
            "pattern",
            "minLength",
            "maxLength",
            "minItems",
            "maxItems",
            "minimum",
            "maximum",
        ):
            if key in node:
                out[key] = node[key]
        if "exclusiveMinimum" in node:
            out["minimum"] = node["exclusiveMinimum"]
            out["exclusiveMinimum"] = True
        if "exclusiveMaximum" in node:
            out["maximum"] = node["exclusiveMaximum"]
            out["exclusiveMaximum"] = True
        if node.get("default") is not None:
            out["default"] = node["default"]
        if out.get("pattern") == NAME_PATTERN and "maxLength" not in out:
            # The pattern allows 63 characters; the API server's cost estimator reads only maxLength (without it, a
            # model name counts as a 3 MiB string: ~80 M for the rule that compares the triggers' models).
            out["maxLength"] = MAX_NAME_LENGTH
        out.update(_CRD_BOUNDS.get((owner or "", field or ""), {}))
        if kind == "object":
            struct = owner if owner in defs else None
            props: dict[str, Any] = {}
            for name, sub in node.get("properties", {}).items():
                child = walk(sub, struct, name)
                desc = _description(struct, name, docs) if struct else ""
                if desc and "description" not in child:
                    child = {"description": desc, **child}
                props[name] = child
            if props:
                out["properties"] = props
            if node.get("required"):
                out["required"] = list(node["required"])
            if node.get("additionalProperties") not in (None, False, True):
                out["additionalProperties"] = walk(node["additionalProperties"], None, None)
        if kind == "array":
            out["items"] = walk(node["items"], None, None)
        return out

    return walk(schema, None, None)


def _untyped(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}
    if node.get("default") is not None:
        out["default"] = node["default"]
    return out


def spec_schema() -> dict[str, Any]:
    """``spec``'s structural schema, with the CRD-only bounds and the CEL rules."""
    out = structural(msgspec.json.schema(ScaledObjectSpec))
    out.pop("description", None)
    out["properties"]["triggers"]["maxItems"] = MAX_TRIGGERS
    trigger = out["properties"]["triggers"]["items"]
    trigger["properties"]["name"]["maxLength"] = MAX_NAME_LENGTH
    out["x-kubernetes-validations"] = copy.deepcopy(CEL_RULES["spec"])
    _path_descriptions(out, "spec")
    return out


def _path_descriptions(node: dict[str, Any], path: str) -> None:
    """`PATH_NOTES` as the descriptions of the structural schema's nodes at those paths."""
    if path in PATH_NOTES:
        node["description"] = _plain_markdown(PATH_NOTES[path])
    for name, sub in node.get("properties", {}).items():
        _path_descriptions(sub, f"{path}.{name}")
    if "items" in node:
        _path_descriptions(node["items"], f"{path}[]")


def _plain_markdown(text: str) -> str:
    return text.replace("**", "")  # bold is the page's; backticks stay, as in the other descriptions


def status_schema() -> dict[str, Any]:
    out = structural(msgspec.json.schema(ScaledObjectStatus))
    conditions = out["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"  # one entry per type, merged by type (as metav1.Condition)
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    conditions["maxItems"] = len(CONDITION_TYPES)
    return out


def _columns() -> list[dict[str, Any]]:
    def cond(kind: str) -> str:
        return f'.status.conditions[?(@.type=="{kind}")].status'

    return [
        {"name": "Kind", "type": "string", "jsonPath": ".spec.scaleTargetRef.kind"},
        {"name": "Target", "type": "string", "jsonPath": ".spec.scaleTargetRef.name"},
        {"name": "Min", "type": "integer", "jsonPath": ".spec.minReplicaCount"},
        {"name": "Max", "type": "integer", "jsonPath": ".spec.maxReplicaCount"},
        {"name": "Ready", "type": "string", "jsonPath": cond("Ready")},
        {"name": "Active", "type": "string", "jsonPath": cond("Active")},
        {"name": "Fallback", "type": "string", "jsonPath": cond("Fallback")},
        {"name": "Paused", "type": "string", "jsonPath": cond("Paused")},
        {"name": "Model", "type": "string", "jsonPath": ".spec.triggers[0].metadata.model", "priority": 1},
        {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas", "priority": 1},
        {"name": "Current", "type": "integer", "jsonPath": ".status.currentReplicas", "priority": 1},
        {"name": "Warm", "type": "integer", "jsonPath": ".status.warmSlots", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    root = {
        "type": "object",
        "description": "A pulsescale ScaledObject: KEDA's ScaledObject fields with the gateway-queue trigger, "
        "scaled from the warm pool.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "maxLength": 317},
            "kind": {"type": "string", "maxLength": 63},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "x-kubernetes-validations": copy.deepcopy(CEL_RULES[""]),
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "pulsescale", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": "ScaledObject",
                "listKind": "ScaledObjectList",
                "plural": PLURAL,
                "singular": "scaledobject",
                "shortNames": list(SHORT_NAMES),
                "categories": ["pulsescale"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _columns(),
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


_HEADER: Final = (
    "# Generated by `pulsescale crd > deploy/crd/scaledobjects.pulsescale.io.yaml` from warmpool.protocol"
    ".ScaledObjectSpec\n# and autoscaler.crd.ScaledObjectStatus: edit those types, not this file.\n"
)


def render() -> str:
    """The CRD as YAML, with a header that says how it is made."""
    return _HEADER + str(yaml.safe_dump(crd(), sort_keys=False, width=120, allow_unicode=True))


def spec_json_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of ``spec`` for editors: msgspec's, with KEDA's string numbers admitted."""
    schema = msgspec.json.schema(ScaledObjectSpec)
    meta = schema["$defs"]["TriggerMetadata"]["properties"]
    for struct, name in _STRING_OR_NUMBER:
        node = schema["$defs"][struct]["properties"][name]
        default = node.pop("default", None)
        schema["$defs"][struct]["properties"][name] = {
            "anyOf": [node, {"type": "string", "pattern": scaledobject.NUMBER_PATTERN}],
            **({"default": default} if default is not None else {}),
        }
    del meta
    return schema


# --- the reference page -----------------------------------------------------------------------------------------

NO_EFFECT: Final[dict[str, str]] = {
    "spec.pollingInterval": "the gateways push a sample every 100 ms; nothing is polled.",
    "spec.triggers[].useCachedMetrics": "every pushed sample is used as it arrives; there is no metrics cache.",
    "spec.triggers[].authenticationRef": "a pushed trigger reads no external system, so it needs no credentials.",
    "spec.advanced.horizontalPodAutoscalerConfig.name": "no HPA is created; the autoscaler itself scales.",
    "spec.scaleTargetRef.envSourceContainerName": "a pushed trigger reads no container environment; its "
    "parameters are in `metadata`.",
}
"""Fields accepted so a KEDA manifest applies, and why they change nothing (the record's notes say the same)."""


def _rows(schema: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(path, type, default, meaning, KEDA field) for every field of msgspec's ``spec`` schema, depth first."""
    defs = schema["$defs"]
    docs = _docs_by_struct()
    rows: list[tuple[str, str, str, str, str]] = []

    def resolve(node: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
        if "anyOf" in node:
            options = [o for o in node["anyOf"] if o.get("type") != "null"]
            if len(options) == 1:
                return resolve(options[0])
            return node, None
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[1]
            return defs[name], name
        return node, None

    def type_of(node: dict[str, Any], struct: str | None, field: str) -> str:
        if (struct, field) in _STRING_OR_NUMBER:
            return "number or string"
        target, _ = resolve(node)
        target = {**target, **_CRD_BOUNDS.get((struct or "", field), {})}
        if "anyOf" in target:
            return " or ".join(str(o.get("type")) for o in target["anyOf"] if o.get("type") != "null")
        if "enum" in target:
            return " \\| ".join(f"`{v}`" for v in target["enum"])
        if target.get("type") == "array":
            item, item_struct = resolve(target["items"])
            return f"list of {item_struct or item.get('type')}"
        kind = str(target.get("type", "object"))
        bounds = []
        for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<=")):
            if key in target:
                bounds.append(f"{sign} {target[key]:g}")
        return f"{kind} ({', '.join(bounds)})" if bounds else kind

    def walk(struct: str, prefix: str) -> None:
        node = defs[struct]
        required = set(node.get("required", []))
        for name, sub in node.get("properties", {}).items():
            path = f"{prefix}.{name}"
            meaning, keda = FIELD_NOTES.get(f"{struct}.{name}", ("", ""))
            meaning = PATH_NOTES.get(path) or docs.get(struct, {}).get(name) or meaning
            if path in NO_EFFECT and "no effect" not in meaning.lower():
                meaning += f" **No effect:** {NO_EFFECT[path]}"
            if "default" in sub and sub["default"] is not None:
                default = f"`{json.dumps(sub['default'])}`"
            elif name in required:
                default = "required"
            else:
                default = "unset"
            rows.append((path, type_of(sub, struct, name), default, meaning.strip(), keda))
            target, child = resolve(sub)
            if child:
                walk(child, path)
            elif target.get("type") == "array":
                _, item_struct = resolve(target["items"])
                if item_struct:
                    walk(item_struct, f"{path}[]")

    walk(schema["$ref"].rsplit("/", 1)[1], "spec")
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def docs_markdown() -> str:
    """docs/scaledobject.md: the reference of every field, generated from the same types as the CRD."""
    spec = msgspec.json.schema(ScaledObjectSpec)
    status = msgspec.json.schema(ScaledObjectStatus)
    out = [
        "<!-- Generated by `pulsescale crd --docs > docs/scaledobject.md` from warmpool.protocol.ScaledObjectSpec"
        " and autoscaler.crd.ScaledObjectStatus; edit those types, not this file. -->",
        "# ScaledObject (`scaledobjects.pulsescale.io/v1alpha1`) reference",
        "",
        "One schema makes the CRD (`deploy/crd/`), what `pulsescale apply` and the operator accept, and this page.",
        "A KEDA ScaledObject applies with two changes: `apiVersion: pulsescale.io/v1alpha1` and a trigger of type",
        "`gateway-queue`; every other field is read as KEDA's, or refused with the reason (see \"Refused, with the",
        'reason" below). Short name: `kubectl get pso` (KEDA owns `so`).',
        "",
        "## Numbers written as strings",
        "",
        'KEDA\'s trigger metadata values are strings (`targetQueueDepth: "4"`); ours may be strings or numbers',
        '(`4`, `0.5`, `"0.5"`). The CRD schema leaves those two fields untyped',
        "(`x-kubernetes-preserve-unknown-fields`): `x-kubernetes-int-or-string` would refuse the number `0.5`, and a",
        'structural schema cannot say "string or number" otherwise. So the API server stores any value there; the',
        "shared validator (in `pulsescale apply` and in the operator, before anything is published) converts it and",
        "refuses a non-number naming the field, and the operator reports that in `status.conditions` (`Ready`) and",
        "an Event. A number is what KEDA's scalers read (Go's `strconv.ParseFloat`, decimal): ASCII digits, a",
        'fraction, an exponent (`"1e3"`); `"1_000"`, `"nan"`, `"inf"` and other digits (`"٣"`) are refused.',
        "",
        "## Rules checked by the API server (CEL) and by the validator",
        "",
    ]
    for path, rules in CEL_RULES.items():
        for rule in rules:
            out.append(f"- `{path or '(root)'}`: {rule['message']}")
    out += [
        f"- `spec.triggers`: at most {MAX_TRIGGERS} (the CRD and the validator; all triggers name the same model).",
        "",
        "## `spec`",
        "",
        "| Field | Type | Default | Meaning | KEDA field |",
        "|---|---|---|---|---|",
    ]
    for path, kind, default, meaning, keda in _rows(spec):
        out.append(f"| `{path}` | {kind} | {default} | {_cell(meaning)} | {keda} |")
    out += ["", "## Accepted, with no effect", ""]
    out += [f"- `{path}`: {why}" for path, why in NO_EFFECT.items()]
    out += ["", "## Refused, with the reason", ""]
    out += [f"- `{path}`: {why}" for path, why in REFUSED.items()]
    out += [
        "",
        "## Pausing",
        "",
        "- Annotations, in KEDA's family (`autoscaling.keda.sh/`) and ours (`pulsescale.io/`), which must agree:",
        '  `paused: "true"` holds the current count; `paused-replicas: "N"` holds N (with or without `paused`;',
        '  `"0"` parks at zero whatever `minReplicaCount` says); `paused-scale-in`/`paused-scale-out: "true"` stop',
        "  one direction.",
        f"- `{_HPA}.scaleUp.selectPolicy: Disabled` pauses scale-out, as the `paused-scale-out` annotation does.",
        f"- `{_HPA}.scaleDown.selectPolicy: Disabled` (or `spec.advanced.scaleDownSelectPolicy: Disabled`) never",
        "  scales down.",
        "- `pulsescale apply` prints each pause in its summary line (`paused at N`, `paused scale-in`, `paused",
        "  scale-out`).",
    ]
    out += [
        "",
        "## `status` (written by the operator)",
        "",
        "| Field | Type | Meaning |",
        "|---|---|---|",
    ]
    for path, kind, _, meaning, _ in _rows(status):
        out.append(f"| `{path.replace('spec', 'status', 1)}` | {kind} | {_cell(meaning)} |")
    out += [
        "",
        "`kubectl get pso` prints Kind, Target, Min, Max, Ready, Active, Fallback, Paused and Age as KEDA's",
        "`kubectl get so` does; `-o wide` adds Model, Desired, Current and Warm.",
        "",
    ]
    return "\n".join(out)


# --- pulsescale crd ---------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, prog: str = "pulsescale crd") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Print the ScaledObject CustomResourceDefinition (kubectl apply -f -), generated from the "
        "same types that pulsescale apply and the operator validate with.",
    )
    from warmpool import output as out  # -o/--json as every printing command has them (issue 11)

    what = parser.add_mutually_exclusive_group()
    what.add_argument("--schema", action="store_true", help="print the JSON Schema of spec instead (for editors)")
    what.add_argument("--docs", action="store_true", help="print the Markdown reference (docs/scaledobject.md)")
    out.add_output_argument(parser)
    args = parser.parse_args(argv)
    fmt = out.machine(args)
    if fmt is not None and (args.schema or args.docs):
        parser.error("-o/--json print the CRD object; --schema and --docs print something else (JSON, Markdown)")
    if fmt is not None:
        # The CRD object alone, without render()'s comment header: `-o json` for jq, `-o yaml` for kubectl.
        sys.stdout.write(out.dump(crd(), fmt) + "\n")
    elif args.schema:
        sys.stdout.write(json.dumps(spec_json_schema(), indent=2) + "\n")
    elif args.docs:
        sys.stdout.write(docs_markdown())
    else:
        sys.stdout.write(render())
    return 0
