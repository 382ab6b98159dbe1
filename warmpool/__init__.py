"""warmpool — the shared core of pulsescale: wire contract, slot lifecycle, registry and placement.

Internal code imports modules (``from warmpool import registry``); the names below are the public face.
"""

from warmpool.errors import (
    BadMessage,
    ClaimConflict,
    DuplicateRequest,
    InvalidTransition,
    LeaseExpired,
    NatsUnavailable,
    NoSlotAvailable,
    PermissionDenied,
    PulsescaleError,
    SlotNotFound,
    StaleToken,
)
from warmpool.protocol import AgentLease, SlotRecord


def __getattr__(name: str) -> object:
    # The registry pulls in nats: load it only when asked, so the pure modules stay import-light.
    if name in ("Claim", "KvSlotStore"):
        from warmpool import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'warmpool' has no attribute {name!r}")


__all__ = [
    "AgentLease",
    "BadMessage",
    "Claim",
    "ClaimConflict",
    "DuplicateRequest",
    "InvalidTransition",
    "KvSlotStore",
    "LeaseExpired",
    "NatsUnavailable",
    "NoSlotAvailable",
    "PermissionDenied",
    "PulsescaleError",
    "SlotNotFound",
    "SlotRecord",
    "StaleToken",
]
