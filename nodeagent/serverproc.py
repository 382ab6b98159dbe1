"""A standby server's process, around its life: how it starts (`preexec`) and what it leaves behind when it dies.

The server runs in its own session and process group, as the engine user with ``PR_SET_NO_NEW_PRIVS`` when the
agent is root (`zygote.drop_privileges`, the zygote's own step), with ``PR_SET_PDEATHSIG`` (SIGKILL) set after the
user change, so a SIGKILLed agent takes its servers with it. Before the exec, as that user, the child checks that
it can read the model directory the server opens by path (`unreadable`): vLLM, refused, exits after ~15 s of
imports with a Hugging Face "Repo id must be in the form..." that does not say "permission". A child refused
before its exec exits `REFUSED_RC`, its reason the last line it wrote, after `REFUSED_PREFIX` (`refusal`).

Its children that left its group, or outlived a SIGKILLed agent, carry `SERVER_MARKER` in their environment and are
found from /proc (`kill_strays`); the multiprocessing segments a killed server left in /dev/shm are removed once
nothing maps them (`sweep_shared_memory`). `nodeagent.served` calls these off the activation path.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, NoReturn

from nodeagent.engine.zygote import drop_privileges

__all__ = [
    "GROUP_GONE_WAIT_S",
    "REFUSED_PREFIX",
    "REFUSED_RC",
    "SERVER_MARKER",
    "SHM_LEFTOVER_PREFIXES",
    "UNREADABLE_FIX",
    "closed_above",
    "describe_rc",
    "kill_strays",
    "killpg",
    "preexec",
    "refusal",
    "sweep_shared_memory",
    "unreadable",
]

_PR_SET_PDEATHSIG: Final = 1
_PR_SET_NO_NEW_PRIVS: Final = 38
REFUSED_RC: Final = 126
"""The exit code of a server child that `preexec` refused before its exec (the shell's "cannot execute")."""
REFUSED_PREFIX: Final = "pulsescale: "
"""How `preexec` starts each line that says why (in the slot's log: nothing else has written there yet). A line
each for the fact and the fix, so that neither is cut by the log tail's line length."""
UNREADABLE_FIX: Final = (
    "fix: give the engine user o+x on each directory above the model directory and o+rX on it (or its group's), "
    "or point --model at a copy that user can read; `pulsescale agent --check` names what is closed"
)


def preexec(run_as: tuple[int, int] | None, parent: int, reads: str | None = None) -> Callable[[], None]:
    """Runs in the forked child before exec (after the new session): drop to the engine user, no new privileges,
    die with the agent; then, as that user, check that the model directory `reads` can be read (`unreadable`).
    A refusal is written to the log (fd 2) and ends the child with `REFUSED_RC`: the agent reports the exit."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here, not in the child

    def refuse(*lines: str) -> NoReturn:
        os.write(2, "".join(f"{REFUSED_PREFIX}{line}\n" for line in lines).encode())
        os._exit(REFUSED_RC)

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
            refuse(f"cannot drop to the engine user {run_as}: {err}")
        why = unreadable(reads) if reads else None
        if why is not None:
            refuse(why, UNREADABLE_FIX)

    return child


def unreadable(model_dir: str) -> str | None:
    """Why this process cannot read `model_dir` (list it, read its files); None when it can. Run as the engine
    user (in `preexec`), it finds what the server would. Subdirectories are the server's business."""
    who = f"the engine user (uid {os.getuid()})"
    try:
        names = os.listdir(model_dir)
    except OSError as err:
        closed = closed_above(model_dir)
        why = f"{closed} is closed to it" if closed else (err.strerror or str(err))
        return f"{who} cannot read the model directory {model_dir} ({why})"
    paths = [os.path.join(model_dir, n) for n in sorted(names)]
    bad = [os.path.basename(p) for p in paths if os.path.isfile(p) and not os.access(p, os.R_OK)]
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        return f"{who} cannot read {shown} in the model directory {model_dir}"
    return None


def closed_above(path: str) -> str | None:
    """The first directory on the way to `path` (itself included) that this process may not enter."""
    p = Path(os.path.abspath(path))
    return next((str(d) for d in [*reversed(p.parents), p] if not os.access(d, os.X_OK)), None)


def refusal(rc: int, tail: Sequence[str]) -> str | None:
    """The reason `preexec` refused a server before its exec (its lines joined), from its exit code and its log's
    last lines; None for any other exit."""
    if rc != REFUSED_RC:
        return None
    said = [line[len(REFUSED_PREFIX) :] for line in tail if line.startswith(REFUSED_PREFIX)]
    return "; ".join(said) or None


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
