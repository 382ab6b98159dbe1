"""The reference gateway: an aiohttp reverse proxy for OpenAI-style requests in front of each model's ready slots.

What happens to a request, in order:

1. The connection is admitted (at most `max_connections` open; its request head within `header_timeout_s`:
   `gateway.listener`), and the body is read: its size is taken from the gateway's body budget first
   (`gateway.budget`: 503 ``body_budget_full`` when it does not fit, 413 ``body_too_large`` past
   `max_body_bytes`), and it must arrive within `body_timeout_s` (408 ``body_timeout``).
2. ``POST /v1/completions`` or ``/v1/chat/completions`` names its model in the JSON body's ``model``, or in a path
   prefix (``POST /<model>/v1/completions``; both given and different: 400). A model the gateway does not serve is
   404 ``unknown_model`` at once (`gateway.catalog`: with ``--models``, any other; without, one that no ScaledObject
   in `pulse_scalers` and no ready slot names; 503 ``models_not_listed`` while `pulse_scalers` is not read).
3. It joins the model's FIFO queue (`gateway.queue`). With `queue_limit` requests already waiting it is refused at
   once: 429 ``queue_full``, ``Retry-After: 1``.
4. It waits until a ready endpoint has room (each takes `endpoint_concurrency` requests at once; the least loaded
   is picked). Waiting longer than `timeout_s` since it arrived: 504 ``timeout``. Once an upstream has it, its body
   leaves the budget.
5. It is forwarded as is. An upstream that breaks (connection refused or reset, a 503, its slot leaving ``ready``)
   before the gateway sent the client anything puts the request back at the head of the queue for another slot,
   within the same deadline, at most `max_attempts` times in all (then 502 ``upstream_failed``). A streamed answer
   (``"stream": true``) that breaks after its first bytes went to the client cannot be retried: the client's
   connection is cut (`pulsescale_gateway_broken_streams_total`). An upstream silent for `upstream_timeout_s`: 504.

Every refusal is named (`gateway.errors`) and counted in `pulsescale_gateway_refused_total{reason}`.

Endpoints come from `pulse_slots` (`gateway.routes`): a slot is routed to while its record says ``ready`` and its
node's assignment (`pulse_assignments`) lists its model, and dropped the moment either stops. Every `sample_every_s`
and on change the gateway publishes each model's `QueueSample` on ``pulse.queue.<model>`` (`gateway.publisher`),
which is what the autoscaler scales on: the queue builds, the autoscaler activates warm slots, they appear ready here
and drain the queue. An idle queue of a model not in ``--models`` is reclaimed (`gateway.catalog`), and its samples
stop.

The NATS user needs the gateway role (publish ``pulse.queue.>``, read ``pulse_slots`` and ``pulse_assignments``)
and, without ``--models``, KV reads of ``pulse_scalers``. ``/healthz`` and ``/metrics`` (Prometheus) are on the same
listener unless given their own (`metrics_host`); every listener binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from nats.aio.client import Client
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.budget import BodyBudget, Hold
from gateway.catalog import Catalog
from gateway.errors import Refused
from gateway.listener import GuardedSite
from gateway.metrics import GatewayMetrics
from gateway.publisher import Publisher
from gateway.queue import Endpoint, Waiter
from gateway.requestbody import error_response, parse_request
from gateway.routes import Routes
from gateway.scalers import Scalers
from gateway.settings import GatewaySettings, default_gateway_id
from gateway.table import Queue, QueueTable
from warmpool import daemonstart
from warmpool.errors import PulsescaleError
from warmpool.rejects import Rejections

__all__ = ["Gateway", "GatewaySettings", "default_gateway_id", "run"]

log = logging.getLogger("pulsescale.gateway")

ROUTES = ("/v1/completions", "/v1/chat/completions")
_FORWARDED_HEADERS = ("Content-Type", "Accept", "X-Request-Id")


class _Retry(Exception):
    """The upstream broke before the client got anything: try another."""


@dataclass(eq=False)
class _Attempt:
    """One request's try at one endpoint; cancelled with `slot_left` when the slot leaves ``ready`` before any
    byte went to the client (`started`)."""

    task: asyncio.Task[web.StreamResponse] = field(init=False)
    started: bool = False
    slot_left: bool = False


class Gateway:
    """The proxy (module doc). `start()` serves on `settings.host:port` with `nc`; `close()` stops it."""

    def __init__(
        self,
        settings: GatewaySettings,
        nc: Client,
        *,
        metrics: GatewayMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        settings.check()
        self.settings = settings
        self.nc = nc
        self.metrics = metrics or GatewayMetrics()
        self._clock = clock
        self.catalog = Catalog(settings.models)
        self.table = QueueTable(settings, self.catalog, self.metrics, clock=clock)
        self.budget = BodyBudget(settings.body_budget_bytes)
        self.metrics.body_budget.set(settings.body_budget_bytes)
        self.rejected = Rejections(log, on_reject=lambda reason: self.metrics.rejected_records.labels(reason).inc())
        self.publisher = Publisher(
            nc,
            settings.gateway_id,
            self.table.queues,
            every_s=settings.sample_every_s,
            min_gap_s=settings.sample_min_gap_s,
            on_published=lambda model: self.metrics.samples.labels(model).inc(),
        )
        self.routes = Routes(
            nc,
            settings.models,
            on_ready=self._on_ready,
            on_gone=self._on_gone,
            rejected=self.rejected,
            require_assignment=settings.require_assignment,
        )
        self.table.publisher = self.publisher
        self.scalers = Scalers(nc, self.catalog, self.rejected) if settings.models is None else None
        for model in sorted(settings.models or ()):
            self.table.queue(model)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._attempts: dict[Endpoint, dict[_Attempt, None]] = {}
        """In-flight attempts per endpoint (insertion-ordered sets)."""
        self._runners: list[web.AppRunner] = []
        self._sites: list[GuardedSite] = []
        self._session: aiohttp.ClientSession | None = None
        self.port = settings.port
        self.metrics_port: int | None = None
        """The port of the listener serving ``/healthz`` and ``/metrics``: `port`, or their own."""

    # --- life ----------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=s.upstream_timeout_s),
            auto_decompress=False,  # bytes pass through as the upstream sent them, with its Content-Encoding
        )
        pages = [web.get("/healthz", self.healthz), web.get("/metrics", self.metrics_page)]
        api = [web.post(path, self.handle) for path in ROUTES]
        api += [web.post("/{model}" + path, self.handle) for path in ROUTES]
        api += [web.get("/v1/models", self.list_models)]
        separate = s.metrics_host is not None
        try:
            self.port = await self._listen("api", api if separate else api + pages, s.host, s.port)
            if s.metrics_host is not None:
                self.metrics_port = await self._listen("metrics", pages, s.metrics_host, s.metrics_port)
            else:
                self.metrics_port = self.port
        except OSError as err:
            await self.close()
            raise PulsescaleError(
                f"cannot listen on {err.filename}: {err.strerror or err}; pick another "
                f"{'--metrics-listen' if err.filename != f'{s.host}:{s.port}' else '--listen'}"
            ) from None
        _check_file_limit(s.max_connections * (2 if separate else 1))
        self._tasks = [
            asyncio.create_task(self.routes.run(self._stop), name="gateway-routes"),
            asyncio.create_task(self._sweep(), name="gateway-sweep"),
        ]
        if s.publish_samples:  # off: another publisher gives these models' demand (`GatewaySettings`)
            self._tasks.append(asyncio.create_task(self.publisher.run(self._stop), name="gateway-publisher"))
        if self.scalers is not None:
            self._tasks.append(asyncio.create_task(self.scalers.run(self._stop), name="gateway-scalers"))
        log.info(
            "gateway %s on http://%s:%d%s (queue limit %d, timeout %g s, %d per endpoint, %s; at most %d "
            "connections, body budget %d MiB)",
            s.gateway_id,
            s.host,
            self.port,
            f", /metrics on http://{s.metrics_host}:{self.metrics_port}" if separate else "",
            s.queue_limit,
            s.timeout_s,
            s.endpoint_concurrency,
            f"models {', '.join(sorted(s.models))}" if s.models is not None else "models from pulse_scalers",
            s.max_connections,
            s.body_budget_bytes // (1024 * 1024),
        )

    async def _listen(self, name: str, routes: list[web.RouteDef], host: str, port: int) -> int:
        """Serve `routes` on `host`:`port` behind the connection cap and header timeout; the bound port. An
        OSError names the address in its `filename`."""
        s = self.settings
        app = web.Application(client_max_size=s.max_body_bytes, middlewares=[self._no_route])
        app.add_routes(routes)
        # A client that leaves while its request waits cancels the handler, so it leaves the queue at once.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, keepalive_timeout=s.keepalive_timeout_s)
        await runner.setup()
        self._runners.append(runner)
        connections = self.metrics.connections.labels(name)
        site = GuardedSite(
            runner,
            host,
            port,
            max_connections=s.max_connections,
            header_timeout_s=s.header_timeout_s,
            on_refused=lambda reason: self.metrics.refused.labels(reason).inc(),
            on_count=connections.set,
        )
        try:
            await site.start()
        except OSError as err:
            err.filename = f"{host}:{port}"
            raise
        self._sites.append(site)
        assert site.bound_port is not None
        return site.bound_port

    @web.middleware
    async def _no_route(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """A path or method this listener does not serve: a named, counted 404/405."""
        try:
            return await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as err:
            if request.match_info.route.resource is not None:
                raise  # raised by a handler of ours, not the router
            self.metrics.refused.labels("no_route").inc()
            return error_response(
                err.status,
                "no_route",
                f"this listener does not serve {request.method} {request.path}",
                headers={"Allow": err.headers["Allow"]} if "Allow" in err.headers else None,
            )

    async def close(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for runner in self._runners:
            await runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def crashed(self) -> BaseException | None:
        """The exception a background task died of, if one did."""
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                return t.exception()
        return None

    # --- queues and endpoints ------------------------------------------------------------------------------------

    @property
    def queues(self) -> dict[str, Queue]:
        """The model queues (`gateway.table`)."""
        return self.table.queues

    def _on_ready(self, model: str, key: str, url: str) -> None:
        self.table.set_endpoint(model, key, url)

    def _on_gone(self, model: str, key: str) -> None:
        ep = self.table.remove_endpoint(model, key)
        if ep is None:
            return
        moved = 0
        for attempt in self._attempts.get(ep, {}):
            if not attempt.started and not attempt.task.done():
                attempt.slot_left = True
                attempt.task.cancel()
                moved += 1
        log.info("%s: %s left ready; not routed any more (%d request(s) moved)", model, key, moved)
        self._changed(self.table.queues[model])

    def _changed(self, q: Queue) -> None:
        self.table.changed(q)
        self.metrics.body_budget_used.set(self.budget.held_bytes)

    async def _sweep(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.settings.sweep_every_s)
            self.table.reclaim_idle()

    # --- requests ------------------------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        arrived = self._clock()
        hold = Hold(self.budget)
        try:
            try:
                body = await self._read_body(request, hold)
                try:
                    model, stream = parse_request(body, request.match_info.get("model"))
                except ValueError as err:
                    raise Refused(400, "bad_request", str(err)) from None
                q = self.table.admit(model)
            except Refused as refusal:
                self.metrics.refused.labels(refusal.reason).inc()
                return error_response(refusal.status, refusal.reason, refusal.message, refusal.headers)
            return await self._wait_and_serve(request, q, hold, body, stream, arrived)
        finally:
            hold.release()
            self.metrics.body_budget_used.set(self.budget.held_bytes)

    async def _read_body(self, request: web.Request, hold: Hold) -> bytearray:
        """The body, its size taken from the budget first (module doc, step 1)."""
        s = self.settings
        length = request.content_length

        def over_budget() -> Refused:
            return Refused(
                503,
                "body_budget_full",
                f"this gateway already holds {self.budget.held_bytes} bytes of request bodies that wait, its "
                f"limit is {s.body_budget_bytes}; retry shortly",
                retry_after_s=1,
            )

        def too_large() -> Refused:
            return Refused(413, "body_too_large", f"the body is over {s.max_body_bytes} bytes")

        try:
            async with asyncio.timeout(s.body_timeout_s):
                if length is not None:
                    if length > s.max_body_bytes:
                        raise too_large()
                    if not hold.take(length):
                        raise over_budget()
                    # Into one buffer of the announced size: no growing copy, no second copy to bytes.
                    body = bytearray(length)
                    view, got = memoryview(body), 0
                    while got < length and (chunk := await request.content.readany()):
                        view[got : got + len(chunk)] = chunk
                        got += len(chunk)
                    view.release()
                    if got != length:
                        raise Refused(400, "bad_request", f"the body ended after {got} of its {length} bytes")
                    return body
                buf = bytearray()
                while chunk := await request.content.readany():
                    if len(buf) + len(chunk) > s.max_body_bytes:
                        raise too_large()
                    if not hold.take(len(chunk)):
                        raise over_budget()
                    buf += chunk
                return buf
        except TimeoutError:
            raise Refused(408, "body_timeout", f"the body did not arrive within {s.body_timeout_s:g} s") from None
        except web.HTTPRequestEntityTooLarge:
            raise too_large() from None

    async def _wait_and_serve(
        self, request: web.Request, q: Queue, hold: Hold, body: bytearray, stream: bool, arrived: float
    ) -> web.StreamResponse:
        model = q.model
        path = "/v1/" + request.path.split("/v1/", 1)[1]
        headers = {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}
        w = q.arrive(asyncio.get_running_loop().create_future(), arrived, self.settings.timeout_s)
        if w is None:
            self.metrics.responses.labels(model, "429").inc()
            self.metrics.refused.labels("queue_full").inc()
            self._changed(q)
            return error_response(
                429,
                "queue_full",
                f"{q.limit} requests for {model} are already waiting; retry shortly",
                headers={"Retry-After": "1"},
            )
        self._changed(q)
        try:
            response = await self._serve(request, q, w, hold, body, path, headers, stream)
            self.metrics.responses.labels(model, str(response.status)).inc()
            if w.state == "gone" and response.status < 500:
                self.metrics.request_seconds.labels(model).observe(self._clock() - arrived)
            return response
        finally:
            # A cancelled handler (the client left) or a bug: the request must still leave the queue's books.
            if w.state == "waiting":
                q.give_up(w, "failed")
            elif w.state == "dispatched":
                q.finish(w, "failed")
            hold.release()
            self._changed(q)

    async def _serve(
        self,
        request: web.Request,
        q: Queue,
        w: Waiter[asyncio.Future[None]],
        hold: Hold,
        body: bytearray,
        path: str,
        headers: dict[str, str],
        stream: bool,
    ) -> web.StreamResponse:
        while True:
            remaining = w.deadline - self._clock()
            if not w.item.done() and remaining > 0:
                await asyncio.wait([w.item], timeout=remaining)
            if not w.item.done() and q.give_up(w, "timeout"):
                return error_response(
                    504,
                    "timeout",
                    f"no {q.model} replica could take the request within {self.settings.timeout_s:g} s; "
                    f"{len(q.endpoints)} ready, {q.depth} waiting",
                )
            hold.release()  # an upstream has it now
            if w.attempts == 1:
                self.metrics.queue_wait.labels(q.model).observe(self._clock() - w.arrived_at)
            ep = w.endpoint
            assert ep is not None
            attempt = _Attempt()
            attempt.task = asyncio.create_task(
                self._forward(request, ep.url + path, body, headers, stream, q.model, attempt)
            )
            on_ep = self._attempts.setdefault(ep, {})
            on_ep[attempt] = None
            try:
                response = await attempt.task
            except _Retry as err:
                why = str(err)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not attempt.slot_left or (task is not None and task.cancelling()):
                    raise  # the client left (or the gateway stops), not the slot
                why = "its slot left ready"
            except TimeoutError:
                q.finish(w, "timeout")
                return error_response(
                    504,
                    "upstream_timeout",
                    f"the {q.model} upstream did not answer within {self.settings.upstream_timeout_s:g} s",
                )
            else:
                q.finish(w, "completed")
                return response
            finally:
                on_ep.pop(attempt, None)
                if not on_ep:
                    self._attempts.pop(ep, None)
            log.info("%s: request on %s retried: %s", q.model, ep.key, why)
            if w.attempts >= self.settings.max_attempts:
                q.finish(w, "failed")
                return error_response(
                    502, "upstream_failed", f"{w.attempts} upstream(s) of {q.model} broke before answering: {why}"
                )
            self.metrics.retries.labels(q.model).inc()
            q.retry(w)
            hold.force(len(body))  # waiting again: admitted already, so over the limit if need be
            w.item = asyncio.get_running_loop().create_future()
            self._changed(q)

    async def _forward(
        self,
        request: web.Request,
        url: str,
        body: bytearray,
        headers: dict[str, str],
        stream: bool,
        model: str,
        attempt: _Attempt,
    ) -> web.StreamResponse:
        """One attempt. Raises `_Retry` when the upstream broke before anything reached the client."""
        assert self._session is not None
        try:
            upstream = await self._session.post(url, data=body, headers=headers)
        except TimeoutError:
            raise
        except (aiohttp.ClientError, OSError) as err:
            raise _Retry(_why(err)) from None
        async with upstream:
            if upstream.status == 503:
                raise _Retry("the upstream answered 503 (not serving)")
            kept = {h: upstream.headers[h] for h in ("Content-Type", "Content-Encoding") if h in upstream.headers}
            if not (stream and upstream.status == 200):
                try:
                    data = await upstream.read()
                except TimeoutError:
                    raise
                except (aiohttp.ClientError, OSError) as err:
                    raise _Retry(_why(err)) from None
                return web.Response(status=upstream.status, body=data, headers=kept)
            try:
                first = await upstream.content.readany()
            except TimeoutError:
                raise
            except (aiohttp.ClientError, OSError) as err:
                raise _Retry(_why(err)) from None
            response = web.StreamResponse(status=200, headers=kept)
            attempt.started = True  # from here on the client has bytes: no retry, even if the slot leaves
            await response.prepare(request)
            await response.write(first)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (aiohttp.ClientError, OSError) as err:
                self.metrics.broken_streams.labels(model).inc()
                log.warning("%s: stream broke after its first bytes (%s); client connection cut", model, _why(err))
                if request.transport is not None:
                    request.transport.close()
                return response
            await response.write_eof()
            return response

    # --- other pages ---------------------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return {
            "gateway": self.settings.gateway_id,
            "nats_connected": self.nc.is_connected,
            "slots_listed": self.routes.listed.is_set(),
            "assignments": self.routes.assigned.state,
            "scalers": self.catalog.scalers,
            "connections": sum(site.connections for site in self._sites),
            "body_budget": {"held_bytes": self.budget.held_bytes, "limit_bytes": self.budget.limit_bytes},
            "models": {
                m: {"ready": len(q.endpoints), "queue_depth": q.depth, "inflight": q.inflight}
                for m, q in sorted(self.queues.items())
            },
        }

    async def healthz(self, _: web.Request) -> web.Response:
        h = self.health()
        ok = h["nats_connected"] and h["slots_listed"] and self.crashed() is None
        return web.json_response(h, status=200 if ok else 503)

    async def metrics_page(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def list_models(self, _: web.Request) -> web.Response:
        """The models a client may ask for: ``--models``, else those of the ScaledObjects and of ready slots."""
        ready = self.table.ready()
        data = [
            {"id": m, "object": "model", "owned_by": "pulsescale", "ready": ready.get(m, 0)}
            for m in self.catalog.listed(ready)
        ]
        return web.json_response({"object": "list", "data": data})


def _check_file_limit(connections: int) -> None:
    """Warn when the process may not open the descriptors `connections` need (a client's and an upstream's each):
    past the limit, accepting fails before the connection cap answers."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * connections + 64
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning(
            "the open-file limit is %d, the connection caps need about %d: raise it (ulimit -n) or lower "
            "--max-connections",
            soft,
            need,
        )


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


async def run(
    settings: GatewaySettings,
    *,
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
    on_started: Callable[[Gateway], None] | None = None,
) -> None:
    """Run the gateway until `stop` is set (signal handling is the caller's)."""
    await daemonstart.serve_until_stopped(
        settings.nats, lambda nc: Gateway(settings, nc), stop, ready=ready, on_started=on_started
    )
