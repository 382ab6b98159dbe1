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

Sources (`nodeagent.stagesource`): a model directory on this node, or an http(s) URL base serving one
(`fetch.UrlSource`: a P2P proxy such as Dragonfly, an object store). A download cut off keeps its ``.partial``
file, which the next stage (the same agent retrying, or a restarted one) continues with a Range request; the
manifest's sha256 is checked end to end.

Budget and progress (`nodeagent.shmbudget`): ``--shm-budget`` bounds what the staging directory holds at the peak
of a stage (the old version stays until the new one verifies, so both count); a stage beyond it is refused before
anything is written (`ShmBudgetExceeded`, which names what is staged, what is needed and the fix); nothing is
evicted, so weights a slot serves from are never taken away. A stage that finds too little room (the budget, the
filesystem's free space, ENOSPC while writing) raises `NoShmRoom`, which the agent retries once room appears
(`room_bytes` says how much there is). `progress.Progress` gets the bytes to write and each block.

Ownership (`nodeagent.stagedir`; the agent runs as root, ``/dev/shm`` is writable by every local user):
``<shm_dir>`` and ``<shm_dir>/<model>`` must be real directories owned by the agent, mode 0700 (made so when
absent, tightened when the agent's own are looser, refused with `UnsafeStagingDir` when they are links or someone
else's). All work inside goes through directory handles and ``O_NOFOLLOW`` opens, so a link planted inside is never
followed: a sweep removes the link, never its target. Sources are opened the same way (a link in the model
directory is refused). Staged files are 0600.

Verified bytes are the used bytes (`nodeagent.stagedfiles`): each staged file is kept open (`StagedFile.fd`,
read-only) from the moment its bytes are hashed; the agent maps and locks from that descriptor and the engines get
it too (`Staged.engine_weights`, passed to the zygote), with its (device, inode, size) to check. A rename keeps the
inode, so the descriptor stays the verified file whatever later happens to the name.

Locking (`nodeagent.weightlock`): the agent maps every staged weights file and ``mlock``s it, so the pages stay
resident for as long as the agent runs (tmpfs pages can otherwise be swapped out). Locking needs ``CAP_IPC_LOCK``
or a large enough ``RLIMIT_MEMLOCK`` (``ulimit -l``, 8 MiB for ordinary users here): when it is refused we say why,
unlock what was locked, and run unlocked, flagged in the status. ``mlock`` does not make memory DMA-pinned; the GPU
loaders of part 2 register the mapping with CUDA for that.

This module does the staging itself (`stage`, `check_staged`) and is the face of staging for the rest of the agent:
the names of the modules above that callers use (`Staged`, `StagedFile`, `lock`, `LockedWeights`, `shm_use`,
`room_bytes`, `check_budget`, `ShmBudgetExceeded`, `NoShmRoom`, `COPY_BLOCK_BYTES`) are importable from here.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from nodeagent import fetch, modelformat
from nodeagent.engine import safetensors_check
from nodeagent.errors import BadWeights, NoShmRoom, StagingFailed
from nodeagent.progress import Progress
from nodeagent.shmbudget import Allowance, ShmBudgetExceeded, check_budget, room_bytes, shm_use
from nodeagent.stagedfiles import Staged, StagedFile, close_fd, ident
from nodeagent.stagedir import FILE_MODE, O_READ, own_dir, own_subdir, size_in
from nodeagent.stagesource import COPY_BLOCK_BYTES, Source, header_of, source_for
from nodeagent.weightlock import LockedWeights, lock

__all__ = [
    "COPY_BLOCK_BYTES",
    "LockedWeights",
    "NoShmRoom",
    "ShmBudgetExceeded",
    "Staged",
    "StagedFile",
    "check_budget",
    "check_staged",
    "lock",
    "room_bytes",
    "shm_use",
    "stage",
]

PARTIAL_SUFFIX: Final = ".partial"


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


def _unchanged(prev: StagedFile, dest_fd: int, want: str) -> bool:
    """`prev` (verified by this agent) is still the staged `name`, byte for byte as verified: no need to read it."""
    if prev.sha256 != want or prev.fd < 0:
        return False
    try:
        now = os.fstat(prev.fd)
        there = os.stat(prev.name, dir_fd=dest_fd, follow_symlinks=False)
    except OSError:
        return False
    return ident(now) == prev.ident and (there.st_dev, there.st_ino) == prev.ident[:2]


def _ours(st: os.stat_result) -> bool:
    """A regular file this agent made, with no other name: a file someone else made (or linked in) could change
    after we hash it."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1


def _reuse(dest_fd: int, dest: Path, name: str, want: str) -> tuple[StagedFile | None, int]:
    """The staged copy of `name` if it is there, ours, and matches the manifest (the agent restarted, shm
    survived); and the bytes read to find out."""
    try:
        fd = os.open(name, O_READ, dir_fd=dest_fd)
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
        header = header_of(fd, name)  # verified against the manifest: good whatever became of the source since
    except BaseException:
        close_fd(fd)
        raise
    if stat.S_IMODE(st.st_mode) != FILE_MODE:
        os.fchmod(fd, FILE_MODE)
    return StagedFile(name, dest / name, st.st_size, want, False, header, fd, ident(st), hashed=st.st_size), st.st_size


def _partial(name: str) -> str:
    return f".{name}{PARTIAL_SUFFIX}"


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)  # a link is removed as a link, never its target
    except FileNotFoundError:
        pass


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


def _fill_file(
    source: Source,
    dest_fd: int,
    dest: Path,
    name: str,
    want: str,
    progress: Progress | None,
    allowance: Allowance | None = None,
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
                raise NoShmRoom(f"{dest} is full while staging {name} ({source.size(name)} bytes)") from None
            raise BadWeights(name, f"copy failed: {err.strerror or err}") from None
        # The observed digest is not reported: reasons land in the registry, readable by every gateway.
        if h.hexdigest() != want:
            raise BadWeights(name, f"sha256 mismatch with {modelformat.MANIFEST_FILE} (corrupt copy or stale manifest)")
        # Read-only for the agent and the engines; the same inode as the one written (our 0700 directory).
        rfd = os.open(partial, O_READ, dir_fd=dest_fd)
        wst, st = os.fstat(wfd), os.fstat(rfd)
        if (wst.st_dev, wst.st_ino) != (st.st_dev, st.st_ino):
            raise StagingFailed(f"{dest / partial} was replaced while it was being written")
        try:
            header = header_of(rfd, name)
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
    return StagedFile(name, dest / name, st.st_size, want, True, header, rfd, ident(st), written=written, hashed=hashed)


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
    raises `BadModel`, `BadWeights`, `StagingFailed` (or its `UnsafeStagingDir`, `NoShmRoom` and its
    `ShmBudgetExceeded`, `fetch.FetchFailed`).

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
    src = source_for(source, fetch_options)
    opened: list[StagedFile] = []  # what this call opened: closed unless it is returned
    ok = False
    try:
        sums = src.manifest()
        shm_fd = own_dir(Path(shm_dir))
        try:
            dest_fd = own_subdir(shm_fd, model, Path(shm_dir) / model)
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
                close_fd(f.fd)


def _stage_in(
    src: Source,
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
        again = sorted((n for n in sums if n not in carried), key=lambda n: -size_in(dest_fd, n))
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
        there = {n: size_in(dest_fd, _partial(n)) for n in todo} if src.resumable else {}
        need = sum(max(0, sizes[n] - there.get(n, 0)) for n in todo)
        vfs = os.statvfs(dest_fd)
        free = vfs.f_bavail * vfs.f_frsize
        if need > free:
            raise NoShmRoom(
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
            allowance = Allowance(budget_bytes - sum(shm_use(shm_fd).values()), model, budget_bytes, dest.parent)
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
