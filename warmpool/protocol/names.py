"""Names of wire contract v1: subjects, buckets, KV key spelling, limits, rejection reasons and error codes.

The one place a subject, bucket or key is spelled: every other module (and every gateway or tool) builds them with
the functions here. A name that breaks the rules is refused `BadMessage` ``bad_name`` (``bad_value`` for an unknown
verb). Pure: no I/O.
"""

from __future__ import annotations

import re
import zlib
from typing import Final, Literal, get_args

from warmpool.errors import BadMessage

__all__ = [
    "AGENTS_BUCKET",
    "AGENT_PREFIX",
    "ASSIGNMENTS_BUCKET",
    "AGENT_VERBS",
    "AUDIT_PREFIX",
    "AUDIT_STREAM",
    "AUDIT_WILDCARD",
    "BUCKETS",
    "CMD_PREFIX",
    "CMD_VERBS",
    "CMD_WILDCARD",
    "ERROR_CODES",
    "EVENTS_PREFIX",
    "IDENTITY_PATTERN",
    "LEADER_LEASE_KEY",
    "LEASES_BUCKET",
    "DEFAULT_MAX_REPLICAS",
    "MAX_CLOCK_SKEW_S",
    "MAX_LEASE_S",
    "MAX_MESSAGE_BYTES",
    "LABEL_KEY_PATTERN",
    "LABEL_VALUE_PATTERN",
    "MAX_LABELS",
    "MAX_MODELS_PER_NODE",
    "MAX_OVERRIDE_S",
    "MAX_REPLICAS_ENV",
    "MAX_REQUEST_TTL_S",
    "MAX_SCHEDULES",
    "MAX_SCHEDULE_S",
    "MAX_SLOTS_PER_NODE",
    "MAX_TRUSTED_SKEW_S",
    "MAX_CONDITION_REASON",
    "MAX_OBJECT_CONDITIONS",
    "NAME_PATTERN",
    "OBJECTS_BUCKET",
    "OBJECT_NAME_PATTERN",
    "OVERRIDE_KEY_PREFIX",
    "QUEUE_PREFIX",
    "QUEUE_WILDCARD",
    "REASONS",
    "REPLICA_KEY_PREFIX",
    "REPLICA_PREFIX",
    "SCALERS_BUCKET",
    "SCHEDULE_KEY_PREFIX",
    "SHARDS",
    "SHARD_KEY_PREFIX",
    "SLOTS_BUCKET",
    "SLOT_STATES",
    "TARGET_PATTERN",
    "VERSION",
    "EngineMode",
    "ErrorCode",
    "EventType",
    "SlotState",
    "agent_subject",
    "audit_subject",
    "cmd_subject",
    "events_subject",
    "is_identity",
    "is_name",
    "override_key",
    "parse_slot_key",
    "queue_subject",
    "replica_key",
    "replica_subject",
    "schedule_key",
    "shard_key",
    "shard_of",
    "slot_key",
]

VERSION: Final = 1
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
MAX_MODELS_PER_NODE: Final = 64
"""The most models one `NodeAssignment` may list (revision 11): a node holds a few models per GPU, 8 GPUs; a longer
list is a generated mistake, refused (``bad_value``) rather than trusted."""
MAX_LABELS: Final = 64
"""The most labels a `ScalerRecord` carries (revision 12): Kubernetes sets no count, but ``metadata`` is bounded
in size; a ScaledObject with more is refused (``bad_value``), not cut (a selector would match a different set)."""
LABEL_KEY_PATTERN: Final = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
"""A Kubernetes label key: an optional DNS-subdomain prefix and ``/``, then a name of at most 63 characters."""
LABEL_VALUE_PATTERN: Final = r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$"
"""A Kubernetes label value: empty, or at most 63 characters as a label name."""
OBJECT_NAME_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""Revision 13: a Kubernetes object name (a DNS subdomain, at most 253 characters), as an `ObjectStatus` names its
ScaledObject: the mirror lists CRs the validator refused, dotted names included (a namespace has no dot, so the
key ``<namespace>.<name>`` still splits at its first dot)."""
TARGET_PATTERN: Final = r"^[A-Za-z][A-Za-z0-9]{0,62}/[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
"""Revision 13: a scale target as ``Kind/name`` (``Deployment/qwen``), as `ObjectStatus.target` spells it."""
MAX_OBJECT_CONDITIONS: Final = 8
"""Revision 13: the most conditions an `ObjectStatus` carries: the CR has four (Ready, Active, Fallback, Paused);
room for a few more from a newer operator, not for a list that grows."""
MAX_CONDITION_REASON: Final = 1024
"""Revision 13: the longest condition reason, as Kubernetes bounds ``metav1.Condition.reason``."""
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
ASSIGNMENTS_BUCKET: Final = "pulse_assignments"
"""Revision 11: ``<node>`` -> `NodeAssignment`, the models that node may offer. Written by the operator's user (as
`pulse_scalers`), only read by the agents: a node's own agent cannot widen what it may serve."""
OBJECTS_BUCKET: Final = "pulse_objects"
"""Revision 13: ``<namespace>.<name>`` -> `ObjectStatus`, every ScaledObject CR the operator sees, published or not,
with the conditions it wrote to the CR. Written by the operator's user only, read by on-call (``pulsescale get so``
shows what the CR says without Kubernetes credentials); nothing acts on it."""
BUCKETS: Final = (SLOTS_BUCKET, AGENTS_BUCKET, SCALERS_BUCKET, LEASES_BUCKET, ASSIGNMENTS_BUCKET, OBJECTS_BUCKET)
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
DEFAULT_MAX_REPLICAS: Final = 1000
"""The most replicas of one model that `apply`, the on-call commands and the autoscaler accept unless configured
otherwise (``$PULSESCALE_MAX_REPLICAS``, ``pulsescale autoscaler --max-replicas``): well above any single model's
fleet today, and small enough that a typo (``100000``, which the wire's `Count` allows) is refused. The one bound
every reader of a replica count uses."""
MAX_REPLICAS_ENV: Final = "PULSESCALE_MAX_REPLICAS"
"""Environment variable that raises (or lowers) `DEFAULT_MAX_REPLICAS` for `apply` and the autoscaler."""
MAX_OVERRIDE_S: Final = 24 * 3600.0
"""The longest a ``scale`` override may last (``--for``): a day covers any incident and its night; an override
that outlives its reason holds a model at a stale count unnoticed, so a longer hold is refused — scale again when
it lapses, or ``pause``, which is visible as paused until someone resumes it. The client checks it before sending,
the autoscaler again on receipt and when it restores a stored override."""

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
    "unassigned_model",  # revision 11: a warm or ready slot of a model its node's assignment does not list
    "bad_source",  # revision 14: a ScaledObject trigger's source block that breaks its rules (the bridge's reason)
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


# --- keys in pulse_leases, shards and the replica subject ------------------------------------------------------


def override_key(model: str) -> str:
    return _check(OVERRIDE_KEY_PREFIX + model, "model", model)


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
