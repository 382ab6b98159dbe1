"""`autoscaler.samples.SampleIngest` on a real nats-server: samples reach `take` from a thread of its own, in
first-arrival order and coalesced; unowned models are dropped before decoding; bad samples are rejected and the
ingest goes on; the reader is woken once per empty -> non-empty; stop() and a failed start() leave nothing behind."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from nats.aio.client import Client

from autoscaler.samples import Outcome, SampleBuffer, SampleIngest
from tests.helpers import wait_for
from tests.test_samples import _s
from warmpool import connect, protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.errors import BadMessage, NatsUnavailable


class Seen:
    """What the ingest reported, from its thread."""

    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.rejected: list[tuple[str, str]] = []
        self.wakes = 0

    def outcome(self, o: Outcome) -> None:
        self.outcomes[o] += 1

    def reject(self, err: BadMessage, subject: str) -> None:
        self.rejected.append((err.reason, subject))

    def wake(self) -> None:
        self.wakes += 1


def _ingest_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pulsescale-samples"]


@asynccontextmanager
async def ingesting(
    url: str, *, wants: Callable[[str], bool] = lambda model: True, capacity: int = 100_000
) -> AsyncIterator[tuple[SampleIngest, Seen]]:
    seen = Seen()
    ingest = SampleIngest(
        connect.NatsOptions(servers=(url,), name="t"),
        buffer=SampleBuffer(capacity),
        wants=wants,
        on_outcome=seen.outcome,
        on_reject=seen.reject,
        wake=seen.wake,
    )
    await ingest.start()
    try:
        yield ingest, seen
    finally:
        await ingest.stop()


async def _publish(nc: Client, *samples: tuple[str, str, int]) -> None:
    for gateway, model, seq in samples:
        await nc.publish(protocol.queue_subject(model), protocol.encode(_s(gateway, model, seq)))
    await nc.flush()


async def test_samples_reach_take_in_first_arrival_order_coalesced(nats_server: NatsServer, nc: Client) -> None:
    async with ingesting(nats_server.url) as (ingest, seen):
        await _publish(nc, ("g1", "a", 1), ("g2", "a", 1), ("g1", "b", 1), ("g1", "a", 2), ("g1", "a", 3))
        await wait_for(lambda: seen.outcomes["coalesced"] == 2, 5, "two samples coalesced")
        got = [(s.gateway, s.model, s.seq) for s, _ in ingest.take(10)]
        assert got == [("g1", "a", 3), ("g2", "a", 1), ("g1", "b", 1)]
        assert ingest.take(10) == []
        assert seen.wakes == 1


async def test_an_unowned_model_is_dropped_before_decoding(nats_server: NatsServer, nc: Client) -> None:
    async with ingesting(nats_server.url, wants=lambda model: model == "mine") as (ingest, seen):
        # Not even valid: an unowned model's sample is never decoded, so it is never a rejection either.
        await nc.publish(protocol.queue_subject("theirs"), b"not json")
        await _publish(nc, ("g1", "theirs", 1), ("g1", "mine", 1))
        await wait_for(lambda: len(ingest.buffer) == 1, 5, "the owned sample")
        assert seen.outcomes == {"not_owned": 2}
        assert seen.rejected == []
        assert [(s.model, s.seq) for s, _ in ingest.take(10)] == [("mine", 1)]


async def test_a_bad_sample_is_rejected_and_the_ingest_goes_on(nats_server: NatsServer, nc: Client) -> None:
    async with ingesting(nats_server.url) as (ingest, seen):
        await nc.publish(protocol.queue_subject("a"), b"not json")
        # Valid, but on another model's subject.
        await nc.publish(protocol.queue_subject("b"), protocol.encode(_s("g1", "a", 1)))
        await _publish(nc, ("g1", "a", 2))
        await wait_for(lambda: len(ingest.buffer) == 1, 5, "the good sample after the bad ones")
        assert seen.outcomes == {"rejected": 2}
        assert [subject for _, subject in seen.rejected] == ["pulse.queue.a", "pulse.queue.b"]
        assert seen.rejected[1][0] == "subject_mismatch"
        assert seen.rejected[0][0]  # named, whatever the decoder calls it
        assert [s.seq for s, _ in ingest.take(10)] == [2]


async def test_wake_once_per_empty_to_non_empty_not_per_sample(nats_server: NatsServer, nc: Client) -> None:
    async with ingesting(nats_server.url) as (ingest, seen):
        n = 5_000
        for i in range(n):
            await nc.publish(protocol.queue_subject(f"m{i % 50}"), protocol.encode(_s(f"g{i}", f"m{i % 50}", 1)))
        await nc.flush()
        await wait_for(lambda: len(ingest.buffer) == n, 20, f"{n} samples buffered")
        assert seen.wakes == 1
        taken = []
        while batch := ingest.take(1_000):
            taken += batch
        assert len(taken) == n
        await _publish(nc, ("g", "m", 1))
        await wait_for(lambda: seen.wakes == 2, 5, "a wake for the first sample into the empty buffer")
        await _publish(nc, ("g", "m", 2), ("h", "m", 1))
        await wait_for(lambda: len(ingest.buffer) == 2, 5, "two keys")
        assert seen.wakes == 2


def _connection_names(server: NatsServer) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/connz", timeout=5) as r:
        return [c.get("name", "") for c in json.load(r)["connections"]]


async def test_stop_leaves_no_thread_and_no_connection(nats_server: NatsServer) -> None:
    async with ingesting(nats_server.url) as (_ingest, _seen):
        assert len(_ingest_threads()) == 1
        assert "t-samples" in await asyncio.to_thread(_connection_names, nats_server)
    assert _ingest_threads() == []

    async def gone() -> bool:
        return "t-samples" not in await asyncio.to_thread(_connection_names, nats_server)

    deadline = time.monotonic() + 5
    while not await gone():  # the server notices a closed socket a moment later
        assert time.monotonic() < deadline, "the samples connection is still in /connz"
        await asyncio.sleep(0.05)


async def test_start_against_a_dead_url_raises_within_the_deadline_and_leaves_no_thread() -> None:
    ingest = SampleIngest(
        connect.NatsOptions(servers=(f"nats://127.0.0.1:{free_port()}",), connect_deadline_s=1.0),
        buffer=SampleBuffer(),
        wants=lambda model: True,
        on_outcome=lambda o: None,
        on_reject=lambda err, subject: None,
        wake=lambda: None,
    )
    t0 = time.monotonic()
    with pytest.raises(NatsUnavailable, match="nothing listens there"):
        await ingest.start()
    assert time.monotonic() - t0 < 5
    assert _ingest_threads() == []
    await ingest.stop()  # harmless after a failed start


async def test_every_sample_is_accounted_for_while_the_main_thread_takes(nats_server: NatsServer, nc: Client) -> None:
    # A buffer smaller than the keys, taken from concurrently: taken + coalesced + dropped == published.
    async with ingesting(nats_server.url, capacity=100) as (ingest, seen):
        taken: list[object] = []
        published = 0
        for seq in range(1, 41):
            for g in range(300):
                await nc.publish(protocol.queue_subject("m"), protocol.encode(_s(f"g{g}", "m", seq)))
                published += 1
            taken += ingest.take(50)
        await nc.flush()

        def accounted() -> bool:
            taken.extend(ingest.take(1_000))
            return len(taken) + seen.outcomes["coalesced"] + seen.outcomes["dropped"] == published

        await wait_for(accounted, 20, f"{published} samples accounted for")
        assert seen.outcomes["dropped"] > 0
