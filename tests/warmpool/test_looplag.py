"""The event-loop lag probe (`warmpool.looplag`) on a real loop, and its series in a running autoscaler."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest
from nats.aio.client import Client

from tests.autoscaler.test_autoscaler import cancel_gateways, running_autoscaler  # noqa: F401 - cancel_gateways is autouse
from tests.helpers import wait_for
from warmpool import looplag
from warmpool.embedded import NatsServer
from warmpool.looplag import LagSettings


async def _block_loop(seconds: float) -> None:
    await asyncio.sleep(0.05)  # let the probe start a sleep first
    time.sleep(seconds)  # noqa: ASYNC251 - the stall under test: a blocking call on the loop


async def test_a_stall_is_read_as_lag_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    readings: list[float] = []
    stop = asyncio.Event()
    settings = LagSettings(every_s=0.02, warn_over_s=0.1, warn_every_s=30)
    probe = asyncio.create_task(looplag.probe(readings.append, stop, settings))
    try:
        with caplog.at_level(logging.WARNING, logger="pulsescale.looplag"):
            await _block_loop(0.3)
            await _block_loop(0.3)  # a second stall within warn_every_s: read, not warned again
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(probe, 1)
    stalls = [r for r in readings if r >= 0.2]
    assert len(stalls) == 2, readings
    assert all(r >= 0 for r in readings)
    assert sorted(readings)[len(readings) // 2] < 0.1, "an idle loop reads near 0"
    warned = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(warned) == 1, warned
    assert re.search(r"the event loop stalled 0\.[23]\d s", warned[0]), warned[0]


async def test_the_warning_names_the_worst_stall_since_the_last_one(caplog: pytest.LogCaptureFixture) -> None:
    """Under the threshold nothing is logged; once over, the warning gives the longest stall it saw."""
    stop = asyncio.Event()
    settings = LagSettings(every_s=0.02, warn_over_s=0.2, warn_every_s=0)
    probe = asyncio.create_task(looplag.probe(lambda _: None, stop, settings))
    try:
        with caplog.at_level(logging.WARNING, logger="pulsescale.looplag"):
            await _block_loop(0.1)
            assert not [r for r in caplog.records if "stalled" in r.getMessage()], "0.1 s is under 0.2 s"
            await _block_loop(0.35)
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(probe, 1)
    warned = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(warned) == 1 and re.search(r"stalled 0\.[34]\d s", warned[0]), warned


async def test_stop_ends_the_probe_without_waiting_out_its_sleep() -> None:
    stop = asyncio.Event()
    readings: list[float] = []
    probe = asyncio.create_task(looplag.probe(readings.append, stop, LagSettings(every_s=60)))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    stop.set()
    await asyncio.wait_for(probe, 2)
    assert time.monotonic() - t0 < 1
    assert readings == [], "a stop is not a reading"


@pytest.mark.parametrize("bad", [{"every_s": 0}, {"warn_over_s": -1}, {"warn_every_s": -1}])
def test_settings_refuse_durations_that_make_no_sense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="positive durations"):
        LagSettings(**bad)


async def test_a_running_autoscaler_exports_its_loop_lag(nats_server: NatsServer, nc: Client) -> None:
    async with running_autoscaler(nats_server.url) as scaler:
        value = scaler.metrics.registry.get_sample_value
        name = "pulsescale_event_loop_lag_seconds"
        await wait_for(lambda: (value(f"{name}_count") or 0) >= 3, 3, "three readings of the loop's lag")
        n = value(f"{name}_count")
        time.sleep(0.6)  # noqa: ASYNC251 - a stall in the daemon's own loop (the test shares it)
        await wait_for(lambda: value(f"{name}_count") > n + 1, 3, "readings after the stall")
        assert value(f"{name}_bucket", {"le": "0.25"}) < value(f"{name}_count"), "the 0.6 s stall is over 0.25 s"
