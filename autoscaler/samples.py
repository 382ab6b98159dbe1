"""The buffer between the sample subscription and the controllers: the newest sample per (gateway, model).

The daemon's sample callback does only the cheap part (decode, validate, subject check) and puts the sample here;
a drain task folds what is buffered into the controllers, yielding to the loop every few milliseconds, so a flood
of samples costs neither the lease renewal nor a claim in flight their turn.

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

from collections import OrderedDict
from typing import Literal

from warmpool.protocol import QueueSample

__all__ = ["Put", "SampleBuffer"]

Put = Literal["queued", "coalesced", "dropped"]
"""What `SampleBuffer.put` did: a new key buffered; a sample of a buffered key merged (one sample not kept); or a
new key buffered by dropping the oldest key's sample (one sample lost)."""


class SampleBuffer:
    """Newest sample per (gateway, model), at most `capacity` keys, drained oldest key first. Not thread-safe:
    one event loop puts and drains."""

    __slots__ = ("_items", "capacity")

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError(f"a sample buffer needs room for at least one sample, not {capacity}")
        self.capacity = capacity
        # Assigning to an existing key keeps its place; popping the first is O(1) (a dict's is not: it scans the
        # holes its earlier pops left).
        self._items: OrderedDict[tuple[str, str], tuple[QueueSample, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: tuple[str, str]) -> bool:
        """A sample of (gateway, model) waits in the buffer."""
        return key in self._items

    def put(self, sample: QueueSample, received_at: float) -> Put:
        """Buffer `sample` (received at `received_at`), keeping the newer one of its key."""
        key = (sample.gateway, sample.model)
        items = self._items
        old = items.get(key)
        if old is not None:
            kept = old[0]
            # (ts, seq) >= the kept one's, without the two tuples: this runs for most samples of a burst.
            if sample.ts > kept.ts or (sample.ts == kept.ts and sample.seq >= kept.seq):
                items[key] = (sample, received_at)
            return "coalesced"
        outcome: Put = "queued"
        if len(items) >= self.capacity:
            items.popitem(last=False)
            outcome = "dropped"
        items[key] = (sample, received_at)
        return outcome

    def take(self, sample: QueueSample) -> bool:
        """Take `sample`'s key out of the buffer for `sample` to be folded now (a pulse's, `intake`): True when
        nothing buffered is newer by (ts, seq) (the buffered sample, older, is dropped: coalesced into it), False
        when a newer one waits there (`sample` is a late packet; it stays out and the newer one in)."""
        key = (sample.gateway, sample.model)
        old = self._items.get(key)
        if old is None:
            return True
        kept = old[0]
        if sample.ts > kept.ts or (sample.ts == kept.ts and sample.seq >= kept.seq):
            del self._items[key]
            return True
        return False

    def pop(self) -> tuple[QueueSample, float]:
        """The oldest key's sample and when it was received. Raises KeyError when empty."""
        return self._items.popitem(last=False)[1]
