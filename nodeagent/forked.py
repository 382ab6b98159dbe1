"""The agent's side of a zygote: arm it, start and stop its engine process, notice when either dies.

The zygote gets the verified weights as descriptors (``pass_fds``: the spec's ``weights``, see
`staging.Staged.engine_weights`) and, when the agent is root, the user to become (``engine_user``, default
``nobody``): engines never run as root, and they read the 0600 staged files only through what they were given.

What an engine is handed is no more than it needs: its environment is the agent's without NATS credentials or the
agent's settings (`engine_env`, shared with `served`), and its output (the zygote's and the engine's stdout and
stderr) goes through a pipe to the slot's log file (`OutputLog`, the standby servers' `served.EngineLog`: 0600 in
a 0700 directory the agent owns), never to the agent's own stderr, where an engine could forge agent log lines. The
zygote's events travel on its original stdout, which it keeps to itself (`zygote.main`).

The pipe speaks typed messages (`nodeagent.engine.pipe`): commands (`pipe.Start`, `pipe.Stop`, `pipe.Exit`) are
encoded by `ForkedEngine`, and each event line is decoded into its `pipe.Event`; a line that is not one (not JSON, an
unknown ``ev``, a field missing or of the wrong type) is a `pipe.BadMessage`, logged and skipped like any other
line the zygote should not have written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from nodeagent.engine import Started, pipe
from nodeagent.errors import EngineFailed

__all__ = ["ENV_DROPPED", "ForkedEngine", "OutputLog", "engine_env", "engine_identity"]

log = logging.getLogger("pulsescale.agent.engine")

ARM_TIMEOUT_S = 60.0
"""A zygote imports numpy and the engine: a second or two on a cold node; far more means something is wrong."""
DEFAULT_ENGINE_USER = "nobody"
"""Who engines run as when the agent is root and the spec names no one: exists on every Linux, owns nothing."""
STOP_GRACE_S = 2.0
"""SIGTERM, then SIGKILL after this long: the local engine exits at once; a stuck one must not block release."""
ENV_DROPPED: Final = ("NATS_", "PULSESCALE_")
"""Prefixes of the agent's environment no engine gets: NATS credentials (``PULSESCALE_NATS_PASSWORD``...) and the
agent's own settings are not theirs, and an engine runs code that came with the model or over HTTP."""
_DRAIN_S: Final = 1.0
"""How long the output pipe is read to its end after the zygote exits (its last words); a leftover holder of the
pipe's write end must not hold up a re-arm."""


def engine_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment an engine process (zygote or standby server) starts with: the agent's, less `ENV_DROPPED`,
    plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_DROPPED)}
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class _ZygoteDied:
    """Not a message of the pipe: what `ForkedEngine` tells a waiting `start` or `stop` when the zygote is gone."""

    reason: str


class OutputLog(Protocol):
    """Where a slot's engine output goes (`served.EngineLog`): appended, capped, last lines kept."""

    path: Path

    def write(self, data: bytes) -> None: ...

    def note(self, text: str) -> None: ...

    def tail(self) -> list[str]: ...

    def close(self) -> None: ...


class ForkedEngine:
    """An engine started by forking a pre-armed zygote.

    `spec` is the zygote's spec (engine, loader, model_dir, files, model_name, host, private, fault); `host`
    is the address put in the endpoint (the engine may bind 0.0.0.0). `on_exit(reason)` is called when the
    serving engine or the zygote dies on its own. `log` receives the zygote's and its engines' output (None: they
    share the agent's stderr, for benchmarks and tools that run an engine in the foreground).
    """

    def __init__(
        self,
        spec: Mapping[str, Any],
        *,
        name: str,
        advertise_host: str,
        port: int = 0,
        on_exit: Callable[[str], None] | None = None,
        log: OutputLog | None = None,
    ) -> None:
        self.spec = dict(spec)
        self.log = log
        self.name = name
        self.advertise_host = advertise_host
        self.port = port
        self.on_exit = on_exit
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pump: asyncio.Task[None] | None = None
        self._armed = asyncio.Event()
        self._arm_error: str | None = None
        self._events: asyncio.Queue[pipe.Event | _ZygoteDied] | None = None
        self._serving: Started | None = None
        self._lock = asyncio.Lock()
        self.arms = 0
        self.prepare_ms = 0.0
        self.zygote_pid: int | None = None
        self._closing = False

    @property
    def armed(self) -> bool:
        return self._armed.is_set() and self._proc is not None and self._proc.returncode is None

    @property
    def serving(self) -> Started | None:
        return self._serving

    @property
    def log_path(self) -> str | None:
        return str(self.log.path) if self.log is not None else None

    def log_tail(self) -> list[str]:
        return self.log.tail() if self.log is not None else []

    def status(self) -> dict[str, Any]:
        return {
            "engine": self.spec["engine"],
            "armed": self.armed,
            "zygote_pid": self.zygote_pid,
            "arms": self.arms,
            "prepare_ms": round(self.prepare_ms, 1),
            "engine_pid": self._serving.pid if self._serving else None,
            "endpoint": self._serving.endpoint if self._serving else None,
        }

    # --- zygote lifecycle ------------------------------------------------------------------------------------

    async def arm(self) -> None:
        async with self._lock:
            if self.armed:
                return
            await self._kill_zygote()
            self._armed.clear()
            self._arm_error = None
            run_as = engine_identity(str(self.spec.get("engine_user") or DEFAULT_ENGINE_USER))
            spec = {**self.spec, "parent_pid": os.getpid(), "run_as": run_as}
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "nodeagent.engine.zygote",
                json.dumps(spec),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,  # its events; the zygote moves its own prints to stderr
                stderr=asyncio.subprocess.PIPE if self.log is not None else None,
                env=engine_env(),
                pass_fds=[int(w["fd"]) for w in self.spec.get("weights", ())],
            )
            self.zygote_pid = self._proc.pid
            if self.log is not None:
                self.log.note(f"zygote {self._proc.pid} started" + (f" as uid {run_as[0]}" if run_as else ""))
                self._pump = asyncio.create_task(self._copy_output(self._proc), name=f"zygote-log-{self.name}")
            self._reader = asyncio.create_task(self._read(self._proc), name=f"zygote-{self.name}")
            try:
                await asyncio.wait_for(self._armed.wait(), ARM_TIMEOUT_S)
            except TimeoutError:
                await self._kill_zygote()
                raise EngineFailed("arm", f"zygote did not arm within {ARM_TIMEOUT_S:.0f} s") from None
            if self._arm_error is not None:
                await self._kill_zygote()
                raise EngineFailed("arm", self._arm_error)
            self.arms += 1

    async def _copy_output(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None and self.log is not None
        while chunk := await proc.stderr.read(65536):
            self.log.write(chunk)

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while True:
            line = await proc.stdout.readline()
            if not line:
                break
            try:
                ev = pipe.decode_event(line)
            except pipe.BadMessage as err:
                log.warning("slot %s: zygote said %r (%s)", self.name, line[:200], err.why)
                continue
            self._on_event(ev)
        rc = await proc.wait()
        reason = f"zygote {proc.pid} exited ({_describe_rc(rc)})"
        if self.log is not None:
            self.log.note(reason)
        if not self._armed.is_set():
            self._arm_error = self._arm_error or reason
            self._armed.set()  # wakes `arm`, which reports the error
            return
        self._armed.clear()
        if self._closing:
            return
        if self._events is not None:
            self._events.put_nowait(_ZygoteDied(reason))
        elif self._serving is not None:
            self._serving = None
            self._exit(f"{reason}; the engine went with it")
        elif proc is self._proc:
            self._exit(reason)

    def _on_event(self, ev: pipe.Event) -> None:
        if isinstance(ev, pipe.Armed):
            self.prepare_ms = ev.prepare_ms
            self._armed.set()
        elif isinstance(ev, pipe.Error) and ev.fatal:
            self._arm_error = ev.reason
        elif self._events is not None:
            self._events.put_nowait(ev)
        elif isinstance(ev, pipe.Exited) and self._serving is not None and ev.pid == self._serving.pid:
            self._serving = None
            self._exit(f"engine process {ev.pid} {ev.describe()} while serving")
        else:
            log.debug("slot %s: zygote event %s", self.name, ev)

    def _exit(self, reason: str) -> None:
        log.warning("slot %s: %s", self.name, reason)
        if self.on_exit is not None:
            self.on_exit(reason)

    # --- engine process ----------------------------------------------------------------------------------------

    def _send(self, cmd: pipe.Command) -> None:
        if self._proc is None or self._proc.stdin is None or self._proc.returncode is not None:
            raise EngineFailed("arm", "the zygote is not running")
        self._proc.stdin.write(pipe.encode(cmd))

    async def start(self, *, timeout_s: float) -> Started:
        async with self._lock:
            if self._serving is not None:
                return self._serving
            if not self.armed:
                raise EngineFailed("arm", "the zygote is not armed (it died and is being re-armed)")
            self._events = asyncio.Queue()
            t0 = time.perf_counter()
            pid: int | None = None
            try:
                self._send(pipe.Start(port=self.port))
                async with asyncio.timeout(timeout_s):
                    while True:
                        ev = await self._events.get()
                        if isinstance(ev, pipe.Forked):
                            pid = ev.pid
                        elif isinstance(ev, pipe.Serving):
                            ms = (time.perf_counter() - t0) * 1e3
                            self._serving = Started(
                                endpoint=f"http://{self.advertise_host}:{ev.port}",
                                pid=ev.pid,
                                load_ms=ev.load_ms,
                                engine_ms=max(0.0, ms - ev.load_ms),
                                loaded_bytes=ev.bytes,
                                mode=ev.mode,
                            )
                            return self._serving
                        elif isinstance(ev, pipe.Failed):
                            raise EngineFailed(ev.stage, ev.reason)
                        elif isinstance(ev, pipe.Exited):
                            raise EngineFailed("engine", f"engine process {ev.pid} {ev.describe()}")
                        elif isinstance(ev, (_ZygoteDied, pipe.Error)):
                            raise EngineFailed("engine", ev.reason)
            except TimeoutError:
                raise EngineFailed(
                    "engine", f"engine process {pid} not serving after {timeout_s * 1e3:.0f} ms", code="deadline"
                ) from None
            finally:
                self._events = None

    async def stop(self) -> None:
        async with self._lock:
            self._serving = None
            if not self.armed:
                return
            self._events = asyncio.Queue()
            try:
                self._send(pipe.Stop(grace_s=STOP_GRACE_S))
                async with asyncio.timeout(STOP_GRACE_S + 5.0):
                    while True:
                        ev = await self._events.get()
                        if isinstance(ev, _ZygoteDied) or (isinstance(ev, pipe.Exited) and ev.requested):
                            return
            except TimeoutError:
                log.error("slot %s: zygote did not stop its engine; killing the zygote", self.name)
                await self._kill_zygote()
            finally:
                self._events = None

    async def reset(self) -> None:
        """Stopping already ends the engine's process (SIGTERM, then SIGKILL) and keeps the zygote armed."""
        await self.stop()

    async def _kill_zygote(self) -> None:
        proc, self._proc = self._proc, None
        reader, self._reader = self._reader, None
        pump, self._pump = self._pump, None
        self._armed.clear()
        if proc is not None:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()  # its engine child gets SIGKILL from the kernel (PR_SET_PDEATHSIG)
            await proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        if pump is not None:  # the zygote's last words into the log, then the pipe is let go
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(pump), _DRAIN_S)
            pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def close(self) -> None:
        self._closing = True
        async with self._lock:
            self._serving = None
            proc = self._proc
            if proc is not None and proc.returncode is None and proc.stdin is not None:
                with contextlib.suppress(OSError, RuntimeError):
                    proc.stdin.write(pipe.encode(pipe.Exit()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), STOP_GRACE_S + 1.0)
            await self._kill_zygote()
            if self.log is not None:
                self.log.close()


def engine_identity(user: str) -> tuple[int, int] | None:
    """(uid, gid) the zygote drops to: `user`'s when the agent is root, None when it is not (nothing to drop)
    or when `user` is root itself (an explicit, logged opt-out)."""
    if os.geteuid() != 0:
        return None
    if user.isdigit():  # a bare uid (containers often have no passwd entry): its own group
        uid = int(user)
        return None if uid == 0 else (uid, uid)
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise EngineFailed(
            "arm",
            f"engine user {user!r} does not exist on this node; create it (useradd --system --no-create-home "
            f"{user}) or pass --engine-user with an existing unprivileged user",
        ) from None
    if pw.pw_uid == 0:
        log.warning("engines run as root (--engine-user %s): a compromised engine owns the node", user)
        return None
    return pw.pw_uid, pw.pw_gid


def _describe_rc(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        import signal

        return f"killed by {signal.Signals(-rc).name}"
    return f"code {rc}"
