"""One model's bounded FIFO queue and its least-loaded routing. Pure: no I/O, time is passed in.

A request arrives (`arrive`), waits in FIFO order, and is handed to the ready endpoint with the fewest requests in
flight that still has room (`dispatch`; each endpoint takes at most `concurrency` at once). It leaves in exactly one
way, which the counters record:

- ``completed``: an upstream answered it (any status the upstream chose);
- ``timeout``: it waited past its deadline, or the upstream did not answer in time (the gateway answers 504);
- ``rejected``: the queue was full when it arrived (429);
- ``failed``: every attempt's upstream broke, or the client left (502, or nothing to answer).

So ``arrivals_total == queue_depth + inflight + completions_total + timeouts_total + rejected_total +
failed_total`` at every instant. The first five are what a `QueueSample` carries (`rejected_total` and
`failed_total` are the gateway's own metrics: the contract has no field for them).

A request whose upstream broke before it answered is put back at the head of the queue (`retry`) with its original
deadline, and avoids that endpoint while another exists.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

__all__ = ["Endpoint", "ModelQueue", "Outcome", "QueueCounts", "Waiter"]

T = TypeVar("T")
Outcome = Literal["completed", "timeout", "failed"]
WaiterState = Literal["waiting", "dispatched", "gone"]


@dataclass(eq=False)
class Endpoint:
    """A ready slot's serving endpoint, keyed by the slot's key (``<model>.<node>.<slot>``)."""

    key: str
    url: str
    inflight: int = 0
    dispatched_total: int = 0


@dataclass(eq=False)
class Waiter(Generic[T]):
    """A request of the queue. `item` is the caller's handle (the proxy keeps a future there)."""

    item: T
    arrived_at: float
    deadline: float
    state: WaiterState = "waiting"
    attempts: int = 0
    avoid: set[str] = field(default_factory=set)
    """Endpoints whose upstream broke on this request: tried last."""
    endpoint: Endpoint | None = None


@dataclass(frozen=True)
class QueueCounts:
    queue_depth: int
    inflight: int
    arrivals_total: int
    completions_total: int
    timeouts_total: int
    rejected_total: int
    failed_total: int


class ModelQueue(Generic[T]):
    """The queue and endpoints of one model (module doc)."""

    def __init__(self, model: str, *, limit: int, concurrency: int) -> None:
        if limit < 0 or concurrency < 1:
            raise ValueError(f"queue limit must be >= 0 and endpoint concurrency >= 1 (got {limit}, {concurrency})")
        self.model = model
        self.limit = limit
        self.concurrency = concurrency
        self.endpoints: dict[str, Endpoint] = {}
        self._waiting: deque[Waiter[T]] = deque()
        self.depth = 0
        """Waiting requests (the deque may also hold ones that left, skipped when they reach its head)."""
        self.inflight = 0
        """Requests handed to an upstream and not finished, also those whose endpoint left meanwhile."""
        self.arrivals_total = 0
        self.completions_total = 0
        self.timeouts_total = 0
        self.rejected_total = 0
        self.failed_total = 0

    # --- endpoints ---------------------------------------------------------------------------------------------

    def set_endpoint(self, key: str, url: str) -> bool:
        """Offer `key`'s endpoint (a slot became ready); True when that changed anything. A new URL under the same
        key is a new endpoint: requests in flight to the old one finish against the old object."""
        cur = self.endpoints.get(key)
        if cur is not None and cur.url == url:
            return False
        self.endpoints[key] = Endpoint(key, url)
        return True

    def remove_endpoint(self, key: str) -> bool:
        """Stop routing to `key` (its slot left ``ready``); requests in flight there finish or fail on their own."""
        return self.endpoints.pop(key, None) is not None

    # --- requests ----------------------------------------------------------------------------------------------

    def arrive(self, item: T, now: float, timeout_s: float) -> Waiter[T] | None:
        """Queue a request; None (counted ``rejected``) when `limit` requests already wait."""
        self.arrivals_total += 1
        if self.depth >= self.limit and not self._has_room():
            self.rejected_total += 1
            return None
        w = Waiter(item, now, now + timeout_s)
        self._waiting.append(w)
        self.depth += 1
        return w

    def _has_room(self) -> bool:
        # A request that would be dispatched at once is never refused, even with limit 0.
        return self.depth == 0 and any(e.inflight < self.concurrency for e in self.endpoints.values())

    def dispatch(self) -> list[Waiter[T]]:
        """Hand waiting requests, head first, to endpoints with room; each returned waiter has its `endpoint`. Stops
        at the first request no endpoint can take (FIFO: nobody overtakes the head)."""
        out: list[Waiter[T]] = []
        while self._waiting:
            w = self._waiting[0]
            if w.state != "waiting":
                self._waiting.popleft()
                continue
            ep = self._pick(w)
            if ep is None:
                break
            self._waiting.popleft()
            self.depth -= 1
            w.state, w.endpoint = "dispatched", ep
            w.attempts += 1
            ep.inflight += 1
            ep.dispatched_total += 1
            self.inflight += 1
            out.append(w)
        return out

    def _pick(self, w: Waiter[T]) -> Endpoint | None:
        """Least in flight among endpoints with room; ties go to the one that took fewer so far (spreads load),
        then the key (stable). Endpoints this request broke on count only when no other endpoint exists."""
        candidates = [e for e in self.endpoints.values() if e.key not in w.avoid] or list(self.endpoints.values())
        free = [e for e in candidates if e.inflight < self.concurrency]
        if not free:
            return None
        return min(free, key=lambda e: (e.inflight, e.dispatched_total, e.key))

    def give_up(self, w: Waiter[T], outcome: Literal["timeout", "failed"]) -> bool:
        """A waiting request leaves the queue (its deadline passed: ``timeout``; its client left: ``failed``).
        False when it is not waiting (already dispatched: the caller uses that dispatch instead)."""
        if w.state != "waiting":
            return False
        w.state = "gone"
        self.depth -= 1
        self._count(outcome)
        return True

    def finish(self, w: Waiter[T], outcome: Outcome) -> None:
        """A dispatched request is over: its endpoint gets the room back."""
        self._release(w)
        w.state = "gone"
        self._count(outcome)

    def retry(self, w: Waiter[T]) -> None:
        """A dispatched request whose upstream broke before answering goes back to the head of the queue (over the
        limit if need be: it was admitted), avoiding that endpoint; its deadline stays."""
        ep = self._release(w)
        if ep is not None:
            w.avoid.add(ep.key)
        w.state = "waiting"
        self._waiting.appendleft(w)
        self.depth += 1

    def _release(self, w: Waiter[T]) -> Endpoint | None:
        if w.state != "dispatched" or w.endpoint is None:
            raise ValueError(f"request is {w.state}, not dispatched")
        ep, w.endpoint = w.endpoint, None
        ep.inflight -= 1
        self.inflight -= 1
        return ep

    def _count(self, outcome: str) -> None:
        if outcome == "completed":
            self.completions_total += 1
        elif outcome == "timeout":
            self.timeouts_total += 1
        else:
            self.failed_total += 1

    def counts(self) -> QueueCounts:
        return QueueCounts(
            self.depth,
            self.inflight,
            self.arrivals_total,
            self.completions_total,
            self.timeouts_total,
            self.rejected_total,
            self.failed_total,
        )

    def oldest_wait_s(self, now: float) -> float:
        """How long the head of the queue has waited (0 when empty)."""
        for w in self._waiting:
            if w.state == "waiting":
                return max(0.0, now - w.arrived_at)
        return 0.0
