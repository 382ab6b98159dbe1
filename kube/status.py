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
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Final

import msgspec

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
    "mode_changes",
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
