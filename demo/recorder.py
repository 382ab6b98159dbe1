"""What a run records as it goes, each stream from where it happens (`demo.report` combines them): the gateway's
queue samples (or, with ``--source vllm-metrics``, the bridge's), the autoscaler's events, the slot registry counted
every tick, the phases and what the demo said; and the live view's `Snapshot`, filled in from them every tick.
`disk_reads` reads the host's disk counter (the run reads it at the pulse's start and end); `gateway_counters` reads
the gateway's own answer counters from its ``/metrics`` once the load has drained, and `bridge_counters` the
bridge's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from demo import load as load_mod
from demo import report as report_mod
from demo.settings import MODEL
from demo.view import Snapshot, View
from warmpool import protocol
from warmpool.errors import BadMessage
from warmpool.protocol import Event, QueueSample
from warmpool.registry import KvSlotStore

__all__ = [
    "ACTIVATING_STATES",
    "Recorder",
    "bridge_counters",
    "disk_reads",
    "gateway_counters",
    "parse_bridge_metrics",
    "parse_gateway_metrics",
]

ACTIVATING_STATES = frozenset({"claimed", "activating"})


def disk_reads() -> int | None:
    """Reads completed by the host's whole block devices (not partitions, loop or RAM disks), from /proc/diskstats."""
    try:
        text = Path("/proc/diskstats").read_text()
    except OSError:
        return None
    total = 0
    for line in text.splitlines():
        f = line.split()
        if len(f) < 4 or f[2].startswith(("loop", "ram", "zram", "dm-")) or not Path("/sys/block", f[2]).exists():
            continue
        total += int(f[3])
    return total


def parse_gateway_metrics(text: str, model: str) -> dict[str, Any]:
    """`model`'s answers by HTTP status (``pulsescale_gateway_responses_total``) and its arrival -> answer histogram
    (``pulsescale_gateway_request_seconds``: ``count``, ``sum`` and cumulative ``buckets`` as [le, count]) from the
    gateway's Prometheus text."""
    statuses: dict[str, int] = {}
    hist: dict[str, Any] = {"count": 0, "sum": 0.0, "buckets": []}
    for family in text_string_to_metric_families(text):
        for smp in family.samples:
            if smp.labels.get("model") != model:
                continue
            if smp.name == "pulsescale_gateway_responses_total":
                statuses[smp.labels["code"]] = int(smp.value)
            elif smp.name == "pulsescale_gateway_request_seconds_count":
                hist["count"] = int(smp.value)
            elif smp.name == "pulsescale_gateway_request_seconds_sum":
                hist["sum"] = round(smp.value, 4)
            elif smp.name == "pulsescale_gateway_request_seconds_bucket" and smp.labels["le"] != "+Inf":
                hist["buckets"].append([float(smp.labels["le"]), int(smp.value)])  # +Inf: the count
    hist["buckets"].sort()
    return {"responses_by_status": dict(sorted(statuses.items())), "request_seconds": hist}


def parse_bridge_metrics(text: str, model: str) -> dict[str, Any]:
    """From the bridge's Prometheus text: `model`'s samples published and the times they stopped (a source failed
    or went stale), its reads and its bad input by reason, summed over the sources it reads at the end (a slot's
    series go with the slot)."""
    out: dict[str, Any] = {"samples_published": 0, "samples_stopped": 0, "reads": 0, "errors_by_reason": {}}
    errors: dict[str, int] = out["errors_by_reason"]
    for family in text_string_to_metric_families(text):
        for smp in family.samples:
            if smp.name == "pulsescale_bridge_samples_published_total" and smp.labels.get("model") == model:
                out["samples_published"] = int(smp.value)
            elif smp.name == "pulsescale_bridge_samples_stopped_total" and smp.labels.get("model") == model:
                out["samples_stopped"] = int(smp.value)
            elif smp.name == "pulsescale_bridge_reads_total":
                out["reads"] += int(smp.value)
            elif smp.name == "pulsescale_bridge_errors_total" and smp.value:
                reason = smp.labels["reason"]
                errors[reason] = errors.get(reason, 0) + int(smp.value)
    out["errors_by_reason"] = dict(sorted(errors.items()))
    return out


async def _metrics_text(url: str) -> str | None:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session,
            session.get(f"{url.rstrip('/')}/metrics") as r,
        ):
            if r.status != 200:
                return None
            return await r.text()
    except (aiohttp.ClientError, OSError):
        return None


async def gateway_counters(url: str, model: str) -> dict[str, Any] | None:
    """`parse_gateway_metrics` of the gateway at `url`; None (the report says so) when it cannot be read."""
    text = await _metrics_text(url)
    return None if text is None else parse_gateway_metrics(text, model)


async def bridge_counters(url: str, model: str) -> dict[str, Any] | None:
    """`parse_bridge_metrics` of the bridge at `url`; None when it cannot be read."""
    text = await _metrics_text(url)
    return None if text is None else parse_bridge_metrics(text, model)


class Recorder:
    """The run's records and its live view: `say` and `phase` record and show, `on_sample` takes the gateway's
    samples, `tick` counts the registry's slots (every `tick_s` while `ticker` runs) and shows the snapshot."""

    def __init__(self, view: View, tick_s: float) -> None:
        self.view = view
        self.tick_s = tick_s
        self.snap = Snapshot(needed=None)
        self.events: list[Event] = []
        self.samples: list[QueueSample] = []
        self.ticks: list[report_mod.Tick] = []
        self.phases: list[tuple[str, float]] = []
        self.notes: list[str] = []
        self.cold_nodes: dict[str, float] = {}
        self.cold_warm_at: dict[str, float] = {}
        self.desired: int | None = None
        self.load_start: float | None = None
        self._seen_samples = 0

    # --- messages -------------------------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        self.notes.append(text)
        self.snap.messages.append(text)
        self.view.say(text)

    def phase(self, name: str) -> None:
        self.phases.append((name, time.time()))
        self.snap.phase = name
        self.view.update(self.snap)

    async def on_sample(self, msg: Msg) -> None:
        try:
            self.samples.append(protocol.decode(msg.data, QueueSample))
        except BadMessage:
            return

    # --- ticks ----------------------------------------------------------------------------------------------------

    def counts(self, store: KvSlotStore | None) -> tuple[int, int, int]:
        assert store is not None
        ready = activating = warm = 0
        for r in store.records(MODEL):
            if r.state == "ready":
                ready += 1
            elif r.state in ACTIVATING_STATES:
                activating += 1
            elif r.state == "warm":
                warm += 1
            if (
                r.node in self.cold_nodes
                and r.node not in self.cold_warm_at
                and r.state not in ("prewarming", "failed")
            ):
                # Warm by now (possibly claimed since): the first sighting, or its first claim if that was earlier.
                claims = [e.ts for e in self.events if e.type == "slot.claimed" and e.node == r.node]
                self.cold_warm_at[r.node] = min([time.time(), *claims])
        return ready, activating, warm

    def tick(self, load: load_mod.LoadRun | None, store: KvSlotStore | None) -> None:
        ready, activating, warm = self.counts(store)
        fresh = self.samples[self._seen_samples :]
        self._seen_samples = len(self.samples)
        last = self.samples[-1] if self.samples else None
        now = time.time()
        t = now - self.load_start if self.load_start is not None else 0.0
        s = self.snap
        s.t, s.ready, s.activating, s.warm, s.desired = t, ready, activating, warm, self.desired
        if last is not None:
            # The deepest queue since the last tick: a burst between two ticks is what the plot must show.
            s.queue_depth = max((x.queue_depth for x in fresh), default=last.queue_depth)
            s.inflight = max((x.inflight for x in fresh), default=last.inflight)
        if load is not None:
            done = load.seconds()
            if done:
                lastsec = done[-1]
                s.offered_rps, s.timeouts_last_s, s.p99_ms = lastsec.sent, lastsec.timeouts, lastsec.p99_ms
            s.ok_rps = self._completions_rate(now)
            totals = load.totals()
            s.timeouts_total, s.errors_total = totals.get("timeouts", 0), totals.get("errors", 0)
        if self.load_start is not None:
            self.ticks.append(
                report_mod.Tick(t, ready, activating, warm, s.queue_depth, s.inflight, self.desired, s.phase)
            )
        self.view.update(s)

    def _completions_rate(self, now: float, window_s: float = 1.0) -> float:
        """Requests/s the gateway completed over the last `window_s`, from its own counters."""
        if not self.samples:
            return 0.0
        last = self.samples[-1]
        older = next((x for x in reversed(self.samples) if x.ts <= now - window_s), None)
        if older is None or last.ts <= older.ts:
            return 0.0
        return (last.completions_total - older.completions_total) / (last.ts - older.ts)

    async def ticker(
        self, load: Callable[[], load_mod.LoadRun | None], stop: asyncio.Event, store: KvSlotStore | None
    ) -> None:
        while not stop.is_set():
            self.tick(load(), store)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.tick_s)

    async def settle_samples(self, runner: load_mod.LoadRun, *, counted: bool = True) -> None:
        """Wait (briefly) for the gateway sample that counts every request the load sent. `counted` False: the
        samples are the bridge's, whose counters are the engines' (readiness checks and the calibration too), so
        only an empty queue is waited for."""
        sent = runner.totals().get("sent", 0)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            last = self.samples[-1] if self.samples else None
            if (
                last is not None
                and (last.arrivals_total >= sent or not counted)
                and last.queue_depth == 0
                and last.inflight == 0
            ):
                return
            await asyncio.sleep(0.05)
