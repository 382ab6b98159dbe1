"""A slot as the agent keeps it, and what every part of the agent does to one.

`Slot` is one engine slot of this node: its local phase (`SlotPhase`), the lock that serialises its requests, the
engine that keeps it armed (`SlotEngine`: a zygote, `forked.ForkedEngine`, for ``local``; a standby server,
`served.ServedEngine`, for ``command``), and, while it serves, the claim it serves under
(`Active`). The local phase is the agent's own readiness; the slot's state in the registry is the shared truth,
moved by compare-and-set.

`SlotKeeper` holds the node's slots and the weights they are armed for, and does what activation and prewarm
both do to a slot: write its record as its agent (`set_state`, `fail`, `give_back`), arm its zygote for the staged
weights (`ensure_armed`, `rearm`), stop its engine (`stop_engine`), and run background work on it (`spawn`,
cancelled at shutdown). Which state the agent may move a slot to is the pure `warmpool.slots.agent_target`; the
compare-and-set itself is `warmpool.registry`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shlex
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import msgspec
import nats.errors

from nodeagent import staging, vllm
from nodeagent.engine import Started
from nodeagent.errors import ActivationRefused, EngineFailed, describe
from nodeagent.forked import ForkedEngine
from nodeagent.metrics import AgentMetrics
from nodeagent.rootfs import Rootfs
from nodeagent.served import EngineLog, ServedEngine, ServerSpec
from nodeagent.settings import AgentSettings
from warmpool import protocol, slots
from warmpool.errors import ClaimConflict, InvalidTransition, SlotNotFound, StaleToken
from warmpool.protocol import AgentSlotStatus, SlotRecord, SlotState, StageTimings
from warmpool.registry import Claim, KvSlotStore

__all__ = ["REGISTRY_ERRORS", "Active", "Slot", "SlotEngine", "SlotKeeper", "SlotPhase"]

log = logging.getLogger("pulsescale.agent")

REGISTRY_ERRORS = (nats.errors.Error, TimeoutError, OSError, ClaimConflict)
"""What a registry call raises when the broker is away or contended: logged and retried, never fatal."""

SlotPhase = Literal["prewarming", "warm", "active", "failed"]
"""A slot's local readiness: ``prewarming`` (staging or arming), ``warm`` (weights staged, zygote armed),
``active`` (an engine serves or is starting under a claim), ``failed`` (`Slot.reason` says why)."""


class SlotEngine(Protocol):
    """What a slot's engine is to the agent, whichever adapter: armed off the activation path (`arm`), taken into
    service (`start`, then the agent checks readiness) and out of it (`stop`), gone for good (`close`).
    `on_exit(reason)` is called when it dies on its own; `spec` equal to a new one means no re-arm is needed."""

    spec: Any
    on_exit: Callable[[str], None] | None

    @property
    def armed(self) -> bool: ...

    @property
    def serving(self) -> Started | None: ...

    @property
    def log_path(self) -> str | None: ...

    def log_tail(self) -> list[str]: ...

    def status(self) -> dict[str, Any]: ...

    async def arm(self) -> None: ...

    async def start(self, *, timeout_s: float) -> Started: ...

    async def stop(self) -> None: ...

    async def reset(self) -> None:
        """Out of service whatever state the engine is in (wedged, frozen): killed, not asked; armed again later."""
        ...

    async def close(self) -> None: ...


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
    """One engine slot of this node, as its agent keeps it (the registry holds its shared state)."""

    def __init__(self, name: str, key: str, port: int) -> None:
        self.name = name
        self.key = key
        self.port = port
        """The engine's port; 0: any free port (reported in its endpoint)."""
        self.lock = asyncio.Lock()
        self.phase: SlotPhase = "prewarming"
        self.reason: str | None = None
        self.highest_token = 0
        """The highest fencing token the registry has verified for this slot: anything lower is refused unread."""
        self.active: Active | None = None
        self.failures = 0
        """Failures in a row (activations, engine deaths): at `max_consecutive_failures` the slot is quarantined."""
        self.activations = 0
        self.last_timings: StageTimings | None = None
        self.last_mode: str | None = None
        """The engine mode of the last activation (`Started.engine_mode`)."""
        self.engine: SlotEngine | None = None
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

    async def lock_by(self, until: float, t_recv: float) -> None:
        """Take the lock, waiting no longer than `until` (`time.perf_counter`, the clock `t_recv` is on); say what
        held it if it was not free in time. The caller releases it, or hands that to `unlock_after`."""
        left_s = until - time.perf_counter()
        try:
            async with asyncio.timeout(max(0.0, left_s)):
                await self.lock.acquire()  # a free lock is taken without waiting, even past the deadline
        except TimeoutError:
            waited_ms = (time.perf_counter() - t_recv) * 1e3
            if left_s <= 0:
                raise ActivationRefused(
                    "deadline", f"request arrived {-left_s * 1e3:.0f} ms after its deadline (slot {self.key} busy)"
                ) from None
            raise ActivationRefused(
                "deadline",
                f"slot {self.key} busy ({self.busy or 'serving another request'}) until the deadline; "
                f"waited {waited_ms:.0f} ms",
            ) from None

    async def unlock_after(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` under the lock taken by `lock_by`, then release it."""
        try:
            await work
        finally:
            self.busy = None
            self.lock.release()

    @property
    def idle(self) -> bool:
        """Warm, armed and serving nobody: what the registry should say `warm` (or `draining`)."""
        return self.phase == "warm" and self.active is None and self.engine is not None and self.engine.armed

    def status(self, record: SlotRecord | None) -> AgentSlotStatus:
        """The slot as `status` (NATS and HTTP) shows it. Never a claim id: with the token it is what deactivates
        the slot (contract revision 2), and status is read by people and tools that hold no claim; one that
        turns up in a reason (an error naming the holder) is masked too."""
        reason = self.reason or (record.reason if record else None)
        for claim_id in (self.active.claim_id if self.active else None, record.claim_id if record else None):
            if reason and claim_id:
                reason = reason.replace(claim_id, "<claim>")
        return AgentSlotStatus(
            slot=self.name,
            key=self.key,
            phase=self.phase,
            state=record.state if record else None,
            reason=reason,
            highest_token=self.highest_token,
            claim_id=None,
            endpoint=self.active.started.endpoint if self.active else None,
            activations=self.activations,
            consecutive_failures=self.failures,
            last_timings=self.last_timings,
            engine=self.engine.status() if self.engine else None,
            engine_mode=self.active.started.engine_mode if self.active else self.last_mode,  # type: ignore[arg-type]
            log_path=self.engine.log_path if self.engine else None,
            log_tail=self.engine.log_tail() if self.engine else [],
        )


class SlotKeeper:
    """The node's slots, the weights they are armed for, and the agent-side moves of a slot."""

    def __init__(self, settings: AgentSettings, store: KvSlotStore, metrics: AgentMetrics, loader: str) -> None:
        s = settings
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.loader = loader
        self.slots = {
            name: Slot(name, protocol.slot_key(s.model_name, s.node, name), port=_port(s, i))
            for i, name in enumerate(s.slot_names)
        }
        self.staged: staging.Staged | None = None
        """The verified weights on disk now; zygotes are armed for them (`engine_spec`)."""
        self.rootfs: Rootfs | None = None
        """The mounted ``--image`` the standby servers run from (set by the prewarm's rootfs stage)."""
        self.staging_error: str | None = None
        self.stopping = False
        self.on_engine_exit: Callable[[Slot, str], None] | None = None
        """Called when a slot's engine or zygote dies on its own (prewarm recovers it)."""
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- reading ----------------------------------------------------------------------------------------------

    def slot(self, name: str) -> Slot:
        slot = self.slots.get(name)
        if slot is None:
            raise ActivationRefused(
                "unknown_slot", f"node {self.settings.node} has no slot {name!r} (it has {', '.join(self.slots)})"
            )
        return slot

    def by_key(self, key: str) -> Slot | None:
        return next((x for x in self.slots.values() if x.key == key), None)

    def record(self, slot: Slot) -> tuple[SlotRecord, int] | None:
        """The slot's (record, revision) in the registry view."""
        return self.store.entry(slot.key)

    def refresh_gauges(self) -> None:
        counts = dict.fromkeys(protocol.SLOT_STATES, 0)
        for slot in self.slots.values():
            hit = self.record(slot)
            if hit is not None:
                counts[hit[0].state] += 1
        self.metrics.set_slots(self.settings.model_name, counts)  # and the warm slot-seconds up to now

    # --- background work --------------------------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    @property
    def task_count(self) -> int:
        """Background tasks running now (requests among them): bounded, see `Requests`."""
        return len(self._tasks)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def cancel_tasks(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- the slot's record --------------------------------------------------------------------------------------

    async def set_state(self, slot: Slot, wanted: SlotState, **fields: Any) -> None:
        """Agent-side transition to where `slots.agent_target` says `wanted` leads; a slot held by a claim is
        left alone (its holder moves it on) unless it is failed."""
        try:
            rec, _ = await self.store.get(slot.key)
        except SlotNotFound:
            await self.store.register(self.fresh_record(slot, wanted, **fields))
            return
        except REGISTRY_ERRORS as err:
            log.warning("slot %s: cannot write %s: %s", slot.key, wanted, err)
            return
        target = slots.agent_target(rec.state, wanted, drain=rec.drain)
        if target is None:
            return
        # The compare-and-set re-reads on a lost race: accept any state from which `wanted` leads to the same move.
        expect = [st for st in protocol.SLOT_STATES if slots.agent_target(st, wanted, drain=rec.drain) == target]
        try:
            await self.store.set_state(slot.key, target, expect=expect, **fields)
        except InvalidTransition as err:
            log.info("slot %s: not moved to %s: %s", slot.key, target, err)
        except REGISTRY_ERRORS as err:
            log.warning("slot %s: cannot write %s: %s", slot.key, target, err)
        self.refresh_gauges()

    def fresh_record(self, slot: Slot, state: SlotState, **fields: Any) -> SlotRecord:
        s = self.settings
        rec = SlotRecord(model=s.model_name, node=s.node, slot=slot.name, state="prewarming", rack=s.rack)
        return msgspec.structs.replace(rec, state=state, updated_at=self.store.clock(), **fields)

    async def fail(self, slot: Slot, reason: str) -> None:
        slot.phase, slot.reason = "failed", reason
        await self.set_state(slot, "failed", reason=reason[:4000], claim_id=None, endpoint=None)

    async def give_back(self, slot: Slot, claim: Claim, reason: str | None) -> None:
        """Release a claim as its holder: `warm` (or `draining`); a claim already released elsewhere is fine."""
        try:
            await self.store.release(claim, reason=reason)
        except (StaleToken, InvalidTransition) as err:
            # Named by its token: a claim id with the token deactivates the slot, and logs are read widely.
            shown, hit = str(err), self.record(slot)
            for claim_id in (claim.claim_id, hit[0].claim_id if hit else None):
                shown = shown.replace(claim_id, "<claim>") if claim_id else shown
            log.info("slot %s: the claim with token %d was already released: %s", slot.key, claim.token, shown)
        except REGISTRY_ERRORS as err:
            log.warning("slot %s: cannot release the claim with token %d: %s", slot.key, claim.token, err)
        self.refresh_gauges()

    # --- the slot's engine ----------------------------------------------------------------------------------------

    def engine_spec(self, slot: Slot, staged: staging.Staged) -> dict[str, Any]:
        s = self.settings
        return {
            "engine": s.engine,
            "loader": self.loader,
            "model_dir": str(staged.dir),
            "files": [str(f.path) for f in staged.weights],
            "weights": staged.engine_weights(),  # verified descriptors, passed to the zygote
            "engine_user": s.engine_user,  # who the zygote becomes when the agent is root
            "model_name": s.model_name,
            "host": s.engine_host,
            "private": s.engine_memory == "private",
            "fault": s.faults.get(slot.name),
            "slot": slot.name,
            "version": staged.version,  # a zygote armed for another version is re-armed before it serves
        }

    def server_spec(self, staged: staging.Staged) -> ServerSpec | None:
        """The standby server a slot of this node runs (`served`), or None for the forked ``local`` engine."""
        s = self.settings
        if s.engine == "command":
            if not s.engine_cmd:
                raise EngineFailed("arm", "the command engine needs its server command line (--engine-cmd)")
            return ServerSpec(
                engine="command",
                argv=tuple(shlex.split(s.engine_cmd)),
                ready_path=s.ready_path,
                health_timeout_s=s.engine_start_timeout_s,
                engine_user=s.engine_user,
                version=staged.version,
            )
        if s.engine == "vllm":
            return vllm.server_spec(
                engine_user=s.engine_user,
                extra_args=s.vllm_args,
                sleep_mode=s.vllm_sleep_mode,
                health_timeout_s=s.engine_start_timeout_s,
                version=staged.version,
            )
        return None

    def served_spec(self, staged: staging.Staged) -> ServerSpec | None:
        """`server_spec`, run from the rootfs when one is mounted: its ``bin`` and site-packages first on
        ``PATH``/``PYTHONPATH`` (`rootfs.Rootfs.engine_env`); a new image is a new spec, so the server restarts."""
        spec = self.server_spec(staged)
        if spec is None or self.rootfs is None:
            return spec
        extra = self.rootfs.engine_env_extra({**os.environ, **spec.env})
        return dataclasses.replace(spec, env={**spec.env, **extra})

    def _new_engine(self, slot: Slot, staged: staging.Staged) -> SlotEngine:
        s = self.settings

        def on_exit(reason: str) -> None:
            self._engine_exited(slot, reason)

        server = self.served_spec(staged)
        if server is None:
            return ForkedEngine(
                self.engine_spec(slot, staged),
                name=slot.name,
                advertise_host=s.endpoint_host,
                port=slot.port,
                on_exit=on_exit,
                log=EngineLog(s.engine_log_dir, slot.name),  # its output, never the agent's own stderr
            )
        values = {
            "model_dir": str(Path(s.model_dir).resolve()),
            "staged_dir": str(staged.dir),
            "model_name": s.model_name,
            "slot": slot.name,
            "rootfs": str(self.rootfs.mountpoint) if self.rootfs is not None else "",
        }
        return ServedEngine(
            server,
            name=slot.name,
            bind_host=s.engine_host,
            advertise_host=s.endpoint_host,
            port=slot.port,
            values=values,
            log_dir=s.engine_log_dir,
            on_exit=on_exit,
        )

    def _wanted_spec(self, slot: Slot, staged: staging.Staged) -> Any:
        server = self.served_spec(staged)
        return server if server is not None else self.engine_spec(slot, staged)

    def needs_arming(self, slot: Slot, staged: staging.Staged) -> bool:
        """The slot's engine is not armed for `staged` (absent, dead, or armed for another spec)."""
        try:
            wanted = self._wanted_spec(slot, staged)
        except EngineFailed:
            return True
        return slot.engine is None or not slot.engine.armed or slot.engine.spec != wanted

    async def ensure_armed(self, slot: Slot, staged: staging.Staged) -> str | None:
        """With the slot's lock held: its engine armed for `staged` (re-made if its spec changed); the reason if
        it cannot arm, logged once here (every caller fails the slot with it). A standby server is started here
        and waited for (its readiness URL), which is why this runs at prewarm and in clean-ups, never on the
        activation path."""
        try:
            err = await self._arm(slot, staged)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the slot is failed with it, never left prewarming
            err = f"cannot start the engine: {describe(exc)}"
        if err is not None:
            log.error("slot %s: cannot arm its engine: %s", slot.key, _headline(err))
        return err

    async def _arm(self, slot: Slot, staged: staging.Staged) -> str | None:
        try:
            wanted = self._wanted_spec(slot, staged)
        except EngineFailed as err:
            return err.reason
        if slot.engine is not None and slot.engine.spec != wanted:
            await slot.engine.close()
            slot.engine = None
        if isinstance(slot.engine, ServedEngine) and slot.phase == "failed":
            await slot.engine.reset()  # a quarantined server may be wedged: a prewarm starts it afresh
        if slot.engine is None:
            try:
                slot.engine = self._new_engine(slot, staged)
            except OSError as err:  # the log directory refused
                return f"cannot prepare the engine: {err.strerror or err}"
        try:
            was_armed = slot.engine.armed
            await slot.engine.arm()
            if not was_armed:
                self.metrics.zygote_arms.inc()
        except EngineFailed as err:
            return err.reason
        except OSError as err:  # the interpreter (or the server's program) could not even be started
            what = "server" if isinstance(slot.engine, ServedEngine) else "zygote"
            return f"cannot start the {what}: {err.strerror or err}" + (f" ({err.filename})" if err.filename else "")
        return None

    def _engine_exited(self, slot: Slot, reason: str) -> None:
        if not self.stopping:
            self.metrics.engine_exits.inc()
            if self.on_engine_exit is not None:
                self.on_engine_exit(slot, reason)

    async def stop_engine(self, slot: Slot, why: str) -> None:
        active, slot.active = slot.active, None
        if slot.engine is not None:
            await slot.engine.stop()
        if active is not None:
            log.info("slot %s: engine %d stopped: %s", slot.key, active.started.pid, why)
        if slot.phase == "active":
            slot.phase = "warm"

    async def rearm(self, slot: Slot) -> None:
        """After an engine stops the zygote must be ready for the next activation (it normally still is), and
        armed for the weights staged now (a re-stage while it served skipped it). A standby server that must be
        (re)started is not waited for here (deactivation replies first): a server that died has already called
        `on_engine_exit`, whose recovery restarts it; one armed for older weights is handed to it the same way."""
        if isinstance(slot.engine, ServedEngine) and self.staged is not None:
            if slot.engine.armed and self.needs_arming(slot, self.staged) and self.on_engine_exit is not None:
                if slot.phase == "active":
                    slot.phase = "warm"
                self.on_engine_exit(slot, "restarting its server for the weights staged since it started")
                return
            if not slot.engine.armed:
                if slot.phase == "active":
                    slot.phase = "warm"  # its recovery (already spawned by the exit) takes it from here
                return
        if slot.engine is not None and self.staged is not None:
            err = await self.ensure_armed(slot, self.staged)
            if err is not None:
                await self.fail(slot, f"cannot re-arm the engine: {err}")
                return
        if slot.phase == "active":
            slot.phase = "warm"


def _headline(reason: str) -> str:
    """A failure's reason for the agent's log: its first line, the agent's own words (what follows is the engine's
    output, kept in the slot's log and record: on the agent's log an engine could forge lines), printable only."""
    first = reason.partition("\n")[0].removesuffix("; last output:")
    return "".join(c if c.isprintable() else "?" for c in first)[:1000]


def _port(settings: AgentSettings, index: int) -> int:
    """Slot `index`'s engine port: `engine_port_base` + index, or 0 (any free port) without a base."""
    return settings.engine_port_base + index if settings.engine_port_base else 0
