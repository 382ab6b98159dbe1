"""What a slot's standby server is: the interface an engine adapter plugs in (`ServerSpec`), its command line
(`render`), and the small HTTP client its hooks use (`http_request`). `nodeagent.served` runs it.

`ServerSpec` is frozen and compared to decide whether a slot's server must be restarted::

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
equal); it raises `EngineFailed` (or anything: described as the reason) when the server refused. Placeholders of
the command line (`PLACEHOLDERS`): ``{port}``, ``{host}``, ``{model_dir}``, ``{staged_dir}``, ``{model_name}``,
``{slot}``, ``{rootfs}`` (what each means: `nodeagent.served`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import shlex
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from nodeagent.forked import DEFAULT_ENGINE_USER

__all__ = ["PLACEHOLDERS", "BadCommand", "Hook", "ServerSpec", "free_port", "http_request", "render"]

Hook = Callable[[str, float], Awaitable[None]]
"""``async hook(endpoint, timeout_s)``: wake or sleep a standby server; raises when it refused."""

PLACEHOLDERS: Final = ("port", "host", "model_dir", "staged_dir", "model_name", "slot", "rootfs")


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
