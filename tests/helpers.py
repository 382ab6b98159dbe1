"""The one helpers module of the tests: waiting on a condition, clocks a test moves by hand, event collection.

Doubles of what cannot run here live beside it and say so in their names (`agent_double`); everything else the
tests use is real.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import resource
import shutil
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from warmpool.embedded import NatsServer

__all__ = [
    "HandClock",
    "ShiftedClock",
    "broker_subscriptions",
    "can_lock",
    "has_ipc_lock",
    "wait_for",
    "without_ipc_lock",
]


def has_ipc_lock() -> bool:
    """CAP_IPC_LOCK in this process's effective set (bit 14 of CapEff): root in a container may lack it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 14 & 1)
    return False


def can_lock(nbytes: int) -> bool:
    """CAP_IPC_LOCK (root here and in CI) or an RLIMIT_MEMLOCK that covers `nbytes`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return has_ipc_lock() or soft == resource.RLIM_INFINITY or soft >= nbytes


def without_ipc_lock(argv: list[str]) -> list[str] | None:
    """`argv` run without CAP_IPC_LOCK (so an RLIMIT_MEMLOCK of 0 refuses every lock): as it is where this process
    lacks it, under ``setpriv`` (util-linux) dropping it where it holds it; None where it holds it and has no
    setpriv."""
    if not has_ipc_lock():
        return argv
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    return [setpriv, "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock", *argv]


def broker_subscriptions(server: NatsServer, connection: str) -> Counter[tuple[str, str]]:
    """(subject, queue group or "") of each subscription `server` holds for its one client connection named
    `connection`, as its monitoring port's ``/connz`` lists them: what the broker delivers to, whatever the client
    believes it subscribed."""
    assert server.monitor_port is not None, "the server has no monitoring port"
    url = f"http://127.0.0.1:{server.monitor_port}/connz?subs=detail"
    with urllib.request.urlopen(url, timeout=5) as r:
        conns = [c for c in json.loads(r.read())["connections"] if c.get("name") == connection]
    assert len(conns) == 1, f"{len(conns)} connections named {connection!r}"
    return Counter((s["subject"], s.get("qgroup", "")) for s in conns[0].get("subscriptions_list_detail") or [])


async def wait_for(
    pred: Callable[[], object | Awaitable[object]], timeout_s: float = 15.0, what: str = "condition"
) -> float:
    """Poll `pred` (plain or async) every 10 ms until it is truthy; the seconds it took. Fails the test with
    `what` after `timeout_s`: a generous bound that only catches a hang, never a speed assertion."""
    t0 = time.monotonic()
    while True:
        result = pred()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class HandClock:
    """Time that moves only when the test says so (Knative's autoscaler tests do the same). Kept in tenths of a
    millisecond, so a thousand 0.1 s steps land exactly on 100.0 s."""

    start: float = 1_700_000_000.0
    ticks: int = 0
    now: float = field(init=False)

    def __post_init__(self) -> None:
        self.now = self.start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> float:
        self.ticks += round(dt * 10_000)
        self.now = self.start + self.ticks / 10_000
        return self.now


class ShiftedClock:
    """Wall time plus a shift the test controls: for code whose requests must carry real `expires_at`. Called, it is
    a clock that is off (another machine's, or ours before chrony synced); `monotonic` moves by the same shift, for
    a process that is to see that much time *pass* (a lease aged, an outage lasting)."""

    def __init__(self, shift: float = 0.0) -> None:
        self.shift = shift

    def __call__(self) -> float:
        return time.time() + self.shift

    def monotonic(self) -> float:
        return time.monotonic() + self.shift
