"""Shared fixtures and helpers of the node agent tests.

Test modules import the fixtures by their ``*_fixture`` names (pytest registers them under `name=`), so a
test's parameter never shadows an import.

Everything is real: tiny models written by `make_tiny`, a unique directory under /dev/shm per test (removed at
teardown even on failure), in-process `agent.run` tasks whose zygotes and engines are real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from nodeagent import agent as agent_mod
from nodeagent import tinymodel
from nodeagent.settings import AgentSettings
from tests.helpers import wait_for
from warmpool import connect, protocol
from warmpool.embedded import NatsServer
from warmpool.protocol import SlotRecord
from warmpool.registry import Claim, KvSlotStore

MODEL = "tiny"
NODE = "node-a"


@pytest.fixture(name="shm_dir")
def shm_dir_fixture() -> Iterator[Path]:
    path = Path("/dev/shm") / f"pulsescale-test-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(name="tiny_source", scope="session")
def tiny_source_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1 MB model in two shards, written once; tests that damage a model copy it first (`model_copy`)."""
    out = tmp_path_factory.mktemp("models") / MODEL
    tinymodel.make_tiny(out, 1_000_000, shard_bytes=600_000)
    return out


@pytest.fixture(name="model_dir")
def model_dir_fixture(tiny_source: Path, tmp_path: Path) -> Path:
    out = tmp_path / MODEL
    shutil.copytree(tiny_source, out)
    return out


def state(store: KvSlotStore, key: str) -> SlotRecord | None:
    hit = store.entry(key)
    return hit[0] if hit else None


async def wait_state(store: KvSlotStore, key: str, *states: str, timeout_s: float = 20.0) -> SlotRecord:
    await wait_for(
        lambda: (r := state(store, key)) is not None and r.state in states,
        timeout_s,
        f"{key} in {states} (now {state(store, key)})",
    )
    rec = state(store, key)
    assert rec is not None
    return rec


def settings(model_dir: Path, shm_dir: Path, url: str, **kw: Any) -> AgentSettings:
    base: dict[str, Any] = {
        "node": NODE,
        "model_dir": model_dir,
        "model_name": MODEL,
        "nats": connect.NatsOptions(servers=(url,), name="agent-under-test"),
        "shm_dir": shm_dir,
        "metrics_port": None,
        "heartbeat_interval_s": 0.5,
        "lease_s": 3.0,
    }
    base.update(kw)
    return AgentSettings(**base)


@contextlib.asynccontextmanager
async def running_agent(
    cfg: AgentSettings, *, clock: Callable[[], float] = time.time
) -> AsyncIterator[tuple[agent_mod.Agent, CollectorRegistry]]:
    """`agent.run` as a task; stopped (engines and zygotes killed) at exit, failures re-raised. `clock` is the
    node's wall clock (`ShiftedClock`: a node whose clock is off)."""
    stop = asyncio.Event()
    registry = CollectorRegistry()
    box: list[agent_mod.Agent] = []
    task = asyncio.create_task(
        agent_mod.run(cfg, stop=stop, registry=registry, on_started=lambda a, _: box.append(a), clock=clock),
        name="agent-under-test",
    )
    try:
        await wait_for(lambda: bool(box) or task.done(), 30, "the agent to start")
        if task.done():
            task.result()
        yield box[0], registry
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def request(nc: Client, verb: str, node: str = NODE, timeout_s: float = 10.0, **fields: Any) -> protocol.Reply:
    now = time.time()
    body = {"v": 1, "id": secrets.token_hex(8), "expires_at": now + 30, **fields}
    if verb == "activate":
        body.setdefault("deadline", now + 5)
    msg = await nc.request(protocol.agent_subject(node, verb), protocol._encoder.encode(body), timeout=timeout_s)
    return protocol.decode_reply(msg.data)


async def activate(nc: Client, claim: Claim, **extra: Any) -> protocol.Reply:
    return await request(nc, "activate", slot=claim.slot, token=claim.token, claim_id=claim.claim_id, **extra)


async def deactivate(nc: Client, claim: Claim, **extra: Any) -> protocol.Reply:
    return await request(nc, "deactivate", slot=claim.slot, token=claim.token, claim_id=claim.claim_id, **extra)


async def completion(endpoint: str, prompt: str = "hello", max_tokens: int = 4) -> dict[str, object]:
    """One real completion from a slot's engine; fails the test unless it answers 200."""
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
        async with s.post(f"{endpoint}/v1/completions", json=body) as r:
            assert r.status == 200
            out: dict[str, object] = await r.json()
            return out


def key(slot: str) -> str:
    return protocol.slot_key(MODEL, NODE, slot)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        if f.read().split(") ", 1)[1].startswith("Z"):
            return False  # a zombie has exited; its parent reaps it
    return True


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on `port`, from /proc/net/tcp{,6} (hex, as the kernel
    shows them: ``0100007F`` is 127.0.0.1, ``00000000`` is 0.0.0.0)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                addr, hex_port = fields[1].split(":")
                if int(hex_port, 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    found.add(addr)
    return found


__all__ = [
    "MODEL",
    "NODE",
    "NatsServer",
    "activate",
    "alive",
    "completion",
    "deactivate",
    "key",
    "listening_addresses",
    "model_dir_fixture",
    "request",
    "running_agent",
    "settings",
    "shm_dir_fixture",
    "state",
    "tiny_source_fixture",
    "wait_for",
    "wait_state",
]
