"""`pulsescale bench bridge`: the decision delay the bridge adds to the push path, both timed in one run.

One embedded nats-server, one real ``pulsescale autoscaler`` process and one real ``pulsescale bridge`` process.
Each timed pulse has a model of its own (a ScaledObject with ``minReplicaCount`` 0 and 4 warm slots, as `bench
decide`'s), so every pulse meets an idle model and nothing has to scale back between pulses:

- **push**: a gateway stand-in in this process publishes each push model's `QueueSample` every 100 ms (the
  contract's pace: queue 0), and at t0 the jump, at once (a gateway publishes on change): ``--depth`` waiting;
- **bridge**: a stand-in engine page in this process (vLLM's ``/metrics`` format: ``vllm:num_requests_waiting``,
  ``vllm:num_requests_running``, ``vllm:request_success_total`` per ``model_name``), which the bridge reads every
  ``--scrape-every`` and publishes as each bridge model's samples; at t0 the page's waiting count jumps to
  ``--depth``. Both paths carry the same jump: queue depth ``--depth``, and ``--depth`` more arrivals.

Timed: t0 -> the first claim of the model's slots written in `pulse_slots`, seen by this process's watch (the same
watch for both paths, so its delay cancels in the difference). A stand-in agent answers every activation at once
(as in `bench decide`), so no engine's time is in the figures. The pulses alternate between the paths (push first on
even pulses, bridge first on odd ones) with a random pause of up to one scrape period between them, so t0 falls at
every phase of the bridge's scrape. Before the timed pulses, every model's samples flow for the policy's windows to
settle (as `bench decide` waits), and one untimed pulse per path checks that both reach the autoscaler.

It prints each path's p50 / p99 / max and the difference (bridge - push) of the p50s and the p99s: the bridge adds
up to a scrape period (the jump waits for the next read; half a period on average), the read itself and the
bridge's publish. ``-o json|yaml`` (``--json``) prints one object instead (`BridgeBenchReport`), the text report
going to stderr as progress. Figures are printed, not asserted: these machines are shared and noisy.
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
from typing import IO, Any

import msgspec
import numpy as np
from aiohttp import web

from autoscaler.decide.policyspec import PolicySpec
from pulsescale.bench import report as rpt
from pulsescale.bench.traffic import _spec, _stand_in_agent
from pulsescale.bench.watch import _metric_or, _SlotWatch
from warmpool import connect, durations, protocol
from warmpool import output as out
from warmpool.embedded import NatsServer, free_port
from warmpool.errors import PulsescaleError
from warmpool.protocol import QueueSample, ScalerRecord
from warmpool.registry import KvSlotStore, ensure_buckets
from warmpool.seed import seed_pool

__all__ = ["BridgeBenchReport", "bridge"]

SAMPLE_EVERY_S = 0.1
"""The push stand-in's sample period (the contract's pace)."""
PULSE_TIMEOUT_S = 5.0
"""A timed pulse with no claim after this long counts as unanswered: well past a scrape period and a decision."""
START_TIMEOUT_S = 60.0
"""The autoscaler and the bridge must be up, and the first pulse of each path claimed, within this."""
WARM_UP_S = 2.0
"""Samples flow this long beyond the policy's own settling before the first timed pulse (`bench decide`'s)."""
SLOTS_PER_MODEL = 4


class BridgeBenchReport(msgspec.Struct, kw_only=True):
    """`pulsescale bench bridge -o json|yaml`: the run's parameters and figures, units in the names, None (null)
    where a figure cannot be computed."""

    bench: str = "bridge"
    pulses: int
    scrape_every_s: float
    depth: int
    push: rpt.Percentiles
    """t0 (the push stand-in publishes the jump) -> first claim written."""
    bridge: rpt.Percentiles
    """t0 (the engine page's waiting count jumps) -> first claim written."""
    added_p50_ms: float | None
    """bridge p50 - push p50."""
    added_p99_ms: float | None
    """bridge p99 - push p99."""
    run_s: float | None = None


class _Page:
    """The stand-in engine page: each bridge model's waiting count and finished counter, rendered as vLLM does."""

    def __init__(self, models: list[str]) -> None:
        self.waiting = dict.fromkeys(models, 0)
        self.finished = dict.fromkeys(models, 0)

    def render(self) -> bytes:
        lines = ["# TYPE vllm:num_requests_waiting gauge"]
        lines += [f'vllm:num_requests_waiting{{engine="0",model_name="{m}"}} {n}.0' for m, n in self.waiting.items()]
        lines.append("# TYPE vllm:num_requests_running gauge")
        lines += [f'vllm:num_requests_running{{engine="0",model_name="{m}"}} 0.0' for m in self.waiting]
        lines.append("# TYPE vllm:request_success_total counter")
        lines += [
            f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{m}"}} {n}.0'
            for m, n in self.finished.items()
        ]
        return ("\n".join(lines) + "\n").encode()

    async def handle(self, _: web.Request) -> web.Response:
        return web.Response(body=self.render(), content_type="text/plain", charset="utf-8")


class _Push:
    """The push path's gateway stand-in: every push model's sample every 100 ms on its own connection (gateways are
    other processes), and a jump published at once."""

    def __init__(self, nc: Any, models: list[str]) -> None:
        self.nc = nc
        self.depth = dict.fromkeys(models, 0)
        self.arrivals = dict.fromkeys(models, 0)
        self.seq = 0

    async def publish(self, model: str) -> None:
        self.seq += 1
        sample = QueueSample(
            gateway="bench-push", model=model, seq=self.seq, ts=time.time(), queue_depth=self.depth[model],
            inflight=0, arrivals_total=self.arrivals[model], completions_total=0, timeouts_total=0,
        )  # fmt: skip
        await self.nc.publish(protocol.queue_subject(model), protocol.encode(sample))

    async def jump(self, model: str, depth: int) -> None:
        self.depth[model] = depth
        self.arrivals[model] += depth
        await self.publish(model)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            for m in self.depth:
                await self.publish(m)
            await asyncio.sleep(max(0.0, t0 + SAMPLE_EVERY_S - time.perf_counter()))


def _pct(xs: list[float]) -> str:
    if not xs:
        return "none answered"
    ms = np.array(xs) * 1e3
    return f"p50 {np.percentile(ms, 50):7.2f} ms   p99 {np.percentile(ms, 99):7.2f} ms   max {ms.max():7.2f} ms"


def _added(bridged: float | None, pushed: float | None) -> float | None:
    return None if bridged is None or pushed is None else out.finite(bridged - pushed)


class _Run:
    """One run: the processes, the stand-ins and the timed pulses."""

    def __init__(self, args: argparse.Namespace, server: NatsServer, nc: Any, store: KvSlotStore) -> None:
        self.args = args
        self.server = server
        self.nc = nc
        self.store = store
        self.fmt = out.machine(args)
        self.push_models = [f"p{i}" for i in range(args.pulses)] + ["p-check"]
        self.bridge_models = [f"b{i}" for i in range(args.pulses)] + ["b-check"]
        self.page = _Page(self.bridge_models)
        self.slots = _SlotWatch()
        self.procs: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []
        self.runner: web.AppRunner | None = None

    def say(self, line: str) -> None:
        print(line, file=out.progress(self.fmt), flush=True)

    async def seed(self) -> None:
        scalers = (await ensure_buckets(self.nc.jetstream()))[protocol.SCALERS_BUCKET]

        async def one(m: str) -> None:
            await seed_pool(self.store, m, nodes=1, slots_per_node=SLOTS_PER_MODEL, node_prefix=f"n-{m}")
            rec = ScalerRecord(namespace="bench", name=m, spec=_spec(m))
            await scalers.put(rec.key, protocol.encode(rec))

        await asyncio.gather(*(one(m) for m in [*self.push_models, *self.bridge_models]))

    async def serve_page(self) -> str:
        app = web.Application()
        app.router.add_get("/metrics", self.page.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}/metrics"

    def spawn(self, name: str, argv: list[str]) -> None:
        err = tempfile.NamedTemporaryFile(prefix=f"bench-bridge-{name}-", suffix=".log")  # noqa: SIM115 - closed at the end
        proc = subprocess.Popen([sys.executable, "-m", "pulsescale", *argv], stderr=err, stdout=subprocess.DEVNULL)
        self.procs.append((name, proc, err))

    def check_alive(self) -> None:
        for name, proc, err in self.procs:
            if proc.poll() is not None:
                err.seek(0)
                tail = err.read()[-1500:].decode(errors="replace").strip()
                raise PulsescaleError(f"pulsescale {name} exited with {proc.returncode}: {tail}")

    async def start(self, page_url: str) -> int:
        """The autoscaler and the bridge; the autoscaler's metrics port."""
        port = free_port()
        self.spawn("autoscaler", ["autoscaler", "--nats", self.server.url, "--metrics-port", str(port),
                                  "--identity", "bench-r0", "--log-level", "WARNING"])  # fmt: skip
        self.spawn("bridge", ["bridge", "--nats", self.server.url, "--target", page_url,
                              "--scrape-every", f"{self.args.scrape_every:g}", "--listen", f"127.0.0.1:{free_port()}",
                              "--gateway-id", "bench-bridge", "--log-level", "WARNING"])  # fmt: skip
        return port

    async def first_claim(self, model: str, t0: float) -> float | None:
        while model not in self.slots.first_claim and time.perf_counter() - t0 < PULSE_TIMEOUT_S:
            await asyncio.sleep(0.0005)
        return self.slots.first_claim[model] - t0 if model in self.slots.first_claim else None

    async def pulse(self, path: str, model: str, push: _Push) -> float | None:
        t0 = time.perf_counter()
        if path == "push":
            await push.jump(model, self.args.depth)
        else:
            self.page.waiting[model] = self.args.depth
        return await self.first_claim(model, t0)

    async def check_paths(self, push: _Push) -> None:
        """One untimed pulse per path, within `START_TIMEOUT_S`: the autoscaler owns the models and the bridge
        publishes (a path that never answers makes the timed figures meaningless)."""
        deadline = time.perf_counter() + START_TIMEOUT_S
        for path, model in (("push", "p-check"), ("bridge", "b-check")):
            while True:
                self.check_alive()
                if await self.pulse(path, model, push) is not None:
                    break
                if time.perf_counter() > deadline:
                    raise PulsescaleError(f"the {path} path's first pulse got no claim within {START_TIMEOUT_S:g} s")

    async def timed(self, push: _Push) -> tuple[list[float], list[float]]:
        got: dict[str, list[float]] = {"push": [], "bridge": []}
        for i in range(self.args.pulses):
            order = ("push", "bridge") if i % 2 == 0 else ("bridge", "push")
            for path in order:
                await asyncio.sleep(random.uniform(0.02, 0.02 + self.args.scrape_every))
                took = await self.pulse(path, f"{path[0]}{i}", push)
                if took is not None:
                    got[path].append(took)
            self.check_alive()
        return got["push"], got["bridge"]

    def stop(self) -> None:
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for _, proc, err in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            err.close()
        self.procs.clear()


async def _run(args: argparse.Namespace) -> BridgeBenchReport:
    t_start = time.perf_counter()
    server = NatsServer().start()
    run: _Run | None = None
    tasks: list[asyncio.Task[None]] = []
    stop = asyncio.Event()
    clients: list[Any] = []  # closed before the server stops: a client left open reconnects forever at exit
    store: KvSlotStore | None = None
    try:
        nc = await connect.connect(connect.NatsOptions(servers=(server.url,), name="bench-bridge"))
        clients.append(nc)
        gateway = await connect.connect(connect.NatsOptions(servers=(server.url,), name="bench-bridge-push"))
        clients.append(gateway)
        store = await KvSlotStore.open(nc)
        await store.start()
        run = _Run(args, server, nc, store)
        await run.seed()
        slots = run.slots

        async def watch_slots() -> None:
            async for ev in store.watch():
                slots.on(ev)

        tasks.append(asyncio.create_task(watch_slots()))
        await _stand_in_agent(nc, store, slots.held)
        push = _Push(gateway, run.push_models)
        tasks.append(asyncio.create_task(push.run(stop)))
        page_url = await run.serve_page()
        metrics_port = await run.start(page_url)
        deadline = time.perf_counter() + START_TIMEOUT_S
        while _metric_or(metrics_port, "pulsescale_samples_total") <= 0:
            run.check_alive()
            if time.perf_counter() > deadline:
                raise PulsescaleError(f"the autoscaler took no sample within {START_TIMEOUT_S:g} s")
            await asyncio.sleep(0.2)
        settle_s = PolicySpec.of(_spec("p0")).trend_settle_s + WARM_UP_S
        run.say(f"setup: nats-server, 1 autoscaler, the bridge (--scrape-every {args.scrape_every:g}s) and "
                f"{2 * args.pulses + 2} models x {SLOTS_PER_MODEL} warm slots up in "
                f"{time.perf_counter() - t_start:.1f} s; samples flow {settle_s:.1f} s before the pulses")  # fmt: skip
        await asyncio.sleep(settle_s)
        await run.check_paths(push)
        pushed, bridged = await run.timed(push)
        p, b = rpt.percentiles(pushed), rpt.percentiles(bridged)
        n = args.pulses
        run.say(f"t0 -> first claim written, {n} pulses per path, interleaved (queue {args.depth} at t0):")
        run.say(f"  push   (a sample published at t0)        {_pct(pushed)}   ({len(pushed)}/{n} answered)")
        run.say(f"  bridge (the engine page jumps at t0)     {_pct(bridged)}   ({len(bridged)}/{n} answered)")
        added50, added99 = _added(b.p50_ms, p.p50_ms), _added(b.p99_ms, p.p99_ms)
        if added50 is not None and added99 is not None:
            run.say(f"  added by the bridge                      p50 {added50:+7.2f} ms   p99 {added99:+7.2f} ms   "
                    f"(a scrape every {args.scrape_every * 1e3:g} ms)")  # fmt: skip
        return BridgeBenchReport(
            pulses=n, scrape_every_s=args.scrape_every, depth=args.depth, push=p, bridge=b,
            added_p50_ms=added50, added_p99_ms=added99, run_s=out.finite(time.perf_counter() - t_start),
        )  # fmt: skip
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if run is not None:
            run.stop()  # the autoscaler and the bridge first: the stand-in agent outlives their last requests
            if run.runner is not None:
                await run.runner.cleanup()
        if store is not None:
            with contextlib.suppress(Exception):
                await store.close()
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()
        server.stop()


def bridge(argv: list[str], prog: str) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pulses", type=int, default=40, help="timed pulses per path [40]")
    p.add_argument(
        "--scrape-every",
        type=durations.duration_arg(),
        default=0.25,
        metavar="DURATION",
        help="the bridge's --scrape-every (250ms, 1s or plain seconds) [250ms, its default]",
    )
    p.add_argument("--depth", type=int, default=4, help="the queue at t0, on both paths [4: one replica]")
    out.add_output_argument(p)
    args = p.parse_args(argv)
    if args.pulses < 1 or args.depth < 1:
        p.error("--pulses and --depth must be >= 1")
    if not 0 < args.scrape_every <= 1:
        p.error("--scrape-every must be in (0, 1s]")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    result = asyncio.run(_run(args))
    fmt = out.machine(args)
    if fmt is not None:
        print(out.dump(result, fmt))
    return 0
