"""`pulsescale demo`: the article's surge, end to end, on this machine.

One run, in phases (each shown live and recorded):

1. **starting**: an embedded nats-server (its own store in a temporary directory), the buckets, the ScaledObject
   (``minReplicaCount`` = the replicas the base load is provisioned with; written once the pool holds their warm
   slots), a generated tiny model, and the rootfs stage (`demo.image`): as root, one real EROFS image built,
   loop-mounted and warmed once for every agent, locked in the page cache until the load ends; elsewhere skipped,
   said once.
2. **staging**: the autoscaler (a ``pulsescale autoscaler`` process), the node agents of the warm pool (one
   ``pulsescale agent`` process per node: they stage the weights into /dev/shm, fork their engines' zygotes and
   offer their slots) and the reference gateway (``pulsescale gateway``); with ``--source vllm-metrics`` the gateway
   publishes no samples and ``pulsescale bridge --slots``, started once the calibration is done, reads every ready
   engine's /metrics instead. The autoscaler activates the base replicas as soon as slots are warm. A progress bar
   counts slots until the pool is warm.
3. **calibrating**: sequential requests through the gateway measure one replica's service time, which sets the
   replicas the pulse needs.
4. **base / pulse / after**: the load generator's open-loop load: the base rate, then the pulse (a multiple of the
   provisioned capacity, reached within `ramp_s`), held, then back to the base rate.
5. **draining**: the answers still outstanding come in; then report.json, the PNG and the article's table.

The cold path: when the pool is smaller than the pulse needs, the autoscaler publishes ``cold.start`` (it has no
Kubernetes to ask here); the demo answers it by starting node agents outside the pool, from nothing (a process,
its imports, the staging, the engine's zygote), which is this machine's cold start; `cold_delay_s` adds what a real
cluster adds before that (scheduling, the image pull).

Whatever ends the run (the end, an error, Ctrl-C, SIGTERM), `run` stops every process group it started, kills
anything of the run that left its group (`demo.procs`), unmounts the rootfs image and detaches its loop device
(`demo.image.release`, then a lazy unmount of anything left), and removes its /dev/shm and temporary directories
before it returns or raises.

The parts, each a class of its own that `Demo` composes: `demo.recorder` (what the run records, and the live view),
`demo.rootfs_stage` (the rootfs stage and its page-cache keeper), `demo.model` (the generated model and how the
engines run it), `demo.fleet` (the processes and the cold path). `Demo` runs the phases with them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from demo import load as load_mod
from demo import report as report_mod
from demo import table as table_mod
from demo.errors import DemoError
from demo.fleet import HEALTHY_WITHIN_S, Fleet
from demo.model import DemoModel
from demo.recorder import Recorder, bridge_counters, disk_reads, gateway_counters
from demo.rootfs_stage import DemoRootfs, unmount_under
from demo.settings import MODEL, DemoSettings
from demo.view import View
from warmpool import connect, protocol
from warmpool.errors import BadMessage, PulsescaleError
from warmpool.protocol import Event, ScaledObjectSpec, ScalerRecord
from warmpool.registry import KvSlotStore, ensure_buckets

__all__ = ["DemoError", "DemoResult", "run_demo"]


@dataclass
class DemoResult:
    report: dict[str, Any]
    table: str
    report_path: Path
    plot_path: Path | None
    leftovers: list[int]


class Demo:
    """One run (module doc): the phases, run with the parts it composes (`recorder`, `rootfs`, `model`, `fleet`);
    the run's NATS connection, slot registry and work directory are its own."""

    def __init__(
        self, settings: DemoSettings, view: View, on_nats: Callable[[str], Awaitable[None]] | None = None
    ) -> None:
        self.s = settings
        self.run_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.workdir = Path(tempfile.mkdtemp(prefix="pulsescale-demo-"))
        self._threads: list[asyncio.Future[Any]] = []
        self.recorder = Recorder(view, settings.tick_s)
        self.rootfs = DemoRootfs(settings.image, self.workdir, self.recorder.say, self._in_thread)
        self.model = DemoModel(settings, self.workdir, self.recorder.say, self._in_thread)
        self.fleet = Fleet(
            settings,
            self.run_id,
            self.workdir,
            model=self.model,
            rootfs=self.rootfs,
            say=self.recorder.say,
            in_thread=self._in_thread,
            cold_nodes=self.recorder.cold_nodes,
        )
        self.nc: Client | None = None
        self.store: KvSlotStore | None = None
        self.gateway_url = ""
        self.bridge_url: str | None = None
        """``--source vllm-metrics``: the bridge's /healthz and /metrics."""
        self.on_nats = on_nats
        self.pulse_rps = settings.pulse_rps
        """The pulse's rate: nominal until a replica's service time is measured (`DemoSettings.pulse_rps_for`)."""

    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        """`fn` in a thread that cleanup waits for: a Ctrl-C while it runs must not leave a process it starts (the
        nats-server), files it writes, a mount or a lock behind. Shielded: cancelling the caller must not cancel
        the future cleanup awaits, which would end at once while the thread runs on (a `to_thread` task did)."""
        fut = asyncio.get_running_loop().run_in_executor(None, fn)
        self._threads.append(fut)
        return await asyncio.shield(fut)

    # --- messages -------------------------------------------------------------------------------------------------

    async def _on_event(self, msg: Msg) -> None:
        try:
            ev = protocol.decode(msg.data, Event)
        except BadMessage:
            return  # the autoscaler is ours: nothing else publishes here
        self.recorder.events.append(ev)
        if ev.type == "scale.decision" and ev.desired is not None:
            self.recorder.desired = ev.desired
        elif ev.type == "cold.start":
            self.fleet.cold_start(ev, self.store)

    # --- the parts ------------------------------------------------------------------------------------------------

    def _scaler_spec(self) -> dict[str, Any]:
        """The ScaledObject's spec as the demo writes it (and report.json's config records it)."""
        s = self.s
        return {
            "scaleTargetRef": {"name": MODEL},
            "minReplicaCount": s.base_replicas,
            "maxReplicaCount": s.fleet_slots,
            # Short windows: the demo lasts half a minute, and the way back down is part of what it shows.
            "cooldownPeriod": 5,
            "triggers": [
                {"type": "gateway-queue", "metadata": {"model": MODEL, "targetQueueDepth": s.target_queue_depth}}
            ],
            "advanced": {
                "stableWindowSeconds": 6,
                "panicWindowSeconds": 1,
                "scaleDownStabilizationSeconds": 4,
                "scaleDownPeriodSeconds": 1,
                "scaleDownPercent": 50,
                # The forecast horizon before the autoscaler has measured claim -> ready here (~30 ms): 2.5 s (the
                # default, for 100 GB models) extrapolates the first trickle of the base load into 5 replicas.
                "leadTimeSeconds": 0.5,
            },
            "warmPool": {"size": s.warm_slots, "engine": s.engine},
        }

    def _scaler(self) -> ScalerRecord:
        spec = protocol.decode(msgspec.json.encode(self._scaler_spec()), ScaledObjectSpec)
        return ScalerRecord(namespace="demo", name=MODEL, spec=spec, updated_at=time.time())

    # --- phases ---------------------------------------------------------------------------------------------------

    async def _wait_warm(self, apply: Callable[[], Awaitable[Any]]) -> None:
        """Until the pool is warm and the base replicas serve (the progress bar), or `ready_timeout_s`. The
        ScaledObject is written (`apply`) once the pool holds the base replicas' warm slots (or is all warm, when
        smaller): written earlier, the autoscaler finds no warm slot for ``minReplicaCount`` and asks the cold path
        before any load."""
        self.recorder.phase("staging")
        want = self.s.warm_slots
        self.recorder.snap.stage_total = max(want, self.s.base_replicas)
        timeout_s = self.s.vllm_ready_timeout_s if self.s.engine == "vllm" else self.s.ready_timeout_s
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + 2
        applied = False
        while True:
            self.fleet.check_children()
            ready, activating, warm = self.recorder.counts(self.store)
            self.recorder.snap.stage_done = min(self.recorder.snap.stage_total, ready + warm + activating)
            self.recorder.snap.stage_note = f"{ready} ready (base {self.s.base_replicas}), {warm} warm"
            self.recorder.tick(None, self.store)
            if not applied and warm >= min(self.s.base_replicas, want):  # a pool smaller than the base: all of it
                await apply()
                applied = True
            if applied and ready + warm >= want and ready >= self.s.base_replicas and activating == 0:
                return
            if time.monotonic() > next_check:
                next_check = time.monotonic() + 2
                await self._check_agents()
            if time.monotonic() > deadline:
                raise DemoError(
                    f"the fleet was not warm after {timeout_s:.0f} s ({ready} ready, {warm} warm, "
                    f"{activating} activating; wanted {want} slots and {self.s.base_replicas} ready); agent logs in "
                    f"{self.workdir}/logs"
                )
            await asyncio.sleep(0.1)

    async def _check_agents(self) -> None:
        """Ask the pool's agents how they are (`status`); one whose staging failed ends the demo with its reason."""
        assert self.nc is not None
        for node, _ in self.fleet.warm_nodes:
            req = protocol.AgentStatusRequest(id=secrets.token_hex(8), expires_at=time.time() + 30)
            try:
                msg = await self.nc.request(protocol.agent_subject(node, "status"), protocol.encode(req), timeout=1)
                reply = protocol.decode(msg.data, protocol.AgentStatusReply)
            except (TimeoutError, BadMessage, PulsescaleError, Exception):  # noqa: BLE001 - still starting: ask later
                continue
            if reply.weights is not None and reply.weights.error:
                raise DemoError(f"agent {node} could not stage the weights: {reply.weights.error}")

    async def _calibrate(self) -> float:
        """One replica's service time: the median of sequential requests (one at a time, so each meets an idle
        engine) sent straight to a ready slot's engine. Not through the gateway: its queue samples would show the
        autoscaler a burst of traffic from nothing, which it rightly scales out for, before the load starts."""
        self.recorder.phase("calibrating")
        assert self.store is not None
        ready = [r for r in self.store.records(MODEL) if r.state == "ready" and r.endpoint]
        if not ready:
            raise DemoError("no ready replica to time (the base replicas went away before the load)")
        endpoint = ready[0].endpoint
        took: list[float] = []
        body = {"model": MODEL, "prompt": "Say something about autoscaling.", "max_tokens": self.s.max_tokens}
        async with aiohttp.ClientSession() as session:
            for _ in range(12):
                t0 = time.perf_counter()
                async with session.post(f"{endpoint}/v1/completions", json=body) as r:
                    await r.read()
                    if r.status != 200:
                        raise DemoError(f"a calibration request to {endpoint} got HTTP {r.status}")
                took.append(time.perf_counter() - t0)
        return statistics.median(took[2:])  # the first requests open the connection

    async def _start_bridge(self, url: str) -> None:
        """``--source vllm-metrics``: the bridge, after the calibration (whose requests the engines count: the
        bridge would show them to the autoscaler as a burst from nothing, which the gateway's samples never do), and
        its first sample before the load."""
        self.bridge_url = await self.fleet.start_bridge(url)
        deadline = time.monotonic() + HEALTHY_WITHIN_S
        while not any(x.gateway == self.fleet.bridge_id for x in self.recorder.samples):
            self.fleet.check_children()
            if time.monotonic() > deadline:
                raise DemoError(
                    f"the bridge published no sample within {HEALTHY_WITHIN_S:g} s of its start; log: "
                    f"{self.workdir}/logs/bridge.log"
                )
            await asyncio.sleep(0.05)

    # --- the run --------------------------------------------------------------------------------------------------

    async def run(self) -> DemoResult:
        s = self.s
        try:
            self.recorder.phase("starting")
            url = await self.fleet.start_nats()
            if self.on_nats is not None:
                await self.on_nats(url)
            self.nc = await connect.connect(connect.NatsOptions(servers=(url,), name="pulsescale-demo"))
            buckets = await ensure_buckets(self.nc.jetstream(timeout=5.0), harden=True)
            await self.nc.subscribe(protocol.events_subject(MODEL), cb=self._on_event)
            await self.nc.subscribe(protocol.queue_subject(MODEL), cb=self.recorder.on_sample)
            self.store = KvSlotStore(self.nc, buckets)
            await self.store.start()
            rec = self._scaler()
            scalers = buckets[protocol.SCALERS_BUCKET]
            self.fleet.model_dir = await self.model.make()
            self.fleet.shm_root.mkdir(mode=0o755)
            await self.rootfs.prepare()
            self.fleet.start_autoscaler(url)
            for node, slots in self.fleet.warm_nodes:
                self.fleet.start_agent(url, node, slots, self.fleet.model_dir, cold=False)
            self.gateway_url = await self.fleet.start_gateway(url)
            await self._wait_warm(lambda: scalers.put(rec.key, protocol.encode(rec)))
            await self.rootfs.ask_agents(self.nc, self.fleet.warm_nodes)
            service_s = await self._calibrate()
            if s.source == "vllm-metrics":
                await self._start_bridge(url)
            self.pulse_rps = s.pulse_rps_for(service_s)
            needed = report_mod.needed_replicas(self.pulse_rps, service_s)
            self.recorder.snap.needed = needed
            if needed > s.warm_slots:
                self.recorder.say(
                    f"the pulse needs {needed} replicas and the warm pool holds {s.warm_slots}: the rest comes from "
                    "the cold path, and this run shows what that costs"
                )
            record = await self._load(service_s)
            return await self._finish(record)
        finally:
            await asyncio.shield(self._cleanup())

    async def _load(self, service_s: float) -> report_mod.RunRecord:
        s = self.s
        shape = load_mod.shape_of(
            base_rps=s.base_rps,
            pulse_rps=self.pulse_rps,
            duration_s=s.duration_s,
            pulse_at_s=s.pulse_start_s,
            pulse_s=s.pulse_len_s,
            ramp_s=s.ramp_s,
        )
        # Answers may take the gateway's timeout and then some: the generator waits that long for the last ones.
        runner = load_mod.LoadRun(
            self.gateway_url,
            MODEL,
            shape,
            max_tokens=s.max_tokens,
            timeout_s=s.request_timeout_s + s.drain_s,
            kind="poisson" if s.arrivals == "poisson" else "uniform",
        )
        stop_ticks = asyncio.Event()
        current: list[load_mod.LoadRun | None] = [None]
        ticker = asyncio.create_task(self.recorder.ticker(lambda: current[0], stop_ticks, self.store))
        tasks: list[asyncio.Task[Any]] = []
        try:
            self.recorder.load_start = time.time()
            current[0] = runner
            self.recorder.phase("base")
            task = asyncio.create_task(runner.run())
            tasks.append(task)
            pulse_start = self.recorder.load_start + s.pulse_start_s
            pulse_end = pulse_start + s.pulse_len_s
            await _sleep_until(pulse_start, task)
            reads0 = disk_reads()
            self.recorder.phase("pulse")
            self.rootfs.measure("pulse_start", self.store)
            await _sleep_until(pulse_end, task)
            reads1 = disk_reads()
            self.rootfs.measure("pulse_end", self.store)
            self.recorder.phase("after")
            await _sleep_until(self.recorder.load_start + s.duration_s, task)
            self.recorder.phase("draining")
            await asyncio.wait_for(task, s.drain_s + s.request_timeout_s + 5)
            load_end = time.time()
            await self.recorder.settle_samples(runner, counted=self.bridge_url is None)
            gateway_metrics = await gateway_counters(self.gateway_url, MODEL)
            bridge_metrics = None if self.bridge_url is None else await bridge_counters(self.bridge_url, MODEL)
            assert runner.started_at is not None
            # The generator's own t=0 (a few ms after ours): the per-second series and the pulse are timed from it.
            load_start = runner.started_at
            pulse_start, pulse_end = load_start + s.pulse_start_s, load_start + s.pulse_start_s + s.pulse_len_s
        finally:
            stop_ticks.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(ticker, *tasks, return_exceptions=True)
        rec = report_mod.RunRecord(
            load_start=load_start,
            pulse_start=pulse_start,
            pulse_end=pulse_end,
            load_end=load_end,
            seconds=runner.seconds(),
            ticks=list(self.recorder.ticks),
            events=list(self.recorder.events),
            samples=list(self.recorder.samples),
            phases=list(self.recorder.phases),
            cold_nodes=dict(self.recorder.cold_nodes),
            cold_warm_at=dict(self.recorder.cold_warm_at),
            replica_service_s=service_s,
            disk_reads=None if reads0 is None or reads1 is None else reads1 - reads0,
            notes=list(self.recorder.notes),
            load_totals=runner.totals(),
            requests=list(runner.requests),
            offered_end=load_start + shape.duration_s,
            gateway_metrics=gateway_metrics,
            bridge_id=self.fleet.bridge_id if self.bridge_url is not None else None,
            bridge_metrics=bridge_metrics,
        )
        await self.rootfs.stop_keeper()
        rec.rootfs = dict(self.rootfs.report)
        return rec

    def _config(self, service_s: float | None) -> dict[str, Any]:
        s = self.s
        cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()}
        cfg.update(
            pool_size=s.warm_slots,
            fleet_slots=s.fleet_slots,
            base_replicas=s.base_replicas,
            provisioned_rps=round(self.pulse_rps / s.pulse, 2),
            pulse_rps=round(self.pulse_rps, 2),
            pulse_start_s=s.pulse_start_s,
            pulse_s=s.pulse_len_s,
            service_s=service_s,
            scaled_object=self._scaler_spec(),
            engine_user=self.model.engine_user,
            vllm_args=self.model.vllm_args or None,
            machine={"cpus": os.cpu_count(), "python": sys.version.split()[0], "root": os.geteuid() == 0},
        )
        return cfg

    async def _finish(self, rec: report_mod.RunRecord) -> DemoResult:
        s = self.s
        self.recorder.phase("done")
        report = report_mod.build_report(
            rec,
            self._config(rec.replica_service_s),
            pulse_rps=self.pulse_rps,
            timeout_s=s.request_timeout_s,
        )
        s.out_dir.mkdir(parents=True, exist_ok=True)
        report_path = s.out_dir / "report.json"
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        plot_path: Path | None = s.out_dir / "pulsescale-demo.png"
        try:
            from demo import plot

            assert plot_path is not None
            await asyncio.to_thread(plot.plot, report, plot_path)
        except Exception as err:  # noqa: BLE001 - the report stands without its picture; say why
            self.recorder.say(f"no plot: {err}")
            plot_path = None
        table = table_mod.article_table(report)
        return DemoResult(report, table, report_path, plot_path, [])

    async def _cleanup(self) -> None:
        """Stop everything of the run and remove its files, whatever state it is in."""
        self.fleet.closing = True
        for fut in self._threads:
            with contextlib.suppress(BaseException):
                await fut
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.close()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        await self.fleet.stop()
        await self.rootfs.stop_keeper()
        await self.rootfs.release()  # after every process is stopped: nothing holds the mount any more
        unmount_under(self.workdir)
        if self.s.keep_logs and (self.workdir / "logs").is_dir():
            with contextlib.suppress(OSError):
                dest = self.s.out_dir / "logs"
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(self.workdir / "logs", dest)
        shutil.rmtree(self.fleet.shm_root, ignore_errors=True)
        self.model.remove()
        shutil.rmtree(self.workdir, ignore_errors=True)


async def _sleep_until(wall: float, task: asyncio.Task[Any]) -> None:
    """Sleep until wall time `wall`, or until `task` ends (its error is raised)."""
    delay = wall - time.time()
    if delay > 0:
        await asyncio.wait([task], timeout=delay)
    if task.done() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


async def run_demo(
    settings: DemoSettings, view: View, *, on_nats: Callable[[str], Awaitable[None]] | None = None
) -> DemoResult:
    """Run the demo once (module doc); every process and file of the run is gone when this returns or raises.
    `on_nats(url)` is awaited once the embedded nats-server is up, before anything publishes (a test subscribes
    there to check the report against the run's own events)."""
    return await Demo(settings, view, on_nats).run()
