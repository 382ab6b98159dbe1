"""What the bridge tests share: a vLLM-shaped engine page served on loopback (an aiohttp server whose figures a test
sets, rendered by prometheus_client as vLLM renders its own), a double of the Prometheus HTTP query API, a bridge in
process, and a collector of the bridge's real queue samples that checks the contract on each."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from nats.aio.client import Client
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from bridge.daemon import Bridge
from bridge.settings import BridgeSettings
from warmpool import connect, protocol

FAST = {
    "scrape_every_s": 0.1,
    "stale_after_s": 0.5,
    "query_every_s": 0.1,
    "query_stale_after_s": 0.5,
    "timeout_s": 0.3,
}
"""Test periods: a tenth of a second, so a staleness bound passes in half a second."""


class Engine:
    """An engine's ``/metrics`` on 127.0.0.1, with vLLM's three families and labels (``model_name``, ``engine``;
    ``finished_reason`` on the counter). `mode` breaks it: ``ok``, ``html`` (an error page with 200), ``status``
    (HTTP 500), ``slow`` (answers after `slow_s`), ``garbage`` (bytes that are not text)."""

    def __init__(self, *, served: str = "tiny") -> None:
        self.served = served
        self.mode = "ok"
        self.slow_s = 2.0
        self.hits = 0
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self._waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", labels, registry=self.registry)
        self._running = Gauge("vllm:num_requests_running", "Requests running", labels, registry=self.registry)
        self._success = Counter(
            "vllm:request_success", "Finished requests", [*labels, "finished_reason"], registry=self.registry
        )
        self.extra = ""
        """Text appended to the page (a NaN gauge, another model)."""
        self._runner: web.AppRunner | None = None
        self.port = 0

    def set(self, waiting: float, running: float, finished: int | None = None, *, model: str | None = None,
            engine: str = "0") -> None:  # fmt: skip
        """The figures of `model` (default: `served`) on data-parallel engine `engine`; `finished` is where the
        ``stop`` counter stands (it only rises, as a counter; a lower value needs `restart_counters`)."""
        name = model or self.served
        self._waiting.labels(name, engine).set(waiting)
        self._running.labels(name, engine).set(running)
        if finished is not None:
            child = self._success.labels(name, engine, "stop")
            child.inc(finished - child._value.get())

    def restart_counters(self) -> None:
        """The engine restarted: its counters start from zero again."""
        self.registry.unregister(self._success)
        self._success = Counter(
            "vllm:request_success",
            "Finished requests",
            ["model_name", "engine", "finished_reason"],
            registry=self.registry,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def page(self, _: web.Request) -> web.Response:
        self.hits += 1
        if self.mode == "slow":
            await asyncio.sleep(self.slow_s)
        if self.mode == "html":
            return web.Response(text="<html><body>502 Bad Gateway</body></html>", content_type="text/html")
        if self.mode == "status":
            return web.Response(status=500, text="internal error")
        if self.mode == "garbage":
            return web.Response(body=b"\xff\xfe\x00binary", content_type="application/octet-stream")
        body = generate_latest(self.registry).decode() + self.extra
        return web.Response(text=body, content_type="text/plain")

    async def start(self) -> Engine:
        app = web.Application()
        app.add_routes([web.get("/metrics", self.page)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        """The endpoint goes away: nothing listens on its port any more (`start` again serves on the same one)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


@asynccontextmanager
async def engines(*es: Engine) -> AsyncIterator[tuple[Engine, ...]]:
    try:
        for e in es:
            await e.start()
        yield es
    finally:
        for e in es:
            await e.stop()


class PrometheusDouble:
    """A protocol-level double of a Prometheus server's ``GET /api/v1/query`` (not a Prometheus): each query string
    gets the answer `answers` holds for it, shaped as the real API's JSON."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[int, Any]] = {}
        self.asked: list[str] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    def vector(self, query: str, *values: str) -> None:
        """`query` returns one series per value (``"3"``, ``"NaN"``, ``"+Inf"``: the API writes numbers as strings)."""
        result = [{"metric": {"i": str(i)}, "value": [1.7e9, v]} for i, v in enumerate(values)]
        self.answers[query] = (200, {"status": "success", "data": {"resultType": "vector", "result": result}})

    def error(self, query: str, message: str = "parse error at char 4") -> None:
        self.answers[query] = (400, {"status": "error", "errorType": "bad_data", "error": message})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def query(self, request: web.Request) -> web.Response:
        q = request.query.get("query", "")
        self.asked.append(q)
        status, doc = self.answers.get(q, (200, {"status": "success", "data": {"resultType": "vector", "result": []}}))
        return web.Response(status=status, text=json.dumps(doc), content_type="application/json")

    async def start(self) -> PrometheusDouble:
        app = web.Application()
        app.add_routes([web.get("/api/v1/query", self.query)])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@dataclass
class Samples:
    """One model's samples from the bridge, checked as they arrive: one gateway id; within a run of samples `seq`
    rises by one (a new run, after the model was stale, starts at 1); the counters never go down, ever."""

    got: list[protocol.QueueSample] = field(default_factory=list)
    received_at: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, s: protocol.QueueSample, at: float) -> None:
        if self.got:
            last = self.got[-1]
            if s.gateway != last.gateway:
                self.errors.append(f"gateway {last.gateway} -> {s.gateway}")
            if s.seq != last.seq + 1 and s.seq != 1:
                self.errors.append(f"seq {last.seq} -> {s.seq}")
            for f in ("arrivals_total", "completions_total", "timeouts_total"):
                if getattr(s, f) < getattr(last, f):
                    self.errors.append(f"{f} went down: {getattr(last, f)} -> {getattr(s, f)}")
        self.got.append(s)
        self.received_at.append(at)

    @property
    def last(self) -> protocol.QueueSample | None:
        return self.got[-1] if self.got else None

    def since(self, t: float) -> list[protocol.QueueSample]:
        return [s for s, at in zip(self.got, self.received_at, strict=True) if at >= t]


@asynccontextmanager
async def samples_of(nc: Client, model: str) -> AsyncIterator[Samples]:
    out = Samples()
    loop = asyncio.get_running_loop()

    async def on_msg(msg: Any) -> None:
        out.add(protocol.decode(msg.data, protocol.QueueSample), loop.time())

    sub = await nc.subscribe(protocol.queue_subject(model), cb=on_msg)
    try:
        yield out
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    assert out.errors == [], out.errors


@asynccontextmanager
async def running_bridge(nc: Client, url: str, **overrides: Any) -> AsyncIterator[Bridge]:
    """A bridge in process with the test periods (`FAST`) unless `overrides` say otherwise."""
    settings = BridgeSettings(
        nats=connect.NatsOptions(servers=(url,)), port=0, gateway_id="bridge-test", **{**FAST, **overrides}
    )
    bridge = Bridge(settings, nc)
    await bridge.start()
    try:
        yield bridge
        assert bridge.crashed() is None
    finally:
        await bridge.close()


def errors(bridge: Bridge, source: str, reason: str) -> float:
    value = bridge.metrics.registry.get_sample_value(
        "pulsescale_bridge_errors_total", {"source": source, "reason": reason}
    )
    return value or 0.0


def gauge(bridge: Bridge, name: str, model: str) -> float | None:
    return bridge.metrics.registry.get_sample_value(name, {"model": model})


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
