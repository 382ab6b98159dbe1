"""`pulsescale gateway` (the reference gateway daemon) and `pulsescale load` (the pulse load generator).

A NATS failure at start-up (unreachable, credentials or a permission refused) and a port taken leave as a
`PulsescaleError`; the dispatcher prints it as one line and exits 1."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable
from dataclasses import replace

from warmpool import connect, daemonstart, durations, protocol
from warmpool.sizes import parse_size


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"{text!r}: give HOST:PORT, e.g. 127.0.0.1:8080")
    return host.strip("[]"), int(port)


def _models(text: str) -> frozenset[str]:
    names = frozenset(m.strip() for m in text.split(",") if m.strip())
    bad = sorted(m for m in names if not protocol.is_name(m))
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(bad) or 'none given'}: names match {protocol.NAME_PATTERN}")
    return names


def _size(text: str) -> int:
    """``128MiB`` -> 134217728, ``500MB`` -> 500000000, ``1048576`` -> bytes (`warmpool.sizes.parse_size`)."""
    try:
        n = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 128MiB, 1GiB, 500MB or plain bytes") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least 1 byte")
    return n


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 1")
    return int(text)


def _mib(n: int) -> str:
    return f"{n // 1024**2}MiB" if n % 1024**2 == 0 else str(n)


def run_gateway(argv: list[str], prog: str) -> int:
    from gateway import proxy

    d = proxy.GatewaySettings
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the reference gateway: an OpenAI-style reverse proxy in front of each model's ready slots "
        "(from pulse_slots) with a bounded FIFO queue per model, least-loaded routing, 429 when the queue is full, "
        "504 after --timeout-s; publishes pulse.queue.<model> samples every 100 ms and on change. Serves the models "
        "of --models, else those of the ScaledObjects in pulse_scalers and any with a ready slot (404 unknown_model "
        "for others); a slot is routed only if its node's assignment (pulse_assignments) lists its model. /healthz "
        "and /metrics on the same port unless --metrics-listen.",
    )
    connect.add_nats_arguments(p)
    p.add_argument("--listen", type=_listen, default=(d.host, d.port), metavar="HOST:PORT", help=f"[{d.host}:{d.port}]")
    p.add_argument(
        "--metrics-listen",
        type=_listen,
        metavar="HOST:PORT",
        help="serve /healthz and /metrics here, and not on --listen [on --listen]",
    )
    p.add_argument(
        "--queue-limit",
        type=int,
        default=d.queue_limit,
        metavar="N",
        help=f"waiting requests per model [{d.queue_limit}]",
    )
    p.add_argument(
        "--timeout-s",
        type=durations.duration_arg(),
        default=d.timeout_s,
        metavar="DURATION",
        help=f"longest wait for a slot (30s, 500ms, plain seconds) [{d.timeout_s}]",
    )
    p.add_argument(
        "--upstream-timeout-s",
        type=durations.duration_arg(),
        default=d.upstream_timeout_s,
        metavar="DURATION",
        help=f"longest an upstream may take to answer [{d.upstream_timeout_s}]",
    )
    p.add_argument(
        "--endpoint-concurrency",
        type=int,
        default=d.endpoint_concurrency,
        metavar="N",
        help=f"requests one ready slot gets at once [{d.endpoint_concurrency}]",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=d.max_attempts,
        metavar="N",
        help=f"upstreams tried when they break before answering [{d.max_attempts}]",
    )
    p.add_argument(
        "--models",
        type=_models,
        metavar="M1,M2",
        help="serve only these models [those of the ScaledObjects in pulse_scalers, and any with a ready slot]",
    )
    p.add_argument(
        "--require-assignment",
        action="store_true",
        help="route a node's ready slots only of the models `pulsescale assign` gave that node (KV "
        "pulse_assignments); without it a node with no assignment is routed to whatever its agent advertises. The "
        "secure deployment sets it, as on the autoscaler [off: a node with an assignment is held to it either way]",
    )
    p.add_argument(
        "--body-budget",
        type=_size,
        default=d.body_budget_bytes,
        metavar="SIZE",
        help="request bodies held by requests being read or waiting, all models together, in bytes (128MiB, 1GiB, "
        f"500MB or plain bytes); past it a request is refused 503 body_budget_full [{_mib(d.body_budget_bytes)}]",
    )
    p.add_argument(
        "--max-connections",
        type=_positive,
        default=d.max_connections,
        metavar="N",
        help=f"open client connections per listener; past it a new one gets 503 and is closed [{d.max_connections}]",
    )
    p.add_argument(
        "--header-timeout-s",
        type=durations.duration_arg(),
        default=d.header_timeout_s,
        metavar="DURATION",
        help=f"a new connection's request head must arrive within this, or 408 and closed [{d.header_timeout_s:g}s]",
    )
    p.add_argument(
        "--body-timeout-s",
        type=durations.duration_arg(),
        default=d.body_timeout_s,
        metavar="DURATION",
        help=f"a request body must arrive within this of its head, or 408 [{d.body_timeout_s:g}s]",
    )
    p.add_argument(
        "--keepalive-timeout-s",
        type=durations.duration_arg(),
        default=d.keepalive_timeout_s,
        metavar="DURATION",
        help=f"an idle kept-alive connection is closed this long after its last answer [{d.keepalive_timeout_s:g}s]",
    )
    p.add_argument("--gateway-id", help="name in the queue samples [gw-<host>-<pid>-<random>]")
    p.add_argument(
        "--no-samples",
        action="store_true",
        help="publish no queue samples: another publisher (pulsescale bridge, reading the engines) gives the "
        "autoscaler these models' demand, which would otherwise count twice [off: publish]",
    )
    daemonstart.add_log_level_argument(p)
    args = p.parse_args(argv)
    if args.gateway_id is not None and not 0 < len(args.gateway_id) <= 128:
        p.error("--gateway-id: 1 to 128 characters")
    settings = d(
        nats=connect.options_from_args(args, name="pulsescale-gateway"),
        host=args.listen[0],
        port=args.listen[1],
        **(
            {"metrics_host": args.metrics_listen[0], "metrics_port": args.metrics_listen[1]}
            if args.metrics_listen
            else {}
        ),
        body_budget_bytes=args.body_budget,
        max_connections=args.max_connections,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        keepalive_timeout_s=args.keepalive_timeout_s,
        queue_limit=args.queue_limit,
        timeout_s=args.timeout_s,
        upstream_timeout_s=args.upstream_timeout_s,
        endpoint_concurrency=args.endpoint_concurrency,
        max_attempts=args.max_attempts,
        models=args.models,
        require_assignment=args.require_assignment,
        **({"gateway_id": args.gateway_id} if args.gateway_id else {}),
        publish_samples=not args.no_samples,
    )
    try:
        settings.check()
    except ValueError as err:
        p.error(str(err))
    daemonstart.configure_logging(args)

    def run(nats: connect.NatsOptions, stop: asyncio.Event, ready: asyncio.Event) -> Awaitable[None]:
        return proxy.run(replace(settings, nats=nats), stop=stop, ready=ready)

    daemonstart.run_until_signalled(settings.nats, run)
    return 0


def run_load_cli(argv: list[str], prog: str) -> int:
    from gateway import loadgen

    return loadgen.main(argv, prog)
