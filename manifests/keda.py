"""KEDA's fields in a ScaledObject: what reads as KEDA's, what is refused with the reason, what is noted.

Part of the ScaledObject reader (`manifests.scaledobject` is its face and says what is checked): the trigger list
(`_keda_triggers`: one trigger type, ``AverageValue``, unique names, metadata numbers written as strings, KEDA's
prometheus keys that have another name here; `check_sources`: revision 14's demand sources), HPA
``behavior`` mapped onto the policy's scale-down fields (`_map_hpa`), and the pause annotations of both families
(`_flag`, `_replicas`). Each field that is accepted with no effect adds its line to the record's notes. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from manifests.terms import (
    _ASCII_COUNT,
    _ASCII_NUMBER,
    ANNOTATION_PREFIXES,
    MAX_TRIGGERS,
    SCALE_TARGETS,
    TRIGGER_TYPE,
    ScaledObjectError,
    _over,
)
from warmpool import protocol
from warmpool.protocol import Advanced, HPAScalingRules

__all__ = ["NOTE_ENV_SOURCE", "check_replica_bounds", "check_scale_target", "check_sources"]


def _is_number_type(info: msgspec.inspect.Type) -> bool:
    if isinstance(info, msgspec.inspect.UnionType):
        return any(_is_number_type(t) for t in info.types)
    return isinstance(info, (msgspec.inspect.FloatType, msgspec.inspect.IntType))


_METADATA_INFO: Final = msgspec.inspect.type_info(protocol.TriggerMetadata)
assert isinstance(_METADATA_INFO, msgspec.inspect.StructType)
_METADATA_NUMBERS: Final = frozenset(f.encode_name for f in _METADATA_INFO.fields if _is_number_type(f.type))
"""Trigger metadata keys whose wire type is a number: KEDA writes them as strings (``"4"``), converted here."""


# --- KEDA's fields: what reads as KEDA's, what is refused, what is noted -----------------------------------------

_NOTE_POLLING: Final = (
    "spec.pollingInterval has no effect: the gateway-queue trigger is pushed by the gateways (every 100 ms), "
    "never polled"
)
_NOTE_CACHED: Final = (
    "spec.triggers[].useCachedMetrics has no effect: a pushed trigger is never polled; every sample is used as "
    "it arrives"
)
_NOTE_AUTH: Final = (
    "spec.triggers[].authenticationRef has no effect: a pushed trigger reads no external metric source, so there "
    "is nothing to authenticate to (NATS permissions guard the samples)"
)
NOTE_ENV_SOURCE: Final = (
    "spec.scaleTargetRef.envSourceContainerName has no effect: a pushed trigger reads no container environment "
    "(KEDA reads trigger parameters from it; pulsescale's come from metadata)"
)
_NOTE_HPA_NAME: Final = (
    "spec.advanced.horizontalPodAutoscalerConfig.name has no effect: pulsescale makes no HPA; it scales the "
    "target itself (warm slots, else the scale subresource)"
)
# Revision 14: a trigger whose metadata.source is read by `pulsescale bridge` (not pushed) says so instead.
_PULLED: Final = frozenset(protocol.SOURCES) - {"gateway"}
_NOTE_POLLING_PULLED: Final = (
    "spec.pollingInterval has no effect: pulsescale bridge reads the trigger's source at its own period "
    "(--scrape-every, --query-every) and the autoscaler uses each sample as it arrives"
)
_NOTE_CACHED_PULLED: Final = (
    "spec.triggers[].useCachedMetrics has no effect: pulsescale bridge reads the trigger's source at its own period; "
    "every sample it publishes is used as it arrives"
)
_NOTE_AUTH_PULLED: Final = (
    "spec.triggers[].authenticationRef has no effect: pulsescale bridge reads the trigger's source without "
    "credentials (no TriggerAuthentication is read); give it a serverAddress or metricsURL it may read as it is"
)
_KEDA_RENAMED: Final = {
    # KEDA's prometheus scaler keys that mean one of ours: refused with the name to use, not a generic "unknown".
    "threshold": ("targetQueueDepth", "queued + in-flight requests one replica should carry"),
    "activationThreshold": ("activationQueueDepth", "from zero replicas, scale up only when demand exceeds it"),
}


def _number(value: Any, field: str) -> Any:
    """A KEDA metadata value as a number: strings are parsed; anything else is left for msgspec to judge."""
    if not isinstance(value, str):
        return value
    if not _ASCII_NUMBER.fullmatch(value):
        raise ScaledObjectError(field, f'"{value}" is not a number (write it as "4", "0.5" or 4; ASCII digits)')
    number = float(value)
    if not math.isfinite(number):
        raise ScaledObjectError(field, f'"{value}" is not a finite number')
    return int(number) if number.is_integer() else number


def _keda_triggers(raw_spec: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """`raw_spec` with trigger metadata numbers converted; refuses what KEDA has and pulsescale cannot mean."""
    spec = dict(raw_spec)
    triggers = raw_spec.get("triggers")
    if not isinstance(triggers, list):
        return spec  # msgspec says what is wrong with it
    if len(triggers) > MAX_TRIGGERS:
        raise ScaledObjectError(
            "spec.triggers",
            f"{len(triggers)} triggers: at most {MAX_TRIGGERS} (as the CRD); every trigger names the same model, "
            "so more than one only names them",
        )
    names: dict[str, int] = {}
    converted: list[Any] = []
    pulled = False  # a trigger before this one reads a source through the bridge (its notes say so)
    for i, trigger in enumerate(triggers):
        at = f"spec.triggers[{i}]"
        if not isinstance(trigger, Mapping):
            converted.append(trigger)
            continue
        kind = trigger.get("type")
        if kind is not None and kind != TRIGGER_TYPE:
            how = (
                "to scale on a PromQL query write type: gateway-queue with metadata source: prometheus, "
                "serverAddress and query (pulsescale bridge --scaledobjects asks it), or keep this trigger on KEDA"
                if kind == "prometheus"
                else f"keep {kind} triggers on KEDA for other workloads"
            )
            raise ScaledObjectError(
                f"{at}.type",
                f"{kind!r} is not a pulsescale trigger: pulsescale has one trigger type, {TRIGGER_TYPE!r}, fed "
                f"by the queue samples for metadata.model; {how}",
            )
        metric_type = trigger.get("metricType")
        if metric_type is not None and metric_type != "AverageValue":
            why = {
                "Value": "Value scales on the metric as a whole (replicas x metric / target)",
                "Utilization": "Utilization is a percentage of the pods' resource requests (cpu/memory triggers)",
            }.get(str(metric_type), f"{metric_type!r} is not a KEDA metricType either")
            raise ScaledObjectError(
                f"{at}.metricType",
                f"{why}; pulsescale's rule is AverageValue: desired replicas = demand / targetQueueDepth per "
                "replica. Remove metricType or set AverageValue",
            )
        name = trigger.get("name")
        if isinstance(name, str):
            if name in names:
                raise ScaledObjectError(
                    f"{at}.name",
                    f"{name!r} is also the name of spec.triggers[{names[name]}]; trigger names must be unique "
                    "within a ScaledObject",
                )
            names[name] = i
        meta = trigger.get("metadata")
        source = meta.get("source") if isinstance(meta, Mapping) else None
        pulled = pulled or (isinstance(source, str) and source in _PULLED)  # a list there is unhashable
        cached, auth = (_NOTE_CACHED_PULLED, _NOTE_AUTH_PULLED) if pulled else (_NOTE_CACHED, _NOTE_AUTH)
        if trigger.get("useCachedMetrics") is True and cached not in notes:
            notes.append(cached)
        if trigger.get("authenticationRef") is not None and auth not in notes:
            notes.append(auth)
        if isinstance(meta, Mapping):
            for key, (ours, means) in _KEDA_RENAMED.items():
                if key in meta:
                    raise ScaledObjectError(
                        f"{at}.metadata.{key}",
                        f"KEDA's prometheus key; pulsescale names it {ours} ({means}): rename it",
                    )
            meta = {k: _number(v, f"{at}.metadata.{k}") if k in _METADATA_NUMBERS else v for k, v in meta.items()}
            trigger = {**trigger, "metadata": meta}
        converted.append(trigger)
    spec["triggers"] = converted
    if raw_spec.get("pollingInterval") is not None:
        notes.append(_NOTE_POLLING_PULLED if pulled else _NOTE_POLLING)
    target = raw_spec.get("scaleTargetRef")
    if isinstance(target, Mapping) and target.get("envSourceContainerName") is not None:
        notes.append(NOTE_ENV_SOURCE)
    raw_fallback = raw_spec.get("fallback")
    fallback: Mapping[str, Any] = raw_fallback if isinstance(raw_fallback, Mapping) else {}
    threshold = fallback.get("failureThreshold")
    if isinstance(threshold, int) and not isinstance(threshold, bool) and threshold < 0:
        raise ScaledObjectError(
            "spec.fallback.failureThreshold",
            f"{threshold}: must be >= 0 (the failures tolerated before the fallback count applies; 0: fall "
            "back on the first, as KEDA)",
        )
    advanced = raw_spec.get("advanced")
    if isinstance(advanced, Mapping) and "scalingModifiers" in advanced:
        raise ScaledObjectError(
            "spec.advanced.scalingModifiers",
            "not supported: every trigger of a ScaledObject feeds the same model's demand (the gateways' queue), "
            "so there is no second metric for a formula to combine; remove it and set targetQueueDepth on the "
            "trigger",
        )
    return spec


def check_sources(spec: protocol.ScaledObjectSpec) -> None:
    """Revision 14: each trigger's demand source (``metadata.source`` and its parameters) keeps the contract's rules
    (`protocol.TriggerMetadata.source_problem`: a known source, only its own parameters, ``prometheus`` with
    ``serverAddress`` and ``query``, http(s) URLs), and every trigger reads the same one; else a
    `ScaledObjectError` naming the key. The wire decoder does not refuse these (its readers ignore what they do not
    use), so the reader refuses them before anything is published."""
    problem = spec.source_problem()
    if problem is not None:
        path, detail = problem
        raise ScaledObjectError(f"spec.{path}", detail)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_replica_bounds(raw_spec: Mapping[str, Any]) -> None:
    """KEDA's admission webhook on ``idleReplicaCount`` (kedacore/keda ``CheckReplicaCountBoundsAreValid``, run by
    ``verifyReplicaCount``), with its wording: idle must be below the minimum, where an unset ``minReplicaCount``
    counts 0 and a ``minReplicaCount`` of 0 counts 1 (``GetHPAMinReplicas``: the HPA's least). So ``0`` with
    ``idleReplicaCount: 3`` is refused (the autoscaler would otherwise ignore the idle count), and ``0`` with
    ``idleReplicaCount: 0`` is admitted. Values of the wrong type are left for msgspec to name."""
    idle, given = raw_spec.get("idleReplicaCount"), raw_spec.get("minReplicaCount")
    if not isinstance(idle, int) or not _whole(idle) or not (given is None or _whole(given)):
        return
    least = 0 if not isinstance(given, int) else max(given, 1)
    if idle < least:
        return
    why = {
        None: "minReplicaCount is unset, which KEDA's webhook reads as 0: set minReplicaCount above it",
        0: "KEDA's webhook reads minReplicaCount 0 as the HPA's least, 1: with 0 only idleReplicaCount 0 is admitted",
    }.get(given, "set idleReplicaCount below minReplicaCount, or remove it")
    raise ScaledObjectError(
        "spec.idleReplicaCount",
        f"IdleReplicaCount={idle} must be less than MinReplicaCount={least}, as KEDA's admission webhook says: {why}",
    )


def check_scale_target(raw_spec: Mapping[str, Any]) -> None:
    """Refuse a ``scaleTargetRef`` that is not one of `SCALE_TARGETS` (an Argo Rollout, a custom resource with a
    scale subresource): KEDA resolves any ``/scale`` target through API discovery, pulsescale's operator reads the
    pod template and the scale subresource of Deployments and StatefulSets only (and its RBAC grants no more), so
    accepting one would publish a ScaledObject whose target nothing scales. Wrong types are left to msgspec."""
    ref = raw_spec.get("scaleTargetRef")
    if not isinstance(ref, Mapping):
        return
    kind, api = ref.get("kind", "Deployment"), ref.get("apiVersion", "apps/v1")
    if not isinstance(kind, str) or not isinstance(api, str) or (api, kind) in SCALE_TARGETS:
        return
    field = "kind" if kind not in {k for _, k in SCALE_TARGETS} else "apiVersion"
    allowed = " or ".join(f"{a} {k}" for a, k in SCALE_TARGETS)
    raise ScaledObjectError(
        f"spec.scaleTargetRef.{field}",
        f"{api} {kind} is not a target pulsescale scales: the operator makes standby pods from the pod template and "
        f"writes the scale subresource of an {allowed} only (KEDA takes anything with a /scale subresource, such as "
        "an Argo Rollout: keep that workload on KEDA, or point scaleTargetRef at a Deployment or StatefulSet)",
    )


_HPA: Final = "spec.advanced.horizontalPodAutoscalerConfig.behavior"
_HPA_DEFAULT_SCALE_UP: Final = [("Percent", 100, 15), ("Pods", 4, 15)]
"""autoscaling/v2's default scaleUp policies (sorted), pasted by many KEDA users."""


def _conflict(raw_advanced: Mapping[str, Any], ours: str, theirs: str) -> None:
    if ours in raw_advanced:
        raise ScaledObjectError(
            f"spec.advanced.{ours}",
            f"set twice: here and by {_HPA}.{theirs} (which maps onto it); keep one of the two",
        )


def _no_tolerance(rules: HPAScalingRules, at: str) -> None:
    if rules.tolerance is not None:
        raise ScaledObjectError(
            f"{at}.tolerance",
            "HPA's tolerance (a dead band around the target) has no counterpart: pulsescale's stable window and "
            "scale-down stabilization smooth the demand instead; remove it",
        )


def _map_hpa(raw_advanced: Mapping[str, Any], advanced: Advanced, notes: list[str]) -> tuple[Advanced, bool]:
    """``horizontalPodAutoscalerConfig`` onto the policy's fields: (advanced with the mapped values, whether
    scale-out is disabled). HPA's scale-down rules map one to one (one period for all policies, since the policy
    has one `scaleDownPeriodSeconds`); scale-up rate limits are refused: pulsescale scales out as fast as the
    demand asks, from warm slots, and a rate limit there would only add queueing."""
    config = advanced.horizontal_pod_autoscaler_config
    if config is None:
        return advanced, False
    if config.name is not None:
        notes.append(_NOTE_HPA_NAME)
    if config.behavior is None:
        return advanced, False
    changes: dict[str, Any] = {}
    scale_out_disabled = False
    up = config.behavior.scale_up
    if up is not None:
        at = f"{_HPA}.scaleUp"
        _no_tolerance(up, at)
        if up.policies:
            limits = sorted((p.type, p.value, p.period_seconds) for p in up.policies)
            if limits == _HPA_DEFAULT_SCALE_UP and up.select_policy in (None, "Max"):
                raise ScaledObjectError(
                    f"{at}.policies",
                    "this is the HPA's default scale-up (Percent 100 and Pods 4 per 15 s, Max), which pulsescale "
                    "does not apply: it scales out as fast as the demand asks, faster than this default, so "
                    "removing it loses nothing. Remove scaleUp (selectPolicy: Disabled alone is honoured)",
                )
            raise ScaledObjectError(
                f"{at}.policies",
                "scale-up rate limits are not applied: pulsescale scales out as fast as the demand asks (warm "
                "slots activate in seconds; a limit would only queue requests). Remove scaleUp.policies; "
                "selectPolicy: Disabled (no scale-out) is honoured",
            )
        if up.stabilization_window_seconds:
            raise ScaledObjectError(
                f"{at}.stabilizationWindowSeconds",
                "scale-up stabilization is not applied: scale-out follows advanced.stableWindowSeconds (the "
                "averaging window) and panics on bursts; remove it or set 0",
            )
        scale_out_disabled = up.select_policy == "Disabled"
    down = config.behavior.scale_down
    if down is not None:
        at = f"{_HPA}.scaleDown"
        _no_tolerance(down, at)
        if down.stabilization_window_seconds is not None:
            _conflict(raw_advanced, "scaleDownStabilizationSeconds", "scaleDown.stabilizationWindowSeconds")
            changes["scale_down_stabilization_seconds"] = float(down.stabilization_window_seconds)
        select = down.select_policy
        if down.policies:
            periods = sorted({p.period_seconds for p in down.policies})
            if len(periods) > 1:
                raise ScaledObjectError(
                    f"{at}.policies",
                    f"periodSeconds differ ({', '.join(map(str, periods))}): pulsescale has one scale-down period "
                    "(advanced.scaleDownPeriodSeconds) for both limits; give every policy the same periodSeconds",
                )
            by_type: dict[str, int] = {}
            for j, policy in enumerate(down.policies):
                if policy.type in by_type:
                    raise ScaledObjectError(
                        f"{at}.policies[{j}]",
                        f"a second {policy.type} policy (the first is policies[{by_type[policy.type]}]): with one "
                        f"period, two {policy.type} limits are one; keep the one you mean",
                    )
                by_type[policy.type] = j
            for ours in ("scaleDownPercent", "scaleDownPods", "scaleDownPeriodSeconds"):
                _conflict(raw_advanced, ours, "scaleDown.policies")
            changes["scale_down_period_seconds"] = float(periods[0])
            values = {p.type: p.value for p in down.policies}
            if "Percent" in values:
                if values["Percent"] > 100:
                    raise ScaledObjectError(
                        f"{at}.policies[{by_type['Percent']}].value",
                        f"{values['Percent']} %: scale-down removes at most 100 % of the replicas; use 100",
                    )
                changes["scale_down_percent"] = float(values["Percent"])
                changes["scale_down_pods"] = values.get("Pods")
            else:
                # Pods alone: at most that many, which is min(100 % of the replicas, Pods).
                changes["scale_down_percent"] = 100.0
                changes["scale_down_pods"] = values["Pods"]
                if select != "Disabled":
                    select = "Min"
        if select is not None:
            _conflict(raw_advanced, "scaleDownSelectPolicy", "scaleDown.selectPolicy")
            changes["scale_down_select_policy"] = select
    return msgspec.structs.replace(advanced, **changes), scale_out_disabled


# --- annotations --------------------------------------------------------------------------------------------------


def _annotation(annotations: Mapping[str, Any], key: str) -> str | None:
    value = annotations.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ScaledObjectError(
            f"metadata.annotations[{key}]",
            f"must be a string, got {type(value).__name__} {value!r} (annotations are strings in Kubernetes: quote it)",
        )
    return value


def _flag(annotations: Mapping[str, Any], suffix: str) -> tuple[bool, str] | None:
    """The ``"true"``/``"false"`` annotation `suffix` of either family, and the key it came from; both set to
    different values is refused naming both."""
    found: list[tuple[bool, str]] = []
    for prefix in ANNOTATION_PREFIXES:
        key = prefix + suffix
        text = _annotation(annotations, key)
        if text is None:
            continue
        if text.strip().lower() not in ("true", "false"):
            raise ScaledObjectError(f"metadata.annotations[{key}]", f'must be "true" or "false", got {text!r}')
        found.append((text.strip().lower() == "true", key))
    if len(found) == 2 and found[0][0] != found[1][0]:
        raise ScaledObjectError(
            f"metadata.annotations[{found[1][1]}]",
            f"{str(found[1][0]).lower()} contradicts {found[0][1]}: {str(found[0][0]).lower()}; remove one of the two",
        )
    return found[0] if found else None


def _replicas(annotations: Mapping[str, Any], max_replicas: int) -> tuple[int, str] | None:
    found: list[tuple[int, str]] = []
    for prefix in ANNOTATION_PREFIXES:
        key = prefix + "paused-replicas"
        text = _annotation(annotations, key)
        if text is None:
            continue
        field = f"metadata.annotations[{key}]"
        if not _ASCII_COUNT.fullmatch(text):
            raise ScaledObjectError(field, f"must be a whole number of replicas (ASCII digits 0-9), got {text!r}")
        count = int(text)
        if count > max_replicas:
            raise _over(field, count, max_replicas)
        found.append((count, key))
    if len(found) == 2 and found[0][0] != found[1][0]:
        raise ScaledObjectError(
            f"metadata.annotations[{found[1][1]}]",
            f'"{found[1][0]}" contradicts {found[0][1]}: "{found[0][0]}"; remove one of the two',
        )
    return found[0] if found else None
