"""Where a model's bytes come from when it is staged: a model directory on this node, or a URL base.

`source_for` picks the kind: a directory (`DirSource`, read through a directory handle: a link in it is refused,
`open_file`) or an http(s) URL base serving one (`nodeagent.fetch.UrlSource`: a P2P proxy such as Dragonfly, an
object store; a cut-off download is continued with a Range request). Either gives the manifest, each file's size,
and its bytes written into a staged ``.partial`` file while they are hashed (`copy_hashing`: one pass over them).
`header_of` validates a safetensors file's header through its descriptor.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Protocol

from nodeagent import fetch, modelformat
from nodeagent.engine import safetensors_check
from nodeagent.errors import BadModel, BadWeights
from nodeagent.stagedir import O_READ, size_in

__all__ = ["COPY_BLOCK_BYTES", "DirSource", "Source", "copy_hashing", "header_of", "open_file", "source_for"]

COPY_BLOCK_BYTES: Final = 8 * 2**20
"""Read-hash-write block: large enough for full disk and memory bandwidth, small enough to stay in cache."""


class Source(Protocol):
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


class DirSource:
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
        return size_in(self.fd, name)

    def fetch(self, name: str, wfd: int, have: int, h: Any, on_bytes: Callable[[int], None]) -> tuple[Any, int, int]:
        sfd = open_file(self.fd, self.path, name)
        try:
            n = copy_hashing(sfd, wfd, h, on_bytes)
        finally:
            os.close(sfd)
        return h, n, n

    def close(self) -> None:
        os.close(self.fd)


def source_for(source: str | os.PathLike[str], options: fetch.FetchOptions | None) -> Source:
    """The source `source` names: a URL base (`fetch.UrlSource`) or a model directory (`DirSource`)."""
    if fetch.is_url(source):
        return fetch.UrlSource(str(source), options)
    return DirSource(Path(source))


def open_file(src_fd: int, source: Path, name: str) -> int:
    """`name` of the model directory `source` (handle `src_fd`), opened for reading: a regular file, never
    through a link; raises `BadWeights` saying why not."""
    try:
        fd = os.open(name, O_READ, dir_fd=src_fd)
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


def copy_hashing(src_fd: int, dst_fd: int, h: Any, on_bytes: Callable[[int], None]) -> int:
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


def header_of(fd: int, name: str) -> safetensors_check.Header | None:
    """The validated header of `name` through `fd` when it is a safetensors file; None for any other file."""
    return safetensors_check.read_header_fd(fd, name) if name.endswith(".safetensors") else None
