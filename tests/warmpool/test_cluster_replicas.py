"""How many replicas the registry's buckets get: detected (1 on a single server, 3 on a cluster), or set by
``PULSESCALE_KV_REPLICAS`` / ``pulsescale autoscaler --kv-replicas``; a bucket with fewer than asked is raised by
the autoscaler and reported by everyone else; a count the servers cannot place is a named error. Real servers:
the conftest's single nats-server, and the 3-node cluster of `tests.cluster_helpers`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client

from tests.cluster_helpers import CLUSTER_SIZE, NatsCluster, first_put
from tests.helpers import wait_for
from warmpool import buckets, connect, protocol, registry
from warmpool.embedded import NatsServer, find_nats_server, free_port
from warmpool.errors import NatsUnavailable
from warmpool.registry import BucketSettings, KvReplicasError, ensure_buckets

# A 3-server cluster's elections and failovers are bounded in wall-clock time: run alone (tests/conftest.py).
pytestmark = pytest.mark.serial


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    with NatsCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


@pytest.fixture(autouse=True)
def no_replicas_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(registry.KV_REPLICAS_ENV, raising=False)


async def replicas(nc: Client) -> dict[str, int]:
    """Replicas of each bucket that exists."""
    js, out = nc.jetstream(), {}
    for bucket in protocol.BUCKETS:
        try:
            out[bucket] = (await js.stream_info(f"KV_{bucket}")).config.num_replicas or 1
        except nats.js.errors.NotFoundError:
            pass
    return out


def autoscaler_proc(url: str, *flags: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != registry.KV_REPLICAS_ENV}
    return subprocess.Popen(
        [sys.executable, "-m", "pulsescale", "autoscaler", "--nats", url, "--log-level", "WARNING", *flags],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


async def test_a_single_server_gets_one_replica(nc: Client) -> None:
    await ensure_buckets(nc.jetstream(), harden=True)
    assert set((await replicas(nc)).values()) == {1}


async def test_a_cluster_gets_three_replicas_and_buckets_that_take_writes_at_once(cluster: NatsCluster) -> None:
    nc = await connect.connect(connect.NatsOptions(servers=tuple(cluster.urls)))
    try:
        kv = await ensure_buckets(nc.jetstream(timeout=10.0))  # a replicated create with fsync: generous on CI
        # Straight after creation (each new bucket's stream leader is waited for).
        assert await first_put(kv[protocol.AGENTS_BUCKET], "n", b"x") > 0
        assert set((await replicas(nc)).values()) == {CLUSTER_SIZE}
    finally:
        await nc.close()


async def test_the_environment_and_the_settings_choose(cluster: NatsCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    nc = await connect.connect(connect.NatsOptions(servers=tuple(cluster.urls)))
    try:
        monkeypatch.setenv(registry.KV_REPLICAS_ENV, "1")
        await ensure_buckets(nc.jetstream(), names=[protocol.SLOTS_BUCKET])
        assert registry.replicas_for(nc, BucketSettings(replicas=2)) == 2  # the settings win over the environment
        await ensure_buckets(nc.jetstream(), BucketSettings(replicas=2), names=[protocol.AGENTS_BUCKET])
        got = await replicas(nc)
        assert (got[protocol.SLOTS_BUCKET], got[protocol.AGENTS_BUCKET]) == (1, 2)
    finally:
        await nc.close()


@pytest.mark.parametrize("text", ["0", "6", "three", "1.5"])
def test_a_bad_count_names_the_variable_and_the_range(text: str) -> None:
    with pytest.raises(KvReplicasError, match=rf"{registry.KV_REPLICAS_ENV}='{text}'.*from 1 to 5"):
        registry.parse_replicas(text)


async def test_more_replicas_than_servers_is_a_named_error(nc: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.KV_REPLICAS_ENV, "3")
    with pytest.raises(KvReplicasError, match=r"pulse_slots with 3 replicas.*--kv-replicas"):
        await ensure_buckets(nc.jetstream(), names=[protocol.SLOTS_BUCKET])


async def test_a_bucket_with_fewer_replicas_is_reported_then_raised_by_the_autoscaler(
    cluster: NatsCluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    nc = await connect.connect(connect.NatsOptions(servers=tuple(cluster.urls)))
    try:
        monkeypatch.setenv(registry.KV_REPLICAS_ENV, "1")  # e.g. made before the cluster grew to three servers
        kv = (await ensure_buckets(nc.jetstream(), names=[protocol.SLOTS_BUCKET]))[protocol.SLOTS_BUCKET]
        rev = await first_put(kv, "m.n.s0", b"kept")
        monkeypatch.delenv(registry.KV_REPLICAS_ENV)
        with caplog.at_level(logging.WARNING, logger="pulsescale.registry"):
            await ensure_buckets(nc.jetstream(), names=[protocol.SLOTS_BUCKET])  # a role that may not update
        assert "bucket pulse_slots has 1 replica(s), 3 asked" in caplog.text
        assert (await replicas(nc))[protocol.SLOTS_BUCKET] == 1
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pulsescale.registry"):
            await ensure_buckets(nc.jetstream(), names=[protocol.SLOTS_BUCKET], harden=True)  # the autoscaler
        assert "bucket pulse_slots had 1 replica(s): raised to 3" in caplog.text
        assert (await replicas(nc))[protocol.SLOTS_BUCKET] == CLUSTER_SIZE
        entry = await kv.get("m.n.s0")
        assert (entry.value, entry.revision) == (b"kept", rev)
    finally:
        await nc.close()


async def test_the_autoscaler_flag_sets_the_replicas_of_what_it_creates(cluster: NatsCluster) -> None:
    proc = autoscaler_proc(cluster.url, "--kv-replicas", "1")
    nc = await connect.connect(connect.NatsOptions(servers=tuple(cluster.urls)))
    try:

        async def made() -> bool:
            try:
                return len(await replicas(nc)) == len(protocol.BUCKETS)  # every bucket, whichever it makes last
            except (TimeoutError, nats.errors.Error):
                return False

        await wait_for(made, what="the autoscaler to create its buckets")
        assert await replicas(nc) == dict.fromkeys(protocol.BUCKETS, 1)
    finally:
        await nc.close()
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err.decode()


async def test_a_cluster_still_electing_its_meta_leader_is_waited_for(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Deployed together, the autoscaler may open the buckets before the servers have elected a meta leader, while
    every JetStream request times out: it asks again (with a warning, when it had to) instead of dying."""
    c = NatsCluster(tmp_path_factory.mktemp("electing"))
    try:
        for s in c.servers:
            s.launch()
        for s in c.servers:
            s.wait_ready(30)  # serving clients; JetStream still electing
        nc = await connect.connect(connect.NatsOptions(servers=tuple(c.urls)))
        try:
            with caplog.at_level(logging.WARNING, logger="pulsescale.registry"):
                await ensure_buckets(nc.jetstream(timeout=1.0), harden=True)
            assert set((await replicas(nc)).values()) == {CLUSTER_SIZE}
            assert len(await replicas(nc)) == len(protocol.BUCKETS)
        finally:
            await nc.close()
    finally:
        c.stop()


async def _refused_at_once(url: str, match: str) -> None:
    """Opening the buckets at `url` is a `NatsUnavailable` matching `match`, without waiting for JetStream."""
    nc = await connect.connect(connect.NatsOptions(servers=(url,)))
    try:
        t0 = time.monotonic()
        with pytest.raises(NatsUnavailable, match=match):
            await ensure_buckets(nc.jetstream(timeout=1.0))
        assert time.monotonic() - t0 < buckets.JETSTREAM_WAIT_S / 2, "waited for a JetStream that is not there"
    finally:
        await nc.close()


def _server_without_jetstream(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([find_nats_server(), "-a", "127.0.0.1", "-p", str(port)], stderr=subprocess.DEVNULL)


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


async def test_a_server_without_jetstream_is_a_named_error_at_once() -> None:
    port = free_port()
    proc = _server_without_jetstream(port)
    try:
        await wait_for(lambda: _accepts(port), 10, "the server without JetStream to listen")
        await _refused_at_once(f"nats://127.0.0.1:{port}", r"JetStream enabled \(-js\)")
    finally:
        proc.kill()
        proc.wait()


async def test_an_account_without_jetstream_is_a_named_error_at_once(tmp_path_factory: pytest.TempPathFactory) -> None:
    accounts = (
        "accounts {\n"
        "  WITH: { jetstream: enabled, users: [{user: a, password: a}] }\n"
        "  WITHOUT: { users: [{user: b, password: b}] }\n"
        "}\n"
    )
    server = NatsServer(tmp_path_factory.mktemp("accounts"), extra_config=accounts, monitor_port=None).start()
    try:
        await _refused_at_once(f"nats://b:b@127.0.0.1:{server.port}", "not enabled for account")
    finally:
        server.stop()


async def test_a_third_server_joining_during_the_create_gets_the_bucket_three_replicas(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A cluster places on a peer only once it has heard from it (CI once got 2 replicas of 3 on a cluster that
    had just formed): the detected count is asked again for `PLACEMENT_SETTLE_S` before it comes down. Here a
    cluster of two is scaled to three while the bucket is being made."""
    with NatsCluster(tmp_path_factory.mktemp("grow"), size=2) as pair:
        nc = await connect.connect(connect.NatsOptions(servers=tuple(pair.urls)))
        try:
            create = asyncio.create_task(ensure_buckets(nc.jetstream(timeout=5.0), names=[protocol.SLOTS_BUCKET]))
            await asyncio.sleep(0.5)
            assert not create.done(), "the create came down to what two servers hold without waiting"
            pair.join()
            await asyncio.wait_for(create, buckets.PLACEMENT_SETTLE_S + 10)
            assert (await replicas(nc))[protocol.SLOTS_BUCKET] == CLUSTER_SIZE
        finally:
            await nc.close()


async def test_a_cluster_of_two_gets_two_replicas_with_a_warning(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Detected replicas (3 on any cluster) come down to what the servers can place, said in a warning, once
    the placement has had its settling time (shortened here). (A server that is merely down does not count:
    JetStream places a bucket's third replica on it, and it catches up.)"""
    monkeypatch.setattr(buckets, "PLACEMENT_SETTLE_S", 1.0)
    with NatsCluster(tmp_path_factory.mktemp("pair"), size=2) as pair:
        nc = await connect.connect(connect.NatsOptions(servers=tuple(pair.urls)))
        try:
            with caplog.at_level(logging.WARNING, logger="pulsescale.registry"):
                await ensure_buckets(nc.jetstream(timeout=5.0), names=[protocol.SLOTS_BUCKET])
            assert (await replicas(nc))[protocol.SLOTS_BUCKET] == 2
            assert "bucket pulse_slots created with 2 replica(s), not 3" in caplog.text
        finally:
            await nc.close()
