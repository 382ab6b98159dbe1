"""The slot registry on JetStream KV: fenced claims by compare-and-set, agent leases, and watches.

Buckets (names from `protocol`): `pulse_slots` holds one `SlotRecord` per ``<model>.<node>.<slot>``;
`pulse_agents` holds one `AgentLease` per node; `pulse_assignments`, when the store follows it (the autoscaler
does), one `NodeAssignment` per node: the models that node may offer (revision 11). Every slot write is
``kv.update(key, value, last=rev)`` on the revision we last saw, so the server decides every race. The revision
of the claim write is the claim's fencing token; with the random `claim_id` it is what a holder must present to
move the slot on.

A `KvSlotStore` keeps a view of both buckets from KV watches (snapshot, then deltas; re-listed after every
reconnect, since watches do not resume by themselves). Claims pick candidates from the view and let the
compare-and-set say whether the view was current: reads are not read-your-writes, so no decision rests on one.
`BucketView` is that view for any bucket of contract records; the autoscaler follows `pulse_scalers` with one.
On a cluster a watch can also go silent with the connection up (its consumer lived on a server that died, or
nats-py's reset of it failed): a view silent for `WATCH_PROBE_S` asks the server about its consumer, and re-lists
unless it delivers to the view and holds nothing the view missed.

The buckets are made and opened by `warmpool.buckets` (re-exported here): `replicas_for` replicas, raised by the
autoscaler on an existing bucket that has fewer; other roles report it.

Leases are judged by when the reader heard them, on its own monotonic clock, never by comparing an agent's stamp
with the reader's wall clock (`warmpool.agentclocks`, contract revision 10: an agent whose clock is off serves
like any other, and its measured skew is `clock_skew`). A lease is called lapsed only on a current view: after a
reconnect the agents' view is re-listed, and a lease is called lapsed only once its agent had two heartbeat
intervals since to renew it (`lease_lapsed`). Without that, an outage longer than a lease would make every
healthy agent look dead.

`KvSlotStore` is the face the rest of the code uses; it composes the parts that do the work, each in its own
module: `SlotIndex` (`warmpool.slotindex`: the views of both buckets, the indexes a claim picks from, every
lookup; no I/O), `SlotWrites` (`warmpool.slotwrites`: the one compare-and-set loop, reads from the broker, the
agent's writes, drains) and `Claimer` (`warmpool.claims`: claims and the holder's fenced moves). `BucketView`, its
events and `check_record` live in `warmpool.bucketview`, `Claim` in `warmpool.claims`; both are re-exported here.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from nats.aio.client import Client
from nats.js.kv import KeyValue

from warmpool import protocol
from warmpool.buckets import (
    ALL_BUCKETS,
    KV_REPLICAS_ENV,
    BucketSettings,
    KvReplicasError,
    ensure_buckets,
    parse_replicas,
    replicas_for,
)
from warmpool.bucketview import (
    SNAPSHOT_QUIET_S,
    WATCH_PROBE_S,
    WATCH_PROBE_TIMEOUT_S,
    BucketView,
    Changed,
    Clock,
    Removed,
    SlotEvent,
    Snapshot,
    check_record,
)
from warmpool.claims import Claim, Claimer
from warmpool.protocol import AgentLease, SlotRecord, SlotState
from warmpool.rejects import Rejections
from warmpool.slotindex import SlotIndex
from warmpool.slotwrites import SlotWrites
from warmpool.tasks import cancel_and_wait

__all__ = [
    "BucketSettings",
    "BucketView",
    "Changed",
    "Claim",
    "KvSlotStore",
    "Removed",
    "Snapshot",
    "SlotEvent",
    "ALL_BUCKETS",
    "check_record",
    "KV_REPLICAS_ENV",
    "KvReplicasError",
    "ensure_buckets",
    "parse_replicas",
    "replicas_for",
    "SNAPSHOT_QUIET_S",
    "WATCH_PROBE_S",
    "WATCH_PROBE_TIMEOUT_S",
]

log = logging.getLogger("pulsescale.registry")


# --- the store ------------------------------------------------------------------------------------------------


class KvSlotStore:
    """The slot registry on JetStream KV. Use ``async with await KvSlotStore.open(nc) as store:``.

    Reading is from the views (`record`, `entry`, `records`, `claimable` here; leases, lease verdicts, unreachable
    nodes and clock skews on `index`; no I/O), writing is by compare-and-set: claims (`claim`, `claim_slot`), the
    holder's moves (`advance`, `release`), the agent's (`register`, `set_state`, `heartbeat`, `withdraw`), drains,
    and `watch` for the slot changes. The claimer's settings and counters are on `claimer`.

    This class opens the buckets, runs the watches and hands each call to the part that does it: `SlotIndex`
    (reads), `SlotWrites` (the compare-and-set loop, the agent's writes, drains), `Claimer` (claims, the
    holder's moves). They share the views `slots` and `agents`, the clock and `rejected`."""

    def __init__(
        self,
        nc: Client,
        buckets: dict[str, KeyValue],
        *,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
        rng: random.Random | None = None,
        resolve_timeout_s: float = 10.0,
        on_reject: Callable[[str], None] | None = None,
        require_assignment: bool = False,
    ) -> None:
        """`clock` (wall) stamps records and measures the agents' clocks; `monotonic` times how long ago each
        lease was heard (their freshness) and how long ago the views were listed.

        With `pulse_assignments` among `buckets` the store follows it and offers a node's slots only of the models
        its assignment lists (revision 11, `slotindex.Assignments`); `require_assignment` (which needs the bucket)
        offers nothing of a node that has none."""
        self.nc = nc
        self.clock = clock
        self.monotonic = monotonic
        self.rng = rng or random.Random()
        self.rejected = Rejections(log, on_reject=on_reject)
        """Records in the buckets that break the contract: skipped, counted by reason, logged at a bounded rate;
        `on_reject(reason)` binds the owner's metric (``pulsescale_registry_rejected_records_total``)."""
        slots_kv = buckets[protocol.SLOTS_BUCKET]
        agents_kv = buckets[protocol.AGENTS_BUCKET]
        assignments_kv = buckets.get(protocol.ASSIGNMENTS_BUCKET)
        if require_assignment and assignments_kv is None:
            raise ValueError(f"require_assignment needs the bucket {protocol.ASSIGNMENTS_BUCKET} among `buckets`")
        self.index = SlotIndex(
            nc,
            slots_kv,
            agents_kv,
            self.rejected,
            clock=clock,
            monotonic=monotonic,
            assignments_kv=assignments_kv,
            require_assignment=require_assignment,
        )
        """The read side: slots and agent leases as last seen, the claimable pool, each node's lease verdict
        (`lease`, `lease_fresh`, `lease_verdict`, ...), unreachable nodes and clock skews. What only reads goes
        here; the store itself claims, writes and watches."""
        self.slots: BucketView[SlotRecord] = self.index.slots
        self.agents: BucketView[AgentLease] = self.index.agents
        self._writes = SlotWrites(slots_kv, agents_kv, self.slots, self.agents, clock=clock)
        self.claimer = Claimer(
            self.index, self._writes, clock=clock, rng=self.rng, resolve_timeout_s=resolve_timeout_s
        )
        """Takes warm slots with fenced compare-and-sets (`claim_conflicts`: those lost to another claimer)."""
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def open(
        cls,
        nc: Client,
        *,
        settings: BucketSettings = BucketSettings(),
        timeout_s: float = 2.0,
        assignments: bool = False,
        **kwargs: Any,
    ) -> KvSlotStore:
        """`timeout_s` bounds each KV call: a claim caught by a broker restart learns its fate (by reading
        it back) after this long instead of the client's default 5 s. `assignments` (implied by
        `require_assignment`): follow `pulse_assignments` too, as the autoscaler does."""
        names = [protocol.SLOTS_BUCKET, protocol.AGENTS_BUCKET]
        if assignments or kwargs.get("require_assignment"):
            names.append(protocol.ASSIGNMENTS_BUCKET)
        buckets = await ensure_buckets(nc.jetstream(timeout=timeout_s), settings, names=names)
        return cls(nc, buckets, **kwargs)

    # --- the watches ---------------------------------------------------------------------------------------------

    async def start(self, timeout_s: float = 10.0) -> None:
        """Start the watches and wait for their first snapshot."""
        views: list[BucketView[Any]] = [self.slots, self.agents]
        if self.index.assigned is not None:
            views.append(self.index.assigned)
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(view.run(), name=f"registry-watch-{name}")
                for view, name in zip(views, ("slots", "agents", "assignments"), strict=False)
            ]
        await asyncio.wait_for(asyncio.gather(*(view.ready.wait() for view in views)), timeout_s)
        self.index.assignments.judge_all(self.slots.value)  # the slots listed before the assignments were

    async def stop_slot_watch(self) -> None:
        """Stop following `pulse_slots`; the view keeps what it holds, and our own writes (`apply_local`). For
        `pulsescale bench claims --without-slot-watch`, which shows what receiving our claims' echoes costs."""
        self.slots.closed = True
        await cancel_and_wait(self._tasks[:1])

    async def close(self) -> None:
        self.slots.closed = self.agents.closed = True
        if self.index.assigned is not None:
            self.index.assigned.closed = True
        await cancel_and_wait(self._tasks)
        self._tasks = []

    async def __aenter__(self) -> KvSlotStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- reading (`SlotIndex`) ---------------------------------------------------------------------------------

    def record(self, key: str) -> SlotRecord | None:
        """`SlotIndex.record`."""
        return self.index.record(key)

    def entry(self, key: str) -> tuple[SlotRecord, int] | None:
        """`SlotIndex.entry`."""
        return self.index.entry(key)

    def records(self, model: str | None = None) -> list[SlotRecord]:
        """`SlotIndex.records`."""
        return self.index.records(model)

    def claimable(self, model: str, now: float | None = None) -> list[SlotRecord]:
        """`SlotIndex.claimable`."""
        return self.index.claimable(model, now)

    async def get(self, key: str) -> tuple[SlotRecord, int]:
        """`SlotWrites.get`: one slot from the broker (not the view)."""
        return await self._writes.get(key)

    # --- claims and the holder's moves (`Claimer`) ---------------------------------------------------------------

    async def claim(self, model: str, *, exclude: Iterable[str] = ()) -> Claim:
        """`Claimer.claim`."""
        return await self.claimer.claim(model, exclude=exclude)

    async def claim_slot(self, key: str) -> Claim:
        """`Claimer.claim_slot`."""
        return await self.claimer.claim_slot(key)

    async def advance(self, claim: Claim, state: SlotState, **fields: Any) -> Claim:
        """`Claimer.advance`."""
        return await self.claimer.advance(claim, state, **fields)

    async def release(self, claim: Claim, *, reason: str | None = None) -> None:
        """`Claimer.release`."""
        await self.claimer.release(claim, reason=reason)

    def adopt(self, key: str) -> Claim | None:
        """`Claimer.adopt`."""
        return self.claimer.adopt(key)

    # --- agent side and drains (`SlotWrites`) ----------------------------------------------------------------------

    async def register(self, record: SlotRecord) -> int:
        """`SlotWrites.register`."""
        return await self._writes.register(record)

    async def set_state(
        self, key: str, state: SlotState, *, expect: Iterable[SlotState] | None = None, **fields: Any
    ) -> tuple[SlotRecord, int]:
        """`SlotWrites.set_state`."""
        return await self._writes.set_state(key, state, expect=expect, **fields)

    async def heartbeat(self, lease: AgentLease) -> int:
        """`SlotWrites.heartbeat`."""
        return await self._writes.heartbeat(lease)

    async def withdraw(self, node: str) -> None:
        """`SlotWrites.withdraw`."""
        await self._writes.withdraw(node)

    async def unregister(self, key: str) -> None:
        """`SlotWrites.unregister`."""
        await self._writes.unregister(key)

    async def drain(self, node: str) -> list[str]:
        """`SlotWrites.drain`."""
        return await self._writes.drain(node)

    async def undrain(self, node: str) -> list[str]:
        """`SlotWrites.undrain`."""
        return await self._writes.undrain(node)

    # --- watch ---------------------------------------------------------------------------------------------------

    async def watch(self) -> AsyncIterator[SlotEvent]:
        """A `Snapshot` of every slot, then each change; a new `Snapshot` after every reconnect."""
        if not self._tasks:
            await self.start()
        async for event in self.slots.changes():
            yield event
