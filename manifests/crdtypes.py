"""The ScaledObject CRD's identity and its status types: what the operator writes and `pulsescale get` reads.

The group, version and names (``scaledobjects.pulsescale.io``, short name ``pso``), the condition types, and
`ScaledObjectStatus` with its parts: the struct the operator builds and merge-patches onto the status
subresource (kube/status.py), whose schema is the CRD's ``status`` (manifests/crdschema.py) and whose field
docstrings are the descriptions there and on docs/scaledobject.md (read from this module's source with `ast`,
manifests/crdnotes.py: keep them right under each field). `scaler_active` is the one rule of ``Active``. Pure.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from warmpool.protocol import Count

__all__ = [
    "ACTIVE_WINDOW_S",
    "CONDITION_TYPES",
    "CRD_NAME",
    "GROUP",
    "MAX_LAST_DECISIONS",
    "PLURAL",
    "SHORT_NAMES",
    "VERSION",
    "ColdPathStatus",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "LastDecision",
    "Rfc3339",
    "ScaledObjectStatus",
    "scaler_active",
]

GROUP: Final = "pulsescale.io"
VERSION: Final = "v1alpha1"
PLURAL: Final = "scaledobjects"
CRD_NAME: Final = f"{PLURAL}.{GROUP}"
SHORT_NAMES: Final = ("pso",)
"""Not KEDA's ``so``: with both CRDs installed (a migration), ``kubectl get so`` would pick one of the two
silently. ``pso`` is free, and ``kubectl get scaledobjects.pulsescale.io`` always names ours."""

MAX_LAST_DECISIONS: Final = 10
"""Decisions kept in ``status.lastDecisions`` (newest last): enough to explain the last minutes, small enough that
the object stays far below etcd's 1.5 MiB."""

ACTIVE_WINDOW_S: Final = 10.0
"""`scaler_active`'s default: demand above the activation threshold this recently is Active (the operator's two
status rounds at 5 s; `pulsescale get so` polls once)."""


def scaler_active(last_active_at: float | None, now: float, window_s: float = ACTIVE_WINDOW_S) -> bool:
    """KEDA's ``Active``: the trigger's demand was above its activation threshold within `window_s` (the
    autoscaler's `StatusRow.last_active_at`), not "it has replicas" (minReplicaCount > 0 is not activity). The one
    rule of the CR's condition (kube/status.py) and `pulsescale get so` (oncall/get.py); no report of
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
    """Replicas the autoscaler asked for (the warm pool's shortfall) in this episode's last request; the target's
    own replicas count towards it, so the target is raised to at least this many, never by this many."""
    from_replicas: Count
    """The target's replica count when the episode began."""
    to_replicas: Count
    """The count the target runs for the request: the current count when it already covers it, else the request
    (at most ``maxReplicaCount``)."""
    time: Rfc3339
    """When the episode was last written."""


class ScaledObjectStatus(_Camel, kw_only=True):
    """``status`` of a pulsescale ScaledObject: what the operator patches from the autoscaler's `StatusRow`.

    Field names are KEDA's where KEDA has one (``conditions``, ``originalReplicaCount``, ``pausedReplicaCount``,
    ``lastActiveTime``, ``scaleTargetKind``); the rest say what pulsescale adds (warm slots, the cold path, decisions
    with reasons).
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
    two per trigger and four more)."""
    original_replica_count: Count | None = None
    """The target's replica count before the first scale, for ``advanced.restoreToOriginalReplicaCount``."""
    cold_path: ColdPathStatus | None = None
    """The cold path's current episode; removed (merge patch ``null``) when the autoscaler's shortfall is met."""
    paused_replica_count: Count | None = None
    """As KEDA: the count the ``paused-replicas`` annotation set the target to (through its scale subresource);
    removed when the annotation goes."""
