"""What the sources said, per source and model, and what the bridge publishes from it. Pure: time is passed in
(monotonic seconds), no I/O.

A *pair* is one source's view of one model: its last good reading and when it came. A model's demand is the sum
over its pairs (one engine per pair: data-parallel engines and replicas add up). A model is **fresh**, and its
samples go out, while every one of its pairs had a good reading within its source's bound (a pair that never had
one counts from when it was expected) and at least one has a reading. So one failing engine of a model stops the
whole model's samples once its bound passes: a partial sum would be a silent under-count, while no sample at all
lets the autoscaler's own staleness rule hold the replicas (missing metrics never scale down).

Counters. The contract's `arrivals_total` and `completions_total` must be monotonic per gateway run; the bridge
keeps them per model and adds what each pair's readings say happened between two of them:

- completions: the rise of the engine's finished-requests counter (vLLM's ``request_success_total``, every
  finish reason: stop, length, abort, error);
- arrivals: the completions plus the rise of what is present (waiting + running): every request that arrived
  has finished or is still there. Gauges and counters are not read at one instant, so a step may come out
  negative by a request or two; that is carried to the next step (`_Pair.arrivals_debt`), never published.
- the first reading of a pair is a baseline: nothing from before the bridge watched is counted as this run's,
  except the requests present then, which did arrive (so arrivals >= present + completions holds);
- a counter that goes down is an engine restart (`counter_reset`): its new value counts as completed since the
  restart and its present requests as arrived, as Prometheus' ``increase()`` reads a reset.

A model whose pairs do not all have a finished counter (a PromQL source, an engine without it) gets no rates: its
counters stay where they are (see `rates_known`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

__all__ = ["MAX_COUNT", "EngineReading", "ModelTotals", "Readings", "Recorded"]

MAX_COUNT: Final = 2**53
"""Counts beyond this are refused (``bad_value``): past it a float (the exposition format's numbers) no longer holds
every integer, so deltas would be wrong."""


@dataclass(frozen=True, slots=True)
class EngineReading:
    """One source's view of one model at one scrape."""

    waiting: int
    running: int
    finished_total: int | None = None
    """The engine's finished-requests counter; None: it has none (no rates from this pair)."""


@dataclass(slots=True)
class ModelTotals:
    """The bridge's own monotonic counters of one model (the samples' `arrivals_total`, `completions_total`)."""

    arrivals_total: int = 0
    completions_total: int = 0


@dataclass(frozen=True, slots=True)
class Recorded:
    """What one `Readings.record` changed."""

    models: frozenset[str]
    """Models whose demand, counters or freshness may have changed."""
    resets: tuple[str, ...] = ()
    """Models whose finished counter went down at this source (an engine restart)."""


@dataclass(slots=True)
class _Pair:
    since: float
    """When the pair began to be expected (its age counts from here until a first reading)."""
    stale_after_s: float
    reading: EngineReading | None = None
    good_at: float | None = None
    arrivals_debt: int = 0
    """A negative arrivals step not yet made up (module doc)."""

    def age(self, now: float) -> float:
        return now - (self.good_at if self.good_at is not None else self.since)


@dataclass
class Readings:
    """The pairs by model, and each model's counters (module doc)."""

    _pairs: dict[str, dict[str, _Pair]] = field(default_factory=dict)
    """model -> source id -> pair."""
    totals: dict[str, ModelTotals] = field(default_factory=dict)

    def expect(self, source: str, model: str, now: float, stale_after_s: float) -> None:
        """`source` reports `model` (a slot's engine, a target or query bound to a model): the model is not fresh
        without it once `stale_after_s` has passed with no reading."""
        self._pairs.setdefault(model, {}).setdefault(source, _Pair(now, stale_after_s))

    def record(
        self,
        source: str,
        readings: Mapping[str, EngineReading],
        now: float,
        stale_after_s: float,
        *,
        named: Iterable[str] | None = None,
    ) -> Recorded:
        """A good scrape of `source`. `named`: every model the page named, good or not (an unbound source); a model
        it no longer names is dropped from the source (the engine stopped serving it: its requests went with it),
        one it names without a usable reading is expected of it. None: a bound source, whose pairs stay."""
        affected: set[str] = set(readings)
        if named is not None:
            keep = set(named) | set(readings)
            for model, pairs in list(self._pairs.items()):
                if source in pairs and model not in keep:
                    del pairs[source]
                    affected.add(model)
                    if not pairs:
                        del self._pairs[model]
            for model in keep - set(readings):
                # Named with no usable reading (NaN, say): a source of the model that fails, as a bound one would.
                self._pairs.setdefault(model, {}).setdefault(source, _Pair(now, stale_after_s))
                affected.add(model)
        resets = []
        for model, reading in readings.items():
            pair = self._pairs.setdefault(model, {}).setdefault(source, _Pair(now, stale_after_s))
            pair.stale_after_s = stale_after_s
            if self._count(model, pair, reading):
                resets.append(model)
            pair.reading, pair.good_at = reading, now
        return Recorded(frozenset(affected), tuple(resets))

    def _count(self, model: str, pair: _Pair, new: EngineReading) -> bool:
        """Add what happened between `pair`'s reading and `new` to `model`'s counters; whether it was a reset."""
        totals = self.totals.setdefault(model, ModelTotals())
        old = pair.reading
        present = new.waiting + new.running
        if old is None or old.finished_total is None or new.finished_total is None:
            if old is None:
                totals.arrivals_total += present  # they arrived, before or while the bridge started watching
            return False
        reset = new.finished_total < old.finished_total
        if reset:
            done = new.finished_total
            arrived = done + present
        else:
            done = new.finished_total - old.finished_total
            arrived = done + present - (old.waiting + old.running)
        arrived += pair.arrivals_debt
        pair.arrivals_debt = min(arrived, 0)
        totals.completions_total += done
        totals.arrivals_total += max(arrived, 0)
        return reset

    def drop_source(self, source: str) -> frozenset[str]:
        """`source` is gone (a slot left ``ready``): its pairs go; the models they were of."""
        gone = set()
        for model, pairs in list(self._pairs.items()):
            if pairs.pop(source, None) is not None:
                gone.add(model)
                if not pairs:
                    del self._pairs[model]
        return frozenset(gone)

    def models(self) -> list[str]:
        return sorted(self._pairs)

    def sources_of(self, model: str) -> list[str]:
        return sorted(self._pairs.get(model, {}))

    def fresh(self, model: str, now: float) -> bool:
        pairs = self._pairs.get(model)
        if not pairs or all(p.reading is None for p in pairs.values()):
            return False
        return all(p.age(now) <= p.stale_after_s for p in pairs.values())

    def stale_sources(self, model: str, now: float) -> list[tuple[str, float]]:
        """The sources that keep `model` from being fresh, with their ages (s)."""
        pairs = self._pairs.get(model, {})
        return sorted((s, p.age(now)) for s, p in pairs.items() if p.age(now) > p.stale_after_s)

    def demand(self, model: str) -> tuple[int, int]:
        """(waiting, running) over the pairs of `model` that have a reading."""
        readings = [p.reading for p in self._pairs.get(model, {}).values() if p.reading is not None]
        return sum(r.waiting for r in readings), sum(r.running for r in readings)

    def rates_known(self, model: str) -> bool:
        """Whether every pair of `model` reads a finished counter: only then do its counters move."""
        pairs = self._pairs.get(model, {}).values()
        return bool(pairs) and all(p.reading is not None and p.reading.finished_total is not None for p in pairs)

    def age(self, model: str, now: float) -> float | None:
        """The age of `model`'s oldest pair (what decides its freshness); None when it has no pair."""
        pairs = self._pairs.get(model)
        return max(p.age(now) for p in pairs.values()) if pairs else None

    def expires_at(self, model: str) -> float | None:
        """When `model` goes stale if no reading comes (None: no pair)."""
        pairs = self._pairs.get(model)
        if not pairs:
            return None
        return min((p.good_at if p.good_at is not None else p.since) + p.stale_after_s for p in pairs.values())
