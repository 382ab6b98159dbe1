"""warmpool's subcommands: `pulsescale nats` (a local broker) and `pulsescale slots` (the registry, raw)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading

from warmpool import connect as nats_connect
from warmpool.embedded import NatsServer
from warmpool.errors import NatsUnavailable
from warmpool.registry import KvSlotStore


def run_nats(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(
        prog=prog, description="Run nats-server with JetStream from this virtualenv, for local use; Ctrl-C stops it."
    )
    p.add_argument("--port", type=int, default=4222)
    p.add_argument("--store-dir", default=".pulsescale/nats", help="JetStream store [.pulsescale/nats]")
    p.add_argument("--sync-always", action="store_true", help="fsync every JetStream write, as production does")
    args = p.parse_args(argv)
    server = NatsServer(args.store_dir, port=args.port, sync_always=args.sync_always)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"nats-server with JetStream on {server.url} (store {server.store_dir}, log {server.log_path})", flush=True)
    try:
        while not stop.wait(0.5):
            if server.proc is None or server.proc.poll() is not None:
                print(f"nats-server exited; log:\n{server.tail_log()}", file=sys.stderr)
                return 1
    finally:
        server.kill(signal.SIGTERM)
    return 0


async def _slots(args: argparse.Namespace) -> None:
    nc = await nats_connect.connect(nats_connect.options_from_args(args, name="pulsescale-slots"))
    try:
        async with await KvSlotStore.open(nc) as store:
            now = store.clock()
            rows = sorted(store.records(args.model), key=lambda r: r.key)
            print(f"{'SLOT':<40} {'STATE':<11} {'RACK':<10} {'AGENT':<7} {'RESIDENT':<8} REASON")
            for r in rows:
                lease = store.lease(r.node)
                agent = "fresh" if lease and lease.fresh(now) else "stale"
                resident = "yes" if r.weights_resident else "no"
                print(f"{r.key:<40} {r.state:<11} {r.rack or '-':<10} {agent:<7} {resident:<8} {r.reason or ''}")
            print(f"{len(rows)} slot(s)")
    finally:
        await nc.close()


def slots(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description="List slots straight from the pulse_slots bucket.")
    p.add_argument("model", nargs="?", help="only this model's slots")
    nats_connect.add_nats_arguments(p)
    args = p.parse_args(argv)
    try:
        asyncio.run(_slots(args))
    except NatsUnavailable as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    return 0
