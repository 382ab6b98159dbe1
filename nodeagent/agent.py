"""The node agent daemon: stage the weights, keep the slots warm and leased, activate and deactivate on request.

`run(settings, stop=...)` is the one place it starts: it connects, registers the slots (`prewarming`), and
spawns named root tasks: the heartbeat (the lease in `pulse_agents`), the registry watch (fencing: an engine
whose claim moved on is stopped), the initial prewarm (stage, verify, lock, arm a zygote per slot, then `warm`),
the metrics server; and it serves ``pulse.agent.<node>.{prewarm,activate,deactivate,status}``. Each request is
handled in its own task, so a slow activation never delays another slot or a status call; a slot's requests are
serialised by its lock. A bad message is counted, logged at a bounded rate and answered; it never stops the
daemon. On stop (SIGTERM) the lease is withdrawn first (the slots stop being claimable at once), then engines
and zygotes are stopped and the slots marked `failed` with the reason.

The activation path does no work that can be done before: the zygote has imported everything, the weights are
staged, verified and locked, and the slot's record (with its revision) comes from the registry watch, so the
token check costs one compare-and-set.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import nats.errors
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from nodeagent import modelformat, readiness, staging
from nodeagent.engine import Started, loaders
from nodeagent.engine import local as local_engine
from nodeagent.errors import ActivationRefused, BadWeights, EngineFailed
from nodeagent.forked import ForkedEngine
from nodeagent.metrics import AgentMetrics
from nodeagent.settings import AgentSettings
from warmpool import connect as nats_connect
from warmpool import protocol, slots
from warmpool.errors import (
    BadMessage,
    ClaimConflict,
    DuplicateRequest,
    InvalidTransition,
    PulsescaleError,
    SlotNotFound,
    StaleToken,
)
from warmpool.protocol import AgentLease, SlotRecord, StageTimings
from warmpool.registry import Changed, Claim, KvSlotStore, Removed, Snapshot
from warmpool.rejects import Rejections

__all__ = ["Agent", "run"]

log = logging.getLogger("pulsescale.agent")

REGISTRY_ERRORS = (nats.errors.Error, TimeoutError, OSError, ClaimConflict)
"""What a registry call raises when the broker is away or contended: logged and retried, never fatal."""


@dataclass
class Active:
    """The engine a slot serves with, and the claim it serves under."""

    claim: Claim
    started: Started
    timings: StageTimings

    @property
    def token(self) -> int:
        return self.claim.token

    @property
    def claim_id(self) -> str:
        return self.claim.claim_id


class Slot:
    def __init__(self, agent: Agent, name: str, index: int) -> None:
        s = agent.settings
        self.name = name
        self.key = protocol.slot_key(s.model_name, s.node, name)
        self.port = s.engine_port_base + index if s.engine_port_base else 0
        self.lock = asyncio.Lock()
        self.phase = "prewarming"
        """Local readiness: ``prewarming`` | ``warm`` (armed, weights staged) | ``active`` | ``failed``."""
        self.reason: str | None = None
        self.highest_token = 0
        self.active: Active | None = None
        self.failures = 0
        self.activations = 0
        self.last_timings: StageTimings | None = None
        self.engine: ForkedEngine | None = None
        self.busy: str | None = None
        """What holds the lock now (re-arming, deactivating...): named when an activation cannot wait for it."""

    @contextlib.asynccontextmanager
    async def held(self, what: str) -> AsyncIterator[None]:
        """The slot's lock, with `what` it is held for."""
        async with self.lock:
            self.busy = what
            try:
                yield
            finally:
                self.busy = None

    def status(self, record: SlotRecord | None) -> dict[str, Any]:
        return {
            "slot": self.name,
            "key": self.key,
            "phase": self.phase,
            "state": record.state if record else None,
            "reason": self.reason or (record.reason if record else None),
            "highest_token": self.highest_token,
            "claim_id": self.active.claim_id if self.active else None,
            "endpoint": self.active.started.endpoint if self.active else None,
            "activations": self.activations,
            "consecutive_failures": self.failures,
            "last_timings": msgspec.structs.asdict(self.last_timings) if self.last_timings else None,
            "engine": self.engine.status() if self.engine else None,
        }


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        nc: Client,
        store: KvSlotStore,
        metrics: AgentMetrics,
        session: aiohttp.ClientSession,
    ) -> None:
        self.settings = settings
        self.nc = nc
        self.store = store
        self.metrics = metrics
        self.session = session
        self.loader, self.loader_reason = loaders.choose(settings.loader)
        self.slots = {name: Slot(self, name, i) for i, name in enumerate(settings.slot_names)}
        self.staged: staging.Staged | None = None
        self.locked: staging.LockedWeights | None = None
        self.staging_error: str | None = None
        self.ledger = protocol.RequestLedger()
        self.rejected = Rejections(log, on_reject=lambda reason: metrics.rejected.labels(reason).inc())
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._subs: list[Subscription] = []
        self._prewarm: asyncio.Task[None] | None = None
        self._stopping = False
        self.started_at = time.time()

    # --- helpers -----------------------------------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    def record(self, slot: Slot) -> tuple[SlotRecord, int] | None:
        return self.store.entry(slot.key)

    def refresh_gauges(self) -> None:
        counts = dict.fromkeys(protocol.SLOT_STATES, 0)
        for slot in self.slots.values():
            hit = self.record(slot)
            if hit is not None:
                counts[hit[0].state] += 1
        for state, n in counts.items():
            self.metrics.slots.labels(state).set(n)

    def engine_spec(self, slot: Slot, staged: staging.Staged) -> dict[str, Any]:
        s = self.settings
        return {
            "engine": s.engine,
            "loader": self.loader.name,
            "model_dir": str(staged.dir),
            "files": [str(f.path) for f in staged.weights],
            "model_name": s.model_name,
            "host": s.engine_host,
            "private": s.engine_memory == "private",
            "fault": s.faults.get(slot.name),
            "slot": slot.name,
            "version": staged.version,  # a zygote armed for another version is re-armed before it serves
        }

    def _check_model(self, pending: staging.Staged) -> None:
        """Vets a new staged set before it replaces the old one: the engine's config against the tensors."""
        cfg = local_engine.read_config_file(pending.path_of(modelformat.CONFIG_FILE))
        local_engine.check_model(cfg, pending.shapes())

    # --- start-up and prewarm ------------------------------------------------------------------------------------

    async def register_all(self) -> None:
        now = time.time()
        for slot in self.slots.values():
            rec = SlotRecord(
                model=self.settings.model_name,
                node=self.settings.node,
                slot=slot.name,
                state="prewarming",
                rack=self.settings.rack,
                updated_at=now,
            )
            await self.store.register(rec)
        self.refresh_gauges()

    async def prewarm(self, names: list[str]) -> None:
        """Stage (or re-verify) the weights, lock them, arm the named slots' zygotes, then mark them `warm`."""
        targets = [self.slots[n] for n in names if self.slots[n].active is None]
        for slot in targets:
            slot.phase = "prewarming"
            await self._set_state(slot, "prewarming", reason=None, weights_resident=False)
        s = self.settings
        t0 = time.perf_counter()
        try:
            # All or nothing: on failure the staged files, `self.staged` and the zygotes' specs stay on the
            # complete previous set.
            staged = await asyncio.to_thread(
                staging.stage,
                s.model_dir,
                s.shm_dir,
                s.model_name,
                threads=s.stage_threads,
                check=self._check_model,
            )
        except Exception as err:  # noqa: BLE001 - whatever it is, the slots must not stay `prewarming`
            await self._staging_failed(targets, f"staging failed: {_describe(err)}")
            return
        self.staged = staged  # what the staged files on disk now are
        try:
            # Re-uses the mappings of unchanged files and unlocks the rest before locking anything new, so the
            # weights never count twice against RLIMIT_MEMLOCK.
            locked = await asyncio.to_thread(
                staging.lock, [f.path for f in staged.weights], want_lock=s.lock_weights, previous=self.locked
            )
        except Exception as err:  # noqa: BLE001
            self.locked = None
            await self._staging_failed(targets, f"cannot map the staged weights: {_describe(err)}")
            return
        self.locked = locked
        self.staging_error = None
        took = time.perf_counter() - t0
        self.metrics.staging_seconds.set(took)
        self.metrics.staged_bytes.set(staged.weights_bytes)
        self.metrics.locked_bytes.set(locked.locked_bytes)
        self.metrics.lock_refused.set(1 if locked.error else 0)
        log.info(
            "staged %s: %d file(s), %.1f MiB (%.1f MiB copied) in %.2f s; %s",
            s.model_name,
            len(staged.files),
            staged.nbytes / 2**20,
            staged.copied_bytes / 2**20,
            took,
            f"locked {locked.locked_bytes / 2**20:.1f} MiB" if locked.error is None else locked.error,
        )
        await asyncio.gather(*(self._arm(slot, staged) for slot in targets))

    async def _staging_failed(self, targets: list[Slot], reason: str) -> None:
        self.staging_error = reason
        log.error("%s", reason)
        for slot in targets:
            await self._fail(slot, reason)

    async def _ensure_armed(self, slot: Slot, staged: staging.Staged) -> str | None:
        """With the slot's lock held: a zygote armed for `staged` (re-made if its spec changed); the reason if
        it cannot arm."""
        spec = self.engine_spec(slot, staged)
        if slot.engine is None or slot.engine.spec != {**spec}:
            if slot.engine is not None:
                await slot.engine.close()
            slot.engine = ForkedEngine(
                spec,
                name=slot.name,
                advertise_host=self.settings.endpoint_host,
                port=slot.port,
                on_exit=functools.partial(self._engine_exited, slot),
            )
        try:
            was_armed = slot.engine.armed
            await slot.engine.arm()
            if not was_armed:
                self.metrics.zygote_arms.inc()
        except EngineFailed as err:
            return err.reason
        except OSError as err:  # the interpreter could not even be started
            return f"cannot start the zygote: {err.strerror or err}"
        return None

    async def _arm(self, slot: Slot, staged: staging.Staged) -> None:
        async with slot.held("arming its engine"):
            if slot.active is not None:
                return
            err = await self._ensure_armed(slot, staged)
            if err is not None:
                await self._fail(slot, f"cannot arm the engine: {err}")
                return
            slot.phase, slot.reason, slot.failures = "warm", None, 0
            await self._set_state(slot, "warm", reason=None, weights_resident=True, claim_id=None, token=None)

    async def _set_state(self, slot: Slot, state: str, **fields: Any) -> None:
        """Agent-side transition; a slot held by a claim is left alone (its holder moves it on)."""
        try:
            rec, _ = await self.store.get(slot.key)
        except SlotNotFound:
            await self.store.register(self._fresh_record(slot, state, **fields))
            return
        except REGISTRY_ERRORS as err:
            log.warning("slot %s: cannot write %s: %s", slot.key, state, err)
            return
        if rec.state in slots.HELD_STATES and state != "failed":
            return
        if state == "warm" and rec.drain:
            state = "draining"  # the node was drained meanwhile: ready again, but not offered
        expect = [st for st, targets in slots.TRANSITIONS.items() if state in targets and st not in slots.HELD_STATES]
        if state == "failed":
            expect = list(slots.TRANSITIONS)
        try:
            await self.store.set_state(slot.key, state, expect=expect, **fields)  # type: ignore[arg-type]
        except InvalidTransition as err:
            log.info("slot %s: not moved to %s: %s", slot.key, state, err)
        except REGISTRY_ERRORS as err:
            log.warning("slot %s: cannot write %s: %s", slot.key, state, err)
        self.refresh_gauges()

    def _fresh_record(self, slot: Slot, state: str, **fields: Any) -> SlotRecord:
        s = self.settings
        rec = SlotRecord(model=s.model_name, node=s.node, slot=slot.name, state="prewarming", rack=s.rack)
        return msgspec.structs.replace(rec, state=state, updated_at=time.time(), **fields)

    async def _fail(self, slot: Slot, reason: str) -> None:
        slot.phase, slot.reason = "failed", reason
        await self._set_state(slot, "failed", reason=reason[:4000], claim_id=None, endpoint=None)

    def _engine_exited(self, slot: Slot, reason: str) -> None:
        if not self._stopping:
            self.metrics.engine_exits.inc()
            self.spawn(self._recover(slot, reason), name=f"recover-{slot.name}")

    async def _recover(self, slot: Slot, reason: str) -> None:
        """An engine or zygote died on its own: fail the claim it served, then re-arm (bounded by the failure
        count) so the slot comes back `warm` if nothing is broken."""
        async with slot.held(f"re-arming after: {reason}"):
            active, slot.active = slot.active, None
            if active is not None:
                slot.failures += 1
                slot.phase, slot.reason = "failed", f"engine died while serving: {reason}"
                with contextlib.suppress(StaleToken, InvalidTransition, *REGISTRY_ERRORS):
                    await self.store.advance(active.claim, "failed", reason=slot.reason, claim_id=None, endpoint=None)
                self.refresh_gauges()
            elif slot.phase == "warm":
                slot.phase = "prewarming"
                await self._set_state(slot, "prewarming", reason=f"re-arming: {reason}")
            else:
                return  # failed or prewarming: a prewarm owns the slot now
        if slot.failures >= self.settings.max_consecutive_failures:
            await self._fail(slot, f"{slot.failures} failures in a row, last: {reason}; send prewarm to retry")
            return
        if self.staged is not None:
            await self._arm(slot, self.staged)

    # --- requests -----------------------------------------------------------------------------------------------

    async def subscribe(self) -> None:
        handlers: dict[str, Callable[[Any, float], Awaitable[bytes]]] = {
            "prewarm": self.on_prewarm,
            "activate": self.on_activate,
            "deactivate": self.on_deactivate,
            "status": self.on_status,
        }
        for verb, handler in handlers.items():
            subject = protocol.agent_subject(self.settings.node, verb)

            async def cb(
                msg: Msg, verb: str = verb, handler: Callable[[Any, float], Awaitable[bytes]] = handler
            ) -> None:
                self.spawn(self._handle(msg, verb, handler, time.perf_counter()), name=f"{verb}-request")

            self._subs.append(await self.nc.subscribe(subject, cb=cb))

    async def _handle(
        self, msg: Msg, verb: str, handler: Callable[[Any, float], Awaitable[bytes]], t_recv: float
    ) -> None:
        try:
            req = protocol.decode(msg.data, protocol.AGENT_REQUEST_TYPES[verb])
            protocol.admit(req, time.time(), self.ledger)
        except DuplicateRequest as dup:
            self.rejected(dup, source=msg.subject)
            await self._respond(msg, dup.reply)
            return
        except BadMessage as err:
            self.rejected(err, source=msg.subject)
            await self._respond(msg, protocol.error_reply("bad_message", str(err), reason=err.reason))
            return
        pending = self._pending.get(req.id)
        if pending is not None:  # a repeat of a request still being applied: answer with its result
            await self._respond(msg, await asyncio.shield(pending))
            return
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[req.id] = fut
        try:
            reply = await handler(req, t_recv)
        except Exception as err:
            log.exception("%s request %s failed", verb, req.id)
            reply = protocol.error_reply("internal", f"{type(err).__name__}: {err}")
        finally:
            self._pending.pop(req.id, None)
        if not fut.done():
            fut.set_result(reply)
        self.ledger.record(req, reply, time.time())
        await self._respond(msg, reply)

    async def _respond(self, msg: Msg, reply: bytes) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await msg.respond(reply)

    def _slot(self, name: str) -> Slot:
        slot = self.slots.get(name)
        if slot is None:
            raise ActivationRefused(
                "unknown_slot", f"node {self.settings.node} has no slot {name!r} (it has {', '.join(self.slots)})"
            )
        return slot

    async def on_status(self, req: protocol.AgentStatusRequest, t_recv: float) -> bytes:
        return protocol.ok_reply(**self.status(req.slot))

    def status(self, only: str | None = None) -> dict[str, Any]:
        s = self.settings
        staged, locked = self.staged, self.locked
        weights: dict[str, Any] = {
            "model": s.model_name,
            "source": str(s.model_dir),
            "staged_dir": str(staged.dir) if staged else None,
            "files": len(staged.files) if staged else 0,
            "staged_bytes": staged.weights_bytes if staged else 0,
            "staged_at": staged.staged_at if staged else None,
            "locked": bool(locked and locked.locked),
            "locked_bytes": locked.locked_bytes if locked else 0,
            "lock_error": locked.error if locked else None,
            "error": self.staging_error,
        }
        chosen = [x for x in self.slots.values() if only is None or x.name == only]
        return {
            "node": s.node,
            "rack": s.rack,
            "engine": s.engine,
            "engine_memory": s.engine_memory,
            "loader": self.loader.name,
            "loader_reason": self.loader_reason,
            "weights": weights,
            "unlocked": bool(locked and locked.error),
            "slots": [x.status(hit[0] if (hit := self.record(x)) else None) for x in chosen],
            "uptime_s": round(time.time() - self.started_at, 1),
        }

    async def on_prewarm(self, req: protocol.PrewarmRequest, t_recv: float) -> bytes:
        names = [req.slot] if req.slot else list(self.slots)
        try:
            busy = [n for n in names if self._slot(n).active is not None]
        except ActivationRefused as err:
            return protocol.error_reply(err.code, str(err))
        names = [n for n in names if n not in busy]
        if self._prewarm is not None and not self._prewarm.done():
            return protocol.error_reply("busy", "a prewarm is already running; watch the registry for its result")
        if names:
            for n in names:
                self.slots[n].failures = 0
            self._prewarm = self.spawn(self.prewarm(names), name="prewarm")
        return protocol.ok_reply(accepted=names, skipped_serving=busy, state="prewarming")

    # --- activation -----------------------------------------------------------------------------------------------

    async def on_activate(self, req: protocol.ActivateRequest, t_recv: float) -> bytes:
        try:
            slot = self._slot(req.slot)
            await self._lock_by_deadline(slot, req, t_recv)
            handed_off = False
            try:
                reply, cleanup = await self._activate(slot, req, t_recv)
                if cleanup is not None:
                    # Reply first; the clean-up (stop, re-check, re-arm, give back) keeps the lock and frees it.
                    self.spawn(self._unlocking(slot, cleanup), name=f"after-activation-{slot.name}")
                    handed_off = True
            finally:
                if not handed_off:
                    slot.lock.release()
        except ActivationRefused as err:
            self.metrics.activations.labels("refused").inc()
            log.info("activate %s refused: %s: %s", req.slot, err.code, err)
            return protocol.error_reply(err.code, str(err), slot=req.slot)
        return reply

    async def _lock_by_deadline(self, slot: Slot, req: protocol.ActivateRequest, t_recv: float) -> None:
        """Take the slot's lock, waiting no longer than the request's deadline; say what held it if it was not
        free in time."""
        left_s = req.deadline - time.time()
        try:
            async with asyncio.timeout(max(0.0, left_s)):
                await slot.lock.acquire()  # a free lock is taken without waiting, even past the deadline
        except TimeoutError:
            waited_ms = (time.perf_counter() - t_recv) * 1e3
            if left_s <= 0:
                raise ActivationRefused(
                    "deadline", f"request arrived {-left_s * 1e3:.0f} ms after its deadline (slot {slot.key} busy)"
                ) from None
            raise ActivationRefused(
                "deadline",
                f"slot {slot.key} busy ({slot.busy or 'serving another request'}) until the deadline; "
                f"waited {waited_ms:.0f} ms",
            ) from None

    async def _unlocking(self, slot: Slot, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        finally:
            slot.busy = None
            slot.lock.release()

    def _check_claim(self, slot: Slot, rec: SlotRecord, rev: int, token: int, claim_id: str | None) -> None:
        """Refuse a request whose claim does not hold the slot, naming who does."""
        if rec.claim_id is None:
            raise ActivationRefused(
                "stale_token",
                f"slot {slot.key} is {rec.state} and held by no claim (revision {rev}); token {token} "
                "is stale (released or never claimed)",
            )
        if claim_id is not None and rec.claim_id != claim_id:
            newer = (rec.token or rev) > token
            raise ActivationRefused(
                "stale_token" if newer else "foreign_claim",
                f"slot {slot.key} is held by claim {rec.claim_id} (token {rec.token or '?'}, revision {rev}), "
                f"not by claim {claim_id} with token {token}",
            )
        if rec.token is not None and rec.token != token:
            raise ActivationRefused(
                "stale_token", f"slot {slot.key} is held under token {rec.token}, the request has token {token}"
            )

    async def _current(self, slot: Slot, min_revision: int) -> tuple[SlotRecord, int]:
        """The slot's record as of `min_revision` at least: the watch view when it has caught up (usual: the
        claim write reaches the watch before the request reaches us), else one read."""
        hit = self.record(slot)
        if hit is not None and hit[1] >= min_revision:
            return hit
        try:
            return await self.store.get(slot.key)
        except SlotNotFound:
            raise ActivationRefused("unknown_slot", f"slot {slot.key} is not in the registry") from None

    async def _activate(
        self, slot: Slot, req: protocol.ActivateRequest, t_recv: float
    ) -> tuple[bytes, Coroutine[Any, Any, None] | None]:
        """With the slot's lock held: (the reply, clean-up to run after replying, still under the lock)."""
        if req.token < slot.highest_token:
            raise ActivationRefused(
                "stale_token", f"token {req.token} is lower than {slot.highest_token}, already seen for {slot.key}"
            )
        active = slot.active
        if active is not None and active.token == req.token and active.claim_id == req.claim_id:
            return self._ready_reply(slot, active, repeated=True), None  # a retry of an activation that succeeded
        rec, rev = await self._current(slot, req.token)
        self._check_claim(slot, rec, rev, req.token, req.claim_id)
        if rec.state not in ("claimed", "activating", "ready"):
            raise ActivationRefused("not_claimed", f"slot {slot.key} is {rec.state}, not claimed for activation")
        if rec.state != "claimed" and rec.token != req.token:
            raise ActivationRefused("stale_token", f"slot {slot.key} is {rec.state} under token {rec.token}")
        claim = Claim(key=slot.key, token=req.token, claim_id=req.claim_id, revision=rev, record=rec)
        remaining = req.deadline - time.time()
        if remaining <= 0:
            await self._give_back(slot, claim, f"activation arrived {-remaining * 1e3:.0f} ms past its deadline")
            self.metrics.activations.labels("deadline").inc()
            raise ActivationRefused("deadline", f"request arrived {-remaining * 1e3:.0f} ms after its deadline")
        engine = slot.engine
        if slot.phase not in ("warm", "active") or engine is None or not engine.armed:
            why = slot.reason or self.staging_error or f"slot is {slot.phase}"
            raise ActivationRefused("slot_unavailable", f"slot {slot.key} cannot activate now: {why}")
        try:
            if rec.state == "claimed":
                # The compare-and-set is the fencing check: it succeeds only for the claim's own token.
                claim = await self.store.advance(claim, "activating")
        except StaleToken as err:
            raise ActivationRefused("stale_token", str(err)) from None
        except InvalidTransition as err:
            raise ActivationRefused("not_claimed", str(err)) from None
        # Verified by the registry: only now may this token raise the bar or displace an engine.
        slot.highest_token = max(slot.highest_token, req.token)
        if active is not None:  # an engine serving an older claim that lost the slot: a fenced zombie
            await self._stop_engine(slot, f"superseded by claim {req.claim_id} (token {req.token})")
        t_token = time.perf_counter()
        slot.phase = "active"
        stage = "engine"
        budget_ms = (req.deadline - time.time()) * 1e3
        try:
            try:
                # One deadline over both stages; each stage also bounds itself, so it can say what it waited for.
                async with asyncio.timeout(max(0.0, req.deadline - time.time()) + 0.05):
                    started = await engine.start(timeout_s=max(0.001, req.deadline - time.time()))
                    t_engine = time.perf_counter()
                    stage = "readiness"
                    await readiness.check(
                        self.session, started.endpoint, self.settings.model_name, timeout_s=req.deadline - time.time()
                    )
                    t_ready = time.perf_counter()
            except TimeoutError:
                raise EngineFailed(
                    stage, f"not done by the deadline ({budget_ms:.0f} ms after arrival)", code="deadline"
                ) from None
            stage = "ready"
            try:
                claim = await self.store.advance(claim, "ready", endpoint=started.endpoint, reason=None)
            except (StaleToken, InvalidTransition) as err:
                # The claim was released while we started (the claimer gave up): stop, the slot is someone else's.
                await engine.stop()
                slot.phase = "warm"
                self.metrics.activations.labels("refused").inc()
                raise ActivationRefused("stale_token", f"claim lost during activation: {err}") from None
            t_done = time.perf_counter()
            timings = StageTimings(
                token_ms=(t_token - t_recv) * 1e3,
                load_ms=started.load_ms,
                engine_ms=started.engine_ms,
                readiness_ms=(t_ready - t_engine) * 1e3,
                total_ms=(t_done - t_recv) * 1e3,
            )
            slot.active = Active(claim, started, timings)
        except ActivationRefused:
            raise
        except EngineFailed as err:
            return self._activation_failed(slot, claim, err, t_recv)
        except Exception as err:  # a registry error, a bug: never leave an engine serving that nobody owns
            log.exception("slot %s: activation failed at stage %s", slot.key, stage)
            code = "registry_unavailable" if isinstance(err, REGISTRY_ERRORS) else "internal"
            return self._activation_failed(slot, claim, EngineFailed(stage, _describe(err), code=code), t_recv)
        slot.last_timings = timings
        slot.activations += 1
        slot.failures = 0
        slot.reason = None
        m = self.metrics
        for name in ("token", "load", "engine", "readiness", "total"):
            m.activation_seconds.labels(name).observe(getattr(timings, f"{name}_ms") / 1e3)
        m.activations.labels("ready").inc()
        m.loaded_bytes.inc(started.loaded_bytes)
        self.refresh_gauges()
        log.info(
            "slot %s ready at %s under claim %s (token %d) in %.1f ms (load %.1f ms)",
            slot.key,
            started.endpoint,
            req.claim_id,
            req.token,
            timings.total_ms,
            timings.load_ms,
        )
        return self._ready_reply(slot, slot.active, repeated=False), None

    def _ready_reply(self, slot: Slot, active: Active, *, repeated: bool) -> bytes:
        return protocol.ok_reply(
            slot=slot.name,
            key=slot.key,
            state="ready",
            endpoint=active.started.endpoint,
            token=active.token,
            claim_id=active.claim_id,
            timings=active.timings,
            loaded_bytes=active.started.loaded_bytes,
            load_mode=active.started.mode,
            loader=self.loader.name,
            repeated=repeated,
        )

    def _activation_failed(
        self, slot: Slot, claim: Claim, err: EngineFailed, t_recv: float
    ) -> tuple[bytes, Coroutine[Any, Any, None]]:
        """The reply now, and the clean-up to run after it under the slot's lock: stop what was started, then
        give the slot back (`warm`), or fail it if it is broken."""
        slot.failures += 1
        quarantine = slot.failures >= self.settings.max_consecutive_failures
        slot.busy = "cleaning up after a failed activation"
        self.metrics.activations.labels("deadline" if err.code == "deadline" else "failed").inc()
        took_ms = (time.perf_counter() - t_recv) * 1e3
        reason = f"activation failed after {took_ms:.0f} ms at stage {err.stage}: {err.reason}"
        log.warning("slot %s: %s", slot.key, reason)
        reply = protocol.error_reply(
            err.code,
            reason,
            slot=slot.name,
            stage=err.stage,
            state="failed" if quarantine else slots.release_target(claim.record),
            timings=StageTimings(total_ms=took_ms),
        )
        return reply, self._after_failed_activation(slot, claim, reason, quarantine)

    async def _after_failed_activation(self, slot: Slot, claim: Claim, reason: str, quarantine: bool) -> None:
        slot.active = None
        engine = slot.engine
        if engine is not None:
            await engine.stop()  # before the claim goes back: no engine serves a slot it does not hold
        broken = None
        if self.staged is not None:
            try:
                await asyncio.to_thread(staging.check_staged, self.staged)
            except BadWeights as bad:
                broken = f"staged weights damaged: {bad}"
        if broken is None and self.staged is not None and engine is not None:
            arm_err = await self._ensure_armed(slot, self.staged)
            if arm_err is not None:
                broken = f"cannot re-arm the engine: {arm_err}"
        if broken is None and quarantine:
            broken = f"{slot.failures} activations in a row failed; send prewarm to retry"
        if broken is None:
            slot.phase, slot.reason = "warm", reason
            await self._give_back(slot, claim, reason)
        else:
            slot.phase, slot.reason = "failed", f"{broken}; last: {reason}"
            try:
                await self.store.advance(claim, "failed", reason=slot.reason[:4000], claim_id=None, endpoint=None)
            except (StaleToken, InvalidTransition):
                await self._fail(slot, slot.reason)  # the claimer released it first: fail the slot as such
            except REGISTRY_ERRORS as err:
                log.warning("slot %s: cannot write failed: %s", slot.key, err)
        self.refresh_gauges()

    async def _give_back(self, slot: Slot, claim: Claim, reason: str | None) -> None:
        """Release a claim as its holder: `warm` (or `draining`); a claim already released elsewhere is fine."""
        try:
            await self.store.release(claim, reason=reason)
        except (StaleToken, InvalidTransition) as err:
            log.info("slot %s: claim %s already released: %s", slot.key, claim.claim_id, err)
        except REGISTRY_ERRORS as err:
            log.warning("slot %s: cannot release claim %s: %s", slot.key, claim.claim_id, err)
        self.refresh_gauges()

    async def _stop_engine(self, slot: Slot, why: str) -> None:
        active, slot.active = slot.active, None
        if slot.engine is not None:
            await slot.engine.stop()
        if active is not None:
            log.info("slot %s: engine %d stopped: %s", slot.key, active.started.pid, why)
        if slot.phase == "active":
            slot.phase = "warm"

    # --- deactivation -----------------------------------------------------------------------------------------------

    async def on_deactivate(self, req: protocol.DeactivateRequest, t_recv: float) -> bytes:
        try:
            slot = self._slot(req.slot)
            async with slot.held("deactivating"):
                reply = await self._deactivate(slot, req)
        except ActivationRefused as err:
            self.metrics.deactivations.labels("refused").inc()
            return protocol.error_reply(err.code, str(err), slot=req.slot)
        self.metrics.deactivations.labels("ok").inc()
        return reply

    async def _deactivate(self, slot: Slot, req: protocol.DeactivateRequest) -> bytes:
        if req.token < slot.highest_token:
            raise ActivationRefused(
                "stale_token", f"token {req.token} is lower than {slot.highest_token}, already seen for {slot.key}"
            )
        active = slot.active
        if active is not None and req.token == active.token and req.claim_id not in (None, active.claim_id):
            raise ActivationRefused(
                "foreign_claim", f"slot {slot.key} serves claim {active.claim_id}, not {req.claim_id}"
            )
        try:
            rec, rev = await self.store.get(slot.key)
        except SlotNotFound:
            raise ActivationRefused("unknown_slot", f"slot {slot.key} is not in the registry") from None
        except REGISTRY_ERRORS as err:
            raise ActivationRefused("registry_unavailable", f"cannot read {slot.key}: {err}") from None
        held = rec.claim_id is not None and rec.state in (*slots.HELD_STATES, "failed")
        claim_id = req.claim_id or (active.claim_id if active is not None else rec.claim_id)
        if held and rec.claim_id == claim_id and rec.token in (None, req.token):
            claim = Claim(key=slot.key, token=req.token, claim_id=rec.claim_id or "", revision=rev, record=rec)
            serving_it = active is not None and active.token == req.token
            if serving_it:
                await self._stop_engine(slot, f"deactivated (token {req.token})")  # stop serving before `warm`
            try:
                await self.store.release(claim)  # verifies the token against the claim write
            except (StaleToken, InvalidTransition) as err:
                raise ActivationRefused("stale_token", str(err)) from None
            slot.highest_token = max(slot.highest_token, req.token)
            if slot.active is not None:
                await self._stop_engine(slot, f"its slot was released by claim {claim.claim_id}")
            note = "released"
        elif held:
            if active is not None and active.token == req.token:
                await self._stop_engine(slot, f"its claim {active.claim_id} no longer holds the slot")
            newer = (rec.token or rev) > req.token
            raise ActivationRefused(
                "stale_token" if newer else "foreign_claim",
                f"slot {slot.key} is held by claim {rec.claim_id} (token {rec.token or '?'}), not by token {req.token}",
            )
        else:
            # Nobody holds it: the claimer (or a deadline) already released it. Stop anything still serving.
            if active is not None and active.token == req.token:
                await self._stop_engine(slot, "its claim was released")
            note = f"already {rec.state}"
        await self._rearm(slot)
        self.refresh_gauges()
        hit = self.record(slot)
        return protocol.ok_reply(slot=slot.name, key=slot.key, state=hit[0].state if hit else None, note=note)

    async def _rearm(self, slot: Slot) -> None:
        """After an engine stops the zygote must be ready for the next activation (it normally still is), and
        armed for the weights staged now (a re-stage while it served skipped it)."""
        if slot.engine is not None and self.staged is not None:
            err = await self._ensure_armed(slot, self.staged)
            if err is not None:
                await self._fail(slot, f"cannot re-arm the engine: {err}")
                return
        if slot.phase == "active":
            slot.phase = "warm"

    # --- loops ----------------------------------------------------------------------------------------------------

    async def heartbeat_loop(self) -> None:
        s = self.settings
        gpus = loaders.gpu_count()
        failing = False
        while True:
            lease = AgentLease(
                node=s.node,
                slots=list(self.slots),
                heartbeat_at=time.time(),
                lease_s=s.lease_s,
                rack=s.rack,
                gpus=gpus,
                shm_free_bytes=loaders.shm_free_bytes(str(s.shm_dir)),
            )
            try:
                await self.store.heartbeat(lease)
                if failing:
                    log.info("heartbeat written again")
                failing = False
            except REGISTRY_ERRORS as err:
                if not failing:
                    log.warning("cannot write the lease (%s); retrying every %.1f s", err, s.heartbeat_interval_s)
                failing = True
            self.refresh_gauges()
            await asyncio.sleep(s.heartbeat_interval_s)

    async def watch_loop(self) -> None:
        """Fencing from the registry side: an engine whose claim no longer holds its slot is stopped, and a slot
        record deleted under us is written again."""
        async for event in self.store.watch():
            if isinstance(event, Snapshot):
                changed = [(k, r) for k, r in event.records.items()]
                for slot in self.slots.values():
                    if slot.key not in event.records:
                        self.spawn(self._restore(slot), name=f"restore-{slot.name}")
            elif isinstance(event, Changed):
                changed = [(event.key, event.record)]
            elif isinstance(event, Removed):
                for slot in self.slots.values():
                    if slot.key == event.key:
                        self.spawn(self._restore(slot), name=f"restore-{slot.name}")
                continue
            else:
                continue
            for key, rec in changed:
                mine = next((x for x in self.slots.values() if x.key == key), None)
                if mine is not None and mine.active is not None and rec.claim_id != mine.active.claim_id:
                    self.spawn(self._fence(mine), name=f"fence-{mine.name}")

    async def _fence(self, slot: Slot) -> None:
        async with slot.held("stopping a fenced engine"):
            active, hit = slot.active, self.record(slot)
            if active is None or hit is None or hit[0].claim_id == active.claim_id:
                return
            await self._stop_engine(slot, f"claim {active.claim_id} was released or superseded in the registry")
            await self._rearm(slot)

    async def _restore(self, slot: Slot) -> None:
        if self._stopping or self.record(slot) is not None:
            return
        state = {"active": "failed", "warm": "warm", "failed": "failed"}.get(slot.phase, "prewarming")
        log.warning("slot %s vanished from the registry; writing it again as %s", slot.key, state)
        async with slot.held("restoring its record"):
            if slot.active is not None:
                await self._stop_engine(slot, "its record was deleted")
                await self._rearm(slot)
                state = "warm" if slot.phase == "warm" else state
            with contextlib.suppress(*REGISTRY_ERRORS):
                await self.store.register(
                    self._fresh_record(slot, state, weights_resident=self.staged is not None, reason=slot.reason)
                )

    # --- shutdown --------------------------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        self._stopping = True
        with contextlib.suppress(*REGISTRY_ERRORS):
            await self.store.withdraw(self.settings.node)  # first: no new claims while we go
        for sub in self._subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(x.engine.close() for x in self.slots.values() if x.engine), return_exceptions=True)
        reason = f"agent on {self.settings.node} stopped at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
        for slot in self.slots.values():
            slot.active = None
            with contextlib.suppress(*REGISTRY_ERRORS, InvalidTransition, SlotNotFound):
                await self.store.set_state(
                    slot.key, "failed", reason=reason, claim_id=None, endpoint=None, weights_resident=False
                )
        if self.locked is not None:
            self.locked.release()
            self.locked = None


def _describe(err: BaseException) -> str:
    """An error for a reason field: our named errors say it all; anything else also says what it is."""
    if isinstance(err, (PulsescaleError, ValueError)):
        return str(err)
    return f"{type(err).__name__}: {err}"


async def _metrics_server(agent: Agent, host: str, port: int) -> tuple[web.AppRunner, int]:
    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(agent.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        ok = agent.nc.is_connected
        return web.json_response({"ok": ok, "nats_connected": agent.nc.is_connected}, status=200 if ok else 503)

    async def status(_: web.Request) -> web.Response:
        return web.json_response(agent.status())

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
) -> None:
    """Run the agent until `stop` is set. `ready` is set once requests are served (staging may still run);
    `on_started(agent, metrics_port)` lets a caller (tests, the CLI) see the live agent."""
    metrics = AgentMetrics(registry if registry is not None else CollectorRegistry())
    nc = await nats_connect.connect(settings.nats)
    runner: web.AppRunner | None = None
    agent: Agent | None = None
    store: KvSlotStore | None = None
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=None)
    )
    try:
        store = await KvSlotStore.open(nc)
        await store.start()
        agent = Agent(settings, nc, store, metrics, session)
        await agent.register_all()
        await agent.subscribe()
        roots = [
            asyncio.create_task(agent.heartbeat_loop(), name="agent-heartbeat"),
            asyncio.create_task(agent.watch_loop(), name="agent-watch"),
        ]
        agent._prewarm = agent.spawn(agent.prewarm(list(agent.slots)), name="prewarm")
        port = None
        if settings.metrics_port is not None:
            try:
                runner, port = await _metrics_server(agent, settings.metrics_host, settings.metrics_port)
            except OSError as err:
                raise PulsescaleError(
                    f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: {err.strerror or err}; "
                    "pick another --metrics-port (0 = any free port, -1 = off)"
                ) from None
            log.info("metrics on http://%s:%d/metrics", settings.metrics_host, port)
        if on_started is not None:
            on_started(agent, port)
        if ready is not None:
            ready.set()
        stopped = asyncio.create_task(stop.wait(), name="agent-stop")
        done, _ = await asyncio.wait([stopped, *roots], return_when=asyncio.FIRST_COMPLETED)
        for t in roots:
            t.cancel()
        await asyncio.gather(*roots, return_exceptions=True)
        if stopped not in done:
            stopped.cancel()
            crashed = next(iter(done))
            raise RuntimeError(f"root task {crashed.get_name()} ended: {crashed.exception()!r}")
    finally:
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
