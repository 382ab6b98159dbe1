"""The decide side of one model's control loop: samples in, a target replica count and its reason out.

`ModelDecider` holds everything a decision rests on and nothing that acts: the gateways' demand
(`ingest.ModelDemand`), the policy's state, the on-call override and the ScaledObject's paused annotation, the
measured claim -> ready times the forecast looks ahead by, and the decisions made (for `pulsescale status`). No
NATS, no tasks, no metrics, no clock: time is an argument, so it is tested on a hand clock.

Its seams: `decide` runs the pure policy (`policy.decide`) and returns an `Evaluation`; the act side
(`autoscaler.act.scaler`) reads the target through `desired(held)` and reports measured activations through
`add_lead_time`; the controller (`autoscaler.controller`) joins the two and owns the one timer that fires a
deferred decision at `due_at`.

Debounce. An accepted sample that changes the model's demand (its gateway's queue + in-flight differs from what that
gateway last said, or the gateway was new or stale) asks for a decision, at most one per `debounce_s`: a burst of
samples is one decision, never a polling period. A sample above the largest single-gateway demand decided on since the
target last fell may be a pulse, and is decided at once. A sample that changes nothing asks for nothing: what time alone
changes (the windows, stale gateways, cooldowns, an override's expiry) is decided by the controller's housekeeping, on
its own period, for the models where it can change anything: `settled` says when a decision now would repeat the last
one exactly and leave the policy's windows as deciding would (`PolicySpec.settle_s`, `settling.time_events`, a gateway
turning stale), and housekeeping skips those.

Schedules (protocol revision 8). The ScaledObject's ``schedules`` and the on-call ones (`oncall_schedules`, set
by ``pulsescale schedule``) are resolved to windows (`autoscaler.decide.schedules`); the floor in force is handed to the
policy as `policy.Observation.scheduled_floor`. A schedule's start and end are time events: `settled` is False
across one, and `next_boundary` tells the controller when to decide with no sample at all.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Final

from autoscaler.decide import policy, schedules, settling
from autoscaler.decide.ingest import Accepted, ModelDemand
from warmpool import protocol
from warmpool.protocol import DecisionRow, OnCallSchedule, Override, QueueSample, ScalerRecord, StatusRow

__all__ = ["LEAD_TIME_MIN_SAMPLES", "DeciderSettings", "Evaluation", "ModelDecider"]

log = logging.getLogger("pulsescale.decider")

LEAD_TIME_MIN_SAMPLES: Final = 3
"""Measured claim -> ready times needed before their p90 replaces the spec's `leadTimeSeconds`: one or two
activations say little about the next one."""


@dataclass(frozen=True)
class DeciderSettings:
    debounce_s: float = 0.05
    """At most one decision per model per this many seconds: a burst of samples is one decision, not many."""
    lead_time_samples: int = 50
    """Recent claim -> ready durations kept for the lead-time p90 the forecast uses."""
    decisions_kept: int = 20
    """Decisions kept per model for `pulsescale status` (the reasons are what on-call reads)."""


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One run of the policy and what the controller needs to act on it."""

    decision: policy.Decision
    changed: bool
    """The target or the mode differs from the previous decision: a new history row, and an event."""
    demand: float | None
    """Queue + in-flight over the fresh gateways; None when no gateway is fresh."""
    sample_at: float | None
    """Receive time of the first sample since the previous decision, when samples caused this one (the start of
    `pulsescale_decision_seconds`); None for a decision only time caused (housekeeping, an override, an edit)."""
    arrival_rate: float | None = None
    """Requests per second arriving over the fresh gateways (``pulsescale_arrival_rate``); None: no rate yet."""


class ModelDecider:
    """The decide side of one model; see the module docstring."""

    def __init__(
        self,
        record: ScalerRecord,
        settings: DeciderSettings = DeciderSettings(),
        *,
        now: float,
        current_replicas: int = 0,
    ) -> None:
        self.record = record
        self.settings = settings
        self.demand = ModelDemand(record.spec.model, record.spec.advanced.stale_after_seconds)
        self.policy_spec = policy.PolicySpec.of(record.spec)
        """The ScaledObject as the policy reads it, built once per edit (`autoscaler.decide.policyspec`)."""
        self.state = policy.initial_state(self.policy_spec, now=now, current_replicas=current_replicas)
        self.override: Override | None = None
        """The on-call override (`scale`, `pause`); the paused annotation is read from `record`."""
        self.oncall_schedules: tuple[OnCallSchedule, ...] = ()
        """The on-call schedules (``pulsescale schedule``); the ScaledObject's are read from `record`."""
        self._windows: tuple[schedules.Window, ...] | None = None  # both sources resolved; None: not yet
        self.decision: policy.Decision | None = None
        self.history: deque[DecisionRow] = deque(maxlen=settings.decisions_kept)
        """Decisions that changed the target or the mode, newest last."""
        self.lead_times: deque[float] = deque(maxlen=settings.lead_time_samples)
        self.due_at: float | None = None
        """When the next decision is due; None while none is asked for."""
        self.last_scale_at: float | None = None
        """When a decision last changed the target count (the status's ``lastScaleTime``)."""
        self._decided_at = -math.inf
        self._decided_demand = 0.0  # the largest single-gateway demand decided on since the target last fell
        self._sample_at: float | None = None  # receive time of the first sample since the last decision
        self._changed_at = now  # when the demand (or the spec) last changed: `settled` counts from it
        self._decided_with: tuple[object, ...] | None = None  # (ready, lead time, record, rates)
        self._demand_seen: float | None = None  # the demand the last decision saw
        self._rates_seen: tuple[float | None, float | None, float | None] = (None, None, None)  # queued, rates
        self._current_at = -math.inf  # when the state was last brought up to date (a decision or `skip`)

    @property
    def model(self) -> str:
        return self.record.spec.model

    @property
    def spec(self) -> protocol.ScaledObjectSpec:
        return self.record.spec

    @property
    def decided_at(self) -> float:
        """When the last decision was taken (-inf: none yet)."""
        return self._decided_at

    @property
    def reason(self) -> str:
        return self.decision.reason if self.decision is not None else ""

    def desired(self, held: int) -> int:
        """The target replica count; before the first decision, the `held` count (nothing to change yet)."""
        return self.decision.desired if self.decision is not None else held

    # --- schedules ------------------------------------------------------------------------------------------------

    @property
    def windows(self) -> tuple[schedules.Window, ...]:
        """The ScaledObject's and the on-call schedules, resolved to Unix seconds (`autoscaler.decide.schedules`)."""
        if self._windows is None:
            self._windows = schedules.windows(self.record.spec.schedules, self.oncall_schedules)
        return self._windows

    def set_schedules(self, oncall: tuple[OnCallSchedule, ...], now: float) -> float:
        """New on-call schedules: the next decision uses them. Returns when that decision is due."""
        self.oncall_schedules = oncall
        self._windows = None
        return self.request(now)

    def next_boundary(self, now: float) -> float | None:
        """The next start or end of a schedule after `now`: a decision is due then, samples or not."""
        return schedules.next_boundary(self.windows, now)

    # --- asking for a decision ---------------------------------------------------------------------------------

    def update_record(self, record: ScalerRecord, now: float) -> float:
        """A live edit of the ScaledObject: the next decision uses it. Returns when that decision is due."""
        if record.spec != self.record.spec:
            self.policy_spec = policy.PolicySpec.of(record.spec)
        self.record = record
        self._windows = None
        self.demand.stale_after_s = record.spec.advanced.stale_after_seconds
        self._changed_at = now
        # The windows hold what was recorded under the old spec: only `settle_s` tells when that has gone.
        self.state = dataclasses.replace(self.state, flat=None)
        return self.request(now)

    def on_sample(self, sample: QueueSample, now: float) -> Accepted:
        """Fold one gateway sample into the demand; an accepted one that changes the demand asks for a decision
        (`due_at`)."""
        last = self.demand.gateways.get(sample.gateway)
        # This gateway's part of the model's demand before the sample: None when it counted for nothing (new, or
        # stale, which `ModelDemand.observe` judges the same way).
        fresh = last is not None and now - last.received_at <= self.demand.stale_after_s
        before = last.queue_depth + last.inflight if last is not None and fresh else None
        outcome = self.demand.add(sample, now)
        value = sample.queue_depth + sample.inflight
        if outcome in ("accepted", "restart") and value != before:
            if self._sample_at is None:
                self._sample_at = now
            self._changed_at = now
            # Rising demand is a possible pulse: decide now. Falling demand can wait for the debounce.
            self.request(now, urgent=self.urgent(sample))
        return outcome

    def urgent(self, sample: QueueSample) -> bool:
        """`sample` would be decided on at once (`on_sample`): its gateway's demand above the largest one the
        decisions saw since the target last fell, a possible pulse. Below it, the target held was sized for as much,
        and the sample waits for the debounce."""
        return sample.queue_depth + sample.inflight > self._decided_demand

    def request(self, now: float, *, urgent: bool = False) -> float:
        """Ask for a decision: at once when `urgent` or the debounce has passed, else when it passes. Returns
        `due_at`; an earlier request still pending stands."""
        at = now if urgent else max(now, self._decided_at + self.settings.debounce_s)
        if self.due_at is None or at < self.due_at:
            self.due_at = at
        return self.due_at

    def touch(self, now: float) -> None:
        """Something the demand rests on changed other than by a sample (gateways forgotten): `settled` starts over."""
        self._changed_at = max(self._changed_at, now)

    def settled(self, now: float, *, ready: int) -> bool:
        """Deciding at `now` with `ready` replicas would repeat the last decision exactly (reason and figures too),
        so housekeeping may `skip` it. Conservative: False unless the last decision had fresh demand, no panic, no
        hold after restart, no scale step still within its period, no override or pause, the same ready count,
        lead time and ScaledObject, was taken `PolicySpec.settle_s` after the demand last changed (a gateway turning
        stale is a change), and no time event (`settling.time_events`) falls since the state was last brought up to
        date (a decision, or `skip`)."""
        d, state, at, demand = self.decision, self.state, self._decided_at, self._demand_seen
        if d is None or demand is None or self.due_at is not None or self.override is not None or self.record.paused:
            return False
        seen = self.demand.observe(now)
        rates = (seen.queued, seen.arrival_rate, seen.completion_rate)
        if (
            self._decided_with != (ready, self.lead_time_s(), self.record, rates)
            or state.last_fresh_at != self._current_at
        ):
            return False
        # A hold of 0 replicas after a restart binds nothing (no decision goes below it): as good as none.
        if d.panic or state.hold_replicas or state.scale_downs or state.scale_ups:
            return False
        if policy.cooling_s(self.policy_spec, state, self.record.created_at, now) > 0:
            return False
        stale_at = -math.inf
        stale_after = self.demand.stale_after_s
        for g in self.demand.gateways.values():
            turned_stale = g.received_at + stale_after  # `ModelDemand.observe`: stale once now - received > this
            if turned_stale < now:
                stale_at = max(stale_at, turned_stale)
        changed = max(self._changed_at, stale_at)
        # Windows that only ever held this demand (`PolicyState.flat`) need not wait for older values to leave:
        # a fleet's models start steady, and waiting `settle_s` (minutes) re-decided every one on every turn.
        # ...unless the demand changed since the last decision other than by a sample (`touch`: gateways forgotten).
        flat = stale_at < at and self._changed_at <= at and settling.flat_settled(self.policy_spec, state, at)
        if at < changed + self.policy_spec.settle_s and not flat:
            return False
        events = settling.time_events(self.policy_spec, state, self.record.created_at, demand)
        if any(self._current_at < t <= now for t in events):
            return False
        # A schedule that started or ended since: the floor changes (`next_boundary`).
        boundary = schedules.next_boundary(self.windows, self._current_at)
        return boundary is None or boundary > now

    def skip(self, now: float) -> None:
        """Stand for a decision at `now` that `settled` said would repeat the last one: bring the state's times
        up to date as that decision would (`settling.repeat`), without running the policy."""
        assert self._demand_seen is not None
        assert self.decision is not None
        q, lam, mu = self._rates_seen
        self.state = settling.repeat(
            self.policy_spec, self.state, self.decision, now, self._demand_seen, queued=q, arrival_rate=lam,
            completion_rate=mu,
        )  # fmt: skip
        self._current_at = now

    def due(self, now: float) -> bool:
        return self.due_at is not None and now >= self.due_at

    # --- deciding ------------------------------------------------------------------------------------------------

    def lead_time_s(self) -> float | None:
        """p90 of the measured claim -> ready times; None until `LEAD_TIME_MIN_SAMPLES` were measured."""
        if len(self.lead_times) < LEAD_TIME_MIN_SAMPLES:
            return None
        ordered = sorted(self.lead_times)
        rank = -(-9 * len(ordered) // 10)  # nearest rank, ceil(0.9 n) in integers: 9 in 10 are at or below it
        return ordered[rank - 1]

    def add_lead_time(self, seconds: float) -> None:
        """One measured claim -> ready time (the act side reports its own activations)."""
        self.lead_times.append(seconds)

    def active_override(self, now: float) -> Override | None:
        """The override in force: the paused annotation first, then the on-call one. An expired on-call override
        is returned once more, so the decision's reason says the policy resumed, and then forgotten."""
        if self.record.paused:
            return Override(kind="pause", replicas=self.record.paused_replicas, expires_at=None, by="annotation")
        o = self.override
        if o is not None and o.expires_at is not None and now >= o.expires_at:
            log.info("%s: override %s by %s expired; the policy resumes", self.model, o.kind, o.by)
            self.override = None
        return o

    def decide(self, now: float, *, ready: int) -> Evaluation:
        """Run the policy on what is known at `now`, with `ready` replicas serving."""
        self._decided_at = now
        self.due_at = None
        sample_at, self._sample_at = self._sample_at, None
        seen = self.demand.observe(now)
        top = max((g.queue_depth + g.inflight for g in self.demand.gateways.values()), default=0)
        record = self.record
        obs = policy.Observation(
            demand=seen.demand,
            ready=ready,
            lead_time_s=self.lead_time_s(),
            override=self.active_override(now),
            paused_scale_in=record.paused_scale_in,
            paused_scale_out=record.paused_scale_out,
            created_at=record.created_at,
            queued=seen.queued,
            arrival_rate=seen.arrival_rate,
            completion_rate=seen.completion_rate,
            scheduled_floor=schedules.floor_at(self.windows, now),
        )
        before = self.state.desired
        decision, self.state = policy.decide(self.policy_spec, obs, self.state, now)
        self._demand_seen, self._current_at = obs.demand, now
        self._rates_seen = (obs.queued, obs.arrival_rate, obs.completion_rate)
        # What `settled` compares; none after a decision with an override in it (its reason names the override,
        # and the next one, without it, will not).
        self._decided_with = (ready, obs.lead_time_s, record, self._rates_seen) if obs.override is None else None
        if decision.desired != before:
            self.last_scale_at = now
        # `urgent`'s bar: the largest single-gateway demand decided on since the target last fell, which the target
        # was sized for (a fall sizes it for less: the bar starts over). The last decision's alone made every other
        # sample of a gateway whose queue wanders urgent: `bench ingest` with demands of 0-8 took 14.8 us of CPU a
        # sample, 9.8 us with this bar.
        fell = self.decision is not None and decision.desired < self.decision.desired
        self._decided_demand = top if fell else max(self._decided_demand, top)
        previous, self.decision = self.decision, decision
        changed = previous is None or previous.desired != decision.desired or previous.mode != decision.mode
        if changed:
            self.history.append(DecisionRow(ts=now, desired=decision.desired, reason=decision.reason))
        return Evaluation(decision, changed, seen.demand, sample_at, arrival_rate=obs.arrival_rate)

    # --- status --------------------------------------------------------------------------------------------------

    def paused(self, now: float) -> bool:
        """Paused as KEDA's ``Paused`` condition means it: the ``paused``/``paused-replicas`` annotation, or an
        on-call ``pause`` in force. The one-way pauses (``paused-scale-in``/``-out``) are not: the ScaledObject still
        scales the other way (its mode and reason say when one holds the count)."""
        o = self.override
        live = o is not None and o.kind == "pause" and (o.expires_at is None or now < o.expires_at)
        return self.record.paused or live

    def status_row(
        self, *, ready: int, activating: int, warm: int, stale: int, cold_requested: int = 0, now: float | None = None
    ) -> StatusRow:
        """The model's row in `pulsescale status` (and the operator's status subresource); the slot counts and the
        cold path's ask come from the act side and the registry. `now` judges an on-call pause's expiry (default:
        the last decision's time)."""
        d = self.decision
        when = now if now is not None else self._decided_at
        ws = self.windows
        return StatusRow(
            model=self.model,
            scaler=self.record.key,
            desired=self.desired(ready + activating),
            ready=ready,
            activating=activating,
            warm=warm,
            stale=stale,
            panic=bool(d and d.panic),
            mode=d.mode if d else "starting",
            override=self.override,
            reason=d.reason if d else "",
            decisions=list(self.history),
            key=self.record.key,
            fallback=bool(d and d.mode == "fallback"),
            paused=self.paused(when),
            cold_requested=cold_requested,
            last_active_at=self.state.last_active_at,
            last_scale_at=self.last_scale_at,
            scheduled_floor=schedules.floor_at(ws, when),
            schedules=schedules.status_rows(ws, when),
            pool_floor=schedules.pool_floor(ws, when),
        )
