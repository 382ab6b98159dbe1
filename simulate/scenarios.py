"""Scenarios: the load, the service, the fleet and the start-up paths, and the policies that run on them.

`seed` is the article's load test (../shared/SEED.md): a fleet provisioned for normal load takes a pulse to 300 %
of its capacity within one step, held; the pulse needs `instances` more replicas (the article's "100-instance
burst": 50 provisioned, 150 needed). Every baseline pays the article's cold start for each new pod (scheduling 1.5
+ image 120 + Python 18 + weights 45.5 = 185 s); ours activates warm slots (claim -> ready measured by `pulsescale
bench activate`, or a file of measured activations) while its pool lasts, then pays the same cold start.

`zero` starts from 0 replicas (an idle model, minReplicaCount 0) and shows what KEDA's 30 s activation poll and
Knative's panic mode do with a first burst.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Final

from simulate import engine, policies
from simulate.engine import Delay, Empirical, Fixed, Load, Result, Service, Startup

__all__ = [
    "ARTICLE_COLD_STAGES_S",
    "DEFAULT_WARM_S",
    "POOL_HEADROOM",
    "SCENARIOS",
    "Scenario",
    "make",
    "policies_for",
    "pool_size",
    "run",
]

ARTICLE_COLD_STAGES_S: Final = {"scheduling": 1.5, "image": 120.0, "python": 18.0, "weights": 45.5}
"""The article's classic cold start, HPA decision -> ready (SEED.md, 185 s in all)."""

POOL_HEADROOM: Final = 0.2
"""The default pool is the burst + 20 %: a queue-driven target at 100 % concurrency asks for a few more replicas
than the exact need while arrivals fluctuate, and a pool of exactly the burst sends those few down the cold path."""

DEFAULT_WARM_S: Final = 0.1
"""Claim -> ready of a warm slot when no measurements are given: `pulsescale bench activate` here measured 22 ms
p50 for a vLLM standby and well under 100 ms for the local engine; 0.1 s leaves room for the control plane."""


@dataclass(frozen=True)
class Scenario:
    name: str
    instances: int
    """Replicas the pulse needs beyond the provisioned fleet (the article's burst: 100)."""
    pulse: float = 3.0
    """Pulse load as a multiple of the provisioned capacity (300 %)."""
    base_utilisation: float = 0.7
    """Normal load as a share of the provisioned capacity (an HPA's usual 70 % target)."""
    warmup_s: float = 120.0
    """Normal load before the pulse: our policy and Knative want a full 60 s window of data first."""
    pulse_s: float = 600.0
    """How long the pulse is held: long enough for a 185 s cold start and the slowest ramp to finish."""
    after_s: float = 300.0
    """Normal load after the pulse (scale-down and its GPU cost)."""
    service: Service = field(default_factory=Service)
    cold_s: float = sum(ARTICLE_COLD_STAGES_S.values())
    pool_size: int | None = None
    """Our warm standby slots; None: the burst plus `POOL_HEADROOM` (see `pool_size`)."""
    min_replicas: int | None = None
    """The floor of every policy; None: the provisioned fleet."""
    max_factor: float = 2.0
    """Every policy's ceiling, as a multiple of the replicas the pulse needs (queue-driven metrics overshoot while
    pods are still starting; the ceiling bounds what that costs)."""
    poisson: bool = True
    seed: int = 1
    from_zero: bool = False
    """An idle model: nothing provisioned, no load, then a pulse that needs `instances` replicas."""
    stabilization_s: float | None = None
    """Our ``scaleDownStabilizationSeconds``; None: the ScaledObject's default (60 s)."""
    trace: bool = False
    """A replayed trace (`simulate.replay`): no pulse; `instances` is the oracle's peak, not a known need."""

    @property
    def provisioned(self) -> int:
        """The fleet before the pulse: a pulse of `pulse` x its capacity needs `instances` more."""
        if self.from_zero:
            return 0
        return max(round(self.instances / (self.pulse - 1)), 0) if self.pulse > 1 else self.instances

    @property
    def pulse_rps(self) -> float:
        return (self.provisioned + self.instances) * self.service.rps_per_replica

    @property
    def base_rps(self) -> float:
        return self.base_utilisation * self.provisioned * self.service.rps_per_replica

    @property
    def needed(self) -> int:
        """Ready replicas that carry the pulse (each at its full concurrency)."""
        return math.ceil(self.pulse_rps / self.service.rps_per_replica - 1e-9)

    @property
    def floor(self) -> int:
        return self.provisioned if self.min_replicas is None else self.min_replicas

    @property
    def ceiling(self) -> int:
        return max(math.ceil(self.needed * self.max_factor), self.floor, 1)

    @property
    def duration_s(self) -> float:
        return self.warmup_s + self.pulse_s + self.after_s

    @property
    def load(self) -> Load:
        t1 = self.warmup_s
        return Load(((0.0, self.base_rps), (t1, self.pulse_rps), (t1 + self.pulse_s, self.base_rps)), self.poisson)


def pool_size(sc: Scenario) -> int:
    return math.ceil(sc.instances * (1 + POOL_HEADROOM)) if sc.pool_size is None else sc.pool_size


def make(name: str, *, instances: int | None = None) -> Scenario:
    if name not in SCENARIOS:
        raise KeyError(name)
    sc = SCENARIOS[name]
    return sc if instances is None else replace(sc, instances=instances)


SCENARIOS: dict[str, Scenario] = {
    "seed": Scenario("seed", instances=100),
    "zero": Scenario("zero", instances=40, base_utilisation=0.0, from_zero=True, warmup_s=90.0),
}


OURS: Final = "pulsescale"


def policies_for(sc: Scenario) -> list[engine.Policy]:
    """Ours and the three baselines, each with the scenario's target, floor and ceiling."""
    target = float(sc.service.concurrency)
    floor, ceiling = sc.floor, sc.ceiling
    start = sc.floor
    return [
        policies.Ours(policies.our_spec(target=target, min_replicas=floor, max_replicas=ceiling,
                                        stabilization_s=sc.stabilization_s), initial_replicas=start),
        policies.HPA(target=target, min_replicas=max(floor, 1), max_replicas=ceiling),
        policies.KEDA(policies.HPA(target=target, min_replicas=max(floor, 1), max_replicas=ceiling),
                      min_replicas=floor),
        policies.KPA(target=target, min_replicas=floor, max_replicas=ceiling),
    ]  # fmt: skip


def activation_mean_s(warm: Delay) -> float:
    """The oracle's activation time: the mean of the measured ones (it knows when each will be ready)."""
    if isinstance(warm, Empirical):
        return float(sum(warm.seconds) / len(warm.seconds))
    if isinstance(warm, Fixed):
        return warm.seconds
    return DEFAULT_WARM_S


def run(sc: Scenario, *, warm: Delay | None = None, only: set[str] | None = None) -> list[Result]:
    """Every policy over the same requests (drawn once with the scenario's seed), the oracle first; ours with the
    warm path, the oracle with warm slots that cost nothing while idle."""
    warm = warm if warm is not None else Fixed(DEFAULT_WARM_S)
    steps = round(sc.duration_s / engine.STEP_S)
    arrivals = engine.Arrivals.from_load(sc.load, steps=steps, service_s=sc.service.service_s, seed=sc.seed)
    return run_arrivals(sc, arrivals, warm=warm, only=only)


def run_arrivals(sc: Scenario, arrivals: engine.Arrivals, *, warm: Delay, only: set[str] | None = None) -> list[Result]:
    """`run` on given requests (a scenario's draw, or a replayed trace)."""
    pool = pool_size(sc)
    cold = Fixed(sc.cold_s)
    steps = round(sc.duration_s / engine.STEP_S)
    lead = activation_mean_s(warm)
    oracle = policies.Oracle(
        policies.oracle_plan(
            arrivals, steps=steps, concurrency=sc.service.concurrency, activation_s=lead,
            service_s=sc.service.service_s, floor=sc.floor, ceiling=sc.ceiling,
        )
    )  # fmt: skip
    results = []
    for pol in [oracle, *policies_for(sc)]:
        if only is not None and pol.name not in only:
            continue
        if isinstance(pol, policies.Oracle):
            startup = Startup(cold=cold, warm=Fixed(lead), pool_size=1 << 30, standby_cost=False)
        elif isinstance(pol, policies.Ours):
            startup = Startup(cold=cold, warm=warm, pool_size=pool)
        else:
            startup = Startup(cold=cold)
        results.append(
            engine.run(
                pol,
                load=arrivals,
                service=sc.service,
                startup=startup,
                duration_s=sc.duration_s,
                # An HPA cannot run a target at 0 (minReplicas >= 1): it starts from its floor of 1.
                initial_replicas=max(sc.floor, 1) if isinstance(pol, policies.HPA) else sc.floor,
                needed=sc.needed,
                pulse_at_s=sc.warmup_s,
                seed=sc.seed,
            )
        )
    return results


def recommend_pool(sc: Scenario, arrivals: engine.Arrivals, *, warm: Delay, ours: Result) -> int | None:
    """The smallest warm pool that keeps ours at 0 504s on these requests (a binary search of runs of ours alone,
    at most `ours.pool_peak_in_use`: a pool that size starts nothing cold); None when ours had 504s even with its
    pool."""
    if ours.timeouts > 0:
        return None
    hi = ours.pool_peak_in_use  # 0 504s there: the same run as `ours`, no slot missing
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        got = run_arrivals(replace(sc, pool_size=mid), arrivals, warm=warm, only={OURS})
        if got[0].timeouts == 0:
            hi = mid
        else:
            lo = mid + 1
    return hi
