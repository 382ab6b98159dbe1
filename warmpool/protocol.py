"""Wire contract v1: every subject, bucket, and message pulsescale puts on NATS.

This is the one module that spells a subject or bucket name. Gateways and tools are written against it, so
it only grows by adding optional fields. All messages are UTF-8 JSON objects with ``"v": 1``; unknown fields
are ignored. `decode` enforces every rule of DESIGN.md ("Wire contract v1") and raises `BadMessage` with one
of `REASONS`, so consumers count rejections by reason and keep going.

Pure: no I/O, no NATS import; `now` is passed in where time matters.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec

from warmpool.errors import BadMessage, DuplicateRequest

__all__ = [
    "AGENTS_BUCKET",
    "AGENT_VERBS",
    "AUDIT_STREAM",
    "AUDIT_WILDCARD",
    "CMD_VERBS",
    "CMD_WILDCARD",
    "EVENT_TYPES",
    "LEASES_BUCKET",
    "MAX_MESSAGE_BYTES",
    "NAME_PATTERN",
    "QUEUE_WILDCARD",
    "REASONS",
    "SCALERS_BUCKET",
    "SLOTS_BUCKET",
    "SLOT_STATES",
    "ActivateReply",
    "ActivateRequest",
    "AgentLease",
    "AgentStatusRequest",
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
    "Fallback",
    "ScaleCommand",
    "ScaleTargetRef",
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
    "parse_slot_key",
    "queue_subject",
    "slot_key",
]

VERSION: Final = 1
MAX_MESSAGE_BYTES: Final = 64 * 1024
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

CMD_VERBS: Final = ("scale", "pause", "resume", "status", "pool", "drain", "undrain")
AGENT_VERBS: Final = ("prewarm", "activate", "deactivate", "status")
EVENT_TYPES: Final = (
    "scale.decision",
    "slot.claimed",
    "slot.ready",
    "slot.released",
    "slot.failed",
    "pool.exhausted",
    "cold.start",
)
SLOT_STATES: Final = (
    "prewarming",
    "warm",
    "claimed",
    "activating",
    "ready",
    "releasing",
    "failed",
    "draining",
)

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
    "subject_mismatch",  # the payload names another model/node than its subject
    "expired",  # a request past its expires_at
    "duplicate_id",  # a request id already applied
)


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
}

# --- autoscaler -> nodeagent (pulse.agent.<node>.<verb>) -------------------------------------------------------


class PrewarmRequest(Request, kw_only=True):
    """Stage (or re-stage) a slot; without `slot`, every slot of the agent."""

    slot: Name | None = None


class ActivateRequest(Request, kw_only=True):
    """Take a claimed slot into service. `token` is the claim write's KV revision; `deadline` is Unix s."""

    slot: Name
    token: Token
    claim_id: Id
    deadline: float

    def _validate(self) -> None:
        super()._validate()
        _finite(self, "deadline")


class DeactivateRequest(Request, kw_only=True):
    slot: Name
    token: Token
    claim_id: Id | None = None


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


class ActivateReply(Message, kw_only=True):
    ok: bool
    endpoint: str | None = None
    timings: StageTimings | None = None
    error: dict[str, str] | None = None


# --- KV records ---------------------------------------------------------------------------------------------------

SlotState = Literal["prewarming", "warm", "claimed", "activating", "ready", "releasing", "failed", "draining"]


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

    @property
    def key(self) -> str:
        return f"{self.model}.{self.node}.{self.slot}"

    def _validate(self) -> None:
        _finite(self, "updated_at")


class AgentLease(Message, kw_only=True):
    """The value under ``<node>`` in `pulse_agents`: a heartbeat judged fresh by the reader's clock."""

    node: Name
    slots: list[Name] = []
    heartbeat_at: float
    lease_s: float
    rack: str = ""
    gpus: Count = 0
    shm_free_bytes: Count = 0

    def _validate(self) -> None:
        _finite(self, "heartbeat_at", "lease_s")
        if self.lease_s <= 0:
            raise ValueError("[bad_value] `lease_s` must be > 0")

    def fresh(self, now: float) -> bool:
        return now <= self.heartbeat_at + self.lease_s


# --- ScaledObject (KV pulse_scalers, key <namespace>.<name>) ----------------------------------------------------
# Field names mirror KEDA's where they mean the same (camelCase on the wire, snake_case in Python).


class _Spec(msgspec.Struct, kw_only=True, rename="camel", forbid_unknown_fields=False):
    pass


# Upper bounds keep the policy's arithmetic finite: a day is longer than any window anyone means.
Seconds = Annotated[float, msgspec.Meta(gt=0, le=86_400)]


class ScaleTargetRef(_Spec, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
    kind: str = "Deployment"
    api_version: str = "apps/v1"


class TriggerMetadata(_Spec, kw_only=True):
    model: Name
    target_queue_depth: Annotated[float, msgspec.Meta(ge=0.001, le=1e9)] = 4.0
    """Queue + in-flight requests one replica should carry; desired = demand / this."""
    activation_queue_depth: Annotated[float, msgspec.Meta(ge=0, le=1e9)] = 0.0
    """From zero replicas, scale up only when demand exceeds this (KEDA's activation threshold)."""


class Trigger(_Spec, kw_only=True):
    type: Literal["gateway-queue"]
    metadata: TriggerMetadata


class Fallback(_Spec, kw_only=True):
    failure_threshold: Annotated[int, msgspec.Meta(ge=1)]
    """Missed sample intervals (of `advanced.staleAfterSeconds`) before the fallback count applies."""
    replicas: Count


class Advanced(_Spec, kw_only=True):
    stable_window_seconds: Seconds = 60.0
    panic_window_seconds: Seconds = 6.0
    panic_threshold: Annotated[float, msgspec.Meta(ge=1, le=1000)] = 2.0
    """Panic when panic-window demand >= this x ready capacity (Knative's default 200 %)."""
    scale_down_stabilization_seconds: Annotated[float, msgspec.Meta(ge=0, le=86_400)] = 60.0
    scale_down_percent: Annotated[float, msgspec.Meta(gt=0, le=100)] = 50.0
    """At most this share of the replicas (and at least one) is removed per `scaleDownPeriodSeconds`."""
    scale_down_period_seconds: Seconds = 60.0
    stale_after_seconds: Seconds = 1.0
    """A gateway silent this long leaves the demand sum (3 sample intervals of ~300 ms)."""
    lead_time_seconds: Seconds = 2.5
    """Forecast horizon until measured claim -> ready times exist (DESIGN: p90, default 2.5 s)."""


class WarmPool(_Spec, kw_only=True):
    size: Count = 0
    image: str | None = None
    weights: str | None = None
    engine: Literal["local", "command", "vllm"] = "local"
    loader: Literal["auto", "host", "cuda-pinned", "kvikio"] = "auto"


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

    def __post_init__(self) -> None:
        if self.min_replica_count > self.max_replica_count:
            raise ValueError("[bad_value] `minReplicaCount` must be <= `maxReplicaCount`")
        if self.idle_replica_count is not None and self.idle_replica_count >= self.min_replica_count > 0:
            raise ValueError("[bad_value] `idleReplicaCount` must be < `minReplicaCount` (as in KEDA)")
        if len({t.metadata.model for t in self.triggers}) != 1:
            raise ValueError("[bad_value] all triggers of one ScaledObject must name the same model")

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

    @property
    def key(self) -> str:
        return f"{self.namespace}.{self.name}"


# --- events and audit -----------------------------------------------------------------------------------------------


class Event(Message, kw_only=True):
    """Published on ``pulse.events.<model>``; the optional fields are the ones that explain the event."""

    type: Literal[
        "scale.decision",
        "slot.claimed",
        "slot.ready",
        "slot.released",
        "slot.failed",
        "pool.exhausted",
        "cold.start",
    ]
    model: Name
    ts: float
    reason: Text | None = None
    node: Name | None = None
    slot: Name | None = None
    token: int | None = None
    claim_id: str | None = None
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


# --- replies ----------------------------------------------------------------------------------------------------------


class ReplyError(msgspec.Struct):
    code: str
    message: str


class Reply(msgspec.Struct):
    """A decoded request/reply answer. Extra fields of an ok reply are in `fields`."""

    ok: bool
    error: ReplyError | None = None
    fields: dict[str, Any] = {}


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
    """Refuse a request past its expiry: nats-py replays buffered publishes after a reconnect, possibly late."""
    if now > req.expires_at:
        raise BadMessage("expired", f"request {req.id} expired {now - req.expires_at:.3f} s ago")


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
