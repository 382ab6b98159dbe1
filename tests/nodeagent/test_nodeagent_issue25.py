"""Issue 25: an agent that comes back finds its slots as they should be; staging waits for space; a dead agent's
slots are not offered again; an engine that cannot start says why and fails its slot.

All real: nats-server, agent processes (SIGSTOP / SIGKILL), real /dev/shm staging and real engine processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from nats.aio.client import Client

from autoscaler.controller import ControllerSettings
from tests.autoscaler.test_autoscaler import (  # noqa: F401 - cancel_gateways is an autouse fixture
    Gateway,
    autoscaler_in_process,
    cancel_gateways,
    put_scaler,
)
from tests.helpers import wait_for
from tests.nodeagent_helpers import (
    MODEL,
    activate,
    wait_state,
)
from warmpool.embedded import NatsServer
from warmpool.registry import Changed, KvSlotStore

LEASE_S = 2.0
HEARTBEAT_S = LEASE_S / 3  # the CLI heartbeats three times a lease


def agent_process(url: str, node: str, model_dir: Path, shm_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A real agent process (`extra` flags come last: a repeated flag wins)."""
    return subprocess.Popen(
        [sys.executable, "-m", "pulsescale", "agent", "--nats", url, "--node", node, "--slots", "1",
         "--model", str(model_dir), "--model-name", MODEL, "--shm-dir", str(shm_dir), "--metrics-port", "-1",
         "--lease-s", str(LEASE_S), "--log-level", "INFO", *extra],
    )  # fmt: skip


@contextlib.contextmanager
def reaped(proc: subprocess.Popen[bytes]) -> Iterator[subprocess.Popen[bytes]]:
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_a_slot_released_while_its_agent_was_away_is_warm_within_a_heartbeat_of_its_return(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    key = f"{MODEL}.away.s0"
    with reaped(agent_process(nats_server.url, "away", model_dir, shm_dir)) as proc:
        await wait_state(store, key, "warm", timeout_s=30)
        claim = await store.claim_slot(key)
        reply = await activate(nc, claim, node="away")
        assert reply.ok, reply
        await wait_state(store, key, "ready")
        os.kill(proc.pid, signal.SIGSTOP)  # serving when it froze: the autoscaler replaces it once the lease lapses
        await wait_for(lambda: store.index.lease_lapsed("away", time.time()), 10, "the lease lapsed")
        await store.release(claim, reason="activation timed out")
        rec = await wait_state(store, key, "failed")
        assert rec.reason is not None and "was away" in rec.reason
        os.kill(proc.pid, signal.SIGCONT)
        t0 = time.monotonic()
        await wait_state(store, key, "warm", timeout_s=10)
        assert time.monotonic() - t0 <= HEARTBEAT_S + 1.5, f"warm again after {time.monotonic() - t0:.1f} s"


async def test_a_dead_agents_slots_are_not_offered_again_before_its_lease_lapses(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    """An agent SIGKILLed while an activation of one of its slots is in flight (its engine hangs): the activation
    times out, the deactivate finds nobody subscribed, and no slot of that node is claimed again while its lease
    (6 s) is still fresh."""
    claims: list[tuple[float, str]] = []

    async def watch() -> None:
        async for ev in store.watch():
            if isinstance(ev, Changed) and ev.record.state == "claimed":
                claims.append((time.monotonic(), ev.key))

    watcher = asyncio.create_task(watch())
    faults = ("--fault", "s0=hang", "--fault", "s1=hang")
    proc = agent_process(nats_server.url, "dead", model_dir, shm_dir, "--slots", "2", "--lease-s", "6", *faults)
    try:
        with reaped(proc):
            await wait_for(lambda: sum(r.state == "warm" for r in store.records(MODEL)) == 2, 30, "2 warm")
            await put_scaler(nc, MODEL, maxReplicaCount=2)
            async with autoscaler_in_process(nats_server.url, controller=ControllerSettings(activation_deadline_s=1.0)):
                Gateway(nc, MODEL).background(4, 8.0)
                await wait_for(lambda: bool(claims), 10, "a claim")
                await asyncio.sleep(0.2)  # the activation is in flight: the engine hangs
                proc.kill()
                killed = time.monotonic()
                # Until the lease lapses (at least 4 s from now: renewed every 2 s, 6 s long).
                await asyncio.sleep(3.5)
                again = [k for t, k in claims if t > killed]
                assert not again, f"claimed again {len(again)} time(s) while the dead agent's lease was fresh: {again}"
    finally:
        watcher.cancel()
