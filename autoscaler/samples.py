"""Samples, from the wire to the controllers' door: `SampleIngest` takes them off NATS in a thread of its own and
keeps the newest per (gateway, model) in a `SampleBuffer`, which the daemon's drain empties on the main loop.

Why a thread: at 1,000 models a replica receives ~10,000 samples a second. On the main loop, nats-py's read loop
(up to 32 KB, ~120 messages, parsed per read without yielding), the subscription's callbacks and the decoding each
take slices of it, and every step of a claim (reconcile, bring-up, kv.update, the reply) waits a loop iteration
behind them; a second connection on the same loop isolates nothing. `SampleIngest` runs the samples' connection,
subscription, decode, contract checks and buffering on an asyncio loop in its own thread; the main loop only pays
for folding samples in (`SampleIngest.take`, under the buffer's lock). The two threads still share the GIL:
the ingest thread gives it up when it waits on its socket, and at the interpreter's switch interval.

Coalescing is safe for what the autoscaler reads from samples. The demand is the latest queue + in-flight of each
gateway, which the newest sample carries; the rates are deltas of the gateways' counters, which are cumulative, so
skipping a sample in between only widens the interval the next delta is taken over (the same traffic over a longer
dt), and loses no requests. A buffered sample is replaced by a newer one of the same gateway and model (newer by
the gateway's own (ts, seq): a late packet never replaces the sample it is older than); either way the one not kept
is counted as ``coalesced``. The buffer is bounded in distinct keys: when a new key arrives and it is full, the
oldest key's sample is dropped (counted as ``dropped``, never silently); the next sample of that gateway carries
its counters on.

Distinct keys are drained in the order they first entered the buffer: a busy gateway whose samples keep replacing
each other keeps its place, and cannot push a quiet model's sample to the back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, Literal

from nats.aio.client import Client
from nats.aio.msg import Msg

from warmpool import connect, protocol
from warmpool.errors import BadMessage
from warmpool.protocol import QueueSample

__all__ = ["Outcome", "Put", "SampleBuffer", "SampleIngest"]

log = logging.getLogger("pulsescale.samples")

Put = Literal["queued", "coalesced", "dropped"]
"""What `SampleBuffer.put` did: a new key buffered; a sample of a buffered key merged (one sample not kept); or a
new key buffered by dropping the oldest key's sample (one sample lost)."""

Outcome = Literal["coalesced", "dropped", "rejected", "not_owned"]
"""What `SampleIngest` reports of a sample that will not reach the drain as itself: merged into a newer one,
dropped with the oldest key, refused by the contract, or for a model this replica does not own."""


class SampleBuffer:
    """Newest sample per (gateway, model), at most `capacity` keys, drained oldest key first. Thread-safe: one
    thread puts while another takes (a lock around each dict operation; uncontended it costs ~0.1 us)."""

    __slots__ = ("_items", "_lock", "capacity")

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError(f"a sample buffer needs room for at least one sample, not {capacity}")
        self.capacity = capacity
        # Assigning to an existing key keeps its place; popping the first is O(1) (a dict's is not: it scans the
        # holes its earlier pops left).
        self._items: OrderedDict[tuple[str, str], tuple[QueueSample, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, sample: QueueSample, received_at: float) -> Put:
        """Buffer `sample` (received at `received_at`), keeping the newer one of its key."""
        return self.add(sample, received_at)[0]

    def add(self, sample: QueueSample, received_at: float) -> tuple[Put, bool]:
        """`put`, and whether the buffer was empty before: the one put after which the reader must be woken."""
        key = (sample.gateway, sample.model)
        with self._lock:
            old = self._items.get(key)
            if old is not None:
                kept = old[0]
                if (sample.ts, sample.seq) >= (kept.ts, kept.seq):
                    self._items[key] = (sample, received_at)
                return "coalesced", False
            was_empty = not self._items
            outcome: Put = "queued"
            if len(self._items) >= self.capacity:
                self._items.popitem(last=False)
                outcome = "dropped"
            self._items[key] = (sample, received_at)
            return outcome, was_empty

    def pop(self) -> tuple[QueueSample, float]:
        """The oldest key's sample and when it was received. Raises KeyError when empty."""
        with self._lock:
            return self._items.popitem(last=False)[1]

    def take(self, max_items: int) -> list[tuple[QueueSample, float]]:
        """Up to `max_items` samples, oldest key first, with when each was received; [] when empty. One lock for
        the lot: the putting thread waits at most that long."""
        items = self._items
        with self._lock:
            return [items.popitem(last=False)[1] for _ in range(min(max_items, len(items)))]


PENDING_MSGS_LIMIT: Final = 1_000_000
"""Samples nats-py may hold for the subscription before it drops them (each one counted and logged by
`connect`): ~100 s of a 1,000-model fleet, so only an ingest thread that stopped keeping up loses any."""


class SampleIngest:
    """The samples' NATS connection, subscription, decoding, checks and buffering, on an asyncio loop in a thread
    of its own (see the module docstring). Its callbacks run in that thread: `on_outcome`, `on_reject` and `wake`
    must be thread-safe (prometheus counters are; for an asyncio.Event, `wake` is
    ``lambda: loop.call_soon_threadsafe(event.set)``)."""

    def __init__(
        self,
        opts: connect.NatsOptions,
        *,
        buffer: SampleBuffer,
        wants: Callable[[str], bool],
        on_outcome: Callable[[Outcome], None],
        on_reject: Callable[[BadMessage, str], None],
        wake: Callable[[], None],
        clock: Callable[[], float] = time.time,
        pending_msgs_limit: int = PENDING_MSGS_LIMIT,
    ) -> None:
        self.opts = dataclasses.replace(opts, name=f"{opts.name}-samples")
        """The connection's options: the daemon's, named ``<name>-samples`` in the server's /connz."""
        self.buffer = buffer
        self.wants = wants
        """wants(model): False drops a sample before it is decoded (a model this replica does not own)."""
        self.on_outcome = on_outcome
        self.on_reject = on_reject
        """on_reject(err, subject): a sample that breaks the contract (the daemon's `Rejections`)."""
        self.wake = wake
        """Called when the buffer goes from empty to non-empty, never once per sample."""
        self.clock = clock
        self.pending_msgs_limit = pending_msgs_limit
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()  # set in the ingest thread's loop (Event binds to a loop on first wait)

    # --- the main loop's side ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the thread, connect and subscribe; return once the subscription is flushed to the server. A
        failure to connect (`NatsUnavailable`) is raised here, and leaves no thread behind."""
        if self._thread is not None:
            raise RuntimeError("SampleIngest.start called twice")
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="pulsescale-samples", daemon=True)
        self._thread.start()
        try:
            await asyncio.wrap_future(ready)
        except BaseException:
            await self.stop()  # also when start() itself is cancelled: the thread must not outlive us
            raise

    def take(self, max_items: int) -> list[tuple[QueueSample, float]]:
        """Up to `max_items` buffered samples, oldest key first (`SampleBuffer.take`)."""
        return self.buffer.take(max_items)

    async def stop(self) -> None:
        """Close the connection in its thread and join the thread. Idempotent; safe before `start` finished."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        if not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._stopping.set)
            except RuntimeError:  # the loop closed meanwhile: the thread is ending by itself
                pass
        await asyncio.to_thread(thread.join)

    # --- the ingest thread's side --------------------------------------------------------------------------------

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve(ready))
        except BaseException as err:  # handed to start(), which raises it in the caller
            if not ready.done():
                ready.set_exception(err)
            else:
                log.exception("the sample ingest thread failed")
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    async def _serve(self, ready: concurrent.futures.Future[None]) -> None:
        nc: Client = await connect.connect(self.opts)
        try:
            await nc.subscribe(protocol.QUEUE_WILDCARD, cb=self._on_msg, pending_msgs_limit=self.pending_msgs_limit)
            await nc.flush()
            if not ready.done():
                ready.set_result(None)
            await self._stopping.wait()
        finally:
            # close, not drain: what is still pending is stale by the time anyone would fold it in.
            try:
                await nc.close()
            except Exception:  # shutting down; the connection may already be gone
                log.debug("closing the samples connection failed", exc_info=True)

    async def _on_msg(self, msg: Msg) -> None:
        subject = msg.subject
        if not self.wants(subject[len(protocol.QUEUE_PREFIX) :]):
            self.on_outcome("not_owned")
            return
        try:
            sample = protocol.decode(msg.data, QueueSample)
            if subject != protocol.QUEUE_PREFIX + sample.model:
                raise BadMessage("subject_mismatch", f"sample for {sample.model} published on {subject}")
        except BadMessage as err:
            self.on_outcome("rejected")
            self.on_reject(err, subject)
            return
        put, was_empty = self.buffer.add(sample, self.clock())
        if put != "queued":
            self.on_outcome(put)
        if was_empty:
            self.wake()
