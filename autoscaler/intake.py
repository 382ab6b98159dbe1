"""The samples' way in: the taker, the buffer's drain, and the standing aside between slices.

The taker (`SampleIntake.consume`: one task for every sample subscription, on the samples' own connection) does
the cheap part: decode, check, buffer (`samples.SampleBuffer`, newest per gateway and model). A sample its model
would decide on at once (a pulse's first) skips the buffer and is folded as it is taken, its claim started in the
same step. The drain folds the rest in slices of `slice_s`; between two slices it, and the daemon's housekeeping,
stand aside for this process's young claims and for samples being taken, at most `stand_aside_s` each. The daemon
composes it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from nats.aio.msg import Msg

from autoscaler.act.scaler import ClaimsInFlight
from autoscaler.metrics import AutoscalerMetrics
from autoscaler.models import Models
from autoscaler.samples import SampleBuffer
from warmpool import protocol
from warmpool.errors import BadMessage
from warmpool.protocol import QueueSample
from warmpool.rejects import Rejections

__all__ = ["BEHIND_MSGS", "INGEST_QUIET_S", "SampleIntake", "StandAside"]

BEHIND_MSGS: Final = 256
"""Samples waiting in the samples' queue past which their taker catches up (`SampleIntake.consume`): a quarter of
what one read of the socket brings at most, and a few milliseconds of work."""
INGEST_QUIET_S: Final = 0.001
"""The sample taker silent this long: the burst it was taking is over (`SampleIntake._ingest_first`). Within a
burst nats-py hands samples over microseconds apart; parsing its next read takes about a millisecond."""


@dataclass
class StandAside:
    """One loop's standing aside (`SampleIntake.stand_aside`): the last wait ran to its bound, skip the next."""

    skip_next: bool = False


class SampleIntake:
    """Samples from the wire into the models' controllers (`models`, the daemon's `Models`)."""

    def __init__(
        self,
        models: Models,
        *,
        claims: ClaimsInFlight,
        metrics: AutoscalerMetrics,
        rejections: Rejections,
        clock: Callable[[], float],
        internal_error: Callable[[str], None],
        buffer_keys: int,
        slice_s: float,
        stand_aside_s: float,
        catch_up_s: float | None = None,
    ) -> None:
        self.models = models
        """The controllers by model, and whether this replica owns a model now (`Models.owns`)."""
        self.claims = claims
        """The process's claims in flight, over every model (`Deps.claims`): stood aside for, and counted around a
        sample's fold to tell whether it started a claim (`fold_sample`)."""
        self.metrics = metrics
        self.rejections = rejections
        self.clock = clock
        self.internal_error = internal_error
        """Logs the exception being handled and counts it (the daemon's `_internal_error`)."""
        self.slice_s = slice_s
        self.stand_aside_s = stand_aside_s
        self.catch_up_s = slice_s if catch_up_s is None else catch_up_s
        """The longest the taker runs without yielding while samples queue up behind it (`BEHIND_MSGS`)."""
        self.samples = SampleBuffer(buffer_keys)
        """Samples decoded by `consume`, waiting for `drain` (newest per gateway and model)."""
        self._waiting = asyncio.Event()
        self._taken_at = -math.inf  # perf_counter() of the taker's last sample (`_ingest_first`)
        self._callback_until = 0.0  # perf_counter() past which the taker yields once
        self._step_until = 0.0  # perf_counter() past which it yields even while behind (`catch_up_s`)

    async def consume(self, queue: asyncio.Queue[Msg]) -> None:
        """Take the samples of every sample subscription, which nats-py puts in this one `queue`
        (`SampleSubscriptions`): decode, check, buffer. The controllers see a sample in `drain`, one loop iteration
        later when the buffer was empty. One task for all of them: with nats-py's own callback per subscription
        (one per model owned), every sample woke a task of its own, which cost a replica of 1,000 models a quarter
        of its CPU in the steady state and left less of the core for a pulse's claim. Runs until cancelled; a sample
        that raises is logged and counted (`internal_error`), and the next is taken."""
        get_nowait = queue.get_nowait
        while True:
            try:
                msg = get_nowait()
            except asyncio.QueueEmpty:
                msg = await queue.get()
            queue.task_done()  # nothing joins it; kept true for anyone who does
            try:
                yield_now = self.take(msg, queue.qsize() > BEHIND_MSGS)
            except Exception:  # noqa: BLE001 - logged with its traceback and counted there; the next sample goes on
                self.internal_error(f"a sample on {msg.subject}")
                yield_now = True
            if yield_now:
                await asyncio.sleep(0)
                self.yielded()

    def take(self, msg: Msg, behind: bool) -> bool:
        """One sample from the queue (`consume`); True when the taker should yield to the loop now. `behind`: more
        than `BEHIND_MSGS` samples wait behind this one."""
        self._taken_at = taken = time.perf_counter()  # one reading per sample: the slice's bound is a sample late
        if not self.take_sample(msg.subject, msg.data):
            if taken < self._callback_until:
                return False
            if behind and taken < self._step_until and not self.claims.recent(self.stand_aside_s):
                # Behind: nats-py parses a whole read (up to ~1,000 samples) per turn of the loop, and taking a
                # slice's worth per turn a backlog once built only grew: a pulse's sample waited seconds behind it
                # in a takeover's first seconds. Catch up, `catch_up_s` at most per turn of the loop; not while a
                # claim is young, whose few hops through the loop would each wait that long behind us.
                self._callback_until = taken + self.slice_s
                return False
        # Let the claims in flight and the drain run every slice, and a claim this sample started go out before
        # the next sample. (Not after every sample while any claim is young, as before: one sample per turn of
        # the loop, against a read's worth parsed per turn, built the same backlog; `bench decide
        # --pulses-after 1.5` answered 78 of 100 pulses within 2 s.)
        return True

    def yielded(self) -> None:
        """The taker is back from yielding (`take` said to): the next slice, and the next catch-up, start now."""
        now = time.perf_counter()
        self._callback_until = now + self.slice_s
        self._step_until = now + self.catch_up_s

    def take_sample(self, subject: str, data: bytes) -> bool:
        """The cheap part of a sample: decode and check it (rejections counted), then buffer it. A sample of a model
        another replica owns (a subscription's last messages after its shard moved) is dropped undecoded.

        A sample its model would decide on at once (`ModelController.urgent`: demand above any decided on since the
        target last fell, a pulse's first sample) is folded in as it is taken, not behind the buffer: in a burst of
        steady samples it waited for every key ahead of it. Its own key's older sample, when one waits, is dropped for
        it (coalesced, as the drain would have): with every model's gateway speaking every 100 ms a pulse's key was
        nearly always waiting, and a pulse waited for the drain to reach it, seconds in a takeover's first seconds.
        Returns whether the sample started a claim."""
        model = subject[len(protocol.QUEUE_PREFIX) :]
        c = self.models.by_model.get(model)
        # Its controller's own fence (its shard looked up once), not the model's shard hashed again per sample.
        if not (c.deps.owns() if c is not None else self.models.owns(model)):
            self.metrics.sample("not_owned").inc()
            return False
        try:
            sample = protocol.decode(data, QueueSample)
            if sample.model != model:
                raise BadMessage("subject_mismatch", f"sample for {sample.model} published on {subject}")
        except BadMessage as err:
            self.metrics.sample("rejected").inc()
            self.rejections(err, source=subject)
            return False
        if c is not None and c.urgent(sample):
            if (sample.gateway, model) not in self.samples:
                return self.fold_sample(sample, self.clock())
            if self.samples.take(sample):  # its key's older sample waited: this one goes first, that one goes
                self.metrics.sample("coalesced").inc()
                return self.fold_sample(sample, self.clock())
        woken = not self.samples  # else the drain is due already, or busy with the buffer and sees this too
        put = self.samples.put(sample, self.clock())
        if put != "queued":
            self.metrics.sample(put).inc()  # "coalesced" into a newer sample, or "dropped" with the oldest key
        if woken:
            self._waiting.set()
        return False

    async def drain(self) -> None:
        """Fold buffered samples into the controllers, oldest key first, yielding every `slice_s` of work.
        Rising samples do not wait here (`take_sample`); a sample that starts a claim ends the slice, so the claim
        goes out before the next sample is folded."""
        aside = StandAside()
        while True:
            await self._waiting.wait()
            self._waiting.clear()
            await self.stand_aside(aside)
            until = time.perf_counter() + self.slice_s
            while self.samples:
                sample, _received = self.samples.pop()
                # Folded in at the drain's time, not the receipt's: the policy's clock must never run backwards
                # (housekeeping may have decided in between), and the difference is a slice or so.
                if self.fold_sample(sample, self.clock()) or time.perf_counter() >= until:
                    await asyncio.sleep(0)
                    await self.stand_aside(aside)
                    until = time.perf_counter() + self.slice_s

    async def stand_aside(self, aside: StandAside) -> None:
        """Between two slices of the drain or housekeeping: wait for this process's young claims and for samples
        being taken (`_ingest_first`), each at most `stand_aside_s`; after a wait that ran to its bound the next
        slice goes without waiting, so a claim stuck retrying or a stream that never pauses takes at most half
        of their time, not all of it."""
        if aside.skip_next:
            aside.skip_next = False
            return
        timed_out = not await self.claims.wait_idle(self.stand_aside_s)
        timed_out = not await self._ingest_first() or timed_out
        aside.skip_next = timed_out

    async def _ingest_first(self) -> bool:
        """Stand aside while samples are being taken, at most `stand_aside_s`: a pulse's sample behind them is only
        seen (and skips the buffer, `take_sample`) once they are taken, and the drain's slices between the taker's
        doubled that wait in a burst. "Being taken": the taker took one within `INGEST_QUIET_S` (O(1); scanning
        nats-py's queue of each per-model subscription cost a replica of 1,000 models its CPU). What is taken
        meanwhile coalesces in the buffer."""
        until = None
        while (quiet := time.perf_counter() - self._taken_at) < INGEST_QUIET_S:
            now = time.perf_counter()
            if until is None:
                until = now + self.stand_aside_s
            elif now >= until:
                return False
            await asyncio.sleep(INGEST_QUIET_S - quiet)  # a timer, not a spin: the loop waits on its sockets
        return True

    def fold_sample(self, sample: QueueSample, now: float) -> bool:
        """One decoded sample into its model's controller (counted by outcome). Returns whether it started a
        claim (the caller yields at once, so the claim goes out before the next sample)."""
        c = self.models.by_model.get(sample.model)
        if c is None:
            self.metrics.sample("no_scaler").inc()
            return False
        # A claim the sample starts is counted in the process's claims before `on_sample` returns (its decision
        # wakes the scaler at once); none ends inside it (they end in their own tasks).
        before = self.claims.count
        try:  # the daemon's `_contained`, inline: this runs for every sample
            self.metrics.sample(c.on_sample(sample, now)).inc()
        except Exception:  # noqa: BLE001 - logged with its traceback and counted there
            self.internal_error(f"a sample of {sample.model}")
        return self.claims.count > before
