"""The ScaledObject's status subresource, composed from what the operator knows and the autoscaler's `StatusRow`.

Pure (no I/O): `compose` builds an `manifests.crdtypes.ScaledObjectStatus` from

- the operator's own verdict on the object (`Verdict`: published, invalid spec, target conflict, deleting),
  which is the ``Ready`` condition;
- the autoscaler's row for the object's key (``<namespace>.<name>``; None while the autoscaler has not reported
  it), which gives ``Active``, ``Fallback``, ``Paused``, the replica counts, warm slots, the cold path, times and
  the last decisions;
- the status the object carries now, so a condition keeps its ``lastTransitionTime`` while its status does not
  change. Fields this module does not own (``originalReplicaCount`` and the cold path's own) are left out of the
  patch, so they keep what their writer put there.

`body_of` turns it into the JSON body of a merge patch of the status subresource; the operator patches only when
that body differs from the object's current status (`differs`), so a quiet ScaledObject costs no API writes.
`mirror_of` turns the same composed status into the object's `protocol.ObjectStatus` (contract revision 13), the
copy in KV `pulse_objects` that ``pulsescale get so`` reads: what the CR says, published or not.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from kube import bodies
from manifests.crdtypes import (
    ACTIVE_WINDOW_S,
    MAX_LAST_DECISIONS,
    Condition,
    ConditionStatus,
    ConditionType,
    LastDecision,
    scaler_active,
)
from manifests.crdtypes import ScaledObjectStatus as ScaledObjectStatus
from warmpool import protocol
from warmpool.protocol import StatusRow

__all__ = [
    "READY_REASONS",
    "ModeChange",
    "Verdict",
    "body_of",
    "compose",
    "differs",
    "mirror_of",
    "mode_changes",
    "model_of",
    "rfc3339",
]

READY_REASONS: Final = (
    "ScalerPublished",  # the spec is in pulse_scalers
    "InvalidSpec",  # the shared validator refused it; the message is its error
    "TargetConflict",  # another ScaledObject or an HPA scales the same workload
    "ModelConflict",  # another ScaledObject's record already scales the same model
    "ModelOwnedByOtherNamespace",  # the model belongs to another namespace (kube/records.py `ModelOwners`)
    "ModelOwnerUnknown",  # the ConfigMap of model owners cannot be read or written: nothing new is published
    "ScaleTargetNotFound",  # published, but the scaleTargetRef workload does not exist (KEDA: not Ready)
    "ScalerWrittenByApply",  # `pulsescale apply` wrote the record under its key: in force, not replaced
    "Deleting",  # the finalizer runs: record removed, waiting for the model's slots
    "Pending",  # seen, not handled yet
)
DEFAULT_ACTIVE_WINDOW_S: Final = ACTIVE_WINDOW_S  # demand above activation this recently: Active (2 rounds)
_UNKNOWABLE: Final[tuple[ConditionType, ...]] = ("Active", "Fallback")  # only the autoscaler can tell
_OWNED: Final = (
    "conditions",
    "observedGeneration",
    "scaleTargetKind",
    "scaleTargetName",
    "currentReplicas",
    "desiredReplicas",
    "readyReplicas",
    "warmSlots",
    "coldRequested",
    "lastActiveTime",
    "lastScaleTime",
    "lastDecisions",
    "notes",
)


def rfc3339(ts: float) -> str:
    """Unix seconds as Kubernetes writes times (``2026-12-03T07:51:44Z``, UTC, whole seconds)."""
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Verdict:
    """The operator's judgement of one ScaledObject: the ``Ready`` condition."""

    ready: bool
    reason: str
    message: str
    paused_by_annotation: bool = False
    one_way_pause: str = ""  # "scale-in", "scale-out": KEDA's one-way pauses (Paused stays False, as in KEDA)
    notes: tuple[str, ...] = ()
    in_force: bool = False  # not ready, but an earlier valid record still runs (InvalidSpec of an edit)


def _one_way(verdict: Verdict) -> str:
    """The Paused=False message: not paused, and a one-way pause if one is on (KEDA's is not Paused either)."""
    if verdict.one_way_pause:
        return f"not paused; {verdict.one_way_pause} is paused by annotation (scaling the other way goes on)"
    return "not paused"


def _paused(verdict: Verdict, row: StatusRow) -> tuple[str, str]:
    """Reason and message of the Paused condition from the autoscaler's row. Paused by an on-call command only
    when the row carries a ``pause`` override (`pulsescale pause`); otherwise the pause is the annotation's, even in
    the round where the autoscaler has the new record and this verdict does not (or the reverse)."""
    if not row.paused:
        return "NotPaused", _one_way(verdict)
    override = row.override
    if override is not None and override.kind == "pause":
        holding = f" (holding {override.replicas})" if override.replicas is not None else ""
        by = f" by {override.by}" if override.by else ""
        return "PausedByCommand", f"paused by an on-call command{holding}{by}"
    return "PausedByAnnotation", "paused by annotation"


def _condition(
    previous: dict[str, Any], kind: ConditionType, status: ConditionStatus, reason: str, message: str,
    generation: int | None, now: float,
) -> Condition:  # fmt: skip
    old = previous.get(kind) or {}
    # The transition time moves only when the status changes (metav1.Condition semantics).
    since = old.get("lastTransitionTime") if old.get("status") == status else None
    return Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since or rfc3339(now),
        observed_generation=generation,
    )


def compose(
    body: dict[str, Any],
    verdict: Verdict,
    row: StatusRow | None,
    now: float,
    active_window_s: float = DEFAULT_ACTIVE_WINDOW_S,
    silent_since: float | None = None,
) -> ScaledObjectStatus:
    """The status the object should carry now (see the module docstring). `silent_since`: the autoscaler has not
    answered since then; `row` is its last answer (counts kept), Active and Fallback become Unknown."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    current = body.get("status") or {}
    generation = meta.get("generation")
    generation = generation if isinstance(generation, int) else None
    previous: dict[str, Any] = {str(c.get("type")): c for c in current.get("conditions") or [] if isinstance(c, dict)}
    target = spec.get("scaleTargetRef") or {}
    target_kind = f"{target.get('apiVersion', 'apps/v1')}.{target.get('kind', 'Deployment')}" if target else None

    conditions = [
        _condition(previous, "Ready", "True" if verdict.ready else "False", verdict.reason, verdict.message,
                   generation, now),
    ]  # fmt: skip
    if row is None:
        why = "the autoscaler has not reported this ScaledObject yet" if verdict.ready else verdict.message
        for kind in _UNKNOWABLE:
            conditions.append(_condition(previous, kind, "Unknown", "NotReported", why, generation, now))
        paused = verdict.paused_by_annotation
        conditions.append(
            _condition(previous, "Paused", "True" if paused else "False",
                       "PausedByAnnotation" if paused else "NotPaused",
                       "paused by annotation" if paused else _one_way(verdict), generation, now)
        )  # fmt: skip
    elif silent_since is not None:
        why = (
            f"the autoscaler has not answered {protocol.cmd_subject('status')} since {rfc3339(silent_since)}; "
            "the replica counts are from then"
        )
        for kind in _UNKNOWABLE:
            conditions.append(_condition(previous, kind, "Unknown", "AutoscalerNotReporting", why, generation, now))
        conditions.append(
            _condition(previous, "Paused", "True" if row.paused else "False", *_paused(verdict, row), generation,
                       now)
        )  # fmt: skip
    else:
        # As KEDA's Active: the trigger's demand is above its activation threshold now, i.e. the autoscaler saw
        # such demand within `active_window_s` (two status rounds), not "it has replicas" (minReplicaCount > 0).
        seen = row.last_active_at
        active = scaler_active(seen, now, active_window_s)  # the rule `pulsescale get so` uses too
        # Only what changes with the state: the policy's reason (with its ever-growing "stale 12 s") is in
        # lastDecisions; here it would make every status round a patch.
        detail = f"desired {row.desired}, ready {row.ready}, activating {row.activating}, mode {row.mode}"
        if seen is None:
            detail = f"no demand above the activation threshold seen; {detail}"
        elif active:
            detail = f"demand above the activation threshold; {detail}"
        else:
            detail = f"no demand above the activation threshold since {rfc3339(seen)}; {detail}"
        conditions.append(
            _condition(previous, "Active", "True" if active else "False",
                       "ScalerActive" if active else "ScalerNotActive", detail, generation, now)
        )  # fmt: skip
        conditions.append(
            _condition(previous, "Fallback", "True" if row.fallback else "False",
                       "FallbackInForce" if row.fallback else "NoFallback",
                       "metrics are stale beyond fallback.failureThreshold; holding the fallback count"
                       if row.fallback else "", generation, now)
        )  # fmt: skip
        how, message = _paused(verdict, row)
        conditions.append(
            _condition(previous, "Paused", "True" if row.paused else "False", how, message, generation, now)
        )
    decisions = None
    if row is not None and row.decisions:
        decisions = [
            LastDecision(time=rfc3339(d.ts), desired=d.desired, reason=d.reason[:4096])
            for d in row.decisions[-MAX_LAST_DECISIONS:]
        ]
    return ScaledObjectStatus(
        conditions=conditions,
        observed_generation=generation,
        scale_target_kind=target_kind,
        scale_target_name=target.get("name") if isinstance(target.get("name"), str) else None,
        current_replicas=None if row is None else row.ready + row.activating,
        desired_replicas=None if row is None else row.desired,
        ready_replicas=None if row is None else row.ready,
        warm_slots=None if row is None else row.warm,
        cold_requested=None if row is None else row.cold_requested,
        last_active_time=None if row is None or row.last_active_at is None else rfc3339(row.last_active_at),
        last_scale_time=None if row is None or row.last_scale_at is None else rfc3339(row.last_scale_at),
        last_decisions=decisions,
        notes=list(verdict.notes) or None,
        # originalReplicaCount is the cold path's (kube/coldpath.py): never in this patch, so a stale copy of the
        # object here cannot write an old value back.
    )


def body_of(status: ScaledObjectStatus, current: dict[str, Any] | None = None) -> dict[str, Any]:
    """The merge-patch body of the status subresource: the composed fields, and null for a field this module owns
    that the object carries but the composed status no longer has (a merge patch deletes a key only by null)."""
    out: dict[str, Any] = msgspec.to_builtins(status)
    for key in _OWNED:
        if key not in out and key in (current or {}):
            out[key] = None
    return out


def differs(patch: dict[str, Any], current: dict[str, Any] | None) -> bool:
    """Whether applying `patch` (a `body_of`) to `current` would change anything."""
    current = current or {}
    for key, value in patch.items():
        if value is None:
            if key in current:
                return True
        elif current.get(key) != value:
            return True
    return False


@dataclass(frozen=True)
class ModeChange:
    """A condition that flipped between two statuses, for a Kubernetes Event."""

    type: ConditionType
    status: str
    event_type: str  # "Normal" or "Warning"
    reason: str
    message: str


_CHANGE_EVENTS: Final[dict[tuple[str, str], tuple[str, str]]] = {
    ("Fallback", "True"): ("Warning", "FallbackActivated"),
    ("Fallback", "False"): ("Normal", "FallbackEnded"),
    ("Paused", "True"): ("Normal", "Paused"),
    ("Paused", "False"): ("Normal", "Resumed"),
    ("Active", "True"): ("Normal", "Activated"),
    ("Active", "False"): ("Normal", "Deactivated"),
}


def mode_changes(before: dict[str, Any] | None, after: dict[str, Any]) -> list[ModeChange]:
    """The Active/Fallback/Paused conditions whose status changed from `before` to `after` (status bodies), except
    from or to Unknown (no news); and Paused=True on the first status (created paused)."""
    old = {c.get("type"): c for c in (before or {}).get("conditions") or []}
    out = []
    for cond in after.get("conditions") or []:
        kind, status = cond.get("type"), cond.get("status")
        prior = (old.get(kind) or {}).get("status")
        # A first status that is already paused is news too (an object created paused); other first values not.
        first_pause = prior is None and (kind, status) == ("Paused", "True")
        if (kind, status) in _CHANGE_EVENTS and (first_pause or prior not in (None, "Unknown", status)):
            event_type, reason = _CHANGE_EVENTS[(kind, status)]
            out.append(ModeChange(kind, status, event_type, reason, cond.get("message") or reason))
    return out


# --- the mirror in pulse_objects (contract revision 13) ----------------------------------------------------------

_TARGET: Final = re.compile(protocol.TARGET_PATTERN)
_MODEL: Final = re.compile(protocol.NAME_PATTERN)
_LABEL_KEY: Final = re.compile(protocol.LABEL_KEY_PATTERN)
_LABEL_VALUE: Final = re.compile(protocol.LABEL_VALUE_PATTERN)
_REASON: Final = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")
_MESSAGE_CHARS: Final = 4096  # `protocol.Text`: a longer message is cut, marked with an ellipsis


def model_of(body: Any) -> str | None:
    """The model a ScaledObject body names (first trigger's ``metadata.model``), None if it names none. Reads any
    shape without raising: a body here may never have passed the validator (a list for ``metadata``, a string for
    ``triggers``), and a bug on one object must not stop the loops for every other one."""
    spec = body.get("spec") if isinstance(body, dict) else None
    triggers = spec.get("triggers") if isinstance(spec, dict) else None
    first = triggers[0] if isinstance(triggers, list) and triggers else None
    metadata = first.get("metadata") if isinstance(first, dict) else None
    model = metadata.get("model") if isinstance(metadata, dict) else None
    return model if isinstance(model, str) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _labels(value: Any) -> dict[str, str]:
    """The labels as the contract carries them; none where they do not fit (more than `protocol.MAX_LABELS`: the
    reader publishes such an object without them too, `manifests.conversion`, since a cut set would match other
    selectors than the CR's)."""
    if not isinstance(value, dict) or len(value) > protocol.MAX_LABELS:
        return {}
    fits = all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 317 and len(v) <= 63
        and _LABEL_KEY.match(k) and _LABEL_VALUE.match(v)
        for k, v in value.items()
    )  # fmt: skip
    return dict(value) if fits else {}


def _mirrored(c: Condition) -> protocol.ObjectCondition:
    message = c.message if len(c.message) <= _MESSAGE_CHARS else c.message[: _MESSAGE_CHARS - 1] + "\u2026"
    reason = c.reason if len(c.reason) <= protocol.MAX_CONDITION_REASON and _REASON.fullmatch(c.reason) else ""
    return protocol.ObjectCondition(
        type=c.type, status=c.status, reason=reason, message=message, since=bodies.parse_time(c.last_transition_time)
    )


def mirror_of(
    body: dict[str, Any], composed: ScaledObjectStatus, *, published: bool, now: float
) -> protocol.ObjectStatus:
    """The object's `protocol.ObjectStatus`: the conditions just composed for its status (what the CR carries once
    patched), whether its record is in force (`published`), and what can be read of its spec and metadata; a field
    that does not fit the contract is left out (None, or no labels), never guessed. Raises `BadMessage` when the
    object itself cannot be named in it (not a Kubernetes name: never from a real API server)."""
    meta = body.get("metadata") or {}
    spec: dict[str, Any] = body["spec"] if isinstance(body.get("spec"), dict) else {}
    ref: dict[str, Any] = spec["scaleTargetRef"] if isinstance(spec.get("scaleTargetRef"), dict) else {}
    target = f"{ref.get('kind') or 'Deployment'}/{ref.get('name')}" if isinstance(ref.get("name"), str) else None
    model = model_of(body)
    record = protocol.ObjectStatus(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        published=published,
        conditions=[_mirrored(c) for c in composed.conditions or []],
        model=model if model is not None and _MODEL.match(model) else None,
        target=target if target is not None and len(target) <= 317 and _TARGET.match(target) else None,
        min_replicas=_count(spec.get("minReplicaCount")),
        max_replicas=_count(spec.get("maxReplicaCount")),
        labels=_labels(meta.get("labels")),
        generation=composed.observed_generation,
        created_at=bodies.parse_time(meta.get("creationTimestamp")),
        updated_at=now,
    )
    # Built from a body the validator may have refused: checked as a reader will check it, before it is written.
    return protocol.decode(protocol.encode(record), protocol.ObjectStatus)
