"""How every daemon (autoscaler, agent, gateway, operator) starts: its ``--log-level`` and logging, then its loop.

`add_log_level_argument` adds ``--log-level`` to a daemon's parser and `configure_logging` sets up logging from it,
one format for all (``<time> <LEVEL> <logger>: <message>`` on stderr). `run_until_signalled` runs the daemon:
``asyncio.run`` of a loop where SIGTERM and SIGINT set the daemon's ``stop`` event (a graceful stop: it finishes
what it must and returns, exit 0), under `connect.run_daemon` (a permission the server refuses before the daemon
sets ``ready`` ends it with `PermissionDenied`). A failure at start-up leaves as the daemon raised it: a
`PulsescaleError`, which the dispatcher prints as one line and exits with its code.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from warmpool import connect

__all__ = ["LOG_FORMAT", "LOG_LEVELS", "add_log_level_argument", "configure_logging", "run_until_signalled"]

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
