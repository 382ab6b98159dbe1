"""Fenced claims: taking a warm slot by compare-and-set, and the holder's moves from then on.

A claim picks a candidate from the local index (`warmpool.slotindex`), reserves it there while the write is in
flight, and lets the compare-and-set say whether the view was current. The revision of the claim write is the
claim's fencing token; with the random `claim_id` it is what a holder must present to move the slot on
(`advance`, `release`), checked on every write (`Claimer._verify_holder`). A claim whose outcome is unknown (the
broker gone mid-write) is resolved by reading the slot back, never by guessing. `adopt` hands a new leader the
claims of the previous one. The writes go through `SlotWrites.cas` (`warmpool.slotwrites`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

from warmpool import protocol, slots
from warmpool.bucketview import Clock
from warmpool.errors import ClaimConflict, NoSlotAvailable, SlotNotFound, StaleToken
from warmpool.protocol import SlotRecord, SlotState
from warmpool.slotindex import SlotIndex
from warmpool.slotwrites import SlotWrites

__all__ = ["Claim", "Claimer"]

log = logging.getLogger("pulsescale.registry")  # the registry's logger: operators filter on it


@dataclass(frozen=True)
class Claim:
    """A held slot. `token` is the claim write's revision (the fencing token); `revision` the latest write."""

    key: str
    token: int
    claim_id: str
    revision: int
    record: SlotRecord

    @property
    def model(self) -> str:
        return self.record.model

    @property
    def node(self) -> str:
        return self.record.node

    @property
    def slot(self) -> str:
        return self.record.slot


class Claimer:
    """Claims (`claim`, `claim_slot`) picked from `index` and written through `writes`, the holder's fenced moves
    (`advance`, `release`), and `adopt`."""

    # A claim tries at most this many candidates that turn out to be taken before it reports a conflict:
    # a loser of a race learns the truth from the compare-and-set and moves on to the next slot.
    max_claim_attempts = 16

    def __init__(
        self,
        index: SlotIndex,
        writes: SlotWrites,
        *,
        clock: Clock = time.time,
        rng: random.Random | None = None,
        resolve_timeout_s: float = 10.0,
    ) -> None:
        self.index = index
        self.writes = writes
        self.clock = clock
        self.rng = rng or random.Random()
        self.resolve_timeout_s = resolve_timeout_s
        """How long a claim whose outcome is unknown (broker gone mid-write) keeps asking the broker."""
        self.claim_conflicts = 0
        """Claim compare-and-sets lost to another writer (each one a wasted round trip plus a re-read)."""

    # --- claims --------------------------------------------------------------------------------------------------

    async def claim(self, model: str, *, exclude: Iterable[str] = ()) -> Claim:
        """Claim the best claimable slot of `model`, or raise `NoSlotAvailable` / `ClaimConflict`.

        While the bucket's stream has no leader (a cluster electing one after a server died, a few seconds),
        the write has no taker and nats-py's `NoStreamResponseError` comes out at once: the write did not land,
        and trying other slots cannot help, so it is not turned into a `ClaimConflict` (whose callers retry at
        once); callers wait a moment as for any broker error."""
        skip = set(exclude)
        conflicts = 0
        while True:
            now = self.clock()

            def usable(node: str, keys: Collection[str], now: float = now) -> list[str]:
                return self.index.usable(model, node, keys, now)

            pool = self.index.pools.get(model)
            key = pool.pick(usable=usable, skip=skip, rng=self.rng) if pool is not None else None
            if key is None:
                raise NoSlotAvailable(f"no claimable slot of model {model}")
            try:
                return await self._claim_one(self.index.slots.get(key), now)
            except ClaimConflict:
                conflicts += 1
                skip.add(key)
                if conflicts >= self.max_claim_attempts:
                    raise ClaimConflict(
                        f"lost {conflicts} races for slots of {model} in a row; the pool is contended"
                    ) from None

    async def claim_slot(self, key: str) -> Claim:
        """Claim one named slot (the on-call path and tests)."""
        hit = self.index.slots.get(key) or await self.writes.refresh(key)
        if hit is None:
            raise SlotNotFound(f"no slot {key}")
        rec = hit[0]
        now = self.clock()
        if not self.index.assignments.allows(rec.model, rec.node):
            raise NoSlotAvailable(
                f"slot {key}: model {rec.model} is not assigned to node {rec.node} ({protocol.ASSIGNMENTS_BUCKET}); "
                f"`pulsescale assign {rec.node} {rec.model}` if that node should serve it"
            )
        if not slots.claimable(rec, self.index.lease(rec.node), now, fresh=self.index.lease_fresh(rec.node, now)):
            raise NoSlotAvailable(f"slot {key} is {rec.state}{' (drained)' if rec.drain else ''} or its agent is stale")
        return await self._claim_one(hit, self.clock())

    async def _claim_one(self, hit: tuple[SlotRecord, int] | None, now: float) -> Claim:
        if hit is None:
            raise ClaimConflict("the slot left the view")
        rec, last = hit
        key = rec.key
        if rec.state != "warm" or rec.drain:
            # The CAS would pass (the revision is current) but would take a slot that is not free: the
            # index and the record disagree, which must never turn into a double hold.
            log.error("index offered %s in state %s; refusing to claim it", key, rec.state)
            raise ClaimConflict(f"slot {key} is {rec.state}, not warm")
        if key in self.index.reserved:
            # Our own claim of this slot is in flight: one of the two would lose the compare-and-set.
            raise ClaimConflict(f"slot {key} is being claimed by this process already")
        claim_id = secrets.token_hex(8)
        new = msgspec.structs.replace(
            rec, state="claimed", claim_id=claim_id, token=None, endpoint=None, reason=None, updated_at=now
        )
        self.index.reserve(key, rec)
        try:
            rev = await self.writes.slots_kv.update(key, protocol.encode(new), last=last)
        except nats.js.errors.KeyWrongLastSequenceError:
            self.claim_conflicts += 1
            await self.writes.refresh(key)
            raise ClaimConflict(f"slot {key} changed under us") from None
        except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError, nats.errors.NoRespondersError):
            # The broker may or may not have applied the write: ask it, never guess.
            resolved = await self._resolve(key, claim_id)
            if resolved is None:
                raise ClaimConflict(f"claim of {key} did not go through (broker unavailable mid-write)") from None
            rev = resolved
        finally:
            self.index.unreserve(key)
        # No await since `unreserve`: no other claimer can see the slot filed as warm again before this.
        self.index.slots.apply_local(key, new, rev)
        return Claim(key=key, token=rev, claim_id=claim_id, revision=rev, record=new)

    async def _resolve(self, key: str, claim_id: str) -> int | None:
        deadline = time.monotonic() + self.resolve_timeout_s
        while time.monotonic() < deadline:
            try:
                rec, rev = await self.writes.get(key)
            except (TimeoutError, nats.errors.Error, OSError):
                await asyncio.sleep(0.1)
                continue
            return rev if rec.claim_id == claim_id and rec.state == "claimed" else None
        return None

    async def advance(self, claim: Claim, state: SlotState, **fields: Any) -> Claim:
        """Move a held slot on (`activating`, `ready`, `releasing`, `failed`, ...) by compare-and-set.

        Raises `StaleToken` when the claim no longer holds the slot (the fenced-zombie case) and
        `InvalidTransition` when the lifecycle table forbids the move.
        """

        def build(rec: SlotRecord) -> SlotRecord:
            slots.check_transition(rec.state, state)
            return msgspec.structs.replace(rec, state=state, token=claim.token, updated_at=self.clock(), **fields)

        new, rev = await self._cas_as_holder(claim, build)
        return Claim(key=claim.key, token=claim.token, claim_id=claim.claim_id, revision=rev, record=new)

    async def release(self, claim: Claim, *, reason: str | None = None) -> None:
        """Give a held slot back: `warm`, or `draining` if its node was drained meanwhile. A slot whose agent's
        lease has lapsed, or whose agent was found not subscribed (`SlotIndex.mark_unreachable`), goes to `failed`
        instead: `warm` would advertise a slot nobody can serve from (its agent writes it `warm` again when it
        comes back)."""

        def build(rec: SlotRecord) -> SlotRecord:
            now = self.clock()
            if rec.state in ("activating", "ready"):
                # In service (or getting there): the lifecycle goes through `releasing` first.
                return msgspec.structs.replace(rec, state="releasing", reason=reason, updated_at=now)
            target = slots.release_target(rec)
            why = reason
            if target == "warm" and self.index.lease_lapsed(rec.node, now):
                target = "failed"
                why = f"released while the agent of {rec.node} was away (lease lapsed)" + (
                    f": {reason}" if reason else ""
                )
            elif target == "warm" and rec.node in self.index.unreachable:
                # Its agent is not subscribed (dead, or not connected): its lease may stay fresh for seconds yet.
                target = "failed"
                why = f"released while the agent of {rec.node} was not answering (nobody subscribed)" + (
                    f": {reason}" if reason else ""
                )
            slots.check_transition(rec.state, target)
            return msgspec.structs.replace(
                rec, state=target, claim_id=None, token=None, endpoint=None, reason=why, updated_at=now
            )

        for _ in range(2):
            new, rev = await self._cas_as_holder(claim, build)
            if new.state != "releasing":
                return
            claim = Claim(key=claim.key, token=claim.token, claim_id=claim.claim_id, revision=rev, record=new)
        raise ClaimConflict(f"slot {claim.key} did not leave releasing")

    def adopt(self, key: str) -> Claim | None:
        """The claim that holds `key` now, as a `Claim` this process can act on (a new leader takes over the
        previous leader's claims this way). None when the slot is not held, or is of a model its node may not offer
        (revision 11): its agent can write a held record under its node, claim id and all, and an adopted claim
        counts as capacity and may be activated."""
        hit = self.index.slots.get(key)
        if hit is None:
            return None
        rec, rev = hit
        if not self.index.assignments.allows(rec.model, rec.node):
            return None
        if rec.state not in slots.HELD_STATES or rec.claim_id is None:
            return None
        token = rec.token if rec.token is not None else rev  # untouched since the claim write: its revision
        return Claim(key=key, token=token, claim_id=rec.claim_id, revision=rev, record=rec)

    # --- fencing ---------------------------------------------------------------------------------------------------

    async def _cas_as_holder(self, claim: Claim, build: Callable[[SlotRecord], SlotRecord]) -> tuple[SlotRecord, int]:
        """Write `build(current)` as the claim's holder: fenced by `_verify_holder` on every attempt."""

        async def fenced(rec: SlotRecord | None, rev: int) -> SlotRecord:
            if rec is None:
                raise StaleToken(f"slot {claim.key} is gone; claim {claim.claim_id} holds nothing")
            await self._verify_holder(claim, rec, rev)
            return build(rec)

        done = await self.writes.cas(claim.key, fenced, what="under its holder", start=(claim.record, claim.revision))
        assert done is not None  # `fenced` never returns None
        return done

    async def _verify_holder(self, claim: Claim, rec: SlotRecord, rev: int) -> None:
        """The fencing check: same claim id, and the token is the revision of that claim's write."""
        stale = StaleToken(
            f"slot {claim.key} is no longer held by claim {claim.claim_id} (token {claim.token}); "
            f"it is {rec.state} under {rec.claim_id or 'nobody'}"
        )
        if rec.claim_id != claim.claim_id:
            raise stale
        if rec.token is not None:
            if rec.token != claim.token:
                raise stale
            return
        if rev == claim.token:
            return  # the record is still the claim write itself
        # Fields were updated since the claim write, before any holder wrote its token: read that write back.
        try:
            entry = await self.writes.slots_kv.get(claim.key, revision=claim.token)
        except nats.js.errors.KeyNotFoundError:
            raise stale from None
        if entry.value is None:
            raise stale
        first = protocol.decode(entry.value, SlotRecord)
        if first.claim_id != claim.claim_id or first.state != "claimed":
            raise stale
