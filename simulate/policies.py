"""The policies the simulation compares: ours (the real `autoscaler.decide.policy.decide`) and three baselines written
from their documented algorithms, each with its documented defaults. All read the same metric, the gateway's demand
(queue + in flight), against the same per-replica target, so the table compares the algorithms, not the metrics.

Kubernetes HPA v2 (autoscaling/v2), from
https://kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/ ("Algorithm details", "Configurable
scaling behavior", "Default Behavior") and the HPAScalingRules API reference
(https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/horizontal-pod-autoscaler-v2/):

- a sync every 15 s (``--horizontal-pod-autoscaler-sync-period``);
- ``desiredReplicas = ceil(currentReplicas * currentMetricValue / desiredMetricValue)``; for an external metric with
  an ``AverageValue`` target that is ``ceil(total / target)``; no change while the usage ratio is within the
  tolerance of 0.1;
- stabilisation: up to the lowest recommendation of the scale-up window (default 0 s: none), down only to the
  highest of the scale-down window (default 300 s);
- rate: scale-up policies ``Percent 100`` and ``Pods 4`` per 15 s, the larger wins (``selectPolicy: Max``);
  scale-down ``Percent 100`` per 15 s; counted from the replicas at the start of the period;
- then ``[minReplicas, maxReplicas]``; nothing happens while the target has 0 replicas (KEDA owns 0 <-> 1).

KEDA, from https://keda.sh/docs/latest/reference/scaledobject-spec/ and
https://keda.sh/docs/latest/concepts/scaling-deployments/: KEDA checks its triggers every ``pollingInterval``
(default 30 s) and itself activates a workload at 0 replicas (0 -> 1 when the metric exceeds the activation
threshold) and deactivates it after ``cooldownPeriod`` (default 300 s) without activity when ``minReplicaCount``
is 0; from 1 to N it hands the metric to an HPA (above, with its defaults). So with a floor above 0 KEDA scales
exactly as the HPA does; the `zero` scenario shows the activation delay.

Knative KPA, from https://knative.dev/docs/serving/autoscaling/kpa-specific/ and the ``config-autoscaler``
defaults (https://github.com/knative/serving/blob/main/config/core/configmaps/autoscaler.yaml): a decision every
``tick-interval`` 2 s over metrics scraped every second; stable demand = the mean over ``stable-window`` 60 s, panic
demand = the mean over the panic window (``panic-window-percentage`` 10 % = 6 s);
``dspc = ceil(stable / target)``, ``dppc = ceil(panic / target)``, both within ``[floor(ready /
max-scale-down-rate 2), ceil(max-scale-up-rate 1000 * ready)]``; panic when ``dppc / ready >=
panic-threshold-percentage 200 %`` (ready counted as at least 1); in panic the count is the highest ``dppc`` seen
(never down), and panic ends a stable window after the condition last held; then min-scale / max-scale.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

from autoscaler.decide import policy as ours
from simulate.engine import STEP_S, Arrivals, Metrics
from warmpool.protocol import Advanced, ScaledObjectSpec, ScaleTargetRef, Trigger, TriggerMetadata

__all__ = ["HPA", "KEDA", "KPA", "HPABehavior", "Oracle", "Ours", "ScalingPolicy", "oracle_plan", "our_spec"]

_EPS: Final = 1e-9


def our_spec(
    *, target: float, min_replicas: int, max_replicas: int, model: str = "sim", stabilization_s: float | None = None
) -> ScaledObjectSpec:
    """The ScaledObject our policy runs with: the same target, floor and ceiling as the baselines, defaults else
    (`stabilization_s`: ``scaleDownStabilizationSeconds``, when given)."""
    advanced = Advanced() if stabilization_s is None else Advanced(scale_down_stabilization_seconds=stabilization_s)
    return ScaledObjectSpec(
        scale_target_ref=ScaleTargetRef(name=model),
        triggers=[Trigger(type="gateway-queue", metadata=TriggerMetadata(model=model, target_queue_depth=target))],
        min_replica_count=min_replicas,
        max_replica_count=max_replicas,
        advanced=advanced,
    )


class Ours:
    """`autoscaler.decide.policy.decide` on every gateway sample (100 ms), as the real decider calls it."""

    sample_s = 0.1

    def __init__(self, spec: ScaledObjectSpec, *, initial_replicas: int, name: str = "pulsescale") -> None:
        self.name = name
        self.spec = spec
        self.policy_spec = ours.PolicySpec.of(spec)  # built once, as the decider builds it per edit
        self.state = ours.initial_state(self.policy_spec, now=0.0, current_replicas=initial_replicas)
        self.decision: ours.Decision | None = None
        self.panics = 0
        self.modes: dict[str, int] = {}
        """Decisions by the policy's mode (normal, panic, hold, ...): what the real policy did on this run."""
        self._last: tuple[float, int, int] | None = None

    def sample(self, m: Metrics) -> int | None:
        # The gateway's counters read as the real ingest reads them: rates over the interval since the last sample.
        lam = mu = None
        if self._last is not None and m.now > self._last[0]:
            dt = m.now - self._last[0]
            lam, mu = (m.arrivals_total - self._last[1]) / dt, (m.completions_total - self._last[2]) / dt
        self._last = (m.now, m.arrivals_total, m.completions_total)
        obs = ours.Observation(
            demand=m.demand,
            ready=m.ready,
            lead_time_s=m.lead_time_s,
            queued=float(m.queued),
            arrival_rate=lam,
            completion_rate=mu,
        )
        was_panic = self.state.panic
        self.decision, self.state = ours.decide(self.policy_spec, obs, self.state, m.now)
        self.panics += int(self.decision.panic and not was_panic)
        self.modes[self.decision.mode] = self.modes.get(self.decision.mode, 0) + 1
        return self.decision.desired


@dataclass(frozen=True)
class ScalingPolicy:
    type: Literal["Pods", "Percent"]
    value: int
    period_s: float


@dataclass(frozen=True)
class HPABehavior:
    """`spec.behavior` with the documented defaults."""

    scale_up_stabilization_s: float = 0.0
    scale_up: tuple[ScalingPolicy, ...] = (ScalingPolicy("Percent", 100, 15.0), ScalingPolicy("Pods", 4, 15.0))
    scale_down_stabilization_s: float = 300.0
    scale_down: tuple[ScalingPolicy, ...] = (ScalingPolicy("Percent", 100, 15.0),)


@dataclass
class HPA:
    """The HPA controller for one target with an external ``AverageValue`` metric."""

    target: float
    min_replicas: int = 1
    max_replicas: int = 100
    tolerance: float = 0.1
    sync_s: float = 15.0
    behavior: HPABehavior = field(default_factory=HPABehavior)
    name: str = "HPA v2"
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    events: list[tuple[float, int]] = field(default_factory=list)
    """Scale events ``(when, +added / -removed)``, for the rate policies."""

    @property
    def sample_s(self) -> float:
        return self.sync_s

    def raw(self, demand: float, current: int) -> int:
        """The metric's recommendation before behavior: unchanged within the tolerance."""
        if current <= 0:
            return 0
        ratio = demand / (self.target * current)
        if abs(1.0 - ratio) <= self.tolerance + _EPS:
            return current
        return math.ceil(demand / self.target - _EPS)

    def _stabilise(self, now: float, rec: int, current: int) -> int:
        up_cut = now - self.behavior.scale_up_stabilization_s
        down_cut = now - self.behavior.scale_down_stabilization_s
        up = down = rec
        for ts, r in self.recommendations:
            if ts > up_cut:
                up = min(up, r)
            if ts > down_cut:
                down = max(down, r)
        keep = max(self.behavior.scale_up_stabilization_s, self.behavior.scale_down_stabilization_s)
        self.recommendations = [(ts, r) for ts, r in self.recommendations if ts > now - keep]
        self.recommendations.append((now, rec))
        out = current
        if out < up:
            out = up
        if out > down:
            out = down
        return out

    def _period_start(self, now: float, current: int, period_s: float) -> int:
        added = sum(d for ts, d in self.events if d > 0 and ts > now - period_s)
        removed = -sum(d for ts, d in self.events if d < 0 and ts > now - period_s)
        return current - added + removed

    def _up_limit(self, now: float, current: int) -> int:
        limits = []
        for p in self.behavior.scale_up:
            start = self._period_start(now, current, p.period_s)
            if p.type == "Pods":
                limits.append(start + p.value)
            else:
                limits.append(math.ceil(start * (1 + p.value / 100) - _EPS))
        return max(limits)

    def _down_limit(self, now: float, current: int) -> int:
        limits = []
        for p in self.behavior.scale_down:
            start = self._period_start(now, current, p.period_s)
            if p.type == "Pods":
                limits.append(start - p.value)
            else:
                limits.append(int(start * (1 - p.value / 100)))
        return min(limits)

    def desired(self, now: float, demand: float, current: int) -> int:
        """One sync: the count the HPA writes to the scale subresource."""
        if current <= 0:
            return current  # "scaling is disabled since the replica count of the target is zero"
        stabilised = self._stabilise(now, self.raw(demand, current), current)
        out = stabilised
        if stabilised > current:
            limit = max(self._up_limit(now, current), current)
            out = min(stabilised, min(self.max_replicas, limit))
        elif stabilised < current:
            limit = min(self._down_limit(now, current), current)
            out = max(stabilised, max(self.min_replicas, limit))
        out = min(max(out, self.min_replicas), self.max_replicas)
        if out != current:
            self.events = [(ts, d) for ts, d in self.events if ts > now - 3600]
            self.events.append((now, out - current))
        return out

    def sample(self, m: Metrics) -> int | None:
        return self.desired(m.now, m.demand, m.current)


@dataclass
class KEDA:
    """KEDA's operator (activation 0 <-> 1 on its polling interval) in front of an HPA (1 <-> N)."""

    hpa: HPA
    min_replicas: int = 0
    polling_s: float = 30.0
    cooldown_s: float = 300.0
    activation: float = 0.0
    name: str = "KEDA"
    next_poll: float = 0.0
    next_sync: float = 0.0
    last_active: float | None = None

    @property
    def sample_s(self) -> float:
        return math.gcd(round(self.polling_s * 10), round(self.hpa.sync_s * 10)) / 10

    def desired(self, now: float, demand: float, current: int) -> int | None:
        if now + _EPS >= self.next_poll:
            self.next_poll += self.polling_s
            active = demand > self.activation
            if active:
                self.last_active = now
            if current == 0:
                return 1 if active else None
            idle_s = now - (self.last_active if self.last_active is not None else 0.0)
            if self.min_replicas == 0 and not active and idle_s >= self.cooldown_s:
                self.hpa.recommendations.clear()
                return 0
        if current == 0 or now + _EPS < self.next_sync:
            return None
        self.next_sync += self.hpa.sync_s * max(math.floor((now + _EPS - self.next_sync) / self.hpa.sync_s) + 1, 1)
        return self.hpa.desired(now, demand, current)

    def sample(self, m: Metrics) -> int | None:
        return self.desired(m.now, m.demand, m.current)


@dataclass
class KPA:
    """Knative's pod autoscaler with the documented defaults."""

    target: float
    min_replicas: int = 0
    max_replicas: int = 0
    """0: no upper bound (Knative's default max-scale)."""
    tick_s: float = 2.0
    stable_window_s: float = 60.0
    panic_window_pct: float = 10.0
    panic_threshold_pct: float = 200.0
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0
    name: str = "Knative KPA"
    sample_s: float = 1.0
    samples: deque[tuple[float, float]] = field(default_factory=deque)
    panic_since: float | None = None
    panic_at: float | None = None
    """The last tick the panic condition held."""
    max_panic_pods: int = 0
    next_tick: float = 0.0
    panics: int = 0

    @property
    def panic_window_s(self) -> float:
        return self.stable_window_s * self.panic_window_pct / 100

    @property
    def in_panic(self) -> bool:
        return self.panic_since is not None

    def record(self, now: float, demand: float) -> None:
        self.samples.append((now, demand))
        while self.samples and self.samples[0][0] <= now - self.stable_window_s - _EPS:
            self.samples.popleft()

    def _mean(self, now: float, window_s: float) -> float | None:
        vals = [v for ts, v in self.samples if ts > now - window_s + _EPS]
        return sum(vals) / len(vals) if vals else None

    def scale(self, now: float, ready: int) -> int | None:
        """One tick; None while there is no data yet (Knative's invalid ScaleResult)."""
        stable = self._mean(now, self.stable_window_s)
        panic = self._mean(now, self.panic_window_s)
        if stable is None or panic is None:
            return None
        ready_n = max(ready, 1)
        up_max = math.ceil(self.max_scale_up_rate * ready_n)
        down_min = math.floor(ready_n / self.max_scale_down_rate)
        dspc = min(max(math.ceil(stable / self.target - _EPS), down_min), up_max)
        dppc = min(max(math.ceil(panic / self.target - _EPS), down_min), up_max)
        over = dppc / ready_n >= self.panic_threshold_pct / 100
        if over:
            if self.panic_since is None:
                self.panic_since = now
                self.panics += 1
            self.panic_at = now
        elif self.panic_since is not None and self.panic_at is not None and now > self.panic_at + self.stable_window_s:
            self.panic_since = self.panic_at = None
            self.max_panic_pods = 0
        want = dspc
        if self.panic_since is not None:
            self.max_panic_pods = max(self.max_panic_pods, dppc)
            want = self.max_panic_pods
        want = max(want, self.min_replicas)
        if self.max_replicas > 0:
            want = min(want, self.max_replicas)
        return want

    def sample(self, m: Metrics) -> int | None:
        self.record(m.now, m.demand)
        if m.now + _EPS < self.next_tick:
            return None
        self.next_tick += self.tick_s
        return self.scale(m.now, m.ready)


def oracle_plan(
    arrivals: Arrivals,
    *,
    steps: int,
    concurrency: int,
    activation_s: float,
    service_s: float,
    floor: int,
    ceiling: int,
) -> npt.NDArray[np.int64]:
    """The oracle's replica count per step. It knows every request to come: at each step it needs the replicas
    that the requests in service over the next service time fill on average if none waited (``ceil(mean busy /
    concurrency)``, within the floor and ceiling); it starts each one `activation_s` before that, and keeps it
    until one service time after its last need (a replica let go still holds its GPU while its requests finish,
    so dropping it between two needs would cost as much and serve nothing). Nothing is held for a backlog: none
    forms."""
    ahead = max(round(activation_s / STEP_S), 0)
    svc = max(round(service_s / STEP_S), 1)
    busy = arrivals.busy(steps + ahead + svc).astype(np.float64)
    smooth = np.convolve(busy, np.ones(svc) / svc, mode="full")[svc - 1 : svc - 1 + steps + ahead]
    need = np.clip(np.ceil(smooth / max(concurrency, 1) - 1e-9), floor, max(ceiling, floor)).astype(np.int64)
    padded = np.concatenate([np.full(svc, need[0]), need])  # the step before 0 needed what step 0 does
    windows = np.lib.stride_tricks.sliding_window_view(padded, svc + ahead + 1)
    return np.asarray(windows.max(axis=1)[:steps], dtype=np.int64)


class Oracle:
    """Replays `oracle_plan` on every 100 ms step: the lower bound a policy's GPU-seconds are measured against."""

    sample_s = STEP_S

    def __init__(self, plan: npt.NDArray[np.int64], *, name: str = "oracle") -> None:
        self.name = name
        self.plan = plan

    def sample(self, m: Metrics) -> int | None:
        return int(self.plan[min(m.step, len(self.plan) - 1)])
