"""The samples' way in at a fleet's scale (`autoscaler.intake`, `autoscaler.samples`, `autoscaler.metrics`).

- A rising sample takes its key's older buffered sample out and is folded at once; a late packet does not.
- While samples queue up for it, the taker catches up (up to `catch_up_s` per turn of the loop) instead of taking
  one slice's worth per turn, which let a backlog, once built, only grow; not while a claim of ours is young. A
  sample that raises is counted and the next one taken.
- ``pulsescale_samples_total`` is a plain count per outcome, read at scrape time.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from autoscaler.act.book import ClaimsInFlight
from autoscaler.intake import BEHIND_MSGS, SampleIntake
from autoscaler.metrics import AutoscalerMetrics
from autoscaler.models import Models
from autoscaler.samples import SampleBuffer
from warmpool import protocol
from warmpool.protocol import QueueSample
from warmpool.rejects import Rejections


def _sample(model: str = "m", seq: int = 1, ts: float = 100.0, depth: int = 0) -> QueueSample:
    return QueueSample(gateway="g", model=model, seq=seq, ts=ts, queue_depth=depth, inflight=0,
                       arrivals_total=seq, completions_total=seq, timeouts_total=0)  # fmt: skip


def test_a_rising_sample_takes_its_keys_older_sample_out_but_a_late_packet_does_not() -> None:
    buf = SampleBuffer()
    buf.put(_sample(seq=2, ts=100.0), 0.0)
    buf.put(_sample("other"), 0.0)
    assert buf.take(_sample(seq=1, ts=99.0)) is False, "a late packet: the newer sample stays buffered"
    assert ("g", "m") in buf
    assert buf.take(_sample(seq=3, ts=101.0)) is True
    assert ("g", "m") not in buf and len(buf) == 1
    assert buf.take(_sample("absent")) is True  # nothing waits for it


class _AllOwned:
    def owns_model(self, model: str) -> bool:
        return True


def _intake(*, catch_up_s: float) -> SampleIntake:
    models = Models()
    models.shards = _AllOwned()  # type: ignore[assignment]
    return SampleIntake(
        models,
        claims=ClaimsInFlight(),
        metrics=AutoscalerMetrics(),
        rejections=Rejections(logging.getLogger("test")),
        clock=time.time,
        internal_error=lambda what: None,
        buffer_keys=100_000,
        slice_s=0.0,  # every sample past its slice: whether the callback yields is up to the backlog
        stand_aside_s=0.05,
        catch_up_s=catch_up_s,
    )


def _msg(model: str) -> Msg:
    data = protocol.encode(_sample(model, ts=time.time()))
    return Msg(_client=None, subject=protocol.queue_subject(model), data=data)  # type: ignore[arg-type]


async def _turns_while_taking(intake: SampleIntake, n: int, *, behind_them: int) -> int:
    """Turns of the loop another task got while the taker (`SampleIntake.consume`) took `n` samples from its queue,
    `behind_them` more waiting there behind them all along."""
    queue: asyncio.Queue[Msg] = asyncio.Queue()
    for i in range(n + behind_them):
        queue.put_nowait(_msg(f"x{i}"))
    turns = 0

    async def count() -> None:
        nonlocal turns
        while queue.qsize() > behind_them:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.ensure_future(count())
    taker = asyncio.ensure_future(intake.consume(queue))
    try:
        await asyncio.wait_for(counter, 10)
    finally:
        taker.cancel()
    return turns - 1  # the counter's first turn comes before the taker's first


async def test_the_taker_catches_up_while_samples_queue_for_it_and_yields_when_they_do_not() -> None:
    behind = await _turns_while_taking(_intake(catch_up_s=60.0), 200, behind_them=BEHIND_MSGS + 1)
    assert behind <= 1, f"behind, the taker yielded {behind} times in 200 samples"
    caught_up = await _turns_while_taking(_intake(catch_up_s=60.0), 200, behind_them=0)
    assert caught_up >= 150, f"with nothing queued it should yield every slice (here every sample): {caught_up}"
    bounded = await _turns_while_taking(_intake(catch_up_s=0.0), 200, behind_them=BEHIND_MSGS + 1)
    assert bounded >= 150, "catching up is bounded by catch_up_s"


async def test_the_taker_does_not_catch_up_while_a_claim_is_young() -> None:
    """A young claim's hops through the loop (its write, the flush, the reply) would each wait a catch-up's
    `catch_up_s` behind the taker: while one is, the taker yields every slice, behind or not."""
    intake = _intake(catch_up_s=60.0)
    intake.claims.add(1)
    young = await _turns_while_taking(intake, 200, behind_them=BEHIND_MSGS + 1)
    assert young >= 150, f"with a claim young, the taker should yield every slice (here every sample): {young}"
    intake.claims.started_at -= 3600  # an old claim (stuck retrying) holds nothing up
    old = await _turns_while_taking(intake, 200, behind_them=BEHIND_MSGS + 1)
    assert old <= 1, f"behind, with only an old claim in flight, the taker caught up: {old}"


async def test_a_sample_that_raises_is_counted_and_the_taker_goes_on() -> None:
    errors: list[str] = []
    intake = _intake(catch_up_s=60.0)
    intake.internal_error = errors.append
    queue: asyncio.Queue[Msg] = asyncio.Queue()
    queue.put_nowait(Msg(_client=None, subject=None, data=b"{}"))  # type: ignore[arg-type]  # no subject: a TypeError
    queue.put_nowait(_msg("after"))
    taker = asyncio.ensure_future(intake.consume(queue))
    try:
        for _ in range(100):
            if queue.empty() and ("g", "after") in intake.samples:
                break
            await asyncio.sleep(0.01)
        assert not taker.done(), "the taker ran on"
    finally:
        taker.cancel()
    assert errors == ["a sample on None"]
    assert ("g", "after") in intake.samples, "the sample after the one that raised was taken"


def test_sample_outcomes_are_plain_counts_read_at_scrape_time() -> None:
    m = AutoscalerMetrics()
    m.sample("coalesced").inc()
    m.sample("coalesced").inc(2)
    assert m.sample("coalesced") is m.sample("coalesced")
    get = m.registry.get_sample_value
    assert get("pulsescale_samples_total", {"outcome": "coalesced"}) == 3
    assert b'pulsescale_samples_total{outcome="coalesced"} 3.0' in m.exposition.render_now()
