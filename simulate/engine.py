"""The simulation core: open-loop arrivals, the gateway's FIFO queue with a timeout (504), and replicas that start
after a delay and serve a fixed number of requests at a time.

What it models, and at what grain. Requests are integer *cohorts* on the gateway's 100 ms sample grid (`STEP_S`):
all arrivals of one step form one cohort that waits in FIFO order, is dispatched to free replica slots (possibly
split over several steps), or times out as a whole once it has waited `timeout_s`. Each step does O(cohorts
touched) work, independent of the request rate and of the number of replicas, so 1000 instances at 6000 req/s
cost what 10 instances do (a per-request event queue would be ~10^7 heap operations per policy at that size).
Waits, timeouts and time to capacity are therefore exact to one step (100 ms), which is also how often a gateway
publishes the queue depth our policy reads. Replica starts, readiness and slot re-arming are events (a heap keyed
by time); a policy is shown the gateway's metrics every `Policy.sample_s` and may set a new desired count.

Accounting is in whole requests, and the engine checks it at the end of every run:
``requests == ok + timeouts + rejected + queued + in_flight``.

GPU-seconds: every replica that holds a GPU (starting, serving, or draining its in-flight requests after a
scale-down) and every warm standby slot of the pool (a GPU reserved for the model, idle until claimed) counts.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "STEP_S",
    "AccountingError",
    "Delay",
    "Empirical",
    "Fixed",
    "Load",
    "Metrics",
    "Policy",
    "Result",
    "Service",
    "Startup",
    "run",
]

STEP_S: Final = 0.1
"""The grid of arrivals and dispatch: a gateway publishes its queue every 100 ms, so finer steps would show a
policy nothing new."""


class AccountingError(AssertionError):
    """The simulation lost or invented requests: a bug in the engine, never a property of a policy."""


class Delay(Protocol):
    def sample(self, rng: np.random.Generator) -> float: ...


@dataclass(frozen=True)
class Fixed:
    seconds: float

    def sample(self, rng: np.random.Generator) -> float:
        return self.seconds


@dataclass(frozen=True)
class Empirical:
    """Measured durations, drawn with replacement (a file of claim -> ready times, `bench activate` output)."""

    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.seconds or any(not (math.isfinite(s) and s >= 0) for s in self.seconds):
            raise ValueError("Empirical needs at least one finite duration >= 0 s")

    def sample(self, rng: np.random.Generator) -> float:
        return self.seconds[int(rng.integers(len(self.seconds)))]


@dataclass(frozen=True)
class Startup:
    """How a new replica becomes ready: from the warm pool while it has a free slot, else the cold path."""

    cold: Delay
    """Pod created -> ready without a warm slot (the article: 1.5 + 120 + 18 + 45.5 s)."""
    warm: Delay | None = None
    """Claim -> ready of a warm slot; None: this policy has no warm pool."""
    pool_size: int = 0
    """Warm standby slots at the start; a released replica's slot returns to the pool after `rearm_s`."""
    rearm_s: float = 10.0
    """Released slot -> warm again (the engine restarted into standby); the pool is not refilled instantly."""


@dataclass(frozen=True)
class Service:
    concurrency: int = 8
    """Requests one replica serves at once (the engine's batch slots)."""
    service_s: float = 2.0
    """Time one request holds a slot (prefill + decode of a typical completion)."""
    timeout_s: float = 60.0
    """A request still queued after this long gets 504 (nginx's default proxy_read_timeout is 60 s)."""
    queue_limit: int | None = None
    """Requests the gateway queue holds; arrivals beyond it are rejected (counted apart from 504s). None: no bound."""

    @property
    def rps_per_replica(self) -> float:
        return self.concurrency / self.service_s


@dataclass(frozen=True)
class Load:
    """Offered load, piecewise constant: ``(from_s, requests per second)``, the first at 0."""

    phases: tuple[tuple[float, float], ...]
    poisson: bool = True
    """Poisson arrivals per step (seeded); False: the exact rate, fractions carried to the next step."""

    def rate(self, t: float) -> float:
        current = 0.0
        for start, rps in self.phases:
            if t + 1e-9 >= start:
                current = rps
        return current


@dataclass(frozen=True)
class Metrics:
    """What a policy sees at `now`: the gateway's sample plus the replica counts a controller knows."""

    now: float
    queued: int
    in_flight: int
    ready: int
    starting: int
    desired: int
    lead_time_s: float | None
    """p90 of the last 50 measured start -> ready times (after 3), as the real decider feeds the policy."""

    @property
    def demand(self) -> float:
        return float(self.queued + self.in_flight)

    @property
    def current(self) -> int:
        """Replicas that exist (ready or starting): what a Deployment's status reports."""
        return self.ready + self.starting


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def sample_s(self) -> float:
        """How often the engine shows this policy the metrics (a multiple of `STEP_S`)."""
        ...

    def sample(self, m: Metrics) -> int | None:
        """The new desired count, or None to leave it as it is."""
        ...


@dataclass
class Result:
    policy: str
    requests: int = 0
    ok: int = 0
    timeouts: int = 0
    rejected: int = 0
    queued_at_end: int = 0
    in_flight_at_end: int = 0
    gpu_s: float = 0.0
    standby_gpu_s: float = 0.0
    """The part of `gpu_s` spent by idle warm standby slots."""
    warm_starts: int = 0
    cold_starts: int = 0
    needed: int = 0
    pulse_at_s: float = 0.0
    time_to_capacity_s: float | None = None
    """Pulse start -> ready replicas >= `needed` for the first time; None: not within the run."""
    wait_hist: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Requests by queue wait in steps; requests that timed out are counted at the timeout."""
    series: dict[str, list[float]] = field(default_factory=dict)
    """Per second: t, offered (req/s), capacity (req/s of ready replicas), served (req/s), queued, in_flight,
    timeouts (504s in that second), ready, starting, desired."""

    def wait_percentile_s(self, q: float) -> float:
        total = int(self.wait_hist.sum())
        if total == 0:
            return 0.0
        rank = math.ceil(q / 100 * total)
        idx = int(np.searchsorted(np.cumsum(self.wait_hist), rank))
        return idx * STEP_S


def _p90(values: deque[float]) -> float | None:
    if len(values) < 3:
        return None
    return float(np.percentile(np.fromiter(values, dtype=np.float64), 90))


def run(
    policy: Policy,
    *,
    load: Load,
    service: Service,
    startup: Startup,
    duration_s: float,
    initial_replicas: int,
    needed: int,
    pulse_at_s: float,
    seed: int = 1,
) -> Result:
    """Run one policy over the load; see the module docstring for the model."""
    rng = np.random.default_rng(seed)
    start_rng = np.random.default_rng(seed + 1)  # start delays drawn apart from arrivals: same trace for all
    steps = round(duration_s / STEP_S)
    sample_every = max(round(policy.sample_s / STEP_S), 1)
    service_steps = max(round(service.service_s / STEP_S), 1)
    timeout_steps = max(round(service.timeout_s / STEP_S), 1)
    c = service.concurrency

    res = Result(policy=policy.name, needed=needed, pulse_at_s=pulse_at_s)
    wait_hist = np.zeros(timeout_steps + 1, dtype=np.int64)
    queue: deque[list[int]] = deque()  # [arrival step, count], oldest first
    queued = 0
    in_flight = 0
    completions = np.zeros(service_steps + 1, dtype=np.int64)  # ring by step
    ready_warm = initial_replicas  # the initial fleet is already up; counted as warm-sourced (nothing to re-arm)
    ready_cold = 0
    draining = 0  # slots of removed replicas still finishing requests
    starting: list[tuple[float, int, bool]] = []  # heap of (ready at, id, from the pool)
    cancelled: set[int] = set()
    next_id = 0
    pool_free = startup.pool_size if startup.warm is not None else 0
    rearming: list[float] = []  # heap of times a released slot is warm again
    desired = initial_replicas
    lead_times: deque[float] = deque(maxlen=50)
    carry = 0.0
    sec: dict[str, float] = {"arrived": 0.0, "served": 0.0, "timeouts": 0.0}
    series: dict[str, list[float]] = {
        k: []
        for k in ("t", "offered", "capacity", "served", "queued", "in_flight", "timeouts", "ready", "starting",
                  "desired")
    }  # fmt: skip
    per_sec = round(1.0 / STEP_S)
    started_at: dict[int, float] = {}

    def n_starting() -> int:
        return len(starting) - len(cancelled)

    def scale_to(target: int, now: float) -> None:
        nonlocal desired, next_id, pool_free, ready_warm, ready_cold, draining
        desired = max(target, 0)
        have = ready_warm + ready_cold + n_starting()
        if desired > have:
            for _ in range(desired - have):
                warm = startup.warm is not None and pool_free > 0
                if warm:
                    assert startup.warm is not None
                    pool_free -= 1
                    delay = startup.warm.sample(start_rng)
                    res.warm_starts += 1
                else:
                    delay = startup.cold.sample(start_rng)
                    res.cold_starts += 1
                heapq.heappush(starting, (now + delay, next_id, warm))
                started_at[next_id] = now
                next_id += 1
        elif desired < have:
            drop = have - desired
            # Not-ready pods go first (Kubernetes deletes unready pods before ready ones), the furthest from ready
            # first.
            for _when, rid, warm in sorted(starting, reverse=True):
                if drop == 0:
                    break
                if rid in cancelled:
                    continue
                cancelled.add(rid)
                started_at.pop(rid, None)
                if warm:
                    heapq.heappush(rearming, now + startup.rearm_s)
                drop -= 1
            # Then ready replicas: cold-started ones first, a warm one's slot goes back to the pool. A removed
            # replica takes no new requests; its in-flight ones finish (counted as draining GPU time).
            take = min(drop, ready_cold)
            ready_cold -= take
            drop -= take
            take_warm = min(drop, ready_warm)
            ready_warm -= take_warm
            for _ in range(take_warm if startup.warm is not None else 0):
                heapq.heappush(rearming, now + startup.rearm_s)
            draining += (take + take_warm) * c

    # Start in the steady state of the load at t=0: the initial fleet already serves it (requests that arrived
    # before 0 s and finish within the first service time), so no policy sees a start-up ramp that is not there.
    if initial_replicas > 0 and load.rate(0.0) > 0:
        per_step = min(load.rate(0.0) * STEP_S, initial_replicas * c / service_steps)
        acc = 0.0
        for i in range(1, service_steps + 1):
            acc += per_step
            n = math.floor(acc + 1e-9)
            acc -= n
            completions[i % len(completions)] += n
            in_flight += n
            res.requests += n
            wait_hist[0] += n

    for k in range(steps):
        now = k * STEP_S
        # Replicas and slots whose time has come.
        while starting and starting[0][0] <= now + 1e-9:
            _, rid, warm = heapq.heappop(starting)
            if rid in cancelled:
                cancelled.discard(rid)
                continue
            lead_times.append(now - started_at.pop(rid))
            if warm:
                ready_warm += 1
            else:
                ready_cold += 1
        while rearming and rearming[0] <= now + 1e-9:
            heapq.heappop(rearming)
            pool_free += 1
        ready = ready_warm + ready_cold
        if res.time_to_capacity_s is None and now + 1e-9 >= pulse_at_s and ready >= needed:
            res.time_to_capacity_s = round(now - pulse_at_s, 6)

        # Completions free slots (draining replicas' slots first: they go away).
        done = int(completions[k % len(completions)])
        completions[k % len(completions)] = 0
        in_flight -= done
        res.ok += done
        sec["served"] += done
        draining = max(min(draining, in_flight), 0)

        # Arrivals.
        rate = load.rate(now)
        if load.poisson:
            arrived = int(rng.poisson(rate * STEP_S)) if rate > 0 else 0
        else:
            carry += rate * STEP_S
            arrived = math.floor(carry + 1e-9)
            carry -= arrived
        res.requests += arrived
        sec["arrived"] += arrived
        if service.queue_limit is not None and queued + arrived > service.queue_limit:
            over = queued + arrived - service.queue_limit
            res.rejected += over
            arrived -= over
        if arrived:
            queue.append([k, arrived])
            queued += arrived

        # Timeouts: a cohort that has waited `timeout_s` leaves with 504.
        while queue and k - queue[0][0] >= timeout_steps:
            _, n = queue.popleft()
            queued -= n
            res.timeouts += n
            sec["timeouts"] += n
            wait_hist[timeout_steps] += n

        # Dispatch to free slots, oldest first.
        free = ready * c - (in_flight - draining)
        while free > 0 and queue:
            head = queue[0]
            n = min(free, head[1])
            wait_hist[k - head[0]] += n
            head[1] -= n
            queued -= n
            free -= n
            in_flight += n
            completions[(k + service_steps) % len(completions)] += n
            if head[1] == 0:
                queue.popleft()

        # GPU time of this step.
        standby = pool_free + len(rearming)
        holding = ready + n_starting() + math.ceil(draining / c)
        res.gpu_s += (holding + standby) * STEP_S
        res.standby_gpu_s += standby * STEP_S

        # The policy reads the gateway's sample.
        if k % sample_every == 0:
            m = Metrics(now, queued, in_flight, ready, n_starting(), desired, _p90(lead_times))
            target = policy.sample(m)
            if target is not None and target != desired:
                scale_to(target, now)

        if (k + 1) % per_sec == 0:
            series["t"].append(round(now + STEP_S - 1.0, 6))
            series["offered"].append(sec["arrived"])
            series["capacity"].append(ready * service.rps_per_replica)
            series["served"].append(sec["served"])
            series["queued"].append(queued)
            series["in_flight"].append(in_flight)
            series["timeouts"].append(sec["timeouts"])
            series["ready"].append(ready)
            series["starting"].append(n_starting())
            series["desired"].append(desired)
            sec = dict.fromkeys(sec, 0.0)

    res.queued_at_end = queued
    res.in_flight_at_end = in_flight
    res.wait_hist = wait_hist
    res.series = series
    left = res.requests - (res.ok + res.timeouts + res.rejected + res.queued_at_end + res.in_flight_at_end)
    if left != 0 or queued != sum(n for _, n in queue) or int(completions.sum()) != in_flight:
        raise AccountingError(f"{policy.name}: {left} requests unaccounted for")
    if int(wait_hist.sum()) != res.ok + res.timeouts + in_flight:
        raise AccountingError(f"{policy.name}: wait histogram holds {int(wait_hist.sum())} requests")
    return res
