"""The ScaledObject CRD (``scaledobjects.pulsescale.io``, ``v1alpha1``), generated from the one schema.

The spec's OpenAPI schema is `msgspec.json.schema(protocol.ScaledObjectSpec)` made structural (every ``$ref``
inlined, every node typed), so the CRD, ``pulsescale apply``'s validation (autoscaler/scaledobject.py decodes
into the same type) and docs/scaledobject.md cannot drift apart. The status is `ScaledObjectStatus`, the struct
the operator builds and patches, so its schema cannot drift from what the operator writes either.

Pure: no I/O libraries. `main` (``pulsescale crd``) prints; it writes nothing.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from warmpool.protocol import Count

__all__ = [
    "CONDITION_TYPES",
    "MAX_LAST_DECISIONS",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "LastDecision",
    "ScaledObjectStatus",
]

MAX_LAST_DECISIONS: Final = 10
"""Decisions kept in ``status.lastDecisions`` (newest last): enough to explain the last minutes, small enough that
the object stays far below etcd's 1.5 MiB."""

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


class ScaledObjectStatus(_Camel, kw_only=True):
    """``status`` of a pulsescale ScaledObject: what the operator patches from the autoscaler's `StatusRow`.

    Field names are KEDA's where KEDA has one (``conditions``, ``originalReplicaCount``, ``lastActiveTime``,
    ``scaleTargetKind``); the rest say what pulsescale adds (warm slots, the cold path, decisions with reasons).
    Every field is optional so a partial patch (merge patch of the status subresource) is a valid status.
    """

    conditions: list[Condition] | None = None
    observed_generation: Count | None = None
    """The ``metadata.generation`` of the spec this status describes."""
    scale_target_kind: str | None = None
    """``<apiVersion>.<kind>`` of the target as KEDA writes it (``apps/v1.Deployment``)."""
    scale_target_name: str | None = None
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
    notes: list[str] | None = None
    """One line per accepted field that has no effect here, and why (the ScalerRecord's notes)."""
    original_replica_count: Count | None = None
    """The target's replica count before the first scale, for ``advanced.restoreToOriginalReplicaCount``."""
