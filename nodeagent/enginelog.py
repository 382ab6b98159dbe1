"""A slot server's output, written by the agent: ``<log_dir>/<slot>.log``, 0600 in a 0700 directory the agent owns,
rotated to ``.1`` at `LOG_MAX_BYTES`, its last lines kept for the status (`EngineLog.tail`).

The standby servers' output (`nodeagent.served`) and the zygotes' and their engines' (`nodeagent.forked`, through
its `OutputLog` interface) come through a pipe to the agent, which writes them here: never to the agent's own
stderr, where an engine could forge agent log lines, and never by the engine into the directory itself.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import stat
import time
from pathlib import Path
from typing import Final

__all__ = ["LOG_MAX_BYTES", "LOG_TAIL_LINES", "EngineLog"]

log = logging.getLogger("pulsescale.agent.engine")

LOG_MAX_BYTES: Final = 16 * 2**20
"""A slot's log is rotated (one ``.1`` kept) at this size: a chatty server cannot fill the node's tmpfs."""
LOG_TAIL_LINES: Final = 20
"""Lines of the log kept in memory for the status (NATS reply size stays small)."""
_LOG_LINE_CHARS: Final = 400


def _own_log_dir(path: Path) -> int:
    """A handle of `path`, made 0700 if absent; refused if a link or not the agent's (a server writes through
    the agent, never into the directory itself)."""
    with contextlib.suppress(FileExistsError):
        os.makedirs(path, mode=0o700)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(
            errno.EPERM, f"engine log directory {path} is owned by uid {st.st_uid}, not by the agent; remove it"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)
    return fd


class EngineLog:
    """A slot server's output: appended to ``<dir>/<name>.log`` (rotated at `max_bytes`), last lines kept."""

    def __init__(self, directory: Path, name: str, *, max_bytes: int = LOG_MAX_BYTES) -> None:
        self.path = directory / f"{name}.log"
        self.max_bytes = max_bytes
        self._name = f"{name}.log"
        self._dir_fd = _own_log_dir(directory)
        self._fd = self._open()
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._partial = b""

    def _open(self) -> int:
        fd = os.open(
            self._name,
            os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=self._dir_fd,
        )
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            raise PermissionError(errno.EPERM, f"{self.path} is not a plain file of the agent's; remove it")
        return fd

    def note(self, text: str) -> None:
        """A line from the agent itself (start, exit), marked as such."""
        self.write(f"--- pulsescale {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: {text}\n".encode())

    def write(self, data: bytes) -> None:
        if self._fd < 0:
            return
        try:
            if os.fstat(self._fd).st_size + len(data) > self.max_bytes:
                os.replace(self._name, f"{self._name}.1", src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
                os.close(self._fd)
                self._fd = self._open()
            os.write(self._fd, data)
        except OSError as err:  # a full tmpfs must not stop the server: the tail still shows its output
            log.warning("cannot write %s: %s", self.path, err.strerror or err)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()[-4096:]
        for line in lines:
            self._tail.append(line.decode("utf-8", "replace").rstrip()[:_LOG_LINE_CHARS])

    def tail(self) -> list[str]:
        last = [self._partial.decode("utf-8", "replace")[:_LOG_LINE_CHARS]] if self._partial else []
        return [*self._tail, *last][-LOG_TAIL_LINES:]

    def close(self) -> None:
        for fd in (self._fd, self._dir_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fd = self._dir_fd = -1
