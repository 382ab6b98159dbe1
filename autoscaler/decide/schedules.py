"""Scheduled warm-ups (protocol revision 8): which floor is in force at `now`, and when that next changes.

A model's schedules come from two places: its ScaledObject's ``spec.schedules`` and the on-call ``pulsescale
schedule`` verb (`protocol.OnCallSchedule`, kept in `pulse_leases`). Each is a window ``[start, start + duration)``
in Unix seconds (`protocol.Schedule.window`: the local start read in its IANA zone, DST included). This module
turns them into `Window`s and answers, for a time passed in:

- `floor_at`: the floor in force (the largest `replicas` over the windows holding `now`; None when none does),
  which the decider hands the policy as `policy.Observation.scheduled_floor`;
- `next_boundary`: the next start or end after `now`, when a decision must run even with no samples;
- `pool_floor`: the floor the warm pool should already cover, `lead_s` ahead of a start (the operator sizes the
  standby pods by it; see `POOL_LEAD_S`);
- `status_rows` / `pending_rows`: the rows `status` and ``schedule --list`` show.

Pure: no I/O, no clock; tested on a hand clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from warmpool.protocol import OnCallSchedule, Schedule, ScheduleRow

__all__ = [
    "POOL_LEAD_S",
    "Window",
    "floor_at",
    "next_boundary",
    "pending_rows",
    "pool_floor",
    "status_rows",
    "windows",
]

POOL_LEAD_S: Final = 600.0
"""How long before a schedule starts the warm pool is asked to cover its floor: a standby pod must be scheduled,
its image mounted and the weights staged into /dev/shm (minutes for a large model), so that at the start the floor
is reached from warm slots (seconds), not from the cold path."""

Source = Literal["scaledobject", "oncall"]


@dataclass(frozen=True, slots=True)
class Window:
    """One schedule resolved to Unix seconds: the floor `replicas` holds for ``starts_at <= now < ends_at``."""

    schedule: Schedule
    source: Source
    starts_at: float
    ends_at: float
    by: str = ""

    @property
    def name(self) -> str:
        return self.schedule.name

    @property
    def replicas(self) -> int:
        return self.schedule.replicas

    def active(self, now: float) -> bool:
        return self.starts_at <= now < self.ends_at

    def row(self, now: float) -> ScheduleRow:
        s = self.schedule
        return ScheduleRow(
            name=s.name,
            source=self.source,
            replicas=s.replicas,
            start=s.start,
            timezone=s.timezone,
            duration_seconds=s.duration_seconds,
            starts_at=self.starts_at,
            ends_at=self.ends_at,
            active=self.active(now),
            by=self.by,
        )


def windows(spec: Iterable[Schedule], oncall: Iterable[OnCallSchedule] = ()) -> tuple[Window, ...]:
    """The windows of the ScaledObject's schedules and the on-call ones, soonest start first."""
    out = [Window(s, "scaledobject", *s.window()) for s in spec]
    out += [Window(o.schedule, "oncall", *o.schedule.window(), by=o.by) for o in oncall]
    return tuple(sorted(out, key=lambda w: (w.starts_at, w.ends_at, w.name)))


def floor_at(ws: Sequence[Window], now: float) -> int | None:
    """The floor in force at `now`: the largest `replicas` over the windows holding it; None when none does."""
    return max((w.replicas for w in ws if w.active(now)), default=None)


def pool_floor(ws: Sequence[Window], now: float, lead_s: float = POOL_LEAD_S) -> int | None:
    """The floor the warm pool should cover at `now`: as `floor_at`, with each window starting `lead_s` early."""
    return max((w.replicas for w in ws if w.starts_at - lead_s <= now < w.ends_at), default=None)


def next_boundary(ws: Sequence[Window], now: float) -> float | None:
    """The first start or end strictly after `now` (a decision is due then); None when every window has ended."""
    return min((t for w in ws for t in (w.starts_at, w.ends_at) if t > now), default=None)


def pending_rows(ws: Sequence[Window], now: float) -> list[ScheduleRow]:
    """Every window that has not ended, soonest first (``pulsescale schedule --list``)."""
    return [w.row(now) for w in ws if now < w.ends_at]


def status_rows(ws: Sequence[Window], now: float) -> list[ScheduleRow]:
    """The windows in force, then the next one to start (``pulsescale status``)."""
    rows = [w.row(now) for w in ws if w.active(now)]
    upcoming = [w for w in ws if w.starts_at > now]
    if upcoming:
        rows.append(upcoming[0].row(now))
    return rows
