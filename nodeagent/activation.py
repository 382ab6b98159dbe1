"""Activation and deactivation: take a claimed slot into service and out of it, fenced by its claim.

`on_activate` takes the slot's lock by the request's deadline, checks the claim against the registry (the slot's
record comes from the registry watch, so the check usually costs no read), writes `activating` by compare-and-set
(the fencing check proper: it succeeds only for the claim's own token), starts the armed zygote's engine, checks
readiness (``GET`` of its health path, `Started.health_path`, and one real completion) and writes `ready` with
the endpoint, as the claim's holder.
The reply carries the stage timings. The activation path does no work that can be done before: the zygote has
imported everything and the weights are staged, verified and locked (`prewarm`).

A failed or late activation is answered at once; its clean-up (stop the engine, re-check the staged weights,
re-arm, give the claim back or quarantine a slot that keeps failing) runs after the reply, still under the lock.

Deadline (contract revision 10): the request's `deadline` is in this node's clock (the autoscaler states it so, from
the skew it measures in our heartbeats). It is read once, at arrival, and turned into a deadline on
`time.perf_counter` (`_until`), no later than `deadline_s` after arrival when the request carries it: every wait of
the activation is timed on that one monotonic clock, so a step of the wall clock meanwhile (chrony syncing at boot)
neither cuts nor stretches it.

Fencing: the agent keeps the highest verified token per slot and refuses anything lower unread; a request must
carry both halves of the claim (token and claim id) that holds the slot. `deactivate` stops the engine before the
slot goes back, so no engine serves a slot it does not hold; `fence` does the same when the registry shows the
claim released or superseded without a deactivate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp

from nodeagent import readiness, staging
from nodeagent.errors import ActivationRefused, BadWeights, EngineFailed, describe
from nodeagent.slot import REGISTRY_ERRORS, Active, Slot, SlotKeeper
from warmpool import protocol, slots
from warmpool.errors import InvalidTransition, SlotNotFound, StaleToken
from warmpool.protocol import ActivateReply, DeactivateReply, ErrorCode, SlotRecord, StageTimings
from warmpool.registry import Claim

__all__ = ["Activator"]

log = logging.getLogger("pulsescale.agent")

STAGES = ("token", "load", "engine", "readiness", "total")


class Activator:
    """The ``activate`` and ``deactivate`` verbs, and fencing an engine whose claim moved on (`fence`)."""

    def __init__(self, keeper: SlotKeeper, session: aiohttp.ClientSession) -> None:
        self.keeper = keeper
        self.session = session

    # --- activate --------------------------------------------------------------------------------------------

    def _until(self, req: protocol.ActivateRequest, t_recv: float) -> float:
        """The activation's deadline on `time.perf_counter` (the clock `t_recv` is on): `deadline` read on our wall
        clock now, and no later than `deadline_s` after arrival (revision 10) when the request carries it."""
        until = time.perf_counter() + (req.deadline - self.keeper.store.clock())
        if req.deadline_s is not None:
            until = min(until, t_recv + req.deadline_s)
        return until

    async def on_activate(self, req: protocol.ActivateRequest, t_recv: float) -> ActivateReply:
        until = self._until(req, t_recv)
        try:
            slot = self.keeper.slot(req.slot)
            await slot.lock_by(until, t_recv)
            handed_off = False
            try:
                reply, cleanup = await self._activate(slot, req, t_recv, until)
                if cleanup is not None:
                    # Reply first; the clean-up (stop, re-check, re-arm, give back) keeps the lock and frees it.
                    self.keeper.spawn(slot.unlock_after(cleanup), name=f"after-activation-{slot.name}")
                    handed_off = True
            finally:
                if not handed_off:
                    slot.lock.release()
        except ActivationRefused as err:
            self.keeper.metrics.activations.labels("refused").inc()
            message = self._masked(str(err), req.slot, req.claim_id)
            # The log never holds a claim id, not even the asker's own (the asker may be its holder).
            log.info("activate %s refused: %s: %s", req.slot, err.code, message.replace(req.claim_id, "<claim>"))
            return protocol.refusal(ActivateReply, err.code, message, slot=req.slot)
        return reply

    def _masked(self, message: str, slot_name: str, own: str) -> str:
        """`message` without the claim id of whoever else holds the slot: with the token (public in `pulse_slots`)
        it would deactivate the slot (contract revision 2), and a refusal goes to whoever asked. The holder is
        named by its token instead. Refusals only: the success path does not pay for it."""
        slot = self.keeper.slots.get(slot_name)
        if slot is None:
            return message
        hit = self.keeper.record(slot)
        for claim_id in (slot.active.claim_id if slot.active else None, hit[0].claim_id if hit else None):
            if claim_id and claim_id != own:
                message = message.replace(claim_id, "<another claim>")
        return message

    def _check_claim(self, slot: Slot, rec: SlotRecord, rev: int, token: int, claim_id: str) -> None:
        """Refuse a request whose claim does not hold the slot, naming the holder by its token (never its id)."""
        if rec.claim_id is None:
            raise ActivationRefused(
                "stale_token",
                f"slot {slot.key} is {rec.state} and held by no claim (revision {rev}); token {token} "
                "is stale (released or never claimed)",
            )
        if rec.claim_id != claim_id:
            newer = (rec.token or rev) > token
            raise ActivationRefused(
                "stale_token" if newer else "foreign_claim",
                f"slot {slot.key} is held by another claim (token {rec.token or '?'}, revision {rev}), "
                f"not by claim {claim_id} with token {token}",
            )
        if rec.token is not None and rec.token != token:
            raise ActivationRefused(
                "stale_token", f"slot {slot.key} is held under token {rec.token}, the request has token {token}"
            )

    async def _current(self, slot: Slot, min_revision: int) -> tuple[SlotRecord, int]:
        """The slot's record as of `min_revision` at least: the watch view when it has caught up (usual: the
        claim write reaches the watch before the request reaches us), else one read."""
        hit = self.keeper.record(slot)
        if hit is not None and hit[1] >= min_revision:
            return hit
        try:
            return await self.keeper.store.get(slot.key)
        except SlotNotFound:
            raise ActivationRefused("unknown_slot", f"slot {slot.key} is not in the registry") from None

    async def _activate(
        self, slot: Slot, req: protocol.ActivateRequest, t_recv: float, until: float
    ) -> tuple[ActivateReply, Coroutine[Any, Any, None] | None]:
        """With the slot's lock held: (the reply, clean-up to run after replying, still under the lock). `until`
        is the deadline on `time.perf_counter` (`_until`)."""
        k = self.keeper
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
        remaining = until - time.perf_counter()
        if remaining <= 0:
            await k.give_back(slot, claim, f"activation arrived {-remaining * 1e3:.0f} ms past its deadline")
            k.metrics.activations.labels("deadline").inc()
            raise ActivationRefused("deadline", f"request arrived {-remaining * 1e3:.0f} ms after its deadline")
        engine = slot.engine
        if slot.phase not in ("warm", "active") or engine is None or not engine.armed:
            why = slot.reason or k.staging_error or f"slot is {slot.phase}"
            raise ActivationRefused("slot_unavailable", f"slot {slot.key} cannot activate now: {why}")
        try:
            if rec.state == "claimed":
                # The compare-and-set is the fencing check: it succeeds only for the claim's own token.
                claim = await k.store.advance(claim, "activating")
        except StaleToken as err:
            raise ActivationRefused("stale_token", str(err)) from None
        except InvalidTransition as err:
            raise ActivationRefused("not_claimed", str(err)) from None
        # Verified by the registry: only now may this token raise the bar or displace an engine.
        slot.highest_token = max(slot.highest_token, req.token)
        if active is not None:  # an engine serving an older claim that lost the slot: a fenced zombie
            await k.stop_engine(slot, f"superseded by the claim with token {req.token}")
        t_token = time.perf_counter()
        slot.phase = "active"
        stage = "engine"
        budget_ms = (until - time.perf_counter()) * 1e3
        try:
            try:
                # One deadline over both stages; each stage also bounds itself, so it can say what it waited for.
                async with asyncio.timeout(max(0.0, until - time.perf_counter()) + 0.05):
                    started = await engine.start(timeout_s=max(0.001, until - time.perf_counter()))
                    t_engine = time.perf_counter()
                    stage = "readiness"
                    await readiness.check(
                        self.session,
                        started.endpoint,
                        k.settings.model_name,
                        timeout_s=until - time.perf_counter(),
                        health_path=started.health_path,
                    )
                    t_ready = time.perf_counter()
            except TimeoutError:
                raise EngineFailed(
                    stage, f"not done by the deadline ({budget_ms:.0f} ms after arrival)", code="deadline"
                ) from None
            stage = "ready"
            try:
                claim = await k.store.advance(
                    claim,
                    "ready",
                    endpoint=started.endpoint,
                    reason=None,
                    engine=k.settings.engine,
                    engine_mode=started.engine_mode,
                )
            except (StaleToken, InvalidTransition) as err:
                # The claim was released while we started (the claimer gave up): stop, the slot is someone else's.
                await engine.stop()
                slot.phase = "warm"
                k.metrics.activations.labels("refused").inc()
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
            code: ErrorCode = "registry_unavailable" if isinstance(err, REGISTRY_ERRORS) else "internal"
            return self._activation_failed(slot, claim, EngineFailed(stage, describe(err), code=code), t_recv)
        slot.last_timings = timings
        slot.last_mode = started.engine_mode
        slot.activations += 1
        slot.failures = 0
        slot.reason = None
        m = k.metrics
        for name in STAGES:
            m.activation_seconds.labels(name).observe(getattr(timings, f"{name}_ms") / 1e3)
        m.activations.labels("ready").inc()
        m.loaded_bytes.inc(started.loaded_bytes)
        k.refresh_gauges()
        log.info(
            "slot %s ready at %s under token %d in %.1f ms (load %.1f ms)",
            slot.key,
            started.endpoint,
            req.token,
            timings.total_ms,
            timings.load_ms,
        )
        return self._ready_reply(slot, slot.active, repeated=False), None

    def _ready_reply(self, slot: Slot, active: Active, *, repeated: bool) -> ActivateReply:
        return ActivateReply(
            slot=slot.name,
            key=slot.key,
            state="ready",
            endpoint=active.started.endpoint,
            token=active.token,
            claim_id=active.claim_id,
            timings=active.timings,
            loaded_bytes=active.started.loaded_bytes,
            load_mode=active.started.mode,
            engine_mode=active.started.engine_mode,  # type: ignore[arg-type]
            loader=self.keeper.loader,
            repeated=repeated,
        )

    def _activation_failed(
        self, slot: Slot, claim: Claim, err: EngineFailed, t_recv: float
    ) -> tuple[ActivateReply, Coroutine[Any, Any, None]]:
        """The reply now, and the clean-up to run after it under the slot's lock: stop what was started, then
        give the slot back (`warm`), or fail it if it is broken."""
        slot.failures += 1
        quarantine = slot.failures >= self.keeper.settings.max_consecutive_failures
        slot.busy = "cleaning up after a failed activation"
        self.keeper.metrics.activations.labels("deadline" if err.code == "deadline" else "failed").inc()
        took_ms = (time.perf_counter() - t_recv) * 1e3
        reason = f"activation failed after {took_ms:.0f} ms at stage {err.stage}: {err.reason}"
        log.warning("slot %s: %s", slot.key, reason)
        reply = protocol.refusal(
            ActivateReply,
            err.code,
            reason,
            slot=slot.name,
            stage=err.stage,
            state="failed" if quarantine else slots.release_target(claim.record),
            timings=StageTimings(total_ms=took_ms),
        )
        return reply, self._after_failed_activation(slot, claim, reason, quarantine)

    async def _after_failed_activation(self, slot: Slot, claim: Claim, reason: str, quarantine: bool) -> None:
        k = self.keeper
        slot.active = None
        engine = slot.engine
        if engine is not None:
            await engine.stop()  # before the claim goes back: no engine serves a slot it does not hold
        broken = None
        if k.staged is not None:
            try:
                await asyncio.to_thread(staging.check_staged, k.staged)
            except BadWeights as bad:
                broken = f"staged weights damaged: {bad}"
        if broken is None and k.staged is not None and engine is not None:
            arm_err = await k.ensure_armed(slot, k.staged)
            if arm_err is not None:
                broken = f"cannot re-arm the engine: {arm_err}"
        if broken is None and quarantine:
            broken = f"{slot.failures} activations in a row failed; send prewarm to retry"
        if broken is None:
            slot.phase, slot.reason = "warm", reason
            await k.give_back(slot, claim, reason)
        else:
            slot.phase, slot.reason = "failed", f"{broken}; last: {reason}"
            try:
                await k.store.advance(claim, "failed", reason=slot.reason[:4000], claim_id=None, endpoint=None)
            except (StaleToken, InvalidTransition):
                await k.fail(slot, slot.reason)  # the claimer released it first: fail the slot as such
            except REGISTRY_ERRORS as err:
                log.warning("slot %s: cannot write failed: %s", slot.key, err)
        k.refresh_gauges()

    # --- deactivate ---------------------------------------------------------------------------------------------

    async def on_deactivate(self, req: protocol.DeactivateRequest, t_recv: float) -> DeactivateReply:
        m = self.keeper.metrics
        try:
            slot = self.keeper.slot(req.slot)
            async with slot.held("deactivating"):
                reply = await self._deactivate(slot, req)
        except ActivationRefused as err:
            m.deactivations.labels("refused").inc()
            return protocol.refusal(
                DeactivateReply, err.code, self._masked(str(err), req.slot, req.claim_id), slot=req.slot
            )
        m.deactivations.labels("ok").inc()
        return reply

    async def _deactivate(self, slot: Slot, req: protocol.DeactivateRequest) -> DeactivateReply:
        """With the slot's lock held: release the slot if the request's claim (token and claim id) holds it,
        stopping its engine first; refuse any other claim, naming the holder."""
        k = self.keeper
        if req.token < slot.highest_token:
            raise ActivationRefused(
                "stale_token", f"token {req.token} is lower than {slot.highest_token}, already seen for {slot.key}"
            )
        active = slot.active
        if active is not None and req.token == active.token and req.claim_id != active.claim_id:
            raise ActivationRefused(
                "foreign_claim", f"slot {slot.key} serves another claim (token {active.token}), not {req.claim_id}"
            )
        try:
            rec, rev = await k.store.get(slot.key)
        except SlotNotFound:
            raise ActivationRefused("unknown_slot", f"slot {slot.key} is not in the registry") from None
        except REGISTRY_ERRORS as err:
            raise ActivationRefused("registry_unavailable", f"cannot read {slot.key}: {err}") from None
        held = rec.claim_id is not None and rec.state in (*slots.HELD_STATES, "failed")
        if held and rec.claim_id == req.claim_id and rec.token in (None, req.token):
            claim = Claim(key=slot.key, token=req.token, claim_id=req.claim_id, revision=rev, record=rec)
            if active is not None and active.token == req.token:
                await k.stop_engine(slot, f"deactivated (token {req.token})")  # stop serving before `warm`
            try:
                await k.store.release(claim)  # verifies the token against the claim write
            except (StaleToken, InvalidTransition) as err:
                raise ActivationRefused("stale_token", str(err)) from None
            slot.highest_token = max(slot.highest_token, req.token)
            if slot.active is not None:
                await k.stop_engine(slot, f"its slot was released by the claim with token {claim.token}")
            note = "released"
        elif held:
            if active is not None and active.token == req.token:  # ours, but the registry moved on: a zombie
                await k.stop_engine(slot, f"its claim (token {active.token}) no longer holds the slot")
            newer = (rec.token or rev) > req.token
            raise ActivationRefused(
                "stale_token" if newer else "foreign_claim",
                f"slot {slot.key} is held by another claim (token {rec.token or '?'}), not by claim "
                f"{req.claim_id} with token {req.token}",
            )
        else:
            # Nobody holds it: the claimer (or a deadline) already released it. Stop anything still serving.
            if active is not None and active.token == req.token:
                await k.stop_engine(slot, "its claim was released")
            note = f"already {rec.state}"
        await k.rearm(slot)
        k.refresh_gauges()
        now = k.record(slot)
        return DeactivateReply(slot=slot.name, key=slot.key, state=now[0].state if now else None, note=note)

    async def fence(self, slot: Slot) -> None:
        """The registry shows the claim this slot serves under released or superseded: stop its engine."""
        async with slot.held("stopping a fenced engine"):
            active, hit = slot.active, self.keeper.record(slot)
            if active is None or hit is None or hit[0].claim_id == active.claim_id:
                return
            await self.keeper.stop_engine(
                slot, f"its claim (token {active.token}) was released or superseded in the registry"
            )
            await self.keeper.rearm(slot)
