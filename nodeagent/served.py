"""Standby server engines: one OpenAI-compatible server process per slot, started at prewarm and kept standing.

The ``command`` engine (and ``vllm``, which builds on this module) does not fork on activation: the agent starts
the slot's server while the slot is being prewarmed, announces the slot `warm` only once the server's readiness
URL answers 200, and activation is then an optional *wake* hook plus the agent's usual readiness check
(`nodeagent.readiness`). Deactivation runs an optional *sleep* hook; the server stays up (``resident``).

The interface an engine adapter plugs in is `ServerSpec` (`nodeagent.serverspec`: frozen, compared to decide
whether a slot's server must be restarted; its hooks, `render` of its command line, `http_request` for hooks). The
slot's engine mode is ``wake`` when a wake hook ran and ``resident`` otherwise. Placeholders of the command line
(`PLACEHOLDERS`): ``{port}``, ``{host}``, ``{model_dir}`` (the ``--model`` directory as given: the server, running as
the engine user, opens it by path), ``{staged_dir}`` (the agent's verified copy in shm, readable by the server only
when the agent is not root), ``{model_name}``, ``{slot}``, ``{rootfs}`` (the mounted ``--image``,
`nodeagent.rootfs`; empty without one: its bin and site-packages are also put first on ``PATH``/``PYTHONPATH``
through the spec's env).

Process hygiene (`nodeagent.serverproc`): the server runs in its own session and process group (stopped as a group:
SIGTERM, SIGKILL after `STOP_GRACE_S`), as the engine user with ``PR_SET_NO_NEW_PRIVS`` when the agent is root
(`zygote.drop_privileges`, the zygote's own step), with ``PR_SET_PDEATHSIG`` (SIGKILL) set after the user change,
so a SIGKILLed agent takes its servers with it. Its stdout and stderr go through a pipe to the agent, which writes
them to ``<log_dir>/<slot>.log`` (`nodeagent.enginelog`: 0600 in a 0700 directory the agent owns, rotated to ``.1``
at `LOG_MAX_BYTES`) and keeps the last lines for the status (`EngineLog.tail`).

This module runs the server (`ServedEngine`) and is the face of the standby servers for the rest of the agent:
the names of the modules above that callers use are importable from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from nodeagent.engine import Started
from nodeagent.enginelog import LOG_MAX_BYTES, LOG_TAIL_LINES, EngineLog
from nodeagent.errors import EngineFailed
from nodeagent.forked import engine_env, engine_identity
from nodeagent.serverproc import (
    GROUP_GONE_WAIT_S,
    SERVER_MARKER,
    SHM_LEFTOVER_PREFIXES,
    describe_rc,
    kill_strays,
    killpg,
    preexec,
    refusal,
    sweep_shared_memory,
)
from nodeagent.serverspec import PLACEHOLDERS, BadCommand, Hook, ServerSpec, free_port, http_request, render

__all__ = [
    "GROUP_GONE_WAIT_S",
    "LOG_MAX_BYTES",
    "LOG_TAIL_LINES",
    "PLACEHOLDERS",
    "SERVER_MARKER",
    "SHM_LEFTOVER_PREFIXES",
    "BadCommand",
    "EngineLog",
    "Hook",
    "ServedEngine",
    "ServerSpec",
    "free_port",
    "http_request",
    "kill_strays",
    "render",
    "sweep_shared_memory",
]

log = logging.getLogger("pulsescale.agent.engine")

STOP_GRACE_S: Final = 5.0
"""SIGTERM to the group, then SIGKILL after this long: a server flushing its logs or freeing a GPU needs a few
seconds; one that ignores SIGTERM must not hold up a shutdown."""
HOOK_TIMEOUT_S: Final = 60.0
"""A sleep hook's bound (off the activation path): vLLM offloading a large model's weights takes seconds."""
_POLL_S: Final = (0.05, 0.1, 0.2, 0.5)
"""Health retry pauses while a server starts: servers take seconds to minutes, so polling faster buys nothing."""
_PROBE_S: Final = 5.0
"""The longest one readiness probe waits for its answer (less when the health deadline is nearer)."""
_EXIT_POLL_S: Final = 0.1
"""How often a server's return code is looked at while its children still hold its output pipe."""
_MODEL_PATHS: Final = ("model_dir", "staged_dir")
"""Placeholders naming a model directory the server opens by path (the first one its command line has)."""


class ServedEngine:
    """A slot's standby server: started by `arm` (waits for health), woken by `start`, put to sleep by `stop`,
    killed with its process group by `close`. The interface `slot.SlotEngine` names, as `forked.ForkedEngine`.

    `on_exit(reason)` is called when the server dies on its own (not on `close`).
    """

    def __init__(
        self,
        spec: ServerSpec,
        *,
        name: str,
        bind_host: str,
        advertise_host: str,
        port: int = 0,
        values: Mapping[str, str],
        log_dir: Path,
        on_exit: Callable[[str], None] | None = None,
    ) -> None:
        self.spec = spec
        self.name = name
        self.bind_host = bind_host
        self.advertise_host = advertise_host
        self.port = port
        self.values = dict(values)
        self.log_dir = log_dir
        self.on_exit = on_exit
        self.log: EngineLog | None = None
        self.arms = 0
        self.prepare_ms = 0.0
        """Process start to the first healthy answer, last arm."""
        self.restarts = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._port: int | None = None
        self._pump: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._healthy = False
        self._closing = False
        self._serving: Started | None = None
        self._lock = asyncio.Lock()
        self._owner: int | None = None
        self._started_at = 0.0
        self.shm_swept = 0
        """Shared-memory segments left by killed servers and removed (`sweep_shared_memory`)."""

    @property
    def marker(self) -> str:
        """This slot's value of `SERVER_MARKER`: unique per agent (its log directory) and slot."""
        return str(self.log_dir / self.name)

    # --- what the slot sees --------------------------------------------------------------------------------------

    @property
    def engine_name(self) -> str:
        return self.spec.engine

    @property
    def mode(self) -> str:
        return self.spec.mode

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    @property
    def endpoint(self) -> str | None:
        return f"http://{self.advertise_host}:{self._port}" if self._port else None

    @property
    def armed(self) -> bool:
        return self._healthy and self._proc is not None and self._proc.returncode is None

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
            "engine": self.spec.engine,
            "mode": self.spec.mode,
            "armed": self.armed,
            "server_pid": self.pid,
            "arms": self.arms,
            "restarts": self.restarts,
            "prepare_ms": round(self.prepare_ms, 1),
            "endpoint": self.endpoint,
            "serving": self._serving is not None,
        }

    # --- standby -------------------------------------------------------------------------------------------------

    async def arm(self) -> None:
        """Start the server (unless it stands healthy already) and wait for its readiness URL to answer 200.
        Raises `EngineFailed` (stage ``arm``) with the log's last lines when it exits or stays unhealthy."""
        async with self._lock:
            if self.armed:
                return
            had = self._proc is not None
            await self._kill()  # with a process, this also kills what it left outside its group
            if not had:
                await asyncio.to_thread(kill_strays, self.marker)  # what a SIGKILLed agent's server left running
            if self.log is None:
                self.log = EngineLog(self.log_dir, self.name)
            port = self.port or free_port(self.bind_host)
            argv = render(self.spec.argv, {**self.values, "port": port, "host": self.bind_host})
            run_as = engine_identity(self.spec.engine_user)
            # The model directory the server opens by path: checked as the engine user before the exec (`preexec`).
            reads = next((self.values.get(p) for p in _MODEL_PATHS if _names(self.spec.argv, p)), None)
            self._owner, self._started_at = (run_as[0] if run_as else os.geteuid()), time.time()
            self.log.note(f"starting {shlex.join(argv)}" + (f" as uid {run_as[0]}" if run_as else ""))
            t0 = time.perf_counter()
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                # No NATS credentials, none of the agent's settings; the marker finds what the server leaves behind.
                env=engine_env({**self.spec.env, SERVER_MARKER: self.marker}),
                start_new_session=True,  # its own process group: stopped as a group, Ctrl-C is the agent's
                preexec_fn=preexec(run_as, os.getpid(), reads),
            )
            # Said once at the start: a server's own output goes to its log, and the wait can be minutes long.
            log.info(
                "slot %s: server %d starting%s; up to %g s for %s to answer 200 (its output: %s)",
                self.name,
                self._proc.pid,
                f" as uid {run_as[0]}" if run_as else "",
                self.spec.health_timeout_s,
                self.spec.ready_path,
                self.log.path,
            )
            self._port = port
            self._pump = asyncio.create_task(self._read(self._proc), name=f"server-log-{self.name}")
            self._watch = asyncio.create_task(self._wait(self._proc), name=f"server-{self.name}")
            try:
                await self._until_healthy(self._proc, t0)
            except EngineFailed:
                await self._kill()
                raise
            self.prepare_ms = (time.perf_counter() - t0) * 1e3
            self._healthy = True
            self.arms += 1
            self.log.note(f"healthy after {self.prepare_ms:.0f} ms on port {port}")
            log.info("slot %s: server %d healthy after %.0f ms", self.name, self._proc.pid, self.prepare_ms)

    async def _until_healthy(self, proc: asyncio.subprocess.Process, t0: float) -> None:
        assert self._watch is not None
        url = f"http://{_connect_host(self.bind_host)}:{self._port}"
        timeout_s = self.spec.health_timeout_s
        last = "no answer yet"
        attempt = 0
        while True:
            if proc.returncode is not None:
                await self._drained()
                refused = refusal(proc.returncode, self.log_tail())
                if refused is not None:
                    raise EngineFailed("arm", f"server {proc.pid} stopped before it ran: {refused}")
                raise EngineFailed(
                    "arm",
                    f"server {proc.pid} {describe_rc(proc.returncode)} before {self.spec.ready_path} answered 200"
                    + self._tail_note(),
                )
            left = timeout_s - (time.perf_counter() - t0)
            if left <= 0:
                raise EngineFailed(
                    "arm",
                    f"server {proc.pid} not healthy after {timeout_s:g} s ({self.spec.ready_path}: {last})"
                    + self._tail_note(),
                )
            probe_s = min(_PROBE_S, left)
            try:
                status, _ = await http_request(url, "GET", self.spec.ready_path, timeout_s=probe_s)
                if status == 200:
                    return
                last = f"answered {status}"
            except (OSError, TimeoutError) as err:
                # A probe the deadline cut short says nothing new about the server: keep what it last answered.
                if not (isinstance(err, TimeoutError) and probe_s < _PROBE_S and last.startswith("answered")):
                    last = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            pause = min(_POLL_S[min(attempt, len(_POLL_S) - 1)], max(0.0, left))
            attempt += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._watch), pause)  # wakes at once if it exits

    def _tail_note(self) -> str:
        tail = self.log_tail()
        where = f" (log: {self.log_path})" if self.log_path else ""
        return f"{where}; last output:\n" + "\n".join(tail[-10:]) if tail else f"{where}; it printed nothing"

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while chunk := await proc.stdout.read(65536):
            if self.log is not None:
                self.log.write(chunk)

    async def _drained(self) -> None:
        """The pipe read to its end (the server's last words are in the tail), bounded: a grandchild may hold it."""
        if self._pump is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._pump), 1.0)

    async def _wait(self, proc: asyncio.subprocess.Process) -> None:
        # `proc.wait()` (Python 3.11) returns only once the output pipe is closed too, and children left in the
        # server's group hold it open (vLLM's engine core outlives a killed API server): watch the return code,
        # which is set when the server itself is reaped, and take its group down with it.
        waiter = asyncio.ensure_future(proc.wait())
        while not waiter.done() and proc.returncode is None:
            await asyncio.wait({waiter}, timeout=_EXIT_POLL_S)
        if not waiter.done():
            killpg(proc.pid, signal.SIGKILL)
        rc = await waiter
        if self.log is not None:
            self.log.note(f"server {proc.pid} {describe_rc(rc)}")
        if self._closing or proc is not self._proc or not self._healthy:
            return  # stopped by us, replaced, or still starting (`arm` reports it)
        self._healthy = False
        was = self._serving
        self._serving = None
        await self._drained()
        reason = f"server {proc.pid} {describe_rc(rc)}{' while serving' if was else ''}" + self._tail_note()
        log.warning("slot %s: %s", self.name, reason)
        killpg(proc.pid, signal.SIGKILL)  # whatever it left behind in its group
        await self._sweep(proc.pid)
        self.restarts += 1
        if self.on_exit is not None:
            self.on_exit(reason)

    # --- activation ----------------------------------------------------------------------------------------------

    async def start(self, *, timeout_s: float) -> Started:
        """Take the standing server into service: the wake hook, if any. Readiness is the agent's to check."""
        async with self._lock:
            if self._serving is not None:
                return self._serving
            if not self.armed or self._proc is None:
                raise EngineFailed("engine", "the standby server is not running (it died and is being restarted)")
            endpoint = self.endpoint
            assert endpoint is not None
            t0 = time.perf_counter()
            if self.spec.wake is not None:
                try:
                    async with asyncio.timeout(timeout_s):
                        await self.spec.wake(endpoint, timeout_s)
                except TimeoutError:
                    raise EngineFailed(
                        "engine", f"wake not done after {timeout_s * 1e3:.0f} ms", code="deadline"
                    ) from None
                except EngineFailed:
                    raise
                except Exception as err:  # noqa: BLE001 - a hook's failure is the activation's reason
                    raise EngineFailed("engine", f"wake failed: {type(err).__name__}: {err}") from None
            self._serving = Started(
                endpoint=endpoint,
                pid=self._proc.pid,
                load_ms=0.0,  # a standby server holds its weights already
                engine_ms=(time.perf_counter() - t0) * 1e3,
                loaded_bytes=0,
                mode=self.spec.mode,
                engine_mode=self.spec.mode,
                health_path=self.spec.ready_path,
            )
            return self._serving

    async def stop(self) -> None:
        """Out of service, server left standing: the sleep hook, if any. A server that refuses to sleep is
        killed (`on_exit` does not fire) and comes back at the next `arm`, off the activation path."""
        async with self._lock:
            was, self._serving = self._serving, None
            if was is None or self.spec.sleep is None or not self.armed:
                return
            endpoint = self.endpoint
            assert endpoint is not None
            try:
                async with asyncio.timeout(HOOK_TIMEOUT_S):
                    await self.spec.sleep(endpoint, HOOK_TIMEOUT_S)
            except Exception as err:  # noqa: BLE001 - any failure: the server is in an unknown state
                log.warning("slot %s: sleep failed (%s: %s); restarting its server", self.name, type(err).__name__, err)
                await self._kill()

    async def reset(self) -> None:
        """After a failed activation: the server may be wedged; kill it so the next `arm` starts it afresh."""
        async with self._lock:
            self._serving = None
            await self._kill()

    async def close(self) -> None:
        self._closing = True
        async with self._lock:
            self._serving = None
            await self._kill()
            if self.log is not None:
                self.log.close()

    async def _kill(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after the grace; waits for it."""
        proc, self._proc = self._proc, None
        self._healthy = False
        if proc is not None:
            if proc.returncode is None:
                killpg(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
                except TimeoutError:
                    log.warning("slot %s: server %d ignored SIGTERM; killing its group", self.name, proc.pid)
            killpg(proc.pid, signal.SIGKILL)  # also what it left behind in its group
            await proc.wait()
            strays = await asyncio.to_thread(kill_strays, self.marker)  # children that left the group
            if strays:
                log.warning("slot %s: killed %d process(es) its server left outside its group", self.name, len(strays))
            await self._sweep(proc.pid)
        for task in (self._pump, self._watch):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._pump = self._watch = None

    async def _sweep(self, pgid: int) -> None:
        """Once the server's group is gone, remove the shared memory it left in /dev/shm (off the activation path)."""
        if self._owner is None:
            return
        for _ in range(int(GROUP_GONE_WAIT_S / _EXIT_POLL_S)):
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                break
            await asyncio.sleep(_EXIT_POLL_S)
        removed = await asyncio.to_thread(sweep_shared_memory, self._owner, self._started_at)
        if removed:
            self.shm_swept += len(removed)
            log.info("slot %s: removed %d shared-memory segment(s) its server left: %s", self.name, len(removed),
                     ", ".join(removed[:5]))  # fmt: skip


def _names(argv: tuple[str, ...], placeholder: str) -> bool:
    """`argv` has ``{placeholder}`` in one of its words."""
    return any(f"{{{placeholder}}}" in word for word in argv)


def _connect_host(bind_host: str) -> str:
    """Where the agent reaches a server bound to `bind_host`: loopback for a wildcard bind."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "") else "::1" if bind_host == "::" else bind_host
