"""Prewarm: bring slots to `warm` and keep them there.

A prewarm stages (or re-verifies) the model's weights in shm (`staging.stage`, all or nothing: a failed re-stage
keeps the complete previous set), maps and locks them (`staging.lock`), arms each slot's zygote for them, and
writes the slots `warm`. It runs at start-up and on the ``prewarm`` verb, one at a time; a slot that serves is
skipped (it is re-armed for the new weights when it is given back). A prewarm costs little when nothing changed
(anyone on the bus may send one): files this agent verified and that are unchanged since are not read again,
and a `warm` slot stays `warm` (claimable) throughout; it goes `prewarming` only while its zygote is re-armed
for a set that did change.

A stage refused for lack of shm room (`errors.NoShmRoom`: the budget, the filesystem's free space, ENOSPC) fails
its slots with the reason, logged once, and is tried again once room appears: shm's room is looked at after
`staging_retry_first_s`, then twice as long each time up to `staging_retry_max_s`, and the stage runs again only when
the room grew since it was refused (`_wait_for_room`). Staged, the slots go `warm` as after any prewarm. Other
failures (corrupt weights, a bad model) are not retried: they need a person, then a ``prewarm``.

Keeping slots warm: an engine or zygote that dies on its own fails the claim it served and is re-armed, bounded by
the slot's failures in a row (`recover`); a slot record deleted under the agent is written again (`restore`);
an idle slot the registry failed while this agent's lease had lapsed is written `warm` again (`revive`). Every
write goes through `SlotKeeper.set_state`, so a slot held by a claim is never taken from its holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Literal

from nodeagent import fetch, modelformat, progress, staging
from nodeagent.engine import local as local_engine
from nodeagent.errors import ActivationRefused, StagingFailed, describe
from nodeagent.metrics import AgentMetrics
from nodeagent.rootfsstage import RootfsStage
from nodeagent.slot import REGISTRY_ERRORS, Slot, SlotKeeper
from warmpool import protocol
from warmpool.errors import InvalidTransition, StaleToken
from warmpool.protocol import PrewarmReply, SlotRecord, SlotState

__all__ = ["Prewarmer"]

log = logging.getLogger("pulsescale.agent")

ROOTFS_RECHECK_S = 2.0
"""A rootfs residency check this recent stands for the slots armed with it (one ``mincore`` walk, not one each)."""

Outcome = Literal["staged", "no_room", "failed"]
"""How a prewarm's stage went: ``no_room`` is retried when room appears (`Prewarmer._wait_for_room`)."""


class Prewarmer:
    """The ``prewarm`` verb and the start-up prewarm; recovers, restores and revives slots (it is the keeper's
    `on_engine_exit`)."""

    def __init__(self, keeper: SlotKeeper) -> None:
        self.keeper = keeper
        self.locked: staging.LockedWeights | None = None
        """The staged weights' mappings, locked in memory where the limit allows."""
        self._running: asyncio.Task[None] | None = None
        self.progress: progress.Progress | None = None
        """The stage running now (bytes written of those to write), for the status; None between stages."""
        keeper.on_engine_exit = self._engine_exited
        s = keeper.settings
        self.rootfs = RootfsStage(
            s.image_source, s.rootfs_dir, min_resident_pct=s.rootfs_min_resident_pct, pin=s.rootfs_pin
        )
        """The engines' EROFS rootfs (``--image``): built or found, mounted or reused, and warmed by the prewarm."""
        self._rootfs_lock = asyncio.Lock()
        self._room_wait: asyncio.Task[None] | None = None
        """Waits for shm room after a stage refused for lack of it, then stages again (`_wait_for_room`)."""
        self._room_names: list[str] = []
        """The slots that wait for it."""

    async def register_all(self) -> None:
        """Write every slot `prewarming` (start-up): visible at once, claimable only once `warm`."""
        k, s = self.keeper, self.keeper.settings
        now = k.store.clock()
        for slot in k.slots.values():
            rec = SlotRecord(
                model=s.model_name,
                node=s.node,
                slot=slot.name,
                state="prewarming",
                rack=s.rack,
                updated_at=now,
                engine=s.engine,
            )
            await k.store.register(rec)
        k.refresh_gauges()

    def start(self, names: list[str]) -> None:
        if self._room_wait is not None:
            # The slots waiting for shm room come along: this prewarm stages for them too (and waits again,
            # for all of them, if it is refused the same way).
            self._room_wait.cancel()
            self._room_wait = None
            wanted = set(names) | set(self._room_names)
            names = [n for n in self.keeper.slots if n in wanted]
        self._running = self.keeper.spawn(self.prewarm(names), name="prewarm")

    @property
    def running(self) -> bool:
        return self._running is not None and not self._running.done()

    async def on_prewarm(self, req: protocol.PrewarmRequest, t_recv: float) -> PrewarmReply:
        k = self.keeper
        names = [req.slot] if req.slot else list(k.slots)
        try:
            busy = [n for n in names if k.slot(n).active is not None]
        except ActivationRefused as err:
            return protocol.refusal(PrewarmReply, err.code, str(err))
        names = [n for n in names if n not in busy]
        if self.running:
            return protocol.refusal(
                PrewarmReply, "busy", "a prewarm is already running; watch the registry for its result"
            )
        if names:
            for n in names:
                k.slots[n].failures = 0
            self.start(names)
        return PrewarmReply(accepted=names, skipped_serving=busy, state="prewarming")

    async def prewarm(self, names: list[str], *, retry: bool = False) -> Outcome:
        """Stage (or re-verify) the weights, lock them, arm the named slots' zygotes, then mark them `warm`.
        `retry`: a try of `_wait_for_room`, whose refusal for lack of room again is neither logged nor waited
        for anew (the wait goes on)."""
        k, s = self.keeper, self.keeper.settings
        targets = [k.slots[n] for n in names if k.slots[n].active is None]
        previous = k.staged
        for slot in targets:
            # A warm slot serves the staged set while it is re-verified; `arm` takes it out only to re-arm it.
            if not (slot.phase == "warm" and previous is not None and slot.engine is not None and slot.engine.armed):
                slot.phase = "prewarming"
                await k.set_state(slot, "prewarming", reason=None, weights_resident=False)
        t0 = time.perf_counter()
        mounting = k.spawn(self.prepare_rootfs(), name="rootfs")  # alongside staging: both wait on disks
        try:
            # All or nothing: on failure the staged files, `staged` and the zygotes' specs stay on the complete
            # previous set.
            staged = await asyncio.to_thread(
                staging.stage,
                s.model_source,
                s.shm_dir,
                s.model_name,
                threads=s.stage_threads,
                budget_bytes=s.shm_budget_bytes,
                progress=self._progress(),
                fetch_options=fetch.FetchOptions(
                    timeout_s=s.fetch_timeout_s, retries=s.fetch_retries, redirect_hosts=s.fetch_redirect_hosts
                ),
                check=_check_model if s.engine == "local" else None,  # a server reads its own format
                previous=previous,
            )
        except Exception as err:  # noqa: BLE001 - whatever it is, the slots must not stay `prewarming`
            if isinstance(err, staging.ShmBudgetExceeded):
                k.metrics.staging_refused.labels("shm_budget").inc()
            reason = f"staging failed: {describe(err)}"
            if not isinstance(err, staging.NoShmRoom):
                await self._staging_failed(targets, reason)
                return "failed"
            # No room: nothing is wrong with the weights. Logged once per episode, not once per try.
            await self._staging_failed(targets, f"{reason} (staged again once room appears)", quiet=retry)
            if not retry:
                if self._room_wait is not None:
                    self._room_wait.cancel()  # one wait at a time (`start` already ended any)
                self._room_names = list(names)
                self._room_wait = k.spawn(self._wait_for_room(), name="staging-room-wait")
            return "no_room"
        finally:
            self.progress = None
        k.staged = staged  # what the staged files on disk now are
        await mounting  # engines start from the rootfs: mounted (or said why not) before any is armed
        _count_staged(k.metrics, staged)
        try:
            return "staged" if await self._lock_and_arm(staged, targets, t0) else "failed"
        finally:
            if previous is not None:
                previous.close(keep=staged)  # running zygotes hold their own copies of what they were given

    async def _wait_for_room(self) -> None:
        """Stage again for the slots refused for lack of shm room once there is more room than when it was
        refused; looked at after `staging_retry_first_s`, then twice as long each time up to
        `staging_retry_max_s`. The slots stay `failed` with the reason meanwhile. Ends staged, refused for
        another reason (logged as such), superseded by a ``prewarm`` (`start`), or cancelled at shutdown."""
        k, s = self.keeper, self.keeper.settings
        t0, tries, outcome = time.monotonic(), 0, "no_room"
        delay_s = s.staging_retry_first_s
        refused_at = await self._room()
        try:
            while outcome == "no_room" and not k.stopping:
                await asyncio.sleep(delay_s)
                delay_s = min(2 * delay_s, s.staging_retry_max_s)
                room = await self._room()
                if self.running or (room is not None and refused_at is not None and room <= refused_at):
                    continue  # nothing freed: the same stage would be refused the same way
                tries += 1
                self._running = asyncio.current_task()
                try:
                    outcome = await self.prewarm(self._room_names, retry=True)
                finally:
                    self._running = None
                refused_at = await self._room()
        finally:
            if self._room_wait is asyncio.current_task():
                self._room_wait = None
        if outcome == "staged":
            log.info(
                "shm has room again: staged %s after %d tr%s, %.0f s after it was refused",
                s.model_name,
                tries,
                "y" if tries == 1 else "ies",
                time.monotonic() - t0,
            )

    async def _room(self) -> int | None:
        """Bytes a stage could write in shm now (`staging.room_bytes`); None when that cannot be told."""
        s = self.keeper.settings
        try:
            return await asyncio.to_thread(staging.room_bytes, s.shm_dir, s.shm_budget_bytes)
        except (OSError, StagingFailed):
            return None  # stage again on the back-off: the stage itself says what is wrong

    def _progress(self) -> progress.Progress:
        """A line in the log every `progress_interval_s` or 10 % of a stage's bytes; the fraction in the status."""
        s = self.keeper.settings

        def say(p: progress.Progress, now: float) -> None:
            log.info("%s", progress.describe(p, now))  # from a staging thread: logging is thread-safe

        self.progress = progress.Progress(
            total_bytes=0,
            started_at=time.monotonic(),
            what=f"staging {s.model_name} from {fetch.shown(s.model_source) if s.model_url else s.model_source}",
            on_due=say,
            gate=progress.Gate(interval_s=s.progress_interval_s),
        )
        return self.progress

    async def _lock_and_arm(self, staged: staging.Staged, targets: list[Slot], t0: float) -> bool:
        """False when the staged weights cannot be mapped (the slots are `failed`); each slot's arming says
        for itself how it went."""
        k, s = self.keeper, self.keeper.settings
        try:
            # Re-uses the mappings of unchanged files and unlocks the rest before locking anything new, so the
            # weights never count twice against RLIMIT_MEMLOCK. Mapped from the verified descriptors.
            locked = await asyncio.to_thread(
                staging.lock, staged.weights, want_lock=s.lock_weights, previous=self.locked
            )
        except Exception as err:  # noqa: BLE001
            self.locked = None
            await self._staging_failed(targets, f"cannot map the staged weights: {describe(err)}")
            return False
        self.locked = locked
        k.staging_error = None
        took = time.perf_counter() - t0
        m = k.metrics
        m.staging_seconds.set(took)
        m.staged_bytes.set(staged.weights_bytes)
        m.locked_bytes.set(locked.locked_bytes)
        m.lock_refused.set(1 if locked.error else 0)
        log.info(
            "staged %s: %d file(s), %.1f MiB (%.1f MiB %s, %.1f MiB read to verify) in %.2f s; %s",
            s.model_name,
            len(staged.files),
            staged.nbytes / 2**20,
            staged.written_bytes / 2**20,
            staged.how,
            staged.hashed_bytes / 2**20,
            took,
            f"locked {locked.locked_bytes / 2**20:.1f} MiB" if locked.error is None else locked.error,
        )
        await asyncio.gather(*(self.arm(slot, staged) for slot in targets))
        return True

    async def _staging_failed(self, targets: list[Slot], reason: str, *, quiet: bool = False) -> None:
        """Every target `failed` with `reason`; logged unless `quiet` (a retry refused as the first try was)."""
        self.keeper.staging_error = reason
        if quiet:
            log.debug("%s", reason)
        else:
            log.error("%s", reason)
        for slot in targets:
            await self.keeper.fail(slot, reason)

    async def arm(self, slot: Slot, staged: staging.Staged) -> None:
        k = self.keeper
        async with slot.held("arming its engine"):
            if slot.active is not None:
                return
            same = not k.needs_arming(slot, staged)
            if not same and slot.phase == "warm":
                slot.phase = "prewarming"  # not claimable while its zygote is re-armed for the new set
                await k.set_state(slot, "prewarming", reason=None)
            err = await k.ensure_armed(slot, staged)
            if err is not None:
                await k.fail(slot, f"cannot arm the engine: {err}")
                return
            slot.phase, slot.reason, slot.failures = "warm", None, 0
            await self.rootfs_resident()  # offered only with its rootfs back in the page cache
            await k.set_state(
                slot,
                "warm",
                reason=None,
                weights_resident=True,
                claim_id=None,
                token=None,
                engine=k.settings.engine,
                **self.rootfs.record_fields(),
            )

    # --- the rootfs --------------------------------------------------------------------------------------------------

    async def prepare_rootfs(self) -> None:
        """Build or find the image, mount or reuse it, warm it (`RootfsStage.prepare`); a failure is the
        stage's reason, said once, and the slots run without it."""
        if self.rootfs.source is None:
            return
        async with self._rootfs_lock:
            try:
                await asyncio.to_thread(self.rootfs.prepare)
            except Exception as err:  # noqa: BLE001 - a rootfs problem never keeps a slot from serving
                self.rootfs.rootfs = None
                self.rootfs.reason = f"rootfs stage failed: {describe(err)}"
                log.error("%s", self.rootfs.reason)
            self.keeper.rootfs = self.rootfs.rootfs  # standby servers run from it (`SlotKeeper.served_spec`)

    async def rootfs_resident(self) -> None:
        """Re-check the rootfs's residency before a slot is offered and re-warm it below the target; slots armed
        together share one check (`ROOTFS_RECHECK_S`)."""
        if not self.rootfs.mounted:
            return
        async with self._rootfs_lock:
            checked = self.rootfs.checked_at
            if checked is not None and time.time() - checked < ROOTFS_RECHECK_S:
                return
            try:
                await asyncio.to_thread(self.rootfs.ensure_resident)
            except OSError as err:
                log.warning("rootfs: cannot check its page-cache residency: %s", err)

    def release(self) -> None:
        """Unlock and unmap the staged weights and the rootfs image (shutdown); the staged files and the image's
        mount stay for the next start."""
        if self.locked is not None:
            self.locked.release()
            self.locked = None
        if self.keeper.staged is not None:
            self.keeper.staged.close()  # the engines are gone; the files stay, the descriptors need not
        self.rootfs.unpin()

    # --- keeping slots warm --------------------------------------------------------------------------------------

    def _engine_exited(self, slot: Slot, reason: str) -> None:
        self.keeper.spawn(self.recover(slot, reason), name=f"recover-{slot.name}")

    async def recover(self, slot: Slot, reason: str) -> None:
        """An engine or zygote died on its own: fail the claim it served, then re-arm (bounded by the failure
        count) so the slot comes back `warm` if nothing is broken."""
        k = self.keeper
        async with slot.held(f"re-arming after: {reason}"):
            active, slot.active = slot.active, None
            if active is not None:
                slot.failures += 1
                slot.phase, slot.reason = "failed", f"engine died while serving: {reason}"
                with contextlib.suppress(StaleToken, InvalidTransition, *REGISTRY_ERRORS):
                    await k.store.advance(active.claim, "failed", reason=slot.reason, claim_id=None, endpoint=None)
                k.refresh_gauges()
            elif slot.phase == "warm":
                slot.phase = "prewarming"
                await k.set_state(slot, "prewarming", reason=f"re-arming: {reason}")
            else:
                return  # failed or prewarming: a prewarm owns the slot now
        if slot.failures >= k.settings.max_consecutive_failures:
            await k.fail(slot, f"{slot.failures} failures in a row, last: {reason}; send prewarm to retry")
            return
        if k.staged is not None:
            await self.arm(slot, k.staged)

    async def restore(self, slot: Slot) -> None:
        """The slot's record was deleted under us: write it again as what the slot is."""
        k = self.keeper
        if k.stopping or k.record(slot) is not None:
            return
        state: SlotState = "prewarming" if slot.phase == "prewarming" else "warm" if slot.phase == "warm" else "failed"
        log.warning("slot %s vanished from the registry; writing it again as %s", slot.key, state)
        async with slot.held("restoring its record"):
            if slot.active is not None:
                await k.stop_engine(slot, "its record was deleted")
                await k.rearm(slot)
                state = "warm" if slot.phase == "warm" else state
            with contextlib.suppress(*REGISTRY_ERRORS):
                await k.store.register(
                    k.fresh_record(
                        slot,
                        state,
                        weights_resident=k.staged is not None,
                        reason=slot.reason,
                        **self.rootfs.record_fields(),
                    )
                )

    async def revive(self, slot: Slot) -> None:
        """An idle, armed slot that the registry shows `failed` with no claim: a claim was given back while this
        agent's lease had lapsed (the registry cannot tell a dead agent from a slow one). Alive again, the agent
        writes it `warm`."""
        k = self.keeper
        async with slot.held("writing it warm again"):
            rec = k.store.record(slot.key)
            if k.stopping or not slot.idle or rec is None or rec.state != "failed" or rec.claim_id is not None:
                return
            log.info("slot %s: failed while this agent was away (%s); warm again", slot.key, rec.reason)
            await self.rootfs_resident()
            fields = self.rootfs.record_fields()
            await k.set_state(slot, "warm", reason=None, weights_resident=True, claim_id=None, token=None, **fields)


def _count_staged(m: AgentMetrics, staged: staging.Staged) -> None:
    """Copied, fetched and reused bytes, and bytes hashed: an agent restart that finds its weights staged counts
    them reused (and hashed, to re-verify), never copied or fetched."""
    m.staged_bytes_total.labels(staged.how).inc(staged.written_bytes)
    m.staged_bytes_total.labels("reused").inc(staged.reused_bytes)
    m.hashed_bytes_total.inc(staged.hashed_bytes)


def _check_model(pending: staging.Staged) -> None:
    """Vets a new staged set before it replaces the old one: the engine's config against the tensors."""
    cfg = local_engine.read_config_file(pending.path_of(modelformat.CONFIG_FILE))
    local_engine.check_model(cfg, pending.shapes())
