"""The book of one model's held slots: what the leader holds, and the bring-ups on their way to it.

`SlotBook` keeps the slots this leader holds for one model (`Held`: a fenced `Claim` and its phase,
``activating`` / ``ready`` / ``releasing``), the bring-ups not yet booked (`claiming`, counted over every model in
`ClaimsInFlight` too), and the activations and releases this process is in the middle of. It counts (`ready`,
`activating`) and picks what a scale-down takes (`pick_victims`); it does no I/O and decides nothing.
`ModelScaler` (`autoscaler.act.scaler`) reads it to match the target; the slot actions (`autoscaler.act.slotactions`)
write into it what a claim, an activation or a release changed.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Literal

from warmpool.registry import Claim

__all__ = ["ClaimsInFlight", "Held", "Phase", "SlotBook", "Unbooked"]

Phase = Literal["activating", "ready", "releasing"]


@dataclass
class Held:
    """One slot in the book: the claim that holds it and where its bring-up or take-down is."""

    claim: Claim
    phase: Phase
    since: float
    """When the claim was written (ours), or the record's last update (adopted)."""
    release_failed: bool = False
    """The broker refused or timed out our release: housekeeping retries it."""


@dataclass
class Unbooked:
    """A bring-up's place in `SlotBook.claiming`: counted while it has no claim in the book."""

    counted: bool = True


class ClaimsInFlight:
    """Bring-ups of this process between their start and their claim booked, over every model: the pulse's
    path. While one started recently is, the sample drain and housekeeping stand aside (`wait_idle`), so the
    claim's few hops through the event loop do not each wait behind a slice of theirs."""

    __slots__ = ("_idle", "count", "started_at")

    def __init__(self) -> None:
        self.count = 0
        self.started_at = -math.inf  # monotonic time of the latest bring-up started
        self._idle: asyncio.Event | None = None  # made on first use: it binds to the running loop

    def add(self, n: int) -> None:
        if n > 0:
            self.started_at = time.monotonic()
        self.count += n
        if self.count == 0 and self._idle is not None:
            self._idle.set()

    def recent(self, bound_s: float) -> bool:
        """A claim is in flight and the latest started less than `bound_s` ago (one stuck retrying against an
        unhappy broker holds nothing up for longer)."""
        return self.count > 0 and time.monotonic() < self.started_at + bound_s

    async def wait_idle(self, bound_s: float) -> bool:
        """Until no claim is in flight, waiting only while one is `recent`. Returns False when it stopped at the
        bound."""
        if self.count == 0:
            return True
        if not self.recent(bound_s):
            return False
        left = self.started_at + bound_s - time.monotonic()
        if self._idle is None:
            self._idle = asyncio.Event()
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), left)
        except TimeoutError:
            return False
        return True


class SlotBook:
    """One model's book; see the module docstring."""

    def __init__(self, claims: ClaimsInFlight) -> None:
        self.held: dict[str, Held] = {}
        self.claims = claims
        self._claiming = 0  # bring-ups between their start and their claim landing in `held`
        self.activating_here: set[str] = set()  # activations this process is waiting on
        self.releasing_here: set[str] = set()  # releases in flight

    @property
    def claiming(self) -> int:
        """Bring-ups between their start and their claim landing in `held` (kept in `claims` too)."""
        return self._claiming

    @claiming.setter
    def claiming(self, value: int) -> None:
        self.claims.add(value - self._claiming)
        self._claiming = value

    @property
    def ready(self) -> int:
        return sum(1 for h in self.held.values() if h.phase == "ready")

    @property
    def activating(self) -> int:
        return self.claiming + sum(1 for h in self.held.values() if h.phase == "activating")

    def pick_victims(self, n: int) -> list[Held]:
        ready = [h for h in self.held.values() if h.phase == "ready"]
        per_node: dict[str, int] = {}
        for h in ready:
            per_node[h.claim.node] = per_node.get(h.claim.node, 0) + 1
        # Take from the most loaded node first, newest first: the mirror image of placement's spread.
        ready.sort(key=lambda h: (-per_node[h.claim.node], -h.since))
        return ready[:n]

    def forget(self) -> None:
        """Empty the book (`ModelScaler.forget_claims`: after losing the lease it is the next leader's)."""
        self.held.clear()
        self.claiming = 0
        self.activating_here.clear()
        self.releasing_here.clear()
