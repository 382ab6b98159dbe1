"""ScaledObject manifests (``pulsescale.io/v1alpha1``) to `ScalerRecord`s for KV `pulse_scalers`.

One conversion for both writers of that bucket: `pulsescale apply -f` (no Kubernetes) and the kopf operator (a
CR's body is the same mapping). Pure: no I/O; `updated_at` is passed in.

What is checked, and why it is stricter than the wire decoder:

- ``apiVersion``/``kind`` must be ours. A KEDA ScaledObject uses the same field names, so the error says so.
- ``metadata.name`` and ``metadata.namespace`` become the KV key ``<namespace>.<name>``: they must be names
  (`protocol.NAME_PATTERN`: no dots, since the key's parts are split on them). ``namespace`` defaults to
  ``default`` as with kubectl.
- ``spec`` decodes into `protocol.ScaledObjectSpec` (camelCase keys). Unknown keys are an error here, not
  ignored: the CRD's structural schema and ``kubectl apply`` (strict field validation) refuse them too, and an
  on-call engineer's ``maxReplica: 4`` typo must not be silently dropped.
- Annotations work like KEDA's: ``pulsescale.io/paused: "true"`` pauses at the current count;
  ``pulsescale.io/paused-replicas: "N"`` pauses at N (with or without ``paused: "true"``). Values are strings,
  as Kubernetes requires; N must lie within ``[minReplicaCount, maxReplicaCount]``, the same rule as the
  ``pause --replicas`` command.

- Replica counts (``minReplicaCount``, ``maxReplicaCount``, ``idleReplicaCount``, paused-replicas) are at most
  `max_replicas` (`DEFAULT_MAX_REPLICAS`, or ``$PULSESCALE_MAX_REPLICAS``): the wire allows 100000, but one
  ScaledObject asking for that much is a typo or an attack, and the autoscaler caps what it acts on at its own
  ``--max-replicas`` (`capped`).

Every error is a `ScaledObjectError` naming the field (``spec.maxReplicaCount``); `load_documents` prefixes
the source and the 1-based document index (``qwen.yaml doc 1: spec.maxReplicaCount: Expected `int` >= 1``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import yaml

from warmpool import protocol
from warmpool.errors import PulsescaleError
from warmpool.protocol import ScaledObjectSpec, ScalerRecord

__all__ = [
    "API_VERSION",
    "DEFAULT_MAX_REPLICAS",
    "DEFAULT_NAMESPACE",
    "KIND",
    "MAX_REPLICAS_ENV",
    "PAUSED_ANNOTATION",
    "PAUSED_REPLICAS_ANNOTATION",
    "Manifest",
    "ScaledObjectError",
    "capped",
    "from_manifest",
    "load_documents",
    "max_replicas_from_env",
    "same_content",
]

API_VERSION: Final = "pulsescale.io/v1alpha1"
KIND: Final = "ScaledObject"
DEFAULT_NAMESPACE: Final = "default"
PAUSED_ANNOTATION: Final = "pulsescale.io/paused"
PAUSED_REPLICAS_ANNOTATION: Final = "pulsescale.io/paused-replicas"
DEFAULT_MAX_REPLICAS: Final = 1000
"""The most replicas of one model that `apply`, the on-call commands and the autoscaler accept unless configured
otherwise: well above any single model's fleet today, and small enough that a typo (``100000``) is refused."""
MAX_REPLICAS_ENV: Final = "PULSESCALE_MAX_REPLICAS"
"""Environment variable that raises (or lowers) `DEFAULT_MAX_REPLICAS` for `apply` and the autoscaler."""


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


# --- the conversion ---------------------------------------------------------------------------------------------

_AT: Final = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_MISSING: Final = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")
_TAG: Final = re.compile(r"^\[\w+\] ")


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
    if not text.isdigit() or int(text) < 1:
        raise ScaledObjectError("", f"${MAX_REPLICAS_ENV} is {text!r}; it must be a whole number of replicas >= 1")
    return int(text)


def _over(field: str, value: int, max_replicas: int) -> ScaledObjectError:
    return ScaledObjectError(
        field,
        f"{value} is over the limit of {max_replicas} replicas per model; raise it with --max-replicas N or "
        f"${MAX_REPLICAS_ENV} (and the autoscaler's --max-replicas) if you mean it",
    )


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
    api_version, kind = doc.get("apiVersion"), doc.get("kind")
    if api_version != API_VERSION:
        hint = ""
        if isinstance(api_version, str) and api_version.startswith("keda.sh/"):
            hint = f" (this is a KEDA ScaledObject; pulsescale's uses apiVersion {API_VERSION}, same field names)"
        raise ScaledObjectError("apiVersion", f"expected {API_VERSION}, got {api_version!r}{hint}")
    if kind != KIND:
        raise ScaledObjectError("kind", f"expected {KIND}, got {kind!r}")

    meta = _mapping(doc.get("metadata"), "metadata")
    name = _name(meta.get("name"), "metadata.name")
    namespace = _name(meta.get("namespace", DEFAULT_NAMESPACE), "metadata.namespace")
    if generation is None:
        gen = meta.get("generation", 0)
        generation = gen if isinstance(gen, int) and not isinstance(gen, bool) and gen >= 0 else 0

    raw_spec = _mapping(doc.get("spec"), "spec")
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

    annotations = _mapping(meta.get("annotations"), "metadata.annotations", required=False)
    paused_text = _annotation(annotations, PAUSED_ANNOTATION)
    replicas_text = _annotation(annotations, PAUSED_REPLICAS_ANNOTATION)
    paused = False
    if paused_text is not None:
        if paused_text.strip().lower() not in ("true", "false"):
            raise ScaledObjectError(
                f"metadata.annotations[{PAUSED_ANNOTATION}]", f'must be "true" or "false", got {paused_text!r}'
            )
        paused = paused_text.strip().lower() == "true"
    paused_replicas = None
    if replicas_text is not None:
        field = f"metadata.annotations[{PAUSED_REPLICAS_ANNOTATION}]"
        if not replicas_text.strip().isdigit():
            raise ScaledObjectError(field, f"must be a whole number of replicas, got {replicas_text!r}")
        paused_replicas = int(replicas_text)
        lo, hi = spec.min_replica_count, spec.max_replica_count
        if not lo <= paused_replicas <= hi:
            raise ScaledObjectError(
                field, f"{paused_replicas} is outside [minReplicaCount, maxReplicaCount] = [{lo}, {hi}]"
            )
        if paused_text is not None and not paused:
            raise ScaledObjectError(
                field, f'contradicts {PAUSED_ANNOTATION}: "false" (paused-replicas pauses; remove one of the two)'
            )
        paused = True  # as KEDA: paused-replicas alone pauses at that count
    return ScalerRecord(
        namespace=namespace,
        name=name,
        spec=spec,
        paused=paused,
        paused_replicas=paused_replicas,
        generation=generation,
        updated_at=updated_at,
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
    spec = msgspec.structs.replace(
        spec, max_replica_count=min(spec.max_replica_count, max_replicas), min_replica_count=lo, idle_replica_count=idle
    )
    paused = None if record.paused_replicas is None else min(record.paused_replicas, max_replicas)
    what = (
        f"replicas {record.spec.min_replica_count}..{record.spec.max_replica_count} over the limit of {max_replicas} "
        f"per model; acting on {lo}..{spec.max_replica_count} (raise the limit with --max-replicas or "
        f"${MAX_REPLICAS_ENV})"
    )
    return msgspec.structs.replace(record, spec=spec, paused_replicas=paused), what


def load_documents(
    text: str, source: str, *, updated_at: float = 0.0, max_replicas: int = DEFAULT_MAX_REPLICAS
) -> list[Manifest]:
    """Every ScaledObject in a (multi-document) YAML text; empty documents are skipped but counted.

    Raises `ScaledObjectError` for the first bad document, located as ``<source> doc <n>``, or for YAML that
    does not parse, located by line and column. Two documents with the same ``<namespace>.<name>`` are refused:
    the second would silently win.
    """
    out: list[Manifest] = []
    seen: dict[str, int] = {}
    try:
        for index, doc in enumerate(yaml.safe_load_all(text), start=1):
            if doc is None:
                continue
            where = f"{source} doc {index}"
            try:
                record = from_manifest(doc, updated_at=updated_at, max_replicas=max_replicas)
            except ScaledObjectError as err:
                raise err.located(where) from None
            if record.key in seen:
                raise ScaledObjectError(
                    "metadata.name", f"{record.key} is also defined by doc {seen[record.key]}", where=where
                )
            seen[record.key] = index
            out.append(Manifest(source, index, record))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "YAML"
        problem = getattr(err, "problem", None) or str(err)
        raise ScaledObjectError("", f"{at}: {problem}", where=source) from None
    if not out:
        raise ScaledObjectError("", "no ScaledObject in it (the file is empty)", where=source)
    return out


def same_content(a: ScalerRecord, b: ScalerRecord) -> bool:
    """True when two records configure the same thing (generation and time aside): `apply` then writes nothing."""
    return (a.namespace, a.name, a.spec, a.paused, a.paused_replicas) == (
        b.namespace,
        b.name,
        b.spec,
        b.paused,
        b.paused_replicas,
    )
