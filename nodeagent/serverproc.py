"""A standby server's process, around its life: how it starts (`preexec`) and what it leaves behind when it dies.

The server runs in its own session and process group, as the engine user with ``PR_SET_NO_NEW_PRIVS`` when the
agent is root (`zygote.drop_privileges`, the zygote's own step), with ``PR_SET_PDEATHSIG`` (SIGKILL) set after the
user change, so a SIGKILLed agent takes its servers with it. Its children that left its group, or outlived a
SIGKILLed agent, carry `SERVER_MARKER` in their environment and are found from /proc (`kill_strays`); the
multiprocessing segments a killed server left in /dev/shm are removed once nothing maps them
(`sweep_shared_memory`). `nodeagent.served` calls these off the activation path.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Final

from nodeagent.engine.zygote import drop_privileges

__all__ = [
    "GROUP_GONE_WAIT_S",
    "SERVER_MARKER",
    "SHM_LEFTOVER_PREFIXES",
    "describe_rc",
    "kill_strays",
    "killpg",
    "preexec",
    "sweep_shared_memory",
]

_PR_SET_PDEATHSIG: Final = 1
_PR_SET_NO_NEW_PRIVS: Final = 38


def preexec(run_as: tuple[int, int] | None, parent: int) -> Callable[[], None]:
    """Runs in the forked child before exec (after the new session): drop to the engine user, no new privileges,
    die with the agent. Errors are written to the log (fd 2) and end the child: the agent reports the exit."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here, not in the child

    def child() -> None:
        try:
            if run_as is not None:
                drop_privileges(*run_as)  # no_new_privs, no groups, then group and user
            elif libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS refused")
            # After the user change, which clears the parent-death signal.
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "PR_SET_PDEATHSIG refused")
            if os.getppid() != parent:
                os._exit(1)  # the agent died before the signal was armed
        except OSError as err:
            os.write(2, f"pulsescale: cannot drop to the engine user {run_as}: {err}\n".encode())
            os._exit(126)

    return child


def describe_rc(rc: int) -> str:
    """How the server's process ended: ``was killed by SIGKILL``, ``exited with code 1``."""
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


SERVER_MARKER: Final = "PULSESCALE_SERVER_OF"
"""Set in every standby server's environment, so in its children's: a process that left the server's group (its own
session) or outlived a SIGKILLed agent (the parent-death signal reaches the server, not its children) is found by
it, from /proc, when the slot's server is stopped or started again."""


def kill_strays(marker: str) -> list[int]:
    """SIGKILL every process whose environment carries ``SERVER_MARKER=marker``; their pids."""
    needle = f"{SERVER_MARKER}={marker}".encode()
    killed = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue  # gone, or not ours to read
        if needle in env.split(b"\0"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
    return killed


GROUP_GONE_WAIT_S: Final = 2.0
"""How long a killed group may take to be reaped before its shared memory is swept (what is still mapped stays)."""
SHM_LEFTOVER_PREFIXES: Final = ("psm_", "sem.mp-")
"""Python's multiprocessing segments and semaphores (vLLM and torch use them): unlinked only on a clean exit."""


def sweep_shared_memory(owner: int, since: float, shm: Path = Path("/dev/shm")) -> list[str]:
    """Remove multiprocessing segments in `shm` that a killed server left: owned by `owner`, changed since `since`
    (the server's start), and mapped or open by no live process. A killed vLLM leaves 150-250 MB per server."""
    try:
        candidates = [
            e for e in os.scandir(shm)
            if e.name.startswith(SHM_LEFTOVER_PREFIXES) and e.is_file(follow_symlinks=False)
            and e.stat(follow_symlinks=False).st_uid == owner and e.stat(follow_symlinks=False).st_ctime >= since - 1
        ]  # fmt: skip
    except OSError:
        return []
    if not candidates:
        return []
    in_use = _shm_in_use(shm)
    removed = []
    for e in candidates:
        if e.name in in_use:
            continue
        with contextlib.suppress(OSError):
            os.unlink(e.path)
            removed.append(e.name)
    return removed


def _shm_in_use(shm: Path) -> set[str]:
    """Names under `shm` that a live process maps or holds open (from /proc: what the agent, as root, can read)."""
    prefix = f"{shm}/"
    used: set[str] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                at = line.find(prefix)
                if at >= 0:
                    used.add(line[at + len(prefix) :].split()[0])
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        used.add(target[len(prefix) :].split()[0])
    return used


def killpg(pgid: int, sig: int) -> None:
    """`sig` to the process group `pgid`, if it is still there (and ours to signal)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
