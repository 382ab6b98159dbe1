"""When this process heard each agent's lease, and how far that agent's clock is from ours (contract revision 10).

Lease freshness is judged on one clock: ours. A lease is fresh for its `lease_s` after its heartbeat *arrived*, on
this process's monotonic clock; the heartbeat's own stamp (`heartbeat_at`, the agent's wall clock) is never compared
with our wall clock to say whether the agent is alive. So an agent whose clock is seconds or minutes off (chrony
not yet synced at boot, a VM after a suspend) is exactly as fresh as any other, and a stamp dated far ahead buys a
forger nothing: the lease still lapses `lease_s` after we last heard it.

What the stamp is still good for is measuring the agent's clock: each heartbeat heard gives one sample, its
`heartbeat_at` minus our wall clock at arrival (the skew, less the few milliseconds the heartbeat travelled). The
estimate `skew_s` is the highest sample of the last `SKEW_WINDOW_S` (the one that travelled fastest: a delayed
delivery, such as a heartbeat buffered through a reconnect, only lowers a sample), so a step of the agent's clock
shows at its next heartbeat forward and within the window backward. The autoscaler states the times of its requests
to that agent in the agent's clock with it (`autoscaler.act.agentclient`), shows it in ``pulsescale pool`` and exports
it as ``pulsescale_agent_clock_skew_seconds{node}``.

A heartbeat stamped more than `protocol.MAX_TRUSTED_SKEW_S` from our clock, either way, is a broken clock or a
forged stamp: that lease is not fresh (its slots are not offered), and each such heartbeat is counted
(``clock_skew``) and logged at a bounded rate.

A lease only *listed* (at start, or re-listed after a reconnect with a revision we did not hear arrive) has no
known arrival: it is judged by its stamp against our wall clock as before revision 10 (`AgentLease.fresh`),
corrected by the agent's measured skew (none while no heartbeat of it was heard: this process just started, or the
agent is new). A listed stamp more than `LISTED_AHEAD_S` ahead of the agent's clock as we know it is not offered
(``unheard``): that agent is ahead of us by more than we measured, and a request stated in our clock could reach
it already expired, which is how the fault review's claim loop began. Its next heartbeat, one interval later (2 s
by default), is heard. An agent behind us is offered meanwhile: our requests reach it early, never late.

Pure bookkeeping: no I/O; both clocks are injected (`clock` wall, `monotonic` elapsed).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, Literal

from warmpool import protocol
from warmpool.errors import BadMessage
from warmpool.protocol import AgentLease
from warmpool.rejects import Rejections

__all__ = ["LISTED_AHEAD_S", "SKEW_WINDOW_S", "AgentClocks", "Verdict"]

Clock = Callable[[], float]

SKEW_WINDOW_S: Final = 10.0
"""The skew estimate is the highest sample heard in this long before the newest: five heartbeats at the default
2 s interval, enough that one delayed delivery does not move it, short enough that a clock stepped back by chrony is
followed within seconds."""
_MAX_SAMPLES: Final = 64  # bounds the memory per node whatever the heartbeat interval
LISTED_AHEAD_S: Final = 0.5
"""A lease only listed is offered when its stamp is at most this far ahead of the agent's clock as we know it (ours
while none of its heartbeats was heard). A stamp is taken before we read it, so with the clock known it is never
ahead but for the heartbeat's travel (milliseconds); half a second ahead costs an activation at most that much of
its 2.5 s deadline until the next heartbeat is heard."""

Verdict = Literal["fresh", "lapsed", "skewed", "unheard"]
"""``fresh``: heard within its `lease_s` (or, only listed, its stamp says so on the agent's measured clock): its
slots may be offered; ``lapsed``: not renewed in time; ``skewed``: renewed, but its agent's clock is more than
`protocol.MAX_TRUSTED_SKEW_S` from ours; ``unheard``: only listed, its stamp more than `LISTED_AHEAD_S` ahead of
the agent's clock as we know it: not offered, not lapsed, until its next heartbeat is heard."""


@dataclass
class _Heard:
    lease: AgentLease
    """The lease that arrived (by identity: a listing that brings a new object keeps the time only when equal)."""
    at: float
    """Our monotonic time when it arrived."""
    sample_s: float
    """Its `heartbeat_at` minus our wall clock when it arrived."""


@dataclass
class _Node:
    heard: _Heard | None = None
    samples: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=_MAX_SAMPLES))
    """(our monotonic time, sample) of the recent heartbeats, oldest first."""
    skew_s: float | None = None
    """The estimate from `samples`, kept at each heartbeat: read per request, and by a metrics scrape's thread."""


class AgentClocks:
    """Arrival times and clock skew of the agents' leases, as this process heard them."""

    def __init__(self, rejected: Rejections, *, clock: Clock = time.time, monotonic: Clock = time.monotonic) -> None:
        self.rejected = rejected
        self.clock = clock
        self.monotonic = monotonic
        self._nodes: dict[str, _Node] = {}

    # --- what the registry view tells us -----------------------------------------------------------------------

    def heard(self, node: str, lease: AgentLease) -> None:
        """`lease` arrived just now (a watch delta, or our own acknowledged write): time it and sample the skew."""
        at, sample = self.monotonic(), lease.heartbeat_at - self.clock()
        n = self._nodes.setdefault(node, _Node())
        n.heard = _Heard(lease, at, sample)
        n.samples.append((at, sample))
        while n.samples[0][0] < at - SKEW_WINDOW_S:
            n.samples.popleft()
        n.skew_s = max(s for _, s in n.samples)
        if abs(sample) > protocol.MAX_TRUSTED_SKEW_S:
            ahead = "ahead of" if sample > 0 else "behind"
            self.rejected(
                BadMessage(
                    "clock_skew",
                    f"the heartbeat of node {node} is stamped {abs(sample):.1f} s {ahead} this process's clock (at "
                    f"most {protocol.MAX_TRUSTED_SKEW_S:g} s is trusted): its slots are not offered until that "
                    "node's clock is set right (chrony/NTP), or this process's",
                ),
                source=f"{protocol.AGENTS_BUCKET}/{node}",
            )

    def listed(self, node: str, lease: AgentLease | None) -> None:
        """The view now holds `lease` for `node` (None: gone). Keeps the arrival time when it is the lease we heard
        (a re-list that found it unchanged); forgets the node when its lease is gone."""
        if lease is None:
            self._nodes.pop(node, None)
            return
        n = self._nodes.get(node)
        if n is not None and n.heard is not None and n.heard.lease is not lease:
            if n.heard.lease == lease:
                n.heard.lease = lease
            else:
                n.heard = None  # written while we were not listening: when, we do not know

    # --- judging ---------------------------------------------------------------------------------------------

    def skew_s(self, node: str) -> float | None:
        """How far `node`'s clock is ahead of ours (negative: behind), seconds; None until a heartbeat was heard."""
        n = self._nodes.get(node)
        return None if n is None else n.skew_s

    def skews(self) -> dict[str, float]:
        """`skew_s` of every node heard. Safe from another thread (a metrics scrape): it only reads."""
        return {node: n.skew_s for node, n in list(self._nodes.items()) if n.skew_s is not None}

    def judge(self, node: str, lease: AgentLease, now: float) -> Verdict:
        """Whether `lease` (the view's lease of `node`) is fresh. `now` (our wall clock) judges only a lease whose
        arrival we did not hear; a heard one is judged by how long ago it arrived, on our monotonic clock."""
        n = self._nodes.get(node)
        heard = n.heard if n is not None else None
        if heard is not None and heard.lease is lease:
            if abs(heard.sample_s) > protocol.MAX_TRUSTED_SKEW_S:
                return "skewed"
            return "fresh" if self.monotonic() - heard.at <= lease.lease_s else "lapsed"
        # Only listed: its stamp, read on the agent's clock as we measured it.
        skew = self.skew_s(node)
        if skew is not None and abs(skew) > protocol.MAX_TRUSTED_SKEW_S:
            return "skewed"
        agent_now = now + (skew or 0.0)
        if agent_now > lease.heartbeat_at + lease.lease_s:
            return "lapsed"
        return "unheard" if lease.heartbeat_at > agent_now + LISTED_AHEAD_S else "fresh"

    def fresh(self, node: str, lease: AgentLease | None, now: float) -> bool:
        return lease is not None and self.judge(node, lease, now) == "fresh"
