"""The reference gateway's settings (`pulsescale gateway`'s flags), each with its unit and why its default is what it
is. `gateway.proxy` re-exports `GatewaySettings`."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field

from warmpool import connect, protocol

__all__ = ["GatewaySettings", "default_gateway_id"]

MiB = 1024 * 1024


def default_gateway_id() -> str:
    """``gw-<host>-<pid>-<random>``: unique per run, so the autoscaler tells runs (and restarts) apart."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname())[:60]
    return f"gw-{host}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class GatewaySettings:
    nats: connect.NatsOptions = field(default_factory=connect.NatsOptions)
    host: str = "127.0.0.1"
    """Listen address: loopback unless told otherwise (README, Security); in Kubernetes the pod IP."""
    port: int = 8080
    """Listen port; 0 picks a free one (`Gateway.port` says which)."""
    metrics_host: str | None = None
    """Serve ``/healthz`` and ``/metrics`` on their own listener at `metrics_host`:`metrics_port` (and not on the
    clients' one): probes and scrapes then reach the gateway whatever its clients do, and clients do not see its
    metrics. None: both on the clients' listener."""
    metrics_port: int = 0
    """Port of that listener; 0 picks a free one (`Gateway.metrics_port` says which)."""
    queue_limit: int = 1000
    """Requests that may wait per model; the next is refused 429. A queue deeper than what the fleet clears within
    `timeout_s` only turns 429s into 504s later; 1000 covers a 300 % pulse on a few dozen slots for seconds."""
    timeout_s: float = 30.0
    """The longest a request waits for a slot, from its arrival: then 504. Clients and load balancers commonly give
    up around 30-60 s; a warm activation takes seconds, an HPA cold start minutes (SEED.md)."""
    upstream_timeout_s: float = 300.0
    """The longest an upstream may take to answer in full (a long generation): then 504."""
    endpoint_concurrency: int = 4
    """Requests one ready slot gets at once; the rest wait in the gateway's queue, where the autoscaler sees them.
    Set it to what one engine serves without queueing inside (vLLM: its batch; the local engine: 1-4)."""
    max_attempts: int = 3
    """Upstreams tried per request when they break before answering (a slot leaving mid-request)."""
    models: frozenset[str] | None = None
    """Serve only these models (and publish their samples from the start); None: the models of the ScaledObjects
    in `pulse_scalers` and any model with a ready slot (`gateway.catalog`)."""
    require_assignment: bool = False
    """Route a node's ready slots only of the models `pulse_assignments` lists for it (``pulsescale assign``): a node
    without an assignment is not routed to. Off: such a node is routed to, as before revision 11 (the quickstart,
    the demo); a node with an assignment is held to it either way. The secure deployment sets it, as on the
    autoscaler."""
    queue_idle_s: float = 300.0
    """A queue of a model not in `models` that has had nothing waiting, nothing in flight and no ready slot this
    long is reclaimed (its samples stop); one of a model no longer known goes as soon as it is idle. Longer than
    the autoscaler's default stable window (60 s), so a model's demand does not vanish while it still counts."""
    max_body_bytes: int = MiB
    """Largest request body (413 beyond): prompts are text; a megabyte is a long one."""
    body_budget_bytes: int = 128 * MiB
    """Request bodies held by requests being read or waiting for a slot, all models together (`gateway.budget`);
    past it a request is refused 503 ``body_budget_full``. 128 MiB is 128 maximal bodies or about 13,000 chat
    requests of 10 kB, well inside a gateway pod's memory."""
    header_timeout_s: float = 10.0
    """A new connection must send a complete request head within this (408 ``header_timeout`` and closed beyond):
    a real client sends it at once; Go's servers commonly use 10 s as their ReadHeaderTimeout."""
    body_timeout_s: float = 30.0
    """A request body must arrive in full within this of its head (408 ``body_timeout``): 1 MiB at 35 kB/s."""
    keepalive_timeout_s: float = 75.0
    """An idle kept-alive connection is closed this long after its last answer (also the bound on a later request's
    head). 75 s (aiohttp's and nginx's default) outlasts the 60 s idle timeout of common load balancers, so the
    balancer, not the gateway, closes first."""
    max_connections: int = 4096
    """Open connections per listener; a new one beyond is answered 503 ``too_many_connections`` and closed. Each
    waiting request holds one, so this must exceed the requests that wait at once; the process needs about two
    file descriptors per connection (the client's and the upstream's)."""
    gateway_id: str = field(default_factory=default_gateway_id)
    publish_samples: bool = True
    """Publish the queue samples (`gateway.publisher`). Off (``--no-samples``) only when something else publishes
    these models' demand, such as ``pulsescale bridge`` reading the engines: the autoscaler adds every gateway's
    demand up, so both publishing would count each request twice."""
    sample_every_s: float = 0.1
    """The contract's sample period (`warmpool.protocol.QueueSample`: every <= 100 ms)."""
    sample_min_gap_s: float = 0.01
    """Shortest gap between two samples of one model when changes come faster (`gateway.publisher`)."""
    sweep_every_s: float = 1.0
    """How often idle queues are looked for (`queue_idle_s`)."""

    def check(self) -> None:
        if self.queue_limit < 0 or self.endpoint_concurrency < 1 or self.max_attempts < 1 or self.max_connections < 1:
            raise ValueError("queue_limit must be >= 0; endpoint_concurrency, max_attempts, max_connections >= 1")
        timeouts = (self.timeout_s, self.upstream_timeout_s, self.header_timeout_s, self.body_timeout_s)
        if not (min(timeouts) > 0 and self.keepalive_timeout_s > 0 and 0 < self.sample_every_s <= 0.1):
            raise ValueError("timeouts must be > 0 and the sample period in (0, 0.1] s (the contract's bound)")
        if not (self.queue_idle_s > 0 and self.sweep_every_s > 0):
            raise ValueError("queue_idle_s and sweep_every_s must be > 0")
        if not 0 < self.max_body_bytes <= self.body_budget_bytes:
            raise ValueError(
                f"the body budget ({self.body_budget_bytes} bytes) must hold at least one largest body "
                f"({self.max_body_bytes} bytes)"
            )
        bad = [m for m in self.models or () if not protocol.is_name(m)]
        if bad:
            raise ValueError(f"model names {bad} do not match {protocol.NAME_PATTERN}")
