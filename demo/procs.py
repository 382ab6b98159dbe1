"""The demo's child processes: each in its own process group, all marked, all gone when the demo ends.

Every child is started with `start_new_session` (its own process group, so a terminal's Ctrl-C reaches only the
demo, which then stops them in order) and with ``PSDEMO_RUN=<run id>`` in its environment. Engines inherit the
marker (the agent drops only ``NATS_*``/``PULSESCALE_*`` from their environment), so after the groups are stopped a
scan of /proc finds anything of this run that left its group, and it is killed too. A SIGKILLed demo still takes
its children with it: they ask the kernel for SIGKILL when their parent dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["MARKER_ENV", "Child", "Processes", "marked_pids"]

log = logging.getLogger("pulsescale.demo")

MARKER_ENV: Final = "PSDEMO_RUN"
"""Environment variable every process of a demo run carries (not ``PULSESCALE_``: engines would not get it)."""
_PR_SET_PDEATHSIG: Final = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""


def marked_pids(run_id: str, *, exclude: int | None = None) -> list[int]:
    """Processes whose environment carries this run's marker (readable: ours, or any as root)."""
    needle = f"{MARKER_ENV}={run_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == exclude:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def _killpg(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _group_alive(pgid: int) -> bool:
    return _killpg(pgid, 0)


class Processes:
    """Starts children (`spawn`) and stops every one of them (`stop_all`), whatever state the run is in."""

    def __init__(self, run_id: str, log_dir: Path) -> None:
        self.run_id = run_id
        self.log_dir = log_dir
        self.children: list[Child] = []

    def spawn(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        child_env = dict(os.environ if env is None else env)
        child_env[MARKER_ENV] = self.run_id
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # only a prctl between fork and exec
            )
        child = Child(name, proc, log_path, time.time())
        self.children.append(child)
        return child

    def adopt(self, name: str, proc: subprocess.Popen[bytes], log_path: Path) -> Child:
        """A child started elsewhere (the embedded nats-server) that the demo stops with the rest."""
        child = Child(name, proc, log_path, time.time())
        self.children.append(child)
        return child

    async def stop(self, child: Child, timeout_s: float) -> None:
        """SIGTERM to the child's group, SIGKILL to it after `timeout_s` (and to what is left of the group)."""
        pgid = child.pid
        _killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while child.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if child.proc.poll() is None:
            log.warning("%s did not stop within %.0f s of SIGTERM; killing its process group", child.name, timeout_s)
        _killpg(pgid, signal.SIGKILL)  # what it left in its group, or itself
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(5)

    async def stop_all(self, timeout_s: float, *, order: Sequence[str] = ()) -> list[int]:
        """Stop every child: those whose name starts with a prefix in `order` first, in that order (the load
        before the gateway before the agents...), the rest together; then kill whatever of this run is left.
        Returns the pids that had to be killed by the marker scan (none, when everything stopped in its group)."""
        remaining = [c for c in self.children if c.alive() or _group_alive(c.pid)]
        for prefix in order:
            batch = [c for c in remaining if c.name.startswith(prefix)]
            await asyncio.gather(*(self.stop(c, timeout_s) for c in batch))
            remaining = [c for c in remaining if c not in batch]
        await asyncio.gather(*(self.stop(c, timeout_s) for c in remaining))
        stray = marked_pids(self.run_id, exclude=os.getpid())
        for pid in stray:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return stray
