"""Which models this gateway serves, and when a model's queue may go. Pure: no I/O, time is passed in.

A client never decides what the gateway keeps: a model is served when a trusted source names it.

- With ``--models`` (`fixed`), those and no others; their queues live as long as the gateway.
- Without, the models of the published ScaledObjects (KV `pulse_scalers`, followed by `gateway.scalers`) and any
  model with a ready slot (its agent wrote it to `pulse_slots`).

Any other name is ``unknown`` (404 at once: no queue, no metric series). While `pulse_scalers` has not been read
(the first listing, or a NATS user that may not read it) a name nothing else vouches for is ``undecided`` (503 at
once): the gateway cannot tell a model scaled to zero from a made-up name.

A queue of a model that is not fixed is reclaimed once nothing waits in it, nothing is in flight and no slot is
ready, when the model is unknown now (its ScaledObject was deleted) or when it has stayed so for `queue_idle_s`. Its
samples stop; if the model comes back, a new queue starts its counters and `seq` again, which the autoscaler reads as
this gateway restarting for that model (the contract's rule).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

__all__ = ["Catalog", "ScalersState", "Verdict"]

Verdict = Literal["known", "unknown", "undecided"]
ScalersState = Literal["off", "listing", "listed", "absent", "unreadable"]
"""How far `pulse_scalers` has been read: ``off`` (``--models`` given: not read), ``listing`` (not yet),
``listed`` (followed), ``absent`` (the bucket does not exist: no ScaledObject anywhere), ``unreadable`` (no answer:
a NATS user without KV reads of it is refused silently, or JetStream is down)."""


class Catalog:
    """The models the gateway knows (module doc)."""

    def __init__(self, fixed: frozenset[str] | None) -> None:
        self.fixed = fixed
        self.scaled: frozenset[str] = frozenset()
        """Models of the ScaledObjects in `pulse_scalers`, as last read."""
        self.scalers: ScalersState = "off" if fixed is not None else "listing"

    def set_scaled(self, models: Iterable[str]) -> None:
        self.scaled = frozenset(models)
        self.scalers = "listed"

    def set_scalers(self, state: ScalersState) -> None:
        """`pulse_scalers` is absent or unreadable (what it named before is kept: better than nothing), or is
        being listed again."""
        if state == "absent":
            self.scaled = frozenset()
        self.scalers = state

    def verdict(self, model: str, *, ready: bool) -> Verdict:
        """Whether `model` is served (`ready`: it has a ready slot here)."""
        if self.fixed is not None:
            return "known" if model in self.fixed else "unknown"
        if ready or model in self.scaled:
            return "known"
        return "unknown" if self.scalers in ("listed", "absent") else "undecided"

    def reclaimable(self, model: str, *, busy: bool, ready: bool, idle_for_s: float, queue_idle_s: float) -> bool:
        """Whether `model`'s queue may go: `busy` (requests wait or are in flight) and `ready` queues stay, and
        fixed ones always; another goes when its model is unknown now, or after `queue_idle_s` idle."""
        if busy or ready or (self.fixed is not None and model in self.fixed):
            return False
        return self.verdict(model, ready=False) == "unknown" or idle_for_s >= queue_idle_s

    def listed(self, ready: Iterable[str]) -> list[str]:
        """The models a client may ask for (``GET /v1/models``), given those with a ready slot."""
        if self.fixed is not None:
            return sorted(self.fixed)
        return sorted(self.scaled.union(ready))
