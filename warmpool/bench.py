"""`pulsescale bench claims`: claim latency and throughput against a real nats-server, next to the floor.

Starts an embedded nats-server (or uses `--nats URL`), seeds a warm pool of `--nodes` x `--slots-per-node` slots
of one model, and claims it with `--concurrency` claimers sharing one registry client; slots are released between
rounds, untimed. Each level is measured with its floor, in the same run and conditions: the two take turns in
`--slices` slices, so a noisy neighbour slows both alike. The floor is bare nats-py doing the one write a claim
does, ``kv.update(key, value, last=rev)`` on keys of the same shape and a value of the same size (a scratch bucket
made like the slots bucket, deleted at the end), by as many concurrent writers. The ratio is claim p99 over floor
p99; `conflicts` counts the claims' compare-and-sets lost to another writer (each a wasted round trip and a
re-read; concurrent claimers sharing a registry reserve their candidates, so none are expected here). Figures are
printed, not asserted: these machines are shared and noisy.

``--json`` (``-o json|yaml``) prints one object instead, and nothing else on stdout: the run's parameters and, in
``levels``, one entry a concurrency level with every figure of its row (``p50_ms``, ``p99_ms``, ``claims_per_s``,
``floor_p99_ms``, ``ratio_p99`` = p99_ms / floor_p99_ms, ...) and the wall times the rates come from.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import sys
import time

import msgspec
import numpy as np
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from warmpool import connect as nats_connect
from warmpool import output as out
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.errors import ClaimConflict, NoSlotAvailable
from warmpool.registry import BucketSettings, Claim, KvSlotStore
from warmpool.seed import seed_pool

MODEL = "bench"
FLOOR_BUCKET = "pulse_bench_floor"
"""Scratch bucket for the bare KV-update floor; never one the system uses."""


async def scratch_bucket(js: JetStreamContext, name: str) -> KeyValue:
    """A fresh bucket named `name`, shaped like `pulse_slots` (history, storage), for a bench's bare nats-py floor;
    one a crashed run left behind is replaced. The caller deletes it (`js.delete_key_value`) when done."""
    with contextlib.suppress(Exception):
        await js.delete_key_value(name)
    settings = BucketSettings()
    return await js.create_key_value(
        KeyValueConfig(bucket=name, history=settings.slot_history, storage=settings.storage)
    )


class ClaimsLevel(msgspec.Struct, kw_only=True):
    """One concurrency level: a row of the text report, with the wall times its rates come from."""

    claimers: int
    claims: int
    """Claims that landed: the run's `claims` (each level claims that many)."""
    p50_ms: float
    p99_ms: float
    max_ms: float
    claims_per_s: float
    """claims / wall_s."""
    wall_s: float
    """Time spent in the claim rounds (releases between rounds and the floor's slices not counted)."""
    conflicts: int
    """The claims' compare-and-sets lost to another writer."""
    floor_updates: int
    floor_p50_ms: float
    floor_p99_ms: float
    floor_max_ms: float
    floor_updates_per_s: float
    """floor_updates / floor_wall_s."""
    floor_wall_s: float
    ratio_p99: float
    """p99_ms / floor_p99_ms: what a claim costs over the one write it does."""


class ClaimsReport(msgspec.Struct, kw_only=True):
    """`bench claims --json`: the run's parameters, then one `ClaimsLevel` a concurrency level."""

    bench: str = "claims"
    nats: str
    """The server's URL (`--nats`, without credentials, or the embedded one's)."""
    embedded: bool
    sync_always: bool | None
    """The embedded server fsyncs every write (`--sync-always`); None for a `--nats` server."""
    nodes: int
    slots_per_node: int
    slots: int
    """Warm slots seeded: nodes x slots_per_node."""
    claims_per_level: int
    concurrency: list[int]
    slices: int
    slot_watch: bool
    """False with `--without-slot-watch`: the slot watch stopped once the pool was seeded."""
    floor: str = "bare nats-py kv.update(key, value, last=rev), same key shape and value size, as many writers"
    levels: list[ClaimsLevel] = msgspec.field(default_factory=list)


SETTLE_S = 0.05
"""Untimed pause after each slice's releases: their watch echoes are handled before the next floor slice."""


async def _round(store: KvSlotStore, concurrency: int, budget: int) -> tuple[list[float], list[Claim], int, float]:
    latencies: list[float] = []
    held: list[Claim] = []
    issued = 0

    async def claimer() -> None:
        nonlocal issued
        while issued < budget:
            issued += 1  # counted before the await, so concurrent claimers stop at the budget
            t0 = time.perf_counter()
            try:
                c = await store.claim(MODEL)
            except NoSlotAvailable:
                return
            except ClaimConflict:
                issued -= 1  # 16 lost races in a row: the next try counts as a new claim
                continue
            latencies.append(time.perf_counter() - t0)
            held.append(c)

    lost = store.claimer.claim_conflicts
    t0 = time.perf_counter()
    await asyncio.gather(*(claimer() for _ in range(concurrency)))
    return latencies, held, store.claimer.claim_conflicts - lost, time.perf_counter() - t0


async def _floor_keys(kv: KeyValue, keys: list[str], value: bytes, count: int) -> dict[str, int]:
    """Key -> revision of the scratch keys the floor writes: as many as a level's claims take (one write each)."""
    return {k: await kv.put(k, value) for k in keys[: min(len(keys), count)]}


async def _floor(
    kv: KeyValue, revs: dict[str, int], value: bytes, concurrency: int, count: int
) -> tuple[list[float], float]:
    """Bare nats-py: `count` updates by `concurrency` writers, each on its own keys, each on the revision it
    last wrote (as a claim writes on the revision its view holds). Latencies (s) and the wall time."""
    keys = list(revs)
    latencies: list[float] = []

    async def writer(mine: list[str], n: int) -> None:
        for i in range(n):
            key = mine[i % len(mine)]
            t0 = time.perf_counter()
            revs[key] = await kv.update(key, value, last=revs[key])
            latencies.append(time.perf_counter() - t0)

    per = [count // concurrency + (1 if w < count % concurrency else 0) for w in range(concurrency)]
    t0 = time.perf_counter()
    await asyncio.gather(*(writer(keys[w::concurrency], per[w]) for w in range(concurrency) if per[w]))
    return latencies, time.perf_counter() - t0


def _ms(lat: list[float]) -> tuple[float, float]:
    a = np.array(lat) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def _public(url: str) -> str:
    """`url` without a ``user:password@`` in it: the JSON report is kept and shared."""
    scheme, sep, rest = url.rpartition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"


def _row(level: ClaimsLevel) -> str:
    return (
        f"{level.claimers:>8} {level.claims:>7} {level.p50_ms:>8.2f} {level.p99_ms:>8.2f} {level.max_ms:>8.2f} "
        f"{level.claims_per_s:>9.0f} {level.conflicts:>9} | "
        f"{level.floor_p50_ms:>9.2f} {level.floor_p99_ms:>9.2f} {level.floor_updates_per_s:>9.0f} "
        f"{level.ratio_p99:>8.2f}x"
    )


async def _bench(args: argparse.Namespace) -> None:
    fmt = out.machine(args)
    text = fmt is None

    def say(line: str) -> None:  # the text report; with -o json|yaml only the object is printed
        if text:
            print(line, flush=True)

    server = None
    if args.nats_url:
        opts = nats_connect.options_from_args(args, name="pulsescale-bench")
        where = args.nats_url
        url = ",".join(_public(u) for u in opts.servers)
    else:
        server = NatsServer(sync_always=args.sync_always).start()
        opts = nats_connect.NatsOptions(servers=(server.url,), name="pulsescale-bench")
        url = server.url
        where = f"embedded nats-server {server.url}" + (" (sync_interval: always)" if args.sync_always else "")
    per_node = args.slots // args.nodes if args.slots else args.slots_per_node
    try:
        nc = await nats_connect.connect(opts)
        store = await KvSlotStore.open(nc)
        await store.start()
        keys = await seed_pool(store, MODEL, nodes=args.nodes, slots_per_node=per_node, racks=4)
        if args.without_slot_watch:
            await store.stop_slot_watch()
        js = nc.jetstream(timeout=5.0)
        floor_kv = await scratch_bucket(js, FLOOR_BUCKET)
        sample = store.record(keys[0])
        assert sample is not None
        value = protocol.encode(msgspec.structs.replace(sample, state="claimed", claim_id="0" * 16))
        report = ClaimsReport(
            nats=url, embedded=server is not None, sync_always=args.sync_always if server is not None else None,
            nodes=args.nodes, slots_per_node=per_node, slots=len(keys), claims_per_level=args.claims,
            concurrency=list(args.concurrency), slices=args.slices, slot_watch=not args.without_slot_watch,
        )  # fmt: skip
        say(f"claims bench: {len(keys)} warm slots on {args.nodes} nodes x {per_node}, {where}")
        if args.without_slot_watch:
            say("slot watch: stopped after the pool was seeded (a diagnostic: our claims' echoes are not received)")
        head = ("claimers", "claims", "p50 ms", "p99 ms", "max ms", "claims/s", "conflicts")
        floor_head = ("floor p50", "floor p99", "updates/s", "p99/floor")
        widths = (8, 7, 8, 8, 8, 9, 9)
        say(
            " ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True))
            + " | "
            + " ".join(f"{h:>9}" for h in floor_head)
        )
        for conc in args.concurrency:
            revs = await _floor_keys(floor_kv, keys, value, max(conc, args.claims))
            gc.collect()
            gc.freeze()
            floor_lat: list[float] = []
            floor_wall = 0.0
            lat_all: list[float] = []
            wall = 0.0
            conflicts = 0
            for i in range(args.slices):
                # Floor and claims take turns in slices, so that both see the same (shared, noisy) machine.
                n = args.claims * (i + 1) // args.slices - args.claims * i // args.slices
                lat, secs = await _floor(floor_kv, revs, value, conc, n)
                floor_lat += lat
                floor_wall += secs
                landed = 0
                while landed < n:
                    lat, held, conf, secs = await _round(store, conc, n - landed)
                    landed += len(lat)
                    lat_all += lat
                    wall += secs
                    conflicts += conf
                    await asyncio.gather(*(store.release(c) for c in held))
                await asyncio.sleep(SETTLE_S)
                # Untimed, as `pulsescale autoscaler` does every second (`--gc-freeze-every`): the pool's records
                # out of the cyclic collector, whose full passes over 80,000 slots otherwise stop a claim ~150 ms.
                gc.collect(1)
                gc.freeze()
            p50, p99 = _ms(lat_all)
            f50, f99 = _ms(floor_lat)
            level = ClaimsLevel(
                claimers=conc, claims=len(lat_all), p50_ms=p50, p99_ms=p99, max_ms=max(lat_all) * 1e3,
                claims_per_s=len(lat_all) / wall, wall_s=wall, conflicts=conflicts,
                floor_updates=len(floor_lat), floor_p50_ms=f50, floor_p99_ms=f99, floor_max_ms=max(floor_lat) * 1e3,
                floor_updates_per_s=len(floor_lat) / floor_wall, floor_wall_s=floor_wall, ratio_p99=p99 / f99,
            )  # fmt: skip
            report.levels.append(level)
            say(_row(level))
            if not text:  # progress, on stderr: stdout has the object only
                done = f"claimers {conc}: {len(lat_all)} claims, p99 {p99:.2f} ms ({p99 / f99:.2f}x the floor)"
                print(done, file=sys.stderr, flush=True)
        say(f"floor: {report.floor}, measured in {args.slices} slices taking turns with the claims'")
        with contextlib.suppress(Exception):
            await js.delete_key_value(FLOOR_BUCKET)
        await store.close()
        await nc.close()
    finally:
        if server is not None:
            server.stop()
    if fmt is not None:
        print(out.dump(report, fmt))


def claims(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=20, help="nodes in the pool [20]")
    p.add_argument("--slots-per-node", type=int, default=8, help="warm slots on each node [8]")
    p.add_argument("--slots", type=int, default=None, help="total warm slots instead (spread over --nodes)")
    p.add_argument("--claims", type=int, default=3000, help="claims measured per concurrency level [3000]")
    p.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 16], help="concurrent claimers; several levels allowed [1 16]"
    )
    p.add_argument(
        "--slices", type=int, default=10, help="floor and claims take turns in this many slices per level [10]"
    )
    p.add_argument("--sync-always", action="store_true", help="embedded server fsyncs every write (production)")
    p.add_argument(
        "--without-slot-watch",
        action="store_true",
        help="stop the registry's slot watch once the pool is seeded: what receiving our own claims' echoes costs",
    )
    nats_connect.add_nats_arguments(p)
    out.add_output_argument(p)
    args = p.parse_args(argv)
    asyncio.run(_bench(args))
    return 0
