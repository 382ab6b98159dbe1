"""`pulsescale autoscaler` (the daemon). (`pulsescale operator` lands here with the Kubernetes operator.)

A NATS failure at start-up (unreachable, credentials or a permission refused) leaves as `NatsUnavailable`; the
dispatcher prints it as one line and exits 1."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Awaitable
from dataclasses import replace

from autoscaler import daemon
from autoscaler.controller import ControllerSettings
from autoscaler.leader import LeaseSettings
from warmpool import connect


def run_autoscaler(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the autoscaler: ingest gateway queue samples, decide, claim and activate warm slots. "
        "Run several for high availability; one leads (lease in KV pulse_leases), the others stand by.",
    )
    connect.add_nats_arguments(p)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--identity", help="replica name in the leader lease [host-pid-random]")
    p.add_argument(
        "--lease",
        type=float,
        default=LeaseSettings.lease_s,
        metavar="SECONDS",
        help=f"leader lease [{LeaseSettings.lease_s}]",
    )
    p.add_argument(
        "--activation-deadline",
        type=float,
        default=ControllerSettings.activation_deadline_s,
        metavar="SECONDS",
        help=f"claim -> ready budget per slot [{ControllerSettings.activation_deadline_s}]",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = daemon.AutoscalerSettings(
        nats=connect.options_from_args(args, name="pulsescale-autoscaler"),
        metrics_port=args.metrics_port,
        lease=LeaseSettings(lease_s=args.lease, renew_every_s=args.lease / 4),
        controller=ControllerSettings(activation_deadline_s=args.activation_deadline),
        **({"identity": args.identity} if args.identity else {}),
    )

    async def main() -> None:
        stop, ready = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        def run(nats: connect.NatsOptions) -> Awaitable[daemon.Autoscaler]:
            return daemon.run(replace(settings, nats=nats), stop=stop, ready=ready)

        await connect.run_daemon(settings.nats, run, ready)

    asyncio.run(main())
    return 0
