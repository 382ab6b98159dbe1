"""Weights staging: copy a model into shm, verify every byte, validate every header, then map and lock it.

Layout: ``<shm_dir>/<model>/<file>`` for every file in the model's ``sha256sums.txt`` (see `tinymodel`). All
slots of a model on a node share one staged copy. Each file to copy goes to ``.<file>.partial``, hashed on the
way (one pass over the bytes), compared with the manifest, its safetensors header validated; only when *every*
file of the new set has verified are the partial files renamed into place. So a bad source or a crash mid-copy
never replaces a good staged file, and a failed re-stage never leaves a mix of two versions. A staged file that
already matches the manifest (the agent restarted, shm survived, or the file did not change between versions)
is verified and kept instead of copied again. After a successful stage, files that are not in the manifest and
``.partial`` files of a killed copy are removed, so shm holds one version.

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
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from nodeagent import modelformat
from nodeagent.engine import safetensors_check
from nodeagent.errors import BadModel, BadWeights, StagingFailed

__all__ = ["COPY_BLOCK_BYTES", "LockedWeights", "Staged", "StagedFile", "check_staged", "lock", "stage"]

COPY_BLOCK_BYTES: Final = 8 * 2**20
"""Read-hash-write block: large enough for full disk and memory bandwidth, small enough to stay in cache."""
PARTIAL_SUFFIX: Final = ".partial"


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
    version: str = ""
    """A digest of the manifest: engines armed for another version must be re-armed before they serve."""

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

    def path_of(self, name: str) -> Path:
        """Where the bytes of manifest entry `name` are (the staged file, or a ``.partial`` being vetted)."""
        return next((f.path for f in self.files if f.name == name), self.dir / name)

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


def _reuse(dest: Path, name: str, want: str) -> StagedFile | None:
    """The staged copy of `name` if it is there and matches the manifest (the agent restarted, shm survived)."""
    final = dest / name
    try:
        if not final.is_file() or _hash_file(final) != want:
            return None
        size = final.stat().st_size
    except OSError:
        return None  # unreadable: copied again
    # Verified against the manifest: good whatever became of the source since.
    header = safetensors_check.read_header(final) if name.endswith(".safetensors") else None
    return StagedFile(name, final, size, want, copied=False, header=header)


def _partial(dest: Path, name: str) -> Path:
    return dest / f".{name}{PARTIAL_SUFFIX}"


def _copy_file(source: Path, dest: Path, name: str, want: str) -> StagedFile:
    """Copy `name` to its ``.partial`` file, hash it on the way and validate its header; the staged name is
    untouched. On any failure the partial file is removed."""
    src = source / name
    try:
        src_bytes = src.stat().st_size
    except FileNotFoundError:
        raise BadWeights(name, f"listed in {modelformat.MANIFEST_FILE} but missing from {source}") from None
    except OSError as err:
        raise BadWeights(name, f"cannot read the source: {err.strerror}") from None
    partial = _partial(dest, name)
    ok = False
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
            header = safetensors_check.read_header(partial) if name.endswith(".safetensors") else None
        except BadWeights as bad:
            raise BadWeights(name, bad.reason) from None
        ok = True
    finally:
        if not ok:
            partial.unlink(missing_ok=True)
    return StagedFile(name, dest / name, src_bytes, want, copied=True, header=header)


def _sweep(dest: Path, keep: Collection[str]) -> list[str]:
    """Remove what is not part of the staged set: files of an earlier version and ``.partial`` files left by a
    copy that was killed. Directories are left alone (we never make any)."""
    removed = []
    for p in dest.iterdir():
        if p.name in keep:
            continue
        try:
            if p.is_symlink() or p.is_file():
                p.unlink()
                removed.append(p.name)
        except OSError:
            pass  # reported by the free-space numbers; nothing depends on it
    return removed


def _version(sums: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(sums):
        h.update(f"{sums[name]}  {name}\n".encode())
    return h.hexdigest()[:16]


def _run_all(
    pool: ThreadPoolExecutor, fn: Callable[..., StagedFile | None], args: list[tuple[object, ...]]
) -> tuple[list[StagedFile | None], list[BaseException]]:
    futures = [pool.submit(fn, *a) for a in args]
    out: list[StagedFile | None] = []
    errors: list[BaseException] = []
    for fut in futures:
        try:
            out.append(fut.result())
        except Exception as err:  # noqa: BLE001 - re-raised below once every thread is done
            out.append(None)
            errors.append(err)
    return out, errors


def stage(
    source: str | os.PathLike[str],
    shm_dir: str | os.PathLike[str],
    model: str,
    *,
    threads: int = 2,
    clock: Callable[[], float] = time.time,
    check: Callable[[Staged], None] | None = None,
) -> Staged:
    """Stage `source` as `model` under `shm_dir`; raises `BadModel`, `BadWeights` or `StagingFailed`.

    All or nothing: every file that needs copying is copied to its ``.partial`` file and verified first; only
    when the whole set verifies are they renamed into place. On failure the staged files are the complete
    previous set, untouched. After success, files not in the manifest and stale ``.partial`` files are removed.
    `check(pending)` vets the whole new set before it replaces anything (the engine's config against the
    tensors); in `pending` a copied file's `path` is its ``.partial`` file. What it raises is raised, nothing
    replaced. One stager per directory (the agent serialises its prewarms). Blocking (disk and hashing): the agent runs
    it in a thread.
    """
    t0 = time.perf_counter()
    src = Path(source)
    if not src.is_dir():
        raise BadModel(f"model directory {src} does not exist or is not a directory")
    sums = modelformat.read_manifest(src)
    dest = Path(shm_dir) / model
    try:
        dest.mkdir(parents=True, exist_ok=True)
        for stale in dest.glob(f".*{PARTIAL_SUFFIX}"):  # a copy killed mid-way (SIGKILL, node crash)
            stale.unlink(missing_ok=True)
    except OSError as err:
        raise StagingFailed(f"cannot prepare the staging directory {dest}: {err.strerror}") from None
    # Largest first, so the two halves of a multi-shard model finish together.
    names = sorted(sums, key=lambda n: -((src / n).stat().st_size if (src / n).exists() else 0))
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="stage") as pool:
        kept, errors = _run_all(pool, _reuse, [(dest, n, sums[n]) for n in names])
        if errors:
            raise errors[0]
        todo = [n for n, f in zip(names, kept, strict=True) if f is None]
        need = 0
        for name in todo:
            try:
                need += (src / name).stat().st_size
            except OSError:
                pass  # reported by name when that file is copied
        free = shutil.disk_usage(dest).free
        if need > free:
            raise StagingFailed(
                f"{shm_dir} has {free / 2**20:.0f} MiB free, staging {model} needs {need / 2**20:.0f} MiB more "
                "(the previous version stays staged until the new one verifies); free shm or give the node a "
                "larger /dev/shm"
            )
        copied, errors = _run_all(pool, _copy_file, [(src, dest, n, sums[n]) for n in todo])
    if errors:
        for name in todo:
            _partial(dest, name).unlink(missing_ok=True)
        raise errors[0]
    done = [f for f in copied if f is not None]
    version = _version(sums)
    if check is not None:
        pending = [f for f in kept if f is not None] + [replace(f, path=_partial(dest, f.name)) for f in done]
        try:
            check(Staged(model, src, dest, sorted(pending, key=lambda f: f.name), 0.0, clock(), version=version))
        except BaseException:
            for name in todo:
                _partial(dest, name).unlink(missing_ok=True)
            raise
    try:
        for f in done:
            os.replace(_partial(dest, f.name), f.path)
    except OSError as err:
        for name in todo:
            _partial(dest, name).unlink(missing_ok=True)
        raise StagingFailed(f"cannot rename the verified copies into {dest}: {err.strerror or err}") from None
    _sweep(dest, set(sums))
    files = sorted([f for f in kept if f is not None] + done, key=lambda f: f.name)
    return Staged(model, src, dest, files, time.perf_counter() - t0, clock(), version=version)


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


def lock(paths: list[Path], *, want_lock: bool = True, previous: LockedWeights | None = None) -> LockedWeights:
    """Map every file read-only and, if `want_lock`, `mlock` it (which also faults every page in).

    `previous` is the lock being replaced (a re-stage): a file still the same (device, inode, size) keeps its
    mapping and lock, and every other old mapping is unlocked and unmapped *before* anything new is locked, so
    the weights never count twice against ``RLIMIT_MEMLOCK``. `previous` is left empty.
    """
    libc = _libc()
    out = LockedWeights()
    stats = [(p, p.stat()) for p in paths]
    total = sum(st.st_size for _, st in stats)
    reusable: dict[tuple[int, int, int], _Map] = {}
    if previous is not None:
        wanted = {(st.st_dev, st.st_ino, st.st_size) for _, st in stats}
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
        for p, st in stats:
            size = st.st_size
            if size == 0:
                continue
            ident = (st.st_dev, st.st_ino, size)
            hit = reusable.pop(ident, None)
            if hit is not None:
                m = hit
            else:
                fd = os.open(p, os.O_RDONLY)
                try:
                    addr = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
                finally:
                    os.close(fd)  # the mapping keeps the file; the descriptor is not needed
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
    return out
