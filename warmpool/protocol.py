"""Wire contract v1: every subject, bucket, and message pulsescale puts on NATS.

This is the one module that spells a subject or bucket name. Gateways and tools are written against it, so
it only grows by adding optional fields. All messages are UTF-8 JSON objects with ``"v": 1``; unknown fields
are ignored. `decode` enforces every rule of DESIGN.md ("Wire contract v1") and raises `BadMessage` with one
of `REASONS`, so consumers count rejections by reason and keep going.

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
  slots the warm pool should hold, from `autoscaler.schedules.POOL_LEAD_S` before a start). Schedules whose windows
  overlap with different `replicas` are refused ``bad_value`` (identical floors may overlap: the floor is the same
  either way); `replicas` over `maxReplicaCount`, a duration over `MAX_SCHEDULE_S`, an unknown zone are refused.
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

Pure: no I/O, no NATS import; `now` is passed in where time matters.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import zlib
import zoneinfo
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, Any, Final, Literal, TypeVar, get_args

import msgspec

from warmpool.errors import BadMessage, DuplicateRequest

__all__ = [
    "AGENTS_BUCKET",
    "AGENT_VERBS",
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
    "RequestLedger",
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
    "admit",
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
]

VERSION: Final = 1
CONTRACT_REVISION: Final = 10
"""Revision of wire contract v1 this code speaks (see the module doc for what each revision changed)."""
MAX_MESSAGE_BYTES: Final = 64 * 1024
MAX_LEASE_S: Final = 300.0
"""The longest agent lease any reader honours: a lease that says it lasts longer is refused (``bad_value``), so a
writer cannot keep a dead or fake node claimable for hours. Real leases are a few heartbeats (6 s by default)."""
MAX_SLOTS_PER_NODE: Final = 256
"""The most slots one agent lease may list (revision 4). A node holds a few slots per GPU and model (8 GPUs x a
handful of models is well under 100); the bound is what one node's agent user can make the autoscaler try in vain:
a slot is claimable only when its node's fresh lease lists it, so a node that writes thousands of fake records costs
at most this many failed activations. A lease over it is refused (``bad_value``), not truncated: no honest agent
sends one, and a truncated list would offer an arbitrary subset."""
MAX_CLOCK_SKEW_S: Final = 5.0
"""A heartbeat dated more than this ahead of the reader's clock is not fresh: a future-dated lease is a clock fault
or a forgery, never a reason to trust a node for longer."""
MAX_TRUSTED_SKEW_S: Final = 120.0
"""Revision 10: the furthest an agent's clock may be from a reader's (its heartbeat's `heartbeat_at` minus the
reader's time when the heartbeat arrived), either way, for the reader to offer its slots. Freshness no longer rests
on the stamp (a lease is fresh for `lease_s` after it was *heard*), so a clock that chrony has not yet stepped at
boot, or a VM's after a suspend, serves as usual: the fault review saw 3 to 30 s. Minutes off is a broken clock (or
a forged stamp, like one dated an hour ahead): that node is shown with its skew and counted, not offered."""
MAX_REQUEST_TTL_S: Final = 3_600.0
"""The latest `expires_at` a consumer accepts, from its own clock: a request cannot stay replayable (or stay in the
idempotency ledger) for longer. An hour covers the longest on-call wait anyone types."""
NAME_PATTERN: Final = r"^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?$"
_NAME_RE: Final = re.compile(NAME_PATTERN)

# --- subjects and buckets -------------------------------------------------------------------------------------

QUEUE_PREFIX: Final = "pulse.queue."
QUEUE_WILDCARD: Final = "pulse.queue.*"
CMD_PREFIX: Final = "pulse.cmd."
CMD_WILDCARD: Final = "pulse.cmd.*"
AGENT_PREFIX: Final = "pulse.agent."
EVENTS_PREFIX: Final = "pulse.events."
AUDIT_PREFIX: Final = "pulse.audit."
AUDIT_WILDCARD: Final = "pulse.audit.>"
AUDIT_STREAM: Final = "PULSE_AUDIT"

SLOTS_BUCKET: Final = "pulse_slots"
AGENTS_BUCKET: Final = "pulse_agents"
SCALERS_BUCKET: Final = "pulse_scalers"
LEASES_BUCKET: Final = "pulse_leases"
BUCKETS: Final = (SLOTS_BUCKET, AGENTS_BUCKET, SCALERS_BUCKET, LEASES_BUCKET)
"""Every bucket of the registry."""

CMD_VERBS: Final = ("scale", "pause", "resume", "status", "pool", "drain", "undrain", "schedule")
AGENT_VERBS: Final = ("prewarm", "activate", "deactivate", "status")
EngineMode = Literal["fork", "wake", "resident"]
SlotState = Literal["prewarming", "warm", "claimed", "activating", "ready", "releasing", "failed", "draining"]
SLOT_STATES: Final[tuple[SlotState, ...]] = get_args(SlotState)

EventType = Literal[
    "scale.decision",
    "slot.claimed",
    "slot.ready",
    "slot.released",
    "slot.failed",
    "pool.exhausted",
    "cold.start",
]

LEADER_LEASE_KEY: Final = "autoscaler"
"""Key of the autoscaler replicas' leader lease in `pulse_leases`."""
SHARDS: Final = 32
"""Models are split into this many shards (`shard_of`); each is a lease one autoscaler replica holds at a time.
Part of the contract because every replica must map a model to the same shard: 32 spreads evenly over up to ~10
replicas, and renewing 32 leases every half second costs a broker little."""
SHARD_KEY_PREFIX: Final = "shard."
"""Keys ``shard.<n>`` in `pulse_leases` hold the lease (`LeaderLease`) of shard n (revision 6)."""
REPLICA_KEY_PREFIX: Final = "replica."
"""Keys ``replica.<identity>`` in `pulse_leases` hold each live autoscaler replica's `ReplicaRecord` (revision 6)."""
REPLICA_PREFIX: Final = "pulse.autoscaler."
"""``pulse.autoscaler.<identity>.cmd.<verb>``: a command handed to the replica that owns the model (revision 6)."""
IDENTITY_PATTERN: Final = r"^[A-Za-z0-9_-]{1,128}$"
"""An autoscaler replica's identity: one subject token and one key token (no dots, no wildcards)."""
OVERRIDE_KEY_PREFIX: Final = "override."
"""Keys ``override.<model>`` in `pulse_leases` hold on-call overrides, so a new leader keeps them."""
SCHEDULE_KEY_PREFIX: Final = "schedule."
"""Keys ``schedule.<model>`` in `pulse_leases` hold a model's on-call schedules (`ScheduleRecord`, revision 8), so
a new owner of its shard keeps them."""
MAX_SCHEDULES: Final = 16
"""The most schedules one ScaledObject lists, and the most on-call schedules one model keeps (revision 8): a
launch, a few rehearsals and the week's peaks; the overlap check compares every pair."""
MAX_SCHEDULE_S: Final = 7 * 86_400.0
"""The longest one schedule may hold its floor (revision 8): a week covers any event's run-up; a longer floor is
a `minReplicaCount` edit, which a review sees, not a schedule someone forgets."""

# Machine-readable rejection reasons; metrics label on these, so they never change meaning.
REASONS: Final = (
    "bad_json",  # not UTF-8 JSON at all
    "not_object",  # JSON, but not an object
    "bad_version",  # "v" missing or not 1
    "missing_field",  # a required field is absent
    "wrong_type",  # a field has the wrong JSON type
    "non_finite",  # NaN, Infinity, or a number out of float range
    "negative",  # a count, sequence or size below zero
    "bad_name",  # model/node/slot name outside NAME_PATTERN
    "bad_value",  # in range for its type but not a legal value (unknown verb, empty id, ...)
    "too_large",  # over MAX_MESSAGE_BYTES
    "too_late",  # a request whose expires_at is more than MAX_REQUEST_TTL_S ahead (revision 3)
    "subject_mismatch",  # the payload names another model/node than its subject
    "expired",  # a request past its expires_at
    "duplicate_id",  # a request id already applied
    "clock_skew",  # revision 10: an agent's heartbeat stamped more than MAX_TRUSTED_SKEW_S from the reader's clock
)

# Error codes of failed replies (``{"ok": false, "error": {"code", "message"}}``); clients branch on these, so
# they never change meaning. A request that breaks the contract is answered with its `REASONS` entry as the code
# (the on-call commands) or with ``bad_message`` and the reason in `reason` (the agent).
ErrorCode = Literal[
    # on-call commands (pulse.cmd.<verb>)
    "not_leader",  # this autoscaler replica does not lead; retry (another will answer)
    "unknown_model",  # no ScaledObject names the model
    # a replica count outside [minReplicaCount, maxReplicaCount] or over the autoscaler's limit, or an override
    # longer than allowed
    "out_of_bounds",
    "unknown_node",  # no agent or slot on the node
    "conflict",  # revision 8: a schedule overlaps another with a different floor, or its name is taken
    "unknown_schedule",  # revision 8: no on-call schedule of the model has that name
    # node agent (pulse.agent.<node>.<verb>)
    "bad_message",  # the request broke the contract; `reason` says how
    "unknown_slot",  # the node has no such slot
    "stale_token",  # the request's claim no longer holds the slot (released, or a newer claim took it)
    "foreign_claim",  # the slot is held by another claim with an equal or older token
    "not_claimed",  # the slot is not in a state an activation can start from
    "slot_unavailable",  # the slot cannot serve now (staging failed, engine not armed)
    "deadline",  # the request's deadline passed (before or during the activation)
    "engine_failed",  # the engine crashed or reported an error while starting
    "not_ready",  # the engine started but failed its readiness check
    "registry_unavailable",  # the agent could not read or write the slot's record
    "busy",  # a prewarm is already running, or too many requests are in flight on the agent (revision 3)
    # either
    "internal",  # a bug, caught and survived; the message has the exception
]
ERROR_CODES: Final[tuple[str, ...]] = get_args(ErrorCode)


def _check(subject: str, kind: str, name: str) -> str:
    if not _NAME_RE.match(name):
        raise BadMessage("bad_name", f"{kind} {name!r} does not match {NAME_PATTERN}")
    return subject


def is_name(name: str) -> bool:
    """True when `name` can be a model, node or slot name (one subject token, one KV key part)."""
    return bool(_NAME_RE.match(name))


def queue_subject(model: str) -> str:
    return _check(QUEUE_PREFIX + model, "model", model)


def cmd_subject(verb: str) -> str:
    if verb not in CMD_VERBS:
        raise BadMessage("bad_value", f"unknown command verb {verb!r}; known: {', '.join(CMD_VERBS)}")
    return CMD_PREFIX + verb


def agent_subject(node: str, verb: str) -> str:
    if verb not in AGENT_VERBS:
        raise BadMessage("bad_value", f"unknown agent verb {verb!r}; known: {', '.join(AGENT_VERBS)}")
    return _check(f"{AGENT_PREFIX}{node}.{verb}", "node", node)


def events_subject(model: str) -> str:
    return _check(EVENTS_PREFIX + model, "model", model)


def audit_subject(verb: str) -> str:
    return AUDIT_PREFIX + verb


def slot_key(model: str, node: str, slot: str) -> str:
    """KV key of a slot in `pulse_slots`: ``<model>.<node>.<slot>``."""
    for kind, name in (("model", model), ("node", node), ("slot", slot)):
        _check(name, kind, name)
    return f"{model}.{node}.{slot}"


def parse_slot_key(key: str) -> tuple[str, str, str]:
    parts = key.split(".")
    if len(parts) != 3 or not all(_NAME_RE.match(p) for p in parts):
        raise BadMessage("bad_name", f"slot key {key!r} is not <model>.<node>.<slot>")
    return parts[0], parts[1], parts[2]


# --- field types ------------------------------------------------------------------------------------------------

Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
Count = Annotated[int, msgspec.Meta(ge=0)]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Token = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]  # a JetStream sequence number


def _finite(owner: msgspec.Struct, *fields: str) -> None:
    for f in fields:
        value = getattr(owner, f)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"[non_finite] `{f}` must be a finite number")


def _not_negative(owner: msgspec.Struct, *fields: str) -> None:
    for f in fields:
        value = getattr(owner, f)
        if value is not None and value < 0:
            raise ValueError(f"[negative] `{f}` must be >= 0")


class Message(msgspec.Struct, kw_only=True, omit_defaults=False):
    """Base of every v1 message; `v` is checked on decode."""

    v: int = VERSION

    def _validate(self) -> None:
        """Subclasses add checks msgspec's constraints cannot express."""

    def __post_init__(self) -> None:
        if self.v != VERSION:
            raise ValueError(f"[bad_version] `v` is {self.v}, this consumer speaks v{VERSION}")
        self._validate()


class Request(Message, kw_only=True):
    """A request: `id` makes it idempotent, `expires_at` (Unix s) bounds how late it may be applied."""

    id: Id
    expires_at: float

    def _validate(self) -> None:
        _finite(self, "expires_at")


# --- gateway -> autoscaler --------------------------------------------------------------------------------------


class QueueSample(Message, kw_only=True):
    """One gateway's view of one model, published on ``pulse.queue.<model>`` every ≤100 ms and on change.

    Counters are monotonic within one gateway run; a decrease or a `seq` restart means the gateway restarted.
    """

    gateway: Id
    model: Name
    seq: Count
    ts: float
    queue_depth: Count
    inflight: Count
    arrivals_total: Count
    completions_total: Count
    timeouts_total: Count

    def _validate(self) -> None:
        _finite(self, "ts")
        _not_negative(self, "ts")


# --- on-call -> autoscaler (pulse.cmd.<verb>) -----------------------------------------------------------------


class Command(Request, kw_only=True):
    by: Id


class ScaleCommand(Command, kw_only=True):
    """Hold `model` at `replicas` for `for_s` seconds (an override that beats the policy until it expires)."""

    model: Name
    replicas: Count
    for_s: float

    def _validate(self) -> None:
        super()._validate()
        _finite(self, "for_s")
        if self.for_s <= 0:
            raise ValueError("[bad_value] `for_s` must be > 0")


class PauseCommand(Command, kw_only=True):
    model: Name
    replicas: Count | None = None


class ResumeCommand(Command, kw_only=True):
    model: Name


class StatusCommand(Command, kw_only=True):
    model: Name | None = None


class PoolCommand(Command, kw_only=True):
    model: Name | None = None


class DrainCommand(Command, kw_only=True):
    node: Name


class ScheduleCommand(Command, kw_only=True):
    """Revision 8: a model's on-call schedules: `add` one (refused when it ends in the past, overlaps another with
    a different floor, or exceeds ``maxReplicaCount``), `delete` one by name, or (neither) list them all."""

    model: Name
    add: Schedule | None = None
    delete: Name | None = None

    def _validate(self) -> None:
        super()._validate()
        if self.add is not None and self.delete is not None:
            raise ValueError("[bad_value] a schedule command either adds or deletes, not both")


class UndrainCommand(Command, kw_only=True):
    node: Name


COMMAND_TYPES: Final[dict[str, type[Command]]] = {
    "scale": ScaleCommand,
    "pause": PauseCommand,
    "resume": ResumeCommand,
    "status": StatusCommand,
    "pool": PoolCommand,
    "drain": DrainCommand,
    "undrain": UndrainCommand,
    "schedule": ScheduleCommand,
}

# --- autoscaler -> nodeagent (pulse.agent.<node>.<verb>) -------------------------------------------------------


class PrewarmRequest(Request, kw_only=True):
    """Stage (or re-stage) a slot; without `slot`, every slot of the agent."""

    slot: Name | None = None


class ActivateRequest(Request, kw_only=True):
    """Take a claimed slot into service. `token` is the claim write's KV revision; `deadline` is Unix s (since
    revision 10 in the agent's clock, as the autoscaler measures it: see the module doc)."""

    slot: Name
    token: Token
    claim_id: Id
    deadline: float
    deadline_s: float | None = None
    """Revision 10: the same deadline as seconds from when the agent receives the request, timed by its monotonic
    clock; the agent stops at the earlier of this and `deadline`. None (older autoscalers): `deadline` alone."""

    def _validate(self) -> None:
        super()._validate()
        _finite(self, "deadline", "deadline_s")
        if self.deadline_s is not None and not 0 < self.deadline_s <= MAX_REQUEST_TTL_S:
            raise ValueError(
                f"[bad_value] `deadline_s` is {self.deadline_s:g}; it must be in (0, {MAX_REQUEST_TTL_S:g}] seconds"
            )


class DeactivateRequest(Request, kw_only=True):
    """Take a serving slot out of service. Both halves of the claim are required (revision 2): the token is
    public in `pulse_slots`, the random `claim_id` is known only to the claimer."""

    slot: Name
    token: Token
    claim_id: Id


class AgentStatusRequest(Request, kw_only=True):
    slot: Name | None = None


AGENT_REQUEST_TYPES: Final[dict[str, type[Request]]] = {
    "prewarm": PrewarmRequest,
    "activate": ActivateRequest,
    "deactivate": DeactivateRequest,
    "status": AgentStatusRequest,
}


class StageTimings(msgspec.Struct, kw_only=True):
    """Where an activation spent its time, in milliseconds."""

    token_ms: float = 0.0
    load_ms: float = 0.0
    engine_ms: float = 0.0
    readiness_ms: float = 0.0
    total_ms: float = 0.0

    def __post_init__(self) -> None:
        _finite(self, "token_ms", "load_ms", "engine_ms", "readiness_ms", "total_ms")
        _not_negative(self, "token_ms", "load_ms", "engine_ms", "readiness_ms", "total_ms")


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


# --- ScaledObject (KV pulse_scalers, key <namespace>.<name>) ----------------------------------------------------
# Field names mirror KEDA's where they mean the same (camelCase on the wire, snake_case in Python).


class _Spec(msgspec.Struct, kw_only=True, rename="camel", forbid_unknown_fields=False):
    pass


# Upper bounds keep the policy's arithmetic finite: a day is longer than any window anyone means.
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86_400)]


class ScaleTargetRef(_Spec, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    kind: Annotated[str, msgspec.Meta(min_length=1, max_length=63)] = "Deployment"
    api_version: Annotated[str, msgspec.Meta(min_length=1, max_length=317)] = "apps/v1"
    """A group (a DNS subdomain, 253) and a version (63)."""
    env_source_container_name: Annotated[str, msgspec.Meta(max_length=63)] | None = None
    """Revision 5: KEDA's ``envSourceContainerName``, accepted; no effect (a pushed trigger reads no environment)."""


class TriggerMetadata(_Spec, kw_only=True):
    model: Name
    target_queue_depth: Annotated[float, msgspec.Meta(ge=0.001, le=1e9)] = 4.0
    """Queue + in-flight requests one replica should carry; desired = demand / this."""
    activation_queue_depth: Annotated[float, msgspec.Meta(ge=0, le=1e9)] = 0.0
    """From zero replicas, scale up only when demand exceeds this (KEDA's activation threshold)."""


class AuthenticationRef(_Spec, kw_only=True):
    """KEDA's ``authenticationRef`` (revision 5): accepted so a KEDA manifest applies; a pushed trigger needs no
    credentials to read a metric, so it has no effect (the ScalerRecord's `notes` say so)."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    kind: Literal["TriggerAuthentication", "ClusterTriggerAuthentication"] = "TriggerAuthentication"


class Trigger(_Spec, kw_only=True):
    type: Literal["gateway-queue"]
    metadata: TriggerMetadata
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=63)] | None = None
    """Revision 5, as KEDA: names a trigger (unique within the ScaledObject)."""
    metric_type: Literal["AverageValue"] = "AverageValue"
    """Revision 5: KEDA's ``metricType``. Only ``AverageValue`` (demand / target per replica) is our rule."""
    use_cached_metrics: bool = False
    """Revision 5: accepted, no effect: a pushed trigger is never polled, every sample is used as it arrives."""
    authentication_ref: AuthenticationRef | None = None
    """Revision 5: accepted, no effect (see `AuthenticationRef`)."""


FallbackBehavior = Literal["static", "currentReplicas", "currentReplicasIfHigher", "currentReplicasIfLower"]


class Fallback(_Spec, kw_only=True):
    failure_threshold: Annotated[int, msgspec.Meta(ge=0)]
    """Missed intervals (of `advanced.staleAfterSeconds`) tolerated; the fallback applies at the next, as KEDA's
    failures > failureThreshold (revision 5: 0 admitted, falling back at the first missed interval)."""
    replicas: Count
    behavior: FallbackBehavior = "static"
    """Revision 5, as KEDA: ``static`` uses `replicas`; ``currentReplicas`` keeps the current count;
    ``currentReplicasIfHigher``/``IfLower`` use the current count when it is higher/lower than `replicas`."""


MAX_HPA_POLICIES: Final = 10
"""Most policies in one HPA ``behavior`` rule: the pulsescale mapping uses one Percent and one Pods policy, and the
CRD needs a bound on every list (the API server's cost estimator)."""


class HPAScalingPolicy(_Spec, kw_only=True):
    """One policy of an HPA ``behavior`` rule (autoscaling/v2 ``HPAScalingPolicy``)."""

    type: Literal["Pods", "Percent"]
    value: Annotated[int, msgspec.Meta(ge=1)]
    period_seconds: Annotated[int, msgspec.Meta(ge=1, le=1800)]


class HPAScalingRules(_Spec, kw_only=True):
    """autoscaling/v2 ``HPAScalingRules``."""

    stabilization_window_seconds: Annotated[int, msgspec.Meta(ge=0, le=3600)] | None = None
    select_policy: Literal["Max", "Min", "Disabled"] | None = None
    policies: Annotated[list[HPAScalingPolicy], msgspec.Meta(max_length=MAX_HPA_POLICIES)] | None = None
    tolerance: str | float | None = None


class HPABehavior(_Spec, kw_only=True):
    scale_up: HPAScalingRules | None = None
    scale_down: HPAScalingRules | None = None


class HorizontalPodAutoscalerConfig(_Spec, kw_only=True):
    """KEDA's ``advanced.horizontalPodAutoscalerConfig`` (revision 5): `behavior` is mapped onto this policy's
    scale-down fields by the ScaledObject reader; what cannot map is refused there with the reason."""

    name: Annotated[str, msgspec.Meta(max_length=253)] | None = None
    behavior: HPABehavior | None = None


class Advanced(_Spec, kw_only=True):
    stable_window_seconds: Seconds = 60.0
    panic_window_seconds: Seconds = 6.0
    panic_threshold: Annotated[float, msgspec.Meta(ge=1, le=1000)] = 2.0
    """Panic when panic-window demand >= this x ready capacity (Knative's default 200 %)."""
    scale_down_stabilization_seconds: Annotated[float, msgspec.Meta(ge=0, le=86_400)] | msgspec.UnsetType = (
        msgspec.UNSET
    )
    """Scale down to the highest recommendation of this window. Unset (revision 9): the scale-in hold, one
    measured lead time (claim -> ready p90) kept between `panicWindowSeconds` and 60 s, and panic is then left that
    long after its condition: bringing a released replica back costs one lead time from the warm pool, so an idle
    one is not held longer than the warm path makes worth it."""
    scale_down_percent: Annotated[float, msgspec.Meta(gt=0, le=100)] | msgspec.UnsetType = msgspec.UNSET
    """At most this share of the replicas (and at least one) is removed per `scaleDownPeriodSeconds`. Unset
    (revision 9): 100 while the stabilisation window is unset too (the hold paces scale-in: one step per hold), else
    50 (revision 8's default)."""
    scale_down_period_seconds: Seconds | msgspec.UnsetType = msgspec.UNSET
    """The period of the scale-down rate. Unset (revision 9): the scale-in hold while the stabilisation window is
    unset too, else 60 s."""
    stale_after_seconds: Seconds = 1.0
    """A gateway silent this long leaves the demand sum (ten of the gateways' 100 ms sample intervals)."""
    lead_time_seconds: Seconds = 2.5
    """Forecast horizon until measured claim -> ready times exist (DESIGN: p90, default 2.5 s)."""
    scale_down_pods: Count | None = None
    """Revision 5: at most this many replicas removed per `scaleDownPeriodSeconds` (HPA's ``Pods`` policy); with
    `scaleDownPercent` both apply as `scaleDownSelectPolicy` says."""
    scale_down_select_policy: Literal["Max", "Min", "Disabled"] = "Max"
    """Revision 5, as HPA's ``selectPolicy``: ``Max`` allows the larger of the two removals, ``Min`` the smaller,
    ``Disabled`` never scales down."""
    restore_to_original_replica_count: bool = False
    """Revision 5, as KEDA: on delete, the operator puts the target back to the replica count it had before."""
    horizontal_pod_autoscaler_config: HorizontalPodAutoscalerConfig | None = None


class WarmPool(_Spec, kw_only=True):
    size: Count = 0
    image: Text | None = None
    weights: Text | None = None
    engine: Literal["local", "command", "vllm"] = "local"
    loader: Literal["auto", "host", "cuda-pinned", "kvikio"] = "auto"


LOCAL_TIME_PATTERN: Final = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}(:[0-9]{2})?$"
"""`Schedule.start`: an ISO-8601 local date-time without an offset (``2026-12-24T18:00``); the zone is `timezone`."""
_LOCAL_TIME_RE: Final = re.compile(LOCAL_TIME_PATTERN)
ZONE_PATTERN: Final = r"^[A-Za-z0-9_+-]+(/[A-Za-z0-9_+-]+)*$"
"""An IANA zone name (``Europe/Berlin``, ``UTC``): path segments only, so the name never reaches outside the zone
database (``..`` or an absolute path)."""
_ZONE_RE: Final = re.compile(ZONE_PATTERN)


def zone(name: str) -> zoneinfo.ZoneInfo:
    """The IANA zone `name`, or ValueError ``[bad_value]`` naming it."""
    if not _ZONE_RE.fullmatch(name):
        raise ValueError(f"[bad_value] `timezone` {name!r} is not an IANA zone name (Europe/Berlin, UTC, ...)")
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(
            f"[bad_value] `timezone` {name!r} is not a zone this machine's zone database knows (an IANA name such "
            "as Europe/Berlin, America/New_York or UTC)"
        ) from None


class Schedule(_Spec, kw_only=True):
    """A scheduled warm-up before a known event (KEDA's cron scaler): from `start` (local time in `timezone`) for
    `durationSeconds`, the model's count is at least `replicas`, and the warm pool is asked
    for that many slots ahead of it. A local time that does not exist (skipped by a DST change) is read with the
    offset before the change (02:30 on a spring-forward night starts at 03:30); one that exists twice (fall-back)
    is the first. The duration is elapsed time, whatever the clocks do meanwhile."""

    name: Name
    """Names the schedule: unique among the ScaledObject's (and among a model's on-call schedules)."""
    start: Annotated[str, msgspec.Meta(max_length=32, extra_json_schema={"pattern": LOCAL_TIME_PATTERN})]
    """When the floor starts: an ISO-8601 local date-time without offset, ``2026-12-24T18:00`` or
    ``2026-12-24T18:00:00``, in `timezone`."""
    duration_seconds: Annotated[float, msgspec.Meta(gt=0, le=MAX_SCHEDULE_S)]
    """How long the floor holds from `start`, in seconds (at most a week)."""
    replicas: Count
    """The floor: at least this many replicas while the schedule is in force (at most `maxReplicaCount`)."""
    timezone: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] = "UTC"
    """IANA zone `start` is read in (``Europe/Berlin``); default UTC."""

    def __post_init__(self) -> None:
        if not _LOCAL_TIME_RE.fullmatch(self.start):
            raise ValueError(
                f"[bad_value] `start` {self.start!r} is not a local date-time YYYY-MM-DDTHH:MM[:SS] (no offset: the "
                "zone is `timezone`)"
            )
        try:
            dt.datetime.fromisoformat(self.start)
        except ValueError as err:
            raise ValueError(f"[bad_value] `start` {self.start!r} is not a date-time: {err}") from None
        zone(self.timezone)

    def window(self) -> tuple[float, float]:
        """(start, end) in Unix seconds: the floor holds for start <= now < end."""
        local = dt.datetime.fromisoformat(self.start).replace(tzinfo=zone(self.timezone))
        begin = local.timestamp()
        return begin, begin + self.duration_seconds


def schedule_conflict(schedules: Sequence[Schedule], *, max_replicas: int | None = None) -> str | None:
    """What is wrong with a set of schedules together, or None: more than `MAX_SCHEDULES`, a name twice, a floor
    over `max_replicas`, or two windows that overlap with different floors ("overlaps badly": which floor holds
    would depend on the order they were written; identical floors may overlap, e.g. to extend one)."""
    if len(schedules) > MAX_SCHEDULES:
        return f"{len(schedules)} schedules; at most {MAX_SCHEDULES} are kept per model"
    names: set[str] = set()
    for s in schedules:
        if s.name in names:
            return f"two schedules are named {s.name!r}; names must be unique"
        names.add(s.name)
        if max_replicas is not None and s.replicas > max_replicas:
            return (
                f"schedule {s.name!r} raises the floor to {s.replicas} replicas, over `maxReplicaCount` {max_replicas}"
            )
    windows = [(s, *s.window()) for s in schedules]
    for i, (a, a0, a1) in enumerate(windows):
        for b, b0, b1 in windows[i + 1 :]:
            if a0 < b1 and b0 < a1 and a.replicas != b.replicas:
                return (
                    f"schedules {a.name!r} ({a.replicas} replicas) and {b.name!r} ({b.replicas} replicas) overlap with "
                    "different floors; make them not overlap, or give them the same replicas"
                )
    return None


def check_schedules(schedules: Sequence[Schedule], *, max_replicas: int | None = None) -> None:
    """`schedule_conflict` as a ValueError ``[bad_value]`` (what the decoders turn into a rejection reason)."""
    problem = schedule_conflict(schedules, max_replicas=max_replicas)
    if problem is not None:
        raise ValueError(f"[bad_value] {problem}")


class ScaledObjectSpec(_Spec, kw_only=True):
    scale_target_ref: ScaleTargetRef
    triggers: Annotated[list[Trigger], msgspec.Meta(min_length=1)]
    min_replica_count: Count = 0
    max_replica_count: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 100
    idle_replica_count: Count | None = None
    cooldown_period: Annotated[float, msgspec.Meta(ge=0, le=86_400 * 7)] = 300.0
    """Seconds without demand before dropping to `idleReplicaCount` (or `minReplicaCount`), as KEDA."""
    fallback: Fallback | None = None
    advanced: Advanced = msgspec.field(default_factory=Advanced)
    warm_pool: WarmPool = msgspec.field(default_factory=WarmPool)
    polling_interval: Annotated[int, msgspec.Meta(ge=1, le=86_400)] | None = None
    """Revision 5: KEDA's ``pollingInterval``, accepted; a pushed trigger is read as samples arrive, not polled."""
    initial_cooldown_period: Annotated[float, msgspec.Meta(ge=0, le=86_400 * 7)] = 0.0
    """Revision 5, as KEDA: seconds after the ScaledObject is created before it may scale down to
    `idleReplicaCount`/zero."""
    schedules: Annotated[list[Schedule], msgspec.Meta(max_length=MAX_SCHEDULES)] = []
    """Revision 8: scheduled warm-ups (KEDA's cron scaler): each raises the floor to its `replicas` from its
    `start` for its `durationSeconds`. Windows that overlap must have the same `replicas`."""

    def __post_init__(self) -> None:
        if self.min_replica_count > self.max_replica_count:
            raise ValueError("[bad_value] `minReplicaCount` must be <= `maxReplicaCount`")
        if self.idle_replica_count is not None and self.idle_replica_count >= self.min_replica_count > 0:
            raise ValueError("[bad_value] `idleReplicaCount` must be < `minReplicaCount` (as in KEDA)")
        if len({t.metadata.model for t in self.triggers}) != 1:
            raise ValueError("[bad_value] all triggers of one ScaledObject must name the same model")
        if self.schedules:
            check_schedules(self.schedules, max_replicas=self.max_replica_count)

    @property
    def model(self) -> str:
        return self.triggers[0].metadata.model


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

    @property
    def key(self) -> str:
        return f"{self.namespace}.{self.name}"


# --- events and audit -----------------------------------------------------------------------------------------------


class Event(Message, kw_only=True):
    """Published on ``pulse.events.<model>``; the optional fields are the ones that explain the event."""

    type: EventType
    model: Name
    ts: float
    reason: Text | None = None
    node: Name | None = None
    slot: Name | None = None
    token: int | None = None
    claim_id: str | None = None
    """Never set since revision 3: events reach every gateway, and a claim id with the public token stops a slot."""
    desired: Count | None = None
    ready: Count | None = None
    activating: Count | None = None
    endpoint: str | None = None
    timings: StageTimings | None = None

    def _validate(self) -> None:
        _finite(self, "ts")


class AuditRecord(Message, kw_only=True):
    """One on-call command and its outcome, in JetStream stream `PULSE_AUDIT`."""

    verb: str
    id: str
    by: str
    ts: float
    request: dict[str, Any]
    reply: dict[str, Any]
    applied: bool


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


def override_key(model: str) -> str:
    return _check(OVERRIDE_KEY_PREFIX + model, "model", model)


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


def schedule_key(model: str) -> str:
    return _check(SCHEDULE_KEY_PREFIX + model, "model", model)


def shard_of(model: str, shards: int = SHARDS) -> int:
    """The shard a model belongs to: CRC-32 of its name, so every replica (and every version) agrees."""
    return zlib.crc32(model.encode()) % shards


def shard_key(shard: int) -> str:
    if not 0 <= shard < SHARDS:
        raise ValueError(f"shard {shard} is not in [0, {SHARDS})")
    return f"{SHARD_KEY_PREFIX}{shard}"


def is_identity(identity: str) -> bool:
    return re.fullmatch(IDENTITY_PATTERN, identity) is not None


def replica_key(identity: str) -> str:
    if not is_identity(identity):
        raise ValueError(f"replica identity {identity!r} does not match {IDENTITY_PATTERN}")
    return REPLICA_KEY_PREFIX + identity


def replica_subject(identity: str, verb: str) -> str:
    """Where a command for a model the replica `identity` owns is handed to it."""
    if not is_identity(identity):
        raise ValueError(f"replica identity {identity!r} does not match {IDENTITY_PATTERN}")
    return f"{REPLICA_PREFIX}{identity}.cmd.{verb}"


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


# --- replies ----------------------------------------------------------------------------------------------------------


class ReplyError(msgspec.Struct):
    code: str
    message: str


class Reply(msgspec.Struct):
    """A decoded request/reply answer, untyped: extra fields of the reply are in `fields`."""

    ok: bool
    error: ReplyError | None = None
    fields: dict[str, Any] = {}


class TypedReply(Message, kw_only=True):
    """Base of the typed replies: ``{"v": 1, "ok": true, ...}`` or ``{"v": 1, "ok": false, "error": {...}}``."""

    ok: bool = True
    error: ReplyError | None = None
    reason: str | None = None
    """With error code ``bad_message``: the request's rejection reason, one of `REASONS`."""


class CommandReply(TypedReply, kw_only=True):
    """What a mutating command's reply has in common; the verb's own fields are in its subclass."""


class OverrideReply(CommandReply, kw_only=True):
    """Reply to `scale`, `pause` and `resume`: the override now in force (None after `resume`)."""

    model: Name | None = None
    override: Override | None = None


class DrainReply(CommandReply, kw_only=True):
    node: Name | None = None
    drained: bool = False
    touched: list[str] = []


class ScheduleRow(msgspec.Struct, kw_only=True):
    """Revision 8: one schedule as `status` and ``schedule --list`` show it, its window resolved to Unix seconds."""

    name: Name
    source: Literal["scaledobject", "oncall"]
    """Where it comes from: the ScaledObject's `schedules`, or ``pulsescale schedule``."""
    replicas: Count
    start: str
    timezone: str
    duration_seconds: float
    starts_at: float
    ends_at: float
    active: bool = False
    """In force at the reply's time."""
    by: str = ""
    """Who set an on-call schedule."""


class ScheduleReply(CommandReply, kw_only=True):
    """Reply to ``schedule`` (revision 8): the model's schedules that have not ended, soonest first, both sources."""

    model: Name | None = None
    schedules: list[ScheduleRow] = []
    added: str | None = None
    deleted: str | None = None


class DecisionRow(msgspec.Struct, kw_only=True):
    ts: float
    desired: Count
    reason: str


class StatusRow(msgspec.Struct, kw_only=True):
    """One model in `pulsescale status`."""

    model: Name
    scaler: str
    desired: Count
    ready: Count
    activating: Count
    warm: Count
    """Claimable slots: warm, not drained, their agent's lease fresh."""
    stale: Count = 0
    """Slots that read `warm` but whose agent's lease has lapsed: not claimable (revision 2)."""
    panic: bool = False
    mode: str = "starting"
    override: Override | None = None
    reason: str = ""
    decisions: list[DecisionRow] = []
    key: str | None = None
    """Revision 5: the ScaledObject's ``<namespace>.<name>`` (its `pulse_scalers` key)."""
    fallback: bool = False
    """Revision 5: the fallback count is in force (metrics stale beyond `fallback.failureThreshold`)."""
    paused: bool = False
    """Revision 5: paused by annotation or on-call command."""
    cold_requested: Count = 0
    """Revision 5: replicas last asked of the cold path (the pool could not provide them); 0 once met."""
    last_active_at: float | None = None
    """Revision 5: last time demand was above the activation threshold (Unix s)."""
    last_scale_at: float | None = None
    """Revision 5: last time the desired count changed (Unix s)."""
    owner: str | None = None
    """Revision 6: identity of the autoscaler replica that owns the model's shard; None while none does."""
    shard: int | None = None
    """Revision 6: the model's shard (`shard_of`)."""
    scheduled_floor: Count | None = None
    """Revision 8: the floor the schedules in force raise the count to (before ``maxReplicaCount``); None: none."""
    schedules: list[ScheduleRow] = []
    """Revision 8: the schedules in force, then the next one to start (if any)."""
    pool_floor: Count | None = None
    """Revision 8: the slots the warm pool should hold for the schedules, from a lead time before their start (the
    operator keeps at least this many standby pods); None: no schedule in force or about to start."""


class StatusReply(CommandReply, kw_only=True):
    models: list[StatusRow] = []
    replicas: list[ReplicaRecord] = []
    """Revision 6: the live autoscaler replicas and the shards each holds."""
    missing: list[str] = []
    """Revision 6: replicas that did not answer the status in time; their models are missing from `models`."""


class PoolSlot(msgspec.Struct, kw_only=True):
    """One slot in `pulsescale pool`."""

    key: str
    model: Name
    node: Name
    rack: str = ""
    state: SlotState
    drain: bool = False
    agent: Literal["fresh", "stale"]
    resident: bool = False
    endpoint: str | None = None
    reason: str | None = None
    engine: str | None = None
    """Revision 4: as `SlotRecord.engine`, `engine_mode`, `rootfs_mounted` and `image_digest`."""
    engine_mode: EngineMode | None = None
    rootfs_mounted: bool = False
    image_digest: str | None = None
    skew_s: float | None = None
    """Revision 10: how far the clock of the slot's agent is from the autoscaler's (agent minus autoscaler,
    seconds, from its recent heartbeats); None: none of its heartbeats heard yet."""


class PoolReply(CommandReply, kw_only=True):
    slots: list[PoolSlot] = []
    counts: dict[str, dict[str, int]] = {}
    """Model -> state -> slots, for every slot (also those cut from `slots` to fit the message)."""
    now: float = 0.0
    truncated: Count = 0
    """Slots left out of `slots` to stay under `MAX_MESSAGE_BYTES`."""


class ActivateReply(TypedReply, kw_only=True):
    """The agent's answer to `activate`. On success: the endpoint (informational: the serving endpoint is the one
    in the holder's fenced `ready` write) and the stage timings; on failure the error, the stage it failed at and
    the state the slot goes to."""

    slot: Name | None = None
    key: str | None = None
    state: SlotState | None = None
    endpoint: str | None = None
    token: int | None = None
    claim_id: str | None = None
    timings: StageTimings | None = None
    engine_mode: EngineMode | None = None
    """Revision 4: as `SlotRecord.engine_mode`."""
    loaded_bytes: Count = 0
    load_mode: str | None = None
    loader: str | None = None
    repeated: bool = False
    """A retry of an activation that had already succeeded: answered from the running engine."""
    stage: str | None = None


class DeactivateReply(TypedReply, kw_only=True):
    slot: Name | None = None
    key: str | None = None
    state: SlotState | None = None
    note: str | None = None


class PrewarmReply(TypedReply, kw_only=True):
    accepted: list[Name] = []
    skipped_serving: list[Name] = []
    state: SlotState | None = None


class WeightsStatus(msgspec.Struct, kw_only=True):
    model: str
    source: str
    staged_dir: str | None = None
    files: Count = 0
    staged_bytes: Count = 0
    staged_at: float | None = None
    locked: bool = False
    locked_bytes: Count = 0
    lock_error: str | None = None
    error: str | None = None
    hashed_bytes: Count = 0
    """Revision 4: bytes read and hashed by the last stage (0 when every file was reused unchanged)."""
    budget_bytes: Count | None = None
    """Revision 4: the agent's shm budget (``--shm-budget``), None when unbounded."""
    progress: float | None = None
    """Revision 4: fraction of the bytes to copy done, while a stage runs (None otherwise)."""


class RootfsStatus(msgspec.Struct, kw_only=True):
    """Revision 4: the EROFS rootfs image of an agent."""

    source: str
    digest: str | None = None
    image: str | None = None
    mountpoint: str | None = None
    mounted: bool = False
    resident_pct: float | None = None
    """Share of the image's file pages in the page cache (``mincore``), 0-100, at the last check."""
    reason: str | None = None
    """Why the rootfs stage was skipped or failed (no root, no erofs-utils, no kernel EROFS support, ...)."""
    images_built: Count = 0
    """Images this agent process built (0 after a restart that found its image: restart reuse, by counter)."""
    mounts_reused: Count = 0
    """Mounts found in place and reused rather than mounted again."""
    rewarms: Count = 0
    """Times the residency re-check found pages dropped and read the image back in."""
    pinned_bytes: Count = 0
    """Revision 7: bytes of the image's files this agent holds locked in memory (mmap + mlock); 0: not pinned
    (``--no-pin-rootfs``, or the lock was refused at the first file)."""
    pin_refused: str | None = None
    """Revision 7: why locking the image stopped (no CAP_IPC_LOCK, RLIMIT_MEMLOCK, ...); None: all of it is locked,
    or pinning is off."""


class AgentSlotStatus(msgspec.Struct, kw_only=True):
    slot: Name
    key: str
    phase: str
    state: SlotState | None = None
    reason: str | None = None
    highest_token: Count = 0
    claim_id: str | None = None
    """Always null since revision 3 (status reaches on-call and HTTP; the claim id is the holder's secret)."""
    endpoint: str | None = None
    activations: Count = 0
    consecutive_failures: Count = 0
    last_timings: StageTimings | None = None
    engine: dict[str, Any] | None = None
    engine_mode: EngineMode | None = None
    """Revision 4: as `SlotRecord.engine_mode`."""
    log_path: str | None = None
    """Revision 4: the engine's log file on the node (``command`` and ``vllm`` engines)."""
    log_tail: list[str] = []
    """Revision 4: the last lines of that log."""


class AgentStatusReply(TypedReply, kw_only=True):
    node: Name | None = None
    rack: str = ""
    engine: str | None = None
    engine_memory: str | None = None
    loader: str | None = None
    loader_reason: str | None = None
    weights: WeightsStatus | None = None
    rootfs: RootfsStatus | None = None
    unlocked: bool = False
    slots: list[AgentSlotStatus] = []
    uptime_s: float = 0.0


R = TypeVar("R", bound=TypedReply)


def refusal(type_: type[R], code: str, message: str, **fields: Any) -> R:
    """A failed typed reply: ``refusal(ActivateReply, "stale_token", "...", slot="s0")``."""
    return type_(ok=False, error=ReplyError(code, message), **fields)


def ok_reply(**fields: Any) -> bytes:
    return _encoder.encode({"v": VERSION, "ok": True, **fields})


def error_reply(code: str, message: str, **fields: Any) -> bytes:
    return _encoder.encode({"v": VERSION, "ok": False, "error": {"code": code, "message": message}, **fields})


def decode_reply(data: bytes) -> Reply:
    raw = _decode_object(data)
    ok = raw.pop("ok", None)
    if not isinstance(ok, bool):
        raise BadMessage("missing_field" if ok is None else "wrong_type", "reply has no boolean `ok`")
    err = raw.pop("error", None)
    raw.pop("v", None)
    if ok:
        return Reply(ok=True, fields=raw)
    if not isinstance(err, dict) or not isinstance(err.get("code"), str):
        raise BadMessage("wrong_type", "a failed reply must carry error {code, message}")
    return Reply(ok=False, error=ReplyError(err["code"], str(err.get("message", ""))), fields=raw)


# --- encode / decode --------------------------------------------------------------------------------------------------

_encoder: Final = msgspec.json.Encoder()
_decoders: dict[type, msgspec.json.Decoder[Any]] = {}
_object_decoder: Final = msgspec.json.Decoder(dict[str, Any])
M = TypeVar("M", bound=msgspec.Struct)

# msgspec's messages are stable within a major version; this maps them onto our reasons.
_NON_FINITE_TOKEN: Final = re.compile(rb"(?<![\w\"])-?(NaN|Infinity)(?![\w\"])")
_REASON_TAG: Final = re.compile(r"^\[(\w+)\] ")
_NEGATIVE: Final = re.compile(r"^Expected `(int|float)` >= [01](\.0)?( |$)")  # a count's floor; other floors: bad_value


def encode(msg: msgspec.Struct) -> bytes:
    """Encode a message; refuses to emit something our own consumers would reject as too large."""
    data = _encoder.encode(msg)
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage("too_large", f"{type(msg).__name__} encodes to {len(data)} bytes > {MAX_MESSAGE_BYTES}")
    return data


def _reason_for(err: msgspec.ValidationError) -> BadMessage:
    text = str(err)
    tagged = _REASON_TAG.match(text)
    if tagged:
        return BadMessage(tagged.group(1), text[tagged.end() :])
    if text.startswith("Object missing required field `v`"):
        return BadMessage("bad_version", '`v` is missing; send "v": 1')
    if text.startswith("Object missing required field"):
        return BadMessage("missing_field", text)
    if text.startswith("Expected `object`"):
        return BadMessage("not_object", text)
    if "matching regex" in text:
        return BadMessage("bad_name", text + " (names are lowercase letters, digits, '-' and '_', no dots)")
    if text.startswith("Number out of range"):
        return BadMessage("non_finite", text)
    if _NEGATIVE.match(text):
        return BadMessage("negative", text)
    if "at `$.v`" in text:
        return BadMessage("bad_version", text)
    if text.startswith("Expected `") and ", got `" in text:
        return BadMessage("wrong_type", text)
    return BadMessage("bad_value", text)


def _check_size(data: bytes) -> None:
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage("too_large", f"{len(data)} bytes > {MAX_MESSAGE_BYTES}")


def _decode_object(data: bytes) -> dict[str, Any]:
    _check_size(data)
    try:
        return _object_decoder.decode(data)
    except msgspec.ValidationError as err:
        raise BadMessage("not_object", str(err)) from None
    except msgspec.DecodeError as err:
        raise _bad_json(data, err) from None


def _bad_json(data: bytes, err: msgspec.DecodeError) -> BadMessage:
    if _NON_FINITE_TOKEN.search(data):
        return BadMessage("non_finite", "NaN and Infinity are not JSON numbers")
    return BadMessage("bad_json", str(err))


def decode(data: bytes, type_: type[M]) -> M:
    """Decode and validate one v1 message, or raise `BadMessage` with a reason from `REASONS`."""
    _check_size(data)
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        msg = dec.decode(data)
    except msgspec.ValidationError as err:
        raise _reason_for(err) from None
    except msgspec.DecodeError as err:
        raise _bad_json(data, err) from None
    # `v` has a default so code can build messages without it, but on the wire it is required. A decoded
    # message with no `"v"` token anywhere cannot have carried it (the check costs no second parse).
    if isinstance(msg, Message) and b'"v"' not in data:
        raise BadMessage("bad_version", '`v` is missing; send "v": 1')
    return msg  # type: ignore[no-any-return]


# --- request freshness and idempotency -------------------------------------------------------------------------


def check_fresh(req: Request, now: float) -> None:
    """Refuse a request past its expiry (nats-py replays buffered publishes after a reconnect, possibly late), and
    one that would stay valid for more than `MAX_REQUEST_TTL_S`: every admitted request expires soon, so a replay
    is refused and the ledger forgets it in bounded time."""
    if now > req.expires_at:
        raise BadMessage("expired", f"request {req.id} expired {now - req.expires_at:.3f} s ago")
    if req.expires_at > now + MAX_REQUEST_TTL_S:
        raise BadMessage(
            "too_late",
            f"request {req.id} expires {req.expires_at - now:.0f} s from now; at most {MAX_REQUEST_TTL_S:.0f} s "
            "is accepted (check the sender's clock)",
        )


class RequestLedger:
    """Remembers applied request ids and their replies, so a repeat is answered but not applied again.

    Bounded (oldest forgotten first) and forgetting ids whose request has expired anyway, since an expired
    repeat is refused by `check_fresh` before the ledger is asked.
    """

    def __init__(self, max_entries: int = 10_000) -> None:
        self._max = max_entries
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def seen(self, req_id: str) -> bytes | None:
        hit = self._entries.get(req_id)
        return None if hit is None else hit[1]

    def record(self, req: Request, reply: bytes, now: float) -> None:
        self._entries[req.id] = (req.expires_at, reply)
        self._entries.move_to_end(req.id)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
        # Expired entries can never match again (the request would be refused first); drop a few per call.
        for _ in range(2):
            oldest = next(iter(self._entries.items()), None)
            if oldest is None or oldest[1][0] >= now:
                break
            self._entries.popitem(last=False)


def admit(req: Request, now: float, ledger: RequestLedger) -> None:
    """Gate for every request consumer: refuse it if expired, and if already applied raise `DuplicateRequest`
    carrying the first reply (answered again, not applied again)."""
    check_fresh(req, now)
    previous = ledger.seen(req.id)
    if previous is not None:
        raise DuplicateRequest(req.id, previous)
