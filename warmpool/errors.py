"""Named errors shared by every pulsescale component.

Each error says what was wrong and, where a person will read it, what to do. Machine-readable parts
(`reason`, `code`) are stable strings: metrics label on them and clients branch on them.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "BadInput",
    "BadMessage",
    "ClaimConflict",
    "DuplicateRequest",
    "InvalidTransition",
    "LeaseExpired",
    "NatsUnavailable",
    "NatsUnreachable",
    "NoSlotAvailable",
    "PermissionDenied",
    "PulsescaleError",
    "SlotNotFound",
    "StaleToken",
]


class PulsescaleError(Exception):
    """Base of every error pulsescale raises on purpose."""

    code = "error"
    exit_code = 1
    """The exit status of a command this error ends (`pulsescale.cli`): 1, refused (credentials, a permission, the
    autoscaler said no); 2, bad input (argparse's own); 3, unreachable (nothing answers); 130, interrupted."""


class BadMessage(PulsescaleError):
    """A message that breaks wire contract v1; `reason` is one of `protocol.REASONS`."""

    code = "bad_message"

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class DuplicateRequest(BadMessage):
    """A request whose `id` was already applied; `reply` is the answer it got then, to send again."""

    def __init__(self, req_id: str, reply: bytes) -> None:
        super().__init__("duplicate_id", f"request {req_id} was already applied; answering with its first reply")
        self.reply = reply


class ClaimConflict(PulsescaleError):
    """The slot changed between our read and our compare-and-set: someone else won it."""

    code = "claim_conflict"


class NoSlotAvailable(PulsescaleError):
    """No slot of the model is claimable (warm, fresh agent lease, not draining)."""

    code = "no_slot"


class StaleToken(PulsescaleError):
    """A request carried a fencing token or claim id that no longer holds the slot."""

    code = "stale_token"


class LeaseExpired(PulsescaleError):
    """The agent that owns the slot has not heartbeated within its lease."""

    code = "lease_expired"


class InvalidTransition(PulsescaleError):
    """A slot state change that the lifecycle table does not allow."""

    code = "invalid_transition"


class SlotNotFound(PulsescaleError):
    """No slot is registered under that key."""

    code = "slot_not_found"


class NatsUnavailable(PulsescaleError):
    """The NATS server could not be reached or refused us; the message says which and what to check."""

    code = "nats_unavailable"


class NatsUnreachable(NatsUnavailable):
    """Nothing answered at the NATS URL(s): nothing listens, no route, no answer in time, a name that does not
    resolve. Exit 3: another try may work, unlike a refusal (exit 1)."""

    code = "nats_unreachable"
    exit_code = 3


class BadInput(PulsescaleError):
    """What the user gave cannot be used as given (a URL of another scheme, say): exit 2, as argparse's errors."""

    code = "bad_input"
    exit_code = 2


class PermissionDenied(NatsUnavailable):
    """The server refused a publish or a subscription on `subject`: the NATS user lacks that permission."""

    code = "permission_denied"

    def __init__(self, operation: Literal["publish", "subscribe"], subject: str) -> None:
        self.operation = operation
        self.subject = subject
        if subject.startswith("$JS.API.STREAM.CREATE."):
            # Only the autoscaler creates buckets; another role gets here when it starts first.
            why = (
                "the bucket or stream does not exist yet and this NATS user may not create it: the autoscaler "
                "creates the registry's buckets when it starts, so start it first; `pulsescale nats --secure` "
                "creates them locally"
            )
        else:
            why = (
                f"this NATS user may not {operation} {'to' if operation == 'publish' else 'on'} it: use the user "
                "of the right role, or grant it in the server's authorization"
            )
        super().__init__(f"refused: permission denied on {subject} ({why})")
