"""The gateway's bound on the memory that request bodies take while no upstream has them. Pure: no I/O.

Without it, each model's queue bounds its waiting requests (`queue_limit`) but not their bytes, and nothing bounds
the models together: 200 waiting 1 MiB requests took a gateway from 44 to 281 MiB. The budget counts a body from
before it is read (its Content-Length; a chunked body chunk by chunk) until an upstream has it, so a client that
sends a body slowly holds its share too; past the limit a request is refused at once (503 ``body_budget_full``).
What upstreams hold is bounded by the ready slots (`endpoint_concurrency` each), not by this.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BodyBudget", "Hold"]


@dataclass
class BodyBudget:
    """Bytes of request bodies held by requests that are being read or waiting for a slot, across all models.

    A request takes its body's size before reading it (its Content-Length; a chunked body chunk by chunk) and
    gives it back once an upstream has it, or when it leaves; one that does not fit is refused at once. A request
    put back in the queue (its upstream broke) takes its size again over the limit: it was admitted."""

    limit_bytes: int
    held_bytes: int = 0

    def take(self, n: int) -> bool:
        if self.held_bytes + n > self.limit_bytes:
            return False
        self.held_bytes += n
        return True


@dataclass(eq=False)
class Hold:
    """One request's share of a `BodyBudget`; `release` is idempotent, so every way out may call it."""

    budget: BodyBudget
    held_bytes: int = 0

    def take(self, n: int) -> bool:
        if not self.budget.take(n):
            return False
        self.held_bytes += n
        return True

    def force(self, n: int) -> None:
        """Take `n` whatever the limit (a retried request, admitted already)."""
        self.budget.held_bytes += n
        self.held_bytes += n

    def release(self) -> None:
        self.budget.held_bytes -= self.held_bytes
        self.held_bytes = 0
