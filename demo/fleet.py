"""The run's processes: the embedded nats-server, the autoscaler, the node agents (the warm pool's, and the cold
path's, started from nothing when the autoscaler asks), the reference gateway and, with ``--source vllm-metrics``,
``pulsescale bridge``; watched while the run waits on them, and all stopped in order at the end (`demo.procs`).

The cold path: the autoscaler publishes ``cold.start`` when the pool cannot give it the replicas it wants (it has no
Kubernetes to ask here); `Fleet.cold_start` answers it by starting spare nodes' agents from nothing, after
`cold_delay_s` (what a real cluster adds: scheduling, the image pull).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from demo.errors import DemoError
from demo.model import DemoModel
from demo.procs import Child, Processes
from demo.rootfs_stage import DemoRootfs
from demo.settings import MODEL, DemoSettings
from warmpool.embedded import NatsServer, free_port
from warmpool.protocol import Event
from warmpool.registry import KvSlotStore

__all__ = ["STOP_ORDER", "Fleet"]

log = logging.getLogger("pulsescale.demo")

STOP_ORDER = ("load", "gateway", "bridge", "autoscaler", "cold-", "agent-", "nats")
"""Children stop in this order: nothing sends requests to a stopped gateway, no claim lands on a stopped agent."""
HEALTHY_WITHIN_S = 30.0
"""The gateway and the bridge answer /healthz within this of their start (a second or two on an idle machine)."""


def _python() -> list[str]:
    return [sys.executable, "-m", "pulsescale"]


def _child_env() -> dict[str, str]:
    """The demo's environment without NATS settings meant for another broker (children get `--nats`)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PULSESCALE_NATS")}


class Fleet:
    """Starts the run's processes (each in its own group, `demo.procs`), answers the cold path, stops them all
    (`stop`). The agents get the `model` and, once the stage has mounted one, the `rootfs` image; `say` tells the run's
    view; `in_thread` runs a blocking step in a thread the run's clean-up waits for (`Demo._in_thread`); `cold_nodes`
    is the run's record of when the cold path started each node (`Recorder.cold_nodes`), written here."""

    def __init__(
        self,
        settings: DemoSettings,
        run_id: str,
        workdir: Path,
        *,
        model: DemoModel,
        rootfs: DemoRootfs,
        say: Callable[[str], None],
        in_thread: Callable[[Callable[[], Any]], Awaitable[Any]],
        cold_nodes: dict[str, float],
    ) -> None:
        self.s = settings
        self.workdir = workdir
        self.model = model
        self.rootfs = rootfs
        self.say = say
        self._in_thread = in_thread
        self.shm_root = Path("/dev/shm") / f"pulsescale-demo-{run_id}"
        self.procs = Processes(run_id, workdir / "logs")
        self.bridge_id = f"demo-bridge-{run_id}"
        """The bridge's gateway id in its samples (``--source vllm-metrics``)."""
        self.nats: NatsServer | None = None
        self.cold_nodes = cold_nodes
        self.cold_scheduled: set[str] = set()
        self.warm_nodes, self.spare_nodes = self._layout()

    closing = False
    """Set as the run's clean-up begins: a cold start still waiting out its delay starts nothing then."""
    model_dir: Path
    """The generated model (`DemoModel.make`), set before the first agent starts."""

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

    # --- the parts ------------------------------------------------------------------------------------------------

    async def start_nats(self) -> str:
        self.nats = NatsServer(self.workdir / "nats")
        await self._in_thread(self.nats.start)
        assert self.nats.proc is not None
        self.procs.adopt("nats", self.nats.proc, self.nats.log_path)
        return self.nats.url

    def start_autoscaler(self, url: str) -> None:
        self.procs.spawn(
            "autoscaler",
            [*_python(), "autoscaler", "--nats", url, "--lease", "2", "--log-level", "WARNING"],
            env=_child_env(),
        )

    def agent_argv(self, url: str, node: str, slots: int, model_dir: Path) -> list[str]:
        argv = [
            *_python(), "agent", "--nats", url, "--node", node, "--rack", f"rack-{int(node[1:]) % 4}",
            "--slots", str(slots), "--model", str(model_dir), "--model-name", MODEL,
            "--shm-dir", str(self.shm_root / node), "--metrics-port", "-1", "--engine", self.s.engine,
            "--log-level", "WARNING",
        ]  # fmt: skip
        if self.rootfs.image is not None:
            argv += ["--image", str(self.rootfs.image.source), "--rootfs-dir", str(self.rootfs.image.rootfs_dir)]
        if self.s.engine == "vllm":
            assert self.model.engine_user is not None
            argv += [
                "--engine-user", self.model.engine_user, "--vllm-args", self.model.vllm_args,
                "--engine-start-timeout-s", str(self.s.vllm_ready_timeout_s),
            ]  # fmt: skip
        return argv

    def start_agent(self, url: str, node: str, slots: int, model_dir: Path, *, cold: bool) -> Child:
        name = f"{'cold-' if cold else 'agent-'}{node}"
        return self.procs.spawn(name, self.agent_argv(url, node, slots, model_dir), env=_child_env())

    async def start_gateway(self, url: str) -> str:
        port = free_port()
        # One request per slot at a time: the local engine serves one at a time (its model lock), so the rest wait
        # in the gateway's queue, where the autoscaler sees them. With the bridge as the source, the queue must be
        # in the engines, where it reads them (`DemoSettings.engine_queue`), and the gateway publishes nothing.
        bridged = self.s.source == "vllm-metrics"
        argv = [
            *_python(), "gateway", "--nats", url, "--listen", f"127.0.0.1:{port}", "--models", MODEL,
            "--timeout-s", str(self.s.request_timeout_s), "--queue-limit", str(self.s.queue_limit),
            "--endpoint-concurrency", str(self.s.engine_queue if bridged else 1), "--log-level", "WARNING",
            *(["--no-samples"] if bridged else []),
        ]  # fmt: skip
        self.procs.spawn("gateway", argv, env=_child_env())
        return await self._healthy("gateway", f"http://127.0.0.1:{port}")

    async def start_bridge(self, url: str) -> str:
        """``pulsescale bridge --slots``: every ready slot's engine page, read every `bridge_scrape_every_s`, as
        the model's demand under the gateway id `bridge_id`. Its base URL (/healthz, /metrics)."""
        port = free_port()
        argv = [
            *_python(), "bridge", "--nats", url, "--slots", "--models", MODEL, "--listen", f"127.0.0.1:{port}",
            "--scrape-every", f"{self.s.bridge_scrape_every_s:g}", "--gateway-id", self.bridge_id,
            "--log-level", "WARNING",
        ]  # fmt: skip
        self.procs.spawn("bridge", argv, env=_child_env())
        return await self._healthy("bridge", f"http://127.0.0.1:{port}")

    async def _healthy(self, name: str, base: str) -> str:
        """`base` once its /healthz answers 200; a `DemoError` naming its log after `HEALTHY_WITHIN_S`."""
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + HEALTHY_WITHIN_S
            while time.monotonic() < deadline:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with session.get(f"{base}/healthz", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200:
                            return base
                self.check_children()
                await asyncio.sleep(0.1)
        raise DemoError(
            f"the {name} did not answer {base}/healthz within {HEALTHY_WITHIN_S:g} s; log: "
            f"{self.workdir}/logs/{name}.log"
        )

    def check_children(self) -> None:
        for c in self.procs.children:
            if not c.alive() and c.name != "load":
                raise DemoError(f"{c.name} exited with {c.proc.returncode}: {c.tail(800).strip()}")

    # --- the cold path --------------------------------------------------------------------------------------------

    def cold_start(self, ev: Event, store: KvSlotStore | None) -> None:
        """Answer the autoscaler's ``cold.start``: start spare nodes for the replicas it could not find warm."""
        asked = ev.desired or 0
        # Slots of the pool still staging are on their way: only what they cannot cover is the cold path's.
        want = max(0, asked - self._cold_slots_pending(store) - self._pool_slots_starting(store))
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

    def _pool_slots_starting(self, store: KvSlotStore | None) -> int:
        """Slots of the warm pool's nodes that have not turned warm yet (their agents are still staging)."""
        if store is None:
            return 0
        pool = {n for n, _ in self.warm_nodes}
        up = sum(1 for r in store.records(MODEL) if r.node in pool and r.state not in ("prewarming", "failed"))
        return max(0, self.s.warm_slots - up)

    def _launch_cold(self, node: str) -> None:
        if self.nats is None or self.closing:
            return
        self.cold_nodes[node] = time.time()
        self.start_agent(self.nats.url, node, self.s.slots_per_node, self.model_dir, cold=True)

    def _cold_slots_pending(self, store: KvSlotStore | None) -> int:
        """Slots of the nodes the cold path started (or will, after its delay) that are not warm yet."""
        assert store is not None
        up: dict[str, int] = {}
        for r in store.records(MODEL):
            if r.state not in ("prewarming", "failed"):
                up[r.node] = up.get(r.node, 0) + 1
        return sum(max(0, self.s.slots_per_node - up.get(n, 0)) for n in self.cold_scheduled)

    # --- the end --------------------------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop every process of the run, in `STOP_ORDER` (the nats-server too, when the clean-up came before its
        start was done), and kill what of the run left its group."""
        if (
            self.nats is not None
            and self.nats.proc is not None
            and not any(c.proc is self.nats.proc for c in self.procs.children)
        ):
            self.procs.adopt("nats", self.nats.proc, self.nats.log_path)
        stray = await self.procs.stop_all(self.s.stop_timeout_s, order=STOP_ORDER)
        if stray:
            log.warning("killed %d process(es) of this run that had left their group: %s", len(stray), stray)
