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
    standby_cost: bool = True
    """Idle warm slots hold a GPU each (counted in `Result.standby_gpu_s`); False for the oracle, whose warm
    slots appear when it needs them."""


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
class Arrivals:
    """Requests that arrive, as cohorts on the step grid: ``counts[i]`` requests in step ``steps[i]``, each holding a
    replica slot for ``service_steps[i]`` steps once dispatched. Steps ascending; one step may hold several cohorts
    (a replayed trace's requests of different lengths). Made once per scenario, so every policy, the oracle among
    them, sees the same requests."""

    steps: npt.NDArray[np.int64]
    counts: npt.NDArray[np.int64]
    service_steps: npt.NDArray[np.int64]

    def __post_init__(self) -> None:
        n = len(self.steps)
        if len(self.counts) != n or len(self.service_steps) != n:
            raise ValueError("Arrivals: steps, counts and service_steps differ in length")
        if n and (np.any(np.diff(self.steps) < 0) or np.any(self.counts < 0) or np.any(self.service_steps < 1)):
            raise ValueError("Arrivals: steps must ascend, counts be >= 0 and service >= 1 step")

    @classmethod
    def from_load(cls, load: Load, *, steps: int, service_s: float, seed: int) -> Arrivals:
        """Draws `load` on the grid with `seed` (Poisson per step, or the exact rate with fractions carried)."""
        rng = np.random.default_rng(seed)
        counts = np.zeros(steps, dtype=np.int64)
        carry = 0.0
        for k in range(steps):
            rate = load.rate(k * STEP_S)
            if load.poisson:
                counts[k] = int(rng.poisson(rate * STEP_S)) if rate > 0 else 0
            else:
                carry += rate * STEP_S
                counts[k] = math.floor(carry + 1e-9)
                carry -= counts[k]
        keep = counts > 0
        svc = max(round(service_s / STEP_S), 1)
        idx = np.flatnonzero(keep).astype(np.int64)
        return cls(idx, counts[keep], np.full(len(idx), svc, dtype=np.int64))

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def per_step(self, steps: int) -> npt.NDArray[np.int64]:
        """Requests arriving in each of the first `steps` steps."""
        out = np.zeros(steps, dtype=np.int64)
        inside = self.steps < steps
        np.add.at(out, self.steps[inside], self.counts[inside])
        return out

    def busy(self, steps: int) -> npt.NDArray[np.int64]:
        """Requests in service at each step if every one were served the step it arrived (nobody waits): the load
        the oracle provisions for."""
        diff = np.zeros(steps + 1, dtype=np.int64)
        inside = self.steps < steps
        np.add.at(diff, self.steps[inside], self.counts[inside])
        ends = np.minimum(self.steps[inside] + self.service_steps[inside], steps)
        np.subtract.at(diff, ends, self.counts[inside])
        return np.cumsum(diff[:steps])


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
    arrivals_total: int = 0
    """Requests that reached the gateway so far (its `arrivals_total` counter)."""
    completions_total: int = 0
    """Requests served so far (its `completions_total` counter)."""
    step: int = 0
    """The engine's step (`now` / `STEP_S`): the oracle reads its plan by it."""

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
    """Every GPU held: `replica_gpu_s` + `standby_gpu_s`."""
    standby_gpu_s: float = 0.0
    """The part of `gpu_s` spent by idle warm standby slots."""
    starting_gpu_s: float = 0.0
    """Replicas between their start and ready (activating, or a cold start)."""
    serving_gpu_s: float = 0.0
    """Ready replicas, busy or not."""
    draining_gpu_s: float = 0.0
    """Removed replicas still finishing their in-flight requests."""
    peak_replicas: int = 0
    """The most replicas held at once (ready + starting)."""
    pool_peak_in_use: int = 0
    """The most warm slots out of the pool at once (claimed, serving or re-arming): a pool this size starts nothing
    cold on this run."""
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

    @property
    def replica_gpu_s(self) -> float:
        """GPU-seconds of replicas: starting + serving + draining (the standby pool apart)."""
        return self.starting_gpu_s + self.serving_gpu_s + self.draining_gpu_s

    @property
    def max_wait_s(self) -> float:
        nz = np.flatnonzero(self.wait_hist)
        return float(nz[-1]) * STEP_S if nz.size else 0.0

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
    load: Load | Arrivals,
    service: Service,
    startup: Startup,
    duration_s: float,
    initial_replicas: int,
    needed: int,
    pulse_at_s: float,
    seed: int = 1,
) -> Result:
    """Run one policy over the load; see the module docstring for the model. A `Load` is drawn with `seed`; give
    `Arrivals` to replay the same requests (a trace, or the oracle's view of a load)."""
    steps = round(duration_s / STEP_S)
    arrivals = (
        load if isinstance(load, Arrivals) else Arrivals.from_load(load, steps=steps, service_s=service.service_s,
                                                                      seed=seed)
    )  # fmt: skip
    start_rng = np.random.default_rng(seed + 1)  # start delays drawn apart from arrivals: same trace for all
    sample_every = max(round(policy.sample_s / STEP_S), 1)
    base_service_steps = max(round(service.service_s / STEP_S), 1)
    max_service = max(int(arrivals.service_steps.max()) if len(arrivals.steps) else 1, base_service_steps)
    timeout_steps = max(round(service.timeout_s / STEP_S), 1)
    c = service.concurrency

    res = Result(policy=policy.name, needed=needed, pulse_at_s=pulse_at_s)
    wait_hist = np.zeros(timeout_steps + 1, dtype=np.int64)
    queue: deque[list[int]] = deque()  # [arrival step, count, service steps], oldest first
    queued = 0
    in_flight = 0
    completions = np.zeros(max_service + 1, dtype=np.int64)  # ring by step
    ready_warm = initial_replicas  # the initial fleet is already up; counted as warm-sourced (nothing to re-arm)
    ready_cold = 0
    draining: deque[list[int]] = deque()  # [until step, replicas]: removed replicas finishing their requests
    n_draining = 0
    starting: list[tuple[float, int, bool]] = []  # heap of (ready at, id, from the pool)
    cancelled: set[int] = set()
    next_id = 0
    pool_free = startup.pool_size if startup.warm is not None else 0
    rearming: list[float] = []  # heap of times a released slot is warm again
    desired = initial_replicas
    lead_times: deque[float] = deque(maxlen=50)
    arrivals_total = completions_total = 0
    sec: dict[str, float] = {"arrived": 0.0, "served": 0.0, "timeouts": 0.0}
    series: dict[str, list[float]] = {
        k: []
        for k in ("t", "offered", "capacity", "served", "queued", "in_flight", "timeouts", "ready", "starting",
                  "desired")
    }  # fmt: skip
    per_sec = round(1.0 / STEP_S)
    started_at: dict[int, float] = {}
    a_steps, a_counts, a_service = arrivals.steps.tolist(), arrivals.counts.tolist(), arrivals.service_steps.tolist()
    a_next = 0

    def n_starting() -> int:
        return len(starting) - len(cancelled)

    def scale_to(target: int, now: float) -> None:
        nonlocal desired, next_id, pool_free, ready_warm, ready_cold, n_draining
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
            if take + take_warm:
                # Its requests took a slot at most one service time ago: it holds its GPU until then.
                draining.append([round(now / STEP_S) + base_service_steps, take + take_warm])
                n_draining += take + take_warm

    # Start in the steady state of the load at t=0: the initial fleet already serves it (requests that arrived
    # before 0 s and finish within the first service time), so no policy sees a start-up ramp that is not there.
    first = (
        sum(n for st, n in zip(a_steps, a_counts, strict=True) if st < base_service_steps) / base_service_steps
        if isinstance(load, Arrivals)
        else load.rate(0.0) * STEP_S
    )
    if initial_replicas > 0 and first > 0:
        per_step = min(first, initial_replicas * c / base_service_steps)
        acc = 0.0
        for i in range(1, base_service_steps + 1):
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
        completions_total += done
        sec["served"] += done
        while draining and draining[0][0] <= k:
            n_draining -= draining.popleft()[1]
        drain_slots = min(n_draining * c, in_flight)  # what the removed replicas still serve

        # Arrivals: this step's cohorts, each with its service time.
        arrived = 0
        while a_next < len(a_steps) and a_steps[a_next] <= k:
            n, svc = a_counts[a_next], a_service[a_next]
            a_next += 1
            if a_steps[a_next - 1] < k or n <= 0:
                continue  # before the run's first step: nothing to do
            res.requests += n
            arrivals_total += n
            sec["arrived"] += n
            if service.queue_limit is not None and queued + n > service.queue_limit:
                over = queued + n - service.queue_limit
                res.rejected += over
                n -= over
            if n > 0:
                queue.append([k, n, svc])
                queued += n
                arrived += n

        # Timeouts: a cohort that has waited `timeout_s` leaves with 504.
        while queue and k - queue[0][0] >= timeout_steps:
            _, n, _svc = queue.popleft()
            queued -= n
            res.timeouts += n
            sec["timeouts"] += n
            wait_hist[timeout_steps] += n

        # Dispatch to free slots, oldest first.
        free = ready * c - (in_flight - drain_slots)
        while free > 0 and queue:
            head = queue[0]
            n = min(free, head[1])
            wait_hist[k - head[0]] += n
            head[1] -= n
            queued -= n
            free -= n
            in_flight += n
            completions[(k + head[2]) % len(completions)] += n
            if head[1] == 0:
                queue.popleft()

        # GPU time of this step.
        standby = pool_free + len(rearming) if startup.standby_cost else 0
        n_start = n_starting()
        held_draining = n_draining
        res.serving_gpu_s += ready * STEP_S
        res.starting_gpu_s += n_start * STEP_S
        res.draining_gpu_s += held_draining * STEP_S
        res.standby_gpu_s += standby * STEP_S
        res.gpu_s += (ready + n_start + held_draining + standby) * STEP_S
        res.peak_replicas = max(res.peak_replicas, ready + n_start)
        if startup.warm is not None:
            res.pool_peak_in_use = max(res.pool_peak_in_use, startup.pool_size - pool_free)

        # The policy reads the gateway's sample.
        if k % sample_every == 0:
            m = Metrics(
                now, queued, in_flight, ready, n_start, desired, _p90(lead_times), arrivals_total, completions_total, k
            )
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
    if left != 0 or queued != sum(n for _, n, _s in queue) or int(completions.sum()) != in_flight:
        raise AccountingError(f"{policy.name}: {left} requests unaccounted for")
    if int(wait_hist.sum()) != res.ok + res.timeouts + in_flight:
        raise AccountingError(f"{policy.name}: wait histogram holds {int(wait_hist.sum())} requests")
    return res
