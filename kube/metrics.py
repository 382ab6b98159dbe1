"""The operator's Prometheus metrics, served on ``/metrics`` of its health port (kube/cli.py ``--health-port``).

As the other daemons' registries: the process, platform and GC collectors and ``pulsescale_build_info{version,
component}``. The operator's own series are read at scrape time from what the replica already keeps (`bind`): whether
it holds the Lease, its NATS connection, the unexpected errors it survived (`OperatorContext.failures`), the
background loops that died (`OperatorContext.died`) and the records of gone ScaledObjects swept from `pulse_objects`
(`OperatorContext.mirror_swept`). deploy/monitoring's alerts and dashboard read these names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import (
    CollectorRegistry,
    Gauge,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from warmpool.build import register_process

__all__ = ["OperatorMetrics"]


class _Failures(Collector):
    """``pulsescale_operator_failures_total{where}``, from the context's per-place counts (kept by the operator)."""

    NAME = "pulsescale_operator_failures"

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, int]] = dict

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            self.NAME,
            "Unexpected errors the operator survived, by where (a bug met on one object: logged with its traceback, "
            "the loop goes on with the others)",
            labels=["where"],
        )
        for where, n in sorted(dict(self.source()).items()):
            family.add_metric([where], n)
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.NAME, "", labels=["where"])


class _Swept(Collector):
    """``pulsescale_operator_mirror_swept_total``, from the context's count (kube/records.py `MirrorSweep`)."""

    NAME = "pulsescale_operator_mirror_swept"
    HELP = (
        "Records deleted from the pulse_objects bucket because their ScaledObject no longer exists (deleted while no "
        "operator led, or its delete did not reach the bucket)"
    )

    def __init__(self) -> None:
        self.source: Callable[[], int] = lambda: 0

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.NAME, self.HELP, value=self.source())

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.NAME, self.HELP)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        register_process(r, "operator")
        self.nats_connected = Gauge("pulsescale_nats_connected", "1 while the connection to NATS is up", registry=r)
        self.leading = Gauge(
            "pulsescale_operator_leading",
            "1 while this replica holds the operator's Lease and acts (ScaledObjects, standby pods, the cold path)",
            registry=r,
        )
        self.background_died = Gauge(
            "pulsescale_operator_background_died",
            "Background loops of the operator that ended with an error (/healthz answers 503 while not 0)",
            registry=r,
        )
        self.failures = _Failures()
        r.register(self.failures)
        self.mirror_swept = _Swept()
        r.register(self.mirror_swept)

    def bind(
        self,
        *,
        nats_connected: Callable[[], bool],
        leading: Callable[[], bool],
        failures: Callable[[], Mapping[str, int]],
        died: Callable[[], Sequence[str]],
        mirror_swept: Callable[[], int] = lambda: 0,
    ) -> None:
        """Read the series from the live replica at each scrape."""
        self.nats_connected.set_function(lambda: 1.0 if nats_connected() else 0.0)
        self.leading.set_function(lambda: 1.0 if leading() else 0.0)
        self.background_died.set_function(lambda: float(len(died())))
        self.failures.source = failures
        self.mirror_swept.source = mirror_swept
