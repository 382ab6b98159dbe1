"""Per-model control: one `ModelDecider` (decide side) and one `ModelScaler` (act side), joined.

Knative's decider/scaler seam. `ModelController.on_sample` hands a gateway sample to the decider, which folds it
into the model's demand and asks for a decision (at once for rising demand, else after the debounce); the
controller owns the one timer that fires a deferred decision, runs it (`evaluate`), publishes the
``scale.decision`` event and the decision gauges, and — on the leader only — wakes the scaler, which claims,
activates, releases and falls back to the cold path to match the target. Everything registry- and time-driven
(slot changes, housekeeping, adoption at takeover) is passed through to the side it belongs to.

The on-call `ControlPlane` (`autoscaler.daemon.Autoscaler`) reads `status_row` and sets `override` and the on-call
schedules here. A second timer fires at the next start or end of a schedule (`ModelDecider.next_boundary`), so a
scheduled floor begins and ends on time with no sample at all (capped at `BOUNDARY_TIMER_MAX_S`, then re-armed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from nats.aio.client import Client

from autoscaler.act.agentclient import AgentClient
from autoscaler.act.scaler import ClaimsInFlight, ColdPath, Events, LocalColdPath, ModelScaler, ScalerSettings
from autoscaler.decide import policy
from autoscaler.decide.decider import DeciderSettings, ModelDecider
from autoscaler.decide.ingest import Accepted
from autoscaler.metrics import AutoscalerMetrics
from warmpool import protocol
from warmpool.protocol import OnCallSchedule, Override, QueueSample, ScalerRecord, SlotRecord, StatusRow
from warmpool.registry import KvSlotStore

__all__ = ["ColdPath", "ControllerSettings", "Deps", "LocalColdPath", "ModelController"]

log = logging.getLogger("pulsescale.controller")

BOUNDARY_TIMER_MAX_S: Final = 3600.0
"""The longest the schedule-boundary timer is set for: the loop's clock is monotonic, the schedules' wall time, so a
boundary days away is re-aimed hourly (one extra decision an hour) instead of drifting with the wall clock."""


@dataclass(frozen=True)
class ControllerSettings:
    debounce_s: float = 0.05
    """At most one decision per model per this many seconds: a burst of samples is one decision, not many."""
    activation_deadline_s: float = 2.5
    """Claim -> ready budget for one slot (DESIGN: 2.5 s for a 100 GB model); past it the claim is released."""
    deactivate_timeout_s: float = 2.0
    """How long a scale-down waits for the agent before releasing the claim itself."""
    max_claims_in_flight: int = ScalerSettings.max_claims_in_flight
    """Bring-ups one model may have in flight at once (`ScalerSettings.max_claims_in_flight` says why)."""
    lead_time_samples: int = 50
    """Recent claim -> ready durations kept for the lead-time p90 the forecast uses."""
    decisions_kept: int = 20
    """Decisions kept per model for `pulsescale status` (the reasons are what on-call reads)."""

    @property
    def decider(self) -> DeciderSettings:
        return DeciderSettings(self.debounce_s, self.lead_time_samples, self.decisions_kept)

    @property
    def scaler(self) -> ScalerSettings:
        return ScalerSettings(self.activation_deadline_s, self.deactivate_timeout_s, self.max_claims_in_flight)


@dataclass
class Deps:
    nc: Client
    store: KvSlotStore
    metrics: AutoscalerMetrics
    cold_path: ColdPath
    owns: Callable[[], bool]
    """This replica owns the model's shard now, so it acts for the model (the glossary's *owner*)."""
    settings: ControllerSettings = field(default_factory=ControllerSettings)
    clock: Callable[[], float] = time.time
    claims: ClaimsInFlight = field(default_factory=ClaimsInFlight)
    """The process's claims in flight, over every model (`scaler_book.ClaimsInFlight`)."""


class ModelController:
    def __init__(self, record: ScalerRecord, deps: Deps, *, current_replicas: int = 0) -> None:
        self.deps = deps
        self.decider = ModelDecider(record, deps.settings.decider, now=deps.clock(), current_replicas=current_replicas)
        self.events = Events(deps.nc, record.spec.model, deps.clock)
        self.scaler = ModelScaler(
            self.decider,
            store=deps.store,
            agents=AgentClient(deps.nc, clock=deps.clock, skew=deps.store.index.clock_skew),
            events=self.events,
            metrics=deps.metrics,
            cold_path=deps.cold_path,
            owns=deps.owns,
            settings=deps.settings.scaler,
            clock=deps.clock,
            claims=deps.claims,
        )
        self._timer: asyncio.TimerHandle | None = None
        self._boundary_timer: asyncio.TimerHandle | None = None
        self._boundary_at: float | None = None  # the schedule boundary `_boundary_timer` is aimed at

    @property
    def model(self) -> str:
        return self.decider.model

    @property
    def record(self) -> ScalerRecord:
        return self.decider.record

    @property
    def spec(self) -> protocol.ScaledObjectSpec:
        return self.decider.spec

    @property
    def override(self) -> Override | None:
        return self.decider.override

    def update_record(self, record: ScalerRecord) -> None:
        now = self.deps.clock()
        self.decider.update_record(record, now)
        self._run_due(now)

    # --- decisions ------------------------------------------------------------------------------------------------

    def urgent(self, sample: QueueSample) -> bool:
        """`on_sample` would decide on `sample` at once (`ModelDecider.urgent`): the intake folds it in as it is
        taken, not behind the buffer."""
        return self.decider.urgent(sample)

    def on_sample(self, sample: QueueSample, now: float) -> Accepted:
        outcome = self.decider.on_sample(sample, now)
        self._run_due(now)
        return outcome

    def _run_due(self, now: float) -> None:
        """Decide now if a decision is due, else make sure the timer fires when it is."""
        at = self.decider.due_at
        if at is None:
            return
        if at <= now:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.evaluate(now)
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(at - now, self._timer_fired)

    def _timer_fired(self) -> None:
        self._timer = None
        self.evaluate(self.deps.clock())

    def decided_since(self, at: float) -> bool:
        """A decision was taken at or after `at` (by the controller's clock)."""
        return self.decider.decision is not None and self.decider.decided_at >= at

    def evaluate(self, now: float) -> policy.Decision:
        """Decide on what is known now; publish a changed target and hand it to the scaler (leader only)."""
        ev = self.decider.decide(now, ready=self.scaler.ready)
        d, series, model = ev.decision, self.scaler.series, self.model
        series.desired.set(d.desired)
        series.panic.set(1 if d.panic else 0)
        series.demand.set(ev.demand or 0)
        series.arrival_rate.set(ev.arrival_rate or 0)
        if ev.changed:
            log.info("%s: desired %d (%s)", model, d.desired, d.reason)
            self.events.publish(
                "scale.decision",
                reason=d.reason,
                desired=d.desired,
                ready=self.scaler.ready,
                activating=self.scaler.activating,
            )
        if self.deps.owns():
            # A new target that a sample caused starts `pulsescale_decision_seconds`; its first claim ends it.
            self.scaler.wake(ev.sample_at if ev.changed else None)
        self._arm_boundary(now)
        return d

    def _arm_boundary(self, now: float) -> None:
        """Aim the boundary timer at the next schedule start or end (unchanged: left as it is)."""
        at = self.decider.next_boundary(now) if self.deps.owns() else None
        if at == self._boundary_at and (at is None or self._boundary_timer is not None):
            return
        self._cancel_boundary()
        if at is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # decided outside a loop (a test): housekeeping's `settled` still sees the boundary
            return
        self._boundary_at = at
        self._boundary_timer = loop.call_later(min(max(at - now, 0.0), BOUNDARY_TIMER_MAX_S), self._boundary_fired)

    def _cancel_boundary(self) -> None:
        if self._boundary_timer is not None:
            self._boundary_timer.cancel()
        self._boundary_timer = None
        self._boundary_at = None

    def _boundary_fired(self) -> None:
        self._boundary_timer = None
        self._boundary_at = None
        if not self.deps.owns():
            return  # the shard moved on: its new owner decides
        now = self.deps.clock()
        self.decider.request(now)
        self._run_due(now)

    def set_schedules(self, oncall: tuple[OnCallSchedule, ...]) -> policy.Decision:
        """Install the on-call schedules and decide at once."""
        now = self.deps.clock()
        self.decider.set_schedules(oncall, now)
        return self.evaluate(now)

    def set_override(self, override: Override | None) -> policy.Decision:
        """Install (or, with None, drop) the on-call override and decide at once."""
        self.decider.override = override
        return self.evaluate(self.deps.clock())

    # --- acting (leader only) -----------------------------------------------------------------------------------

    def take_over(
        self,
        records: list[SlotRecord],
        *,
        override: Override | None = None,
        schedules: tuple[OnCallSchedule, ...] | None = None,
    ) -> None:
        """This replica took the model's shard: book the held slots of `records` (a predecessor's claims, see
        `ModelScaler.adopt`), put back its stored on-call `override` and `schedules` (None: left as they are),
        and start acting. No decision yet: `Ownership.take_over` decides once every model taken has started."""
        self.scaler.adopt(records)
        if override is not None:
            self.decider.override = override
        if schedules is not None:
            self.decider.set_schedules(schedules, self.deps.clock())
        self.scaler.start()

    async def stop(self, *, release_in_flight: bool = True) -> None:
        """Stop deciding on a timer and stop acting (see `ModelScaler.stop`). Without `release_in_flight` (the
        shard was lost) the claims in flight are left for the next owner, and forgotten here once stopped (see
        `ModelScaler.forget_claims`), however the stop ends."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._cancel_boundary()
        try:
            await self.scaler.stop(release_in_flight=release_in_flight)
        finally:
            if not release_in_flight:
                self.scaler.forget_claims()

    async def retire(self, reason: str) -> int:
        """The ScaledObject was deleted: stop, and (leader only) release every slot the model holds."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._cancel_boundary()
        if not self.deps.owns():
            await self.scaler.stop(release_in_flight=False)  # the leader releases them
            return 0
        return await self.scaler.release_all(reason)

    def on_slot_change(self, key: str, rec: SlotRecord | None) -> None:
        self.scaler.on_slot_change(key, rec)

    def on_slot_snapshot(self, records: dict[str, SlotRecord]) -> None:
        """A fresh listing of every slot (after a reconnect): check each slot in the book against it."""
        for key in list(self.scaler.held):
            self.scaler.on_slot_change(key, records.get(key))

    async def housekeeping(self, now: float, *, decide: bool = True, forget_after_s: float | None = None) -> bool:
        """Time-driven work no sample triggers: when `decide` (the model's turn), gateways silent for
        `forget_after_s` (long gone) dropped so the table does not grow forever, and a decision (override expiry,
        stale gateways, the windows moving on) unless `ModelDecider.settled` says it would repeat the last one; then
        the scaler's (every tick while it holds slots, else on its turn). Returns whether it decided."""
        turn = decide
        if decide and forget_after_s is not None and self.decider.demand.forget_stale(now, forget_after_s):
            self.decider.touch(now)
        if decide:
            decide = not self.decider.settled(now, ready=self.scaler.ready)
            if decide:
                self.decider.request(now)
                self._run_due(now)
            else:
                self.decider.skip(now)
        if self.housekeeping_due(turn):
            await self.scaler.housekeeping(now)
        return decide

    def housekeeping_due(self, turn: bool) -> bool:
        """Housekeeping has anything to do for this model: on its `turn`, else only while it holds slots (a dead
        agent's slot is replaced at once) or found its pool empty; the orphan check waits for its turn."""
        return turn or bool(self.scaler.held) or self.scaler.exhausted

    # --- status ------------------------------------------------------------------------------------------------

    def status_row(self, now: float | None = None) -> StatusRow:
        """The model's row in `pulsescale status`. `warm` counts the slots a claim could take now; `stale` the
        ones that read `warm` but whose agent's lease has lapsed."""
        now = self.deps.clock() if now is None else now
        store = self.deps.store
        idle = sum(1 for r in store.records(self.model) if r.state == "warm" and not r.drain)
        warm = len(store.claimable(self.model, now))
        return self.decider.status_row(
            ready=self.scaler.ready,
            activating=self.scaler.activating,
            warm=warm,
            stale=idle - warm,
            cold_requested=self.scaler.cold_requested,
            now=now,
        )
