"""ScaledObject manifests (``pulsescale.io/v1alpha1``) to `ScalerRecord`s for KV `pulse_scalers`.

One conversion for both writers of that bucket: `pulsescale apply -f` (no Kubernetes) and the kopf operator (a
CR's body is the same mapping). Pure apart from `load_path` (which reads files); `updated_at` is passed in.

The spec reads as KEDA's (``keda.sh/v1alpha1`` ScaledObject, KEDA 2.17 reference): a KEDA user changes the
``apiVersion`` and the trigger ``type``, and every other field means what it meant there, or is refused with the
reason. What is checked, and why it is stricter than the wire decoder:

- ``apiVersion``/``kind`` must be ours. A ``keda.sh/v1alpha1`` manifest with our trigger type gets the one-line
  fix; one with KEDA's own triggers is told pulsescale has one trigger type.
- ``metadata.name`` and ``metadata.namespace`` become the KV key ``<namespace>.<name>``: they must be names
  (`protocol.NAME_PATTERN`: no dots, since the key's parts are split on them). ``namespace`` defaults to
  ``default`` as with kubectl. Everything else in ``metadata`` (uid, resourceVersion, managedFields, labels,
  finalizers, ownerReferences...) and a ``status`` block are ignored, so a CR body from the API server reads;
  ``metadata.creationTimestamp`` (RFC 3339) becomes `ScalerRecord.created_at`.
- ``spec`` decodes into `protocol.ScaledObjectSpec` (camelCase keys). Unknown keys are an error here, not
  ignored: the CRD's structural schema and ``kubectl apply`` (strict field validation) refuse them too, and an
  on-call engineer's ``maxReplica: 4`` typo must not be silently dropped.
- Triggers: ``type`` is ``gateway-queue`` (the one trigger: demand pushed by the gateways; a ``prometheus`` or
  ``kafka`` trigger has nothing to read here). ``metadata`` values may be strings as in KEDA (``"4"``) or
  numbers; where the wire type is a number they are converted, and a non-number is refused naming the key.
  A number string is what Go's ``strconv.ParseFloat`` (KEDA's scalers) reads in decimal: ASCII digits, a
  fraction, an exponent (``"1e3"``); not Python's extras (``"1_000"``, ``"٣"``, ``"nan"``). Every whole number
  read from a string (paused-replicas, ``$PULSESCALE_MAX_REPLICAS``) is ASCII digits only: ``str.isdigit``
  admits ``"²"``, which ``int`` then refuses with a ValueError (a traceback; a crashed operator handler).
  At most `MAX_TRIGGERS` triggers, as the CRD.
  Trigger names are unique within the ScaledObject. ``metricType`` is ``AverageValue`` (our rule divides demand by
  the per-replica target); ``Value`` and ``Utilization`` are refused with that reason.
- Accepted with no effect, each adding one line to `ScalerRecord.notes` (printed by ``apply``, shown in the
  status): ``pollingInterval``, ``useCachedMetrics`` (a pushed trigger is read as samples arrive, never polled),
  ``authenticationRef`` (nothing to authenticate to), ``horizontalPodAutoscalerConfig.name`` (no HPA is made),
  ``scaleTargetRef.envSourceContainerName`` (a pushed trigger reads no container environment).
- ``fallback.failureThreshold``: KEDA's meaning, in the policy too (falls back when failures > threshold; a
  failure is a missed interval of ``advanced.staleAfterSeconds``); ``0`` falls back at the first, as KEDA's.
- One ScaledObject per model: the autoscaler serves the first and drops a second (``daemon.apply_scaler``), so
  two of one model in one apply are refused naming both (`load_documents`, `load_path`), and `check_models`
  refuses one whose model another key of ``pulse_scalers`` already scales (``apply`` runs it before writing).
- ``advanced.horizontalPodAutoscalerConfig.behavior`` is mapped onto the policy's scale-down fields (`_map_hpa`);
  what cannot map is refused with the reason, and so is setting a field both ways. ``scaleUp.selectPolicy:
  Disabled`` is what KEDA's ``paused-scale-out`` annotation does to its HPA, so it pauses scale-out here.
  ``advanced.scalingModifiers`` is refused: all triggers of one ScaledObject feed one model's demand, so there
  is no second metric for a formula to combine.
- Annotations, in both families, ``pulsescale.io/`` and KEDA's ``autoscaling.keda.sh/`` (the same value in both
  is fine; different values are refused naming both): ``paused: "true"`` pauses at the current count;
  ``paused-replicas: "N"`` pauses at N, with or without ``paused`` (KEDA), any N from 0 to the per-model limit
  (KEDA: "any arbitrary number"; ``"0"`` parks at zero whatever ``minReplicaCount`` says; the policy does not
  clamp a pause); ``paused-scale-in``/``paused-scale-out: "true"`` stop one direction. Values are strings, as
  Kubernetes requires, and ``"true"``/``"false"`` only (KEDA reads any other ``paused`` value as true: a typo
  here is refused instead of pausing).
- Replica counts (``minReplicaCount``, ``maxReplicaCount``, ``idleReplicaCount``, paused-replicas) are at most
  `max_replicas` (`DEFAULT_MAX_REPLICAS`, or ``$PULSESCALE_MAX_REPLICAS``): the wire allows 100000, but one
  ScaledObject asking for that much is a typo or an attack, and the autoscaler caps what it acts on at its own
  ``--max-replicas`` (`capped`).
- YAML: a mapping with the same key twice is refused with its line (PyYAML would keep the last one silently);
  multi-document streams and a ``kind: List`` with ``items`` read as with kubectl; `load_path` reads a
  directory's ``*.yaml``/``*.yml``/``*.json`` in name order (``-R``: recursively), as ``kubectl apply -f DIR``.
  Documents of other APIs (a Namespace, Deployment or Service beside the ScaledObject, as deploy/examples/ has)
  are skipped, each said in `skipped` (kubectl applies them, `pulsescale apply` writes only ScaledObjects); a
  ScaledObject of any apiVersion, and any kind of the pulsescale.io group, is still checked (a keda.sh one is
  refused with its hint), and a text or directory where nothing is left is refused.
  A text over `MAX_TEXT_BYTES` is refused before parsing, nesting deeper than `MAX_DEPTH` before composing
  (PyYAML's composer recurses per level: 3,000 levels were a RecursionError traceback), and any other failure of
  the loader is a `ScaledObjectError` too: the operator must never see another exception from here.

Every error is a `ScaledObjectError` naming the field (``spec.maxReplicaCount``); `load_documents` prefixes
the source and the 1-based document index (``qwen.yaml doc 1: spec.maxReplicaCount: Expected `int` >= 1``).
"""

from __future__ import annotations

import datetime as dt
import difflib
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec
import yaml

from warmpool import protocol
from warmpool.errors import PulsescaleError
from warmpool.protocol import Advanced, HPAScalingRules, ScaledObjectSpec, ScalerRecord

__all__ = [
    "ANNOTATION_PREFIXES",
    "API_VERSION",
    "DEFAULT_MAX_REPLICAS",
    "DEFAULT_NAMESPACE",
    "KEDA_API_GROUP",
    "KIND",
    "MANIFEST_SUFFIXES",
    "MAX_DEPTH",
    "MAX_REPLICAS_ENV",
    "MAX_TEXT_BYTES",
    "MAX_TRIGGERS",
    "NOTE_ENV_SOURCE",
    "NUMBER_PATTERN",
    "PAUSED_ANNOTATION",
    "PAUSED_REPLICAS_ANNOTATION",
    "PAUSED_SCALE_IN_ANNOTATION",
    "PAUSED_SCALE_OUT_ANNOTATION",
    "TRIGGER_TYPE",
    "Manifest",
    "ScaledObjectError",
    "capped",
    "check_models",
    "from_manifest",
    "load_documents",
    "other_kind",
    "load_path",
    "max_replicas_from_env",
    "same_content",
]

API_VERSION: Final = "pulsescale.io/v1alpha1"
KIND: Final = "ScaledObject"
KEDA_API_GROUP: Final = "keda.sh"
TRIGGER_TYPE: Final = "gateway-queue"
DEFAULT_NAMESPACE: Final = "default"
ANNOTATION_PREFIXES: Final = ("pulsescale.io/", "autoscaling.keda.sh/")
"""Pause annotations are read in both families: ours and KEDA's, so a KEDA user's runbook keeps working."""
PAUSED_ANNOTATION: Final = "pulsescale.io/paused"
PAUSED_REPLICAS_ANNOTATION: Final = "pulsescale.io/paused-replicas"
PAUSED_SCALE_IN_ANNOTATION: Final = "pulsescale.io/paused-scale-in"
PAUSED_SCALE_OUT_ANNOTATION: Final = "pulsescale.io/paused-scale-out"
MANIFEST_SUFFIXES: Final = (".yaml", ".yml", ".json")
"""What `load_path` reads from a directory, as ``kubectl apply -f DIR``."""
DEFAULT_MAX_REPLICAS: Final = 1000
"""The most replicas of one model that `apply`, the on-call commands and the autoscaler accept unless configured
otherwise: well above any single model's fleet today, and small enough that a typo (``100000``) is refused."""
MAX_REPLICAS_ENV: Final = "PULSESCALE_MAX_REPLICAS"
"""Environment variable that raises (or lowers) `DEFAULT_MAX_REPLICAS` for `apply` and the autoscaler."""
MAX_TRIGGERS: Final = 16
"""Most triggers in one ScaledObject, as the CRD's ``maxItems`` (autoscaler/crd.py uses this one): every trigger
names the same model, so more than one is only to name them, and the API server needs a bound for the CEL rule."""
MAX_TEXT_BYTES: Final = 3 * 1024 * 1024
"""Largest file (or stdin) read, in bytes: the API server's own request limit (3 MiB). A ScaledObject is ~1 KiB;
a bigger text is a wrong file, and refusing it before parsing bounds the parser's time and memory."""
MAX_DEPTH: Final = 64
"""Deepest nesting of mappings and lists read. The deepest field is 8 levels down (an HPA policy's ``value``), a
CR body's ``managedFields`` ~15; PyYAML's composer recurses per level and dies with RecursionError near 1000."""
_ASCII_COUNT: Final = re.compile(r"[ \t]*[0-9]+[ \t]*")
"""A whole number as Kubernetes writes one: ASCII digits only (``str.isdigit`` admits "²" and "٣", and ``int``
reads "٣" as 3 and raises on "²")."""
NUMBER_PATTERN: Final = r"^[ \t]*[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?[ \t]*$"
_ASCII_NUMBER: Final = re.compile(NUMBER_PATTERN)
"""A metadata number as KEDA's scalers read one (Go's ``strconv.ParseFloat``, decimal form): ASCII digits, an
optional fraction and exponent (``"1e3"``). Not Python's ``float`` extras: ``"1_000"``, non-ASCII digits,
``"nan"``/``"inf"``. The editor schema (``pulsescale crd --schema``) uses the same pattern."""


class ScaledObjectError(PulsescaleError):
    """A ScaledObject manifest that cannot become a `ScalerRecord`; `field` is a path such as ``spec.triggers[0]``."""

    code = "invalid_scaledobject"

    def __init__(self, field: str, detail: str, *, where: str = "") -> None:
        self.field = field
        self.detail = detail
        self.where = where
        head = f"{where}: " if where else ""
        super().__init__(f"{head}{field}: {detail}" if field else f"{head}{detail}")

    def located(self, where: str) -> ScaledObjectError:
        return ScaledObjectError(self.field, self.detail, where=where)


@dataclass(frozen=True)
class Manifest:
    """One document of a file: where it came from and the record it becomes."""

    source: str
    index: int
    """1-based position of the document in its file (empty documents count, so it matches an editor's view)."""
    record: ScalerRecord
    item: int | None = None
    """0-based position in the document's ``items`` when the document is a ``kind: List``."""

    @property
    def where(self) -> str:
        return _where(self.source, self.index, self.item)


def _where(source: str, index: int, item: int | None) -> str:
    return f"{source} doc {index}" + ("" if item is None else f" items[{item}]")


# --- msgspec errors and unknown fields ---------------------------------------------------------------------------

_AT: Final = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING: Final = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_TAG: Final = re.compile(r"^\[\w+\] ")
_STEP: Final = re.compile(r"\.(\w+)|\[\d+\]")


def _literal_values(path: str) -> list[str]:
    """The values a ``Literal`` field at `path` (``.fallback.behavior``) allows, for an "Invalid enum value"."""
    info: msgspec.inspect.Type = _SPEC_INFO
    for step in _STEP.finditer(path):
        while isinstance(info, msgspec.inspect.UnionType):
            kinds = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
            if len(kinds) != 1:
                return []
            info = kinds[0]
        if step.group(1) is not None and isinstance(info, msgspec.inspect.StructType):
            found = [f.type for f in info.fields if f.encode_name == step.group(1)]
            if not found:
                return []
            info = found[0]
        elif step.group(1) is None and isinstance(info, msgspec.inspect.ListType):
            info = info.item_type
        else:
            return []
    return [str(v) for v in info.values] if isinstance(info, msgspec.inspect.LiteralType) else []


def _spec_error(err: msgspec.ValidationError) -> ScaledObjectError:
    """msgspec's message, with its ``$.a.b`` path turned into the manifest's ``spec.a.b``."""
    text = str(err)
    path = ""
    at = _AT.search(text)
    if at:
        path = at.group("path")
        text = text[: at.start()]
    missing = _MISSING.match(text)
    if missing:
        path += "." + missing.group("field")
        text = "required field is missing"
    text = _TAG.sub("", text)
    if "matching regex" in text:
        text += " (a name: lowercase letters, digits, '-' and '_'; no dots)"
    if text.startswith("Invalid enum value"):
        allowed = _literal_values(path)
        if allowed:
            text += f" (one of: {', '.join(allowed)})"
    return ScaledObjectError("spec" + path, text)


def _unknown_fields(value: Any, info: msgspec.inspect.Type, path: str) -> list[tuple[str, str]]:
    """(path, hint) of each key in `value` that the type does not have, the hint naming a close known field.
    Only where `value` has the expected shape: shape errors are msgspec's to report."""
    if isinstance(info, msgspec.inspect.UnionType):
        found = [_unknown_fields(value, t, path) for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        return found[0] if len(found) == 1 else []
    if isinstance(info, msgspec.inspect.ListType) and isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _unknown_fields(item, info.item_type, f"{path}[{i}]")]
    if isinstance(info, msgspec.inspect.StructType) and isinstance(value, Mapping):
        fields = {f.encode_name: f.type for f in info.fields}
        out = []
        for key, item in value.items():
            sub = f"{path}.{key}"
            if key in fields:
                out += _unknown_fields(item, fields[key], sub)
            else:
                close = difflib.get_close_matches(str(key), fields, n=1)
                out.append((sub, f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(fields)})"))
        return out
    return []


_SPEC_INFO: Final = msgspec.inspect.type_info(ScaledObjectSpec)


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
    for i, trigger in enumerate(triggers):
        at = f"spec.triggers[{i}]"
        if not isinstance(trigger, Mapping):
            converted.append(trigger)
            continue
        kind = trigger.get("type")
        if kind is not None and kind != TRIGGER_TYPE:
            raise ScaledObjectError(
                f"{at}.type",
                f"{kind!r} is not a pulsescale trigger: pulsescale has one trigger type, {TRIGGER_TYPE!r}, fed "
                f"by the gateways' queue samples for metadata.model; keep {kind} triggers on KEDA for other "
                "workloads",
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
        if trigger.get("useCachedMetrics") is True and _NOTE_CACHED not in notes:
            notes.append(_NOTE_CACHED)
        if trigger.get("authenticationRef") is not None and _NOTE_AUTH not in notes:
            notes.append(_NOTE_AUTH)
        meta = trigger.get("metadata")
        if isinstance(meta, Mapping):
            meta = {k: _number(v, f"{at}.metadata.{k}") if k in _METADATA_NUMBERS else v for k, v in meta.items()}
            trigger = {**trigger, "metadata": meta}
        converted.append(trigger)
    spec["triggers"] = converted
    if raw_spec.get("pollingInterval") is not None:
        notes.append(_NOTE_POLLING)
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


# --- metadata and annotations ------------------------------------------------------------------------------------


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


def _created_at(value: Any) -> float | None:
    """``metadata.creationTimestamp`` (RFC 3339; YAML may have made it a datetime already) as Unix seconds."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value.strip())
        except ValueError:
            raise ScaledObjectError(
                "metadata.creationTimestamp", f"{value!r} is not an RFC 3339 time (2026-12-03T07:51:44Z)"
            ) from None
    if not isinstance(value, dt.datetime):
        raise ScaledObjectError(
            "metadata.creationTimestamp", f"must be an RFC 3339 time string, got {type(value).__name__}"
        )
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)  # Kubernetes writes UTC
    return float(value.timestamp())


def _mapping(value: Any, field: str, *, required: bool = True) -> Mapping[str, Any]:
    if value is None and not required:
        return {}
    if not isinstance(value, Mapping):
        what = "missing" if value is None else f"must be a mapping, got {type(value).__name__}"
        raise ScaledObjectError(field, what)
    return value


def _name(value: Any, field: str) -> str:
    if value is None:
        raise ScaledObjectError(field, "required field is missing")
    if not isinstance(value, str) or not protocol.is_name(value):
        raise ScaledObjectError(
            field,
            f"{value!r} is not a pulsescale name ({protocol.NAME_PATTERN}: lowercase letters, digits, '-' "
            "and '_', no dots, since <namespace>.<name> is the pulse_scalers key)",
        )
    return value


def max_replicas_from_env(env: Mapping[str, str]) -> int:
    """`MAX_REPLICAS_ENV` from `env`, else `DEFAULT_MAX_REPLICAS`; a value that is not a whole number >= 1 is a
    `ScaledObjectError` saying so."""
    text = env.get(MAX_REPLICAS_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_REPLICAS
    if not _ASCII_COUNT.fullmatch(text) or int(text) < 1:
        raise ScaledObjectError("", f"${MAX_REPLICAS_ENV} is {text!r}; it must be a whole number of replicas >= 1")
    return int(text)


def _over(field: str, value: int, max_replicas: int) -> ScaledObjectError:
    return ScaledObjectError(
        field,
        f"{value} is over the limit of {max_replicas} replicas per model; raise it with --max-replicas N or "
        f"${MAX_REPLICAS_ENV} (and the autoscaler's --max-replicas) if you mean it",
    )


def _api_version(doc: Mapping[str, Any]) -> None:
    api_version = doc.get("apiVersion")
    if api_version == API_VERSION:
        return
    hint = ""
    if isinstance(api_version, str) and api_version.split("/")[0] == KEDA_API_GROUP:
        spec = doc.get("spec")
        triggers = spec.get("triggers") if isinstance(spec, Mapping) else None
        listed = triggers if isinstance(triggers, list) else []
        types = {str(t.get("type")) for t in listed if isinstance(t, Mapping)}  # str: a list there is unhashable
        if types <= {TRIGGER_TYPE}:
            hint = f" (change apiVersion to {API_VERSION}; every other field is read as KEDA's)"
        else:
            other = sorted(str(t) for t in types - {TRIGGER_TYPE})
            hint = (
                f" (a KEDA ScaledObject for KEDA's own triggers ({', '.join(other)}): pulsescale reads "
                f"{API_VERSION} with trigger type {TRIGGER_TYPE})"
            )
    raise ScaledObjectError("apiVersion", f"expected {API_VERSION}, got {api_version!r}{hint}")


# --- the conversion ---------------------------------------------------------------------------------------------


def from_manifest(
    doc: Any, *, updated_at: float = 0.0, generation: int | None = None, max_replicas: int = DEFAULT_MAX_REPLICAS
) -> ScalerRecord:
    """Convert one ScaledObject manifest (a YAML document, or a CR body from the API server).

    `generation` defaults to ``metadata.generation`` when present (the operator's case), else 0. Replica counts
    over `max_replicas` are refused.
    """
    if not isinstance(doc, Mapping):
        raise ScaledObjectError(
            "", f"a manifest is a mapping with apiVersion, kind, metadata and spec; got {type(doc).__name__}"
        )
    _api_version(doc)
    if doc.get("kind") != KIND:
        raise ScaledObjectError("kind", f"expected {KIND}, got {doc.get('kind')!r}")

    meta = _mapping(doc.get("metadata"), "metadata")
    name = _name(meta.get("name"), "metadata.name")
    namespace = _name(meta.get("namespace", DEFAULT_NAMESPACE), "metadata.namespace")
    if generation is None:
        gen = meta.get("generation", 0)
        generation = gen if isinstance(gen, int) and not isinstance(gen, bool) and gen >= 0 else 0
    created_at = _created_at(meta.get("creationTimestamp"))

    notes: list[str] = []
    raw_spec = _keda_triggers(_mapping(doc.get("spec"), "spec"), notes)
    unknown = _unknown_fields(raw_spec, _SPEC_INFO, "spec")
    if unknown:
        (field, hint), more = unknown[0], len(unknown) - 1
        raise ScaledObjectError(field, f"unknown field{hint}" + (f"; {more} more unknown field(s)" if more else ""))
    try:
        spec = msgspec.convert(raw_spec, ScaledObjectSpec)
    except msgspec.ValidationError as err:
        raise _spec_error(err) from None
    for field, value in (
        ("spec.maxReplicaCount", spec.max_replica_count),
        ("spec.minReplicaCount", spec.min_replica_count),
        ("spec.idleReplicaCount", spec.idle_replica_count or 0),
    ):
        if value > max_replicas:
            raise _over(field, value, max_replicas)
    raw_advanced = raw_spec.get("advanced")
    advanced, scale_out_disabled = _map_hpa(
        raw_advanced if isinstance(raw_advanced, Mapping) else {}, spec.advanced, notes
    )
    spec = msgspec.structs.replace(spec, advanced=advanced)

    annotations = _mapping(meta.get("annotations"), "metadata.annotations", required=False)
    paused_flag = _flag(annotations, "paused")
    paused = paused_flag is not None and paused_flag[0]
    replicas = _replicas(annotations, max_replicas)
    paused_replicas = None
    if replicas is not None:
        paused_replicas, key = replicas
        if paused_flag is not None and not paused_flag[0]:
            raise ScaledObjectError(
                f"metadata.annotations[{key}]",
                f'contradicts {paused_flag[1]}: "false" (paused-replicas pauses; remove one of the two)',
            )
        paused = True  # as KEDA: paused-replicas alone pauses at that count
    scale_in = _flag(annotations, "paused-scale-in")
    scale_out = _flag(annotations, "paused-scale-out")
    if scale_out is not None and not scale_out[0] and scale_out_disabled:
        raise ScaledObjectError(
            f"metadata.annotations[{scale_out[1]}]",
            f'"false" contradicts {_HPA}.scaleUp.selectPolicy: Disabled (no scale-out); remove one of the two',
        )
    return ScalerRecord(
        namespace=namespace,
        name=name,
        spec=spec,
        paused=paused,
        paused_replicas=paused_replicas,
        generation=generation,
        updated_at=updated_at,
        paused_scale_in=scale_in is not None and scale_in[0],
        paused_scale_out=scale_out_disabled or (scale_out is not None and scale_out[0]),
        notes=notes,
        created_at=created_at,
    )


def capped(record: ScalerRecord, max_replicas: int) -> tuple[ScalerRecord, str | None]:
    """`record` with its replica counts cut to `max_replicas`, and what was cut (None: nothing). The autoscaler
    acts on this, whoever wrote the record: a ScaledObject written to `pulse_scalers` without `apply` (the
    operator, or anyone with the operator's permission) cannot make it chase 100000 replicas."""
    spec = record.spec
    if spec.max_replica_count <= max_replicas and (record.paused_replicas or 0) <= max_replicas:
        return record, None
    lo = min(spec.min_replica_count, max_replicas)
    idle = spec.idle_replica_count
    if idle is not None and idle >= lo > 0:
        idle = lo - 1
    top = min(spec.max_replica_count, max_replicas)
    # A schedule's floor is at most maxReplicaCount (the spec's own check): cut with it.
    schedules = [s if s.replicas <= top else msgspec.structs.replace(s, replicas=top) for s in spec.schedules]
    spec = msgspec.structs.replace(
        spec, max_replica_count=top, min_replica_count=lo, idle_replica_count=idle, schedules=schedules
    )
    paused = None if record.paused_replicas is None else min(record.paused_replicas, max_replicas)
    what = (
        f"replicas {record.spec.min_replica_count}..{record.spec.max_replica_count} over the limit of {max_replicas} "
        f"per model; acting on {lo}..{spec.max_replica_count} (raise the limit with --max-replicas or "
        f"${MAX_REPLICAS_ENV})"
    )
    return msgspec.structs.replace(record, spec=spec, paused_replicas=paused), what


# --- YAML ---------------------------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types
    """SafeLoader that refuses a mapping with the same key twice (PyYAML keeps the last one silently: a pasted
    ``maxReplicaCount`` below an old one would win unseen). Merge keys (``<<``) may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: SafeLoader's own error says so
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"duplicate key {key!r} (first at line {first.line + 1}); YAML would keep only the last one: "
                    "remove one",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


class _TooDeep(Exception):
    def __init__(self, mark: yaml.Mark) -> None:
        super().__init__(mark)
        self.mark = mark


def _check_depth(text: str) -> None:
    """Raise `_TooDeep` at the first mapping or list nested deeper than `MAX_DEPTH`. PyYAML's parser is a loop
    (its events need no recursion), its composer and constructor recurse once per level: this runs first."""
    depth = 0
    for event in yaml.parse(text, Loader=_StrictLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _TooDeep(event.start_mark)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _documents(text: str) -> list[Any]:
    _check_depth(text)
    return list(yaml.load_all(text, Loader=_StrictLoader))


def _parse(text: str, source: str) -> list[Any]:
    """`_documents`, every failure a `ScaledObjectError` located in `source` (never a traceback: the operator
    runs this on whatever a CR holds)."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TEXT_BYTES:
        raise ScaledObjectError(
            "",
            f"{size} bytes: more than a ScaledObject file holds (at most {MAX_TEXT_BYTES}); wrong file?",
            where=source,
        )
    try:
        return _documents(text)
    except _TooDeep as err:
        at = f"line {err.mark.line + 1}, column {err.mark.column + 1}"
        raise ScaledObjectError(
            "", f"{at}: nested too deeply (more than {MAX_DEPTH} levels of mappings and lists)", where=source
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "YAML"
        problem = getattr(err, "problem", None) or str(err)
        raise ScaledObjectError("", f"{at}: {problem}", where=source) from None
    except RecursionError:
        raise ScaledObjectError("", "YAML: nested too deeply to read", where=source) from None
    except (ValueError, TypeError, OverflowError, MemoryError) as err:  # PyYAML's constructors (int, float, date)
        raise ScaledObjectError("", f"YAML: cannot be read ({type(err).__name__}: {err})", where=source) from None


_GROUP: Final = API_VERSION.partition("/")[0]


def other_kind(doc: Any) -> str | None:
    """``Kind namespace/name`` of a document of another API (not ours to write: kubectl applies it), or None for
    what is checked as a ScaledObject: kind ScaledObject of any apiVersion, any kind of the pulsescale.io group,
    and a document without a string kind and apiVersion (broken, not foreign)."""
    if not isinstance(doc, Mapping):
        return None
    kind, api = doc.get("kind"), doc.get("apiVersion")
    if not isinstance(kind, str) or not kind or kind in (KIND, "List") or not isinstance(api, str):
        return None
    if api.partition("/")[0] == _GROUP:
        return None
    meta = doc.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    name, namespace = meta.get("name"), meta.get("namespace")
    ident = "/".join(str(x) for x in (namespace, name) if isinstance(x, str) and x)
    return f"{kind} {ident}".rstrip()


def _skipped_text(skipped: Sequence[str]) -> str:
    return f" ({len(skipped)} document(s) of other kinds skipped)" if skipped else ""


def _is_list(doc: Any) -> bool:
    return isinstance(doc, Mapping) and doc.get("kind") == "List" and isinstance(doc.get("items"), list)


def load_documents(
    text: str,
    source: str,
    *,
    updated_at: float = 0.0,
    max_replicas: int = DEFAULT_MAX_REPLICAS,
    allow_empty: bool = False,
    skipped: list[str] | None = None,
) -> list[Manifest]:
    """Every ScaledObject in a (multi-document) YAML or JSON text; empty documents are skipped but counted; a
    ``kind: List`` document contributes its ``items``.

    Raises `ScaledObjectError` for the first bad document, located as ``<source> doc <n>`` (``... items[<i>]``),
    or for YAML that does not parse or repeats a key, located by line and column. Two documents with the same
    ``<namespace>.<name>`` are refused: the second would silently win. A text without any ScaledObject is refused
    unless `allow_empty`. Documents of other APIs (`other_kind`) are skipped, each appended to `skipped` as
    ``skipped <Kind> <namespace>/<name> (<source> doc <n>): not a ScaledObject (kubectl applies it)``.
    """
    here: list[str] = []
    out: list[Manifest] = []
    seen: dict[str, str] = {}
    models: dict[str, Manifest] = {}
    docs = _parse(text, source)
    for index, doc in enumerate(docs, start=1):
        if doc is None:
            continue
        entries = list(enumerate(doc["items"])) if _is_list(doc) else [(None, doc)]
        for item, body in entries:
            foreign = other_kind(body)
            if foreign is not None:
                here.append(
                    f"skipped {foreign} ({_where(source, index, item)}): not a ScaledObject (kubectl applies it)"
                )
                continue
            try:
                record = from_manifest(body, updated_at=updated_at, max_replicas=max_replicas)
            except ScaledObjectError as err:
                raise err.located(_where(source, index, item)) from None
            m = Manifest(source, index, record, item)
            if record.key in seen:
                raise ScaledObjectError(
                    "metadata.name", f"{record.key} is also defined by {seen[record.key]}", where=m.where
                )
            seen[record.key] = m.where.removeprefix(f"{source} ")
            _one_per_model(models, m)
            out.append(m)
    if skipped is not None:
        skipped += here
    if not out and not allow_empty:
        why = _skipped_text(here) if here else " (the file is empty)"
        raise ScaledObjectError("", f"no ScaledObject in it{why}", where=source)
    return out


_MODEL_FIELD: Final = "spec.triggers[0].metadata.model"


def _one_per_model(models: dict[str, Manifest], m: Manifest) -> None:
    """Record `m` as its model's ScaledObject in `models`; a second one of the model is refused naming the first
    (the autoscaler serves one ScaledObject per model and would drop the other, `daemon.apply_scaler`)."""
    model = m.record.spec.model
    first = models.setdefault(model, m)
    if first is not m and first.record.key != m.record.key:
        first_where = first.where.removeprefix(f"{m.source} ") if first.source == m.source else first.where
        raise ScaledObjectError(
            _MODEL_FIELD,
            f"{model} is also scaled by {first.record.key} ({first_where}); one ScaledObject per model: merge the "
            "two or give each its own model",
            where=m.where,
        )


def check_models(manifests: Sequence[Manifest], written: Iterable[ScalerRecord]) -> None:
    """Refuse (before anything is written) a manifest whose model is scaled by another ScaledObject already in
    `pulse_scalers` (`written`): the autoscaler serves the first and drops the second. A record that this same
    apply rewrites does not count, so one apply may move a model from one ScaledObject to another."""
    applying = {m.record.key for m in manifests}
    owners = {r.spec.model: r.key for r in written if r.key not in applying}
    for m in manifests:
        owner = owners.get(m.record.spec.model)
        if owner is None:
            continue
        namespace, _, name = owner.partition(".")
        raise ScaledObjectError(
            _MODEL_FIELD,
            f"{m.record.spec.model} is already scaled by {owner} in {protocol.SCALERS_BUCKET}; one ScaledObject per "
            f"model: delete {owner} first (pulsescale delete so {name} -n {namespace}), or change this one's model",
            where=m.where,
        )


def _files(path: Path, *, recursive: bool) -> list[Path]:
    if not path.is_dir():
        return [path]
    found = path.rglob("*") if recursive else path.iterdir()
    return sorted((f for f in found if f.is_file() and f.suffix in MANIFEST_SUFFIXES), key=lambda f: f.parts)


def load_path(
    path: str | os.PathLike[str],
    *,
    recursive: bool = False,
    updated_at: float = 0.0,
    max_replicas: int = DEFAULT_MAX_REPLICAS,
    skipped: list[str] | None = None,
) -> list[Manifest]:
    """The ScaledObjects of ``-f PATH`` as ``kubectl apply -f`` reads it: a file's documents, or a directory's
    `MANIFEST_SUFFIXES` files in name order (with `recursive`, its subdirectories' too), empty files skipped.

    Errors are `ScaledObjectError` located ``<file> doc <n>``; an unreadable file, a directory without any
    ScaledObject and one ``<namespace>.<name>`` in two files are refused. Documents of other APIs are skipped
    and said in `skipped` (`load_documents`).
    """
    here: list[str] = []
    root = Path(path)
    is_dir = root.is_dir()
    out: list[Manifest] = []
    first: dict[str, Manifest] = {}
    models: dict[str, Manifest] = {}
    for file in _files(root, recursive=recursive):
        try:
            if file.stat().st_size > MAX_TEXT_BYTES:  # refused before it is read into memory
                raise ScaledObjectError(
                    "",
                    f"{file.stat().st_size} bytes: more than a ScaledObject file holds (at most "
                    f"{MAX_TEXT_BYTES}); wrong file?",
                    where=str(file),
                )
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ScaledObjectError("", f"cannot read it: {err}", where=str(file)) from None
        found = load_documents(
            text, str(file), updated_at=updated_at, max_replicas=max_replicas, allow_empty=is_dir, skipped=here
        )
        for m in found:
            seen = first.setdefault(m.record.key, m)
            if seen is not m:
                raise ScaledObjectError(
                    "metadata.name", f"{m.record.key} is also defined by {seen.where}", where=m.where
                )
            _one_per_model(models, m)
            out.append(m)
    if skipped is not None:
        skipped += here
    if not out:
        more = "" if recursive else " (add -R for its subdirectories)"
        raise ScaledObjectError(
            "",
            f"no ScaledObject in its {', '.join(MANIFEST_SUFFIXES)} files{more}{_skipped_text(here)}",
            where=str(root),
        )
    return out


def same_content(a: ScalerRecord, b: ScalerRecord) -> bool:
    """True when two records configure the same thing (generation and times aside): `apply` then writes nothing."""

    def content(r: ScalerRecord) -> tuple[Any, ...]:
        return (r.namespace, r.name, r.spec, r.paused, r.paused_replicas, r.paused_scale_in, r.paused_scale_out,
                r.notes)  # fmt: skip

    return content(a) == content(b)
