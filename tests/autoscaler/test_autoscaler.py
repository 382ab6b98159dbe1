"""The autoscaler daemon against a real nats-server: pulses become claims, failures become the next claim,
and a leader crash is survived by the standby. Agents are the protocol-level double in tests/agent_double.py,
so they can go silent on cue."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import ClassVar

import msgspec
import pytest
from nats.aio.client import Client

from autoscaler import daemon
from autoscaler.controller import ControllerSettings
from autoscaler.metrics import AutoscalerMetrics
from autoscaler.shards.leader import LeaseSettings
from tests.agent_double import AgentDouble
from tests.helpers import ShiftedClock, wait_for
from warmpool import connect, protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.errors import PulsescaleError
from warmpool.protocol import QueueSample, ScaledObjectSpec, ScalerRecord
from warmpool.registry import KvSlotStore, ensure_buckets


def spec(model: str, **over: object) -> ScaledObjectSpec:
    raw = {
        "scaleTargetRef": {"name": model},
        "minReplicaCount": 0,
        "maxReplicaCount": 8,
        "triggers": [{"type": "gateway-queue", "metadata": {"model": model, "targetQueueDepth": 4}}],
        **over,
    }
    return protocol.decode(msgspec.json.encode(raw), ScaledObjectSpec)


async def put_scaler(nc: Client, model: str, **over: object) -> None:
    kv = (await ensure_buckets(nc.jetstream()))[protocol.SCALERS_BUCKET]
    rec = ScalerRecord(namespace="test", name=model, spec=spec(model, **over))
    await kv.put(rec.key, protocol.encode(rec))


class Gateway:
    def __init__(self, nc: Client, model: str, name: str = "gw-1") -> None:
        self.nc, self.model, self.name, self.seq = nc, model, name, 0

    async def send(self, depth: int, inflight: int = 0) -> None:
        self.seq += 1
        s = QueueSample(
            gateway=self.name,
            model=self.model,
            seq=self.seq,
            ts=time.time(),
            queue_depth=depth,
            inflight=inflight,
            arrivals_total=self.seq,
            completions_total=0,
            timeouts_total=0,
        )
        await self.nc.publish(protocol.queue_subject(self.model), protocol.encode(s))

    running: ClassVar[set[asyncio.Task[None]]] = set()

    def background(self, depth: int, seconds: float) -> asyncio.Task[None]:
        """`steady` as a task; `cancel_gateways` (autouse) cancels what a test leaves running, pass or fail."""
        task = asyncio.create_task(self.steady(depth, seconds))
        Gateway.running.add(task)
        task.add_done_callback(Gateway.running.discard)
        return task

    async def steady(self, depth: int, seconds: float, every_s: float = 0.1) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            await self.send(depth)
            await asyncio.sleep(every_s)


@pytest.fixture(autouse=True)
async def cancel_gateways() -> AsyncIterator[None]:
    yield
    for task in list(Gateway.running):
        task.cancel()
    await asyncio.gather(*Gateway.running, return_exceptions=True)


async def collect_events(nc: Client, model: str) -> list[protocol.Event]:
    """Every event published for `model` from now on, decoded (so a malformed one fails the test)."""
    events: list[protocol.Event] = []

    async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
        events.append(protocol.decode(msg.data, protocol.Event))

    await nc.subscribe(protocol.events_subject(model), cb=on_event)
    return events


async def held(store: KvSlotStore, model: str, states: tuple[str, ...] = ("ready",)) -> list[protocol.SlotRecord]:
    return [r for r in store.records(model) if r.state in states]


@contextlib.asynccontextmanager
async def running_autoscaler(url: str, *, wait_to_lead: bool = True, **kw: object) -> AsyncIterator[daemon.Autoscaler]:
    """The daemon's `run` as a task, leading (unless not `wait_to_lead`); yields the live `Autoscaler` (its `metrics`
    for assertions). Settings are the test defaults (a 1 s leader lease) unless `kw` names them."""
    settings = daemon.AutoscalerSettings(
        nats=connect.NatsOptions(servers=(url,), name="test-autoscaler"),
        **{"lease": LeaseSettings(lease_s=1.0, renew_every_s=0.2), **kw},  # type: ignore[arg-type]
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    started: list[daemon.Autoscaler] = []
    task = asyncio.create_task(
        daemon.run(settings, stop=stop, ready=ready, metrics=AutoscalerMetrics(), on_started=started.append)
    )
    await asyncio.wait_for(ready.wait(), 10)
    try:
        scaler = started[0]
        await wait_for(scaler.ready, 5, "the autoscaler's views and ScaledObjects")
        if wait_to_lead:
            # Alone, it takes every shard, and then the samples of every model are its.
            await wait_for(
                lambda: protocol.QUEUE_WILDCARD in scaler.subscriptions.sample_subjects, 5, "the autoscaler to lead"
            )
        yield scaler
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)  # a crash or a hang at shutdown fails the test


@contextlib.asynccontextmanager
async def autoscaler_in_process(url: str, **kw: object) -> AsyncIterator[AutoscalerMetrics]:
    """`running_autoscaler`, for tests that only read its metrics."""
    async with running_autoscaler(url, **kw) as scaler:
        await wait_for(lambda: scaler.metrics.leader._value.get() == 1, 5)  # type: ignore[attr-defined]
        yield scaler.metrics


async def test_a_pulse_claims_and_activates_warm_slots(nats_server: NatsServer, nc: Client, store: KvSlotStore) -> None:
    agents = [await AgentDouble(nc, store, f"node-{i}", "m", slots=4, rack=f"r{i}").start() for i in range(2)]
    await put_scaler(nc, "m")
    events = await collect_events(nc, "m")
    try:
        async with autoscaler_in_process(nats_server.url) as metrics:
            gw = Gateway(nc, "m")
            await gw.steady(0, 0.5)
            await gw.send(24)  # from nothing to 24 requests at 4 per replica: at least 6 replicas, at once
            took = await wait_for(lambda: held(store, "m"), 3)
            desired = metrics.desired.labels("m")._value.get()  # type: ignore[attr-defined]
            assert desired >= 6
            await wait_for(lambda: _count(store, "m") == desired, 3)
            await gw.steady(24, 0.3)
            ready = await held(store, "m")
            assert len(ready) == desired and len({r.claim_id for r in ready}) == desired
            assert {r.node for r in ready} == {"node-0", "node-1"}, "claims did not spread over nodes"
            assert took < 3
            assert sum(1 for e in events if e.type == "slot.ready") == desired
            decisions = [e for e in events if e.type == "scale.decision"]
            assert decisions and decisions[-1].desired == desired and decisions[-1].reason
            assert (metrics.registry.get_sample_value("pulsescale_decision_seconds_count") or 0) >= 1
    finally:
        for a in agents:
            await a.stop()


def _count(store: KvSlotStore, model: str) -> int:
    return sum(1 for r in store.records(model) if r.state == "ready")


async def test_silent_agent_is_released_and_the_next_slot_claimed_in_time(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    deadline_s = 0.5
    # The silent node's slots are the preferred ones (weights resident), so they are claimed first.
    silent = await AgentDouble(nc, store, "silent", "m", slots=1, behaviour="silent").start()
    live = await AgentDouble(nc, store, "live", "m", slots=1, resident=False).start()
    await put_scaler(nc, "m")
    claims: dict[str, float] = {}

    async def watch() -> None:
        async for ev in store.watch():
            if hasattr(ev, "record") and ev.record.state == "claimed":  # type: ignore[union-attr]
                claims.setdefault(ev.key, time.monotonic())  # type: ignore[union-attr]

    watcher = asyncio.create_task(watch())
    try:
        async with autoscaler_in_process(
            nats_server.url, controller=ControllerSettings(activation_deadline_s=deadline_s)
        ):
            await Gateway(nc, "m").send(4)  # one replica
            await wait_for(lambda: "m.live.s0" in claims, 5)
            first, second = claims["m.silent.s0"], claims["m.live.s0"]
            assert second - first <= deadline_s + 0.1, f"next claim after {second - first:.3f} s"
            await wait_for(lambda: _count(store, "m") == 1, 2)
            rec, _ = await store.get("m.silent.s0")
            assert rec.state == "warm" and rec.claim_id is None  # given back, claimable again
    finally:
        watcher.cancel()
        await silent.stop()
        await live.stop()


async def test_empty_pool_takes_the_cold_path_and_says_so(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    agent = await AgentDouble(nc, store, "node-0", "m", slots=1).start()
    await put_scaler(nc, "m")
    events = await collect_events(nc, "m")
    try:
        async with autoscaler_in_process(nats_server.url) as metrics:
            await Gateway(nc, "m").send(12)  # 3 replicas wanted, 1 slot in the pool
            await wait_for(lambda: any(e.type == "cold.start" for e in events), 3)
            cold = next(e for e in events if e.type == "cold.start")
            assert cold.desired == 2 and "no warm slot" in (cold.reason or "")
            assert any(e.type == "pool.exhausted" for e in events)
            assert metrics.cold_starts.labels("m")._value.get() >= 1  # type: ignore[attr-defined]
    finally:
        await agent.stop()


def _autoscaler_proc(url: str, identity: str, metrics_port: int | None = None) -> subprocess.Popen[bytes]:
    extra = ["--metrics-port", str(metrics_port)] if metrics_port else []
    return subprocess.Popen(
        [sys.executable, "-m", "pulsescale", "autoscaler", "--nats", url, "--identity", identity, "--lease", "1",
         "--log-level", "WARNING", *extra],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def _follows(port: int, model: str) -> bool:
    """Whether the autoscaler behind `port` has a controller for `model` (its desired gauge exists)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
            return f'pulsescale_desired_replicas{{model="{model}"}}' in r.read().decode()
    except OSError:
        return False


@pytest.mark.slow
async def test_two_replicas_and_a_leader_crash_mid_pulse(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    agents = [await AgentDouble(nc, store, f"node-{i}", "m", slots=5, activation_delay_s=0.3).start() for i in range(2)]
    await put_scaler(nc, "m")
    leases = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    ports = {name: free_port() for name in ("replica-a", "replica-b")}
    procs = {name: _autoscaler_proc(nats_server.url, name, port) for name, port in ports.items()}
    try:

        async def leader() -> str | None:
            """The replica acting for m: the holder of its shard's lease (the replicas share the 32 shards)."""
            with contextlib.suppress(Exception):
                entry = await leases.get(protocol.shard_key(protocol.shard_of("m")))
                return str(msgspec.json.decode(entry.value)["holder"])
            return None

        await wait_for(leader, 10)
        await wait_for(lambda: all(_follows(p, "m") for p in ports.values()), 10)  # both follow the scaler
        gw = Gateway(nc, "m")
        first = gw.background(16, 8.0)  # 4 replicas wanted
        await wait_for(lambda: any(r.state in ("claimed", "activating") for r in store.records("m")), 5)
        name = await leader()
        assert name in procs
        procs[name].send_signal(signal.SIGKILL)
        # The pulse grows after the crash: the leader's activations in flight finish at the agents (the survivor
        # adopts them), the other four are the survivor's to claim once the dead leader's lease lapses.
        first.cancel()
        gw.background(32, 8.0)  # 8 replicas wanted
        took = await wait_for(lambda: _count(store, "m") == 8, 10)
        assert took <= 1.0 + 1.0 + 0.3 + 0.5, f"standby finished the scale-up {took:.2f} s after the crash"
        assert await leader() != name, "the survivor took m's shard"
        await asyncio.sleep(0.5)
        recs = await held(store, "m", ("claimed", "activating", "ready", "releasing"))
        assert len(recs) == 8, "the two replicas claimed more (or less) than one would"
        assert len({r.claim_id for r in recs}) == 8
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
            if p.poll() is None:
                p.kill()
        for a in agents:
            await a.stop()


async def test_scaler_changes_apply_live(nats_server: NatsServer, nc: Client, store: KvSlotStore) -> None:
    agent = await AgentDouble(nc, store, "node-0", "m", slots=6).start()
    await put_scaler(nc, "m", maxReplicaCount=2)
    try:
        async with autoscaler_in_process(nats_server.url):
            gw = Gateway(nc, "m")
            pulse = gw.background(40, 5.0)
            await wait_for(lambda: _count(store, "m") == 2, 3)
            await asyncio.sleep(0.3)
            assert _count(store, "m") == 2  # held at the bound
            await put_scaler(nc, "m", maxReplicaCount=5)  # edited while running
            await wait_for(lambda: _count(store, "m") == 5, 3)
            pulse.cancel()
    finally:
        await agent.stop()


async def test_sigterm_leaves_no_claim_dangling(nats_server: NatsServer, nc: Client, store: KvSlotStore) -> None:
    agent = await AgentDouble(nc, store, "node-0", "m", slots=4, activation_delay_s=3.0).start()
    await put_scaler(nc, "m")
    proc = _autoscaler_proc(nats_server.url, "only")
    leases = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    try:
        await wait_for(lambda: _lease_held(leases), 10)
        await asyncio.sleep(0.5)
        await Gateway(nc, "m").send(16)
        await wait_for(lambda: any(r.state in ("claimed", "activating") for r in store.records("m")), 5)
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 10)
        assert rc == 0
        await asyncio.sleep(0.2)
        states = {r.key: r.state for r in store.records("m")}
        assert not [k for k, s in states.items() if s in ("claimed", "activating")], states
        assert not await _lease_held(leases), "the lease was not handed back"
    finally:
        if proc.poll() is None:
            proc.kill()
        await agent.stop()


async def _lease_held(leases) -> bool:  # type: ignore[no-untyped-def]
    try:
        await leases.get("autoscaler")
    except Exception:
        return False
    return True


async def test_an_empty_pool_is_a_state_not_a_busy_loop(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    agent = await AgentDouble(nc, store, "node-0", "m", slots=1).start()
    await put_scaler(nc, "m")
    try:
        async with autoscaler_in_process(nats_server.url):
            gw = Gateway(nc, "m")
            pulse = gw.background(12, 3.0)  # 3 replicas wanted, 1 slot in the pool
            await wait_for(lambda: _count(store, "m") == 1, 3)
            cpu0, wall0 = time.process_time(), time.monotonic()
            await asyncio.sleep(1.5)
            cpu = time.process_time() - cpu0
            wall = time.monotonic() - wall0
            pulse.cancel()
            # The whole test process (gateway, registry watch, autoscaler) idles along; a claim loop would not.
            # A claim loop would keep a core busy (cpu ~ wall); idling, the whole process needs a fraction of it.
            assert cpu < 0.75 * wall, f"{cpu:.2f} s of CPU in {wall:.2f} s with an empty pool"
    finally:
        await agent.stop()


async def test_a_poisonous_scaled_object_does_not_stop_the_others(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    agent = await AgentDouble(nc, store, "node-0", "good", slots=1).start()
    kv = (await ensure_buckets(nc.jetstream()))[protocol.SCALERS_BUCKET]
    poison = {
        "v": 1,
        "namespace": "test",
        "name": "bad",
        "spec": {
            "scaleTargetRef": {"name": "x"},
            "triggers": [{"type": "gateway-queue", "metadata": {"model": "bad", "targetQueueDepth": 1e-320}}],
        },
    }
    await kv.put("test.bad", msgspec.json.encode(poison))
    await put_scaler(nc, "good")
    try:
        async with autoscaler_in_process(nats_server.url) as metrics:
            await Gateway(nc, "bad").send(5)
            await Gateway(nc, "good").send(4)
            await wait_for(lambda: _count(store, "good") == 1, 3)
            rejected = metrics.registry.get_sample_value(
                "pulsescale_registry_rejected_records_total", {"reason": "bad_value"}
            )
            assert rejected is not None and rejected >= 1
    finally:
        await agent.stop()


async def test_an_orphaned_claim_is_adopted_and_given_back(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    """A slot left `ready` under a claim no running autoscaler knows (its holder's books were lost) is adopted
    by the leader and released when it is not needed."""
    agent = await AgentDouble(nc, store, "node-0", "m", slots=2).start()
    fast = {
        "scaleDownStabilizationSeconds": 0.5,
        "scaleDownPeriodSeconds": 0.5,
        "scaleDownPercent": 100,
        "stableWindowSeconds": 1.0,
    }
    await put_scaler(nc, "m", cooldownPeriod=0.5, advanced=fast)
    try:
        async with autoscaler_in_process(nats_server.url, controller=ControllerSettings(activation_deadline_s=0.2)):
            # Made while the leader runs, so it is the sweep (not the takeover) that must find it.
            orphan = await store.claim_slot("m.node-0.s0")
            orphan = await store.advance(orphan, "activating")
            orphan = await store.advance(orphan, "ready", endpoint="http://lost:1")
            gw = Gateway(nc, "m")
            quiet = gw.background(0, 6.0)
            await wait_for(lambda: store.record("m.node-0.s0").state == "warm", 6)
            quiet.cancel()
    finally:
        await agent.stop()


@pytest.mark.parametrize("agent_ahead_s", [600.0, -600.0])
async def test_an_orphan_is_judged_by_how_long_we_saw_it_not_by_the_agents_clock(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, agent_ahead_s: float
) -> None:
    """The orphan's record carries `updated_at` from a clock ten minutes off (ahead: it would look fresh for ten
    minutes and never be adopted; behind: it would look ancient the moment it was written). It is adopted two
    activation deadlines after the leader saw it stand, whatever that clock says."""
    agent = await AgentDouble(nc, store, "node-0", "m", slots=2).start()
    fast = {
        "scaleDownStabilizationSeconds": 0.5,
        "scaleDownPeriodSeconds": 0.5,
        "scaleDownPercent": 100,
        "stableWindowSeconds": 1.0,
    }
    await put_scaler(nc, "m", cooldownPeriod=0.5, advanced=fast)
    skewed = await KvSlotStore.open(nc, clock=ShiftedClock(agent_ahead_s))
    await skewed.start()
    try:
        async with running_autoscaler(
            nats_server.url, controller=ControllerSettings(activation_deadline_s=0.5)
        ) as scaler:
            await wait_for(lambda: len(scaler.fleet.held) == protocol.SHARDS, 5, "every shard held")
            await asyncio.sleep(0.5)  # the takeovers' tasks adopt what they find: the orphan must come after them
            # Adopted, it is released within milliseconds (desired is 0): watch the adoption itself, not the book.
            c = scaler.fleet.by_model["m"]
            adopt, adopted = c.scaler.adopt, list[float]()

            def spy(records: list[protocol.SlotRecord]) -> int:
                held = adopt(records)
                if "m.node-0.s0" in c.scaler.held:
                    adopted.append(time.monotonic())
                return held

            c.scaler.adopt = spy  # type: ignore[method-assign]
            # Made while the leader runs, so it is the sweep (not the takeover) that must find it.
            orphan = await store.claim_slot("m.node-0.s0")  # a replica that died; its agent's clock is off:
            orphan = await skewed.advance(orphan, "activating")
            orphan = await skewed.advance(orphan, "ready", endpoint="http://lost:1")
            assert abs(orphan.record.updated_at - time.time() - agent_ahead_s) < 5
            seen = time.monotonic()
            await wait_for(lambda: adopted, 30, "the leader to adopt the orphan")
            # Not before two deadlines (1 s) of seeing it stand: as old as its clock says (behind) is not enough.
            assert adopted[0] - seen >= 0.9
    finally:
        await skewed.close()
        await agent.stop()


async def test_a_start_that_fails_half_way_closes_its_nats_connection(nats_server: NatsServer) -> None:
    # The metrics port is taken, so the start fails after the first connection is up: that connection must
    # go (a leaked socket is a ResourceWarning in some later test, or a stale client on the broker).
    taken = socket.create_server(("127.0.0.1", 0))
    settings = daemon.AutoscalerSettings(
        nats=connect.NatsOptions(servers=(nats_server.url,), name="test-autoscaler-half-started"),
        metrics_port=taken.getsockname()[1],
    )
    try:
        with pytest.raises(PulsescaleError, match=r"cannot serve metrics .* address already in use"):
            await asyncio.wait_for(daemon.run(settings, stop=asyncio.Event()), 10)
    finally:
        taken.close()

    def clients() -> list[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{nats_server.monitor_port}/connz", timeout=5) as r:
            return [c.get("name", "") for c in msgspec.json.decode(r.read())["connections"]]

    await wait_for(lambda: "test-autoscaler-half-started" not in clients(), 5, "the broker to see the client go")


async def test_a_slot_held_for_a_model_no_scaled_object_scales_is_released_and_a_scaled_ones_kept(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    """`Retirement.sweep_unowned`: a slot left held for a model whose ScaledObject went while no autoscaler ran (the
    operator's finalizer waits for it) is released once its grace has passed; a slot its scaled model holds stays."""
    gone = await AgentDouble(nc, store, "node-0", "gone", slots=1).start()
    kept = await AgentDouble(nc, store, "node-1", "m", slots=1).start()
    await put_scaler(nc, "m", minReplicaCount=1)
    try:
        async with running_autoscaler(nats_server.url, controller=ControllerSettings(activation_deadline_s=0.2)):
            await wait_for(lambda: store.record("m.node-1.s0").state == "ready", 5, "m's floor of one served")
            claim = await store.claim_slot("gone.node-0.s0")
            await store.advance(claim, "activating")
            await wait_for(lambda: store.record("gone.node-0.s0").state == "warm", 6, "the unscaled model's slot back")
            assert store.record("m.node-1.s0").state == "ready", "the scaled model's slot is its own"
    finally:
        await gone.stop()
        await kept.stop()
