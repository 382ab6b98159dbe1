"""The gateway's table of model queues: the one owner of the queues that the publisher samples, the proxy's requests
join and the routes fill with endpoints.

A queue is made for a model the catalog knows (`gateway.catalog`): on its first request, or when one of its slots
becomes ready; never for a name a client made up (`admit` refuses it first). After each change of a queue `changed`
hands its waiting requests to free endpoints, refreshes its gauges, notes when it went idle and wakes the publisher;
`reclaim_idle` drops the idle queues the catalog lets go, with their samples and gauges.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.catalog import Catalog
from gateway.errors import Refused
from gateway.metrics import GatewayMetrics
from gateway.publisher import Publisher
from gateway.queue import Endpoint, ModelQueue
from gateway.settings import GatewaySettings

__all__ = ["Queue", "QueueTable"]

log = logging.getLogger("pulsescale.gateway")

Queue = ModelQueue[asyncio.Future[None]]
"""A model's queue; each waiter's item is the future its request's handler waits on until it is dispatched."""


class QueueTable:
    """The model queues (module doc). `queues` is the table itself; the publisher reads it."""

    def __init__(
        self,
        settings: GatewaySettings,
        catalog: Catalog,
        metrics: GatewayMetrics,
        *,
        clock: Callable[[], float],
    ) -> None:
        self._settings = settings
        self.catalog = catalog
        self._metrics = metrics
        self._clock = clock
        self.queues: dict[str, Queue] = {}
        self._idle_since: dict[str, float] = {}
        """Queues with nothing waiting, nothing in flight and no endpoint, since when."""
        self.publisher: Publisher | None = None
        """Told of each change and each queue reclaimed (bound by the gateway, which makes it over `queues`)."""

    def get(self, model: str) -> Queue | None:
        return self.queues.get(model)

    def queue(self, model: str) -> Queue:
        """`model`'s queue, made on first use: only for a model the catalog knows (callers ask it first)."""
        q = self.queues.get(model)
        if q is None:
            s = self._settings
            q = self.queues[model] = ModelQueue(model, limit=s.queue_limit, concurrency=s.endpoint_concurrency)
            self._metrics.queues.set(len(self.queues))
            if self.publisher is not None:
                self.publisher.changed(model)
        return q

    def admit(self, model: str) -> Queue:
        """The queue of `model` if the gateway serves it; `Refused` says why not (and nothing is kept)."""
        q = self.queues.get(model)
        verdict = self.catalog.verdict(model, ready=q is not None and bool(q.endpoints))
        if verdict == "unknown":
            raise Refused(404, "unknown_model", f"this gateway does not serve model {model!r}")
        if verdict == "undecided":
            raise Refused(
                503,
                "models_not_listed",
                f"this gateway has not read which models it serves yet, and no slot of {model!r} is ready; retry "
                "shortly",
                retry_after_s=1,
            )
        return self.queue(model)

    def set_endpoint(self, model: str, key: str, url: str) -> None:
        """A slot of `model` became ready: a ready slot makes its model known (`routes` filters by --models)."""
        q = self.queue(model)
        if q.set_endpoint(key, url):
            log.info("%s: routing to %s (%s)", model, key, url)
            self.changed(q)

    def remove_endpoint(self, model: str, key: str) -> Endpoint | None:
        """A slot of `model` left ready: the endpoint no longer routed to, if it was (the caller moves the requests
        in flight there, then calls `changed`)."""
        q = self.queues.get(model)
        ep = q.endpoints.get(key) if q is not None else None
        if q is None or ep is None:
            return None
        q.remove_endpoint(key)
        return ep

    def changed(self, q: Queue) -> None:
        """After any change of `q` (module doc)."""
        for w in q.dispatch():
            if not w.item.done():
                w.item.set_result(None)
        m = self._metrics
        m.queue_depth.labels(q.model).set(q.depth)
        m.inflight.labels(q.model).set(q.inflight)
        m.endpoints.labels(q.model).set(len(q.endpoints))
        if q.depth or q.inflight or q.endpoints:
            self._idle_since.pop(q.model, None)
        else:
            self._idle_since.setdefault(q.model, self._clock())
        if self.publisher is not None:
            self.publisher.changed(q.model)

    def reclaim_idle(self) -> list[str]:
        """Drop the queues the catalog lets go (`gateway.catalog`); the models dropped."""
        now = self._clock()
        gone = []
        for model, q in list(self.queues.items()):
            since = self._idle_since.get(model)
            idle_for_s = now - since if since is not None else 0.0
            busy, ready = bool(q.depth or q.inflight), bool(q.endpoints)
            if self.catalog.reclaimable(
                model, busy=busy, ready=ready, idle_for_s=idle_for_s, queue_idle_s=self._settings.queue_idle_s
            ):
                del self.queues[model]
                self._idle_since.pop(model, None)
                if self.publisher is not None:
                    self.publisher.forget(model)
                self._metrics.forget(model)
                self._metrics.queues_reclaimed.inc()
                gone.append(model)
        if gone:
            self._metrics.queues.set(len(self.queues))
            log.info("reclaimed the idle queue(s) of %s", ", ".join(gone))
        return gone

    def ready(self) -> dict[str, int]:
        """Ready endpoints per model that has any."""
        return {m: len(q.endpoints) for m, q in self.queues.items() if q.endpoints}
