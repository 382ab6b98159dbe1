"""`warmpool.tasks.cancel_and_wait`: a loop that lost its cancel still ends."""

from __future__ import annotations

import asyncio
import sys

import pytest

from warmpool.tasks import cancel_and_wait


async def test_a_loop_whose_cancel_met_its_reply_still_ends() -> None:
    # The heartbeat loop's shape: a request through `asyncio.wait_for`, then a sleep, forever.
    replies: list[asyncio.Future[None]] = []
    waiting = asyncio.Event()

    async def heartbeat() -> None:
        while True:
            replies.append(reply := asyncio.get_running_loop().create_future())
            waiting.set()
            await asyncio.wait_for(reply, 10)
            await asyncio.sleep(3600)

    loop = asyncio.create_task(heartbeat())
    await waiting.wait()
    # The reply lands in the same turn as the cancel, as a KV write's answer may when the daemon stops.
    replies[0].set_result(None)
    loop.cancel()
    await asyncio.sleep(0.05)
    if sys.version_info < (3, 12):
        assert not loop.done(), "Python 3.11's wait_for returns the reply and the loop runs on (gh-86296)"
    await asyncio.wait_for(cancel_and_wait([loop], again_every_s=0.05), 5)
    assert loop.done()


async def test_a_task_that_swallows_its_first_cancel_still_ends() -> None:
    # Any Python: what a lost cancel leaves, without depending on 3.11's wait_for to lose it.
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.sleep(3600)

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([task], again_every_s=0.05), 5)
    assert swallowed.is_set() and task.cancelled()


async def test_what_the_tasks_raise_is_not_raised_here() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("clean-up failed") from None

    task = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)
    await cancel_and_wait([task, asyncio.create_task(asyncio.sleep(0))])
    with pytest.raises(RuntimeError, match="clean-up failed"):
        task.result()
