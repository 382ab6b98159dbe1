"""Page-cache residency of a tree of files: warm it (``posix_fadvise(WILLNEED)`` + reads), measure it
(``mincore``) and pin it (``mmap`` + ``mlock``), as vmtouch does.

An activation that imports its Python and site-packages from a rootfs whose pages are all resident reads nothing
from the block device under it (the article's "0 IOPS"): the prewarm reads the files once, off the critical path,
and re-checks before a slot is offered, re-warming what the kernel evicted since.

`mincore` reports, per page of a mapping, whether it is in the page cache. Python has no binding for it, so this
maps each file with libc's ``mmap`` through ctypes (``mmap.mmap`` refuses a read-only buffer to ctypes), asks
``mincore``, and unmaps: nothing is read, so measuring does not change what it measures.

Pure of agent state; the functions take paths and return values. They walk without following symbolic links and
count only regular files.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Pinned", "Residency", "Warmed", "drop", "files_under", "pin", "residency", "warm"]

PAGE_BYTES = mmap.PAGESIZE
READ_CHUNK_BYTES = 1 << 20
"""Reads of 1 MiB: large enough that syscalls cost nothing next to the copy, small enough to stay in L2."""
BATCH_FILES = 256
"""Files advised (and held open) at once: read-ahead for many files in flight, well under ``ulimit -n``."""

_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


@dataclass(frozen=True)
class Residency:
    """How much of a set of files is in the page cache."""

    files: int
    pages: int
    """Pages of all the files (the last page of each counts whole)."""
    resident_pages: int
    unreadable: int = 0
    """Files that could not be opened or mapped (counted, not measured)."""

    @property
    def bytes(self) -> int:
        return self.pages * PAGE_BYTES

    @property
    def pct(self) -> float:
        """Share of the pages resident, 0-100; an empty set is fully resident."""
        return 100.0 if self.pages == 0 else 100.0 * self.resident_pages / self.pages


@dataclass(frozen=True)
class Warmed:
    """What a `warm` did."""

    files: int
    read_bytes: int
    skipped: int
    """Files that could not be read (vanished, no permission): counted, the rest is warmed."""


def files_under(root: Path | str) -> Iterator[Path]:
    """Every regular file under `root` (sorted, symbolic links not followed, other mounts not entered)."""
    root = Path(root)
    dev = os.lstat(root).st_dev
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        subdirs: list[Path] = []
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield Path(e.path)
            elif stat.S_ISDIR(st.st_mode) and st.st_dev == dev:
                subdirs.append(Path(e.path))
        stack.extend(reversed(subdirs))


def _paths(root: Path | str, paths: Iterable[Path | str] | None) -> list[Path]:
    """The files to act on: `paths` (a manifest, relative to `root` or absolute) or every file under `root`."""
    if paths is None:
        return list(files_under(root))
    return [Path(root, p) for p in paths]


def _open(path: Path) -> int:
    """A regular file opened for reading, never through a final link, never a FIFO or device (a manifest may name
    anything): O_NONBLOCK keeps a FIFO from blocking the open, and is harmless for a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path}: not a regular file")
    return fd


def file_residency(fd: int, size: int) -> tuple[int, int]:
    """(pages, resident pages) of the open file `fd` of `size` bytes."""
    if size <= 0:
        return 0, 0
    pages = (size + PAGE_BYTES - 1) // PAGE_BYTES
    addr = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    try:
        vec = (ctypes.c_ubyte * pages)()
        if _libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        return pages, sum(b & 1 for b in bytes(vec))
    finally:
        _libc.munmap(ctypes.c_void_p(addr), size)


def residency(root: Path | str, paths: Iterable[Path | str] | None = None) -> Residency:
    """The page-cache residency of the files under `root` (or of `paths`), measured with ``mincore``; reads
    nothing."""
    files = pages = resident = unreadable = 0
    for path in _paths(root, paths):
        try:
            fd = _open(path)
        except OSError:
            unreadable += 1
            continue
        try:
            size = os.fstat(fd).st_size
            p, r = file_residency(fd, size)
        except OSError:
            unreadable += 1
            continue
        finally:
            os.close(fd)
        files += 1
        pages += p
        resident += r
    return Residency(files=files, pages=pages, resident_pages=resident, unreadable=unreadable)


def warm(root: Path | str, paths: Iterable[Path | str] | None = None) -> Warmed:
    """Bring the files under `root` (or `paths`) into the page cache: ``posix_fadvise(WILLNEED)`` on a batch of files
    first (the kernel reads ahead for all of them at once), then a read of each, which waits for the
    pages and fetches what read-ahead skipped. Batches of `BATCH_FILES` files, so a large tree never holds more
    descriptors than that."""
    targets = _paths(root, paths)
    files = read = skipped = 0
    buf = bytearray(READ_CHUNK_BYTES)
    view = memoryview(buf)
    for at in range(0, len(targets), BATCH_FILES):
        fds: list[int] = []
        try:
            for path in targets[at : at + BATCH_FILES]:
                try:
                    fds.append(_open(path))
                except OSError:
                    skipped += 1
                    continue
                os.posix_fadvise(fds[-1], 0, 0, os.POSIX_FADV_WILLNEED)
            for fd in fds:
                try:
                    while n := os.readv(fd, [view]):
                        read += n
                    files += 1
                except OSError:  # EIO from a failing disk: the rest is still warmed, the count says so
                    skipped += 1
        finally:
            for fd in fds:
                os.close(fd)
    return Warmed(files=files, read_bytes=read, skipped=skipped)


@dataclass
class Pinned:
    """Files mapped read-only and locked in memory by `pin`: their pages stay resident until `release`."""

    files: int = 0
    bytes: int = 0
    refused: str | None = None
    """Why pinning stopped, at the first file refused (mlock: EPERM without CAP_IPC_LOCK, ENOMEM past
    RLIMIT_MEMLOCK; mmap; too many files): the rest is not locked. None: every file is pinned."""
    _maps: list[tuple[int, int]] = field(default_factory=list, repr=False)

    def release(self) -> None:
        """Unmap (and so unlock) every file; idempotent. Needed before the filesystem can be unmounted."""
        for addr, size in self._maps:
            _libc.munmap(ctypes.c_void_p(addr), size)
        self._maps.clear()


def pin(root: Path | str, paths: Iterable[Path | str] | None = None) -> Pinned:
    """Map each file under `root` (or of `paths`) read-only and ``mlock`` the mapping, as ``vmtouch -l`` does: the
    lock reads the pages in, and the kernel neither evicts nor pages out locked pages, where a warm tree is
    evicted by memory pressure or, on some kernels, with none (DAMON's proactive ``pageout`` of cold pages, as on
    this project's test machines). Needs CAP_IPC_LOCK or an RLIMIT_MEMLOCK that covers the files. The first
    mapping or lock refused (the limit; ``vm.max_map_count``, of which this takes at most half) stops pinning and
    says why (`Pinned.refused`); what was pinned stays pinned until `Pinned.release`, also when this raises. A file
    that cannot be opened is passed over, as `warm` passes it over."""
    pinned = Pinned()
    budget = _map_budget()
    try:
        for path in _paths(root, paths):
            try:
                fd = _open(path)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                if size <= 0:
                    continue
                if len(pinned._maps) >= budget:
                    pinned.refused = f"{budget} files mapped, half of vm.max_map_count: {path} and the rest not locked"
                    break
                addr = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
                if addr is None or addr == _MAP_FAILED:
                    pinned.refused = f"mmap of {path}: {os.strerror(ctypes.get_errno())}"
                    break
                pinned._maps.append((addr, size))  # released with the rest from here on, whatever happens
                if _libc.mlock(ctypes.c_void_p(addr), size) != 0:
                    pinned.refused = f"mlock of {path}: {os.strerror(ctypes.get_errno())}"
                    _libc.munmap(ctypes.c_void_p(addr), size)
                    pinned._maps.pop()
                    break
                pinned.files += 1
                pinned.bytes += size
            finally:
                os.close(fd)  # the mapping, and its lock, outlive the descriptor
    except BaseException:
        pinned.release()
        raise
    return pinned


def _map_budget() -> int:
    """Half of the process's ``vm.max_map_count`` (65,530 by default): a large tree must not leave this process
    without mappings for its threads and allocations."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text()) // 2
    except (OSError, ValueError):
        return 32_765


def drop(root: Path | str, paths: Iterable[Path | str] | None = None) -> int:
    """Ask the kernel to evict the files' clean pages (``posix_fadvise(DONTNEED)``); returns the files dropped.
    For tests and benchmarks: what a node under memory pressure does to an idle rootfs."""
    n = 0
    for path in _paths(root, paths):
        try:
            fd = _open(path)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n
