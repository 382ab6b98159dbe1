"""A thread of its own, with its own event loop and NATS connection, where the shard leases are renewed.

On the daemon's loop a renewal's answer waited behind whatever ran there: a sample burst, a takeover's adoption, a
scrape, a stuck handler. Past the fence (`ShardSettings.stop_fraction` of the lease) the shard was lost although
the broker had answered in time. Here the keepers (`ShardTerms._keeper`, and `CompatLeader._keeper` for the leader
lease of the holder of shard 0) run on a loop nothing else uses, over a connection nothing else uses, so a renewal
waits for its own round trip and, at worst, for the interpreter to hand this thread the GIL (every switch interval,
5 ms, while the daemon's thread computes; a blocking call of the daemon's that releases the GIL, as `time.sleep`
does, costs it nothing).

Only the renewal writes happen here. Whatever changes the daemon's state (a lost term's `on_lost`, the leases'
view) is handed back to the daemon's loop with `on_main`. The daemon starts one (`start`) and closes it after the
shards are resigned (`close`).

Renewing from here must not outlive the daemon's ability to act: a loop wedged for good (a stuck handler, a
deadlock) or a main connection that is down would keep its shards, their models decided by no one, until a
liveness probe restarted the pod. So this thread asks the daemon's loop for a turn every `PING_S`
(`main_stalled_s`: how long since one was had with `main_ok` true), and the keepers stop renewing once that is past
`ShardSettings.main_lost_after_s`: the leases lapse and another replica takes the shards.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

from nats.aio.client import Client
from nats.js.kv import KeyValue

from warmpool import connect, protocol

__all__ = ["LeaseRenewer"]

log = logging.getLogger("pulsescale.shards")

T = TypeVar("T")

PING_S: Final = 0.25
"""How often the renewals' thread asks the daemon's loop for a turn (`main_stalled_s`): a call_soon_threadsafe of
a one-line callback, nothing the daemon's loop notices."""


class LeaseRenewer:
    """The renewals' thread, loop, connection and `kv` (KV `pulse_leases` on that connection)."""

    def __init__(
        self, options: connect.NatsOptions, *, kv_timeout_s: float, main_ok: Callable[[], bool] | None = None
    ) -> None:
        """`options` are the daemon's (the connection is named ``<name>-leases``); `kv_timeout_s` bounds each lease
        write, as the daemon's own lease rounds are bounded. `main_ok`, called on the daemon's loop: whether the
        daemon can act (its own NATS connection is up); None: always."""
        self.options = options
        self.kv_timeout_s = kv_timeout_s
        self.main_ok = main_ok
        self._main_heard = time.monotonic()  # when the daemon's loop last had a turn with `main_ok` true
        self.kv: KeyValue | None = None
        self._nc: Client | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None  # set on the renewals' loop by `close`
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        """Start the thread and connect there; raise what the connection raised (`connect.connect`'s errors)."""
        self._main = asyncio.get_running_loop()
        started: asyncio.Future[None] = self._main.create_future()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="pulsescale-lease-renewals", daemon=True
        )
        self._thread.start()
        await started

    def _run(self, started: asyncio.Future[None]) -> None:
        try:
            asyncio.run(self._serve(started))
        except BaseException as err:
            if not self._settle(started, err):
                log.exception("the lease renewals' thread ended")

    def _settle(self, started: asyncio.Future[None], err: BaseException | None) -> bool:
        """Answer `start` from this thread; False when it was answered already."""
        if started.done() or self._main is None or self._main.is_closed():
            return False

        def settle() -> None:
            if not started.done():
                started.set_exception(err) if err is not None else started.set_result(None)

        self._main.call_soon_threadsafe(settle)
        return True

    async def _serve(self, started: asyncio.Future[None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        opts = self.options
        self._nc = await connect.connect(dataclasses.replace(opts, name=f"{opts.name}-leases"))
        try:
            self.kv = await self._nc.jetstream(timeout=self.kv_timeout_s).key_value(protocol.LEASES_BUCKET)
            self._main_heard = time.monotonic()
            self._settle(started, None)
            ping = asyncio.create_task(self._ping_main(), name="pulsescale-lease-ping")
            try:
                await self._stop.wait()
            finally:
                ping.cancel()
        finally:
            with contextlib.suppress(Exception):
                await self._nc.close()

    async def _ping_main(self) -> None:
        while True:
            self.on_main(self._heard)
            await asyncio.sleep(PING_S)

    def _heard(self) -> None:
        """On the daemon's loop: a turn was had (and the daemon can act)."""
        if self.main_ok is None or self.main_ok():
            self._main_heard = time.monotonic()

    def main_stalled_s(self) -> float:
        """Seconds since the daemon's loop last had a turn with `main_ok` true (about `PING_S` when all is well)."""
        return time.monotonic() - self._main_heard

    @property
    def running(self) -> bool:
        return self._loop is not None and self._thread is not None and self._thread.is_alive()

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the renewals' loop (soon; from any thread). Dropped once the thread has ended."""
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed in between
                self._loop.call_soon_threadsafe(fn, *args)

    def on_main(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the daemon's loop (soon; from the renewals' thread)."""
        if self._main is not None and not self._main.is_closed():
            with contextlib.suppress(RuntimeError):
                self._main.call_soon_threadsafe(fn, *args)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T | None:
        """Run `coro` on the renewals' loop and wait for it from the daemon's; None (and `coro` closed) when the
        thread has ended."""
        if not self.running or self._loop is None:
            coro.close()
            return None
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def close(self) -> None:
        """End the thread (its connection closed) and wait for it, off the daemon's loop."""
        if self._stop is not None:
            self.call(self._stop.set)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
