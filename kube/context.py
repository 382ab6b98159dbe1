"""What every part of the operator shares: the NATS handles, the Kubernetes client and the settings.

One `OperatorContext` is built by `pulsescale operator` (kube/cli.py) and handed to `kube.kopfrun.build_registry`,
which passes it to each part's ``register(registry, ctx)`` (the ScaledObject handlers here, kube/standby.py,
kube/coldpath.py). Handlers close over it instead of reaching for globals, so two operators (the leader test) live
in one process.

The Kubernetes client is the official synchronous `kubernetes` client; async code calls it through
`OperatorContext.call` (a worker thread), never on the event loop. kopf itself talks to the API server with its
own aiohttp client, logged in with the same credentials (`kopf_connection`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import kopf
from kubernetes import client as k8s
from nats.aio.client import Client
from nats.js.kv import KeyValue

from warmpool import protocol
from warmpool.errors import PulsescaleError

__all__ = [
    "DEFAULT_DELETE_WAIT_S",
    "DEFAULT_HOME_NAMESPACE",
    "DEFAULT_MIRROR_SWEEP_EVERY_S",
    "DEFAULT_STATUS_EVERY_S",
    "DEFAULT_STATUS_TIMEOUT_S",
    "FIELD_MANAGER",
    "OperatorContext",
    "kopf_connection",
    "open_buckets",
]

DEFAULT_STATUS_EVERY_S: Final = 5.0  # how often the status subresource is refreshed from the autoscaler's `status`
DEFAULT_STATUS_TIMEOUT_S: Final = 3.0  # how long one `status` request may take before this round is skipped
DEFAULT_DELETE_WAIT_S: Final = 60.0  # how long a deleted ScaledObject waits for its model's slots to be released
DEFAULT_HOME_NAMESPACE: Final = "pulsescale-system"  # the operator's own namespace when nothing says which
DEFAULT_MIRROR_SWEEP_EVERY_S: Final = 60.0
"""How often the leader sweeps `pulse_objects` of records whose ScaledObject is gone (kube/records.py `MirrorSweep`;
the first sweep is at once when it starts leading). Cheap: a headers-only scan of its namespaces' keys, and a LIST of
the ScaledObjects only when a key there was not written by this replica; it bounds how long a record outlives its CR
when the delete could not reach the bucket (NATS out of reach as the finalizer ran)."""
FIELD_MANAGER: Final = "pulsescale-operator"  # the field manager and the Events' reporting component

T = TypeVar("T")


@dataclass
class OperatorContext:
    """Everything the handlers need. `namespaces` empty: every namespace (kopf's ``clusterwide``)."""

    nc: Client
    scalers: KeyValue  # pulse_scalers: read and written (the operator is its writer on Kubernetes)
    slots: KeyValue  # pulse_slots: read only (the finalizer waits for releases; standby pods follow slots)
    api: k8s.ApiClient
    assignments: KeyValue | None = None
    """pulse_assignments, written from the standby pods' nodes (kube/assignments.py); None: not written
    (``pulsescale operator --no-assignments``, or a bucket that could not be opened)."""
    assignments_settle_s: float = 20.0
    """How long after it starts leading the operator takes no model off a node (`kube.assignments.SETTLE_S`)."""
    namespaces: tuple[str, ...] = ()
    home_namespace: str = DEFAULT_HOME_NAMESPACE
    """The operator's own namespace (its Lease's): where the ConfigMap of model owners lives (kube/records.py),
    out of the tenants' reach. Need not be one of `namespaces`."""
    identity: str = "pulsescale-operator"  # this replica (the Lease holder; the Events' reportingInstance)
    status_every_s: float = DEFAULT_STATUS_EVERY_S
    status_timeout_s: float = DEFAULT_STATUS_TIMEOUT_S
    delete_wait_s: float = DEFAULT_DELETE_WAIT_S
    mirror_sweep_every_s: float = DEFAULT_MIRROR_SWEEP_EVERY_S
    max_replicas: int | None = None  # None: the validator's default (or $PULSESCALE_MAX_REPLICAS)
    clock: Callable[[], float] = time.time
    extra: dict[str, Any] = field(default_factory=dict)  # per-part state (kube.standby, kube.coldpath) by name
    failures: dict[str, int] = field(default_factory=dict)
    """Unexpected errors survived, per place (e.g. ``standby``): a bug met on one object is logged and counted, and
    the loop goes on with the others (`count_failure`)."""
    mirror_swept: int = 0
    """Records deleted from `pulse_objects` by the sweep (their ScaledObject gone), for
    ``pulsescale_operator_mirror_swept_total`` (kube/metrics.py)."""
    died: list[str] = field(default_factory=list)
    """Background work (`kube.operator.BACKGROUND`) that ended with an error before the stop flag: ``/healthz``
    answers 503 while this is not empty, so the kubelet restarts the replica instead of it idling as if fine."""

    def count_failure(self, where: str, what: str) -> None:
        """Logs the exception being handled (with its traceback) and counts it under `where`."""
        self.failures[where] = self.failures.get(where, 0) + 1
        logging.getLogger("pulsescale.operator").exception("%s: unexpected error on %s; going on", where, what)

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    def watches(self, namespace: str | None) -> bool:
        """Whether an object in `namespace` is in this operator's scope."""
        return self.clusterwide or namespace in self.namespaces

    async def call(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Runs a blocking `kubernetes` client call on a worker thread."""
        return await asyncio.to_thread(functools.partial(fn, *args, **kwargs))

    @property
    def core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.api)

    @property
    def apps(self) -> k8s.AppsV1Api:
        return k8s.AppsV1Api(self.api)

    @property
    def custom(self) -> k8s.CustomObjectsApi:
        return k8s.CustomObjectsApi(self.api)


async def open_buckets(
    nc: Client, names: Sequence[str] = (protocol.SCALERS_BUCKET, protocol.SLOTS_BUCKET)
) -> dict[str, KeyValue]:
    """Opens the operator's buckets; they must exist (the autoscaler creates them: the operator's NATS user may
    not). A missing one is a named error with the fix."""
    js = nc.jetstream(timeout=5.0)
    out: dict[str, KeyValue] = {}
    for name in names:
        try:
            out[name] = await js.key_value(name)
        except Exception as err:
            raise PulsescaleError(
                f"cannot open KV bucket {name}: {err!r}; start the autoscaler first (it creates the buckets), and "
                "check the operator's NATS user (pulsescale nats --secure writes one)"
            ) from err
    return out


def kopf_connection(api: k8s.ApiClient) -> kopf.ConnectionInfo:
    """kopf's login from the `kubernetes` client's configuration (kubeconfig or in-cluster), so both clients
    talk to the same server as the same user. kopf calls it again on a 401, so a rotated token is picked up."""
    cfg: k8s.Configuration = api.configuration
    if cfg.refresh_api_key_hook is not None:
        cfg.refresh_api_key_hook(cfg)  # in-cluster: re-read the projected token, which the kubelet rotates
    auth = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken") or ""
    prefix = (cfg.api_key_prefix or {}).get("authorization", "")
    scheme, token = None, None
    if auth:
        if " " in auth:
            scheme, token = auth.split(" ", 1)
        else:
            scheme, token = prefix or "Bearer", auth
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert or None,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file or None,
        private_key_path=cfg.key_file or None,
        default_namespace=None,
    )
