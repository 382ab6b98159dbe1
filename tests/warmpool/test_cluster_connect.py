"""Connecting to a cluster whose first listed server swallows packets (a dead node's address: nothing refuses,
nothing answers), against real servers: a listening socket that never speaks, and the 3-node cluster."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from tests.cluster_helpers import NatsCluster
from warmpool import connect

# A 3-server cluster's elections and failovers are bounded in wall-clock time: run alone (tests/conftest.py).
pytestmark = pytest.mark.serial

DEADLINE_S = 3.0


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A URL whose TCP handshake completes (the kernel's backlog) and then nothing: no INFO ever comes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"nats://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    with NatsCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def test_each_attempt_gets_a_share_of_the_deadline() -> None:
    opts = connect.NatsOptions(servers=("a", "b", "c"), connect_deadline_s=6.0)
    assert connect.attempt_timeout_s(opts) == 2.0
    assert connect.attempt_timeout_s(connect.NatsOptions(connect_deadline_s=6.0)) == 6.0
    assert connect.attempt_timeout_s(connect.NatsOptions(servers=("a",) * 10)) == connect.MIN_ATTEMPT_S


async def test_a_silent_first_server_leaves_time_for_the_others(silent_server: str, cluster: NatsCluster) -> None:
    """Before: the one attempt on the silent server took the whole deadline and the connection failed."""
    opts = connect.NatsOptions(
        servers=(silent_server, *cluster.urls), connect_deadline_s=DEADLINE_S, extra={"dont_randomize": True}
    )
    t0 = time.monotonic()
    nc = await connect.connect(opts)
    try:
        assert nc.connected_url is not None and nc.connected_url.netloc != silent_server.removeprefix("nats://")
        assert time.monotonic() - t0 < DEADLINE_S
        assert (await nc.jetstream().account_info()).streams == 0  # a working connection to the cluster
    finally:
        await nc.close()
