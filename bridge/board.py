"""The one owner of what the bridge publishes: the readings table (`bridge.readings`), and from it the models whose
samples go out now (`published`, the table the gateway's `Publisher` samples) with their counts.

After every read of a source (`apply`) and at each model's staleness deadline (`sweep`), a model that is fresh is
put in `published` (or its counts refreshed, and the publisher woken when they changed); one that is not is taken
out and the publisher told to forget it, so no sample of it goes out until its sources read well again. Its next
samples then start a new `seq`, which the autoscaler reads as this gateway restarting for that model (a new
baseline for its rates). Never a sample with a stale or made-up figure.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from bridge.errors import SourceError
from bridge.metrics import BridgeMetrics
from bridge.parse import Page
from bridge.readings import Readings
from gateway.queue import QueueCounts

__all__ = ["DemandBoard", "ModelCounts", "Outcome", "SamplePublisher"]

log = logging.getLogger("pulsescale.bridge")

_PAST_S = 0.001
"""A deadline is checked this long after it passes: at the deadline itself the reading is still within its bound."""


class SamplePublisher(Protocol):
    """What the board needs of `gateway.publisher.Publisher`."""

    def changed(self, model: str) -> None: ...

    def forget(self, model: str) -> None: ...


class ModelCounts:
    """One published model, as `gateway.publisher.Publisher` reads a queue: `counts()`."""

    __slots__ = ("now",)

    def __init__(self, now: QueueCounts) -> None:
        self.now = now

    def counts(self) -> QueueCounts:
        return self.now


@dataclass(frozen=True)
class Outcome:
    """One read of a source: a page (or a query's reading) or the error that made it unusable."""

    page: Page | None = None
    error: SourceError | None = None


class DemandBoard:
    """The readings and the published models (module doc)."""

    def __init__(
        self, metrics: BridgeMetrics, *, clock: Callable[[], float], models: frozenset[str] | None = None
    ) -> None:
        self.metrics = metrics
        self.models = models
        """Publish only these (`BridgeSettings.models`); what sources say of others is left out."""
        self.clock = clock
        self.readings = Readings()
        self.published: dict[str, ModelCounts] = {}
        self.publisher: SamplePublisher | None = None
        """Told of each change and each model taken out (bound by the daemon, which makes it over `published`)."""
        self.last_error: dict[str, SourceError] = {}
        """Per source, the error of its last read, while its reads fail."""
        self._page_errors: dict[str, SourceError] = {}
        """Per source, a problem of its last good page (a model of it left out): said when that model stops."""
        self.wake = asyncio.Event()
        """Set when a deadline may have moved (the sweeper waits on it)."""
        self._known: set[str] = set()

    # --- sources -------------------------------------------------------------------------------------------------

    def expect(self, source: str, model: str, stale_after_s: float) -> None:
        if self.models is not None and model not in self.models:
            return
        self.readings.expect(source, model, self.clock(), stale_after_s)
        self._refresh([model])

    def drop(self, source: str) -> None:
        self.last_error.pop(source, None)
        self._page_errors.pop(source, None)
        self._refresh(self.readings.drop_source(source))

    def apply(self, source: str, outcome: Outcome, stale_after_s: float) -> None:
        """A read of `source` ended with `outcome`: count its errors, record its page, re-judge its models."""
        now = self.clock()
        errors = list(outcome.page.errors) if outcome.page is not None else []
        if outcome.error is not None:
            errors.append(outcome.error)
        for err in errors:
            self.metrics.errors.labels(source, err.reason).inc()
        if outcome.page is None:
            failed = outcome.error
            assert failed is not None
            if source not in self.last_error:
                log.warning("%s: %s", source, failed)  # once per failure streak; the counter has every one
            self.last_error[source] = failed
            self.wake.set()
            return
        for err in outcome.page.errors:
            log.debug("%s: %s", source, err)
        if outcome.page.errors:
            self._page_errors[source] = outcome.page.errors[-1]
        else:
            self._page_errors.pop(source, None)
        if self.last_error.pop(source, None) is not None:
            log.info("%s: reads well again", source)
        readings, named = outcome.page.readings, outcome.page.named
        if self.models is not None:
            readings = {m: r for m, r in readings.items() if m in self.models}
            named = None if named is None else named & self.models
        recorded = self.readings.record(source, readings, now, stale_after_s, named=named)
        for model in recorded.resets:
            self.metrics.errors.labels(source, "counter_reset").inc()
            log.info("%s: %s's finished-requests counter went down (engine restarted); counted from 0", source, model)
        self._refresh(recorded.models)

    # --- models --------------------------------------------------------------------------------------------------

    def sweep(self) -> float | None:
        """Re-judge every model; when the next one may go stale (None: no model is published)."""
        now = self.clock()
        for model in self.readings.models():
            self._judge(model, now)
        deadlines = [self.readings.expires_at(m) for m in self.published]
        return min((d for d in deadlines if d is not None), default=None)

    def next_check_at(self) -> float | None:
        deadline = self.sweep()
        return None if deadline is None else deadline + _PAST_S

    def _refresh(self, models: Iterable[str]) -> None:
        now = self.clock()
        for model in models:
            self._judge(model, now)
        self.wake.set()  # a deadline may have moved: the sweeper looks again

    def _judge(self, model: str, now: float) -> None:
        r, m = self.readings, self.metrics
        if not r.sources_of(model):
            if model in self._known:
                self._known.discard(model)
                self._take_out(model, "no source reports it any more")
                m.model_removed(model)
            return
        if model not in self._known:
            self._known.add(model)
            m.model_added(model, lambda: _age_or_nan(r.age(model, self.clock())))
        if not r.fresh(model, now):
            self._take_out(model, self._why_stale(model, now))
            return
        waiting, running = r.demand(model)
        totals = r.totals.get(model)
        counts = QueueCounts(
            queue_depth=waiting,
            inflight=running,
            arrivals_total=totals.arrivals_total if totals else 0,
            completions_total=totals.completions_total if totals else 0,
            timeouts_total=0,  # an engine has no such counter; requests lost in a restart stay arrived only
            rejected_total=0,
            failed_total=0,
        )
        m.queue_depth.labels(model).set(waiting)
        m.inflight.labels(model).set(running)
        entry = self.published.get(model)
        if entry is None:
            self.published[model] = ModelCounts(counts)
            m.publishing.labels(model).set(1)
            log.info("%s: publishing samples (from %s)", model, ", ".join(r.sources_of(model)))
        elif entry.now == counts:
            return
        else:
            entry.now = counts
        if self.publisher is not None:
            self.publisher.changed(model)

    def _take_out(self, model: str, why: str) -> None:
        if self.published.pop(model, None) is None:
            return
        if self.publisher is not None:
            self.publisher.forget(model)
        self.metrics.publishing.labels(model).set(0)
        self.metrics.stopped.labels(model).inc()
        log.warning("%s: samples stopped: %s", model, why)

    def _why_stale(self, model: str, now: float) -> str:
        parts = []
        for source, age in self.readings.stale_sources(model, now):
            err = self.last_error.get(source) or self._page_errors.get(source)
            parts.append(f"{source} not read well for {age:.2f} s" + (f" ({err})" if err else ""))
        return "; ".join(parts) or "no reading yet"

    # --- views ---------------------------------------------------------------------------------------------------

    def health(self) -> dict[str, dict[str, object]]:
        now, r = self.clock(), self.readings
        out: dict[str, dict[str, object]] = {}
        for model in r.models():
            waiting, running = r.demand(model)
            age = r.age(model, now)
            out[model] = {
                "publishing": model in self.published,
                "queue_depth": waiting,
                "inflight": running,
                "reading_age_s": None if age is None else round(age, 3),
                "rates": r.rates_known(model),
                "sources": r.sources_of(model),
            }
        return out


def _age_or_nan(age: float | None) -> float:
    return math.nan if age is None else age
