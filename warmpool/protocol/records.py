"""KV records of wire contract v1: the values stored in the registry's buckets.

- `pulse_slots`: `SlotRecord` under ``<model>.<node>.<slot>``.
- `pulse_agents`: `AgentLease` under ``<node>``.
- `pulse_assignments`: `NodeAssignment` under ``<node>`` (revision 11).
- `pulse_scalers`: `ScalerRecord` (a `ScaledObjectSpec`) under ``<namespace>.<name>``.
- `pulse_objects`: `ObjectStatus` (a ScaledObject CR and the conditions on it) under ``<namespace>.<name>``
  (revision 13).
- `pulse_leases`: `LeaderLease` (the leader and each shard), `ReplicaRecord`, `OverrideRecord` (an `Override`) and
  `ScheduleRecord` (`OnCallSchedule`s); their keys are spelled in `warmpool.protocol.names`.

Pure: no I/O.
"""

# msgspec copies a mutable default (`= []`) per instance; ruff cannot tell these classes are Structs when
# their base (`Message`) is imported from another module, so RUF012 is off here.
# ruff: noqa: RUF012

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

import msgspec

from warmpool.protocol.base import Count, Id, Message, Name, Text, _finite, _not_negative
from warmpool.protocol.names import (
    IDENTITY_PATTERN,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    MAX_CLOCK_SKEW_S,
    MAX_CONDITION_REASON,
    MAX_LABELS,
    MAX_LEASE_S,
    MAX_MODELS_PER_NODE,
    MAX_OBJECT_CONDITIONS,
    MAX_SCHEDULES,
    MAX_SLOTS_PER_NODE,
    OBJECT_NAME_PATTERN,
    SHARDS,
    TARGET_PATTERN,
    EngineMode,
    SlotState,
)
from warmpool.protocol.scaledobject import ScaledObjectSpec, Schedule, check_schedules

LabelKey = Annotated[str, msgspec.Meta(pattern=LABEL_KEY_PATTERN, max_length=317)]  # 253 prefix + / + 63
LabelValue = Annotated[str, msgspec.Meta(pattern=LABEL_VALUE_PATTERN, max_length=63)]
ObjectName = Annotated[str, msgspec.Meta(pattern=OBJECT_NAME_PATTERN, max_length=253)]
ConditionReason = Annotated[
    str, msgspec.Meta(pattern=r"^([A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?)?$", max_length=MAX_CONDITION_REASON)
]  # metav1.Condition's reason, or empty

__all__ = [
    "AgentLease",
    "LeaderLease",
    "NodeAssignment",
    "ObjectCondition",
    "ObjectStatus",
    "OnCallSchedule",
    "Override",
    "OverrideRecord",
    "ReplicaRecord",
    "ScalerRecord",
    "ScheduleRecord",
    "SlotRecord",
]

# --- KV records ---------------------------------------------------------------------------------------------------


class SlotRecord(Message, kw_only=True):
    """The value under ``<model>.<node>.<slot>`` in `pulse_slots`.

    `token` is the fencing token of the current claim (the claim write's revision) once known; `claim_id` is the
    claimer's random id. `drain` (added in v1, optional) asks that the slot go to `draining` instead of `warm`
    when its current holder releases it.
    """

    model: Name
    node: Name
    slot: Name
    state: SlotState
    rack: str = ""
    endpoint: str | None = None
    token: int | None = None
    claim_id: str | None = None
    weights_resident: bool = False
    rootfs_mounted: bool = False
    updated_at: float = 0.0
    reason: Text | None = None
    drain: bool = False
    engine: str | None = None
    """Revision 4: the slot's engine adapter (``local``, ``command``, ``vllm``)."""
    engine_mode: EngineMode | None = None
    """Revision 4: how the last activation took the engine into service: ``fork`` (a zygote forked the engine),
    ``wake`` (a sleeping standby server was woken), ``resident`` (a standby server already held its weights)."""
    image_digest: str | None = None
    """Revision 4: content digest (``sha256:...``) of the EROFS rootfs image the slot's engine runs from, if any."""

    @property
    def key(self) -> str:
        return f"{self.model}.{self.node}.{self.slot}"

    def _validate(self) -> None:
        _finite(self, "updated_at")


class AgentLease(Message, kw_only=True):
    """The value under ``<node>`` in `pulse_agents`: a heartbeat judged fresh by the reader's clock (since revision
    10 by when the reader heard it, `warmpool.agentclocks`; `fresh` is the rule for a lease only listed)."""

    node: Name
    slots: list[Name] = []
    heartbeat_at: float
    lease_s: float
    rack: str = ""
    gpus: Count = 0
    shm_free_bytes: Count = 0
    heartbeat_every_s: float | None = None
    """How often the agent renews (revision 2): after an outage, leases are judged only once agents had this long
    to renew. None (older agents): a third of `lease_s`."""

    def _validate(self) -> None:
        _finite(self, "heartbeat_at", "lease_s", "heartbeat_every_s")
        _not_negative(self, "heartbeat_every_s")
        if self.lease_s <= 0:
            raise ValueError("[bad_value] `lease_s` must be > 0")
        if self.lease_s > MAX_LEASE_S:
            raise ValueError(f"[bad_value] `lease_s` is {self.lease_s:g} s, at most {MAX_LEASE_S:g} s is honoured")
        if len(self.slots) > MAX_SLOTS_PER_NODE:
            raise ValueError(
                f"[bad_value] the lease of {self.node} lists {len(self.slots)} slots; at most {MAX_SLOTS_PER_NODE} "
                "are honoured"
            )

    def fresh(self, now: float) -> bool:
        """Renewed within `lease_s` of `now`, and not dated ahead of it by more than the allowed clock skew."""
        return self.heartbeat_at <= now + MAX_CLOCK_SKEW_S and now <= self.heartbeat_at + self.lease_s

    @property
    def renew_every_s(self) -> float:
        return self.heartbeat_every_s if self.heartbeat_every_s else self.lease_s / 3


class NodeAssignment(Message, kw_only=True):
    """Revision 11: the value under ``<node>`` in `pulse_assignments`: the models the node may offer slots of.

    The node's agent may write any key under its node in `pulse_slots`, model included; this record, which only the
    operator's user may write, is what binds the node to its models. A reader refuses a `warm` or `ready` slot of
    another model on the node (``unassigned_model``). An empty `models` offers nothing; no record at all is the
    reader's choice (`warmpool.slotindex.Assignments`: unbound unless it requires an assignment)."""

    OPERATOR: ClassVar[str] = "pulsescale-operator"
    """`by` of a record the Kubernetes operator keeps (the models of its standby pods on the node); a record with
    another `by` was written by a person (``pulsescale assign``) and the operator leaves it alone
    (``pulsescale assign NODE --hand-back`` gives it back)."""

    node: Name
    models: Annotated[list[Name], msgspec.Meta(max_length=MAX_MODELS_PER_NODE)] = []
    by: Text = ""
    """Who wrote it (``pulsescale assign --by``; default the user and host; `OPERATOR`: the operator)."""
    updated_at: float = 0.0

    @property
    def key(self) -> str:
        return self.node

    def _validate(self) -> None:
        _finite(self, "updated_at")


class ScalerRecord(Message, kw_only=True):
    """The value under ``<namespace>.<name>`` in `pulse_scalers`: a ScaledObject as the operator or
    `pulsescale apply` wrote it, with the KEDA-style pause annotations resolved."""

    namespace: Name
    name: Name
    spec: ScaledObjectSpec
    paused: bool = False
    paused_replicas: Count | None = None
    generation: Count = 0
    updated_at: float = 0.0
    paused_scale_in: bool = False
    """Revision 5: KEDA's ``paused-scale-in`` annotation: the policy may scale out, never in."""
    paused_scale_out: bool = False
    """Revision 5: KEDA's ``paused-scale-out`` annotation: the policy may scale in, never out."""
    notes: list[str] = []
    """Revision 5: one line per accepted field that has no effect here, and why (shown by apply and the status)."""
    created_at: float | None = None
    """Revision 5: when the ScaledObject was created (the CR's creationTimestamp; `apply`: its first write), Unix s.
    `initialCooldownPeriod` counts from it; None: from when the autoscaler first saw the record."""
    labels: dict[LabelKey, LabelValue] = {}
    """Revision 12: the ScaledObject's ``metadata.labels``, for ``pulsescale get -l``; nothing acts on them."""
    managed_by: Text = ""
    """Revision 14: who keeps the record: `OPERATOR` when the Kubernetes operator published it from a ScaledObject
    CR (``pulsescale apply`` refuses to replace such a record, and writes "" itself), "" otherwise."""

    OPERATOR: ClassVar[str] = "pulsescale-operator"

    @property
    def published_by_operator(self) -> bool:
        """Whether the Kubernetes operator wrote this record from a ScaledObject CR (`managed_by`)."""
        return self.managed_by == self.OPERATOR

    def unmanaged(self) -> ScalerRecord:
        """This record as ``pulsescale apply`` writes it: `managed_by` empty."""
        return msgspec.structs.replace(self, managed_by="") if self.managed_by else self

    def _validate(self) -> None:
        if len(self.labels) > MAX_LABELS:
            raise ValueError(f"[bad_value] `labels` has {len(self.labels)} entries, more than {MAX_LABELS}")

    @property
    def key(self) -> str:
        return f"{self.namespace}.{self.name}"


class ObjectCondition(msgspec.Struct, kw_only=True, frozen=True):
    """Revision 13: one condition of a ScaledObject CR's status as the operator wrote it (``metav1.Condition``).

    `type` is a name, not a closed list, so a newer operator's condition does not make the record unreadable."""

    type: Annotated[str, msgspec.Meta(pattern=r"^[A-Z][A-Za-z0-9]{0,63}$")]
    status: Literal["True", "False", "Unknown"]
    reason: ConditionReason = ""
    message: Text = ""
    """As on the CR, cut to `Text`'s 4096 characters (the operator's own messages are far shorter)."""
    since: float | None = None
    """``lastTransitionTime``, Unix s."""


class ObjectStatus(Message, kw_only=True):
    """Revision 13: the value under ``<namespace>.<name>`` in `pulse_objects`: a ScaledObject CR as the operator
    saw it, published or not, and the conditions it wrote to the CR's status.

    The operator writes it with the CR's status (the same conditions, no further API calls) and deletes it when the
    CR goes, after its finalizer; ``pulsescale get so`` reads it so that it says what the CR says, and lists the
    objects the operator refused (`published` False), with their reason. What the spec says is only as far as the
    operator could read it (None: absent or unreadable): the spec in force is the `ScalerRecord`'s."""

    namespace: Name
    name: ObjectName
    published: bool = False
    """Its `ScalerRecord` is in `pulse_scalers` (in force, even where Ready is False: a refused edit, a missing
    target)."""
    conditions: Annotated[list[ObjectCondition], msgspec.Meta(max_length=MAX_OBJECT_CONDITIONS)] = []
    model: Name | None = None
    target: Annotated[str, msgspec.Meta(pattern=TARGET_PATTERN, max_length=317)] | None = None
    """``Kind/name`` of ``spec.scaleTargetRef`` (the kind Deployment where it names none)."""
    min_replicas: Count | None = None
    max_replicas: Count | None = None
    labels: dict[LabelKey, LabelValue] = {}
    """The CR's ``metadata.labels`` (empty where they are more than `MAX_LABELS`: such an object is published
    without them, as its `ScalerRecord`)."""
    generation: Count | None = None
    """The CR's ``metadata.generation`` the conditions were written for (``observedGeneration``)."""
    created_at: float | None = None
    """The CR's creationTimestamp, Unix s."""
    updated_at: float = 0.0
    """When the operator wrote this content, Unix s."""

    def _validate(self) -> None:
        _finite(self, "created_at", "updated_at")
        if len(self.labels) > MAX_LABELS:
            raise ValueError(f"[bad_value] `labels` has {len(self.labels)} entries, more than {MAX_LABELS}")
        types = [c.type for c in self.conditions]
        if len(set(types)) != len(types):
            raise ValueError("[bad_value] `conditions` names a type twice")
        for c in self.conditions:
            if c.since is not None and not math.isfinite(c.since):
                raise ValueError("[non_finite] `conditions[].since` must be a finite number")

    @property
    def key(self) -> str:
        return f"{self.namespace}.{self.name}"

    def condition(self, kind: str) -> ObjectCondition | None:
        """The condition of type `kind`, None when the CR has none."""
        return next((c for c in self.conditions if c.type == kind), None)


# --- leader lease and overrides (KV pulse_leases) -------------------------------------------------------------


class LeaderLease(Message, kw_only=True):
    """The value under `LEADER_LEASE_KEY` in `pulse_leases`: who leads, judged by ``renewed_at + lease_s``."""

    holder: Id
    renewed_at: float
    lease_s: float

    def _validate(self) -> None:
        _finite(self, "renewed_at", "lease_s")
        if self.lease_s <= 0:
            raise ValueError("[bad_value] `lease_s` must be > 0")


class Override(msgspec.Struct, kw_only=True, frozen=True):
    """An on-call override: ``scale`` holds `replicas` until `expires_at`; ``pause`` holds `replicas` (or the
    current count when None) until resumed. It beats the policy while it lasts."""

    kind: Literal["scale", "pause"]
    replicas: Count | None = None
    expires_at: float | None = None
    by: Text = ""


class OverrideRecord(Message, kw_only=True):
    """The value under ``override.<model>`` in `pulse_leases`."""

    model: Name
    override: Override


class OnCallSchedule(msgspec.Struct, kw_only=True, frozen=True):
    """Revision 8: a schedule set by ``pulsescale schedule``, with who set it and when (Unix s)."""

    schedule: Schedule
    by: Text = ""
    set_at: float = 0.0


class ScheduleRecord(Message, kw_only=True):
    """Revision 8: the value under ``schedule.<model>`` in `pulse_leases`: the model's on-call schedules."""

    model: Name
    schedules: Annotated[list[OnCallSchedule], msgspec.Meta(max_length=MAX_SCHEDULES)] = []

    def _validate(self) -> None:
        check_schedules([s.schedule for s in self.schedules])


class ReplicaRecord(Message, kw_only=True):
    """The value under ``replica.<identity>`` in `pulse_leases` (revision 6): a live autoscaler replica, judged by
    ``renewed_at + lease_s`` like a lease. Shards are assigned over the live replicas; `shards` is what it holds."""

    identity: Annotated[str, msgspec.Meta(pattern=IDENTITY_PATTERN)]
    renewed_at: float
    lease_s: float
    started_at: float
    shards: list[Annotated[int, msgspec.Meta(ge=0, lt=SHARDS)]] = []
    models: Count = 0
    """ScaledObjects in the shards it holds."""

    def _validate(self) -> None:
        _finite(self, "renewed_at", "lease_s", "started_at")
        if not 0 < self.lease_s <= MAX_LEASE_S:
            raise ValueError(f"[bad_value] `lease_s` must be in (0, {MAX_LEASE_S:.0f}]")
