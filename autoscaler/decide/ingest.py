"""Queue samples from many gateways, folded into one demand figure per model. Pure: time is passed in.

Per model we keep the latest sample of each gateway. A gateway silent for `stale_after_s` leaves the sum (its
last word is no longer the truth, and a dead gateway must not pin capacity up or down). Counter deltas between a
gateway's consecutive samples give arrival and completion rates. A gateway restart (its `seq` starts again, or a
counter goes down) resets that gateway's baseline instead of reading as negative traffic; a duplicate or older
`seq` from the same run is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final, Literal

from warmpool.protocol import QueueSample

__all__ = ["Accepted", "GatewayView", "ModelDemand", "Observed"]

Accepted = Literal["accepted", "restart", "duplicate", "out_of_order"]

RATE_SPAN_S: Final = 0.1
"""Rates are taken over at least this much of the gateway's own time (its sample period): a gateway publishes on
change too, up to every 10 ms, and a rate over one such gap (one arrival in 10 ms: 100 req/s) is noise that the
policy, keeping one value per 100 ms, would sample unevenly."""


@dataclass(slots=True)
class GatewayView:
    """What one gateway last told us about one model."""

    seq: int
    ts: float
    received_at: float
    queue_depth: int
    inflight: int
    arrivals_total: int
    completions_total: int
    timeouts_total: int
    arrival_rate: float | None = None  # req/s over the last `RATE_SPAN_S` or more of this run
    completion_rate: float | None = None
    restarts: int = 0
    marks: deque[tuple[float, int, int]] = field(default_factory=deque)
    """(ts, arrivals_total, completions_total) of this run's recent samples; the first is the rates' reference."""


@dataclass(frozen=True, slots=True)
class Observed:
    demand: float | None  # queue + in-flight over fresh gateways; None when no gateway is fresh
    queued: float | None  # the queue part of `demand`
    arrival_rate: float | None
    completion_rate: float | None
    fresh_gateways: int
    stale_gateways: int
    newest_ts: float | None


def _is_restart(last: GatewayView, s: QueueSample) -> bool:
    if s.seq < last.seq:
        # A lower seq with a newer timestamp is a new gateway run; with an older one, a late packet of this run.
        return s.ts > last.ts
    return s.seq > last.seq and (
        s.arrivals_total < last.arrivals_total
        or s.completions_total < last.completions_total
        or s.timeouts_total < last.timeouts_total
    )


class ModelDemand:
    """The gateways of one model."""

    __slots__ = ("gateways", "model", "stale_after_s")

    def __init__(self, model: str, stale_after_s: float) -> None:
        self.model = model
        self.stale_after_s = stale_after_s
        self.gateways: dict[str, GatewayView] = {}

    def add(self, s: QueueSample, now: float) -> Accepted:
        last = self.gateways.get(s.gateway)
        if last is None:
            self.gateways[s.gateway] = GatewayView(
                s.seq, s.ts, now, s.queue_depth, s.inflight, s.arrivals_total, s.completions_total, s.timeouts_total
            )
            return "accepted"
        restart = _is_restart(last, s)
        if not restart:
            if s.seq == last.seq:
                return "duplicate"
            if s.seq < last.seq:
                return "out_of_order"
            marks = last.marks
            if not marks:
                marks.append((last.ts, last.arrivals_total, last.completions_total))
            # The newest reference at least RATE_SPAN_S older than this sample.
            while len(marks) > 1 and marks[1][0] <= s.ts - RATE_SPAN_S:
                marks.popleft()
            ref_ts, ref_arrivals, ref_completions = marks[0]
            dt = s.ts - ref_ts
            if dt > 0:
                last.arrival_rate = (s.arrivals_total - ref_arrivals) / dt
                last.completion_rate = (s.completions_total - ref_completions) / dt
            marks.append((s.ts, s.arrivals_total, s.completions_total))
        else:
            last.arrival_rate = last.completion_rate = None  # no baseline in the new run yet
            last.marks.clear()
            last.restarts += 1
        last.seq, last.ts, last.received_at = s.seq, s.ts, now
        last.queue_depth, last.inflight = s.queue_depth, s.inflight
        last.arrivals_total, last.completions_total, last.timeouts_total = (
            s.arrivals_total,
            s.completions_total,
            s.timeouts_total,
        )
        return "restart" if restart else "accepted"

    def observe(self, now: float) -> Observed:
        demand = queued = 0.0
        arrivals = completions = 0.0
        have_rate = False
        fresh = stale = 0
        newest: float | None = None
        for g in self.gateways.values():
            # Judged by when we received it, so a gateway's clock skew cannot make it look fresh or stale.
            if now - g.received_at > self.stale_after_s:
                stale += 1
                continue
            fresh += 1
            demand += g.queue_depth + g.inflight
            queued += g.queue_depth
            if g.arrival_rate is not None:
                have_rate = True
                arrivals += g.arrival_rate
                completions += g.completion_rate or 0.0
            if newest is None or g.ts > newest:
                newest = g.ts
        if fresh == 0:
            return Observed(None, None, None, None, 0, stale, None)
        return Observed(
            demand,
            queued,
            arrivals if have_rate else None,
            completions if have_rate else None,
            fresh,
            stale,
            newest,
        )

    def forget_stale(self, now: float, older_than_s: float) -> int:
        """Drop gateways silent for `older_than_s` (long gone), so the table does not grow forever."""
        gone = [k for k, g in self.gateways.items() if now - g.received_at > older_than_s]
        for k in gone:
            del self.gateways[k]
        return len(gone)
