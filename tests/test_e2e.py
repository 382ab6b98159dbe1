"""End to end, all real: nats-server, a node agent with a pre-forked local engine on real /dev/shm weights,
the autoscaler daemon, and a gateway publishing queue samples. A pulse brings a slot to `ready` with an
endpoint that answers a completion; when the pulse is over the slot goes back to `warm`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from nats.aio.client import Client

from autoscaler.controller import ControllerSettings
from tests.autoscaler.test_autoscaler import (  # noqa: F401 - cancel_gateways is an autouse fixture
    Gateway,
    autoscaler_in_process,
    cancel_gateways,
    put_scaler,
    wait_for,
)
from tests.nodeagent_helpers import (
    MODEL,
    running_agent,
    settings,
)
from warmpool.embedded import NatsServer
from warmpool.registry import Changed, KvSlotStore

FAST_WINDOWS = {
    "cooldownPeriod": 0.5,
    "advanced": {
        "stableWindowSeconds": 1.0,
        "panicWindowSeconds": 0.5,
        "scaleDownStabilizationSeconds": 0.5,
        "scaleDownPeriodSeconds": 0.5,
        "scaleDownPercent": 100,
    },
}


def agent_process(url: str, node: str, model_dir: Path, shm_dir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "pulsescale", "agent", "--nats", url, "--node", node, "--slots", "1",
         "--model", str(model_dir), "--model-name", MODEL, "--shm-dir", str(shm_dir), "--metrics-port", "-1",
         "--log-level", "WARNING"],
    )  # fmt: skip


def files_of(root: Path) -> dict[str, tuple[int, int]]:
    """Every staged file's inode and mtime: a re-stage (copy, rename) changes them."""
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def complete(endpoint: str) -> dict:  # type: ignore[type-arg]
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 3}).encode()
    req = urllib.request.Request(f"{endpoint}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


async def test_pulse_to_first_token_and_back(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    cfg = settings(model_dir, shm_dir, nats_server.url, slots=2)
    async with running_agent(cfg):
        await wait_for(lambda: sum(r.state == "warm" for r in store.records(MODEL)) == 2, 30)
        staged = files_of(shm_dir)
        assert staged, "nothing staged"
        await put_scaler(nc, MODEL, maxReplicaCount=2, **FAST_WINDOWS)
        async with autoscaler_in_process(nats_server.url):
            gw = Gateway(nc, MODEL)
            pulse = gw.background(4, 2.0)  # one replica's worth
            t0 = time.monotonic()
            await wait_for(lambda: any(r.state == "ready" for r in store.records(MODEL)), 10)
            claim_to_ready = time.monotonic() - t0
            ready = next(r for r in store.records(MODEL) if r.state == "ready")
            assert ready.endpoint
            answer = await asyncio.to_thread(complete, ready.endpoint)
            assert answer["object"] == "text_completion" and answer["choices"][0]["text"]
            assert claim_to_ready < 5
            await pulse
            # Demand gone: the policy scales down after its (short) window; the agent takes the slot back.
            quiet = gw.background(0, 6.0)
            await wait_for(lambda: all(r.state == "warm" for r in store.records(MODEL)), 8)
            quiet.cancel()
            # And it comes back without re-staging: the same weights, another activation.
            again = gw.background(4, 3.0)
            await wait_for(lambda: any(r.state == "ready" for r in store.records(MODEL)), 10)
            again.cancel()
            assert files_of(shm_dir) == staged, "the weights were staged again"


async def test_a_frozen_agent_is_released_and_the_next_slot_claimed_in_time(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    """A real agent process, SIGSTOPped after its slot went warm: its lease is still fresh and NATS still routes
    to it, so `activate` just goes unanswered. The claim is released at the deadline and the next slot claimed
    within 100 ms of it."""
    deadline_s = 0.5
    live_cfg = settings(model_dir, shm_dir / "live", nats_server.url, node="live", slots=2)
    frozen: subprocess.Popen[bytes] | None = None
    claims: dict[str, float] = {}

    async def watch() -> None:
        async for ev in store.watch():
            if isinstance(ev, Changed) and ev.record.state == "claimed":
                claims[ev.key] = time.monotonic()

    watcher = asyncio.create_task(watch())
    try:
        async with running_agent(live_cfg):
            await wait_for(lambda: sum(r.state == "warm" for r in store.records(MODEL)) == 2, 30)
            await put_scaler(nc, MODEL, maxReplicaCount=3)
            async with autoscaler_in_process(
                nats_server.url, controller=ControllerSettings(activation_deadline_s=deadline_s)
            ):
                gw = Gateway(nc, MODEL)
                await gw.send(4)  # one replica, on the live node: the only one so far
                await wait_for(lambda: any(r.state == "ready" for r in store.records(MODEL)), 10)
                frozen = agent_process(nats_server.url, "frozen", model_dir, shm_dir / "frozen")
                await wait_for(lambda: (r := store.entry("tiny.frozen.s0")) and r[0].state == "warm", 30)
                os.kill(frozen.pid, signal.SIGSTOP)
                claims.clear()
                # A second replica: the frozen node holds no slot of the model, so placement prefers it.
                pulse = gw.background(8, 3.0)
                await wait_for(lambda: "tiny.frozen.s0" in claims and len(claims) >= 2, 5)
                pulse.cancel()
                nxt = min(t for k, t in claims.items() if k != "tiny.frozen.s0")
                gap = nxt - claims["tiny.frozen.s0"]
                assert deadline_s <= gap + 0.05 and gap <= deadline_s + 0.1, f"next claim after {gap:.3f} s"
                await wait_for(lambda: sum(r.state == "ready" for r in store.records(MODEL)) == 2, 5)
                rec, _ = await store.get("tiny.frozen.s0")
                assert rec.state == "warm" and rec.claim_id is None  # given back
    finally:
        watcher.cancel()
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen.pid, signal.SIGCONT)
            frozen.terminate()
            try:
                frozen.wait(10)
            except subprocess.TimeoutExpired:
                frozen.kill()
                frozen.wait()
