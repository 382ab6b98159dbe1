"""`pulsescale demo`: the article's surge, end to end, on this machine.

One run, in phases (each shown live and recorded):

1. **starting**: an embedded nats-server (its own store in a temporary directory), the buckets, the ScaledObject
   (``minReplicaCount`` = the replicas the base load is provisioned with), a generated tiny model, and the rootfs
   stage (`demo.image`): as root, one real EROFS image built, loop-mounted and warmed once for every agent, locked
   in the page cache until the load ends; elsewhere skipped, said once.
2. **staging**: the autoscaler (a ``pulsescale autoscaler`` process), the node agents of the warm pool (one
   ``pulsescale agent`` process per node: they stage the weights into /dev/shm, fork their engines' zygotes and
   offer their slots) and the reference gateway (``pulsescale gateway``). The autoscaler activates the base
   replicas as soon as slots are warm. A progress bar counts slots until the pool is warm.
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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import statistics
import subprocess
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

from demo import image as image_mod
from demo import load as load_mod
from demo import report as report_mod
from demo.procs import Child, Processes
from demo.settings import MODEL, DemoSettings
from demo.view import Snapshot, View
from nodeagent import rootfs, tinymodel
from warmpool import connect, protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.errors import BadMessage, PulsescaleError
from warmpool.protocol import Event, QueueSample, ScaledObjectSpec, ScalerRecord
from warmpool.registry import KvSlotStore, ensure_buckets

__all__ = ["DemoError", "DemoResult", "run_demo"]

log = logging.getLogger("pulsescale.demo")

ACTIVATING_STATES = frozenset({"claimed", "activating"})
STOP_ORDER = ("load", "gateway", "autoscaler", "cold-", "agent-", "nats")
"""Children stop in this order: nothing sends requests to a stopped gateway, no claim lands on a stopped agent."""


class DemoError(PulsescaleError):
    """The demo could not run (a part did not start, the fleet never got warm); the message says which and why."""


@dataclass
class DemoResult:
    report: dict[str, Any]
    table: str
    report_path: Path
    plot_path: Path | None
    leftovers: list[int]


def _python() -> list[str]:
    return [sys.executable, "-m", "pulsescale"]


def _child_env() -> dict[str, str]:
    """The demo's environment without NATS settings meant for another broker (children get `--nats`)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PULSESCALE_NATS")}


def _engine_user() -> tuple[str, str | None]:
    """The user the vLLM servers run as, and why when it is not the agent's default (``nobody``): a root agent
    drops a server to ``nobody`` only when nobody can run this interpreter (every directory up to it searchable);
    a venv under /root (0700) is not, and ``root`` is the agent's explicit opt-out."""
    if os.geteuid() != 0:
        return "nobody", None  # an agent that is not root drops to nobody
    exe = Path(os.path.realpath(sys.executable))
    blocked = [p for p in [exe, *exe.parents] if not os.stat(p).st_mode & 0o001]
    if not blocked:
        return "nobody", None
    return "root", (
        f"vLLM servers run as root: the engine user nobody cannot run {exe} ({blocked[-1]} is not searchable by "
        "others); install the venv outside /root to run them unprivileged"
    )


def _vllm_args(settings: DemoSettings) -> str:
    """`DemoSettings.vllm_args`, plus a share of the GPU per server on a GPU node: every slot of the demo's fleet
    runs its own vLLM on this machine's GPU, and vLLM takes 90 % of it by default (the second server would not
    fit)."""
    from nodeagent import vllm

    args = settings.vllm_args
    try:
        gpu = vllm.detect_platform().gpu
    except PulsescaleError:
        return args
    if gpu and "--gpu-memory-utilization" not in args:
        args += f" --gpu-memory-utilization {max(0.05, 0.85 / settings.fleet_slots):.2f}"
    return args


def _vllm_on_cpu() -> bool:
    from nodeagent import vllm

    try:
        return vllm.detect_platform().cpu
    except PulsescaleError:
        return False


def _disk_reads() -> int | None:
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


class Demo:
    def __init__(
        self, settings: DemoSettings, view: View, on_nats: Callable[[str], Awaitable[None]] | None = None
    ) -> None:
        self.s = settings
        self.view = view
        self.run_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.workdir = Path(tempfile.mkdtemp(prefix="pulsescale-demo-"))
        self.shm_root = Path("/dev/shm") / f"pulsescale-demo-{self.run_id}"
        self.procs = Processes(self.run_id, self.workdir / "logs")
        self.snap = Snapshot(needed=None)
        self.events: list[Event] = []
        self.samples: list[QueueSample] = []
        self.ticks: list[report_mod.Tick] = []
        self.phases: list[tuple[str, float]] = []
        self.notes: list[str] = []
        self.cold_nodes: dict[str, float] = {}
        self.cold_warm_at: dict[str, float] = {}
        self.cold_scheduled: set[str] = set()
        self.desired: int | None = None
        self.load_start: float | None = None
        self.nats: NatsServer | None = None
        self.nc: Client | None = None
        self.store: KvSlotStore | None = None
        self.gateway_url = ""
        self.warm_nodes, self.spare_nodes = self._layout()
        self.rootfs_dir: Path | None = None
        """This run's rootfs directory, once the stage mounts (or tries to): the clean-up releases it."""
        self.image: image_mod.MountedImage | None = None
        self.keeper: image_mod.Keeper | None = None
        self._keeper_stop = asyncio.Event()
        self._keeper_task: asyncio.Task[None] | None = None
        self.rootfs_report: dict[str, Any] = {"mode": settings.image, "mounted": False}
        self._threads: list[asyncio.Future[Any]] = []
        self._seen_samples = 0
        self.on_nats = on_nats
        self.pulse_rps = settings.pulse_rps
        """The pulse's rate: nominal until a replica's service time is measured (`DemoSettings.pulse_rps_for`)."""
        self.engine_user: str | None = None
        """``--engine vllm``: the user its servers run as (`_engine_user`)."""
        self.vllm_args = ""
        self.model_root: Path = self.workdir / "models"
        """Where the generated model goes; for servers that drop to nobody a directory of its own that nobody can
        read (the run's work directory is root's, 0700)."""

    # --- layout ---------------------------------------------------------------------------------------------------

    def _layout(self) -> tuple[list[tuple[str, int]], list[str]]:
        """(warm nodes with their slot counts, spare nodes the cold path may start)."""
        names = [f"n{i + 1:02d}" for i in range(self.s.nodes)]
        warm: list[tuple[str, int]] = []
        left = self.s.warm_slots
        for name in names:
            if left <= 0:
                break
            k = min(self.s.slots_per_node, left)
            warm.append((name, k))
            left -= k
        return warm, names[len(warm) :]

    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        """`fn` in a thread that cleanup waits for: a Ctrl-C while it runs must not leave a process it starts (the
        nats-server), files it writes, a mount or a lock behind. Shielded: cancelling the caller must not cancel
        the future cleanup awaits, which would end at once while the thread runs on (a `to_thread` task did)."""
        fut = asyncio.get_running_loop().run_in_executor(None, fn)
        self._threads.append(fut)
        return await asyncio.shield(fut)

    # --- messages -------------------------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        self.notes.append(text)
        self.snap.messages.append(text)
        self.view.say(text)

    def phase(self, name: str) -> None:
        self.phases.append((name, time.time()))
        self.snap.phase = name
        self.view.update(self.snap)

    async def _on_event(self, msg: Msg) -> None:
        try:
            ev = protocol.decode(msg.data, Event)
        except BadMessage:
            return  # the autoscaler is ours: nothing else publishes here
        self.events.append(ev)
        if ev.type == "scale.decision" and ev.desired is not None:
            self.desired = ev.desired
        elif ev.type == "cold.start":
            self._cold_start(ev)

    async def _on_sample(self, msg: Msg) -> None:
        try:
            self.samples.append(protocol.decode(msg.data, QueueSample))
        except BadMessage:
            return

    # --- the parts ------------------------------------------------------------------------------------------------

    async def _start_nats(self) -> str:
        self.nats = NatsServer(self.workdir / "nats")
        await self._in_thread(self.nats.start)
        assert self.nats.proc is not None
        self.procs.adopt("nats", self.nats.proc, self.nats.log_path)
        return self.nats.url

    def _scaler(self) -> ScalerRecord:
        s = self.s
        raw = {
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
        spec = protocol.decode(msgspec.json.encode(raw), ScaledObjectSpec)
        return ScalerRecord(namespace="demo", name=MODEL, spec=spec, updated_at=time.time())

    async def _make_model(self) -> Path:
        """The generated tiny model, with `token_ms` in its config (the emulated accelerator time per token)."""
        if self.s.engine == "vllm":
            user, why = _engine_user()
            self.engine_user, self.vllm_args = user, _vllm_args(self.s)
            if why:
                self.say(why)
            if _vllm_on_cpu():
                self.say(
                    f"vLLM's CPU build: every replica's requests run on this machine's {os.cpu_count()} cores, so "
                    "replicas past the first add little capacity; a pulse beyond what the cores serve gets 504s "
                    "that are the CPU's, not the scale-out's (on CPU, try --pulse 100%)"
                )
            if os.geteuid() != 0 or user != "root":
                self.model_root = Path(tempfile.mkdtemp(prefix="pulsescale-demo-model-"))
                os.chmod(self.model_root, 0o755)
        out = self.model_root / MODEL

        def make() -> None:
            if self.s.engine == "vllm":
                from nodeagent import hfmodel

                hfmodel.make_tiny_hf(out)
                for d in (out, *out.rglob("*")):  # the server reads --model as its engine user
                    os.chmod(d, 0o755 if d.is_dir() else 0o644)
                return
            tinymodel.make_tiny(out, self.s.model_bytes, extra_config={"token_ms": self.s.token_ms})

        await self._in_thread(make)
        return out

    def _agent_argv(self, url: str, node: str, slots: int, model_dir: Path) -> list[str]:
        argv = [
            *_python(), "agent", "--nats", url, "--node", node, "--rack", f"rack-{int(node[1:]) % 4}",
            "--slots", str(slots), "--model", str(model_dir), "--model-name", MODEL,
            "--shm-dir", str(self.shm_root / node), "--metrics-port", "-1", "--engine", self.s.engine,
            "--log-level", "WARNING",
        ]  # fmt: skip
        if self.image is not None:
            argv += ["--image", str(self.image.source), "--rootfs-dir", str(self.image.rootfs_dir)]
        if self.s.engine == "vllm":
            assert self.engine_user is not None
            argv += [
                "--engine-user", self.engine_user, "--vllm-args", self.vllm_args,
                "--engine-start-timeout-s", str(self.s.vllm_ready_timeout_s),
            ]  # fmt: skip
        return argv

    def _start_agent(self, url: str, node: str, slots: int, model_dir: Path, *, cold: bool) -> Child:
        name = f"{'cold-' if cold else 'agent-'}{node}"
        return self.procs.spawn(name, self._agent_argv(url, node, slots, model_dir), env=_child_env())

    def _cold_start(self, ev: Event) -> None:
        """Answer the autoscaler's ``cold.start``: start spare nodes for the replicas it could not find warm."""
        asked = ev.desired or 0
        # Slots of the pool still staging are on their way: only what they cannot cover is the cold path's.
        want = max(0, asked - self._cold_slots_pending() - self._pool_slots_starting())
        started = []
        while want > 0 and self.spare_nodes:
            node = self.spare_nodes.pop(0)
            started.append(node)
            self.cold_scheduled.add(node)
            want -= self.s.slots_per_node
            asyncio.get_running_loop().call_later(self.s.cold_delay_s, self._launch_cold, node)
        if started:
            self.say(
                f"cold path: the pool had no warm slot for {asked} more replica(s); starting {', '.join(started)} "
                f"from nothing"
                + (f" after {self.s.cold_delay_s:g} s (scheduling, image pull)" if self.s.cold_delay_s else "")
            )
        elif want > 0:
            self.say(f"cold path: {asked} more replica(s) asked for, but the fleet has no node left to start")

    def _pool_slots_starting(self) -> int:
        """Slots of the warm pool's nodes that have not turned warm yet (their agents are still staging)."""
        if self.store is None:
            return 0
        pool = {n for n, _ in self.warm_nodes}
        up = sum(1 for r in self.store.records(MODEL) if r.node in pool and r.state not in ("prewarming", "failed"))
        return max(0, self.s.warm_slots - up)

    def _launch_cold(self, node: str) -> None:
        if self.nats is None or self._closing:
            return
        self.cold_nodes[node] = time.time()
        self._start_agent(self.nats.url, node, self.s.slots_per_node, self.model_dir, cold=True)

    async def _start_gateway(self, url: str) -> str:
        port = free_port()
        # One request per slot at a time: the local engine serves one at a time (its model lock), so the rest wait
        # in the gateway's queue, where the autoscaler sees them.
        argv = [
            *_python(), "gateway", "--nats", url, "--listen", f"127.0.0.1:{port}", "--models", MODEL,
            "--timeout-s", str(self.s.request_timeout_s), "--queue-limit", str(self.s.queue_limit),
            "--endpoint-concurrency", "1", "--log-level", "WARNING",
        ]  # fmt: skip
        self.procs.spawn("gateway", argv, env=_child_env())
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.get(f"{base}/healthz", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200:
                            return base
                self._check_children()
                await asyncio.sleep(0.1)
        raise DemoError(f"the gateway did not answer {base}/healthz within 30 s; log: {self.workdir}/logs/gateway.log")

    def _check_children(self) -> None:
        for c in self.procs.children:
            if not c.alive() and c.name != "load":
                raise DemoError(f"{c.name} exited with {c.proc.returncode}: {c.tail(800).strip()}")

    # --- ticks ----------------------------------------------------------------------------------------------------

    def _counts(self) -> tuple[int, int, int]:
        assert self.store is not None
        ready = activating = warm = 0
        for r in self.store.records(MODEL):
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

    def _cold_slots_pending(self) -> int:
        """Slots of the nodes the cold path started (or will, after its delay) that are not warm yet."""
        assert self.store is not None
        up: dict[str, int] = {}
        for r in self.store.records(MODEL):
            if r.state not in ("prewarming", "failed"):
                up[r.node] = up.get(r.node, 0) + 1
        return sum(max(0, self.s.slots_per_node - up.get(n, 0)) for n in self.cold_scheduled)

    def _tick(self, load: load_mod.LoadRun | None) -> None:
        ready, activating, warm = self._counts()
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

    async def _ticker(self, load: Callable[[], load_mod.LoadRun | None], stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._tick(load())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.s.tick_s)

    # --- phases ---------------------------------------------------------------------------------------------------

    async def _wait_warm(self) -> None:
        """Until the pool is warm and the base replicas serve (the progress bar), or `ready_timeout_s`."""
        self.phase("staging")
        want = self.s.warm_slots
        self.snap.stage_total = max(want, self.s.base_replicas)
        timeout_s = self.s.vllm_ready_timeout_s if self.s.engine == "vllm" else self.s.ready_timeout_s
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + 2
        while True:
            self._check_children()
            ready, activating, warm = self._counts()
            self.snap.stage_done = min(self.snap.stage_total, ready + warm + activating)
            self.snap.stage_note = f"{ready} ready (base {self.s.base_replicas}), {warm} warm"
            self._tick(None)
            if ready + warm >= want and ready >= self.s.base_replicas and activating == 0:
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
        for node, _ in self.warm_nodes:
            req = protocol.AgentStatusRequest(id=secrets.token_hex(8), expires_at=time.time() + 30)
            try:
                msg = await self.nc.request(protocol.agent_subject(node, "status"), protocol.encode(req), timeout=1)
                reply = protocol.decode(msg.data, protocol.AgentStatusReply)
            except (TimeoutError, BadMessage, PulsescaleError, Exception):  # noqa: BLE001 - still starting: ask later
                continue
            if reply.weights is not None and reply.weights.error:
                raise DemoError(f"agent {node} could not stage the weights: {reply.weights.error}")

    async def _agents_rootfs(self) -> None:
        """What the pool's agents say of the image (`AgentStatusReply.rootfs`): each should run from the demo's
        mount, having built nothing and reused the mount (one image, one mount, one loop device per host)."""
        if self.image is None:
            return
        assert self.nc is not None
        asked = mounted = built = reused = 0
        reasons: list[str] = []
        for node, _ in self.warm_nodes:
            asked += 1
            req = protocol.AgentStatusRequest(id=secrets.token_hex(8), expires_at=time.time() + 30)
            try:
                msg = await self.nc.request(protocol.agent_subject(node, "status"), protocol.encode(req), timeout=2)
                st = protocol.decode(msg.data, protocol.AgentStatusReply).rootfs
            except Exception as err:  # noqa: BLE001 - a figure of the report, not a reason to stop the run
                reasons.append(f"{node}: no status ({type(err).__name__})")
                continue
            if st is None:
                continue
            if st.mounted and st.digest == self.image.digest:
                mounted += 1
            elif st.reason:
                reasons.append(f"{node}: {st.reason}")
            built += st.images_built
            reused += st.mounts_reused
        self.rootfs_report["agents"] = {
            "asked": asked,
            "mounted": mounted,
            "images_built": built,
            "mounts_reused": reused,
            "reasons": reasons,
        }
        if mounted < asked:
            self.say(f"rootfs: {mounted} of {asked} agents run from the image: {'; '.join(reasons)}")

    async def _calibrate(self) -> float:
        """One replica's service time: the median of sequential requests (one at a time, so each meets an idle
        engine) sent straight to a ready slot's engine. Not through the gateway: its queue samples would show the
        autoscaler a burst of traffic from nothing, which it rightly scales out for, before the load starts."""
        self.phase("calibrating")
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

    # --- the run --------------------------------------------------------------------------------------------------

    _closing = False
    model_dir: Path

    async def run(self) -> DemoResult:
        s = self.s
        try:
            self.phase("starting")
            url = await self._start_nats()
            if self.on_nats is not None:
                await self.on_nats(url)
            self.nc = await connect.connect(connect.NatsOptions(servers=(url,), name="pulsescale-demo"))
            buckets = await ensure_buckets(self.nc.jetstream(timeout=5.0), harden=True)
            await self.nc.subscribe(protocol.events_subject(MODEL), cb=self._on_event)
            await self.nc.subscribe(protocol.queue_subject(MODEL), cb=self._on_sample)
            self.store = KvSlotStore(self.nc, buckets)
            await self.store.start()
            rec = self._scaler()
            await buckets[protocol.SCALERS_BUCKET].put(rec.key, protocol.encode(rec))
            self.model_dir = await self._make_model()
            self.shm_root.mkdir(mode=0o755)
            await self._prepare_rootfs()
            self.procs.spawn(
                "autoscaler",
                [*_python(), "autoscaler", "--nats", url, "--lease", "2", "--log-level", "WARNING"],
                env=_child_env(),
            )
            for node, slots in self.warm_nodes:
                self._start_agent(url, node, slots, self.model_dir, cold=False)
            self.gateway_url = await self._start_gateway(url)
            await self._wait_warm()
            await self._agents_rootfs()
            service_s = await self._calibrate()
            self.pulse_rps = s.pulse_rps_for(service_s)
            needed = report_mod.needed_replicas(self.pulse_rps, service_s)
            self.snap.needed = needed
            if needed > s.warm_slots:
                self.say(
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
        ticker = asyncio.create_task(self._ticker(lambda: current[0], stop_ticks))
        tasks: list[asyncio.Task[Any]] = []
        try:
            self.load_start = time.time()
            current[0] = runner
            self.phase("base")
            task = asyncio.create_task(runner.run())
            tasks.append(task)
            pulse_start = self.load_start + s.pulse_start_s
            pulse_end = pulse_start + s.pulse_len_s
            await _sleep_until(pulse_start, task)
            reads0 = _disk_reads()
            self.phase("pulse")
            self._rootfs_at("pulse_start")
            await _sleep_until(pulse_end, task)
            reads1 = _disk_reads()
            self._rootfs_at("pulse_end")
            self.phase("after")
            await _sleep_until(self.load_start + s.duration_s, task)
            self.phase("draining")
            await asyncio.wait_for(task, s.drain_s + s.request_timeout_s + 5)
            load_end = time.time()
            await self._settle_samples(runner)
            assert runner.result is not None
            # The generator's own t=0 (a few ms after ours): the per-second series and the pulse are timed from it.
            load_start = runner.result.started_at
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
            ticks=list(self.ticks),
            events=list(self.events),
            samples=list(self.samples),
            phases=list(self.phases),
            cold_nodes=dict(self.cold_nodes),
            cold_warm_at=dict(self.cold_warm_at),
            replica_service_s=service_s,
            disk_reads=None if reads0 is None or reads1 is None else reads1 - reads0,
            notes=list(self.notes),
            load_totals=runner.totals(),
        )
        await self._stop_keeper()
        rec.rootfs = dict(self.rootfs_report)
        return rec

    async def _settle_samples(self, runner: load_mod.LoadRun) -> None:
        """Wait (briefly) for the gateway sample that counts every request the load sent."""
        sent = runner.totals().get("sent", 0)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            last = self.samples[-1] if self.samples else None
            if last is not None and last.arrivals_total >= sent and last.queue_depth == 0 and last.inflight == 0:
                return
            await asyncio.sleep(0.05)

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
            engine_user=self.engine_user,
            vllm_args=self.vllm_args or None,
            machine={"cpus": os.cpu_count(), "python": sys.version.split()[0], "root": os.geteuid() == 0},
        )
        return cfg

    async def _finish(self, rec: report_mod.RunRecord) -> DemoResult:
        s = self.s
        self.phase("done")
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
            self.say(f"no plot: {err}")
            plot_path = None
        table = report_mod.article_table(report)
        return DemoResult(report, table, report_path, plot_path, [])

    async def _prepare_rootfs(self) -> None:
        """The rootfs stage (`demo.image`): build and mount the image once, before any agent starts, or say once
        why the stage is skipped."""
        mode = self.s.image
        if mode == image_mod.NONE:
            self.rootfs_report["reason"] = "--image none"
            self.say("rootfs stage off (--image none): engines run from this machine's own files")
            return
        why = rootfs.probe()
        if why is not None:
            self.rootfs_report["reason"] = why
            self.say(f"rootfs stage skipped: {why}; engines run from this machine's own files")
            return
        self.rootfs_dir = image_mod.new_rootfs_dir()
        rootfs_dir = self.rootfs_dir

        def prepare() -> image_mod.MountedImage:
            auto = mode == image_mod.AUTO
            source = image_mod.make_source(self.workdir / "image") if auto else Path(mode).resolve()
            return image_mod.mount_image(source, rootfs_dir)

        try:
            self.image = await self._in_thread(prepare)
        except (rootfs.BadImage, rootfs.RootfsUnavailable, OSError) as err:
            if mode != image_mod.AUTO:
                raise DemoError(str(err) if "--image" in str(err) else f"--image {mode}: {err}") from None
            self.rootfs_report["reason"] = str(err)
            self.say(f"rootfs stage skipped: {err}")
            return
        img = self.image
        self.rootfs_report.update(img.as_report())
        self.keeper = image_mod.Keeper(img)
        pinned = await self._in_thread(self.keeper.pin)  # cleanup waits for it, then `_stop_keeper` unlocks
        self._keeper_task = asyncio.create_task(self._keep_resident(self.keeper))
        self.say(
            f"rootfs: {img.digest[:19]}... ({img.image_bytes / 1e6:.1f} MB, {img.files} files) "
            f"{'built' if img.built else 'found built'} in {img.build_s:.2f} s, loop-mounted read-only in "
            f"{img.mount_s * 1e3:.0f} ms, {img.resident_pct:.0f} % in the page cache, "
            + (f"locked there ({pinned.files} files)" if pinned.refused is None else f"not locked ({pinned.refused})")
            + "; every agent reuses this mount"
        )

    async def _keep_resident(self, keeper: image_mod.Keeper) -> None:
        """Re-check the image every `KEEP_RESIDENT_EVERY_S` until the run ends (`demo.image`, "Kept resident")."""
        while not self._keeper_stop.is_set():
            try:
                await asyncio.to_thread(keeper.check)
            except OSError as err:  # the image went away under us: said once, the run goes on without the check
                self.say(f"rootfs: cannot check the image's page-cache residency any more: {err}")
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._keeper_stop.wait(), image_mod.KEEP_RESIDENT_EVERY_S)

    async def _stop_keeper(self) -> None:
        self._keeper_stop.set()
        if self._keeper_task is not None:
            with contextlib.suppress(BaseException):
                await self._keeper_task  # its thread holds the image's files open for a moment: not cancelled
        if self.keeper is not None:
            self.keeper.release()  # unlocked before the image is unmounted: its mappings hold the files open
            self.rootfs_report.update(self.keeper.as_report())

    def _rootfs_at(self, when: str) -> None:
        """The image's page-cache residency and the slots that run from it, at `when` (the pulse's start, its
        end): what keeps the host's disk quiet during the scale-out."""
        if self.image is None or self.store is None:
            return
        records = [r for r in self.store.records(MODEL) if r.state not in ("prewarming", "failed")]
        self.rootfs_report[f"resident_pct_at_{when}"] = round(self.image.residency_pct(), 2)
        self.rootfs_report[f"slots_at_{when}"] = len(records)
        self.rootfs_report[f"slots_on_image_at_{when}"] = sum(
            1 for r in records if r.rootfs_mounted and r.image_digest == self.image.digest
        )

    async def _cleanup(self) -> None:
        """Stop everything of the run and remove its files, whatever state it is in."""
        self._closing = True
        for fut in self._threads:
            with contextlib.suppress(BaseException):
                await fut
        if (
            self.nats is not None
            and self.nats.proc is not None
            and not any(c.proc is self.nats.proc for c in self.procs.children)
        ):
            self.procs.adopt("nats", self.nats.proc, self.nats.log_path)
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.close()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        stray = await self.procs.stop_all(self.s.stop_timeout_s, order=STOP_ORDER)
        if stray:
            log.warning("killed %d process(es) of this run that had left their group: %s", len(stray), stray)
        await self._stop_keeper()
        if self.rootfs_dir is not None:  # after every process is stopped: nothing holds the mount any more
            try:
                done = await asyncio.to_thread(image_mod.release, self.rootfs_dir)
                log.info("rootfs released: %s", done)
            except Exception as err:  # noqa: BLE001 - the last resort below still runs
                log.warning("rootfs clean-up of %s failed: %s", self.rootfs_dir, err)
            _unmount_under(self.rootfs_dir)
        _unmount_under(self.workdir)
        if self.s.keep_logs and (self.workdir / "logs").is_dir():
            with contextlib.suppress(OSError):
                dest = self.s.out_dir / "logs"
                shutil.rmtree(dest, ignore_errors=True)
                shutil.copytree(self.workdir / "logs", dest)
        shutil.rmtree(self.shm_root, ignore_errors=True)
        if self.model_root.parent != self.workdir:
            shutil.rmtree(self.model_root, ignore_errors=True)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _unmount_under(root: Path) -> None:
    """Last resort: lazily unmount anything still mounted under `root` (a rootfs the agent's cleanup missed)."""
    try:
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return
    for mp in sorted((m for m in mounts if m.startswith(str(root) + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


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
