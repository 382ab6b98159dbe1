"""`pulsescale autoscaler`: the daemon. One `run(settings, stop=...)` starts everything, as named root tasks.

Every replica follows the ScaledObjects in `pulse_scalers` (a `registry.BucketView`) and the slots in
`pulse_slots`, and keeps one `ModelController` per model. The models are sharded over the replicas
(`autoscaler.shards`: 32 shard leases in `pulse_leases`, assigned over the live replicas): a replica acts for a
model only while it holds the model's shard, fenced — it subscribes to that model's samples, decides, claims,
activates, releases, and answers on-call commands for it (`autoscaler.commands`, through the `ControlPlane` that
`Autoscaler` implements; another replica's models are handed to their owner). A replica that takes a shard adopts
the slots held for its models and restores their on-call overrides stored under ``protocol.override_key(model)``;
their windows start afresh. A deleted ScaledObject's slots are given back (the operator's finalizer waits for that):
by the model's owner when the delete arrives, else by a later owner's sweep for held slots no ScaledObject owns.

Samples arrive on a connection of their own, so the lease renewal, claims and activation replies on the main one
never queue behind them; the subscription's callback only decodes and checks them into a `samples.SampleBuffer`
(newest per gateway and model), and a drain task folds them into the controllers (`autoscaler.intake`).
Housekeeping, the drain and the callback each yield to the loop every `AutoscalerSettings.slice_s`. The
``pulsescale_slots`` gauges are kept from the slot view's events (`SlotCounts`), not a scan per tick.

Its HTTP port serves ``/metrics`` (rendered in a thread), ``/healthz`` (200 while this replica holds a shard, or
has a live connection and current views) and ``/readyz`` (200 once the views are listed and the ScaledObjects followed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from autoscaler import commands, scaledobject
from autoscaler.agentclient import AgentClient, AgentUnavailable
from autoscaler.controller import ColdPath, ControllerSettings, Deps, LocalColdPath, ModelController
from autoscaler.intake import SampleIntake, StandAside
from autoscaler.leader import LeaseSettings
from autoscaler.metrics import AutoscalerMetrics
from autoscaler.shards import INVOLUNTARY, ShardLeases, ShardSettings
from warmpool import connect, looplag, protocol
from warmpool.buckets import list_keys
from warmpool.errors import BadMessage, PulsescaleError, StaleToken
from warmpool.protocol import Override, OverrideRecord, ScaledObjectSpec, ScalerRecord, StatusRow
from warmpool.registry import BucketView, Changed, Claim, KvSlotStore, Removed, Snapshot, ensure_buckets
from warmpool.rejects import Rejections
from warmpool.tasks import cancel_and_wait

__all__ = ["Autoscaler", "AutoscalerSettings", "default_identity", "run"]

OVERRIDE_READS_AT_ONCE = 32
"""Stored overrides read in parallel when shards are taken (`Autoscaler.load_overrides`)."""

log = logging.getLogger("pulsescale.autoscaler")


def default_identity() -> str:
    """``<host>-<pid>-<random>``, the host name cut to the characters an identity may hold (one key and subject
    token: `protocol.IDENTITY_PATTERN`), so a dotted host name still gives a valid one."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:100] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class AutoscalerSettings:
    nats: connect.NatsOptions = field(default_factory=connect.NatsOptions)
    identity: str = field(default_factory=lambda: default_identity())
    """Unique per process: two replicas must never mistake each other's lease for their own."""
    metrics_host: str = "127.0.0.1"
    """Bind address of the metrics/health port: loopback unless told otherwise, since the metrics name every model
    and node. In Kubernetes pass the pod IP (``--metrics-host $(POD_IP)`` from the downward API), so Prometheus
    and the kubelet's probes reach it and nothing else on the node's other interfaces does."""
    metrics_port: int | None = None
    """Port of ``/metrics``, ``/healthz`` and ``/readyz``; None serves none (tests read the registry directly),
    0 picks a free one."""
    lease: LeaseSettings = field(default_factory=LeaseSettings)
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    max_replicas: int = scaledobject.DEFAULT_MAX_REPLICAS
    """The most replicas the autoscaler acts on for one model: a ScaledObject over it is cut down to it (logged),
    and ``scale``/``pause`` over it are refused. The wire allows 100000; see `scaledobject.DEFAULT_MAX_REPLICAS`."""
    housekeeping_every_s: float = 0.25
    """Time-driven checks of the models holding slots (dead agents, stuck activations); the rest (override expiry,
    stale gateways, the windows moving on) on each model's turn, `redecide_every_s`. Decisions run on samples."""
    redecide_every_s: float = 1.0
    """How often housekeeping re-decides a model whose decision may change with time alone (its windows moving
    on, a cooldown or stabilisation ending, an override expiring, a gateway turning stale): each tick takes its turn
    of the models, so at the defaults a quarter of them, and 1,000 models cost 1,000 decisions a second instead of
    4,000. A scale-up never waits for it (a rising sample is decided at once); a time-driven scale-down or an
    expiry may come up to this much later than its due time."""
    forget_gateway_after_s: float = 300.0
    """A gateway silent this long is dropped from memory (it left the sum long before)."""
    sample_buffer: int = 100_000
    """Distinct (gateway, model) keys of samples waiting to be folded in (`samples.SampleBuffer`); past it the
    oldest key's sample is dropped (counted). 100k keys is ~100 gateways x 1,000 models, a few tens of MB."""
    slice_s: float = 0.002
    """The longest the sample callback, the drain and housekeeping run without yielding to the loop: the lease
    renewal and claims in flight wait at most about this long behind them."""
    stand_aside_s: float = 0.05
    """The longest the sample drain and housekeeping wait, between two slices, for this process's claims started
    this recently (`scaler.ClaimsInFlight`) and for samples being taken (`intake.SampleIntake`): a claim's
    hops through the event loop, and a pulse's sample behind a burst, each waited behind a slice of theirs."""
    gc_freeze_every_s: float | None = None
    """How often housekeeping moves what survived the young collections out of the cyclic collector's sight
    (`gc.freeze`). At 1,000 models the long-lived state (windows, books, metric children) is ~170,000 objects, and
    a full collection of them stops the loop for ~100 ms, at a random moment: that was the decision p99 at 1,000
    models. Frozen objects are still freed by reference counting; only reference cycles among them wait for
    `gc_full_every_s`. It acts on the whole process, so it is the daemon's (`pulsescale autoscaler` sets 1 s),
    not a library default: None leaves the collector as Python sets it."""
    gc_full_every_s: float = 3600.0
    """How often the frozen objects are handed back and collected in full (one pause of ~100 ms at 1,000 models),
    so cyclic garbage frozen with the rest is reclaimed within this long, not leaked."""
    loop_lag: looplag.LagSettings = field(default_factory=looplag.LagSettings)
    """The loop-lag probe behind ``pulsescale_event_loop_lag_seconds`` and its warning (`warmpool.looplag`)."""


class Autoscaler:
    """The daemon's state; also the `ControlPlane` the on-call command service talks to."""

    def __init__(
        self,
        settings: AutoscalerSettings,
        nc: Client,
        store: KvSlotStore,
        buckets: dict[str, KeyValue],
        *,
        metrics: AutoscalerMetrics | None = None,
        cold_path: ColdPath | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.nc = nc
        self.store = store
        self.metrics = metrics or AutoscalerMetrics()
        self.clock = clock
        self.rejections = Rejections(log, on_reject=lambda r: self.metrics.rejected.labels(r).inc())
        """Messages (samples) that break the contract; records in the buckets go to `store.rejected`."""
        self.shards: ShardLeases | None = None
        """The shard leases (`autoscaler.shards`): this replica acts for the models of the shards it holds."""
        self.deps = Deps(
            nc=nc,
            store=store,
            metrics=self.metrics,
            cold_path=cold_path or LocalColdPath(),
            is_leader=self.is_leader,
            settings=settings.controller,
            clock=clock,
        )
        self.by_scaler: dict[str, ModelController] = {}
        self.by_model: dict[str, ModelController] = {}
        self.by_shard: dict[int, set[str]] = {}
        """Models with a ScaledObject, by shard (`protocol.shard_of`)."""
        self._acquired: set[int] = set()  # shards taken, waiting for `take_over`
        self._arrived: set[str] = set()  # models whose ScaledObject came in a shard already held, ditto
        self._override_writes: dict[str, int] = {}  # model -> on-call overrides set here (see `take_over`)
        self._rejected_overrides: set[tuple[str, int | None]] = set()  # (key, revision) of stored ones refused
        self._stopping: dict[str, asyncio.Future[None]] = {}  # models whose lost shard's stop may still run
        self._held: set[int] = set()  # shards held, as the callbacks said (the gauges; `owns` fences)
        self.sample_subjects: frozenset[str] = frozenset()
        """The sample subjects subscribed to now (`follow_subjects`): the wildcard while this replica holds every
        shard."""
        self.subjects_changed = asyncio.Event()
        """The models this replica owns changed: `follow_subjects` re-subscribes the samples it needs."""
        self._leases_kv = buckets[protocol.LEASES_BUCKET]
        # A bad edit of a ScaledObject keeps the last good one (counted), so autoscaling its model goes on.
        self.scalers: BucketView[ScalerRecord] = BucketView(
            nc, buckets[protocol.SCALERS_BUCKET], ScalerRecord, store.rejected, keep_bad=True, clock=clock
        )
        self.scalers_followed = False
        """Set once the first listing of `pulse_scalers` has been applied (``/readyz``)."""
        self.metrics_port: int | None = None
        """The port ``/metrics``, ``/healthz`` and ``/readyz`` are served on (bound by `run`); None: not served."""
        self._takeover: asyncio.Task[None] | None = None  # held so the task is not garbage-collected mid-run
        self.intake = SampleIntake(
            by_model=self.by_model,
            owns=self.owns,
            claims=self.deps.claims,
            metrics=self.metrics,
            rejections=self.rejections,
            clock=clock,
            internal_error=self._internal_error,
            buffer_keys=settings.sample_buffer,
            slice_s=settings.slice_s,
            stand_aside_s=settings.stand_aside_s,
        )
        """The samples' way in (`autoscaler.intake`): the subscription's callback and the buffer's drain."""
        self._resigning = False  # a clean resign is not a lost lease
        self.slot_counts = SlotCounts()
        """Slots per (model, state) from the slot view's events: the ``pulsescale_slots`` gauges."""
        self.commands: commands.CommandService | None = None
        self._cut: dict[str, float] = {}  # ScaledObjects cut to max_replicas, by key: the version logged
        self._retiring: set[asyncio.Future[int]] = set()  # deleted ScaledObjects releasing their slots
        self._sweeping: set[str] = set()
        self._gc_frozen_at = self._gc_full_at = time.monotonic()  # `_tend_gc`
        self._gc_frozen_once = False
        self._tick = 0  # housekeeping ticks, for the models' turns (`redecide_every_s`)

    @contextlib.contextmanager
    def _contained(self, what: str) -> Iterator[None]:
        """A bug in one model's handling must not take the daemon (and every other model) down with it."""
        try:
            yield
        except Exception:  # noqa: BLE001 - logged with its traceback and counted there
            self._internal_error(what)

    def _internal_error(self, what: str) -> None:
        """Log the exception being handled, count it, carry on (`_contained`)."""
        log.exception("internal error in %s; carrying on", what)
        self.metrics.internal_errors.inc()

    def is_leader(self) -> bool:
        """Acts for at least one shard (answers on-call commands, counts as leading in ``/healthz``)."""
        return self.shards is not None and bool(self.shards.held())

    def owns_shard(self, shard: int) -> bool:
        return self.shards is not None and self.shards.owns(shard)

    def owns(self, model: str) -> bool:
        """This replica acts for `model` now (it holds the lease of its shard, fenced)."""
        return self.shards is not None and self.shards.owns_model(model)

    # --- health ---------------------------------------------------------------------------------------------

    def ready(self) -> bool:
        """The views are listed and the ScaledObjects followed: this replica can decide (``/readyz``)."""
        return self.store.slots.ready.is_set() and self.store.agents.ready.is_set() and self.scalers_followed

    def healthy(self) -> bool:
        """Leading, or able to take over: connected, with views current since the last reconnect (``/healthz``)."""
        if self.is_leader():
            return True
        views = (self.store.slots, self.store.agents, self.scalers)
        return self.nc.is_connected and all(v.current() for v in views)

    def health(self) -> dict[str, Any]:
        return {
            "ok": self.healthy(),
            "ready": self.ready(),
            "leader": self.is_leader(),
            "identity": self.settings.identity,
            "shards": sorted(self.shards.held()) if self.shards is not None else [],
            "nats_connected": self.nc.is_connected,
            "views_current": {
                "slots": self.store.slots.current(),
                "agents": self.store.agents.current(),
                "scalers": self.scalers.current(),
            },
            "models": len(self.by_model),
        }

    # --- ControlPlane ---------------------------------------------------------------------------------------

    def spec_for(self, model: str) -> ScaledObjectSpec | None:
        c = self.by_model.get(model)
        return c.spec if c else None

    def models(self) -> list[str]:
        return sorted(self.by_model)

    async def set_override(self, model: str, override: Override | None) -> None:
        """Store the override (a new leader restores it) and apply it at once."""
        c = self.by_model[model]
        key = protocol.override_key(model)
        # Counted before the write: a `take_over` that read the stored overrides before it does not restore them.
        self._override_writes[model] = self._override_writes.get(model, 0) + 1
        if override is None:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                await self._leases_kv.delete(key)
        else:
            await self._leases_kv.put(key, protocol.encode(OverrideRecord(model=model, override=override)))
        c.set_override(override)

    def status(self, model: str | None) -> list[StatusRow]:
        """Rows of every model this replica knows (all, or `model`), each naming its shard and, as last seen, the
        replica owning it (the command service keeps the ones it owns)."""
        now = self.clock()
        rows = []
        for m, c in sorted(self.by_model.items()):
            if model is None or m == model:
                owner = self.shards.owner_of_model(m) if self.shards is not None else None
                rows.append(msgspec.structs.replace(c.status_row(now), owner=owner, shard=protocol.shard_of(m)))
        return rows

    # --- scalers --------------------------------------------------------------------------------------------

    def apply_scaler(self, key: str, record: ScalerRecord | None) -> None:
        """A ScaledObject appeared, changed, or (None) was deleted."""
        if record is None:
            c = self.by_scaler.pop(key, None)
            if c is not None:
                self.by_model.pop(c.model, None)
                self.by_shard.get(protocol.shard_of(c.model), set()).discard(c.model)
                self.subjects_changed.set()
                # Its series go from the scrape now; the retiring controller's last writes land on detached children.
                self.metrics.forget(c.model)
                log.info("ScaledObject %s removed: %s is no longer autoscaled; releasing its slots", key, c.model)
                task = asyncio.ensure_future(c.retire(f"ScaledObject {key} deleted"))
                self._retiring.add(task)
                task.add_done_callback(self._retired)
            return
        record, cut = scaledobject.capped(record, self.settings.max_replicas)
        if cut is not None and self._cut.get(key) != record.updated_at:
            self._cut[key] = record.updated_at  # said once per version of the record
            log.warning("ScaledObject %s: %s", key, cut)
        model = record.spec.model
        owner = self.by_model.get(model)
        if owner is not None and owner.record.key != key:
            self.store.rejected(
                BadMessage("bad_value", f"{key} targets model {model}, already scaled by {owner.record.key}"),
                source=f"{protocol.SCALERS_BUCKET}/{key}",
            )
            return
        c = self.by_scaler.get(key)
        if c is not None and c.model != model:
            # Re-pointed at another model: a different controller (demand, slots, windows), not an update.
            self.apply_scaler(key, None)
            c = None
        if c is None:
            held = [r for r in self.store.records(model) if r.state in ("ready", "activating", "claimed")]
            shard = protocol.shard_of(model)
            # The controller acts while this replica holds the model's shard (fenced, checked at every act).
            deps = dataclasses.replace(self.deps, is_leader=functools.partial(self.owns_shard, shard))
            c = ModelController(record, deps, current_replicas=len(held))
            self.by_scaler[key] = c
            self.by_model[model] = c
            self.by_shard.setdefault(shard, set()).add(model)
            self.subjects_changed.set()
            self._slot_gauges(c)
            log.info("ScaledObject %s: autoscaling %s (%d slots held)", key, model, len(held))
            if self.owns_shard(shard):
                # Its shard was taken before the ScaledObject was seen (a start can list them in either order):
                # `take_over` adopts and starts it after restoring its stored override, as for a shard just taken.
                self._arrived.add(model)
                self._take_over_soon()
        else:
            c.update_record(record)

    def _retired(self, task: asyncio.Future[int]) -> None:
        self._retiring.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("releasing the slots of a deleted ScaledObject failed: %s", task.exception())

    async def follow_scalers(self, stop: asyncio.Event) -> None:
        """Apply `pulse_scalers` as the view sees it: each listing whole (a ScaledObject deleted while we were
        away is gone from it), then each change. The view runs as its own task (`run`)."""
        async for event in self.scalers.changes():
            if stop.is_set():
                return
            if isinstance(event, Snapshot):
                await self.apply_scalers_snapshot(event)
                continue
            with self._contained("a ScaledObject change"):
                self.apply_scalers_event(event)

    async def apply_scalers_snapshot(self, event: Snapshot[ScalerRecord]) -> None:
        """`apply_scalers_event` for a whole listing, yielding every `slice_s`: 3,000 ScaledObjects take about a
        second to apply, longer than the shard leases may go unrenewed."""
        for key in set(self.by_scaler) - set(event.records):
            self.apply_scaler(key, None)
        until = time.perf_counter() + self.settings.slice_s
        for key, record in event.records.items():
            with self._contained(f"applying ScaledObject {key}"):
                self.apply_scaler(key, record)
            if time.perf_counter() >= until:
                await asyncio.sleep(0)
                until = time.perf_counter() + self.settings.slice_s
        self.scalers_followed = True

    def apply_scalers_event(self, event: Snapshot[ScalerRecord] | Changed[ScalerRecord] | Removed) -> None:
        """One event of the `pulse_scalers` view: a `Snapshot` is the whole bucket (replace, don't merge)."""
        if isinstance(event, Snapshot):
            for key in set(self.by_scaler) - set(event.records):
                self.apply_scaler(key, None)
            for key, record in event.records.items():
                with self._contained(f"applying ScaledObject {key}"):
                    self.apply_scaler(key, record)
            self.scalers_followed = True
        elif isinstance(event, Changed):
            self.apply_scaler(event.key, event.record)
        else:
            self.apply_scaler(event.key, None)

    # --- slots ------------------------------------------------------------------------------------------------

    async def follow_slots(self, stop: asyncio.Event) -> None:
        async for event in self.store.watch():
            if stop.is_set():
                return
            with self._contained("a slot change"):
                self._on_slot_event(event)

    def _on_slot_event(self, event: Snapshot[protocol.SlotRecord] | Changed[protocol.SlotRecord] | Removed) -> None:
        with self._contained("slot gauges"):
            for model, state in self.slot_counts.apply(event):
                c = self.by_model.get(model)
                if c is not None:
                    c.scaler.series.slots[state].set(self.slot_counts.count(model, state))
        if isinstance(event, Snapshot):
            for c in self.by_model.values():
                c.on_slot_snapshot(event.records)
            return
        record = event.record if isinstance(event, Changed) else None
        owner = self.by_model.get(event.key.split(".", 1)[0])  # keys are <model>.<node>.<slot>
        if owner is not None:
            owner.on_slot_change(event.key, record)

    def _slot_gauges(self, c: ModelController) -> None:
        """Set a model's slot gauges from the counts (its controller was just made; events keep them after)."""
        for state, gauge in c.scaler.series.slots.items():
            gauge.set(self.slot_counts.count(c.model, state))

    async def housekeeping(self, stop: asyncio.Event) -> None:
        every = self.settings.housekeeping_every_s
        stopped = asyncio.ensure_future(stop.wait())  # asyncio.wait: see LeaderElection.campaign
        try:
            while not stop.is_set():
                await asyncio.wait([stopped], timeout=every)
                await self.housekeeping_once()
        finally:
            stopped.cancel()

    def _tend_gc(self) -> None:
        """`gc_freeze_every_s`: freeze the survivors of the young generations; once per `gc_full_every_s`,
        unfreeze and collect everything."""
        every = self.settings.gc_freeze_every_s
        if every is None:
            return
        mono = time.monotonic()
        if mono - self._gc_full_at >= self.settings.gc_full_every_s:
            self._gc_full_at = self._gc_frozen_at = mono
            gc.unfreeze()
            gc.collect()
            gc.freeze()
        elif mono - self._gc_frozen_at >= every or (self.scalers_followed and not self._gc_frozen_once):
            # ...and once as soon as the ScaledObjects are followed: the controllers are the bulk of it.
            self._gc_frozen_once = self.scalers_followed
            self._gc_frozen_at = mono
            gc.collect(1)  # young cyclic garbage is collected, not frozen (a few ms)
            gc.freeze()

    async def housekeeping_once(self) -> None:
        self._tend_gc()
        now = self.clock()
        turns = max(1, round(self.settings.redecide_every_s / self.settings.housekeeping_every_s))
        self._tick += 1
        turn = self._tick % turns
        until = time.perf_counter() + self.settings.slice_s
        aside = StandAside()
        for c in list(self.by_model.values()):
            its_turn = protocol.shard_of(c.model, turns) == turn
            if not c.housekeeping_due(its_turn):
                continue  # nothing of it to look at between its turns (a fleet's steady models: most of them)
            if self.by_model.get(c.model) is not c or not c.deps.is_leader():
                continue  # its ScaledObject went (or was re-pointed) while we yielded, or another replica owns it
            with self._contained(f"housekeeping of {c.model}"):
                if its_turn:
                    c.forget_gateways(now, self.settings.forget_gateway_after_s)
                await c.housekeeping(now, decide=its_turn)
            if time.perf_counter() >= until:
                # A tick over 1,000 models is tens of ms: let the lease renewal, claims and samples in between.
                await asyncio.sleep(0)
                await self.intake.stand_aside(aside)
                until = time.perf_counter() + self.settings.slice_s
                now = self.clock()
        if self._held and self.scalers_followed and turn == 0:  # a scan of every slot: once per turn round
            with self._contained("the sweep for slots of deleted ScaledObjects"):
                self._sweep_unowned(now)

    def _sweep_unowned(self, now: float) -> None:
        """Release slots held for a model no ScaledObject scales: its ScaledObject was deleted while no leader
        was there to release them (`apply_scaler` does when one is), and the operator's finalizer waits for them.
        Only the autoscaler claims slots, so a held slot of an unscaled model is nobody's. A grace of two
        activation deadlines since the record's last write leaves alone a claim whose ScaledObject is arriving."""
        grace_s = 2 * self.settings.controller.activation_deadline_s
        agents = AgentClient(self.nc, clock=self.clock)
        for rec in self.store.records():
            if (
                rec.model in self.by_model
                or not self.owns(rec.model)  # the owner of its shard sweeps it
                or rec.key in self._sweeping
                or rec.state not in ("claimed", "activating", "ready")
                or now - rec.updated_at < grace_s
            ):
                continue
            claim = self.store.adopt(rec.key)
            if claim is None:
                continue
            log.warning("slot %s is held for %s, which no ScaledObject scales: releasing it", rec.key, rec.model)
            self._sweeping.add(rec.key)
            task = asyncio.ensure_future(self._release_unowned(agents, claim))
            task.add_done_callback(functools.partial(self._swept, rec.key))

    def _swept(self, key: str, task: asyncio.Future[None]) -> None:
        self._sweeping.discard(key)
        if not task.cancelled() and task.exception() is not None:
            log.error("releasing %s failed: %s", key, task.exception())

    async def _release_unowned(self, agents: AgentClient, claim: Claim) -> None:
        with contextlib.suppress(AgentUnavailable):
            await agents.deactivate(claim, timeout_s=self.settings.controller.deactivate_timeout_s)
        try:
            await self.store.release(claim, reason="its ScaledObject was deleted")
        except StaleToken:
            pass  # the agent gave it back on deactivate
        except (PulsescaleError, nats.errors.Error, TimeoutError) as err:
            log.warning("could not release %s (%s); the next sweep tries again", claim.key, err)

    # --- leadership ---------------------------------------------------------------------------------------------

    def on_shard_acquired(self, shard: int) -> None:
        """`ShardLeases.on_acquired`: act for the shard's models once `take_over` has adopted their slots."""
        self._held.add(shard)
        self._acquired.add(shard)
        self._leading_changed()
        self._take_over_soon()

    def _take_over_soon(self) -> None:
        if self._takeover is None or self._takeover.done():
            self._takeover = asyncio.ensure_future(self.take_over())

    def on_shard_lost(self, shard: int) -> None:
        """`ShardLeases.on_lost`: stop acting for the shard's models at once; claims in flight are left for the
        next owner to adopt or expire. Called synchronously, also from inside a fenced `owns` check."""
        why = self.shards.last_loss if self.shards is not None else ""
        if why in INVOLUNTARY and not self._resigning:
            self.metrics.lease_lost.inc()
        self._held.discard(shard)
        self._acquired.discard(shard)
        for model in list(self.by_shard.get(shard, ())):
            c = self.by_model.get(model)
            if c is not None:
                task = asyncio.ensure_future(c.stop(release_in_flight=False))
                task.add_done_callback(functools.partial(_forget_after_stop, c))
                self._stopping[model] = task
        self._leading_changed()

    def _leading_changed(self) -> None:
        leading = bool(self._held)
        self.metrics.leader.set(1 if leading else 0)
        self.metrics.shards_held.set(len(self._held))
        self.subjects_changed.set()
        if self.commands is not None:
            self.commands.on_leadership(leading)

    def models_owned(self) -> int:
        """ScaledObjects in the shards this replica holds (its `ReplicaRecord.models`)."""
        return sum(len(self.by_shard.get(s, ())) for s in self._held)

    async def take_over(self) -> None:
        """Rebuild the shards just taken from the buckets: adopt their models' held slots, restore their
        overrides, then act; the same for models whose ScaledObject arrived in a shard already held. Those taken
        or arrived while this runs are handled in the same task, overrides read once per batch. (Adopting and
        starting are idempotent: a model met twice is harmless.)"""
        overrides: dict[str, Override] | None = None
        writes: dict[str, int] = {}
        read_at = 0.0
        while self._acquired or self._arrived:
            batch, self._acquired = self._acquired, set()
            arrived, self._arrived = self._arrived, set()
            if overrides is None or time.monotonic() - read_at > 1.0:
                # One read for the shards of a round (they are taken one by one, within milliseconds).
                writes = dict(self._override_writes)
                read_at, overrides = time.monotonic(), await self.load_overrides()
            todo = [(shard, model) for shard in sorted(batch) for model in sorted(self.by_shard.get(shard, ()))]
            todo += [(protocol.shard_of(m), m) for m in sorted(arrived) if protocol.shard_of(m) not in batch]
            # First adopt and start every model, so a sample arriving now acts; then the first decisions.
            started: list[ModelController] = []
            until = time.perf_counter() + self.settings.slice_s
            for shard, model in todo:
                if time.perf_counter() >= until:
                    # 1,000 models' adoption and first decision is a few hundred ms: renewals run between.
                    await asyncio.sleep(0)
                    until = time.perf_counter() + self.settings.slice_s
                stopping = self._stopping.pop(model, None)
                if stopping is not None and not stopping.done():
                    # Lost and taken back in one round: the old term's stop must end (and forget its books)
                    # before this one adopts and starts, or it would undo them.
                    await asyncio.wait([stopping])
                c = self.by_model.get(model)
                if c is None or not self.owns_shard(shard):
                    continue  # its ScaledObject went while we yielded, or the shard moved on meanwhile
                with self._contained(f"taking over {model}"):
                    c.adopt(self.store.records(model))
                    # An override set here since the read is newer than what was read (a resume's delete too).
                    if model in overrides and self._override_writes.get(model, 0) == writes.get(model, 0):
                        c.override = overrides[model]
                    c.start()
                    started.append(c)
            for c in started:
                if time.perf_counter() >= until:
                    await asyncio.sleep(0)
                    until = time.perf_counter() + self.settings.slice_s
                if self.by_model.get(c.model) is c and c.deps.is_leader():
                    with self._contained(f"the first decision of {c.model}"):
                        c.evaluate(self.clock())
            where = f"shard(s) {','.join(map(str, sorted(batch)))}" if batch else "shards already held"
            log.info("acting for %d more model(s) in %s", len(started), where)

    async def load_overrides(self) -> dict[str, Override]:
        """The on-call overrides stored in `pulse_leases`, by model. One that breaks the contract is counted (by
        reason, in the registry's rejections) and logged, and its model runs on the policy."""
        out: dict[str, Override] = {}
        try:
            js = self.nc.jetstream(timeout=2.0)
            keys = await list_keys(js, protocol.LEASES_BUCKET, protocol.OVERRIDE_KEY_PREFIX)
        except (nats.errors.Error, TimeoutError) as err:
            log.warning("cannot list the stored overrides (%s); models run on the policy until one is set", err)
            return out
        # Read at once, a few dozen at a time: the list holds every override ever cleared too (a delete marker
        # stays), and one read after another would hold up the first decisions of a takeover.
        reads = asyncio.Semaphore(OVERRIDE_READS_AT_ONCE)

        async def read(key: str) -> None:
            source = f"{protocol.LEASES_BUCKET}/{key}"
            try:
                async with reads:
                    entry = await self._leases_kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return  # resumed (deleted), now or before
            except (nats.errors.Error, TimeoutError) as err:
                log.warning("cannot read %s (%s); its model runs on the policy", source, err)
                return
            try:
                record = protocol.decode(entry.value or b"", OverrideRecord)
                if protocol.override_key(record.model) != key:
                    raise BadMessage("subject_mismatch", f"an override of {record.model} stored under {key}")
                self._check_stored(record.override)
            except BadMessage as err:
                if (key, entry.revision) not in self._rejected_overrides:  # counted once, however often read
                    self._rejected_overrides.add((key, entry.revision))
                    self.store.rejected(err, source=source)
                return
            out[record.model] = record.override

        await asyncio.gather(*(read(k) for k in keys))
        return out

    def _check_stored(self, override: Override) -> None:
        """A stored override must be one the command service could have accepted: none of ours expires more than
        `commands.MAX_OVERRIDE_S` from now (a clock skew's worth more is tolerated) or holds more replicas than
        `max_replicas`. Anything else was written around the command service, and is not obeyed."""
        now = self.clock()
        limit = now + commands.MAX_OVERRIDE_S + protocol.MAX_CLOCK_SKEW_S
        if override.expires_at is not None and override.expires_at > limit:
            raise BadMessage(
                "too_late",
                f"override expires {override.expires_at - now:.0f} s from now; at most "
                f"{commands.MAX_OVERRIDE_S:.0f} s is accepted",
            )
        if override.replicas is not None and override.replicas > self.settings.max_replicas:
            cap = self.settings.max_replicas
            raise BadMessage("bad_value", f"override holds {override.replicas} replicas, over the limit of {cap}")

    async def shutdown(self, campaign: asyncio.Task[None] | None = None) -> None:
        if self._retiring:
            await asyncio.wait(self._retiring, timeout=self.settings.controller.deactivate_timeout_s + 1.0)
        for c in list(self.by_model.values()):
            await c.stop(release_in_flight=True)
        if self.shards is not None:
            self.shards.halt()
        if campaign is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(campaign, 5)
        if self.shards is not None:
            self._resigning = True
            await self.shards.resign()  # the others take our shards at once, not after a lease (and stops the watch)

    # --- sample subscriptions -----------------------------------------------------------------------------------

    async def follow_subjects(self, nc: Client, stop: asyncio.Event) -> None:
        """Subscribe to the samples this replica needs on `nc` (the samples' connection): while it holds every
        shard, one wildcard subscription; else one per model it owns, so a replica of three receives a third of
        the fleet's samples instead of all of them. The new subscriptions are in place at the server before the
        old are dropped, and what nats-py had queued for an old one is taken as the callback would take it, so a
        move loses no sample (a duplicate is counted as such, and folded once)."""
        subs: dict[str, Subscription] = {}
        self.sample_subjects = frozenset()
        try:
            while not stop.is_set():
                await self.subjects_changed.wait()
                self.subjects_changed.clear()
                if len(self._held) == protocol.SHARDS:
                    want = {protocol.QUEUE_WILDCARD}
                else:
                    want = {protocol.QUEUE_PREFIX + m for s in self._held for m in self.by_shard.get(s, ())}
                failed = False
                for subject in sorted(want - set(subs)):
                    try:
                        # nats-py's own queue in front of the callback: generous, since a message it drops is
                        # counted nowhere of ours (the callback is cheap and coalesces into `samples`).
                        subs[subject] = await nc.subscribe(
                            subject, cb=self.intake.on_queue_msg, pending_msgs_limit=1_000_000
                        )
                    except nats.errors.Error as err:  # disconnected: try again shortly
                        log.warning("cannot subscribe to %s: %s", subject, err)
                        failed = True
                        break
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    # The server has the new subscriptions once the round trip is back, and nats-py has queued
                    # every message the server sent an old one before it.
                    await nc.flush(timeout=2)
                left: list[Msg] = []
                if not failed:
                    for subject in sorted(set(subs) - want):
                        sub = subs.pop(subject)
                        left += _queued(sub)  # an unsubscribe drops them uncounted; no await until it has
                        with contextlib.suppress(nats.errors.Error):
                            await sub.unsubscribe()
                self.sample_subjects = frozenset(subs)
                await self.intake.take_backlog(left)  # folded, or counted `not_owned`
                if failed:
                    self.subjects_changed.set()
                    await asyncio.sleep(0.25)
        finally:
            for sub in subs.values():
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()


class SlotCounts:
    """Slots per (model, state), kept from the slot view's events instead of a scan of every slot per tick.
    Each key's last (model, state) is remembered, so an event is applied by what it changes, whatever the view
    skipped in between; a `Snapshot` (a reconnect) starts over from the listing."""

    __slots__ = ("_of", "counts")

    def __init__(self) -> None:
        self._of: dict[str, tuple[str, str]] = {}  # slot key -> (model, state) as last seen
        self.counts: dict[tuple[str, str], int] = {}

    def count(self, model: str, state: str) -> int:
        return self.counts.get((model, state), 0)

    def apply(
        self, event: Snapshot[protocol.SlotRecord] | Changed[protocol.SlotRecord] | Removed
    ) -> set[tuple[str, str]]:
        """Fold one event in; returns the (model, state) pairs whose count may have changed."""
        if isinstance(event, Snapshot):
            touched = set(self.counts)
            self._of.clear()
            self.counts.clear()
            for key, rec in event.records.items():
                self._add(key, (rec.model, rec.state))
            return touched | set(self.counts)
        new = (event.record.model, event.record.state) if isinstance(event, Changed) else None
        old = self._of.pop(event.key, None)
        if old == new:
            if new is not None:
                self._of[event.key] = new
            return set()
        if old is not None:
            left = self.counts[old] - 1
            if left:
                self.counts[old] = left
            else:
                del self.counts[old]
        if new is not None:
            self._add(event.key, new)
        return {p for p in (old, new) if p is not None}

    def _add(self, key: str, pair: tuple[str, str]) -> None:
        self._of[key] = pair
        self.counts[pair] = self.counts.get(pair, 0) + 1


def _forget_after_stop(c: ModelController, stopped: asyncio.Future[None]) -> None:
    if not stopped.cancelled() and stopped.exception() is not None:
        log.error("%s: stopping after deposition failed: %s", c.model, stopped.exception())
    c.forget_claims()


def _queued(sub: Subscription) -> list[Msg]:
    """The messages nats-py has read for `sub` and not yet handed to its callback, taken out of its queue."""
    queue = sub._pending_queue  # nats-py keeps them only here (its `drain` waits on the queue, with no bound)
    out: list[Msg] = []
    while True:
        try:
            out.append(queue.get_nowait())
        except asyncio.QueueEmpty:
            return out


async def _quietly(close: Callable[[], Awaitable[None]]) -> None:
    with contextlib.suppress(Exception):
        await close()


async def _serve_http(scaler: Autoscaler, host: str, port: int) -> tuple[web.AppRunner, int]:
    """``/metrics``, ``/healthz`` and ``/readyz`` on `host`:`port`; returns the runner and the bound port."""

    async def metrics(_: web.Request) -> web.Response:
        # Rendered in a worker thread: at 1,000 models a scrape renders ~20,000 series (tens of ms of CPU), which on
        # the event loop would hold up every sample and claim behind it; off it, the loop gets the GIL back every
        # switch interval (5 ms). prometheus_client's metrics take their own locks, so a concurrent render is safe.
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, scaler.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response(scaler.health(), status=200 if scaler.healthy() else 503)

    async def readyz(_: web.Request) -> web.Response:
        return web.json_response(scaler.health(), status=200 if scaler.ready() else 503)

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/healthz", healthz), web.get("/readyz", readyz)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as err:
        await runner.cleanup()
        raise PulsescaleError(
            f"cannot serve metrics on {host}:{port}: {err.strerror or err}; pick another --metrics-port"
        ) from None
    addresses = runner.addresses
    return runner, int(addresses[0][1]) if addresses else port


async def run(
    settings: AutoscalerSettings,
    *,
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
    metrics: AutoscalerMetrics | None = None,
    cold_path: ColdPath | None = None,
    on_started: Callable[[Autoscaler], None] | None = None,
) -> Autoscaler:
    """Run until `stop` is set; SIGTERM handling is the caller's (signal handlers belong to the main thread).
    `on_started(autoscaler)` lets a caller (tests) see the live daemon."""
    metrics = metrics or AutoscalerMetrics()
    async with contextlib.AsyncExitStack() as opened:
        # Each connection, watch and listener is closed however the start ends: a stop or an error half-way
        # through leaves no socket for the garbage collector.
        nc = await connect.connect(settings.nats)
        opened.push_async_callback(_quietly, nc.drain)
        # The autoscaler creates the buckets, and turns rollups off on those an older version made.
        buckets = await ensure_buckets(nc.jetstream(timeout=2.0), harden=True)
        store = KvSlotStore(nc, buckets, on_reject=lambda reason: metrics.registry_rejected.labels(reason).inc())
        opened.push_async_callback(store.close)
        await store.start()
        scaler = Autoscaler(settings, nc, store, buckets, metrics=metrics, cold_path=cold_path)
        lease = settings.lease
        # Lease rounds on their own, shorter timeout: a broker that vanished must not hold a round for the default
        # 5 s (the fence ends our terms on time anyway, but re-taking them would wait).
        leases_kv = await nc.jetstream(timeout=lease.renew_every_s * 2).key_value(protocol.LEASES_BUCKET)
        scaler.shards = ShardLeases(
            leases_kv,
            settings.identity,
            ShardSettings(lease_s=lease.lease_s, renew_every_s=lease.renew_every_s, stop_fraction=lease.stop_fraction),
            on_acquired=scaler.on_shard_acquired,
            on_lost=scaler.on_shard_lost,
            count_models=scaler.models_owned,
            rejections=store.rejected,
            nc=nc,
            on_renewal=metrics.lease_renewal_seconds.observe,
        )
        if settings.metrics_port is not None:
            runner, scaler.metrics_port = await _serve_http(scaler, settings.metrics_host, settings.metrics_port)
            opened.push_async_callback(runner.cleanup)
            log.info("metrics on http://%s:%d/metrics", settings.metrics_host, scaler.metrics_port)
        # Samples on their own connection: claims, activation replies and lease renewals on `nc` never queue behind
        # a flood of them, in the server's outbound buffer or in our socket's.
        samples_nc = await connect.connect(dataclasses.replace(settings.nats, name=f"{settings.nats.name}-samples"))
        opened.push_async_callback(_quietly, samples_nc.close)
        service = scaler.commands = commands.CommandService(
            nc,
            scaler,
            store,
            is_leader=scaler.is_leader,
            router=scaler.shards,
            rejections=scaler.rejections,  # counted in pulsescale_rejected_messages_total{reason}
            settings=commands.CommandSettings(max_replicas=settings.max_replicas),
        )
        campaign = asyncio.create_task(scaler.shards.campaign(stop), name="shards")
        tasks = [
            asyncio.create_task(scaler.scalers.run(), name="scalers-view"),
            asyncio.create_task(scaler.follow_scalers(stop), name="scalers"),
            asyncio.create_task(scaler.follow_slots(stop), name="slots"),
            asyncio.create_task(scaler.housekeeping(stop), name="housekeeping"),
            asyncio.create_task(scaler.intake.drain(), name="samples"),
            asyncio.create_task(scaler.follow_subjects(samples_nc, stop), name="sample-subjects"),
            asyncio.create_task(looplag.probe(metrics.loop_lag.observe, stop, settings.loop_lag), name="loop-lag"),
            campaign,
        ]
        try:
            await service.start()
            if on_started is not None:
                on_started(scaler)
            if ready is not None:
                ready.set()
            done, _ = await asyncio.wait(
                [asyncio.create_task(stop.wait()), *tasks], return_when=asyncio.FIRST_COMPLETED
            )
            for t in done:
                if t in tasks and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await service.stop()
            try:
                await scaler.shutdown(campaign=campaign)
            finally:  # the loops end before the exit stack closes the connections under them
                scaler.scalers.closed = True
                await cancel_and_wait(tasks)
    return scaler
