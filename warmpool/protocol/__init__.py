"""Wire contract v1: every subject, bucket, and message pulsescale puts on NATS.

Gateways and tools are written against it, so it only grows by adding optional fields. All messages are UTF-8 JSON
objects with ``"v": 1``; unknown fields are ignored. `decode` enforces every rule of DESIGN.md ("Wire contract v1")
and raises `BadMessage` with one of `REASONS`, so consumers count rejections by reason and keep going.

This package is the face: import from here (``from warmpool import protocol``, ``from warmpool.protocol import X``).
Its parts, each spelled in one place:

- `warmpool.protocol.names`: subjects, bucket names, KV key spelling, limits, `REASONS` and `ERROR_CODES`.
- `warmpool.protocol.base`: the field types and the `Message`/`Request` bases.
- `warmpool.protocol.messages`: samples, on-call commands, agent requests, events and audit records.
- `warmpool.protocol.records`: the KV records (slots, agent leases, scalers, CRs' status, leases, overrides, schedules,
  replicas).
- `warmpool.protocol.scaledobject`: the ScaledObject wire type (`ScaledObjectSpec`) and its parts.
- `warmpool.protocol.replies`: command and agent replies, and the status rows they carry.
- `warmpool.protocol.codec`: `encode`/`decode`, the decoder cache, the request freshness check.

Revisions of v1 (each only adds fields or tightens a request only our own autoscaler sends; ``v`` stays 1):

- revision 1: the first contract.
- revision 2: a `DeactivateRequest` must carry `claim_id` (the fencing token alone is public: anyone who reads
  `pulse_slots` could stop a serving slot with it); one without is refused ``missing_field``. Replies, the leader
  lease and the stored overrides became types of this module (`ActivateReply`, `StatusReply`, `PoolReply`,
  `AgentStatusReply`, `LeaderLease`, `OverrideRecord`, ...) with the fields they already had; `StatusRow` adds
  `stale` (warm slots whose agent's lease lapsed) and `AgentLease` adds `heartbeat_every_s`. Reply error codes
  are listed in `ERROR_CODES`.
- revision 3 (security): an `AgentLease` with `lease_s` over `MAX_LEASE_S` is refused ``bad_value``, and one whose
  `heartbeat_at` is more than `MAX_CLOCK_SKEW_S` ahead of the reader's clock is not fresh; a request whose
  `expires_at` is more than `MAX_REQUEST_TTL_S` ahead is refused ``too_late``; an agent with too many requests in
  flight answers ``busy``; `Event.claim_id` and `AgentSlotStatus.claim_id` are never set. `ActivateReply.endpoint`
  is informational: a slot's serving endpoint is the one in its record's fenced ``ready`` write, never a reply's.
- revision 4 (real engines, rootfs): `SlotRecord` adds `engine`, `engine_mode` (``fork``, ``wake``, ``resident``)
  and `image_digest`; `ActivateReply` and `AgentSlotStatus` add `engine_mode`, the status adds the engine's
  `log_path`/`log_tail`, `WeightsStatus` adds `hashed_bytes`, `budget_bytes` and `progress`, `AgentStatusReply`
  adds `rootfs` (`RootfsStatus`), and `PoolSlot` adds the slot's engine, mode, rootfs and image digest. A slot is
  claimable only when its node's fresh lease lists it in `slots`, and a lease listing more than `MAX_SLOTS_PER_NODE`
  is refused ``bad_value``; a record whose fields name another key than its own is refused ``subject_mismatch``.
- revision 5 (KEDA compatibility, Kubernetes): `ScaledObjectSpec` adds KEDA's `pollingInterval` and
  `initialCooldownPeriod` (and `scaleTargetRef.envSourceContainerName`); `Trigger` adds `name`, `metricType` (only
  ``AverageValue``), `useCachedMetrics` and `authenticationRef`; `Fallback` adds `behavior`; `Advanced` adds
  `restoreToOriginalReplicaCount`, `horizontalPodAutoscalerConfig` (HPA `behavior`, mapped onto the policy),
  `scaleDownPods` and `scaleDownSelectPolicy`; `ScalerRecord` adds `paused_scale_in`/`paused_scale_out` (KEDA's
  annotations of those names), `notes` (why an accepted field has no effect) and `created_at`; `StatusRow` adds the
  ScaledObject's key, `fallback`, `paused`, `cold_requested`, `last_active_at` and `last_scale_at`, for the operator's
  status subresource.
- revision 6 (fleet scale, sharding): models are split into `SHARDS` shards by `shard_of`; each shard is a lease
  (`LeaderLease` under ``shard.<n>`` in `pulse_leases`) held by one autoscaler replica at a time, and each replica
  announces itself with a `ReplicaRecord` under ``replica.<identity>``. On-call commands reach any replica, which
  hands a model's command to the replica owning its shard on ``pulse.autoscaler.<identity>.cmd.<verb>``.
  `StatusRow` adds `owner` and `shard`; `StatusReply` adds `replicas` and `missing` (replicas that did not answer).
- revision 7 (rootfs pinned): `RootfsStatus` adds `pinned_bytes` and `pin_refused`: the agent locks its mounted
  image's pages in memory (``--pin-rootfs``, on by default) and says how much it holds and why it stopped.
- revision 8 (scheduled warm-up, KEDA's cron scaler): `ScaledObjectSpec` adds `schedules` (`Schedule`: `name`,
  `start` a local ISO-8601 date-time, `timezone` an IANA zone, `durationSeconds`, `replicas`), each raising the
  model's floor to `replicas` from its start for its duration; a new on-call verb ``schedule``
  (`ScheduleCommand`: add one, delete one by name, or list; answered by `ScheduleReply`) keeps on-call schedules
  under ``schedule.<model>`` in `pulse_leases` (`ScheduleRecord`), so a new owner keeps them; `StatusRow` adds
  `scheduled_floor`, `schedules` (`ScheduleRow`: those in force and the next to start) and `pool_floor` (the
  slots the warm pool should hold, from `autoscaler.decide.schedules.POOL_LEAD_S` before a start). Schedules whose
  windows overlap with different `replicas` are refused ``bad_value`` (identical floors may overlap: the floor is the
  same either way); `replicas` over `maxReplicaCount`, a duration over `MAX_SCHEDULE_S`, an unknown zone are refused.
  The verb's refusals: ``out_of_bounds`` (floor over ``maxReplicaCount`` or the autoscaler's limit, already ended,
  starting more than a year ahead, too many schedules), ``conflict`` (overlaps another schedule of the model with a
  different floor, or the name is taken) and ``unknown_schedule`` (delete of a name it does not have): two new
  `ERROR_CODES`.
- revision 9 (a scale-in hold sized from the warm path): `Advanced.scaleDownStabilizationSeconds`,
  `scaleDownPeriodSeconds` and `scaleDownPercent` may be left unset, and are unset by default (revision 8: 60 s,
  60 s, 50 %). Unset, the stabilisation window is the scale-in hold, one measured lead time (claim -> ready p90)
  between the panic window and 60 s, and panic is left that long after its condition (not a stable window); an
  unset period is the hold too and an unset percent 100, or 60 s and 50 % where the stabilisation is set. A value
  that is set means what it meant, so a ScaledObject that spells out revision 8's defaults scales as before.
  Records are unchanged: an unset field is absent.
- revision 10 (clock skew between machines): a reader judges an agent's lease by when *it heard* the heartbeat, on
  its own monotonic clock (fresh for `lease_s` after it arrived), never by comparing `heartbeat_at` with its own
  wall clock; it measures each agent's clock against its own (the heartbeat's `heartbeat_at` minus its own time at
  arrival) and does not offer the slots of an agent whose heartbeat is stamped more than `MAX_TRUSTED_SKEW_S` from
  its clock, either way (counted ``clock_skew``, a new entry of `REASONS`). A lease it only listed (its arrival
  unknown: at start, after a re-list) is judged by `heartbeat_at` as before, corrected by the measured skew, and is
  not offered while its stamp is ahead of that (`warmpool.agentclocks.LISTED_AHEAD_S`) until a heartbeat is heard.
  The autoscaler states an agent request's `expires_at` and `deadline` in *that agent's* clock (its own time plus
  the measured skew), so an agent of any revision judges them on its own clock; `ActivateRequest` adds `deadline_s`
  (the same deadline as seconds from arrival, timed by the agent's monotonic clock: the agent stops at the earlier
  of the two; absent from older autoscalers: `deadline` alone, as before), and `PoolSlot` adds `skew_s` (the
  measured skew of the slot's agent, None until one of its heartbeats was heard).
- revision 11 (agents bound to their models): a new bucket, `pulse_assignments` (`ASSIGNMENTS_BUCKET`), holds a
  `NodeAssignment` (`node`, `models`, `by`, `updated_at`) under ``<node>``: the models that node may offer. The
  operator's user writes it (``pulsescale assign``); agents may only read it; the autoscaler creates the bucket.
  A reader that follows it refuses a `warm` or `ready` slot whose model its node's assignment does not list: never
  claimed or adopted, counted ``unassigned_model`` (a new entry of `REASONS`). A node without an assignment offers
  what it writes, as before, unless the reader requires one (``pulsescale autoscaler --require-assignment``).
  A list over `MAX_MODELS_PER_NODE` is refused ``bad_value``. Nothing else changes shape.
- revision 12 (labels): `ScalerRecord` adds `labels` (the ScaledObject's ``metadata.labels``, Kubernetes' key and
  value syntax, at most `MAX_LABELS`; default empty), for ``pulsescale get -l``. Nothing acts on them.
- revision 13 (what the CR says): a new bucket, `pulse_objects` (`OBJECTS_BUCKET`), holds an `ObjectStatus` under
  ``<namespace>.<name>`` for every ScaledObject CR the operator sees, published or not: `namespace`, `name` (a
  Kubernetes name, `OBJECT_NAME_PATTERN`: dotted names too), `published`, `conditions` (`ObjectCondition`: `type`,
  `status`, `reason`, `message`, `since`; as the operator wrote them to the CR, at most `MAX_OBJECT_CONDITIONS`),
  and what it could read of the spec (`model`, `target` as ``Kind/name``, `min_replicas`, `max_replicas`), `labels`,
  `generation`, `created_at`, `updated_at`. The operator's user writes it with the CR's status and deletes it when
  the CR goes; on-call may only read it; the autoscaler creates the bucket and reads nothing of it. ``pulsescale
  get so`` takes READY, ACTIVE, FALLBACK and PAUSED of an object from it, and lists the unpublished ones with their
  reason; an object without one (`pulsescale apply` with no operator, an operator or autoscaler before revision 13)
  is shown as before. Nothing else changes shape.
- revision 14 (where demand comes from): `TriggerMetadata` adds four optional keys, each absent unless set, so a
  record of a ``gateway`` trigger is what revision 13 wrote: `source` (`SOURCES`: ``gateway``, the same as absent;
  ``vllm-metrics``; ``prometheus``), `metricsURL` (``vllm-metrics``: comma-separated engine pages; absent: the
  model's ready slots), and KEDA's prometheus keys `serverAddress` and `query` (``prometheus``, both required). The
  operator's user and ``pulsescale apply`` write them (the ScaledObject reader refuses a block that breaks
  `TriggerMetadata.source_problem`, naming the key); ``pulsescale bridge --scaledobjects`` reads them with the
  gateway role (KV reads of `pulse_scalers`, and of `pulse_slots` for a model's ready slots, which it already has:
  no permission changes) and publishes the model's `QueueSample`s as a gateway. A record whose block breaks the
  rules is still read (`decode` checks only the keys' types and lengths): the autoscaler acts on nothing of it,
  older readers ignore the keys, and a later revision may add a source; the bridge counts it ``bad_source`` (a new
  entry of `REASONS`) and keeps that ScaledObject's last good block. `http_url_problem` is the URL rule of both.
  `ScalerRecord` adds `managed_by`: ``pulsescale-operator`` (`ScalerRecord.OPERATOR`) on every record the Kubernetes
  operator publishes; ``pulsescale apply`` refuses to replace such a record (``--force`` overrides) and writes ""
  itself; an older operator's record lacks it and is marked when the operator next publishes it.

Pure: no I/O, no NATS import; `now` is passed in where time matters.
"""

from __future__ import annotations

from typing import Final

from warmpool.protocol.base import (
    Count,
    Id,
    Message,
    Name,
    Request,
    Text,
    Token,
)
from warmpool.protocol.codec import _encoder as _encoder  # tests encode raw (invalid) bodies with it
from warmpool.protocol.codec import (
    check_fresh,
    decode,
    encode,
)
from warmpool.protocol.messages import (
    AGENT_REQUEST_TYPES,
    COMMAND_TYPES,
    ActivateRequest,
    AgentStatusRequest,
    AuditRecord,
    Command,
    DeactivateRequest,
    DrainCommand,
    Event,
    PauseCommand,
    PoolCommand,
    PrewarmRequest,
    QueueSample,
    ResumeCommand,
    ScaleCommand,
    ScheduleCommand,
    StageTimings,
    StatusCommand,
    UndrainCommand,
)
from warmpool.protocol.names import (
    AGENT_PREFIX,
    AGENT_VERBS,
    AGENTS_BUCKET,
    ASSIGNMENTS_BUCKET,
    AUDIT_PREFIX,
    AUDIT_STREAM,
    AUDIT_WILDCARD,
    BUCKETS,
    CMD_PREFIX,
    CMD_VERBS,
    CMD_WILDCARD,
    DEFAULT_MAX_REPLICAS,
    ERROR_CODES,
    EVENTS_PREFIX,
    IDENTITY_PATTERN,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    LEADER_LEASE_KEY,
    LEASES_BUCKET,
    MAX_CLOCK_SKEW_S,
    MAX_CONDITION_REASON,
    MAX_LABELS,
    MAX_LEASE_S,
    MAX_MESSAGE_BYTES,
    MAX_MODELS_PER_NODE,
    MAX_OBJECT_CONDITIONS,
    MAX_OVERRIDE_S,
    MAX_REPLICAS_ENV,
    MAX_REQUEST_TTL_S,
    MAX_SCHEDULE_S,
    MAX_SCHEDULES,
    MAX_SLOTS_PER_NODE,
    MAX_TRUSTED_SKEW_S,
    NAME_PATTERN,
    OBJECT_NAME_PATTERN,
    OBJECTS_BUCKET,
    OVERRIDE_KEY_PREFIX,
    QUEUE_PREFIX,
    QUEUE_WILDCARD,
    REASONS,
    REPLICA_KEY_PREFIX,
    REPLICA_PREFIX,
    SCALERS_BUCKET,
    SCHEDULE_KEY_PREFIX,
    SHARD_KEY_PREFIX,
    SHARDS,
    SLOT_STATES,
    SLOTS_BUCKET,
    TARGET_PATTERN,
    VERSION,
    EngineMode,
    ErrorCode,
    EventType,
    SlotState,
    agent_subject,
    audit_subject,
    cmd_subject,
    events_subject,
    is_identity,
    is_name,
    override_key,
    parse_slot_key,
    queue_subject,
    replica_key,
    replica_subject,
    schedule_key,
    shard_key,
    shard_of,
    slot_key,
)
from warmpool.protocol.records import (
    AgentLease,
    LeaderLease,
    NodeAssignment,
    ObjectCondition,
    ObjectStatus,
    OnCallSchedule,
    Override,
    OverrideRecord,
    ReplicaRecord,
    ScalerRecord,
    ScheduleRecord,
    SlotRecord,
)
from warmpool.protocol.replies import (
    ActivateReply,
    AgentSlotStatus,
    AgentStatusReply,
    CommandReply,
    DeactivateReply,
    DecisionRow,
    DrainReply,
    OverrideReply,
    PoolReply,
    PoolSlot,
    PrewarmReply,
    Reply,
    ReplyError,
    RootfsStatus,
    ScheduleReply,
    ScheduleRow,
    StatusReply,
    StatusRow,
    TypedReply,
    WeightsStatus,
    decode_reply,
    error_reply,
    ok_reply,
    refusal,
)
from warmpool.protocol.scaledobject import (
    LOCAL_TIME_PATTERN,
    MAX_HPA_POLICIES,
    MAX_METRICS_URLS,
    MAX_URL_LENGTH,
    SOURCE_PARAMETERS,
    SOURCES,
    ZONE_PATTERN,
    Advanced,
    AuthenticationRef,
    Fallback,
    FallbackBehavior,
    HorizontalPodAutoscalerConfig,
    HPABehavior,
    HPAScalingPolicy,
    HPAScalingRules,
    ScaledObjectSpec,
    ScaleTargetRef,
    Schedule,
    Seconds,
    Trigger,
    TriggerMetadata,
    WarmPool,
    check_schedules,
    http_url_problem,
    schedule_conflict,
    zone,
)

__all__ = [
    "AGENTS_BUCKET",
    "AGENT_VERBS",
    "ASSIGNMENTS_BUCKET",
    "AUDIT_STREAM",
    "AUDIT_WILDCARD",
    "BUCKETS",
    "CMD_VERBS",
    "CMD_WILDCARD",
    "CONTRACT_REVISION",
    "ERROR_CODES",
    "LEADER_LEASE_KEY",
    "LEASES_BUCKET",
    "OVERRIDE_KEY_PREFIX",
    "IDENTITY_PATTERN",
    "REPLICA_KEY_PREFIX",
    "REPLICA_PREFIX",
    "SHARDS",
    "SHARD_KEY_PREFIX",
    "ReplicaRecord",
    "is_identity",
    "replica_key",
    "replica_subject",
    "shard_key",
    "shard_of",
    "MAX_CLOCK_SKEW_S",
    "MAX_TRUSTED_SKEW_S",
    "MAX_LEASE_S",
    "MAX_MESSAGE_BYTES",
    "LABEL_KEY_PATTERN",
    "LABEL_VALUE_PATTERN",
    "MAX_LABELS",
    "MAX_MODELS_PER_NODE",
    "MAX_CONDITION_REASON",
    "MAX_OBJECT_CONDITIONS",
    "OBJECTS_BUCKET",
    "OBJECT_NAME_PATTERN",
    "TARGET_PATTERN",
    "MAX_REQUEST_TTL_S",
    "MAX_SLOTS_PER_NODE",
    "NAME_PATTERN",
    "QUEUE_WILDCARD",
    "REASONS",
    "SCALERS_BUCKET",
    "SLOTS_BUCKET",
    "SLOT_STATES",
    "ActivateReply",
    "ActivateRequest",
    "AgentLease",
    "AgentSlotStatus",
    "AgentStatusReply",
    "AgentStatusRequest",
    "CommandReply",
    "DeactivateReply",
    "DecisionRow",
    "DrainReply",
    "EngineMode",
    "ErrorCode",
    "EventType",
    "LeaderLease",
    "NodeAssignment",
    "ObjectCondition",
    "ObjectStatus",
    "Override",
    "OverrideRecord",
    "OverrideReply",
    "PoolReply",
    "PoolSlot",
    "PrewarmReply",
    "ReplyError",
    "RootfsStatus",
    "SlotState",
    "StatusReply",
    "StatusRow",
    "WeightsStatus",
    "AuditRecord",
    "DeactivateRequest",
    "DrainCommand",
    "Event",
    "PauseCommand",
    "PoolCommand",
    "PrewarmRequest",
    "QueueSample",
    "Reply",
    "ResumeCommand",
    "Advanced",
    "AuthenticationRef",
    "Fallback",
    "FallbackBehavior",
    "HPABehavior",
    "HPAScalingPolicy",
    "HPAScalingRules",
    "HorizontalPodAutoscalerConfig",
    "ScaleCommand",
    "ScaleTargetRef",
    "Schedule",
    "ScheduleCommand",
    "ScheduleRecord",
    "ScheduleReply",
    "ScheduleRow",
    "OnCallSchedule",
    "MAX_SCHEDULES",
    "MAX_SCHEDULE_S",
    "DEFAULT_MAX_REPLICAS",
    "MAX_OVERRIDE_S",
    "MAX_REPLICAS_ENV",
    "SCHEDULE_KEY_PREFIX",
    "check_schedules",
    "schedule_key",
    "ScaledObjectSpec",
    "ScalerRecord",
    "Trigger",
    "TriggerMetadata",
    "WarmPool",
    "SlotRecord",
    "StageTimings",
    "StatusCommand",
    "UndrainCommand",
    "agent_subject",
    "audit_subject",
    "check_fresh",
    "cmd_subject",
    "decode",
    "decode_reply",
    "encode",
    "error_reply",
    "events_subject",
    "is_name",
    "ok_reply",
    "override_key",
    "parse_slot_key",
    "refusal",
    "queue_subject",
    "slot_key",
    # also re-exported: the parts' other public names (each was `protocol.X` before the split into a package)
    "AGENT_PREFIX",
    "AUDIT_PREFIX",
    "CMD_PREFIX",
    "EVENTS_PREFIX",
    "QUEUE_PREFIX",
    "VERSION",
    "Count",
    "Id",
    "Message",
    "Name",
    "Request",
    "Text",
    "Token",
    "LOCAL_TIME_PATTERN",
    "MAX_HPA_POLICIES",
    "MAX_METRICS_URLS",
    "MAX_URL_LENGTH",
    "SOURCES",
    "SOURCE_PARAMETERS",
    "ZONE_PATTERN",
    "Seconds",
    "http_url_problem",
    "schedule_conflict",
    "zone",
    "AGENT_REQUEST_TYPES",
    "COMMAND_TYPES",
    "Command",
    "TypedReply",
]

CONTRACT_REVISION: Final = 14
"""Revision of wire contract v1 this code speaks (see the module doc for what each revision changed)."""
