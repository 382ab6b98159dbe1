"""`pulsescale autoscaler`: the daemon. One `run(settings, stop=...)` starts everything, as named root tasks.

Every replica ingests samples, follows the ScaledObjects in `pulse_scalers` and the slots in `pulse_slots`, and
runs the policy, so a standby's windows are full when it takes over. Only the leader (lease in `pulse_leases`)
claims, activates, releases, and answers on-call commands. A new leader adopts the slots its predecessor held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from prometheus_client import start_http_server

from autoscaler import commands, policy
from autoscaler.controller import ColdPath, ControllerSettings, Deps, LocalColdPath, ModelController
from autoscaler.leader import LeaderElection, LeaseSettings
from autoscaler.metrics import AutoscalerMetrics
from warmpool import connect, protocol
from warmpool.errors import BadMessage
from warmpool.protocol import QueueSample, ScaledObjectSpec, ScalerRecord
from warmpool.registry import Changed, KvSlotStore, Removed, Snapshot, ensure_buckets
from warmpool.rejects import Rejections

__all__ = ["Autoscaler", "AutoscalerSettings", "run"]

log = logging.getLogger("pulsescale.autoscaler")

_OVERRIDE_PREFIX = "override."  # keys in pulse_leases holding on-call overrides, so a new leader keeps them


@dataclass(frozen=True)
class AutoscalerSettings:
    nats: connect.NatsOptions = field(default_factory=connect.NatsOptions)
    identity: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    """Unique per process: two replicas must never mistake each other's lease for their own."""
    metrics_port: int | None = None
    """Prometheus scrape port; None serves no metrics endpoint (tests read the registry directly)."""
    lease: LeaseSettings = field(default_factory=LeaseSettings)
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    housekeeping_every_s: float = 0.25
    """Time-driven checks (override expiry, stale gateways, dead agents). Decisions themselves run on samples."""
    forget_gateway_after_s: float = 300.0
    """A gateway silent this long is dropped from memory (it left the sum long before)."""


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
    ) -> None:
        self.settings = settings
        self.nc = nc
        self.store = store
        self.metrics = metrics or AutoscalerMetrics()
        self.rejections = Rejections(log, on_reject=lambda r: self.metrics.rejected.labels(r).inc())
        self.leader: LeaderElection | None = None
        self.deps = Deps(
            nc=nc,
            store=store,
            metrics=self.metrics,
            cold_path=cold_path or LocalColdPath(),
            is_leader=self.is_leader,
            settings=settings.controller,
        )
        self.by_scaler: dict[str, ModelController] = {}
        self.by_model: dict[str, ModelController] = {}
        self._leases_kv = buckets[protocol.LEASES_BUCKET]
        self._scalers_kv = buckets[protocol.SCALERS_BUCKET]
        self._takeover: asyncio.Task[None] | None = None  # held so the task is not garbage-collected mid-run
        self._handled = 0
        self.commands: commands.CommandService | None = None

    @contextlib.contextmanager
    def _contained(self, what: str) -> Iterator[None]:
        """A bug in one model's handling must not take the daemon (and every other model) down with it."""
        try:
            yield
        except Exception:
            log.exception("internal error in %s; carrying on", what)
            self.metrics.internal_errors.inc()

    def is_leader(self) -> bool:
        return self.leader is not None and self.leader.is_leader

    # --- ControlPlane ---------------------------------------------------------------------------------------

    def spec_for(self, model: str) -> ScaledObjectSpec | None:
        c = self.by_model.get(model)
        return c.spec if c else None

    def models(self) -> list[str]:
        return sorted(self.by_model)

    async def set_override(self, model: str, override: policy.Override | None) -> None:
        c = self.by_model[model]
        key = _OVERRIDE_PREFIX + model
        if override is None:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                await self._leases_kv.delete(key)
        else:
            data = msgspec.json.encode(
                {
                    "kind": override.kind,
                    "replicas": override.replicas,
                    "expires_at": override.expires_at,
                    "by": override.by,
                }
            )
            await self._leases_kv.put(key, data)
        c.override = override
        c.evaluate(time.time())

    def status(self, model: str | None) -> list[dict[str, Any]]:
        rows = [c.status_row() for m, c in sorted(self.by_model.items()) if model is None or m == model]
        return rows

    # --- scalers --------------------------------------------------------------------------------------------

    def apply_scaler(self, key: str, data: bytes | None) -> None:
        if data is None:
            c = self.by_scaler.pop(key, None)
            if c is not None:
                self.by_model.pop(c.model, None)
                log.info("ScaledObject %s removed: %s is no longer autoscaled (its slots keep serving)", key, c.model)
                task = asyncio.ensure_future(c.stop(release_in_flight=True))
                task.add_done_callback(lambda t: t.exception())
            return
        try:
            record = protocol.decode(data, ScalerRecord)
        except BadMessage as err:
            self.rejections(err, source=f"{protocol.SCALERS_BUCKET}/{key}")
            return
        model = record.spec.model
        owner = self.by_model.get(model)
        if owner is not None and owner.record.key != key:
            self.rejections(
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
            c = ModelController(record, self.deps, current_replicas=len(held))
            self.by_scaler[key] = c
            self.by_model[model] = c
            log.info("ScaledObject %s: autoscaling %s (%d slots held)", key, model, len(held))
            if self.is_leader():
                c.adopt(self.store.records(model))
                c.start()
        else:
            c.update_record(record)

    async def follow_scalers(self, stop: asyncio.Event) -> None:
        kv = self._scalers_kv
        while not stop.is_set():
            reconnects = self.nc.stats["reconnects"]
            try:
                watcher = await kv.watchall()
            except (nats.errors.Error, TimeoutError):
                await asyncio.sleep(0.25)
                continue
            seen: set[str] = set()
            snapshot = True
            try:
                while not stop.is_set() and self.nc.stats["reconnects"] == reconnects:
                    try:
                        entry = await watcher.updates(timeout=0.25)
                    except nats.errors.TimeoutError:
                        continue
                    if entry is None:
                        if snapshot:  # after a re-list, scalers deleted meanwhile are gone
                            for key in set(self.by_scaler) - seen:
                                self.apply_scaler(key, None)
                        snapshot = False
                        continue
                    if not hasattr(entry, "key"):
                        break
                    seen.add(entry.key)
                    deleted = entry.operation in ("DEL", "PURGE")
                    with self._contained(f"applying ScaledObject {entry.key}"):
                        self.apply_scaler(entry.key, None if deleted else entry.value)
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()

    # --- samples ----------------------------------------------------------------------------------------------

    async def on_queue_msg(self, msg: Msg) -> None:
        self._handled += 1
        if self._handled % 256 == 0:
            # nats-py runs this callback back to back while samples are queued, and it never awaits: let the
            # lease renewal and the claims in flight run, or a flood of samples would cost us the lease.
            await asyncio.sleep(0)
        now = time.time()
        try:
            sample = protocol.decode(msg.data, QueueSample)
            if msg.subject != protocol.QUEUE_PREFIX + sample.model:
                raise BadMessage("subject_mismatch", f"sample for {sample.model} published on {msg.subject}")
        except BadMessage as err:
            self.metrics.samples.labels("rejected").inc()
            self.rejections(err, source=msg.subject)
            return
        c = self.by_model.get(sample.model)
        if c is None:
            self.metrics.samples.labels("no_scaler").inc()
            return
        with self._contained(f"a sample of {sample.model}"):
            self.metrics.samples.labels(c.on_sample(sample, now)).inc()

    # --- slots ------------------------------------------------------------------------------------------------

    async def follow_slots(self, stop: asyncio.Event) -> None:
        async for event in self.store.watch():
            if stop.is_set():
                return
            with self._contained("a slot change"):
                self._on_slot_event(event)

    def _on_slot_event(self, event: Snapshot | Changed | Removed) -> None:
        if isinstance(event, Snapshot):
            for c in self.by_model.values():
                for key in list(c.held):
                    c.on_slot_change(key, event.records.get(key))
        elif isinstance(event, Changed):
            c = self.by_model.get(event.record.model)
            if c is not None:
                c.on_slot_change(event.key, event.record)
        elif isinstance(event, Removed):
            model = event.key.split(".", 1)[0]
            c = self.by_model.get(model)
            if c is not None:
                c.on_slot_change(event.key, None)

    def _slot_gauges(self) -> None:
        counts: dict[tuple[str, str], int] = {}
        for rec in self.store.records():
            counts[(rec.model, rec.state)] = counts.get((rec.model, rec.state), 0) + 1
        for model in self.by_model:
            for state in protocol.SLOT_STATES:
                self.metrics.slots.labels(model, state).set(counts.get((model, state), 0))

    async def housekeeping(self, stop: asyncio.Event) -> None:
        every = self.settings.housekeeping_every_s
        stopped = asyncio.ensure_future(stop.wait())  # asyncio.wait: see LeaderElection.campaign
        while not stop.is_set():
            await asyncio.wait([stopped], timeout=every)
            now = time.time()
            self.metrics.leader.set(1 if self.is_leader() else 0)
            for c in list(self.by_model.values()):
                with self._contained(f"housekeeping of {c.model}"):
                    c.demand.forget_stale(now, self.settings.forget_gateway_after_s)
                    await c.housekeeping(now)
            with self._contained("slot gauges"):
                self._slot_gauges()

    # --- leadership ---------------------------------------------------------------------------------------------

    def on_elected(self) -> None:
        self._takeover = asyncio.ensure_future(self.take_over())
        if self.commands is not None:
            self.commands.on_leadership(True)

    async def take_over(self) -> None:
        """Rebuild from the buckets: adopt held slots, restore overrides, then act."""
        overrides = await self._load_overrides()
        if not self.is_leader():
            return  # deposed while reading: the next leader adopts, not us
        for model, c in list(self.by_model.items()):
            c.adopt(self.store.records(model))
            if model in overrides:
                c.override = overrides[model]
            c.start()
            c.evaluate(time.time())
        log.info("leader: acting for %d model(s)", len(self.by_model))

    async def _load_overrides(self) -> dict[str, policy.Override]:
        out: dict[str, policy.Override] = {}
        try:
            keys = await self._leases_kv.keys()
        except (nats.js.errors.NoKeysError, nats.errors.Error, TimeoutError):
            return out
        for key in keys:
            if not key.startswith(_OVERRIDE_PREFIX):
                continue
            with contextlib.suppress(Exception):
                entry = await self._leases_kv.get(key)
                d = msgspec.json.decode(entry.value)
                out[key.removeprefix(_OVERRIDE_PREFIX)] = policy.Override(
                    kind=d["kind"], replicas=d["replicas"], expires_at=d["expires_at"], by=d.get("by", "")
                )
        return out

    def on_deposed(self) -> None:
        # Stop acting at once; claims in flight are left for the next leader to adopt or expire.
        if self.commands is not None:
            self.commands.on_leadership(False)
        for c in list(self.by_model.values()):
            task = asyncio.ensure_future(c.stop(release_in_flight=False))
            task.add_done_callback(lambda t, c=c: (t.exception(), c.forget_claims()))

    async def shutdown(self, campaign: asyncio.Task[None] | None = None) -> None:
        for c in list(self.by_model.values()):
            await c.stop(release_in_flight=True)
        if self.leader is not None:
            self.leader.halt()
        if campaign is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(campaign, 5)
        if self.leader is not None:
            await self.leader.resign()


async def run(
    settings: AutoscalerSettings,
    *,
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
    metrics: AutoscalerMetrics | None = None,
    cold_path: ColdPath | None = None,
) -> Autoscaler:
    """Run until `stop` is set; SIGTERM handling is the caller's (signal handlers belong to the main thread)."""
    nc = await connect.connect(settings.nats)
    buckets = await ensure_buckets(nc.jetstream(timeout=2.0))
    store = KvSlotStore(nc, buckets)
    await store.start()
    scaler = Autoscaler(settings, nc, store, buckets, metrics=metrics, cold_path=cold_path)
    scaler.leader = LeaderElection(
        buckets[protocol.LEASES_BUCKET],
        settings.identity,
        settings.lease,
        on_elected=scaler.on_elected,
        on_deposed=scaler.on_deposed,
    )
    if settings.metrics_port is not None:
        start_http_server(settings.metrics_port, registry=scaler.metrics.registry)
    sub = await nc.subscribe(protocol.QUEUE_WILDCARD, cb=scaler.on_queue_msg, pending_msgs_limit=1_000_000)
    service = scaler.commands = commands.CommandService(nc, scaler, store, is_leader=scaler.is_leader)
    tasks = [
        asyncio.create_task(scaler.follow_scalers(stop), name="scalers"),
        asyncio.create_task(scaler.follow_slots(stop), name="slots"),
        asyncio.create_task(scaler.housekeeping(stop), name="housekeeping"),
        asyncio.create_task(scaler.leader.campaign(stop), name="leader"),
    ]
    await service.start()
    if ready is not None:
        ready.set()
    try:
        done, _ = await asyncio.wait([asyncio.create_task(stop.wait()), *tasks], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t in tasks and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        with contextlib.suppress(Exception):
            await service.stop()
        await scaler.shutdown(campaign=tasks[3])
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await store.close()
        with contextlib.suppress(Exception):
            await nc.drain()
    return scaler
