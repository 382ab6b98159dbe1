"""The words of the CRD and of docs/scaledobject.md: where each field's description comes from.

A field's description is its docstring in the type's source (`warmpool.protocol.scaledobject` for the spec,
`manifests.crdtypes` for the status), read with `ast` (`_docs_by_struct`), else its entry in `FIELD_NOTES`
(which also names the KEDA field it mirrors). `PATH_NOTES` describes a field by its full path where one struct
means different things at different paths (HPA ``scaleUp`` and ``scaleDown``). Used by the schema
(manifests/crdschema.py) and the reference page (manifests/crddocs.py). Pure.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from types import ModuleType
from typing import Final

import msgspec

from manifests import crdtypes
from manifests.crdtypes import MAX_LAST_DECISIONS
from warmpool import protocol
from warmpool.protocol import scaledobject as wire_scaledobject

__all__ = ["FIELD_NOTES", "PATH_NOTES"]


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
    for module in (protocol, crdtypes):
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
        "Where demand comes from: one `gateway-queue` trigger (more only to name them; all name the same model and "
        "read the same `metadata.source`).",
        "spec.triggers",
    ),
    "ScaledObjectSpec.minReplicaCount": ("Replicas kept serving with no demand.", "spec.minReplicaCount"),
    "ScaledObjectSpec.maxReplicaCount": ("Most replicas the policy asks for.", "spec.maxReplicaCount"),
    "ScaledObjectSpec.idleReplicaCount": (
        "Replicas with no demand after `cooldownPeriod`; unset: `minReplicaCount`. As KEDA's admission webhook, "
        "it must be less than `minReplicaCount`, an unset one counting 0 and a `0` counting 1 (so with "
        "`minReplicaCount: 0` only `0` is admitted).",
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
    "ScaleTargetRef.kind": ("Kind of the target: `Deployment` or `StatefulSet`.", "spec.scaleTargetRef.kind"),
    "ScaleTargetRef.apiVersion": ("API version of the target.", "spec.scaleTargetRef.apiVersion"),
    "Trigger.type": (
        "Always `gateway-queue`: the model's queue samples, pushed by the gateways or published by `pulsescale "
        "bridge` from `metadata.source` (other KEDA scalers are refused).",
        "spec.triggers[].type",
    ),
    "Trigger.metadata": (
        "The trigger's parameters. Unknown keys are kept by the API server (as KEDA's string map) and refused by "
        "the validator naming the key, so a typo is `Ready=False`, never silently dropped.",
        "spec.triggers[].metadata",
    ),
    "Trigger.name": ("", "spec.triggers[].name"),
    "Trigger.metricType": ("", "spec.triggers[].metricType"),
    "Trigger.useCachedMetrics": ("", "spec.triggers[].useCachedMetrics (no effect)"),
    "Trigger.authenticationRef": ("", "spec.triggers[].authenticationRef (no effect)"),
    "TriggerMetadata.model": ("The model name the gateways report demand for.", ""),
    "TriggerMetadata.targetQueueDepth": ("", "the scaler's target value (a string in KEDA; string or number here)"),
    "TriggerMetadata.activationQueueDepth": ("", "the scaler's activation value (string or number)"),
    "TriggerMetadata.source": ("", "the scaler's type (`prometheus`; vLLM's metrics have no KEDA scaler)"),
    "TriggerMetadata.serverAddress": ("", "prometheus: metadata.serverAddress"),
    "TriggerMetadata.query": ("", "prometheus: metadata.query"),
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
    "spec.scaleTargetRef.kind": "`Deployment` or `StatefulSet` (apps/v1). **Refused:** any other kind, an Argo "
    "Rollout or another custom resource with a scale subresource (KEDA takes those): the operator makes standby "
    "pods from a Deployment's or StatefulSet's pod template and writes only their scale subresource.",
    "spec.scaleTargetRef.apiVersion": "`apps/v1` (the API of a Deployment or StatefulSet).",
    "spec.fallback.failureThreshold": "Missed intervals (of `advanced.staleAfterSeconds`, counted from the last "
    "decision with fresh demand) tolerated: the fallback count applies at the next one, as KEDA's failures > "
    "failureThreshold; `0` falls back at the first.",
}


def _description(struct: str, camel: str, docs: dict[str, dict[str, str]]) -> str:
    note = FIELD_NOTES.get(f"{struct}.{camel}", ("", ""))[0]
    return docs.get(struct, {}).get(camel) or note


@functools.cache
def _docs_by_struct() -> dict[str, dict[str, str]]:
    """Struct name -> camelCase field name -> docstring."""
    raw = {**_field_docs(wire_scaledobject), **_field_docs(crdtypes)}
    out: dict[str, dict[str, str]] = {}
    for name, cls in _structs().items():
        found = raw.get(name, {})
        out[name] = {f.encode_name: found[f.name] for f in msgspec.structs.fields(cls) if f.name in found}
    return out
