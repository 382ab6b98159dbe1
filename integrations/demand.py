"""What the LiteLLM hook counts, per pulsescale model: requests that entered the proxy and were not yet sent to a
backend (`queue_depth`), those sent and not yet answered (`inflight`), and the contract's counters. Pure: no I/O,
time is passed in.

A request is known by LiteLLM's call id from its arrival (the proxy's pre-call hook) until its end, which LiteLLM
may report more than once (a proxy-level hook and a logging event): the first report ends it, later ones and
reports of calls the proxy never admitted (LiteLLM's own health checks) change nothing. So does a second arrival
under a live id (a client may set ``x-litellm-call-id``): that request is not counted. A request can end while
still queued (LiteLLM refused it before picking a backend: its parallel-request limit, a model it does not know).

``arrivals_total == queue_depth + inflight + completions_total + timeouts_total + failed_total`` per model at
every instant; `failed_total` has no field in the contract (as the gateway's ``failed``: a request that errored
without an answer counts neither as served nor as given up waiting).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.queue import QueueCounts

__all__ = ["DemandBook", "ModelTally", "Outcome"]

Outcome = Literal["completed", "timeout", "failed"]


class ModelTally:
    """One model's counts, read the way `gateway.publisher.Publisher` reads a gateway queue: `counts()`."""

    __slots__ = (
        "arrivals_total",
        "completions_total",
        "failed_total",
        "inflight",
        "last_change",
        "pinned",
        "queue_depth",
        "timeouts_total",
    )

    def __init__(self, now: float, *, pinned: bool = False) -> None:
        self.queue_depth = self.inflight = 0
        self.arrivals_total = self.completions_total = self.timeouts_total = self.failed_total = 0
        self.last_change = now
        self.pinned = pinned
        """Named in the model map: published from the start and never reclaimed."""

    def counts(self) -> QueueCounts:
        return QueueCounts(
            self.queue_depth,
            self.inflight,
            self.arrivals_total,
            self.completions_total,
            self.timeouts_total,
            0,  # rejected: LiteLLM's refusals end as failures here
            self.failed_total,
        )

    def idle(self) -> bool:
        return self.queue_depth == 0 and self.inflight == 0


@dataclass
class _Open:
    model: str
    arrived_at: float
    dispatched: bool = False


class DemandBook:
    """The open requests and the per-model tallies (module doc). Each method returns the model whose counts
    changed (None: none did), for the caller to tell the publisher."""

    def __init__(self, *, forget_after_s: float, idle_after_s: float, max_models: int) -> None:
        self.forget_after_s = forget_after_s
        self.idle_after_s = idle_after_s
        self.max_models = max_models
        self.tallies: dict[str, ModelTally] = {}
        """The publisher's table: every model here is published."""
        self._open: dict[str, _Open] = {}

    def pin(self, model: str, now: float) -> None:
        """Count `model` from now on, traffic or not, and never reclaim it."""
        tally = self.tallies.get(model)
        if tally is None:
            self.tallies[model] = ModelTally(now, pinned=True)
        else:
            tally.pinned = True

    def open_requests(self) -> int:
        return len(self._open)

    def arrive(self, call_id: str, model: str, now: float) -> str | None:
        """A request for `model` entered the proxy. None when it is not counted: its id is live, or the table is
        full (`max_models`) and `model` not in it."""
        if call_id in self._open:
            return None
        tally = self.tallies.get(model)
        if tally is None:
            if len(self.tallies) >= self.max_models:
                return None
            tally = self.tallies[model] = ModelTally(now)
        self._open[call_id] = _Open(model, now)
        tally.queue_depth += 1
        tally.arrivals_total += 1
        tally.last_change = now
        return model

    def dispatch(self, call_id: str, now: float) -> str | None:
        """LiteLLM is sending the request to a backend (again, on a retry: no change)."""
        req = self._open.get(call_id)
        if req is None or req.dispatched:
            return None
        req.dispatched = True
        tally = self.tallies[req.model]
        tally.queue_depth -= 1
        tally.inflight += 1
        tally.last_change = now
        return req.model

    def end(self, call_id: str, outcome: Outcome, now: float) -> str | None:
        """The request is over (the first report of its end; later ones are None)."""
        req = self._open.pop(call_id, None)
        if req is None:
            return None
        self._leave(req, outcome, now)
        return req.model

    def forget_stale(self, now: float) -> set[str]:
        """End, as timeouts, the requests open for `forget_after_s`; the models that changed."""
        stale = [cid for cid, req in self._open.items() if now - req.arrived_at >= self.forget_after_s]
        changed: set[str] = set()
        for cid in stale:
            req = self._open.pop(cid)
            self._leave(req, "timeout", now)
            changed.add(req.model)
        return changed

    def reclaim_idle(self, now: float) -> list[str]:
        """Drop the tallies of unpinned models idle for `idle_after_s`; the models dropped (their samples stop; a
        later request counts again from zero, which the autoscaler reads as this gateway restarting for it)."""
        gone = [
            model
            for model, t in self.tallies.items()
            if not t.pinned and t.idle() and now - t.last_change >= self.idle_after_s
        ]
        for model in gone:
            del self.tallies[model]
        return gone

    def _leave(self, req: _Open, outcome: Outcome, now: float) -> None:
        tally = self.tallies[req.model]
        if req.dispatched:
            tally.inflight -= 1
        else:
            tally.queue_depth -= 1
        if outcome == "completed":
            tally.completions_total += 1
        elif outcome == "timeout":
            tally.timeouts_total += 1
        else:
            tally.failed_total += 1
        tally.last_change = now
