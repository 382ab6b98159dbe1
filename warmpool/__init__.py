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
    PulsescaleError,
    SlotNotFound,
    StaleToken,
)
from warmpool.protocol import AgentLease, SlotRecord
from warmpool.registry import Claim, KvSlotStore, SlotStore

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
    "PulsescaleError",
    "SlotNotFound",
    "SlotRecord",
    "SlotStore",
    "StaleToken",
]
