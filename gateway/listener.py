"""An HTTP listener a client cannot exhaust by holding connections: a connection cap and a header-read timeout in front
of aiohttp's request handling.

aiohttp's server has neither: it accepts every connection, and one that never completes its request head is held
for the handler's keep-alive timeout (an hour by default), so 1,200 half-open connections stayed held. `GuardedSite`
serves an `AppRunner` like `web.TCPSite`, but each connection's protocol is wrapped:

- with `max_connections` open on this listener, a new one is answered ``503 too_many_connections`` and closed (a
  client that already sent its request may see the close as a reset instead);
- a connection whose first request head is not complete within `header_timeout_s` is answered
  ``408 header_timeout`` and closed. Later requests on a kept-alive connection are bounded by the runner's
  `keepalive_timeout` instead, which closes a connection with no complete head that long after its last answer.

A head is complete when aiohttp makes the request of it (the runner's `request_factory`, wrapped here), so the
timer never runs while a request is being answered. Each refusal goes to `on_refused` (also a head aiohttp's
parser refused, which aiohttp answers 400); the count of open connections to `on_count`. One site per runner:
the site wraps its runner's request factory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

import aiohttp.web_protocol
from aiohttp import StreamReader, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import RawRequestMessage

from gateway.errors import Reason, Refused, raw_response

__all__ = ["GuardedSite"]

_UNPARSED: RawRequestMessage | None = getattr(aiohttp.web_protocol, "ERROR", None)
"""The request aiohttp makes of a head its parser refused (it answers 400 and closes); None in an aiohttp without
it, where such refusals go uncounted."""


class GuardedSite(web.BaseSite):
    """A TCP site with a connection cap and a header-read timeout (module doc)."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        max_connections: int,
        header_timeout_s: float,
        on_refused: Callable[[Reason], None] = lambda _: None,
        on_count: Callable[[int], None] = lambda _: None,
        backlog: int = 128,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        server = runner.server
        assert server is not None, "set the runner up first"
        self._host, self._port = host, port
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self._on_refused, self._on_count = on_refused, on_count
        self._handlers = server
        self._open: dict[web.RequestHandler, _Connection] = {}
        self.bound_port: int | None = None
        first = server.request_factory

        def request_factory(
            message: RawRequestMessage,
            payload: StreamReader,
            protocol: web.RequestHandler,
            writer: AbstractStreamWriter,
            task: asyncio.Task[None],
        ) -> web.BaseRequest:
            conn = self._open.get(protocol)
            if conn is not None:
                conn.head_arrived()
            if message is _UNPARSED:
                self._on_refused("malformed_request")
            return first(message, payload, protocol, writer, task)

        server.request_factory = request_factory

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.bound_port or self._port}"

    @property
    def connections(self) -> int:
        return len(self._open)

    async def start(self) -> None:
        await super().start()
        server = await asyncio.get_running_loop().create_server(
            lambda: _Connection(self, self._handlers()), self._host, self._port, backlog=self._backlog
        )
        self._server = server
        self.bound_port = int(server.sockets[0].getsockname()[1]) if server.sockets else self._port

    # --- called by the connections ---------------------------------------------------------------------------

    def _admit(self, conn: _Connection) -> bool:
        if len(self._open) >= self.max_connections:
            self._refuse(
                conn.transport,
                Refused(
                    503,
                    "too_many_connections",
                    f"this gateway holds {self.max_connections} connections, its limit; retry shortly",
                    retry_after_s=1,
                ),
            )
            return False
        self._open[conn.handler] = conn
        self._on_count(len(self._open))
        return True

    def _lost(self, conn: _Connection) -> None:
        if self._open.pop(conn.handler, None) is not None:
            self._on_count(len(self._open))

    def _refuse(self, transport: asyncio.Transport, refusal: Refused) -> None:
        self._on_refused(refusal.reason)
        if not transport.is_closing():
            transport.write(raw_response(refusal))
            transport.close()


class _Connection(asyncio.Protocol):
    """aiohttp's handler of one connection, admitted by `site` and timed until its first request head."""

    def __init__(self, site: GuardedSite, handler: web.RequestHandler) -> None:
        self.site = site
        self.handler = handler
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self._admitted = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        if not self.site._admit(self):
            return
        self._admitted = True
        self._timer = asyncio.get_running_loop().call_later(self.site.header_timeout_s, self._head_late)
        self.handler.connection_made(transport)

    def head_arrived(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_late(self) -> None:
        self._timer = None
        timeout = self.site.header_timeout_s
        self.site._refuse(
            self.transport,
            Refused(408, "header_timeout", f"no complete request head within {timeout:g} s of connecting"),
        )

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            self.handler.data_received(data)

    def eof_received(self) -> None:
        if self._admitted:
            self.handler.eof_received()

    def pause_writing(self) -> None:
        if self._admitted:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.head_arrived()  # cancels the timer
        if self._admitted:
            self._admitted = False
            self.site._lost(self)
            self.handler.connection_lost(exc)
