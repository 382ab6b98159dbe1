"""The zygote: one pre-forked, already-imported process per slot; activation is fork-and-go.

The agent starts ``python -m nodeagent.engine.zygote SPEC`` when it arms a slot. The zygote imports the engine and the
loader (numpy, the HTTP server: the interpreter start and imports that a cold pod pays for), reads the model's
config, freezes its heap (`gc.freeze`, so forked children share it copy-on-write) and waits for commands on
stdin, one JSON object per line (`nodeagent.engine.pipe`: typed, decoded there; a line that is not a command is
answered with an ``error`` event):

- ``{"cmd": "start", "port": P}`` (`pipe.Start`): fork a child that loads the staged weights with the loader,
  builds the engine, binds ``host:P`` (0 = any free port) and serves; it reports ``serving`` (or ``failed``) itself.
- ``{"cmd": "stop", "grace_s": S}`` (`pipe.Stop`): SIGTERM the child, SIGKILL it after S seconds; the process exit
  frees every byte of engine memory, while the staged weights stay in shm and the zygote stays armed.
- ``{"cmd": "exit"}`` (`pipe.Exit`) or end of stdin (the agent is gone): kill the child and exit.

The spec's ``weights`` are the staged files as descriptors the agent passed to the zygote (open, read-only,
hashed by the agent through that very descriptor) with the device, inode and size staging verified; the zygote
checks them when it arms and the loader again before it maps (`loaders.VerifiedFile`). Nothing here opens the
weights by name. ``run_as`` ([uid, gid], set when the agent is root) is the unprivileged user the zygote becomes
once it has imported everything and read the config: ``PR_SET_NO_NEW_PRIVS``, no supplementary groups, then the
group and user (real, effective and saved), so no engine process ever runs as root or can regain it.

Events (`pipe.Event`) go to the stdout the zygote was started with, one JSON line each (< PIPE_BUF, so the
zygote's and the child's lines never interleave): ``armed``, ``forked``, ``serving``, ``failed``, ``exited``,
``error``. That descriptor is the zygote's own: first thing, it is moved aside and fd 1 joins fd 2 (the slot's log,
through the agent), so nothing an engine or a library prints can pass for an event, and the child closes it once it
serves.
Both processes ask the kernel to kill them when their parent dies (``PR_SET_PDEATHSIG``), so a SIGKILLed agent
leaves no engine behind.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import select
import signal
import sys
import time
import traceback
from typing import Any, Final

from nodeagent.engine import pipe

__all__ = ["CHILD_ENGINES", "FAULTS", "main"]

CHILD_ENGINES: Final = {"local": "nodeagent.engine.local"}
"""Engine name -> module with ``prepare(spec) -> object with boot(weights, host, port, fault)``."""

FAULTS: Final = ("crash", "hang", "unhealthy", "fail", "badreply")
"""Test-only fault injection (failpoints), set per slot by the agent's settings: ``crash`` aborts the engine
after loading (SIGABRT), ``hang`` loads and never serves, ``unhealthy`` serves 503 on /health, ``fail`` reports
an engine error and exits, ``badreply`` answers completions with a JSON list instead of an object."""

_PR_SET_PDEATHSIG: Final = 1
_PR_SET_NO_NEW_PRIVS: Final = 38
_events_fd = 1
"""Where `emit` writes: the stdout the agent reads events from (moved off fd 1 by `main`)."""


def _die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the stdin EOF check still ends the zygote
    if os.getppid() != parent:
        os._exit(1)  # the parent died before prctl took effect


def drop_privileges(uid: int, gid: int) -> None:
    """Become `uid`:`gid` for good: no new privileges (no setuid binary or file capability can raise them
    again), no supplementary groups, then group and user. Raises `OSError` if any step is refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"PR_SET_NO_NEW_PRIVS: {os.strerror(e)}")
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise OSError(f"still {os.getresuid()}:{os.getresgid()} after dropping to {uid}:{gid}")


def emit(event: pipe.Event) -> None:
    """One event line to the agent (`pipe.encode`: compact JSON, well under ``PIPE_BUF``, written at once)."""
    os.write(_events_fd, pipe.encode(event))


def _keep_events_apart() -> None:
    """The event channel on a descriptor of its own; fd 1 (prints) goes where fd 2 goes, the slot's log."""
    global _events_fd
    _events_fd = os.dup(1)
    os.dup2(2, 1)


def _child(spec: dict[str, Any], engine: Any, loader: Any, files: Any, port: int, zygote_pid: int) -> None:
    """Runs in the forked engine process; never returns."""
    code = 0
    try:
        _die_with_parent(zygote_pid)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # the process exit frees the engine's memory
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # commands are the zygote's to read
        t0 = time.perf_counter()
        try:
            weights = loader.load(files, private=spec["private"])
        except Exception as err:  # noqa: BLE001 - reported to the agent, which decides what it means
            traceback.print_exc()
            emit(pipe.Failed(pid=os.getpid(), stage="load", reason=f"{type(err).__name__}: {err}"))
            os._exit(1)
        t1 = time.perf_counter()
        fault = spec.get("fault")
        if fault == "crash":
            os.abort()
        if fault == "fail":
            emit(pipe.Failed(pid=os.getpid(), stage="engine", reason="fault injected: engine failed"))
            os._exit(1)
        if fault == "hang":
            while True:
                time.sleep(3600)
        try:
            server = engine.boot(weights, spec["host"], port, fault)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc()
            emit(pipe.Failed(pid=os.getpid(), stage="engine", reason=f"{type(err).__name__}: {err}"))
            os._exit(1)
        t2 = time.perf_counter()
        emit(
            pipe.Serving(
                pid=os.getpid(),
                port=server.port,
                load_ms=(t1 - t0) * 1e3,
                boot_ms=(t2 - t1) * 1e3,
                bytes=weights.nbytes,
                mode=weights.mode,
            )
        )
        os.close(_events_fd)  # nothing more to say: what it serves cannot write to the agent's event channel
        server.serve_forever(poll_interval=3600)
    except BaseException:  # noqa: BLE001 - a child must never fall back into the zygote's loop
        traceback.print_exc()
        code = 1
    os._exit(code)


class _Zygote:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.child: int | None = None
        self.pidfd: int | None = None

    def arm(self) -> None:
        t0 = time.perf_counter()
        from nodeagent.engine import loaders  # numpy comes with these: the heavy imports, done before any fork

        module = importlib.import_module(CHILD_ENGINES[self.spec["engine"]])
        self.engine = module.prepare(self.spec)
        self.loader, _ = loaders.choose(self.spec["loader"])
        if not self.spec.get("weights"):
            raise ValueError("the spec names no verified weights descriptors (staging.Staged.engine_weights)")
        self.files = loaders.verified_files(self.spec["weights"])
        for vf in self.files:
            vf.check()  # a descriptor that is not the verified file fails arming, not an activation later
        run_as = self.spec.get("run_as")
        if run_as is not None:
            drop_privileges(int(run_as[0]), int(run_as[1]))
            _die_with_parent(int(self.spec["parent_pid"]))  # a change of user clears the parent-death signal
        note = self.loader.prepare(self.files)  # as the engine's user: limits and capabilities as it will have them
        gc.collect()
        gc.freeze()  # objects made so far are never touched by the collector: children share them untouched
        emit(pipe.Armed(pid=os.getpid(), prepare_ms=(time.perf_counter() - t0) * 1e3, loader_note=note))

    def start(self, cmd: pipe.Start) -> None:
        if self.child is not None:
            emit(pipe.Error(reason=f"engine process {self.child} is still running; stop it first"))
            return
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            _child(self.spec, self.engine, self.loader, self.files, cmd.port, me)
        self.child = pid
        self.pidfd = os.pidfd_open(pid)
        emit(pipe.Forked(pid=pid))

    def reap(self, requested: bool) -> None:
        assert self.child is not None and self.pidfd is not None
        _, status = os.waitpid(self.child, 0)
        if os.WIFSIGNALED(status):
            event = pipe.Exited(pid=self.child, requested=requested, signal=signal.Signals(os.WTERMSIG(status)).name)
        else:
            event = pipe.Exited(pid=self.child, requested=requested, code=os.WEXITSTATUS(status))
        os.close(self.pidfd)
        self.child = self.pidfd = None
        emit(event)

    def stop(self, grace_s: float) -> None:
        if self.child is None:
            emit(pipe.Exited(pid=None, requested=True))
            return
        os.kill(self.child, signal.SIGTERM)
        assert self.pidfd is not None
        ready, _, _ = select.select([self.pidfd], [], [], grace_s)
        if not ready:
            os.kill(self.child, signal.SIGKILL)
        self.reap(requested=True)

    def run(self) -> None:
        buf = b""
        while True:
            fds = [0] if self.pidfd is None else [0, self.pidfd]
            ready, _, _ = select.select(fds, [], [])
            if self.pidfd is not None and self.pidfd in ready:
                self.reap(requested=False)
            if 0 not in ready:
                continue
            data = os.read(0, 65536)
            if not data:
                self.shutdown()
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip():
                    continue
                try:
                    cmd = pipe.decode_command(line)
                except pipe.BadMessage as err:  # not JSON, no known ``cmd``, a field missing or of the wrong type
                    emit(pipe.Error(reason=str(err)))
                    continue
                if isinstance(cmd, pipe.Start):
                    self.start(cmd)
                elif isinstance(cmd, pipe.Stop):
                    self.stop(cmd.grace_s)
                else:  # pipe.Exit
                    self.shutdown()
                    return

    def shutdown(self) -> None:
        if self.child is not None:
            os.kill(self.child, signal.SIGKILL)
            self.reap(requested=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _keep_events_apart()
    spec = json.loads(argv[0])
    _die_with_parent(int(spec["parent_pid"]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the agent, which stops its zygotes in order
    zygote = _Zygote(spec)
    try:
        zygote.arm()
    except Exception as err:  # noqa: BLE001 - reported to the agent as the reason the slot cannot arm
        traceback.print_exc()
        emit(pipe.Error(reason=f"cannot arm: {type(err).__name__}: {err}", fatal=True))
        return 1
    zygote.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
