"""How every daemon (autoscaler, agent, gateway, operator) starts: its ``--log-level`` and logging, then its loop.

`add_log_level_argument` adds ``--log-level`` to a daemon's parser and `configure_logging` sets up logging from it,
one format for all (``<time> <LEVEL> <logger>: <message>`` on stderr). `run_until_signalled` runs the daemon:
``asyncio.run`` of a loop where SIGTERM and SIGINT set the daemon's ``stop`` event (a graceful stop: it finishes
what it must and returns, exit 0), under `connect.run_daemon` (a permission the server refuses before the daemon
sets ``ready`` ends it with `PermissionDenied`). A failure at start-up leaves as the daemon raised it: a
`PulsescaleError`, which the dispatcher prints as one line and exits with its code.

`serve_until_stopped` is the body of a daemon's ``run`` whose work is one `Service` on one NATS connection (the
gateway, the bridge): connect, make and start the service, say it serves, then wait for ``stop`` or a background
task's death, and close the service and drain the connection on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Protocol, TypeVar

from nats.aio.client import Client

from warmpool import connect

__all__ = [
    "LOG_FORMAT",
    "LOG_LEVELS",
    "Service",
    "add_log_level_argument",
    "configure_logging",
    "run_until_signalled",
    "serve_until_stopped",
]

LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)

DaemonRun = Callable[[connect.NatsOptions, asyncio.Event, asyncio.Event], Awaitable[object]]
"""``run(nats, stop, ready)``: the daemon with these NATS options (`connect.run_daemon`'s, with its error hook);
it sets ``ready`` once it serves and returns once ``stop`` is set."""


def add_log_level_argument(
    p: argparse.ArgumentParser,
    *,
    default: str = "INFO",
    choices: Sequence[str] | None = LOG_LEVELS,
    help: str | None = None,
) -> None:
    """``--log-level`` (dest ``log_level``): one of `LOG_LEVELS`, `default` unless given; ``choices=None`` takes
    any level name, in either case (`configure_logging` upper-cases it)."""
    p.add_argument("--log-level", default=default, choices=choices, help=help)


def configure_logging(args: argparse.Namespace) -> None:
    """Logging at ``args.log_level`` to stderr, in `LOG_FORMAT` (`logging.basicConfig`: once per process)."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)


def run_until_signalled(nats: connect.NatsOptions, run: DaemonRun) -> None:
    """Run the daemon `run` until SIGTERM or SIGINT sets its ``stop`` event and it returns (see the module)."""

    async def main() -> None:
        stop, ready = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
        await connect.run_daemon(nats, lambda opts: run(opts, stop, ready), ready)

    asyncio.run(main())


class Service(Protocol):
    """What `serve_until_stopped` runs: a daemon's work on one NATS connection, with background tasks of its own."""

    async def start(self) -> None:
        """Serve: start its listeners and tasks (and clean up after itself when that fails)."""

    async def close(self) -> None:
        """Stop its tasks and listeners; the connection is the caller's."""

    def crashed(self) -> BaseException | None:
        """The exception a background task died of, if one did."""


ServiceT = TypeVar("ServiceT", bound=Service)

CRASH_CHECK_S: Final = 1.0
"""How often `serve_until_stopped` looks for a crashed background task while it waits for ``stop``."""


async def serve_until_stopped(
    nats: connect.NatsOptions,
    make: Callable[[Client], ServiceT],
    stop: asyncio.Event,
    *,
    ready: asyncio.Event | None = None,
    on_started: Callable[[ServiceT], None] | None = None,
    check_every_s: float = CRASH_CHECK_S,
) -> None:
    """Connect with `nats`, make the service with `make(nc)` and start it; then `on_started(service)` and set
    `ready`, and wait until `stop` is set (a graceful stop: returns). A background task that died (`crashed`,
    looked at every `check_every_s`) is raised as it is. Either way the service is closed, then the connection
    drained (a drain that fails is ignored: the process is on its way out). A failure to connect, make or start
    leaves as raised, `ready` unset."""
    nc = await connect.connect(nats)
    try:
        service = make(nc)
        await service.start()
        try:
            if on_started is not None:
                on_started(service)
            if ready is not None:
                ready.set()
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), check_every_s)
                crashed = service.crashed()
                if crashed is not None:
                    raise crashed
        finally:
            await service.close()
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()
