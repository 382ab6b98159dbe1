"""warmpool's subcommands: `pulsescale nats` (a local broker), `pulsescale slots` (the registry, raw) and
`pulsescale sample` (gateway samples by hand).

A NATS failure (unreachable, credentials or a permission refused) leaves these as `NatsUnavailable`; the
dispatcher prints it as one line and exits 1."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
import time

from nats.aio.client import Client

from warmpool import connect as nats_connect
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore


def run_nats(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(
        prog=prog, description="Run nats-server with JetStream from this virtualenv, for local use; Ctrl-C stops it."
    )
    p.add_argument("--port", type=int, default=4222, help="client port [4222]")
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


async def _slots(nc: Client, model: str | None) -> None:
    async with await KvSlotStore.open(nc) as store:
        now = store.clock()
        rows = sorted(store.records(model), key=lambda r: r.key)
        print(f"{'SLOT':<40} {'STATE':<11} {'RACK':<10} {'AGENT':<7} {'RESIDENT':<8} REASON")
        for r in rows:
            lease = store.lease(r.node)
            agent = "fresh" if lease and lease.fresh(now) else "stale"
            resident = "yes" if r.weights_resident else "no"
            print(f"{r.key:<40} {r.state:<11} {r.rack or '-':<10} {agent:<7} {resident:<8} {r.reason or ''}")
        print(f"{len(rows)} slot(s)")


def slots(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description="List slots straight from the pulse_slots bucket.")
    p.add_argument("model", nargs="?", help="only this model's slots")
    nats_connect.add_nats_arguments(p)
    args = p.parse_args(argv)
    opts = nats_connect.options_from_args(args, name="pulsescale-slots")
    asyncio.run(nats_connect.run_client(opts, lambda nc: _slots(nc, args.model)))
    return 0


async def _sample(nc: Client, args: argparse.Namespace) -> int:
    """Publish the samples; how many. The flush waits for the server's answer, so a refused publish is known
    (and `run_client` raises it) before this returns."""
    end = time.monotonic() + args.for_s
    seq = 0
    arrivals = 0
    while True:
        seq += 1
        arrivals += args.queue_depth
        s = protocol.QueueSample(
            gateway=args.gateway,
            model=args.model,
            seq=seq,
            ts=time.time(),
            queue_depth=args.queue_depth,
            inflight=args.inflight,
            arrivals_total=arrivals,
            completions_total=0,
            timeouts_total=0,
        )
        await nc.publish(protocol.queue_subject(args.model), protocol.encode(s))
        if time.monotonic() >= end:
            break
        await asyncio.sleep(args.every_s)
    await nc.flush()
    return seq


def sample(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Publish gateway queue samples by hand (drills and demos), as a gateway would: "
        "every --every seconds for --for seconds on pulse.queue.MODEL.",
    )
    p.add_argument("model")
    p.add_argument("--queue-depth", type=int, required=True, help="requests waiting")
    p.add_argument("--inflight", type=int, default=0, help="requests being served [0]")
    p.add_argument("--for", dest="for_s", type=float, default=0.0, metavar="SECONDS", help="keep publishing [once]")
    p.add_argument("--every", dest="every_s", type=float, default=0.1, metavar="SECONDS", help="interval [0.1]")
    p.add_argument("--gateway", default="cli", help="gateway name in the samples [cli]")
    nats_connect.add_nats_arguments(p)
    args = p.parse_args(argv)
    if not protocol.is_name(args.model):
        p.error(f"model {args.model!r} is not a valid name ({protocol.NAME_PATTERN})")
    if args.queue_depth < 0 or args.inflight < 0:
        p.error("counts must be >= 0")
    opts = nats_connect.options_from_args(args, name="pulsescale-sample")
    sent = asyncio.run(nats_connect.run_client(opts, lambda nc: _sample(nc, args)))
    print(f"published {sent} sample(s) for {args.model}: queue {args.queue_depth}, in-flight {args.inflight}")
    return 0
