"""`pulsescale operator`: the Kubernetes operator daemon (kopf) for ScaledObject CRs, standby pods and the cold path.

Start-up checks, each a named error that says what to do (the dispatcher prints it as one line and exits 1):

- Kubernetes credentials: ``--kubeconfig`` (or ``$KUBECONFIG``, or ``~/.kube/config``), else the pod's service
  account (in a cluster); neither is `KubeConfigMissing`. An API server that does not answer is `KubeUnreachable`.
- the CRD: API discovery must list ``scaledobjects`` in ``pulsescale.io/v1alpha1`` (discovery needs no RBAC on
  CRDs), else `CrdMissing` with the fix ``kubectl apply -k deploy/crd``.
- NATS: the same flags and environment as the other daemons (`warmpool.connect`); unreachable, credentials or a
  permission refused is `NatsUnavailable` (from `connect`). The buckets must exist (the autoscaler creates them).

Scope: every namespace (``-A``, the default: deploy/base's ClusterRole), or only those named by ``--namespace NS``
(repeated; exact names), for deploy/overlays/namespaced, which grants a Role in each of them and nothing
cluster-wide. Either way the Lease and the ConfigMap of model owners (kube/records.py) live in the operator's own
namespace (``--lease-namespace``).

Then one replica of possibly several: a candidate for the Lease (kube/leader.py), and while it leads, the operator
(kube/operator.py `run_operator`). SIGTERM/SIGINT: the operator stops, the Lease is released, exit 0.

``--health-port`` serves ``/healthz`` (200 while the process runs its loop with NATS connected and no background
loop of the operator has died: `OperatorContext.died`) and ``/readyz``
(200 while NATS is connected and the last Lease round reached the API server: a standby replica is ready to take
over), and ``/metrics`` (Prometheus text, `kube.metrics`); all on 127.0.0.1 unless ``--health-host`` says otherwise
(in a pod: its IP from the downward API).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from aiohttp import web
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from nats.aio.client import Client
from nats.js.kv import KeyValue
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kube import apicall, leader
from kube.context import DEFAULT_HOME_NAMESPACE, DEFAULT_STATUS_EVERY_S, OperatorContext, open_buckets
from kube.metrics import OperatorMetrics
from manifests.crdtypes import GROUP, PLURAL, VERSION
from warmpool import connect, daemonstart, protocol
from warmpool.errors import PulsescaleError

__all__ = ["CrdMissing", "KubeConfigMissing", "KubeUnreachable", "OperatorSettings", "run_operator", "serve"]

log = logging.getLogger("pulsescale.operator")

DEFAULT_LEASE_NAMESPACE: Final = DEFAULT_HOME_NAMESPACE
SERVICE_ACCOUNT_NAMESPACE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DISCOVERY_TIMEOUT_S: Final = 10.0
NAMESPACE_NAME: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # RFC 1123 label, as the API server checks


class KubeConfigMissing(PulsescaleError):
    code = "kubeconfig_missing"


class KubeUnreachable(PulsescaleError):
    code = "kube_unreachable"


class CrdMissing(PulsescaleError):
    code = "crd_missing"


@dataclass(frozen=True)
class OperatorSettings:
    nats: connect.NatsOptions
    kubeconfig: str | None = None
    """A kubeconfig file; None: $KUBECONFIG or ~/.kube/config if there, else the in-cluster service account."""
    context: str | None = None
    namespaces: tuple[str, ...] = ()
    """The namespaces watched; empty: all of them."""
    lease: leader.LeaseSettings | None = None
    status_every_s: float = DEFAULT_STATUS_EVERY_S
    health_host: str = "127.0.0.1"
    """Loopback by default, as the other daemons' HTTP ports: in a pod, pass its IP (downward API)."""
    health_port: int | None = None
    assignments: bool = True
    """Keep KV pulse_assignments from the standby pods' nodes (kube/assignments.py); False: ``--no-assignments``."""


async def open_assignments(nc: Client) -> KeyValue | None:
    """KV pulse_assignments, or None (said once) when it cannot be opened: the operator runs on without writing it."""
    try:
        return await nc.jetstream(timeout=5.0).key_value(protocol.ASSIGNMENTS_BUCKET)
    except Exception as err:  # noqa: BLE001 - any failure to open it only turns the assignments off, said here
        log.warning(
            "cannot open KV bucket %s (%s): nodes are not assigned from the standby pods; an autoscaler of contract "
            "revision 11 or later creates it, and the operator's NATS user needs its grants (`pulsescale nats "
            "--print-authorization`); `--no-assignments` silences this", protocol.ASSIGNMENTS_BUCKET,
            str(err) or type(err).__name__,
        )  # fmt: skip
        return None


def load_api_client(kubeconfig: str | None, context: str | None = None) -> k8s.ApiClient:
    """The `kubernetes` client from a kubeconfig, else in-cluster; `KubeConfigMissing` when neither exists."""
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    if path is None:
        default = Path.home() / ".kube" / "config"
        path = str(default) if default.exists() else None
    if path is not None:
        if not Path(path.split(os.pathsep)[0]).exists():
            raise KubeConfigMissing(f"kubeconfig {path} does not exist: pass --kubeconfig FILE")
        try:
            client: k8s.ApiClient = k8s_config.new_client_from_config(  # type: ignore[no-untyped-call]
                config_file=path, context=context
            )
            return client
        except k8s_config.ConfigException as err:
            raise KubeConfigMissing(f"kubeconfig {path} is not usable: {err}") from None
    if not os.environ.get("KUBERNETES_SERVICE_HOST"):
        raise KubeConfigMissing(
            "no Kubernetes credentials: pass --kubeconfig FILE (or set $KUBECONFIG), or run the operator in a pod "
            "with a service account (deploy/ does)"
        )
    cfg = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except k8s_config.ConfigException as err:
        raise KubeConfigMissing(f"in a cluster, but its service account is not usable: {err}") from None
    return k8s.ApiClient(cfg)


async def check_crd(api: k8s.ApiClient) -> None:
    """API discovery must list the ScaledObject resource; else `CrdMissing` (or `KubeUnreachable`)."""
    host = api.configuration.host
    try:
        listing = await apicall.call(
            k8s.CustomObjectsApi(api).get_api_resources, GROUP, VERSION, _request_timeout=DISCOVERY_TIMEOUT_S
        )
    except apicall.ApiException as err:
        if err.status == 404:
            listing = {}
        else:
            raise KubeUnreachable(f"the Kubernetes API at {host} answered {err.status} {err.reason} to discovery "
                                  "of pulsescale.io/v1alpha1: check the operator's credentials") from None  # fmt: skip
    except (apicall.ApiUnreachable, OSError) as err:
        raise KubeUnreachable(f"cannot reach the Kubernetes API at {host}: {_first_line(err)}") from None
    names = {r.get("name") for r in listing.get("resources") or []}
    if PLURAL not in names:
        raise CrdMissing(
            f"the ScaledObject CRD is not installed on {host} (API discovery has no {PLURAL}.{GROUP}/{VERSION}): "
            "install it: kubectl apply -k deploy/crd"
        )


def _first_line(err: BaseException) -> str:
    text = str(err)
    return text.splitlines()[0] if text else type(err).__name__


async def _health(
    settings: OperatorSettings, nc: Client, elector: leader.LeaseElector, ctx: OperatorContext
) -> web.AppRunner | None:
    if settings.health_port is None:
        return None

    def state() -> dict[str, Any]:
        return {"nats": nc.is_connected, "leading": elector.leading(), "holder": elector.holder,
                "identity": elector.settings.identity, "died": list(ctx.died),
                "failures": dict(ctx.failures)}  # fmt: skip

    async def healthz(_: web.Request) -> web.Response:
        # A background loop that died (kube/operator.py) leaves the replica doing nothing while it looks fine.
        return web.json_response(state(), status=200 if nc.is_connected and not ctx.died else 503)

    async def readyz(_: web.Request) -> web.Response:
        ok = nc.is_connected and elector.reached and not ctx.died
        return web.json_response(state(), status=200 if ok else 503)

    metrics = OperatorMetrics()
    metrics.bind(nats_connected=lambda: nc.is_connected, leading=elector.leading, failures=lambda: ctx.failures,
                 died=lambda: ctx.died, mirror_swept=lambda: ctx.mirror_swept)  # fmt: skip

    async def prometheus(_: web.Request) -> web.Response:
        # On the loop: a few dozen series, read from the state the loop keeps (no other thread touches it).
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz), web.get("/readyz", readyz), web.get("/metrics", prometheus)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, settings.health_host, settings.health_port).start()
    except OSError as err:
        await runner.cleanup()
        raise PulsescaleError(
            f"cannot serve /healthz on {settings.health_host}:{settings.health_port}: {err.strerror or err}; pick "
            "another --health-port"
        ) from None
    return runner


async def serve(settings: OperatorSettings, *, stop: asyncio.Event, ready: asyncio.Event) -> None:
    """The daemon: checks, then lead-or-stand-by until `stop`. `ready` is set once it runs its loop."""
    api = load_api_client(settings.kubeconfig, settings.context)
    try:
        await check_crd(api)
        nc = await connect.connect(settings.nats)
        try:
            buckets = await open_buckets(nc)
            assignments = await open_assignments(nc) if settings.assignments else None
            lease = settings.lease or leader.LeaseSettings(namespace=_own_namespace())
            elector = leader.LeaseElector(k8s.CoordinationV1Api(api), lease)
            ctx = OperatorContext(
                nc=nc, scalers=buckets["pulse_scalers"], slots=buckets["pulse_slots"], api=api, assignments=assignments,
                namespaces=settings.namespaces, home_namespace=lease.namespace, identity=lease.identity,
                status_every_s=settings.status_every_s,
            )  # fmt: skip
            ctx.extra["leading"] = elector.leading
            health = await _health(settings, nc, elector, ctx)
            from kube.kopfrun import run_operator as run_kopf  # kopf's import is heavy: after the checks

            async def act(stop_flag: asyncio.Event) -> None:
                await run_kopf(ctx, stop_flag=stop_flag)

            log.info("operator %s: candidate for Lease %s/%s; watching %s", lease.identity, lease.namespace,
                     lease.name, ", ".join(settings.namespaces) or "all namespaces")  # fmt: skip
            ready.set()
            try:
                await leader.run_elected(elector, act, stop=stop)
            finally:
                if health is not None:
                    await health.cleanup()
        finally:
            await nc.close()
    finally:
        api.close()  # type: ignore[no-untyped-call]


def _own_namespace() -> str:
    """The Lease's namespace by default: $POD_NAMESPACE, else the service account's, else pulsescale-system."""
    if ns := os.environ.get("POD_NAMESPACE"):
        return ns
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or DEFAULT_LEASE_NAMESPACE
    except OSError:
        return DEFAULT_LEASE_NAMESPACE


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def _namespace(text: str) -> str:
    """An exact namespace name. kopf also takes globs (``team-*``) and negations (``!kube-*``), but it resolves them
    by listing and watching Namespaces, which this operator does not (no cluster scanning, no cluster-scoped RBAC
    in the namespaced mode): with scanning off kopf would take ``team-*`` as a literal name and watch nothing."""
    if not NAMESPACE_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a namespace name (lowercase letters, digits and '-', at most 63): name each namespace "
            "exactly, repeating --namespace; globs and negations are not supported"
        )
    return text


def run_operator(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run the Kubernetes operator: ScaledObject CRs to pulse_scalers and back to their status, "
        "standby pods, the cold path. Run two for high availability: one leads (a Kubernetes Lease), the other "
        "stands by.",
    )
    p.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig [$KUBECONFIG, ~/.kube/config, or in-cluster]")
    p.add_argument("--context", help="kubeconfig context [its current-context]")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", metavar="NS", type=_namespace,
                       help="watch ScaledObjects in NS only (repeat for several; deploy/overlays/namespaced grants a "
                       "Role in each) [all namespaces]")  # fmt: skip
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    connect.add_nats_arguments(p)
    g = p.add_argument_group("leader election (a coordination.k8s.io/v1 Lease)")
    g.add_argument("--lease-name", default=leader.DEFAULT_LEASE_NAME, help=f"[{leader.DEFAULT_LEASE_NAME}]")
    g.add_argument("--lease-namespace", metavar="NS",
                   help=f"[$POD_NAMESPACE, the service account's, or {DEFAULT_LEASE_NAMESPACE}]")  # fmt: skip
    g.add_argument("--identity", help="this replica in the Lease [$POD_NAME or the host name]")
    g.add_argument("--lease-duration", type=_positive, default=leader.DEFAULT_LEASE_DURATION_S, metavar="SECONDS",
                   help="leaseDurationSeconds: a failover takes up to this long "
                   f"[{leader.DEFAULT_LEASE_DURATION_S:g}]")  # fmt: skip
    p.add_argument("--status-every", type=_positive, default=DEFAULT_STATUS_EVERY_S, metavar="SECONDS",
                   help="refresh ScaledObject status from the autoscaler this often "
                   f"[{DEFAULT_STATUS_EVERY_S:g}]")  # fmt: skip
    p.add_argument("--health-port", type=int, metavar="PORT",
                   help="serve /healthz, /readyz and /metrics on this port [off]")  # fmt: skip
    p.add_argument("--health-host", default=OperatorSettings.health_host, metavar="ADDRESS",
                   help="bind the health port to this address; in Kubernetes the pod IP from the downward API "
                   f"[{OperatorSettings.health_host}]")  # fmt: skip
    p.add_argument("--no-assignments", action="store_true",
                   help="do not write KV pulse_assignments from where the standby pods are scheduled (assign nodes "
                   "with `pulsescale assign`, or run the autoscaler and gateways without --require-assignment) "
                   "[written]")  # fmt: skip
    daemonstart.add_log_level_argument(p)
    args = p.parse_args(argv)
    try:
        lease = leader.LeaseSettings(
            namespace=args.lease_namespace or _own_namespace(),
            name=args.lease_name,
            identity=args.identity or leader.default_identity(),
            duration_s=args.lease_duration,
        )
    except ValueError as err:
        p.error(str(err))
    daemonstart.configure_logging(args)
    settings = OperatorSettings(
        nats=connect.options_from_args(args, name="pulsescale-operator"),
        kubeconfig=args.kubeconfig,
        context=args.context,
        namespaces=tuple(dict.fromkeys(args.namespace or ())),
        lease=lease,
        status_every_s=args.status_every,
        health_host=args.health_host,
        health_port=args.health_port,
        assignments=not args.no_assignments,
    )

    def run(nats: connect.NatsOptions, stop: asyncio.Event, ready: asyncio.Event) -> Awaitable[None]:
        return serve(replace(settings, nats=nats), stop=stop, ready=ready)

    daemonstart.run_until_signalled(settings.nats, run)
    return 0
