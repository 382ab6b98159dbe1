"""The bridge's settings (`pulsescale bridge`'s flags and config file), each with its unit and why its default is
what it is; and the sources they name: engine pages to scrape (`Target`) and PromQL queries (`Query`)."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

from warmpool import connect, protocol

__all__ = ["DEFAULT_PORT", "BridgeSettings", "Query", "Target", "default_bridge_id", "http_url", "metrics_page"]

DEFAULT_PORT: Final = 9465
"""Beside the node agent's 9464 (both are Prometheus exporters on a node)."""
MiB: Final = 1024 * 1024


def default_bridge_id() -> str:
    """``bridge-<host>-<pid>-<random>``: unique per run, as a gateway's id is, so the autoscaler tells runs apart
    (a new run's samples start a new baseline)."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:60]
    return f"bridge-{host}-{os.getpid()}-{secrets.token_hex(3)}"


def http_url(url: str, *, what: str) -> str:
    """`url` if it is ``http(s)://host[:port][/path]`` without credentials or a fragment; else a ValueError that
    says which `what` and why. The contract's rule (`protocol.http_url_problem`), which a ScaledObject's
    ``serverAddress`` and ``metricsURL`` keep too."""
    problem = protocol.http_url_problem(url)
    if problem is not None:
        raise ValueError(f"{what} {url!r}: {problem}")
    return url


def metrics_page(url: str) -> str:
    """An engine's page: `url`, or ``<url>/metrics`` when it has no path (vLLM serves its metrics there)."""
    return url.rstrip("/") + "/metrics" if urlsplit(url).path in ("", "/") else url


@dataclass(frozen=True)
class Target:
    """An engine's Prometheus page to scrape (vLLM's ``/metrics``)."""

    url: str
    """The page itself; a URL with no path gets ``/metrics``."""
    model: str | None = None
    """Every series of the page counts for this model (an engine serves one); None: each series counts for its
    ``model_name`` label (renamed by `BridgeSettings.model_names`)."""

    @staticmethod
    def parse(text: str) -> Target:
        """``[MODEL=]URL``."""
        model, sep, url = text.partition("=")
        if not sep or "://" in model:
            model, url = "", text
        url = metrics_page(http_url(url.strip(), what="target"))
        if model and not protocol.is_name(model.strip()):
            raise ValueError(f"target {text!r}: model {model.strip()!r} does not match {protocol.NAME_PATTERN}")
        return Target(url, model.strip() or None)


@dataclass(frozen=True)
class Query:
    """A PromQL instant query whose one value is `model`'s demand."""

    model: str
    promql: str

    @staticmethod
    def parse(text: str) -> Query:
        """``MODEL=PROMQL``."""
        model, sep, promql = text.partition("=")
        model, promql = model.strip(), promql.strip()
        if not sep or not protocol.is_name(model) or not promql:
            raise ValueError(f"query {text!r}: give MODEL=PROMQL, MODEL matching {protocol.NAME_PATTERN}")
        return Query(model, promql)


@dataclass(frozen=True)
class BridgeSettings:
    nats: connect.NatsOptions = field(default_factory=connect.NatsOptions)
    gateway_id: str = field(default_factory=default_bridge_id)
    """The `gateway` of its samples: the bridge is one gateway to the autoscaler."""
    host: str = "127.0.0.1"
    """Where ``/healthz`` and ``/metrics`` listen: loopback unless told otherwise (README, Security)."""
    port: int = DEFAULT_PORT
    """Their port; 0 picks a free one (`Bridge.port` says which)."""
    targets: tuple[Target, ...] = ()
    model_names: tuple[tuple[str, str], ...] = ()
    """(served name, model): an engine's ``model_name`` (``Qwen/Qwen2.5-0.5B``) is rarely a pulsescale name."""
    slots: bool = False
    """Also scrape each ready slot of `pulse_slots` (its endpoint + `slot_metrics_path`), for its model. Off unless
    asked: an engine that serves no Prometheus page (the built-in local engine) would keep its model stale."""
    slot_metrics_path: str = "/metrics"
    """vLLM serves its metrics on the API's port, at ``/metrics``."""
    require_assignment: bool = False
    """Read a node's ready slots (`slots`, `scaledobjects`) only of the models `pulse_assignments` lists for it
    (``pulsescale assign``): a node without an assignment is not read. Off: such a node is read, as before; a node
    with an assignment is held to it either way (the gateway's rule, `gateway.routes`). The secure deployment sets
    it, as on the gateway and the autoscaler: else an agent on an unassigned node could write a ``ready`` record of
    any model pointing at a page it serves, and the bridge would publish that page's figures as the model's demand."""
    models: frozenset[str] | None = None
    """Publish only these models (what the sources report of others is ignored, and a ScaledObject of another is not
    read); None: every model they report."""
    scaledobjects: bool = False
    """Also read what the ScaledObjects' triggers name (contract revision 14, `pulse_scalers`): the engines' pages
    for ``source: vllm-metrics``, the query for ``source: prometheus``, added and dropped as the records change.
    Off unless asked: a bridge run for its flags alone must not start reading what someone else's ScaledObject
    names. The flags (and --config) win for a model they name (`flagged`)."""
    prometheus_url: str | None = None
    """The Prometheus server the `queries` go to (``http://prometheus:9090``)."""
    queries: tuple[Query, ...] = ()
    scrape_every_s: float = 0.25
    """Engine pages are read this often. A pulse shows within one period (the contract asks samples every 100 ms,
    the autoscaler decides on each); a vLLM page renders in milliseconds, and only three of its families are
    parsed, so four reads a second per engine cost little."""
    stale_after_s: float = 1.0
    """An engine page not read well for this long stops its models' samples. Four periods: one or two slow or lost
    scrapes are ridden over; and with the autoscaler's own 1 s (``staleAfterSeconds``) a dead engine is off the
    demand within about 2 s, instead of its last figure standing in for a live one."""
    query_every_s: float = 1.0
    """Queries go this often. A Prometheus server's series are only as new as its own scrape of the engines (15 s
    by default; scrape the series you scale on every 1 s), so asking more often reads the same value again."""
    query_stale_after_s: float = 3.0
    """A query not answered well for this long stops its model's samples: three query periods."""
    timeout_s: float = 0.5
    """The longest one scrape or query may take. Both answer in milliseconds when well; half the engine bound leaves
    time for another try before a model goes stale."""
    max_body_bytes: int = 4 * MiB
    """Largest page or query answer read: a vLLM page is about 100 KB; a wrong URL serving a file stops here."""
    sample_every_s: float = 0.1
    """The contract's sample period (`warmpool.protocol.QueueSample`: every <= 100 ms): the last good reading is
    sent again between scrapes, so the autoscaler tells a live bridge from a dead one."""
    sample_min_gap_s: float = 0.01
    """Shortest gap between two samples of one model when readings change faster (`gateway.publisher`)."""

    def names(self) -> dict[str, str]:
        return dict(self.model_names)

    def flagged(self, model: str) -> str | None:
        """The flag that reads `model` (None: none does). The flags win over a ScaledObject's source for that model:
        both read, its demand would count twice. An unbound --target names no model before it is read: bind it
        (MODEL=URL) for this rule to see it."""
        if any(q.model == model for q in self.queries):
            return f"--query {model}=..."
        if any(t.model == model for t in self.targets):
            return f"--target {model}=..."
        if self.slots and (self.models is None or model in self.models):
            return "--slots (every ready slot of the models it reads)"
        return None

    def check(self) -> None:
        if not (self.targets or self.slots or self.queries or self.scaledobjects):
            raise ValueError(
                "nothing to read: give --target, --slots, --query or --scaledobjects (or a --config file naming them)"
            )
        if self.queries and not self.prometheus_url:
            raise ValueError("--query needs --prometheus URL (the Prometheus server to ask)")
        if self.prometheus_url:
            http_url(self.prometheus_url, what="--prometheus")
        for t in self.targets:
            http_url(t.url, what="target")
        seen = [q.model for q in self.queries]
        if len(set(seen)) != len(seen):
            raise ValueError("a model has two --query: one query per model (aggregate in PromQL)")
        names = [m for _, m in self.model_names] + list(self.models or ())
        bad = sorted(m for m in names if not protocol.is_name(m))
        if bad:
            raise ValueError(f"model names {bad} do not match {protocol.NAME_PATTERN}")
        if not self.slot_metrics_path.startswith("/"):
            raise ValueError(f"--slot-metrics-path {self.slot_metrics_path!r}: a path, starting with /")
        if not 0 < self.sample_every_s <= 0.1 or self.sample_min_gap_s <= 0:
            raise ValueError("the sample period must be in (0, 100ms] (the contract's bound), its gap > 0")
        if not (self.scrape_every_s > 0 and self.query_every_s > 0 and self.timeout_s > 0):
            raise ValueError("periods and the timeout must be > 0")
        # One late or lost read must not stop a model's samples: each bound covers at least two periods.
        if self.stale_after_s < 2 * self.scrape_every_s or self.query_stale_after_s < 2 * self.query_every_s:
            raise ValueError(
                f"a staleness bound must cover two periods: --stale-after {self.stale_after_s:g}s with "
                f"--scrape-every {self.scrape_every_s:g}s, --query-stale-after {self.query_stale_after_s:g}s with "
                f"--query-every {self.query_every_s:g}s"
            )
        if self.timeout_s > min(self.stale_after_s, self.query_stale_after_s):
            raise ValueError("--timeout must not exceed a staleness bound: a model would go stale inside one read")
        if self.max_body_bytes < 1024:
            raise ValueError("--max-body must be at least 1KiB")
