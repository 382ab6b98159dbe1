"""Map and lock the staged weights, so their pages stay resident for as long as the agent runs.

The agent maps every staged weights file read-only from its verified descriptor (`StagedFile.fd`, never reopened by
name) and ``mlock``s it (tmpfs pages can otherwise be swapped out). Locking needs ``CAP_IPC_LOCK`` or a large enough
``RLIMIT_MEMLOCK`` (``ulimit -l``, 8 MiB for ordinary users here): when it is refused we say why, unlock what was
locked, and run unlocked, flagged in the status (`LockedWeights.error`). A re-stage keeps the mappings of files that
did not change and lets go of the others before anything new is locked. ``mlock`` does not make memory DMA-pinned;
the GPU loaders register the mapping with CUDA for that.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from nodeagent.errors import StagingFailed
from nodeagent.stagedfiles import StagedFile

__all__ = ["LockedWeights", "lock"]

_PROT_READ: Final = 0x1
_MAP_SHARED: Final = 0x01
_MAP_FAILED: Final = ctypes.c_void_p(-1).value


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


@dataclass
class _Map:
    addr: int
    size: int
    locked: bool
    ident: tuple[int, int, int]
    """(device, inode, size) of the mapped file: an unchanged file keeps its mapping across a re-stage."""


@dataclass
class LockedWeights:
    """The agent's mappings of the staged weights; `locked_bytes` of them are `mlock`ed."""

    mapped_bytes: int = 0
    locked_bytes: int = 0
    error: str | None = None
    """Why the weights are not locked (None when they are, or when locking was not asked)."""
    _maps: list[_Map] = field(default_factory=list, repr=False)

    @property
    def locked(self) -> bool:
        return self.error is None and self.locked_bytes == self.mapped_bytes and self.mapped_bytes > 0

    def release(self) -> None:
        libc = _libc()
        for m in self._maps:
            if m.locked:
                libc.munlock(m.addr, m.size)
            libc.munmap(m.addr, m.size)
        self._maps.clear()
        self.mapped_bytes = self.locked_bytes = 0


def _explain_lock(err: int, want: int, done: int) -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.1f} MiB"
    fix = (
        "run the agent as root or with CAP_IPC_LOCK (Kubernetes: securityContext.capabilities.add [IPC_LOCK]), "
        "or raise RLIMIT_MEMLOCK (`ulimit -l`, systemd LimitMEMLOCK=infinity)"
    )
    name = errno.errorcode.get(err, str(err))
    return (
        f"mlock refused ({name}: {os.strerror(err)}) after {done / 2**20:.1f} of {want / 2**20:.1f} MiB; "
        f"RLIMIT_MEMLOCK is {limit}; running unlocked (pages may be swapped or reclaimed): {fix}"
    )


def lock(
    files: Sequence[StagedFile | Path], *, want_lock: bool = True, previous: LockedWeights | None = None
) -> LockedWeights:
    """Map every file read-only and, if `want_lock`, `mlock` it (which also faults every page in).

    A `StagedFile` is mapped from its verified descriptor (never reopened by name); a `Path` is opened without
    following links. `previous` is the lock being replaced (a re-stage): a file still the same (device, inode,
    size) keeps its mapping and lock, and every other old mapping is unlocked and unmapped *before* anything new
    is locked, so the weights never count twice against ``RLIMIT_MEMLOCK``. `previous` is left empty.
    """
    libc = _libc()
    out = LockedWeights()
    opened: list[int] = []
    try:
        fds = []
        for f in files:
            if isinstance(f, StagedFile):
                fds.append((str(f.path), f.fd))
            else:
                fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                opened.append(fd)
                fds.append((str(f), fd))
        stats = [(p, fd, os.fstat(fd)) for p, fd in fds]
        _lock_all(libc, out, stats, want_lock, previous)
    finally:
        for fd in opened:
            os.close(fd)
    return out


def _lock_all(
    libc: ctypes.CDLL,
    out: LockedWeights,
    stats: list[tuple[str, int, os.stat_result]],
    want_lock: bool,
    previous: LockedWeights | None,
) -> None:
    total = sum(st.st_size for _, _, st in stats)
    reusable: dict[tuple[int, int, int], _Map] = {}
    if previous is not None:
        wanted = {(st.st_dev, st.st_ino, st.st_size) for _, _, st in stats}
        for m in previous._maps:
            if m.ident in wanted and m.ident not in reusable:
                reusable[m.ident] = m
            else:
                if m.locked:
                    libc.munlock(m.addr, m.size)
                libc.munmap(m.addr, m.size)
        previous._maps.clear()
        previous.mapped_bytes = previous.locked_bytes = 0
    try:
        for p, fd, st in stats:
            size = st.st_size
            if size == 0:
                continue
            ident = (st.st_dev, st.st_ino, size)
            hit = reusable.pop(ident, None)
            if hit is not None:
                m = hit
            else:
                addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)  # the mapping keeps the file
                if addr is None or addr == _MAP_FAILED:
                    e = ctypes.get_errno()
                    raise StagingFailed(f"cannot map {p}: {os.strerror(e)}")
                m = _Map(addr, size, False, ident)
            out._maps.append(m)
            out.mapped_bytes += size
            if want_lock and out.error is None:
                if m.locked or libc.mlock(m.addr, size) == 0:
                    m.locked = True
                    out.locked_bytes += size
                else:
                    out.error = _explain_lock(ctypes.get_errno(), total, out.locked_bytes)
    except BaseException:
        out._maps.extend(reusable.values())
        out.release()
        raise
    for m in reusable.values():  # a duplicate path list can leave one over
        if m.locked:
            libc.munlock(m.addr, m.size)
        libc.munmap(m.addr, m.size)
    if out.error is not None or not want_lock:
        # All or nothing: a half-locked model is harder to reason about than an unlocked one.
        for m in out._maps:
            if m.locked:
                libc.munlock(m.addr, m.size)
                m.locked = False
        out.locked_bytes = 0
