"""Messages of wire contract v1 that travel on subjects: samples, on-call commands, agent requests, events.

- ``pulse.queue.<model>`` (gateway -> autoscaler): `QueueSample`.
- ``pulse.cmd.<verb>`` (on-call -> autoscaler): the `Command` types, by verb in `COMMAND_TYPES`.
- ``pulse.agent.<node>.<verb>`` (autoscaler -> node agent): the `Request` types, by verb in `AGENT_REQUEST_TYPES`.
- ``pulse.events.<model>`` and the `PULSE_AUDIT` stream: `Event`, `AuditRecord`.

Their replies are in `warmpool.protocol.replies`, the KV values in `warmpool.protocol.records`. Pure: no I/O.
"""

from __future__ import annotations

import math
from typing import Any, Final

import msgspec

from warmpool.protocol.base import Count, Id, Message, Name, Request, Text, Token, _finite, _not_negative
from warmpool.protocol.names import MAX_REQUEST_TTL_S, VERSION, EventType
from warmpool.protocol.scaledobject import Schedule

__all__ = [
    "AGENT_REQUEST_TYPES",
    "COMMAND_TYPES",
    "ActivateRequest",
    "AgentStatusRequest",
    "AuditRecord",
    "Command",
    "DeactivateRequest",
    "DrainCommand",
    "Event",
    "PauseCommand",
    "PoolCommand",
    "PrewarmRequest",
    "QueueSample",
    "ResumeCommand",
    "ScaleCommand",
    "ScheduleCommand",
    "StageTimings",
    "StatusCommand",
    "UndrainCommand",
]

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

    def __post_init__(self) -> None:
        # Every sample (10,000 a second at 1,000 models): the checks below in one call, not four; a sample that
        # fails them goes the general way, which names the reason.
        if self.v == VERSION and 0.0 <= self.ts < math.inf:
            return
        super().__post_init__()

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
