"""Replies of wire contract v1: what the autoscaler's on-call commands and the node agents answer.

`Reply` is the untyped view any client decodes (`decode_reply`); the typed replies (`TypedReply` and its subclasses)
are what each verb answers, with the status rows the on-call tools show (`StatusRow`, `PoolSlot`, `ScheduleRow`,
`AgentSlotStatus`, ...). `refusal`, `ok_reply` and `error_reply` build failed and plain replies. Reply error codes are
`warmpool.protocol.names.ERROR_CODES`. Pure: no I/O.
"""

# msgspec copies a mutable default (`= []`) per instance; ruff cannot tell these classes are Structs when
# their base (`Message`) is imported from another module, so RUF012 is off here.
# ruff: noqa: RUF012

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

from warmpool.errors import BadMessage
from warmpool.protocol.base import Count, Message, Name
from warmpool.protocol.codec import _decode_object, _encoder
from warmpool.protocol.messages import StageTimings
from warmpool.protocol.names import VERSION, EngineMode, SlotState
from warmpool.protocol.records import Override, ReplicaRecord

__all__ = [
    "ActivateReply",
    "AgentSlotStatus",
    "AgentStatusReply",
    "CommandReply",
    "DeactivateReply",
    "DecisionRow",
    "DrainReply",
    "OverrideReply",
    "PoolReply",
    "PoolSlot",
    "PrewarmReply",
    "Reply",
    "ReplyError",
    "RootfsStatus",
    "ScheduleReply",
    "ScheduleRow",
    "StatusReply",
    "StatusRow",
    "TypedReply",
    "WeightsStatus",
    "decode_reply",
    "error_reply",
    "ok_reply",
    "refusal",
]

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
