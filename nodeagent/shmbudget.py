"""The shm budget: what the staging directory holds, and the bound ``--shm-budget`` puts on it.

``--shm-budget`` bounds what the staging directory holds at the peak of a stage (the old version stays until the new
one verifies, so both count). `check_budget` refuses a stage beyond it before anything is written
(`ShmBudgetExceeded`, which names what is staged, what is needed and the fix); `Allowance` stops a download that
goes beyond it while it runs (a server that announces less than it sends). Nothing is evicted, so weights a slot
serves from are never taken away. `shm_use` counts allocated blocks per model directory: what counts against
/dev/shm, ``.partial`` files and old versions included.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from nodeagent.errors import NoShmRoom
from nodeagent.stagedir import O_DIR, own_dir

__all__ = ["Allowance", "ShmBudgetExceeded", "check_budget", "gib", "room_bytes", "shm_use"]


class ShmBudgetExceeded(NoShmRoom):
    """Staging would take the staging directory's shm use beyond ``--shm-budget``; the message says what is
    staged, what is needed, the budget and the fix. Nothing is evicted to make room: the agent stages again when
    room appears (a staged model removed)."""


def shm_use(shm_fd: int) -> dict[str, int]:
    """Bytes of shm each model directory under the agent's staging directory holds (allocated blocks: what
    counts against /dev/shm), ``.partial`` files and old versions included."""
    use: dict[str, int] = {}
    for model in os.listdir(shm_fd):
        try:
            fd = os.open(model, O_DIR, dir_fd=shm_fd)
        except OSError:
            continue  # a file or a link at the top: not a staged model
        try:
            total = 0
            for name in os.listdir(fd):
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    total += st.st_blocks * 512
            use[model] = total
        finally:
            os.close(fd)
    return use


def room_bytes(shm_dir: Path, budget_bytes: int | None) -> int:
    """What a stage could write under `shm_dir` now: the filesystem's free bytes and, under ``--shm-budget``, the
    budget less what the directory holds (the smaller). Reads only (`own_dir` with ``create=False``); raises
    `StagingFailed` or `OSError` when the directory cannot be opened."""
    fd = own_dir(shm_dir, create=False)
    try:
        vfs = os.fstatvfs(fd)
        room = vfs.f_bavail * vfs.f_frsize
        if budget_bytes is not None:
            room = min(room, budget_bytes - sum(shm_use(fd).values()))
        return room
    finally:
        os.close(fd)


def gib(n: float) -> str:
    """`n` bytes for a message: GiB from 1 GiB up, else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_budget(use: dict[str, int], model: str, need: int, budget_bytes: int | None, where: Path) -> None:
    """Refuse a stage that would take the staging directory's shm use beyond the budget. Nothing is evicted to
    make room: what is staged now may be serving (and stays until its replacement verifies)."""
    if budget_bytes is None:
        return
    now = sum(use.values())
    if need == 0 or now + need <= budget_bytes:
        return  # nothing to add (a restart re-verifying what is staged): never refused
    held = ", ".join(
        f"{m} {gib(b)}" + (" (the version staged now: kept until the new one verifies)" if m == model else "")
        for m, b in sorted(use.items(), key=lambda kv: -kv[1])
        if b
    )
    others = [m for m, b in use.items() if m != model and b]
    fix = f"raise --shm-budget to at least {gib(now + need)}"
    if others:
        fix += f", or remove staged models no agent on this node serves (`rm -rf {where / others[0]}`)"
    raise ShmBudgetExceeded(
        f"staging {model} needs {gib(need)} more shm; {where} holds {gib(now)} ({held or 'nothing'}); "
        f"that is {gib(now + need)} against --shm-budget {gib(budget_bytes)}. Nothing was evicted: staged "
        f"weights may be serving. Fix: {fix}"
    )


class Allowance:
    """The bytes a stage may still write under ``--shm-budget``, shared by its copying threads: a server that
    announces no length (or less than it sends) is stopped at the budget, not when /dev/shm is full (80 MiB were
    written with a 16 MiB budget)."""

    def __init__(self, room: int, model: str, budget_bytes: int, where: Path) -> None:
        self.room, self.model, self.budget_bytes, self.where = room, model, budget_bytes, where
        self._lock = threading.Lock()

    def wrap(self, on_bytes: Callable[[int], None]) -> Callable[[int], None]:
        def counted(k: int) -> None:
            with self._lock:
                self.room -= k  # a restarted file gives its bytes back (k < 0)
                over = self.room < 0
            if over:
                raise ShmBudgetExceeded(
                    f"staging {self.model} went beyond --shm-budget {gib(self.budget_bytes)} while downloading (the "
                    f"server announced less than it sent, or no length); stopped and its partial files removed. "
                    f"Fix: raise --shm-budget, or serve the files with their Content-Length"
                )
            on_bytes(k)

        return counted
