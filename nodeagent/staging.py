"""Weights staging: copy a model into shm, verify every byte, validate every header, then map and lock it.

Layout: ``<shm_dir>/<model>/<file>`` for every file in the model's ``sha256sums.txt`` (see `tinymodel`). All
slots of a model on a node share one staged copy. A file is copied to ``.<file>.partial``, hashed on the way
(one pass over the bytes), compared with the manifest, its safetensors header validated, and only then renamed
into place; so a bad source or a crash mid-copy never replaces a good staged file. A staged file that already
matches the manifest (the agent restarted, shm survived) is verified and kept instead of copied again.

Locking: the agent maps every staged weights file and ``mlock``s it, so the pages stay resident for as long as
the agent runs (tmpfs pages can otherwise be swapped out). Locking needs ``CAP_IPC_LOCK`` or a large enough
``RLIMIT_MEMLOCK`` (``ulimit -l``, 8 MiB for ordinary users here): when it is refused we say why, unlock what
was locked, and run unlocked, flagged in the status. ``mlock`` does not make memory DMA-pinned; the GPU loaders
of part 2 register the mapping with CUDA for that.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import resource
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from nodeagent import safetensors_check, tinymodel
from nodeagent.errors import BadModel, BadWeights, StagingFailed

__all__ = ["COPY_BLOCK_BYTES", "LockedWeights", "Staged", "StagedFile", "check_staged", "lock", "stage"]

COPY_BLOCK_BYTES: Final = 8 * 2**20
"""Read-hash-write block: large enough for full disk and memory bandwidth, small enough to stay in cache."""


@dataclass(frozen=True)
class StagedFile:
    name: str
    path: Path
    nbytes: int
    sha256: str
    copied: bool
    """False when an already staged copy matched the manifest and was kept."""
    header: safetensors_check.Header | None = None


@dataclass
class Staged:
    model: str
    source: Path
    dir: Path
    files: list[StagedFile]
    stage_s: float
    staged_at: float

    @property
    def weights(self) -> list[StagedFile]:
        return [f for f in self.files if f.header is not None]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def weights_bytes(self) -> int:
        return sum(f.nbytes for f in self.weights)

    @property
    def copied_bytes(self) -> int:
        return sum(f.nbytes for f in self.files if f.copied)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {t.name: (t.shape, t.dtype) for f in self.weights for t in f.header.tensors}  # type: ignore[union-attr]


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(COPY_BLOCK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _copy_hashing(src: Path, dst: Path) -> str:
    """Copy `src` to `dst` and return the sha256 of the bytes written: one read of the source."""
    h = hashlib.sha256()
    buf = bytearray(COPY_BLOCK_BYTES)
    view = memoryview(buf)
    with open(src, "rb", buffering=0) as fi, open(dst, "wb", buffering=0) as fo:
        while n := fi.readinto(buf):
            h.update(view[:n])  # hashlib releases the GIL for large blocks: files hash in parallel
            fo.write(view[:n])
    return h.hexdigest()


def _stage_file(source: Path, dest: Path, name: str, want: str) -> StagedFile:
    src, final = source / name, dest / name
    is_weights = name.endswith(".safetensors")
    if final.exists() and _hash_file(final) == want:
        # Verified against the manifest: good whatever became of the source since.
        header = safetensors_check.read_header(final) if is_weights else None
        return StagedFile(name, final, final.stat().st_size, want, copied=False, header=header)
    try:
        src_bytes = src.stat().st_size
    except FileNotFoundError:
        raise BadWeights(name, f"listed in {tinymodel.MANIFEST_FILE} but missing from {source}") from None
    except OSError as err:
        raise BadWeights(name, f"cannot read the source: {err.strerror}") from None
    partial = dest / f".{name}.partial"
    try:
        try:
            got = _copy_hashing(src, partial)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise StagingFailed(f"{dest} is full while staging {name} ({src_bytes} bytes)") from None
            raise BadWeights(name, f"copy failed: {err.strerror or err}") from None
        if got != want:
            raise BadWeights(
                name,
                f"sha256 mismatch: the manifest says {want[:16]}..., the file hashes to {got[:16]}... "
                "(corrupt copy or stale manifest)",
            )
        try:
            header = safetensors_check.read_header(partial) if is_weights else None
        except BadWeights as bad:
            raise BadWeights(name, bad.reason) from None
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    return StagedFile(name, final, src_bytes, want, copied=True, header=header)


def stage(
    source: str | os.PathLike[str],
    shm_dir: str | os.PathLike[str],
    model: str,
    *,
    threads: int = 2,
    clock: Callable[[], float] = time.time,
) -> Staged:
    """Stage `source` as `model` under `shm_dir`; raises `BadModel`, `BadWeights` or `StagingFailed`.

    Blocking (disk and hashing): the agent runs it in a thread.
    """
    t0 = time.perf_counter()
    src = Path(source)
    if not src.is_dir():
        raise BadModel(f"model directory {src} does not exist or is not a directory")
    sums = tinymodel.read_manifest(src)
    dest = Path(shm_dir) / model
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise StagingFailed(f"cannot create the staging directory {dest}: {err.strerror}") from None
    need = 0
    for name in sums:
        try:
            need += (src / name).stat().st_size
        except OSError:
            pass  # reported by name when that file is staged
    have = sum(p.stat().st_size for p in dest.iterdir() if p.is_file() and p.name in sums)
    free = shutil.disk_usage(dest).free
    if need - have > free:
        raise StagingFailed(
            f"{shm_dir} has {free / 2**20:.0f} MiB free, staging {model} needs {(need - have) / 2**20:.0f} MiB more; "
            "free shm or give the node a larger /dev/shm"
        )
    # Largest first, so the two halves of a multi-shard model finish together.
    names = sorted(sums, key=lambda n: -((src / n).stat().st_size if (src / n).exists() else 0))
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="stage") as pool:
        futures = [pool.submit(_stage_file, src, dest, name, sums[name]) for name in names]
        files, errors = [], []
        for fut in futures:
            try:
                files.append(fut.result())
            except (BadWeights, StagingFailed) as err:
                errors.append(err)
    if errors:
        raise errors[0]
    files.sort(key=lambda f: f.name)
    return Staged(model, src, dest, files, time.perf_counter() - t0, clock())


def check_staged(staged: Staged) -> None:
    """Cheap re-check after an engine crash: every staged file is still there, full size, header intact."""
    for f in staged.files:
        try:
            size = f.path.stat().st_size
        except OSError:
            raise BadWeights(f.name, f"the staged copy {f.path} is gone") from None
        if size != f.nbytes:
            raise BadWeights(f.name, f"the staged copy is {size} bytes, {f.nbytes} were staged")
        if f.header is not None:
            safetensors_check.read_header(f.path)


# --- map and lock ------------------------------------------------------------------------------------------------

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
class LockedWeights:
    """The agent's mappings of the staged weights; `locked_bytes` of them are `mlock`ed."""

    mapped_bytes: int = 0
    locked_bytes: int = 0
    error: str | None = None
    """Why the weights are not locked (None when they are, or when locking was not asked)."""
    _maps: list[tuple[int, int, bool]] = field(default_factory=list, repr=False)

    @property
    def locked(self) -> bool:
        return self.error is None and self.locked_bytes == self.mapped_bytes and self.mapped_bytes > 0

    def release(self) -> None:
        libc = _libc()
        for addr, size, is_locked in self._maps:
            if is_locked:
                libc.munlock(addr, size)
            libc.munmap(addr, size)
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


def lock(paths: list[Path], *, want_lock: bool = True) -> LockedWeights:
    """Map every file read-only and, if `want_lock`, `mlock` it (which also faults every page in)."""
    libc = _libc()
    out = LockedWeights()
    total = sum(p.stat().st_size for p in paths)
    for p in paths:
        size = p.stat().st_size
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        finally:
            os.close(fd)  # the mapping keeps the file; the descriptor is not needed
        if addr is None or addr == _MAP_FAILED:
            e = ctypes.get_errno()
            out.release()
            raise StagingFailed(f"cannot map {p}: {os.strerror(e)}")
        is_locked = False
        if want_lock and out.error is None:
            if libc.mlock(addr, size) == 0:
                is_locked = True
                out.locked_bytes += size
            else:
                out.error = _explain_lock(ctypes.get_errno(), total, out.locked_bytes)
        out._maps.append((addr, size, is_locked))
        out.mapped_bytes += size
    if out.error is not None:
        # All or nothing: a half-locked model is harder to reason about than an unlocked one.
        for i, (addr, size, is_locked) in enumerate(out._maps):
            if is_locked:
                libc.munlock(addr, size)
                out._maps[i] = (addr, size, False)
        out.locked_bytes = 0
    return out
