"""The slot registry against a real nats-server: fenced claims, leases, watches, drain, broker crashes."""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from collections import Counter

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from tests.helpers import HandClock, ShiftedClock, wait_for
from warmpool import connect, protocol, registry
from warmpool.embedded import NatsServer
from warmpool.errors import (
    ClaimConflict,
    InvalidTransition,
    NoSlotAvailable,
    PulsescaleError,
    StaleToken,
)
from warmpool.protocol import AgentLease, SlotRecord
from warmpool.registry import BucketView, Changed, Claim, KvSlotStore, Removed, Snapshot, ensure_buckets
from warmpool.rejects import Rejections
from warmpool.seed import seed_pool


async def open_stores(url: str, n: int) -> tuple[list[Client], list[KvSlotStore]]:
    conns, stores = [], []
    for i in range(n):
        c = await connect.connect(connect.NatsOptions(servers=(url,), name=f"claimer-{i}"))
        s = await KvSlotStore.open(c)
        await s.start()
        conns.append(c)
        stores.append(s)
    return conns, stores


async def close_all(conns: list[Client], stores: list[KvSlotStore]) -> None:
    for s in stores:
        await s.close()
    for c in conns:
        await c.close()


async def test_hundred_claimers_race_for_ten_slots(nats_server: NatsServer, store: KvSlotStore) -> None:
    await seed_pool(store, "m", nodes=5, slots_per_node=2)
    conns, stores = await open_stores(nats_server.url, 4)  # 4 clients x 25 claimers: real races on the broker
    try:
        outcomes: list[object] = []

        async def claimer(s: KvSlotStore) -> None:
            try:
                outcomes.append(await s.claim("m"))
            except (ClaimConflict, NoSlotAvailable) as err:
                outcomes.append(err)

        await asyncio.gather(*(claimer(stores[i % 4]) for i in range(100)))
    finally:
        await close_all(conns, stores)
    wins = [o for o in outcomes if isinstance(o, Claim)]
    losses = [o for o in outcomes if not isinstance(o, Claim)]
    assert len(wins) == 10
    assert len({w.key for w in wins}) == 10, "a slot was held twice"
    assert len(losses) == 90 and all(isinstance(o, ClaimConflict | NoSlotAvailable) for o in losses)
    # The broker agrees with the winners, claim by claim.
    for w in wins:
        rec, rev = await store.get(w.key)
        assert rec.state == "claimed" and rec.claim_id == w.claim_id and rev == w.token


async def test_claim_prefers_resident_slots_and_spreads_nodes(store: KvSlotStore) -> None:
    now = time.time()
    for node in ("a", "b", "c"):
        await store.heartbeat(
            AgentLease(node=node, slots=["s0", "s1", "s2"], heartbeat_at=now, lease_s=60, rack=f"r-{node}")
        )
        for i in range(3):
            await store.register(
                SlotRecord(
                    model="m",
                    node=node,
                    slot=f"s{i}",
                    state="warm",
                    rack=f"r-{node}",
                    weights_resident=(node != "c"),
                    rootfs_mounted=True,
                )
            )
    first = [await store.claim("m") for _ in range(3)]
    assert all(c.node != "c" for c in first), "a slot without resident weights was chosen first"
    assert Counter(c.node for c in first[:2]) == Counter({"a": 1, "b": 1}), "claims did not spread over nodes"


async def test_fenced_zombie_is_refused(store: KvSlotStore) -> None:
    await seed_pool(store, "m", nodes=1, slots_per_node=1)
    zombie = await store.claim("m")
    await store.release(zombie, reason="activation deadline")  # e.g. the autoscaler gave up on it
    holder = await store.claim("m")
    assert holder.key == zombie.key and holder.token > zombie.token and holder.claim_id != zombie.claim_id
    with pytest.raises(StaleToken):
        await store.advance(zombie, "activating")
    with pytest.raises(StaleToken):
        await store.release(zombie)
    forged = Claim(
        key=holder.key, token=zombie.token, claim_id=holder.claim_id, revision=holder.revision, record=holder.record
    )
    holder = await store.advance(holder, "activating")
    with pytest.raises(StaleToken):
        await store.advance(forged, "ready")  # right claim id, stale token
    rec, _ = await store.get(holder.key)
    assert rec.state == "activating" and rec.claim_id == holder.claim_id and rec.token == holder.token


async def test_lifecycle_is_enforced(store: KvSlotStore) -> None:
    await seed_pool(store, "m", nodes=1, slots_per_node=1)
    c = await store.claim("m")
    with pytest.raises(InvalidTransition):
        await store.advance(c, "ready")  # claimed -> ready skips activating
    c = await store.advance(c, "activating")
    c = await store.advance(c, "ready", endpoint="http://127.0.0.1:9000")
    assert c.record.endpoint == "http://127.0.0.1:9000"
    with pytest.raises(NoSlotAvailable):
        await store.claim("m")
    await store.release(c)
    rec, _ = await store.get(c.key)
    assert rec.state == "warm" and rec.claim_id is None and rec.endpoint is None
    again = await store.claim("m")
    assert again.token > c.token


async def test_advance_survives_a_concurrent_writer(store: KvSlotStore) -> None:
    """The agent writes too (residency, endpoint); the holder's CAS retries on the new revision."""
    await seed_pool(store, "m", nodes=1, slots_per_node=1)
    c = await store.claim("m")
    await store.set_state(c.key, "claimed", weights_resident=False)  # an agent-side field update
    c = await store.advance(c, "activating")
    assert c.record.weights_resident is False and c.record.state == "activating"


async def test_stale_lease_stops_claims_within_lease_plus_one_second(store: KvSlotStore) -> None:
    lease_s = 1.0
    await store.heartbeat(AgentLease(node="n1", slots=["s0"], heartbeat_at=time.time(), lease_s=lease_s))
    await store.register(SlotRecord(model="m", node="n1", slot="s0", state="warm"))
    assert store.claimable("m")
    stopped = time.time()  # the agent's last heartbeat; it dies here
    while store.claimable("m"):
        await asyncio.sleep(0.05)
        assert time.time() - stopped <= lease_s + 1.0, "slot still claimable past lease + 1 s"
    with pytest.raises(NoSlotAvailable):
        await store.claim("m")
    await store.heartbeat(AgentLease(node="n1", slots=["s0"], heartbeat_at=time.time(), lease_s=lease_s))
    assert (await store.claim("m")).node == "n1"


async def test_withdrawn_agent_is_not_claimable(store: KvSlotStore) -> None:
    await seed_pool(store, "m", nodes=1, slots_per_node=2)
    await store.withdraw("node-0")
    for _ in range(50):
        if not store.claimable("m"):
            break
        await asyncio.sleep(0.02)
    with pytest.raises(NoSlotAvailable):
        await store.claim("m")


async def test_drain_and_undrain(store: KvSlotStore) -> None:
    await seed_pool(store, "m", nodes=2, slots_per_node=2)
    held = await store.claim_slot("m.node-0.s0")
    touched = await store.drain("node-0")
    assert set(touched) == {"m.node-0.s0", "m.node-0.s1"}
    assert {r.node for r in store.claimable("m")} == {"node-1"}
    assert (await store.get("m.node-0.s1"))[0].state == "draining"
    # The held slot finishes, then goes to draining, not warm.
    held = await store.advance(held, "activating")
    await store.release(held)
    assert (await store.get("m.node-0.s0"))[0].state == "draining"
    await store.undrain("node-0")
    assert {r.key for r in store.claimable("m")} == {"m.node-0.s0", "m.node-0.s1", "m.node-1.s0", "m.node-1.s1"}


async def test_register_keeps_a_pending_drain(store: KvSlotStore) -> None:
    await seed_pool(store, "m", nodes=1, slots_per_node=1)
    c = await store.claim("m")
    await store.drain("node-0")
    await store.register(SlotRecord(model="m", node="node-0", slot="s0", state="prewarming"))  # agent restart
    rec, _ = await store.get(c.key)
    assert rec.drain and rec.state == "prewarming"


async def test_watch_snapshot_then_changes(store: KvSlotStore) -> None:
    await seed_pool(store, "m", nodes=1, slots_per_node=2)
    events = store.watch()
    first = await asyncio.wait_for(anext(events), 5)
    assert isinstance(first, Snapshot) and set(first.records) == {"m.node-0.s0", "m.node-0.s1"}
    c = await store.claim("m")
    change = await asyncio.wait_for(anext(events), 5)
    assert isinstance(change, Changed) and change.key == c.key and change.record.state == "claimed"
    await store.unregister("m.node-0.s1")
    gone = await asyncio.wait_for(anext(events), 5)
    assert isinstance(gone, Removed) and gone.key == "m.node-0.s1"
    await events.aclose()


async def test_bad_records_in_the_bucket_are_skipped_and_counted(nc: Client, store: KvSlotStore) -> None:
    kv = await nc.jetstream().key_value(protocol.SLOTS_BUCKET)
    await kv.put("m.n.bad", b'{"v":1,"model":"m"}')
    await kv.put("m.n.worse", b"not json")
    await seed_pool(store, "m", nodes=1, slots_per_node=1)
    for _ in range(100):
        if store.rejected.total() >= 2:
            break
        await asyncio.sleep(0.02)
    assert store.rejected.counts == {"missing_field": 1, "bad_json": 1}
    assert (await store.claim("m")).key == "m.node-0.s0"


@pytest.mark.slow
async def test_broker_sigkill_mid_claims(nats_server: NatsServer, store: KvSlotStore) -> None:
    """Kill -9 the broker while 4 clients claim; after restart no slot has two holders, clients reconnect,
    and every watch re-lists and converges to what the broker holds."""
    await seed_pool(store, "m", nodes=10, slots_per_node=10)
    conns, stores = await open_stores(nats_server.url, 4)
    wins: list[Claim] = []
    stop = asyncio.Event()

    async def claimer(s: KvSlotStore) -> None:
        while not stop.is_set():
            try:
                wins.append(await s.claim("m"))
            except NoSlotAvailable:
                return
            except (TimeoutError, PulsescaleError, nats.errors.Error):
                await asyncio.sleep(0.05)  # broker away: keep trying, as the controller does

    tasks = [asyncio.create_task(claimer(stores[i % 4])) for i in range(12)]
    try:
        while len(wins) < 30:
            await asyncio.sleep(0.005)
        await asyncio.to_thread(nats_server.kill)  # SIGKILL: no flush, no goodbye
        await asyncio.sleep(0.3)
        await asyncio.to_thread(nats_server.start)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
    try:
        by_key = Counter(w.key for w in wins)
        assert max(by_key.values()) == 1, f"held twice: {[k for k, n in by_key.items() if n > 1]}"
        assert len(wins) == 100, "some slot was never claimed after the restart"
        assert not any(s.index.reserved for s in stores), "a claim cut off by the broker kept its local reservation"
        for w in wins:
            rec, rev = await stores[0].get(w.key)
            assert rec.claim_id == w.claim_id and rev == w.token
        # Watches re-listed and every view converged to the broker's truth.
        for s in [store, *stores]:
            for _ in range(100):
                if all((r := s.record(w.key)) is not None and r.claim_id == w.claim_id for w in wins):
                    break
                await asyncio.sleep(0.05)
            assert s.slots.relists >= 1
            assert {r.key: r.claim_id for r in s.records()} == {w.key: w.claim_id for w in wins}
    finally:
        await close_all(conns, stores)


async def test_claim_outcome_is_resolved_by_reading_not_guessing(store: KvSlotStore) -> None:
    """The resolver says 'held' only when the broker shows our claim id."""
    await seed_pool(store, "m", nodes=1, slots_per_node=1)
    c = await store.claim("m")
    assert await store.claimer._resolve(c.key, c.claim_id) == c.token
    assert await store.claimer._resolve(c.key, "someone-else") is None


def test_placement_pick_matches_rank() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from warmpool import placement

    @settings(max_examples=200, deadline=None)
    @given(
        st.lists(st.tuples(st.integers(0, 4), st.booleans(), st.booleans()), min_size=1, max_size=30),
        st.lists(st.integers(0, 4), max_size=10),
        st.integers(0, 2**32),
    )
    def check(slots: list[tuple[int, bool, bool]], held_nodes: list[int], seed: int) -> None:
        recs = [
            SlotRecord(
                model="m",
                node=f"n{n}",
                slot=f"s{i}",
                state="warm",
                rack=f"r{n % 2}",
                weights_resident=w,
                rootfs_mounted=r,
            )
            for i, (n, w, r) in enumerate(slots)
        ]
        held = [
            SlotRecord(model="m", node=f"n{n}", slot=f"h{i}", state="ready", rack=f"r{n % 2}")
            for i, n in enumerate(held_nodes)
        ]
        warm: dict[int, dict[str, set[str]]] = {}
        for r in recs:
            warm.setdefault(placement.tier(r), {}).setdefault(r.node, set()).add(r.key)
        node_load, rack_load = placement.loads(held)
        key = placement.pick(
            warm,
            rack_of={r.node: r.rack for r in recs},
            node_load=node_load,
            rack_load=rack_load,
            usable=lambda n, keys: keys,
            skip=(),
            rng=random.Random(seed),
        )
        chosen = next(r for r in recs if r.key == key)
        best = placement.rank(recs, held, random.Random(seed))[0]

        def score(r: SlotRecord) -> tuple[int, int, int]:
            return (placement.tier(r), node_load[r.node], rack_load[r.rack])

        assert score(chosen) == score(best)

    check()


async def test_an_undecodable_update_withdraws_the_slot(nc: Client, store: KvSlotStore) -> None:
    """A record this version cannot read (a newer agent's v2, a hand edit) is not offered: its compare-and-set
    could never succeed, and a claim must not fail on it."""
    await seed_pool(store, "m", nodes=1, slots_per_node=2)
    kv = await nc.jetstream().key_value(protocol.SLOTS_BUCKET)
    await kv.put("m.node-0.s0", b'{"v":2,"model":"m","node":"node-0","slot":"s0","state":"warm"}')
    for _ in range(100):
        if store.record("m.node-0.s0") is None:
            break
        await asyncio.sleep(0.02)
    assert [r.key for r in store.claimable("m")] == ["m.node-0.s1"]
    assert (await store.claim("m")).key == "m.node-0.s1"
    with pytest.raises(NoSlotAvailable):
        await store.claim("m")
    assert store.rejected.counts["bad_version"] >= 1


async def test_lease_is_judged_only_on_a_current_view(nats_server: NatsServer) -> None:
    """After an outage longer than a lease every heartbeat in the view is old: a lease is called lapsed only once
    the view was re-listed and its agent had one heartbeat interval since to renew (issue 7: healthy serving
    slots were replaced after an 8 s outage). The shift is time passing here: both clocks move."""
    clock = ShiftedClock()
    c = await connect.connect(connect.NatsOptions(servers=(nats_server.url,), name="judge"))
    s = await KvSlotStore.open(c, clock=clock, monotonic=clock.monotonic)
    await s.start()
    try:
        await s.heartbeat(AgentLease(node="n1", heartbeat_at=clock(), lease_s=1.0, heartbeat_every_s=0.5))
        assert not s.index.lease_lapsed("n1", clock())
        assert s.index.lease_lapsed("gone", clock())  # no lease at all in a current view: withdrawn or never there
        await asyncio.to_thread(nats_server.kill)
        await wait_for(lambda: not c.is_connected, 5, "the client to notice the outage")
        clock.shift = 10.0  # the outage lasts ten leases
        assert not s.agents.current()
        assert not s.index.lease_lapsed("n1", clock()), "judged on a view that is not current"
        await asyncio.to_thread(nats_server.start)
        await wait_for(lambda: s.agents.current(), 10, "the agents view to re-list")
        # Re-listed, but the agent had no time to renew yet: its old heartbeat proves nothing.
        assert not s.index.lease_lapsed("n1", clock())
        clock.shift += 0.6  # one heartbeat interval later: the agent may still be reconnecting
        assert not s.index.lease_lapsed("n1", clock())
        clock.shift += 0.5  # two intervals and still no renewal: now it has lapsed
        assert s.index.lease_lapsed("n1", clock())
        await s.heartbeat(AgentLease(node="n1", heartbeat_at=clock(), lease_s=1.0, heartbeat_every_s=0.5))
        assert not s.index.lease_lapsed("n1", clock())
    finally:
        await s.close()
        await c.close()


async def test_release_of_a_slot_whose_agent_is_gone_does_not_offer_it(store: KvSlotStore) -> None:
    """`warm` would advertise a slot nobody serves from: a release under a lapsed lease writes `failed`."""
    await seed_pool(store, "m", nodes=2, slots_per_node=1)
    alive, dead = await store.claim_slot("m.node-0.s0"), await store.claim_slot("m.node-1.s0")
    await store.withdraw("node-1")
    await wait_for(lambda: store.index.lease("node-1") is None, 5, "the withdrawal to reach the view")
    await store.release(alive, reason="scale down")
    await store.release(dead, reason="scale down")
    back, _ = await store.get(alive.key)
    assert back.state == "warm" and back.claim_id is None
    failed, _ = await store.get(dead.key)
    assert failed.state == "failed" and failed.claim_id is None
    assert failed.reason is not None and "lease lapsed" in failed.reason and "scale down" in failed.reason


async def test_a_bucket_view_can_keep_the_last_good_record(nc: Client) -> None:
    """The autoscaler follows ScaledObjects with `keep_bad=True`: a bad edit is counted and the last good spec
    stands; slots use the default, where an unreadable record is absent."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.AGENTS_BUCKET]
    good = AgentLease(node="n1", heartbeat_at=1.0, lease_s=2.0)
    await kv.put("n1", protocol.encode(good))
    rejected = Rejections(logging.getLogger("test"))
    keeping = BucketView(nc, kv, AgentLease, rejected, keep_bad=True)
    dropping = BucketView(nc, kv, AgentLease, rejected)
    tasks = [asyncio.create_task(v.run()) for v in (keeping, dropping)]
    try:
        await wait_for(lambda: keeping.ready.is_set() and dropping.ready.is_set(), 5, "both snapshots")
        events = keeping.changes()
        first = await asyncio.wait_for(anext(events), 5)
        assert isinstance(first, Snapshot) and first.records == {"n1": good}
        await kv.put("n1", b'{"v":1,"node":"n1"}')  # no heartbeat_at, no lease_s
        await wait_for(lambda: rejected.total() >= 2, 5, "both views to count the bad record")
        assert keeping.value("n1") == good
        assert dropping.value("n1") is None
        newer = AgentLease(node="n1", heartbeat_at=2.0, lease_s=2.0)
        await kv.put("n1", protocol.encode(newer))
        changed = await asyncio.wait_for(anext(events), 5)
        assert isinstance(changed, Changed) and changed.record == newer
        await events.aclose()
    finally:
        keeping.closed = dropping.closed = True
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_bucket_view_times_each_revision_on_the_readers_clock(nats_server: NatsServer, nc: Client) -> None:
    """How long a record stood unchanged, on the reader's clock (the writer's ``updated_at`` is on the writer's,
    which may be off by minutes): a record first seen in a listing counts from the listing, a new revision from
    when it arrived, and a re-listing after a reconnect keeps the time of a revision it already held."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.AGENTS_BUCKET]

    def lease(beat: float, node: str = "n1") -> AgentLease:
        return AgentLease(node=node, heartbeat_at=beat, lease_s=2.0)

    await kv.put("n1", protocol.encode(lease(1.0)))
    await kv.put("n2", protocol.encode(lease(1.0, "n2")))
    clock = HandClock(start=100.0)
    view = BucketView(nc, kv, AgentLease, Rejections(logging.getLogger("test")), clock=clock)
    task = asyncio.create_task(view.run())
    try:
        await wait_for(view.ready.is_set, 5, "the first snapshot")
        assert (view.heard_at("n1"), view.heard_at("n2"), view.heard_at("n3")) == (100.0, 100.0, None)
        clock.now = 105.0
        await kv.put("n1", protocol.encode(lease(2.0)))
        await wait_for(lambda: view.value("n1") == lease(2.0), 5, "the new revision")
        assert (view.heard_at("n1"), view.heard_at("n2")) == (105.0, 100.0)
        await kv.delete("n2")
        await wait_for(lambda: "n2" not in view, 5, "the delete")
        assert view.heard_at("n2") is None
        clock.now = 110.0
        relists = view.relists
        await asyncio.to_thread(nats_server.restart, signal.SIGTERM)
        await wait_for(lambda: view.relists > relists and view.current(), 30, "a re-listing after the restart")
        assert (view.heard_at("n1"), view.heard_at("n2")) == (105.0, None)  # the same revision: its time kept
    finally:
        view.closed = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class EarlyMarker:
    """Fault injection around the real bucket, not a double: its watch hands over nats-py's end-of-initial-values
    marker before the entries, as nats-py does when they are still in flight while it asks for the consumer's
    pending count (nats-io/nats.py#995). With `purge`, that key's messages are purged from the stream (as
    `KeyValue.purge_deletes` does to delete markers) between the view's status read and its watch. With
    `hold_s`, the entries come that long after the marker (a stalled delivery)."""

    def __init__(self, kv: KeyValue, js: JetStreamContext, *, purge: str | None = None, hold_s: float = 0.0) -> None:
        self.kv, self.js, self.purge, self.hold_s = kv, js, purge, hold_s
        self.held: list[asyncio.Task[None]] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.kv, name)

    async def status(self) -> KeyValue.BucketStatus:
        status = await self.kv.status()
        if self.purge is not None:
            stream = status.stream_info.config.name or ""
            await self.js.purge_stream(stream, subject=f"$KV.{status.bucket}.{self.purge}")
        return status

    async def watchall(self) -> KeyValue.KeyWatcher:
        watcher = await self.kv.watchall()
        queued = watcher._updates._queue  # type: ignore[attr-defined]  # asyncio.Queue's deque
        await wait_for(lambda: None in queued, 5, "nats-py's marker queued after the entries")
        queued.remove(None)
        if self.hold_s:
            entries = list(queued)
            queued.clear()

            async def later() -> None:
                await asyncio.sleep(self.hold_s)
                for entry in entries:
                    watcher._updates.put_nowait(entry)

            self.held.append(asyncio.create_task(later()))
        queued.appendleft(None)
        return watcher


async def _first_snapshot(view: BucketView[AgentLease]) -> tuple[Snapshot[AgentLease], float]:
    """The view's first snapshot as published when it went ready, and how long that took."""
    q = view.subscribe()  # before `run`: the first event is the snapshot as installed
    task = asyncio.create_task(view.run())
    t0 = time.monotonic()
    try:
        first = await asyncio.wait_for(q.get(), 10)
        assert isinstance(first, Snapshot)
        return first, time.monotonic() - t0
    finally:
        view.closed = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_view_is_ready_only_once_the_bucket_as_it_was_is_in_even_if_the_marker_comes_first(
    nc: Client,
) -> None:
    """A view went ready holding none of the bucket when nats-py's end marker came before the entries (in CI a
    second store called a live agent stale): it now also waits for the bucket's last revision before the watch."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.AGENTS_BUCKET]
    leases = {f"n{i}": AgentLease(node=f"n{i}", heartbeat_at=1.0, lease_s=2.0) for i in range(20)}
    for node, lease in leases.items():
        await kv.put(node, protocol.encode(lease))
    view = BucketView(nc, EarlyMarker(kv, nc.jetstream()), AgentLease, Rejections(logging.getLogger("test")))  # type: ignore[arg-type]
    first, _ = await _first_snapshot(view)
    assert first.records == leases


async def test_a_view_whose_newest_revision_was_removed_meanwhile_goes_ready_after_a_quiet_second(nc: Client) -> None:
    kv = (await ensure_buckets(nc.jetstream()))[protocol.AGENTS_BUCKET]
    leases = {f"n{i}": AgentLease(node=f"n{i}", heartbeat_at=1.0, lease_s=2.0) for i in range(5)}
    for node, lease in leases.items():
        await kv.put(node, protocol.encode(lease))
    faulty = EarlyMarker(kv, nc.jetstream(), purge="n4")  # the newest revision
    view = BucketView(nc, faulty, AgentLease, Rejections(logging.getLogger("test")))  # type: ignore[arg-type]
    first, took = await _first_snapshot(view)
    assert first.records == {k: v for k, v in leases.items() if k != "n4"}
    assert took >= registry.SNAPSHOT_QUIET_S  # it waited for the quiet second, then took what there was


async def test_a_view_whose_listing_stalls_after_the_marker_waits_for_it_while_the_newest_revision_is_there(
    nc: Client,
) -> None:
    """Quiet past `SNAPSHOT_QUIET_S` is not enough to go ready: the stream still holds the newest revision, so
    the entries are on their way (a time-only fallback went ready empty here)."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.AGENTS_BUCKET]
    leases = {f"n{i}": AgentLease(node=f"n{i}", heartbeat_at=1.0, lease_s=2.0) for i in range(5)}
    for node, lease in leases.items():
        await kv.put(node, protocol.encode(lease))
    stalled = EarlyMarker(kv, nc.jetstream(), hold_s=registry.SNAPSHOT_QUIET_S + 0.5)
    view = BucketView(nc, stalled, AgentLease, Rejections(logging.getLogger("test")))  # type: ignore[arg-type]
    try:
        first, took = await _first_snapshot(view)
    finally:
        await asyncio.gather(*stalled.held)
    assert first.records == leases
    assert took >= stalled.hold_s


class Deafened:
    """Fault injection around the real bucket, not a double: the view's first watch, once `deafen` is called, hands
    over nothing more. `reset`: as nats-py's ordered consumer does after a gap or two missed heartbeats, the watch
    moves to a new inbox, and the ask for a consumer there fails (as while a cluster elects), so the old consumer
    lives on delivering to an inbox nobody reads. `drop`: the deliveries still come and are lost on the way."""

    def __init__(self, kv: KeyValue, fault: str) -> None:
        self.kv, self.fault = kv, fault
        self.first: KeyValue.KeyWatcher | None = None

    def __getattr__(self, name: str) -> object:
        return getattr(self.kv, name)

    async def watchall(self) -> KeyValue.KeyWatcher:
        watcher = await self.kv.watchall()
        self.first = self.first or watcher
        return watcher

    async def deafen(self) -> None:
        assert self.first is not None and self.first._sub is not None
        if self.fault == "drop":

            async def lost(entry: object) -> None:
                pass

            self.first._updates.put = lost  # type: ignore[method-assign]
            return
        jsi = self.first._sub._sub._jsi  # type: ignore[attr-defined]

        async def refused() -> None:
            pass

        jsi.recreate_consumer = refused
        await jsi.reset_ordered_consumer(jsi._sseq + 1)


@pytest.mark.parametrize("fault", ["reset", "drop"])
async def test_a_watch_that_hears_nothing_more_while_its_consumer_lives_is_made_anew(nc: Client, fault: str) -> None:
    """After a follower's kill in CI a store's view missed a lease for 15 s: its consumer was there, so the probe
    kept the watch. The view now also re-lists when the consumer delivers elsewhere or sent what it never got."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.AGENTS_BUCKET]
    first = AgentLease(node="n1", heartbeat_at=1.0, lease_s=2.0)
    await kv.put("n1", protocol.encode(first))
    deaf = Deafened(kv, fault)
    view = BucketView(nc, deaf, AgentLease, Rejections(logging.getLogger("test")))  # type: ignore[arg-type]
    task = asyncio.create_task(view.run())
    try:
        await wait_for(lambda: view.value("n1") == first, 5, "the first snapshot")
        await deaf.deafen()
        later = AgentLease(node="n2", heartbeat_at=1.0, lease_s=2.0)
        await kv.put("n2", protocol.encode(later))
        # nats-py alone never hears it (its next reset fails the same way; dropped deliveries look delivered).
        took = await wait_for(lambda: view.value("n2") == later, 10, "the view to see the write made while deaf")
        assert view.relists >= 1
        assert took >= registry.WATCH_PROBE_S - 0.5  # by the probe, after the silence it allows
    finally:
        view.closed = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_list_keys_names_every_key_under_a_prefix_deleted_ones_included(nc: Client) -> None:
    """`buckets.list_keys` is one stream-info request, not a watch that must be handled in time (nats-py's
    `KeyValue.keys()` may end empty when the loop is busy, as the daemon's did). Deleted keys are listed; their
    `get` says so."""
    from warmpool.buckets import list_keys

    kv = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    for key in ("override.b", "override.a", "shard.3", "override.gone"):
        await kv.put(key, b"{}")
    await kv.delete("override.gone")
    got = await list_keys(nc.jetstream(), protocol.LEASES_BUCKET, "override.")
    assert got == ["override.a", "override.b", "override.gone"]
    assert await list_keys(nc.jetstream(), protocol.LEASES_BUCKET, "nothing.") == []
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("override.gone")
