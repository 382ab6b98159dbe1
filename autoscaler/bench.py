"""`pulsescale bench decide`: decision latency, ownership over replicas, takeover and ingest throughput.

1. In-process ingest: decode + fold + (debounced) decide for samples spread over `--models` models, one core.
2. End to end, against an embedded nats-server and `--replicas` real `pulsescale autoscaler` processes
   (identities ``bench-r<i>``, each its own metrics port, stderr captured): `--models` models have ScaledObjects
   and 4 warm slots each (seeded concurrently, `SEED_BATCH` models at a time) and get steady background samples
   (10/s per model, the gateways spread over `GATEWAY_PHASES` phases of each 100 ms, or all in one burst with
   `--gateways-in-step`); then `--pulses` models spread over all of them (so every replica's share is exercised) get a
   pulse one at a time, and we time *sample published -> first claim written* by watching `pulse_slots`. A
   stand-in agent in this process answers `activate` at once (writing `activating` and `ready` as a holder's
   agent does), so the figure is the autoscaler's own and not an engine's.
   Next to it, the floor measured in the same run and conditions (the background samples flowing): bare nats-py
   doing the path's irreducible work, *sample published -> a subscriber on its own connection does one
   kv.update(key, value, last=rev) -> a KV watcher sees it*, one pulse per pulsed model; and the ratio.
3. Ownership, read from KV `pulse_leases`: a model's owner is the live holder of its shard's lease (``shard.<n>``,
   protocol revision 6) or, while no shard lease exists, of the one leader lease. Checked before, during and
   after the pulses and after a takeover; "every model has exactly one owner" means every check found each
   model's lease fresh and held by a replica still running, and so did every 250 ms sample once the shards had
   settled (the warm-up's samples, while the replicas join one after another and shards are handed over, are
   printed but not counted: a handed-over shard has no lease until the taker's next round).
4. With `--replicas` >= 2 and `--kill` (the default then): SIGKILL the replica owning the most models, pulse up to
   `TAKEOVER_SAMPLE` of its models with rising demand every 100 ms until each is claimed again, and print the
   takeover time (kill -> first claim) next to the bar ``lease_s + 1 s`` (lease_s read from the leases).
   Throughout, the slot watch counts double claims (see `_SlotWatch`).
5. Ingest throughput through NATS: samples published as fast as one publisher can, counted by each autoscaler's
   `pulsescale_samples_total` metric. Then leases lost (``pulsescale_lease_lost_total`` where exported, else the
   "no longer the leader" lines in stderr), CPU seconds per replica (/proc/<pid>/stat), and the run's length,
   which every phase bounds.
Figures are printed, not asserted: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import IO, Any

import msgspec
import nats.js.errors
import numpy as np

from autoscaler import settling
from autoscaler.controller import Deps, LocalColdPath, ModelController
from autoscaler.metrics import AutoscalerMetrics
from warmpool import connect, protocol
from warmpool.bench import scratch_bucket
from warmpool.embedded import NatsServer, free_port
from warmpool.errors import PulsescaleError
from warmpool.protocol import QueueSample, ScaledObjectSpec, ScalerRecord, SlotRecord
from warmpool.registry import Changed, KvSlotStore, Snapshot, ensure_buckets
from warmpool.seed import seed_pool
from warmpool.slots import HELD_STATES


def _spec(model: str) -> ScaledObjectSpec:
    return protocol.decode(
        msgspec.json.encode(
            {
                "scaleTargetRef": {"name": model},
                "minReplicaCount": 0,
                "maxReplicaCount": 4,
                "triggers": [{"type": "gateway-queue", "metadata": {"model": model, "targetQueueDepth": 4}}],
            }
        ),
        ScaledObjectSpec,
    )


def _sample(model: str, seq: int, depth: int, gateway: str = "bench") -> bytes:
    return protocol.encode(
        QueueSample(
            gateway=gateway,
            model=model,
            seq=seq,
            ts=time.time(),
            queue_depth=depth,
            inflight=0,
            arrivals_total=seq,
            completions_total=seq,
            timeouts_total=0,
        )
    )


INGEST_IN_PROCESS_MAX_S = 10.0
"""The in-process ingest stops after this long (at thousands of models it is slow), and its rate is what it did."""


async def _ingest_in_process(nc, store: KvSlotStore, models: int, samples: int) -> float:  # type: ignore[no-untyped-def]
    """Samples/s through decode -> ingest -> debounced decide; a follower's controllers, so nothing is claimed."""
    deps = Deps(
        nc=nc,
        store=store,
        metrics=AutoscalerMetrics(),
        cold_path=LocalColdPath(),
        is_leader=lambda: False,
    )
    ctrls = {
        f"x{i}": ModelController(ScalerRecord(namespace="bench", name=f"x{i}", spec=_spec(f"x{i}")), deps)
        for i in range(models)
    }
    names = list(ctrls)
    payloads = [_sample(names[i % models], i // models + 1, i % 7) for i in range(samples)]
    t0 = time.perf_counter()
    done = 0
    for done, data in enumerate(payloads, 1):
        s = protocol.decode(data, QueueSample)
        ctrls[s.model].on_sample(s, time.time())
        if done % 1000 == 0 and time.perf_counter() - t0 > INGEST_IN_PROCESS_MAX_S:
            break
    return done / (time.perf_counter() - t0)


async def _stand_in_agent(nc, store: KvSlotStore, held: dict[tuple[str, str, str], str]) -> None:  # type: ignore[no-untyped-def]
    """Answers for every node at once, as the holder's agent would: `activating`, then `ready` with the endpoint
    (the autoscaler reads the endpoint from that fenced write), then the reply; `deactivate` gives the slot back.
    `held` maps (node, slot, claim_id) to the slot's key (kept by the run's slot watch), so an activation finds
    its slot in O(1) instead of scanning every record."""

    async def activate(msg) -> None:  # type: ignore[no-untyped-def]
        req = protocol.decode(msg.data, protocol.ActivateRequest)
        node = msg.subject.split(".")[2]
        key = held.get((node, req.slot, req.claim_id))
        for _ in range(100):  # the claim's watch echo may still be on its way to this process
            if key is not None:
                break
            await asyncio.sleep(0.002)
            key = held.get((node, req.slot, req.claim_id))
        try:
            if key is None:
                raise PulsescaleError(f"no slot {req.slot} held by {req.claim_id}")
            await store.set_state(key, "activating", expect=["claimed"], token=req.token)
            await store.set_state(key, "ready", expect=["activating"], endpoint="http://127.0.0.1:1/bench")
        except PulsescaleError as err:
            reply = protocol.refusal(protocol.ActivateReply, "stale_token", str(err), slot=req.slot)
        else:
            reply = protocol.ActivateReply(slot=req.slot, key=key, state="ready", timings=protocol.StageTimings())
        await msg.respond(protocol.encode(reply))

    async def deactivate(msg) -> None:  # type: ignore[no-untyped-def]
        req = protocol.decode(msg.data, protocol.DeactivateRequest)
        key = held.get((msg.subject.split(".")[2], req.slot, req.claim_id))
        claim = store.adopt(key) if key is not None else None
        if claim is not None:
            with contextlib.suppress(PulsescaleError):
                await store.release(claim, reason="deactivated")
        await msg.respond(protocol.encode(protocol.DeactivateReply(slot=req.slot, key=key)))

    await nc.subscribe("pulse.agent.*.activate", cb=activate)
    await nc.subscribe("pulse.agent.*.deactivate", cb=deactivate)


FLOOR_BUCKET = "pulse_bench_decide_floor"
"""Scratch bucket for the bare nats-py floor; never one the system uses."""
FLOOR_PREFIX = "bench.decide.floor."


async def _floor(nc, url: str, models: list[str], value: bytes) -> list[float]:  # type: ignore[no-untyped-def]
    """Bare nats-py, the decide path's irreducible work: a sample published -> a subscriber on its own connection
    (as the autoscaler has) decodes it and does one kv.update on the revision it last wrote -> our KV watcher sees
    the update. One pulse per model, one at a time, as the timed pulses. Latencies (s)."""
    js = nc.jetstream(timeout=5.0)
    kv = await scratch_bucket(js, FLOOR_BUCKET)
    keys = {m: f"{m}.floor.s0" for m in models}
    revs = {m: await kv.put(keys[m], value) for m in models}
    responder = await connect.connect(connect.NatsOptions(servers=(url,), name="bench-decide-floor"))
    rkv = await responder.jetstream(timeout=5.0).key_value(FLOOR_BUCKET)

    async def on_sample(msg) -> None:  # type: ignore[no-untyped-def]
        sample = protocol.decode(msg.data, QueueSample)
        revs[sample.model] = await rkv.update(keys[sample.model], value, last=revs[sample.model])

    sub = await responder.subscribe(FLOOR_PREFIX + "*", cb=on_sample)
    await responder.flush()
    seen: dict[str, asyncio.Event] = {k: asyncio.Event() for k in keys.values()}
    watcher = await kv.watchall()

    async def follow() -> None:
        async for entry in watcher:
            if entry is not None and entry.key in seen:
                seen[entry.key].set()

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0.2)  # the watcher's initial listing goes by
    latencies: list[float] = []
    try:
        for seq, m in enumerate(models, 1):
            event = seen[keys[m]]
            event.clear()
            t0 = time.perf_counter()
            await nc.publish(FLOOR_PREFIX + m, _sample(m, seq, 16))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), 2.0)
                latencies.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    finally:
        follower.cancel()
        await watcher.stop()
        await sub.unsubscribe()
        await responder.close()
        with contextlib.suppress(Exception):
            await js.delete_key_value(FLOOR_BUCKET)
    return latencies


def _scrape(port: int) -> list[str]:
    """One autoscaler's /metrics, as lines. A blocking read: one per replica per figure, not one per series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        body: bytes = r.read()
    return body.decode().splitlines()


def _summed(lines: list[str], name: str) -> float | None:
    """Sum of a metric's series in a scrape; None when it holds no such metric."""
    total, seen = 0.0, False
    for line in lines:
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


def _over(lines: list[str], name: str, over_s: float) -> tuple[int, str] | None:
    """From a histogram in a scrape: how many observations exceeded `over_s` (a bucket bound), and the smallest
    bucket bound holding them all ("+Inf" past the last); None when the scrape holds no such histogram."""
    buckets: list[tuple[float, float]] = []
    for line in lines:
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets:
        return None
    buckets.sort()
    total = buckets[-1][1]
    if total == 0:
        return 0, "none read"
    under = next((n for le, n in buckets if le >= over_s), total)
    longest = next(le for le, n in buckets if n >= total)
    return int(total - under), ("+Inf" if longest == float("inf") else f"{longest:g} s")


def _metric(port: int, name: str) -> float | None:
    """Sum of a metric's series on one autoscaler's /metrics; None when it exports no such metric."""
    return _summed(_scrape(port), name)


def _metric_or(port: int, name: str, default: float = 0.0) -> float:
    with contextlib.suppress(OSError):
        got = _metric(port, name)
        if got is not None:
            return got
    return default


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process, from /proc/<pid>/stat (fields 14 and 15); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


LOST_LINE = "no longer the leader"
"""What an autoscaler logs (WARNING) when it loses a lease; counted while it exports no lease-lost metric."""
LOST_METRIC = "pulsescale_lease_lost_total"
LAG_METRIC = "pulsescale_event_loop_lag_seconds"
STALL_S = 0.5
"""A loop stall this long is counted in the report (the daemon warns over the same; `warmpool.looplag`)."""
RENEWAL_METRIC = "pulsescale_lease_renewal_seconds"
SLOW_RENEWAL_S = 1.0
"""A shard renewal this slow is counted in the report: two in a row and the 1.6 s fence has passed."""
SAMPLES = "pulsescale_samples_total"


@dataclass
class _Replica:
    identity: str
    port: int
    proc: subprocess.Popen[bytes]
    stderr: IO[str]  # the file its stderr goes to
    cpu_s: float = 0.0
    lost_metric: float | None = None  # the last scrape of LOST_METRIC; None while it exports none
    stalls: tuple[int, str] | None = None  # the last scrape's loop stalls over STALL_S, and the longest's bucket
    slow_renewals: tuple[int, str] | None = None  # the same for shard renewals over SLOW_RENEWAL_S
    killed: bool = False

    def sample(self) -> None:
        """Refresh the CPU seconds, the lease-lost count and the loop stalls while the process lives."""
        if self.killed or self.proc.poll() is not None:
            return
        if (cpu := _cpu_s(self.proc.pid)) is not None:
            self.cpu_s = cpu
        with contextlib.suppress(OSError):
            lines = _scrape(self.port)
            self.lost_metric = _summed(lines, LOST_METRIC)
            self.stalls = _over(lines, LAG_METRIC, STALL_S) or self.stalls
            self.slow_renewals = _over(lines, RENEWAL_METRIC, SLOW_RENEWAL_S) or self.slow_renewals

    def warnings(self) -> int:
        self.stderr.flush()
        with open(self.stderr.name, errors="replace") as f:
            return sum(" WARNING " in line or " ERROR " in line or " CRITICAL " in line for line in f)

    def lost(self) -> int:
        if self.lost_metric is not None:
            return int(self.lost_metric)
        self.stderr.flush()
        with open(self.stderr.name, errors="replace") as f:
            return sum(LOST_LINE in line for line in f)


class _Leases:
    """Our view of KV `pulse_leases`: the shard leases (revision 6) when there are any, else the one leader lease.
    A model's owner is the holder of its shard's lease (or of the leader lease) while ``renewed_at + lease_s`` has
    not passed by our clock when the lease was read (a read answered late in a busy moment of this process is not
    judged seconds later, after the other reads); an expired or unreadable lease owns nothing."""

    def __init__(self) -> None:
        self.leases: dict[str, protocol.LeaderLease] = {}
        self.read_at: dict[str, float] = {}  # key -> time.time() of the read that gave its lease (none: the watch)

    def apply(self, key: str, value: bytes | None, read_at: float | None = None) -> None:
        self.leases.pop(key, None)
        self.read_at.pop(key, None)
        if read_at is not None:
            self.read_at[key] = read_at
        if not value:
            return
        with contextlib.suppress(Exception):  # something else in the bucket (overrides, replicas) or a broken one
            if key == protocol.LEADER_LEASE_KEY or key.startswith(protocol.SHARD_KEY_PREFIX):
                self.leases[key] = protocol.decode(value, protocol.LeaderLease)

    @property
    def sharded(self) -> bool:
        return any(k.startswith(protocol.SHARD_KEY_PREFIX) for k in self.leases)

    def lease_s(self) -> float | None:
        return max((lease.lease_s for lease in self.leases.values()), default=None)

    def owner_of_shard(self, now: float) -> dict[int, str | None]:
        def holder(key: str) -> str | None:
            lease = self.leases.get(key)
            at = min(now, self.read_at.get(key, now))
            return lease.holder if lease is not None and at <= lease.renewed_at + lease.lease_s else None

        if self.sharded:
            return {s: holder(protocol.shard_key(s)) for s in range(protocol.SHARDS)}
        leader = holder(protocol.LEADER_LEASE_KEY)
        return dict.fromkeys(range(protocol.SHARDS), leader)

    def ownership(self, shard_of_model: dict[str, int], live: set[str]) -> tuple[dict[str, list[str]], int]:
        """(models per live owner, models with no live owner)."""
        owners = self.owner_of_shard(time.time())
        per: dict[str, list[str]] = {}
        orphans = 0
        for m, s in shard_of_model.items():
            who = owners[s]
            if who is None or who not in live:
                orphans += 1
            else:
                per.setdefault(who, []).append(m)
        return per, orphans


async def _follow_leases(kv, leases: _Leases) -> None:  # type: ignore[no-untyped-def]
    watcher = await kv.watchall()
    try:
        async for entry in watcher:
            if entry is not None:
                leases.apply(entry.key, None if entry.operation in ("DEL", "PURGE") else entry.value)
    finally:
        with contextlib.suppress(Exception):
            await watcher.stop()


class _SlotWatch:
    """Every write to `pulse_slots` through the run, as the store's watch delivers them (each revision once).

    The double-claim check: a key whose record is written in a held state (claimed, activating, ready,
    releasing) with a claim_id different from the claim_id of its previous record while that previous record
    was itself held: a second claim while the first was still held, with no release (a record in a free state,
    claim_id cleared) between them. Each such write is counted."""

    def __init__(self) -> None:
        self.holder: dict[str, str] = {}  # key -> claim_id of the claim holding it now
        self.held: dict[tuple[str, str, str], str] = {}  # (node, slot, claim_id) -> key, for the stand-in agent
        self.first_claim: dict[str, float] = {}  # model -> perf_counter of its first claim seen
        self.claims_after: dict[str, float] = {}  # model -> first claim seen after `since`
        self.stamped_after: dict[str, float] = {}  # model -> that claim's `updated_at`, the claimer's wall clock
        self.since = float("inf")
        self.double_claims = 0
        self.writes = 0

    def on(self, event: Any) -> None:
        if isinstance(event, Snapshot):
            for key, rec in event.records.items():
                self._seen(key, rec, snapshot=True)
        elif isinstance(event, Changed):
            self._seen(event.key, event.record, snapshot=False)

    def _seen(self, key: str, rec: SlotRecord, *, snapshot: bool) -> None:
        self.writes += not snapshot
        prev = self.holder.get(key)
        if rec.state in HELD_STATES and rec.claim_id is not None:
            if prev is not None and prev != rec.claim_id and not snapshot:
                self.double_claims += 1
            if prev is not None and prev != rec.claim_id:
                self.held.pop((rec.node, rec.slot, prev), None)
            self.holder[key] = rec.claim_id
            self.held[(rec.node, rec.slot, rec.claim_id)] = key
            if rec.state == "claimed" and prev != rec.claim_id and not snapshot:
                now = time.perf_counter()
                self.first_claim.setdefault(rec.model, now)
                if now >= self.since and rec.model not in self.claims_after:
                    self.claims_after[rec.model] = now
                    self.stamped_after[rec.model] = rec.updated_at
        elif prev is not None:
            del self.holder[key]
            self.held.pop((rec.node, rec.slot, prev), None)


def _pct(xs: list[float]) -> str:
    ms = np.array(xs) * 1e3
    return f"p50 {np.percentile(ms, 50):.2f} ms   p99 {np.percentile(ms, 99):.2f} ms   max {ms.max():.2f} ms"


SEED_BATCH = 100
"""Models seeded at once (their slots, agent leases and ScaledObjects written concurrently)."""
PULSE_TIMEOUT_S = 2.0
"""A timed pulse with no claim after this long counts as unanswered."""
READY_TIMEOUT_S = 60.0
"""The replicas must own every model (and the ownership settle) within this long of starting."""
TAKEOVER_GRACE_S = 10.0
"""After a SIGKILL, the killed replica's models are pulsed until claimed, at most lease_s + this long."""
SAMPLE_EVERY_S = 0.1
"""Each gateway's sample interval (the contract's pace)."""
GATEWAY_PHASES = 10
"""The background gateways speak at this many phases of each `SAMPLE_EVERY_S`, as independent gateways do at
their own; `--gateways-in-step` puts them all at one (a pulse then waits behind every model's sample)."""
BACKGROUND_YIELD_EVERY = 200
"""The background samples yield to the event loop after this many publishes (a publish rarely yields itself)."""
WARM_UP_S = 3.5
"""Steady traffic before the pulses, past the windows' settling (`settling.trend_settle_s` of the bench's spec):
a model is skipped from the turn after its first decision on settled windows, one or two turns of
`redecide_every_s` (1 s) later."""
OWNERSHIP_EVERY_S = 0.25
"""How often the ownership is sampled between the named checks."""
TAKEOVER_SAMPLE = 100
"""Models of the killed replica pulsed (a sample, so the phase stays short at 1,000s of models)."""


class _Run:
    """One end-to-end run: the broker, the seeded pool, the replicas and what is watched; one method per phase."""

    def __init__(self, args: argparse.Namespace, server: NatsServer, nc: Any, store: KvSlotStore) -> None:
        self.args = args
        self.server = server
        self.nc = nc
        self.store = store
        self.models = [f"m{i}" for i in range(args.models)]
        self.shard_of_model = {m: protocol.shard_of(m) for m in self.models}
        self.replicas: list[_Replica] = []
        self.leases = _Leases()
        self.slots = _SlotWatch()
        self.quiet: set[str] = set()  # models the background leaves alone (pulsed ones: their last word stands)
        self.seq = 1  # the gateway's sequence number, shared by the background and the pulses
        self.checks: list[bool] = []
        self.in_takeover = False  # from the SIGKILL until the survivors hold every lease: orphans are expected
        self.ownership_samples = 0
        self.orphaned_samples = 0  # samples that found a model without a live owner
        self.phase = "warm-up"  # the run's phase now, to say where the orphans were found
        self.orphans_by_phase: collections.Counter[str] = collections.Counter()
        self.most_orphans = 0
        self.leases_kv: Any = None  # KV pulse_leases, for the named checks' fresh reads
        self.last_owned: dict[str, list[str]] = {}  # the last ownership sampled with an owner (picks the victim)

    def live(self) -> set[str]:
        return {r.identity for r in self.replicas if not r.killed and r.proc.poll() is None}

    async def refresh_leases(self, attempts: int = 3) -> None:
        """Read the leases afresh: the named checks must not judge a lease by our watch, which lags when this
        process is busy publishing the background samples (a lease would look expired when it is not). A read
        that failed (a timeout, this process saturated) is asked again, up to `attempts` rounds."""
        keys = [protocol.LEADER_LEASE_KEY, *(protocol.shard_key(s) for s in range(protocol.SHARDS))]

        async def one(key: str) -> None:
            try:
                entry = await self.leases_kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                self.leases.apply(key, None, read_at=time.time())
            else:
                self.leases.apply(key, entry.value, read_at=time.time())
            keys.remove(key)

        for _ in range(attempts):
            if not keys:
                return
            await asyncio.gather(*(one(k) for k in list(keys)), return_exceptions=True)

    async def settle(self, timeout_s: float) -> float:
        """Wait until every model has a live owner and every live replica holds a share (the shards split over
        them); returns how long it took."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            await self.refresh_leases()
            per, orphans = self.leases.ownership(self.shard_of_model, self.live())
            if orphans == 0 and (len(per) == len(self.live()) or not self.leases.sharded):
                break
            await asyncio.sleep(0.1)
        return time.perf_counter() - t0

    def print_own_decision_times(self) -> None:
        """The autoscalers' own view of the same path, from their ``pulsescale_decision_seconds`` histograms: a
        sample taken in -> its first claim written, with no NATS hop or bench process on either end."""
        live = [r for r in self.replicas if not r.killed and r.proc.poll() is None]
        scrapes = []
        for r in live:
            with contextlib.suppress(OSError):
                scrapes.append(_scrape(r.port))
        total = sum(_summed(lines, "pulsescale_decision_seconds_count") or 0.0 for lines in scrapes)
        under = {
            le: sum(_summed(lines, f'pulsescale_decision_seconds_bucket{{le="{le}"}}') or 0.0 for lines in scrapes)
            for le in ("0.002", "0.005", "0.01", "0.02", "0.05")
        }
        within = ", ".join(f"{n:.0f} within {float(le) * 1e3:.0f} ms" for le, n in under.items())
        print(f"the autoscalers' own decision time (pulsescale_decision_seconds since start): of {total:.0f}, {within}")

    async def check_owners(self, when: str) -> dict[str, list[str]]:
        await self.refresh_leases()
        per, orphans = self.leases.ownership(self.shard_of_model, self.live())
        self.checks.append(orphans == 0)
        spread = "  ".join(f"{r.identity} {len(per.get(r.identity, []))}" for r in self.replicas if not r.killed)
        mode = "shard leases" if self.leases.sharded else f"the {protocol.LEADER_LEASE_KEY!r} leader lease"
        print(f"ownership {when} (from {mode}): models per replica: {spread};"
              f" models without a live owner: {orphans}")  # fmt: skip
        return per

    async def seed(self, scalers: Any) -> None:
        async def one(i: int, m: str) -> None:
            await seed_pool(self.store, m, nodes=2, slots_per_node=2, node_prefix=f"n{i}")
            rec = ScalerRecord(namespace="bench", name=m, spec=_spec(m))
            await scalers.put(rec.key, protocol.encode(rec))

        for lo in range(0, len(self.models), SEED_BATCH):
            await asyncio.gather(*(one(i, self.models[i]) for i in range(lo, min(lo + SEED_BATCH, len(self.models)))))

    def start_replicas(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for idx in range(self.args.replicas):
            identity = f"bench-r{idx}"
            err: IO[str]
            if self.args.logs:
                os.makedirs(self.args.logs, exist_ok=True)
                err = open(os.path.join(self.args.logs, f"{identity}.log"), "w+")  # noqa: SIM115 - closed at the end
            else:
                err = tempfile.NamedTemporaryFile("w+", prefix=f"bench-decide-{identity}-", suffix=".log")  # noqa: SIM115
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "pulsescale", "autoscaler", "--nats", self.server.url,
                 "--metrics-port", str(port), "--identity", identity, "--log-level", self.args.log_level],
                env=env, stderr=err,
            )  # fmt: skip
            self.replicas.append(_Replica(identity=identity, port=port, proc=proc, stderr=err))

    async def wait_ready(self) -> None:
        """Every model has a live owner and the spread has not changed for a second (replicas that join later
        rebalance the shards); under the leader lease, the leader also says so on its metrics."""
        deadline = time.perf_counter() + READY_TIMEOUT_S
        last, stable_since = None, time.perf_counter()
        while time.perf_counter() < deadline:
            per, orphans = self.leases.ownership(self.shard_of_model, self.live())
            spread = sorted((w, len(ms)) for w, ms in per.items())
            if spread != last:
                last, stable_since = spread, time.perf_counter()
            leading = self.leases.sharded or any(_metric_or(r.port, "pulsescale_leader") == 1 for r in self.replicas)
            if orphans == 0 and leading and time.perf_counter() - stable_since >= 1.0:
                return
            if any(r.proc.poll() is not None for r in self.replicas):
                raise PulsescaleError("an autoscaler exited during start-up; run with --logs DIR to keep its stderr")
            await asyncio.sleep(0.1)
        print(f"replicas not settled after {READY_TIMEOUT_S:.0f} s; going on")

    async def watch_ownership(self, stop: asyncio.Event) -> None:
        """Between the named checks, sample the ownership every `OWNERSHIP_EVERY_S` (outside the takeover), so a
        lease lost and not yet retaken shows even when no named check falls on it."""
        while not stop.is_set():
            if not self.in_takeover:
                await self.refresh_leases()
            if not self.in_takeover:  # again: the kill may have come while the leases were read
                per, orphans = self.leases.ownership(self.shard_of_model, self.live())
                self.last_owned = per or self.last_owned
                self.ownership_samples += 1
                self.orphaned_samples += orphans > 0
                if orphans:
                    self.orphans_by_phase[self.phase] += 1
                self.most_orphans = max(self.most_orphans, orphans)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), OWNERSHIP_EVERY_S)

    async def background(self, stop: asyncio.Event) -> None:
        """Every model's gateway speaks every 100 ms (the contract's pace): 10 samples/s x models, on a connection
        of their own: gateways are other processes, and a pulse published behind a burst of ours waited in this
        process's write buffer for all of it (a delay of the load generator, not of the autoscaler)."""
        gateways = await connect.connect(connect.NatsOptions(servers=(self.server.url,), name="bench-decide-gateways"))
        try:
            await self._background(gateways, stop)
        finally:
            await gateways.close()

    async def _background(self, nc: Any, stop: asyncio.Event) -> None:
        phases = 1 if self.args.gateways_in_step else GATEWAY_PHASES
        while not stop.is_set():
            t0 = time.perf_counter()
            for phase in range(phases):
                # Gateway i speaks at phase i % phases of the 100 ms (all at once with --gateways-in-step).
                for i, m in enumerate(self.models[phase::phases], 1):
                    if m not in self.quiet:
                        await nc.publish(protocol.queue_subject(m), _sample(m, self.seq, 0))
                    if i % BACKGROUND_YIELD_EVERY == 0:
                        await asyncio.sleep(0)  # our own watches and the stand-in agent run in between
                await asyncio.sleep(max(0.0, t0 + SAMPLE_EVERY_S * (phase + 1) / phases - time.perf_counter()))
            self.seq += 1

    async def pulse(self, m: str, depth: int) -> None:
        self.seq += 1
        await self.nc.publish(protocol.queue_subject(m), _sample(m, self.seq, depth))

    async def timed_pulses(self) -> dict[str, list[str]]:
        """The pulsed models are spread over all models, so every replica's share is exercised."""
        args, models = self.args, self.models
        n_pulses = min(args.pulses, len(models))
        pulse_models = [models[i * len(models) // n_pulses] for i in range(n_pulses)]
        records = self.store.records()
        floor = await _floor(self.nc, self.server.url, pulse_models, protocol.encode(records[0]))
        latencies = []
        pulse_deadline = time.perf_counter() + args.pulse_budget_s
        for k, m in enumerate(pulse_models):
            if time.perf_counter() > pulse_deadline:
                print(f"pulse budget of {args.pulse_budget_s:.0f} s spent after {k} pulses")
                break
            if k == n_pulses // 2:
                await self.check_owners("mid-pulses")
            self.quiet.add(m)
            t0 = time.perf_counter()
            # Demand 4 (= targetQueueDepth): one replica wanted, so the model's other slots stay free for the
            # takeover pulses.
            await self.pulse(m, 4)
            while m not in self.slots.first_claim and time.perf_counter() - t0 < PULSE_TIMEOUT_S:
                await asyncio.sleep(0.0005)
            if m in self.slots.first_claim:
                latencies.append(self.slots.first_claim[m] - t0)
            await asyncio.sleep(0.02)
        for r in self.replicas:
            r.sample()
        self.print_own_decision_times()
        per = await self.check_owners("after the pulses")
        gateways = "in step" if args.gateways_in_step else f"at {GATEWAY_PHASES} phases"
        print(f"decision latency, sample published -> first claim written ({args.models} models active over "
              f"{args.replicas} replica(s), gateways {gateways}, "
              f"{len(latencies)}/{n_pulses} pulses answered):")  # fmt: skip
        if latencies:
            print(f"  {_pct(latencies)}")
        print(f"floor, bare nats-py in the same run: sample published -> one kv.update -> watcher sees it "
              f"({len(floor)}/{n_pulses} answered):")  # fmt: skip
        if floor:
            print(f"  {_pct(floor)}")
        if latencies and floor:
            print(f"ratio to the floor: p50 {np.percentile(latencies, 50) / np.percentile(floor, 50):.2f}x   "
                  f"p99 {np.percentile(latencies, 99) / np.percentile(floor, 99):.2f}x")  # fmt: skip
        return per

    async def takeover(self, per: dict[str, list[str]]) -> None:
        """SIGKILL the replica owning the most models; pulse a sample of its models with rising demand every
        100 ms until each is claimed again (by whoever owns it now); the takeover time is kill -> first claim."""
        per = per or self.last_owned  # nobody owns anything this instant (a lease lost): the last one that did
        victim = max(
            (r for r in self.replicas if r.identity in per and r.proc.poll() is None),
            key=lambda r: len(per[r.identity]),
            default=None,
        )
        if victim is None:
            print("takeover: no replica owns a model; nothing to kill")
            return
        owned = per[victim.identity]
        sample = ([m for m in owned if m not in self.quiet] + [m for m in owned if m in self.quiet])[:TAKEOVER_SAMPLE]
        lease_s = self.leases.lease_s() or 2.0
        bar = lease_s + 1.0
        victim.sample()
        self.quiet.update(sample)
        self.in_takeover = True
        self.slots.since = t_kill = time.perf_counter()
        wall_kill = time.time()
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.killed = True
        print(f"takeover: SIGKILL {victim.identity} (owned {len(owned)} models); pulsing {len(sample)} of them "
              f"(demand 16) every 100 ms until claimed")  # fmt: skip
        waiting = set(sample)
        deadline = t_kill + lease_s + TAKEOVER_GRACE_S
        while waiting and time.perf_counter() < deadline:
            waiting -= self.slots.claims_after.keys()
            for m in waiting:
                await self.pulse(m, 16)
            await asyncio.sleep(0.1)
        took = [self.slots.claims_after[m] - t_kill for m in sample if m in self.slots.claims_after]
        line = f"takeover time, SIGKILL -> first claim ({len(took)}/{len(sample)} models claimed again)"
        if took:
            p50, worst = float(np.percentile(took, 50)), max(took)
            met = worst <= bar and len(took) == len(sample)
            print(f"{line}: p50 {p50 * 1e3:.0f} ms   max {worst * 1e3:.0f} ms   bar lease_s + 1 s = {bar * 1e3:.0f} ms"
                  f" ({'met' if met else 'NOT met'})")  # fmt: skip
        else:
            print(f"{line}: bar lease_s + 1 s = {bar * 1e3:.0f} ms (NOT met)")
        # The same claims by their writers' own stamps: what of the time is the autoscaler's, and what this process
        # took to see the claims (its watch shares a core with the background samples it publishes).
        stamped = [self.slots.stamped_after[m] - wall_kill for m in sample if m in self.slots.stamped_after]
        if stamped:
            print(f"  the same, by each claim's own stamp (updated_at, the claimer's clock): p50 "
                  f"{float(np.percentile(stamped, 50)) * 1e3:.0f} ms   max {max(stamped) * 1e3:.0f} ms")  # fmt: skip
        # The survivors take the killed replica's leases as each expires: look once none is left without a live
        # owner (or the phase's bound has passed, and the check says so).
        while time.perf_counter() < deadline:
            await self.refresh_leases()
            if self.leases.ownership(self.shard_of_model, self.live())[1] == 0:
                break
            await asyncio.sleep(0.1)
        self.in_takeover = False
        await self.check_owners("after the takeover")

    async def ingest(self) -> None:
        """Samples published as fast as one publisher can; counted by each live replica until the counts stop."""
        alive = [r for r in self.replicas if not r.killed]

        def scrape(r: _Replica, last: float | None) -> float | None:
            # A busy replica may not answer its scrape in time: keep its last good reading rather than a 0.
            with contextlib.suppress(OSError):
                return _metric(r.port, SAMPLES) or 0.0
            return last

        before = [scrape(r, None) for r in alive]
        n = self.args.samples
        t0 = time.perf_counter()
        for i in range(n):
            m = self.models[i % len(self.models)]
            await self.nc.publish(protocol.queue_subject(m), _sample(m, self.seq + i, 0, gateway="flood"))
            if i % BACKGROUND_YIELD_EVERY == 0:
                # The stand-in agent answers the takeover's last activations meanwhile: without this it missed
                # their 2.5 s deadline and the replicas churned through releases and claims during the count.
                await asyncio.sleep(0)
        await self.nc.flush()
        deadline = time.perf_counter() + 30
        readings = list(before)
        counts = [0.0] * len(alive)
        t_moved = time.perf_counter()
        while time.perf_counter() < deadline:
            readings = [scrape(r, last) for r, last in zip(alive, readings, strict=True)]
            now_counts = [
                (now - b) if now is not None and b is not None else 0.0 for now, b in zip(readings, before, strict=True)
            ]
            if now_counts != counts:
                counts, t_moved = now_counts, time.perf_counter()
            elif time.perf_counter() - t_moved > 0.5:
                break  # every replica has taken what it will take
            await asyncio.sleep(0.05)
        secs = t_moved - t0
        each = "  ".join(
            f"{r.identity} {c:.0f}" if b is not None else f"{r.identity} (no scrape before)"
            for r, c, b in zip(alive, counts, before, strict=True)
        )
        print(f"ingest through NATS into the autoscaler processes: {n} samples published, counted: {each};"
              f" {max(counts):.0f} in {secs:.2f} s = {max(counts) / secs:,.0f} samples/s (the busiest)")  # fmt: skip

    def report(self, t_start: float) -> None:
        for r in self.replicas:
            r.sample()
        print(f"leases lost during the run: {sum(r.lost() for r in self.replicas)}"
              f" (from {LOST_METRIC} where exported, else {LOST_LINE!r} lines in stderr)")  # fmt: skip
        for what, over, attr, name in (
            ("event-loop stalls", STALL_S, "stalls", f"{LAG_METRIC}, read every 100 ms"),
            ("shard lease renewals", SLOW_RENEWAL_S, "slow_renewals", RENEWAL_METRIC),
        ):
            print(
                f"{what} over {over:g} s per replica ({name}; the longest within the bucket bound given): "
                + "  ".join(
                    f"{r.identity} "
                    + (f"{got[0]} (longest <= {got[1]})" if (got := getattr(r, attr)) else "not exported")
                    + (" (until killed)" if r.killed else "")
                    for r in self.replicas
                )
            )
        print(
            "CPU seconds per replica (/proc/<pid>/stat utime+stime): "
            + "  ".join(f"{r.identity} {r.cpu_s:.1f}{' (killed)' if r.killed else ''}" for r in self.replicas)
        )
        print(
            "stderr lines per replica (WARNING or worse): "
            + "  ".join(f"{r.identity} {r.warnings()}" for r in self.replicas)
            + (f" (kept in {self.args.logs})" if self.args.logs else " (--logs DIR keeps them)")
        )
        print(
            f"slot writes watched: {self.slots.writes}; slots claimed twice without a release between (a held "
            f"record's claim_id replaced by another while the first was still held): {self.slots.double_claims}"
        )
        print(f"ownership sampled every {OWNERSHIP_EVERY_S * 1e3:.0f} ms outside the takeover: "
              f"{self.ownership_samples} samples, {self.orphaned_samples} found models without a live owner "
              f"(at most {self.most_orphans}"
              + "".join(f"; {n} in the {phase}" for phase, n in sorted(self.orphans_by_phase.items()))
              + ")")  # fmt: skip
        # The warm-up's samples fall on the replicas joining one after another: a shard handed over has no lease
        # between the giver's delete and the taker's next round (at most one owner, never two). The bar is for the
        # run after the shards have settled; the warm-up's are printed above, not counted.
        counted = self.orphaned_samples - self.orphans_by_phase["warm-up"]
        one = all(self.checks) and counted == 0
        print(f"every model has exactly one owner: {'yes' if one else 'no'} "
              f"({sum(self.checks)}/{len(self.checks)} named checks passed, {counted} samples with orphans after "
              f"the shards settled)")  # fmt: skip
        print(f"run length: {time.perf_counter() - t_start:.1f} s (bounded: in-process ingest <= "
              f"{INGEST_IN_PROCESS_MAX_S:.0f} s, start-up <= {READY_TIMEOUT_S:.0f} s,"
              f" pulses <= {self.args.pulse_budget_s:.0f} s + {PULSE_TIMEOUT_S:.0f} s, takeover <= lease_s + "
              f"{TAKEOVER_GRACE_S:.0f} s, ingest <= 30 s after publishing)")  # fmt: skip

    def stop_replicas(self) -> None:
        for r in self.replicas:
            if r.proc.poll() is None:
                r.proc.terminate()
        for r in self.replicas:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(10)
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
            if not r.stderr.closed:
                r.stderr.close()


async def _end_to_end(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    server = NatsServer().start()
    tasks: list[asyncio.Task[None]] = []
    run: _Run | None = None
    try:
        nc = await connect.connect(connect.NatsOptions(servers=(server.url,), name="bench-decide"))
        store = await KvSlotStore.open(nc)
        await store.start()
        buckets = await ensure_buckets(nc.jetstream())
        run = _Run(args, server, nc, store)
        run.leases_kv = buckets[protocol.LEASES_BUCKET]
        await run.seed(buckets[protocol.SCALERS_BUCKET])
        slots = run.slots

        async def watch_slots() -> None:
            async for ev in store.watch():
                slots.on(ev)

        tasks.append(asyncio.create_task(watch_slots()))
        tasks.append(asyncio.create_task(_follow_leases(buckets[protocol.LEASES_BUCKET], run.leases)))
        await _stand_in_agent(nc, store, slots.held)
        t_seeded = time.perf_counter()
        print(f"setup: {args.models} models x 4 warm slots seeded in {t_seeded - t_start:.1f} s")
        rate = await _ingest_in_process(nc, store, args.models, args.samples)
        print(f"ingest in process (decode + fold + debounced decide, one core): {rate:,.0f} samples/s")
        t_started = time.perf_counter()
        run.start_replicas()
        await run.wait_ready()
        print(f"replicas: {args.replicas} autoscaler processes ready in {time.perf_counter() - t_started:.1f} s")
        stop = asyncio.Event()
        bg = asyncio.create_task(run.background(stop))
        owners = asyncio.create_task(run.watch_ownership(stop))
        # Steady traffic until the models' windows settle (`settling.trend_settle_s`): a fleet's models are timed
        # as they run, not in their first seconds, when housekeeping still re-decides every one of them.
        await asyncio.sleep(WARM_UP_S + settling.trend_settle_s(_spec("m0")))
        settled = await run.settle(READY_TIMEOUT_S)
        run.phase = "pulses"
        print(f"ownership settled {settled:.1f} s after the pulses' warm-up")
        await run.check_owners("before the pulses")
        per = await run.timed_pulses()
        if args.kill and args.replicas >= 2:
            await run.takeover(per)
        run.phase = "time after the takeover"
        stop.set()
        await bg
        await owners
        await run.ingest()
        run.report(t_start)
        # The replicas go before our connection: the stand-in agent must outlive their last activations.
        run.stop_replicas()
        for t in tasks:
            t.cancel()
        await store.close()
        await nc.close()
    finally:
        for t in tasks:
            t.cancel()
        if run is not None:
            run.stop_replicas()
        server.stop()


def decide(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=int, default=100, help="models active at once [100]")
    p.add_argument("--replicas", type=int, default=1, help="autoscaler processes sharing the models [1]")
    p.add_argument("--pulses", type=int, default=100, help="pulses timed, spread over the models [100]")
    p.add_argument("--samples", type=int, default=50_000, help="samples for the throughput runs [50000]")
    p.add_argument(
        "--kill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --replicas >= 2, SIGKILL the replica owning the most models mid-run and time the takeover "
        "[on with --replicas >= 2]",
    )
    p.add_argument(
        "--gateways-in-step",
        action="store_true",
        help="every model's background sample at the same instant of each 100 ms, in one burst (the worst case: "
        f"a pulse waits behind all of them) [off: spread over {GATEWAY_PHASES} phases, as independent gateways]",
    )
    p.add_argument("--logs", metavar="DIR", help="keep each replica's stderr in DIR/<identity>.log")
    p.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the replicas' log level (INFO shows shards taken and handed over, with --logs) [WARNING]",
    )
    p.add_argument(
        "--pulse-budget-s", type=float, default=300.0, help="the timed pulses stop after this many seconds [300]"
    )
    args = p.parse_args(argv)
    if args.models < 1 or args.replicas < 1 or args.pulses < 1:
        p.error("--models, --replicas and --pulses must be >= 1")
    if args.kill is None:
        args.kill = args.replicas >= 2
    asyncio.run(_end_to_end(args))
    return 0
