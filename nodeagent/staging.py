"""Weights staging: copy a model into shm, verify every byte, validate every header, then map and lock it.

Layout: ``<shm_dir>/<model>/<file>`` for every file in the model's ``sha256sums.txt`` (see `tinymodel`). All
slots of a model on a node share one staged copy. Each file to copy goes to ``.<file>.partial``, hashed on the
way (one pass over the bytes), compared with the manifest, its safetensors header validated; only when *every*
file of the new set has verified are the partial files renamed into place. So a bad source or a crash mid-copy
never replaces a good staged file, and a failed re-stage never leaves a mix of two versions. A staged file that
already matches the manifest (the agent restarted, shm survived, or the file did not change between versions)
is verified and kept instead of copied again; one this agent verified itself and that has not changed since
(same device, inode, size and mtime, same manifest digest) is kept without reading it again. After a successful
stage, files that are not in the manifest and ``.partial`` files of a killed copy are removed, so shm holds one
version.

Sources: a model directory on this node, or an http(s) URL base serving one (`fetch.UrlSource`: a P2P proxy such
as Dragonfly, an object store). A download cut off keeps its ``.partial`` file, which the next stage (the same
agent retrying, or a restarted one) continues with a Range request; the manifest's sha256 is checked end to end.

Budget and progress: ``--shm-budget`` bounds what the staging directory holds at the peak of a stage (the old
version stays until the new one verifies, so both count); a stage beyond it is refused before anything is
written (`ShmBudgetExceeded`, which names what is staged, what is needed and the fix); nothing is evicted, so
weights a slot serves from are never taken away. `progress.Progress` gets the bytes to write and each block.

Ownership (the agent runs as root; ``/dev/shm`` is writable by every local user): ``<shm_dir>`` and
``<shm_dir>/<model>`` must be real directories owned by the agent, mode 0700 (made so when absent, tightened
when the agent's own are looser, refused with `UnsafeStagingDir` when they are links or someone else's). All work
inside goes through directory handles and ``O_NOFOLLOW`` opens, so a link planted inside is never followed: a
sweep removes the link, never its target. Sources are opened the same way (a link in the model directory is
refused). Staged files are 0600.

Verified bytes are the used bytes: each staged file is kept open (`StagedFile.fd`, read-only) from the moment
its bytes are hashed; the agent maps and locks from that descriptor and the engines get it too
(`Staged.engine_weights`, passed to the zygote), with its (device, inode, size) to check. A rename keeps the
inode, so the descriptor stays the verified file whatever later happens to the name.

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
import stat
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Protocol

from nodeagent import fetch, modelformat
from nodeagent.engine import safetensors_check
from nodeagent.errors import BadModel, BadWeights, StagingFailed, UnsafeStagingDir
from nodeagent.progress import Progress

__all__ = [
    "COPY_BLOCK_BYTES",
    "LockedWeights",
    "ShmBudgetExceeded",
    "Staged",
    "StagedFile",
    "check_budget",
    "check_staged",
    "lock",
    "shm_use",
    "stage",
]

COPY_BLOCK_BYTES: Final = 8 * 2**20
"""Read-hash-write block: large enough for full disk and memory bandwidth, small enough to stay in cache."""
PARTIAL_SUFFIX: Final = ".partial"
DIR_MODE: Final = 0o700
FILE_MODE: Final = 0o600
"""Staged weights are the agent's: engines read them through the descriptors they are given, not by name."""

_O_DIR: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_READ: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a planted FIFO never hangs us


@dataclass(frozen=True)
class StagedFile:
    name: str
    path: Path
    nbytes: int
    sha256: str
    copied: bool
    """False when an already staged copy matched the manifest and was kept."""
    header: safetensors_check.Header | None = None
    fd: int = -1
    """A read-only descriptor of the verified file, held by the agent for as long as this file is staged."""
    ident: tuple[int, int, int, int] = (0, 0, 0, 0)
    """(device, inode, size, mtime ns) when it verified: unchanged since means not read again."""
    written: int = 0
    """Bytes this stage wrote into shm for it (copied or downloaded; less than `nbytes` for a resumed download)."""
    hashed: int = 0
    """Bytes this stage read and hashed for it (0 when carried over unchanged)."""


@dataclass
class Staged:
    model: str
    source: str
    """The model directory, or the URL base (shown without credentials or query)."""
    dir: Path
    files: list[StagedFile]
    stage_s: float
    staged_at: float
    version: str = ""
    """A digest of the manifest: engines armed for another version must be re-armed before they serve."""
    hashed_bytes: int = 0
    """Bytes read and hashed by this stage (0 when every file was kept unchanged from the previous one)."""
    fetched: bool = False
    """The source is a URL: `written_bytes` were downloaded rather than copied."""

    @property
    def how(self) -> str:
        """How the written bytes came: ``fetched`` or ``copied`` (the label of the staged-bytes counter)."""
        return "fetched" if self.fetched else "copied"

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

    @property
    def written_bytes(self) -> int:
        """Bytes this stage wrote into shm (copied from the directory or downloaded from the URL)."""
        return sum(f.written for f in self.files)

    @property
    def reused_bytes(self) -> int:
        """Bytes of files already staged and kept (carried over, or re-verified after a restart)."""
        return sum(f.nbytes for f in self.files if not f.copied)

    def path_of(self, name: str) -> Path:
        """Where the bytes of manifest entry `name` are (the staged file, or a ``.partial`` being vetted)."""
        return next((f.path for f in self.files if f.name == name), self.dir / name)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {t.name: (t.shape, t.dtype) for f in self.weights for t in f.header.tensors}  # type: ignore[union-attr]

    def engine_weights(self) -> list[dict[str, Any]]:
        """What the zygote's spec carries: each weights file's descriptor (passed to it) and its identity."""
        return [
            {"name": f.name, "fd": f.fd, "dev": f.ident[0], "ino": f.ident[1], "size": f.nbytes} for f in self.weights
        ]

    def close(self, keep: Staged | None = None) -> None:
        """Close the descriptors of files that `keep` (the set that replaced this one) does not carry over."""
        kept = {f.fd for f in keep.files} if keep is not None else set()
        for f in self.files:
            if f.fd >= 0 and f.fd not in kept:
                _close(f.fd)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass  # already closed (a Staged closed twice): nothing to do


def _ident(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class ShmBudgetExceeded(StagingFailed):
    """Staging would take the staging directory's shm use beyond ``--shm-budget``; the message says what is
    staged, what is needed, the budget and the fix. Nothing is evicted to make room."""


# --- the staging directory -----------------------------------------------------------------------------------


def _own_dir(path: Path, *, create: bool = True) -> int:
    """A handle of `path`, the agent's own directory: made 0700 if absent, refused unless ours and not a link.
    Its ancestors are opened one by one from ``/`` without following links (``O_NOFOLLOW``), each owned by root or
    the agent and not writable by others unless sticky: a link or another user's directory anywhere above it could
    point the whole path elsewhere. With `create` False (`nodeagent.preflight`) nothing is made or changed: an
    absent directory raises `FileNotFoundError`, a looser mode is left as it is."""
    pfd, shown = os.open("/", _O_DIR), Path("/")
    try:
        for part in Path(os.path.abspath(path)).parent.parts[1:]:
            _check_above(pfd, shown, path)
            try:
                nfd = os.open(part, _O_DIR, dir_fd=pfd)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafeStagingDir(
                        f"{shown / part} (above the staging directory {path}) is a symbolic link or not a "
                        f"directory: the agent (root) never stages through a link; give the real path "
                        f"(`realpath {path}`) as --shm-dir"
                    ) from None
                raise StagingFailed(
                    f"cannot open {shown / part}, above the staging directory: {err.strerror}"
                ) from None
            os.close(pfd)
            pfd, shown = nfd, shown / part
        _check_above(pfd, shown, path)
        return _own_subdir(pfd, path.name, path, create=create)
    finally:
        os.close(pfd)


def _check_above(fd: int, shown: Path, path: Path) -> None:
    """`fd` (`shown`, a directory above the staging directory `path`) is root's or ours, and others cannot
    rename or replace what is in it (not writable by them, or sticky)."""
    st = os.fstat(fd)
    if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        raise UnsafeStagingDir(
            f"{shown} (above the staging directory {path}) is owned by uid {st.st_uid} or writable by other "
            f"users without the sticky bit (mode {stat.S_IMODE(st.st_mode):o}): its owner could point {path} "
            "anywhere; use a --shm-dir whose every parent is root's (e.g. /dev/shm/pulsescale)"
        )


def _own_subdir(dir_fd: int, name: str, shown: Path, *, create: bool = True) -> int:
    try:
        if create:
            os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
    except FileExistsError:
        pass  # checked below, whoever made it
    except OSError as err:
        raise StagingFailed(f"cannot create the staging directory {shown}: {err.strerror}") from None
    try:
        fd = os.open(name, _O_DIR, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ENOENT and not create:
            raise  # a check that makes nothing: absent is the caller's answer
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeStagingDir(
                f"{shown} is a symbolic link or not a directory: the agent (root) stages only into a directory "
                f"it made itself, never through a link another user could point elsewhere; remove it "
                f"(`rm {shown}`) and prewarm again: the agent creates it"
            ) from None
        raise StagingFailed(f"cannot open the staging directory {shown}: {err.strerror}") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafeStagingDir(
            f"{shown} is owned by uid {st.st_uid}, not by the agent (uid {os.geteuid()}): another user made it "
            f"and could plant links or replace files in it; remove it (`rm -rf {shown}`) and prewarm again: the "
            "agent creates it, mode 0700"
        )
    if create and stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.fchmod(fd, DIR_MODE)  # ours, made looser by an older version or by hand: only we could write in it
    return fd


# --- sources ---------------------------------------------------------------------------------------------------


class _Source(Protocol):
    """Where a model's bytes come from: a local directory or a URL base (`fetch.UrlSource`)."""

    shown: str
    resumable: bool
    """A cut-off ``.partial`` file is continued rather than started again."""

    def manifest(self) -> dict[str, str]: ...

    def size(self, name: str) -> int: ...

    def fetch(
        self, name: str, wfd: int, have: int, h: Any, on_bytes: Callable[[int], None]
    ) -> tuple[Any, int, int]: ...

    def close(self) -> None: ...


class _DirSource:
    """A model directory on this node, read through a directory handle (links inside are refused)."""

    resumable = False  # a local copy runs at memory speed: a killed one starts again

    def __init__(self, path: Path) -> None:
        self.path = path
        self.shown = str(path)
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            raise BadModel(f"model directory {path} does not exist or is not a directory") from None

    def manifest(self) -> dict[str, str]:
        return modelformat.read_manifest(self.path, dir_fd=self.fd)

    def size(self, name: str) -> int:
        return _size_in(self.fd, name)

    def fetch(self, name: str, wfd: int, have: int, h: Any, on_bytes: Callable[[int], None]) -> tuple[Any, int, int]:
        sfd = _open_source(self.fd, self.path, name)
        try:
            n = _copy_hashing(sfd, wfd, h, on_bytes)
        finally:
            os.close(sfd)
        return h, n, n

    def close(self) -> None:
        os.close(self.fd)


def _source(source: str | os.PathLike[str], options: fetch.FetchOptions | None) -> _Source:
    if fetch.is_url(source):
        return fetch.UrlSource(str(source), options)
    return _DirSource(Path(source))


# --- hashing and copying ---------------------------------------------------------------------------------------


def _hash_into(fd: int, h: Any) -> int:
    """Feed the file behind `fd` to `h` with positional reads (the descriptor's offset is shared with the
    zygotes that inherit it); returns the bytes read."""
    buf = bytearray(COPY_BLOCK_BYTES)
    view = memoryview(buf)
    at = 0
    while n := os.preadv(fd, [buf], at):
        h.update(view[:n])  # hashlib releases the GIL for large blocks: files hash in parallel
        at += n
    return at


def _hash_fd(fd: int) -> str:
    """The sha256 of the file behind `fd`."""
    h = hashlib.sha256()
    _hash_into(fd, h)
    return h.hexdigest()


def _copy_hashing(src_fd: int, dst_fd: int, h: Any, on_bytes: Callable[[int], None]) -> int:
    """Copy `src_fd` to `dst_fd`, feeding `h` on the way (one read of the source); returns the bytes copied."""
    buf = bytearray(COPY_BLOCK_BYTES)
    view = memoryview(buf)
    total = 0
    while n := os.readv(src_fd, [buf]):
        h.update(view[:n])
        done = 0
        while done < n:
            done += os.write(dst_fd, view[done:n])
        total += n
        on_bytes(n)
    return total


def _header(fd: int, name: str) -> safetensors_check.Header | None:
    return safetensors_check.read_header_fd(fd, name) if name.endswith(".safetensors") else None


def _unchanged(prev: StagedFile, dest_fd: int, want: str) -> bool:
    """`prev` (verified by this agent) is still the staged `name`, byte for byte as verified: no need to read it."""
    if prev.sha256 != want or prev.fd < 0:
        return False
    try:
        now = os.fstat(prev.fd)
        there = os.stat(prev.name, dir_fd=dest_fd, follow_symlinks=False)
    except OSError:
        return False
    return _ident(now) == prev.ident and (there.st_dev, there.st_ino) == prev.ident[:2]


def _ours(st: os.stat_result) -> bool:
    """A regular file this agent made, with no other name: a file someone else made (or linked in) could change
    after we hash it."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1


def _reuse(dest_fd: int, dest: Path, name: str, want: str) -> tuple[StagedFile | None, int]:
    """The staged copy of `name` if it is there, ours, and matches the manifest (the agent restarted, shm
    survived); and the bytes read to find out."""
    try:
        fd = os.open(name, _O_READ, dir_fd=dest_fd)
    except OSError:
        return None, 0  # absent, a link, unreadable: copied again (the rename replaces whatever the name was)
    try:
        st = os.fstat(fd)
        if not _ours(st):
            os.close(fd)
            return None, 0
        if _hash_fd(fd) != want:
            os.close(fd)
            return None, st.st_size
        header = _header(fd, name)  # verified against the manifest: good whatever became of the source since
    except BaseException:
        _close(fd)
        raise
    if stat.S_IMODE(st.st_mode) != FILE_MODE:
        os.fchmod(fd, FILE_MODE)
    return StagedFile(name, dest / name, st.st_size, want, False, header, fd, _ident(st), hashed=st.st_size), st.st_size


def _partial(name: str) -> str:
    return f".{name}{PARTIAL_SUFFIX}"


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)  # a link is removed as a link, never its target
    except FileNotFoundError:
        pass


def _open_source(src_fd: int, source: Path, name: str) -> int:
    try:
        fd = os.open(name, _O_READ, dir_fd=src_fd)
    except FileNotFoundError:
        raise BadWeights(name, f"listed in {modelformat.MANIFEST_FILE} but missing from {source}") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise BadWeights(
                name,
                f"is a symbolic link in {source}; staging runs as root and never follows links in the model "
                "directory: put the file itself there",
            ) from None
        raise BadWeights(name, f"cannot read the source: {err.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise BadWeights(name, f"is not a regular file in {source}")
    os.set_blocking(fd, True)
    return fd


_O_PARTIAL: Final = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_partial(dest_fd: int, partial: str, *, resume: bool) -> tuple[int, int, Any]:
    """The ``.partial`` file to write: the one a cut-off download left (its bytes hashed, to be continued) when
    `resume` and it is ours; else a new empty one. Returns (descriptor, bytes there, hash of those bytes)."""
    h = hashlib.sha256()
    if resume:
        try:
            fd = os.open(partial, _O_PARTIAL | os.O_NONBLOCK, dir_fd=dest_fd)  # NONBLOCK: a planted FIFO
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                st = os.fstat(fd)
                if _ours(st):
                    os.fchmod(fd, FILE_MODE)
                    return fd, _hash_into(fd, h), h
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
    _unlink(dest_fd, partial)
    fd = os.open(partial, _O_PARTIAL | os.O_CREAT | os.O_EXCL, FILE_MODE, dir_fd=dest_fd)
    return fd, 0, h


class _Allowance:
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
                    f"staging {self.model} went beyond --shm-budget {_gib(self.budget_bytes)} while downloading (the "
                    f"server announced less than it sent, or no length); stopped and its partial files removed. "
                    f"Fix: raise --shm-budget, or serve the files with their Content-Length"
                )
            on_bytes(k)

        return counted


def _fill_file(
    source: _Source,
    dest_fd: int,
    dest: Path,
    name: str,
    want: str,
    progress: Progress | None,
    allowance: _Allowance | None = None,
) -> StagedFile:
    """Write `name` to its ``.partial`` file (from the start, or on from a cut-off download), hash it on the way
    and validate its header; the staged name is untouched. Returns the partial file verified, open read-only. On
    failure the partial file is removed, except after a failed download (`fetch.FetchFailed`): resumed next time."""
    partial = _partial(name)
    wfd, have, h = _open_partial(dest_fd, partial, resume=source.resumable)
    on_bytes: Callable[[int], None] = progress.add if progress is not None else _ignore
    rfd = -1
    ok = keep = False
    try:
        on_bytes(have)  # on disk already: counted in the shm use the allowance was taken from
        if allowance is not None:
            on_bytes = allowance.wrap(on_bytes)
        hashed = have
        try:
            h, size, written = source.fetch(name, wfd, have, h, on_bytes)
            hashed += written
            if have and h.hexdigest() != want:
                # The partial bytes were of another version of the file: once more, from the start.
                os.ftruncate(wfd, 0)
                on_bytes(-size)
                h, size, again = source.fetch(name, wfd, 0, hashlib.sha256(), on_bytes)
                written += again
                hashed += again
        except fetch.FetchFailed:
            keep = True
            raise
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise StagingFailed(f"{dest} is full while staging {name} ({source.size(name)} bytes)") from None
            raise BadWeights(name, f"copy failed: {err.strerror or err}") from None
        # The observed digest is not reported: reasons land in the registry, readable by every gateway.
        if h.hexdigest() != want:
            raise BadWeights(name, f"sha256 mismatch with {modelformat.MANIFEST_FILE} (corrupt copy or stale manifest)")
        # Read-only for the agent and the engines; the same inode as the one written (our 0700 directory).
        rfd = os.open(partial, _O_READ, dir_fd=dest_fd)
        wst, st = os.fstat(wfd), os.fstat(rfd)
        if (wst.st_dev, wst.st_ino) != (st.st_dev, st.st_ino):
            raise StagingFailed(f"{dest / partial} was replaced while it was being written")
        try:
            header = _header(rfd, name)
        except BadWeights as bad:
            raise BadWeights(name, bad.reason) from None
        ok = True
    finally:
        os.close(wfd)
        if not ok:
            if rfd >= 0:
                os.close(rfd)
            if not keep:
                _unlink(dest_fd, partial)
    return StagedFile(
        name, dest / name, st.st_size, want, True, header, rfd, _ident(st), written=written, hashed=hashed
    )


def _ignore(_: int) -> None:
    pass


def _sweep(dest_fd: int, keep: Collection[str]) -> list[str]:
    """Remove what is not part of the staged set: files of an earlier version, ``.partial`` files left by a
    copy that was killed, links. Directories are left alone (we never make any)."""
    removed = []
    for name in os.listdir(dest_fd):
        if name in keep:
            continue
        try:
            if not stat.S_ISDIR(os.stat(name, dir_fd=dest_fd, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=dest_fd)
                removed.append(name)
        except OSError:
            pass  # reported by the free-space numbers; nothing depends on it
    return removed


def _version(sums: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(sums):
        h.update(f"{sums[name]}  {name}\n".encode())
    return h.hexdigest()[:16]


def _run_all(
    pool: ThreadPoolExecutor, fn: Callable[..., Any], args: Sequence[tuple[object, ...]]
) -> tuple[list[Any], list[BaseException]]:
    futures = [pool.submit(fn, *a) for a in args]
    out: list[Any] = []
    errors: list[BaseException] = []
    for fut in futures:
        try:
            out.append(fut.result())
        except Exception as err:  # noqa: BLE001 - re-raised below once every thread is done
            out.append(None)
            errors.append(err)
    return out, errors


def _size_in(dir_fd: int, name: str) -> int:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


# --- the shm budget ----------------------------------------------------------------------------------------------


def shm_use(shm_fd: int) -> dict[str, int]:
    """Bytes of shm each model directory under the agent's staging directory holds (allocated blocks: what
    counts against /dev/shm), ``.partial`` files and old versions included."""
    use: dict[str, int] = {}
    for model in os.listdir(shm_fd):
        try:
            fd = os.open(model, _O_DIR, dir_fd=shm_fd)
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


def _gib(n: float) -> str:
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
        f"{m} {_gib(b)}" + (" (the version staged now: kept until the new one verifies)" if m == model else "")
        for m, b in sorted(use.items(), key=lambda kv: -kv[1])
        if b
    )
    others = [m for m, b in use.items() if m != model and b]
    fix = f"raise --shm-budget to at least {_gib(now + need)}"
    if others:
        fix += f", or remove staged models no agent on this node serves (`rm -rf {where / others[0]}`)"
    raise ShmBudgetExceeded(
        f"staging {model} needs {_gib(need)} more shm; {where} holds {_gib(now)} ({held or 'nothing'}); "
        f"that is {_gib(now + need)} against --shm-budget {_gib(budget_bytes)}. Nothing was evicted: staged "
        f"weights may be serving. Fix: {fix}"
    )


# --- staging -----------------------------------------------------------------------------------------------------


def stage(
    source: str | os.PathLike[str],
    shm_dir: str | os.PathLike[str],
    model: str,
    *,
    threads: int = 2,
    clock: Callable[[], float] = time.time,
    check: Callable[[Staged], None] | None = None,
    previous: Staged | None = None,
    budget_bytes: int | None = None,
    progress: Progress | None = None,
    fetch_options: fetch.FetchOptions | None = None,
) -> Staged:
    """Stage `source` (a model directory, or an http(s) URL serving one: `fetch`) as `model` under `shm_dir`;
    raises `BadModel`, `BadWeights`, `StagingFailed` (or its `UnsafeStagingDir`, `ShmBudgetExceeded`,
    `fetch.FetchFailed`).

    All or nothing: every file that needs copying is copied to its ``.partial`` file and verified first; only
    when the whole set verifies are they renamed into place. On failure the staged files are the complete
    previous set, untouched. After success, files not in the manifest and stale ``.partial`` files are removed.
    `check(pending)` vets the whole new set before it replaces anything (the engine's config against the
    tensors); in `pending` a copied file's `path` is its ``.partial`` file. What it raises is raised, nothing
    replaced. `previous` is the set staged now by this agent: its files unchanged since they verified are carried
    over (same descriptor) without being read. The caller closes `previous` (`Staged.close(keep=new)`) once
    nothing uses it. `budget_bytes` bounds the staging directory's shm use at the peak of the stage (old and new
    versions together); `progress` gets the bytes to write as its total and each block as it lands. One stager
    per directory (the agent serialises its prewarms). Blocking (disk, network and hashing): the agent runs it in
    a thread.
    """
    t0 = time.perf_counter()
    src = _source(source, fetch_options)
    opened: list[StagedFile] = []  # what this call opened: closed unless it is returned
    ok = False
    try:
        sums = src.manifest()
        shm_fd = _own_dir(Path(shm_dir))
        try:
            dest_fd = _own_subdir(shm_fd, model, Path(shm_dir) / model)
            try:
                staged = _stage_in(
                    src,
                    shm_fd,
                    dest_fd,
                    Path(shm_dir) / model,
                    model,
                    sums,
                    threads,
                    check,
                    previous,
                    opened,
                    clock,
                    budget_bytes,
                    progress,
                )
            finally:
                os.close(dest_fd)
        finally:
            os.close(shm_fd)
        staged.stage_s = time.perf_counter() - t0
        ok = True
        return staged
    finally:
        src.close()
        if not ok:
            for f in opened:
                _close(f.fd)


def _stage_in(
    src: _Source,
    shm_fd: int,
    dest_fd: int,
    dest: Path,
    model: str,
    sums: dict[str, str],
    threads: int,
    check: Callable[[Staged], None] | None,
    previous: Staged | None,
    opened: list[StagedFile],
    clock: Callable[[], float],
    budget_bytes: int | None,
    progress: Progress | None,
) -> Staged:
    # A copy killed mid-way (SIGKILL, node crash) left a .partial file: removed, unless it is a download of a
    # file of this manifest, which is continued.
    resumable = {_partial(n) for n in sums} if src.resumable else set()
    try:
        for name in os.listdir(dest_fd):
            if name.startswith(".") and name.endswith(PARTIAL_SUFFIX) and name not in resumable:
                _unlink(dest_fd, name)
    except OSError as err:
        raise StagingFailed(f"cannot prepare the staging directory {dest}: {err.strerror}") from None
    before = {f.name: f for f in previous.files} if previous is not None else {}
    carried = {
        n: replace(before[n], copied=False, written=0, hashed=0)
        for n in sums
        if n in before and _unchanged(before[n], dest_fd, sums[n])
    }
    hashed = 0
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="stage") as pool:
        # Staged sizes, largest first, so the halves of a multi-shard model finish together.
        again = sorted((n for n in sums if n not in carried), key=lambda n: -_size_in(dest_fd, n))
        found, errors = _run_all(pool, _reuse, [(dest_fd, dest, n, sums[n]) for n in again])
        opened.extend(x[0] for x in found if x is not None and x[0] is not None)
        if errors:
            raise errors[0]
        kept: dict[str, StagedFile] = dict(carried)
        for n, (f, nbytes) in zip(again, found, strict=True):
            hashed += nbytes
            if f is not None:
                kept[n] = f
        # Sizes of the files to write only (a URL source asks the server: none when everything is staged).
        sizes = {n: src.size(n) for n in sums if n not in kept}
        todo = sorted(sizes, key=lambda n: -sizes[n])
        there = {n: _size_in(dest_fd, _partial(n)) for n in todo} if src.resumable else {}
        need = sum(max(0, sizes[n] - there.get(n, 0)) for n in todo)
        vfs = os.statvfs(dest_fd)
        free = vfs.f_bavail * vfs.f_frsize
        if need > free:
            raise StagingFailed(
                f"{dest.parent} has {free / 2**20:.0f} MiB free, staging {model} needs {need / 2**20:.0f} MiB more "
                "(the previous version stays staged until the new one verifies); free shm or give the node a "
                "larger /dev/shm"
            )
        check_budget(shm_use(shm_fd), model, need, budget_bytes, dest.parent)
        if progress is not None:
            progress.total_bytes = sum(sizes.values())
            progress.started_at = progress.clock()
        allowance = None
        if budget_bytes is not None:
            allowance = _Allowance(budget_bytes - sum(shm_use(shm_fd).values()), model, budget_bytes, dest.parent)
        fills = [(src, dest_fd, dest, n, sums[n], progress, allowance) for n in todo]
        copied, errors = _run_all(pool, _fill_file, fills)
    done: list[StagedFile] = [f for f in copied if f is not None]
    opened.extend(done)
    if errors:
        if not src.resumable:  # a download keeps its verified and cut-off partial files for the next try
            for name in todo:
                _unlink(dest_fd, _partial(name))
        raise errors[0]
    hashed += sum(f.hashed for f in done)
    version = _version(sums)
    if check is not None:
        pending = list(kept.values()) + [replace(f, path=dest / _partial(f.name)) for f in done]
        try:
            check(Staged(model, src.shown, dest, sorted(pending, key=lambda f: f.name), 0.0, clock(), version=version))
        except BaseException:
            for name in todo:
                _unlink(dest_fd, _partial(name))
            raise
    try:
        for f in done:
            os.replace(_partial(f.name), f.name, src_dir_fd=dest_fd, dst_dir_fd=dest_fd)  # the inode (and fd) stays
    except OSError as err:
        for name in todo:
            _unlink(dest_fd, _partial(name))
        raise StagingFailed(f"cannot rename the verified copies into {dest}: {err.strerror or err}") from None
    _sweep(dest_fd, set(sums))
    files = sorted(list(kept.values()) + done, key=lambda f: f.name)
    return Staged(
        model,
        src.shown,
        dest,
        files,
        0.0,
        clock(),
        version=version,
        hashed_bytes=hashed,
        fetched=src.resumable,
    )


def check_staged(staged: Staged) -> None:
    """Cheap re-check after an engine crash: every staged file is still there, full size, header intact."""
    for f in staged.files:
        try:
            st = os.fstat(f.fd)
        except OSError:
            raise BadWeights(f.name, f"the staged copy {f.path} is no longer open") from None
        if (st.st_dev, st.st_ino) != f.ident[:2]:
            raise BadWeights(f.name, f"descriptor {f.fd} is no longer the staged copy {f.path}")
        if st.st_nlink == 0:
            raise BadWeights(f.name, f"the staged copy {f.path} was removed")
        if st.st_size != f.nbytes:
            raise BadWeights(f.name, f"the staged copy is {st.st_size} bytes, {f.nbytes} were staged")
        if f.header is not None:
            safetensors_check.read_header_fd(f.fd, f.name)


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
