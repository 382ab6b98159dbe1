"""`pulsescale bench ingest`: how fast an autoscaler takes samples in, next to a bare nats-py subscriber.

Against an embedded nats-server, `--models` ScaledObjects and one real `pulsescale autoscaler` process (holding
every shard, so one wildcard subscription, as a lone replica has), each model's gateway (``steady``, demand 0)
speaks every `TRICKLE_EVERY_S` to the autoscaler and to the floor alike, so the models stay settled as a steady
fleet's do. After `WARM_UP_S` of that, slices of `--samples` more samples of the same gateways are published as
fast as one publisher can, alternately to the floor and to the autoscaler, `--rounds` times each, so both meet
the same machine (the trickle waits while a slice is published). The floor is bare nats-py in a process of its
own (`pulsescale.bench.floorsub`): a subscription whose callback decodes each sample (`protocol.decode`, what our
intake does first) and counts it.

A slice is timed from its first publish until the consumer has counted every sample (polled every
`POLL_EVERY_S`: the autoscaler's ``pulsescale_samples_total`` through ``/metrics?name[]=``, the floor's count by a
request); its CPU seconds are the consumer's own (/proc). Figures: samples/s and CPU us per sample of each slice,
their medians, and ours over the floor's on both: samples/s (wall time; the publisher bounds it while the floor
keeps up with it) and samples per CPU second (what each could take with a core of its own). The bar: >= 0.5x on
both. ``--cpu-hog`` runs a busy loop on one core throughout (`pulsescale.bench.hog`). ``--demand wandering`` gives
each sample a queue depth drawn from 0-`WANDER_MAX` (one seeded generator for ours and the floor) instead of 0: a live
fleet's queues, whose changes ask the autoscaler for decisions (the figure then includes them; the floor only
decodes). ``--json`` prints one object (`IngestReport`), the text going to stderr.
Figures are printed, not asserted: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from typing import IO, Final

import msgspec
import numpy as np

from pulsescale.bench.hog import cpu_hog
from pulsescale.bench.report import IngestThroughNats
from pulsescale.bench.traffic import _sample, _spec
from pulsescale.bench.watch import SAMPLES, _cpu_s, _summed
from warmpool import connect, protocol
from warmpool import output as out
from warmpool.embedded import NatsServer, free_port
from warmpool.errors import PulsescaleError
from warmpool.output import finite
from warmpool.protocol import ScalerRecord
from warmpool.registry import ensure_buckets

__all__ = ["Floor", "IngestReport", "SliceFigures", "ingest", "ingest_through_nats", "our_count", "timed_slice"]

FLOOR_PREFIX: Final = "bench.ingest.floor"
POLL_EVERY_S: Final = 0.01
"""How often a slice's consumer is asked for its count: its share of the slice's time is this at most."""
SLICE_MAX_S: Final = 60.0
"""A slice stops waiting for its consumer after this long, or once its count has not moved for `STALLED_S`."""
STALLED_S: Final = 2.0
READY_TIMEOUT_S: Final = 60.0
TRICKLE_EVERY_S: Final = 0.5
"""Each model's gateway speaks this often throughout (to both consumers), so the gateways stay fresh (a sample
goes stale after 1 s) and the models settled: the slices measure a steady fleet's ingest, not a start's."""
STALE_AFTER_S: Final = 10.0
"""The models' ``staleAfterSeconds``: this bench's own publisher, on a busy machine, stalled past the default 1 s
now and then, and each model then flapped between "stale" and "idle" (a decision, an event, a log line each): the
cost of a stalled gateway, not of ingest."""
WARM_UP_S: Final = 8.0
"""The trickle alone before the first slice: the models' windows settle (`PolicySpec.trend_settle_s`, ~7 s)."""
BAR: Final = 0.5
"""Ours over the floor the issue asks for (samples/s)."""


class SliceFigures(msgspec.Struct, kw_only=True):
    who: str
    """``ours`` or ``floor``."""
    published: int
    counted: int
    seconds: float
    """First publish -> every sample counted (or the last count that moved)."""
    samples_per_s: float | None
    cpu_s: float | None
    """The consumer's CPU seconds over the slice (/proc; None once it is gone)."""
    cpu_us_per_sample: float | None


class IngestReport(msgspec.Struct, kw_only=True):
    bench: str = "ingest"
    models: int
    samples: int
    rounds: int
    cpu_hog: bool
    demand: str = "steady"
    """The samples' queue depths: ``steady`` (0) or ``wandering`` (0-`WANDER_MAX`, `--demand`)."""
    slices: list[SliceFigures] = msgspec.field(default_factory=list)
    ours_samples_per_s: float | None = None
    """Median over our slices."""
    floor_samples_per_s: float | None = None
    ratio_to_floor: float | None = None
    """ours_samples_per_s / floor_samples_per_s (wall time: bound by the publisher when the floor keeps up)."""
    ratio_to_floor_per_cpu_s: float | None = None
    """floor_cpu_us_per_sample / ours_cpu_us_per_sample: samples per CPU second, ours over the floor's (what each
    could take with a core to itself)."""
    ours_trickle_cpu_pct: float | None = None
    """The autoscaler's CPU with only the trickle flowing (2 s before the first slice), % of a core."""
    ours_cpu_us_per_sample: float | None = None
    floor_cpu_us_per_sample: float | None = None
    bar: float = BAR
    met: bool = False
    """ratio_to_floor >= bar and ratio_to_floor_per_cpu_s >= bar."""


def our_count(port: int) -> float:
    """An autoscaler's samples taken so far (every outcome), through ``/metrics?name[]=`` (cheap to ask)."""
    url = f"http://127.0.0.1:{port}/metrics?name[]={SAMPLES}"
    with urllib.request.urlopen(url, timeout=5) as r:
        return _summed(r.read().decode().splitlines(), SAMPLES) or 0.0


class Floor:
    """The floor's subscriber process (`pulsescale.bench.floorsub`) and how to ask it for its count."""

    def __init__(self, url: str, nc: object) -> None:
        self.url = url
        self.nc = nc
        self.proc: subprocess.Popen[str] | None = None

    def spawn(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pulsescale.bench.floorsub", self.url, FLOOR_PREFIX],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    async def start(self) -> Floor:
        self.spawn()
        assert self.proc is not None and self.proc.stdout is not None
        line = await asyncio.to_thread(self.proc.stdout.readline)
        if line.strip() != "ready":
            raise PulsescaleError(f"the floor's subscriber did not start (said {line!r})")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def count(self) -> float:
        reply = await self.nc.request(f"{FLOOR_PREFIX}.count", b"", timeout=5)  # type: ignore[attr-defined]
        return float(reply.data)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _cpu(pids: list[int]) -> float | None:
    got = [_cpu_s(pid) for pid in pids]
    return None if any(c is None for c in got) else sum(c for c in got if c is not None)


async def timed_slice(
    nc: object,
    who: str,
    messages: list[tuple[str, bytes]],
    count: Callable[[], Awaitable[float]],
    pid: int | list[int],
) -> SliceFigures:
    """Publish `messages` as fast as one publisher can and time the consumer (`count`, its process or processes
    `pid`) until it has counted them all."""
    pids = pid if isinstance(pid, list) else [pid]
    before = await count()
    cpu0 = _cpu(pids)
    t0 = time.perf_counter()
    for i, (subject, data) in enumerate(messages):
        await nc.publish(subject, data)  # type: ignore[attr-defined]
        if i % 500 == 0:
            await asyncio.sleep(0)
    await nc.flush()  # type: ignore[attr-defined]
    counted, moved_at = 0.0, time.perf_counter()
    while time.perf_counter() - t0 < SLICE_MAX_S and time.perf_counter() - moved_at < STALLED_S:
        now = await count() - before
        if now != counted:
            counted, moved_at = now, time.perf_counter()
        if counted >= len(messages):
            break
        await asyncio.sleep(POLL_EVERY_S)
    seconds = moved_at - t0
    cpu1 = _cpu(pids)
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    return SliceFigures(
        who=who,
        published=len(messages),
        counted=round(counted),
        seconds=seconds,
        samples_per_s=finite(counted / seconds) if seconds > 0 else None,
        cpu_s=cpu,
        cpu_us_per_sample=finite(cpu / counted * 1e6) if cpu is not None and counted else None,
    )


async def ingest_through_nats(
    nc: object,
    url: str,
    replicas: list[tuple[str, int, int]],
    models: list[str],
    n: int,
    say: Callable[[str], None],
) -> IngestThroughNats:
    """`bench decide`'s ingest phase: `n` samples (a new gateway, ``flood``, demand 0) spread over `models`,
    published as fast as one publisher can to the autoscaler `replicas` ((identity, metrics port, pid): each
    counts its own models'), then as many to the floor's bare subscriber, each timed until every sample was
    counted (`timed_slice`)."""
    counts: dict[str, float] = {}

    async def ours() -> float:
        for identity, port, _ in replicas:
            with contextlib.suppress(OSError):  # a busy replica may not answer in time: its last count stands
                counts[identity] = await asyncio.to_thread(our_count, port)
        return sum(counts.values())

    def messages(prefix: str) -> list[tuple[str, bytes]]:
        return [(prefix + models[i % len(models)], _sample(models[i % len(models)], 10**9 + i, 0, gateway="flood"))
                for i in range(n)]  # fmt: skip

    await ours()
    before = dict(counts)
    mine = await timed_slice(nc, "ours", messages(protocol.QUEUE_PREFIX), ours, [pid for _, _, pid in replicas])
    floor = Floor(url, nc)
    try:
        await floor.start()
        bare = await timed_slice(nc, "floor", messages(f"{FLOOR_PREFIX}.m."), floor.count, floor.pid)
    finally:
        floor.stop()
    counted: dict[str, int | None] = {
        who: round(counts[who] - before[who]) if who in before and who in counts else None for who, _, _ in replicas
    }
    busiest = max((c for c in counted.values() if c is not None), default=0)
    say(f"ingest through NATS into the autoscaler processes: {n} samples published, counted: "
        + "  ".join(f"{who} {c}" for who, c in counted.items())
        + f"; {mine.counted} in {mine.seconds:.2f} s = {mine.samples_per_s or 0:,.0f} samples/s "
        f"({mine.cpu_us_per_sample or 0:.1f} us CPU each)")  # fmt: skip
    say(f"  the floor, a bare nats-py subscriber (decode, count) in the same run: {bare.counted} in "
        f"{bare.seconds:.2f} s = {bare.samples_per_s or 0:,.0f} samples/s ({bare.cpu_us_per_sample or 0:.1f} us CPU "
        "each)")  # fmt: skip
    return IngestThroughNats(
        published=n, publish_s=mine.seconds, counted=counted, busiest=busiest, busiest_s=mine.seconds,
        samples_per_s=mine.samples_per_s, cpu_us_per_sample=mine.cpu_us_per_sample,
        floor_samples_per_s=bare.samples_per_s, floor_cpu_us_per_sample=bare.cpu_us_per_sample,
        ratio_to_floor=finite(mine.samples_per_s / bare.samples_per_s)
        if mine.samples_per_s and bare.samples_per_s else None,
        ratio_to_floor_per_cpu_s=finite(bare.cpu_us_per_sample / mine.cpu_us_per_sample)
        if mine.cpu_us_per_sample and bare.cpu_us_per_sample else None,
    )  # fmt: skip


def _median(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return finite(float(np.median(got))) if got else None


WANDER_MAX = 8
"""With ``--demand wandering``, each sample's queue depth is drawn from 0-this (twice the bench's target per
replica, so the model's target moves between 0 and 2 replicas)."""


class _Gateways:
    """The samples' one gateway (``steady``) per model, its ``seq`` shared by the trickle and the slices so each
    model's samples arrive in order: the slices' samples are more of a steady fleet's traffic, not a new gateway."""

    def __init__(self, models: list[str], *, wandering: bool = False) -> None:
        self.models = models
        self.seq = dict.fromkeys(models, 0)
        self.paused = asyncio.Event()
        self._depth = random.Random(27) if wandering else None

    def sample(self, model: str) -> bytes:
        """The next sample of `model`'s gateway: its seq moves on, its counters stay (no traffic: the rates are 0
        however often it speaks), its queue 0, or drawn afresh with ``--demand wandering``."""
        self.seq[model] += 1
        depth = self._depth.randint(0, WANDER_MAX) if self._depth is not None else 0
        return _sample(model, self.seq[model], depth, gateway="steady", served=0)

    def slice(self, prefix: str, n: int) -> list[tuple[str, bytes]]:
        models = self.models
        return [(prefix + models[i % len(models)], self.sample(models[i % len(models)])) for i in range(n)]

    async def trickle(self, nc: object, stop: asyncio.Event) -> None:
        """Every model's gateway speaks every `TRICKLE_EVERY_S`, to the autoscaler and to the floor alike, except
        while a slice is being published (`paused` clear)."""
        while not stop.is_set():
            t0 = time.perf_counter()
            for prefix in (protocol.QUEUE_PREFIX, f"{FLOOR_PREFIX}.m."):
                for i, m in enumerate(self.models):
                    await self.paused.wait()
                    await nc.publish(prefix + m, self.sample(m))  # type: ignore[attr-defined]
                    if i % 200 == 0:
                        await asyncio.sleep(0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, t0 + TRICKLE_EVERY_S - time.perf_counter()))


async def _run(args: argparse.Namespace, say: Callable[[str], None]) -> IngestReport:
    report = IngestReport(
        models=args.models, samples=args.samples, rounds=args.rounds, cpu_hog=args.cpu_hog, demand=args.demand
    )
    models = [f"m{i}" for i in range(args.models)]
    with NatsServer() as server:
        nc = await connect.connect(connect.NatsOptions(servers=(server.url,), name="bench-ingest"))
        scalers = (await ensure_buckets(nc.jetstream()))[protocol.SCALERS_BUCKET]
        for lo in range(0, len(models), 100):
            recs = [
                ScalerRecord(namespace="bench", name=m, spec=_spec(m, stale_after_s=STALE_AFTER_S))
                for m in models[lo : lo + 100]
            ]
            await asyncio.gather(*(scalers.put(r.key, protocol.encode(r)) for r in recs))
        port = free_port()
        log = tempfile.NamedTemporaryFile("w+", prefix="bench-ingest-", suffix=".log")  # noqa: SIM115
        replica = _replica(server.url, port, log)
        floor = Floor(server.url, nc)
        gateways = _Gateways(models, wandering=args.demand == "wandering")
        gateways.paused.set()
        stop = asyncio.Event()
        trickle: asyncio.Task[None] | None = None
        try:
            await _wait_for_every_shard(port, replica)
            await floor.start()
            trickle = asyncio.create_task(gateways.trickle(nc, stop))
            await asyncio.sleep(WARM_UP_S)
            cpu0, t0 = _cpu_s(replica.pid), time.perf_counter()
            await asyncio.sleep(2.0)
            cpu1 = _cpu_s(replica.pid)
            if cpu0 is not None and cpu1 is not None:
                report.ours_trickle_cpu_pct = finite((cpu1 - cpu0) / (time.perf_counter() - t0) * 100)
            for k in range(args.rounds):
                for who in ("floor", "ours"):
                    prefix = f"{FLOOR_PREFIX}.m." if who == "floor" else protocol.QUEUE_PREFIX
                    gateways.paused.clear()  # the slice's samples keep the gateways fresh meanwhile
                    msgs = gateways.slice(prefix, args.samples)
                    try:
                        if who == "floor":
                            fig = await timed_slice(nc, who, msgs, floor.count, floor.pid)
                        else:
                            fig = await timed_slice(nc, who, msgs, counter(port), replica.pid)
                    finally:
                        gateways.paused.set()
                    report.slices.append(fig)
                    say(f"round {k + 1} {who:>5}: {fig.counted}/{fig.published} samples in {fig.seconds:.2f} s"
                        f" = {fig.samples_per_s or 0:,.0f} samples/s, {fig.cpu_us_per_sample or 0:.1f} us CPU"
                        " each")  # fmt: skip
                    await asyncio.sleep(1.0)  # the trickle alone between slices
        finally:
            stop.set()
            gateways.paused.set()
            if trickle is not None:
                await trickle
            floor.stop()
            replica.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                replica.wait(10)
            if replica.poll() is None:
                replica.kill()
            log.close()
            await nc.close()
    ours_slices = [s for s in report.slices if s.who == "ours"]
    bare = [s for s in report.slices if s.who == "floor"]
    report.ours_samples_per_s = _median([s.samples_per_s for s in ours_slices])
    report.floor_samples_per_s = _median([s.samples_per_s for s in bare])
    report.ours_cpu_us_per_sample = _median([s.cpu_us_per_sample for s in ours_slices])
    report.floor_cpu_us_per_sample = _median([s.cpu_us_per_sample for s in bare])
    if report.ours_samples_per_s and report.floor_samples_per_s:
        report.ratio_to_floor = finite(report.ours_samples_per_s / report.floor_samples_per_s)
    if report.ours_cpu_us_per_sample and report.floor_cpu_us_per_sample:
        report.ratio_to_floor_per_cpu_s = finite(report.floor_cpu_us_per_sample / report.ours_cpu_us_per_sample)
    report.met = all(r is not None and r >= BAR for r in (report.ratio_to_floor, report.ratio_to_floor_per_cpu_s))
    depths = f"0-{WANDER_MAX}" if args.demand == "wandering" else "0"
    say(
        f"ingest, median of {args.rounds} slices each ({args.models} models, {args.samples} samples a slice, each "
        f"gateway also speaking every {TRICKLE_EVERY_S:g} s, queue depths {depths}"
        f"{', beside --cpu-hog' if args.cpu_hog else ''}):"
    )
    say(
        f"  ours {report.ours_samples_per_s or 0:,.0f} samples/s, {report.ours_cpu_us_per_sample or 0:.1f} us CPU "
        f"each (the trickle alone: {report.ours_trickle_cpu_pct or 0:.0f} % of a core)"
    )
    say(
        f"  the floor {report.floor_samples_per_s or 0:,.0f} samples/s, {report.floor_cpu_us_per_sample or 0:.1f} us "
        "CPU each"
    )
    per_cpu = report.ratio_to_floor_per_cpu_s or 0
    say(
        f"  ratio: {report.ratio_to_floor or 0:.2f}x the floor's samples/s, {per_cpu:.2f}x its samples per CPU "
        f"second (bar >= {BAR}x on both: {'met' if report.met else 'NOT met'})"
    )
    return report


def counter(port: int) -> Callable[[], Awaitable[float]]:
    """`our_count` of the autoscaler on `port`, asked off the loop; a scrape that fails or times out (a busy
    replica, or one that renders its whole registry for it) keeps the last count."""
    last = 0.0

    async def count() -> float:
        nonlocal last
        with contextlib.suppress(OSError, TimeoutError):
            last = await asyncio.to_thread(our_count, port)
        return last

    return count


def _replica(url: str, port: int, log: IO[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "pulsescale", "autoscaler", "--nats", url, "--metrics-port", str(port),
         "--identity", "bench-ingest"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stderr=log,
    )  # fmt: skip


def _shards_held(port: int) -> float | None:
    url = f"http://127.0.0.1:{port}/metrics?name[]=pulsescale_shards_held"
    with urllib.request.urlopen(url, timeout=2) as r:
        return _summed(r.read().decode().splitlines(), "pulsescale_shards_held")


def _cycle(models: list[str]):  # type: ignore[no-untyped-def]
    while True:
        yield from models


async def _wait_for_every_shard(port: int, replica: subprocess.Popen[bytes]) -> None:
    """The replica holds every shard, and has for a second (its models adopted and started)."""
    deadline = time.perf_counter() + READY_TIMEOUT_S
    held_since = None
    while time.perf_counter() < deadline:
        if replica.poll() is not None:
            raise PulsescaleError("the autoscaler exited during start-up")
        with contextlib.suppress(OSError):
            if await asyncio.to_thread(_shards_held, port) == protocol.SHARDS:
                held_since = held_since or time.perf_counter()
                if time.perf_counter() - held_since >= 1.0:
                    return
        await asyncio.sleep(0.1)
    raise PulsescaleError(f"the autoscaler did not hold every shard within {READY_TIMEOUT_S:.0f} s")


def ingest(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models", type=int, default=1000, help="models with a ScaledObject, samples spread over them [1000]"
    )
    p.add_argument("--samples", type=int, default=50_000, help="samples published per slice [50000]")
    p.add_argument("--rounds", type=int, default=3, help="slices of each, alternating floor and ours [3]")
    p.add_argument("--cpu-hog", action="store_true", help="a busy loop on one core for the whole run [off]")
    p.add_argument(
        "--demand",
        choices=["steady", "wandering"],
        default="steady",
        help=f"each sample's queue depth: 0, or drawn from 0-{WANDER_MAX} (a live fleet's, which asks for "
        "decisions) [steady]",
    )
    out.add_output_argument(p)
    args = p.parse_args(argv)
    if args.models < 1 or args.samples < 1 or args.rounds < 1:
        p.error("--models, --samples and --rounds must be >= 1")
    fmt = out.machine(args)

    def say(line: str) -> None:
        print(line, file=out.progress(fmt), flush=True)

    with cpu_hog(args.cpu_hog):
        report = asyncio.run(_run(args, say))
    if fmt is not None:
        print(out.dump(report, fmt))
    return 0
