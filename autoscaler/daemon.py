"""`pulsescale autoscaler`: the daemon. One `run(settings, stop=...)` starts everything, as named root tasks.

Every replica follows the ScaledObjects in `pulse_scalers` (a `registry.BucketView`) and the slots in
`pulse_slots`, and keeps one `ModelController` per model. The models are sharded over the replicas
(`autoscaler.shards.leases`: 32 shard leases in `pulse_leases`, assigned over the live replicas): a replica acts for a
model only while it holds the model's shard, fenced — it subscribes to that model's samples, decides, claims,
activates, releases, and answers on-call commands for it (`autoscaler.commands.service`, through the `ControlPlane` that
`Autoscaler` implements; another replica's models are handed to their owner). A replica that takes a shard adopts
the slots held for its models and restores their on-call overrides stored under ``protocol.override_key(model)``
(`autoscaler.ownership`, `autoscaler.stored.overrides`); their windows start afresh. A deleted ScaledObject's slots are
given back (the operator's finalizer waits for that): by the model's owner when the delete arrives, else by a later
owner's sweep for held slots no ScaledObject owns (`autoscaler.retire`).

Samples arrive on a connection of their own, so the lease renewal, claims and activation replies on the main one
never queue behind them; the subscriptions follow the models owned (`autoscaler.subscriptions`), their callback
only decodes and checks them into a `samples.SampleBuffer` (newest per gateway and model), and a drain task folds
them into the controllers (`autoscaler.intake`).
Housekeeping, the drain and the callback each yield to the loop every `AutoscalerSettings.slice_s`. The
``pulsescale_slots`` gauges are kept from the slot view's events (`slotview.SlotCounts`), not a scan per tick.

Its HTTP port (`autoscaler.endpoints`) serves ``/metrics`` (what changed since the last scrape rendered, on the
loop in slices: `autoscaler.exposition`), ``/healthz`` (liveness: 200 while this replica holds a shard, has a live
connection and current views, or has no connection at all: a NATS outage is not cured by restarting every
replica) and ``/readyz`` (200 while connected, once the views are listed and the ScaledObjects followed; else 503
with the ``reason``). The shard leases are renewed on a thread of their own (`autoscaler.shards.renewer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
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
from nats.aio.client import Client
from nats.js.kv import KeyValue

from autoscaler.commands import service as commands
from autoscaler.controller import ColdPath, ControllerSettings, Deps, LocalColdPath, ModelController
from autoscaler.endpoints import serve_http
from autoscaler.gctending import GcTending
from autoscaler.intake import SampleIntake, StandAside
from autoscaler.metrics import AutoscalerMetrics
from autoscaler.models import Models
from autoscaler.ownership import Ownership
from autoscaler.retire import Retirement
from autoscaler.shards.leader import LeaseSettings
from autoscaler.shards.leases import ShardLeases, ShardSettings
from autoscaler.shards.renewer import LeaseRenewer
from autoscaler.slotview import SlotCounts as SlotCounts  # importable from here too
from autoscaler.slotview import SlotEvents
from autoscaler.stored.overrides import OVERRIDE_READS_AT_ONCE as OVERRIDE_READS_AT_ONCE  # importable from here too
from autoscaler.stored.overrides import StoredOverrides
from autoscaler.stored.schedules import StoredSchedules
from autoscaler.subscriptions import SampleSubscriptions
from autoscaler.warmup import warm_then_campaign
from manifests import scaledobject
from warmpool import connect, looplag, protocol
from warmpool.errors import BadMessage
from warmpool.protocol import OnCallSchedule, Override, ScaledObjectSpec, ScalerRecord, StatusRow
from warmpool.registry import BucketView, Changed, KvSlotStore, Removed, Snapshot, ensure_buckets
from warmpool.rejects import Rejections
from warmpool.tasks import cancel_and_wait

__all__ = ["Autoscaler", "AutoscalerSettings", "default_identity", "run"]

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
    """Port of ``/metrics``, ``/healthz`` and ``/readyz``; None serves none (tests read the registry), 0 a free one."""
    lease: LeaseSettings = field(default_factory=LeaseSettings)
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    max_replicas: int = protocol.DEFAULT_MAX_REPLICAS
    """The most replicas the autoscaler acts on for one model: a ScaledObject over it is cut down to it (logged),
    and ``scale``/``pause`` over it are refused. The wire allows 100000; see `protocol.DEFAULT_MAX_REPLICAS`."""
    require_assignment: bool = False
    """Offer a node's slots only of the models `pulse_assignments` lists for it (revision 11). Off: a node without
    an assignment offers what its agent writes (the quickstart, the demo); the secure deployment turns it on."""
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
    slice_s: float = 0.0005
    """The longest the sample taker, the drain and housekeeping run without yielding to the loop: a claim or lease
    renewal waits about this long at each of its hops through the loop (at 2 ms, up to 18 of 100 pulses > 6 ms)."""
    catch_up_s: float = 0.02
    """The longest the sample taker runs without yielding while samples queue up for it (`intake.BEHIND_MSGS`):
    nats-py parses a whole read per turn of the loop (~8 ms here), and a `slice_s` per turn never caught up."""
    stand_aside_s: float = 0.05
    """The longest the sample drain and housekeeping wait, between two slices, for this process's claims started
    this recently (`scaler_book.ClaimsInFlight`) and for samples being taken (`intake.SampleIntake`): a claim's
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
    warm_up_max_s: float = 30.0
    """The longest a replica warms up before it campaigns for shards anyway (`autoscaler.warmup`)."""
    renew_on_own_thread: bool = True
    """Renew the shard leases on a thread, loop and connection of their own (`autoscaler.shards.renewer`): a busy
    loop then delays decisions, never costs a lease (and a move of its models for nothing). Off: on this loop."""
    loop_lag: looplag.LagSettings = field(default_factory=looplag.LagSettings)
    """The loop-lag probe behind ``pulsescale_event_loop_lag_seconds`` and its warning (`warmpool.looplag`)."""


class Autoscaler:
    """The daemon; also the `ControlPlane` the on-call command service talks to. It follows the ScaledObjects into
    the controllers and keeps house; the rest it composes: the controllers and the shards held (`fleet`), the
    samples' way in (`intake`, `subscriptions`), the slot view's events (`slot_events`), the reactions to the
    shards (`ownership`), the stored overrides (`overrides`) and the slots of deleted ScaledObjects (`retirement`)."""

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
        self.fleet = Models()
        """The controllers by model, ScaledObject and shard, the shards held, the shard leases and the command
        service (`autoscaler.models`), which every part below asks. (Not `models`: that is `ControlPlane.models`.)"""
        self.deps = Deps(
            nc=nc,
            store=store,
            metrics=self.metrics,
            cold_path=cold_path or LocalColdPath(),
            owns=self.fleet.holds_shards,
            settings=settings.controller,
            clock=clock,
        )
        # The parts below copy the settings they use: `settings` is fixed for the daemon's life (a frozen dataclass;
        # only what the daemon reads itself, such as the GC's, may be swapped on a live one, as a test does).
        self.overrides = StoredOverrides(
            nc, buckets[protocol.LEASES_BUCKET], store, clock=clock, max_replicas=settings.max_replicas
        )
        """The on-call overrides stored in `pulse_leases` (`autoscaler.stored.overrides`): a new owner restores them."""
        self.stored_schedules = StoredSchedules(
            nc, buckets[protocol.LEASES_BUCKET], store, clock=clock, max_replicas=settings.max_replicas
        )
        """The on-call schedules stored in `pulse_leases` (`autoscaler.stored.schedules`): a new owner restores them."""
        self.ownership = Ownership(
            store,
            self.overrides,
            self.fleet,
            metrics=self.metrics,
            contained=self._contained,
            clock=clock,
            slice_s=settings.slice_s,
            schedules=self.stored_schedules,
        )
        """The shards held and the reactions to them (`autoscaler.ownership`): take over, stop."""
        # A bad edit of a ScaledObject keeps the last good one (counted), so autoscaling its model goes on.
        self.scalers: BucketView[ScalerRecord] = BucketView(
            nc, buckets[protocol.SCALERS_BUCKET], ScalerRecord, store.rejected, keep_bad=True, clock=clock
        )
        self.scalers_followed = False
        """Set once the first listing of `pulse_scalers` has been applied (``/readyz``)."""
        self.metrics_port: int | None = None
        """The port ``/metrics``, ``/healthz`` and ``/readyz`` are served on (bound by `run`); None: not served."""
        self.intake = SampleIntake(
            self.fleet,
            claims=self.deps.claims,
            metrics=self.metrics,
            rejections=self.rejections,
            clock=clock,
            internal_error=self._internal_error,
            buffer_keys=settings.sample_buffer,
            slice_s=settings.slice_s,
            stand_aside_s=settings.stand_aside_s,
            catch_up_s=settings.catch_up_s,
        )
        """The samples' way in (`autoscaler.intake`): the subscription's callback and the buffer's drain."""
        self.subscriptions = SampleSubscriptions(self.intake, self.fleet)
        """The samples' subscriptions for the models owned (`autoscaler.subscriptions`)."""
        self.slot_events = SlotEvents(store, self.fleet, contained=self._contained)
        """`pulse_slots`' events into the ``pulsescale_slots`` gauges and the controllers (`autoscaler.slotview`)."""
        self._cut: dict[str, float] = {}  # ScaledObjects cut to max_replicas, by key: the version logged
        self.retirement = Retirement(nc, store, self.fleet, settings=settings.controller, clock=clock)
        """The slots of deleted ScaledObjects given back (`autoscaler.retire`)."""
        self.gc = GcTending()
        """The cyclic collector's freezes and full collections (`autoscaler.gctending`), from housekeeping."""
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

    # --- health ---------------------------------------------------------------------------------------------

    def ready(self) -> bool:
        """Connected, views listed, ScaledObjects followed: it can decide (``/readyz``, `not_ready_reason`)."""
        return self.not_ready_reason() is None

    def not_ready_reason(self) -> str | None:
        """Why ``/readyz`` answers 503, or None when it answers 200."""
        if not self.nc.is_connected:
            return "NATS is not connected (reconnecting)"
        if not (self.store.slots.ready.is_set() and self.store.agents.ready.is_set()):
            return "the slot and agent views are not listed yet"
        if not self.scalers_followed:
            return "the ScaledObjects are not followed yet"
        return None

    def healthy(self) -> bool:
        """The liveness probe (``/healthz``): false only for a replica a restart could help, one connected to NATS
        whose views stay stale (wedged). Leading, or connected with views current since the last reconnect, is
        alive; so is a replica whose NATS is down: the client reconnects by itself, and a restart would only take
        every replica down at once during a broker outage (``/readyz`` reports it)."""
        if self.fleet.holds_shards() or not self.nc.is_connected:
            return True
        views = (self.store.slots, self.store.agents, self.scalers)
        return all(v.current() for v in views)

    def health(self) -> dict[str, Any]:
        reason = self.not_ready_reason()
        return {
            "ok": self.healthy(),
            "ready": reason is None,
            **({"reason": reason} if reason is not None else {}),
            "leader": self.fleet.holds_shards(),
            "identity": self.settings.identity,
            "shards": sorted(self.fleet.shards.held()) if self.fleet.shards is not None else [],
            "nats_connected": self.nc.is_connected,
            "views_current": {
                "slots": self.store.slots.current(),
                "agents": self.store.agents.current(),
                "scalers": self.scalers.current(),
            },
            "models": len(self.fleet.by_model),
        }

    # --- ControlPlane ---------------------------------------------------------------------------------------

    def spec_for(self, model: str) -> ScaledObjectSpec | None:
        c = self.fleet.by_model.get(model)
        return c.spec if c else None

    def models(self) -> list[str]:
        return sorted(self.fleet.by_model)

    async def set_override(self, model: str, override: Override | None) -> None:
        """Store the override (a new leader restores it) and apply it at once."""
        c = self.fleet.by_model[model]
        await self.overrides.save(model, override)
        c.set_override(override)

    def schedules_for(self, model: str) -> tuple[OnCallSchedule, ...]:
        c = self.fleet.by_model.get(model)
        return c.decider.oncall_schedules if c else ()

    async def set_schedules(self, model: str, schedules: tuple[OnCallSchedule, ...]) -> None:
        """Store the model's on-call schedules (a new owner restores them) and decide on them at once."""
        c = self.fleet.by_model[model]
        await self.stored_schedules.save(model, schedules)
        c.set_schedules(schedules)

    def status(self, model: str | None) -> list[StatusRow]:
        """Rows of every model this replica knows (all, or `model`), each naming its shard and, as last seen, the
        replica owning it (the command service keeps the ones it owns)."""
        now = self.clock()
        rows = []
        for m, c in sorted(self.fleet.by_model.items()):
            if model is None or m == model:
                owner = self.fleet.owner_of(m)
                rows.append(msgspec.structs.replace(c.status_row(now), owner=owner, shard=protocol.shard_of(m)))
        return rows

    # --- scalers --------------------------------------------------------------------------------------------

    def apply_scaler(self, key: str, record: ScalerRecord | None) -> None:
        """A ScaledObject appeared, changed, or (None) was deleted."""
        if record is None:
            c = self.fleet.remove(key)
            if c is not None:
                # Its series go from the scrape now; the retiring controller's last writes land on detached children.
                self.metrics.forget(c.model)
                log.info("ScaledObject %s removed: %s is no longer autoscaled; releasing its slots", key, c.model)
                self.retirement.retire(key, c)
            return
        record, cut = scaledobject.capped(record, self.settings.max_replicas)
        if cut is not None and self._cut.get(key) != record.updated_at:
            self._cut[key] = record.updated_at  # said once per version of the record
            log.warning("ScaledObject %s: %s", key, cut)
        model = record.spec.model
        owner = self.fleet.by_model.get(model)
        if owner is not None and owner.record.key != key:
            self.store.rejected(
                BadMessage("bad_value", f"{key} targets model {model}, already scaled by {owner.record.key}"),
                source=f"{protocol.SCALERS_BUCKET}/{key}",
            )
            return
        c = self.fleet.by_scaler.get(key)
        if c is not None and c.model != model:
            # Re-pointed at another model: a different controller (demand, slots, windows), not an update.
            self.apply_scaler(key, None)
            c = None
        if c is None:
            held = [r for r in self.store.records(model) if r.state in ("ready", "activating", "claimed")]
            shard = protocol.shard_of(model)
            # The controller acts while this replica holds the model's shard (fenced, checked at every act).
            deps = dataclasses.replace(self.deps, owns=functools.partial(self.fleet.owns_shard, shard))
            c = ModelController(record, deps, current_replicas=len(held))
            self.fleet.add(key, c)
            self.slot_events.slot_gauges(c)
            log.info("ScaledObject %s: autoscaling %s (%d slots held)", key, model, len(held))
            if self.fleet.owns_shard(shard):
                # Its shard was taken before the ScaledObject was seen (a start lists them in either order):
                # `Ownership.take_over` adopts and starts it after restoring its override, as for a new shard.
                self.ownership.arrived.add(model)
                self.ownership.take_over_soon()
        else:
            c.update_record(record)

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
        for key in set(self.fleet.by_scaler) - set(event.records):
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
            for key in set(self.fleet.by_scaler) - set(event.records):
                self.apply_scaler(key, None)
            for key, record in event.records.items():
                with self._contained(f"applying ScaledObject {key}"):
                    self.apply_scaler(key, record)
            self.scalers_followed = True
        elif isinstance(event, Changed):
            self.apply_scaler(event.key, event.record)
        else:
            self.apply_scaler(event.key, None)

    # --- housekeeping -----------------------------------------------------------------------------------------

    async def housekeeping(self, stop: asyncio.Event) -> None:
        every = self.settings.housekeeping_every_s
        stopped = asyncio.ensure_future(stop.wait())  # asyncio.wait: see LeaderElection.campaign
        try:
            while not stop.is_set():
                await asyncio.wait([stopped], timeout=every)
                await self.housekeeping_once()
        finally:
            stopped.cancel()

    async def tend_gc(self) -> None:
        """`GcTending.tend` with the settings in force, after young claims and a burst being taken (`stand_aside`)."""
        await self.intake.stand_aside(StandAside())
        self.gc.tend(self.settings.gc_freeze_every_s, self.settings.gc_full_every_s, followed=self.scalers_followed)

    async def housekeeping_once(self) -> None:
        now = self.clock()
        turns = max(1, round(self.settings.redecide_every_s / self.settings.housekeeping_every_s))
        self._tick += 1
        turn = self._tick % turns
        until = time.perf_counter() + self.settings.slice_s
        aside = StandAside()
        for c in list(self.fleet.by_model.values()):
            its_turn = protocol.shard_of(c.model, turns) == turn
            if not c.housekeeping_due(its_turn):
                continue  # nothing of it to look at between its turns (a fleet's steady models: most of them)
            if self.fleet.by_model.get(c.model) is not c or not c.deps.owns():
                continue  # its ScaledObject went (or was re-pointed) while we yielded, or another replica owns it
            with self._contained(f"housekeeping of {c.model}"):
                await c.housekeeping(now, decide=its_turn, forget_after_s=self.settings.forget_gateway_after_s)
            if time.perf_counter() >= until:  # a tick over 1,000 models is tens of ms: claims, samples go between
                await asyncio.sleep(0)
                await self.intake.stand_aside(aside)
                until = time.perf_counter() + self.settings.slice_s
                now = self.clock()
        if turn == 0:  # once per turn round: a scan of the leases and of the models
            with self._contained("the agent lease and model ownership gauges"):
                self._round_gauges(now)
        if self.fleet.held and self.scalers_followed and turn == 0:  # a scan of every slot: once per turn round
            with self._contained("the sweep for slots of deleted ScaledObjects"):
                self.retirement.sweep_unowned(now)

    def _round_gauges(self, now: float) -> None:
        """``pulsescale_agent_leases`` and, of them, ``pulsescale_agent_leases_lapsed`` (`KvSlotStore.lease_lapsed`:
        only on a current view, so a replica cut off from the broker does not call every agent stale); and
        ``pulsescale_model_owned`` of every model (which replica's decision gauges are current)."""
        nodes = list(self.store.index.leases())
        self.metrics.agent_leases.set(len(nodes))
        self.metrics.agent_leases_lapsed.set(sum(1 for node in nodes if self.store.index.lease_lapsed(node, now)))
        for c in self.fleet.by_model.values():
            c.scaler.series.owned.set(1 if c.deps.owns() else 0)

    # --- leadership (`autoscaler.ownership`) --------------------------------------------------------------------

    async def shutdown(self, campaign: asyncio.Task[None] | None = None) -> None:
        if self.retirement.retiring:
            await asyncio.wait(self.retirement.retiring, timeout=self.settings.controller.deactivate_timeout_s + 1.0)
        for c in list(self.fleet.by_model.values()):
            await c.stop(release_in_flight=True)
        if self.fleet.shards is not None:
            self.fleet.shards.halt()
        if campaign is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(campaign, 5)
        if self.fleet.shards is not None:
            self.ownership.resigning = True
            # The others take our shards at once, not after a lease (and it stops the watch).
            await self.fleet.shards.resign()


async def _quietly(close: Callable[[], Awaitable[None]]) -> None:
    with contextlib.suppress(Exception):
        await close()


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
        metrics.nats_connected.set_function(lambda: 1.0 if nc.is_connected else 0.0)
        # The autoscaler creates the buckets, and turns rollups off on those an older version made.
        buckets = await ensure_buckets(nc.jetstream(timeout=2.0), harden=True)
        store = KvSlotStore(
            nc,
            buckets,
            on_reject=lambda reason: metrics.registry_rejected.labels(reason).inc(),
            require_assignment=settings.require_assignment,
        )
        metrics.agent_clock_skew.source = store.index.clocks.skews
        opened.push_async_callback(store.close)
        await store.start()
        scaler = Autoscaler(settings, nc, store, buckets, metrics=metrics, cold_path=cold_path)
        lease = settings.lease
        # Lease rounds on their own, shorter timeout: a broker that vanished must not hold a round for the default
        # 5 s (the fence ends our terms on time anyway, but re-taking them would wait).
        leases_kv = await nc.jetstream(timeout=lease.renew_every_s * 2).key_value(protocol.LEASES_BUCKET)
        renewer = LeaseRenewer(settings.nats, kv_timeout_s=lease.renew_every_s * 2, main_ok=lambda: nc.is_connected)
        if settings.renew_on_own_thread:  # closed after the shards are resigned (`Autoscaler.shutdown`)
            await renewer.start()
            opened.push_async_callback(renewer.close)
        shards = scaler.fleet.shards = ShardLeases(
            leases_kv,
            settings.identity,
            ShardSettings(lease_s=lease.lease_s, renew_every_s=lease.renew_every_s, stop_fraction=lease.stop_fraction),
            on_acquired=scaler.ownership.on_shard_acquired,
            on_lost=scaler.ownership.on_shard_lost,
            count_models=scaler.fleet.models_owned,
            rejections=store.rejected,
            nc=nc,
            on_renewal=metrics.lease_renewal_seconds.observe,
            on_slack=metrics.lease_renewal_slack.observe,
            renewer=renewer,
        )
        metrics.watches.follow(store.slots, store.agents, scaler.scalers, shards.view, store.index.assigned)
        if settings.metrics_port is not None:
            runner, scaler.metrics_port = await serve_http(scaler, settings.metrics_host, settings.metrics_port)
            opened.push_async_callback(runner.cleanup)
            log.info("metrics on http://%s:%d/metrics", settings.metrics_host, scaler.metrics_port)
        # Samples on their own connection: what goes on `nc` (claims, replies, renewals) never queues behind them.
        samples_nc = await connect.connect(dataclasses.replace(settings.nats, name=f"{settings.nats.name}-samples"))
        opened.push_async_callback(_quietly, samples_nc.close)
        service = scaler.fleet.commands = commands.CommandService(
            nc,
            scaler,
            store,
            holds_shards=scaler.fleet.holds_shards,
            router=shards,
            rejections=scaler.rejections,  # counted in pulsescale_rejected_messages_total{reason}
            settings=commands.CommandSettings(max_replicas=settings.max_replicas),
        )
        campaign = asyncio.create_task(warm_then_campaign(
            scaler.ready, shards.campaign, stop, gc=scaler.gc, freeze_every_s=settings.gc_freeze_every_s,
            exposition=metrics.exposition, max_s=settings.warm_up_max_s), name="shards")  # fmt: skip
        tasks = [
            asyncio.create_task(scaler.scalers.run(), name="scalers-view"),
            asyncio.create_task(scaler.follow_scalers(stop), name="scalers"),
            asyncio.create_task(scaler.slot_events.follow_slots(stop), name="slots"),
            asyncio.create_task(scaler.housekeeping(stop), name="housekeeping"),
            asyncio.create_task(
                scaler.gc.keep(stop, lambda: scaler.settings.gc_freeze_every_s, scaler.tend_gc), name="gc"
            ),
            asyncio.create_task(scaler.intake.drain(), name="samples"),
            asyncio.create_task(scaler.intake.consume(scaler.subscriptions.queue), name="sample-taker"),
            asyncio.create_task(scaler.subscriptions.follow_subjects(samples_nc, stop), name="sample-subjects"),
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
