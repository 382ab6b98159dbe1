"""The daemon's garbage-collector tending (`AutoscalerSettings.gc_freeze_every_s`): long-lived objects are frozen
once the ScaledObjects are followed and every period after, and handed back for a full collection every
`gc_full_every_s`, so cyclic garbage is reclaimed, not leaked. It acts on the whole process: the test restores it."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Iterator

import pytest
from nats.aio.client import Client

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
        await scaler.housekeeping_once()
        assert gc.get_freeze_count() > 0, "frozen once the ScaledObjects are followed"
        frozen = gc.get_freeze_count()
        await scaler.housekeeping_once()
        assert gc.get_freeze_count() == frozen, "not again within the period"
        # Cyclic garbage that was frozen with the rest is reclaimed by the next full collection.
        cycle = _Cycle()
        alive = weakref.ref(cycle)
        gc.freeze()
        del cycle
        gc.collect()
        assert alive() is not None, "frozen: out of the collector's sight"
        scaler.settings = dataclasses.replace(scaler.settings, gc_full_every_s=0.0)
        await scaler.housekeeping_once()
        assert alive() is None, "the full collection reclaimed the cycle"
        assert gc.get_freeze_count() > 0, "and froze the survivors again"


async def test_without_the_setting_the_collector_is_left_alone(
    nats_server: NatsServer, nc: Client, thawed: None
) -> None:
    async with running_autoscaler(nats_server.url) as scaler:
        await scaler.housekeeping_once()
        assert gc.get_freeze_count() == 0
