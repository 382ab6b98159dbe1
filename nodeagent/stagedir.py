"""The staging directory: the agent's own, reached without following a link, and what it holds.

The agent runs as root and ``/dev/shm`` is writable by every local user: ``<shm_dir>`` and ``<shm_dir>/<model>``
must be real directories owned by the agent, mode 0700 (made so when absent, tightened when the agent's own are
looser, refused with `UnsafeStagingDir` when they are links or someone else's), and every directory above them root's
or the agent's and not writable by others unless sticky. `own_dir` walks from ``/`` with ``O_NOFOLLOW`` and returns a
handle; all work inside (`nodeagent.staging`, `nodeagent.shmbudget`) goes through such handles and ``O_NOFOLLOW``
opens (`O_DIR`, `O_READ`), so a link planted inside is never followed. With ``create=False`` (`nodeagent.preflight`)
the same walk makes and changes nothing.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Final

from nodeagent.errors import StagingFailed, UnsafeStagingDir

__all__ = ["DIR_MODE", "FILE_MODE", "O_DIR", "O_READ", "own_dir", "own_subdir", "size_in"]

DIR_MODE: Final = 0o700
FILE_MODE: Final = 0o600
"""Staged weights are the agent's: engines read them through the descriptors they are given, not by name."""

O_DIR: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_READ: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a planted FIFO never hangs us


def own_dir(path: Path, *, create: bool = True) -> int:
    """A handle of `path`, the agent's own directory: made 0700 if absent, refused unless ours and not a link.
    Its ancestors are opened one by one from ``/`` without following links (``O_NOFOLLOW``), each owned by root or
    the agent and not writable by others unless sticky: a link or another user's directory anywhere above it could
    point the whole path elsewhere. With `create` False (`nodeagent.preflight`) nothing is made or changed: an
    absent directory raises `FileNotFoundError`, a looser mode is left as it is."""
    pfd, shown = os.open("/", O_DIR), Path("/")
    try:
        for part in Path(os.path.abspath(path)).parent.parts[1:]:
            _check_above(pfd, shown, path)
            try:
                nfd = os.open(part, O_DIR, dir_fd=pfd)
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
        return own_subdir(pfd, path.name, path, create=create)
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


def own_subdir(dir_fd: int, name: str, shown: Path, *, create: bool = True) -> int:
    try:
        if create:
            os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
    except FileExistsError:
        pass  # checked below, whoever made it
    except OSError as err:
        raise StagingFailed(f"cannot create the staging directory {shown}: {err.strerror}") from None
    try:
        fd = os.open(name, O_DIR, dir_fd=dir_fd)
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


def size_in(dir_fd: int, name: str) -> int:
    """The size of the regular file `name` in the directory `dir_fd`; 0 when absent, a link or not a file."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0
