"""The hook's engine, apart from LiteLLM's interface (`integrations.litellm` adapts that): counts each request's
arrival, dispatch and end in a `DemandBook`, and publishes each counted model's `QueueSample` with the reference
gateway's publisher (`gateway.publisher.Publisher`: every 100 ms and on change) over a `NatsLink`.

It never slows or breaks the requests it counts: counting is a few dictionary operations with no await, publishing
and connecting run in background tasks, and an error of the hook's own is logged once and swallowed. The tasks
start on the running event loop: at construction when there is one (LiteLLM loads its ``callbacks`` inside it),
else at the first request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, cast

from nats.aio.client import Client

from gateway.publisher import Publisher
from gateway.queue import ModelQueue
from integrations.demand import DemandBook, Outcome
from integrations.link import NatsLink
from integrations.settings import HookSettings
from warmpool import tasks

__all__ = ["DemandHook"]

log = logging.getLogger("pulsescale.litellm")

_MAX_TOLD = 1000  # clients may name any number of unknown groups: say the first ones, then be quiet

SWEEP_EVERY_S = 1.0
"""How often stale requests and idle models are looked for: both bounds are minutes long."""


class DemandHook:
    """Counts and publishes (module doc). `arrived`, `dispatched` and `ended` never raise."""

    def __init__(
        self,
        settings: HookSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        link: NatsLink | None = None,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self.book = DemandBook(
            forget_after_s=settings.forget_after_s,
            idle_after_s=settings.idle_after_s,
            max_models=settings.max_models,
        )
        for model in set(settings.models.names.values()):
            self.book.pin(model, clock())
        self.link = link or NatsLink(settings.nats, reconnect_max_s=settings.reconnect_max_s)
        # The publisher calls only `publish` on its client (`NatsLink` has it, dropping samples while NATS is
        # away) and only `counts()` on its queues (`ModelTally` has it); its annotations name the gateway's types.
        self.publisher = Publisher(
            cast(Client, self.link),
            settings.gateway_id,
            cast("dict[str, ModelQueue[Any]]", self.book.tallies),
            every_s=settings.sample_every_s,
            min_gap_s=settings.sample_min_gap_s,
            clock=clock,
            wall=wall,
        )
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the tasks run on: a hook called on another thread wakes the publisher through it."""
        self._told: set[str] = set()
        """Things logged once: groups not counted, the table full, errors of the hook's own."""

    # --- the request path: no await, never raises ------------------------------------------------------------

    def arrived(self, call_id: object, group: object) -> None:
        """A request for model group `group` entered the proxy (its pre-call hook)."""
        try:
            self.start()
            if not isinstance(call_id, str) or not isinstance(group, str):
                return  # not a model call (no model named): nothing to count
            model = self.settings.models.model_for(group)
            if model is None:
                name = group[:100]  # a client's text: bounded in the log
                self._once(f"group:{name}", "model group %r is not counted (PULSESCALE_LITELLM_MODELS)", name)
                return
            changed = self.book.arrive(call_id, model, self._clock())
            if changed is None and model not in self.book.tallies:
                self._once(
                    "full",
                    "%d models are counted already; %r is not (HookSettings.max_models)",
                    self.settings.max_models,
                    model,
                )
            self._changed(changed)
        except Exception as err:  # noqa: BLE001 - the hook must never fail a request
            self._failed(err)

    def dispatched(self, call_id: object) -> None:
        """LiteLLM picked a backend for the request and is sending it there."""
        try:
            if isinstance(call_id, str):
                self._changed(self.book.dispatch(call_id, self._clock()))
        except Exception as err:  # noqa: BLE001 - the hook must never fail a request
            self._failed(err)

    def ended(self, call_id: object, outcome: Outcome) -> None:
        """LiteLLM reported the request's end (any report; the first one counts)."""
        try:
            if isinstance(call_id, str):
                self._changed(self.book.end(call_id, outcome, self._clock()))
        except Exception as err:  # noqa: BLE001 - the hook must never fail a request
            self._failed(err)

    # --- the background ----------------------------------------------------------------------------------------

    def start(self) -> bool:
        """Start the background tasks on the running loop, once; False when no loop runs here (yet)."""
        if self._tasks:
            return True
        loop = _running_loop()
        if loop is None:
            return False
        self._loop = loop
        self._stop = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self.link.run(self._stop), name="pulsescale-nats"),
            asyncio.create_task(self.publisher.run(self._stop), name="pulsescale-samples"),
            asyncio.create_task(self._sweep(), name="pulsescale-sweep"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._ended_task)
        return True

    async def aclose(self) -> None:
        """Stop publishing and close the connection (tests; LiteLLM has no shutdown hook for callbacks)."""
        self._stop.set()
        if self._tasks:
            done, _ = await asyncio.wait(self._tasks, timeout=2.0)
            await tasks.cancel_and_wait(t for t in self._tasks if t not in done)

    async def _sweep(self) -> None:
        while not self._stop.is_set():
            now = self._clock()
            for model in self.book.forget_stale(now):
                self._once(
                    f"stale:{model}",
                    "requests for %s open %gs given up (PULSESCALE_LITELLM_FORGET_AFTER)",
                    model,
                    self.settings.forget_after_s,
                )
                self.publisher.changed(model)
            for model in self.book.reclaim_idle(now):
                self.publisher.forget(model)
            try:
                await asyncio.wait_for(self._stop.wait(), SWEEP_EVERY_S)
            except TimeoutError:
                pass

    def _changed(self, model: str | None) -> None:
        if model is None:
            return
        if self._loop is None or _running_loop() is self._loop:
            self.publisher.changed(model)
        else:  # LiteLLM runs the hooks on the proxy's loop; an SDK call from a thread would not
            self._loop.call_soon_threadsafe(self.publisher.changed, model)

    def _ended_task(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and not self._stop.is_set():
            log.error(
                "pulsescale: the hook's %s task failed; its samples stop", task.get_name(), exc_info=task.exception()
            )

    def _failed(self, err: Exception) -> None:
        self._once(f"error:{type(err).__name__}", "pulsescale hook error (the request goes on): %r", err)

    def _once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._told and len(self._told) < _MAX_TOLD:
            self._told.add(key)
            log.warning(msg, *args)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
