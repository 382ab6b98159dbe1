"""`warmpool.daemonstart.serve_until_stopped`: the gateway's and the bridge's ``run``, against a real nats-server."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client

from warmpool import connect, daemonstart
from warmpool.embedded import NatsServer


class _Service:
    """A service with nothing to serve: records what was done to it, crashes when told."""

    def __init__(self, nc: Client, events: list[str], *, fail_start: bool = False) -> None:
        self.nc = nc
        self.events = events
        self.fail_start = fail_start
        self.crash: BaseException | None = None

    async def start(self) -> None:
        self.events.append("start")
        if self.fail_start:
            raise RuntimeError("cannot listen")

    async def close(self) -> None:
        self.events.append("close")

    def crashed(self) -> BaseException | None:
        return self.crash


def _opts(server: NatsServer) -> connect.NatsOptions:
    return connect.NatsOptions(servers=(server.url,), name="pytest-daemonstart")


async def test_serves_until_stop_then_closes_and_drains(nats_server: NatsServer) -> None:
    events: list[str] = []
    made: list[_Service] = []
    stop, ready = asyncio.Event(), asyncio.Event()

    def make(nc: Client) -> _Service:
        made.append(_Service(nc, events))
        return made[0]

    def started(service: _Service) -> None:
        assert service is made[0] and not ready.is_set()  # on_started first, then ready
        events.append("on_started")

    task = asyncio.create_task(
        daemonstart.serve_until_stopped(_opts(nats_server), make, stop, ready=ready, on_started=started)
    )
    await asyncio.wait_for(ready.wait(), 10)
    assert events == ["start", "on_started"] and made[0].nc.is_connected
    stop.set()
    await asyncio.wait_for(task, 10)
    assert events == ["start", "on_started", "close"]
    assert made[0].nc.is_closed  # drained


async def test_a_crashed_task_is_raised_after_close(nats_server: NatsServer) -> None:
    events: list[str] = []
    made: list[_Service] = []
    ready = asyncio.Event()

    def make(nc: Client) -> _Service:
        made.append(_Service(nc, events))
        return made[0]

    task = asyncio.create_task(
        daemonstart.serve_until_stopped(_opts(nats_server), make, asyncio.Event(), ready=ready, check_every_s=0.05)
    )
    await asyncio.wait_for(ready.wait(), 10)
    made[0].crash = ValueError("the publisher died")
    with pytest.raises(ValueError, match="the publisher died"):
        await asyncio.wait_for(task, 10)
    assert events == ["start", "close"] and made[0].nc.is_closed


async def test_a_failed_start_leaves_as_raised_not_ready(nats_server: NatsServer) -> None:
    # The service cleans up after a failed start itself (`Service.start`): it is not closed again.
    events: list[str] = []
    made: list[_Service] = []
    ready = asyncio.Event()

    def make(nc: Client) -> _Service:
        made.append(_Service(nc, events, fail_start=True))
        return made[0]

    with pytest.raises(RuntimeError, match="cannot listen"):
        await asyncio.wait_for(
            daemonstart.serve_until_stopped(_opts(nats_server), make, asyncio.Event(), ready=ready), 10
        )
    assert events == ["start"] and not ready.is_set() and made[0].nc.is_closed
