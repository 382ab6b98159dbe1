"""Per-model control: samples in, decisions out, warm slots claimed and activated to match.

`ModelController.on_sample` folds a gateway sample into the model's demand and re-evaluates the policy at
once (debounced to one decision per `debounce_s`, so a burst of samples costs one decision, never a polling
period). The decision goes to `reconcile`, which — on the leader only — claims warm slots in parallel, sends
`activate` to each slot's agent with the fencing token and a deadline, releases a claim whose activation fails or
runs late and claims the next slot, falls back to the cold path when nothing is claimable, and on scale-down
sends `deactivate` so the slot goes back to `warm`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import nats.errors
from nats.aio.client import Client

from autoscaler import policy
from autoscaler.ingest import ModelDemand
from autoscaler.metrics import AutoscalerMetrics
from warmpool import protocol
from warmpool.errors import BadMessage, ClaimConflict, NoSlotAvailable, PulsescaleError, StaleToken
from warmpool.protocol import QueueSample, ScalerRecord, SlotRecord
from warmpool.registry import Claim, KvSlotStore

__all__ = ["ColdPath", "ControllerSettings", "Deps", "LocalColdPath", "ModelController"]

log = logging.getLogger("pulsescale.controller")


@dataclass(frozen=True)
class ControllerSettings:
    debounce_s: float = 0.05
    """At most one decision per model per this many seconds: a burst of samples is one decision, not many."""
    activation_deadline_s: float = 2.5
    """Claim -> ready budget for one slot (DESIGN: 2.5 s for a 100 GB model); past it the claim is released."""
    deactivate_timeout_s: float = 2.0
    """How long a scale-down waits for the agent before releasing the claim itself."""
    lead_time_samples: int = 50
    """Recent claim -> ready durations kept for the lead-time p90 the forecast uses."""
    decisions_kept: int = 20
    """Decisions kept per model for `pulsescale status` (the reasons are what on-call reads)."""


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


@dataclass
class Deps:
    nc: Client
    store: KvSlotStore
    metrics: AutoscalerMetrics
    cold_path: ColdPath
    is_leader: Callable[[], bool]
    settings: ControllerSettings = field(default_factory=ControllerSettings)
    clock: Callable[[], float] = time.time


Phase = Literal["activating", "ready", "releasing"]


@dataclass
class Held:
    claim: Claim
    phase: Phase
    since: float
    endpoint: str | None = None
    release_failed: bool = False  # the broker refused or timed out our release: housekeeping retries it


class ModelController:
    def __init__(self, record: ScalerRecord, deps: Deps, *, current_replicas: int = 0) -> None:
        self.record = record
        self.deps = deps
        now = deps.clock()
        self.demand = ModelDemand(self.model, record.spec.advanced.stale_after_seconds)
        self.state = policy.initial_state(record.spec, now=now, current_replicas=current_replicas)
        self.override: policy.Override | None = None
        self.decision: policy.Decision | None = None
        self.decisions: deque[tuple[float, int, str]] = deque(maxlen=deps.settings.decisions_kept)
        self.held: dict[str, Held] = {}
        self.claiming = 0  # claims in flight, not yet in `held`
        self._activating_here: set[str] = set()  # activations this process is waiting on
        self._releasing_here: set[str] = set()  # releases in flight
        # Set when a claim found the pool empty: no new bring-ups until a slot of the model turns warm again
        # (or the next housekeeping tick), so an empty pool is a state, not a busy loop.
        self.exhausted = False
        self._stopping = False
        self.cold_requested = 0
        self.lead_times: deque[float] = deque(maxlen=deps.settings.lead_time_samples)
        self._last_eval = 0.0
        self._last_eval_demand = 0.0  # the largest single-gateway demand seen at the last decision
        self._timer: asyncio.TimerHandle | None = None
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self.first_sample_at: float | None = None  # receive time of the sample that triggered the pending decision

    # --- identity and counts ------------------------------------------------------------------------------------

    @property
    def model(self) -> str:
        return self.record.spec.model

    @property
    def spec(self) -> protocol.ScaledObjectSpec:
        return self.record.spec

    @property
    def ready(self) -> int:
        return sum(1 for h in self.held.values() if h.phase == "ready")

    @property
    def activating(self) -> int:
        return self.claiming + sum(1 for h in self.held.values() if h.phase == "activating")

    @property
    def desired(self) -> int:
        return self.decision.desired if self.decision is not None else self.ready + self.activating

    def update_record(self, record: ScalerRecord) -> None:
        self.record = record
        self.demand.stale_after_s = record.spec.advanced.stale_after_seconds
        self._schedule(self.deps.clock())

    # --- samples and decisions ----------------------------------------------------------------------------------

    def on_sample(self, sample: QueueSample, now: float) -> str:
        outcome = self.demand.add(sample, now)
        if outcome in ("accepted", "restart"):
            if self.first_sample_at is None:
                self.first_sample_at = time.perf_counter()
            # Rising demand is a possible pulse: decide now. Flat or falling demand can wait for the debounce.
            rising = sample.queue_depth + sample.inflight > self._last_eval_demand
            self._schedule(now, urgent=rising)
        return outcome

    def _schedule(self, now: float, *, urgent: bool = False) -> None:
        wait = self._last_eval + self.deps.settings.debounce_s - now
        if wait <= 0 or urgent:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self.evaluate(now)
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(wait, self._timer_fired)

    def _timer_fired(self) -> None:
        self._timer = None
        self.evaluate(self.deps.clock())

    def lead_time_s(self) -> float | None:
        if len(self.lead_times) < 3:
            return None
        ordered = sorted(self.lead_times)
        return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]

    def _active_override(self, now: float) -> policy.Override | None:
        if self.record.paused:
            return policy.Override(kind="pause", replicas=self.record.paused_replicas, expires_at=None, by="annotation")
        o = self.override
        if o is not None and o.expires_at is not None and now >= o.expires_at:
            # Passed once more so the decision's reason says the policy resumed; then forgotten.
            log.info("%s: override %s by %s expired; the policy resumes", self.model, o.kind, o.by)
            self.override = None
        return o

    def evaluate(self, now: float) -> policy.Decision:
        """Run the policy on what we know now; hand a changed target to the reconciler."""
        self._last_eval = now
        seen = self.demand.observe(now)
        self._last_eval_demand = max((g.queue_depth + g.inflight for g in self.demand.gateways.values()), default=0)
        obs = policy.Observation(
            demand=seen.demand,
            ready=self.ready,
            lead_time_s=self.lead_time_s(),
            override=self._active_override(now),
        )
        decision, self.state = policy.decide(self.spec, obs, self.state, now)
        previous = self.decision
        self.decision = decision
        m, model = self.deps.metrics, self.model
        if self.first_sample_at is not None:
            m.decision_seconds.observe(time.perf_counter() - self.first_sample_at)
        m.desired.labels(model).set(decision.desired)
        m.panic.labels(model).set(1 if decision.panic else 0)
        m.demand.labels(model).set(seen.demand or 0)
        if previous is None or previous.desired != decision.desired or previous.mode != decision.mode:
            self.decisions.append((now, decision.desired, decision.reason))
            log.info("%s: desired %d (%s)", model, decision.desired, decision.reason)
            self._publish(
                "scale.decision",
                reason=decision.reason,
                desired=decision.desired,
                ready=self.ready,
                activating=self.activating,
            )
        if self.deps.is_leader():
            self._wake.set()
        else:
            self.first_sample_at = None
        return decision

    # --- events -------------------------------------------------------------------------------------------------

    def _publish(self, type_: str, **fields: Any) -> None:
        event = protocol.Event(type=type_, model=self.model, ts=self.deps.clock(), **fields)  # type: ignore[arg-type]
        task = asyncio.ensure_future(self.deps.nc.publish(protocol.events_subject(self.model), protocol.encode(event)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- reconciliation (leader only) ------------------------------------------------------------------------

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._reconcile_loop(), name=f"reconcile-{self.model}")
            self._wake.set()

    async def stop(self, *, release_in_flight: bool = True) -> None:
        """Stop acting. Slots still activating are released (nobody would finish them); serving slots stay
        serving — the next leader adopts them."""
        self._stopping = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
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
        if release_in_flight:
            for key, h in list(self.held.items()):
                if h.phase != "ready":
                    with contextlib.suppress(PulsescaleError, nats.errors.Error, TimeoutError):
                        await self.deps.store.release(h.claim, reason="autoscaler stopped mid-activation")
                    self.held.pop(key, None)
        self._stopping = False

    def forget_claims(self) -> None:
        """After losing the lease: the books are the next leader's now. If we lead again, `adopt` re-reads
        them from the registry, which is the truth; what we remembered may be stale by then."""
        self.held.clear()
        self.claiming = 0
        self._activating_here.clear()
        self._releasing_here.clear()
        self.exhausted = False

    async def _reconcile_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self.deps.is_leader():
                continue
            self.reconcile_once()

    def reconcile_once(self) -> None:
        desired = self.desired
        current = self.ready + self.activating
        m = self.deps.metrics
        m.ready.labels(self.model).set(self.ready)
        m.activating.labels(self.model).set(self.activating)
        if desired > current and not self.exhausted and not self._stopping:
            for _ in range(desired - current):
                self.claiming += 1
                self._spawn(self._bring_up(), f"bring-up-{self.model}")
        elif desired < current:
            surplus = current - desired
            # Only serving slots can be taken down now; activating ones count and are handled when ready.
            victims = self._pick_victims(surplus)
            for h in victims:
                h.phase = "releasing"
                self._spawn(self._take_down(h), f"take-down-{self.model}")
        if desired <= current:
            self.first_sample_at = None
            self.cold_requested = 0  # met from the pool again: a later shortfall is news worth an event

    def _pick_victims(self, n: int) -> list[Held]:
        ready = [h for h in self.held.values() if h.phase == "ready"]
        per_node: dict[str, int] = {}
        for h in ready:
            per_node[h.claim.node] = per_node.get(h.claim.node, 0) + 1
        # Take from the most loaded node first, newest first: the mirror image of placement's spread.
        ready.sort(key=lambda h: (-per_node[h.claim.node], -h.since))
        return ready[:n]

    async def _bring_up(self) -> None:
        """Claim a slot and activate it; on failure release it and claim the next, while still needed."""
        tried: set[str] = set()
        counted = True  # this task is counted in `claiming` until its claim is in `held`
        try:
            while self.deps.is_leader() and not self._stopping:
                try:
                    claim = await self.deps.store.claim(self.model, exclude=tried)
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
                if self.first_sample_at is not None:
                    self.deps.metrics.claim_latency_seconds.observe(time.perf_counter() - self.first_sample_at)
                    self.first_sample_at = None
                started = self.deps.clock()
                held = Held(claim, "activating", started)
                self.held[claim.key] = held
                self.claiming -= 1
                counted = False
                self._publish(
                    "slot.claimed", node=claim.node, slot=claim.slot, token=claim.token, claim_id=claim.claim_id
                )
                self._activating_here.add(claim.key)
                try:
                    error = await self._activate(held)
                finally:
                    self._activating_here.discard(claim.key)
                if error is None:
                    held.phase = "ready"
                    self.lead_times.append(self.deps.clock() - started)
                    self.deps.metrics.activations.labels(self.model, "ready").inc()
                    return
                self.deps.metrics.activations.labels(self.model, "failed").inc()
                self._publish("slot.failed", node=claim.node, slot=claim.slot, reason=error)
                log.warning(
                    "%s: activation of %s failed: %s; releasing it and claiming the next slot",
                    self.model,
                    claim.key,
                    error,
                )
                await self._release(held, reason=error, wait_for_agent=False)
                tried.add(claim.key)
                if self.ready + self.activating >= self.desired:
                    return  # no longer needed
                self.claiming += 1
                counted = True
        finally:
            if counted:
                self.claiming -= 1
            self._wake.set()

    async def _activate(self, held: Held) -> str | None:
        """Send `activate`; None when the slot is ready, else why not."""
        claim = held.claim
        now = self.deps.clock()
        deadline = now + self.deps.settings.activation_deadline_s
        req = protocol.ActivateRequest(
            id=uuid.uuid4().hex,
            expires_at=deadline,
            slot=claim.slot,
            token=claim.token,
            claim_id=claim.claim_id,
            deadline=deadline,
        )
        try:
            msg = await self.deps.nc.request(
                protocol.agent_subject(claim.node, "activate"),
                protocol.encode(req),
                timeout=max(0.01, deadline - self.deps.clock()),
            )
        except nats.errors.NoRespondersError:
            return f"agent {claim.node} is not answering"
        except (nats.errors.TimeoutError, TimeoutError):
            return f"no answer from {claim.node} within the {self.deps.settings.activation_deadline_s} s deadline"
        try:
            reply = protocol.decode_reply(msg.data)
        except BadMessage as err:
            return f"unreadable reply from {claim.node}: {err}"
        if not reply.ok:
            assert reply.error is not None
            return f"{reply.error.code}: {reply.error.message}"
        held.endpoint = reply.fields.get("endpoint")
        timings = reply.fields.get("timings") or {}
        for stage in ("token_ms", "load_ms", "engine_ms", "readiness_ms", "total_ms"):
            if isinstance(timings.get(stage), int | float):
                self.deps.metrics.activation_seconds.labels(stage.removesuffix("_ms")).observe(timings[stage] / 1e3)
        self._publish("slot.ready", node=claim.node, slot=claim.slot, endpoint=held.endpoint)
        return None

    async def _deactivate(self, held: Held, reason: str) -> bool:
        claim = held.claim
        req = protocol.DeactivateRequest(
            id=uuid.uuid4().hex,
            expires_at=self.deps.clock() + self.deps.settings.deactivate_timeout_s,
            slot=claim.slot,
            token=claim.token,
            claim_id=claim.claim_id,
        )
        try:
            msg = await self.deps.nc.request(
                protocol.agent_subject(claim.node, "deactivate"),
                protocol.encode(req),
                timeout=self.deps.settings.deactivate_timeout_s,
            )
            return protocol.decode_reply(msg.data).ok
        except (nats.errors.Error, TimeoutError, BadMessage):
            return False

    async def _release(self, held: Held, reason: str, *, wait_for_agent: bool = True) -> None:
        """Tell the agent to stop, then give the claim back; fenced, so never someone else's.

        After a failed activation the agent is told without waiting (it may be the thing that is stuck),
        so the next slot is claimed at once; on scale-down the agent gets `deactivate_timeout_s` to finish."""
        key = held.claim.key
        held.phase = "releasing"
        self._releasing_here.add(key)
        try:
            if wait_for_agent:
                await self._deactivate(held, reason)
            else:
                self._spawn(self._deactivate(held, reason), f"deactivate-{key}")
            try:
                await self.deps.store.release(held.claim, reason=reason)
            except StaleToken:
                pass  # the agent already returned the slot (or a drain took it): nothing of ours to release
            except (PulsescaleError, nats.errors.Error, TimeoutError) as err:
                # Still ours in the registry: keep it on the books and let housekeeping try again, rather
                # than forget a slot that nobody would ever give back.
                log.warning("%s: could not release %s (%s); retrying", self.model, key, err)
                held.release_failed = True
                return
            self.held.pop(key, None)
            self._publish("slot.released", node=held.claim.node, slot=held.claim.slot, reason=reason)
        finally:
            self._releasing_here.discard(key)

    async def _take_down(self, held: Held) -> None:
        reason = self.decision.reason if self.decision else "scale down"
        await self._release(held, reason=f"scale down: {reason}")
        self._wake.set()

    async def _cold_start(self) -> None:
        # Capacity not already serving or activating in a held slot; in-flight claims are failing like this one.
        in_held = sum(1 for h in self.held.values() if h.phase == "activating")
        needed = max(0, self.desired - self.ready - in_held)
        if needed and needed != self.cold_requested:
            reason = f"no warm slot of {self.model} is claimable; asking the cold path for {needed} more"
            log.warning("%s: %s", self.model, reason)
            self.deps.metrics.cold_starts.labels(self.model).inc()
            self._publish("pool.exhausted", reason=reason, desired=self.desired, ready=self.ready)
            self._publish("cold.start", reason=reason, desired=needed)
            try:
                await self.deps.cold_path.scale(self.record, needed, reason)
            except Exception as err:  # noqa: BLE001 - any actuator failure: say so, ask again next time
                log.error("%s: the cold path failed: %s", self.model, err)
                return
            self.cold_requested = needed

    # --- registry changes and takeover -----------------------------------------------------------------------------

    def adopt(self, records: list[SlotRecord]) -> int:
        """A new leader takes over the slots its predecessor held for this model."""
        now = self.deps.clock()
        for rec in records:
            if rec.key in self.held:
                continue
            claim = self.deps.store.adopt(rec.key)
            if claim is None:
                continue
            phase: Phase = "ready" if rec.state == "ready" else "activating"
            held = Held(claim, phase, rec.updated_at or now, endpoint=rec.endpoint)
            self.held[rec.key] = held
            if rec.state == "claimed":
                # The previous leader died between its claim and its `activate`: finish what it started.
                self._spawn(self._resume(held), f"resume-{rec.key}")
        return len(self.held)

    async def _resume(self, held: Held) -> None:
        if not self.deps.is_leader():
            return
        self._activating_here.add(held.claim.key)
        try:
            error = await self._activate(held)
        finally:
            self._activating_here.discard(held.claim.key)
        if error is None:
            held.phase = "ready"
        else:
            await self._release(held, reason=error, wait_for_agent=False)
        self._wake.set()

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
            if rec.state == "ready" and held.phase == "activating" and key not in self._activating_here:
                held.phase = "ready"  # an adopted activation that its agent finished
                held.endpoint = rec.endpoint
                self._publish("slot.ready", node=held.claim.node, slot=held.claim.slot, endpoint=rec.endpoint)
                self._wake.set()
            held.claim = Claim(
                key=key,
                token=held.claim.token,
                claim_id=held.claim.claim_id,
                revision=self.deps.store.slots.revision(key) or held.claim.revision,
                record=rec,
            )

    async def housekeeping(self, now: float) -> None:
        """Time-driven checks no sample triggers: override expiry, stale gateways, dead agents, late adoptions."""
        self._schedule(now)
        if not self.deps.is_leader():
            return
        deadline_s = self.deps.settings.activation_deadline_s
        self.exhausted = False  # look at the pool again, at most once per tick
        # Held slots of this model that nobody here tracks (a predecessor's claim that outlived its activation,
        # books lost to a bug): adopt them, so they count and a scale-down can give them back.
        orphans = [
            r
            for r in self.deps.store.records(self.model)
            if r.key not in self.held
            and r.state in ("claimed", "activating", "ready")
            and now - r.updated_at > 2 * deadline_s
        ]
        if orphans:
            log.warning(
                "%s: adopting %d slot(s) held by no one here: %s",
                self.model,
                len(orphans),
                ", ".join(r.key for r in orphans),
            )
            self.adopt(orphans)
        for key, h in list(self.held.items()):
            if h.phase == "releasing" and h.release_failed and key not in self._releasing_here:
                h.release_failed = False
                self._spawn(self._release(h, reason="retrying a failed release"), f"release-{key}")
                continue
            lease = self.deps.store.lease(h.claim.node)
            if h.phase == "ready" and (lease is None or not lease.fresh(now)):
                log.warning("%s: agent of %s stopped heartbeating; replacing the slot", self.model, key)
                h.phase = "releasing"
                self._spawn(self._release(h, reason="agent lease expired"), f"release-{key}")
            elif h.phase == "activating" and key not in self._activating_here and now - h.since > deadline_s + 0.5:
                # An adopted activation that its agent did not finish within the deadline: give it back.
                rec = self.deps.store.entry(key)
                if rec is None or rec[0].state != "ready":
                    h.phase = "releasing"
                    self._spawn(self._release(h, reason="activation never finished"), f"release-{key}")
                else:
                    h.phase = "ready"
        self._wake.set()

    def status_row(self) -> dict[str, Any]:
        d = self.decision
        o = self.override
        warm = sum(1 for r in self.deps.store.records(self.model) if r.state == "warm" and not r.drain)
        return {
            "model": self.model,
            "scaler": self.record.key,
            "desired": self.desired,
            "ready": self.ready,
            "activating": self.activating,
            "warm": warm,
            "panic": bool(d and d.panic),
            "mode": d.mode if d else "starting",
            "override": None
            if o is None
            else {"kind": o.kind, "replicas": o.replicas, "expires_at": o.expires_at, "by": o.by},
            "reason": d.reason if d else "",
            "decisions": [{"ts": ts, "desired": n, "reason": r} for ts, n, r in self.decisions],
        }
