"""The conversion: one ScaledObject manifest (a YAML document or a CR body) to a `ScalerRecord`.

Part of the ScaledObject reader (`manifests.scaledobject` is its face and says what is checked, and why):
`from_manifest` checks ``apiVersion``/``kind`` and the metadata, lets `manifests.keda` read KEDA's fields,
decodes ``spec`` into `protocol.ScaledObjectSpec` (unknown keys refused with a close known field, msgspec's errors
named by the manifest's path) and applies the per-model replica limit; `capped` is the autoscaler's cut of a record
written by anyone; `same_content` says when `apply` has nothing to write. Pure: `updated_at` is passed in.
"""

from __future__ import annotations

import datetime as dt
import difflib
import re
from collections.abc import Mapping
from typing import Any, Final

import msgspec

from manifests.keda import (
    _HPA,
    _flag,
    _keda_triggers,
    _map_hpa,
    _replicas,
    check_replica_bounds,
    check_scale_target,
    check_sources,
)
from manifests.terms import (
    API_VERSION,
    DEFAULT_MAX_REPLICAS,
    DEFAULT_NAMESPACE,
    KEDA_API_GROUP,
    KIND,
    MAX_REPLICAS_ENV,
    TRIGGER_TYPE,
    ScaledObjectError,
    _over,
)
from warmpool import protocol
from warmpool.protocol import ScaledObjectSpec, ScalerRecord

__all__ = ["NOTE_LABELS_DROPPED", "capped", "from_manifest", "same_content"]


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


# --- metadata -----------------------------------------------------------------------------------------------------


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


_LABEL_KEY: Final = re.compile(protocol.LABEL_KEY_PATTERN)
_LABEL_VALUE: Final = re.compile(protocol.LABEL_VALUE_PATTERN)


NOTE_LABELS_DROPPED: Final = (
    f"metadata.labels: more than {protocol.MAX_LABELS}, the most a record carries; published without its labels, so "
    "`pulsescale get -l` cannot select this ScaledObject (kubectl get -l still can); nothing else reads them"
)
"""The note of an object with more labels than `ScalerRecord.labels` carries (`_labels`)."""


def _labels(value: Any, notes: list[str]) -> dict[str, str]:
    """``metadata.labels`` as Kubernetes admits them (what ``pulsescale get -l`` selects on), or the label named.

    Kubernetes sets no limit on their number, the contract does (`protocol.MAX_LABELS`, revision 12): an object
    with more is published all the same, without labels, and `NOTE_LABELS_DROPPED` says so (an object that
    published before revision 12 must not be unpublished by an upgrade). None rather than the first 64: a cut set
    matches selectors that the object's labels do not (``!team`` with ``team`` cut off), and the operator's mirror
    of the CR (`kube.status`) drops them the same way, so `get -l` reads one answer from either."""
    labels = _mapping(value, "metadata.labels", required=False)
    out: dict[str, str] = {}
    for key, val in labels.items():
        field = f"metadata.labels[{key!r}]"
        prefix, _, name = str(key).rpartition("/")
        if not isinstance(key, str) or not _LABEL_KEY.match(key) or len(name) > 63 or len(prefix) > 253:
            raise ScaledObjectError(field, "not a Kubernetes label key ([prefix/]name, name at most 63 characters)")
        if not isinstance(val, str) or len(val) > 63 or not _LABEL_VALUE.match(val):
            raise ScaledObjectError(field, f"{val!r} is not a label value (a string, at most 63 characters)")
        out[key] = val
    if len(out) > protocol.MAX_LABELS:
        notes.append(NOTE_LABELS_DROPPED)
        return {}
    return out


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
    # KEDA's own rules, in KEDA's words, before the wire type's looser idle < min (which binds only above 0).
    check_replica_bounds(raw_spec)
    check_scale_target(raw_spec)
    try:
        spec = msgspec.convert(raw_spec, ScaledObjectSpec)
    except msgspec.ValidationError as err:
        raise _spec_error(err) from None
    check_sources(spec)
    # idleReplicaCount needs no bound of its own: KEDA's rule above keeps it below a minimum that is within it.
    for field, value in (
        ("spec.maxReplicaCount", spec.max_replica_count),
        ("spec.minReplicaCount", spec.min_replica_count),
    ):
        if value > max_replicas:
            raise _over(field, value, max_replicas)
    raw_advanced = raw_spec.get("advanced")
    advanced, scale_out_disabled = _map_hpa(
        raw_advanced if isinstance(raw_advanced, Mapping) else {}, spec.advanced, notes
    )
    spec = msgspec.structs.replace(spec, advanced=advanced)

    labels = _labels(meta.get("labels"), notes)
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
        labels=labels,
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


def same_content(a: ScalerRecord, b: ScalerRecord) -> bool:
    """True when two records configure the same thing (generation and times aside): `apply` then writes nothing."""

    def content(r: ScalerRecord) -> tuple[Any, ...]:
        return (
            r.namespace,
            r.name,
            r.spec,
            r.paused,
            r.paused_replicas,
            r.paused_scale_in,
            r.paused_scale_out,
            r.notes,
            r.labels,
            r.managed_by,
        )  # fmt: skip  (labels: `get -l` reads them from the record; managed_by: who may replace it)

    return content(a) == content(b)
