"""The sources the bridge reads and the loops that read them: one task per source, a read every period (a fixed
rate: a slow read does not pile up more), each answer handed to the board (`bridge.board`).

A source is an engine page (a `--target`, a ``metricsURL`` entry, or a ready slot's endpoint) or a PromQL query, named
by the flags or by a ScaledObject's trigger (`Source.scaler`, `bridge.scalers`). Reading never raises:
whatever goes wrong is a named `SourceError` in the outcome (`bridge.errors`), and a bug in a read is caught,
counted ``internal`` and logged, so one source cannot stop the others or the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import aiohttp

from bridge import parse
from bridge.board import DemandBoard, Outcome
from bridge.errors import SourceError
from bridge.metrics import BridgeMetrics
from bridge.readings import EngineReading
from bridge.settings import BridgeSettings

__all__ = ["Fetcher", "Source", "SourceKind", "Sources"]

log = logging.getLogger("pulsescale.bridge")

SourceKind = Literal["target", "slot", "query"]
QUERY_PATH = "/api/v1/query"


@dataclass(frozen=True)
class Source:
    id: str
    """Its name in metrics and logs: a target's URL, a slot's key, ``query:<model>``."""
    kind: SourceKind
    url: str
    """The page to scrape; for a query, the Prometheus server."""
    model: str | None
    """The model all its series count for; None: by each series' ``model_name`` (an unbound target)."""
    every_s: float
    stale_after_s: float
    promql: str | None = None
    scaler: str | None = None
    """The ScaledObject (``<namespace>.<name>``) whose trigger names this source (contract revision 14); None: the
    flags or --config do."""


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class Fetcher:
    """Reads a source over HTTP into an `Outcome`."""

    def __init__(self, session: aiohttp.ClientSession, settings: BridgeSettings) -> None:
        self._session = session
        self._timeout_s = settings.timeout_s
        self._max_bytes = settings.max_body_bytes
        self._names = settings.names()

    async def read(self, source: Source) -> Outcome:
        try:
            if source.kind == "query":
                assert source.model is not None and source.promql is not None
                status, body = await self._get(source.url.rstrip("/") + QUERY_PATH, {"query": source.promql})
                value = parse.query_value(body, status)
                # A query's value is the whole demand; in flight, since it cannot say what waits (README).
                return Outcome(parse.Page({source.model: EngineReading(waiting=0, running=value)}))
            status, body = await self._get(source.url, None)
            if status != 200:
                raise SourceError("http_status", f"HTTP {status} from {source.url}")
            return Outcome(parse.engine_page(body, model=source.model, names=self._names))
        except SourceError as err:
            return Outcome(error=err)

    async def _get(self, url: str, params: dict[str, str] | None) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(self._timeout_s), self._session.get(url, params=params) as resp:
                if resp.content_length is not None and resp.content_length > self._max_bytes:
                    raise SourceError("too_large", f"{resp.content_length} bytes, over {self._max_bytes}")
                body = bytearray()
                async for chunk in resp.content.iter_any():
                    body += chunk
                    if len(body) > self._max_bytes:
                        raise SourceError("too_large", f"over {self._max_bytes} bytes")
                return resp.status, bytes(body)
        except TimeoutError:
            raise SourceError("timeout", f"no full answer within {self._timeout_s:g} s") from None
        except (aiohttp.ClientError, OSError) as err:
            raise SourceError("unreachable", _why(err)) from None


class Sources:
    """The sources read now, by id, each with its loop (module doc)."""

    def __init__(
        self,
        fetcher: Fetcher,
        board: DemandBoard,
        metrics: BridgeMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetcher = fetcher
        self._board = board
        self._metrics = metrics
        self._clock = clock
        self.by_id: dict[str, Source] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ending: set[asyncio.Task[None]] = set()
        """Loops of removed sources, cancelled, until they have ended (awaited by `close`)."""

    def add(self, source: Source) -> bool:
        """Start reading `source`; False when it is read already (the same id, or another source of that page:
        a target that is also a ready slot is read once)."""
        if source.id in self.by_id or (
            source.kind != "query" and any(s.url == source.url for s in self.by_id.values())
        ):
            return False
        self.by_id[source.id] = source
        self._metrics.source_added(source.id)
        self._metrics.sources.labels(source.kind).inc()
        if source.model is not None:
            self._board.expect(source.id, source.model, source.stale_after_s)
        self._tasks[source.id] = asyncio.create_task(self._loop(source), name=f"bridge-read-{source.id}")
        model = f", {source.model}" if source.model else ""
        by = f", for ScaledObject {source.scaler}" if source.scaler else ""
        log.info("reading %s (%s%s%s) every %g s", source.id, source.kind, model, by, source.every_s)  # fmt: skip
        return True

    def remove(self, source_id: str) -> None:
        """Stop reading `source_id` and drop what it said. At once: its loop, cancelled here, applies nothing more
        (its only waits are the read and the pause, and a cancelled wait ends it)."""
        source = self.by_id.pop(source_id, None)
        if source is None:
            return
        task = self._tasks.pop(source_id)
        task.cancel()
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)
        self._board.drop(source_id)
        self._metrics.source_removed(source_id)
        self._metrics.sources.labels(source.kind).dec()
        log.info("no longer reading %s", source_id)

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *self._ending]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def _loop(self, source: Source) -> None:
        next_at = self._clock()
        while True:
            started = self._clock()
            try:
                outcome = await self._fetcher.read(source)
            except Exception as err:  # a bug in one read must not stop this source for good
                log.exception("%s: read failed", source.id)
                outcome = Outcome(error=SourceError("internal", _why(err)))
            self._metrics.reads.labels(source.id).inc()
            self._metrics.read_seconds.labels(source.kind).observe(self._clock() - started)
            try:
                self._board.apply(source.id, outcome, source.stale_after_s)
            except Exception:  # the same, on the board's side; its models age out meanwhile
                log.exception("%s: its reading could not be applied", source.id)
                self._metrics.errors.labels(source.id, "internal").inc()
            next_at = max(next_at + source.every_s, self._clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.sleep(next_at - self._clock())
