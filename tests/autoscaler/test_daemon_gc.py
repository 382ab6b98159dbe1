"""The daemon's garbage-collector tending (`AutoscalerSettings.gc_freeze_every_s`): long-lived objects are frozen
once the ScaledObjects are followed and every period after, and handed back for a full collection every
`gc_full_every_s`, so cyclic garbage is reclaimed, not leaked. It acts on the whole process: the test restores it."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import weakref
from collections.abc import Iterator

import pytest
from nats.aio.client import Client

from autoscaler.gctending import GcTending
from tests.autoscaler.test_autoscaler import running_autoscaler
from warmpool.embedded import NatsServer


@pytest.fixture
def thawed() -> Iterator[None]:
    gc.unfreeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


async def test_long_lived_objects_are_frozen_and_cyclic_garbage_is_still_collected(
    nats_server: NatsServer, nc: Client, thawed: None
) -> None:
    async with running_autoscaler(nats_server.url, gc_freeze_every_s=3600.0, gc_full_every_s=3600.0) as scaler:
        await scaler.tend_gc()
        assert gc.get_freeze_count() > 0, "frozen once the ScaledObjects are followed"
        frozen = gc.get_freeze_count()
        await scaler.tend_gc()
        assert gc.get_freeze_count() == frozen, "not again within the period"
        # Cyclic garbage that was frozen with the rest is reclaimed by the next full collection.
        cycle = _Cycle()
        alive = weakref.ref(cycle)
        gc.freeze()
        del cycle
        gc.collect()
        assert alive() is not None, "frozen: out of the collector's sight"
        scaler.settings = dataclasses.replace(scaler.settings, gc_full_every_s=0.0)
        await scaler.tend_gc()
        assert alive() is None, "the full collection reclaimed the cycle"
        assert gc.get_freeze_count() > 0, "and froze the survivors again"


async def test_without_the_setting_the_collector_is_left_alone(
    nats_server: NatsServer, nc: Client, thawed: None
) -> None:
    async with running_autoscaler(nats_server.url) as scaler:
        await scaler.tend_gc()
        assert gc.get_freeze_count() == 0


async def test_the_keeper_tends_every_period_in_force_and_not_without_one() -> None:
    """`GcTending.keep`: `tend` once per period read afresh each time; none while the period is None; gone at stop."""
    period: list[float | None] = [0.01]
    tends = 0

    async def tend() -> None:
        nonlocal tends
        tends += 1

    stop = asyncio.Event()
    keeper = asyncio.ensure_future(GcTending().keep(stop, lambda: period[0], tend))
    await asyncio.sleep(0.2)
    assert 5 <= tends <= 25, f"every 10 ms for 200 ms: {tends}"
    period[0] = None
    await asyncio.sleep(0.05)
    before = tends
    await asyncio.sleep(0.2)
    assert tends == before, "no period, no tending"
    stop.set()
    await asyncio.wait_for(keeper, 2)


async def test_the_running_daemon_freezes_on_its_own(nats_server: NatsServer, nc: Client, thawed: None) -> None:
    async with running_autoscaler(nats_server.url, gc_freeze_every_s=0.05, gc_full_every_s=3600.0):
        for _ in range(100):
            if gc.get_freeze_count() > 0:
                break
            await asyncio.sleep(0.05)
        assert gc.get_freeze_count() > 0, "the daemon's own task froze the survivors"
