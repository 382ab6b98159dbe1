"""``--cpu-hog``: a busy loop on one core for the length of a bench, as a neighbour's work would be.

The hog is a child process (a Python ``while True: pass``) pinned to one CPU. It goes however the bench ends: on
a normal or failed exit `CpuHog.stop` kills it, and should the bench itself be killed the kernel sends it SIGKILL
as its parent dies (``PR_SET_PDEATHSIG``), so no hog outlives its bench.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Final

__all__ = ["CpuHog", "cpu_hog"]

_PR_SET_PDEATHSIG: Final = 1
_LOOP: Final = "while True:\n    pass\n"


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the bench dies (Linux; elsewhere `stop` is the only guard)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class CpuHog:
    """One busy child process on `cpu` (the last CPU this process may run on, by default)."""

    def __init__(self, cpu: int | None = None) -> None:
        allowed = sorted(os.sched_getaffinity(0))
        self.cpu = allowed[-1] if cpu is None else cpu
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> CpuHog:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _LOOP], preexec_fn=_die_with_parent, stdin=subprocess.DEVNULL
        )
        with contextlib.suppress(OSError):
            os.sched_setaffinity(self.proc.pid, {self.cpu})
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()


@contextlib.contextmanager
def cpu_hog(on: bool) -> Iterator[CpuHog | None]:
    """A running `CpuHog` for the block when `on`, stopped however the block ends; else None."""
    if not on:
        yield None
        return
    hog = CpuHog().start()
    try:
        yield hog
    finally:
        hog.stop()
