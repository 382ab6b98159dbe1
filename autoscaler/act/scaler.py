"""The act side of one model's control loop: the book of held slots, and the moves that make it match the target.

`ModelScaler` keeps the book of the slots this leader holds for one model (`Held`: a fenced `Claim` and its
phase, ``activating`` / ``ready`` / ``releasing``) and, whenever it is woken, moves the pool towards the target
its `Target` (the decider) sets:

- **bring-up**: claim the best warm slot (`KvSlotStore.claim`), `activate` it through the `AgentClient`; on a
  failure release the claim and claim the next while still needed. An empty pool asks the cold path once and is
  then a state (`exhausted`), not a busy loop, until a slot turns warm or the next housekeeping tick.
- **take-down**: the newest slot on the most loaded node is told to `deactivate`, then its claim is released.
- **adoption**: a new leader (or the sweep for orphans) books held slots nobody here tracks, and finishes the
  activations its predecessor left at `claimed`.
- **slot changes** from the registry watch: losses (the agent failed it, a drain, a newer claim), and adopted
  activations that their agent finished.
- **housekeeping**: failed releases retried, slots of dead agents replaced (judged by `KvSlotStore.lease_lapsed`,
  so never from a view an outage left stale), adopted activations that never finished given back.

`ModelScaler` decides when and how many — the reconcile loop, a bring-up's retries, the cold path, leadership,
adoption, slot changes and housekeeping — and composes the rest: the book is a `SlotBook` (`autoscaler.act.book`);
one slot's claim, activation and release, and what the agent's refusal codes mean for a claim whose activation
failed, are `SlotActions` (`autoscaler.act.slotactions`); the model's events go out through `Events`
(`autoscaler.act.events`). Only the leader acts; nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import nats.errors

from autoscaler.act.agentclient import AgentClient
from autoscaler.act.book import ClaimsInFlight, Held, Phase, SlotBook, Unbooked
from autoscaler.act.events import Events
from autoscaler.act.slotactions import SlotActions, ready_under
from autoscaler.metrics import AutoscalerMetrics
from warmpool.errors import ClaimConflict, NoSlotAvailable, PulsescaleError
from warmpool.protocol import ScalerRecord, SlotRecord
from warmpool.registry import Claim, KvSlotStore

__all__ = ["ClaimsInFlight", "ColdPath", "Events", "Held", "LocalColdPath", "ModelScaler", "ScalerSettings", "Target"]

log = logging.getLogger("pulsescale.scaler")


@dataclass(frozen=True)
class ScalerSettings:
    activation_deadline_s: float = 2.5
    """Claim -> ready budget for one slot (DESIGN: 2.5 s for a 100 GB model); past it the claim is released."""
    deactivate_timeout_s: float = 2.0
    """How long a scale-down waits for the agent before releasing the claim itself."""
    max_claims_in_flight: int = 32
    """Bring-ups (claiming or activating) one model may have at once. Work per model stays bounded whatever its
    target says (a ScaledObject asking for 100000 replicas costs 32 tasks, not 100000); a bigger step waits for
    activations to finish, each within `activation_deadline_s`, so 100 replicas still take only ~4 deadlines."""


class ColdPath(Protocol):
    """Capacity that is not in the warm pool (the Kubernetes actuator, kube/coldpath.py, patches the target's
    scale subresource). `replicas` is how many replicas the warm pool could not provide right now, beyond those
    serving or activating. The replicas the target already runs count towards them: the actuator raises the
    target to `replicas` when it runs fewer (a Deployment already at 3 covers a request for 1), never by them."""

    async def scale(self, record: ScalerRecord, replicas: int, reason: str) -> None: ...


class LocalColdPath:
    """Without Kubernetes: remember what would have been asked for (the event says so too)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, int, str]] = []

    async def scale(self, record: ScalerRecord, replicas: int, reason: str) -> None:
        self.requests.append((record.spec.model, replicas, reason))


class Target(Protocol):
    """What the act side reads from the decide side (`autoscaler.decide.decider.ModelDecider` is one)."""

    @property
    def record(self) -> ScalerRecord: ...

    @property
    def reason(self) -> str:
        """Why the target is what it is (for take-down reasons)."""
        ...

    def desired(self, held: int) -> int:
        """The target count; `held` (serving + activating) when there is no decision yet."""
        ...

    def add_lead_time(self, seconds: float) -> None:
        """A measured claim -> ready time."""
        ...


@dataclass
class _Trigger:
    """The scale-up decision a bring-up serves: its first claim written ends `pulsescale_decision_seconds`."""

    sample_at: float
    observed: bool = False


class ModelScaler:
    """The act side of one model; see the module docstring."""

    def __init__(
        self,
        target: Target,
        *,
        store: KvSlotStore,
        agents: AgentClient,
        events: Events,
        metrics: AutoscalerMetrics,
        cold_path: ColdPath,
        owns: Callable[[], bool],
        settings: ScalerSettings = ScalerSettings(),
        clock: Callable[[], float] = time.time,
        claims: ClaimsInFlight | None = None,
    ) -> None:
        self.target = target
        self.store = store
        self.agents = agents
        self.events = events
        self.metrics = metrics
        self.series = metrics.model(self.model)
        """The model's label children, looked up once (a sample or a decision costs no `labels()` lookup)."""
        self.cold_path = cold_path
        self.owns = owns
        self.settings = settings
        self.clock = clock
        self.claims = claims if claims is not None else ClaimsInFlight()
        self.book = SlotBook(self.claims)
        """The slots held for the model and the bring-ups on their way to it (`scaler_book.SlotBook`)."""
        self.actions = SlotActions(
            self.model,
            self.book,
            store=store,
            agents=agents,
            events=events,
            metrics=metrics,
            series=self.series,
            clock=clock,
            add_lead_time=target.add_lead_time,
            spawn=self._spawn,
            activation_deadline_s=settings.activation_deadline_s,
            deactivate_timeout_s=settings.deactivate_timeout_s,
        )
        """One slot's claim, activation and release (`scaler_slots.SlotActions`)."""
        self.exhausted = False
        """A claim found the pool empty: no new bring-ups until a slot turns warm again or housekeeping looks."""
        self.cold_requested = 0  # what the cold path was last asked for, so a repeat is not news
        self._stopping = False
        self._trigger: _Trigger | None = None  # the scale-up decision the next reconcile serves
        self._capped = False  # the last reconcile held bring-ups back at max_claims_in_flight (logged once)
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None

    @property
    def model(self) -> str:
        return self.target.record.spec.model

    @property
    def held(self) -> dict[str, Held]:
        """The book's slots, by key (`SlotBook.held`)."""
        return self.book.held

    @property
    def claiming(self) -> int:
        """Bring-ups between their start and their claim landing in `held` (`SlotBook.claiming`)."""
        return self.book.claiming

    @property
    def ready(self) -> int:
        return self.book.ready

    @property
    def activating(self) -> int:
        return self.book.activating

    @property
    def desired(self) -> int:
        return self.target.desired(self.ready + self.activating)

    # --- the reconcile loop ---------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._reconcile_loop(), name=f"reconcile-{self.model}")
            self._wake.set()

    def wake(self, sample_at: float | None = None) -> None:
        """Reconcile soon. `sample_at`: the receive time of the sample behind a new target, measured to the first
        claim the next reconcile writes for it (`pulsescale_decision_seconds`); dropped when that reconcile needs
        no claim or the pool is empty. While one is pending, the earliest stands."""
        if sample_at is not None and self._trigger is None:
            self._trigger = _Trigger(sample_at)
        if sample_at is not None and self._loop_task is not None and not self._stopping and self.owns():
            # A sample's new target: the claim starts now, not a loop iteration later behind other work. A failure
            # here must not reach the decision's caller; the loop below reconciles again.
            try:
                self.reconcile_once()
            except Exception:
                log.exception("%s: reconcile on a new target failed; the reconcile loop retries", self.model)
        self._wake.set()

    async def _reconcile_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.owns():
                self.reconcile_once()

    def reconcile_once(self) -> None:
        desired = self.desired
        current = self.ready + self.activating
        trigger, self._trigger = self._trigger, None
        series = self.series
        series.ready.set(self.ready)
        series.activating.set(self.activating)
        if desired > current and not self.exhausted and not self._stopping:
            for _ in range(self._bring_ups_to_start(desired - current)):
                self.book.claiming += 1
                self._spawn(self._bring_up(trigger), f"bring-up-{self.model}")
        elif desired < current:
            # Only serving slots can be taken down now; activating ones count and are handled when ready.
            for h in self.book.pick_victims(current - desired):
                h.phase = "releasing"
                self._spawn(self._take_down(h), f"take-down-{self.model}")
        if desired <= current:
            self.cold_requested = 0  # met from the pool again: a later shortfall is news worth an event

    def _bring_ups_to_start(self, missing: int) -> int:
        """How many of `missing` replicas to start bringing up now: no more than the pool has claimable slots for
        (less those our bring-ups not yet booked are about to take) and than `max_claims_in_flight` allows. What
        the pool cannot cover is the cold path's, asked once (`exhausted`) until a slot turns warm or housekeeping
        looks again — never one failing claim per missing replica, every tick."""
        free = len(self.store.claimable(self.model)) - self.claiming
        cap = self.settings.max_claims_in_flight
        n = max(0, min(missing, free, cap - self.activating))
        if free < missing:
            self.exhausted = True
            self._spawn(self._cold_start(missing - max(0, free)), f"cold-start-{self.model}")
        capped = n < missing and self.activating + n >= cap
        if capped and not self._capped:
            log.info("%s: %d replica(s) missing; bringing up at most %d at once (max_claims_in_flight), the rest as "
                     "those finish", self.model, missing, cap)  # fmt: skip
        self._capped = capped
        return n

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- bring-up -----------------------------------------------------------------------------------------------

    async def _bring_up(self, trigger: _Trigger | None) -> None:
        """Claim a slot and activate it; on failure claim the next, while still needed."""
        tried: set[str] = set()
        unbooked = Unbooked()  # counted in `claiming` until its claim is in `held`
        try:
            while self.owns() and not self._stopping:
                try:
                    held = await self.actions.claim(tried, unbooked)
                except NoSlotAvailable:
                    self.exhausted = True
                    await self._cold_start()
                    return
                except ClaimConflict:
                    await asyncio.sleep(0.01)
                    continue
                except (PulsescaleError, nats.errors.Error, TimeoutError) as err:
                    log.warning("%s: claim failed: %s", self.model, err)
                    await asyncio.sleep(0.1)  # the broker is away or unhappy: do not spin
                    continue
                claim = held.claim
                if trigger is not None and not trigger.observed:
                    trigger.observed = True
                    self.metrics.decision_seconds.observe(max(0.0, held.since - trigger.sample_at))
                self.events.publish("slot.claimed", node=claim.node, slot=claim.slot, token=claim.token)
                if await self.actions.activate(held, measured=True):
                    return
                tried.add(claim.key)
                if self.ready + self.activating >= self.desired:
                    return  # no longer needed
                self.book.claiming += 1
                unbooked.counted = True
        finally:
            if unbooked.counted:
                self.book.claiming -= 1
            self._wake.set()

    async def _cold_start(self, needed: int | None = None) -> None:
        """Ask the cold path for `needed` replicas; by default the capacity not already serving or activating in
        a held slot (from a failed claim: the bring-ups still claiming are failing like it)."""
        if needed is None:
            in_held = sum(1 for h in self.held.values() if h.phase == "activating")
            needed = max(0, self.desired - self.ready - in_held)
        if needed and needed != self.cold_requested:
            reason = f"no warm slot of {self.model} is claimable; asking the cold path for {needed} more"
            log.warning("%s: %s", self.model, reason)
            self.series.cold_starts.inc()
            self.events.publish("pool.exhausted", reason=reason, desired=self.desired, ready=self.ready)
            self.events.publish("cold.start", reason=reason, desired=needed)
            try:
                await self.cold_path.scale(self.target.record, needed, reason)
            except Exception as err:  # noqa: BLE001 - any actuator failure: say so, ask again next time
                log.error("%s: the cold path failed: %s", self.model, err)
                return
            self.cold_requested = needed

    # --- take-down --------------------------------------------------------------------------------------------

    async def _take_down(self, held: Held) -> None:
        await self.actions.release(held, reason=f"scale down: {self.target.reason or 'scale down'}")
        self._wake.set()

    # --- leadership -------------------------------------------------------------------------------------------

    async def stop(self, *, release_in_flight: bool = True) -> None:
        """Stop acting. Slots still activating are released (nobody would finish them); serving slots stay
        serving — the next leader adopts them."""
        self._stopping = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.events.close()
        if release_in_flight:
            for key, h in list(self.held.items()):
                if h.phase != "ready":
                    with contextlib.suppress(PulsescaleError, nats.errors.Error, TimeoutError):
                        await self.store.release(h.claim, reason="autoscaler stopped mid-activation")
                    self.held.pop(key, None)
        self._stopping = False

    async def release_all(self, reason: str) -> int:
        """The ScaledObject was deleted: stop acting and give back every slot of the model that is held — ours,
        and a predecessor's we had not adopted yet — each told to `deactivate` first, then released, fenced. The
        operator's finalizer waits for the model's slots to be free. Returns how many were released; one the
        broker would not release stays held (logged) and the sweep for orphans of a deleted model finds it."""
        await self.stop(release_in_flight=True)
        now = self.clock()
        for rec in self.store.records(self.model):
            if rec.key in self.held or rec.state not in ("claimed", "activating", "ready"):
                continue
            claim = self.store.adopt(rec.key)  # booked to be released, never activated (`adopt` would finish it)
            if claim is not None:
                self.held[rec.key] = Held(claim, "ready" if rec.state == "ready" else "activating", now)
        victims = list(self.held.values())
        await asyncio.gather(*(self.actions.release(h, reason=reason) for h in victims), return_exceptions=True)
        released = sum(1 for h in victims if self.held.get(h.claim.key) is not h)
        left = len(victims) - released
        if left:
            log.warning("%s: %d slot(s) could not be released after the ScaledObject was deleted", self.model, left)
        return released

    def forget_claims(self) -> None:
        """After losing the lease: the books are the next leader's now. If we lead again, `adopt` re-reads
        them from the registry, which is the truth; what we remembered may be stale by then."""
        self.book.forget()
        self.exhausted = False
        self._trigger = None

    def adopt(self, records: list[SlotRecord]) -> int:
        """Book the held slots of `records` that nobody here tracks (a predecessor's claims); finish the
        activations it left at `claimed`. Returns the size of the book."""
        now = self.clock()
        for rec in records:
            if rec.key in self.held:
                continue
            claim = self.store.adopt(rec.key)
            if claim is None:
                continue
            phase: Phase = "ready" if rec.state == "ready" else "activating"
            # Since when, on our clock: how long we have seen the record stand (its `updated_at` may be the
            # agent's clock, minutes off; a record first seen in a listing is as new as the listing).
            held = Held(claim, phase, now - self.store.index.unchanged_s(rec.key))
            self.held[rec.key] = held
            if rec.state == "claimed":
                # The previous leader died between its claim and its `activate`: finish what it started.
                self._spawn(self._resume(held), f"resume-{rec.key}")
        return len(self.held)

    async def _resume(self, held: Held) -> None:
        if self.owns():
            await self.actions.activate(held, measured=False)
            self._wake.set()

    # --- registry changes and time -------------------------------------------------------------------------------

    def on_slot_change(self, key: str, rec: SlotRecord | None) -> None:
        """The registry moved one of our slots; notice losses (agent failed it, a drain, a zombie fence)."""
        held = self.held.get(key)
        if held is None:
            if rec is not None and rec.state == "warm" and not rec.drain and self.exhausted:
                self.exhausted = False  # the pool has a slot again
                self._wake.set()
            return
        if held.phase == "releasing":
            return
        if rec is None or rec.claim_id != held.claim.claim_id or rec.state in ("failed", "warm", "draining"):
            why = "removed" if rec is None else f"now {rec.state}" + (f" ({rec.reason})" if rec.reason else "")
            log.warning("%s: lost slot %s: %s", self.model, key, why)
            if held.phase == "ready":
                self.held.pop(key, None)
                self._wake.set()
        elif rec.state in ("activating", "ready"):
            if held.phase == "activating" and key not in self.book.activating_here and ready_under(rec, held.claim):
                held.phase = "ready"  # an adopted activation that its agent finished
                self.events.publish("slot.ready", node=held.claim.node, slot=held.claim.slot, endpoint=rec.endpoint)
                self._wake.set()
            hit = self.store.entry(key)
            held.claim = Claim(
                key=key,
                token=held.claim.token,
                claim_id=held.claim.claim_id,
                revision=hit[1] if hit is not None else held.claim.revision,
                record=rec,
            )

    async def housekeeping(self, now: float) -> None:
        """Time-driven checks no sample triggers: late adoptions, failed releases, dead agents, stuck activations."""
        if not self.owns():
            return
        deadline_s = self.settings.activation_deadline_s
        was_exhausted, self.exhausted = self.exhausted, False  # look at the pool again, at most once per tick
        # Held slots of this model that nobody here tracks (a predecessor's claim that outlived its activation,
        # books lost to a bug): adopt them, so they count and a scale-down can give them back.
        orphans = [
            r
            for r in self.store.records(self.model)
            if r.key not in self.held
            and r.state in ("claimed", "activating", "ready")
            and self.store.index.unchanged_s(r.key) > 2 * deadline_s  # on our clock: the agent's may be off
            # A slot of a model its node may not offer is never adopted (`Claimer.adopt`; the index counted it
            # `unassigned_model`): asking again every tick only logged "adopting" forever.
            and self.store.index.assignments.allows(r.model, r.node)
        ]
        if orphans:
            log.warning("%s: adopting %d slot(s) held by no one here: %s", self.model, len(orphans),
                        ", ".join(r.key for r in orphans))  # fmt: skip
            self.adopt(orphans)
        for key, h in list(self.held.items()):
            if h.phase == "releasing" and h.release_failed and key not in self.book.releasing_here:
                h.release_failed = False
                self._spawn(self.actions.release(h, reason="retrying a failed release"), f"release-{key}")
                continue
            # Judged only on a current view of the agents, once they had a heartbeat interval to renew: right
            # after an outage (a reconnect, a takeover) every lease looks old, and the slots are still serving.
            if h.phase == "ready" and self.store.index.lease_lapsed(h.claim.node, now):
                log.warning("%s: agent of %s stopped heartbeating; replacing the slot", self.model, key)
                h.phase = "releasing"
                self._spawn(self.actions.release(h, reason="agent lease expired"), f"release-{key}")
            elif h.phase == "activating" and key not in self.book.activating_here and now - h.since > deadline_s + 0.5:
                # An adopted activation that its agent did not finish within the deadline: give it back.
                rec = self.store.record(key)
                if rec is None or rec.state != "ready":
                    h.phase = "releasing"
                    self._spawn(self.actions.release(h, reason="activation never finished"), f"release-{key}")
                else:
                    h.phase = "ready"
        ready, activating = self.ready, self.activating
        self.series.ready.set(ready)
        self.series.activating.set(activating)
        # Wake the reconcile only when there is something to match: with 1,000 models, waking every one each tick
        # queued 1,000 task steps ahead of the next pulse's sample.
        if was_exhausted or self.desired != ready + activating or orphans:
            self._wake.set()
