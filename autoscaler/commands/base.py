"""What the parts of the on-call command plane share: its settings, its two seams into the rest of the autoscaler,
and what handling one request comes to.

`CommandSettings` bounds and times the whole plane. `ControlPlane` is what the verbs need from the controller (the
daemon implements it); `Router` says who owns which model (`autoscaler.shards.leases.ShardLeases` implements it). The
work of a verb (`autoscaler.commands.verbs`, `autoscaler.commands.status`) ends in an `Outcome`, or raises `Refused`
with the error code the client gets; the service (`autoscaler.commands.service`) remembers, audits and sends either. The
public names here are re-exported by `autoscaler.commands.service`: other code imports them from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from warmpool import protocol
from warmpool.protocol import ErrorCode, OnCallSchedule, Override, ReplicaRecord, ScaledObjectSpec, StatusRow

__all__ = [
    "MAX_SCHEDULE_AHEAD_S",
    "CommandSettings",
    "ControlPlane",
    "Outcome",
    "Refused",
    "Router",
]

MAX_SCHEDULE_AHEAD_S: Final = 366 * 86_400.0
"""The furthest ahead ``pulsescale schedule`` may start a floor: a year covers next year's launch; further is a
typo in the year, and a stored schedule nobody remembers."""


class ControlPlane(Protocol):
    """What the command plane needs from the controller; the controller implements it."""

    def spec_for(self, model: str) -> ScaledObjectSpec | None:
        """The model's ScaledObject spec, or None for a model no ScaledObject names."""
        ...

    def models(self) -> list[str]: ...

    async def set_override(self, model: str, override: Override | None) -> None:
        """Install an on-call override (it beats the policy until it expires); None hands the model back."""
        ...

    def schedules_for(self, model: str) -> tuple[OnCallSchedule, ...]:
        """The model's on-call schedules (``pulsescale schedule``), as set; its ScaledObject's are in its spec."""
        ...

    async def set_schedules(self, model: str, schedules: tuple[OnCallSchedule, ...]) -> None:
        """Store the model's on-call schedules (a new owner restores them) and decide on them at once."""
        ...

    def status(self, model: str | None) -> list[StatusRow]:
        """One row per model (all, or `model`), its decisions newest last."""
        ...


class Router(Protocol):
    """Who owns which model, from this replica's view of the shard leases (`autoscaler.shards.leases.ShardLeases`
    implements it). Read on every request: it must be cheap and never block."""

    @property
    def identity(self) -> str:
        """This replica's identity (`protocol.IDENTITY_PATTERN`): its hand-over subject's token."""
        ...

    def owns_model(self, model: str) -> bool:
        """Whether this replica holds the lease of the model's shard now."""
        ...

    def owner_of_model(self, model: str) -> str | None:
        """Identity of the live replica holding the model's shard, or None while none does."""
        ...

    def replicas(self) -> Sequence[ReplicaRecord]:
        """The live replicas, this one included."""
        ...


@dataclass(frozen=True)
class CommandSettings:
    queue_group: str = "pulsescale-autoscaler"
    """Queue group of the command subscription: while two replicas briefly both believe they lead, each request
    still reaches only one of them."""
    audit_max_age_s: float = 90 * 24 * 3600.0
    """How long audit records are kept: 90 days covers a quarter's incident reviews; longer belongs in a log
    archive, not on the broker's disk."""
    audit_max_bytes: int = 1 << 30
    """Size cap of the audit stream (oldest dropped first), so a misbehaving client cannot fill the broker's disk."""
    audit_replicas: int | None = None
    """JetStream replicas of the audit stream; None: as the registry's buckets (`registry.replicas_for`: 1 on a
    single server, 3 on a cluster, or ``$PULSESCALE_KV_REPLICAS``)."""
    audit_timeout_s: float = 1.0
    """How long the audit write may take before the reply goes out anyway (logged): well under the CLI's 5 s."""
    ledger_entries: int = 10_000
    """Replies remembered for duplicate ids; far more than on-call traffic within one request lifetime."""
    status_decisions: int = 10
    """Newest decisions per model sent in a status reply; the autoscaler may keep more."""
    max_replicas: int = protocol.DEFAULT_MAX_REPLICAS
    """The largest replica count ``scale`` and ``pause`` accept, whatever a ScaledObject's maxReplicaCount says
    (`protocol.DEFAULT_MAX_REPLICAS`; ``pulsescale autoscaler --max-replicas``)."""
    max_override_s: float = protocol.MAX_OVERRIDE_S
    """The longest ``scale --for`` accepted (`protocol.MAX_OVERRIDE_S`)."""
    leadership_poll_s: float = 0.25
    """How often the service checks `holds_shards` to (un)subscribe: elections take a lease period (seconds), so
    this adds little to a failover; the per-request fence covers the lag on deposition."""
    peer_status_timeout_s: float = 1.5
    """How long the front waits for the other replicas' rows in a ``status`` of every model: a live replica
    answers in milliseconds, and the CLI gives up after 5 s, so a silent replica (dying, partitioned) is named in
    the reply with time to spare instead of costing the whole answer."""


@dataclass
class Outcome:
    """What handling one request came to: the reply to send, whether it was applied (for the audit record), and
    whether the ledger remembers it for a repeat of its id."""

    reply: bytes
    applied: bool
    remember: bool
    audit_reply: dict[str, Any] | None = None
    """What the audit record keeps of the reply, when not all of it (status and pool are summarised)."""


class Refused(Exception):
    """A request refused by a check (or by routing, or the leader fence): answered with `code` and `message`;
    remembered by the ledger unless `remember` is False (a transient refusal, worth a retry)."""

    def __init__(self, code: ErrorCode, message: str, *, remember: bool = True) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.remember = remember
