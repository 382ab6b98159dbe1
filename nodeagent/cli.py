"""The node agent's subcommands: `pulsescale agent` (the daemon) and `pulsescale model` (model tools)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable
from dataclasses import replace
from pathlib import Path

from nodeagent import modelformat, served, tinymodel
from nodeagent.engine import ENGINES, loaders, safetensors_check
from nodeagent.engine.zygote import FAULTS
from nodeagent.errors import BadModel, BadWeights, LoaderUnavailable
from nodeagent.settings import AgentSettings
from warmpool import connect as nats_connect
from warmpool import protocol

__all__ = ["model", "run_agent"]


def _agent_parser(prog: str) -> argparse.ArgumentParser:
    d = AgentSettings(node="x", model_dir=Path("."), model_name="x")
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the node agent: stage a model's weights in shm, keep its slots warm and leased, activate "
        "and deactivate them on request (pulse.agent.<node>.*). SIGTERM stops it cleanly.",
    )
    p.add_argument("--node", default=os.environ.get("PULSESCALE_NODE"), help="this node's name [$PULSESCALE_NODE]")
    p.add_argument(
        "--rack", default=os.environ.get("PULSESCALE_RACK", ""), help="rack, for placement [$PULSESCALE_RACK]"
    )
    p.add_argument("--slots", type=int, default=d.slots, help=f"slots (engines) for the model [{d.slots}]")
    p.add_argument("--model", required=True, metavar="DIR", help="model directory (safetensors + sha256sums.txt)")
    p.add_argument("--model-name", help="the model's name in the registry [the directory's name]")
    p.add_argument("--engine", default=d.engine, choices=ENGINES, help=f"engine adapter [{d.engine}]")
    p.add_argument("--loader", default=d.loader, choices=loaders.LOADERS, help=f"weight loader [{d.loader}]")
    p.add_argument("--shm-dir", default=str(d.shm_dir), help=f"where weights are staged [{d.shm_dir}]")
    p.add_argument("--engine-host", default=d.engine_host, help=f"address engines bind [{d.engine_host}]")
    p.add_argument("--advertise-host", help="host put in endpoints (pod/node IP) [the engine host]")
    p.add_argument("--engine-port-base", type=int, default=0, help="slot i serves on this port + i [0: any free port]")
    p.add_argument(
        "--engine-memory",
        default=d.engine_memory,
        choices=("shared", "private"),
        help="shared: engines read the shm mapping in place; private: the loader copies into engine memory",
    )
    p.add_argument("--lease-s", type=float, default=d.lease_s, help=f"agent lease in seconds [{d.lease_s}]")
    p.add_argument("--metrics-host", default=d.metrics_host, help=f"metrics bind address [{d.metrics_host}]")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help=f"Prometheus port, 0 = any free, -1 = off [{d.metrics_port}]",
    )
    p.add_argument("--no-mlock", action="store_true", help="do not lock the staged weights in memory")
    p.add_argument(
        "--engine-user",
        default=d.engine_user,
        help=f"user engines run as when the agent is root (name or uid; root opts out) [{d.engine_user}]",
    )
    p.add_argument(
        "--engine-cmd",
        metavar="CMDLINE",
        help="command engine: the server's command line (no shell), with {port} {host} {model_dir} {staged_dir} "
        "{model_name} {slot} placeholders; one standby server per slot",
    )
    p.add_argument(
        "--ready-path", default=d.ready_path, help=f"standby server's readiness path (200 = healthy) [{d.ready_path}]"
    )
    p.add_argument(
        "--engine-start-timeout-s",
        type=float,
        default=d.engine_start_timeout_s,
        help=f"standby server start to healthy, else the slot fails [{d.engine_start_timeout_s:g}]",
    )
    p.add_argument("--log-dir", help="where standby servers' logs go (0700, agent-owned) [<shm-dir>/.logs]")
    p.add_argument("--fault", action="append", default=[], metavar="SLOT=KIND", help=argparse.SUPPRESS)
    p.add_argument("--log-level", default=os.environ.get("PULSESCALE_LOG_LEVEL", "INFO"), help="[INFO]")
    nats_connect.add_nats_arguments(p)
    return p


def _settings(args: argparse.Namespace, p: argparse.ArgumentParser) -> AgentSettings:
    if not args.node:
        p.error("--node is required (or set PULSESCALE_NODE)")
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        p.error(f"--model {model_dir}: not a directory")
    name = args.model_name or model_dir.resolve().name
    for kind, value, flag in (("node", args.node, "--node"), ("model", name, "--model-name")):
        if not protocol.is_name(value):
            p.error(f"{kind} name {value!r} must match {protocol.NAME_PATTERN} (set {flag})")
    if args.slots < 1:
        p.error("--slots must be >= 1")
    if args.engine == "vllm":
        p.error(f"engine {args.engine!r} is not built yet in this version; use --engine local or command")
    if args.engine == "command":
        if not args.engine_cmd:
            p.error("--engine command needs --engine-cmd 'SERVER COMMAND LINE' (e.g. 'my-server --port {port}')")
        try:
            served.render(args.engine_cmd, dict.fromkeys(served.PLACEHOLDERS, "x"))
        except served.BadCommand as err:
            p.error(f"--engine-cmd: {err}")
    elif args.engine_cmd:
        p.error(f"--engine-cmd is for --engine command, not {args.engine}")
    if not args.ready_path.startswith("/"):
        p.error(f"--ready-path {args.ready_path!r} must start with /")
    if args.engine_start_timeout_s <= 0:
        p.error("--engine-start-timeout-s must be > 0")
    try:
        loaders.choose(args.loader)
    except LoaderUnavailable as err:
        p.error(str(err))
    faults = {}
    slot_names = AgentSettings(node=args.node, model_dir=model_dir, model_name=name, slots=args.slots).slot_names
    for item in args.fault:
        slot, _, kind = item.partition("=")
        if kind not in FAULTS:
            p.error(f"--fault {item!r}: kind must be one of {', '.join(FAULTS)}")
        if slot not in slot_names:
            p.error(f"--fault {item!r}: no slot {slot!r} on this agent (it has {', '.join(slot_names)})")
        faults[slot] = kind
    if not 0 < args.lease_s <= protocol.MAX_LEASE_S:
        # Readers refuse a longer lease (contract revision 3): the node would never count as alive.
        p.error(f"--lease-s {args.lease_s:g}: must be > 0 and at most {protocol.MAX_LEASE_S:g} s")
    return AgentSettings(
        node=args.node,
        model_dir=model_dir,
        model_name=name,
        nats=nats_connect.options_from_args(args, name=f"pulsescale-agent-{args.node}"),
        rack=args.rack,
        slots=args.slots,
        engine=args.engine,
        loader=args.loader,
        shm_dir=Path(args.shm_dir),
        engine_host=args.engine_host,
        advertise_host=args.advertise_host,
        engine_port_base=args.engine_port_base,
        engine_memory=args.engine_memory,
        lease_s=args.lease_s,
        heartbeat_interval_s=max(0.2, args.lease_s / 3),
        metrics_host=args.metrics_host,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        lock_weights=not args.no_mlock,
        engine_user=args.engine_user,
        engine_cmd=args.engine_cmd,
        ready_path=args.ready_path,
        engine_start_timeout_s=args.engine_start_timeout_s,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        faults=faults,
    )


def run_agent(argv: list[str], prog: str) -> int:
    p = _agent_parser(prog)
    args = p.parse_args(argv)
    settings = _settings(args, p)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    from nodeagent import agent  # the daemon's imports (nats, aiohttp) only when it runs

    async def main() -> None:
        stop, ready = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        def started(a: agent.Agent, port: int | None) -> None:
            where = f", metrics on :{port}" if port is not None else ""
            print(f"agent {settings.node}: serving pulse.agent.{settings.node}.*{where}", file=sys.stderr, flush=True)

        def run(nats: nats_connect.NatsOptions) -> Awaitable[None]:
            return agent.run(replace(settings, nats=nats), stop=stop, ready=ready, on_started=started)

        await nats_connect.run_daemon(settings.nats, run, ready)

    # NATS unreachable or refused, a permission denied at start, the metrics port taken: `PulsescaleError`s, which
    # the dispatcher prints as one line.
    asyncio.run(main())
    return 0


# --- pulsescale model ------------------------------------------------------------------------------------------------


def _make_tiny(args: argparse.Namespace) -> int:
    try:
        size = tinymodel.parse_size(args.size)
        shard = tinymodel.parse_size(args.shard_size)
    except ValueError as err:
        print(f"make-tiny: {err}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    cfg = tinymodel.make_tiny(args.dir, size, shard_bytes=shard, seed=args.seed)
    files = sorted(Path(args.dir).glob("*.safetensors"))
    print(
        f"wrote {args.dir}: {cfg.nbytes / 1e6:.1f} MB of F32 weights in {len(files)} file(s) "
        f"(dim {cfg.dim}, {cfg.layers} layers x {cfg.experts} experts) + {modelformat.CONFIG_FILE} + "
        f"{modelformat.MANIFEST_FILE} in {time.perf_counter() - t0:.1f} s"
    )
    return 0


def _verify(args: argparse.Namespace) -> int:
    """Check a model directory the way staging will, without staging it."""
    bad = 0
    try:
        sums = modelformat.read_manifest(args.dir)
    except BadModel as err:
        print(f"verify: {err}", file=sys.stderr)
        return 1
    for name, want in sorted(sums.items()):
        path = Path(args.dir, name)
        try:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(8 * 2**20):
                    h.update(chunk)
            if h.hexdigest() != want:
                raise BadWeights(name, "sha256 mismatch with the manifest")
            if name.endswith(".safetensors"):
                hdr = safetensors_check.read_header(path)
                print(f"ok    {name}: {len(hdr.tensors)} tensors, {hdr.data_bytes} bytes")
            else:
                print(f"ok    {name}")
        except (BadWeights, OSError) as err:
            bad += 1
            print(f"BAD   {name}: {err}")
    return 1 if bad else 0


def model(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description="Model tools for the node agent.")
    sub = p.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser(
        "make-tiny",
        help="write a local-engine model of a given size (safetensors + sha256sums.txt)",
        description="Write a byte-level mixture-of-experts model for the local engine; sizes in SI (MB, GB) or "
        "binary (MiB, GiB) units.",
    )
    mk.add_argument("dir")
    mk.add_argument("--size", default="64MB", help="about this many bytes of weights [64MB]")
    mk.add_argument("--shard-size", default="512MiB", help="largest weights file [512MiB]")
    mk.add_argument("--seed", type=int, default=0)
    ver = sub.add_parser("verify", help="check every file against sha256sums.txt and every safetensors header")
    ver.add_argument("dir")
    args = p.parse_args(argv)
    if args.cmd == "make-tiny":
        return _make_tiny(args)
    return _verify(args)
