"""`pulsescale autoscaler` (the daemon). (`pulsescale operator` lands here with the Kubernetes operator.)

A NATS failure at start-up (unreachable, credentials or a permission refused) leaves as `NatsUnavailable`; the
dispatcher prints it as one line and exits 1."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable
from dataclasses import replace

from autoscaler import daemon
from autoscaler.controller import ControllerSettings
from autoscaler.shards.leader import LeaseSettings
from manifests import scaledobject
from warmpool import connect, daemonstart, durations, protocol, registry

GC_FREEZE_EVERY_S = 0.25
"""The daemon's `AutoscalerSettings.gc_freeze_every_s` (see there)."""


def run_autoscaler(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the autoscaler: ingest gateway queue samples, decide, claim and activate warm slots. "
        "Run several to share the models and survive one's death: the models are split into 32 shards (leases in KV "
        "pulse_leases) spread over the live replicas.",
    )
    connect.add_nats_arguments(p)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics, /healthz and /readyz on this port")
    p.add_argument(
        "--metrics-host",
        default=daemon.AutoscalerSettings.metrics_host,
        metavar="ADDRESS",
        help="bind the metrics port to this address; in Kubernetes the pod IP from the downward API "
        f"[{daemon.AutoscalerSettings.metrics_host}]",
    )
    p.add_argument(
        "--max-replicas",
        type=int,
        metavar="N",
        help="the most replicas acted on per model: larger ScaledObjects are cut to it, larger scale/pause "
        f"refused [${protocol.MAX_REPLICAS_ENV} or {protocol.DEFAULT_MAX_REPLICAS}]",
    )
    p.add_argument(
        "--max-claims-in-flight",
        type=int,
        default=ControllerSettings.max_claims_in_flight,
        metavar="N",
        help=f"bring-ups one model may have in flight at once [{ControllerSettings.max_claims_in_flight}]",
    )
    p.add_argument(
        "--kv-replicas",
        metavar="N",
        help="JetStream replicas of the KV buckets it creates, and the least an existing one is raised to "
        f"[${registry.KV_REPLICAS_ENV}, else detected: 1 on a single server, 3 on a cluster of 3 or more]",
    )
    p.add_argument(
        "--require-assignment",
        action="store_true",
        help="offer a node's slots only of the models `pulsescale assign` gave that node (KV pulse_assignments); "
        "without it a node with no assignment offers whatever its agent advertises. The secure deployment sets it "
        "[off: a node with an assignment is held to it either way]",
    )
    p.add_argument("--identity", help="replica name in the shard leases: letters, digits, - and _ [host-pid-random]")
    p.add_argument(
        "--lease",
        type=durations.duration_arg(),
        default=LeaseSettings.lease_s,
        metavar="DURATION",
        help=f"shard lease: a dead replica's models are taken over after this [{LeaseSettings.lease_s}]",
    )
    p.add_argument(
        "--activation-deadline",
        type=durations.duration_arg(),
        default=ControllerSettings.activation_deadline_s,
        metavar="DURATION",
        help=f"claim -> ready budget per slot [{ControllerSettings.activation_deadline_s}]",
    )
    p.add_argument(
        "--gc-freeze-every",
        type=durations.duration_arg(allow_zero=True),
        default=GC_FREEZE_EVERY_S,
        metavar="DURATION",
        help="move long-lived objects out of the cyclic garbage collector's sight this often, so a full "
        f"collection does not stop decisions for ~100 ms at 1,000 models; 0 leaves Python's collector as is "
        f"[{GC_FREEZE_EVERY_S:g}]",
    )
    daemonstart.add_log_level_argument(p)
    args = p.parse_args(argv)
    try:
        max_replicas = args.max_replicas or scaledobject.max_replicas_from_env(os.environ)
    except scaledobject.ScaledObjectError as err:
        p.error(str(err))
    if args.identity is not None and not protocol.is_identity(args.identity):
        p.error(f"--identity {args.identity!r}: use 1-128 letters, digits, '-' or '_' (it names keys and subjects)")
    if max_replicas < 1 or args.max_claims_in_flight < 1:
        p.error("--max-replicas and --max-claims-in-flight must be >= 1")
    kv_replicas = args.kv_replicas or os.environ.get(registry.KV_REPLICAS_ENV)
    if kv_replicas:
        try:
            registry.parse_replicas(kv_replicas, source="--kv-replicas" if args.kv_replicas else None)
        except registry.KvReplicasError as err:
            p.error(str(err))
        # The daemon creates its buckets with `registry.ensure_buckets`, which reads the variable: the flag
        # reaches it this way until `AutoscalerSettings` carries the bucket settings.
        os.environ[registry.KV_REPLICAS_ENV] = kv_replicas
    daemonstart.configure_logging(args)
    settings = daemon.AutoscalerSettings(
        nats=connect.options_from_args(args, name="pulsescale-autoscaler"),
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        max_replicas=max_replicas,
        require_assignment=args.require_assignment,
        gc_freeze_every_s=args.gc_freeze_every if args.gc_freeze_every > 0 else None,
        lease=LeaseSettings(lease_s=args.lease, renew_every_s=args.lease / 4),
        controller=ControllerSettings(
            activation_deadline_s=args.activation_deadline, max_claims_in_flight=args.max_claims_in_flight
        ),
        **({"identity": args.identity} if args.identity else {}),
    )

    def run(nats: connect.NatsOptions, stop: asyncio.Event, ready: asyncio.Event) -> Awaitable[daemon.Autoscaler]:
        return daemon.run(replace(settings, nats=nats), stop=stop, ready=ready)

    daemonstart.run_until_signalled(settings.nats, run)
    return 0
