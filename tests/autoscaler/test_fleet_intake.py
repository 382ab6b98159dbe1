"""The samples' way in at a fleet's scale (`autoscaler.intake`, `autoscaler.samples`, `autoscaler.metrics`).

- A rising sample takes its key's older buffered sample out and is folded at once; a late packet does not.
- While samples queue up for it in nats-py, the callback catches up (up to `catch_up_s` per turn of the loop)
  instead of taking one slice's worth per turn, which let a backlog, once built, only grow.
- ``pulsescale_samples_total`` is a plain count per outcome, read at scrape time.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from autoscaler.act.book import ClaimsInFlight
from autoscaler.intake import BEHIND_MSGS, Queued, SampleIntake
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


class _Pending:
    """A subscription as `Queued` reads it: how many samples wait for its callback."""

    def __init__(self, pending: int) -> None:
        self.pending_msgs = pending
        self._closed = False


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


async def _turns_while_taking(intake: SampleIntake, queued: Queued, n: int) -> int:
    """Turns of the loop another task got while the callback took `n` samples back to back, as nats-py calls it."""
    turns = 0
    done = False

    async def count() -> None:
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.ensure_future(count())
    await asyncio.sleep(0)
    turns = 0
    for i in range(n):
        data = protocol.encode(_sample(f"x{i}", ts=time.time()))
        await intake.on_queue_msg(Msg(_client=None, subject=protocol.queue_subject(f"x{i}"), data=data), queued)  # type: ignore[arg-type]
    done = True
    await counter
    return turns


async def test_the_callback_catches_up_while_samples_queue_for_it_and_yields_when_they_do_not() -> None:
    queued = Queued()
    queued.sub = _Pending(BEHIND_MSGS + 1)  # type: ignore[assignment]
    behind = await _turns_while_taking(_intake(catch_up_s=60.0), queued, 200)
    assert behind <= 1, f"behind, the callback yielded {behind} times in 200 samples"
    queued.sub = _Pending(0)  # type: ignore[assignment]
    caught_up = await _turns_while_taking(_intake(catch_up_s=60.0), queued, 200)
    assert caught_up >= 150, f"with nothing queued it should yield every slice (here every sample): {caught_up}"
    queued.sub = _Pending(BEHIND_MSGS + 1)  # type: ignore[assignment]
    bounded = await _turns_while_taking(_intake(catch_up_s=0.0), queued, 200)
    assert bounded >= 150, "catching up is bounded by catch_up_s"


def test_sample_outcomes_are_plain_counts_read_at_scrape_time() -> None:
    m = AutoscalerMetrics()
    m.sample("coalesced").inc()
    m.sample("coalesced").inc(2)
    assert m.sample("coalesced") is m.sample("coalesced")
    get = m.registry.get_sample_value
    assert get("pulsescale_samples_total", {"outcome": "coalesced"}) == 3
    assert b'pulsescale_samples_total{outcome="coalesced"} 3.0' in m.exposition.render_now()
