"""Standby server engines: one OpenAI-compatible server process per slot, started at prewarm and kept standing.

The ``command`` engine (and ``vllm``, which builds on this module) does not fork on activation: the agent starts
the slot's server while the slot is being prewarmed, announces the slot `warm` only once the server's readiness
URL answers 200, and activation is then an optional *wake* hook plus the agent's usual readiness check
(`nodeagent.readiness`). Deactivation runs an optional *sleep* hook; the server stays up (``resident``).

The interface an engine adapter plugs in (`ServerSpec`, frozen, compared to decide whether a slot's server must be
restarted)::

    ServerSpec(
        engine="command",               # the adapter's name, recorded as SlotRecord.engine
        argv=("python", "srv.py", "--port", "{port}"),  # already split; placeholders filled by `render`
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},  # added to the inherited environment (NATS_*/PULSESCALE_* removed)
        ready_path="/health",           # GET http://host:port<ready_path> must answer 200 before `warm`
        health_timeout_s=600.0,         # from process start to that 200; past it: the slot is `failed`
        wake=None,                      # async hook(endpoint, timeout_s) run on activation (vLLM: POST /wake_up)
        sleep=None,                     # async hook(endpoint, timeout_s) run on deactivation (vLLM: POST /sleep)
        engine_user="nobody",           # who the server runs as when the agent is root
        version="...",                  # the staged weights' version: a new one restarts the server
    )

A hook is ``async def hook(endpoint: str, timeout_s: float) -> None`` (a module-level function, so specs compare
equal); it raises `EngineFailed` (or anything: described as the reason) when the server refused. `http_request`
is the small HTTP client hooks can use. The slot's engine mode is ``wake`` when a wake hook ran and ``resident``
otherwise. Placeholders of the command line (`PLACEHOLDERS`): ``{port}``, ``{host}``, ``{model_dir}`` (the
``--model`` directory as given: the server, running as the engine user, opens it by path), ``{staged_dir}`` (the
agent's verified copy in shm, readable by the server only when the agent is not root), ``{model_name}``, ``{slot}``,
``{rootfs}`` (the mounted ``--image``, `nodeagent.rootfs`; empty without one: its bin and site-packages are also put
first on ``PATH``/``PYTHONPATH`` through the spec's env).

Process hygiene: the server runs in its own session and process group (stopped as a group: SIGTERM, SIGKILL after
`STOP_GRACE_S`), as the engine user with ``PR_SET_NO_NEW_PRIVS`` when the agent is root (`zygote.drop_privileges`,
the zygote's own step), with ``PR_SET_PDEATHSIG`` (SIGKILL) set after the user change, so a SIGKILLed agent takes
its servers with it. Its stdout and stderr go through a pipe to the agent, which writes them to
``<log_dir>/<slot>.log`` (0600 in a 0700 directory the agent owns, rotated to ``.1`` at `LOG_MAX_BYTES`) and keeps
the last lines for the status (`EngineLog.tail`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import errno
import logging
import os
import shlex
import signal
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from nodeagent.engine import Started
from nodeagent.engine.zygote import drop_privileges
from nodeagent.errors import EngineFailed
from nodeagent.forked import DEFAULT_ENGINE_USER, engine_env, engine_identity

__all__ = [
    "PLACEHOLDERS",
    "BadCommand",
    "EngineLog",
    "Hook",
    "ServedEngine",
    "ServerSpec",
    "free_port",
    "http_request",
    "render",
]

log = logging.getLogger("pulsescale.agent.engine")

Hook = Callable[[str, float], Awaitable[None]]
"""``async hook(endpoint, timeout_s)``: wake or sleep a standby server; raises when it refused."""

PLACEHOLDERS: Final = ("port", "host", "model_dir", "staged_dir", "model_name", "slot", "rootfs")
STOP_GRACE_S: Final = 5.0
"""SIGTERM to the group, then SIGKILL after this long: a server flushing its logs or freeing a GPU needs a few
seconds; one that ignores SIGTERM must not hold up a shutdown."""
HOOK_TIMEOUT_S: Final = 60.0
"""A sleep hook's bound (off the activation path): vLLM offloading a large model's weights takes seconds."""
LOG_MAX_BYTES: Final = 16 * 2**20
"""A slot's log is rotated (one ``.1`` kept) at this size: a chatty server cannot fill the node's tmpfs."""
LOG_TAIL_LINES: Final = 20
"""Lines of the log kept in memory for the status (NATS reply size stays small)."""
_LOG_LINE_CHARS: Final = 400
_POLL_S: Final = (0.05, 0.1, 0.2, 0.5)
"""Health retry pauses while a server starts: servers take seconds to minutes, so polling faster buys nothing."""
_PROBE_S: Final = 5.0
"""The longest one readiness probe waits for its answer (less when the health deadline is nearer)."""
_EXIT_POLL_S: Final = 0.1
"""How often a server's return code is looked at while its children still hold its output pipe."""
_PR_SET_PDEATHSIG: Final = 1
_PR_SET_NO_NEW_PRIVS: Final = 38


@dataclass(frozen=True)
class ServerSpec:
    """What a slot's standby server is; two equal specs are the same server (no restart needed)."""

    engine: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    ready_path: str = "/health"
    health_timeout_s: float = 600.0
    wake: Hook | None = None
    sleep: Hook | None = None
    engine_user: str = DEFAULT_ENGINE_USER
    version: str = ""

    def __hash__(self) -> int:  # env is a mapping: hash what identifies the server
        return hash((self.engine, self.argv, self.version))

    @property
    def mode(self) -> str:
        """The engine mode an activation of this server records (`warmpool.protocol.EngineMode`)."""
        return "wake" if self.wake is not None else "resident"


class BadCommand(ValueError):
    """An ``--engine-cmd`` that cannot be rendered: says which placeholder or quote is wrong."""


def render(template: str | tuple[str, ...], values: Mapping[str, object]) -> tuple[str, ...]:
    """The argv of `template` (a command line, shlex-split, no shell; or an already split tuple) with
    ``{placeholders}`` filled from `values`. Raises `BadCommand` on an unknown placeholder or bad quoting."""
    try:
        words = shlex.split(template) if isinstance(template, str) else list(template)
    except ValueError as err:
        raise BadCommand(f"cannot split the engine command {template!r}: {err}") from None
    if not words:
        raise BadCommand("the engine command is empty; give the server's command line with --engine-cmd")
    out = []
    for word in words:
        try:
            out.append(word.format_map(values))
        except KeyError as err:
            raise BadCommand(
                f"unknown placeholder {{{err.args[0]}}} in the engine command (known: "
                f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)}; write {{{{ and }}}} for literal braces)"
            ) from None
        except (ValueError, IndexError) as err:
            raise BadCommand(f"bad placeholder in {word!r} of the engine command: {err}") from None
    return tuple(out)


def free_port(host: str) -> int:
    """A port free on `host` now (the kernel's pick), for a server that must be told its port up front."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def http_request(
    endpoint: str, method: str, path: str, *, body: bytes | None = None, timeout_s: float = 5.0
) -> tuple[int, bytes]:
    """One HTTP/1.0 request to `endpoint` (``http://host:port``); (status, body). Raises `OSError` or
    `TimeoutError`. No client library: it runs while slots are prewarmed and in hooks, and asks for one thing."""
    hostport = endpoint.removeprefix("http://").rstrip("/")
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]")
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            head = f"{method} {path} HTTP/1.0\r\nHost: {hostport}\r\nConnection: close\r\n"
            if body is not None:
                head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            writer.write(head.encode() + b"\r\n" + (body or b""))
            await writer.drain()
            data = await reader.read(1 << 20)
            while chunk := await reader.read(1 << 20):
                data += chunk
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    status_line, _, rest = data.partition(b"\r\n")
    parts = status_line.split()
    if len(parts) < 2 or not parts[1].isdigit():
        raise OSError(errno.EPROTO, f"not an HTTP answer: {status_line[:80]!r}")
    return int(parts[1]), rest.partition(b"\r\n\r\n")[2]


# --- the log ---------------------------------------------------------------------------------------------------


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


# --- the server process --------------------------------------------------------------------------------------------


def _preexec(run_as: tuple[int, int] | None, parent: int) -> Callable[[], None]:
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


def _describe_rc(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


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
                preexec_fn=_preexec(run_as, os.getpid()),
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
                raise EngineFailed(
                    "arm",
                    f"server {proc.pid} {_describe_rc(proc.returncode)} before {self.spec.ready_path} answered 200"
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
            _killpg(proc.pid, signal.SIGKILL)
        rc = await waiter
        if self.log is not None:
            self.log.note(f"server {proc.pid} {_describe_rc(rc)}")
        if self._closing or proc is not self._proc or not self._healthy:
            return  # stopped by us, replaced, or still starting (`arm` reports it)
        self._healthy = False
        was = self._serving
        self._serving = None
        await self._drained()
        reason = f"server {proc.pid} {_describe_rc(rc)}{' while serving' if was else ''}" + self._tail_note()
        log.warning("slot %s: %s", self.name, reason)
        _killpg(proc.pid, signal.SIGKILL)  # whatever it left behind in its group
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
                _killpg(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
                except TimeoutError:
                    log.warning("slot %s: server %d ignored SIGTERM; killing its group", self.name, proc.pid)
            _killpg(proc.pid, signal.SIGKILL)  # also what it left behind in its group
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


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _connect_host(bind_host: str) -> str:
    """Where the agent reaches a server bound to `bind_host`: loopback for a wildcard bind."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "") else "::1" if bind_host == "::" else bind_host
