"""warmpool's subcommands: `pulsescale nats` (a local broker; `--secure`: with the production's users,
permissions and TLS), `pulsescale slots` (the registry, raw),
`pulsescale assign` (the models each node may offer, KV `pulse_assignments`) and
`pulsescale sample` (gateway samples by hand).

A NATS failure (unreachable, credentials or a permission refused) leaves these as `NatsUnavailable`, and a port
`pulsescale nats` cannot bind as a `PulsescaleError`; the dispatcher prints it as one line and exits with its
`exit_code` (1 refused or failed, 3 unreachable)."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import shutil
import signal
import socket
import sys
import threading
import time

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client

from warmpool import buckets, durations, natsauth, protocol
from warmpool import connect as nats_connect
from warmpool import output as out
from warmpool.embedded import NatsServer, PortTaken
from warmpool.errors import BadMessage, PulsescaleError
from warmpool.registry import KvSlotStore, ensure_buckets


def run_nats(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(
        prog=prog, description="Run nats-server with JetStream from this virtualenv, for local use; Ctrl-C stops it."
    )
    p.add_argument("--port", type=int, default=4222, help="client port [4222]")
    p.add_argument("--store-dir", default=".pulsescale/nats", help="JetStream store [.pulsescale/nats]")
    p.add_argument("--sync-always", action="store_true", help="fsync every JetStream write, as production does")
    p.add_argument(
        "--secure",
        action="store_true",
        help="the production layout: a NATS user per role with its permissions (README, 'Security'), "
        "TLS with a fresh local CA; credentials files under STORE-DIR/secure/credentials (0600)",
    )
    p.add_argument(
        "--nodes",
        default="node-0",
        metavar="N1,N2",
        help="with --secure: the nodes that get an agent user (agent-<node>) [node-0]",
    )
    p.add_argument("--no-tls", action="store_true", help="with --secure: users and permissions, but no TLS")
    p.add_argument(
        "--monitor-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve nats-server's HTTP monitoring on 127.0.0.1:PORT (0: a free port). It has no authentication "
        "(/connz lists every client), so with --secure there is none unless asked [without --secure: a free port]",
    )
    p.add_argument(
        "--print-authorization",
        action="store_true",
        help="print the server's authorization block for --nodes, passwords as $PULSE_NATS_PASSWORD_<USER> "
        "variables (deploy/base/nats/configmap.yaml auth.conf), and exit",
    )
    args = p.parse_args(argv)
    nodes = [n.strip() for n in args.nodes.split(",") if n.strip()]
    if args.secure or args.print_authorization:
        bad = [n for n in nodes if not protocol.is_name(n)]
        if bad or not nodes:
            p.error(f"--nodes: {', '.join(bad) or 'none given'}: names match {protocol.NAME_PATTERN}")
    if args.print_authorization:
        print(natsauth.render_authorization(natsauth.role_users(nodes)), end="")
        return 0
    monitor = args.monitor_port if args.monitor_port is not None else (None if args.secure else 0)
    server = NatsServer(args.store_dir, port=args.port, sync_always=args.sync_always, monitor_port=monitor)
    layout: natsauth.SecureLayout | None = None
    if args.secure:
        tls = not args.no_tls
        if tls and shutil.which("openssl") is None:
            print("openssl not found: TLS skipped (users and permissions only)", file=sys.stderr)
            tls = False
        layout = natsauth.write_secure_layout(server.store_dir / "secure", server.url, nodes, tls=tls)
        server.extra_config, server.tls = layout.authorization, layout.tls
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except PortTaken as err:
        which = "--monitor-port" if err.port == server.monitor_port else "--port"
        raise PulsescaleError(
            f"port {err.port} is already in use (another nats-server, or `pulsescale nats` already running?): "
            f"stop it or pick another {which}"
        ) from None
    except (RuntimeError, TimeoutError) as err:  # it exited, or never served: its log says why
        last = [line for line in str(err).splitlines() if line.strip()]
        raise PulsescaleError(
            f"nats-server did not start: {last[-1] if last else err} (log {server.log_path})"
        ) from None
    print(f"nats-server with JetStream on {server.url} (store {server.store_dir}, log {server.log_path})", flush=True)
    if server.monitor_port is not None:
        print(f"monitoring (no authentication) on http://127.0.0.1:{server.monitor_port}", flush=True)
    if layout is not None:
        # Any start order works locally: the buckets exist before the first agent or `apply` looks them up.
        creator = natsauth.read_env_file(layout.credentials["autoscaler"])
        asyncio.run(_create_buckets(creator))
        print(_secure_usage(layout), flush=True)
    try:
        while not stop.wait(0.5):
            if server.proc is None or server.proc.poll() is not None:
                print(f"nats-server exited; log:\n{server.tail_log()}", file=sys.stderr)
                return 1
    finally:
        server.kill(signal.SIGTERM)
    return 0


async def _create_buckets(env: dict[str, str]) -> None:
    opts = nats_connect.options_from_args(argparse.Namespace(), name="pulsescale-nats-init", env=env)
    await nats_connect.run_client(opts, lambda nc: ensure_buckets(nc.jetstream(timeout=5.0), harden=True))


_ROLE_COMMANDS: dict[natsauth.Role, str] = {
    "autoscaler": "pulsescale autoscaler",
    "agent": "pulsescale agent --model DIR",
    "operator": "pulsescale apply -f FILE",
    "oncall": "pulsescale status",
    "gateway": "pulsescale sample MODEL --queue-depth N",
}


def _secure_usage(layout: natsauth.SecureLayout) -> str:
    tls = f"TLS: clients verify the server with {layout.tls.ca_cert}" if layout.tls else "TLS: off"
    lines = [
        f"users and permissions per role; {tls}",
        "credentials (PULSESCALE_NATS_URL/_USER/_PASSWORD/_TLS_CA; agents also PULSESCALE_NODE), one file per user:",
    ]
    for u in layout.users:
        lines.append(f"  {u.role:<10} {u.name:<20} {layout.credentials[u.name]}")
    lines.append("use one in a shell (the password stays out of the process list):")
    for u in layout.users:
        lines.append(f"  (set -a; . {layout.credentials[u.name]}; {_ROLE_COMMANDS[u.role]})")
    lines.append("or as flags: --nats URL --nats-user USER --nats-password PASSWORD [--nats-tls-ca CA]")
    return "\n".join(lines)


async def _slots(nc: Client, model: str | None, fmt: str | None) -> None:
    async with await KvSlotStore.open(nc) as store:
        now = store.clock()
        rows = sorted(store.records(model), key=lambda r: r.key)
        fresh = {}
        for r in rows:
            lease = store.index.lease(r.node)
            fresh[r.key] = "fresh" if lease and lease.fresh(now) else "stale"
        if fmt is not None:
            # The records as stored, each with its agent's freshness (not part of the record: judged here, now).
            print(out.dump([{"key": r.key, **msgspec.to_builtins(r), "agent": fresh[r.key]} for r in rows], fmt))
            return
        table = [
            (r.key, r.state, r.rack or "-", fresh[r.key], "yes" if r.weights_resident else "no", r.reason or "")
            for r in rows
        ]
        print(out.table(("SLOT", "STATE", "RACK", "AGENT", "RESIDENT", "REASON"), table))
        print(f"{len(rows)} slot(s)")


def slots(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(
        prog=prog, description="List slots straight from the pulse_slots bucket.", epilog=out.TIMES_RULE
    )
    p.add_argument("model", nargs="?", help="only this model's slots")
    out.add_output_argument(p)
    nats_connect.add_nats_arguments(p)
    args = p.parse_args(argv)
    opts = nats_connect.options_from_args(args, name="pulsescale-slots")
    asyncio.run(nats_connect.run_client(opts, lambda nc: _slots(nc, args.model, out.machine(args))))
    return 0


async def _assignments(nc: Client) -> list[protocol.NodeAssignment]:
    js = nc.jetstream(timeout=5.0)
    kv = (await ensure_buckets(js, names=(protocol.ASSIGNMENTS_BUCKET,)))[protocol.ASSIGNMENTS_BUCKET]
    found = []
    for node in await buckets.list_keys(js, protocol.ASSIGNMENTS_BUCKET):
        try:
            entry = await kv.get(node)
        except nats.js.errors.KeyNotFoundError:
            continue  # deleted: the node is unbound
        if entry.value:
            found.append(protocol.decode(entry.value, protocol.NodeAssignment))
    return found


async def _assign(nc: Client, record: protocol.NodeAssignment) -> None:
    js = nc.jetstream(timeout=5.0)
    kv = (await ensure_buckets(js, names=(protocol.ASSIGNMENTS_BUCKET,)))[protocol.ASSIGNMENTS_BUCKET]
    await kv.put(record.node, protocol.encode(record))


async def _hand_back(nc: Client, node: str) -> protocol.NodeAssignment:
    """Rewrite `node`'s record as the operator's (`protocol.NodeAssignment.OPERATOR`), its models unchanged, by
    compare-and-set: the operator then adds and removes the models of its standby pods there."""
    js = nc.jetstream(timeout=5.0)
    kv = (await ensure_buckets(js, names=(protocol.ASSIGNMENTS_BUCKET,)))[protocol.ASSIGNMENTS_BUCKET]
    for _ in range(5):
        try:
            entry = await kv.get(node)
        except nats.js.errors.KeyNotFoundError:
            entry = None
        if entry is None or not entry.value:
            raise PulsescaleError(
                f"node {node} has no assignment: nothing to hand back (the operator writes one once a standby pod "
                "is scheduled there)"
            )
        try:
            old = protocol.decode(entry.value, protocol.NodeAssignment)
        except BadMessage:
            old = protocol.NodeAssignment(node=node)
        record = msgspec.structs.replace(old, by=protocol.NodeAssignment.OPERATOR, updated_at=time.time())
        try:
            await kv.update(node, protocol.encode(record), last=entry.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
        return record
    raise PulsescaleError(f"node {node}: its assignment changed under each of 5 tries; run it again")


def _default_by() -> str:
    """Who is assigning: ``$PULSESCALE_USER``, else ``user@host`` (as the on-call commands' ``--by``)."""
    if os.environ.get("PULSESCALE_USER"):
        return os.environ["PULSESCALE_USER"][:128]
    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:128]


def assign(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Set the models a node may offer slots of (KV pulse_assignments; needs the operator's NATS user). "
        "The autoscaler claims none of a node's slots of another model and counts them "
        '(pulsescale_registry_rejected_records_total{reason="unassigned_model"}); a node without an assignment '
        "offers any model unless the autoscaler and the gateway run with --require-assignment. "
        "On Kubernetes the operator keeps each node's assignment from its standby pods; one written here overrides "
        "it until --hand-back. Without NODE: list the assignments.",
    )
    p.add_argument("node", nargs="?", help="the node (its agent's --node)")
    p.add_argument("models", nargs="*", metavar="MODEL", help="every model the node may offer (replaces the list)")
    p.add_argument("--none", action="store_true", help="the node may offer no model (take it out of service)")
    p.add_argument(
        "--hand-back",
        action="store_true",
        help="give NODE's assignment back to the Kubernetes operator (its models stay, then follow the node's "
        "standby pods); a manual one overrides the operator's until then",
    )
    p.add_argument("--by", help="who assigns, kept in the record [$PULSESCALE_USER, else user@host]")
    out.add_output_argument(p)
    nats_connect.add_nats_arguments(p)
    args = p.parse_args(argv)
    bad = [n for n in ([args.node] if args.node else []) + args.models if not protocol.is_name(n)]
    if bad:
        p.error(f"{', '.join(map(repr, bad))}: names match {protocol.NAME_PATTERN}")
    if args.hand_back and (args.models or args.none or args.by or not args.node):
        p.error("--hand-back takes NODE alone")
    if args.node and not args.models and not args.none and not args.hand_back:
        p.error(f"give the models {args.node} may offer, or --none for no model")
    if args.models and args.none:
        p.error("--none takes no MODEL")
    if len(set(args.models)) > protocol.MAX_MODELS_PER_NODE:
        p.error(f"at most {protocol.MAX_MODELS_PER_NODE} models per node")
    opts = nats_connect.options_from_args(args, name="pulsescale-assign")
    fmt = out.machine(args)
    if args.node is None:
        found = asyncio.run(nats_connect.run_client(opts, _assignments))
        if fmt is not None:
            print(out.dump(found, fmt))
            return 0
        rows = [(a.node, ",".join(a.models) or "<no model>", a.by or "-") for a in found]
        print(out.table(("NODE", "MODELS", "BY"), rows))
        return 0
    if args.hand_back:
        record = asyncio.run(nats_connect.run_client(opts, lambda nc: _hand_back(nc, args.node)))
        if fmt is not None:
            print(out.dump(record, fmt))
            return 0
        print(f"node {record.node} handed back to the operator (may offer {', '.join(record.models) or 'no model'} "
              "until it updates it)")  # fmt: skip
        return 0
    record = protocol.NodeAssignment(
        node=args.node, models=sorted(set(args.models)), by=(args.by or _default_by())[:128], updated_at=time.time()
    )
    asyncio.run(nats_connect.run_client(opts, lambda nc: _assign(nc, record)))
    if fmt is not None:
        print(out.dump(record, fmt))
        return 0
    print(f"node {record.node} may offer {', '.join(record.models) or 'no model'}")
    return 0


async def scaled_models(nc: Client) -> set[str] | None:
    """The models the ScaledObjects in `pulse_scalers` name (empty: no bucket yet); None when it cannot be read
    (no answer in time): the check it serves is advice, not a gate."""
    js = nc.jetstream(timeout=2.0)
    try:
        kv = await js.key_value(protocol.SCALERS_BUCKET)
        keys = await buckets.list_keys(js, protocol.SCALERS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return set()
    except (TimeoutError, nats.errors.Error):
        return None

    async def model_of(key: str) -> str | None:
        try:
            entry = await kv.get(key)
            return protocol.decode(entry.value, protocol.ScalerRecord).spec.model if entry.value else None
        except (nats.js.errors.KeyNotFoundError, BadMessage):
            return None

    try:
        return {m for m in await asyncio.gather(*(model_of(k) for k in keys)) if m is not None}
    except (TimeoutError, nats.errors.Error):
        return None


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


def _is_scaled(opts: nats_connect.NatsOptions, model: str) -> bool:
    """Whether a ScaledObject names `model`; True when that cannot be read (a user that may not read
    `pulse_scalers`, no answer): the check is advice, asked after the samples went out, on a connection of its own
    so that a refusal of it never fails the command."""
    try:
        models = asyncio.run(nats_connect.run_client(opts, scaled_models))
    except PulsescaleError:
        return True
    return models is None or model in models


def sample(argv: list[str], prog: str) -> int:
    p = durations.dashed_values(
        argparse.ArgumentParser(
            prog=prog,
            description="Publish gateway queue samples by hand (drills and demos), as a gateway would: "
            "every --every seconds for --for seconds on pulse.queue.MODEL.",
        )
    )
    p.add_argument("model")
    p.add_argument("--queue-depth", type=int, required=True, help="requests waiting")
    p.add_argument("--inflight", type=int, default=0, help="requests being served [0]")
    p.add_argument(
        "--for",
        dest="for_s",
        type=durations.duration_arg(allow_zero=True),
        default=0.0,
        metavar="DURATION",
        help="keep publishing this long: 30s, 2m, 500ms, plain seconds [once]",
    )
    p.add_argument(
        "--every", dest="every_s", type=durations.duration_arg(), default=0.1, metavar="DURATION", help="[100ms]"
    )
    p.add_argument("--gateway", default="cli", help="gateway name in the samples [cli]")
    out.add_output_argument(p)
    nats_connect.add_nats_arguments(p)
    args = p.parse_args(argv)
    if not protocol.is_name(args.model):
        p.error(f"model {args.model!r} is not a valid name ({protocol.NAME_PATTERN})")
    if args.queue_depth < 0 or args.inflight < 0:
        p.error("counts must be >= 0")
    opts = nats_connect.options_from_args(args, name="pulsescale-sample")
    sent = asyncio.run(nats_connect.run_client(opts, lambda nc: _sample(nc, args)))
    if not _is_scaled(opts, args.model):
        # A warning, not a failure: the samples went out, and a drill may apply its ScaledObject next.
        print(
            f"{prog}: warning: no ScaledObject names model {args.model!r} (KV {protocol.SCALERS_BUCKET}): the "
            "autoscaler ignores its samples until one does (`pulsescale apply -f FILE`; `pulsescale get "
            "scaledobjects` lists them)",
            file=sys.stderr,
        )
    fmt = out.machine(args)
    if fmt is not None:
        published = {"model": args.model, "samples": sent, "queue_depth": args.queue_depth, "inflight": args.inflight}
        print(out.dump(published, fmt))
        return 0
    print(f"published {sent} sample(s) for {args.model}: queue {args.queue_depth}, in-flight {args.inflight}")
    return 0
