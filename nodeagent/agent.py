"""The node agent daemon: stage the weights, keep the slots warm and leased, activate and deactivate on request.

`run(settings, stop=...)` is the one place it starts: it connects, registers the slots (`prewarming`), and
spawns named root tasks: the heartbeat (the lease in `pulse_agents`), the registry watch, the initial prewarm,
the metrics server; and it serves ``pulse.agent.<node>.{prewarm,activate,deactivate,status}``. On stop
(SIGTERM) the lease is withdrawn first (the slots stop being claimable at once), then engines and zygotes are
stopped and the slots marked `failed` with the reason.

`Agent` is a composition along the daemon's seams:

- `requests.Requests`: subscribe per verb, decode, admit, de-duplicate, reply (typed, `warmpool.protocol`);
- `activation.Activator`: activate and deactivate, fenced by the claim, with the failure clean-up;
- `prewarm.Prewarmer`: stage, lock and arm, and keep slots warm (recover, restore, revive);
- `slot.SlotKeeper`: the slots themselves and the agent-side moves both of those make;
- and here what is left: the heartbeat, the watch (fencing from the registry side: an engine whose claim moved
  on is stopped; a deleted record is written again; an idle slot failed while the lease had lapsed is revived;
  a record under this node's keys for its model that is not one of its slots is deleted), the liveness probe of
  serving engines, the status, shutdown, and the HTTP server (``/metrics``, ``/healthz``, ``/status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web
from nats.aio.client import Client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from nodeagent import fetch, staging
from nodeagent.activation import Activator
from nodeagent.engine import loaders
from nodeagent.metrics import AgentMetrics
from nodeagent.prewarm import Prewarmer
from nodeagent.requests import Requests
from nodeagent.settings import AgentSettings
from nodeagent.slot import REGISTRY_ERRORS, Active, Slot, SlotKeeper
from warmpool import connect as nats_connect
from warmpool import protocol
from warmpool.errors import InvalidTransition, PulsescaleError, SlotNotFound, StaleToken
from warmpool.protocol import AgentLease, AgentStatusReply, SlotRecord, WeightsStatus
from warmpool.registry import Changed, KvSlotStore, Removed, Snapshot
from warmpool.tasks import cancel_and_wait

__all__ = ["Agent", "run"]

log = logging.getLogger("pulsescale.agent")

SWEEP_TIMEOUT_S = 10.0
"""Listing this node's keys at start (one filtered watch): a few records normally, read in milliseconds."""


class Agent:
    """One node's agent: the parts composed, and the loops and status that need all of them."""

    def __init__(
        self,
        settings: AgentSettings,
        nc: Client,
        store: KvSlotStore,
        metrics: AgentMetrics,
        session: aiohttp.ClientSession,
    ) -> None:
        """The agent's wall clock is its store's (`store.clock`): heartbeats, records and requests' expiry."""
        self.settings = settings
        self.clock = store.clock
        self.nc = nc
        self.store = store
        self.metrics = metrics
        loader, self.loader_reason = loaders.choose(settings.loader, staging_dir=str(settings.shm_dir))
        log.info("weights loader %s (--loader %s): %s", loader.name, settings.loader, self.loader_reason)
        self.keeper = SlotKeeper(settings, store, metrics, loader.name)
        self.prewarmer = Prewarmer(self.keeper)
        self.activator = Activator(self.keeper, session)
        self.requests = Requests(
            nc,
            settings.node,
            {
                "prewarm": self.prewarmer.on_prewarm,
                "activate": self.activator.on_activate,
                "deactivate": self.activator.on_deactivate,
                "status": self.on_status,
            },
            on_reject=lambda reason: metrics.rejected.labels(reason).inc(),
            spawn=self.keeper.spawn,
            max_in_flight=settings.max_requests_in_flight,
            max_status_in_flight=settings.max_status_in_flight,
            on_busy=lambda verb: metrics.busy.labels(verb).inc(),
            clock=self.clock,
        )
        self._correcting: set[str] = set()
        """Slots whose rewritten record is being written back (one task per slot)."""
        self._tamper_logged: dict[str, str] = {}
        """Slot -> the claim under which a rewrite was last logged (logged once per claim)."""
        self._reviving: set[str] = set()
        """Slots being written `warm` again after a release while our lease had lapsed (one task per slot)."""
        self._foreign: set[str] = set()
        """Keys under this node (for its model) that are not its slots, being deleted."""
        self._foreign_logged = False
        self.metrics_port: int | None = None
        """Where ``/metrics`` and ``/status`` are served, once they are (None: not served)."""
        self.started_at = time.monotonic()

    @property
    def slots(self) -> dict[str, Slot]:
        return self.keeper.slots

    @property
    def staged(self) -> staging.Staged | None:
        return self.keeper.staged

    @property
    def locked(self) -> staging.LockedWeights | None:
        return self.prewarmer.locked

    # --- loops ----------------------------------------------------------------------------------------------------

    async def heartbeat_loop(self) -> None:
        s = self.settings
        gpus = loaders.gpu_count()
        failing = False
        while True:
            lease = AgentLease(
                node=s.node,
                slots=list(self.slots),
                heartbeat_at=self.clock(),
                lease_s=s.lease_s,
                rack=s.rack,
                gpus=gpus,
                shm_free_bytes=loaders.shm_free_bytes(str(s.shm_dir)),
                heartbeat_every_s=s.heartbeat_interval_s,
            )
            try:
                await self.store.heartbeat(lease)
                if failing:
                    log.info("heartbeat written again")
                failing = False
                self.revive_released()  # back from away (frozen, partitioned): our slots are offered again
            except REGISTRY_ERRORS as err:
                if not failing:
                    log.warning("cannot write the lease (%s); retrying every %.1f s", err, s.heartbeat_interval_s)
                failing = True
            self.keeper.refresh_gauges()
            await asyncio.sleep(s.heartbeat_interval_s)

    async def watch_loop(self) -> None:
        """The registry's side of our slots: an engine whose claim no longer holds its slot is stopped, a slot
        record deleted under us is written again, and an idle slot failed behind our back is written `warm`."""
        k = self.keeper
        async for event in self.store.watch():
            if isinstance(event, Snapshot):
                changed = list(event.records.items())
                self.remove_foreign(list(event.records))
                for slot in self.slots.values():
                    if slot.key not in event.records:
                        k.spawn(self.prewarmer.restore(slot), name=f"restore-{slot.name}")
            elif isinstance(event, Changed):
                changed = [(event.key, event.record)]
                self.remove_foreign([event.key])
            elif isinstance(event, Removed):
                if (gone := k.by_key(event.key)) is not None:
                    k.spawn(self.prewarmer.restore(gone), name=f"restore-{gone.name}")
                continue
            else:
                continue
            for key, rec in changed:
                mine = k.by_key(key)
                if mine is not None:
                    self._reconcile(mine, rec)

    # --- records that are not ours ----------------------------------------------------------------------------------

    def _is_foreign(self, key: str) -> bool:
        """`key` is under this node for this agent's model (``<model>.<node>.*``) and is none of its slots."""
        s = self.settings
        return key.split(".")[:2] == [s.model_name, s.node] and self.keeper.by_key(key) is None

    def remove_foreign(self, keys: list[str]) -> None:
        """Delete the records among `keys` that are `_is_foreign`: whoever wrote them holds this node's permissions
        (a compromised or confused agent user), and the autoscaler would try each in vain at every scale-up."""
        for key in keys:
            if self._is_foreign(key) and key not in self._foreign:
                self._foreign.add(key)
                self.keeper.spawn(self._remove_foreign(key), name=f"remove-foreign-{key}")

    async def _remove_foreign(self, key: str) -> None:
        try:
            await self.store.unregister(key)
        except REGISTRY_ERRORS as err:
            log.warning("cannot delete %s (not a slot of this agent): %s", key, err)
            return
        finally:
            self._foreign.discard(key)
        self.metrics.foreign_records.inc()
        if not self._foreign_logged:  # once: a flood of them is the metric's to show, not the log's
            self._foreign_logged = True
            log.warning(
                "deleted %s: a record under node %s for model %s that is not one of its slots (%s); "
                "further ones are deleted and counted (pulsescale_agent_foreign_records_removed_total), not logged",
                key,
                self.settings.node,
                self.settings.model_name,
                ", ".join(self.slots),
            )

    async def sweep_foreign(self) -> None:
        """At start: every key under this node for its model, read from the bucket itself (a record the registry
        view refuses to decode is still a key the autoscaler lists), and those not ours deleted."""
        s = self.settings
        keys = []
        try:
            kv = await self.nc.jetstream().key_value(protocol.SLOTS_BUCKET)
            # A watch filtered by the server (nats-py's `keys(filters=)` lists every key and matches substrings).
            watcher = await kv.watch(f"{s.model_name}.{s.node}.>", ignore_deletes=True, meta_only=True)
            try:
                async with asyncio.timeout(SWEEP_TIMEOUT_S):
                    while (entry := await watcher.updates(timeout=SWEEP_TIMEOUT_S)) is not None:
                        keys.append(entry.key)
            finally:
                with contextlib.suppress(*REGISTRY_ERRORS):
                    await watcher.stop()
        except REGISTRY_ERRORS as err:
            log.warning("cannot list this node's keys to remove those not its own: %s", err)
        foreign = [k for k in keys if self._is_foreign(k)]
        if foreign:
            log.warning("%d record(s) under node %s are not its slots; deleting them", len(foreign), s.node)
        self.remove_foreign(foreign)

    # --- liveness of serving engines ------------------------------------------------------------------------------

    async def liveness_loop(self) -> None:
        """``GET`` of every serving engine's health path (`Started.health_path`: /health, or a standby server's
        ``--ready-path``) every `engine_probe_interval_s`; after `engine_probe_failures` failures in a row under
        the same claim the engine is stopped and its claim failed (`_unresponsive`). A process exit is noticed at
        once by its adapter; this is for one that is alive and does not answer (stopped with SIGSTOP by another
        process of the engine user, or wedged). Off the activation path: only slots that are `ready` under a claim
        are probed, and a slot whose lock is held (deactivating) is skipped."""
        s = self.settings
        misses: dict[str, tuple[Active, int]] = {}
        while True:
            await asyncio.sleep(s.engine_probe_interval_s)
            serving = [(x, x.active) for x in self.slots.values() if x.active is not None and not x.lock.locked()]
            results = await asyncio.gather(
                *(self._probe(a.started.endpoint, a.started.health_path) for _, a in serving)
            )
            for (slot, active), why in zip(serving, results, strict=True):
                if why is None or slot.active is not active:
                    misses.pop(slot.name, None)
                    continue
                prev = misses.get(slot.name)
                n = prev[1] + 1 if prev is not None and prev[0] is active else 1
                misses[slot.name] = (active, n)
                if n >= s.engine_probe_failures:
                    misses.pop(slot.name, None)
                    reason = f"engine unresponsive: {n} liveness probes in a row failed, last: {why}"
                    self.keeper.spawn(self._unresponsive(slot, active, reason), name=f"unresponsive-{slot.name}")

    async def _probe(self, endpoint: str, path: str) -> str | None:
        """Why `endpoint` is not alive (None: ``GET`` of its health `path` answered 200 in time)."""
        timeout_s = self.settings.engine_probe_timeout_s
        try:
            async with self.activator.session.get(
                f"{endpoint}{path}", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as r:
                return None if r.status == 200 else f"{path} answered {r.status}"
        except TimeoutError:
            return f"{path} did not answer within {timeout_s * 1e3:.0f} ms"
        except aiohttp.ClientError as err:
            return f"{path}: {type(err).__name__}: {err}"

    async def _unresponsive(self, slot: Slot, active: Active, reason: str) -> None:
        """Stop an engine that stopped answering, fail its claim (released: the autoscaler replaces the replica),
        then re-arm the slot, bounded by its failures in a row as after an engine death."""
        k = self.keeper
        async with slot.held("stopping an unresponsive engine"):
            if slot.active is not active:
                return  # deactivated or fenced meanwhile
            log.warning("slot %s: %s; stopping it (token %d)", slot.key, reason, active.token)
            k.metrics.engines_unresponsive.inc()
            slot.active = None
            engine = slot.engine
            if engine is not None:
                await engine.reset()  # killed, not asked: a sleep hook would wait on the wedged server
            slot.failures += 1
            slot.phase, slot.reason = "failed", reason
            with contextlib.suppress(StaleToken, InvalidTransition, *REGISTRY_ERRORS):
                await k.store.advance(active.claim, "failed", reason=reason, claim_id=None, endpoint=None)
            k.refresh_gauges()
        if slot.failures >= k.settings.max_consecutive_failures:
            await k.fail(slot, f"{slot.failures} failures in a row, last: {reason}; send prewarm to retry")
        elif k.staged is not None:
            await self.prewarmer.arm(slot, k.staged)

    def _reconcile(self, slot: Slot, rec: SlotRecord) -> None:
        k = self.keeper
        if slot.active is not None and rec.claim_id != slot.active.claim_id:
            k.spawn(self._fence(slot), name=f"fence-{slot.name}")
        elif _tampered(slot, rec) is not None:
            if slot.name not in self._correcting:
                self._correcting.add(slot.name)
                k.spawn(self._correct(slot), name=f"correct-{slot.name}")
        elif rec.state == "failed" and rec.claim_id is None and slot.idle and not k.stopping:
            # Released while our lease had lapsed (the registry fails such a slot): we are back, it is warm.
            self._revive(slot)

    async def _fence(self, slot: Slot) -> None:
        """Stop the engine of a claim released or superseded in the registry; a claim released while our lease
        had lapsed left the slot `failed` (the registry cannot tell a dead agent from a slow one), and with its
        engine stopped and re-armed it is idle again: written `warm` now, not left failed until a restart."""
        await self.activator.fence(slot)
        hit = self.keeper.record(slot)
        if hit is not None and hit[0].state == "failed" and hit[0].claim_id is None and slot.idle:
            self._revive(slot)

    def _revive(self, slot: Slot) -> None:
        """`Prewarmer.revive` the slot, one task per slot at a time."""
        if slot.name in self._reviving or self.keeper.stopping:
            return
        self._reviving.add(slot.name)

        async def revive() -> None:
            try:
                await self.prewarmer.revive(slot)
            finally:
                self._reviving.discard(slot.name)

        self.keeper.spawn(revive(), name=f"revive-{slot.name}")

    def revive_released(self) -> None:
        """After each heartbeat written: every idle slot of ours that the registry shows `failed` with no claim
        (released while our lease had lapsed) is written `warm`, whatever order the watch events came in while we
        were away (one that arrived while the slot was busy finds it idle now)."""
        for slot in self.slots.values():
            hit = self.keeper.record(slot)
            if hit is not None and hit[0].state == "failed" and hit[0].claim_id is None and slot.idle:
                self._revive(slot)

    async def _correct(self, slot: Slot) -> None:
        """Someone else rewrote our ready record's serving fields under our claim (a KV writer steering traffic):
        write the true endpoint back, fenced by the claim (compare-and-set as its holder), until the view agrees.
        A rewritten token cannot be written back (the fencing check itself reads it): stop serving and fail the
        slot instead. Logged once per claim, counted every time."""
        k = self.keeper
        try:
            while True:
                active, hit = slot.active, k.record(slot)
                if active is None or hit is None or (what := _tampered(slot, hit[0])) is None:
                    return
                if self._tamper_logged.get(slot.name) != active.claim_id:
                    self._tamper_logged[slot.name] = active.claim_id
                    log.warning(
                        "slot %s: its ready record was rewritten under our claim (%s); %s",
                        slot.key,
                        what,
                        "fencing it" if hit[0].token != active.token else f"writing {active.started.endpoint} back",
                    )
                if hit[0].token != active.token:
                    k.metrics.record_corrections.labels("fenced").inc()
                    async with slot.held("fencing a rewritten record"):
                        if slot.active is active:
                            await k.stop_engine(slot, "its record's token was rewritten by another writer")
                            await k.fail(slot, f"slot record rewritten under its claim ({what}); send prewarm")
                    return
                try:
                    active.claim = await k.store.advance(active.claim, "ready", endpoint=active.started.endpoint)
                except (StaleToken, InvalidTransition):
                    return  # released or moved on meanwhile: the watch fences as usual
                except REGISTRY_ERRORS as err:
                    log.warning("slot %s: cannot write the true endpoint back: %s", slot.key, err)
                    return  # the next watch event of the record tries again
                k.metrics.record_corrections.labels("corrected").inc()
        finally:
            self._correcting.discard(slot.name)

    # --- status ---------------------------------------------------------------------------------------------------

    async def on_status(self, req: protocol.AgentStatusRequest, t_recv: float) -> AgentStatusReply:
        return self.status(req.slot)

    def status(self, only: str | None = None) -> AgentStatusReply:
        s, k = self.settings, self.keeper
        staged, locked = k.staged, self.prewarmer.locked
        weights = WeightsStatus(
            model=s.model_name,
            source=fetch.shown(s.model_url) if s.model_url else str(s.model_dir),
            staged_dir=str(staged.dir) if staged else None,
            files=len(staged.files) if staged else 0,
            staged_bytes=staged.weights_bytes if staged else 0,
            staged_at=staged.staged_at if staged else None,
            locked=bool(locked and locked.locked),
            locked_bytes=locked.locked_bytes if locked else 0,
            lock_error=locked.error if locked else None,
            error=k.staging_error,
            hashed_bytes=staged.hashed_bytes if staged else 0,
            budget_bytes=s.shm_budget_bytes,
            progress=round(self.prewarmer.progress.fraction, 4) if self.prewarmer.progress else None,
        )
        chosen = [x for x in self.slots.values() if only is None or x.name == only]
        return AgentStatusReply(
            node=s.node,
            rack=s.rack,
            engine=s.engine,
            engine_memory=s.engine_memory,
            loader=k.loader,
            loader_reason=self.loader_reason,
            weights=weights,
            unlocked=bool(locked and locked.error),
            slots=[x.status(k.store.record(x.key)) for x in chosen],
            uptime_s=round(time.monotonic() - self.started_at, 1),
            rootfs=self.prewarmer.rootfs.status(),
        )

    # --- shutdown --------------------------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        k = self.keeper
        k.stopping = True
        with contextlib.suppress(*REGISTRY_ERRORS):
            await self.store.withdraw(self.settings.node)  # first: no new claims while we go
        await self.requests.unsubscribe()
        await k.cancel_tasks()
        await asyncio.gather(*(x.engine.close() for x in self.slots.values() if x.engine), return_exceptions=True)
        reason = f"agent on {self.settings.node} stopped at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
        for slot in self.slots.values():
            slot.active = None
            with contextlib.suppress(*REGISTRY_ERRORS, InvalidTransition, SlotNotFound):
                await self.store.set_state(
                    slot.key, "failed", reason=reason, claim_id=None, endpoint=None, weights_resident=False
                )
        self.prewarmer.release()


def _tampered(slot: Slot, rec: SlotRecord) -> str | None:
    """What another writer changed in the ready record of the claim this slot serves under, or None."""
    active = slot.active
    if active is None or rec.state != "ready" or rec.claim_id != active.claim_id:
        return None
    if rec.token != active.token:
        return f"token {rec.token}, ours is {active.token}"
    if rec.endpoint != active.started.endpoint:
        return f"endpoint {rec.endpoint!r}, ours is {active.started.endpoint}"
    return None


async def _http_server(agent: Agent, host: str, port: int) -> tuple[web.AppRunner, int]:
    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(agent.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        ok = agent.nc.is_connected
        return web.json_response({"ok": ok, "nats_connected": agent.nc.is_connected}, status=200 if ok else 503)

    async def status(_: web.Request) -> web.Response:
        return web.Response(body=protocol.encode(agent.status()), content_type="application/json")

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/healthz", healthz), web.get("/status", status)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    addresses = runner.addresses
    return runner, int(addresses[0][1]) if addresses else port


async def run(
    settings: AgentSettings,
    *,
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
    registry: CollectorRegistry | None = None,
    on_started: Callable[[Agent, int | None], None] | None = None,
    clock: Callable[[], float] = time.time,
) -> None:
    """Run the agent until `stop` is set. `ready` is set once requests are served (staging may still run);
    `on_started(agent, metrics_port)` lets a caller (tests, the CLI) see the live agent. `clock` is the node's wall
    clock (tests set one off from the autoscaler's: contract revision 10)."""
    metrics = AgentMetrics(registry if registry is not None else CollectorRegistry())
    nc = await nats_connect.connect(settings.nats)
    metrics.nats_connected.set_function(lambda: 1.0 if nc.is_connected else 0.0)
    runner: web.AppRunner | None = None
    agent: Agent | None = None
    store: KvSlotStore | None = None
    roots: list[asyncio.Task[None]] = []
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=None)
    )
    try:
        store = await KvSlotStore.open(
            nc, clock=clock, on_reject=lambda reason: metrics.registry_rejected.labels(reason).inc()
        )
        await store.start()
        agent = Agent(settings, nc, store, metrics, session)
        await agent.prewarmer.register_all()
        await agent.sweep_foreign()
        await agent.requests.subscribe()
        roots += [
            asyncio.create_task(agent.heartbeat_loop(), name="agent-heartbeat"),
            asyncio.create_task(agent.watch_loop(), name="agent-watch"),
        ]
        if settings.engine_probe_interval_s > 0:
            roots.append(asyncio.create_task(agent.liveness_loop(), name="agent-liveness"))
        agent.prewarmer.start(list(agent.slots))
        if settings.metrics_port is not None:
            try:
                runner, agent.metrics_port = await _http_server(agent, settings.metrics_host, settings.metrics_port)
            except OSError as err:
                raise PulsescaleError(
                    f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: {err.strerror or err}; "
                    "pick another --metrics-port (0 = any free port, -1 = off)"
                ) from None
            log.info("metrics on http://%s:%d/metrics", settings.metrics_host, agent.metrics_port)
        if on_started is not None:
            on_started(agent, agent.metrics_port)
        if ready is not None:
            ready.set()
        stopped = asyncio.create_task(stop.wait(), name="agent-stop")
        done, _ = await asyncio.wait([stopped, *roots], return_when=asyncio.FIRST_COMPLETED)
        await cancel_and_wait(roots)
        if stopped not in done:
            stopped.cancel()
            crashed = next(iter(done))
            raise RuntimeError(f"root task {crashed.get_name()} ended: {crashed.exception()!r}")
    finally:
        await cancel_and_wait(roots)  # a start that failed half-way too: no heartbeat outlives the agent
        if agent is not None:
            await agent.shutdown()
        if runner is not None:
            await runner.cleanup()
        await session.close()
        if store is not None:
            await store.close()
        with contextlib.suppress(Exception):
            await nc.close()
    log.info("agent on %s stopped", settings.node)
