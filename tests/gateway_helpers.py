"""What the gateway and load generator tests share: a real stdlib HTTP upstream (an engine stand-in whose answers a
test holds, streams or breaks), ready slots written to the real `pulse_slots`, a gateway in process, and a
collector of the gateway's real queue samples that checks the contract on every one."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
from nats.aio.client import Client

from gateway.proxy import Gateway, GatewaySettings
from warmpool import connect, protocol
from warmpool.protocol import ScaledObjectSpec, ScalerRecord, SlotRecord
from warmpool.registry import KvSlotStore, ensure_buckets

MODEL = "tiny"


class Upstream:
    """An OpenAI-style upstream on 127.0.0.1. `mode`: ``ok`` answers at once (or when `hold` is set, if
    `holding`); ``stream`` sends a chunked answer, and with `break_stream` cuts the connection after the first
    chunk. `received` counts requests."""

    def __init__(self, name: str, *, mode: str = "ok", holding: bool = False, break_stream: bool = False) -> None:
        self.name = name
        self.mode = mode
        self.holding = holding
        self.break_stream = break_stream
        self.hold = threading.Event()
        self.received = 0
        self.answered = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

            def log_message(self, *_: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer._lock:
                    outer.received += 1
                if outer.holding:
                    outer.hold.wait(30)
                if outer.mode == "stream":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self._chunk(b"data: first\n\n")
                    if outer.break_stream:
                        self.connection.shutdown(socket.SHUT_RDWR)
                        self.close_connection = True
                        return
                    self._chunk(b"data: [DONE]\n\n")
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    data = json.dumps({"upstream": outer.name, "echo": json.loads(body or b"{}")}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                with outer._lock:
                    outer.answered += 1

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name=f"upstream-{name}", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


@asynccontextmanager
async def upstreams(*ups: Upstream) -> AsyncIterator[tuple[Upstream, ...]]:
    try:
        yield ups
    finally:
        for u in ups:
            await asyncio.to_thread(u.close)


async def set_slot(store: KvSlotStore, node: str, state: str, endpoint: str | None = None, model: str = MODEL) -> str:
    """Write slot ``<model>.<node>.s0`` as its agent would; its key."""
    rec = SlotRecord(model=model, node=node, slot="s0", state=state, endpoint=endpoint)  # type: ignore[arg-type]
    await store.register(rec)
    return rec.key


async def put_scaler(nc: Client, model: str) -> str:
    """Publish a ScaledObject for `model` in `pulse_scalers` as the operator would; its key."""
    raw = {
        "scaleTargetRef": {"name": model},
        "triggers": [{"type": "gateway-queue", "metadata": {"model": model}}],
    }
    spec = protocol.decode(msgspec.json.encode(raw), ScaledObjectSpec)
    rec = ScalerRecord(namespace="test", name=model, spec=spec)
    kv = (await ensure_buckets(nc.jetstream(), names=[protocol.SCALERS_BUCKET]))[protocol.SCALERS_BUCKET]
    await kv.put(rec.key, protocol.encode(rec))
    return rec.key


async def delete_scaler(nc: Client, key: str) -> None:
    kv = await nc.jetstream().key_value(protocol.SCALERS_BUCKET)
    await kv.delete(key)


@dataclass
class Samples:
    """The gateway's samples of one model, checked against the contract as they arrive: seq + 1 each time,
    counters never lower, the accounting never off."""

    got: list[protocol.QueueSample] = field(default_factory=list)
    received_at: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, s: protocol.QueueSample, at: float) -> None:
        if self.got:
            last = self.got[-1]
            if s.seq != last.seq + 1:
                self.errors.append(f"seq {last.seq} -> {s.seq}")
            for f in ("arrivals_total", "completions_total", "timeouts_total"):
                if getattr(s, f) < getattr(last, f):
                    self.errors.append(f"{f} went down: {getattr(last, f)} -> {getattr(s, f)}")
        if s.arrivals_total < s.queue_depth + s.inflight + s.completions_total + s.timeouts_total:
            self.errors.append(f"more requests accounted than arrived: {s}")
        self.got.append(s)
        self.received_at.append(at)

    @property
    def last(self) -> protocol.QueueSample | None:
        return self.got[-1] if self.got else None


@asynccontextmanager
async def samples_of(nc: Client, model: str = MODEL) -> AsyncIterator[Samples]:
    out = Samples()
    loop = asyncio.get_running_loop()

    async def on_msg(msg: Any) -> None:
        out.add(protocol.decode(msg.data, protocol.QueueSample), loop.time())

    sub = await nc.subscribe(protocol.queue_subject(model), cb=on_msg)
    try:
        yield out
    finally:
        await sub.unsubscribe()
    assert out.errors == [], out.errors


@asynccontextmanager
async def running_gateway(nc: Client, url: str, **overrides: Any) -> AsyncIterator[Gateway]:
    """A gateway in process on a free port, serving `MODEL` (``--models tiny``) unless `overrides` say otherwise
    (``models=None``: the models of `pulse_scalers` and of ready slots)."""
    overrides.setdefault("models", frozenset({MODEL}))
    settings = GatewaySettings(nats=connect.NatsOptions(servers=(url,)), port=0, gateway_id="gw-test", **overrides)
    gw = Gateway(settings, nc)
    await gw.start()
    try:
        await asyncio.wait_for(gw.routes.listed.wait(), 15)
        yield gw
    finally:
        await gw.close()
