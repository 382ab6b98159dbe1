"""One slot's bring-up and take-down: claim it, activate it, deactivate it, release it.

`SlotActions` does, for one slot at a time, what `ModelScaler` (`autoscaler.act.scaler`) decides for the model: `claim`
writes the claim of the best warm slot (`KvSlotStore.claim`) and books it (`autoscaler.act.book`) in the step
that hears the write acknowledged; `activate` sends `activate` through the `AgentClient` and counts the slot serving
only on the holder's fenced ``ready`` write (`ready_under`), never on a reply; `release` tells the agent to
`deactivate`, then gives the claim back, fenced. Each publishes what became of the slot (``slot.ready``,
``slot.failed``, ``slot.released``) and the activation's timings. How many, when, and what to do after a failure
(claim the next, ask the cold path) stay with `ModelScaler`.

The agent's refusal codes decide what happens to a claim whose activation failed: `stale_token` and
`foreign_claim` mean a newer claim holds the slot, so ours is dropped from the book without a release; any other
failure (`deadline`, `engine_failed`, `not_ready`, `slot_unavailable`, no answer at all, ...) releases the claim,
fenced, and `ModelScaler` claims the next slot. Nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Final

import nats.errors

from autoscaler.act.agentclient import AgentClient, AgentUnavailable, AgentUnsubscribed
from autoscaler.act.book import Held, SlotBook, Unbooked
from autoscaler.act.events import Events
from autoscaler.metrics import AutoscalerMetrics, ModelSeries
from warmpool.errors import PulsescaleError, StaleToken
from warmpool.protocol import ActivateReply, SlotRecord
from warmpool.registry import Claim, KvSlotStore

__all__ = ["CLAIM_GONE", "SlotActions", "ready_under"]

log = logging.getLogger("pulsescale.scaler")

CLAIM_GONE: Final = frozenset({"stale_token", "foreign_claim"})
"""Refusal codes that say a newer claim holds the slot: ours holds nothing, so it is dropped, not released."""

_STAGES: Final = ("token", "load", "engine", "readiness", "total")
"""Stages of `protocol.StageTimings`, observed as the agent reported them."""


class SlotActions:
    """One model's slots, one at a time; see the module docstring."""

    def __init__(
        self,
        model: str,
        book: SlotBook,
        *,
        store: KvSlotStore,
        agents: AgentClient,
        events: Events,
        metrics: AutoscalerMetrics,
        series: ModelSeries,
        clock: Callable[[], float],
        add_lead_time: Callable[[float], None],
        spawn: Callable[[Coroutine[Any, Any, None], str], None],
        activation_deadline_s: float,
        deactivate_timeout_s: float,
    ) -> None:
        self.model = model
        self.book = book
        self.store = store
        self.agents = agents
        self.events = events
        self.metrics = metrics
        self.series = series
        self.clock = clock
        self.add_lead_time = add_lead_time
        """A measured claim -> ready time, to the decide side (`Target.add_lead_time`)."""
        self.spawn = spawn
        """Runs a coroutine as one of the scaler's tasks (`ModelScaler._spawn`: `stop` cancels them)."""
        self.activation_deadline_s = activation_deadline_s
        """`ScalerSettings.activation_deadline_s`."""
        self.deactivate_timeout_s = deactivate_timeout_s
        """`ScalerSettings.deactivate_timeout_s`."""

    async def claim(self, tried: set[str], unbooked: Unbooked) -> Held:
        """Claim the best slot and book it, in the step that hears the write acknowledged: until it is booked,
        an adoption would take our own claim for a predecessor's. A stop cannot cut it short either: a claim
        whose write is on its way lands whether or not we wait, so it runs as its own task and is booked (and
        released by `ModelScaler.stop`) instead of left held by nobody."""

        async def claim_and_book() -> Held:
            claim = await self.store.claim(self.model, exclude=tried)
            held = self.book.held[claim.key] = Held(claim, "activating", self.clock())
            self.book.claiming -= 1
            unbooked.counted = False
            return held

        pending = asyncio.ensure_future(claim_and_book())
        try:
            return await asyncio.shield(pending)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await pending
            raise

    async def activate(self, held: Held, *, measured: bool) -> bool:
        """Send `activate` for a held slot; True when it serves. On a failure the claim is dropped (a newer claim
        holds the slot) or released, and the failure published. `measured`: our own claim, timed from its write."""
        claim = held.claim
        key = claim.key
        self.book.activating_here.add(key)
        reply: ActivateReply | AgentUnavailable
        record: SlotRecord | None = None
        try:
            try:
                reply = await self.agents.activate(claim, deadline_s=self.activation_deadline_s)
            except AgentUnavailable as err:
                reply = err
                if isinstance(err, AgentUnsubscribed):
                    self._unreachable(claim.node, err)
            if isinstance(reply, ActivateReply) and reply.ok:
                # Serving only on the holder's fenced `ready` write: a reply alone is a claim anyone on the
                # subject can make (DESIGN, "Trust boundaries"), and its endpoint is never used. Still ours to
                # finish meanwhile (`SlotBook.activating_here`): the watch echo of that write is not an adoption's.
                record = await self._fenced_ready(claim)
        finally:
            self.book.activating_here.discard(key)
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
            if self.book.held.get(key) is held:
                del self.book.held[key]
            return False
        log.warning("%s: activation of %s failed: %s; releasing it and claiming the next slot", self.model, key, why)
        await self.release(held, reason=why, wait_for_agent=False)
        return False

    def _serving(self, held: Held, reply: ActivateReply, record: SlotRecord, *, measured: bool) -> None:
        claim = held.claim
        held.phase = "ready"
        stages = self.series.activation  # pulsescale_autoscaler_activation_seconds{model,stage}
        self.series.activations_ready.inc()
        if measured:
            took = self.clock() - held.since
            self.add_lead_time(took)
            stages["claim_to_ready"].observe(max(0.0, took))
        if reply.timings is not None:
            for stage in _STAGES:
                stages[stage].observe(getattr(reply.timings, f"{stage}_ms") / 1e3)
        self.events.publish(
            "slot.ready", node=claim.node, slot=claim.slot, endpoint=record.endpoint, timings=reply.timings
        )

    async def _fenced_ready(self, claim: Claim) -> SlotRecord | None:
        """The holder's fenced `ready` write of `claim`, whose endpoint is the one traffic goes to; None when the
        registry has none. The agent writes it before it replies, so the view has it but for a watch echo still
        on its way; then the broker is asked."""
        rec = self.store.record(claim.key)
        if not ready_under(rec, claim):
            with contextlib.suppress(PulsescaleError, nats.errors.Error, TimeoutError):
                rec, _ = await self.store.get(claim.key)
        if rec is not None and ready_under(rec, claim):
            return rec
        return None

    def _unreachable(self, node: str, err: AgentUnsubscribed) -> None:
        """Nobody is subscribed to `node`'s agent: a dead agent's lease stays fresh for up to its `lease_s`, and
        each claim of its slots meanwhile would fail the same way. None is offered until it heartbeats again, and
        a slot of it released meanwhile goes `failed` (its agent, back, writes it `warm`)."""
        if node not in self.store.index.unreachable:
            log.warning("%s: %s; offering none of its slots until it heartbeats again", self.model, err)
        self.store.index.mark_unreachable(node)

    async def _deactivate(self, held: Held) -> None:
        try:
            reply = await self.agents.deactivate(held.claim, timeout_s=self.deactivate_timeout_s)
        except AgentUnavailable as err:
            if isinstance(err, AgentUnsubscribed):
                self._unreachable(held.claim.node, err)
            log.info("%s: %s; releasing %s without it", self.model, err, held.claim.key)
            return
        if not reply.ok and reply.error is not None:
            log.info("%s: deactivate of %s refused (%s: %s)", self.model, held.claim.key, reply.error.code,
                     reply.error.message)  # fmt: skip

    async def release(self, held: Held, reason: str, *, wait_for_agent: bool = True) -> None:
        """Tell the agent to stop, then give the claim back; fenced, so never someone else's.

        After a failed activation the agent is told without waiting (it may be the thing that is stuck),
        so the next slot is claimed at once; on scale-down the agent gets `deactivate_timeout_s` to finish."""
        key = held.claim.key
        held.phase = "releasing"
        self.book.releasing_here.add(key)
        try:
            if wait_for_agent:
                await self._deactivate(held)
            else:
                self.spawn(self._deactivate(held), f"deactivate-{key}")
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
            if self.book.held.get(key) is held:
                del self.book.held[key]
            self.events.publish("slot.released", node=held.claim.node, slot=held.claim.slot, reason=reason)
        finally:
            self.book.releasing_here.discard(key)


def _failure(reply: ActivateReply | AgentUnavailable) -> tuple[str, str]:
    """(code, why) of a failed activation: the agent's refusal, or no usable answer at all."""
    if isinstance(reply, AgentUnavailable):
        return reply.code, str(reply)
    if reply.error is None:
        return "internal", "the agent refused without saying why"
    stage = f" at stage {reply.stage}" if reply.stage else ""
    return reply.error.code, f"{reply.error.code}{stage}: {reply.error.message}"


def ready_under(rec: SlotRecord | None, claim: Claim) -> bool:
    """`rec` is the `ready` write of `claim` (same claim id and fencing token)."""
    return rec is not None and rec.state == "ready" and rec.claim_id == claim.claim_id and rec.token == claim.token
