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

The agent's refusal codes decide what happens to a claim whose activation failed: `stale_token` and
`foreign_claim` mean a newer claim holds the slot, so ours is dropped from the book without a release; any other
failure (`deadline`, `engine_failed`, `not_ready`, `slot_unavailable`, no answer at all, ...) releases the claim,
fenced, and claims the next slot. Only the leader acts; nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

import nats.errors
from nats.aio.client import Client

from autoscaler.agentclient import AgentClient, AgentUnavailable
from autoscaler.metrics import AutoscalerMetrics
from warmpool import protocol
from warmpool.errors import ClaimConflict, NoSlotAvailable, PulsescaleError, StaleToken
from warmpool.protocol import ActivateReply, EventType, ScalerRecord, SlotRecord
from warmpool.registry import Claim, KvSlotStore

__all__ = ["ColdPath", "Events", "Held", "LocalColdPath", "ModelScaler", "ScalerSettings", "Target"]

log = logging.getLogger("pulsescale.scaler")

CLAIM_GONE: Final = frozenset({"stale_token", "foreign_claim"})
"""Refusal codes that say a newer claim holds the slot: ours holds nothing, so it is dropped, not released."""

_STAGES: Final = ("token", "load", "engine", "readiness", "total")
"""Stages of `protocol.StageTimings`, observed as the agent reported them."""


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
    """Capacity that is not in the warm pool (the Kubernetes actuator, with its issue, patches the target's
    scale subresource). `replicas` is how many replicas the warm pool could not provide right now, beyond those
    serving or activating — not a total; the actuator adds it to what it already runs."""

    async def scale(self, record: ScalerRecord, replicas: int, reason: str) -> None: ...


class LocalColdPath:
    """Without Kubernetes: remember what would have been asked for (the event says so too)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, int, str]] = []

    async def scale(self, record: ScalerRecord, replicas: int, reason: str) -> None:
        self.requests.append((record.spec.model, replicas, reason))


class Target(Protocol):
    """What the act side reads from the decide side (`autoscaler.decider.ModelDecider` is one)."""

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


class Events:
    """Publishes `protocol.Event`s on ``pulse.events.<model>`` without awaiting the broker; `close()` cancels
    what is still in flight."""

    def __init__(self, nc: Client, model: str, clock: Callable[[], float]) -> None:
        self.nc = nc
        self.model = model
        self.subject = protocol.events_subject(model)
        self.clock = clock
        self._tasks: set[asyncio.Future[None]] = set()

    def publish(self, type_: EventType, **fields: Any) -> None:
        event = protocol.Event(type=type_, model=self.model, ts=self.clock(), **fields)
        task = asyncio.ensure_future(self.nc.publish(self.subject, protocol.encode(event)))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("%s: event not published: %s", self.model, task.exception())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


Phase = Literal["activating", "ready", "releasing"]


@dataclass
class Held:
    """One slot in the book: the claim that holds it and where its bring-up or take-down is."""

    claim: Claim
    phase: Phase
    since: float
    """When the claim was written (ours), or the record's last update (adopted)."""
    release_failed: bool = False
    """The broker refused or timed out our release: housekeeping retries it."""


@dataclass
class _Unbooked:
    """A bring-up's place in `ModelScaler.claiming`: counted while it has no claim in the book."""

    counted: bool = True


class ClaimsInFlight:
    """Bring-ups of this process between their start and their claim booked, over every model: the pulse's
    path. While one started recently is, the sample drain and housekeeping stand aside (`wait_idle`), so the
    claim's few hops through the event loop do not each wait behind a slice of theirs."""

    __slots__ = ("_idle", "count", "started_at")

    def __init__(self) -> None:
        self.count = 0
        self.started_at = -math.inf  # monotonic time of the latest bring-up started
        self._idle: asyncio.Event | None = None  # made on first use: it binds to the running loop

    def add(self, n: int) -> None:
        if n > 0:
            self.started_at = time.monotonic()
        self.count += n
        if self.count == 0 and self._idle is not None:
            self._idle.set()

    def recent(self, bound_s: float) -> bool:
        """A claim is in flight and the latest started less than `bound_s` ago (one stuck retrying against an
        unhappy broker holds nothing up for longer)."""
        return self.count > 0 and time.monotonic() < self.started_at + bound_s

    async def wait_idle(self, bound_s: float) -> bool:
        """Until no claim is in flight, waiting only while one is `recent`. Returns False when it stopped at the
        bound."""
        if self.count == 0:
            return True
        if not self.recent(bound_s):
            return False
        left = self.started_at + bound_s - time.monotonic()
        if self._idle is None:
            self._idle = asyncio.Event()
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), left)
        except TimeoutError:
            return False
        return True


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
        is_leader: Callable[[], bool],
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
        self.is_leader = is_leader
        self.settings = settings
        self.clock = clock
        self.held: dict[str, Held] = {}
        self.claims = claims if claims is not None else ClaimsInFlight()
        self._claiming = 0  # bring-ups between their start and their claim landing in `held`
        self.exhausted = False
        """A claim found the pool empty: no new bring-ups until a slot turns warm again or housekeeping looks."""
        self.cold_requested = 0  # what the cold path was last asked for, so a repeat is not news
        self._activating_here: set[str] = set()  # activations this process is waiting on
        self._releasing_here: set[str] = set()  # releases in flight
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
    def claiming(self) -> int:
        """Bring-ups between their start and their claim landing in `held` (kept in `claims` too)."""
        return self._claiming

    @claiming.setter
    def claiming(self, value: int) -> None:
        self.claims.add(value - self._claiming)
        self._claiming = value

    @property
    def ready(self) -> int:
        return sum(1 for h in self.held.values() if h.phase == "ready")

    @property
    def activating(self) -> int:
        return self.claiming + sum(1 for h in self.held.values() if h.phase == "activating")

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
        if sample_at is not None and self._loop_task is not None and not self._stopping and self.is_leader():
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
            if self.is_leader():
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
                self.claiming += 1
                self._spawn(self._bring_up(trigger), f"bring-up-{self.model}")
        elif desired < current:
            # Only serving slots can be taken down now; activating ones count and are handled when ready.
            for h in self._pick_victims(current - desired):
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

    def _pick_victims(self, n: int) -> list[Held]:
        ready = [h for h in self.held.values() if h.phase == "ready"]
        per_node: dict[str, int] = {}
        for h in ready:
            per_node[h.claim.node] = per_node.get(h.claim.node, 0) + 1
        # Take from the most loaded node first, newest first: the mirror image of placement's spread.
        ready.sort(key=lambda h: (-per_node[h.claim.node], -h.since))
        return ready[:n]

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- bring-up -----------------------------------------------------------------------------------------------

    async def _bring_up(self, trigger: _Trigger | None) -> None:
        """Claim a slot and activate it; on failure claim the next, while still needed."""
        tried: set[str] = set()
        unbooked = _Unbooked()  # counted in `claiming` until its claim is in `held`
        try:
            while self.is_leader() and not self._stopping:
                try:
                    held = await self._claim(tried, unbooked)
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
                if await self._activate(held, measured=True):
                    return
                tried.add(claim.key)
                if self.ready + self.activating >= self.desired:
                    return  # no longer needed
                self.claiming += 1
                unbooked.counted = True
        finally:
            if unbooked.counted:
                self.claiming -= 1
            self._wake.set()

    async def _claim(self, tried: set[str], unbooked: _Unbooked) -> Held:
        """Claim the best slot and book it, in the step that hears the write acknowledged: until it is booked,
        an adoption would take our own claim for a predecessor's. A stop cannot cut it short either: a claim
        whose write is on its way lands whether or not we wait, so it runs as its own task and is booked (and
        released by `stop`) instead of left held by nobody."""

        async def claim_and_book() -> Held:
            claim = await self.store.claim(self.model, exclude=tried)
            held = self.held[claim.key] = Held(claim, "activating", self.clock())
            self.claiming -= 1
            unbooked.counted = False
            return held

        pending = asyncio.ensure_future(claim_and_book())
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await pending
            raise

    async def _activate(self, held: Held, *, measured: bool) -> bool:
        """Send `activate` for a held slot; True when it serves. On a failure the claim is dropped (a newer claim
        holds the slot) or released, and the failure published. `measured`: our own claim, timed from its write."""
        claim = held.claim
        key = claim.key
        self._activating_here.add(key)
        reply: ActivateReply | AgentUnavailable
        record: SlotRecord | None = None
        try:
            try:
                reply = await self.agents.activate(claim, deadline_s=self.settings.activation_deadline_s)
            except AgentUnavailable as err:
                reply = err
            if isinstance(reply, ActivateReply) and reply.ok:
                # Serving only on the holder's fenced `ready` write: a reply alone is a claim anyone on the
                # subject can make (DESIGN, "Trust boundaries"), and its endpoint is never used. Still ours to
                # finish meanwhile (`_activating_here`): the watch echo of that write is not an adoption's.
                record = await self._fenced_ready(claim)
        finally:
            self._activating_here.discard(key)
        if isinstance(reply, ActivateReply) and reply.ok:
            if record is not None:
                self._serving(held, reply, record, measured=measured)
                return True
            code, why = "not_ready", f"replied ready, but the registry holds no ready write of claim {claim.claim_id}"
        else:
            code, why = _failure(reply)
        self.series.activations_failed.inc()
        self.events.publish("slot.failed", node=claim.node, slot=claim.slot, reason=why)
        if code in CLAIM_GONE:
            log.warning("%s: activation of %s refused: %s; a newer claim holds it, claiming the next", self.model,
                        key, why)  # fmt: skip
            if self.held.get(key) is held:
                del self.held[key]
            return False
        log.warning("%s: activation of %s failed: %s; releasing it and claiming the next slot", self.model, key, why)
        await self._release(held, reason=why, wait_for_agent=False)
        return False

    def _serving(self, held: Held, reply: ActivateReply, record: SlotRecord, *, measured: bool) -> None:
        claim = held.claim
        held.phase = "ready"
        m = self.metrics
        self.series.activations_ready.inc()
        if measured:
            took = self.clock() - held.since
            self.target.add_lead_time(took)
            m.activation_seconds.labels("claim_to_ready").observe(max(0.0, took))
        if reply.timings is not None:
            for stage in _STAGES:
                m.activation_seconds.labels(stage).observe(getattr(reply.timings, f"{stage}_ms") / 1e3)
        self.events.publish(
            "slot.ready", node=claim.node, slot=claim.slot, endpoint=record.endpoint, timings=reply.timings
        )

    async def _fenced_ready(self, claim: Claim) -> SlotRecord | None:
        """The holder's fenced `ready` write of `claim`, whose endpoint is the one traffic goes to; None when the
        registry has none. The agent writes it before it replies, so the view has it but for a watch echo still
        on its way; then the broker is asked."""
        rec = self.store.record(claim.key)
        if not _ready_under(rec, claim):
            with contextlib.suppress(PulsescaleError, nats.errors.Error, TimeoutError):
                rec, _ = await self.store.get(claim.key)
        if rec is not None and _ready_under(rec, claim):
            return rec
        return None

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
        await self._release(held, reason=f"scale down: {self.target.reason or 'scale down'}")
        self._wake.set()

    async def _deactivate(self, held: Held) -> None:
        try:
            reply = await self.agents.deactivate(held.claim, timeout_s=self.settings.deactivate_timeout_s)
        except AgentUnavailable as err:
            log.info("%s: %s; releasing %s without it", self.model, err, held.claim.key)
            return
        if not reply.ok and reply.error is not None:
            log.info("%s: deactivate of %s refused (%s: %s)", self.model, held.claim.key, reply.error.code,
                     reply.error.message)  # fmt: skip

    async def _release(self, held: Held, reason: str, *, wait_for_agent: bool = True) -> None:
        """Tell the agent to stop, then give the claim back; fenced, so never someone else's.

        After a failed activation the agent is told without waiting (it may be the thing that is stuck),
        so the next slot is claimed at once; on scale-down the agent gets `deactivate_timeout_s` to finish."""
        key = held.claim.key
        held.phase = "releasing"
        self._releasing_here.add(key)
        try:
            if wait_for_agent:
                await self._deactivate(held)
            else:
                self._spawn(self._deactivate(held), f"deactivate-{key}")
            try:
                await self.store.release(held.claim, reason=reason)
            except StaleToken:
                pass  # the agent already returned the slot (or a drain took it): nothing of ours to release
            except (PulsescaleError, nats.errors.Error, TimeoutError) as err:
                # Still ours in the registry: keep it on the books and let housekeeping try again, rather
                # than forget a slot that nobody would ever give back.
                log.warning("%s: could not release %s (%s); retrying", self.model, key, err)
                held.release_failed = True
                return
            if self.held.get(key) is held:
                del self.held[key]
            self.events.publish("slot.released", node=held.claim.node, slot=held.claim.slot, reason=reason)
        finally:
            self._releasing_here.discard(key)

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
        await asyncio.gather(*(self._release(h, reason=reason) for h in victims), return_exceptions=True)
        released = sum(1 for h in victims if self.held.get(h.claim.key) is not h)
        left = len(victims) - released
        if left:
            log.warning("%s: %d slot(s) could not be released after the ScaledObject was deleted", self.model, left)
        return released

    def forget_claims(self) -> None:
        """After losing the lease: the books are the next leader's now. If we lead again, `adopt` re-reads
        them from the registry, which is the truth; what we remembered may be stale by then."""
        self.held.clear()
        self.claiming = 0
        self._activating_here.clear()
        self._releasing_here.clear()
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
            held = Held(claim, phase, rec.updated_at or now)
            self.held[rec.key] = held
            if rec.state == "claimed":
                # The previous leader died between its claim and its `activate`: finish what it started.
                self._spawn(self._resume(held), f"resume-{rec.key}")
        return len(self.held)

    async def _resume(self, held: Held) -> None:
        if self.is_leader():
            await self._activate(held, measured=False)
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
            if held.phase == "activating" and key not in self._activating_here and _ready_under(rec, held.claim):
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
        if not self.is_leader():
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
            and now - r.updated_at > 2 * deadline_s
        ]
        if orphans:
            log.warning("%s: adopting %d slot(s) held by no one here: %s", self.model, len(orphans),
                        ", ".join(r.key for r in orphans))  # fmt: skip
            self.adopt(orphans)
        for key, h in list(self.held.items()):
            if h.phase == "releasing" and h.release_failed and key not in self._releasing_here:
                h.release_failed = False
                self._spawn(self._release(h, reason="retrying a failed release"), f"release-{key}")
                continue
            # Judged only on a current view of the agents, once they had a heartbeat interval to renew: right
            # after an outage (a reconnect, a takeover) every lease looks old, and the slots are still serving.
            if h.phase == "ready" and self.store.lease_lapsed(h.claim.node, now):
                log.warning("%s: agent of %s stopped heartbeating; replacing the slot", self.model, key)
                h.phase = "releasing"
                self._spawn(self._release(h, reason="agent lease expired"), f"release-{key}")
            elif h.phase == "activating" and key not in self._activating_here and now - h.since > deadline_s + 0.5:
                # An adopted activation that its agent did not finish within the deadline: give it back.
                rec = self.store.record(key)
                if rec is None or rec.state != "ready":
                    h.phase = "releasing"
                    self._spawn(self._release(h, reason="activation never finished"), f"release-{key}")
                else:
                    h.phase = "ready"
        ready, activating = self.ready, self.activating
        self.series.ready.set(ready)
        self.series.activating.set(activating)
        # Wake the reconcile only when there is something to match: with 1,000 models, waking every one each tick
        # queued 1,000 task steps ahead of the next pulse's sample.
        if was_exhausted or self.desired != ready + activating or orphans:
            self._wake.set()


def _failure(reply: ActivateReply | AgentUnavailable) -> tuple[str, str]:
    """(code, why) of a failed activation: the agent's refusal, or no usable answer at all."""
    if isinstance(reply, AgentUnavailable):
        return reply.code, str(reply)
    if reply.error is None:
        return "internal", "the agent refused without saying why"
    stage = f" at stage {reply.stage}" if reply.stage else ""
    return reply.error.code, f"{reply.error.code}{stage}: {reply.error.message}"


def _ready_under(rec: SlotRecord | None, claim: Claim) -> bool:
    """`rec` is the `ready` write of `claim` (same claim id and fencing token)."""
    return rec is not None and rec.state == "ready" and rec.claim_id == claim.claim_id and rec.token == claim.token
