"""`pulsescale bench claims`: claim latency and throughput against a real nats-server.

Starts an embedded nats-server (or uses `--nats URL`), seeds a warm pool, and claims it empty with
`--concurrency` claimers sharing one registry client; slots are released between rounds, untimed.
Figures are printed, not asserted: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from warmpool import connect as nats_connect
from warmpool.embedded import NatsServer
from warmpool.errors import ClaimConflict, NoSlotAvailable
from warmpool.registry import Claim, KvSlotStore
from warmpool.seed import seed_pool

MODEL = "bench"


async def _round(store: KvSlotStore, concurrency: int, budget: int) -> tuple[list[float], list[Claim], int, float]:
    latencies: list[float] = []
    held: list[Claim] = []
    conflicts = 0

    issued = 0

    async def claimer() -> None:
        nonlocal conflicts, issued
        while issued < budget:
            issued += 1  # counted before the await, so concurrent claimers stop at the budget
            t0 = time.perf_counter()
            try:
                c = await store.claim(MODEL)
            except NoSlotAvailable:
                return
            except ClaimConflict:
                issued -= 1
                conflicts += 1
                continue
            latencies.append(time.perf_counter() - t0)
            held.append(c)

    t0 = time.perf_counter()
    await asyncio.gather(*(claimer() for _ in range(concurrency)))
    return latencies, held, conflicts, time.perf_counter() - t0


async def _bench(args: argparse.Namespace) -> None:
    server = None
    if args.nats_url:
        opts = nats_connect.options_from_args(args, name="pulsescale-bench")
        where = args.nats_url
    else:
        server = NatsServer(sync_always=args.sync_always).start()
        opts = nats_connect.NatsOptions(servers=(server.url,), name="pulsescale-bench")
        where = f"embedded nats-server {server.url}" + (" (sync_interval: always)" if args.sync_always else "")
    try:
        nc = await nats_connect.connect(opts)
        store = await KvSlotStore.open(nc)
        await store.start()
        keys = await seed_pool(store, MODEL, nodes=args.nodes, slots_per_node=args.slots // args.nodes, racks=4)
        print(f"claims bench: {len(keys)} warm slots on {args.nodes} nodes, {where}")
        head = ("concurrency", "claims", "p50 ms", "p99 ms", "max ms", "claims/s", "conflicts")
        print(" ".join(f"{h:>{w}}" for h, w in zip(head, (11, 7, 8, 8, 8, 9, 9), strict=True)))
        for conc in args.concurrency:
            lat_all: list[float] = []
            wall = 0.0
            conflicts = 0
            while len(lat_all) < args.claims:
                lat, held, conf, secs = await _round(store, conc, args.claims - len(lat_all))
                lat_all += lat
                wall += secs
                conflicts += conf
                await asyncio.gather(*(store.release(c) for c in held))
            ms = np.array(lat_all) * 1e3
            print(
                f"{conc:>11} {len(ms):>7} {np.percentile(ms, 50):>8.2f} {np.percentile(ms, 99):>8.2f} "
                f"{ms.max():>8.2f} {len(ms) / wall:>9.0f} {conflicts:>9}"
            )
        await store.close()
        await nc.close()
    finally:
        if server is not None:
            server.stop()


def claims(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=1000, help="warm slots in the pool [1000]")
    p.add_argument("--nodes", type=int, default=20, help="nodes they are spread over [20]")
    p.add_argument("--claims", type=int, default=3000, help="claims measured per concurrency level [3000]")
    p.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 16], help="concurrent claimers; several levels allowed [1 16]"
    )
    p.add_argument("--sync-always", action="store_true", help="embedded server fsyncs every write (production)")
    nats_connect.add_nats_arguments(p)
    args = p.parse_args(argv)
    asyncio.run(_bench(args))
    return 0
