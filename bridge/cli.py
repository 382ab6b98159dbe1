"""`pulsescale bridge`: the daemon that turns engines' metrics (or PromQL queries) into the contract's queue samples.

A NATS failure at start-up (unreachable, credentials or a permission refused), a port taken and a config file
that cannot be read leave as a `PulsescaleError`; the dispatcher prints it as one line and exits with its code.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace

from bridge.settings import BridgeSettings, Query, Target
from warmpool import connect, daemonstart, durations, protocol

__all__ = ["run_bridge"]

_DESCRIPTION = """\
Publish demand samples (pulse.queue.<model>) from metrics, for a gateway that does not publish on NATS.

Engine pages: every --scrape-every, each --target (and, with --slots, each ready slot of pulse_slots) is read as
vLLM's /metrics: per model, vllm:num_requests_waiting is the queue depth, vllm:num_requests_running the requests in
flight, and vllm:request_success_total gives the arrival and completion counters. Queries: every --query-every, each
--query is an instant query to --prometheus (/api/v1/query, as KEDA's prometheus scaler asks); its one value is the
model's demand (published as in flight). ScaledObjects (--scaledobjects): a trigger whose metadata.source is
vllm-metrics (its metricsURL pages, else the model's ready slots) or prometheus (its query to its serverAddress) is
read the same way, followed in pulse_scalers: added, changed and dropped as the ScaledObjects are. The flags (and
--config) win: a model that --query, a bound --target (MODEL=URL) or --slots reads, or that --models leaves out, is
not read for its ScaledObject; the log says so, and /healthz shows it.

A model whose sources fail, or read nothing good for --stale-after (--query-stale-after for a query), is not
published until they read well again, so the autoscaler's own staleness rule holds its replicas; a stale or
made-up figure is never sent. Bad input (unreachable, not Prometheus text, no series or several, NaN, a counter
reset) is counted per source and reason in pulsescale_bridge_errors_total. Needs only the gateway NATS role.
A ready slot is read only if its node's assignment (pulse_assignments) lists its model, or the node has none and
--require-assignment is off: the gateway's rule.
Serves /healthz and /metrics on --listen. Do not bridge a model that a gateway already publishes: the autoscaler
adds gateways' demands up."""

_EPILOG = """\
examples:
  pulsescale bridge --target http://10.0.0.5:8000 --model-name Qwen/Qwen2.5-0.5B-Instruct=qwen
  pulsescale bridge --target qwen=http://10.0.0.5:8000/metrics --target qwen=http://10.0.0.6:8000/metrics
  pulsescale bridge --slots --models qwen
  pulsescale bridge --scaledobjects          # what the ScaledObjects' triggers name (metadata.source)
  pulsescale bridge --prometheus http://prometheus:9090 \\
      --query 'qwen=sum(vllm:num_requests_waiting{model_name="qwen"})
        + sum(vllm:num_requests_running{model_name="qwen"})'
  pulsescale bridge --slots --require-assignment   # the secure deployment: as the gateway routes
  pulsescale bridge --config /etc/pulsescale/bridge.yaml   # targets, model_names, slots, scaledobjects,
                                                           # require_assignment, models, prometheus, queries
"""


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"{text!r}: give HOST:PORT, e.g. 127.0.0.1:9465")
    return host.strip("[]"), int(port)


def _typed(parse: type[Target] | type[Query]) -> Callable[[str], Target | Query]:
    def read(text: str) -> Target | Query:
        try:
            return parse.parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return read


def _model_name(text: str) -> tuple[str, str]:
    served, sep, model = text.rpartition("=")
    if not sep or not served or not protocol.is_name(model):
        raise argparse.ArgumentTypeError(f"{text!r}: give SERVED=MODEL, MODEL matching {protocol.NAME_PATTERN}")
    return served, model


def _models(text: str) -> frozenset[str]:
    names = frozenset(m.strip() for m in text.split(",") if m.strip())
    bad = sorted(m for m in names if not protocol.is_name(m))
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(bad) or 'none given'}: names match {protocol.NAME_PATTERN}")
    return names


def _parser(prog: str) -> argparse.ArgumentParser:
    d = BridgeSettings
    p = argparse.ArgumentParser(
        prog=prog, description=_DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    every = durations.duration_arg()
    src = p.add_argument_group("sources")
    src.add_argument(
        "--target",
        action="append",
        type=_typed(Target),
        default=[],
        metavar="[MODEL=]URL",
        help="an engine's Prometheus page (no path: /metrics); with MODEL= every series counts for "
        "MODEL, else for its model_name label; repeatable",
    )
    src.add_argument(
        "--model-name",
        action="append",
        type=_model_name,
        default=[],
        metavar="SERVED=MODEL",
        help="read model_name SERVED as the pulsescale model MODEL; repeatable",
    )
    src.add_argument(
        "--slots",
        action="store_true",
        default=None,
        help="also read each ready slot's engine page (from pulse_slots), for the slot's model",
    )
    src.add_argument(
        "--slot-metrics-path",
        default=d.slot_metrics_path,
        metavar="PATH",
        help=f"the page's path on a slot's endpoint [{d.slot_metrics_path}]",
    )
    src.add_argument(
        "--scaledobjects",
        action="store_true",
        default=None,
        help="also read what the ScaledObjects' triggers name (pulse_scalers, metadata.source vllm-metrics or "
        "prometheus), as they change; the flags win for a model they read",
    )
    src.add_argument(
        "--require-assignment",
        action="store_true",
        default=None,
        help="with --slots or --scaledobjects, read a node's ready slots only of the models `pulsescale assign` gave "
        "that node (KV pulse_assignments); without it a node with no assignment is read for whatever its agent "
        "advertises. The secure deployment sets it, as on the gateway and the autoscaler [off: a node with an "
        "assignment is held to it either way]",
    )
    src.add_argument("--models", type=_models, metavar="M1,M2", help="publish only these models [all reported]")
    src.add_argument("--prometheus", metavar="URL", help="the Prometheus server --query asks")
    src.add_argument(
        "--query",
        action="append",
        type=_typed(Query),
        default=[],
        metavar="MODEL=PROMQL",
        help="an instant query whose one value is MODEL's demand; repeatable, one per model",
    )
    src.add_argument(
        "--config",
        metavar="FILE",
        help="YAML with targets, model_names, slots, scaledobjects, require_assignment, models, prometheus, queries "
        "(flags add to it)",
    )
    t = p.add_argument_group("timing (durations: 250ms, 1s, 1m or plain seconds)")
    t.add_argument(
        "--scrape-every",
        type=every,
        default=d.scrape_every_s,
        metavar="DURATION",
        help=f"read each engine page this often [{durations.format_duration(d.scrape_every_s)}]",
    )
    t.add_argument(
        "--stale-after",
        type=every,
        default=d.stale_after_s,
        metavar="DURATION",
        help="stop a model's samples when an engine page of it has read nothing good for this long "
        f"[{durations.format_duration(d.stale_after_s)}]",
    )
    t.add_argument(
        "--query-every",
        type=every,
        default=d.query_every_s,
        metavar="DURATION",
        help=f"ask each query this often [{durations.format_duration(d.query_every_s)}]",
    )
    t.add_argument(
        "--query-stale-after",
        type=every,
        default=d.query_stale_after_s,
        metavar="DURATION",
        help="stop a model's samples when its query has answered nothing good for this long "
        f"[{durations.format_duration(d.query_stale_after_s)}]",
    )
    t.add_argument(
        "--timeout",
        type=every,
        default=d.timeout_s,
        metavar="DURATION",
        help=f"the longest one read may take [{durations.format_duration(d.timeout_s)}]",
    )
    p.add_argument(
        "--listen",
        type=_listen,
        default=(d.host, d.port),
        metavar="HOST:PORT",
        help=f"serve /healthz and /metrics here [{d.host}:{d.port}]",
    )
    p.add_argument("--gateway-id", help="the gateway name in its samples [bridge-<host>-<pid>-<random>]")
    connect.add_nats_arguments(p)
    daemonstart.add_log_level_argument(p)
    return durations.dashed_values(p)


def settings_from_args(args: argparse.Namespace, p: argparse.ArgumentParser) -> BridgeSettings:
    """The settings the flags and the config file give (flags add to the file's lists and win over the rest)."""
    from bridge import config  # yaml, only when asked for

    f = config.load(args.config) if args.config else config.ConfigFile()
    if args.gateway_id is not None and not 0 < len(args.gateway_id) <= 128:
        p.error("--gateway-id: 1 to 128 characters")
    models = args.models if args.models is not None else f.models
    settings = BridgeSettings(
        nats=connect.options_from_args(args, name="pulsescale-bridge"),
        host=args.listen[0],
        port=args.listen[1],
        targets=(*f.targets, *args.target),
        model_names=(*f.model_names, *args.model_name),
        slots=bool(args.slots if args.slots is not None else f.slots),
        scaledobjects=bool(args.scaledobjects if args.scaledobjects is not None else f.scaledobjects),
        require_assignment=bool(
            args.require_assignment if args.require_assignment is not None else f.require_assignment
        ),
        slot_metrics_path=args.slot_metrics_path,
        models=models,
        prometheus_url=args.prometheus or f.prometheus_url,
        queries=(*f.queries, *args.query),
        scrape_every_s=args.scrape_every,
        stale_after_s=args.stale_after,
        query_every_s=args.query_every,
        query_stale_after_s=args.query_stale_after,
        timeout_s=args.timeout,
        **({"gateway_id": args.gateway_id} if args.gateway_id else {}),
    )
    try:
        settings.check()
    except ValueError as err:
        p.error(str(err))
    return settings


def run_bridge(argv: list[str], prog: str) -> int:
    p = _parser(prog)
    args = p.parse_args(argv)
    settings = settings_from_args(args, p)
    daemonstart.configure_logging(args)
    from bridge import daemon  # NATS and aiohttp, only to run

    def run(nats: connect.NatsOptions, stop: asyncio.Event, ready: asyncio.Event) -> Awaitable[None]:
        return daemon.run(replace(settings, nats=nats), stop=stop, ready=ready)

    daemonstart.run_until_signalled(settings.nats, run)
    return 0
