"""Waits that never lose a cancellation.

On Python 3.11 `asyncio.wait_for` returns the awaited result when its task is cancelled in the same loop iteration
as that result arrives: the cancellation is gone (fixed in 3.12, whose wait_for is `asyncio.timeout`). A loop that
stops only by being cancelled then runs on, and whoever cancelled it waits forever: a shutdown of the operator hung
that way (the standby loop woken by a slot change as it was cancelled), and a cancelled Lease holder kept renewing
when its cancel met a renewal's answer. So the operator's loops (kube/) wait with these, built on `asyncio.timeout`
(which counts cancellations and re-raises a foreign one), and test their stop flag besides: nats-py's own requests
still use wait_for.
"""

from __future__ import annotations

import asyncio

__all__ = ["wait_event"]


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until `event` is set or `timeout_s` has passed; True if it is set. Cancellation always propagates."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(max(0.0, timeout_s)):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True
