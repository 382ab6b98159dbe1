"""The reference gateway: an aiohttp reverse proxy for OpenAI-style requests in front of each model's ready slots.

What happens to a request, in order:

1. ``POST /v1/completions`` or ``/v1/chat/completions`` names its model in the JSON body's ``model``, or in a path
   prefix (``POST /<model>/v1/completions``; both given and different: 400). A model the gateway does not serve is
   404 (with ``--models``: any other; without: beyond `max_models` distinct names).
2. It joins the model's FIFO queue (`gateway.queue`). With `queue_limit` requests already waiting it is refused at
   once: 429 ``queue_full``, ``Retry-After: 1``.
3. It waits until a ready endpoint has room (each takes `endpoint_concurrency` requests at once; the least loaded
   is picked). Waiting longer than `timeout_s` since it arrived: 504 ``timeout``.
4. It is forwarded as is. An upstream that breaks (connection refused or reset, a 503, its slot leaving ``ready``)
   before the gateway sent the client anything puts the request back at the head of the queue for another slot,
   within the same deadline, at most `max_attempts` times in all (then 502 ``upstream_failed``). A streamed answer
   (``"stream": true``) that breaks after its first bytes went to the client cannot be retried: the client's
   connection is cut (`pulsescale_gateway_broken_streams_total`). An upstream silent for `upstream_timeout_s`: 504.

Endpoints come from `pulse_slots` (`gateway.routes`): a slot is routed to while its record says ``ready``, and
dropped the moment it says anything else. Every `sample_every_s` and on change the gateway publishes each model's
`QueueSample` on ``pulse.queue.<model>`` (`gateway.publisher`), which is what the autoscaler scales on: the queue
builds, the autoscaler activates warm slots, they appear ready here and drain the queue.

The NATS user needs only the gateway role (publish ``pulse.queue.>``, read ``pulse_slots``). ``/healthz`` and
``/metrics`` (Prometheus) are on the same listener, which binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from nats.aio.client import Client
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.metrics import GatewayMetrics
from gateway.publisher import Publisher
from gateway.queue import Endpoint, ModelQueue, Waiter
from gateway.routes import Routes
from warmpool import connect, protocol
from warmpool.errors import PulsescaleError
from warmpool.rejects import Rejections

__all__ = ["Gateway", "GatewaySettings", "default_gateway_id", "run"]

log = logging.getLogger("pulsescale.gateway")

ROUTES = ("/v1/completions", "/v1/chat/completions")
_FORWARDED_HEADERS = ("Content-Type", "Accept", "X-Request-Id")


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
    """Serve only these models (and publish their samples from the start); None: any valid name, up to
    `max_models`."""
    max_models: int = 64
    """Distinct models served without `models`: bounds the state a client can make the gateway keep."""
    max_body_bytes: int = 1024 * 1024
    """Largest request body (413 beyond): prompts are text; a megabyte is a long one."""
    gateway_id: str = field(default_factory=default_gateway_id)
    sample_every_s: float = 0.1
    """The contract's sample period (`warmpool.protocol.QueueSample`: every <= 100 ms)."""
    sample_min_gap_s: float = 0.01
    """Shortest gap between two samples of one model when changes come faster (`gateway.publisher`)."""

    def check(self) -> None:
        if self.queue_limit < 0 or self.endpoint_concurrency < 1 or self.max_attempts < 1 or self.max_models < 1:
            raise ValueError("queue_limit must be >= 0; endpoint_concurrency, max_attempts, max_models >= 1")
        if not (self.timeout_s > 0 and self.upstream_timeout_s > 0 and 0 < self.sample_every_s <= 0.1):
            raise ValueError("timeouts must be > 0 and the sample period in (0, 0.1] s (the contract's bound)")
        bad = [m for m in self.models or () if not protocol.is_name(m)]
        if bad:
            raise ValueError(f"model names {bad} do not match {protocol.NAME_PATTERN}")


class _Retry(Exception):
    """The upstream broke before the client got anything: try another."""


@dataclass(eq=False)
class _Attempt:
    """One request's try at one endpoint; cancelled with `slot_left` when the slot leaves ``ready`` before any
    byte went to the client (`started`)."""

    task: asyncio.Task[web.StreamResponse] = field(init=False)
    started: bool = False
    slot_left: bool = False


Queue = ModelQueue[asyncio.Future[None]]


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
        self.queues: dict[str, Queue] = {}
        self.rejected = Rejections(log, on_reject=lambda reason: self.metrics.rejected_records.labels(reason).inc())
        self.publisher = Publisher(
            nc,
            settings.gateway_id,
            self.queues,
            every_s=settings.sample_every_s,
            min_gap_s=settings.sample_min_gap_s,
            on_published=lambda model: self.metrics.samples.labels(model).inc(),
        )
        self.routes = Routes(
            nc, settings.models, on_ready=self._on_ready, on_gone=self._on_gone, rejected=self.rejected
        )
        for model in sorted(settings.models or ()):
            self._queue(model)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._attempts: dict[Endpoint, dict[_Attempt, None]] = {}
        """In-flight attempts per endpoint (insertion-ordered sets)."""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port = settings.port

    # --- life ----------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
            timeout=aiohttp.ClientTimeout(total=self.settings.upstream_timeout_s),
            auto_decompress=False,  # bytes pass through as the upstream sent them, with its Content-Encoding
        )
        app = web.Application(client_max_size=self.settings.max_body_bytes)
        app.add_routes(
            [web.post(path, self.handle) for path in ROUTES]
            + [web.post("/{model}" + path, self.handle) for path in ROUTES]
            + [
                web.get("/healthz", self.healthz),
                web.get("/metrics", self.metrics_page),
                web.get("/v1/models", self.list_models),
            ]
        )
        # A client that leaves while its request waits cancels the handler, so it leaves the queue at once.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.settings.host, self.settings.port).start()
        except OSError as err:
            await self.close()
            raise PulsescaleError(
                f"cannot listen on {self.settings.host}:{self.settings.port}: {err.strerror or err}; "
                "pick another --listen"
            ) from None
        addresses = self._runner.addresses
        self.port = int(addresses[0][1]) if addresses else self.settings.port
        self._tasks = [
            asyncio.create_task(self.routes.run(self._stop), name="gateway-routes"),
            asyncio.create_task(self.publisher.run(self._stop), name="gateway-publisher"),
        ]
        log.info(
            "gateway %s on http://%s:%d (queue limit %d, timeout %g s, %d per endpoint)",
            self.settings.gateway_id,
            self.settings.host,
            self.port,
            self.settings.queue_limit,
            self.settings.timeout_s,
            self.settings.endpoint_concurrency,
        )

    async def close(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            await self._runner.cleanup()
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

    def _queue(self, model: str) -> Queue | None:
        q = self.queues.get(model)
        if q is None:
            models = self.settings.models
            # A given list is the bound; without one, `max_models` bounds what clients can make us keep.
            if (model not in models) if models is not None else len(self.queues) >= self.settings.max_models:
                return None
            q = self.queues[model] = ModelQueue(
                model, limit=self.settings.queue_limit, concurrency=self.settings.endpoint_concurrency
            )
            self.publisher.changed(model)
        return q

    def _on_ready(self, model: str, key: str, url: str) -> None:
        q = self._queue(model)
        if q is not None and q.set_endpoint(key, url):
            log.info("%s: routing to %s (%s)", model, key, url)
            self._changed(q)

    def _on_gone(self, model: str, key: str) -> None:
        q = self.queues.get(model)
        ep = q.endpoints.get(key) if q is not None else None
        if q is None or ep is None:
            return
        q.remove_endpoint(key)
        moved = 0
        for attempt in self._attempts.get(ep, {}):
            if not attempt.started and not attempt.task.done():
                attempt.slot_left = True
                attempt.task.cancel()
                moved += 1
        log.info("%s: %s left ready; not routed any more (%d request(s) moved)", model, key, moved)
        self._changed(q)

    def _changed(self, q: Queue) -> None:
        """After any change of `q`: hand waiting requests to free endpoints, refresh the gauges, wake the
        publisher."""
        for w in q.dispatch():
            if not w.item.done():
                w.item.set_result(None)
        m = self.metrics
        m.queue_depth.labels(q.model).set(q.depth)
        m.inflight.labels(q.model).set(q.inflight)
        m.endpoints.labels(q.model).set(len(q.endpoints))
        self.publisher.changed(q.model)

    # --- requests ------------------------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        arrived = self._clock()
        body = await request.read()
        try:
            model, stream = _parse(body, request.match_info.get("model"))
        except ValueError as err:
            return _error(400, "bad_request", str(err))
        q = self._queue(model)
        if q is None:
            return _error(404, "unknown_model", f"this gateway does not serve model {model!r}")
        path = "/v1/" + request.path.split("/v1/", 1)[1]
        headers = {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}
        w = q.arrive(asyncio.get_running_loop().create_future(), arrived, self.settings.timeout_s)
        if w is None:
            self.metrics.responses.labels(model, "429").inc()
            self._changed(q)
            return _error(
                429,
                "queue_full",
                f"{q.limit} requests for {model} are already waiting; retry shortly",
                headers={"Retry-After": "1"},
            )
        self._changed(q)
        try:
            response = await self._serve(request, q, w, body, path, headers, stream)
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
            self._changed(q)

    async def _serve(
        self,
        request: web.Request,
        q: Queue,
        w: Waiter[asyncio.Future[None]],
        body: bytes,
        path: str,
        headers: dict[str, str],
        stream: bool,
    ) -> web.StreamResponse:
        while True:
            remaining = w.deadline - self._clock()
            if not w.item.done() and remaining > 0:
                await asyncio.wait([w.item], timeout=remaining)
            if not w.item.done() and q.give_up(w, "timeout"):
                return _error(
                    504,
                    "timeout",
                    f"no {q.model} replica could take the request within {self.settings.timeout_s:g} s; "
                    f"{len(q.endpoints)} ready, {q.depth} waiting",
                )
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
                return _error(
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
                return _error(
                    502, "upstream_failed", f"{w.attempts} upstream(s) of {q.model} broke before answering: {why}"
                )
            self.metrics.retries.labels(q.model).inc()
            q.retry(w)
            w.item = asyncio.get_running_loop().create_future()
            self._changed(q)

    async def _forward(
        self,
        request: web.Request,
        url: str,
        body: bytes,
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
        data = [
            {"id": m, "object": "model", "owned_by": "pulsescale", "ready": len(q.endpoints)}
            for m, q in sorted(self.queues.items())
        ]
        return web.json_response({"object": "list", "data": data})


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _parse(body: bytes, path_model: str | None) -> tuple[str, bool]:
    """The model and whether the answer is streamed; ValueError says what is wrong with the request."""
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):
        raise ValueError("the body is not JSON") from None
    if not isinstance(req, dict):
        raise ValueError("the body must be a JSON object")
    model = req.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("`model` must be a string")
    if path_model is not None and model is not None and model != path_model:
        raise ValueError(f"the path names model {path_model!r} but the body names {model!r}")
    model = path_model or model
    if not model:
        raise ValueError("name the model: `model` in the body, or POST /<model>/v1/completions")
    if not protocol.is_name(model):
        raise ValueError(f"model {model!r} is not a valid name ({protocol.NAME_PATTERN})")
    return model, req.get("stream") is True


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style error body: ``{"error": {"message", "type", "code"}}``."""
    kind = "invalid_request_error" if status < 500 and status != 429 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": code}}, status=status, headers=headers
    )


async def run(
    settings: GatewaySettings,
    *,
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
    on_started: Callable[[Gateway], None] | None = None,
) -> None:
    """Run the gateway until `stop` is set (signal handling is the caller's)."""
    nc = await connect.connect(settings.nats)
    try:
        gw = Gateway(settings, nc)
        await gw.start()
        try:
            if on_started is not None:
                on_started(gw)
            if ready is not None:
                ready.set()
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
                crashed = gw.crashed()
                if crashed is not None:
                    raise crashed
        finally:
            await gw.close()
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()
