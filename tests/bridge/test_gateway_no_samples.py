"""``pulsescale gateway --no-samples``: the gateway's switch for a model whose demand the bridge publishes (the
autoscaler adds every gateway's demand up, so both publishing would count each request twice). A real gateway
process on a real nats-server: with the flag it serves (its /healthz answers, its queue is there) and publishes no
sample; without it, the same gateway publishes its queue every 100 ms."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from nats.aio.client import Client

from warmpool import protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.protocol import QueueSample
from warmpool.registry import ensure_buckets

MODEL = "m"


@contextlib.asynccontextmanager
async def gateway(nats_url: str, *flags: str) -> AsyncIterator[dict[str, object]]:
    """A `pulsescale gateway` process serving `MODEL`, once its /healthz answers; its health. It logs warnings only,
    to a pipe read when it exits early."""
    port = free_port()
    argv = [sys.executable, "-m", "pulsescale", "gateway", "--nats", nats_url, "--listen", f"127.0.0.1:{port}",
            "--models", MODEL, "--log-level", "WARNING", *flags]  # fmt: skip
    pipe = asyncio.subprocess
    proc = await asyncio.create_subprocess_exec(*argv, stdout=pipe.DEVNULL, stderr=pipe.PIPE)
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 30
            while True:
                if proc.returncode is not None:
                    assert proc.stderr is not None
                    pytest.fail(f"the gateway exited with {proc.returncode}: {(await proc.stderr.read()).decode()}")
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.get(f"http://127.0.0.1:{port}/healthz") as r:
                        if r.status == 200:
                            health = await r.json()
                            break
                assert time.monotonic() < deadline, "the gateway did not answer /healthz within 30 s"
                await asyncio.sleep(0.1)
        yield health
    finally:
        if proc.returncode is None:
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def samples_within(nc: Client, seconds: float) -> list[QueueSample]:
    got: list[QueueSample] = []

    async def on_sample(msg) -> None:  # type: ignore[no-untyped-def]
        got.append(protocol.decode(msg.data, QueueSample))

    sub = await nc.subscribe(protocol.queue_subject(MODEL), cb=on_sample)
    await asyncio.sleep(seconds)
    await sub.unsubscribe()
    return got


@pytest.mark.slow
async def test_a_gateway_with_no_samples_serves_and_publishes_nothing_and_without_it_publishes(
    nats_server: NatsServer, nc: Client
) -> None:
    await ensure_buckets(nc.jetstream())  # the gateway answers /healthz once it has read pulse_slots and assignments
    async with gateway(nats_server.url, "--no-samples") as health:
        assert health["models"] == {MODEL: {"ready": 0, "queue_depth": 0, "inflight": 0}}, health
        assert await samples_within(nc, 1.0) == []
    async with gateway(nats_server.url):
        got = await samples_within(nc, 1.0)
    assert len(got) >= 5 and {s.model for s in got} == {MODEL}, got  # every 100 ms, so the test can fail
