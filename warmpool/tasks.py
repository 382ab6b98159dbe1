"""Ending a daemon's loops for sure.

Python 3.11's `asyncio.wait_for` loses a cancel that arrives in the same turn as the result it waits for: it
returns the result instead of raising (gh-86296, fixed in 3.12 by rewriting it on `asyncio.timeout`). nats-py's
requests wait through it, so a heartbeat loop stopped just as its KV write is answered runs on, and the daemon's
shutdown waits for it forever (CI saw a node agent not stop within 30 s).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any, Final

__all__ = ["RECANCEL_EVERY_S", "cancel_and_wait"]

RECANCEL_EVERY_S: Final = 0.5
"""How long a cancelled task has to end before it is cancelled again (s): well above what a loop's own clean-up
takes (a watch's unsubscribe, a sleep's end), well below a shutdown bound."""


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], *, again_every_s: float = RECANCEL_EVERY_S) -> None:
    """Cancel `tasks` and return once every one has ended, cancelling again each one still running every
    `again_every_s`. What they raised is not raised here, and counts as retrieved: a caller that cares reads
    `task.exception()`."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=again_every_s)
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved: no "Task exception was never retrieved" when it is collected
